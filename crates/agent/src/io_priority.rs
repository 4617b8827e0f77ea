//! The calling thread's I/O priority (`ioprio_set(2)`): the switch-over's
//! records flushed ahead of other processes' writeback.
//!
//! The source's `committed` and the target's `running` are written while the
//! guest is paused, each a 512-byte sector and an `fdatasync`. On a disk
//! busy with someone else's writeback, that flush queues behind it. The
//! block layer's schedulers that honour priorities (mq-deadline, BFQ)
//! dispatch the real-time class first, so the record's sector goes ahead
//! of the queued writeback; the device's cache flush that follows still
//! waits for what the device already holds (BENCHMARKS.md, "The
//! switch-over's records at the real-time I/O class").
//!
//! The priority belongs to the thread, so [`realtime`] sets it around one
//! piece of work and gives the thread back the priority it had: the agent's
//! runtime threads do all its other I/O at their own.

/// `IOPRIO_WHO_PROCESS`: with id 0, the calling thread.
const WHO_THREAD: libc::c_int = 1;
/// A priority value is its class shifted by this, or'ed with its level.
const CLASS_SHIFT: u32 = 13;

/// The I/O scheduling classes of `ioprio_set(2)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// No class set: best effort at a level derived from the CPU nice value.
    None = 0,
    RealTime = 1,
    BestEffort = 2,
    Idle = 3,
}

/// The calling thread's I/O priority: its class and level (0 highest, 7 lowest).
pub fn current() -> std::io::Result<(Class, u8)> {
    // SAFETY: ioprio_get takes two integers and touches no memory of ours.
    let v = unsafe { libc::syscall(libc::SYS_ioprio_get, WHO_THREAD, 0) };
    if v < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let class = match v >> CLASS_SHIFT {
        1 => Class::RealTime,
        2 => Class::BestEffort,
        3 => Class::Idle,
        _ => Class::None,
    };
    Ok((class, (v & 7) as u8))
}

fn set(class: Class, level: u8) -> std::io::Result<()> {
    let value = ((class as libc::c_long) << CLASS_SHIFT) | libc::c_long::from(level & 7);
    // SAFETY: ioprio_set takes three integers and touches no memory of ours.
    let r = unsafe { libc::syscall(libc::SYS_ioprio_set, WHO_THREAD, 0, value) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Runs `f` with the calling thread's I/O in the real-time class at its
/// highest level, then gives the thread back the priority it had. Where
/// the class cannot be had (it takes `CAP_SYS_ADMIN` or `CAP_SYS_NICE`),
/// `f` runs at the thread's own priority. The second value says which.
pub fn realtime<T>(f: impl FnOnce() -> T) -> (T, bool) {
    let before = current().ok();
    let raised = before.is_some() && set(Class::RealTime, 0).is_ok();
    let out = f();
    if raised {
        if let Some((class, level)) = before {
            if let Err(e) = set(class, level) {
                tracing::warn!(error = %e, "giving a thread back its I/O priority");
            }
        }
    }
    (out, raised)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_runs_at_the_real_time_class_where_allowed_and_the_thread_gets_its_own_back() {
        // a thread of its own: the priority is the thread's, whatever the harness does
        std::thread::spawn(|| {
            let before = current().expect("ioprio_get");
            let (during, raised) = realtime(|| current().expect("ioprio_get"));
            // root (as CI and the lab tests run) holds CAP_SYS_ADMIN
            // SAFETY: geteuid has no preconditions.
            let root = unsafe { libc::geteuid() } == 0;
            if root {
                assert!(raised, "root could not take the real-time class");
                assert_eq!(during, (Class::RealTime, 0));
            } else {
                assert!(!raised, "the real-time class without the capability");
                assert_eq!(during, before);
            }
            assert_eq!(
                current().expect("ioprio_get"),
                before,
                "the thread's own priority back"
            );
            // and from a priority set on purpose, that one back
            set(Class::BestEffort, 6).expect("a thread may lower its own priority");
            let ((), _) = realtime(|| ());
            assert_eq!(current().expect("ioprio_get"), (Class::BestEffort, 6));
        })
        .join()
        .expect("the test's thread");
    }
}
