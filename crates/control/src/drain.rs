//! Host drain (seed 000: "you can't afford to wait many hours while all
//! hosts drain"): place every VM of a host on a target with room, move them
//! with a limit on simultaneous migrations that tunes itself, retry a failed
//! move elsewhere, and name what cannot move. The planner and the tuner are
//! pure and unit-tested here; [`crate::Control::drain`] runs them.

use std::time::{Duration, Instant};

use ferry_api::drain::{PlannedMove, Unplaceable};
use ferry_api::size::human_bytes;

/// Host memory a VM takes beyond its RAM (QEMU itself); agents reserve the same.
pub const VM_OVERHEAD: u64 = 64 << 20;
/// Attempts per VM before it is left where it is.
pub const MAX_ATTEMPTS: u32 = 3;

/// Places VMs (name, memory) on targets (name, free memory): biggest VM
/// first, each on the target with the most free memory that fits it, which
/// spreads the load. Returns the moves and the VMs no target can take.
pub fn plan(
    vms: &[(String, u64)],
    targets: &mut [(String, u64)],
) -> (Vec<PlannedMove>, Vec<Unplaceable>) {
    let mut order: Vec<&(String, u64)> = vms.iter().collect();
    order.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut moves = Vec::new();
    let mut left = Vec::new();
    for (vm, memory) in order {
        let need = memory + VM_OVERHEAD;
        match pick(targets, need, &[]) {
            Some(i) => {
                targets[i].1 -= need;
                moves.push(PlannedMove {
                    vm: vm.clone(),
                    memory: *memory,
                    to: targets[i].0.clone(),
                });
            }
            None => left.push(Unplaceable {
                vm: vm.clone(),
                memory: *memory,
                reason: unplaceable_reason(targets, need),
            }),
        }
    }
    (moves, left)
}

/// The target with the most free memory that fits `need`, skipping `exclude`.
pub fn pick(targets: &[(String, u64)], need: u64, exclude: &[String]) -> Option<usize> {
    targets
        .iter()
        .enumerate()
        .filter(|(_, (n, free))| *free >= need && !exclude.contains(n))
        .max_by(|a, b| a.1 .1.cmp(&b.1 .1).then(b.1 .0.cmp(&a.1 .0)))
        .map(|(i, _)| i)
}

pub fn unplaceable_reason(targets: &[(String, u64)], need: u64) -> String {
    match targets.iter().max_by_key(|t| t.1) {
        Some((n, free)) => format!(
            "needs {} of host memory; the most any target has free is {} on {n}",
            human_bytes(need),
            human_bytes(*free)
        ),
        None => "no target host takes VMs".into(),
    }
}

/// The simultaneous-migration limit in `auto` mode: start at 4, measure the
/// aggregate rate (bytes completed ÷ wall time) at each limit over at least
/// `limit` completions, climb while a step up pays ≥ 5%, step back and stay
/// when it costs ≥ 5%.
#[derive(Debug, Clone)]
pub struct AutoLimit {
    pub limit: u32,
    pub min: u32,
    pub max: u32,
    level_start: Instant,
    level_bytes: u64,
    level_done: u32,
    /// (limit, bytes/s) measured so far.
    pub history: Vec<(u32, f64)>,
    settled: bool,
}

impl AutoLimit {
    pub const START: u32 = 4;

    pub fn new(now: Instant) -> AutoLimit {
        AutoLimit {
            limit: Self::START,
            min: 1,
            max: 8,
            level_start: now,
            level_bytes: 0,
            level_done: 0,
            history: Vec::new(),
            settled: false,
        }
    }

    /// Records a completed migration; returns a new limit and why, if it changes.
    pub fn completed(&mut self, bytes: u64, now: Instant) -> Option<(u32, String)> {
        self.level_bytes += bytes;
        self.level_done += 1;
        if self.settled || self.level_done < self.limit {
            return None;
        }
        let secs = now
            .duration_since(self.level_start)
            .max(Duration::from_millis(1))
            .as_secs_f64();
        let rate = self.level_bytes as f64 / secs;
        let prev = self.history.last().copied();
        self.history.push((self.limit, rate));
        self.level_start = now;
        self.level_bytes = 0;
        self.level_done = 0;
        let mbit = |r: f64| r * 8.0 / 1e6;
        let (next, why) = match prev {
            None if self.limit < self.max => (
                self.limit + 1,
                format!(
                    "{:.0} Mbit/s at {}; trying {}",
                    mbit(rate),
                    self.limit,
                    self.limit + 1
                ),
            ),
            Some((pl, pr)) if rate >= pr * 1.05 && self.limit > pl && self.limit < self.max => (
                self.limit + 1,
                format!(
                    "{} paid ({:.0} vs {:.0} Mbit/s); trying {}",
                    self.limit,
                    mbit(rate),
                    mbit(pr),
                    self.limit + 1
                ),
            ),
            Some((pl, pr)) if rate <= pr * 0.95 => {
                self.settled = true;
                (
                    pl,
                    format!(
                        "{} did not pay ({:.0} vs {:.0} Mbit/s at {pl}); back to {pl}",
                        self.limit,
                        mbit(rate),
                        mbit(pr)
                    ),
                )
            }
            _ => {
                self.settled = true;
                return None;
            }
        };
        let next = next.clamp(self.min, self.max);
        (next != self.limit).then(|| {
            self.limit = next;
            (next, why)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1 << 30;

    fn t(n: &str, free: u64) -> (String, u64) {
        (n.into(), free)
    }

    #[test]
    fn plan_spreads_and_names_what_does_not_fit() {
        let vms = vec![
            ("a".into(), G),
            ("b".into(), G / 2),
            ("c".into(), G / 2),
            ("huge".into(), 8 * G),
        ];
        let mut targets = vec![t("host2", 3 * G), t("host3", 3 * G)];
        let (moves, left) = plan(&vms, &mut targets);
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].vm, "huge");
        assert!(left[0].reason.contains("host"), "{}", left[0].reason);
        assert_eq!(moves.len(), 3);
        // both targets used
        assert!(moves.iter().any(|m| m.to == "host2") && moves.iter().any(|m| m.to == "host3"));
        // bookkeeping never overcommits
        assert!(targets.iter().all(|(_, free)| *free < 3 * G));
    }

    #[test]
    fn plan_never_overcommits_a_target() {
        let vms: Vec<(String, u64)> = (0..10).map(|i| (format!("v{i}"), G)).collect();
        let mut targets = vec![t("host2", 2 * G + 200 * (1 << 20))];
        let (moves, left) = plan(&vms, &mut targets);
        assert_eq!(moves.len(), 2, "{moves:?}");
        assert_eq!(left.len(), 8);
    }

    #[test]
    fn pick_skips_excluded_targets() {
        let targets = vec![t("host2", 4 * G), t("host3", 2 * G)];
        assert_eq!(pick(&targets, G, &[]), Some(0));
        assert_eq!(pick(&targets, G, &["host2".into()]), Some(1));
        assert_eq!(pick(&targets, 3 * G, &["host2".into()]), None);
    }

    #[test]
    fn auto_limit_climbs_while_it_pays_and_steps_back_when_it_does_not() {
        let t0 = Instant::now();
        let mut a = AutoLimit::new(t0);
        assert_eq!(a.limit, 4);
        // 4 completions of 1 GiB in 4 s at limit 4 → 1 GiB/s
        for i in 1..=3 {
            assert_eq!(a.completed(G, t0 + Duration::from_secs(i)), None);
        }
        let (l, _) = a.completed(G, t0 + Duration::from_secs(4)).unwrap();
        assert_eq!(l, 5);
        // at 5: 5 GiB in 4 s → pays
        for i in 1..=4 {
            assert_eq!(a.completed(G, t0 + Duration::from_secs(4 + i)), None);
        }
        let (l, why) = a.completed(G, t0 + Duration::from_secs(8)).unwrap();
        assert_eq!(l, 6, "{why}");
        // at 6: 6 GiB in 12 s → worse: back to 5 and stay
        for i in 1..=5 {
            assert_eq!(a.completed(G, t0 + Duration::from_secs(8 + 2 * i)), None);
        }
        let (l, why) = a.completed(G, t0 + Duration::from_secs(20)).unwrap();
        assert_eq!(l, 5, "{why}");
        assert!(why.contains("did not pay"));
        for i in 0..20 {
            assert_eq!(a.completed(G, t0 + Duration::from_secs(21 + i)), None);
        }
    }
}
