//! Guests paused for their storage (see `ferry_agent::resilience`), as the
//! cluster sees them: storage named by node, and every pause, resume and
//! stop in the event log.
//!
//! Agents pause and resume guests on their own (they need no control
//! service for it); each heartbeat's VM lists show the pause now under way
//! or the last one, and this module logs what changed since the last round:
//! `storage_pause` when a pause begins, then `storage_resume` (with how long
//! the guest was paused) or `storage_stop` (the window ran out).

use std::collections::BTreeMap;

use ferry_api::util::lock;
use ferry_api::{HostEntry, PauseState, StoragePause, VmInfo};

use crate::Control;

/// What the log has said of each VM's pauses: (pause start, state).
#[derive(Default)]
pub(crate) struct Logged {
    by_vm: std::sync::Mutex<BTreeMap<String, (u64, PauseState)>>,
    /// NBD endpoint (`HOST:PORT`) → storage node name, from the nodes' disk
    /// lists (kept while a node is down: that is when it is needed).
    nodes: std::sync::Mutex<BTreeMap<String, String>>,
}

/// The events a pause record calls for, given what was logged of it.
pub(crate) fn transitions(
    p: &StoragePause,
    logged: Option<(u64, PauseState)>,
) -> Vec<(&'static str, serde_json::Value)> {
    let mut out = Vec::new();
    let known = logged.filter(|(since, _)| *since == p.since_ms);
    if known.is_none() {
        out.push((
            "storage_pause",
            serde_json::json!({ "storage": p.storage, "since_ms": p.since_ms }),
        ));
    }
    let was = known.map(|(_, s)| s).unwrap_or(PauseState::Paused);
    if p.state != was {
        let took = p.until_ms.unwrap_or(p.since_ms).saturating_sub(p.since_ms);
        match p.state {
            PauseState::Resumed => out.push((
                "storage_resume",
                serde_json::json!({ "storage": p.storage, "paused_ms": took }),
            )),
            PauseState::Stopped => out.push((
                "storage_stop",
                serde_json::json!({
                    "storage": p.storage, "paused_ms": took,
                    "reason": "its storage did not answer within the host's storage_pause_max: the VM was stopped",
                }),
            )),
            // paused again within the grace of a resume: the same outage
            PauseState::Paused => out.push((
                "storage_pause",
                serde_json::json!({ "storage": p.storage, "since_ms": p.since_ms, "again": true }),
            )),
        }
    }
    out
}

impl Control {
    /// Learns which node serves which NBD endpoint from its disks' URIs.
    pub(crate) fn learn_endpoints(&self, node: &str, disks: &[ferry_api::storage::DiskInfo]) {
        let mut m = lock(&self.pauses.nodes);
        for d in disks {
            if let Some((addr, _)) = d.uri.strip_prefix("nbd://").and_then(|r| r.split_once('/')) {
                m.insert(addr.to_string(), node.to_string());
            }
        }
    }

    /// `storage1 (198.18.0.2:10809)` for an endpoint a node serves.
    fn name_storage(&self, storage: &str) -> String {
        let m = lock(&self.pauses.nodes);
        storage
            .split(", ")
            .map(|e| match m.get(e) {
                Some(n) => format!("{n} ({e})"),
                None => e.to_string(),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Names the storage of every pause in `vms`.
    pub(crate) fn name_pauses(&self, vms: &mut [VmInfo]) {
        for v in vms {
            if let Some(p) = &mut v.storage_pause {
                p.storage = self.name_storage(&p.storage);
            }
        }
    }

    /// One heartbeat's share: logs pauses begun and ended since the last.
    pub(crate) fn log_pauses(&self, hosts: &[HostEntry]) {
        for h in hosts {
            let Some(info) = &h.info else { continue };
            for v in &info.vms {
                let Some(p) = &v.storage_pause else { continue };
                let logged = lock(&self.pauses.by_vm).get(&v.name).copied();
                let named = StoragePause {
                    storage: self.name_storage(&p.storage),
                    ..p.clone()
                };
                for (kind, mut detail) in transitions(&named, logged) {
                    detail["host"] = h.name.clone().into();
                    if kind == "storage_stop" {
                        tracing::error!(vm = %v.name, host = %h.name, "{}", named.describe(ferry_api::util::now_ms()));
                    }
                    self.log(kind, &v.name, detail);
                }
                lock(&self.pauses.by_vm).insert(v.name.clone(), (p.since_ms, p.state));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pause(state: PauseState, until: Option<u64>) -> StoragePause {
        StoragePause {
            storage: "storage1 (198.18.0.2:10809)".into(),
            since_ms: 1_000,
            state,
            until_ms: until,
        }
    }

    fn kinds(v: Vec<(&'static str, serde_json::Value)>) -> Vec<&'static str> {
        v.into_iter().map(|(k, _)| k).collect()
    }

    #[test]
    fn each_pause_is_logged_once_and_its_end_once() {
        let p = pause(PauseState::Paused, None);
        assert_eq!(kinds(transitions(&p, None)), ["storage_pause"]);
        assert!(transitions(&p, Some((1_000, PauseState::Paused))).is_empty());
        let r = pause(PauseState::Resumed, Some(13_500));
        let t = transitions(&r, Some((1_000, PauseState::Paused)));
        assert_eq!(t[0].0, "storage_resume");
        assert_eq!(t[0].1["paused_ms"], 12_500);
        assert!(transitions(&r, Some((1_000, PauseState::Resumed))).is_empty());
        // a whole pause between two heartbeats: both ends logged
        assert_eq!(
            kinds(transitions(&r, None)),
            ["storage_pause", "storage_resume"]
        );
        // an older pause logged: this is a new one
        assert_eq!(
            kinds(transitions(&r, Some((500, PauseState::Resumed)))),
            ["storage_pause", "storage_resume"]
        );
        let s = pause(PauseState::Stopped, Some(1_801_000));
        let t = transitions(&s, Some((1_000, PauseState::Paused)));
        assert_eq!(t[0].0, "storage_stop");
        assert!(t[0].1["reason"].as_str().unwrap().contains("stopped"));
    }
}
