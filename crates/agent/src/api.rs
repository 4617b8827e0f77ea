//! The agent's HTTP API (all under `/api/v1`). Over TLS, callers need a
//! client certificate of the cluster: routes marked *peer* serve the
//! control service and peer agents (a migration's other end), every other
//! route the control service only — a user's token is never accepted here.
//! Under `--insecure-http` every route takes the cluster credential instead.
//! Handlers only translate HTTP to [`Agent`] calls.
//!
//! | method | path | does |
//! |---|---|---|
//! | GET | /host | *peer*: host, memory, NICs, VMs |
//! | GET/POST | /vms | list / create (body: `VmSpec`) |
//! | GET | /vms/{name}/check | *peer*: guest check (the source's, after the switch-over) |
//! | DELETE | /vms/{name} | stop and remove |
//! | GET | /vms/{name}/console | the end of its serial console (query `bytes`, default 16 KiB, at most 1 MiB) |
//! | POST | /vms/{name}/migrate | move (body: `MigrateRequest`), NDJSON events |
//! | POST | /incoming | *peer*: target: reserve + skeleton (body: `IncomingRequest`) |
//! | GET/DELETE | /incoming/{id} | *peer*: target: status (`?qemu=alive`: QEMU not asked) / discard |
//! | POST | /incoming/{id}/ready | *peer*: target: wait until everything has loaded, paused (before the commit) |
//! | POST | /incoming/{id}/run | *peer*: target: RUN, the source has committed: start the guest, adopt it |
//! | GET | /migrations/{id} | *peer*: source: its record of a migration (`SourceStatus`), asked by a waiting target |
//! | POST | /vms/{name}/resolve | settle a migration of this VM that is in doubt here (`ResolveReport`) |
//! | POST | /incoming/{id}/rejoin | *peer*: target, `mptcp`: announce a NIC's address again (body: `RejoinRequest`) |
//! | GET | /paths | NIC pairs to peers, as last probed (`NicPath`) |
//! | POST | /paths/probe | probe the peers given (body: `[PeerRef]`) now, not from the cache; return every pair |
//! | GET | /validate/facts | NICs, CPU power, queues, RDMA as seen here |
//! | POST | /validate/path | largest don't-fragment packet to a peer |
//! | POST, GET | /validate/sink, /validate/sink/{port} | throughput sink and its count |
//! | POST | /validate/send | send to a peer's sink for a while |
//! | GET/PUT | /bandwidth | classes enforced here and their rates / set the policy (body: `BandwidthPolicy`) |
//! | GET | /pki | this agent's certificate: serial, end, revocation list in force (`PkiStatus`) |
//! | POST | /pki/request | a new key, kept here, and its signing request (`CertRenewal`) |
//! | PUT | /pki/certificate | the renewed certificate for that key (body: `CertInstall`), in force from the next connection |
//! | PUT | /pki/crl | a revocation list signed by the cluster CA, no older than the one in force (body: `CrlInstall`) |

use std::sync::Arc;

use axum::{
    extract::{Path, State},
    middleware,
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use ferry_api::validation::{
    HostFacts, PathProbeRequest, PathProbeResult, SendRequest, SendResult, SinkReply, SinkRequest,
    SinkResult,
};
use ferry_api::{ApiError, IncomingRequest, MigrateRequest, VmSpec};
use ferry_net::server::{
    ndjson, not_found, require_peer, ApiJson, ErrorResponse, PeerAuth, PeerCert,
};
use ferry_net::tls::Role;
use tokio_stream_shim::ReceiverStream;

use crate::Agent;

type R<T> = Result<Json<T>, ErrorResponse>;

async fn host(State(a): State<Arc<Agent>>) -> R<ferry_api::HostInfo> {
    Ok(Json(a.host_info().await))
}

async fn paths(State(a): State<Arc<Agent>>) -> R<Vec<ferry_api::NicPath>> {
    Ok(Json(a.facts.paths.all()))
}

async fn probe_paths(
    State(a): State<Arc<Agent>>,
    ApiJson(peers): ApiJson<Vec<ferry_api::PeerRef>>,
) -> R<Vec<ferry_api::NicPath>> {
    Ok(Json(a.probe_peers(peers).await))
}

async fn list_vms(State(a): State<Arc<Agent>>) -> R<Vec<ferry_api::VmInfo>> {
    Ok(Json(a.list_vms().await))
}

/// The boot runs to its end even when the caller hangs up (a control
/// instance that dies mid-failover): a half-made VM would hold its name
/// and memory, with no one to finish or undo it.
async fn create_vm(
    State(a): State<Arc<Agent>>,
    ApiJson(spec): ApiJson<VmSpec>,
) -> R<ferry_api::VmInfo> {
    let boot = tokio::spawn(async move { a.create_vm(spec).await });
    let vm = boot
        .await
        .map_err(|e| ApiError::internal(format!("the boot's task ended: {e}")))??;
    Ok(Json(vm))
}

/// `?after=N`: the guest's last tick on the host it came from.
#[derive(serde::Deserialize)]
struct CheckQuery {
    after: Option<u64>,
}

async fn check_vm(
    State(a): State<Arc<Agent>>,
    Path(name): Path<String>,
    axum::extract::Query(q): axum::extract::Query<CheckQuery>,
) -> R<ferry_api::CheckResult> {
    Ok(Json(a.check_vm(&name, q.after).await?))
}

/// `?bytes=N`: how much of the console's end (default 16 KiB).
#[derive(serde::Deserialize)]
struct ConsoleQuery {
    bytes: Option<u64>,
}

async fn console(
    State(a): State<Arc<Agent>>,
    Path(name): Path<String>,
    axum::extract::Query(q): axum::extract::Query<ConsoleQuery>,
) -> R<ferry_api::ConsoleTail> {
    Ok(Json(
        a.console_tail(&name, q.bytes.unwrap_or(16 << 10)).await?,
    ))
}

async fn plug_disk(
    State(a): State<Arc<Agent>>,
    Path(name): Path<String>,
    ApiJson(plug): ApiJson<ferry_api::DiskPlug>,
) -> R<ferry_api::VmInfo> {
    Ok(Json(a.plug_disk(&name, plug).await?))
}

async fn grow_disk(
    State(a): State<Arc<Agent>>,
    Path((name, disk)): Path<(String, String)>,
    ApiJson(r): ApiJson<ferry_api::storage::DiskResizeRequest>,
) -> R<ferry_api::VmInfo> {
    Ok(Json(a.grow_disk(&name, &disk, r.size).await?))
}

async fn hold_disk(
    State(a): State<Arc<Agent>>,
    Path((name, disk)): Path<(String, String)>,
) -> R<ferry_api::VmInfo> {
    Ok(Json(a.hold_for_disk(&name, &disk).await?))
}

async fn switch_disk(
    State(a): State<Arc<Agent>>,
    Path((name, disk)): Path<(String, String)>,
    ApiJson(r): ApiJson<ferry_api::storage::DiskSwitchRequest>,
) -> R<ferry_api::VmInfo> {
    Ok(Json(a.switch_disk(&name, &disk, r.uri).await?))
}

async fn remove_vm(State(a): State<Arc<Agent>>, Path(name): Path<String>) -> R<serde_json::Value> {
    a.remove_vm(&name).await?;
    Ok(Json(serde_json::json!({ "removed": name })))
}

async fn migrate(
    State(a): State<Arc<Agent>>,
    Path(name): Path<String>,
    ApiJson(req): ApiJson<MigrateRequest>,
) -> Response {
    match a.start_migration(&name, req).await {
        Ok(rx) => ndjson(ReceiverStream(rx)),
        Err(e) => ErrorResponse(e).into_response(),
    }
}

async fn bandwidth(State(a): State<Arc<Agent>>) -> R<ferry_api::bandwidth::HostBandwidth> {
    Ok(Json(a.bandwidth().await?))
}

async fn set_bandwidth(
    State(a): State<Arc<Agent>>,
    ApiJson(p): ApiJson<ferry_api::bandwidth::BandwidthPolicy>,
) -> R<ferry_api::bandwidth::HostBandwidth> {
    Ok(Json(a.set_bandwidth(p).await?))
}

/// The calling peer agent, when the caller is one (None: the control
/// service, or a caller known by the cluster credential).
type Caller = Option<axum::Extension<PeerCert>>;

fn peer_agent(caller: &Caller) -> Option<&ferry_net::tls::Identity> {
    caller
        .as_ref()
        .map(|axum::Extension(PeerCert(id))| id)
        .filter(|id| id.role == Role::Agent)
}

/// A peer's say over incoming migration `id`: the id as a source makes
/// them, and a peer agent only over the migrations it is the source of.
async fn own_incoming(a: &Agent, id: &str, caller: &Caller) -> Result<(), ApiError> {
    ferry_api::validate_migration_id(id)?;
    if let Some(who) = peer_agent(caller) {
        if let Some(source) = a.incoming_peer(id).await {
            if source != who.name {
                tracing::warn!(caller = %who, migration = %id, %source, "refused: not this migration's source");
                return Err(ApiError::Forbidden {
                    caller: who.to_string(),
                    role: who.role.to_string(),
                    action: format!("act on incoming migration {id}"),
                    needed: format!("the migration's source, {source}"),
                });
            }
        }
    }
    Ok(())
}

async fn incoming(
    State(a): State<Arc<Agent>>,
    caller: Caller,
    ApiJson(req): ApiJson<IncomingRequest>,
) -> R<ferry_api::IncomingReply> {
    ferry_api::validate_migration_id(&req.migration_id)?;
    ferry_api::validate_name("source", &req.source)?;
    // a peer agent hands over only its own VMs: it is the source it names
    if let Some(who) = peer_agent(&caller) {
        if who.name != req.source {
            tracing::warn!(caller = %who, claimed = %req.source, "refused: an incoming migration from another host's name");
            return Err(ApiError::Forbidden {
                caller: who.to_string(),
                role: who.role.to_string(),
                action: format!("hand over a migration as {}", req.source),
                needed: format!("the certificate of {}", req.source),
            }
            .into());
        }
    }
    // and only a move the control service ordered
    if let Some(v) = &a.tickets {
        let digest = ferry_net::ticket::spec_digest(&req.spec);
        let want = ferry_net::ticket::Expect {
            vm: &req.spec.name,
            spec: &digest,
            source: &req.source,
            target: &a.cfg.name,
        };
        if let Err(e) = v.admit(req.ticket.as_ref(), &want, ferry_net::ticket::now_ms()) {
            tracing::warn!(source = %req.source, vm = %req.spec.name, "refused an incoming migration: {e}");
            return Err(ApiError::from(e).into());
        }
    }
    Ok(Json(a.prepare_incoming(req).await?))
}

/// `?qemu=alive`: only whether the target's QEMU lives, QEMU not asked.
#[derive(serde::Deserialize)]
struct IncomingQuery {
    qemu: Option<String>,
}

async fn incoming_status(
    State(a): State<Arc<Agent>>,
    caller: Caller,
    Path(id): Path<String>,
    axum::extract::Query(q): axum::extract::Query<IncomingQuery>,
) -> R<ferry_api::IncomingStatus> {
    own_incoming(&a, &id, &caller).await?;
    Ok(Json(match q.qemu.as_deref() {
        None => a.incoming_status(&id).await?,
        Some("alive") => a.incoming_alive(&id).await?,
        Some(other) => {
            return Err(ApiError::InvalidArgument {
                field: "qemu".into(),
                reason: format!("'{}' is not 'alive'", other.escape_debug()),
            }
            .into())
        }
    }))
}

async fn incoming_ready(
    State(a): State<Arc<Agent>>,
    caller: Caller,
    Path(id): Path<String>,
) -> R<ferry_api::IncomingStatus> {
    own_incoming(&a, &id, &caller).await?;
    Ok(Json(a.ready_incoming(&id).await?))
}

/// RUN and discarding run to their end in their own task: a caller that
/// hangs up (its deadline passed) must not cut a journaled step in half.
async fn incoming_run(
    State(a): State<Arc<Agent>>,
    caller: Caller,
    Path(id): Path<String>,
) -> R<ferry_api::IncomingStatus> {
    own_incoming(&a, &id, &caller).await?;
    let run = tokio::spawn(async move { a.run_incoming(&id).await });
    Ok(Json(run.await.map_err(ApiError::internal)??))
}

async fn migration_record(
    State(a): State<Arc<Agent>>,
    Path(id): Path<String>,
) -> R<ferry_api::SourceStatus> {
    ferry_api::validate_migration_id(&id)?;
    Ok(Json(a.source_status(&id)?))
}

async fn resolve_vm(
    State(a): State<Arc<Agent>>,
    Path(name): Path<String>,
    ApiJson(req): ApiJson<ferry_api::ResolveRequest>,
) -> R<Vec<ferry_api::ResolveReport>> {
    Ok(Json(a.resolve_vm(&name, &req).await?))
}

async fn incoming_recover(
    State(a): State<Arc<Agent>>,
    caller: Caller,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ferry_api::RecoverRequest>,
) -> R<ferry_api::RecoverReply> {
    own_incoming(&a, &id, &caller).await?;
    Ok(Json(a.resume_incoming_postcopy(&id, &req.nic).await?))
}

async fn incoming_rejoin(
    State(a): State<Arc<Agent>>,
    caller: Caller,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ferry_api::RejoinRequest>,
) -> R<serde_json::Value> {
    own_incoming(&a, &id, &caller).await?;
    let nic = a.rejoin_incoming(&id, &req.nic).await?;
    Ok(Json(serde_json::json!({ "announced": nic })))
}

async fn incoming_abort(
    State(a): State<Arc<Agent>>,
    caller: Caller,
    Path(id): Path<String>,
) -> R<serde_json::Value> {
    own_incoming(&a, &id, &caller).await?;
    let id2 = id.clone();
    let abort = tokio::spawn(async move { a.abort_incoming(&id2).await });
    abort.await.map_err(ApiError::internal)??;
    Ok(Json(serde_json::json!({ "discarded": id })))
}

async fn vm_action(
    State(a): State<Arc<Agent>>,
    Path((name, action)): Path<(String, String)>,
    ApiJson(req): ApiJson<ferry_api::ha::ActionRequest>,
) -> R<ferry_api::ha::Stopped> {
    let action = ferry_api::ha::Action::parse(&action)?;
    Ok(Json(a.vm_action(&name, action, &req).await?))
}

async fn lease(State(a): State<Arc<Agent>>) -> R<ferry_api::ha::LeaseState> {
    Ok(Json(a.lease.view()))
}

async fn renew_lease(
    State(a): State<Arc<Agent>>,
    ApiJson(req): ApiJson<ferry_api::ha::LeaseRenewal>,
) -> R<ferry_api::ha::LeaseState> {
    a.lease.renew(&req);
    Ok(Json(a.lease.view()))
}

/// Probes a peer's agent over the migration fabrics (the HA manager's
/// second signal).
async fn peer_alive(
    State(a): State<Arc<Agent>>,
    ApiJson(req): ApiJson<ferry_api::ha::AliveRequest>,
) -> R<ferry_api::ha::Liveness> {
    let mut addrs = Vec::new();
    for s in &req.addresses {
        addrs.push(
            s.parse::<std::net::SocketAddr>()
                .map_err(|_| ApiError::invalid("addresses", format!("'{s}' is not IP:PORT")))?,
        );
    }
    if addrs.len() > 16 {
        return Err(ApiError::invalid("addresses", "more than 16").into());
    }
    use crate::probe::alive::{probe_any, Heard};
    let (heard, at) = probe_any(&a.cfg.name, a.cred.secret(), &req.host, &addrs).await;
    let address = at.map(|a| a.to_string()).unwrap_or_default();
    Ok(Json(match heard {
        Heard::Agent { state, .. } => ferry_api::ha::Liveness::Answered { state, address },
        Heard::AgentDown => ferry_api::ha::Liveness::AgentDown { address },
        Heard::Silent => ferry_api::ha::Liveness::Silent,
    }))
}

async fn facts(State(a): State<Arc<Agent>>) -> R<HostFacts> {
    let (name, rate, nics) = (a.cfg.name.clone(), a.cfg.nic_rate, a.nics());
    tokio::task::spawn_blocking(move || crate::validate::facts(&name, rate, nics))
        .await
        .map(Json)
        .map_err(|e| ErrorResponse(ApiError::internal(e)))
}

async fn probe_path(ApiJson(req): ApiJson<PathProbeRequest>) -> R<PathProbeResult> {
    Ok(Json(crate::validate::probe_path(req).await?))
}

async fn open_sink(
    State(a): State<Arc<Agent>>,
    ApiJson(req): ApiJson<SinkRequest>,
) -> R<SinkReply> {
    Ok(Json(a.sinks.open(req, a.cred.secret()).await?))
}

async fn sink_result(State(a): State<Arc<Agent>>, Path(port): Path<u16>) -> R<SinkResult> {
    Ok(Json(a.sinks.result(port).await?))
}

async fn send(State(a): State<Arc<Agent>>, ApiJson(req): ApiJson<SendRequest>) -> R<SendResult> {
    Ok(Json(crate::validate::send(req, a.cred.secret()).await?))
}

/// Who may call: by certificate, or the cluster credential without TLS.
fn peer_auth(agent: &Agent, roles: &'static [Role]) -> PeerAuth {
    match agent.pki {
        Some(_) => PeerAuth::Certificates(roles),
        None => PeerAuth::Credential(agent.cred.clone()),
    }
}

pub fn router(agent: Arc<Agent>) -> Router {
    // a migration's other end calls these
    let peer = Router::new()
        .route("/host", get(host))
        .route("/incoming", post(incoming))
        .route(
            "/incoming/{id}",
            get(incoming_status).delete(incoming_abort),
        )
        .route("/incoming/{id}/ready", post(incoming_ready))
        .route("/incoming/{id}/run", post(incoming_run))
        .route("/incoming/{id}/rejoin", post(incoming_rejoin))
        .route("/incoming/{id}/recover", post(incoming_recover))
        .route("/migrations/{id}", get(migration_record))
        // the source checks the guest on the target after the switch-over
        .route("/vms/{name}/check", get(check_vm))
        .layer(middleware::from_fn_with_state(
            peer_auth(&agent, &[Role::Control, Role::Agent]),
            require_peer,
        ))
        .with_state(agent.clone());
    let control = Router::new()
        .route("/vms", get(list_vms).post(create_vm))
        .route("/vms/{name}", axum::routing::delete(remove_vm))
        .route("/vms/{name}/console", get(console))
        .route("/vms/{name}/disks", post(plug_disk))
        .route(
            "/vms/{name}/disks/{disk}/size",
            axum::routing::put(grow_disk),
        )
        .route("/vms/{name}/disks/{disk}/hold", post(hold_disk))
        .route("/vms/{name}/disks/{disk}/switch", post(switch_disk))
        .route("/vms/{name}/migrate", post(migrate))
        .route("/vms/{name}/resolve", post(resolve_vm))
        .route("/vms/{name}/action/{action}", post(vm_action))
        .route("/lease", get(lease).put(renew_lease))
        .route("/peers/alive", post(peer_alive))
        .route("/paths", get(paths))
        .route("/paths/probe", post(probe_paths))
        .route("/validate/facts", get(facts))
        .route("/validate/path", post(probe_path))
        .route("/validate/sink", post(open_sink))
        .route("/validate/sink/{port}", get(sink_result))
        .route("/validate/send", post(send))
        .route("/bandwidth", get(bandwidth).put(set_bandwidth))
        .layer(middleware::from_fn_with_state(
            peer_auth(&agent, &[Role::Control]),
            require_peer,
        ))
        .with_state(agent.clone());
    // unknown routes are refused like the rest
    let fallback = Router::new()
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(
            peer_auth(&agent, &[Role::Control, Role::Agent]),
            require_peer,
        ));
    let mut api = peer.merge(control);
    if let Some(p) = &agent.pki {
        api = api.merge(ferry_net::server::pki_routes(p.clone()));
    }
    Router::new()
        .nest(ferry_api::API_PREFIX, api)
        .merge(fallback)
}

/// Serves the agent until the process ends: first settles what its journal
/// left open (see [`crate::commit`]), then reaps and questions skeletons every 2 s.
pub async fn serve(agent: Arc<Agent>) -> std::io::Result<()> {
    agent.recover().await;
    let forgetter = agent.clone();
    tokio::spawn(async move { forgetter.forget_settled().await });
    let listener = tokio::net::TcpListener::bind(agent.cfg.listen).await?;
    let probes = std::net::UdpSocket::bind(std::net::SocketAddr::from((
        [0, 0, 0, 0],
        agent.cfg.probe_port,
    )))?;
    let (name, secret) = (agent.cfg.name.clone(), agent.cred.secret().to_vec());
    let lease = agent.lease.clone();
    std::thread::Builder::new()
        .name("probe-responder".into())
        .spawn(move || crate::probe::respond(probes, name, secret, move || lease.view()))?;
    tokio::spawn(agent.clone().watch_lease());
    tracing::info!(host = %agent.cfg.name, listen = %agent.cfg.listen, "agent serving");
    let classes = agent.classes.clone();
    tokio::spawn(async move {
        // bandwidth classes follow NICs going down and up, and rates
        loop {
            crate::facts::tick(std::time::Duration::from_secs(1)).await;
            if ferry_api::util::lock(&classes).is_idle() {
                continue; // no policy: not worth a hand-off to the blocking pool
            }
            let c = classes.clone();
            let _ =
                tokio::task::spawn_blocking(move || ferry_api::util::lock(&c).reconcile()).await;
        }
    });
    let gauge = agent.clone();
    tokio::spawn(async move { gauge.facts.idle.run().await });
    // the CPU models QEMU offers, asked before a first migration needs them
    let catalog = agent.clone();
    tokio::spawn(async move {
        if let Err(e) = catalog.cpu_catalog().await {
            tracing::warn!(error = %e, "cannot ask QEMU for its CPU models");
        }
    });
    let sampler = agent.clone();
    tokio::spawn(async move { sampler.sample_dirty_rates().await });
    let watcher = agent.clone();
    tokio::spawn(async move {
        // guests waiting for their storage: paused, resumed, stopped
        loop {
            crate::facts::tick(std::time::Duration::from_secs(1)).await;
            watcher.watch_storage().await;
        }
    });
    let reaper = agent.clone();
    tokio::spawn(async move {
        loop {
            crate::facts::tick(std::time::Duration::from_secs(2)).await;
            reaper.reap_incoming().await;
            reaper.settle_committed().await;
            reaper.rotate_consoles().await;
        }
    });
    let tls = match &agent.pki {
        Some(p) => Some(
            p.server_tls(true)
                .map_err(|e| std::io::Error::other(e.to_string()))?,
        ),
        None => None,
    };
    let limits = agent.cfg.limits;
    ferry_net::server::serve_with(listener, router(agent), tls, limits).await
}

/// A `Stream` over a tokio mpsc receiver (what tokio-stream's wrapper does).
mod tokio_stream_shim {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    pub struct ReceiverStream<T>(pub tokio::sync::mpsc::Receiver<T>);

    impl<T> futures::Stream for ReceiverStream<T> {
        type Item = T;
        fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
            self.0.poll_recv(cx)
        }
    }
}
