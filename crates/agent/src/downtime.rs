//! Downtime as a promise: the QEMU downtime limit a move asks for, and how
//! it is lowered or raised while pre-copy runs. Pure; the copy loop feeds it
//! QEMU's round counter.
//!
//! The guest's blackout is more than QEMU's `downtime`: after QEMU's last
//! byte, the target must finish loading (bytes still queued on the path
//! land there), the source records the commit and the target runs the guest
//! and announces its MACs — the switch-over; and QEMU itself overshoots
//! its limit when its bandwidth estimate is high or the last round dirtied
//! more. So QEMU is given the downtime target minus what the guest saw
//! beyond QEMU's limit in this host's recent moves to the same target (the
//! worst of the last few, [`Learned`]), and keeps iterating until what
//! remains fits that.
//!
//! `auto` (the default) aims lower than the target: QEMU's limit starts at
//! [`AUTO_FLOOR_MS`] and doubles at each new pre-copy round after the
//! second, up to the target's budget — so an idle guest switches over at
//! the floor, a guest that dirties memory after a few more rounds (at most
//! `log2(budget ÷ floor)`), and no guest waits longer than the bounded
//! number of extra rounds for the smallest blackout its dirty rate and the
//! path allow.

use std::collections::{BTreeMap, VecDeque};

/// QEMU's limit where `auto` starts, ms.
pub const AUTO_FLOOR_MS: u64 = 5;
/// The least QEMU limit ever asked, ms: below, QEMU waits for nothing left.
pub const MIN_LIMIT_MS: u64 = 2;
/// The switch-over assumed towards a target not yet seen, ms.
pub const FIRST_SWITCHOVER_MS: u64 = 40;
/// Switch-overs remembered per target.
const REMEMBERED: usize = 5;

#[derive(Debug, Clone, PartialEq)]
pub struct DowntimePlan {
    /// The most downtime the guest may see, ms (the move's `max_downtime`).
    pub target_ms: u64,
    pub auto: bool,
    /// The downtime expected beyond QEMU's limit (switch-over and QEMU's
    /// overshoot), ms.
    pub switchover_ms: u64,
    /// QEMU's downtime limit now, ms.
    pub limit_ms: u64,
    /// Rounds after which the limit was raised.
    pub raised: Vec<(u64, u64)>,
}

impl DowntimePlan {
    pub fn new(target_ms: u64, auto: bool, switchover_ms: u64) -> DowntimePlan {
        let mut p = DowntimePlan {
            target_ms,
            auto,
            switchover_ms,
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

    /// What QEMU may spend: the target less the expected switch-over.
    pub fn budget(&self) -> u64 {
        self.target_ms
            .saturating_sub(self.switchover_ms)
            .max(MIN_LIMIT_MS)
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
            "QEMU limit {} ms = target {} ms less {} ms expected beyond it (switch-over, QEMU's overshoot)",
            self.budget(),
            self.target_ms,
            self.switchover_ms
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

/// Downtime beyond QEMU's limit this host's moves saw, per target: what
/// the next move there expects.
#[derive(Debug, Default)]
pub struct Learned(std::sync::Mutex<BTreeMap<String, VecDeque<u64>>>);

impl Learned {
    /// The worst of the last few to `target`.
    pub fn expect(&self, target: &str) -> u64 {
        ferry_api::util::lock(&self.0)
            .get(target)
            .and_then(|v| v.iter().max().copied())
            .unwrap_or(FIRST_SWITCHOVER_MS)
    }

    pub fn record(&self, target: &str, ms: u64) {
        let mut m = ferry_api::util::lock(&self.0);
        let v = m.entry(target.to_string()).or_default();
        v.push_back(ms);
        while v.len() > REMEMBERED {
            v.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fixed_target_leaves_room_for_the_switch_over() {
        let p = DowntimePlan::new(100, false, 30);
        assert_eq!(p.limit_ms, 70);
        // a switch-over longer than the target: QEMU still gets its floor
        assert_eq!(DowntimePlan::new(20, false, 50).limit_ms, MIN_LIMIT_MS);
        let mut p = p;
        assert_eq!(p.on_round(5), None, "a fixed limit never moves");
    }

    #[test]
    fn auto_starts_at_the_floor_and_doubles_per_round_up_to_the_budget() {
        let mut p = DowntimePlan::new(300, true, 40);
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
        assert_eq!(seen, vec![10, 20, 40, 80, 160, 260]);
        assert!(p.reason().contains("raised 6 time(s)"), "{}", p.reason());
        // an idle guest: never raised
        let p = DowntimePlan::new(300, true, 40);
        assert!(p.reason().contains("at the floor"), "{}", p.reason());
    }

    #[test]
    fn the_worst_recent_switch_over_is_expected() {
        let l = Learned::default();
        assert_eq!(l.expect("h2"), FIRST_SWITCHOVER_MS);
        for ms in [30, 80, 20, 10, 15, 12] {
            l.record("h2", ms);
        }
        // 30 fell out; 80 is still among the last five
        assert_eq!(l.expect("h2"), 80);
        l.record("h2", 5);
        assert_eq!(l.expect("h2"), 20);
        assert_eq!(l.expect("h3"), FIRST_SWITCHOVER_MS);
    }
}
