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

use ferry_api::{ApiError, HostInfo, NicInfo, VmSpec};

use crate::guest::GuestCheck;
use crate::qemu::QemuVm;
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
    pub(crate) fn settled_qemu(&self, name: &str) -> Result<Arc<QemuVm>, ApiError> {
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
    /// One client per peer agent, by (name, URL) (see [`Agent::peer`]).
    peers: std::sync::Mutex<std::collections::HashMap<(String, String), ferry_net::client::Client>>,
    pub state: tokio::sync::Mutex<HostState>,
    pub sinks: crate::validate::Sinks,
    /// Bandwidth classes on this host's NICs.
    pub classes: Arc<std::sync::Mutex<crate::classes::Classes>>,
    /// The migrations room.
    pub moves: Migrations,
    /// Reads guests' consoles for the guest check.
    pub guest: Arc<dyn GuestCheck>,
    /// The host facts room (what is measured as the agent runs).
    pub facts: Facts,
    /// The HA lease the control service renews (see [`crate::lease`]).
    pub lease: Arc<crate::lease::Lease>,
}

/// The migrations room: what moves keep between requests.
pub struct Migrations {
    /// Every migration's commit record (see [`crate::commit`]).
    pub journal: crate::commit::Journal,
    /// Incoming post-copies listening for a recovery stream: id → (NIC, URI).
    pub recovering: tokio::sync::Mutex<BTreeMap<String, (String, String)>>,
    /// Migrations a move of this process is driving now (by id).
    pub live: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// Switch-overs seen per target, for the next move's downtime budget.
    pub switchovers: crate::downtime::Learned,
}

/// The host facts room: what the agent measures as it runs (the facts read
/// from the kernel at each ask are `crate::facts`).
#[derive(Default)]
pub struct Facts {
    /// NIC pairs to peers, as probed (see [`crate::probe`]).
    pub paths: Arc<crate::probe::PathCache>,
    /// The CPU models QEMU can run here, asked once (see [`crate::hardware`]).
    pub(crate) cpus: tokio::sync::OnceCell<Result<Arc<crate::hardware::CpuCatalog>, String>>,
    /// The host's idle CPU share over the last second.
    pub idle: IdleGauge,
    /// Each guest's dirty page rate as last measured, bytes/s (see
    /// [`crate::vms`]'s sampler).
    pub dirty: std::sync::Mutex<std::collections::HashMap<String, u64>>,
}

impl Agent {
    /// The client for peer agent `name` at `url`, made once: every move to
    /// or from that peer, a waiting skeleton's questions and a settling's
    /// share its HTTP/2 connection rather than each paying a TLS handshake.
    pub fn peer(&self, name: &str, url: &str) -> ferry_net::client::Client {
        ferry_api::util::lock(&self.peers)
            .entry((name.to_string(), url.to_string()))
            .or_insert_with(|| {
                ferry_net::client::Client::new(
                    &format!("agent {name}"),
                    url,
                    self.client_auth.clone(),
                )
            })
            .clone()
    }

    pub fn new(
        cfg: AgentConfig,
        cred: ferry_api::auth::Credential,
        pki: Option<ferry_net::tls::Pki>,
        guest: Arc<dyn GuestCheck>,
    ) -> Result<Arc<Agent>, ferry_net::tls::TlsError> {
        let client_auth = ferry_net::client::ClientAuth::component(pki.as_ref(), &cred)?;
        let tickets = pki
            .as_ref()
            .map(|p| ferry_net::ticket::TicketVerifier::with_verifier(p.client_verifier()));
        Ok(Arc::new(Agent {
            cred,
            pki,
            tickets,
            client_auth,
            peers: Default::default(),
            guest,
            facts: Default::default(),
            lease: Arc::new(crate::lease::Lease::load(&cfg.state_dir)),
            moves: Migrations {
                journal: crate::commit::Journal::new(&cfg.state_dir),
                recovering: Default::default(),
                live: Default::default(),
                switchovers: Default::default(),
            },
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

    /// The CPU models QEMU can run on this host.
    pub async fn cpu_catalog(&self) -> Result<Arc<crate::hardware::CpuCatalog>, String> {
        self.facts
            .cpus
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
            Ok(cat) => {
                missing.extend(crate::hardware::cpu_problem(
                    &cat,
                    self.cfg.cpu_models.as_deref(),
                    &spec.cpu,
                    source,
                ));
                missing.extend(crate::hardware::vcpu_problem(&cat, spec));
            }
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

    /// This host's migration NICs (see [`nics`]).
    pub fn nics(&self) -> Vec<NicInfo> {
        nics(&self.cfg.nics)
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
            cpus: host_cpus() as u32,
            nics: self.nics(),
            nic_rate: self.cfg.nic_rate,
            vms,
            bandwidth: ferry_api::util::lock(&self.classes).policy().clone(),
            probe_port: self.cfg.probe_port,
            paths: self.facts.paths.all(),
            features: vec![
                ferry_api::FEATURE_QEMU_ZSTD.into(),
                ferry_api::FEATURE_STREAM_WINDOWS.into(),
                ferry_api::FEATURE_QEMU_CHANNELS.into(),
                ferry_api::FEATURE_SWITCHOVER_HOLD.into(),
            ],
            grants: Some(self.cfg.grants.clone()),
            certificate_expires_ms: self.pki.as_ref().and_then(|p| p.expires_ms()),
            certificate_serial: self.pki.as_ref().and_then(|p| p.serial()),
            crl_number: self.pki.as_ref().and_then(|p| p.crl_number()),
            lease: Some(self.lease.view()),
        }
    }
}

pub use crate::facts::*;
pub use ferry_api::util::error_chain;

#[cfg(test)]
impl Agent {
    /// An agent with no NIC, no QEMU started and no TLS, its journal and
    /// lease in `state_dir`: for tests of its tables and records.
    pub(crate) fn for_tests(state_dir: &std::path::Path) -> Arc<Agent> {
        let cfg = AgentConfig {
            name: "host2".into(),
            listen: "127.0.0.1:0".parse().expect("an address"),
            url: "http://127.0.0.1:0".into(),
            state_dir: state_dir.into(),
            memory: 64 << 30,
            nic_rate: None,
            qemu: crate::qemu::QemuConfig::for_tests(state_dir.join("disks")),
            nics: Default::default(),
            probe_port: 0,
            storage_nic: None,
            cpu_models: None,
            grants: Default::default(),
            console_log_max: crate::guest::CONSOLE_LOG_MAX,
            storage_pause_max: crate::resilience::STORAGE_PAUSE_MAX,
            limits: Default::default(),
            reorder_window: 0,
        };
        Agent::new(
            cfg,
            ferry_api::auth::Credential::generate(),
            None,
            Arc::new(crate::guest::NoWorkload),
        )
        .expect("an agent without TLS")
    }
}
