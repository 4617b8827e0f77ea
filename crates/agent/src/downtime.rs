//! Downtime as a promise: the QEMU downtime limit a move asks for, and how
//! it is lowered or raised while pre-copy runs. Pure; the copy loop feeds it
//! QEMU's round counter.
//!
//! The guest's blackout is more than QEMU's `downtime`: after QEMU's last
//! byte, the target must finish loading (bytes still queued on the path
//! land there), the source records the commit and the target runs the guest
//! and announces its MACs — the switch-over; and QEMU itself overshoots
//! its limit when its bandwidth estimate is high or the last round dirtied
//! more. So QEMU is given the downtime target less the switch-over, divided
//! by QEMU's overshoot, both the worst of this host's last few moves to the
//! same target ([`Learned`]), and keeps iterating until what remains fits.
//!
//! `auto` (the default) aims lower than the target: QEMU's limit starts at
//! [`AUTO_FLOOR_MS`] and doubles at each new pre-copy round after the
//! second, up to the target's budget — so an idle guest switches over at
//! the floor, a guest that dirties memory after a few more rounds (at most
//! `log2(budget ÷ floor)`), and no guest waits longer than the bounded
//! number of extra rounds for the smallest blackout its dirty rate and the
//! path allow.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

/// QEMU's limit where `auto` starts, ms.
pub const AUTO_FLOOR_MS: u64 = 5;
/// The least QEMU limit ever asked, ms: below, QEMU waits for nothing left.
pub const MIN_LIMIT_MS: u64 = 2;
/// The switch-over assumed towards a target not yet seen, ms; with QEMU's
/// overshoot taken as [`MAX_OVERSHOOT`] too: a first move into a host has
/// no figure to go by and ran 105 ms of switch-over where later ones took
/// 20–50 (BENCHMARKS.md "Downtime the guest sees").
pub const FIRST_SWITCHOVER_MS: u64 = 50;
/// Share of what is left after the switch-over that QEMU is given.
pub const MARGIN: f64 = 0.9;
/// Switch-overs remembered per target.
const REMEMBERED: usize = 5;

/// A maximum, not an aim: a plain pre-copy move whose source has been
/// paused this long (QEMU still sending, or the target not yet loaded) is
/// given up before the commit, and the guest resumes on the source: its
/// downtime stays under `max_ms` even when QEMU overshoots past every
/// figure learned. What is kept back is the time resuming takes (QEMU's
/// cancel and `cont`; the abort's record is written after): a tenth of the
/// maximum, 5 to 30 ms.
pub fn pause_deadline(max_ms: u64) -> Duration {
    let reserve = (max_ms / 10).clamp(5, 30);
    Duration::from_millis(max_ms.saturating_sub(reserve).max(max_ms / 2))
}

#[derive(Debug, Clone, PartialEq)]
pub struct DowntimePlan {
    /// The most downtime the guest may see, ms (the move's `max_downtime`).
    pub target_ms: u64,
    pub auto: bool,
    /// The switch-over expected after QEMU's last byte, ms (with a margin
    /// for the source noticing QEMU's end).
    pub switchover_ms: u64,
    /// How far QEMU's downtime may exceed its limit (≥ 1).
    pub overshoot: f64,
    /// QEMU's downtime limit now, ms.
    pub limit_ms: u64,
    /// Rounds after which the limit was raised.
    pub raised: Vec<(u64, u64)>,
}

impl DowntimePlan {
    pub fn new(target_ms: u64, auto: bool, switchover_ms: u64, overshoot: f64) -> DowntimePlan {
        let mut p = DowntimePlan {
            target_ms,
            auto,
            switchover_ms,
            overshoot: overshoot.max(1.0),
            limit_ms: 0,
            raised: Vec::new(),
        };
        p.limit_ms = if auto {
            AUTO_FLOOR_MS.min(p.budget())
        } else {
            p.budget()
        };
        p
    }

    /// What QEMU may be told: the target less the expected switch-over,
    /// shrunk by QEMU's expected overshoot and a margin for a guest that
    /// dirties more than the moves it was learned from.
    pub fn budget(&self) -> u64 {
        let left = self.target_ms.saturating_sub(self.switchover_ms) as f64;
        ((left * MARGIN / self.overshoot) as u64).max(MIN_LIMIT_MS)
    }

    /// QEMU started round `sync` (its dirty-sync count) without switching
    /// over: `auto` doubles the limit from the third round on. Returns the
    /// new limit when it changed.
    pub fn on_round(&mut self, sync: u64) -> Option<u64> {
        if !self.auto || sync < 3 || self.limit_ms >= self.budget() {
            return None;
        }
        if self.raised.last().is_some_and(|r| r.0 >= sync) {
            return None;
        }
        self.limit_ms = (self.limit_ms * 2).min(self.budget());
        self.raised.push((sync, self.limit_ms));
        Some(self.limit_ms)
    }

    /// Why the switch-over came when it did, for the report.
    pub fn reason(&self) -> String {
        let base = format!(
            "QEMU limit {} ms = (target {} ms − {} ms expected switch-over) × 0.9 ÷ {:.2} (QEMU's recent overshoot of its limit)",
            self.budget(),
            self.target_ms,
            self.switchover_ms,
            self.overshoot
        );
        if !self.auto {
            return base;
        }
        match self.raised.last() {
            None => format!(
                "auto: switched over at the floor, QEMU limit {} ms (target {} ms)",
                self.limit_ms, self.target_ms
            ),
            Some(&(sync, l)) => format!(
                "auto: the guest's dirtying kept more than {} ms of copy; raised {} time(s) to {l} ms by round {sync} ({})",
                AUTO_FLOOR_MS,
                self.raised.len(),
                if l >= self.budget() {
                    base
                } else {
                    format!("budget {} ms", self.budget())
                }
            ),
        }
    }
}

/// What this host's recent moves to each target saw: the switch-over
/// (guest downtime less QEMU's) and QEMU's overshoot of its limit.
#[derive(Debug, Default)]
pub struct Learned(std::sync::Mutex<BTreeMap<String, VecDeque<(u64, f64)>>>);

/// QEMU's downtime ÷ its limit is taken as at most this.
pub const MAX_OVERSHOOT: f64 = 2.0;
/// Limits from which QEMU's downtime ÷ limit counts as its overshoot, ms.
const OVERSHOOT_FROM_MS: u64 = 20;

impl Learned {
    /// The worst switch-over (ms) and overshoot (≥ 1) of the last few to
    /// `target`.
    pub fn expect(&self, target: &str) -> (u64, f64) {
        let m = ferry_api::util::lock(&self.0);
        let Some(v) = m.get(target).filter(|v| !v.is_empty()) else {
            return (FIRST_SWITCHOVER_MS, MAX_OVERSHOOT);
        };
        let sw = v.iter().map(|x| x.0).max().unwrap_or(FIRST_SWITCHOVER_MS);
        let over = v.iter().map(|x| x.1).fold(1.0, f64::max).min(MAX_OVERSHOOT);
        (sw, over)
    }

    /// One move: its switch-over, and QEMU's downtime against its limit.
    pub fn record(&self, target: &str, switchover_ms: u64, qemu_ms: u64, limit_ms: u64) {
        // under a few ms of limit QEMU's fixed costs (device state) are
        // most of its downtime: no measure of its overshoot
        let over = if limit_ms >= OVERSHOOT_FROM_MS {
            qemu_ms as f64 / limit_ms as f64
        } else {
            1.0
        };
        let mut m = ferry_api::util::lock(&self.0);
        let v = m.entry(target.to_string()).or_default();
        v.push_back((switchover_ms, over));
        while v.len() > REMEMBERED {
            v.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pause_deadline_keeps_room_to_resume_under_the_maximum() {
        assert_eq!(pause_deadline(300), Duration::from_millis(270));
        assert_eq!(pause_deadline(100), Duration::from_millis(90));
        assert_eq!(pause_deadline(1000), Duration::from_millis(970));
        // the smallest maximum accepted: half of it, never nothing
        assert_eq!(pause_deadline(10), Duration::from_millis(5));
        for max in ferry_api::DOWNTIME_RANGE_MS.step_by(7) {
            let d = pause_deadline(max).as_millis() as u64;
            assert!(d < max && d >= max / 2, "{max}: {d}");
        }
    }

    #[test]
    fn a_fixed_target_leaves_room_for_the_switch_over() {
        let p = DowntimePlan::new(100, false, 30, 1.0);
        assert_eq!(p.limit_ms, 63);
        // QEMU overshot its limit by 25% lately: it is told less
        assert_eq!(DowntimePlan::new(100, false, 30, 1.25).limit_ms, 50);
        // a switch-over longer than the target: QEMU still gets its floor
        assert_eq!(DowntimePlan::new(20, false, 50, 1.0).limit_ms, MIN_LIMIT_MS);
        let mut p = p;
        assert_eq!(p.on_round(5), None, "a fixed limit never moves");
    }

    #[test]
    fn auto_starts_at_the_floor_and_doubles_per_round_up_to_the_budget() {
        let mut p = DowntimePlan::new(300, true, 40, 1.0);
        assert_eq!(p.limit_ms, AUTO_FLOOR_MS);
        // the first pass and the first re-send round stay at the floor
        assert_eq!(p.on_round(1), None);
        assert_eq!(p.on_round(2), None);
        let mut seen = Vec::new();
        for sync in 3..20 {
            if let Some(l) = p.on_round(sync) {
                seen.push(l);
            }
            // a round seen twice raises once
            assert_eq!(p.on_round(sync), None);
        }
        assert_eq!(seen, vec![10, 20, 40, 80, 160, 234]);
        assert!(p.reason().contains("raised 6 time(s)"), "{}", p.reason());
        // an idle guest: never raised
        let p = DowntimePlan::new(300, true, 40, 1.0);
        assert!(p.reason().contains("at the floor"), "{}", p.reason());
    }

    #[test]
    fn the_worst_recent_switch_over_and_overshoot_are_expected() {
        let l = Learned::default();
        // nothing seen yet: the cautious guess
        assert_eq!(l.expect("h2"), (FIRST_SWITCHOVER_MS, MAX_OVERSHOOT));
        // (switch-over, QEMU downtime, limit)
        for (sw, q, lim) in [
            (30, 74, 57),
            (80, 1, 5),
            (20, 3, 60),
            (10, 1, 5),
            (15, 40, 40),
            (12, 2, 5),
        ] {
            l.record("h2", sw, q, lim);
        }
        // the first fell out: 80 ms is the worst switch-over left, and an
        // idle guest far under its limit does not count as an overshoot
        let (sw, over) = l.expect("h2");
        assert_eq!(sw, 80);
        assert!((over - 1.0).abs() < 1e-9, "{over}");
        l.record("h2", 5, 90, 60);
        let (sw, over) = l.expect("h2");
        assert_eq!(sw, 20);
        assert!((over - 1.5).abs() < 1e-9, "{over}");
        // a wild one is capped
        l.record("h2", 5, 500, 40);
        // at a tiny limit QEMU's fixed costs are no overshoot
        l.record("h3", 5, 9, 5);
        assert_eq!(l.expect("h2").1, MAX_OVERSHOOT);
        assert_eq!(l.expect("h3"), (5, 1.0));
        assert_eq!(l.expect("h4"), (FIRST_SWITCHOVER_MS, MAX_OVERSHOOT));
    }
}
