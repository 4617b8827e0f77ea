//! Which host may open which VM's disks over NBD.
//!
//! A storage node serving NBD over TLS opens an export `DISK/VM` to an
//! agent's certificate only when the VM is granted to that host and DISK
//! is one of the VM's disks (`PUT /access/{vm}` on the node): grants are
//! per (disk, VM, host). The control service keeps them true, so one host
//! can neither read another VM's disk nor open any disk under the name of
//! one of its own VMs. A VM's disks are those its spec uses (plugged, or
//! drives on Ferry exports) as the hosts list it. Grants are made:
//! - at `vm create`: the VM's host, before the agent starts QEMU;
//! - at a move's start: source and target, before the target's skeleton
//!   opens its disks; the target stays granted while the move runs;
//! - every heartbeat: each VM to the hosts that list it (running, or a
//!   skeleton), plus moves still running; a host that does not answer keeps
//!   what it had, so a host that is merely slow to answer loses nothing.
//!   A VM no host lists any more is forgotten. A grant made after the
//!   heartbeat asked the hosts stands until a later heartbeat: the answers
//!   cannot list a VM whose QEMU was not started when they were given.
//!
//! Grants are pushed only when they change (and all at once after a start
//! of the control service); the nodes keep them on disk.

use std::collections::{BTreeMap, BTreeSet};

use ferry_api::storage::{AccessInfo, AccessRequest};
use ferry_api::{ApiError, HostEntry};

use crate::{lock, Control, AGENT_TIMEOUT};

/// A VM's grant: the hosts that may open its exports, of these disks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grant {
    pub hosts: BTreeSet<String>,
    pub disks: BTreeSet<String>,
}

impl Grant {
    pub fn new(hosts: BTreeSet<String>, disks: BTreeSet<String>) -> Grant {
        Grant { hosts, disks }
    }

    fn merge(&mut self, other: &Grant) {
        self.hosts.extend(other.hosts.iter().cloned());
        self.disks.extend(other.disks.iter().cloned());
    }
}

/// VM → its grant.
pub type Grants = BTreeMap<String, Grant>;
/// Moves running now: VM → {source, target}.
pub type Moving = std::sync::Mutex<Grants>;

#[derive(Default)]
pub struct Access {
    /// What every node was last told (as far as this control instance knows).
    pushed: std::sync::Mutex<Grants>,
    /// When each VM's grant was last pushed by [`Control::grant`].
    granted_at: std::sync::Mutex<BTreeMap<String, std::time::Instant>>,
    moving: std::sync::Arc<Moving>,
    /// Held by a heartbeat's sync from its first look at what was pushed
    /// to its last push, and by every grant: a grant made while a heartbeat
    /// works out what to take away (from hosts asked before the grant) must
    /// not be taken away by that heartbeat's push landing after it.
    sync: tokio::sync::Mutex<()>,
}

/// The grants the hosts' answers call for: each VM to every reachable host
/// that lists it; what an unreachable host had, it keeps.
pub fn desired(hosts: &[HostEntry], before: &Grants, moving: &Grants) -> Grants {
    let reachable: BTreeSet<&str> = hosts
        .iter()
        .filter(|h| h.reachable)
        .map(|h| h.name.as_str())
        .collect();
    let mut out = Grants::new();
    for h in hosts.iter().filter(|h| h.reachable) {
        for vm in h.info.iter().flat_map(|i| &i.vms) {
            let g = out.entry(vm.name.clone()).or_default();
            g.hosts.insert(h.name.clone());
            g.disks.extend(vm.spec.ferry_disks());
        }
    }
    for (vm, had) in before {
        for host in had.hosts.iter().filter(|h| !reachable.contains(h.as_str())) {
            let g = out.entry(vm.clone()).or_default();
            g.hosts.insert(host.clone());
            g.disks.extend(had.disks.iter().cloned());
        }
    }
    for (vm, g) in moving {
        out.entry(vm.clone()).or_default().merge(g);
    }
    out
}

/// Grants no heartbeat may take away: moves running, and grants pushed
/// (`recent`, already limited to those made since the hosts were asked).
fn standing(
    moving: &Grants,
    before: &Grants,
    recent: &BTreeMap<String, std::time::Instant>,
) -> Grants {
    let mut out = moving.clone();
    for vm in recent.keys() {
        if let Some(g) = before.get(vm) {
            out.entry(vm.clone()).or_default().merge(g);
        }
    }
    out
}

impl Control {
    /// Tells every storage node which hosts may open `vm`'s exports of
    /// which disks; an unreachable node fails it (a VM must not start
    /// without its disks).
    pub(crate) async fn grant(&self, vm: &str, grant: Grant) -> Result<(), ApiError> {
        let _sync = self.access.sync.lock().await;
        self.push_grant(vm, grant).await
    }

    /// [`Self::grant`] with the sync lock held by the caller.
    async fn push_grant(&self, vm: &str, grant: Grant) -> Result<(), ApiError> {
        let req = AccessRequest {
            hosts: grant.hosts.iter().cloned().collect(),
            disks: grant.disks.iter().cloned().collect(),
        };
        for (name, c) in &self.storage {
            c.put::<_, AccessInfo>(&format!("/access/{vm}"), &req, AGENT_TIMEOUT)
                .await
                .map_err(|e| {
                    ApiError::unavailable(format!("storage node {name} (granting {vm}'s disks)"), e)
                })?;
        }
        let mut pushed = lock(&self.access.pushed);
        if grant.hosts.is_empty() {
            pushed.remove(vm);
        } else {
            pushed.insert(vm.into(), grant);
        }
        lock(&self.access.granted_at).insert(vm.into(), std::time::Instant::now());
        Ok(())
    }

    /// Before a move: source and target may open the VM's disks (those of
    /// `spec`) until the move ends ([`Self::moved`]).
    pub(crate) async fn granting_move(
        &self,
        spec: &ferry_api::VmSpec,
        source: &str,
        target: &str,
    ) -> Result<(), ApiError> {
        let vm = spec.name.as_str();
        let both = Grant::new(
            [source.to_string(), target.to_string()].into(),
            spec.ferry_disks(),
        );
        lock(&self.access.moving).insert(vm.into(), both.clone());
        let r = self.grant(vm, both).await;
        if r.is_err() {
            lock(&self.access.moving).remove(vm);
        }
        r
    }

    /// A move ended: the next heartbeat grants what the hosts then list.
    pub(crate) fn moved(&self, vm: &str) {
        lock(&self.access.moving).remove(vm);
    }

    /// For a move's event stream to say when it ends.
    pub(crate) fn access_handle(&self) -> std::sync::Weak<Moving> {
        std::sync::Arc::downgrade(&self.access.moving)
    }

    /// Takes what the storage nodes grant now as what was pushed (an
    /// instance taking the lead from another): the next sync changes only
    /// what the hosts' answers call for, and a host that does not answer
    /// keeps what it holds.
    pub(crate) async fn adopt_grants(&self) -> Result<(), ApiError> {
        let mut all = Grants::new();
        for (name, c) in &self.storage {
            let list: Vec<AccessInfo> = c.get("/access", AGENT_TIMEOUT).await.map_err(|e| {
                ApiError::unavailable(format!("storage node {name} (its grants)"), e)
            })?;
            for a in list {
                all.entry(a.vm).or_default().merge(&Grant::new(
                    a.hosts.into_iter().collect(),
                    a.disks.into_iter().collect(),
                ));
            }
        }
        *lock(&self.access.pushed) = all;
        Ok(())
    }

    /// One heartbeat's share: pushes the grants that changed. `asked` is
    /// when the hosts were asked for `hosts`; grants made since then stand.
    pub(crate) async fn sync_access(&self, hosts: &[HostEntry], asked: std::time::Instant) {
        if self.storage.is_empty() {
            return;
        }
        // no grant lands between what this works out and what it pushes
        let _sync = self.access.sync.lock().await;
        let before = lock(&self.access.pushed).clone();
        let keep = {
            let mut at = lock(&self.access.granted_at);
            at.retain(|_, t| *t >= asked);
            standing(&lock(&self.access.moving), &before, &at)
        };
        let want = self.without_revoked(desired(hosts, &before, &keep));
        let vms: BTreeSet<&String> = before.keys().chain(want.keys()).collect();
        for vm in vms {
            let w = want.get(vm).cloned().unwrap_or_default();
            if before.get(vm) != Some(&w) || (w.hosts.is_empty() && before.contains_key(vm)) {
                if let Err(e) = self.push_grant(vm, w).await {
                    tracing::warn!("NBD access of {vm}: {e}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(name: &str, reachable: bool, vms: &[&str]) -> HostEntry {
        let info: Option<ferry_api::HostInfo> = reachable.then(|| {
            serde_json::from_value(serde_json::json!({
                "name": name, "agent_url": "", "memory_total": 0, "memory_reserved": 0,
                "memory_free": 0, "nics": [], "probe_port": 0,
                "vms": vms.iter().map(|v| serde_json::json!({
                    "name": v, "host": name, "state": "running", "pid": 1,
                    "spec": {"name": v, "memory": 134217728u64, "fill": 0, "dirty_rate": 0,
                             "disks": [{"disk": format!("d{v}"), "uri": format!("nbd://s:1/d{v}/{v}")}]}
                })).collect::<Vec<_>>(),
            }))
            .unwrap()
        });
        HostEntry {
            name: name.into(),
            agent_url: String::new(),
            reachable,
            down: !reachable,
            last_heartbeat_ms: None,
            draining: false,
            settings: None,
            error: None,
            info,
            health: Default::default(),
        }
    }

    fn set(h: &[&str]) -> BTreeSet<String> {
        h.iter().map(|s| s.to_string()).collect()
    }

    /// VM `vm` on hosts `h`, its one disk `d{vm}`.
    fn g(vm: &str, h: &[&str]) -> (String, Grant) {
        (
            vm.to_string(),
            Grant::new(set(h), set(&[&format!("d{vm}")])),
        )
    }

    #[test]
    fn grants_follow_the_hosts_and_an_unreachable_host_keeps_its_own() {
        let before: Grants = [g("a", &["h1"]), g("b", &["h2"])].into();
        let moving: Grants = [g("c", &["h1", "h3"])].into();
        let hosts = [
            host("h1", true, &["a", "c"]),
            host("h2", false, &[]),
            host("h3", true, &[]),
        ];
        let d = desired(&hosts, &before, &moving);
        // each VM its own disks only
        assert_eq!(d["a"], g("a", &["h1"]).1);
        // h2 does not answer: b stays granted to it
        assert_eq!(d["b"], g("b", &["h2"]).1);
        // a move running: its target is granted before its skeleton shows
        assert_eq!(d["c"], g("c", &["h1", "h3"]).1);
        // a VM gone from a host that answers is no longer granted there
        let hosts = [
            host("h1", true, &[]),
            host("h2", true, &["b"]),
            host("h3", true, &[]),
        ];
        let d = desired(&hosts, &before, &Grants::new());
        assert!(!d.contains_key("a"));
        assert_eq!(d["b"], g("b", &["h2"]).1);
    }

    #[test]
    fn a_grant_newer_than_the_hosts_answers_stands() {
        // `vm create` granted d to h1 while the heartbeat's answers (which
        // cannot list d yet) were on their way
        let before: Grants = [g("a", &["h1"]), g("d", &["h1"])].into();
        let hosts = [host("h1", true, &["a"])];
        let recent = [("d".to_string(), std::time::Instant::now())].into();
        let keep = standing(&Grants::new(), &before, &recent);
        let d = desired(&hosts, &before, &keep);
        assert_eq!(d["d"], g("d", &["h1"]).1);
        // the next heartbeat (asked after the grant) does not list d: revoked
        let keep = standing(&Grants::new(), &before, &BTreeMap::new());
        assert!(!desired(&hosts, &before, &keep).contains_key("d"));
    }
}
