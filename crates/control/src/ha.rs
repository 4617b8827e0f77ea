//! VM lifecycle and high availability (see `ferry_api::ha`).
//!
//! The control service keeps every VM's definition and desired state
//! ([`VmRecord`], key `vms` in the store), so a stopped VM keeps its
//! definition, disks and placement, and a failed host's VMs can be booted
//! elsewhere from what was kept.
//!
//! The HA manager runs every second, on its own task (a heartbeat waiting
//! on a dead host must not delay anyone's lease):
//! 1. **Leases**: `PUT /lease` on every agent, naming the HA VMs it runs
//!    and its peers' probe addresses on the migration fabrics.
//! 2. **Suspect**: a host not renewed for [`SUSPECT_MS`]. Nothing is
//!    decided while fewer than half the hosts renew (this service may be
//!    the one cut off), nor before this service has run [`RESTART_AFTER_MS`].
//! 3. **Confirm**, once [`RESTART_AFTER_MS`] passed since its last renewal
//!    (its agent has stopped its HA guests by then, if it lives): a peer
//!    probes its agent over the fabrics (`POST /peers/alive`).
//!    - `fenced`: its agent says it stopped its HA guests: **failed**;
//!    - its kernel answers, its agent does not: **unmanaged** (its guests
//!      may run: nothing is restarted, an event says why);
//!    - silence on every fabric: the storage nodes are asked for its NBD
//!      flows; I/O in the last second means **unmanaged**, none **failed**.
//! 4. **Fence and restart** a failed host: every HA VM's grant is revoked
//!    from it (the storage nodes raise the grant's generation and refuse
//!    its connections' next request), then the VMs boot on surviving hosts
//!    by priority, [`RESTARTS_AT_ONCE`] at a time. Its other VMs are shown
//!    stopped. VMs with drives Ferry cannot fence (`path`, `local`) are not
//!    restarted: an event names them.
//! 5. **Rejoin**: a failed host that renews again is healthy; a VM it still
//!    lists that runs elsewhere now is stopped there (it could not write:
//!    its grant stays revoked until it is gone).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_api::ha::{
    Action, ActionRequest, Desired, HaPolicy, HaUpdate, Health, LeaseRenewal, LeaseState, Liveness,
    PeerAddresses, Restarting, VmRecord, LEASE_TTL_MS, RESTART_AFTER_MS, SELF_FENCE_MS, SUSPECT_MS,
};
use ferry_api::{ApiError, HostEntry, VmInfo, VmSpec};

use crate::{access, lock, Control};

/// The store's key for every VM's record.
pub const RECORDS_KEY: &str = "vms";
/// The store key of the (VM, host) pairs a failover revoked.
pub const REVOKED_KEY: &str = "ha_revoked";
/// Store key of each host's probe addresses: a leader that never saw a
/// host answer (it started after the host failed) probes it there.
pub const PROBE_ADDRS_KEY: &str = "ha_probe_addrs";
/// HA restarts run at once, so storage is not stormed.
pub const RESTARTS_AT_ONCE: usize = 2;
const LEASE_CALL: Duration = Duration::from_millis(900);

#[derive(Default)]
pub struct Ha {
    /// Serializes changes to the records.
    records: tokio::sync::Mutex<()>,
    /// When each agent last took a renewal.
    renewed: std::sync::Mutex<BTreeMap<String, Instant>>,
    pub(crate) health: std::sync::Mutex<BTreeMap<String, Health>>,
    /// (VM, host) pairs a failover revoked: never granted again while the
    /// host still lists the VM.
    pub(crate) revoked: std::sync::Mutex<BTreeSet<(String, String)>>,
    started: std::sync::OnceLock<Instant>,
    /// The hosts as the last heartbeat found them.
    last_hosts: std::sync::Mutex<Vec<HostEntry>>,
    /// Each host's probe addresses on its fabrics (`IP:PORT`), as it last
    /// answered: a host that stopped answering is probed where it was.
    probe_addrs: std::sync::Mutex<BTreeMap<String, Vec<String>>>,
    /// `probe_addrs` as last written to the store.
    saved_addrs: std::sync::Mutex<BTreeMap<String, Vec<String>>>,
    /// Failovers under way.
    failing: std::sync::Mutex<BTreeSet<String>>,
    /// Events said once per state (unmanaged hosts, held restarts).
    said: std::sync::Mutex<BTreeSet<String>>,
}

/// A VM whose drives Ferry cannot fence (a shared path, a local file).
pub fn unfenceable(spec: &VmSpec) -> bool {
    spec.drives
        .iter()
        .any(|d| d.path.is_some() || (d.local.is_some() && !spec.is_workload()))
}

/// A restart placed during a failover: (VM, host, memory).
type Planned = (String, String, u64);

/// Where to boot `spec` among `hosts` (healthy, not draining, reachable),
/// most free memory first, counting what was already placed (`planned`).
pub fn candidates(
    hosts: &[HostEntry],
    spec: &VmSpec,
    exclude: &str,
    planned: &BTreeMap<String, u64>,
) -> Vec<String> {
    let mut c: Vec<(u64, String)> = hosts
        .iter()
        .filter(|h| h.name != exclude && h.reachable && !h.draining && h.health == Health::Ok)
        .filter_map(|h| {
            let free = h.info.as_ref()?.memory_free;
            let free = free.saturating_sub(planned.get(&h.name).copied().unwrap_or(0));
            (free >= spec.memory).then(|| (free, h.name.clone()))
        })
        .collect();
    c.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    c.into_iter().map(|(_, n)| n).collect()
}

/// Whether enough hosts renew for this service to judge others: at least
/// one, and at least half of all.
pub fn quorum(fresh: usize, total: usize) -> bool {
    fresh >= 1 && fresh * 2 >= total
}

/// What the second signal says of a host whose lease lapsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Confirmed: its HA VMs may be fenced and restarted. `alive`: its
    /// agent answered (an isolated host): its other VMs run on there.
    Failed {
        why: String,
        alive: bool,
    },
    Unmanaged(String),
    Wait(String),
}

/// Judges a lapsed host from its peers' probes and its NBD flows' I/O.
pub fn judge(probes: &[Liveness], storage_io: Option<f64>) -> Verdict {
    if let Some(Liveness::Answered { state, address }) = probes
        .iter()
        .find(|l| matches!(l, Liveness::Answered { .. }))
    {
        return if state == "fenced" {
            Verdict::Failed {
                why: format!("its agent says over {address} it stopped its HA guests"),
                alive: true,
            }
        } else {
            Verdict::Wait(format!("its agent answers over {address}, {state}"))
        };
    }
    if let Some(Liveness::AgentDown { address }) = probes
        .iter()
        .find(|l| matches!(l, Liveness::AgentDown { .. }))
    {
        return Verdict::Unmanaged(format!(
            "its kernel answers over {address} and its agent does not: its guests may run"
        ));
    }
    if probes.is_empty() {
        return Verdict::Wait("no peer could probe it".into());
    }
    match storage_io {
        None => Verdict::Wait("a storage node does not answer".into()),
        Some(iops) if iops > 0.0 => Verdict::Unmanaged(format!(
            "silent on every fabric, yet its NBD flows do {iops:.0} IOPS"
        )),
        Some(_) => Verdict::Failed {
            why: "silent on every fabric and on its storage".into(),
            alive: false,
        },
    }
}

impl Control {
    pub(crate) async fn records(&self) -> Result<BTreeMap<String, VmRecord>, ApiError> {
        Ok(self.store.cluster(RECORDS_KEY).await?.unwrap_or_default())
    }

    /// Changes the records under one lock (read, change, write).
    pub(crate) async fn change_records<T>(
        &self,
        f: impl FnOnce(&mut BTreeMap<String, VmRecord>) -> Result<T, ApiError>,
    ) -> Result<T, ApiError> {
        let _g = self.ha.records.lock().await;
        let mut r = self.records().await?;
        let before = r.clone();
        let out = f(&mut r)?;
        if r != before {
            self.store.put_cluster(RECORDS_KEY, &r).await?;
        }
        Ok(out)
    }

    /// [`Control::change_records`] with an event written in the same store
    /// write (`kind`, `subject`, `detail`): both or neither.
    /// Nothing is written where `f` says there is nothing to record.
    async fn change_records_logged(
        &self,
        f: impl FnOnce(&mut BTreeMap<String, VmRecord>) -> bool,
        event: (&str, &str, serde_json::Value),
    ) -> Result<(), ApiError> {
        let _g = self.ha.records.lock().await;
        let mut r = self.records().await?;
        if !f(&mut r) {
            return Ok(());
        }
        self.store.put_cluster_logged(RECORDS_KEY, &r, event).await
    }

    pub(crate) fn health_of(&self, host: &str) -> Health {
        lock(&self.ha.health).get(host).copied().unwrap_or_default()
    }

    /// Every VM: those the hosts list, with what the records say of them,
    /// and those no host runs (stopped, or on a host that does not answer).
    pub(crate) async fn list_all_vms(&self) -> Result<Vec<VmInfo>, ApiError> {
        let mut out = self.list_vms().await?;
        let records = self.records().await?;
        let listed: BTreeSet<String> = out.iter().map(|v| v.name.clone()).collect();
        let hosts = lock(&self.ha.last_hosts).clone();
        for v in &mut out {
            if let Some(r) = records.get(&v.name) {
                v.desired = Some(r.desired);
                v.ha = Some(r.ha.clone());
            }
        }
        for (name, r) in &records {
            if listed.contains(name) {
                continue;
            }
            let answers = hosts.iter().any(|h| h.name == r.host && h.reachable);
            let state = if answers
                || r.desired == Desired::Stopped
                || r.stopped_because.is_some()
                || self.health_of(&r.host) == Health::Failed
            {
                "stopped"
            } else {
                "unknown"
            };
            out.push(VmInfo {
                name: name.clone(),
                host: r.host.clone(),
                spec: r.spec.redacted(),
                state: state.into(),
                pid: None,
                in_doubt: None,
                problem: None,
                accel: String::new(),
                storage_pause: None,
                migrating: false,
                confinement: None,
                moves_encrypted: None,
                desired: Some(r.desired),
                ha: Some(r.ha.clone()),
                stopped_because: r.stopped_because.clone(),
                usage: None,
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// A VM just made: its record.
    pub(crate) async fn record_created(
        &self,
        spec: &VmSpec,
        host: &str,
        ha: Option<HaPolicy>,
    ) -> Result<(), ApiError> {
        let ha = ha.unwrap_or_default();
        self.change_records(|r| {
            r.insert(
                spec.name.clone(),
                VmRecord {
                    spec: spec.clone(),
                    host: host.into(),
                    desired: Desired::Running,
                    ha,
                    restarts: Vec::new(),
                    stopped_because: None,
                    restarting: None,
                },
            );
            Ok(())
        })
        .await
    }

    /// One heartbeat's share: records follow where the hosts run VMs;
    /// a VM no record knows (made before records were kept) gets one.
    /// What every instance keeps of a heartbeat: the hosts, and where each
    /// can be probed (the leases every instance renews name them).
    pub(crate) fn note_hosts(&self, hosts: &[HostEntry]) {
        *lock(&self.ha.last_hosts) = hosts.to_vec();
        self.note_usage(hosts);
        {
            let mut addrs = lock(&self.ha.probe_addrs);
            for h in hosts {
                if let Some(i) = &h.info {
                    let a: Vec<String> = i
                        .nics
                        .iter()
                        .map(|n| format!("{}:{}", n.address, i.probe_port))
                        .collect();
                    addrs.insert(h.name.clone(), a);
                }
            }
        }
    }

    /// The leader's share of a heartbeat: records follow the hosts'
    /// listings, settled revocations go, stale copies are stopped.
    pub(crate) async fn sync_records(&self, hosts: &[HostEntry]) {
        let mut stale = Vec::new();
        let mut found = Vec::new();
        let r = self
            .change_records(|r| {
                for h in hosts.iter().filter(|h| h.reachable) {
                    for v in h.info.iter().flat_map(|i| &i.vms) {
                        if v.state == "incoming" || v.state == "starting" {
                            continue;
                        }
                        if lock(&self.ha.revoked).contains(&(v.name.clone(), h.name.clone())) {
                            stale.push((v.name.clone(), h.name.clone()));
                            continue;
                        }
                        let e = r.entry(v.name.clone()).or_insert_with(|| VmRecord {
                            spec: v.spec.clone(),
                            host: h.name.clone(),
                            desired: Desired::Running,
                            ha: HaPolicy::default(),
                            restarts: Vec::new(),
                            stopped_because: None,
                            restarting: None,
                        });
                        let begun_here = e
                            .restarting
                            .as_ref()
                            .filter(|x| x.to == h.name && e.host != h.name)
                            .map(|x| x.from.clone());
                        if let Some(from) = begun_here {
                            // this instance's own failover records it; one
                            // by a leader that died before it recorded the
                            // restart is completed below
                            if !lock(&self.ha.failing).contains(&from) {
                                found.push((v.name.clone(), e.clone(), from, h.name.clone()));
                            }
                            continue;
                        }
                        if v.state == "running" || v.state == "paused" {
                            e.host = h.name.clone();
                            e.stopped_because = None;
                            // disks plugged since it was made go with it
                            e.spec.disks = v.spec.disks.clone();
                        }
                    }
                }
                Ok(())
            })
            .await;
        if let Err(e) = r {
            tracing::warn!("VM records: {e}");
        }
        for (name, rec, from, to) in found {
            if let Err(e) = self.restarted(&name, &rec, &from, &to, None, true).await {
                tracing::warn!(vm = name, "VM record: {e}");
            }
        }
        // a pair revoked whose host lists the VM no more is settled
        {
            let listed: BTreeSet<(String, String)> = hosts
                .iter()
                .filter(|h| h.reachable)
                .flat_map(|h| {
                    h.info
                        .iter()
                        .flat_map(|i| &i.vms)
                        .map(|v| (v.name.clone(), h.name.clone()))
                })
                .collect();
            let answered: BTreeSet<&str> = hosts
                .iter()
                .filter(|h| h.reachable)
                .map(|h| h.name.as_str())
                .collect();
            let settled = {
                let mut r = lock(&self.ha.revoked);
                let n = r.len();
                r.retain(|p| !answered.contains(p.1.as_str()) || listed.contains(p));
                r.len() != n
            };
            if settled {
                if let Err(e) = self.save_revoked().await {
                    tracing::warn!("revoked grants: {e}");
                }
            }
        }
        for (vm, host) in stale {
            let Ok(c) = self.host(&host) else { continue };
            let path = format!("/vms/{vm}/action/stop");
            match c
                .post::<_, ferry_api::ha::Stopped>(
                    &path,
                    &ActionRequest::default(),
                    LEASE_CALL * 10,
                )
                .await
            {
                Ok(_) => {
                    tracing::warn!(vm, host, "a copy left on a failed host stopped");
                    self.log(
                        "stale_copy_stopped",
                        &vm,
                        serde_json::json!({ "host": host, "reason": "it runs elsewhere since a failover" }),
                    );
                }
                Err(e) => tracing::warn!(vm, host, "cannot stop a stale copy: {e}"),
            }
        }
    }

    /// (VM, host) pairs out of every grant from now on, kept in the store
    /// (key `ha_revoked`) so the next leader keeps them out too.
    async fn revoke(
        &self,
        pairs: impl IntoIterator<Item = (String, String)>,
    ) -> Result<(), ApiError> {
        lock(&self.ha.revoked).extend(pairs);
        self.save_revoked().await
    }

    async fn save_revoked(&self) -> Result<(), ApiError> {
        let all: Vec<(String, String)> = lock(&self.ha.revoked).iter().cloned().collect();
        self.store.put_cluster(REVOKED_KEY, &all).await
    }

    /// Writes the hosts' probe addresses to the store when they changed
    /// (the leader, each heartbeat).
    pub(crate) async fn save_probe_addrs(&self) {
        let now = lock(&self.ha.probe_addrs).clone();
        if *lock(&self.ha.saved_addrs) == now {
            return;
        }
        match self.store.put_cluster(PROBE_ADDRS_KEY, &now).await {
            Ok(()) => *lock(&self.ha.saved_addrs) = now,
            Err(e) => tracing::warn!("probe addresses: {e}"),
        }
    }

    /// Takes up the probe addresses of hosts this instance never saw
    /// answer (an instance taking the lead).
    pub(crate) async fn load_probe_addrs(&self) {
        match self
            .store
            .cluster::<BTreeMap<String, Vec<String>>>(PROBE_ADDRS_KEY)
            .await
        {
            Ok(Some(saved)) => {
                let mut a = lock(&self.ha.probe_addrs);
                for (host, addrs) in saved {
                    a.entry(host).or_insert(addrs);
                }
            }
            Ok(None) => {}
            Err(e) => tracing::warn!("probe addresses: {e}"),
        }
    }

    /// Takes up the pairs revoked (an instance taking the lead).
    pub(crate) async fn load_revoked(&self) {
        match self
            .store
            .cluster::<Vec<(String, String)>>(REVOKED_KEY)
            .await
        {
            Ok(v) => *lock(&self.ha.revoked) = v.unwrap_or_default().into_iter().collect(),
            Err(e) => tracing::warn!("revoked grants: {e}"),
        }
    }

    /// The grant a heartbeat would give, less the pairs a failover revoked.
    pub(crate) fn without_revoked(&self, mut g: access::Grants) -> access::Grants {
        let revoked = lock(&self.ha.revoked).clone();
        for (vm, host) in revoked {
            if let Some(x) = g.get_mut(&vm) {
                x.hosts.remove(&host);
            }
        }
        g
    }

    /// The HA manager: renews leases and judges lapses, once a second, until the process ends.
    pub async fn run_ha(self: Arc<Self>) {
        let _ = self.ha.started.set(Instant::now());
        let mut t = tokio::time::interval(Duration::from_millis(ferry_api::ha::LEASE_RENEW_MS));
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            t.tick().await;
            self.renew_leases().await;
            if self.leading() {
                self.judge_lapses().await;
            }
        }
    }

    async fn renew_leases(&self) {
        let records = self.records().await.unwrap_or_default();
        let addrs = lock(&self.ha.probe_addrs).clone();
        let calls = self.hosts.iter().map(|(name, c)| {
            let ha_vms: Vec<String> = records
                .iter()
                .filter(|(_, r)| r.host == *name && r.ha.enabled)
                .map(|(n, _)| n.clone())
                .collect();
            let peers: Vec<PeerAddresses> = addrs
                .iter()
                .filter(|(h, a)| *h != name && !a.is_empty())
                .map(|(h, a)| PeerAddresses {
                    host: h.clone(),
                    addresses: a.clone(),
                })
                .collect();
            let req = LeaseRenewal {
                ttl_ms: LEASE_TTL_MS,
                self_fence_ms: SELF_FENCE_MS,
                ha_vms,
                peers,
            };
            async move {
                let r = c.put::<_, LeaseState>("/lease", &req, LEASE_CALL).await;
                (name.clone(), r.is_ok())
            }
        });
        let done = futures::future::join_all(calls).await;
        let now = Instant::now();
        let mut renewed = lock(&self.ha.renewed);
        for (name, ok) in done {
            if ok {
                renewed.insert(name, now);
            }
        }
    }

    /// Milliseconds since `host`'s lease was renewed (counted from this
    /// service's start when it never was here).
    fn lapse_ms(&self, host: &str) -> u64 {
        let started = *self.ha.started.get_or_init(Instant::now);
        let at = lock(&self.ha.renewed)
            .get(host)
            .copied()
            .unwrap_or(started)
            .max(started);
        at.elapsed().as_millis() as u64
    }

    async fn judge_lapses(self: &Arc<Self>) {
        let names: Vec<String> = self.hosts.keys().cloned().collect();
        let lapses: Vec<(String, u64)> = names
            .iter()
            .map(|h| (h.clone(), self.lapse_ms(h)))
            .collect();
        let fresh = lapses.iter().filter(|(_, l)| *l < SUSPECT_MS).count();
        for (host, lapse) in &lapses {
            let was = self.health_of(host);
            if *lapse < SUSPECT_MS {
                if was != Health::Ok && !lock(&self.ha.failing).contains(host) {
                    lock(&self.ha.health).insert(host.clone(), Health::Ok);
                    lock(&self.ha.said).retain(|k| !k.starts_with(&format!("{host}:")));
                    tracing::info!(host, "its lease is renewed again");
                    self.log(
                        if was == Health::Failed {
                            "host_rejoined"
                        } else {
                            "host_ok"
                        },
                        host,
                        serde_json::json!({ "was": was }),
                    );
                }
                continue;
            }
            if was == Health::Failed || lock(&self.ha.failing).contains(host) {
                continue;
            }
            if was == Health::Ok {
                lock(&self.ha.health).insert(host.clone(), Health::Suspect);
                tracing::warn!(host, lapse_ms = lapse, "lease lapsed: suspect");
                self.log(
                    "host_suspect",
                    host,
                    serde_json::json!({ "lease_lapsed_ms": lapse }),
                );
            }
            if !quorum(fresh, names.len()) {
                self.say_once(
                    host,
                    "no_quorum",
                    serde_json::json!({ "renewing": fresh, "hosts": names.len(),
                        "reason": "fewer than half the hosts renew their leases: this service may be the one cut off, nothing is restarted" }),
                );
                continue;
            }
            if *lapse < RESTART_AFTER_MS {
                continue;
            }
            let verdict = self.second_signal(host, &lapses).await;
            match verdict {
                Verdict::Failed { why, alive } => {
                    lock(&self.ha.failing).insert(host.clone());
                    lock(&self.ha.health).insert(host.clone(), Health::Failed);
                    tracing::warn!(host, %why, "host failed: fencing and restarting its HA VMs");
                    self.log(
                        "host_failed",
                        host,
                        serde_json::json!({ "lease_lapsed_ms": lapse, "evidence": why }),
                    );
                    let me = self.clone();
                    let (h, lapse) = (host.clone(), *lapse);
                    tokio::spawn(async move {
                        let r = me.fail_over(&h, lapse, alive).await;
                        if let Err(e) = &r {
                            tracing::warn!(host = %h, "failover: {e}; tried again next round");
                            me.log(
                                "failover_error",
                                &h,
                                serde_json::json!({ "error": e.to_string() }),
                            );
                            lock(&me.ha.health).insert(h.clone(), Health::Suspect);
                        }
                        lock(&me.ha.failing).remove(&h);
                    });
                }
                Verdict::Unmanaged(why) => {
                    lock(&self.ha.health).insert(host.clone(), Health::Unmanaged);
                    self.say_once(host, "unmanaged", serde_json::json!({ "reason": why }));
                }
                Verdict::Wait(why) => {
                    tracing::info!(host, %why, "lapsed host not confirmed yet");
                }
            }
        }
    }

    fn say_once(&self, host: &str, kind: &str, detail: serde_json::Value) {
        if lock(&self.ha.said).insert(format!("{host}:{kind}")) {
            tracing::warn!(host, kind, %detail, "HA");
            self.log(&format!("host_{kind}"), host, detail);
        }
    }

    /// Peers probe `host` over the fabrics; the storage nodes say whether
    /// its NBD flows still do I/O.
    async fn second_signal(&self, host: &str, lapses: &[(String, u64)]) -> Verdict {
        let Some(addresses) = lock(&self.ha.probe_addrs).get(host).cloned() else {
            return Verdict::Wait("never seen: its fabric addresses are unknown".into());
        };
        let req = PeerAddresses {
            host: host.into(),
            addresses,
        };
        let probers: Vec<&String> = lapses
            .iter()
            .filter(|(h, l)| h != host && *l < SUSPECT_MS)
            .map(|(h, _)| h)
            .take(2)
            .collect();
        let calls = probers.iter().filter_map(|p| {
            let c = self.host(p).ok()?;
            let req = req.clone();
            Some(async move {
                c.post::<_, Liveness>("/peers/alive", &req, Duration::from_secs(3))
                    .await
                    .ok()
            })
        });
        let probes: Vec<Liveness> = futures::future::join_all(calls)
            .await
            .into_iter()
            .flatten()
            .collect();
        let needs_storage = !probes.iter().any(|l| !matches!(l, Liveness::Silent));
        let io = if needs_storage && !probes.is_empty() {
            self.host_storage_io(host).await
        } else {
            Some(0.0)
        };
        judge(&probes, io)
    }

    /// IOPS of `host`'s NBD flows on every storage node (None: a node did
    /// not answer).
    async fn host_storage_io(&self, host: &str) -> Option<f64> {
        let mut iops = 0.0;
        for r in self
            .ask_every_node::<ferry_api::storage::FlowInfo>("/qos/flows", Duration::from_secs(2))
            .await
        {
            for f in r.ok()? {
                if f.host == host && f.connections > 0 {
                    iops += f.iops;
                }
            }
        }
        Some(iops)
    }

    /// Fences `host` from its HA VMs' disks and boots them elsewhere.
    async fn fail_over(&self, host: &str, lapse_ms: u64, alive: bool) -> Result<(), ApiError> {
        let t0 = Instant::now();
        let now = ferry_api::util::now_ms();
        let records = self.records().await?;
        // a VM a reachable host runs already (booted by a leader that died
        // before it wrote the record) is not booted again
        let elsewhere: BTreeMap<String, String> = self
            .list_vms()
            .await?
            .into_iter()
            .filter(|v| v.host != host)
            .map(|v| (v.name, v.host))
            .collect();
        let mut restart: Vec<(String, VmRecord)> = Vec::new();
        let mut stopped: Vec<(String, String)> = Vec::new();
        // HA VMs whose drives only a power-off fences
        let mut power_off: Vec<(String, VmRecord)> = Vec::new();
        for (name, r) in records.iter().filter(|(_, r)| r.host == host) {
            if r.desired != Desired::Running || r.stopped_because.is_some() {
                continue;
            }
            if let Some(on) = elsewhere.get(name) {
                // booted by a leader that died before it wrote so
                let since = lapse_ms + t0.elapsed().as_millis() as u64;
                self.restarted(name, r, host, on, Some(since), true).await?;
                continue;
            }
            let why = if !r.ha.enabled && alive {
                // an isolated host runs its other VMs on
                continue;
            } else if !r.ha.enabled {
                format!("host {host} failed (HA off)")
            } else if !r.ha.may_restart(&r.restarts, now) {
                format!(
                    "host {host} failed; restart limit reached ({} in {} s)",
                    r.ha.restart_limit, r.ha.restart_window_s
                )
            } else if unfenceable(&r.spec) {
                power_off.push((name.clone(), r.clone()));
                continue;
            } else {
                restart.push((name.clone(), r.clone()));
                continue;
            };
            stopped.push((name.clone(), why));
        }
        if !power_off.is_empty() {
            match self.power_off(host).await {
                Ok(()) => restart.append(&mut power_off),
                Err(why) => stopped.extend(power_off.into_iter().map(|(name, _)| {
                    let how = format!(
                        "host {host} failed; its drives cannot be fenced by Ferry ({why}): once {host} is known \
                         to be off, `ferry vm start {name} --host HOST --confirm-powered-off` (admin)"
                    );
                    (name, how)
                })),
            }
        }
        for (name, why) in &stopped {
            self.log(
                "vm_stopped",
                name,
                serde_json::json!({ "host": host, "reason": why }),
            );
        }
        let marks = stopped.clone();
        let h = host.to_string();
        self.change_records(move |r| {
            for (name, why) in marks {
                if let Some(x) = r.get_mut(&name).filter(|x| x.host == h) {
                    x.stopped_because = Some(why);
                }
            }
            Ok(())
        })
        .await?;
        // fence: no grant of these VMs to the failed host, on every node
        // (all at once: nothing restarts until every one is done)
        self.revoke(
            restart
                .iter()
                .map(|(name, _)| (name.clone(), host.to_string())),
        )
        .await?;
        let fences = restart.iter().map(|(name, r)| async move {
            let disks = r.spec.ferry_disks();
            if !disks.is_empty() {
                self.grant(name, access::Grant::new(BTreeSet::new(), disks.clone()))
                    .await?;
            }
            self.log(
                "vm_fenced",
                name,
                serde_json::json!({ "host": host, "disks": disks }),
            );
            Ok::<(), ApiError>(())
        });
        for r in futures::future::join_all(fences).await {
            r?;
        }
        restart.sort_by(|a, b| b.1.ha.priority.cmp(&a.1.ha.priority).then(a.0.cmp(&b.0)));
        let planned = std::sync::Mutex::new(Vec::<Planned>::new());
        // by priority, the next boot starting as soon as one of those
        // running ends (the semaphore is first come, first served)
        let slots = tokio::sync::Semaphore::new(RESTARTS_AT_ONCE);
        let runs = restart.iter().map(|(name, r)| {
            let slots = &slots;
            let planned = &planned;
            async move {
                let _slot = slots.acquire().await;
                self.restart_one(name, r, host, planned, lapse_ms, t0).await
            }
        });
        futures::future::join_all(runs).await;
        Ok(())
    }

    /// `name` runs on `to` since a failover of `from`: its record says so
    /// (a restart counted for its limit), and an `ha_restart` event, written
    /// with the record in one store write, or alone when the record cannot
    /// be written.
    async fn restarted(
        &self,
        name: &str,
        r: &VmRecord,
        from: &str,
        to: &str,
        since_last_renewal_ms: Option<u64>,
        found_running: bool,
    ) -> Result<(), ApiError> {
        let now = ferry_api::util::now_ms();
        let (n, t) = (name.to_string(), to.to_string());
        tracing::warn!(vm = name, from, to, found_running, "HA restart");
        let mut detail = serde_json::json!({ "from": from, "to": to, "priority": r.ha.priority });
        if let Some(ms) = since_last_renewal_ms {
            detail["since_last_renewal_ms"] = ms.into();
        }
        if found_running {
            // booted by an earlier leader that died before it wrote so
            detail["found_running"] = true.into();
        }
        // the record and its event in one write: a leader killed in
        // between would leave the VM's new host recorded and no event
        // (the next leader finds nothing left to fail over)
        let written = self
            .change_records_logged(
                move |recs| match recs.get_mut(&n) {
                    // recorded already (by this leader's heartbeat, which
                    // found it running there first): once is enough
                    Some(x) if x.host == t && x.restarting.is_none() => false,
                    Some(x) => {
                        x.host = t;
                        x.restarts.push(now);
                        x.stopped_because = None;
                        x.restarting = None;
                        true
                    }
                    None => true,
                },
                ("ha_restart", name, detail.clone()),
            )
            .await;
        if written.is_err() {
            // the event is told even when the record cannot be written
            self.log("ha_restart", name, detail);
        }
        written
    }

    /// Has the cluster's fence hook power `host` off; `Err` says why not.
    async fn power_off(&self, host: &str) -> Result<(), String> {
        let hook = self
            .cluster_settings()
            .await
            .map_err(|e| e.to_string())?
            .fence_hook
            .ok_or_else(|| "no fence hook is set".to_string())?;
        let t0 = Instant::now();
        match self.run_hook_for(&hook, host).await {
            Ok(()) => {
                tracing::warn!(host, hook, "the fence hook confirmed the host is off");
                self.log(
                    "host_powered_off",
                    host,
                    serde_json::json!({ "hook": hook, "took_ms": t0.elapsed().as_millis() as u64 }),
                );
                Ok(())
            }
            Err(why) => {
                let why = format!("the fence hook `{hook}` did not confirm it is off: {why}");
                self.log("fence_failed", host, serde_json::json!({ "reason": why }));
                Err(why)
            }
        }
    }

    async fn restart_one(
        &self,
        name: &str,
        r: &VmRecord,
        from: &str,
        planned: &std::sync::Mutex<Vec<Planned>>,
        lapse_ms: u64,
        t0: Instant,
    ) {
        let hosts = lock(&self.ha.last_hosts).clone();
        let config = match self.placement_config().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(
                    vm = name,
                    "placement rules: {e}; restarting by memory alone"
                );
                Default::default()
            }
        };
        let order = {
            let mut p = lock(planned);
            let memory: BTreeMap<String, u64> = p.iter().fold(BTreeMap::new(), |mut m, x| {
                *m.entry(x.1.clone()).or_default() += x.2;
                m
            });
            let fit = candidates(&hosts, &r.spec, from, &memory);
            // the placement engine orders them, keeping every strict rule,
            // counting the restarts placed before this one
            let mut c = self.cluster_of(&hosts, config);
            for h in &mut c.hosts {
                h.free = h
                    .free
                    .saturating_sub(memory.get(&h.name).copied().unwrap_or(0));
            }
            c.vms
                .retain(|v| v.name != name && !p.iter().any(|x| x.0 == v.name));
            for (vm, host, mem) in p.iter() {
                c.vms.push(crate::placement::Vm::placed(vm, host, *mem));
            }
            c.vms
                .push(crate::placement::Vm::placed(name, "", r.spec.memory));
            let ranked = crate::placement::ranked(&c, name, &|h| fit.iter().any(|f| f == h));
            if let Some(first) = ranked.as_ref().ok().and_then(|o| o.first()) {
                p.push((name.to_string(), first.clone(), r.spec.memory));
            }
            ranked
        };
        let order = match order {
            Ok(o) => o,
            Err(refusal) => {
                let why = format!("no surviving host keeps its rules and has room: {refusal}");
                self.restart_failed(name, from, why).await;
                return;
            }
        };
        let mut errors = Vec::new();
        for to in order {
            if !self.still_leading().await {
                tracing::warn!(vm = name, "no longer the leader: the next one restarts it");
                return;
            }
            // the restart written as begun first: a leader killed once the
            // VM boots leaves it for the next one to complete
            let (n, intent) = (
                name.to_string(),
                Restarting {
                    from: from.to_string(),
                    to: to.clone(),
                },
            );
            if let Err(e) = self
                .change_records(move |recs| {
                    if let Some(x) = recs.get_mut(&n) {
                        x.restarting = Some(intent);
                    }
                    Ok(())
                })
                .await
            {
                errors.push(format!("{to}: recording the restart: {e}"));
                continue;
            }
            match self.boot_on(&to, &r.spec).await {
                Ok(_) => {
                    let since = lapse_ms + t0.elapsed().as_millis() as u64;
                    if let Err(e) = self.restarted(name, r, from, &to, Some(since), false).await {
                        tracing::warn!(vm = name, "VM record: {e}");
                    }
                    return;
                }
                Err(e) => errors.push(format!("{to}: {e}")),
            }
        }
        let why = if errors.is_empty() {
            "no surviving host has room".to_string()
        } else {
            errors.join("; ")
        };
        self.restart_failed(name, from, why).await;
    }

    /// Records and logs a VM left stopped: no host could boot it.
    async fn restart_failed(&self, name: &str, from: &str, why: String) {
        self.log(
            "ha_restart_failed",
            name,
            serde_json::json!({ "from": from, "reason": why }),
        );
        let (n, w) = (name.to_string(), format!("HA restart failed: {why}"));
        let _ = self
            .change_records(move |recs| {
                if let Some(x) = recs.get_mut(&n) {
                    x.stopped_because = Some(w);
                }
                Ok(())
            })
            .await;
    }

    /// Boots `spec` on `host`: its disks granted to that host alone first.
    pub(crate) async fn boot_on(&self, host: &str, spec: &VmSpec) -> Result<VmInfo, ApiError> {
        let agent = self.host(host)?;
        self.check_grants(host, spec).await?;
        let disks = spec.ferry_disks();
        if !disks.is_empty() {
            self.grant(
                &spec.name,
                access::Grant::new([host.to_string()].into(), disks),
            )
            .await?;
        }
        agent.post("/vms", spec, Duration::from_secs(60)).await
    }

    /// `ferry vm start|stop|shutdown|reboot|restart`.
    pub(crate) async fn vm_action(
        &self,
        name: &str,
        action: Action,
        req: &ActionRequest,
    ) -> Result<serde_json::Value, ApiError> {
        let record = self
            .records()
            .await?
            .get(name)
            .cloned()
            .ok_or_else(|| ApiError::not_found("vm", name))?;
        let running = self.locate(name).await.ok();
        let set_desired = |d: Desired| {
            let n = name.to_string();
            self.change_records(move |r| {
                if let Some(x) = r.get_mut(&n) {
                    x.desired = d;
                    if d == Desired::Running {
                        x.stopped_because = None;
                    }
                }
                Ok(())
            })
        };
        let stop = |how: Action, host: String| {
            let path = format!("/vms/{name}/action/{}", how.as_str());
            let timeout = Duration::from_secs(
                req.timeout_s.unwrap_or(ferry_api::ha::DEFAULT_SHUTDOWN_S) + 15,
            );
            async move {
                self.host(&host)?
                    .post::<_, ferry_api::ha::Stopped>(&path, req, timeout)
                    .await
            }
        };
        let out = match action {
            Action::Stop | Action::Shutdown => {
                let Some((host, _)) = running else {
                    return Err(ApiError::Conflict {
                        reason: format!("vm {name} is not running"),
                    });
                };
                set_desired(Desired::Stopped).await?;
                serde_json::to_value(stop(action, host).await?).map_err(ApiError::internal)?
            }
            Action::Reboot => {
                let Some((host, _)) = running else {
                    return Err(ApiError::Conflict {
                        reason: format!("vm {name} is not running"),
                    });
                };
                serde_json::to_value(stop(action, host).await?).map_err(ApiError::internal)?
            }
            Action::Start => {
                if let Some((host, _)) = running {
                    return Err(ApiError::Conflict {
                        reason: format!("vm {name} already runs on {host}"),
                    });
                }
                let to = req.host.clone().unwrap_or_else(|| record.host.clone());
                if to != record.host && self.refuse_down(&record.host).await.is_err() {
                    // its host does not answer: it may still run the VM
                    if !req.confirm_powered_off {
                        return Err(ApiError::Conflict {
                            reason: format!(
                                "vm {name}'s host {} does not answer and may still run it; once it is known to be \
                                 powered off, an admin may start it elsewhere with --confirm-powered-off",
                                record.host
                            ),
                        });
                    }
                    // its grants leave the old host for good
                    self.revoke([(name.to_string(), record.host.clone())])
                        .await?;
                    self.log(
                        "vm_fenced",
                        name,
                        serde_json::json!({ "host": record.host, "by": "operator: powered off" }),
                    );
                }
                self.refuse_draining(&to)?;
                self.refuse_down(&to).await?;
                let info = self.boot_on(&to, &record.spec).await?;
                let (n, t) = (name.to_string(), to.clone());
                self.change_records(move |r| {
                    if let Some(x) = r.get_mut(&n) {
                        x.host = t;
                    }
                    Ok(())
                })
                .await?;
                set_desired(Desired::Running).await?;
                serde_json::to_value(info).map_err(ApiError::internal)?
            }
            Action::Restart => {
                let Some((host, _)) = running else {
                    return Err(ApiError::Conflict {
                        reason: format!("vm {name} is not running (ferry vm start {name})"),
                    });
                };
                let down = stop(Action::Shutdown, host.clone()).await?;
                let info = self.boot_on(&host, &record.spec).await?;
                set_desired(Desired::Running).await?;
                serde_json::json!({ "shutdown": down, "started": info })
            }
        };
        self.log(
            "vm_lifecycle",
            name,
            serde_json::json!({ "action": action.as_str(), "result": out }),
        );
        Ok(out)
    }

    /// `ferry vm set NAME --ha …`.
    pub(crate) async fn set_vm_ha(&self, name: &str, u: &HaUpdate) -> Result<HaPolicy, ApiError> {
        let n = name.to_string();
        let p = self
            .change_records(move |r| {
                let x = r.get_mut(&n).ok_or_else(|| ApiError::not_found("vm", &n))?;
                x.ha = u.apply(&x.ha)?;
                Ok(x.ha.clone())
            })
            .await?;
        self.log("vm_ha", name, serde_json::to_value(&p).unwrap_or_default());
        Ok(p)
    }

    pub(crate) async fn forget_record(&self, name: &str) -> Result<bool, ApiError> {
        let n = name.to_string();
        self.change_records(move |r| Ok(r.remove(&n).is_some()))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(state: &str) -> Liveness {
        Liveness::Answered {
            state: state.into(),
            address: "198.18.1.12:7801".into(),
        }
    }

    /// A leader that never saw a host answer takes its probe addresses
    /// from the store, and keeps what it saw itself.
    #[tokio::test]
    async fn probe_addresses_outlive_the_instance_that_saw_them() {
        let c = Control::new(Vec::new(), Default::default());
        let seen = vec!["198.18.1.11:7801".to_string()];
        lock(&c.ha.probe_addrs).insert("host1".into(), seen.clone());
        c.save_probe_addrs().await;
        lock(&c.ha.probe_addrs).clear();
        lock(&c.ha.probe_addrs).insert("host2".into(), vec!["own".into()]);
        c.load_probe_addrs().await;
        let a = lock(&c.ha.probe_addrs).clone();
        assert_eq!(a.get("host1"), Some(&seen));
        assert_eq!(a.get("host2"), Some(&vec!["own".to_string()]));
    }

    /// A leader that booted a VM elsewhere and died before recording the
    /// restart left it begun; the next leader's heartbeat, finding the VM
    /// running there, records it once, with its event, and a heartbeat
    /// after that adds nothing.
    #[tokio::test]
    async fn a_begun_restart_found_running_is_recorded_once_with_its_event() {
        let c = Control::new(Vec::new(), Default::default());
        let spec = VmSpec::workload("vm1", 256 << 20, 32 << 20, 0);
        c.record_created(&spec, "host3", None).await.unwrap();
        c.change_records(|r| {
            if let Some(x) = r.get_mut("vm1") {
                x.restarting = Some(Restarting {
                    from: "host3".into(),
                    to: "host1".into(),
                });
            }
            Ok(())
        })
        .await
        .unwrap();
        let hosts: Vec<HostEntry> = serde_json::from_value(serde_json::json!([{
            "name": "host1", "agent_url": "https://198.18.0.11:7800", "reachable": true,
            "error": null,
            "info": { "name": "host1", "agent_url": "https://198.18.0.11:7800",
                "memory_total": 1u64 << 33, "memory_reserved": 0, "memory_free": 1u64 << 33,
                "nics": [],
                "vms": [{ "name": "vm1", "host": "host1", "spec": spec, "state": "running",
                    "pid": 42 }] }
        }]))
        .unwrap();
        c.sync_records(&hosts).await;
        c.sync_records(&hosts).await;
        let r = c.records().await.unwrap()["vm1"].clone();
        assert_eq!(r.host, "host1");
        assert_eq!(r.restarting, None);
        assert_eq!(
            r.restarts.len(),
            1,
            "counted against the restart limit once"
        );
        let ev: Vec<_> = c
            .store
            .events(100)
            .await
            .unwrap()
            .into_iter()
            .filter(|e| e.kind == "ha_restart")
            .collect();
        assert_eq!(ev.len(), 1, "{ev:?}");
        assert_eq!(ev[0].subject, "vm1");
        assert_eq!(ev[0].detail["from"], "host3");
        assert_eq!(ev[0].detail["found_running"], true);
    }

    #[test]
    fn a_host_is_failed_only_on_a_second_signal() {
        assert!(matches!(
            judge(&[live("fenced")], Some(0.0)),
            Verdict::Failed { alive: true, .. }
        ));
        // an agent that answers and has not fenced: wait for it
        assert!(matches!(
            judge(&[live("leased")], Some(0.0)),
            Verdict::Wait(_)
        ));
        // up without its agent: its guests may run
        let down = Liveness::AgentDown {
            address: "198.18.1.12:7801".into(),
        };
        assert!(matches!(
            judge(&[Liveness::Silent, down], Some(0.0)),
            Verdict::Unmanaged(_)
        ));
        // silent everywhere: its storage decides
        assert!(matches!(
            judge(&[Liveness::Silent], Some(0.0)),
            Verdict::Failed { alive: false, .. }
        ));
        assert!(matches!(
            judge(&[Liveness::Silent], Some(50.0)),
            Verdict::Unmanaged(_)
        ));
        assert!(matches!(judge(&[Liveness::Silent], None), Verdict::Wait(_)));
        // nobody could ask
        assert!(matches!(judge(&[], Some(0.0)), Verdict::Wait(_)));
    }

    #[test]
    fn no_judgement_without_half_the_hosts() {
        assert!(quorum(1, 2));
        assert!(quorum(2, 3));
        assert!(!quorum(1, 3));
        assert!(!quorum(0, 1));
    }
}
