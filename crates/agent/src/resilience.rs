//! VM storage resiliency: a guest whose storage stops answering is paused,
//! never failed, and runs on by itself when the storage answers again.
//!
//! Every disk device has `werror=stop,rerror=stop`
//! ([`crate::qemu::DISK_ERROR_POLICY`]) and every NBD disk reconnects for
//! [`crate::qemu::QemuConfig::storage_pause_after`] (default 5 s). So:
//!
//! 1. For the first `storage_pause_after` of an outage QEMU reconnects on
//!    its own and reissues what was in flight; the guest sees slow I/O only
//!    (a storage node restarting quickly goes unnoticed).
//! 2. After it, the failing request stops the VM (run state `io-error`).
//!    QEMU keeps the request for a retry on `cont`; nothing reaches the
//!    guest, which cannot tell the pause from a stalled clock.
//! 3. This watcher, once a second, sees the VM in `io-error`, names the
//!    storage it waits for (the NBD endpoints of the devices whose
//!    io-status is `failed`, or `local`) and records the pause; the agent's
//!    VM list carries it to `vm list`, the web page, metrics and the event
//!    log.
//! 4. It probes those endpoints (a TCP connect, 1 s); when all answer it
//!    opens a fresh NBD connection under each failed node (`blockdev-add`
//!    and `blockdev-reopen`: QEMU's own reconnection backs off up to 16 s)
//!    and `cont`s the VM: QEMU reissues the kept requests.
//! 5. A VM still paused after `storage_pause_max` (default 30 minutes) is
//!    stopped, and its record says so.
//!
//! A paused VM is not migrated (see `Agent::migrate`): its move would carry
//! I/O that cannot complete anywhere.

use std::sync::Arc;
use std::time::Duration;

use ferry_api::util::now_ms;
use ferry_api::{PauseState, StoragePause, VmSpec};

use crate::host::Role;
use crate::qemu::{Backing, QemuVm, IO_ERROR};
use crate::Agent;

/// The default window after which a VM still waiting for its storage is
/// stopped (what Hyper-V's VM storage resiliency does).
pub const STORAGE_PAUSE_MAX: Duration = Duration::from_secs(30 * 60);

/// A VM paused again this soon after being resumed continues its earlier
/// pause (same start): a retry that failed is not a new outage.
const REPAUSE_GRACE_MS: u64 = 10_000;

/// How long a storage endpoint has to accept a TCP connection.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// What the watcher does with one VM at one tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Nothing,
    /// The VM stopped on a disk error: a pause begins.
    Pause,
    /// Paused within the window: probe its storage, resume when it answers.
    Probe,
    /// Paused for the whole window: stop the VM.
    Stop,
    /// Running again by other hands (an operator's `cont`): the pause ended.
    Ended,
}

/// The watcher's decision for a VM in QEMU run state `status` whose last
/// pause record is `pause`, at Unix time `now` (ms).
pub fn step(status: &str, pause: Option<&StoragePause>, now: u64, max: Duration) -> Step {
    let active = pause.filter(|p| p.active());
    match (status == IO_ERROR, active) {
        (true, None) => Step::Pause,
        (true, Some(p)) if now.saturating_sub(p.since_ms) >= max.as_millis() as u64 => Step::Stop,
        (true, Some(_)) => Step::Probe,
        (false, Some(_)) if status == "running" => Step::Ended,
        (false, _) => Step::Nothing,
    }
}

/// The pause that begins at `now` on `storage`: the earlier one continued
/// when it ended moments ago on the same storage.
pub fn begin(storage: String, last: Option<&StoragePause>, now: u64) -> StoragePause {
    let since = match last {
        Some(p)
            if p.state == PauseState::Resumed
                && p.storage == storage
                && now.saturating_sub(p.until_ms.unwrap_or(0)) < REPAUSE_GRACE_MS =>
        {
            p.since_ms
        }
        _ => now,
    };
    StoragePause {
        storage,
        since_ms: since,
        state: PauseState::Paused,
        until_ms: None,
    }
}

/// The storage behind each of the VM's block nodes: `(node-name, HOST:PORT
/// or "local")`.
pub fn endpoints(spec: &VmSpec) -> Vec<(String, String)> {
    crate::qemu::block_nodes(spec)
        .into_iter()
        .map(|n| {
            let e = match n.backing {
                Backing::Nbd { host, port, .. } => format!("{host}:{port}"),
                Backing::File(_) | Backing::Local { .. } => "local".to_string(),
            };
            (n.name, e)
        })
        .collect()
}

/// The block nodes whose device stopped the VM on an error.
async fn failed_nodes(q: &QemuVm) -> Vec<String> {
    match q.qmp.query_block().await {
        Ok(blocks) => blocks
            .iter()
            .filter(|b| matches!(b.io_status.as_deref(), Some("failed" | "nospace")))
            .filter_map(|b| b.inserted.as_ref()?.node_name.clone())
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// The storage a VM stopped in `io-error` waits for: the endpoints of its
/// failed devices (every endpoint when QEMU names none), `, `-joined.
async fn failed_storage(spec: &VmSpec, q: &QemuVm) -> String {
    let all = endpoints(spec);
    let failed: Vec<String> = failed_nodes(q)
        .await
        .into_iter()
        .filter_map(|n| {
            all.iter()
                .find(|(node, _)| *node == n)
                .map(|(_, e)| e.clone())
        })
        .collect();
    let mut names = if failed.is_empty() {
        all.into_iter().map(|(_, e)| e).collect()
    } else {
        failed
    };
    names.sort();
    names.dedup();
    if names.is_empty() {
        "unknown".into()
    } else {
        names.join(", ")
    }
}

/// True when every endpoint of `storage` accepts a TCP connection (a local
/// file cannot be probed: QEMU's retry on `cont` is the probe).
async fn storage_answers(storage: &str) -> bool {
    for e in storage.split(", ") {
        if e == "local" || e == "unknown" {
            continue;
        }
        let ok = matches!(
            tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(e)).await,
            Ok(Ok(_))
        );
        if !ok {
            return false;
        }
    }
    true
}

impl Agent {
    /// One round of the storage watcher over every VM running here (not
    /// migrating): see the module's text.
    pub async fn watch_storage(&self) {
        let vms: Vec<(String, VmSpec, Arc<QemuVm>, Option<StoragePause>)> = {
            let st = self.state.lock().await;
            st.vms
                .iter()
                .filter(|(_, s)| s.role == Role::Running && !s.migrating)
                .filter_map(|(n, s)| {
                    let q = s.qemu.clone()?;
                    Some((n.clone(), s.spec.clone(), q, s.storage_pause.clone()))
                })
                .collect()
        };
        for (name, spec, q, pause) in vms {
            let Ok(status) = q.qmp.status_seen().await else {
                continue;
            };
            let now = now_ms();
            let next = match step(
                &status.status,
                pause.as_ref(),
                now,
                self.cfg.storage_pause_max,
            ) {
                Step::Nothing => continue,
                Step::Pause => {
                    let p = begin(failed_storage(&spec, &q).await, pause.as_ref(), now);
                    tracing::warn!(vm = %name, storage = %p.storage, "guest paused: its storage does not answer");
                    p
                }
                Step::Probe => {
                    let mut p = pause.clone().expect("an active pause");
                    if !storage_answers(&p.storage).await {
                        continue;
                    }
                    // QEMU's own reconnection backs off up to 16 s after an
                    // outage: a fresh connection under each failed node
                    // makes the retry on `cont` find the storage at once
                    for node in failed_nodes(&q).await {
                        if let Err(e) = self.reconnect_node(&q, &spec, &node).await {
                            tracing::warn!(vm = %name, node, error = %e, "reconnecting to storage");
                        }
                    }
                    if let Err(e) = q.qmp.cont().await {
                        tracing::warn!(vm = %name, error = %e, "resuming after a storage pause");
                        continue;
                    }
                    p.state = PauseState::Resumed;
                    p.until_ms = Some(now_ms());
                    tracing::info!(vm = %name, storage = %p.storage, paused_ms = now_ms() - p.since_ms, "storage answers: guest resumed");
                    p
                }
                Step::Stop => {
                    let mut p = pause.clone().expect("an active pause");
                    q.stop().await;
                    p.state = PauseState::Stopped;
                    p.until_ms = Some(now_ms());
                    tracing::error!(vm = %name, storage = %p.storage, "guest stopped: its storage did not answer within {:?}", self.cfg.storage_pause_max);
                    p
                }
                Step::Ended => {
                    let mut p = pause.clone().expect("an active pause");
                    p.state = PauseState::Resumed;
                    p.until_ms = Some(now);
                    p
                }
            };
            let mut st = self.state.lock().await;
            // the slot may have changed hands meanwhile (removed, migrating)
            if let Some(slot) = st.vms.get_mut(&name) {
                if slot.qemu.as_ref().is_some_and(|s| Arc::ptr_eq(s, &q)) {
                    if next.state == PauseState::Stopped {
                        slot.problem = Some(next.describe(now_ms()));
                    }
                    slot.storage_pause = Some(next);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_secs(1800);

    fn paused(since: u64) -> StoragePause {
        StoragePause {
            storage: "198.18.0.2:10809".into(),
            since_ms: since,
            state: PauseState::Paused,
            until_ms: None,
        }
    }

    #[test]
    fn an_io_error_pauses_then_probes_then_stops_at_the_window() {
        assert_eq!(step("running", None, 0, MAX), Step::Nothing);
        assert_eq!(step(IO_ERROR, None, 0, MAX), Step::Pause);
        let p = paused(1_000);
        assert_eq!(step(IO_ERROR, Some(&p), 2_000, MAX), Step::Probe);
        assert_eq!(
            step(IO_ERROR, Some(&p), 1_000 + 1_799_999, MAX),
            Step::Probe
        );
        assert_eq!(step(IO_ERROR, Some(&p), 1_000 + 1_800_000, MAX), Step::Stop);
        // resumed by someone else
        assert_eq!(step("running", Some(&p), 5_000, MAX), Step::Ended);
        // paused by an operator, not by storage: not ours to resume
        assert_eq!(step("paused", Some(&p), 5_000, MAX), Step::Nothing);
        assert_eq!(step("paused", None, 5_000, MAX), Step::Nothing);
    }

    #[test]
    fn a_retry_that_fails_at_once_continues_the_pause() {
        let mut p = paused(1_000);
        p.state = PauseState::Resumed;
        p.until_ms = Some(9_000);
        let again = begin(p.storage.clone(), Some(&p), 12_000);
        assert_eq!((again.since_ms, again.state), (1_000, PauseState::Paused));
        // a new outage later, or of other storage, is a new pause
        assert_eq!(begin(p.storage.clone(), Some(&p), 30_000).since_ms, 30_000);
        assert_eq!(begin("local".into(), Some(&p), 12_000).since_ms, 12_000);
        // after a stop, a new pause starts afresh
        p.state = PauseState::Stopped;
        assert_eq!(begin(p.storage.clone(), Some(&p), 12_000).since_ms, 12_000);
    }

    #[test]
    fn endpoints_name_each_block_node_storage() {
        let spec: VmSpec = serde_json::from_value(serde_json::json!({
            "name": "v", "memory": 268435456u64, "fill": 0, "dirty_rate": 0,
            "disks": [{"disk": "d1", "uri": "nbd://198.18.0.2:10809/d1/v"}],
        }))
        .unwrap();
        assert_eq!(
            endpoints(&spec),
            vec![("disk0".to_string(), "198.18.0.2:10809".to_string())]
        );
    }

    #[test]
    fn a_pause_describes_itself() {
        let mut p = paused(3_600_000 * 12 + 1_000);
        let now = p.since_ms + 42_000;
        assert_eq!(
            p.describe(now),
            "paused: storage (198.18.0.2:10809, since 12:00:01 UTC, 42s)"
        );
        p.state = PauseState::Stopped;
        p.until_ms = Some(p.since_ms + 1_800_000);
        assert!(p
            .describe(now)
            .starts_with("stopped: storage (198.18.0.2:10809) did not answer for 30m"));
    }
}
