//! Server-side helpers shared by the control service and the agents, so both
//! serve the API the same way: errors as [`ApiError`] bodies with the one
//! status mapping, JSON bodies whose rejections name what was wrong, the
//! caller checks (certificates, or the cluster credential under `--insecure-http`), TLS serving, and NDJSON event streams.

use axum::{
    body::Body,
    extract::{FromRequest, Request, State},
    http::StatusCode,
    middleware::Next,
    response::{IntoResponse, Response},
};
use futures::StreamExt;
use serde::Serialize;

use crate::{auth::Credential, ApiError};

/// Largest request body accepted.
pub const MAX_BODY: usize = 1 << 20;

/// An [`ApiError`] as an HTTP response.
pub struct ErrorResponse(pub ApiError);

impl From<ApiError> for ErrorResponse {
    fn from(e: ApiError) -> Self {
        ErrorResponse(e)
    }
}

impl IntoResponse for ErrorResponse {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, axum::Json(self.0.to_body())).into_response()
    }
}

/// A JSON body; malformed JSON or unknown fields become `InvalidArgument`
/// naming the body and serde's description of the problem.
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ErrorResponse;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| ApiError::invalid("body", e.body_text()))?;
        if bytes.len() > MAX_BODY {
            return Err(ApiError::invalid("body", "larger than 1 MiB").into());
        }
        serde_json::from_slice(&bytes)
            .map(ApiJson)
            .map_err(|e| ApiError::invalid("body", e.to_string()).into())
    }
}

/// A response streaming one JSON value per line.
pub fn ndjson<E, S>(events: S) -> Response
where
    E: Serialize + Send + 'static,
    S: futures::Stream<Item = E> + Send + 'static,
{
    let lines = events.map(|e| {
        let mut line = serde_json::to_vec(&e).unwrap_or_else(|_| b"{}".to_vec());
        line.push(b'\n');
        Ok::<_, std::convert::Infallible>(line)
    });
    Response::builder()
        .header("content-type", "application/x-ndjson")
        .body(Body::from_stream(lines))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// Route fallback: unknown paths get a `NotFound` naming the path.
pub async fn not_found(req: Request) -> ErrorResponse {
    ErrorResponse(ApiError::not_found("route", req.uri().path()))
}

/// Who a TLS connection's client certificate says the caller is, put on
/// every request of that connection by [`serve`]; absent without TLS or
/// without a client certificate.
#[derive(Debug, Clone)]
pub struct PeerCert(pub crate::tls::Identity);

/// How an agent or a storage node knows its callers.
#[derive(Clone, Debug)]
pub enum PeerAuth {
    /// TLS with client certificates of the cluster: these roles may call.
    Certificates(&'static [crate::tls::Role]),
    /// `--insecure-http` (debugging): the cluster credential as a bearer token.
    Credential(Credential),
}

/// Middleware for agents and storage nodes: only the cluster's own
/// components, by certificate (see [`PeerAuth`]).
pub async fn require_peer(State(auth): State<PeerAuth>, req: Request, next: Next) -> Response {
    match &auth {
        PeerAuth::Credential(cred) => {
            let header = req
                .headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok());
            if !cred.verify_header(header) {
                return ErrorResponse(ApiError::unauthorized(
                    "missing or wrong cluster credential",
                ))
                .into_response();
            }
        }
        PeerAuth::Certificates(roles) => match req.extensions().get::<PeerCert>() {
            None => {
                return ErrorResponse(ApiError::unauthorized(
                    "no client certificate of this cluster",
                ))
                .into_response()
            }
            Some(PeerCert(id)) if !roles.contains(&id.role) => {
                tracing::warn!(caller = %id, path = %req.uri().path(), "refused: role not served here");
                return ErrorResponse(ApiError::Forbidden {
                    caller: id.to_string(),
                    role: id.role.to_string(),
                    action: req.uri().path().to_string(),
                    needed: roles
                        .iter()
                        .map(|r| r.as_str())
                        .collect::<Vec<_>>()
                        .join(" or "),
                })
                .into_response();
            }
            Some(_) => {}
        },
    }
    next.run(req).await
}

/// Serves `router` on `listener` until the process ends: over TLS with
/// `tls` (each request carrying the client certificate's [`PeerCert`]),
/// or plain HTTP when `tls` is `None` (`--insecure-http`). A connection
/// whose handshake fails or stalls is dropped and logged; others go on.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    tls: Option<std::sync::Arc<rustls::ServerConfig>>,
) -> std::io::Result<()> {
    let Some(tls) = tls else {
        return axum::serve(listener, router).await;
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // out of descriptors and the like: wait rather than spin
                tracing::warn!("accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let (acceptor, router) = (acceptor.clone(), router.clone());
        tokio::spawn(async move {
            let _ = tcp.set_nodelay(true);
            let stream =
                match tokio::time::timeout(crate::tls::HANDSHAKE_TIMEOUT, acceptor.accept(tcp))
                    .await
                {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        tracing::info!(%peer, "TLS handshake refused: {e}");
                        return;
                    }
                    Err(_) => {
                        tracing::info!(%peer, "TLS handshake timed out");
                        return;
                    }
                };
            let id = stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .and_then(crate::tls::identity_of);
            let svc = match id {
                Some(id) => router.layer(axum::Extension(PeerCert(id))),
                None => router,
            };
            let hyper_svc = hyper_util::service::TowerToHyperService::new(svc);
            let r =
                hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection_with_upgrades(hyper_util::rt::TokioIo::new(stream), hyper_svc)
                    .await;
            if let Err(e) = r {
                tracing::debug!(%peer, "connection: {e}");
            }
        });
    }
}
