//! The copy loop's decisions as a pure state machine: fed one sample of
//! QEMU's migration statistics at a time (with the time it was taken), it
//! says what to do next — keep copying, switch to post-copy, pause and copy,
//! give up for lack of convergence, or give up on a stalled path. The source
//! agent performs the actions (QMP, events, the commit); the tests here
//! cover each decision without a QEMU.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use ferry_api::AtExpiry;

/// No byte moved for this long: the data path is down.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(5);

/// What the move allows (from its convergence policy).
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    pub postcopy: bool,
    pub throttle: bool,
    pub expiry: AtExpiry,
    /// How long after the first pass pre-copy may take to converge.
    pub timeout: Duration,
    pub max_downtime_ms: u64,
}

/// One poll of `query-migrate`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sample {
    pub transferred: u64,
    pub dirty_sync_count: u64,
    /// Bytes per second the guest dirties.
    pub dirty_rate: f64,
    pub expected_downtime_ms: Option<u64>,
    pub throttle_pct: u64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Action {
    Continue,
    /// Pre-copy does not converge and post-copy is allowed.
    StartPostcopy,
    /// The timeout passed and the policy says pause and copy the rest.
    PauseAndCopy,
    /// The timeout passed and nothing else is allowed.
    NotConverging,
    /// No byte moved for [`STALL_TIMEOUT`].
    Stalled,
}

/// A decision with the rates it was taken on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step {
    pub action: Action,
    /// Bytes per second the path moved over the last 2 s.
    pub path_rate: f64,
    pub dirty_rate: f64,
    pub throttle_pct: u64,
}

impl Step {
    pub fn rates(&self) -> String {
        format!(
            "the guest dirties {:.1} MB/s, the path moves {:.1} MB/s, vCPU throttle {}%",
            self.dirty_rate / 1e6,
            self.path_rate / 1e6,
            self.throttle_pct
        )
    }
}

/// The loop's memory between samples.
#[derive(Debug)]
pub struct CopyLoop {
    policy: Policy,
    /// Set when the first pass is done: convergence is timed from there.
    deadline: Option<Instant>,
    /// Consecutive samples (100 ms apart) that said "does not converge".
    not_converging: u32,
    window: VecDeque<(Instant, u64)>,
    last_transferred: u64,
    last_change: Instant,
    pausing: bool,
    postcopy: bool,
}

impl CopyLoop {
    pub fn new(policy: Policy, now: Instant) -> CopyLoop {
        CopyLoop {
            policy,
            deadline: None,
            not_converging: 0,
            window: VecDeque::new(),
            last_transferred: 0,
            last_change: now,
            pausing: false,
            postcopy: false,
        }
    }

    /// The caller switched to post-copy (or QEMU reports it is in post-copy):
    /// from now on every sample continues, whatever the path does.
    pub fn entered_postcopy(&mut self) {
        self.postcopy = true;
    }

    pub fn in_postcopy(&self) -> bool {
        self.postcopy
    }

    pub fn pausing(&self) -> bool {
        self.pausing
    }

    /// Takes one sample and decides.
    pub fn observe(&mut self, s: &Sample, now: Instant) -> Step {
        let p = self.policy;
        if self.deadline.is_none() && s.dirty_sync_count >= 2 {
            self.deadline = Some(now + p.timeout);
        }
        let expired = self.deadline.is_some_and(|d| now > d);
        // rates over the last 2 s: what the path moves vs what the guest dirties
        self.window.push_back((now, s.transferred));
        while self.window.len() > 2 && now - self.window[0].0 > Duration::from_secs(2) {
            self.window.pop_front();
        }
        let path_rate = match (self.window.front(), self.window.back()) {
            (Some(a), Some(b)) if b.0 > a.0 => {
                b.1.saturating_sub(a.1) as f64 / (b.0 - a.0).as_secs_f64()
            }
            _ => 0.0,
        };
        let step = |action| Step {
            action,
            path_rate,
            dirty_rate: s.dirty_rate,
            throttle_pct: s.throttle_pct,
        };
        // pre-copy converges only if the path outruns the guest's dirtying by
        // enough that what is left fits the downtime target; after the first
        // pass, QEMU's expected downtime (remaining ÷ bandwidth) staying over
        // twice the target says it does not
        let too_slow = s.dirty_rate >= 0.9 * path_rate
            || s.expected_downtime_ms
                .is_some_and(|d| d > 2 * p.max_downtime_ms && s.dirty_sync_count >= 3);
        if !self.postcopy && s.dirty_sync_count >= 2 && path_rate > 0.0 && too_slow {
            self.not_converging += 1;
        } else {
            self.not_converging = 0;
        }
        if self.postcopy {
            return step(Action::Continue);
        }
        if p.postcopy {
            // after 3 s of not converging with throttling at its limit (or
            // without throttling), 10 s with it, or at the timeout: post-copy
            let throttled_out = !p.throttle || s.throttle_pct >= 99;
            if (self.not_converging >= 30 && throttled_out)
                || self.not_converging >= 100
                || (expired && p.expiry == AtExpiry::Postcopy)
            {
                return step(Action::StartPostcopy);
            }
        }
        if expired && !self.pausing && p.expiry == AtExpiry::Pause {
            self.pausing = true;
            return step(Action::PauseAndCopy);
        }
        if expired && !self.pausing {
            return step(Action::NotConverging);
        }
        if s.transferred != self.last_transferred {
            self.last_transferred = s.transferred;
            self.last_change = now;
        } else if now - self.last_change > STALL_TIMEOUT {
            return step(Action::Stalled);
        }
        step(Action::Continue)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: f64 = 1e6;

    fn policy(postcopy: bool, throttle: bool, expiry: AtExpiry) -> Policy {
        Policy {
            postcopy,
            throttle,
            expiry,
            timeout: Duration::from_secs(20),
            max_downtime_ms: 300,
        }
    }

    /// Runs samples 100 ms apart: the path moves `path` B/s, the guest
    /// dirties `dirty` B/s, after the first pass from the start. Returns the
    /// first action other than Continue, and when.
    fn run(p: Policy, path: f64, dirty: f64, throttle: u64, secs: u64) -> (Action, Duration) {
        let t0 = Instant::now();
        let mut l = CopyLoop::new(p, t0);
        for i in 1..=secs * 10 {
            let dt = Duration::from_millis(100 * i);
            let s = Sample {
                transferred: (path * dt.as_secs_f64()) as u64,
                dirty_sync_count: 3,
                dirty_rate: dirty,
                expected_downtime_ms: Some(5_000),
                throttle_pct: throttle,
            };
            let st = l.observe(&s, t0 + dt);
            if st.action != Action::Continue {
                return (st.action, dt);
            }
        }
        (Action::Continue, Duration::from_secs(secs))
    }

    #[test]
    fn a_guest_outrun_by_its_path_keeps_copying() {
        let mut l = CopyLoop::new(policy(true, true, AtExpiry::Cancel), Instant::now());
        let t0 = Instant::now();
        for i in 1..=50u64 {
            let s = Sample {
                transferred: i * 10_000_000,
                dirty_sync_count: 2,
                dirty_rate: 5.0 * MB,
                expected_downtime_ms: Some(100),
                ..Default::default()
            };
            let st = l.observe(&s, t0 + Duration::from_millis(100 * i));
            assert_eq!(st.action, Action::Continue);
            if i > 2 {
                assert!((st.path_rate - 100.0 * MB).abs() < 1.0 * MB, "{st:?}");
            }
        }
    }

    #[test]
    fn postcopy_after_3_s_without_throttling_and_10_s_with_it() {
        let (a, at) = run(
            policy(true, false, AtExpiry::Cancel),
            100.0 * MB,
            120.0 * MB,
            0,
            30,
        );
        assert_eq!(a, Action::StartPostcopy);
        assert!(
            at >= Duration::from_secs(3) && at < Duration::from_secs(4),
            "{at:?}"
        );
        // throttling allowed but not yet at its limit: 10 s
        let (a, at) = run(
            policy(true, true, AtExpiry::Cancel),
            100.0 * MB,
            120.0 * MB,
            40,
            30,
        );
        assert_eq!(a, Action::StartPostcopy);
        assert!(
            at >= Duration::from_secs(10) && at < Duration::from_secs(11),
            "{at:?}"
        );
        // throttling at its limit: 3 s again
        let (_, at) = run(
            policy(true, true, AtExpiry::Cancel),
            100.0 * MB,
            120.0 * MB,
            99,
            30,
        );
        assert!(at < Duration::from_secs(4), "{at:?}");
    }

    #[test]
    fn at_the_timeout_the_policy_decides() {
        // QEMU's expected downtime over twice the target: not converging
        for (expiry, want) in [
            (AtExpiry::Cancel, Action::NotConverging),
            (AtExpiry::Pause, Action::PauseAndCopy),
        ] {
            let (a, at) = run(policy(false, true, expiry), 100.0 * MB, 120.0 * MB, 50, 40);
            assert_eq!(a, want);
            assert!(
                at > Duration::from_secs(20) && at < Duration::from_secs(21),
                "{at:?}"
            );
        }
        let (a, _) = run(
            policy(true, true, AtExpiry::Postcopy),
            100.0 * MB,
            60.0 * MB,
            0,
            40,
        );
        assert_eq!(a, Action::StartPostcopy);
    }

    #[test]
    fn pause_and_copy_is_decided_once_and_then_waits() {
        let t0 = Instant::now();
        let mut l = CopyLoop::new(policy(false, false, AtExpiry::Pause), t0);
        let mut pauses = 0;
        for i in 1..=300u64 {
            let s = Sample {
                transferred: i * 1_000_000,
                dirty_sync_count: 3,
                dirty_rate: 50.0 * MB,
                expected_downtime_ms: Some(10_000),
                ..Default::default()
            };
            match l.observe(&s, t0 + Duration::from_millis(100 * i)).action {
                Action::PauseAndCopy => pauses += 1,
                Action::Continue => {}
                a => panic!("unexpected {a:?}"),
            }
        }
        assert_eq!(pauses, 1);
        assert!(l.pausing());
    }

    #[test]
    fn a_path_that_moves_nothing_for_5_s_is_stalled() {
        let t0 = Instant::now();
        let mut l = CopyLoop::new(policy(false, false, AtExpiry::Cancel), t0);
        let s = Sample {
            transferred: 42,
            dirty_sync_count: 1,
            ..Default::default()
        };
        assert_eq!(
            l.observe(&s, t0 + Duration::from_millis(100)).action,
            Action::Continue
        );
        assert_eq!(
            l.observe(&s, t0 + Duration::from_secs(5)).action,
            Action::Continue
        );
        assert_eq!(
            l.observe(&s, t0 + Duration::from_millis(5_200)).action,
            Action::Stalled
        );
    }

    #[test]
    fn in_postcopy_nothing_but_continue() {
        let t0 = Instant::now();
        let mut l = CopyLoop::new(policy(true, false, AtExpiry::Cancel), t0);
        l.entered_postcopy();
        let s = Sample {
            transferred: 1,
            dirty_sync_count: 5,
            dirty_rate: 500.0 * MB,
            ..Default::default()
        };
        for i in 1..600u64 {
            let st = l.observe(&s, t0 + Duration::from_millis(100 * i));
            assert_eq!(st.action, Action::Continue, "at {i}");
        }
        assert!(l.in_postcopy());
    }
}
