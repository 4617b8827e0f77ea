//! Ferry's control service: the one command API in front of the agents.
//!
//! Front ends (the CLI now; the web page later) send [`Command`]s over REST
//! (`/api/v1`); [`Control::execute`] is the one place each is carried out.
//! The registry of hosts comes from the cluster configuration (for a lab,
//! its `lab.json`); the agents are the source of truth for where VMs run, so
//! the control service asks them rather than keeping a copy that could go
//! stale. Durable cluster state (SQLite/etcd), heartbeats and the event log
//! grow here.

pub mod http;
pub mod validate;

use std::collections::BTreeMap;
use std::time::Duration;

use ferry_api::auth::Credential;
use ferry_api::client::Client;
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

const AGENT_TIMEOUT: Duration = Duration::from_secs(5);

/// Every operation the control service offers, whatever the front end.
#[derive(Debug, Clone)]
pub enum Command {
    ListHosts,
    ListVms,
    CreateVm(VmCreateRequest),
    CheckVm { name: String },
    RemoveVm { name: String },
    MoveVm { name: String, req: MoveRequest },
    Validate(ValidateRequest),
}

/// What a command produces: one JSON value, or a stream of migration events.
pub enum Outcome {
    Value(serde_json::Value),
    Events(BoxStream<'static, MigrationEvent>),
}

fn value<T: serde::Serialize>(v: T) -> Result<Outcome, ApiError> {
    serde_json::to_value(v)
        .map(Outcome::Value)
        .map_err(ApiError::internal)
}

pub struct Control {
    hosts: BTreeMap<String, Client>,
    /// The latest validation, consulted before migrations.
    last_validation: tokio::sync::Mutex<Option<ValidationReport>>,
}

impl Control {
    /// `hosts`: (name, agent URL) for every registered host.
    pub fn new(hosts: Vec<(String, String)>, cred: Credential) -> Control {
        let hosts = hosts
            .into_iter()
            .map(|(n, url)| {
                let c = Client::new(&format!("agent {n}"), &url, cred.clone());
                (n, c)
            })
            .collect();
        Control {
            hosts,
            last_validation: Default::default(),
        }
    }

    fn host(&self, name: &str) -> Result<&Client, ApiError> {
        self.hosts
            .get(name)
            .ok_or_else(|| ApiError::not_found("host", name))
    }

    pub async fn execute(&self, cmd: Command) -> Result<Outcome, ApiError> {
        match cmd {
            Command::ListHosts => value(self.list_hosts().await),
            Command::ListVms => value(self.list_vms().await?),
            Command::CreateVm(req) => value(self.create_vm(req).await?),
            Command::CheckVm { name } => value(self.check_vm(&name).await?),
            Command::RemoveVm { name } => value(self.remove_vm(&name).await?),
            Command::MoveVm { name, req } => self.move_vm(&name, req).await.map(Outcome::Events),
            Command::Validate(req) => value(self.validate(req).await?),
        }
    }

    async fn list_hosts(&self) -> Vec<HostEntry> {
        let calls = self.hosts.iter().map(|(name, c)| async move {
            let r = c.get::<HostInfo>("/host", AGENT_TIMEOUT).await;
            HostEntry {
                name: name.clone(),
                agent_url: c.base().to_string(),
                reachable: r.is_ok(),
                error: r.as_ref().err().map(|e| e.to_string()),
                info: r.ok(),
            }
        });
        futures::future::join_all(calls).await
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
    async fn locate(&self, name: &str) -> Result<(String, VmInfo), ApiError> {
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

    async fn remove_vm(&self, name: &str) -> Result<serde_json::Value, ApiError> {
        let (host, _) = self.locate(name).await?;
        self.host(&host)?
            .delete(&format!("/vms/{name}"), Duration::from_secs(30))
            .await
    }

    async fn move_vm(
        &self,
        name: &str,
        req: MoveRequest,
    ) -> Result<BoxStream<'static, MigrationEvent>, ApiError> {
        let target = self.host(&req.to)?;
        let (source, _) = self.locate(name).await?;
        if source == req.to {
            return Err(ApiError::invalid(
                "to",
                format!("vm {name} already runs on {source}"),
            ));
        }
        let mreq = MigrateRequest {
            target: req.to.clone(),
            target_url: target.base().to_string(),
            option: req.option,
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
                    message: format!(
                        "validation marked {} {} → {} failed ({}): {}",
                        c.host,
                        c.nic.clone().unwrap_or_default(),
                        c.peer.clone().unwrap_or_default(),
                        c.check,
                        c.observed
                    ),
                })
                .collect(),
            None => Vec::new(),
        };
        let vm = name.to_string();
        // a broken event stream is reported as an event, never dropped silently
        let events = events.map(move |r| {
            r.unwrap_or_else(|e| MigrationEvent::Failed {
                error: ApiError::unavailable(
                    format!("events of the migration of {vm} from {source}"),
                    e,
                ),
            })
        });
        Ok(futures::stream::iter(warnings).chain(events).boxed())
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
}
