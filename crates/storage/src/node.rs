//! A storage node: its disks, its policies, its flows, and the glue between
//! the NBD server ([`crate::nbd`]) and the QoS layer ([`crate::qos`]).
//!
//! State that must survive a restart — disks (name, size, write-through,
//! policy), policies and the normalization size — is kept in `state.json`
//! in the node's directory, next to the disk files `disks/NAME.img`, and is
//! rewritten (write + rename) on every change.
//!
//! Flows: a connection to export `DISK/VM` belongs to flow `DISK/VM` (the
//! initiator names itself, as Ferry's agents do); a connection to plain
//! `DISK` belongs to flow `DISK/ADDRESS` of the client's address. A flow with
//! no connection left is shown as `LostCommunication` for
//! [`LOST_FLOW_KEEP`], then forgotten.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferry_api::storage::{
    check_name, AccessInfo, Allocation, DiskCreateRequest, DiskInfo, DiskRole, FlowInfo,
    FlowStatus, IncomingDiskRequest, Policy, PolicyKind, PolicyUpdate, QosSettings,
    DEFAULT_NORMALIZATION, MAX_DISK_SIZE,
};
use ferry_api::ApiError;
use serde::{Deserialize, Serialize};

use crate::export::Export;
use crate::nbd::server::{Attachment, Catalog, Peer, Refusal};
use crate::qos::{self, Counters, FlowId, Params, Scheduler, Ticket};

pub const LOST_FLOW_KEEP: Duration = Duration::from_secs(60);
/// How often flow rates and statuses are recomputed.
pub const SAMPLE_PERIOD: Duration = Duration::from_secs(1);

#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub name: String,
    pub dir: PathBuf,
    /// `host:port` clients reach the NBD server at (for disk URIs).
    pub nbd_address: String,
    /// Normalized IOPS the backing store sustains; 0: not limited here.
    pub capacity_iops: u64,
    /// Client addresses → host names, for the flows' `host` column.
    pub peers: BTreeMap<IpAddr, String>,
    /// How this node opens other nodes' exports (moves and replicas):
    /// its own certificate, `None` when the node runs without TLS.
    pub client_tls: Option<Arc<ferry_net::tls::ClientConfig>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct DiskRecord {
    size: u64,
    write_through: bool,
    policy: Option<String>,
    #[serde(default)]
    role: DiskRole,
    /// The disk's replica, restarted with the node.
    #[serde(default)]
    replica: Option<crate::jobs::ReplicaRecord>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Persisted {
    disks: BTreeMap<String, DiskRecord>,
    policies: BTreeMap<String, Policy>,
    normalization: u64,
    /// VM → the hosts whose certificates may open its exports, and which.
    #[serde(default)]
    grants: BTreeMap<String, VmAccess>,
}

/// Who may open a VM's exports `DISK/VM`, and for which disks.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct VmAccess {
    hosts: BTreeSet<String>,
    disks: BTreeSet<String>,
}

struct Disk {
    export: Arc<Export>,
    /// The disk's policy; a copy that is not the primary runs unlimited
    /// (its one writer is another node) and takes it when it becomes the disk.
    policy: Option<String>,
    role: DiskRole,
    replica: Option<crate::jobs::ReplicaRecord>,
}

struct Flow {
    id: FlowId,
    disk: String,
    initiator: String,
    host: String,
    connections: u32,
    last_seen: Instant,
    allocation: Option<Allocation>,
    /// (when, counters) of the previous sample, and the rates derived.
    sample: (Instant, Counters),
    rates: Rates,
}

#[derive(Debug, Clone, Copy, Default)]
struct Rates {
    iops: f64,
    bandwidth: f64,
    latency_us: f64,
    demand_iops: f64,
    backlogged: f64,
}

struct State {
    disks: BTreeMap<String, Disk>,
    policies: BTreeMap<String, Policy>,
    normalization: u64,
    flows: BTreeMap<String, Flow>,
    next_flow: FlowId,
    access: BTreeMap<String, VmAccess>,
    /// Each VM's grant generation: raised whenever a host loses the VM,
    /// so that host's open connections are refused from their next
    /// request on (see [`Gate`]).
    generations: BTreeMap<String, Arc<AtomicU64>>,
}

/// A connection opened under a host's grant of a VM: refused once a later
/// generation no longer lists the host.
struct Gate {
    generation: Arc<AtomicU64>,
    seen: AtomicU64,
    vm: String,
    host: String,
}

pub struct Node {
    pub cfg: NodeConfig,
    sched: Arc<Scheduler>,
    state: Mutex<State>,
    pub(crate) jobs: crate::jobs::Jobs,
    pub(crate) pushes: crate::jobs::Pushes,
}

fn role_name(r: &DiskRole) -> String {
    match r {
        DiskRole::Primary => "the disk itself".into(),
        DiskRole::Incoming { from } => format!("a move's copy from {from}"),
        DiskRole::Replica { of } => format!("a replica of {of}'s disk"),
        DiskRole::Retired { to } => format!("retired (the disk lives on {to})"),
    }
}

fn io_err(what: impl std::fmt::Display, e: std::io::Error) -> ApiError {
    ApiError::internal(format!("{what}: {e}"))
}

impl Node {
    /// Opens (or creates) the node directory and its disks.
    pub fn open(cfg: NodeConfig) -> Result<Arc<Node>, ApiError> {
        let disks_dir = cfg.dir.join("disks");
        std::fs::create_dir_all(&disks_dir).map_err(|e| io_err(disks_dir.display(), e))?;
        let state_path = cfg.dir.join("state.json");
        let persisted: Persisted = match std::fs::read(&state_path) {
            Ok(b) => serde_json::from_slice(&b)
                .map_err(|e| ApiError::internal(format!("{}: {e}", state_path.display())))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Persisted {
                disks: BTreeMap::new(),
                policies: BTreeMap::new(),
                normalization: DEFAULT_NORMALIZATION,
                grants: BTreeMap::new(),
            },
            Err(e) => return Err(io_err(state_path.display(), e)),
        };
        let mut disks = BTreeMap::new();
        for (name, r) in persisted.disks {
            let p = disks_dir.join(format!("{name}.img"));
            let export =
                Export::open(&name, &p, r.write_through).map_err(|e| io_err(p.display(), e))?;
            disks.insert(
                name,
                Disk {
                    export: Arc::new(export),
                    policy: r.policy,
                    role: r.role,
                    replica: r.replica,
                },
            );
        }
        let sched = Scheduler::new(qos::Config {
            capacity: cfg.capacity_iops as f64,
            normalization: persisted.normalization,
            ..qos::Config::default()
        });
        Ok(Arc::new(Node {
            cfg,
            sched,
            state: Mutex::new(State {
                disks,
                policies: persisted.policies,
                normalization: persisted.normalization,
                flows: BTreeMap::new(),
                next_flow: 1,
                access: persisted.grants,
                generations: BTreeMap::new(),
            }),
            jobs: crate::jobs::Jobs::default(),
            pushes: crate::jobs::Pushes::default(),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        ferry_api::util::lock(&self.state)
    }

    fn save(&self, st: &State) -> Result<(), ApiError> {
        let p = Persisted {
            disks: st
                .disks
                .iter()
                .map(|(n, d)| {
                    (
                        n.clone(),
                        DiskRecord {
                            size: d.export.size(),
                            write_through: d.export.write_through,
                            policy: d.policy.clone(),
                            role: d.role.clone(),
                            replica: d.replica.clone(),
                        },
                    )
                })
                .collect(),
            policies: st.policies.clone(),
            normalization: st.normalization,
            grants: st.access.clone(),
        };
        let path = self.cfg.dir.join("state.json");
        let tmp = self.cfg.dir.join("state.json.tmp");
        let body = serde_json::to_vec_pretty(&p).map_err(ApiError::internal)?;
        std::fs::write(&tmp, body).map_err(|e| io_err(tmp.display(), e))?;
        std::fs::rename(&tmp, &path).map_err(|e| io_err(path.display(), e))
    }

    fn disk_info(&self, st: &State, name: &str, d: &Disk) -> DiskInfo {
        DiskInfo {
            name: name.to_string(),
            node: self.cfg.name.clone(),
            size: d.export.size(),
            write_through: d.export.write_through,
            policy: d.policy.clone(),
            uri: format!("nbd://{}/{name}", self.cfg.nbd_address),
            connections: st
                .flows
                .values()
                .filter(|f| f.disk == name)
                .map(|f| f.connections)
                .sum(),
            role: d.role.clone(),
        }
    }

    pub fn list_disks(&self) -> Vec<DiskInfo> {
        let st = self.lock();
        st.disks
            .iter()
            .map(|(n, d)| self.disk_info(&st, n, d))
            .collect()
    }

    fn disk<'a>(st: &'a State, name: &str) -> Result<&'a Disk, ApiError> {
        st.disks
            .get(name)
            .ok_or_else(|| ApiError::not_found("disk", name))
    }

    /// Calls `f` on disk `name`'s export.
    pub(crate) fn with_disk<T>(
        &self,
        name: &str,
        f: impl FnOnce(&Arc<Export>) -> T,
    ) -> Result<T, ApiError> {
        let st = self.lock();
        Ok(f(&Self::disk(&st, name)?.export))
    }

    /// Saves the state (a disk's size changed) and describes disk `name`.
    pub(crate) fn persist_and_describe(&self, name: &str) -> Result<DiskInfo, ApiError> {
        let st = self.lock();
        self.save(&st)?;
        let d = Self::disk(&st, name)?;
        Ok(self.disk_info(&st, name, d))
    }

    pub fn create_disk(&self, req: &DiskCreateRequest) -> Result<DiskInfo, ApiError> {
        check_name("name", &req.name)?;
        if req.size == 0 || req.size > MAX_DISK_SIZE || !req.size.is_multiple_of(512) {
            return Err(ApiError::invalid(
                "size",
                format!(
                    "{} is not a multiple of 512 between 512 B and 16 TiB",
                    req.size
                ),
            ));
        }
        let mut st = self.lock();
        if st.disks.contains_key(&req.name) {
            return Err(ApiError::AlreadyExists {
                kind: "disk".into(),
                name: req.name.clone(),
            });
        }
        let p = self.cfg.dir.join("disks").join(format!("{}.img", req.name));
        let e = Export::create(&req.name, &p, req.size, req.write_through)
            .map_err(|e| io_err(p.display(), e))?;
        st.disks.insert(
            req.name.clone(),
            Disk {
                export: Arc::new(e),
                policy: None,
                role: DiskRole::Primary,
                replica: None,
            },
        );
        self.save(&st)?;
        let d = Self::disk(&st, &req.name)?;
        Ok(self.disk_info(&st, &req.name, d))
    }

    /// An empty copy of node `req.from`'s disk `name`, for it to write
    /// (a move's target, or a replica). A leftover copy from the same node
    /// (a move that failed while this node was away) is replaced; the
    /// node's own disk of that name never is.
    pub fn create_incoming(
        &self,
        name: &str,
        req: &IncomingDiskRequest,
    ) -> Result<DiskInfo, ApiError> {
        check_name("name", name)?;
        check_name("from", &req.from)?;
        if req.from == self.cfg.name {
            return Err(ApiError::invalid(
                "from",
                format!("{} is this node", req.from),
            ));
        }
        let leftover = {
            let st = self.lock();
            match st.disks.get(name).map(|d| &d.role) {
                None => false,
                Some(DiskRole::Incoming { from } | DiskRole::Replica { of: from })
                    if *from == req.from =>
                {
                    true
                }
                Some(r) => {
                    return Err(ApiError::AlreadyExists {
                        kind: format!("disk (as {})", role_name(r)),
                        name: name.to_string(),
                    })
                }
            }
        };
        if leftover {
            tracing::info!(disk = name, from = %req.from, "replacing a leftover copy");
            self.remove_disk(name)?;
        }
        let info = self.create_disk(&DiskCreateRequest {
            name: name.to_string(),
            size: req.size,
            write_through: req.write_through,
            node: None,
        })?;
        let mut st = self.lock();
        let d = st
            .disks
            .get_mut(name)
            .ok_or_else(|| ApiError::not_found("disk", name))?;
        d.policy = req.policy.clone();
        d.role = if req.replica {
            DiskRole::Replica {
                of: req.from.clone(),
            }
        } else {
            DiskRole::Incoming {
                from: req.from.clone(),
            }
        };
        self.save(&st)?;
        let d = Self::disk(&st, name)?;
        tracing::info!(disk = name, role = ?d.role, size = info.size, "copy of another node's disk created");
        Ok(self.disk_info(&st, name, d))
    }

    /// This node's copy becomes the disk (served to guests, under its
    /// policy). A replica only with `failover` (its primary is gone); a
    /// move's copy only without.
    pub fn activate(&self, name: &str, failover: bool) -> Result<DiskInfo, ApiError> {
        let mut st = self.lock();
        let d = st
            .disks
            .get_mut(name)
            .ok_or_else(|| ApiError::not_found("disk", name))?;
        match (&d.role, failover) {
            (DiskRole::Incoming { .. }, false) | (DiskRole::Replica { .. }, true) => {}
            (DiskRole::Primary, _) => {
                // asked again (a control service that restarted): done
                let d = Self::disk(&st, name)?;
                return Ok(self.disk_info(&st, name, d));
            }
            (r, _) => {
                return Err(ApiError::Conflict {
                    reason: format!(
                        "disk {name} here is {}: {}",
                        role_name(r),
                        if failover {
                            "only a replica fails over"
                        } else {
                            "only a move's copy becomes the disk this way (a replica takes over with failover)"
                        }
                    ),
                })
            }
        }
        tracing::info!(disk = name, was = ?d.role, "this copy is now the disk");
        d.role = DiskRole::Primary;
        self.save(&st)?;
        self.rebind(&st);
        let d = Self::disk(&st, name)?;
        Ok(self.disk_info(&st, name, d))
    }

    /// The disk now lives on node `to`: this copy takes no change any more
    /// (its connections may still read and flush, to swap over; new ones
    /// are refused) and waits to be removed.
    pub fn retire(&self, name: &str, to: &str) -> Result<DiskInfo, ApiError> {
        let mut st = self.lock();
        let d = st
            .disks
            .get_mut(name)
            .ok_or_else(|| ApiError::not_found("disk", name))?;
        d.role = DiskRole::Retired { to: to.to_string() };
        d.replica = None;
        d.export.retire();
        self.save(&st)?;
        self.rebind(&st);
        tracing::info!(disk = name, to, "copy retired: the disk lives on {to}");
        let d = Self::disk(&st, name)?;
        Ok(self.disk_info(&st, name, d))
    }

    /// The role of this node's copy of `name`.
    pub(crate) fn role(&self, name: &str) -> Result<DiskRole, ApiError> {
        let st = self.lock();
        Ok(Self::disk(&st, name)?.role.clone())
    }

    /// Records (or clears) the disk's replica, kept across restarts.
    pub(crate) fn set_replica(
        &self,
        name: &str,
        r: Option<crate::jobs::ReplicaRecord>,
    ) -> Result<(), ApiError> {
        let mut st = self.lock();
        let d = st
            .disks
            .get_mut(name)
            .ok_or_else(|| ApiError::not_found("disk", name))?;
        d.replica = r;
        self.save(&st)
    }

    /// Replicas recorded on this node's disks (restarted by [`crate::serve`]).
    pub(crate) fn replicas(&self) -> Vec<(String, crate::jobs::ReplicaRecord)> {
        let st = self.lock();
        st.disks
            .iter()
            .filter_map(|(n, d)| Some((n.clone(), d.replica.clone()?)))
            .collect()
    }

    pub fn resize_disk(&self, name: &str, size: u64) -> Result<DiskInfo, ApiError> {
        if size == 0 || size > MAX_DISK_SIZE || !size.is_multiple_of(512) {
            return Err(ApiError::invalid(
                "size",
                format!("{size} is not a multiple of 512 up to 16 TiB"),
            ));
        }
        let st = self.lock();
        let d = Self::disk(&st, name)?;
        let now = self.disk_info(&st, name, d).size;
        if size < now {
            return Err(ApiError::invalid(
                "size",
                format!(
                    "disk {name} is {now} bytes; shrinking it to {size} would cut off what guests wrote (refused)"
                ),
            ));
        }
        d.export.resize(size).map_err(|e| io_err(name, e))?;
        self.save(&st)?;
        Ok(self.disk_info(&st, name, d))
    }

    pub fn remove_disk(&self, name: &str) -> Result<DiskInfo, ApiError> {
        let mut st = self.lock();
        let d = Self::disk(&st, name)?;
        let info = self.disk_info(&st, name, d);
        if info.connections > 0 {
            return Err(ApiError::Conflict {
                reason: format!("disk {name} has {} open connections", info.connections),
            });
        }
        self.jobs.busy(name)?;
        self.refuse_pushed(name)?;
        let path = d.export.path.clone();
        st.disks.remove(name);
        let gone: Vec<FlowId> = st
            .flows
            .values()
            .filter(|f| f.disk == name)
            .map(|f| f.id)
            .collect();
        st.flows.retain(|_, f| f.disk != name);
        self.save(&st)?;
        drop(st);
        for f in gone {
            self.sched.remove(f);
        }
        std::fs::remove_file(&path).map_err(|e| io_err(path.display(), e))?;
        // its checkpoints go with it (backups elsewhere stay)
        let cps = self.cfg.dir.join("checkpoints").join(name);
        if cps.exists() {
            std::fs::remove_dir_all(&cps).map_err(|e| io_err(cps.display(), e))?;
        }
        Ok(info)
    }

    pub fn set_disk_policy(
        &self,
        name: &str,
        policy: Option<String>,
    ) -> Result<DiskInfo, ApiError> {
        let mut st = self.lock();
        if let Some(p) = &policy {
            if !st.policies.contains_key(p) {
                return Err(ApiError::not_found("policy", p));
            }
        }
        let d = st
            .disks
            .get_mut(name)
            .ok_or_else(|| ApiError::not_found("disk", name))?;
        d.policy = policy;
        self.save(&st)?;
        self.rebind(&st);
        let d = Self::disk(&st, name)?;
        Ok(self.disk_info(&st, name, d))
    }

    pub fn list_policies(&self) -> Vec<Policy> {
        self.lock().policies.values().cloned().collect()
    }

    pub fn new_policy(&self, p: Policy) -> Result<Policy, ApiError> {
        p.validate()?;
        let mut st = self.lock();
        if st.policies.contains_key(&p.name) {
            return Err(ApiError::AlreadyExists {
                kind: "policy".into(),
                name: p.name,
            });
        }
        st.policies.insert(p.name.clone(), p.clone());
        self.save(&st)?;
        self.rebind(&st);
        Ok(p)
    }

    /// Adds or replaces a policy as given (the cluster pushes its copy).
    pub fn put_policy(&self, p: Policy) -> Result<Policy, ApiError> {
        p.validate()?;
        let mut st = self.lock();
        st.policies.insert(p.name.clone(), p.clone());
        self.save(&st)?;
        self.rebind(&st);
        Ok(p)
    }

    pub fn update_policy(&self, name: &str, u: &PolicyUpdate) -> Result<Policy, ApiError> {
        let mut st = self.lock();
        let old = st
            .policies
            .get(name)
            .ok_or_else(|| ApiError::not_found("policy", name))?;
        let p = u.apply(old);
        p.validate()?;
        st.policies.insert(name.to_string(), p.clone());
        self.save(&st)?;
        self.rebind(&st);
        Ok(p)
    }

    /// Removes a policy; disks naming it keep the name, and their flows run
    /// unlimited with status `UnknownPolicyId` (as in Windows Storage QoS).
    pub fn remove_policy(&self, name: &str) -> Result<Policy, ApiError> {
        let mut st = self.lock();
        let p = st
            .policies
            .remove(name)
            .ok_or_else(|| ApiError::not_found("policy", name))?;
        self.save(&st)?;
        self.rebind(&st);
        Ok(p)
    }

    pub fn settings(&self) -> QosSettings {
        QosSettings {
            normalization: self.lock().normalization,
        }
    }

    pub fn set_settings(&self, s: &QosSettings) -> Result<QosSettings, ApiError> {
        s.validate()?;
        let mut st = self.lock();
        st.normalization = s.normalization;
        self.save(&st)?;
        let mut cfg = self.sched.config();
        cfg.normalization = s.normalization;
        self.sched.set_config(cfg);
        Ok(s.clone())
    }

    /// Sets (or with `None` clears) the allocation of flow `id`, overriding
    /// its disk's policy: the cluster-wide policy manager's lever.
    pub fn set_allocation(&self, id: &str, a: Option<Allocation>) -> Result<FlowInfo, ApiError> {
        let mut st = self.lock();
        let f = st
            .flows
            .get_mut(id)
            .ok_or_else(|| ApiError::not_found("flow", id))?;
        f.allocation = a;
        self.rebind(&st);
        let f = st
            .flows
            .get(id)
            .ok_or_else(|| ApiError::not_found("flow", id))?;
        Ok(self.flow_info(&st, id, f))
    }

    /// The pool and parameters a flow runs under, and whether its policy is unknown.
    fn binding(st: &State, key: &str, f: &Flow) -> (String, Params, Option<Policy>, bool) {
        let own = format!("flow:{key}");
        if let Some(a) = f.allocation {
            let p = Params {
                min_iops: a.min_iops as f64,
                max_iops: a.max_iops as f64,
                max_bandwidth: a.max_bandwidth as f64,
            };
            return (format!("alloc:{key}"), p, None, false);
        }
        let Some(pname) = st
            .disks
            .get(&f.disk)
            .filter(|d| d.role.is_primary())
            .and_then(|d| d.policy.clone())
        else {
            return (own, Params::default(), None, false);
        };
        let Some(pol) = st.policies.get(&pname) else {
            return (own, Params::default(), None, true);
        };
        let params = Params {
            min_iops: pol.min_iops as f64,
            max_iops: pol.max_iops as f64,
            max_bandwidth: pol.max_bandwidth as f64,
        };
        let pool = match pol.kind {
            PolicyKind::Dedicated => own,
            PolicyKind::Aggregated => format!("policy:{pname}"),
        };
        (pool, params, Some(pol.clone()), false)
    }

    fn rebind(&self, st: &State) {
        for (key, f) in &st.flows {
            let (pool, params, _, _) = Self::binding(st, key, f);
            self.sched.bind(f.id, &pool, params);
        }
    }

    fn flow_info(&self, st: &State, key: &str, f: &Flow) -> FlowInfo {
        let (pool, params, policy, unknown) = Self::binding(st, key, f);
        let r = f.rates;
        // an Aggregated minimum is judged on the pool's total
        let (got, backlogged) = if pool.starts_with("policy:") {
            st.flows
                .iter()
                .filter(|(k, g)| Self::binding(st, k, g).0 == pool)
                .fold((0.0, 0.0f64), |(a, b), (_, g)| {
                    (a + g.rates.iops, b.max(g.rates.backlogged))
                })
        } else {
            (r.iops, r.backlogged)
        };
        let status = if f.connections == 0 {
            FlowStatus::LostCommunication
        } else if unknown {
            FlowStatus::UnknownPolicyId
        } else if params.min_iops > 0.0 && backlogged > 0.5 && got < 0.95 * params.min_iops {
            FlowStatus::InsufficientThroughput
        } else {
            FlowStatus::Ok
        };
        FlowInfo {
            id: key.to_string(),
            disk: f.disk.clone(),
            node: self.cfg.name.clone(),
            initiator: f.initiator.clone(),
            host: f.host.clone(),
            policy: policy
                .map(|p| p.name)
                .or_else(|| st.disks.get(&f.disk).and_then(|d| d.policy.clone())),
            connections: f.connections,
            iops: r.iops,
            bandwidth: r.bandwidth,
            latency_us: r.latency_us,
            demand_iops: r.demand_iops,
            backlogged: r.backlogged,
            min_iops: params.min_iops as u64,
            max_iops: params.max_iops as u64,
            max_bandwidth: params.max_bandwidth as u64,
            status,
        }
    }

    pub fn list_flows(&self) -> Vec<FlowInfo> {
        let st = self.lock();
        st.flows
            .iter()
            .map(|(k, f)| self.flow_info(&st, k, f))
            .collect()
    }

    /// Recomputes rates; forgets flows lost for longer than [`LOST_FLOW_KEEP`].
    pub fn sample(&self) {
        let mut st = self.lock();
        let now = Instant::now();
        for f in st.flows.values_mut() {
            let c = self.sched.counters(f.id);
            let (t0, c0) = f.sample;
            let dt = now.duration_since(t0).as_secs_f64();
            if dt < 0.2 {
                continue;
            }
            let done = c.completed.saturating_sub(c0.completed);
            f.rates = Rates {
                iops: (c.ios - c0.ios) / dt,
                bandwidth: c.bytes.saturating_sub(c0.bytes) as f64 / dt,
                latency_us: if done > 0 {
                    (c.latency - c0.latency) / done as f64 * 1e6
                } else {
                    0.0
                },
                demand_iops: (c.arrived - c0.arrived) / dt,
                backlogged: ((c.backlogged - c0.backlogged) / dt).clamp(0.0, 1.0),
            };
            f.sample = (now, c);
        }
        let gone: Vec<(String, FlowId)> = st
            .flows
            .iter()
            .filter(|(_, f)| f.connections == 0 && f.last_seen.elapsed() > LOST_FLOW_KEEP)
            .map(|(k, f)| (k.clone(), f.id))
            .collect();
        for (k, _) in &gone {
            st.flows.remove(k);
        }
        drop(st);
        for (_, id) in gone {
            self.sched.remove(id);
        }
    }

    /// Which hosts may open VM `vm`'s exports, of which disks (the
    /// control service sets it: where the VM runs, and during a move its
    /// target too). No hosts forgets the VM.
    pub fn set_access(
        &self,
        vm: &str,
        hosts: Vec<String>,
        disks: Vec<String>,
    ) -> Result<AccessInfo, ApiError> {
        check_name("vm", vm)?;
        for h in &hosts {
            check_name("host", h)?;
        }
        for d in &disks {
            check_name("disk", d)?;
        }
        let mut st = self.lock();
        let a = VmAccess {
            hosts: hosts.into_iter().collect(),
            disks: disks.into_iter().collect(),
        };
        let lost: Vec<String> = st
            .access
            .get(vm)
            .map(|old| old.hosts.difference(&a.hosts).cloned().collect())
            .unwrap_or_default();
        if !lost.is_empty() {
            let g = st.generations.entry(vm.to_string()).or_default();
            let n = g.fetch_add(1, Ordering::SeqCst) + 1;
            tracing::info!(vm, hosts = ?lost, generation = n, "grant revoked: their connections are fenced");
        }
        if a.hosts.is_empty() {
            st.access.remove(vm);
        } else {
            st.access.insert(vm.to_string(), a.clone());
        }
        self.save(&st)?;
        Ok(access_info(vm, &a, &st))
    }

    pub fn list_access(&self) -> Vec<AccessInfo> {
        let st = self.lock();
        st.access
            .iter()
            .map(|(vm, a)| access_info(vm, a, &st))
            .collect()
    }

    /// May `peer` open export `disk[/initiator]`? Without TLS nobody is
    /// told apart (the node's `nbd_tls = "off"`). Over TLS: the control
    /// service and administrators' tools open any; an agent's certificate
    /// only `DISK/VM` of a VM granted to its host; nothing else.
    fn may_open(
        st: &State,
        peer: &Peer,
        disk: &str,
        initiator: Option<&str>,
    ) -> Result<(), Refusal> {
        use ferry_net::tls::Role;
        let role = st
            .disks
            .get(disk)
            .map(|d| d.role.clone())
            .unwrap_or_default();
        let writer = match &role {
            DiskRole::Primary => None,
            DiskRole::Incoming { from } | DiskRole::Replica { of: from } => Some(from.as_str()),
            DiskRole::Retired { to } => {
                return Err(Refusal::Unknown(format!(
                    "disk '{disk}' is no longer served here: it lives on {to}"
                )))
            }
        };
        // a copy another node writes: that node only (by name over TLS),
        // and never as a guest's export
        if let Some(from) = writer {
            if initiator.is_some() {
                return Err(Refusal::Policy(format!(
                    "disk '{disk}' here is a copy that {from} writes, not served to guests"
                )));
            }
            return match &peer.identity {
                None => Ok(()),
                Some(id) if id.role == Role::Storage && id.name == from => Ok(()),
                Some(id) => Err(Refusal::Policy(format!(
                    "disk '{disk}' here is a copy only {from} writes, not {id}"
                ))),
            };
        }
        let Some(id) = &peer.identity else {
            return Ok(());
        };
        match id.role {
            Role::Admin | Role::Control => Ok(()),
            Role::Storage => Err(Refusal::Policy(format!("{id} opens only copies it writes"))),
            // a VM's own certificate: its disks, while it is placed on the
            // host whose agent signed it
            Role::Vm => {
                let host = peer.vm_host.as_deref().unwrap_or_default();
                if initiator != Some(id.name.as_str()) {
                    return Err(Refusal::Policy(format!(
                        "VM {}'s certificate opens only its own disks, not '{disk}{}'",
                        id.name,
                        initiator.map(|i| format!("/{i}")).unwrap_or_default()
                    )));
                }
                match st
                    .access
                    .get(&id.name)
                    .filter(|a| a.hosts.iter().any(|h| h == host))
                {
                    None => Err(Refusal::Policy(format!(
                        "VM {} is not placed on {host}",
                        id.name
                    ))),
                    Some(a) if !a.disks.contains(disk) => Err(Refusal::Policy(format!(
                        "disk '{disk}' is not one of VM {}'s disks",
                        id.name
                    ))),
                    Some(_) => Ok(()),
                }
            }
            Role::Agent => {
                let Some(vm) = initiator else {
                    return Err(Refusal::Policy(format!(
                        "{id} may open only DISK/VM exports of its VMs, not '{disk}'"
                    )));
                };
                match st.access.get(vm).filter(|a| a.hosts.contains(&id.name)) {
                    None => Err(Refusal::Policy(format!(
                        "VM {vm} is not placed on {} (export '{disk}/{vm}')",
                        id.name
                    ))),
                    Some(a) if !a.disks.contains(disk) => Err(Refusal::Policy(format!(
                        "disk '{disk}' is not one of VM {vm}'s disks ({})",
                        a.disks.iter().cloned().collect::<Vec<_>>().join(", ")
                    ))),
                    Some(_) => Ok(()),
                }
            }
        }
    }

    /// Splits an export name into (disk, initiator named by the client).
    fn split_name(name: &str) -> (&str, Option<&str>) {
        match name.split_once('/') {
            Some((d, i)) if !i.is_empty() => (d, Some(i)),
            _ => (name, None),
        }
    }

    fn release(&self, key: &str) {
        let mut st = self.lock();
        if let Some(f) = st.flows.get_mut(key) {
            f.connections = f.connections.saturating_sub(1);
            f.last_seen = Instant::now();
        }
    }
}

struct NodeAttachment {
    node: Arc<Node>,
    export: Arc<Export>,
    flow: FlowId,
    key: String,
    gate: Option<Gate>,
}

impl Attachment for NodeAttachment {
    fn export(&self) -> &Arc<Export> {
        &self.export
    }
    fn request(&self, bytes: u64) -> Ticket {
        self.node.sched.request(self.flow, bytes)
    }

    fn fenced(&self) -> Option<String> {
        let g = self.gate.as_ref()?;
        let now = g.generation.load(Ordering::SeqCst);
        if now == g.seen.load(Ordering::SeqCst) {
            return None;
        }
        let st = self.node.lock();
        if st
            .access
            .get(&g.vm)
            .is_some_and(|a| a.hosts.contains(&g.host))
        {
            // another host lost the VM; this one keeps it
            g.seen.store(now, Ordering::SeqCst);
            return None;
        }
        Some(format!(
            "host {} no longer holds VM {}'s disks (grant generation {now}): fenced",
            g.host, g.vm
        ))
    }
}

impl Drop for NodeAttachment {
    fn drop(&mut self) {
        self.node.release(&self.key);
    }
}

fn access_info(vm: &str, a: &VmAccess, st: &State) -> AccessInfo {
    AccessInfo {
        vm: vm.to_string(),
        hosts: a.hosts.iter().cloned().collect(),
        disks: a.disks.iter().cloned().collect(),
        generation: st
            .generations
            .get(vm)
            .map(|g| g.load(Ordering::SeqCst))
            .unwrap_or(0),
    }
}

/// The NBD server's view of a node.
pub struct NodeCatalog(pub Arc<Node>);

impl Catalog for NodeCatalog {
    fn list(&self, peer: &Peer) -> Vec<String> {
        let st = self.0.lock();
        st.disks
            .keys()
            .filter(|d| Node::may_open(&st, peer, d, None).is_ok())
            .cloned()
            .collect()
    }

    fn describe(&self, name: &str, peer: &Peer) -> Result<(u64, bool), Refusal> {
        let (disk, initiator) = Node::split_name(name);
        if let Some(i) = initiator {
            check_name("initiator", i).map_err(|e| Refusal::Unknown(e.to_string()))?;
        }
        let st = self.0.lock();
        let d = st
            .disks
            .get(disk)
            .ok_or_else(|| Refusal::Unknown(format!("no export named '{name}'")))?;
        Node::may_open(&st, peer, disk, initiator)?;
        Ok((d.export.size(), false))
    }

    fn attach(&self, name: &str, peer: &Peer) -> Result<Box<dyn Attachment>, Refusal> {
        let node = &self.0;
        let (disk, initiator) = Node::split_name(name);
        if let Some(i) = initiator {
            check_name("initiator", i).map_err(|e| Refusal::Unknown(e.to_string()))?;
        }
        let gone = || Refusal::Unknown(format!("export '{name}' went away"));
        let mut st = node.lock();
        Node::may_open(&st, peer, disk, initiator)?;
        let export = st.disks.get(disk).ok_or_else(gone)?.export.clone();
        // an agent's or a VM's connection holds its host's grant of the VM
        let gate = match (&peer.identity, initiator) {
            (Some(id), Some(vm))
                if matches!(
                    id.role,
                    ferry_net::tls::Role::Agent | ferry_net::tls::Role::Vm
                ) =>
            {
                let host = match id.role {
                    ferry_net::tls::Role::Vm => peer.vm_host.clone().unwrap_or_default(),
                    _ => id.name.clone(),
                };
                let generation = st.generations.entry(vm.to_string()).or_default().clone();
                let seen = AtomicU64::new(generation.load(Ordering::SeqCst));
                Some(Gate {
                    generation,
                    seen,
                    vm: vm.to_string(),
                    host,
                })
            }
            _ => None,
        };
        // a VM's certificate: the host whose agent signed it
        let peer_name = peer
            .vm_host
            .clone()
            .or_else(|| peer.identity.as_ref().map(|i| i.name.clone()));
        let peer = peer.addr;
        // an agent's certificate names its host; else the configured peers
        let host = peer_name
            .or_else(|| node.cfg.peers.get(&peer.ip()).cloned())
            .unwrap_or_else(|| peer.ip().to_string());
        let initiator = initiator
            .map(str::to_string)
            .unwrap_or_else(|| peer.ip().to_string());
        let key = format!("{disk}/{initiator}");
        let next = st.next_flow;
        let f = st.flows.entry(key.clone()).or_insert_with(|| Flow {
            id: next,
            disk: disk.to_string(),
            initiator,
            host: host.clone(),
            connections: 0,
            last_seen: Instant::now(),
            allocation: None,
            sample: (Instant::now(), Counters::default()),
            rates: Rates::default(),
        });
        if f.id == next {
            st.next_flow += 1;
        }
        let f = st.flows.get_mut(&key).ok_or_else(gone)?;
        f.connections += 1;
        f.host = host; // a VM that moved connects from its new host
        f.last_seen = Instant::now();
        let id = f.id;
        let f = st.flows.get(&key).ok_or_else(gone)?;
        let (pool, params, _, _) = Node::binding(&st, &key, f);
        node.sched.bind(id, &pool, params);
        drop(st);
        Ok(Box::new(NodeAttachment {
            node: node.clone(),
            export,
            flow: id,
            key,
            gate,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_net::tls::{Identity, Role};

    fn agent(host: &str) -> Peer {
        Peer {
            addr: "198.18.0.11:40000".parse().unwrap(),
            identity: Some(Identity {
                role: Role::Agent,
                name: host.into(),
            }),
            vm_host: None,
        }
    }

    #[test]
    fn a_host_that_loses_a_vms_grant_is_refused_on_its_open_connections() {
        let dir = tempfile::tempdir().unwrap();
        let node = Node::open(NodeConfig {
            name: "s1".into(),
            dir: dir.path().to_path_buf(),
            nbd_address: "127.0.0.1:10809".into(),
            capacity_iops: 0,
            peers: BTreeMap::new(),
            client_tls: None,
        })
        .unwrap();
        let req = serde_json::json!({ "name": "d", "size": 1 << 20 });
        node.create_disk(&serde_json::from_value(req).unwrap())
            .unwrap();
        let cat = NodeCatalog(node.clone());
        node.set_access("vm1", vec!["host1".into()], vec!["d".into()])
            .unwrap();
        let old = cat.attach("d/vm1", &agent("host1")).ok().unwrap();
        assert!(old.fenced().is_none());
        // a move: host2 joins; host1 keeps its grant, its connection serves on
        node.set_access(
            "vm1",
            vec!["host1".into(), "host2".into()],
            vec!["d".into()],
        )
        .unwrap();
        assert!(old.fenced().is_none());
        // fenced: host1 loses the VM; its open connection is refused from now on
        let a = node
            .set_access("vm1", vec!["host2".into()], vec!["d".into()])
            .unwrap();
        assert_eq!(a.generation, 1);
        let why = old.fenced().expect("host1's connection is fenced");
        assert!(why.contains("host1") && why.contains("vm1"), "{why}");
        let new = cat.attach("d/vm1", &agent("host2")).ok().unwrap();
        assert!(new.fenced().is_none());
        // and host1 cannot open it again
        assert!(cat.attach("d/vm1", &agent("host1")).is_err());
        // another host losing it later leaves host2 serving
        node.set_access("vm1", vec!["host2".into()], vec!["d".into()])
            .unwrap();
        assert!(new.fenced().is_none());
    }
}
