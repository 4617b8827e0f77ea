//! REST API of a storage node, under `/api/v1`. Over TLS only the control
//! service may call it (a client certificate of the cluster with role
//! `control`); under `--insecure-http`, whoever has the cluster credential.
//! Each handler is one call on [`Node`].
//!
//! | method | path | body → answer |
//! |---|---|---|
//! | GET | /disks | → `[DiskInfo]` |
//! | POST | /disks | `DiskCreateRequest` → `DiskInfo` |
//! | PUT | /disks/{d}/size | `DiskResizeRequest` → `DiskInfo` |
//! | PUT | /disks/{d}/policy | `DiskSetRequest` → `DiskInfo` |
//! | DELETE | /disks/{d} | → `DiskInfo` (refused while connected) |
//! | POST | /disks/{d}/backups | `BackupRequest` → `JobInfo` (started) |
//! | GET | /disks/{d}/job | → `JobInfo`: the disk's last copy job |
//! | GET | /disks/{d}/checkpoints | → `[CheckpointInfo]` |
//! | POST | /disks/{d}/checkpoints | `CheckpointRequest` → `JobInfo` (started) |
//! | DELETE | /disks/{d}/checkpoints/{c} | → `CheckpointInfo` |
//! | POST | /disks/{d}/checkpoints/{c}/revert | → `DiskInfo` (refused while open) |
//! | POST | /disks/{d}/incoming | `IncomingDiskRequest` → `DiskInfo`: an empty copy another node writes |
//! | POST | /disks/{d}/activate | `ActivateRequest` → `DiskInfo`: this copy becomes the disk |
//! | POST | /disks/{d}/retire | `RetireRequest` → `DiskInfo`: the disk lives elsewhere now |
//! | GET/POST/DELETE | /disks/{d}/push | `PushRequest` → `PushInfo`: copy the disk to another node |
//! | POST | /disks/{d}/push/finish | → `PushInfo`: a move's final round and commit |
//! | GET | /pushes | → `[PushInfo]` |
//! | GET | /qos/policies | → `[Policy]` |
//! | POST | /qos/policies | `Policy` → `Policy` (new) |
//! | PUT | /qos/policies/{p} | `Policy` → `Policy` (put as given) |
//! | DELETE | /qos/policies/{p} | → `Policy` |
//! | GET/PUT | /qos/settings | `QosSettings` |
//! | GET | /qos/flows | → `[FlowInfo]` |
//! | PUT | /qos/allocations | `AllocationRequest` → `FlowInfo` |
//! | GET | /access | → `[AccessInfo]`: which hosts may open each VM's exports, of which disks |
//! | PUT | /access/{vm} | `AccessRequest` → `AccessInfo` |
//! | GET, POST, PUT, PUT | /pki, /pki/request, /pki/certificate, /pki/crl | the node's certificate, renewed and revoked as an agent's (see `ferry_net::server::pki_routes`) |

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::{middleware, Json, Router};
use ferry_api::storage::{
    ActivateRequest, Allocation, BackupRequest, CheckpointRequest, DiskCreateRequest,
    DiskResizeRequest, DiskSetRequest, IncomingDiskRequest, Policy, PushRequest, QosSettings,
};
use ferry_api::ApiError;
use ferry_net::server::{not_found, require_peer, ApiJson, ErrorResponse, PeerAuth};
use serde::{Deserialize, Serialize};

use crate::node::Node;

/// Body of `POST /disks/{d}/retire`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetireRequest {
    /// The node the disk lives on now.
    pub to: String,
}

/// Body of `PUT /qos/allocations`: `allocation: null` clears it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllocationRequest {
    pub flow: String,
    pub allocation: Option<Allocation>,
}

fn reply<T: Serialize>(r: Result<T, ApiError>) -> Response {
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => ErrorResponse(e).into_response(),
    }
}

type S = State<Arc<Node>>;

/// The node's REST API; `extra`: routes served beside it (the node's
/// certificate, `ferry_net::server::pki_routes`).
pub fn router(node: Arc<Node>, auth: PeerAuth, extra: Router) -> Router {
    let api = Router::new()
        .route(
            "/disks",
            get(|State(n): S| async move { reply(Ok(n.list_disks())) }).post(
                |State(n): S, ApiJson(r): ApiJson<DiskCreateRequest>| async move { reply(n.create_disk(&r)) },
            ),
        )
        .route(
            "/disks/{d}",
            delete(|State(n): S, Path(d): Path<String>| async move { reply(n.remove_disk(&d)) }),
        )
        .route(
            "/disks/{d}/size",
            put(
                |State(n): S, Path(d): Path<String>, ApiJson(r): ApiJson<DiskResizeRequest>| async move {
                    reply(n.resize_disk(&d, r.size))
                },
            ),
        )
        .route(
            "/disks/{d}/policy",
            put(
                |State(n): S, Path(d): Path<String>, ApiJson(r): ApiJson<DiskSetRequest>| async move {
                    reply(n.set_disk_policy(&d, r.policy))
                },
            ),
        )
        .route(
            "/disks/{d}/backups",
            post(
                |State(n): S, Path(d): Path<String>, ApiJson(r): ApiJson<BackupRequest>| async move {
                    reply(n.backup(&d, &r))
                },
            ),
        )
        .route(
            "/disks/{d}/job",
            get(|State(n): S, Path(d): Path<String>| async move { reply(n.job(&d)) }),
        )
        .route(
            "/disks/{d}/checkpoints",
            get(|State(n): S, Path(d): Path<String>| async move { reply(n.list_checkpoints(&d)) }).post(
                |State(n): S, Path(d): Path<String>, ApiJson(r): ApiJson<CheckpointRequest>| async move {
                    reply(n.create_checkpoint(&d, &r))
                },
            ),
        )
        .route(
            "/disks/{d}/checkpoints/{c}",
            delete(|State(n): S, Path((d, c)): Path<(String, String)>| async move {
                reply(n.remove_checkpoint(&d, &c))
            }),
        )
        .route(
            "/disks/{d}/checkpoints/{c}/revert",
            post(|State(n): S, Path((d, c)): Path<(String, String)>| async move {
                let r = tokio::task::spawn_blocking(move || n.revert_checkpoint(&d, &c)).await;
                reply(r.unwrap_or_else(|e| Err(ApiError::internal(e))))
            }),
        )
        .route(
            "/disks/{d}/incoming",
            post(
                |State(n): S, Path(d): Path<String>, ApiJson(r): ApiJson<IncomingDiskRequest>| async move {
                    reply(n.create_incoming(&d, &r))
                },
            ),
        )
        .route(
            "/disks/{d}/activate",
            post(
                |State(n): S, Path(d): Path<String>, ApiJson(r): ApiJson<ActivateRequest>| async move {
                    reply(n.activate(&d, r.failover))
                },
            ),
        )
        .route(
            "/disks/{d}/retire",
            post(
                |State(n): S, Path(d): Path<String>, ApiJson(r): ApiJson<RetireRequest>| async move {
                    reply(n.retire_to(&d, &r.to))
                },
            ),
        )
        .route(
            "/disks/{d}/push",
            get(|State(n): S, Path(d): Path<String>| async move { reply(n.push_info(&d)) })
                .post(
                    |State(n): S, Path(d): Path<String>, ApiJson(r): ApiJson<PushRequest>| async move {
                        reply(n.start_push(&d, &r))
                    },
                )
                .delete(|State(n): S, Path(d): Path<String>| async move { reply(n.cancel_push(&d)) }),
        )
        .route(
            "/disks/{d}/push/finish",
            post(|State(n): S, Path(d): Path<String>| async move { reply(n.finish_push(&d).await) }),
        )
        .route("/pushes", get(|State(n): S| async move { reply(Ok(n.list_pushes())) }))
        .route(
            "/qos/policies",
            get(|State(n): S| async move { reply(Ok(n.list_policies())) })
                .post(|State(n): S, ApiJson(p): ApiJson<Policy>| async move { reply(n.new_policy(p)) }),
        )
        .route(
            "/qos/policies/{p}",
            put(|State(n): S, Path(name): Path<String>, ApiJson(p): ApiJson<Policy>| async move {
                if p.name != name {
                    return reply::<Policy>(Err(ApiError::invalid(
                        "name",
                        format!("body names '{}', path '{name}'", p.name),
                    )));
                }
                reply(n.put_policy(p))
            })
            .delete(|State(n): S, Path(name): Path<String>| async move { reply(n.remove_policy(&name)) }),
        )
        .route(
            "/qos/settings",
            get(|State(n): S| async move { reply(Ok(n.settings())) })
                .put(|State(n): S, ApiJson(s): ApiJson<QosSettings>| async move { reply(n.set_settings(&s)) }),
        )
        .route("/qos/flows", get(|State(n): S| async move { reply(Ok(n.list_flows())) }))
        .route(
            "/qos/allocations",
            put(|State(n): S, ApiJson(r): ApiJson<AllocationRequest>| async move {
                reply(n.set_allocation(&r.flow, r.allocation))
            }),
        )
        .route("/access", get(|State(n): S| async move { reply(Ok(n.list_access())) }))
        .route(
            "/access/{vm}",
            put(
                |State(n): S, Path(vm): Path<String>, ApiJson(r): ApiJson<ferry_api::storage::AccessRequest>| async move {
                    reply(n.set_access(&vm, r.hosts, r.disks))
                },
            ),
        )
        .with_state(node)
        .merge(extra);
    Router::new()
        .nest(ferry_api::API_PREFIX, api)
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(auth, require_peer))
}
