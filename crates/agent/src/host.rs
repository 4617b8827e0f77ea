//! The host an agent runs: its VMs, its memory budget, its NICs, and the
//! guest check ("is this guest intact and still running?").
//!
//! Memory is reserved under the state lock before any QEMU starts, so two
//! concurrent requests can never overcommit a host: a VM being created or
//! arriving by migration holds its reservation from the first moment.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ferry_api::types::DiskUse;
use ferry_api::{ApiError, CheckResult, HostInfo, NicInfo, VmInfo, VmSpec};

use crate::guest::{read_tail, GuestCheck, Reading};
use crate::qemu::{self, QemuVm};
use crate::AgentConfig;

/// Host memory QEMU itself needs per VM beyond guest RAM.
pub const VM_OVERHEAD: u64 = 64 << 20;

/// What a VM slot is doing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// QEMU is being started.
    Starting,
    /// Running here.
    Running,
    /// A skeleton waiting for (or receiving) a migration.
    Incoming {
        migration_id: String,
        source: String,
        /// The source agent's URL, to ask it what became of the migration.
        source_url: String,
        /// The skeleton's directory.
        dir: PathBuf,
        /// When the skeleton was asked for.
        since: std::time::Instant,
        /// This agent's CPU time when the skeleton was asked for.
        agent_cpu_at_start: Duration,
    },
}

pub struct VmSlot {
    pub spec: VmSpec,
    pub role: Role,
    pub qemu: Option<Arc<QemuVm>>,
    /// An outgoing migration is under way.
    pub migrating: bool,
    /// A skeleton's transport session (multichannel), closed with it.
    pub transport: Option<ferry_transport::Carriers>,
    /// A skeleton's session for its local drives' copies (shared-nothing):
    /// closed at RUN, or with the skeleton.
    pub disk_transport: Option<ferry_transport::Session>,
    /// A migration of this VM is in doubt here (see [`crate::commit`]).
    pub doubt: Option<String>,
    /// The last guest check after a migration failed: why.
    pub problem: Option<String>,
    /// The guest's storage stopped answering: now, or last (see
    /// [`crate::resilience`]).
    pub storage_pause: Option<ferry_api::StoragePause>,
    /// Held (paused) for a move of one of its disks between storage nodes.
    pub held: Option<Held>,
}

/// A guest paused while its disk changes storage node
/// ([`Agent::hold_for_disk`]).
#[derive(Debug, Clone)]
pub struct Held {
    pub disk: String,
    /// It was running: it runs again when released.
    pub resume: bool,
    /// Tells this hold from a later one (for its deadline).
    pub id: u64,
}

/// A hold not released by then is released by the agent itself: the
/// guest runs again where its disk was (a move that was not committed
/// leaves the disk there; one that was refuses it, and the guest waits
/// for its storage, as after an outage).
pub const HOLD_MAX: Duration = Duration::from_secs(60);

impl VmSlot {
    /// The QEMU of a VM running here and not migrating, for a change to it.
    fn settled_qemu(&self, name: &str) -> Result<Arc<QemuVm>, ApiError> {
        match (&self.role, &self.qemu, self.migrating) {
            (Role::Running, Some(q), false) => Ok(q.clone()),
            _ => Err(ApiError::Conflict {
                reason: format!("vm {name} is not running here, or is migrating"),
            }),
        }
    }

    pub fn new(spec: VmSpec, role: Role, qemu: Option<Arc<QemuVm>>) -> VmSlot {
        VmSlot {
            spec,
            role,
            qemu,
            migrating: false,
            transport: None,
            disk_transport: None,
            doubt: None,
            problem: None,
            storage_pause: None,
            held: None,
        }
    }
}

#[derive(Default)]
pub struct HostState {
    pub vms: BTreeMap<String, VmSlot>,
}

impl HostState {
    pub fn reserved(&self) -> u64 {
        self.vms.values().map(|v| v.spec.memory + VM_OVERHEAD).sum()
    }
}

pub struct Agent {
    pub cfg: AgentConfig,
    /// The cluster credential: keys the data plane between agents (NIC
    /// probes, transport carriers) and, under `--insecure-http` only,
    /// authenticates API calls.
    pub cred: ferry_api::auth::Credential,
    /// This host's certificate (see [`ferry_net::tls`]); `None` under
    /// `--insecure-http`.
    pub pki: Option<ferry_net::tls::Pki>,
    /// Admits incoming migrations with the control service's tickets
    /// (see [`ferry_net::ticket`]); `None` under `--insecure-http`.
    pub tickets: Option<ferry_net::ticket::TicketVerifier>,
    /// How this agent calls peers.
    pub client_auth: ferry_net::client::ClientAuth,
    pub state: tokio::sync::Mutex<HostState>,
    pub sinks: crate::validate::Sinks,
    /// Bandwidth classes on this host's NICs.
    pub classes: Arc<std::sync::Mutex<crate::classes::Classes>>,
    /// Every migration's commit record (see [`crate::commit`]).
    pub journal: crate::commit::Journal,
    /// Migrations a move of this process is driving now (by id).
    /// Incoming post-copies listening for a recovery stream: id → (NIC, URI).
    pub recovering: tokio::sync::Mutex<BTreeMap<String, (String, String)>>,
    pub live: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// Reads guests' consoles for the guest check.
    pub guest: Arc<dyn GuestCheck>,
    /// NIC pairs to peers, as probed (see [`crate::probe`]).
    pub paths: Arc<crate::probe::PathCache>,
    /// The CPU models QEMU can run here, asked once (see [`crate::hardware`]).
    cpus: tokio::sync::OnceCell<Result<Arc<crate::hardware::CpuCatalog>, String>>,
    /// Switch-overs seen per target, for the next move's downtime budget.
    pub switchovers: crate::downtime::Learned,
    /// The host's idle CPU share over the last second.
    pub idle: IdleGauge,
}

impl Agent {
    pub fn new(
        cfg: AgentConfig,
        cred: ferry_api::auth::Credential,
        pki: Option<ferry_net::tls::Pki>,
        guest: Arc<dyn GuestCheck>,
    ) -> Result<Arc<Agent>, ferry_net::tls::TlsError> {
        let client_auth = ferry_net::client::ClientAuth::component(pki.as_ref(), &cred)?;
        let tickets = pki
            .as_ref()
            .map(|p| ferry_net::ticket::TicketVerifier::new(p.roots()))
            .transpose()
            .map_err(ferry_net::tls::TlsError::Config)?;
        Ok(Arc::new(Agent {
            cred,
            pki,
            tickets,
            client_auth,
            guest,
            paths: Default::default(),
            cpus: Default::default(),
            switchovers: Default::default(),
            idle: Default::default(),
            journal: crate::commit::Journal::new(&cfg.state_dir),
            live: Default::default(),
            recovering: Default::default(),
            state: Default::default(),
            sinks: Default::default(),
            classes: Arc::new(std::sync::Mutex::new(crate::classes::Classes::new(
                cfg.nic_rate,
                cfg.nics.clone(),
                cfg.storage_nic.clone(),
            ))),
            cfg,
        }))
    }

    /// The NIC pairs a move to `info` uses: as [`Agent::paths_to`], but
    /// pairs past their age whose links have not changed are used at once
    /// and probed again behind the move (probing an unreachable pair waits
    /// out its tries, about a second).
    pub async fn paths_for_move(&self, info: &HostInfo) -> Vec<ferry_api::NicPath> {
        let mine = self.nics();
        match self.paths.get(&info.name) {
            Some(p) if !p.fresh(&mine, &info.nics) && p.same_links(&mine, &info.nics) => {
                let (cache, me, secret) = (
                    self.paths.clone(),
                    self.cfg.name.clone(),
                    self.cred.secret().to_vec(),
                );
                let (peer, peer_nics, port) =
                    (info.name.clone(), info.nics.clone(), info.probe_port);
                tokio::spawn(async move {
                    crate::probe::refresh(&cache, (&me, &secret), &mine, &peer, &peer_nics, port)
                        .await;
                });
                p.pairs
            }
            _ => self.paths_to(info).await,
        }
    }

    /// The NIC pairs to `peer` (whose host info is `info`): probed again
    /// when older than [`crate::probe::PROBE_TTL`] or when a link on
    /// either side changed.
    pub async fn paths_to(&self, info: &HostInfo) -> Vec<ferry_api::NicPath> {
        let mine = self.nics();
        if let Some(p) = self.paths.get(&info.name) {
            if p.fresh(&mine, &info.nics) {
                return p.pairs;
            }
        }
        self.probe_now(info, mine).await
    }

    /// The NIC pairs to `peer` from this host's NICs `mine`, probed now
    /// whatever the cache holds.
    async fn probe_now(&self, info: &HostInfo, mine: Vec<NicInfo>) -> Vec<ferry_api::NicPath> {
        crate::probe::refresh(
            &self.paths,
            (&self.cfg.name, self.cred.secret()),
            &mine,
            &info.name,
            &info.nics,
            info.probe_port,
        )
        .await
    }

    /// Probes every peer given (each asked for its NICs first) now, not
    /// from the cache: validation asks what reaches what at this moment,
    /// and a pair probed in a link's first moments back up (its neighbour
    /// entries still failed) would otherwise stand unreachable for
    /// [`crate::probe::PROBE_TTL`]. Returns every pair known.
    pub async fn probe_peers(&self, peers: Vec<ferry_api::PeerRef>) -> Vec<ferry_api::NicPath> {
        let jobs = peers
            .into_iter()
            .filter(|p| p.name != self.cfg.name)
            .map(|p| async move {
                let c = ferry_net::client::Client::new(
                    &format!("agent {}", p.name),
                    &p.url,
                    self.client_auth.clone(),
                );
                match c.get::<HostInfo>("/host", Duration::from_secs(5)).await {
                    Ok(info) => {
                        self.probe_now(&info, self.nics()).await;
                    }
                    Err(e) => {
                        tracing::warn!(peer = %p.name, error = %e, "cannot ask a peer for its NICs")
                    }
                }
            });
        futures::future::join_all(jobs).await;
        self.paths.all()
    }

    /// The CPU models QEMU can run on this host.
    pub async fn cpu_catalog(&self) -> Result<Arc<crate::hardware::CpuCatalog>, String> {
        self.cpus
            .get_or_init(|| async {
                crate::hardware::probe_cpus(&self.cfg.qemu.binary, &self.cfg.qemu.accel)
                    .await
                    .map(Arc::new)
            })
            .await
            .clone()
    }

    /// Refuses a VM this host cannot run — a bridge, drive path, kernel or
    /// firmware file or CPU model it lacks — before anything starts.
    /// `source` is the source host's expansion of a host-dependent CPU
    /// model, on a migration's target.
    pub async fn preflight(
        &self,
        spec: &VmSpec,
        source: Option<&crate::hardware::Expansion>,
    ) -> Result<(), ApiError> {
        // what the host grants first: nothing outside it is even looked at
        let catalog = self.cpu_catalog().await;
        let machines = catalog.as_ref().ok().map(|c| c.machines.as_slice());
        if let Some(r) = crate::grants::refusal(&self.cfg.grants, spec, machines) {
            tracing::warn!(vm = %spec.name, field = %r.field, value = %r.value, "refused: not granted to guests here");
            return Err(r.into_error(&self.cfg.name));
        }
        let mut missing = crate::hardware::missing_here(spec, &self.cfg.qemu.ovmf);
        match catalog {
            Ok(cat) => missing.extend(crate::hardware::cpu_problem(
                &cat,
                self.cfg.cpu_models.as_deref(),
                &spec.cpu,
                source,
            )),
            Err(e) => missing.push(format!("CPU model {} (cannot ask QEMU: {e})", spec.cpu)),
        }
        if missing.is_empty() {
            Ok(())
        } else {
            tracing::warn!(vm = %spec.name, ?missing, "refused: this host lacks what the VM needs");
            Err(ApiError::HostCannotRun {
                host: self.cfg.name.clone(),
                vm: spec.name.clone(),
                missing,
            })
        }
    }

    /// Keeps every guest's console log within `console_log_max` (see
    /// [`crate::guest::rotate`]): a guest printing without end fills no disk.
    pub async fn rotate_consoles(&self) {
        let logs: Vec<(String, PathBuf)> = {
            let st = self.state.lock().await;
            st.vms
                .iter()
                .filter_map(|(n, s)| Some((n.clone(), s.qemu.as_ref()?.console_path())))
                .collect()
        };
        for (vm, log) in logs {
            match crate::guest::rotate(&log, self.cfg.console_log_max) {
                Ok(true) => {
                    tracing::info!(%vm, max = self.cfg.console_log_max, "console log rotated")
                }
                Ok(false) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(%vm, "rotating the console log: {e}"),
            }
        }
    }

    /// This host's migration NICs (see [`nics`]).
    pub fn nics(&self) -> Vec<NicInfo> {
        nics(&self.cfg.nics)
    }

    pub fn vm_dir(&self, name: &str, suffix: &str) -> PathBuf {
        self.cfg
            .state_dir
            .join("vms")
            .join(format!("{name}{suffix}"))
    }

    /// Reserves memory and a name for a VM that is about to start. Fails with
    /// `InsufficientMemory` or `AlreadyExists` before anything starts.
    pub async fn reserve(&self, spec: &VmSpec, role: Role) -> Result<(), ApiError> {
        spec.validate()?;
        let mut st = self.state.lock().await;
        if st.vms.contains_key(&spec.name) {
            return Err(ApiError::AlreadyExists {
                kind: "vm".into(),
                name: spec.name.clone(),
            });
        }
        let available = self.cfg.memory.saturating_sub(st.reserved());
        let needed = spec.memory + VM_OVERHEAD;
        if needed > available {
            return Err(ApiError::InsufficientMemory {
                host: self.cfg.name.clone(),
                needed,
                available,
            });
        }
        st.vms
            .insert(spec.name.clone(), VmSlot::new(spec.clone(), role, None));
        Ok(())
    }

    /// Drops a reservation and returns its QEMU, if any, for the caller to stop.
    pub async fn release(&self, name: &str) -> Option<Arc<QemuVm>> {
        self.state
            .lock()
            .await
            .vms
            .remove(name)
            .and_then(|s| s.qemu)
    }

    /// Creates and boots a VM.
    pub async fn create_vm(&self, spec: VmSpec) -> Result<VmInfo, ApiError> {
        spec.validate()?;
        self.preflight(&spec, None).await?;
        self.reserve(&spec, Role::Starting).await?;
        let made = match crate::local_disk::ensure(&self.cfg.qemu, &spec).await {
            Ok(m) => m,
            Err(e) => {
                self.release(&spec.name).await;
                return Err(e);
            }
        };
        let dir = self.vm_dir(&spec.name, "");
        match qemu::launch(&self.cfg.qemu, &spec, &dir, false).await {
            Ok(vm) => {
                let vm = Arc::new(vm);
                // a workload guest is ready once it ticks; any other once QEMU runs it
                let ready = if spec.is_workload() {
                    wait_workload(self.guest.as_ref(), &vm, BOOT_TIMEOUT).await
                } else {
                    Ok(())
                };
                if let Err(e) = ready {
                    vm.kill().await;
                    self.release(&spec.name).await;
                    crate::local_disk::remove(&made);
                    return Err(ApiError::internal(format!(
                        "vm {} did not start its workload: {e}",
                        spec.name
                    )));
                }
                let mut st = self.state.lock().await;
                if let Some(slot) = st.vms.get_mut(&spec.name) {
                    slot.qemu = Some(vm.clone());
                    slot.role = Role::Running;
                }
                drop(st);
                tracing::info!(vm = %spec.name, pid = vm.pid, "vm started");
                Ok(self.vm_info(&spec, &Role::Running, Some(&vm)).await)
            }
            Err(e) => {
                self.release(&spec.name).await;
                crate::local_disk::remove(&made);
                Err(ApiError::internal(format!(
                    "starting QEMU for {}: {}",
                    spec.name,
                    error_chain(&e)
                )))
            }
        }
    }

    async fn vm_info(&self, spec: &VmSpec, role: &Role, qemu: Option<&Arc<QemuVm>>) -> VmInfo {
        self.vm_info_with(spec, role, qemu, None, None, None).await
    }

    async fn vm_info_with(
        &self,
        spec: &VmSpec,
        role: &Role,
        qemu: Option<&Arc<QemuVm>>,
        in_doubt: Option<String>,
        problem: Option<String>,
        storage_pause: Option<ferry_api::StoragePause>,
    ) -> VmInfo {
        let state = match (role, qemu) {
            (Role::Starting, _) => "starting".to_string(),
            (Role::Incoming { .. }, _) => "incoming".to_string(),
            (Role::Running, Some(q)) => match q.qmp.status().await {
                Ok(s) => s.status,
                Err(_) if !q.alive().await => "exited".to_string(),
                Err(_) => "unreachable".to_string(),
            },
            (Role::Running, None) => "unknown".to_string(),
        };
        VmInfo {
            name: spec.name.clone(),
            host: self.cfg.name.clone(),
            // a listing never carries the seed's user data
            spec: spec.redacted(),
            state,
            pid: qemu.map(|q| q.pid),
            in_doubt,
            problem,
            accel: self.cfg.qemu.accel.clone(),
            storage_pause,
            migrating: false,
        }
    }

    pub async fn list_vms(&self) -> Vec<VmInfo> {
        let slots: Vec<_> = {
            let st = self.state.lock().await;
            st.vms
                .values()
                .map(|s| {
                    (
                        s.spec.clone(),
                        s.role.clone(),
                        s.qemu.clone(),
                        s.doubt.clone(),
                        s.problem.clone(),
                        s.storage_pause.clone(),
                        s.migrating,
                    )
                })
                .collect()
        };
        let mut out = Vec::new();
        for (spec, role, q, doubt, problem, pause, migrating) in slots {
            let mut info = self
                .vm_info_with(&spec, &role, q.as_ref(), doubt, problem, pause)
                .await;
            info.migrating = migrating;
            out.push(info);
        }
        out
    }

    /// The running VM `name` (not a skeleton, not starting).
    pub async fn running_vm(&self, name: &str) -> Result<(VmSpec, Arc<QemuVm>), ApiError> {
        let st = self.state.lock().await;
        match st.vms.get(name) {
            Some(VmSlot {
                spec,
                role: Role::Running,
                qemu: Some(q),
                ..
            }) => Ok((spec.clone(), q.clone())),
            Some(_) => Err(ApiError::Conflict {
                reason: format!("vm {name} is not running here yet"),
            }),
            None => Err(ApiError::not_found("vm", name)),
        }
    }

    /// Hot-plugs an NBD disk into a running VM; the disk joins the VM's spec,
    /// so a migration target starts with it plugged.
    pub async fn plug_disk(
        &self,
        name: &str,
        plug: ferry_api::DiskPlug,
    ) -> Result<VmInfo, ApiError> {
        plug.parse_uri()?;
        let mut st = self.state.lock().await;
        let slot = st
            .vms
            .get_mut(name)
            .ok_or_else(|| ApiError::not_found("vm", name))?;
        let q = slot.settled_qemu(name)?;
        if slot.spec.disks.iter().any(|d| d.disk == plug.disk) {
            return Err(ApiError::AlreadyExists {
                kind: format!("disk of vm {name}"),
                name: plug.disk,
            });
        }
        let index = slot.spec.disks.len();
        if index >= ferry_api::MAX_VM_DISKS {
            return Err(ApiError::invalid(
                "disk",
                format!("vm {name} has {index} disks, the most it takes"),
            ));
        }
        let node = qemu::BlockNode::disk(index, &plug).expect("a parsed URI");
        q.qmp
            .plug_disk(index, node.blockdev(&self.cfg.qemu))
            .await
            .map_err(|e| ApiError::unavailable(format!("plugging {} into {name}", plug.disk), e))?;
        slot.spec.disks.push(plug);
        let spec = slot.spec.clone();
        drop(st);
        // a restarted agent takes the VM back with its disks
        if let Err(e) = q.record(&spec).await {
            tracing::error!(vm = %name, error = %error_chain(&e), "recording the plugged disk");
        }
        tracing::info!(vm = %name, disks = spec.disks.len(), "disk plugged");
        Ok(self.vm_info(&spec, &Role::Running, Some(&q)).await)
    }

    /// Disk `disk` of VM `name` grew to `size` on its storage node: the
    /// guest sees the new size at once: a fresh connection under its node
    /// ([`Agent::reconnect_node`]), then `block_resize`.
    pub async fn grow_disk(&self, name: &str, disk: &str, size: u64) -> Result<VmInfo, ApiError> {
        let st = self.state.lock().await;
        let slot = st
            .vms
            .get(name)
            .ok_or_else(|| ApiError::not_found("vm", name))?;
        let q = slot.settled_qemu(name)?;
        let (index, plug) = slot
            .spec
            .disks
            .iter()
            .enumerate()
            .find(|(_, d)| d.disk == disk)
            .ok_or_else(|| ApiError::not_found(&format!("disk of vm {name}"), disk))?;
        plug.parse_uri()?;
        let spec = slot.spec.clone();
        drop(st);
        let node = format!("disk{index}");
        self.reconnect_node(&q, &spec, &node)
            .await
            .map_err(|e| ApiError::unavailable(format!("growing disk {disk} of {name}"), e))?;
        q.qmp
            .block_resize(&node, size)
            .await
            .map_err(|e| ApiError::unavailable(format!("growing disk {disk} of {name}"), e))?;
        tracing::info!(vm = %name, disk, size, "disk grown");
        Ok(self.vm_info(&spec, &Role::Running, Some(&q)).await)
    }

    /// Pauses VM `name` while its disk `disk` changes storage node: QEMU
    /// completes every request in flight first, so the old node holds
    /// all the guest wrote. Asked again, answers the same hold.
    pub async fn hold_for_disk(
        self: &Arc<Self>,
        name: &str,
        disk: &str,
    ) -> Result<VmInfo, ApiError> {
        let mut st = self.state.lock().await;
        let slot = st
            .vms
            .get_mut(name)
            .ok_or_else(|| ApiError::not_found("vm", name))?;
        let q = slot.settled_qemu(name)?;
        if slot.spec.disk_use(disk).is_none() {
            return Err(ApiError::not_found(&format!("disk of vm {name}"), disk));
        }
        if let Some(h) = &slot.held {
            if h.disk != disk {
                return Err(ApiError::Conflict {
                    reason: format!("vm {name} is held for a move of disk {}", h.disk),
                });
            }
        } else {
            let status = q
                .qmp
                .status()
                .await
                .map_err(|e| ApiError::unavailable(format!("vm {name}"), e))?;
            let resume = status.status == "running";
            if resume {
                q.qmp
                    .stop()
                    .await
                    .map_err(|e| ApiError::unavailable(format!("pausing vm {name}"), e))?;
            }
            let id = ferry_api::util::now_ms();
            slot.held = Some(Held {
                disk: disk.to_string(),
                resume,
                id,
            });
            tracing::info!(vm = name, disk, resume, "held for a move of its disk");
            let (agent, vm) = (self.clone(), name.to_string());
            tokio::spawn(async move {
                tokio::time::sleep(HOLD_MAX).await;
                let still = {
                    let st = agent.state.lock().await;
                    st.vms
                        .get(&vm)
                        .and_then(|s| s.held.as_ref())
                        .is_some_and(|h| h.id == id)
                };
                if still {
                    tracing::warn!(
                        vm,
                        "hold for a disk move not released within {HOLD_MAX:?}: releasing it"
                    );
                    let _ = agent.release_disk(&vm, None).await;
                }
            });
        }
        let spec = slot.spec.clone();
        drop(st);
        Ok(self.vm_info(&spec, &Role::Running, Some(&q)).await)
    }

    /// Disk `disk` of VM `name` is served at `uri` now (`None`: where it
    /// was): a new connection is swapped in and kept in the VM's spec, and
    /// a guest held for the move runs again.
    pub async fn switch_disk(
        &self,
        name: &str,
        disk: &str,
        uri: Option<String>,
    ) -> Result<VmInfo, ApiError> {
        if let Some(uri) = uri {
            ferry_api::types::parse_nbd_uri(&uri)?;
            let mut st = self.state.lock().await;
            let slot = st
                .vms
                .get_mut(name)
                .ok_or_else(|| ApiError::not_found("vm", name))?;
            let q = slot.settled_qemu(name)?;
            let mut spec = slot.spec.clone();
            let node = match spec.disk_use(disk) {
                Some(DiskUse::Plugged(i)) if spec.disks[i].uri != uri => {
                    spec.disks[i].uri = uri.clone();
                    Some(format!("disk{i}"))
                }
                Some(DiskUse::Drive(i)) if spec.drives[i].nbd.as_deref() != Some(&uri) => {
                    spec.drives[i].nbd = Some(uri.clone());
                    Some(format!("drive{i}"))
                }
                Some(_) => None,
                None => return Err(ApiError::not_found(&format!("disk of vm {name}"), disk)),
            };
            if let Some(node) = node {
                if let Err(e) = self.reconnect_node(&q, &spec, &node).await {
                    // QEMU flushes the connection it replaces first: one
                    // that lost a write to a node that is gone cannot be
                    // flushed, so only a new QEMU opens the disk there
                    let lost =
                        matches!(q.qmp.status().await, Ok(s) if s.status == crate::qemu::IO_ERROR);
                    if !lost || !spec.drives.iter().all(|d| d.local.is_none()) {
                        return Err(ApiError::unavailable(
                            format!("switching disk {disk} of {name} to {uri}"),
                            e,
                        ));
                    }
                    drop(st);
                    tracing::warn!(vm = name, disk, "the old connection lost writes to a node that is gone ({e}): restarting the guest on {uri}");
                    return self.restart_with(name, spec).await;
                }
                slot.spec = spec.clone();
                drop(st);
                if let Err(e) = q.record(&spec).await {
                    tracing::error!(vm = %name, error = %error_chain(&e), "recording the switched disk");
                }
                tracing::info!(vm = name, disk, uri, "disk switched to its new node");
            }
        }
        self.release_disk(name, Some(disk)).await
    }

    /// Starts VM `name` again from `spec`: its QEMU stops, a new one boots
    /// (the guest's memory is lost; what it wrote to its disks is not).
    async fn restart_with(&self, name: &str, spec: VmSpec) -> Result<VmInfo, ApiError> {
        let Some(q) = self.release(name).await else {
            return Err(ApiError::not_found("vm", name));
        };
        q.stop().await;
        self.remove_vm_dir(&q.dir, &format!("{name}.restarted"));
        self.create_vm(spec).await
    }

    /// Ends a hold (of disk `disk`, or any): the guest runs again if it ran before.
    async fn release_disk(&self, name: &str, disk: Option<&str>) -> Result<VmInfo, ApiError> {
        let mut st = self.state.lock().await;
        let slot = st
            .vms
            .get_mut(name)
            .ok_or_else(|| ApiError::not_found("vm", name))?;
        let q = slot.settled_qemu(name)?;
        let held = match (&slot.held, disk) {
            (Some(h), Some(d)) if h.disk != d => None,
            _ => slot.held.take(),
        };
        if let Some(h) = held {
            if h.resume {
                q.qmp
                    .cont()
                    .await
                    .map_err(|e| ApiError::unavailable(format!("resuming vm {name}"), e))?;
            }
            tracing::info!(vm = name, disk = %h.disk, "released after a move of its disk");
        }
        let spec = slot.spec.clone();
        drop(st);
        Ok(self.vm_info(&spec, &Role::Running, Some(&q)).await)
    }

    /// Opens a new NBD connection for block node `node` of a VM
    /// (`disk{i}` or `drive{i}` of `spec`) and swaps it in; the connection
    /// it replaces goes. `Ok(false)`: the node does not read over NBD.
    pub async fn reconnect_node(
        &self,
        q: &QemuVm,
        spec: &VmSpec,
        node: &str,
    ) -> Result<bool, crate::qmp::QmpError> {
        let Some(n) = qemu::block_nodes(spec).into_iter().find(|n| n.name == node) else {
            return Ok(false);
        };
        if !matches!(n.backing, qemu::Backing::Nbd { .. }) {
            return Ok(false);
        }
        // a new name for each connection; the ones it replaces go
        let prefix = format!("{node}-f");
        let old: Vec<String> = q
            .qmp
            .block_nodes()
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|n| n.starts_with(&prefix))
            .collect();
        let file_node = format!("{prefix}{}", ferry_api::util::now_ms());
        q.qmp
            .swap_file(
                node,
                n.driver,
                n.read_only,
                n.file(&self.cfg.qemu),
                &file_node,
            )
            .await?;
        for n in old {
            let _ = q.qmp.blockdev_del(&n).await;
        }
        Ok(true)
    }

    pub async fn remove_vm(&self, name: &str) -> Result<(), ApiError> {
        {
            let st = self.state.lock().await;
            match st.vms.get(name) {
                None => return Err(ApiError::not_found("vm", name)),
                Some(s) if s.migrating || s.role != Role::Running => {
                    return Err(ApiError::Conflict {
                        reason: format!("vm {name} is migrating"),
                    })
                }
                Some(_) => {}
            }
        }
        let spec = self
            .state
            .lock()
            .await
            .vms
            .get(name)
            .map(|s| s.spec.clone());
        if let Some(q) = self.release(name).await {
            q.stop().await;
            self.remove_vm_dir(&q.dir, &format!("{name}.removed"));
        }
        // its local drives go with it (they exist nowhere else)
        if let Some(spec) = spec {
            crate::local_disk::remove(&crate::local_disk::paths(&self.cfg.qemu, &spec));
        }
        tracing::info!(vm = name, "vm removed");
        Ok(())
    }

    /// Checks a running guest; a failure is kept on the VM (`problem` in
    /// `vm list`) until a check passes.
    /// `after`: the guest's last tick before it came here (see [`check`]).
    pub async fn check_vm(&self, name: &str, after: Option<u64>) -> Result<CheckResult, ApiError> {
        let (spec, q) = self.running_vm(name).await?;
        let r = check(
            self.guest.as_ref(),
            &self.cfg.name,
            &spec,
            &q,
            Duration::from_secs(8),
            after,
        )
        .await;
        let problem = (!r.ok()).then(|| r.summary());
        if let Some(slot) = self.state.lock().await.vms.get_mut(name) {
            slot.problem = problem;
        }
        Ok(r)
    }

    /// The last `max` bytes of a running VM's serial console.
    pub async fn console_tail(
        &self,
        name: &str,
        max: u64,
    ) -> Result<ferry_api::ConsoleTail, ApiError> {
        let (_, q) = self.running_vm(name).await?;
        let path = q.console_path();
        let unavailable = |e: std::io::Error| ApiError::Unavailable {
            what: format!("{name}'s console log ({})", path.display()),
            reason: e.to_string(),
        };
        let size = std::fs::metadata(&path).map_err(unavailable)?.len();
        let text = read_tail(&path, max.clamp(1, 1 << 20)).map_err(unavailable)?;
        Ok(ferry_api::ConsoleTail {
            vm: name.into(),
            host: self.cfg.name.clone(),
            size,
            text,
        })
    }

    /// Removes a VM's directory, keeping its QEMU log (every run-state change
    /// is traced there) as `STATE_DIR/log/LABEL.qemu.log`.
    pub fn remove_vm_dir(&self, dir: &std::path::Path, label: &str) {
        let logs = self.cfg.state_dir.join("log");
        if std::fs::create_dir_all(&logs).is_ok() {
            let _ = std::fs::copy(dir.join("qemu.log"), logs.join(format!("{label}.qemu.log")));
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    pub async fn host_info(&self) -> HostInfo {
        let vms = self.list_vms().await;
        let reserved = self.state.lock().await.reserved();
        HostInfo {
            name: self.cfg.name.clone(),
            agent_url: self.cfg.url.clone(),
            memory_total: self.cfg.memory,
            memory_reserved: reserved,
            memory_free: self.cfg.memory.saturating_sub(reserved),
            nics: self.nics(),
            vms,
            bandwidth: ferry_api::util::lock(&self.classes).policy().clone(),
            probe_port: self.cfg.probe_port,
            paths: self.paths.all(),
            features: vec![
                ferry_api::FEATURE_QEMU_ZSTD.into(),
                ferry_api::FEATURE_STREAM_WINDOWS.into(),
                ferry_api::FEATURE_QEMU_CHANNELS.into(),
            ],
            grants: Some(self.cfg.grants.clone()),
        }
    }

    /// Sets the bandwidth policy and applies it at once.
    pub async fn set_bandwidth(
        &self,
        p: ferry_api::bandwidth::BandwidthPolicy,
    ) -> Result<ferry_api::bandwidth::HostBandwidth, ApiError> {
        p.check()?;
        let classes = self.classes.clone();
        let host = self.cfg.name.clone();
        tokio::task::spawn_blocking(move || {
            let mut c = ferry_api::util::lock(&classes);
            c.set_policy(p);
            c.reconcile();
            c.status(&host)
        })
        .await
        .map_err(ApiError::internal)
    }

    pub async fn bandwidth(&self) -> Result<ferry_api::bandwidth::HostBandwidth, ApiError> {
        let classes = self.classes.clone();
        let host = self.cfg.name.clone();
        let mut b =
            tokio::task::spawn_blocking(move || ferry_api::util::lock(&classes).status(&host))
                .await
                .map_err(ApiError::internal)?;
        b.cpu_busy = self.idle.idle().map(|i| 1.0 - i);
        Ok(b)
    }
}

/// Time a new guest has to boot and fill its memory.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(180);

/// Waits until the guest workload prints its first tick (it has filled its
/// memory and runs), so a created VM is ready to check or move.
async fn wait_workload(
    guest: &dyn GuestCheck,
    vm: &QemuVm,
    timeout: Duration,
) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let state = guest.read(&read_tail(&vm.console_path(), 64 << 10).unwrap_or_default());
        if !state.problems.is_empty() {
            return Err(state.problems.join(" | "));
        }
        if state.last.is_some() || !guest.has_progress() {
            return Ok(());
        }
        if !vm.alive().await {
            return Err("QEMU exited".into());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("no workload tick within {} s", timeout.as_secs()));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub use crate::facts::*;
pub use ferry_api::util::error_chain;

/// How often the check looks at the guest again: a move's report (and a
/// drain's end) waits for it.
const CHECK_POLL: Duration = Duration::from_millis(50);

/// Has the workload's counter advanced: past the first tick seen during
/// the check, or past `after` (its last tick on the host it came from)?
fn counted(
    first: Option<crate::guest::Progress>,
    last: Option<crate::guest::Progress>,
    after: Option<u64>,
) -> bool {
    match (first, last) {
        (Some(a), Some(b)) if b.tick > a.tick => true,
        (_, Some(b)) => after.is_some_and(|n| b.tick > n),
        _ => false,
    }
}

/// Checks a guest: QEMU's run state, the guest advancing, and no integrity
/// error or panic on its console (as `guest` reads it).
///
/// "Advancing" is the workload's counter for the lab's workload guest
/// (waits up to `wait` for a tick, then a newer one — or for one past
/// `after`, the last tick the guest printed elsewhere: a guest just moved
/// here prints to a console of its own on this host, so a tick past the
/// source's last is one it counted here); for any other guest,
/// CPU time spent by its vCPU threads during the check. A guest with the
/// guest agent must also answer `guest-ping`, and its clock
/// (`guest-get-time`) must move forward.
pub async fn check(
    guest: &dyn GuestCheck,
    host: &str,
    spec: &VmSpec,
    q: &QemuVm,
    wait: Duration,
    after: Option<u64>,
) -> CheckResult {
    let workload = spec.is_workload() && guest.has_progress();
    let counted = |first, last| counted(first, last, after);
    let qemu_status = match q.qmp.status().await {
        Ok(s) => s.status,
        Err(_) => "unreachable".into(),
    };
    let deadline = tokio::time::Instant::now() + wait;
    let path = q.console_path();
    // an unreadable console is a failed check, never a skipped one
    let mut unreadable = None;
    let mut read = || match read_tail(&path, 256 << 10) {
        Ok(text) => guest.read(&text),
        Err(e) => {
            unreadable = Some(format!("console {} unreadable: {e}", path.display()));
            Reading::default()
        }
    };
    let mut first = None;
    let mut state = read();
    let vcpu_start = vcpu_cpu(q).await;
    let mut vcpu_ms = None;
    loop {
        if first.is_none() {
            first = state.last;
        }
        let advanced = if workload {
            counted(first, state.last)
        } else {
            let now = vcpu_cpu(q).await;
            vcpu_ms = match (vcpu_start, now) {
                (Some(a), Some(b)) => Some(b.saturating_sub(a).as_millis() as u64),
                _ => None,
            };
            vcpu_ms.is_some_and(|ms| ms > 0)
        };
        let done = advanced || !state.problems.is_empty();
        if done || tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(CHECK_POLL).await;
        state = read();
    }
    if let Some(why) = unreadable {
        state.problems.push(why);
    }
    let guest_agent = if spec.guest_agent {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let r = ask_guest_agent(q, left.max(Duration::from_secs(3))).await;
        if let Err(why) = &r {
            state.problems.push(format!("guest agent: {why}"));
        }
        Some(r.is_ok())
    } else {
        None
    };
    // integrity errors since boot are in the tick's counter; a panic stops the ticks
    let last = state.last;
    let errors = if workload {
        last.map(|t| t.errors).unwrap_or(0)
    } else {
        0
    };
    let running = qemu_status == "running";
    let advancing = if workload {
        counted(first, last)
    } else {
        vcpu_ms.is_some_and(|ms| ms > 0)
    };
    CheckResult {
        vm: spec.name.clone(),
        host: host.into(),
        running,
        qemu_status,
        tick_first: first.filter(|_| workload).map(|t| t.tick),
        tick_last: last.filter(|_| workload).map(|t| t.tick),
        sweeps: last.filter(|_| workload).map(|t| t.sweeps),
        errors,
        advancing,
        intact: errors == 0
            && state.problems.is_empty()
            && (!workload || last.is_some())
            && running,
        problems: state.problems,
        vcpu_ms,
        guest_agent,
    }
}

/// CPU time the VM's vCPU threads have used so far (`query-cpus-fast`
/// names them; `/proc/PID/task/TID/stat` counts them).
async fn vcpu_cpu(q: &QemuVm) -> Option<Duration> {
    let vcpus = q.qmp.vcpus().await.ok()?;
    let mut total = Duration::ZERO;
    for v in vcpus {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/task/{}/stat", q.pid, v.thread_id)).ok()?;
        total += cpu_of_stat(&stat)?;
    }
    Some(total)
}

/// The guest agent answers a ping and its clock moves forward.
async fn ask_guest_agent(q: &QemuVm, wait: Duration) -> Result<(), String> {
    let sock = q.dir.join(crate::qemu::QGA_SOCK);
    let mut a = crate::qga::Qga::connect(&sock, wait)
        .await
        .map_err(|e| e.to_string())?;
    a.ping().await.map_err(|e| e.to_string())?;
    let t0 = a.time_ns().await.map_err(|e| e.to_string())?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t1 = a.time_ns().await.map_err(|e| e.to_string())?;
    if t1 > t0 {
        Ok(())
    } else {
        Err(format!("its clock did not advance ({t0} then {t1})"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counter_advances_past_the_first_tick_seen_or_the_sources_last() {
        let t = |tick| {
            Some(crate::guest::Progress {
                tick,
                ..Default::default()
            })
        };
        assert!(counted(t(5), t(6), None));
        assert!(!counted(t(5), t(5), None), "one tick is no progress");
        assert!(!counted(None, None, Some(4)));
        // a guest just moved here: its first tick on this console is past the source's last
        assert!(counted(t(5), t(5), Some(4)));
        assert!(!counted(t(4), t(4), Some(4)), "the source's own last tick");
        assert!(!counted(t(3), t(3), Some(4)), "a counter gone back");
    }
}
