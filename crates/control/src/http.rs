//! REST front of the control service: `/api/v1/...`, every route behind a
//! user's API token (see [`crate::tokens`]); each command needs a role
//! ([`Command::needs`]). Each handler turns its request into one [`Command`].
//!
//! | method | path | command |
//! |---|---|---|
//! | GET | /hosts | ListHosts |
//! | GET | /vms | ListVms |
//! | POST | /vms | CreateVm (body: `VmCreateRequest`) |
//! | GET | /vms/{name}/check | CheckVm |
//! | POST | /vms/{name}/resolve | ResolveVm |
//! | DELETE | /vms/{name} | RemoveVm |
//! | POST | /vms/{name}/move | MoveVm (body: `MoveRequest`), NDJSON `MigrationEvent`s; header `X-Ferry-Operation`: its operation's id |
//! | POST | /vms/{name}/start | VmAction start (body: `ActionRequest`) → `VmInfo` |
//! | POST | /vms/{name}/stop | VmAction stop → `Stopped` |
//! | POST | /vms/{name}/shutdown | VmAction shutdown (`timeout_s`) → `Stopped` |
//! | POST | /vms/{name}/reboot | VmAction reboot → `Stopped` |
//! | POST | /vms/{name}/restart | VmAction restart → {shutdown, started} |
//! | PUT | /vms/{name}/ha | SetVmHa (body: `HaUpdate`) → `HaPolicy` |
//! | POST | /validate | Validate (body: `ValidateRequest`) → `ValidationReport` |
//! | POST | /hosts/{host}/drain | Drain (body: `DrainRequest`), NDJSON `DrainEvent`s; header `X-Ferry-Operation`: its operation's id |
//! | POST | /hosts/{host}/resume | Resume: the host takes VMs again |
//! | PUT | /hosts/{host}/settings | SetHost (body: `HostSettings`) |
//! | GET | /disks | Storage(ListDisks) |
//! | POST | /disks | Storage(CreateDisk) (body: `DiskCreateRequest`) |
//! | PUT | /disks/{d}/size | Storage(ResizeDisk) (body: `DiskResizeRequest`) |
//! | PUT | /disks/{d}/policy | Storage(SetDisk) (body: `DiskSetRequest`) |
//! | DELETE | /disks/{d} | Storage(RemoveDisk) |
//! | POST | /disks/{d}/attach | Storage(AttachDisk) (body: `DiskAttachRequest`) |
//! | POST | /disks/{d}/backups | Storage(Backup) (body: `BackupRequest`) → `JobInfo` (admin) |
//! | GET | /disks/{d}/job | Storage(Job) → `JobInfo`: the disk's last backup or checkpoint job |
//! | GET/POST | /disks/{d}/checkpoints | Storage(ListCheckpoints / CreateCheckpoint) (body: `CheckpointRequest`) |
//! | DELETE | /disks/{d}/checkpoints/{cp} | Storage(RemoveCheckpoint) |
//! | POST | /disks/{d}/checkpoints/{cp}/revert | Storage(RevertCheckpoint) → `DiskInfo` |
//! | GET/POST | /disks/{d}/move | Storage(MoveStatus / MoveDisk) (body: `DiskMoveRequest`), NDJSON `DiskMoveInfo`s |
//! | POST/DELETE | /disks/{d}/replica | Storage(Replicate / StopReplica) (body: `ReplicaRequest`) → `PushInfo` |
//! | POST | /disks/{d}/replica/failover | Storage(FailoverReplica) → `DiskInfo` |
//! | GET | /replicas | Storage(ListReplicas) (query `disk`) → `[PushInfo]` |
//! | GET | /qos/policies | Storage(ListPolicies) |
//! | POST | /qos/policies | Storage(NewPolicy) (body: `Policy`) |
//! | PUT | /qos/policies/{p} | Storage(UpdatePolicy) (body: `PolicyUpdate`) |
//! | DELETE | /qos/policies/{p} | Storage(RemovePolicy) |
//! | GET | /qos/flows | Storage(ListFlows) |
//! | GET | /storage/nodes | Storage(ListNodes): storage nodes and whether they answer |
//! | GET/PUT | /qos/settings | Storage(GetSettings / SetSettings) (body: `QosSettings`) |
//! | GET | /bandwidth | ListBandwidth: the policy, and per host and NIC each class's rate, ceiling and current rate |
//! | PUT | /bandwidth | SetBandwidth (body: `BandwidthSetRequest`) |
//! | GET/POST/DELETE | /cluster/rolling | RollingStatus / StartRolling (body: `RollingRequest`) / StopRolling → `RollingStatus` |
//! | GET/PUT | /cluster | GetCluster / SetCluster (body: `ClusterSettingsUpdate`): cluster-wide settings |
//! | GET | /cluster/control | ControlStatus: this control instance, and which instance leads (see [`crate::leader`]) |
//! | POST | /cluster/certificates/requests | CertRequests → `[RenewalItem]`: a new key and signing request from every component (admin) |
//! | POST | /cluster/certificates | InstallCerts (body: `[SignedCert]`) → `[InstallResult]` (admin) |
//! | GET/PUT | /cluster/crl | GetCrl → `CrlInfo` / SetCrl (body: `CrlInstall`) → `[InstallResult]`: the revocation list, in force everywhere (admin) |
//! | GET | /placement | GetPlacement → `PlacementStatus`: rules, host groups, labels, and the strict rules broken now |
//! | POST | /placement/rules | CreateRule (body: `Rule`) → `PlacementConfig`; refused naming the conflict when it cannot be met |
//! | DELETE | /placement/rules/{name} | RemoveRule |
//! | POST | /placement/groups | SetGroup (body: `HostGroup`) → `PlacementConfig` |
//! | DELETE | /placement/groups/{name} | RemoveGroup |
//! | PUT | /hosts/{host}/labels | SetLabels (body: `LabelUpdate`) → the host's labels |
//! | POST | /cluster/balance | Balance (body: `BalanceRequest`) → `BalancePlan`; its moves run unless `dry_run` |
//! | GET | /events | Events (query `limit`, default 100): the event log, oldest first |
//! | GET | /tokens | ListTokens |
//! | POST | /tokens | CreateToken (body: `TokenCreateRequest`) → `TokenCreated` (the secret, this once) |
//! | DELETE | /tokens/{name} | RevokeToken |
//! | GET | /metrics (no prefix) | Metrics: Prometheus text of hosts, NICs, migrations, drains, flows |
//! | GET | /watch | what the topics asked answer (query `topics`: `hosts`, `vms`, `flows`, `events`), each as a Server-Sent Event named by its topic when it changed (checked each second), for 5 minutes a stream |
//! | GET | /operations | ListOperations: migrations and drains, running and recent (`[Operation]`, newest first) |
//! | GET | /operations/{id} | GetOperation → `Operation` with every event so far |
//! | GET | /watch/operations/{id} | an operation's events as Server-Sent Events (`op`, id = its index; `Last-Event-ID` resumes), then `end` with the `Operation` |
//! | GET | /vms/{name}/console | ConsoleTail (query `bytes`, default 16 KiB, at most 1 MiB) → `ConsoleTail` |
//! | GET/POST/DELETE | /session | the web console's session: who is signed in / sign in (body `{"token"}`, sets the cookie) / sign out (see [`crate::sessions`]) |

use std::sync::Arc;

use axum::{
    extract::{Path, State},
    middleware,
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use ferry_api::{MoveRequest, ValidateRequest, VmCreateRequest};
use ferry_net::server::{ndjson, not_found, ApiJson, ErrorResponse};

use crate::storage::StorageCommand;
use crate::tokens::Caller;
use crate::{Command, Control, Outcome};

tokio::task_local! {
    /// The caller of the request being handled, set by [`authenticate`].
    static CALLER: Caller;
}

/// Middleware: every request carries a valid, unrevoked API token — in
/// its `Authorization` header, or the token of the browser session its
/// cookie names (see [`crate::sessions`]; a changing request must then
/// carry the session's CSRF token too); the token's name and role go with
/// the request to [`run`]. Refusals are 401 (403 without the CSRF token),
/// in the service's log and the event log.
async fn authenticate(
    State(c): State<Arc<Control>>,
    req: axum::extract::Request,
    next: middleware::Next,
) -> Response {
    let source = req
        .extensions()
        .get::<ferry_net::server::ClientAddr>()
        .map(|a| a.0.ip().to_string())
        .unwrap_or_else(|| "a client".into());
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let by_session = match session_caller(&c, req.headers(), &method, &path).await {
        Ok(Some(caller)) => Ok(caller),
        Ok(None) => c.tokens.authenticate(
            req.headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok()),
        ),
        Err(e) => Err(e),
    };
    match by_session {
        Ok(caller) => CALLER.scope(caller, next.run(req)).await,
        Err(e) => {
            let path = req.uri().path().to_string();
            tracing::warn!(%path, %source, "refused: {e}");
            c.log_refusal(&source, &path, &e);
            ErrorResponse(e).into_response()
        }
    }
}

/// Who made a request through the browser session its cookie names, when
/// it has no `Authorization` header; a changing request without the
/// session's CSRF token is refused.
async fn session_caller(
    c: &Control,
    headers: &axum::http::HeaderMap,
    method: &axum::http::Method,
    path: &str,
) -> Result<Option<Caller>, ferry_api::ApiError> {
    use crate::sessions;
    if headers.contains_key("authorization") {
        return Ok(None);
    }
    let Some(id) = sessions::cookie_id(headers) else {
        return Ok(None);
    };
    let Some((token, csrf)) = c.sessions.get(&c.store, &id).await else {
        return Err(ferry_api::ApiError::unauthorized(
            "the session has ended: sign in again",
        ));
    };
    let given = headers
        .get(sessions::CSRF_HEADER)
        .and_then(|v| v.to_str().ok());
    if sessions::changes(method) && !sessions::csrf_ok(given, &csrf) {
        return Err(ferry_api::ApiError::Refused {
            reason: format!(
                "{method} {path} from a browser session without its CSRF token (X-Ferry-CSRF)"
            ),
        });
    }
    c.tokens.by_hash(&token).map(Some)
}

/// `POST /api/v1/session` body.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SignIn {
    token: String,
}

/// What a session answers: who is signed in, and the CSRF token for its
/// changing requests.
fn session_body(caller: &Caller, csrf: &str) -> serde_json::Value {
    serde_json::json!({ "name": caller.name, "role": caller.role.as_str(), "csrf": csrf })
}

/// The session the cookie in `headers` names: (ID, who, CSRF token).
async fn current_session(
    c: &Control,
    headers: &axum::http::HeaderMap,
) -> Result<(String, Caller, String), ferry_api::ApiError> {
    let id = crate::sessions::cookie_id(headers)
        .ok_or_else(|| ferry_api::ApiError::unauthorized("not signed in"))?;
    let (token, csrf) =
        c.sessions.get(&c.store, &id).await.ok_or_else(|| {
            ferry_api::ApiError::unauthorized("the session has ended: sign in again")
        })?;
    match c.tokens.by_hash(&token) {
        Ok(caller) => Ok((id, caller, csrf)),
        Err(e) => {
            c.sessions.close(&c.store, &id).await;
            Err(e)
        }
    }
}

/// Sign-in, the session, sign-out: outside [`authenticate`], each checks
/// what it needs itself.
fn session_routes(control: Arc<Control>) -> Router {
    use crate::sessions;
    use axum::http::{header::SET_COOKIE, HeaderMap};
    let refused = |c: &Control, e: ferry_api::ApiError| {
        c.log_refusal("sign-in", &format!("{}/session", ferry_api::API_PREFIX), &e);
        ErrorResponse(e).into_response()
    };
    let secure = |c: &Control| c.secure_cookies.load(std::sync::atomic::Ordering::Relaxed);
    Router::new()
        .route(
            &format!("{}/session", ferry_api::API_PREFIX),
            post(move |State(c): S, ApiJson(r): ApiJson<SignIn>| async move {
                match c.tokens.authenticate(Some(&format!("Bearer {}", r.token.trim()))) {
                    Ok(caller) => {
                        let token = ferry_api::auth::token_hash(r.token.trim());
                        let (id, csrf) = match c.sessions.open(&c.store, &token).await {
                            Ok(s) => s,
                            Err(e) => return ErrorResponse(e).into_response(),
                        };
                        c.log(
                            "session",
                            &caller.name,
                            serde_json::json!({ "action": "signed in", "role": caller.role.as_str() }),
                        );
                        (
                            [(SET_COOKIE, sessions::set_cookie(Some(&id), secure(&c)))],
                            Json(session_body(&caller, &csrf)),
                        )
                            .into_response()
                    }
                    Err(e) => refused(&c, e),
                }
            })
            .get(move |State(c): S, headers: HeaderMap| async move {
                match current_session(&c, &headers).await {
                    Ok((_, caller, csrf)) => Json(session_body(&caller, &csrf)).into_response(),
                    Err(e) => ErrorResponse(e).into_response(),
                }
            })
            .delete(move |State(c): S, headers: HeaderMap| async move {
                let (id, caller, csrf) = match current_session(&c, &headers).await {
                    Ok(s) => s,
                    Err(e) => return ErrorResponse(e).into_response(),
                };
                let given = headers.get(sessions::CSRF_HEADER).and_then(|v| v.to_str().ok());
                if !sessions::csrf_ok(given, &csrf) {
                    return refused(
                        &c,
                        ferry_api::ApiError::Refused {
                            reason: "signing out needs the session's CSRF token (X-Ferry-CSRF)".into(),
                        },
                    );
                }
                c.sessions.close(&c.store, &id).await;
                c.log("session", &caller.name, serde_json::json!({ "action": "signed out" }));
                (
                    [(SET_COOKIE, sessions::set_cookie(None, secure(&c)))],
                    Json(serde_json::json!({})),
                )
                    .into_response()
            }),
        )
        .with_state(control)
}

use ferry_api::drain::{DrainRequest, HostSettings};
use ferry_api::storage::{
    BackupRequest, CheckpointRequest, DiskAttachRequest, DiskCreateRequest, DiskMoveRequest,
    DiskResizeRequest, DiskSetRequest, Policy, PolicyUpdate, QosSettings, ReplicaRequest,
};

async fn run(c: &Arc<Control>, cmd: Command) -> Response {
    let caller = CALLER.try_with(Caller::clone);
    let r = match caller {
        Ok(caller) => c.execute_as(&caller, cmd).await,
        // every route is behind `authenticate`
        Err(_) => Err(ferry_api::ApiError::unauthorized("no API token")),
    };
    match r {
        Ok(Outcome::Value(v)) => Json(v).into_response(),
        Ok(Outcome::Events(s)) => ndjson(s),
        Ok(Outcome::Operation(op)) => {
            let id = op.id();
            let mut r = ndjson(op.follow(0));
            if let Ok(v) = axum::http::HeaderValue::from_str(&id) {
                r.headers_mut().insert(OPERATION_HEADER, v);
            }
            r
        }
        Ok(Outcome::Text(t)) => (
            [(
                axum::http::header::CONTENT_TYPE,
                "text/plain; version=0.0.4",
            )],
            t,
        )
            .into_response(),
        Err(e) => ErrorResponse(e).into_response(),
    }
}

type S = State<Arc<Control>>;

/// How long one `GET /watch` stream lasts; the browser's EventSource
/// then opens another, authenticated afresh (a revoked token or an ended
/// session stops there).
const WATCH_FOR: std::time::Duration = std::time::Duration::from_secs(300);

/// The header naming a started migration's or drain's operation.
pub const OPERATION_HEADER: &str = "x-ferry-operation";

/// A topic of `GET /watch`: its name and the command it runs.
type Topic = (&'static str, fn() -> Command);

/// What `GET /watch` can push.
const TOPICS: &[Topic] = &[
    ("hosts", || Command::ListHosts),
    ("vms", || Command::ListVms),
    ("flows", || Command::Storage(StorageCommand::ListFlows)),
    ("events", || Command::Events { limit: 50 }),
];

#[derive(serde::Deserialize)]
struct WatchQuery {
    topics: Option<String>,
}

/// `GET /watch?topics=hosts,vms`: Server-Sent Events, each topic's answer
/// (what its GET answers) as an event named by the topic, sent when it
/// changed (looked at each second; the first at once), as the caller of the
/// request that opened it. One stream for every topic a page shows: a
/// browser opens few connections to one server.
async fn watch(State(c): S, axum::extract::Query(q): axum::extract::Query<WatchQuery>) -> Response {
    use axum::response::sse::{Event, KeepAlive, Sse};
    let Ok(caller) = CALLER.try_with(Caller::clone) else {
        return ErrorResponse(ferry_api::ApiError::unauthorized("no API token")).into_response();
    };
    let asked = q.topics.unwrap_or_else(|| "hosts".into());
    let mut topics = Vec::new();
    for t in asked.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        match TOPICS.iter().find(|(name, _)| *name == t) {
            Some(&topic) => topics.push(topic),
            None => {
                let known: Vec<&str> = TOPICS.iter().map(|(n, _)| *n).collect();
                return ErrorResponse(ferry_api::ApiError::InvalidArgument {
                    field: "topics".into(),
                    reason: format!("no topic '{t}' (known: {})", known.join(", ")),
                })
                .into_response();
            }
        }
    }
    // refused at once (the role) rather than as a stream of errors
    for (_, cmd) in &topics {
        if let Err(e) = crate::permitted(&caller, &cmd()) {
            return ErrorResponse(e).into_response();
        }
    }
    let slot = match stream_slot(&c, &caller) {
        Ok(s) => s,
        Err(r) => return r.into_response(),
    };
    let until = tokio::time::Instant::now() + WATCH_FOR;
    use futures::StreamExt;
    // each topic on its own: a slow answer (an agent busy loading a guest)
    // holds back its topic only
    let streams = topics.into_iter().map(|(name, cmd)| {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let state = (c.clone(), caller.clone(), tick, String::new());
        futures::stream::unfold(state, move |(c, caller, mut tick, mut last)| async move {
            loop {
                tick.tick().await;
                if tokio::time::Instant::now() >= until {
                    return None;
                }
                let ev = match c.execute_as(&caller, cmd()).await {
                    Ok(Outcome::Value(v)) => {
                        let text = v.to_string();
                        if text == last {
                            continue;
                        }
                        last = text.clone();
                        Event::default().event(name).data(text)
                    }
                    Ok(_) => Event::default().event("error").data("unexpected answer"),
                    Err(e) => Event::default()
                        .event("error")
                        .data(e.to_body().to_string()),
                };
                let ev = ev.retry(std::time::Duration::from_millis(500));
                return Some((
                    Ok::<_, std::convert::Infallible>(ev),
                    (c, caller, tick, last),
                ));
            }
        })
        .boxed()
    });
    // the slot goes back when the client does (the stream is dropped)
    let events = futures::stream::select_all(streams).map(move |e| {
        let _held = &slot;
        e
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// One more event stream for `caller`'s token, or the refusal (logged).
fn stream_slot(c: &Control, caller: &Caller) -> Result<crate::limits::StreamSlot, ErrorResponse> {
    c.streams
        .open(&caller.name, c.max_streams_per_token)
        .map_err(|e| {
            c.log_refused(
                &format!("token {}", caller.name),
                "watch",
                serde_json::json!({ "by": caller.name, "status": 429, "reason": e.to_string() }),
            );
            ErrorResponse(e)
        })
}

/// `GET /watch/operations/{id}`: the operation's events as Server-Sent
/// Events named `op` (data: the event, id: its index; a reconnecting
/// browser's `Last-Event-ID` resumes after it), then `end` with the
/// operation (its state, no events) — the page closes the stream there.
async fn watch_operation(
    State(c): S,
    Path(id): Path<String>,
    headers: axum::http::HeaderMap,
) -> Response {
    use axum::response::sse::{Event, KeepAlive, Sse};
    use futures::StreamExt;
    let Ok(caller) = CALLER.try_with(Caller::clone) else {
        return ErrorResponse(ferry_api::ApiError::unauthorized("no API token")).into_response();
    };
    // the role as for GET /operations/{id}, without copying its events
    let op = match crate::permitted(&caller, &Command::GetOperation { id: id.clone() }) {
        Ok(()) => c.operation(&id).await,
        Err(e) => Err(e),
    };
    let op = match op {
        Ok(op) => op,
        Err(e) => return ErrorResponse(e).into_response(),
    };
    let from = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(0, |i| i + 1);
    let slot = match stream_slot(&c, &caller) {
        Ok(s) => s,
        Err(r) => return r.into_response(),
    };
    let end = op.clone();
    let events = op
        .follow(from)
        .enumerate()
        .map(move |(i, ev)| {
            Event::default()
                .event("op")
                .id((from + i).to_string())
                .data(ev.to_string())
        })
        .chain(futures::stream::once(async move {
            let mut o = end.snapshot();
            o.events.clear();
            Event::default()
                .event("end")
                .data(serde_json::to_string(&o).unwrap_or_default())
        }))
        .map(move |e| {
            let _held = &slot;
            Ok::<_, std::convert::Infallible>(e)
        });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[derive(serde::Deserialize)]
struct ConsoleQuery {
    bytes: Option<u64>,
}

async fn hosts(State(c): S) -> Response {
    run(&c, Command::ListHosts).await
}
async fn vms(State(c): S) -> Response {
    run(&c, Command::ListVms).await
}
async fn create(State(c): S, ApiJson(req): ApiJson<VmCreateRequest>) -> Response {
    run(&c, Command::CreateVm(Box::new(req))).await
}
async fn check(State(c): S, Path(name): Path<String>) -> Response {
    run(&c, Command::CheckVm { name }).await
}
async fn resolve(
    State(c): S,
    Path(name): Path<String>,
    ApiJson(req): ApiJson<ferry_api::ResolveRequest>,
) -> Response {
    run(&c, Command::ResolveVm { name, req }).await
}
async fn vm_action(
    c: &Arc<Control>,
    name: String,
    action: ferry_api::ha::Action,
    req: ferry_api::ha::ActionRequest,
) -> Response {
    run(c, Command::VmAction { name, action, req }).await
}
async fn vm_start(
    State(c): S,
    Path(name): Path<String>,
    ApiJson(req): ApiJson<ferry_api::ha::ActionRequest>,
) -> Response {
    vm_action(&c, name, ferry_api::ha::Action::Start, req).await
}
async fn vm_stop(
    State(c): S,
    Path(name): Path<String>,
    ApiJson(req): ApiJson<ferry_api::ha::ActionRequest>,
) -> Response {
    vm_action(&c, name, ferry_api::ha::Action::Stop, req).await
}
async fn vm_shutdown(
    State(c): S,
    Path(name): Path<String>,
    ApiJson(req): ApiJson<ferry_api::ha::ActionRequest>,
) -> Response {
    vm_action(&c, name, ferry_api::ha::Action::Shutdown, req).await
}
async fn vm_reboot(
    State(c): S,
    Path(name): Path<String>,
    ApiJson(req): ApiJson<ferry_api::ha::ActionRequest>,
) -> Response {
    vm_action(&c, name, ferry_api::ha::Action::Reboot, req).await
}
async fn vm_restart(
    State(c): S,
    Path(name): Path<String>,
    ApiJson(req): ApiJson<ferry_api::ha::ActionRequest>,
) -> Response {
    vm_action(&c, name, ferry_api::ha::Action::Restart, req).await
}
async fn vm_ha(
    State(c): S,
    Path(name): Path<String>,
    ApiJson(update): ApiJson<ferry_api::ha::HaUpdate>,
) -> Response {
    run(&c, Command::SetVmHa { name, update }).await
}
async fn remove(State(c): S, Path(name): Path<String>) -> Response {
    run(&c, Command::RemoveVm { name }).await
}
async fn drain(
    State(c): S,
    Path(host): Path<String>,
    ApiJson(req): ApiJson<DrainRequest>,
) -> Response {
    run(&c, Command::Drain { host, req }).await
}
async fn resume(State(c): S, Path(host): Path<String>) -> Response {
    run(&c, Command::Resume { host }).await
}
async fn set_host(
    State(c): S,
    Path(host): Path<String>,
    ApiJson(settings): ApiJson<HostSettings>,
) -> Response {
    run(&c, Command::SetHost { host, settings }).await
}
async fn validate(State(c): S, ApiJson(req): ApiJson<ValidateRequest>) -> Response {
    run(&c, Command::Validate(req)).await
}
async fn move_vm(
    State(c): S,
    Path(name): Path<String>,
    ApiJson(req): ApiJson<MoveRequest>,
) -> Response {
    run(&c, Command::MoveVm { name, req }).await
}

#[derive(serde::Deserialize)]
struct ReplicaQuery {
    disk: Option<String>,
}

#[derive(serde::Deserialize)]
struct EventsQuery {
    limit: Option<usize>,
}

async fn storage(c: &Arc<Control>, cmd: StorageCommand) -> Response {
    run(c, Command::Storage(cmd)).await
}

fn storage_routes() -> Router<Arc<Control>> {
    use axum::routing::{delete, put};
    Router::new()
        .route(
            "/disks",
            get(|State(c): S| async move { storage(&c, StorageCommand::ListDisks).await }).post(
                |State(c): S, ApiJson(r): ApiJson<DiskCreateRequest>| async move {
                    storage(&c, StorageCommand::CreateDisk(r)).await
                },
            ),
        )
        .route(
            "/disks/{d}",
            delete(|State(c): S, Path(name): Path<String>| async move {
                storage(&c, StorageCommand::RemoveDisk { name }).await
            }),
        )
        .route(
            "/disks/{d}/size",
            put(
                |State(c): S, Path(name): Path<String>, ApiJson(r): ApiJson<DiskResizeRequest>| async move {
                    storage(&c, StorageCommand::ResizeDisk { name, size: r.size }).await
                },
            ),
        )
        .route(
            "/disks/{d}/policy",
            put(
                |State(c): S, Path(name): Path<String>, ApiJson(req): ApiJson<DiskSetRequest>| async move {
                    storage(&c, StorageCommand::SetDisk { name, req }).await
                },
            ),
        )
        .route(
            "/disks/{d}/attach",
            post(
                |State(c): S, Path(name): Path<String>, ApiJson(req): ApiJson<DiskAttachRequest>| async move {
                    storage(&c, StorageCommand::AttachDisk { name, req }).await
                },
            ),
        )
        .route(
            "/disks/{d}/backups",
            post(
                |State(c): S, Path(name): Path<String>, ApiJson(req): ApiJson<BackupRequest>| async move {
                    storage(&c, StorageCommand::Backup { name, req }).await
                },
            ),
        )
        .route(
            "/disks/{d}/job",
            get(|State(c): S, Path(name): Path<String>| async move {
                storage(&c, StorageCommand::Job { name }).await
            }),
        )
        .route(
            "/disks/{d}/checkpoints",
            get(|State(c): S, Path(name): Path<String>| async move {
                storage(&c, StorageCommand::ListCheckpoints { name }).await
            })
            .post(
                |State(c): S, Path(name): Path<String>, ApiJson(req): ApiJson<CheckpointRequest>| async move {
                    storage(&c, StorageCommand::CreateCheckpoint { name, req }).await
                },
            ),
        )
        .route(
            "/disks/{d}/checkpoints/{cp}",
            delete(|State(c): S, Path((name, checkpoint)): Path<(String, String)>| async move {
                storage(&c, StorageCommand::RemoveCheckpoint { name, checkpoint }).await
            }),
        )
        .route(
            "/disks/{d}/checkpoints/{cp}/revert",
            post(|State(c): S, Path((name, checkpoint)): Path<(String, String)>| async move {
                storage(&c, StorageCommand::RevertCheckpoint { name, checkpoint }).await
            }),
        )
        .route(
            "/disks/{d}/move",
            get(|State(c): S, Path(name): Path<String>| async move {
                storage(&c, StorageCommand::MoveStatus { name }).await
            })
            .post(
                |State(c): S, Path(name): Path<String>, ApiJson(req): ApiJson<DiskMoveRequest>| async move {
                    storage(&c, StorageCommand::MoveDisk { name, req }).await
                },
            ),
        )
        .route(
            "/disks/{d}/replica",
            post(
                |State(c): S, Path(name): Path<String>, ApiJson(req): ApiJson<ReplicaRequest>| async move {
                    storage(&c, StorageCommand::Replicate { name, req }).await
                },
            )
            .delete(|State(c): S, Path(name): Path<String>| async move {
                storage(&c, StorageCommand::StopReplica { name }).await
            }),
        )
        .route(
            "/disks/{d}/replica/failover",
            post(|State(c): S, Path(name): Path<String>| async move {
                storage(&c, StorageCommand::FailoverReplica { name }).await
            }),
        )
        .route(
            "/replicas",
            get(|State(c): S, axum::extract::Query(q): axum::extract::Query<ReplicaQuery>| async move {
                storage(&c, StorageCommand::ListReplicas { name: q.disk }).await
            }),
        )
        .route(
            "/qos/policies",
            get(|State(c): S| async move { storage(&c, StorageCommand::ListPolicies).await }).post(
                |State(c): S, ApiJson(p): ApiJson<Policy>| async move {
                    storage(&c, StorageCommand::NewPolicy(p)).await
                },
            ),
        )
        .route(
            "/qos/policies/{p}",
            put(
                |State(c): S, Path(name): Path<String>, ApiJson(update): ApiJson<PolicyUpdate>| async move {
                    storage(&c, StorageCommand::UpdatePolicy { name, update }).await
                },
            )
            .delete(|State(c): S, Path(name): Path<String>| async move {
                storage(&c, StorageCommand::RemovePolicy { name }).await
            }),
        )
        .route(
            "/qos/flows",
            get(|State(c): S| async move { storage(&c, StorageCommand::ListFlows).await }),
        )
        .route(
            "/storage/nodes",
            get(|State(c): S| async move { storage(&c, StorageCommand::ListNodes).await }),
        )
        .route(
            "/qos/settings",
            get(|State(c): S| async move { storage(&c, StorageCommand::GetSettings).await }).put(
                |State(c): S, ApiJson(s): ApiJson<QosSettings>| async move {
                    storage(&c, StorageCommand::SetSettings(s)).await
                },
            ),
        )
}

/// The web page and its files (`assets.rs`): static, no cluster data in
/// them, so served without the credential (the page signs in).
fn web_routes() -> Router {
    let mut r = Router::new();
    for a in crate::assets::ASSETS.iter() {
        r = r.route(a.path, get(crate::assets::serve));
    }
    // browsers ask for it unbidden; there is none
    r.route(
        "/favicon.ico",
        get(|| async { axum::http::StatusCode::NO_CONTENT }),
    )
}

pub fn router(control: Arc<Control>) -> Router {
    let api = Router::new()
        .route("/hosts", get(hosts))
        .route("/vms", get(vms).post(create))
        .route("/vms/{name}", axum::routing::delete(remove))
        .route("/vms/{name}/check", get(check))
        .route("/vms/{name}/resolve", post(resolve))
        .route("/vms/{name}/move", post(move_vm))
        .route("/vms/{name}/start", post(vm_start))
        .route("/vms/{name}/stop", post(vm_stop))
        .route("/vms/{name}/shutdown", post(vm_shutdown))
        .route("/vms/{name}/reboot", post(vm_reboot))
        .route("/vms/{name}/restart", post(vm_restart))
        .route("/vms/{name}/ha", axum::routing::put(vm_ha))
        .route("/validate", post(validate))
        .route("/hosts/{host}/drain", post(drain))
        .route("/hosts/{host}/resume", post(resume))
        .route(
            "/cluster/rolling",
            get(|State(c): S| async move { run(&c, Command::RollingStatus).await })
                .post(
                    |State(c): S, ApiJson(r): ApiJson<ferry_api::rolling::RollingRequest>| async move {
                        run(&c, Command::StartRolling(r)).await
                    },
                )
                .delete(|State(c): S| async move { run(&c, Command::StopRolling).await }),
        )
        .route("/hosts/{host}/settings", axum::routing::put(set_host))
        .route("/watch", get(watch))
        .route("/watch/operations/{id}", get(watch_operation))
        .route(
            "/operations",
            get(|State(c): S| async move { run(&c, Command::ListOperations).await }),
        )
        .route(
            "/operations/{id}",
            get(|State(c): S, Path(id): Path<String>| async move {
                run(&c, Command::GetOperation { id }).await
            }),
        )
        .route(
            "/vms/{name}/console",
            get(
                |State(c): S,
                 Path(name): Path<String>,
                 axum::extract::Query(q): axum::extract::Query<ConsoleQuery>| async move {
                    let bytes = q.bytes.unwrap_or(16 << 10).clamp(1, 1 << 20);
                    run(&c, Command::ConsoleTail { name, bytes }).await
                },
            ),
        )
        .route(
            "/bandwidth",
            get(|State(c): S| async move { run(&c, Command::ListBandwidth).await }).put(
                |State(c): S,
                 ApiJson(req): ApiJson<ferry_api::bandwidth::BandwidthSetRequest>| async move {
                    run(&c, Command::SetBandwidth(req)).await
                },
            ),
        )
        .route(
            "/cluster",
            get(|State(c): S| async move { run(&c, Command::GetCluster).await }).put(
                |State(c): S, ApiJson(u): ApiJson<ferry_api::ClusterSettingsUpdate>| async move {
                    run(&c, Command::SetCluster(u)).await
                },
            ),
        )
        .route(
            "/cluster/control",
            get(|State(c): S| async move { run(&c, Command::ControlStatus).await }),
        )
        .route(
            "/cluster/certificates/requests",
            post(|State(c): S| async move { run(&c, Command::CertRequests).await }),
        )
        .route(
            "/cluster/certificates",
            post(
                |State(c): S, ApiJson(r): ApiJson<Vec<ferry_api::certs::SignedCert>>| async move {
                    run(&c, Command::InstallCerts(r)).await
                },
            ),
        )
        .route(
            "/cluster/crl",
            get(|State(c): S| async move { run(&c, Command::GetCrl).await }).put(
                |State(c): S, ApiJson(r): ApiJson<ferry_api::certs::CrlInstall>| async move {
                    run(&c, Command::SetCrl(r)).await
                },
            ),
        )
        .route(
            "/events",
            get(
                |State(c): S, axum::extract::Query(q): axum::extract::Query<EventsQuery>| async move {
                    run(&c, Command::Events { limit: q.limit.unwrap_or(100) }).await
                },
            ),
        )
        .route(
            "/tokens",
            get(|State(c): S| async move { run(&c, Command::ListTokens).await }).post(
                |State(c): S, ApiJson(r): ApiJson<ferry_api::auth::TokenCreateRequest>| async move {
                    run(&c, Command::CreateToken(r)).await
                },
            ),
        )
        .route(
            "/placement",
            get(|State(c): S| async move { run(&c, Command::GetPlacement).await }),
        )
        .route(
            "/placement/rules",
            post(
                |State(c): S, ApiJson(r): ApiJson<ferry_api::placement::Rule>| async move {
                    run(&c, Command::CreateRule(r)).await
                },
            ),
        )
        .route(
            "/placement/rules/{name}",
            axum::routing::delete(|State(c): S, Path(name): Path<String>| async move {
                run(&c, Command::RemoveRule { name }).await
            }),
        )
        .route(
            "/placement/groups",
            post(
                |State(c): S, ApiJson(g): ApiJson<ferry_api::placement::HostGroup>| async move {
                    run(&c, Command::SetGroup(g)).await
                },
            ),
        )
        .route(
            "/placement/groups/{name}",
            axum::routing::delete(|State(c): S, Path(name): Path<String>| async move {
                run(&c, Command::RemoveGroup { name }).await
            }),
        )
        .route(
            "/hosts/{host}/labels",
            axum::routing::put(
                |State(c): S,
                 Path(host): Path<String>,
                 ApiJson(update): ApiJson<ferry_api::placement::LabelUpdate>| async move {
                    run(&c, Command::SetLabels { host, update }).await
                },
            ),
        )
        .route(
            "/cluster/balance",
            post(
                |State(c): S, ApiJson(r): ApiJson<ferry_api::placement::BalanceRequest>| async move {
                    run(&c, Command::Balance(r)).await
                },
            ),
        )
        .route(
            "/tokens/{name}",
            axum::routing::delete(|State(c): S, Path(name): Path<String>| async move {
                run(&c, Command::RevokeToken { name }).await
            }),
        )
        .merge(storage_routes())
        .with_state(control.clone());
    Router::new()
        .nest(ferry_api::API_PREFIX, api)
        .route(
            "/metrics",
            get(|State(c): S| async move { run(&c, Command::Metrics).await })
                .with_state(control.clone()),
        )
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(
            control.clone(),
            authenticate,
        ))
        .merge(session_routes(control))
        .merge(web_routes())
}

/// Serves the API on `listen`, over TLS with `tls` (the control service's
/// certificate; clients need none), plain HTTP without (`--insecure-http`).
pub async fn serve(
    listen: std::net::SocketAddr,
    control: Arc<Control>,
    tls: Option<ferry_net::server::ServerTls>,
    limits: ferry_net::server::Limits,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(listen).await?;
    tracing::info!(%listen, "control service serving");
    control
        .secure_cookies
        .store(tls.is_some(), std::sync::atomic::Ordering::Relaxed);
    let leadership = tokio::spawn(control.clone().run_leadership());
    let ha = tokio::spawn(control.clone().run_ha());
    // once a second: heartbeats of the agents, and the cluster-wide storage
    // policy manager
    let manager = {
        let c = control.clone();
        tokio::spawn(async move {
            let mut t = tokio::time::interval(std::time::Duration::from_secs(1));
            loop {
                t.tick().await;
                c.heartbeat().await;
                if !c.leading() {
                    continue;
                }
                if let Err(e) = c.manage_policies().await {
                    tracing::warn!("storage policy manager: {e}");
                }
            }
        })
    };
    let r = ferry_net::server::serve_with(listener, router(control), tls, limits).await;
    manager.abort();
    ha.abort();
    leadership.abort();
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;

    async fn call(req: Request<Body>) -> (u16, serde_json::Value) {
        let c = Arc::new(Control::new(vec![], Default::default()));
        c.tokens.bootstrap(&c.store, &AUTH[7..]).await.unwrap();
        send(&mut router(c), req).await
    }

    /// `req` to `app`: the status and the JSON answer (none for an event stream).
    async fn send(app: &mut Router, req: Request<Body>) -> (u16, serde_json::Value) {
        use tower_service::Service;
        let resp = app.call(req).await.unwrap();
        let status = resp.status().as_u16();
        // an event stream runs for minutes: its status is the answer
        if resp
            .headers()
            .get("content-type")
            .is_some_and(|t| t == "text/event-stream")
        {
            return (status, serde_json::Value::Null);
        }
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, serde_json::from_slice(&body).unwrap_or_default())
    }

    const AUTH: &str = "Bearer ferry_0123456789abcdef0123456789abcdef";

    #[tokio::test]
    async fn requests_without_the_credential_are_refused() {
        let (status, body) = call(Request::get("/api/v1/hosts").body(Body::empty()).unwrap()).await;
        assert_eq!(status, 401);
        assert_eq!(body["code"], "unauthorized");
        let req = Request::get("/api/v1/hosts")
            .header("authorization", "Bearer nope")
            .body(Body::empty())
            .unwrap();
        assert_eq!(call(req).await.0, 401);
    }

    #[tokio::test]
    async fn tokens_are_checked_by_role_and_every_refusal_and_change_is_logged() {
        use tower_service::Service;
        let c = Arc::new(Control::new(vec![], Default::default()));
        c.tokens.bootstrap(&c.store, &AUTH[7..]).await.unwrap();
        let mut app = router(c.clone());
        let mut send = |method: &str, path: &str, token: Option<&str>, body: &str| {
            let mut b = Request::builder().method(method).uri(path);
            if let Some(t) = token {
                b = b.header("authorization", format!("Bearer {t}"));
            }
            let req = b.body(Body::from(body.to_string())).unwrap();
            let fut = app.call(req);
            async move {
                let resp = fut.await.unwrap();
                let status = resp.status().as_u16();
                let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
                    .await
                    .unwrap();
                (
                    status,
                    serde_json::from_slice::<serde_json::Value>(&body).unwrap_or_default(),
                )
            }
        };
        let admin = &AUTH[7..];
        // the admin makes a read-only token and an operator token
        let (st, ro) = send(
            "POST",
            "/api/v1/tokens",
            Some(admin),
            r#"{"name":"viewer","role":"read-only"}"#,
        )
        .await;
        assert_eq!(st, 200, "{ro}");
        let ro = ro["token"].as_str().unwrap().to_string();
        let (st, op) = send(
            "POST",
            "/api/v1/tokens",
            Some(admin),
            r#"{"name":"ops","role":"operator"}"#,
        )
        .await;
        assert_eq!(st, 200);
        let op = op["token"].as_str().unwrap().to_string();
        // no, a wrong, a revoked token: 401; read-only on a change: 403 naming the role
        let change = r#"{"encryption":true}"#;
        let (st, b) = send("PUT", "/api/v1/hosts/h1/settings", None, "{}").await;
        assert_eq!((st, b["code"].as_str()), (401, Some("unauthorized")), "{b}");
        let (st, _) = send(
            "PUT",
            "/api/v1/hosts/h1/settings",
            Some("ferry_wrong"),
            "{}",
        )
        .await;
        assert_eq!(st, 401);
        let (st, b) = send("POST", "/api/v1/hosts/h1/resume", Some(&ro), "").await;
        assert_eq!((st, b["code"].as_str()), (403, Some("forbidden")), "{b}");
        assert!(
            b["message"]
                .as_str()
                .unwrap()
                .contains("needs role operator"),
            "{b}"
        );
        // read-only reads; operator cannot touch cluster settings or tokens
        assert_eq!(send("GET", "/api/v1/hosts", Some(&ro), "").await.0, 200);
        let (st, b) = send("PUT", "/api/v1/cluster", Some(&op), change).await;
        assert_eq!(st, 403);
        assert!(
            b["message"].as_str().unwrap().contains("needs role admin"),
            "{b}"
        );
        assert_eq!(send("GET", "/api/v1/tokens", Some(&op), "").await.0, 403);
        // the admin changes a setting; then revokes the operator
        assert_eq!(
            send("PUT", "/api/v1/cluster", Some(admin), change).await.0,
            200
        );
        assert_eq!(
            send("DELETE", "/api/v1/tokens/ops", Some(admin), "")
                .await
                .0,
            200
        );
        let (st, b) = send("GET", "/api/v1/hosts", Some(&op), "").await;
        assert_eq!(st, 401);
        assert!(
            b["message"].as_str().unwrap().contains("'ops' was revoked"),
            "{b}"
        );
        // listing never shows secrets
        let (_, list) = send("GET", "/api/v1/tokens", Some(admin), "").await;
        assert!(!list.to_string().contains(&ro[6..]), "{list}");
        assert_eq!(list.as_array().unwrap().len(), 3);
        // the event log: who changed what, and every refusal
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let ev = c.store.events(100).await.unwrap();
        let has = |kind: &str, f: &dyn Fn(&serde_json::Value) -> bool| {
            ev.iter().any(|e| e.kind == kind && f(&e.detail))
        };
        assert!(has("command", &|d| d["by"] == "admin"
            && d["action"] == "set cluster settings"));
        assert!(has("command", &|d| d["by"] == "admin"
            && d["action"] == "revoke token ops"));
        assert!(has("refused", &|d| d["by"] == "viewer" && d["status"] == 403));
        assert_eq!(
            ev.iter()
                .filter(|e| e.kind == "refused" && e.detail["status"] == 401)
                .count(),
            3,
            "{ev:?}"
        );
    }

    #[tokio::test]
    async fn unknown_fields_are_named() {
        let req = Request::post("/api/v1/vms/a/move")
            .header("authorization", AUTH)
            .header("content-type", "application/json")
            .body(Body::from(r#"{"to":"host2","fast":true}"#))
            .unwrap();
        let (status, body) = call(req).await;
        assert_eq!(status, 400);
        assert!(body["message"].as_str().unwrap().contains("fast"), "{body}");
    }

    #[tokio::test]
    async fn unknown_hosts_and_routes_are_named() {
        let req = Request::post("/api/v1/vms")
            .header("authorization", AUTH)
            .body(Body::from(
                r#"{"host":"host9","spec":{"name":"a","memory":1073741824,"fill":0,"dirty_rate":0}}"#,
            ))
            .unwrap();
        let (status, body) = call(req).await;
        assert_eq!((status, body["code"].as_str()), (404, Some("not_found")));
        assert!(body["message"].as_str().unwrap().contains("host9"));
        let req = Request::get("/api/v1/nothing")
            .header("authorization", AUTH)
            .body(Body::empty())
            .unwrap();
        assert_eq!(call(req).await.0, 404);
    }

    #[tokio::test]
    async fn bad_specs_are_refused_before_any_agent_is_asked() {
        let req = Request::post("/api/v1/vms")
            .header("authorization", AUTH)
            .body(Body::from(
                r#"{"host":"host1","spec":{"name":"a","memory":1024,"fill":0,"dirty_rate":0}}"#,
            ))
            .unwrap();
        let (status, body) = call(req).await;
        assert_eq!(status, 400);
        assert!(
            body["message"].as_str().unwrap().contains("memory"),
            "{body}"
        );
    }

    /// (METHOD, path) pairs of the OpenAPI file, `{param}`s kept.
    fn openapi_routes() -> std::collections::BTreeSet<(String, String)> {
        let doc: serde_json::Value =
            serde_json::from_str(include_str!("../../../docs/openapi.json")).unwrap();
        let mut out = std::collections::BTreeSet::new();
        for (path, ops) in doc["paths"].as_object().unwrap() {
            for m in ops.as_object().unwrap().keys() {
                out.insert((m.to_uppercase(), path.clone()));
            }
        }
        out
    }

    #[test]
    fn the_openapi_file_describes_every_field_of_a_vm_spec() {
        use ferry_api::hardware::*;
        let doc: serde_json::Value =
            serde_json::from_str(include_str!("../../../docs/openapi.json")).unwrap();
        let mut spec = ferry_api::VmSpec::workload("a", 1 << 30, 0, 0);
        spec.kernel = Some(KernelBoot {
            kernel: "/k".into(),
            initrd: Some("/i".into()),
            append: String::new(),
        });
        spec.drives.push(Drive {
            disk: Some("d".into()),
            ..Default::default()
        });
        spec.nics.push(GuestNic {
            bridge: "br0".into(),
            mac: "52:54:00:00:00:01".into(),
        });
        spec.cloud_init = Some(CloudInit {
            user_data: String::new(),
            meta_data: String::new(),
            network_config: Some(String::new()),
            redacted: false,
        });
        let schemas = &doc["components"]["schemas"];
        let check = |schema: &str, value: serde_json::Value| {
            for k in value.as_object().unwrap().keys() {
                assert!(
                    schemas[schema]["properties"].get(k).is_some(),
                    "docs/openapi.json: {schema} lacks {k}"
                );
            }
        };
        let v = serde_json::to_value(&spec).unwrap();
        check("VmSpec", v.clone());
        check("KernelBoot", v["kernel"].clone());
        check("Drive", v["drives"][0].clone());
        check("GuestNic", v["nics"][0].clone());
        check("CloudInit", v["cloud_init"].clone());
        let code = serde_json::to_value(ferry_api::ApiError::HostCannotRun {
            host: "h".into(),
            vm: "v".into(),
            missing: vec![],
        })
        .unwrap();
        let codes = schemas["Error"]["properties"]["code"]["enum"]
            .as_array()
            .unwrap();
        assert!(codes.contains(&code["code"]), "{code}");
    }

    #[test]
    fn the_openapi_file_lists_exactly_the_documented_routes() {
        // the route table at the top of this file, as the router is written
        let mut table = std::collections::BTreeSet::new();
        for line in include_str!("http.rs").lines() {
            let Some(row) = line.strip_prefix("//! | ") else {
                continue;
            };
            let cells: Vec<&str> = row.split(" | ").collect();
            if cells.len() < 2 || cells[0] == "method" || cells[0].starts_with("---") {
                continue;
            }
            let path = cells[1].split(' ').next().unwrap();
            let full = if path == "/metrics" {
                path.to_string()
            } else {
                format!("/api/v1{path}")
            };
            for m in cells[0].split('/') {
                table.insert((m.to_string(), full.clone()));
            }
        }
        assert_eq!(table, openapi_routes());
    }

    #[tokio::test]
    async fn every_route_of_the_openapi_file_is_served() {
        for (method, path) in openapi_routes() {
            let concrete: String = path
                .split('/')
                .map(|seg| if seg.starts_with('{') { "x" } else { seg })
                .collect::<Vec<_>>()
                .join("/");
            let body = if method == "GET" || method == "DELETE" {
                Body::empty()
            } else {
                Body::from("{}")
            };
            let req = Request::builder()
                .method(method.as_str())
                .uri(&concrete)
                .header("authorization", AUTH)
                .header("content-type", "application/json")
                .body(body)
                .unwrap();
            let (status, body) = call(req).await;
            assert_ne!(status, 405, "{method} {path}: method not routed");
            assert!(
                !(status == 404 && body["kind"] == "route"),
                "{method} {path}: no such route ({body})"
            );
        }
    }

    /// One request with optional cookie and CSRF headers: (status, Set-Cookie, body).
    async fn send_session(
        app: &mut Router,
        method: &str,
        path: &str,
        cookie: Option<&str>,
        csrf: Option<&str>,
        body: &str,
    ) -> (u16, String, serde_json::Value) {
        use tower_service::Service;
        let mut b = Request::builder()
            .method(method)
            .uri(path)
            .header("content-type", "application/json");
        if let Some(c) = cookie {
            b = b.header("cookie", c);
        }
        if let Some(t) = csrf {
            b = b.header("x-ferry-csrf", t);
        }
        let resp = app
            .call(b.body(Body::from(body.to_string())).unwrap())
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let set = resp
            .headers()
            .get("set-cookie")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        (
            status,
            set,
            serde_json::from_slice(&body).unwrap_or_default(),
        )
    }

    #[tokio::test]
    async fn a_browser_session_acts_as_its_token_and_needs_its_csrf_token_to_change_anything() {
        let c = Arc::new(Control::new(vec![], Default::default()));
        c.tokens.bootstrap(&c.store, &AUTH[7..]).await.unwrap();
        let mut app = router(c.clone());
        let admin = &AUTH[7..];
        // a wrong token opens nothing
        let (st, set, b) = send_session(
            &mut app,
            "POST",
            "/api/v1/session",
            None,
            None,
            r#"{"token":"ferry_nope"}"#,
        )
        .await;
        assert_eq!(
            (st, set.as_str(), b["code"].as_str()),
            (401, "", Some("unauthorized")),
            "{b}"
        );
        let (st, _, b) = send_session(
            &mut app,
            "POST",
            "/api/v1/session",
            None,
            None,
            r#"{"tok":"x"}"#,
        )
        .await;
        assert_eq!(st, 400, "an unknown field is named: {b}");
        // the token in the body: a cookie, the role, the CSRF token
        let body = format!(r#"{{"token":"{admin}"}}"#);
        let (st, set, b) =
            send_session(&mut app, "POST", "/api/v1/session", None, None, &body).await;
        assert_eq!(st, 200, "{b}");
        assert_eq!(
            (b["name"].as_str(), b["role"].as_str()),
            (Some("admin"), Some("admin"))
        );
        for part in ["HttpOnly", "Secure", "SameSite=Strict"] {
            assert!(set.contains(part), "{set}");
        }
        let cookie = set.split(';').next().unwrap().to_string();
        let csrf = b["csrf"].as_str().unwrap().to_string();
        // reads with the cookie alone; who is signed in
        let (st, _, _) =
            send_session(&mut app, "GET", "/api/v1/hosts", Some(&cookie), None, "").await;
        assert_eq!(st, 200);
        let (st, _, b) =
            send_session(&mut app, "GET", "/api/v1/session", Some(&cookie), None, "").await;
        assert_eq!((st, b["csrf"].as_str()), (200, Some(csrf.as_str())));
        // a change without, or with a wrong, CSRF token: refused, whatever the role
        let change = r#"{"encryption":false}"#;
        for bad in [None, Some("0123456789abcdef0123456789abcdef")] {
            let (st, _, b) = send_session(
                &mut app,
                "PUT",
                "/api/v1/cluster",
                Some(&cookie),
                bad,
                change,
            )
            .await;
            assert_eq!((st, b["code"].as_str()), (403, Some("refused")), "{b}");
            assert!(
                b["message"].as_str().unwrap().contains("X-Ferry-CSRF"),
                "{b}"
            );
        }
        let (st, _, b) = send_session(
            &mut app,
            "PUT",
            "/api/v1/cluster",
            Some(&cookie),
            Some(&csrf),
            change,
        )
        .await;
        assert_eq!(st, 200, "{b}");
        // sign-out needs the CSRF token too; then the cookie is worth nothing
        let (st, _, _) = send_session(
            &mut app,
            "DELETE",
            "/api/v1/session",
            Some(&cookie),
            None,
            "",
        )
        .await;
        assert_eq!(st, 403);
        let (st, set, _) = send_session(
            &mut app,
            "DELETE",
            "/api/v1/session",
            Some(&cookie),
            Some(&csrf),
            "",
        )
        .await;
        assert!(st == 200 && set.contains("Max-Age=0"), "{set}");
        let (st, _, b) =
            send_session(&mut app, "GET", "/api/v1/hosts", Some(&cookie), None, "").await;
        assert_eq!((st, b["code"].as_str()), (401, Some("unauthorized")));
        // revoking a token ends its sessions at once
        let (_, _, t) = send_session(&mut app, "POST", "/api/v1/tokens", None, None, "{}").await;
        assert_eq!(t["code"], "unauthorized", "no cookie, no token: {t}");
        let created = c
            .tokens
            .create(
                &c.store,
                "viewer",
                ferry_api::auth::TokenRole::ReadOnly,
                None,
            )
            .await
            .unwrap();
        let body = format!(r#"{{"token":"{}"}}"#, created.token);
        let (_, set, b) =
            send_session(&mut app, "POST", "/api/v1/session", None, None, &body).await;
        let (viewer, vcsrf) = (
            set.split(';').next().unwrap().to_string(),
            b["csrf"].as_str().unwrap().to_string(),
        );
        // a read-only session with its CSRF token: refused for the role
        let (st, _, b) = send_session(
            &mut app,
            "POST",
            "/api/v1/hosts/h1/resume",
            Some(&viewer),
            Some(&vcsrf),
            "",
        )
        .await;
        assert_eq!((st, b["code"].as_str()), (403, Some("forbidden")), "{b}");
        c.tokens.revoke(&c.store, "viewer").await.unwrap();
        let (st, _, _) =
            send_session(&mut app, "GET", "/api/v1/hosts", Some(&viewer), None, "").await;
        assert_eq!(st, 401);
    }

    #[tokio::test]
    async fn topics_are_pushed_as_server_sent_events_when_they_change() {
        use futures::StreamExt;
        use tower_service::Service;
        let c = Arc::new(Control::new(vec![], Default::default()));
        c.tokens.bootstrap(&c.store, &AUTH[7..]).await.unwrap();
        let mut app = router(c.clone());
        let resp = app
            .call(
                Request::get("/api/v1/watch?topics=hosts,events")
                    .header("authorization", AUTH)
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        let mut body = resp.into_body().into_data_stream();
        let mut text = String::new();
        // what the stream sends for `ms`
        async fn read_for(body: &mut axum::body::BodyDataStream, text: &mut String, ms: u64) {
            let until = tokio::time::Instant::now() + std::time::Duration::from_millis(ms);
            while let Ok(Some(chunk)) = tokio::time::timeout_at(until, body.next()).await {
                text.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
            }
        }
        // each topic at once
        read_for(&mut body, &mut text, 1500).await;
        assert_eq!(text.matches("event: hosts").count(), 1, "{text}");
        assert_eq!(text.matches("event: events").count(), 1, "{text}");
        assert!(text.contains("data: []"), "{text}");
        // unchanged: nothing more; a change (a token made, logged): its topic again
        read_for(&mut body, &mut text, 2000).await;
        assert_eq!(text.matches("event: events").count(), 1, "{text}");
        let (st, _) = send(
            &mut app,
            Request::post("/api/v1/tokens")
                .header("authorization", AUTH)
                .header("content-type", "application/json")
                .body(Body::from(r#"{"name":"w1","role":"read-only"}"#))
                .unwrap(),
        )
        .await;
        assert_eq!(st, 200);
        read_for(&mut body, &mut text, 2500).await;
        assert_eq!(text.matches("event: events").count(), 2, "{text}");
        assert_eq!(text.matches("event: hosts").count(), 1, "{text}");
        // a topic that is not one: named
        let (st, b) = send(
            &mut app,
            Request::get("/api/v1/watch?topics=hosts,weather")
                .header("authorization", AUTH)
                .body(Body::empty())
                .unwrap(),
        )
        .await;
        assert_eq!(st, 400);
        assert!(b["message"].as_str().unwrap().contains("'weather'"), "{b}");
        // without a token: refused at once, not streamed
        let (st, b) = call(
            Request::get("/api/v1/watch?topics=hosts")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
        assert_eq!((st, b["code"].as_str()), (401, Some("unauthorized")));
    }

    #[tokio::test]
    async fn the_web_page_is_served_without_the_credential_and_its_api_calls_are_not() {
        use tower_service::Service;
        let mut app = router(Arc::new(Control::new(vec![], Default::default())));
        for (path, want) in [
            ("/", "<title>Ferry</title>"),
            ("/ui/app.js", "/api/v1/hosts"),
            ("/ui/uPlot.iife.min.js", "uPlot"),
            ("/ui/uPlot.min.css", ".uplot"),
        ] {
            let resp = app
                .call(Request::get(path).body(Body::empty()).unwrap())
                .await
                .unwrap();
            assert_eq!(resp.status().as_u16(), 200, "{path}");
            let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
                .await
                .unwrap();
            assert!(String::from_utf8_lossy(&body).contains(want), "{path}");
        }
        let (status, _) = call(Request::get("/api/v1/vms").body(Body::empty()).unwrap()).await;
        assert_eq!(status, 401);
    }

    #[tokio::test]
    async fn the_console_files_go_compressed_kept_a_year_by_their_hash_and_the_page_revalidated() {
        use std::io::Read;
        use tower_service::Service;
        let mut app = router(Arc::new(Control::new(vec![], Default::default())));
        let mut get = |path: String, headers: Vec<(&'static str, String)>| {
            let mut req = Request::get(path);
            for (k, v) in headers {
                req = req.header(k, v);
            }
            let fut = app.call(req.body(Body::empty()).unwrap());
            async move {
                let resp = fut.await.unwrap();
                let (parts, body) = resp.into_parts();
                let body = axum::body::to_bytes(body, 1 << 20).await.unwrap();
                (parts, body)
            }
        };
        // the page names app.js with its hash
        let (page, body) = get("/".into(), vec![]).await;
        assert_eq!(page.headers["cache-control"], "no-cache");
        let html = String::from_utf8_lossy(&body).into_owned();
        let src = html
            .split("src=\"")
            .filter_map(|s| s.split('"').next())
            .find(|s| s.starts_with("/ui/app.js?v="))
            .expect("app.js named with its hash")
            .to_string();
        // asked by that name, with gzip: compressed, kept a year
        let (js, gz) = get(src.clone(), vec![("accept-encoding", "gzip, br".into())]).await;
        assert_eq!(js.status.as_u16(), 200);
        assert_eq!(js.headers["content-encoding"], "gzip");
        assert_eq!(
            js.headers["cache-control"],
            "public, max-age=31536000, immutable"
        );
        assert_eq!(js.headers["vary"], "Accept-Encoding");
        let mut plain = Vec::new();
        flate2::read::GzDecoder::new(&gz[..])
            .read_to_end(&mut plain)
            .unwrap();
        assert_eq!(plain, include_bytes!("../web/app.js"));
        assert!(gz.len() * 2 < plain.len(), "{} → {}", plain.len(), gz.len());
        // without gzip: as it is; without the hash: revalidated
        let (js2, raw) = get("/ui/app.js".into(), vec![]).await;
        assert!(js2.headers.get("content-encoding").is_none());
        assert_eq!(js2.headers["cache-control"], "no-cache");
        assert_eq!(&raw[..], include_bytes!("../web/app.js"));
        // the same page again: 304, nothing sent
        let etag = page.headers["etag"].to_str().unwrap().to_string();
        let (again, empty) = get("/".into(), vec![("if-none-match", etag.clone())]).await;
        assert_eq!(again.status.as_u16(), 304);
        assert!(empty.is_empty());
        let (changed, _) = get("/".into(), vec![("if-none-match", "\"other\"".into())]).await;
        assert_eq!(changed.status.as_u16(), 200);
    }
}
