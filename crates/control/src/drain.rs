//! Host drain (seed 000: "you can't afford to wait many hours while all
//! hosts drain"): place every VM of a host on a target with room, move them
//! with a limit on simultaneous migrations that tunes itself, retry a failed
//! move elsewhere, and name what cannot move. The planner and the tuner are
//! pure and unit-tested here; `crate::Control::drain` runs them.

use std::time::{Duration, Instant};

use ferry_api::drain::{MigrationLimit, PlannedMove, Unplaceable};
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

/// What the tuner needs to know of a running migration.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Running {
    /// Copying memory for at least [`AutoLimit::WARMUP`] (its start-up no
    /// longer distorts the aggregate rate).
    pub transferring: bool,
    /// In its last round, switching over or being checked on the target: its
    /// share of the links is about to fall idle.
    pub ending: bool,
    /// Ending, or its switch-over is nearer than the next move needs to start
    /// copying: the next may start now.
    pub finishing: bool,
}

impl Running {
    /// Copying and not ending: its rate is the one it keeps.
    pub fn steady(&self) -> bool {
        self.transferring && !self.ending
    }

    /// From a migration's latest progress: QEMU copying (`active`), past
    /// pre-copy (`finished`: switching over, post-copy, pause-and-copy), its
    /// predicted time to the switch-over, and how long it has been copying.
    /// It is finishing once past pre-copy, or in its last round, or when its
    /// switch-over is nearer than `lead` (what starting the next one takes).
    #[allow(clippy::too_many_arguments)]
    pub fn from_progress(
        active: bool,
        finished: bool,
        rounds: u64,
        remaining: u64,
        throughput: f64,
        eta: Option<Duration>,
        lead: Duration,
        copying_for: Duration,
    ) -> Running {
        let ending = finished || (rounds >= 2 && (remaining as f64) <= throughput * 2.0);
        let transferring = active && copying_for >= AutoLimit::WARMUP;
        Running {
            transferring,
            ending,
            // a move just started has no rate worth a prediction (QEMU's
            // first reports may say nothing remains)
            finishing: ending || (transferring && eta.is_some_and(|e| e <= lead)),
        }
    }
}

/// The simultaneous-migration limit in `auto` mode (seed 000: "start at 4
/// and experiment upwards; tune it back down if the speed deteriorates").
///
/// The limit starts at 4. Within it, the number of migrations run at once
/// climbs like a slow start: one, then one more each time the aggregate rate
/// of the host's migrations — bytes sent per second, measured over
/// [`AutoLimit::WINDOW`] while every running migration is copying and none
/// is ending — rose ≥ 10% with the last one added. A level whose rate fills
/// [`AutoLimit::FULL`] of what the drained host's NICs carry is held without
/// trying the next; so is the last level that paid, once a step does not:
/// more migrations at once would only share the same rate and re-send more
/// of the pages their guests dirty meanwhile. When every step up to the
/// limit paid, the limit itself rises (to 8). A finishing migration
/// (ending, or its switch-over nearer than [`AutoLimit::lead`]) does not
/// count, so the next one starts while it switches over and is checked,
/// and the links do not fall idle between moves — also before the level is
/// settled, since on a fast link a move can end before it is measured.
#[derive(Debug, Clone)]
pub struct AutoLimit {
    pub limit: u32,
    pub max: u32,
    /// How many run at once (besides finishing ones, once settled).
    pub want: u32,
    /// (concurrency, sent bytes at the window's start, its start)
    probe: Option<(u32, u64, Instant)>,
    /// (concurrency, aggregate bytes/s) measured so far.
    pub history: Vec<(u32, f64)>,
    pub settled: bool,
    /// What the drained host's NICs can carry for this option, bytes/s.
    capacity: Option<f64>,
    /// The last tick inside the open window: (when, bytes sent).
    last_steady: Option<(Instant, u64)>,
    /// How long a move takes from its start to QEMU copying (smoothed).
    setup: Option<Duration>,
    /// The drained host's CPU busy share, as last seen.
    cpu: Option<f64>,
}

impl AutoLimit {
    pub const START: u32 = 4;
    pub const WARMUP: Duration = Duration::from_millis(500);
    pub const WINDOW: Duration = Duration::from_millis(1500);
    /// A window cut short (a move finishing: short moves may never give a
    /// whole one) still counts from this long.
    pub const MIN_WINDOW: Duration = Duration::from_millis(500);
    /// A step up pays when the aggregate rate rises by this factor.
    pub const PAYS: f64 = 1.10;
    /// The links are full at this share of their capacity (TCP over a
    /// shaped link gets ~0.95 of it): no step up can pay.
    pub const FULL: f64 = 0.85;
    /// CPUs this busy with the links not full: the CPU is the limit.
    pub const CPU_BUSY: f64 = 0.90;

    /// With the capacity of the drained host's links for this option (bytes/s):
    /// a level that fills it is held without trying the next.
    pub fn with_capacity(capacity: Option<f64>) -> AutoLimit {
        AutoLimit {
            capacity: capacity.filter(|c| *c > 0.0),
            ..Self::new()
        }
    }

    /// Takes a move's measured setup time (start → QEMU copying) into the lead.
    pub fn observe_setup(&mut self, d: Duration) {
        self.setup = Some(match self.setup {
            None => d,
            Some(s) => (s * 7 + d) / 8,
        });
    }

    /// How early to start the next move, once settled, before one switches
    /// over: its setup time (1 s until measured) plus half a second for the
    /// switch-over and the check on the target.
    pub fn lead(&self) -> Duration {
        self.setup.unwrap_or(Duration::from_secs(1)) + Duration::from_millis(500)
    }

    pub fn capacity(&self) -> Option<f64> {
        self.capacity
    }

    pub fn new() -> AutoLimit {
        AutoLimit {
            limit: Self::START,
            max: MigrationLimit::MAX.min(8),
            want: 1,
            probe: None,
            history: Vec::new(),
            settled: false,
            capacity: None,
            last_steady: None,
            setup: None,
            cpu: None,
        }
    }

    /// The drained host's CPUs were this busy (0..1) over the last look.
    pub fn observe_cpu(&mut self, busy: f64) {
        self.cpu = Some(busy);
    }

    /// When the links are not full and the CPUs are: says so.
    fn cpu_bound(&self, rate: f64) -> String {
        match (self.cpu, self.capacity) {
            (Some(b), Some(c)) if b >= Self::CPU_BUSY && rate < c * Self::FULL => format!(
                "; CPU-bound: the host's CPUs are {:.0}% busy with the links at {:.0}% of {:.0} Mbit/s",
                b * 100.0,
                rate / c * 100.0,
                c * 8.0 / 1e6
            ),
            (Some(b), None) if b >= Self::CPU_BUSY => {
                format!("; CPU-bound: the host's CPUs are {:.0}% busy", b * 100.0)
            }
            _ => String::new(),
        }
    }

    /// How many migrations may run now, given `sent` (bytes every migration
    /// of the drain has sent so far, finished ones included) and those
    /// running; and the new concurrency with why, when it changes.
    pub fn tick(
        &mut self,
        now: Instant,
        sent: u64,
        running: &[Running],
    ) -> (u32, Option<(u32, String)>) {
        let n = running.len() as u32;
        let mut change = None;
        if !self.settled {
            match self.probe {
                Some((lvl, s0, t0)) if n != lvl || !running.iter().all(Running::steady) => {
                    self.probe = None;
                    // cut short: what it saw until the last tick still counts
                    if let Some((t1, s1)) = self.last_steady {
                        if t1.duration_since(t0) >= Self::MIN_WINDOW {
                            let rate =
                                s1.saturating_sub(s0) as f64 / t1.duration_since(t0).as_secs_f64();
                            change = Some(self.measured(lvl, rate));
                        }
                    }
                }
                Some((lvl, s0, t0)) if now.duration_since(t0) >= Self::WINDOW => {
                    self.probe = None;
                    let rate =
                        sent.saturating_sub(s0) as f64 / now.duration_since(t0).as_secs_f64();
                    change = Some(self.measured(lvl, rate));
                }
                Some(_) => {}
                None if n == self.want && n > 0 && running.iter().all(Running::steady) => {
                    self.probe = Some((n, sent, now))
                }
                None => {}
            }
            self.last_steady = self.probe.map(|_| (now, sent));
        }
        // settled or not: a short move (a fast link) may end before its
        // level is measured, and the links must not idle meanwhile
        let finishing = running.iter().filter(|r| r.finishing).count() as u32;
        (
            (self.want + finishing).min(self.limit),
            change.map(|why| (self.want, why)),
        )
    }

    fn measured(&mut self, lvl: u32, rate: f64) -> String {
        let why = self.judged(lvl, rate);
        why + &self.cpu_bound(rate)
    }

    fn judged(&mut self, lvl: u32, rate: f64) -> String {
        let mbit = |r: f64| r * 8.0 / 1e6;
        let prev = self.history.last().copied();
        self.history.push((lvl, rate));
        if let Some(c) = self.capacity.filter(|c| rate >= c * Self::FULL) {
            self.settled = true;
            self.want = lvl;
            return format!(
                "{:.0} Mbit/s with {lvl} fills the links ({:.0} Mbit/s): holding {lvl}, the next starting as one finishes",
                mbit(rate),
                mbit(c)
            );
        }
        match prev {
            Some((pl, pr)) if rate < pr * Self::PAYS => {
                self.settled = true;
                self.want = pl;
                format!(
                    "{lvl} at once did not pay ({:.0} vs {:.0} Mbit/s with {pl}): holding {pl}, the next starting as one finishes",
                    mbit(rate),
                    mbit(pr)
                )
            }
            _ if lvl < self.limit => {
                self.want = lvl + 1;
                format!("{:.0} Mbit/s with {lvl}; trying {}", mbit(rate), lvl + 1)
            }
            _ if self.limit < self.max => {
                self.limit += 1;
                self.want = lvl + 1;
                format!(
                    "{:.0} Mbit/s with {lvl}, every step paid: limit raised to {}",
                    mbit(rate),
                    self.limit
                )
            }
            _ => {
                self.settled = true;
                format!("{:.0} Mbit/s with {lvl}, the most allowed", mbit(rate))
            }
        }
    }
}

impl Default for AutoLimit {
    fn default() -> Self {
        Self::new()
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

    fn run(n: usize, transferring: bool, finishing: usize) -> Vec<Running> {
        (0..n)
            .map(|i| Running {
                transferring,
                ending: i < finishing,
                finishing: i < finishing,
            })
            .collect()
    }

    /// Drives the tuner as the drain does: ticks every 250 ms, with an
    /// aggregate rate that `rate(n)` gives for n migrations at once.
    fn settle(rate: impl Fn(u32) -> f64) -> AutoLimit {
        let t0 = Instant::now();
        let mut a = AutoLimit::new();
        let (mut sent, mut n) = (0f64, 0u32);
        for i in 0..400u64 {
            let now = t0 + Duration::from_millis(250 * i);
            sent += rate(n) * 0.25;
            let (allowed, _) = a.tick(now, sent as u64, &run(n as usize, true, 0));
            n = allowed;
            if a.settled {
                break;
            }
        }
        a
    }

    #[test]
    fn auto_starts_with_one_and_holds_it_when_one_fills_the_link() {
        let a = settle(|n| if n == 0 { 0.0 } else { 37.5e6 });
        assert!(a.settled);
        assert_eq!(a.want, 1, "{:?}", a.history);
        assert_eq!(a.limit, 4);
        assert_eq!(a.history.len(), 2);
    }

    #[test]
    fn auto_holds_a_level_that_fills_the_links_without_trying_more() {
        let t0 = Instant::now();
        let mut a = AutoLimit::with_capacity(Some(75e6));
        let (mut sent, mut n) = (0f64, 0u32);
        for i in 0..100u64 {
            sent += if n == 0 { 0.0 } else { 70e6 * 0.25 };
            n = a
                .tick(
                    t0 + Duration::from_millis(250 * i),
                    sent as u64,
                    &run(n as usize, true, 0),
                )
                .0;
        }
        assert!(a.settled);
        assert_eq!((a.want, a.history.len()), (1, 1), "{:?}", a.history);
        // unknown capacity: probed as before
        assert_eq!(AutoLimit::with_capacity(Some(0.0)).capacity, None);
    }

    #[test]
    fn auto_says_when_the_cpu_not_the_link_is_the_limit() {
        let t0 = Instant::now();
        let mut a = AutoLimit::with_capacity(Some(250e6));
        a.observe_cpu(0.97);
        let (mut sent, mut n, mut reasons) = (0f64, 0u32, Vec::new());
        for i in 0..200u64 {
            // 120 MB/s whatever the level: half the links, CPUs full
            sent += if n == 0 { 0.0 } else { 120e6 * 0.25 };
            let (allowed, change) = a.tick(
                t0 + Duration::from_millis(250 * i),
                sent as u64,
                &run(n as usize, true, 0),
            );
            n = allowed;
            reasons.extend(change.map(|c| c.1));
            if a.settled {
                break;
            }
        }
        assert!(a.settled);
        assert!(
            reasons
                .iter()
                .all(|r| r.contains("CPU-bound") && r.contains("97% busy")),
            "{reasons:?}"
        );
        // CPUs idle, or the links full: nothing said of the CPU
        let mut b = AutoLimit::with_capacity(Some(250e6));
        b.observe_cpu(0.40);
        assert_eq!(b.cpu_bound(120e6), "");
        b.observe_cpu(0.99);
        assert_eq!(b.cpu_bound(240e6), "");
    }

    #[test]
    fn auto_climbs_while_it_pays_and_holds_the_last_step_that_did() {
        // CPU-bound: each migration alone is slow; three fill what there is
        let a = settle(|n| 40e6 * n.min(3) as f64);
        assert!(a.settled);
        assert_eq!(a.want, 3, "{:?}", a.history);
        // every step pays up to 8: the limit climbs past 4 and stops at 8
        let a = settle(|n| 40e6 * n as f64);
        assert_eq!(a.limit, 8);
        assert_eq!(a.want, 8, "{:?}", a.history);
    }

    #[test]
    fn auto_starts_the_next_while_one_finishes() {
        let t0 = Instant::now();
        let mut a = AutoLimit::new();
        // not settled yet (a move shorter than the warm-up and a window)
        assert_eq!(a.tick(t0, 0, &run(1, true, 0)).0, 1);
        assert_eq!(a.tick(t0, 0, &run(1, true, 1)).0, 2);
        a.settled = true;
        a.want = 2;
        assert_eq!(a.tick(t0, 0, &run(2, true, 0)).0, 2);
        assert_eq!(a.tick(t0, 0, &run(2, true, 1)).0, 3);
        // never beyond the limit
        assert_eq!(a.tick(t0, 0, &run(4, true, 4)).0, 4);
    }

    #[test]
    fn auto_measures_only_while_every_migration_copies() {
        let t0 = Instant::now();
        let mut a = AutoLimit::new();
        // the first is still starting: no window opens
        for i in 0..20 {
            let (n, ch) = a.tick(
                t0 + Duration::from_millis(250 * i),
                i * 1000,
                &run(1, false, 0),
            );
            assert_eq!((n, ch), (1, None));
        }
        assert!(a.history.is_empty());
        // a window opens; a migration ending before MIN_WINDOW discards it
        a.tick(t0, 0, &run(1, true, 0));
        a.tick(t0 + Duration::from_millis(250), 1000, &run(1, true, 0));
        assert_eq!(
            a.tick(t0 + Duration::from_millis(500), 2000, &run(0, true, 0))
                .1,
            None
        );
        assert!(a.history.is_empty());
        // one ending later still gives the rate it saw until then
        let t1 = t0 + Duration::from_secs(1);
        a.tick(t1, 0, &run(1, true, 0));
        for i in 1..=3u64 {
            a.tick(
                t1 + Duration::from_millis(250 * i),
                i * 25_000_000,
                &run(1, true, 0),
            );
        }
        let (_, change) = a.tick(t1 + Duration::from_secs(1), 0, &run(1, true, 1));
        assert!(change.is_some());
        assert_eq!(a.history, vec![(1, 100e6)]);
    }

    #[test]
    fn running_knows_a_last_round_a_near_switch_over_and_a_warm_up() {
        let s = Duration::from_secs(5);
        let lead = Duration::from_millis(1500);
        let eta = |ms| Some(Duration::from_millis(ms));
        let r = Running::from_progress(true, false, 1, 10, 100.0, None, lead, s);
        assert!(
            r.transferring && !r.finishing,
            "no prediction: not finishing"
        );
        let r = Running::from_progress(true, false, 1, 10, 100.0, eta(5000), lead, s);
        assert!(!r.finishing);
        let r = Running::from_progress(true, false, 1, 10, 100.0, eta(1000), lead, s);
        assert!(r.finishing, "switch-over nearer than the lead");
        assert!(r.steady(), "still measured: it copies at its full rate");
        let r = Running::from_progress(true, false, 3, 150, 100.0, None, lead, s);
        assert!(r.finishing, "last round");
        let r = Running::from_progress(true, false, 3, 250, 100.0, None, lead, s);
        assert!(!r.finishing);
        let r = Running::from_progress(false, true, 3, 0, 0.0, None, lead, s);
        assert!(r.finishing && !r.transferring);
        let short = Duration::from_millis(300);
        let r = Running::from_progress(true, false, 1, 10, 100.0, None, lead, short);
        assert!(!r.transferring);
        // just started: QEMU's first report (nothing remaining yet) predicts nothing
        let r = Running::from_progress(true, false, 0, 0, 0.0, eta(0), lead, short);
        assert!(!r.finishing, "a move starting is not finishing");
    }

    #[test]
    fn the_lead_follows_measured_setup_times() {
        let mut a = AutoLimit::new();
        assert_eq!(a.lead(), Duration::from_millis(1500));
        a.observe_setup(Duration::from_millis(700));
        assert_eq!(a.lead(), Duration::from_millis(1200));
        for _ in 0..50 {
            a.observe_setup(Duration::from_millis(300));
        }
        assert!(a.lead() < Duration::from_millis(850), "{:?}", a.lead());
    }
}
