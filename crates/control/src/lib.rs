//! Ferry's control service: the one command API in front of the agents.
//!
//! Front ends (the CLI now; the web page later) send [`Command`]s over REST
//! (`/api/v1`); [`Control::execute`] is the one place each is carried out.
//! The registry of hosts comes from the cluster configuration (for a lab,
//! its `lab.json`); the agents are the source of truth for where VMs run, so
//! the control service asks them rather than keeping a copy that could go
//! stale. Durable cluster state (SQLite/etcd), heartbeats and the event log
//! grow here.

pub mod bandwidth;
pub mod drain;
pub mod http;
pub mod metrics;
pub mod policy_manager;
pub mod storage;
pub mod store;
pub mod validate;

use std::collections::BTreeMap;
use std::time::Duration;

use ferry_api::auth::Credential;
use ferry_api::client::Client;
use ferry_api::drain::{
    DrainEvent, DrainReport, DrainRequest, DrainedVm, HostSettings, MigrationLimit, PlannedMove,
    Unplaceable,
};
use ferry_api::validation::{
    CheckOutcome, CheckStatus, HostFacts, NicFacts, PathProbeRequest, PathProbeResult, SendRequest,
    SendResult, SinkReply, SinkRequest, SinkResult, ValidationReport,
};
use ferry_api::{
    ApiError, CheckResult, HostEntry, HostInfo, MigrateRequest, MigrationEvent, MoveRequest,
    ValidateRequest, VmCreateRequest, VmInfo,
};
use futures::stream::BoxStream;
use futures::StreamExt;
use std::sync::Arc;

const AGENT_TIMEOUT: Duration = Duration::from_secs(5);
/// A heartbeat (a `/host` call) that takes longer than this is missed.
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(2);

/// Every operation the control service offers, whatever the front end.
#[derive(Debug, Clone)]
pub enum Command {
    ListHosts,
    ListVms,
    CreateVm(VmCreateRequest),
    CheckVm {
        name: String,
    },
    /// Shows and settles a migration of the VM left in doubt (on every host
    /// that has a record of it).
    ResolveVm {
        name: String,
    },
    RemoveVm {
        name: String,
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
    SetHost {
        host: String,
        settings: HostSettings,
    },
    /// Disks, QoS policies and flows (see [`storage`]).
    Storage(storage::StorageCommand),
    /// Prometheus text exposition of the cluster (see [`metrics`]).
    Metrics,
    /// The newest `limit` entries of the event log.
    Events {
        limit: usize,
    },
    /// Bandwidth classes: the policy and what each host enforces and sends.
    ListBandwidth,
    SetBandwidth(ferry_api::bandwidth::BandwidthSetRequest),
    /// Settings of the whole cluster (encrypted carriers).
    GetCluster,
    SetCluster(ferry_api::ClusterSettingsUpdate),
}

/// What a command produces: one JSON value, or a stream of events (one JSON
/// value each: migration or drain events).
pub enum Outcome {
    Value(serde_json::Value),
    /// Plain text (metrics).
    Text(String),
    Events(BoxStream<'static, serde_json::Value>),
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
    /// Migrations and drains as their events passed through.
    recorder: std::sync::Mutex<metrics::Recorder>,
    /// Allocations the policy manager pushed, by (node, flow).
    allocations: tokio::sync::Mutex<BTreeMap<(String, String), ferry_api::storage::Allocation>>,
    /// The latest validation, consulted before migrations.
    last_validation: tokio::sync::Mutex<Option<ValidationReport>>,
    /// Hosts being drained (or drained and not resumed): they take no VMs.
    draining: std::sync::Mutex<std::collections::BTreeSet<String>>,
    settings: std::sync::Mutex<BTreeMap<String, HostSettings>>,
    /// The cluster's bandwidth classes (see [`bandwidth`]).
    bandwidth: std::sync::Mutex<ferry_api::bandwidth::BandwidthPolicy>,
}

impl Control {
    /// `hosts`: (name, agent URL) for every registered host.
    pub fn new(hosts: Vec<(String, String)>, cred: Credential) -> Control {
        Control::with_storage(hosts, Vec::new(), cred)
    }

    /// `storage`: (name, REST URL) of every storage node.
    pub fn with_storage(
        hosts: Vec<(String, String)>,
        storage: Vec<(String, String)>,
        cred: Credential,
    ) -> Control {
        let clients = |list: Vec<(String, String)>, kind: &str| {
            list.into_iter()
                .map(|(n, url)| {
                    let c = Client::new(&format!("{kind} {n}"), &url, cred.clone());
                    (n, c)
                })
                .collect()
        };
        Control {
            hosts: clients(hosts, "agent"),
            storage: clients(storage, "storage node"),
            allocations: Default::default(),
            recorder: Default::default(),
            heartbeats: Default::default(),
            store: Arc::new(store::Store::in_memory()),
            down: Default::default(),
            last_validation: Default::default(),
            draining: Default::default(),
            settings: Default::default(),
            bandwidth: Default::default(),
        }
    }

    /// Keeps state in `store` instead of memory, taking up what it holds.
    pub async fn with_store(mut self, store: store::Store) -> Result<Control, ApiError> {
        self.store = Arc::new(store);
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

    /// One heartbeat round: logs hosts going down or coming back, and takes
    /// up state other control instances wrote.
    pub async fn heartbeat(&self) {
        if let Err(e) = self.reload().await {
            tracing::warn!("control state: {e}");
        }
        let hosts = self.list_hosts().await;
        self.align_bandwidth(&hosts).await;
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
        for n in self.storage_nodes().await {
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

    pub async fn execute(self: &Arc<Self>, cmd: Command) -> Result<Outcome, ApiError> {
        match cmd {
            Command::ListHosts => value(self.list_hosts().await),
            Command::ListVms => value(self.list_vms().await?),
            Command::CreateVm(req) => value(self.create_vm(req).await?),
            Command::CheckVm { name } => value(self.check_vm(&name).await?),
            Command::ResolveVm { name } => value(self.resolve_vm(&name).await?),
            Command::RemoveVm { name } => value(self.remove_vm(&name).await?),
            Command::MoveVm { name, req } => {
                let target = req.to.clone();
                let (source, events) = self.move_vm(&name, req).await?;
                let me = self.clone();
                Ok(Outcome::Events(
                    events
                        .map(move |ev| {
                            lock(&me.recorder).migration(&name, &source, &target, &ev);
                            if matches!(
                                ev,
                                MigrationEvent::Completed(_) | MigrationEvent::Failed { .. }
                            ) {
                                let mut detail = to_json(&ev);
                                detail["source"] = source.clone().into();
                                detail["target"] = target.clone().into();
                                me.log("migration", &name, detail);
                            }
                            to_json(ev)
                        })
                        .boxed(),
                ))
            }
            Command::Validate(req) => value(self.validate(req).await?),
            Command::Drain { host, req } => {
                let events = self.clone().drain(host.clone(), req).await?;
                let me = self.clone();
                Ok(Outcome::Events(
                    events
                        .map(move |ev| {
                            lock(&me.recorder).drain(&host, &ev);
                            if let DrainEvent::Done(r) = &ev {
                                me.log("drain", &host, to_json(r));
                            }
                            to_json(ev)
                        })
                        .boxed(),
                ))
            }
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
            Command::Resume { host } => {
                self.host(&host)?;
                let was = lock(&self.draining).remove(&host);
                self.store.set_draining(&host, false).await?;
                let r = serde_json::json!({ "host": host, "was_draining": was });
                self.log("resume", &host, r.clone());
                value(r)
            }
            Command::ListBandwidth => value(self.list_bandwidth().await?),
            Command::SetBandwidth(req) => value(self.set_bandwidth(req).await?),
            Command::GetCluster => value(self.cluster_settings().await?),
            Command::SetCluster(u) => {
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
        let calls = self
            .hosts
            .values()
            .map(|c| c.get::<Vec<VmInfo>>("/vms", AGENT_TIMEOUT));
        let mut out = Vec::new();
        // an unreachable host hides its VMs; `host list` shows why
        for vms in futures::future::join_all(calls).await.into_iter().flatten() {
            out.extend(vms);
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
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

    async fn create_vm(&self, req: VmCreateRequest) -> Result<VmInfo, ApiError> {
        req.spec.validate()?;
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
        agent.post("/vms", &req.spec, Duration::from_secs(60)).await
    }

    async fn check_vm(&self, name: &str) -> Result<CheckResult, ApiError> {
        let (host, _) = self.locate(name).await?;
        self.host(&host)?
            .get(&format!("/vms/{name}/check"), Duration::from_secs(30))
            .await
    }

    /// Asks every host that lists the VM (source and target alike) to settle
    /// what it has in doubt; an unreachable host is named in the answer.
    async fn resolve_vm(&self, name: &str) -> Result<Vec<ferry_api::ResolveReport>, ApiError> {
        let vms = self.list_vms().await?;
        let hosts: std::collections::BTreeSet<String> = vms
            .iter()
            .filter(|v| v.name == name)
            .map(|v| v.host.clone())
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
                    &serde_json::json!({}),
                    Duration::from_secs(30),
                )
                .await?;
            out.extend(r);
        }
        if out.iter().any(|r| r.phase != r.phase_before) {
            self.log(
                "migration-resolved",
                name,
                serde_json::to_value(&out).unwrap_or_default(),
            );
        }
        Ok(out)
    }

    async fn remove_vm(&self, name: &str) -> Result<serde_json::Value, ApiError> {
        let (host, _) = self.locate(name).await?;
        self.host(&host)?
            .delete(&format!("/vms/{name}"), Duration::from_secs(30))
            .await
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
        let target = self.host(&req.to)?;
        self.refuse_draining(&req.to)?;
        self.refuse_down(&req.to).await?;
        let (source, _) = self.locate(name).await?;
        if source == req.to {
            return Err(ApiError::invalid(
                "to",
                format!("vm {name} already runs on {source}"),
            ));
        }
        let (option, convergence) = self.migration_policy(&source, req.option, req.convergence)?;
        let mreq = MigrateRequest {
            target: req.to.clone(),
            target_url: target.base().to_string(),
            option,
            convergence,
            encrypt_carriers: self.cluster_settings().await?.encrypt_carriers,
        };
        let events = self
            .host(&source)?
            .post_events::<_, MigrationEvent>(&format!("/vms/{name}/migrate"), &mreq)
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

    /// Validates hosts and the paths between them (see [`validate`]).
    async fn validate(&self, req: ValidateRequest) -> Result<ValidationReport, ApiError> {
        for h in &req.hosts {
            self.host(h)?;
        }
        let selected = |h: &str| req.hosts.is_empty() || req.hosts.iter().any(|s| s == h);
        let t = Duration::from_secs(30);
        // facts from every host: consistency needs the whole cluster
        let calls = self.hosts.iter().map(|(n, c)| async move {
            (n.clone(), c.get::<HostFacts>("/validate/facts", t).await)
        });
        let mut facts = Vec::new();
        let mut rows = Vec::new();
        for (name, r) in futures::future::join_all(calls).await {
            match r {
                Ok(f) => facts.push(f),
                Err(e) => rows.push(CheckOutcome {
                    check: "agent".into(),
                    host: name.clone(),
                    nic: None,
                    peer: None,
                    status: CheckStatus::Fail,
                    observed: format!("agent unreachable: {e}"),
                    fix: Some(format!(
                        "start the agent of {name} (lab: `ferry lab restart-agent {name}`)"
                    )),
                }),
            }
        }
        // every ordered pair on every fabric that touches a selected host
        let mut pairs: Vec<(String, String, NicFacts, NicFacts)> = Vec::new();
        for a in &facts {
            for b in &facts {
                if a.host == b.host || !(selected(&a.host) || selected(&b.host)) {
                    continue;
                }
                for na in &a.nics {
                    if let Some(nb) = b.nics.iter().find(|n| n.fabric == na.fabric) {
                        pairs.push((a.host.clone(), b.host.clone(), na.clone(), nb.clone()));
                    }
                }
            }
        }
        let probes = pairs.iter().map(|(a, b, na, nb)| async move {
            let req = PathProbeRequest {
                nic: na.name.clone(),
                peer_addr: nb.address.clone(),
                size: na.mtu,
            };
            let r = self
                .host(a)?
                .post::<_, PathProbeResult>("/validate/path", &req, Duration::from_secs(60))
                .await;
            Ok::<_, ApiError>(validate::PathResult {
                host: a.clone(),
                peer: b.clone(),
                nic: na.name.clone(),
                peer_addr: nb.address.clone(),
                result: r.map_err(|e| e.to_string()),
            })
        });
        let paths: Vec<validate::PathResult> = futures::future::join_all(probes)
            .await
            .into_iter()
            .collect::<Result<_, _>>()?;
        // throughput one path at a time, each unordered pair once, so tests do not share a link
        let mut tputs = Vec::new();
        if req.throughput_ms > 0 {
            for (a, b, na, nb) in pairs.iter().filter(|(a, b, ..)| a < b) {
                if !(na.up && nb.up) {
                    continue;
                }
                let result = self.throughput(a, b, na, nb, req.throughput_ms).await;
                tputs.push(validate::ThroughputResult {
                    host: a.clone(),
                    peer: b.clone(),
                    nic: na.name.clone(),
                    fabric: na.fabric,
                    result: result.map_err(|e| e.to_string()),
                });
            }
        }
        rows.extend(validate::evaluate(&facts, &paths, &tputs));
        rows.retain(|r| selected(&r.host) || r.peer.as_deref().is_some_and(selected));
        let names = if req.hosts.is_empty() {
            self.hosts.keys().cloned().collect()
        } else {
            req.hosts.clone()
        };
        let report = ValidationReport::new(names, rows);
        *self.last_validation.lock().await = Some(report.clone());
        Ok(report)
    }

    /// Bits per second from `a`'s NIC to `b`'s, as `b`'s sink measured them.
    async fn throughput(
        &self,
        a: &str,
        b: &str,
        na: &NicFacts,
        nb: &NicFacts,
        ms: u64,
    ) -> Result<f64, ApiError> {
        let t = Duration::from_secs(30);
        let sink: SinkReply = self
            .host(b)?
            .post(
                "/validate/sink",
                &SinkRequest {
                    nic: nb.name.clone(),
                },
                t,
            )
            .await?;
        let send = SendRequest {
            nic: na.name.clone(),
            peer_addr: sink.address.clone(),
            port: sink.port,
            session: sink.session.clone(),
            duration_ms: ms,
        };
        let _: SendResult = self.host(a)?.post("/validate/send", &send, t).await?;
        let got: SinkResult = self
            .host(b)?
            .get(&format!("/validate/sink/{}", sink.port), t)
            .await?;
        if got.duration_ms == 0 {
            return Err(ApiError::unavailable(
                format!("path {a} {} → {b}", na.name),
                "no data arrived",
            ));
        }
        Ok(got.bytes as f64 * 8.0 * 1000.0 / got.duration_ms as f64)
    }

    /// Drains `host`: plan, then move with a self-tuning limit, retrying
    /// failed moves elsewhere. The host takes no VMs from the start.
    async fn drain(
        self: Arc<Self>,
        host: String,
        req: DrainRequest,
    ) -> Result<BoxStream<'static, DrainEvent>, ApiError> {
        self.host(&host)?;
        for t in &req.to {
            self.host(t)?;
            if *t == host {
                return Err(ApiError::invalid(
                    "to",
                    format!("{host} cannot drain onto itself"),
                ));
            }
        }
        let entries = self.list_hosts().await;
        let source = entries
            .iter()
            .find(|h| h.name == host)
            .and_then(|h| h.info.clone())
            .ok_or_else(|| ApiError::unavailable(format!("agent {host}"), "does not answer"))?;
        lock(&self.draining).insert(host.clone());
        self.store.set_draining(&host, true).await?;
        let draining = lock(&self.draining).clone();
        let mut targets: Vec<(String, u64)> = entries
            .iter()
            .filter(|h| h.name != host && !draining.contains(&h.name) && !h.down)
            .filter(|h| req.to.is_empty() || req.to.contains(&h.name))
            .filter_map(|h| Some((h.name.clone(), h.info.as_ref()?.memory_free)))
            .collect();
        let vms: Vec<(String, u64)> = source
            .vms
            .iter()
            .filter(|v| v.state != "incoming")
            .map(|v| (v.name.clone(), v.spec.memory))
            .collect();
        let (moves, unplaceable) = drain::plan(&vms, &mut targets);
        let limit_setting = req
            .max_parallel
            .or_else(|| {
                lock(&self.settings)
                    .get(&host)
                    .and_then(|s| s.max_migrations)
            })
            .unwrap_or_default();
        let warnings: Vec<DrainEvent> = {
            let last = self.last_validation.lock().await;
            let mut to: Vec<&str> = moves.iter().map(|m| m.to.as_str()).collect();
            to.sort();
            to.dedup();
            to.iter()
                .flat_map(|t| {
                    last.as_ref()
                        .map(|r| r.failed_paths(&host, t))
                        .unwrap_or_default()
                })
                .map(|c| DrainEvent::Warning {
                    message: failed_path_warning(c),
                })
                .collect()
        };
        let (tx, rx) = tokio::sync::mpsc::channel::<DrainEvent>(256);
        for w in warnings {
            let _ = tx.send(w).await;
        }
        let me = self.clone();
        tokio::spawn(async move {
            me.run_drain(
                host,
                req.option,
                moves,
                unplaceable,
                targets,
                limit_setting,
                tx,
            )
            .await;
        });
        Ok(
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) })
                .boxed(),
        )
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_drain(
        self: Arc<Self>,
        host: String,
        option: Option<ferry_api::MigrationOption>,
        moves: Vec<PlannedMove>,
        unplaceable: Vec<Unplaceable>,
        mut targets: Vec<(String, u64)>,
        setting: MigrationLimit,
        tx: tokio::sync::mpsc::Sender<DrainEvent>,
    ) {
        let started = std::time::Instant::now();
        let mut auto = drain::AutoLimit::with_capacity(match setting {
            MigrationLimit::Auto => self.drain_capacity(&host, option).await,
            MigrationLimit::Fixed(_) => None,
        });
        let (limit, mut limits) = match setting {
            MigrationLimit::Auto => (auto.limit, vec![auto.want]),
            MigrationLimit::Fixed(n) => (n, vec![n]),
        };
        let _ = tx
            .send(DrainEvent::Plan {
                moves: moves.clone(),
                unplaceable: unplaceable.clone(),
                limit,
            })
            .await;
        if setting == MigrationLimit::Auto {
            let links = match auto.capacity() {
                Some(c) => format!("; the links carry {:.0} Mbit/s", c * 8.0 / 1e6),
                None => String::new(),
            };
            let reason = format!(
                "auto: {} at once to start, one more each time it pays, up to {limit}{links}",
                auto.want
            );
            let _ = tx
                .send(DrainEvent::Limit {
                    limit: auto.want,
                    reason,
                })
                .await;
        }
        // per-class rates of the drained host, while classes are set
        let classes = {
            let me = self.clone();
            let (host, tx) = (host.clone(), tx.clone());
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    if me.bandwidth_policy().classes.is_empty() {
                        continue;
                    }
                    let Ok(c) = me.host(&host) else { break };
                    if let Ok(b) = c
                        .get::<ferry_api::bandwidth::HostBandwidth>("/bandwidth", AGENT_TIMEOUT)
                        .await
                    {
                        let ev = DrainEvent::Classes {
                            host: host.clone(),
                            nics: b.nics,
                        };
                        if tx.send(ev).await.is_err() {
                            break;
                        }
                    }
                }
            })
        };
        let mut queue: std::collections::VecDeque<(PlannedMove, u32, Vec<String>)> =
            moves.into_iter().map(|m| (m, 1, Vec::new())).collect();
        let mut running = tokio::task::JoinSet::new();
        let (mut moved, mut failed) = (Vec::new(), Vec::new());
        // what each running move reports, and the bytes finished ones sent
        let samples: Samples = Default::default();
        let mut setup_seen = std::collections::HashSet::new();
        let mut sent_done = 0u64;
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let allowed = match setting {
                MigrationLimit::Fixed(n) => n,
                MigrationLimit::Auto => {
                    let (sent, runs) = {
                        let s = lock(&samples);
                        for (vm, x) in s.iter() {
                            if let Some(d) = x.setup.filter(|_| !setup_seen.contains(vm)) {
                                auto.observe_setup(d);
                                setup_seen.insert(vm.clone());
                            }
                        }
                        let lead = auto.lead();
                        let sent = sent_done + s.values().map(|x| x.sent).sum::<u64>();
                        (
                            sent,
                            s.values().map(|x| x.running(lead)).collect::<Vec<_>>(),
                        )
                    };
                    let (allowed, change) = auto.tick(std::time::Instant::now(), sent, &runs);
                    if let Some((l, reason)) = change {
                        if limits.last() != Some(&l) {
                            limits.push(l);
                        }
                        let _ = tx.send(DrainEvent::Limit { limit: l, reason }).await;
                    }
                    allowed
                }
            };
            while running.len() < allowed as usize {
                let Some((m, attempt, tried)) = queue.pop_front() else {
                    break;
                };
                lock(&samples).insert(m.vm.clone(), Sample::default());
                let _ = tx
                    .send(DrainEvent::Started {
                        vm: m.vm.clone(),
                        to: m.to.clone(),
                        attempt,
                    })
                    .await;
                let me = self.clone();
                let tx2 = tx.clone();
                let samples = samples.clone();
                running.spawn(async move {
                    let r = me.drain_one(&m, option, &tx2, &samples).await;
                    (m, attempt, tried, r)
                });
            }
            if running.is_empty() {
                break;
            }
            let joined = tokio::select! {
                j = running.join_next() => j,
                _ = tick.tick() => continue,
            };
            let Some(joined) = joined else {
                break;
            };
            let Ok((m, attempt, mut tried, result)) = joined else {
                continue;
            };
            if let Some(last) = lock(&samples).remove(&m.vm) {
                sent_done += match &result {
                    Ok(r) => r.bytes_transferred,
                    Err(_) => last.sent,
                };
            }
            match result {
                Ok(r) => {
                    let d = DrainedVm {
                        vm: m.vm.clone(),
                        to: m.to.clone(),
                        attempts: attempt,
                        total_ms: r.total_ms,
                        transfer_ms: r.transfer_ms,
                        downtime_ms: r.downtime_ms,
                        bytes: r.bytes_transferred,
                    };
                    let _ = tx.send(DrainEvent::Moved(d.clone())).await;
                    moved.push(d);
                }
                Err(e) => {
                    let need = m.memory + drain::VM_OVERHEAD;
                    // the failed target's reservation is free again
                    if let Some(t) = targets.iter_mut().find(|t| t.0 == m.to) {
                        t.1 += need;
                    }
                    tried.push(m.to.clone());
                    let next = (attempt < drain::MAX_ATTEMPTS)
                        .then(|| drain::pick(&targets, need, &tried))
                        .flatten();
                    match next {
                        Some(i) => {
                            targets[i].1 -= need;
                            let to = targets[i].0.clone();
                            let _ = tx
                                .send(DrainEvent::Retry {
                                    vm: m.vm.clone(),
                                    failed_on: m.to.clone(),
                                    reason: e.to_string(),
                                    next: to.clone(),
                                })
                                .await;
                            queue.push_back((PlannedMove { to, ..m }, attempt + 1, tried));
                        }
                        None => {
                            // a migration error already says where the VM runs
                            let reason = match &e {
                                ApiError::MigrationFailed { .. } => e.to_string(),
                                _ => format!("{e}; it keeps running on {host}"),
                            };
                            let _ = tx
                                .send(DrainEvent::Failed {
                                    vm: m.vm.clone(),
                                    reason: reason.clone(),
                                })
                                .await;
                            failed.push(Unplaceable {
                                vm: m.vm,
                                memory: m.memory,
                                reason,
                            });
                        }
                    }
                }
            }
        }
        let report = DrainReport {
            host,
            bytes: moved.iter().map(|d| d.bytes).sum(),
            moved,
            unplaceable,
            failed,
            total_ms: started.elapsed().as_millis() as u64,
            limits,
        };
        classes.abort();
        let _ = tx.send(DrainEvent::Done(report)).await;
    }

    /// What the drained host's links carry for `option`, bytes/s: every NIC
    /// up, or (tcp, one NIC per migration) the fastest; `None` if unknown.
    async fn drain_capacity(
        &self,
        host: &str,
        option: Option<ferry_api::MigrationOption>,
    ) -> Option<f64> {
        let (option, _) = self
            .migration_policy(host, option, Default::default())
            .ok()?;
        let b: ferry_api::bandwidth::HostBandwidth = self
            .host(host)
            .ok()?
            .get("/bandwidth", AGENT_TIMEOUT)
            .await
            .ok()?;
        let rates = b
            .nics
            .iter()
            .filter(|n| n.up)
            .map(|n| n.link_rate as f64 / 8.0);
        let c = match option {
            ferry_api::MigrationOption::Tcp => rates.fold(0.0, f64::max),
            _ => rates.sum(),
        };
        (c > 0.0).then_some(c)
    }

    /// One move of a drain, forwarding its progress (at most twice a second).
    async fn drain_one(
        &self,
        m: &PlannedMove,
        option: Option<ferry_api::MigrationOption>,
        tx: &tokio::sync::mpsc::Sender<DrainEvent>,
        samples: &Samples,
    ) -> Result<ferry_api::MigrationReport, ApiError> {
        let began = std::time::Instant::now();
        // a drain may move onto hosts only it reserved, so no draining check here
        let target = self.host(&m.to)?;
        let (source, _) = self.locate(&m.vm).await?;
        let (option, convergence) = self.migration_policy(&source, option, Default::default())?;
        let mreq = MigrateRequest {
            target: m.to.clone(),
            target_url: target.base().to_string(),
            option,
            convergence,
            encrypt_carriers: self.cluster_settings().await?.encrypt_carriers,
        };
        let mut events = self
            .host(&source)?
            .post_events::<_, MigrationEvent>(&format!("/vms/{}/migrate", m.vm), &mreq)
            .await?;
        let mut last = std::time::Instant::now() - Duration::from_secs(1);
        let mut copying_since = None;
        let mut setup = None;
        while let Some(ev) = events.next().await {
            let ev = ev?;
            if let MigrationEvent::Progress(p) = &ev {
                if p.status != "active" {
                    copying_since = None;
                } else if copying_since.is_none() && p.transferred > 0 {
                    copying_since = Some(std::time::Instant::now());
                    setup.get_or_insert(began.elapsed());
                }
                let progress = SampledProgress {
                    active: p.status == "active",
                    finished: matches!(
                        p.status.as_str(),
                        "device" | "completed" | "postcopy-active"
                    ) || matches!(
                        p.phase.as_str(),
                        "postcopy" | "pause-and-copy" | "blackout"
                    ),
                    rounds: p.rounds,
                    remaining: p.remaining,
                    throughput: p.throughput,
                    eta: p.eta_ms.map(Duration::from_millis),
                    copying_since,
                };
                lock(samples).insert(
                    m.vm.clone(),
                    Sample {
                        sent: p.transferred,
                        progress: Some(progress),
                        setup,
                    },
                );
            }
            match ev {
                MigrationEvent::Progress(p) if last.elapsed() >= Duration::from_millis(500) => {
                    last = std::time::Instant::now();
                    let _ = tx
                        .send(DrainEvent::Progress {
                            vm: m.vm.clone(),
                            transferred: p.transferred,
                            remaining: p.remaining,
                            total: p.total,
                        })
                        .await;
                }
                MigrationEvent::Completed(r) => return Ok(*r),
                MigrationEvent::Failed { error } => return Err(error),
                _ => {}
            }
        }
        Err(ApiError::internal(format!(
            "the migration of {} ended without a result",
            m.vm
        )))
    }
}

/// Where the cluster's settings live in the store.
const CLUSTER_KEY: &str = "settings";

/// A running move of a drain, as its progress last said.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    /// Bytes QEMU has sent.
    sent: u64,
    /// The latest progress, once there is one.
    progress: Option<SampledProgress>,
    /// From the move's start to QEMU copying (establish, skeleton, connection).
    setup: Option<Duration>,
}

#[derive(Debug, Clone, Copy)]
struct SampledProgress {
    active: bool,
    finished: bool,
    rounds: u64,
    remaining: u64,
    throughput: f64,
    eta: Option<Duration>,
    copying_since: Option<std::time::Instant>,
}

impl Sample {
    fn running(&self, lead: Duration) -> drain::Running {
        match &self.progress {
            None => drain::Running::default(),
            Some(p) => drain::Running::from_progress(
                p.active,
                p.finished,
                p.rounds,
                p.remaining,
                p.throughput,
                p.eta,
                lead,
                p.copying_since.map(|t| t.elapsed()).unwrap_or_default(),
            ),
        }
    }
}

type Samples = Arc<std::sync::Mutex<std::collections::HashMap<String, Sample>>>;

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
