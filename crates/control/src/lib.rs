//! Ferry's control service: the one command API in front of the agents.
//!
//! Front ends (the CLI now; the web page later) send [`Command`]s over REST
//! (`/api/v1`); [`Control::execute`] is the one place each is carried out.
//! The registry of hosts comes from the cluster configuration (for a lab,
//! its `lab.json`); the agents are the source of truth for where VMs run, so
//! the control service asks them rather than keeping a copy that could go
//! stale. Durable cluster state (SQLite/etcd), heartbeats and the event log
//! grow here.

pub mod access;
pub mod assets;
pub mod bandwidth;
mod certs;
mod disk_move;
pub mod drain;
mod drain_run;
pub mod ha;
pub mod http;
pub mod leader;
pub mod limits;
pub mod metrics;
pub mod operations;
pub mod placement;
mod placement_run;
pub mod policy_manager;
mod resilience;
pub mod rolling;
pub mod sessions;
pub mod storage;
pub mod store;
pub mod tokens;
pub mod validate;
mod validate_run;

use std::collections::BTreeMap;
use std::time::Duration;

use ferry_api::auth::TokenRole;
use ferry_api::drain::{DrainEvent, DrainRequest, HostSettings};
use ferry_api::validation::{CheckOutcome, ValidationReport};
use ferry_api::{
    ApiError, CheckResult, ConsoleTail, HostEntry, HostInfo, MigrateRequest, MigrationEvent,
    MoveRequest, OperationKind, ValidateRequest, VmCreateRequest, VmInfo,
};
use ferry_net::client::{Client, ClientAuth};
use futures::stream::BoxStream;
use futures::StreamExt;
use std::sync::Arc;
use tokens::Caller;

const AGENT_TIMEOUT: Duration = Duration::from_secs(5);
/// A heartbeat (a `/host` call) that takes longer than this is missed.
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(2);

/// Every operation the control service offers, whatever the front end.
#[derive(Debug, Clone)]
pub enum Command {
    ListHosts,
    ListVms,
    CreateVm(Box<VmCreateRequest>),
    CheckVm {
        name: String,
    },
    /// Shows and settles a migration of the VM left in doubt (on every host
    /// that has a record of it).
    ResolveVm {
        name: String,
        req: ferry_api::ResolveRequest,
    },
    RemoveVm {
        name: String,
    },
    /// Start, stop, shut down, reboot or restart a VM (see [`ha`]).
    VmAction {
        name: String,
        action: ferry_api::ha::Action,
        req: ferry_api::ha::ActionRequest,
    },
    SetVmHa {
        name: String,
        update: ferry_api::ha::HaUpdate,
    },
    MoveVm {
        name: String,
        req: MoveRequest,
    },
    Validate(ValidateRequest),
    Drain {
        host: String,
        req: DrainRequest,
    },
    Resume {
        host: String,
    },
    /// A rolling drain of the cluster (see [`rolling`]).
    StartRolling(ferry_api::rolling::RollingRequest),
    RollingStatus,
    StopRolling,
    SetHost {
        host: String,
        settings: HostSettings,
    },
    /// Disks, QoS policies and flows (see [`storage`]).
    Storage(storage::StorageCommand),
    /// Prometheus text exposition of the cluster (see [`metrics`]).
    Metrics,
    /// Migrations and drains, running and recent (see [`operations`]).
    ListOperations,
    GetOperation {
        id: String,
    },
    /// The end of a VM's serial console, at most `bytes`.
    ConsoleTail {
        name: String,
        bytes: u64,
    },
    /// The newest `limit` entries of the event log.
    Events {
        limit: usize,
    },
    /// Bandwidth classes: the policy and what each host enforces and sends.
    ListBandwidth,
    SetBandwidth(ferry_api::bandwidth::BandwidthSetRequest),
    /// Settings of the whole cluster (encrypted carriers).
    GetCluster,
    ControlStatus,
    SetCluster(ferry_api::ClusterSettingsUpdate),
    /// Certificates renewed with the CA's key kept by an admin (see `certs`).
    CertRequests,
    InstallCerts(Vec<ferry_api::certs::SignedCert>),
    /// The revocation list, kept and pushed to every component.
    GetCrl,
    SetCrl(ferry_api::certs::CrlInstall),
    /// Users' API tokens (see [`tokens`]).
    ListTokens,
    CreateToken(ferry_api::auth::TokenCreateRequest),
    RevokeToken {
        name: String,
    },
    /// Placement rules, host groups and labels (see `placement_run`).
    GetPlacement,
    CreateRule(ferry_api::placement::Rule),
    RemoveRule {
        name: String,
    },
    SetGroup(ferry_api::placement::HostGroup),
    RemoveGroup {
        name: String,
    },
    SetLabels {
        host: String,
        update: ferry_api::placement::LabelUpdate,
    },
    /// The balancer: a plan, run unless a dry run.
    Balance(ferry_api::placement::BalanceRequest),
}

/// Whether `caller`'s role may run `cmd`: `Forbidden` naming the role
/// needed when it is weaker.
pub(crate) fn permitted(caller: &Caller, cmd: &Command) -> Result<(), ApiError> {
    let (needed, action) = cmd.needs();
    if caller.role < needed {
        return Err(ApiError::Forbidden {
            caller: format!("token {}", caller.name),
            role: caller.role.to_string(),
            action,
            needed: needed.to_string(),
        });
    }
    Ok(())
}

impl Command {
    /// The role a token needs to run this command, and what it is called
    /// in refusals and the event log.
    pub fn needs(&self) -> (TokenRole, String) {
        use TokenRole::*;
        match self {
            Command::ListHosts => (ReadOnly, "list hosts".into()),
            Command::ListVms => (ReadOnly, "list VMs".into()),
            Command::CheckVm { name } => (ReadOnly, format!("check VM {name}")),
            Command::Metrics => (ReadOnly, "read metrics".into()),
            Command::Events { .. } => (ReadOnly, "read the event log".into()),
            Command::ListOperations => (ReadOnly, "list operations".into()),
            Command::GetOperation { id } => (ReadOnly, format!("read operation {id}")),
            // a guest's console may print what it keeps from onlookers
            // (passwords made at first boot): an operator's, as moving it is
            Command::ConsoleTail { name, .. } => (Operator, format!("read VM {name}'s console")),
            Command::ListBandwidth => (ReadOnly, "list bandwidth classes".into()),
            Command::GetCluster => (ReadOnly, "read cluster settings".into()),
            Command::ControlStatus => (ReadOnly, "read the control instances' leader".into()),
            Command::CreateVm(r) => (Operator, format!("create VM {}", r.spec.name)),
            // declaring a host lost can run two copies if it is not: an admin's word
            Command::ResolveVm { name, req } => match &req.target_lost {
                Some(h) => (
                    Admin,
                    format!("declare {h} lost and resume VM {name} on its source"),
                ),
                None if req.target_has_all => (
                    Admin,
                    format!("confirm VM {name}'s target has every page and stop its source QEMU"),
                ),
                None => (Operator, format!("resolve VM {name}")),
            },
            Command::RemoveVm { name } => (Operator, format!("remove VM {name}")),
            // starting a VM away from a host that does not answer can run
            // two copies if it is not off: an admin's word
            Command::VmAction { name, req, .. } if req.confirm_powered_off => (
                Admin,
                format!("confirm VM {name}'s host is powered off and start it elsewhere"),
            ),
            Command::VmAction { name, action, .. } => {
                (Operator, format!("{} VM {name}", action.as_str()))
            }
            Command::SetVmHa { name, .. } => (Operator, format!("set VM {name}'s HA policy")),
            Command::MoveVm { name, req } => (Operator, format!("move VM {name} to {}", req.to)),
            Command::Validate(_) => (Operator, "validate hosts".into()),
            Command::Drain { host, .. } => (Operator, format!("drain host {host}")),
            Command::Resume { host } => (Operator, format!("resume host {host}")),
            // a hook is a program the control service runs: an admin's choice
            Command::StartRolling(r) if r.hook.is_some() => {
                (Admin, "start a rolling drain with a hook".into())
            }
            Command::StartRolling(_) => (Operator, "start a rolling drain".into()),
            Command::RollingStatus => (ReadOnly, "read the rolling drain".into()),
            Command::StopRolling => (Operator, "stop the rolling drain".into()),
            Command::Storage(crate::storage::StorageCommand::Backup { name, .. }) => {
                // the storage node writes a file where it is told
                (Admin, format!("back up disk {name} to a path on its node"))
            }
            Command::Storage(c) => match c.mutation() {
                Some((subject, action)) => (Operator, format!("{action} {subject}")),
                None => (ReadOnly, "read storage".into()),
            },
            Command::SetHost { host, .. } => (Admin, format!("set host {host}")),
            Command::SetBandwidth(_) => (Admin, "set bandwidth classes".into()),
            Command::SetCluster(_) => (Admin, "set cluster settings".into()),
            Command::CertRequests => (Admin, "renew the cluster's certificates".into()),
            Command::InstallCerts(_) => (Admin, "install renewed certificates".into()),
            Command::GetCrl => (ReadOnly, "read the revocation list".into()),
            Command::SetCrl(_) => (Admin, "revoke certificates".into()),
            Command::ListTokens => (Admin, "list tokens".into()),
            Command::CreateToken(r) => (Admin, format!("create token {}", r.name)),
            Command::RevokeToken { name } => (Admin, format!("revoke token {name}")),
            Command::GetPlacement => (ReadOnly, "read placement rules".into()),
            Command::CreateRule(r) => (Operator, format!("create rule {}", r.name)),
            Command::RemoveRule { name } => (Operator, format!("remove rule {name}")),
            Command::SetGroup(g) => (Operator, format!("set host group {}", g.name)),
            Command::RemoveGroup { name } => (Operator, format!("remove host group {name}")),
            Command::SetLabels { host, .. } => (Operator, format!("label host {host}")),
            Command::Balance(r) if r.dry_run => (ReadOnly, "plan a balance".into()),
            Command::Balance(_) => (Operator, "balance the cluster".into()),
        }
    }
}

/// What a command produces: one JSON value, or a stream of events (one JSON
/// value each: migration or drain events).
pub enum Outcome {
    Value(serde_json::Value),
    /// Plain text (metrics).
    Text(String),
    Events(BoxStream<'static, serde_json::Value>),
    /// A migration or drain started (see [`operations`]): its events as it
    /// sends them, and its id for anyone else to follow.
    Operation(Arc<operations::Op>),
}

fn to_json<T: serde::Serialize>(e: T) -> serde_json::Value {
    serde_json::to_value(e)
        .unwrap_or_else(|e| serde_json::json!({"event": "failed", "error": e.to_string()}))
}

fn value<T: serde::Serialize>(v: T) -> Result<Outcome, ApiError> {
    serde_json::to_value(v)
        .map(Outcome::Value)
        .map_err(ApiError::internal)
}

const DAY_MS: u64 = 86_400_000;

/// Days left of a certificate ending at `expires` (Unix ms), when that is
/// within [`ferry_api::CERT_WARN_DAYS`] (0 once it has ended).
pub fn expiring(now: u64, expires: u64) -> Option<u64> {
    let left = expires.saturating_sub(now);
    (left < ferry_api::CERT_WARN_DAYS * DAY_MS).then_some(left / DAY_MS)
}

pub struct Control {
    hosts: BTreeMap<String, Client>,
    /// Storage nodes by name.
    storage: BTreeMap<String, Client>,
    /// Durable state: draining marks, host settings, the event log.
    store: Arc<store::Store>,
    /// Hosts seen down at the last heartbeat round (to log transitions).
    down: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// When each agent last answered.
    heartbeats: std::sync::Mutex<BTreeMap<String, std::time::Instant>>,
    /// Migrations and drains, running and recent, with their events.
    operations: operations::Operations,
    /// Migrations and drains as their events passed through.
    recorder: std::sync::Mutex<metrics::Recorder>,
    /// Allocations the policy manager pushed, by (node, flow).
    allocations: tokio::sync::Mutex<BTreeMap<(String, String), ferry_api::storage::Allocation>>,
    /// The latest validation, consulted before migrations.
    last_validation: tokio::sync::Mutex<Option<ValidationReport>>,
    /// Hosts being drained (or drained and not resumed): they take no VMs.
    draining: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// Hosts whose expiring certificate was warned of, and on which day.
    cert_warned: std::sync::Mutex<BTreeMap<String, u64>>,
    settings: std::sync::Mutex<BTreeMap<String, HostSettings>>,
    /// The cluster's bandwidth classes (see [`bandwidth`]).
    bandwidth: std::sync::Mutex<ferry_api::bandwidth::BandwidthPolicy>,
    /// Users' API tokens.
    pub tokens: tokens::Tokens,
    /// Which host may open which VM's disks (see [`access`]).
    access: access::Access,
    /// Guests paused for their storage, as logged (see [`resilience`]).
    pauses: resilience::Logged,
    /// Disks moved between storage nodes (see [`disk_move`]).
    disk_moves: disk_move::DiskMoves,
    /// The cluster's rolling drain (see [`rolling`]).
    rolling: rolling::Rolling,
    /// Event streams open per token (see [`limits`]).
    pub(crate) streams: limits::Streams,
    /// Refusals per source, so a flood cannot push real events out.
    refusals: limits::Refusals,
    /// Where the programs a rolling drain may run as hooks are (see
    /// [`rolling::resolve_hook`]).
    hooks_dir: std::path::PathBuf,
    /// VM records, leases and failovers (see [`ha`]).
    pub(crate) ha: ha::Ha,
    /// Leadership among the instances sharing the store (see [`leader`]).
    pub(crate) leader: leader::Leadership,
    /// Each VM's CPU use, for the placement engine (see [`placement_run`]).
    pub(crate) usage: std::sync::Mutex<placement_run::Usage>,
    /// The balancer's state: one run at a time, hysteresis, cooldowns.
    pub(crate) balancer: std::sync::Mutex<placement_run::Balancer>,
    /// Signs each move's ticket (see [`ferry_net::ticket`]); `None` under
    /// `--insecure-http`, where agents ask for none.
    tickets: Option<Arc<ferry_net::ticket::LiveSigner>>,
    /// This service's certificate (renewed by `POST /cluster/certificates`).
    pki: Option<ferry_net::tls::Pki>,
    /// The revocation list's number each storage node last took (agents
    /// report theirs in `HostInfo`).
    crl_pushed: std::sync::Mutex<BTreeMap<String, u64>>,
    /// Event streams one token may hold open (`max_streams_per_token`).
    pub(crate) max_streams_per_token: usize,
    /// The web console's signed-in browsers (see [`sessions`]).
    pub sessions: sessions::Sessions,
    /// Session cookies say `Secure` (the service speaks TLS).
    pub secure_cookies: std::sync::atomic::AtomicBool,
}

impl Control {
    /// `hosts`: (name, agent URL) for every registered host.
    pub fn new(hosts: Vec<(String, String)>, auth: ClientAuth) -> Control {
        Control::with_storage(hosts, Vec::new(), auth)
    }

    /// `storage`: (name, REST URL) of every storage node.
    pub fn with_storage(
        hosts: Vec<(String, String)>,
        storage: Vec<(String, String)>,
        auth: ClientAuth,
    ) -> Control {
        let clients = |list: Vec<(String, String)>, kind: &str| {
            list.into_iter()
                .map(|(n, url)| {
                    let c = Client::new(&format!("{kind} {n}"), &url, auth.clone());
                    (n, c)
                })
                .collect()
        };
        Control {
            hosts: clients(hosts, "agent"),
            storage: clients(storage, "storage node"),
            allocations: Default::default(),
            operations: Default::default(),
            recorder: Default::default(),
            heartbeats: Default::default(),
            cert_warned: Default::default(),
            store: Arc::new(store::Store::in_memory()),
            tokens: Default::default(),
            access: Default::default(),
            pauses: Default::default(),
            disk_moves: Default::default(),
            rolling: Default::default(),
            hooks_dir: rolling::DEFAULT_HOOKS_DIR.into(),
            tickets: None,
            ha: Default::default(),
            leader: leader::Leadership::new("control"),
            usage: Default::default(),
            balancer: Default::default(),
            pki: None,
            crl_pushed: Default::default(),
            max_streams_per_token: limits::MAX_STREAMS_PER_TOKEN,
            streams: Default::default(),
            refusals: Default::default(),
            sessions: Default::default(),
            secure_cookies: std::sync::atomic::AtomicBool::new(true),
            down: Default::default(),
            last_validation: Default::default(),
            draining: Default::default(),
            settings: Default::default(),
            bandwidth: Default::default(),
        }
    }

    /// Takes rolling-drain hooks from `dir` (default [`rolling::DEFAULT_HOOKS_DIR`]).
    pub fn with_hooks_dir(mut self, dir: std::path::PathBuf) -> Control {
        self.hooks_dir = dir;
        self
    }

    /// This instance's name among several sharing a store (in the leader
    /// key and the events it logs as leader).
    pub fn with_instance(mut self, name: String) -> Control {
        self.leader.me = name;
        self
    }

    /// At most `n` event streams per token (default [`limits::MAX_STREAMS_PER_TOKEN`]).
    pub fn with_max_streams_per_token(mut self, n: usize) -> Control {
        self.max_streams_per_token = n;
        self
    }

    /// This service's certificate: it signs move tickets with its key, and
    /// renews it with the cluster's (see `certs`).
    pub fn with_pki(
        mut self,
        pki: ferry_net::tls::Pki,
    ) -> Result<Control, ferry_net::tls::TlsError> {
        self.tickets = Some(Arc::new(ferry_net::ticket::LiveSigner::new(&pki)?));
        self.pki = Some(pki);
        Ok(self)
    }

    /// Keeps state in `store` instead of memory, taking up what it holds.
    pub async fn with_store(mut self, store: store::Store) -> Result<Control, ApiError> {
        self.store = Arc::new(store);
        self.operations.keep_in(self.store.clone());
        self.reload().await?;
        Ok(self)
    }

    /// Takes up draining marks and settings from the store (another control
    /// instance sharing it may have changed them).
    async fn reload(&self) -> Result<(), ApiError> {
        let draining = self.store.draining().await?;
        let settings = self.store.settings().await?;
        *lock(&self.draining) = draining;
        *lock(&self.settings) = settings;
        self.tokens.reload(&self.store).await?;
        self.reload_bandwidth().await
    }

    /// Appends to the event log; a log that cannot be written is reported
    /// in the service's log, never failing the operation it describes.
    fn log(&self, kind: &str, subject: &str, detail: serde_json::Value) {
        let store = self.store.clone();
        let (kind, subject) = (kind.to_string(), subject.to_string());
        tokio::spawn(async move {
            if let Err(e) = store.log(&kind, &subject, detail).await {
                tracing::warn!("event log: {e}");
            }
        });
    }

    /// A request refused for its credential, in the event log; `source`
    /// is the client's address.
    pub(crate) fn log_refusal(&self, source: &str, path: &str, e: &ApiError) {
        self.log_refused(
            source,
            path,
            serde_json::json!({ "status": e.http_status(), "reason": e.to_string() }),
        );
    }

    /// One refused request from `source` in the event log, unless `source`
    /// has had its share of this window (then it is counted; see [`limits`]).
    pub(crate) fn log_refused(&self, source: &str, subject: &str, detail: serde_json::Value) {
        let (one, closed) = self.refusals.note(
            source,
            detail,
            std::time::Instant::now(),
            limits::REFUSAL_WINDOW,
        );
        if let Some(c) = closed {
            self.log("refused", source, c);
        }
        if let Some(d) = one {
            self.log("refused", subject, d);
        }
    }

    /// Makes the first admin token from the file `control.toml` names (see
    /// [`tokens`]).
    pub async fn bootstrap_admin(&self, secret: &str) -> Result<bool, ApiError> {
        self.tokens.bootstrap(&self.store, secret).await
    }

    /// One heartbeat round: logs hosts going down or coming back, and takes
    /// up state other control instances wrote.
    pub async fn heartbeat(self: &Arc<Self>) {
        if let Err(e) = self.reload().await {
            tracing::warn!("control state: {e}");
        }
        let asked = std::time::Instant::now();
        let hosts = self.list_hosts().await;
        self.note_hosts(&hosts);
        if !self.leading() {
            // the leader writes what the heartbeat finds (see [`leader`])
            return;
        }
        self.sync_records(&hosts).await;
        self.save_probe_addrs().await;
        self.align_bandwidth(&hosts).await;
        self.sync_access(&hosts, asked).await;
        self.resume_rolling().await;
        self.auto_balance(&hosts).await;
        self.log_pauses(&hosts);
        self.warn_expiring(&hosts);
        for s in self
            .refusals
            .flush(std::time::Instant::now(), limits::REFUSAL_WINDOW)
        {
            let source = s["source"].as_str().unwrap_or("?").to_string();
            self.log("refused", &source, s);
        }
        {
            let mut down = lock(&self.down);
            for h in &hosts {
                let was = down.contains(&h.name);
                if h.down && !was {
                    down.insert(h.name.clone());
                    tracing::warn!(host = %h.name, "no heartbeat: nothing is scheduled onto it");
                    self.log(
                    "host_down",
                    &h.name,
                    serde_json::json!({ "last_heartbeat_ms": h.last_heartbeat_ms, "error": h.error }),
                );
                } else if !h.down && was {
                    down.remove(&h.name);
                    self.log("host_up", &h.name, serde_json::json!({}));
                }
            }
        }
        let nodes = self.storage_nodes().await;
        for n in &nodes {
            let key = format!("storage:{}", n.name);
            let was = lock(&self.down).contains(&key);
            if !n.reachable && !was {
                lock(&self.down).insert(key);
                tracing::warn!(node = %n.name, "storage node does not answer");
                self.log(
                    "storage_down",
                    &n.name,
                    serde_json::json!({ "error": n.error }),
                );
            } else if n.reachable && was {
                lock(&self.down).remove(&key);
                self.log("storage_up", &n.name, serde_json::json!({}));
            }
        }
        self.sync_crl(&hosts, &nodes).await;
    }

    /// An event `certificate_expiring` for each host whose certificate ends
    /// within [`ferry_api::CERT_WARN_DAYS`], once a day.
    fn warn_expiring(&self, hosts: &[HostEntry]) {
        let now = ferry_api::util::now_ms();
        let today = now / DAY_MS;
        let mut warned = lock(&self.cert_warned);
        for h in hosts {
            let Some(expires) = h.info.as_ref().and_then(|i| i.certificate_expires_ms) else {
                continue;
            };
            let Some(days_left) = expiring(now, expires) else {
                continue;
            };
            if warned.get(&h.name) == Some(&today) {
                continue;
            }
            warned.insert(h.name.clone(), today);
            tracing::warn!(host = %h.name, days_left, "its certificate expires soon: issue it a new one");
            self.log(
                "certificate_expiring",
                &h.name,
                serde_json::json!({ "expires_ms": expires, "days_left": days_left }),
            );
        }
    }

    /// The host takes VMs again (ends its maintenance in a rolling drain).
    pub(crate) async fn resume_host(&self, host: &str) -> Result<serde_json::Value, ApiError> {
        self.host(host)?;
        let was = lock(&self.draining).remove(host);
        self.store.set_draining(host, false).await?;
        let r = serde_json::json!({ "host": host, "was_draining": was });
        self.log("resume", host, r.clone());
        Ok(r)
    }

    fn refuse_draining(&self, host: &str) -> Result<(), ApiError> {
        if lock(&self.draining).contains(host) {
            return Err(ApiError::Conflict {
                reason: format!("{host} is draining and takes no VMs (`ferry host resume {host}`)"),
            });
        }
        Ok(())
    }

    pub(crate) fn host(&self, name: &str) -> Result<&Client, ApiError> {
        self.hosts
            .get(name)
            .ok_or_else(|| ApiError::not_found("host", name))
    }

    /// Runs `cmd` for `caller`: refused with `Forbidden` naming the role
    /// needed when the caller's is weaker; every change is written to the
    /// event log with the token that made it.
    pub async fn execute_as(
        self: &Arc<Self>,
        caller: &Caller,
        cmd: Command,
    ) -> Result<Outcome, ApiError> {
        let (needed, action) = cmd.needs();
        let source = format!("token {}", caller.name);
        if let Err(e) = permitted(caller, &cmd) {
            tracing::warn!(token = %caller.name, role = %caller.role, %action, "refused: role too weak");
            self.log_refused(
                &source,
                &action,
                serde_json::json!({ "by": caller.name, "role": caller.role, "action": action,
                                    "needs": needed, "status": 403 }),
            );
            return Err(e);
        }
        if needed == TokenRole::ReadOnly {
            return self.execute_by(cmd, &caller.name).await;
        }
        self.log(
            "command",
            &action,
            serde_json::json!({ "by": caller.name, "role": caller.role, "action": action }),
        );
        let r = self.execute_by(cmd, &caller.name).await;
        // a change refused at a boundary (a host's grants, a field's
        // format, a limit) is a refusal too, in the log with its reason
        if let Err(e) = &r {
            if matches!(e.http_status(), 400 | 403 | 412 | 429) {
                tracing::warn!(token = %caller.name, %action, "refused: {e}");
                self.log_refused(
                    &source,
                    &action,
                    serde_json::json!({ "by": caller.name, "role": caller.role, "action": action,
                                        "status": e.http_status(), "code": serde_json::to_value(e).ok().and_then(|v| v.get("code").cloned()),
                                        "reason": e.to_string() }),
                );
            }
        }
        r
    }

    /// Runs `cmd` as the control service itself (see [`Self::execute_as`]).
    pub async fn execute(self: &Arc<Self>, cmd: Command) -> Result<Outcome, ApiError> {
        self.execute_by(cmd, "control service").await
    }

    /// Runs `cmd`; `by` names who asked (on the operations it starts).
    async fn execute_by(self: &Arc<Self>, cmd: Command, by: &str) -> Result<Outcome, ApiError> {
        match cmd {
            Command::ListTokens => value(self.tokens.list()),
            Command::CreateToken(r) => {
                let t = self
                    .tokens
                    .create(&self.store, &r.name, r.role, None)
                    .await?;
                self.log("token", &r.name, serde_json::json!({ "created": t.info }));
                value(t)
            }
            Command::RevokeToken { name } => {
                let t = self.tokens.revoke(&self.store, &name).await?;
                self.log("token", &name, serde_json::json!({ "revoked": t }));
                value(t)
            }
            Command::GetPlacement => value(self.placement_status().await?),
            Command::CreateRule(r) => value(self.create_rule(r).await?),
            Command::RemoveRule { name } => value(self.remove_rule(&name).await?),
            Command::SetGroup(g) => value(self.create_group(g).await?),
            Command::RemoveGroup { name } => value(self.remove_group(&name).await?),
            Command::SetLabels { host, update } => value(self.set_labels(&host, update).await?),
            Command::Balance(r) => value(self.balance(r).await?),
            Command::ListHosts => value(self.list_hosts().await),
            Command::ListVms => value(self.list_all_vms().await?),
            Command::CreateVm(req) => value(self.create_vm(*req).await?),
            Command::VmAction { name, action, req } => {
                value(self.vm_action(&name, action, &req).await?)
            }
            Command::SetVmHa { name, update } => value(self.set_vm_ha(&name, &update).await?),
            Command::CheckVm { name } => value(self.check_vm(&name).await?),
            Command::ResolveVm { name, req } => value(self.resolve_vm(&name, &req).await?),
            Command::RemoveVm { name } => value(self.remove_vm(&name).await?),
            Command::MoveVm { name, req } => {
                let target = req.to.clone();
                let (source, events) = self.move_vm(&name, req).await?;
                let me = self.clone();
                let (vm, from, to) = (name.clone(), source.clone(), target.clone());
                let events = events
                    .map(move |ev| {
                        lock(&me.recorder).migration(&vm, &from, &to, &ev);
                        if matches!(
                            ev,
                            MigrationEvent::Completed(_) | MigrationEvent::Failed { .. }
                        ) {
                            let mut detail = to_json(&ev);
                            detail["source"] = from.clone().into();
                            detail["target"] = to.clone().into();
                            me.log("migration", &vm, detail);
                        }
                        to_json(ev)
                    })
                    .boxed();
                let start = operations::Start {
                    kind: OperationKind::Migration,
                    subject: name,
                    source,
                    target: Some(target),
                    by: by.into(),
                };
                Ok(Outcome::Operation(self.operations.start(
                    start,
                    events,
                    operations::migration_end,
                )))
            }
            Command::Validate(req) => value(self.validate(req).await?),
            Command::Drain { host, req } => {
                let events = self.clone().drain(host.clone(), req).await?;
                let me = self.clone();
                let h = host.clone();
                let events = events
                    .map(move |ev| {
                        lock(&me.recorder).drain(&h, &ev);
                        if let DrainEvent::Done(r) = &ev {
                            me.log("drain", &h, to_json(r));
                        }
                        to_json(ev)
                    })
                    .boxed();
                let start = operations::Start {
                    kind: OperationKind::Drain,
                    subject: host.clone(),
                    source: host,
                    target: None,
                    by: by.into(),
                };
                Ok(Outcome::Operation(self.operations.start(
                    start,
                    events,
                    operations::drain_end,
                )))
            }
            Command::ListOperations => value(self.operations.list().await),
            Command::GetOperation { id } => value(self.operations.get(&id).await?.snapshot()),
            Command::ConsoleTail { name, bytes } => value(self.console_tail(&name, bytes).await?),
            Command::Metrics => {
                let hosts = self.list_hosts().await;
                // an unreachable storage node hides its flows; the rest still count
                let flows: Vec<ferry_api::storage::FlowInfo> = self
                    .ask_every_node("/qos/flows", AGENT_TIMEOUT)
                    .await
                    .into_iter()
                    .flatten()
                    .flatten()
                    .collect();
                let text = metrics::render(&hosts, &flows, &lock(&self.recorder));
                Ok(Outcome::Text(text))
            }
            Command::Resume { host } => value(self.resume_host(&host).await?),
            Command::StartRolling(req) => value(self.start_rolling(req).await?),
            Command::RollingStatus => value(self.rolling_status().await?),
            Command::StopRolling => value(self.stop_rolling().await?),
            Command::ListBandwidth => value(self.list_bandwidth().await?),
            Command::SetBandwidth(req) => value(self.set_bandwidth(req).await?),
            Command::GetCluster => value(self.cluster_settings().await?),
            Command::ControlStatus => value(self.control_status().await?),
            Command::CertRequests => value(self.cert_requests().await?),
            Command::InstallCerts(signed) => value(self.install_certs(signed).await?),
            Command::GetCrl => value(self.crl().await?),
            Command::SetCrl(c) => value(self.set_crl(c.crl).await?),
            Command::SetCluster(u) => {
                u.validate()?;
                if let Some(h) = u.fence_hook.as_deref().filter(|h| !h.is_empty()) {
                    rolling::resolve_hook(&self.hooks_dir, h)
                        .map_err(|e| ApiError::invalid("fence_hook", e.to_string()))?;
                }
                let s = self.cluster_settings().await?.updated(&u);
                self.store.put_cluster(CLUSTER_KEY, &s).await?;
                self.log(
                    "cluster",
                    "settings",
                    serde_json::to_value(&s).unwrap_or_default(),
                );
                value(s)
            }
            Command::SetHost { host, settings } => {
                self.host(&host)?;
                let settings = lock(&self.settings)
                    .get(&host)
                    .cloned()
                    .unwrap_or_default()
                    .updated(&settings);
                settings.check()?;
                self.store.put_settings(&host, &settings).await?;
                lock(&self.settings).insert(host.clone(), settings.clone());
                let r = serde_json::json!({ "host": host, "settings": settings });
                self.log("settings", &host, r.clone());
                value(r)
            }
            Command::Storage(crate::storage::StorageCommand::MoveDisk { name, req }) => {
                Ok(Outcome::Events(self.start_disk_move(&name, &req.to).await?))
            }
            Command::Storage(c) => {
                let what = c.mutation();
                let r = self.storage_command(c).await?;
                if let Some((subject, action)) = what {
                    self.log(
                        "storage",
                        &subject,
                        serde_json::json!({ "action": action, "result": r }),
                    );
                }
                Ok(Outcome::Value(r))
            }
            Command::Events { limit } => value(self.store.events(limit.clamp(1, 10_000)).await?),
        }
    }

    /// Asks every agent; an answer is a heartbeat.
    pub async fn list_hosts(&self) -> Vec<HostEntry> {
        let calls = self.hosts.iter().map(|(name, c)| async move {
            let r = c.get::<HostInfo>("/host", HEARTBEAT_TIMEOUT).await;
            (name, c, r)
        });
        let answers = futures::future::join_all(calls).await;
        let mut beats = lock(&self.heartbeats);
        let draining = lock(&self.draining).clone();
        let settings = lock(&self.settings).clone();
        answers
            .into_iter()
            .map(|(name, c, r)| {
                if r.is_ok() {
                    beats.insert(name.clone(), std::time::Instant::now());
                }
                let age = beats.get(name).map(|t| t.elapsed().as_millis() as u64);
                HostEntry {
                    name: name.clone(),
                    agent_url: c.base().to_string(),
                    reachable: r.is_ok(),
                    down: age.is_none_or(|a| a >= ferry_api::HOST_DEAD_AFTER_MS),
                    last_heartbeat_ms: age,
                    draining: draining.contains(name),
                    settings: settings.get(name).cloned(),
                    error: r.as_ref().err().map(|e| e.to_string()),
                    info: r.ok(),
                    health: self.health_of(name),
                }
            })
            .collect()
    }

    /// Refuses a host whose agent has missed its heartbeats (after asking it
    /// once more, so an agent just restarted is not refused).
    async fn refuse_down(&self, host: &str) -> Result<(), ApiError> {
        let fresh = |me: &Self| {
            lock(&me.heartbeats)
                .get(host)
                .is_some_and(|t| t.elapsed().as_millis() < ferry_api::HOST_DEAD_AFTER_MS as u128)
        };
        if !fresh(self) {
            if let Ok(c) = self.host(host) {
                if c.get::<HostInfo>("/host", HEARTBEAT_TIMEOUT).await.is_ok() {
                    lock(&self.heartbeats).insert(host.to_string(), std::time::Instant::now());
                }
            }
        }
        let age = lock(&self.heartbeats).get(host).map(|t| t.elapsed());
        match age {
            Some(a) if a.as_millis() < ferry_api::HOST_DEAD_AFTER_MS as u128 => Ok(()),
            Some(a) => Err(ApiError::unavailable(
                format!("host {host}"),
                format!(
                    "its agent has not answered for {:.1} s; it takes no VMs until it does",
                    a.as_secs_f64()
                ),
            )),
            None => Err(ApiError::unavailable(
                format!("host {host}"),
                "its agent has never answered; it takes no VMs until it does",
            )),
        }
    }

    async fn list_vms(&self) -> Result<Vec<VmInfo>, ApiError> {
        // a host that missed its heartbeats gets a short wait
        let down = lock(&self.down).clone();
        // a failed host's VMs are known from their records (see `ha`)
        let calls = self
            .hosts
            .iter()
            .filter(|(n, _)| self.health_of(n) != ferry_api::ha::Health::Failed)
            .map(|(n, c)| {
                let wait = if down.contains(n) {
                    HEARTBEAT_TIMEOUT
                } else {
                    AGENT_TIMEOUT
                };
                c.get::<Vec<VmInfo>>("/vms", wait)
            });
        let mut out = Vec::new();
        // an unreachable host hides its VMs; `host list` shows why
        for vms in futures::future::join_all(calls).await.into_iter().flatten() {
            out.extend(vms);
        }
        let encrypted = self.cluster_settings().await?.encryption;
        for v in &mut out {
            v.moves_encrypted = Some(encrypted);
        }
        self.name_pauses(&mut out);
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Refuses `spec` on `host` before anything is asked of it when the
    /// grants the host reports do not cover it, judging paths as written;
    /// the agent checks again with every path resolved.
    async fn check_grants(&self, host: &str, spec: &ferry_api::VmSpec) -> Result<(), ApiError> {
        let info: HostInfo = self
            .host(host)?
            .get("/host", AGENT_TIMEOUT)
            .await
            .map_err(|e| ApiError::unavailable(format!("host {host}"), e))?;
        let lexical = &ferry_api::grants::lexically_inside;
        match info.grants.and_then(|g| g.refusal_by(spec, None, lexical)) {
            Some(r) => Err(r.into_error(host)),
            None => Ok(()),
        }
    }

    /// The host running VM `name` (skeletons on migration targets excluded).
    pub(crate) async fn locate(&self, name: &str) -> Result<(String, VmInfo), ApiError> {
        self.list_vms()
            .await?
            .into_iter()
            .find(|v| v.name == name && v.state != "incoming")
            .map(|v| (v.host.clone(), v))
            .ok_or_else(|| ApiError::not_found("vm", name))
    }

    async fn create_vm(&self, mut req: VmCreateRequest) -> Result<VmInfo, ApiError> {
        req.spec.validate()?;
        // a new VM without a board gets the lean one; `None` stays for VMs
        // created before boards had a name (see `Board`)
        req.spec
            .board
            .get_or_insert(ferry_api::hardware::Board::Lean);
        if let Some(h) = &req.ha {
            h.validate()?;
        }
        if self.records().await?.contains_key(&req.spec.name) {
            return Err(ApiError::AlreadyExists {
                kind: "vm".into(),
                name: req.spec.name,
            });
        }
        // a Ferry disk named by a drive: its export for this VM, as attach does
        for (i, d) in req.spec.drives.iter_mut().enumerate() {
            if let Some(name) = d.disk.clone() {
                let (disk, _) = self.locate_disk(&name).await.map_err(|e| match e {
                    ApiError::NotFound { .. } => ApiError::invalid(
                        &format!("drives[{i}].disk"),
                        format!("no Ferry disk named '{name}' (ferry disk list)"),
                    ),
                    e => e,
                })?;
                d.nbd = Some(format!("{}/{}", disk.uri, req.spec.name));
                d.disk = None;
                d.validate(i)?;
            }
        }
        // the placement engine's choice, or its check of the host named
        let named = (!req.host.is_empty()).then(|| req.host.clone());
        if let Some(h) = &named {
            self.host(h)?;
            self.refuse_draining(h)?;
            self.refuse_down(h).await?;
        }
        let placed = self
            .place_new(&req.spec.name, req.spec.memory, named.as_deref())
            .await?;
        req.host = placed.to.clone();
        if !placed.breaks.is_empty() {
            self.log(
                "placement",
                &req.spec.name,
                serde_json::json!({ "host": req.host, "breaks": placed.breaks }),
            );
        }
        let agent = self.host(&req.host)?;
        self.refuse_draining(&req.host)?;
        self.refuse_down(&req.host).await?;
        if self
            .list_vms()
            .await?
            .iter()
            .any(|v| v.name == req.spec.name)
        {
            return Err(ApiError::AlreadyExists {
                kind: "vm".into(),
                name: req.spec.name,
            });
        }
        self.check_grants(&req.host, &req.spec).await?;
        // its disks open to its host before QEMU asks for them
        if !req.spec.disks.is_empty() || req.spec.drives.iter().any(|d| d.nbd.is_some()) {
            let grant = access::Grant::new([req.host.clone()].into(), req.spec.ferry_disks());
            self.grant(&req.spec.name, grant).await?;
        }
        let info: VmInfo = agent
            .post("/vms", &req.spec, Duration::from_secs(60))
            .await?;
        self.record_created(&req.spec, &req.host, req.ha).await?;
        Ok(info)
    }

    async fn check_vm(&self, name: &str) -> Result<CheckResult, ApiError> {
        let (host, _) = self.locate(name).await?;
        self.host(&host)?
            .get(&format!("/vms/{name}/check"), Duration::from_secs(30))
            .await
    }

    /// Asks every host that lists the VM (source and target alike) to settle
    /// what it has in doubt; an unreachable host is named in the answer.
    async fn resolve_vm(
        &self,
        name: &str,
        req: &ferry_api::ResolveRequest,
    ) -> Result<Vec<ferry_api::ResolveReport>, ApiError> {
        req.check()?;
        let vms = self.list_vms().await?;
        let hosts: std::collections::BTreeSet<String> = vms
            .iter()
            .filter(|v| v.name == name)
            .map(|v| v.host.clone())
            // the lost host is not asked: only the source settles
            .filter(|h| req.target_lost.as_ref() != Some(h))
            .collect();
        if hosts.is_empty() {
            return Err(ApiError::not_found("vm", name));
        }
        let mut out = Vec::new();
        for h in hosts {
            let r: Vec<ferry_api::ResolveReport> = self
                .host(&h)?
                .post(
                    &format!("/vms/{name}/resolve"),
                    req,
                    Duration::from_secs(30),
                )
                .await?;
            out.extend(r);
        }
        if let Some(lost) = &req.target_lost {
            if out.is_empty() {
                return Err(ApiError::Conflict {
                    reason: format!("no migration of {name} to {lost} is in doubt"),
                });
            }
            self.log(
                "migration-target-lost",
                name,
                serde_json::json!({ "target": lost, "reports": out }),
            );
        } else if out.iter().any(|r| r.phase != r.phase_before) {
            self.log(
                "migration-resolved",
                name,
                serde_json::to_value(&out).unwrap_or_default(),
            );
        }
        Ok(out)
    }

    /// A migration or drain kept (see [`operations`]).
    pub(crate) async fn operation(&self, id: &str) -> Result<Arc<operations::Op>, ApiError> {
        self.operations.get(id).await
    }

    async fn console_tail(&self, name: &str, bytes: u64) -> Result<ConsoleTail, ApiError> {
        let (host, _) = self.locate(name).await?;
        self.host(&host)?
            .get(&format!("/vms/{name}/console?bytes={bytes}"), AGENT_TIMEOUT)
            .await
    }

    async fn remove_vm(&self, name: &str) -> Result<serde_json::Value, ApiError> {
        let host = match self.locate(name).await {
            Ok((host, _)) => host,
            // stopped: only its record is left
            Err(ApiError::NotFound { .. }) if self.forget_record(name).await? => {
                return Ok(serde_json::json!({ "removed": name, "was": "stopped" }));
            }
            Err(e) => return Err(e),
        };
        let r = self
            .host(&host)?
            .delete(&format!("/vms/{name}"), Duration::from_secs(30))
            .await?;
        self.forget_record(name).await?;
        Ok(r)
    }

    /// The cluster's settings, from the store (another control instance may have set them).
    async fn cluster_settings(&self) -> Result<ferry_api::ClusterSettings, ApiError> {
        Ok(self.store.cluster(CLUSTER_KEY).await?.unwrap_or_default())
    }

    /// A migration's option and convergence policy: what it chose, else the
    /// source host's defaults (`ferry host set`), else the built-in ones.
    fn migration_policy(
        &self,
        source: &str,
        option: Option<ferry_api::MigrationOption>,
        convergence: ferry_api::ConvergenceChoice,
    ) -> Result<(ferry_api::MigrationOption, ferry_api::Convergence), ApiError> {
        let host = lock(&self.settings)
            .get(source)
            .cloned()
            .unwrap_or_default();
        let option = option.or(host.migration_option).unwrap_or_default();
        let convergence = convergence.or(host.convergence).resolve()?;
        Ok((option, convergence))
    }

    async fn move_vm(
        &self,
        name: &str,
        req: MoveRequest,
    ) -> Result<(String, BoxStream<'static, MigrationEvent>), ApiError> {
        self.host(&req.to)?;
        self.refuse_draining(&req.to)?;
        self.refuse_down(&req.to).await?;
        let (source, info) = self.locate(name).await?;
        refuse_storage_paused(&info)?;
        if source != req.to {
            self.check_move(name, &req.to).await?;
        }
        if source == req.to {
            return Err(ApiError::invalid(
                "to",
                format!("vm {name} already runs on {source}"),
            ));
        }
        let events = self
            .begin_migration(&info, &req.to, req.option, req.convergence)
            .await?;
        let warnings: Vec<MigrationEvent> = match &*self.last_validation.lock().await {
            Some(r) => r
                .failed_paths(&source, &req.to)
                .into_iter()
                .map(|c| MigrationEvent::Warning {
                    message: failed_path_warning(c),
                })
                .collect(),
            None => Vec::new(),
        };
        let vm = name.to_string();
        let from = source.clone();
        // a broken event stream is reported as an event, never dropped silently
        let events = events.map(move |r| {
            r.unwrap_or_else(|e| MigrationEvent::Failed {
                error: ApiError::unavailable(
                    format!("events of the migration of {vm} from {source}"),
                    e,
                ),
            })
        });
        Ok((from, futures::stream::iter(warnings).chain(events).boxed()))
    }
}

impl Control {
    /// Starts a move of VM `info` (as [`Self::locate`] found it) from its
    /// host to `to` on the source's agent (for `vm move` and drains alike):
    /// the option and convergence policy resolved, the spec checked against
    /// the target's grants and named in a ticket, the target granted the
    /// VM's disks until the move's events end. Returns the source's event
    /// stream.
    pub(crate) async fn begin_migration(
        &self,
        info: &VmInfo,
        to: &str,
        option: Option<ferry_api::MigrationOption>,
        convergence: ferry_api::ConvergenceChoice,
    ) -> Result<futures::stream::BoxStream<'static, Result<MigrationEvent, ApiError>>, ApiError>
    {
        let (vm, source, spec) = (info.name.as_str(), info.host.as_str(), &info.spec);
        let target = self.host(to)?;
        let (option, convergence) = self.migration_policy(source, option, convergence)?;
        // the spec as `locate` found it on its host: what the ticket and the
        // grants name
        self.check_grants(to, spec).await?;
        let ticket = self
            .tickets
            .as_ref()
            .map(|signer| signer.sign(spec, source, to, ferry_net::ticket::now_ms()));
        let mreq = MigrateRequest {
            target: to.to_string(),
            target_url: target.base().to_string(),
            option,
            convergence,
            encryption: self.cluster_settings().await?.encryption,
            ticket,
        };
        if !self.storage.is_empty() {
            self.granting_move(spec, source, to).await?;
        }
        let events = match self
            .host(source)?
            .post_events::<_, MigrationEvent>(&format!("/vms/{vm}/migrate"), &mreq)
            .await
        {
            Ok(e) => e,
            Err(e) => {
                self.moved(vm);
                return Err(e);
            }
        };
        Ok(MoveEnds {
            inner: events.boxed(),
            access: self.access_handle(),
            vm: vm.to_string(),
        }
        .boxed())
    }
}

/// A move's event stream; when it ends (or is dropped) the move no longer
/// holds its target's grant.
struct MoveEnds {
    inner: futures::stream::BoxStream<'static, Result<MigrationEvent, ApiError>>,
    access: std::sync::Weak<access::Moving>,
    vm: String,
}

impl futures::Stream for MoveEnds {
    type Item = Result<MigrationEvent, ApiError>;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

impl Drop for MoveEnds {
    fn drop(&mut self) {
        if let Some(m) = self.access.upgrade() {
            lock(&m).remove(&self.vm);
        }
    }
}

/// Where the cluster's settings live in the store.
const CLUSTER_KEY: &str = "settings";

/// How a move or drain warns of a path the latest validation marked failed.
fn failed_path_warning(c: &CheckOutcome) -> String {
    format!(
        "validation marked {} {} → {} failed ({}): {}",
        c.host,
        c.nic.clone().unwrap_or_default(),
        c.peer.clone().unwrap_or_default(),
        c.check,
        c.observed
    )
}

use ferry_api::util::lock;

/// A guest paused for its storage does not move: its held I/O can complete
/// nowhere else. Refused naming the pause.
pub(crate) fn refuse_storage_paused(vm: &VmInfo) -> Result<(), ApiError> {
    match &vm.storage_pause {
        Some(p) if p.active() => Err(ApiError::Conflict {
            reason: format!(
                "vm {} is {}; it moves once its storage answers",
                vm.name,
                p.describe(ferry_api::util::now_ms())
            ),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod expiry_tests {
    use super::*;

    #[test]
    fn a_certificate_is_warned_of_in_its_last_thirty_days_only() {
        let now = 1_000 * DAY_MS;
        assert_eq!(expiring(now, now + 365 * DAY_MS), None);
        assert_eq!(expiring(now, now + 30 * DAY_MS), None);
        assert_eq!(expiring(now, now + 30 * DAY_MS - 1), Some(29));
        assert_eq!(expiring(now, now + DAY_MS / 2), Some(0));
        assert_eq!(expiring(now, now - DAY_MS), Some(0), "already ended");
    }
}
