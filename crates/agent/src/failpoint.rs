//! Named points in the migration path where a fault can be injected on
//! purpose, to test what the commit protocol promises (an agent frozen, an
//! agent killed, a QEMU killed at an exact step). Off unless the agent's
//! environment sets `FERRY_FAILPOINTS`, e.g.
//! `FERRY_FAILPOINTS=target-before-run=stop,source-after-commit=exit`.
//!
//! | point | where |
//! |---|---|
//! | `target-at-ready` | target, asked whether the memory has arrived, when it has, before answering |
//! | `target-before-run` | target, told to run, before it writes Running |
//! | `source-after-commit` | source, right after its Committed record is on disk |
//! | `source-start-postcopy` | source, in place of asking QEMU to switch to post-copy |
//! | `source-postcopy-running` | source, in post-copy, once the target answered RUN |
//!
//! Actions: `stop` (SIGSTOP to the whole agent: frozen until SIGCONT), `exit`
//! (SIGKILL to the agent: a crash), `kill-qemu` (the caller kills the VM's
//! QEMU), `fail` (the caller fails the step as if what it asked for was
//! refused), `delay` (the caller waits [`DELAY`] there, the agent answering
//! meanwhile: a window for the other side's questions). Each point fires
//! once per process.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Stop,
    Exit,
    KillQemu,
    Fail,
    Delay,
}

/// How long a `delay` holds its caller: past a waiting skeleton's first
/// question to its source (`ASK_AFTER` plus the reaper's period), whatever
/// the skeleton's age when the point fires.
pub const DELAY: std::time::Duration = std::time::Duration::from_secs(13);

fn parse(spec: &str) -> Result<BTreeMap<String, Action>, String> {
    let mut out = BTreeMap::new();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (point, action) = item
            .split_once('=')
            .ok_or_else(|| format!("FERRY_FAILPOINTS: {item:?} is not POINT=ACTION"))?;
        let action = match action {
            "stop" => Action::Stop,
            "exit" => Action::Exit,
            "kill-qemu" => Action::KillQemu,
            "fail" => Action::Fail,
            "delay" => Action::Delay,
            a => {
                return Err(format!(
                "FERRY_FAILPOINTS: unknown action {a:?} for {point} (stop, exit, kill-qemu, fail, delay)"
            ))
            }
        };
        out.insert(point.to_string(), action);
    }
    Ok(out)
}

fn armed() -> &'static Mutex<BTreeMap<String, Action>> {
    static ARMED: OnceLock<Mutex<BTreeMap<String, Action>>> = OnceLock::new();
    ARMED.get_or_init(|| {
        let spec = std::env::var("FERRY_FAILPOINTS").unwrap_or_default();
        let map = parse(&spec).unwrap_or_else(|e| {
            tracing::error!("{e}; no failpoint armed");
            BTreeMap::new()
        });
        if !map.is_empty() {
            tracing::warn!(?map, "failpoints armed (FERRY_FAILPOINTS)");
        }
        Mutex::new(map)
    })
}

/// Fires point `name` if it is armed: `stop` and `exit` act on this process
/// here; `kill-qemu`, `fail` and `delay` are returned for the caller to
/// carry out.
pub fn hit(name: &str) -> Option<Action> {
    let action = ferry_api::util::lock(armed()).remove(name)?;
    tracing::warn!(point = name, ?action, "failpoint fired");
    // raised on this thread, not sent to the process: a signal sent with
    // kill(2) may be taken by another thread while this one runs on past the
    // point (a READY answered after `stop` fired); raised here, this thread
    // goes no further, and the signal stops or ends every thread
    match action {
        // SAFETY: raising a signal on this thread has no memory effects.
        Action::Stop => unsafe {
            libc::raise(libc::SIGSTOP);
        },
        // SAFETY: as above; SIGKILL ends the process at once, like a crash.
        Action::Exit => unsafe {
            libc::raise(libc::SIGKILL);
        },
        Action::KillQemu | Action::Fail | Action::Delay => {}
    }
    Some(action)
}

/// [`hit`] at a point whose caller has nothing to refuse: a `delay` waits
/// here; `fail` and `kill-qemu` do nothing.
pub async fn pass(name: &str) {
    if hit(name) == Some(Action::Delay) {
        tokio::time::sleep(DELAY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_bad_ones_name_the_item() {
        let m = parse("target-before-run=stop, source-after-commit=exit").unwrap();
        assert_eq!(m["target-before-run"], Action::Stop);
        assert_eq!(m["source-after-commit"], Action::Exit);
        assert_eq!(
            parse("source-start-postcopy=fail").unwrap()["source-start-postcopy"],
            Action::Fail
        );
        assert_eq!(
            parse("source-after-commit=delay").unwrap()["source-after-commit"],
            Action::Delay
        );
        assert!(parse("").unwrap().is_empty());
        assert!(parse("x").unwrap_err().contains("\"x\""));
        assert!(parse("x=boom").unwrap_err().contains("boom"));
    }
}
