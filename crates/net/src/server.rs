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

use ferry_api::{auth::Credential, ApiError};

#[cfg(test)]
mod limit_tests {
    use super::*;

    #[test]
    fn connections_are_capped_per_client_and_in_all() {
        let table = ConnectionTable::new(3, 2);
        let a: std::net::IpAddr = "198.18.0.5".parse().unwrap();
        let b: std::net::IpAddr = "198.18.0.6".parse().unwrap();
        let a1 = table.admit(a).unwrap();
        let _a2 = table.admit(a).unwrap();
        let why = table.admit(a).err().unwrap();
        assert!(why.contains("max_connections_per_client 2"), "{why}");
        let _b1 = table.admit(b).unwrap();
        let why = table.admit(b).err().unwrap();
        assert!(why.contains("max_connections)"), "{why}");
        drop(a1);
        assert!(table.admit(b).is_ok());
    }
}

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
        let max = req
            .extensions()
            .get::<BodyLimit>()
            .map_or(MAX_BODY, |l| l.0);
        let too_big = || {
            ApiError::invalid(
                "body",
                format!("larger than {max} bytes (limits.max_body_bytes)"),
            )
        };
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| match e.status() {
                StatusCode::PAYLOAD_TOO_LARGE => too_big(),
                _ => ApiError::invalid("body", e.body_text()),
            })?;
        if bytes.len() > max {
            return Err(too_big().into());
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

/// The address a request's connection came from (TLS serving), put on
/// every request as an extension.
#[derive(Debug, Clone, Copy)]
pub struct ClientAddr(pub std::net::SocketAddr);

/// What one server takes from its clients, each a named setting with a
/// safe default: no client can hold every connection, trickle its headers
/// forever or send headers or bodies without end. The `[limits]` table of
/// `agent.toml`, `control.toml` and `storage.toml`; the keys are the
/// serialized names below.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Connections open at once, from everyone (`max_connections`).
    pub max_connections: usize,
    /// Connections open at once from one address (`max_connections_per_client`);
    /// and, apart, HTTP/2 requests under way from one address, since one
    /// connection carries many ([`ConnectionTable::admit_stream`]).
    #[serde(rename = "max_connections_per_client")]
    pub per_client: usize,
    /// A request's head (request line and headers) must arrive within this,
    /// counted from when the server waits for it — so a keep-alive
    /// connection idle this long is closed too (`header_timeout_secs`).
    #[serde(rename = "header_timeout_secs", with = "secs")]
    pub header_timeout: std::time::Duration,
    /// The largest request head, bytes (`max_header_bytes`); over it the
    /// answer is 431 and the connection closes.
    pub max_header_bytes: usize,
    /// The largest JSON request body, bytes (`max_body_bytes`).
    pub max_body_bytes: usize,
    /// A TLS connection takes no new request after this long
    /// (`max_connection_age_secs`): its requests under way finish, and the
    /// client's next one comes over a new handshake, where the revocation
    /// list in force is checked. Components keep one HTTP/2 connection to
    /// each peer busy for as long as both run; this bounds how long a
    /// certificate revoked meanwhile keeps one.
    #[serde(rename = "max_connection_age_secs", with = "secs")]
    pub max_connection_age: std::time::Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 1024,
            per_client: 64,
            header_timeout: std::time::Duration::from_secs(30),
            max_header_bytes: 64 << 10,
            max_body_bytes: MAX_BODY,
            max_connection_age: std::time::Duration::from_secs(120),
        }
    }
}

impl Limits {
    /// Refuses limits no server can work within, naming the key.
    pub fn validate(&self) -> Result<(), ApiError> {
        let floor = |key: &str, v: u64, min: u64| at_least(&format!("limits.{key}"), v, min);
        floor("max_connections", self.max_connections as u64, 1)?;
        floor("max_connections_per_client", self.per_client as u64, 1)?;
        floor("header_timeout_secs", self.header_timeout.as_secs(), 1)?;
        floor("max_header_bytes", self.max_header_bytes as u64, 4096)?;
        floor("max_body_bytes", self.max_body_bytes as u64, 64 << 10)?;
        floor(
            "max_connection_age_secs",
            self.max_connection_age.as_secs(),
            1,
        )?;
        if self.per_client > self.max_connections {
            return Err(ApiError::invalid(
                "limits.max_connections_per_client",
                format!(
                    "{} is more than max_connections ({})",
                    self.per_client, self.max_connections
                ),
            ));
        }
        Ok(())
    }
}

/// A limit `field` of `v` refused when below `min`, the least that works.
pub fn at_least(field: &str, v: u64, min: u64) -> Result<(), ApiError> {
    if v < min {
        Err(ApiError::invalid(
            field,
            format!("{v} is below the least that works, {min}"),
        ))
    } else {
        Ok(())
    }
}

mod secs {
    pub fn serialize<S: serde::Serializer>(
        d: &std::time::Duration,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_secs())
    }
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<std::time::Duration, D::Error> {
        <u64 as serde::Deserialize>::deserialize(d).map(std::time::Duration::from_secs)
    }
}

/// The largest body a server takes ([`Limits::max_body_bytes`]), for [`ApiJson`].
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub usize);

/// Open connections per client address, and HTTP/2 requests under way
/// per client address; a [`Slot`] gives one back.
#[derive(Default)]
struct Connections {
    total: usize,
    per: std::collections::HashMap<std::net::IpAddr, usize>,
    streams: std::collections::HashMap<std::net::IpAddr, usize>,
}

/// Connections a server holds open, per client address and in all: the
/// TLS servers' ([`serve_with`]) and the storage node's NBD.
#[derive(Clone)]
pub struct ConnectionTable {
    table: std::sync::Arc<std::sync::Mutex<Connections>>,
    max_connections: usize,
    per_client: usize,
}

impl ConnectionTable {
    pub fn new(max_connections: usize, per_client: usize) -> ConnectionTable {
        ConnectionTable {
            table: Default::default(),
            max_connections,
            per_client,
        }
    }

    /// A slot for one more connection from `ip` (given back when dropped),
    /// or why not, naming the limit.
    pub fn admit(&self, ip: std::net::IpAddr) -> Result<Slot, String> {
        let mut t = ferry_api::util::lock(&self.table);
        let mine = t.per.get(&ip).copied().unwrap_or(0);
        if t.total >= self.max_connections {
            return Err(format!(
                "{} connections open (max_connections)",
                self.max_connections
            ));
        }
        if mine >= self.per_client {
            return Err(format!(
                "{mine} connections open from {ip} (max_connections_per_client {})",
                self.per_client
            ));
        }
        t.total += 1;
        *t.per.entry(ip).or_default() += 1;
        Ok(Slot {
            table: self.table.clone(),
            ip,
            stream: false,
        })
    }

    /// A slot for one more HTTP/2 request under way from `ip`, or why not.
    /// One HTTP/2 connection carries many requests at once; counted here
    /// against `per_client` as connections are, a client's streams hold
    /// no more of the server than its connections could.
    pub fn admit_stream(&self, ip: std::net::IpAddr) -> Result<Slot, ApiError> {
        let mut t = ferry_api::util::lock(&self.table);
        let mine = t.streams.entry(ip).or_default();
        if *mine >= self.per_client {
            return Err(ApiError::TooMany {
                what: format!("HTTP/2 requests under way from {ip}"),
                limit: self.per_client as u64,
                setting: "max_connections_per_client".into(),
            });
        }
        *mine += 1;
        Ok(Slot {
            table: self.table.clone(),
            ip,
            stream: true,
        })
    }
}

/// One open connection, or one HTTP/2 request under way; dropping it
/// gives it back.
pub struct Slot {
    table: std::sync::Arc<std::sync::Mutex<Connections>>,
    ip: std::net::IpAddr,
    stream: bool,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut t = ferry_api::util::lock(&self.table);
        let per = if self.stream {
            &mut t.streams
        } else {
            t.total = t.total.saturating_sub(1);
            &mut t.per
        };
        if let Some(n) = per.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                per.remove(&self.ip);
            }
        }
    }
}

/// A request's body, shared: the handler reads it through one clone, its
/// response ([`Held`]) keeps another.
#[derive(Clone)]
struct SharedBody(std::sync::Arc<std::sync::Mutex<axum::body::Body>>);

impl axum::body::HttpBody for SharedBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, axum::Error>>> {
        std::pin::Pin::new(&mut *ferry_api::util::lock(&self.0)).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        ferry_api::util::lock(&self.0).is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        ferry_api::util::lock(&self.0).size_hint()
    }
}

/// How long a response waits, once whole, for the rest of a request body
/// its handler did not read ([`Held`]).
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(5);

/// An HTTP/2 response body that holds its request's [`Slot`] until it is
/// sent whole or dropped (an event stream's slot lasts as long as the
/// stream), and that ends its stream only once the request has ended too.
///
/// A handler may answer before the request's body has come (a 401 or 403
/// given by the authentication layer). Ended then, the stream is reset
/// under a client still sending, and some clients (curl) lose the answer
/// to a stream error. So the rest of the body is taken and thrown away
/// first: at most the body limit's worth, for at most [`DRAIN_TIME`];
/// past either, the stream ends anyway.
struct Held {
    body: axum::body::Body,
    _slot: Option<Slot>,
    request: SharedBody,
    /// Bytes of the request body still to be taken before giving up.
    drain_left: usize,
    /// Set once the response is whole: when draining gives up.
    drain_until: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl axum::body::HttpBody for Held {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, axum::Error>>> {
        use std::task::Poll;
        if self.drain_until.is_none() {
            match std::pin::Pin::new(&mut self.body).poll_frame(cx) {
                Poll::Ready(None) => {
                    self.drain_until = Some(Box::pin(tokio::time::sleep(DRAIN_TIME)));
                }
                other => return other,
            }
        }
        loop {
            if let Some(until) = self.drain_until.as_mut() {
                if std::future::Future::poll(until.as_mut(), cx).is_ready() {
                    return Poll::Ready(None);
                }
            }
            match std::pin::Pin::new(&mut self.request).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(f))) => {
                    let n = f.data_ref().map_or(0, |d| d.len());
                    if n > self.drain_left {
                        return Poll::Ready(None);
                    }
                    self.drain_left -= n;
                }
                Poll::Ready(_) => return Poll::Ready(None),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream() && self.request.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// Each HTTP/2 request: counted from `ip` in `table` while it is under way
/// (its response body included), refused past the client's limit with 429
/// (an HTTP/1.1 connection carries one request at a time, so its
/// connection's slot is the bound), and its stream ended only after the
/// request's ([`Held`]); `body_limit` is [`Limits::max_body_bytes`].
async fn one_stream(
    State((table, ip, body_limit)): State<(ConnectionTable, std::net::IpAddr, usize)>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    if req.version() != axum::http::Version::HTTP_2 {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let request = SharedBody(std::sync::Arc::new(std::sync::Mutex::new(body)));
    let req = axum::extract::Request::from_parts(parts, axum::body::Body::new(request.clone()));
    let slot = table.admit_stream(ip);
    let resp = match &slot {
        Ok(_) => next.run(req).await,
        Err(e) => ErrorResponse(e.clone()).into_response(),
    };
    resp.map(|body| {
        axum::body::Body::new(Held {
            body,
            _slot: slot.ok(),
            request,
            drain_left: body_limit,
            drain_until: None,
        })
    })
}

/// What a TLS server serves with: its configuration and, from a
/// [`crate::tls::Pki`], word of each change to the certificate or the
/// revocation list in force, upon which every open connection takes no new
/// request (those under way finish): the client's next request comes over a
/// handshake against what is in force now, so a certificate revoked loses
/// the connections it kept at once, not only at their age.
#[derive(Clone)]
pub struct ServerTls {
    pub config: std::sync::Arc<rustls::ServerConfig>,
    pub changes: Option<tokio::sync::watch::Receiver<u64>>,
}

impl From<std::sync::Arc<rustls::ServerConfig>> for ServerTls {
    fn from(config: std::sync::Arc<rustls::ServerConfig>) -> Self {
        ServerTls {
            config,
            changes: None,
        }
    }
}

/// Waits for the next change told on `changes` (forever without one).
async fn changed(changes: &mut Option<tokio::sync::watch::Receiver<u64>>) {
    if let Some(rx) = changes {
        if rx.changed().await.is_ok() {
            return;
        }
    }
    std::future::pending().await
}

/// Serves `router` on `listener` until the process ends: over TLS with
/// `tls` (each request carrying the client certificate's [`PeerCert`]),
/// or plain HTTP when `tls` is `None` (`--insecure-http`). A connection
/// whose handshake fails or stalls is dropped and logged; others go on.
/// Serving takes the default [`Limits`].
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    tls: Option<std::sync::Arc<rustls::ServerConfig>>,
) -> std::io::Result<()> {
    serve_with(
        listener,
        router,
        tls.map(ServerTls::from),
        Limits::default(),
    )
    .await
}

/// [`serve`] with these `limits`: a connection past them is closed at
/// once (logged at most once a second), before its TLS handshake.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    tls: Option<ServerTls>,
    limits: Limits,
) -> std::io::Result<()> {
    let router = router
        .layer(axum::extract::DefaultBodyLimit::max(limits.max_body_bytes))
        .layer(axum::Extension(BodyLimit(limits.max_body_bytes)));
    let Some(tls) = tls else {
        return axum::serve(listener, router).await;
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.config);
    let table = ConnectionTable::new(limits.max_connections, limits.per_client);
    let mut last_said = std::time::Instant::now() - std::time::Duration::from_secs(2);
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
        let slot = match table.admit(peer.ip()) {
            Ok(s) => s,
            Err(why) => {
                if last_said.elapsed() >= std::time::Duration::from_secs(1) {
                    tracing::warn!(%peer, "connection refused: {why}");
                    last_said = std::time::Instant::now();
                }
                drop(tcp);
                continue;
            }
        };
        let router = router.clone().layer(axum::middleware::from_fn_with_state(
            (table.clone(), peer.ip(), limits.max_body_bytes),
            one_stream,
        ));
        let acceptor = acceptor.clone();
        // a connection ends at a change of what is in force after its
        // handshake, not at one before it
        let mut changes = tls.changes.clone();
        if let Some(rx) = &mut changes {
            rx.mark_unchanged();
        }
        tokio::spawn(async move {
            let _slot = slot;
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
            let router = router.layer(axum::Extension(ClientAddr(peer)));
            let svc = match id {
                Some(id) => router.layer(axum::Extension(PeerCert(id))),
                None => router,
            };
            let hyper_svc = hyper_util::service::TowerToHyperService::new(svc);
            let mut b =
                hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
            b.http1()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .max_buf_size(limits.max_header_bytes.max(8192) * 2);
            b.http2()
                .timer(hyper_util::rt::TokioTimer::new())
                .max_header_list_size(limits.max_header_bytes as u32)
                .keep_alive_interval(limits.header_timeout)
                .keep_alive_timeout(std::time::Duration::from_secs(20));
            let conn =
                b.serve_connection_with_upgrades(hyper_util::rt::TokioIo::new(stream), hyper_svc);
            tokio::pin!(conn);
            let aged = tokio::time::sleep(limits.max_connection_age);
            tokio::pin!(aged);
            let mut closing = false;
            let r = loop {
                tokio::select! {
                    r = conn.as_mut() => break r,
                    // HTTP/2: GOAWAY, streams under way run to their end;
                    // HTTP/1.1: closed after the request under way
                    _ = &mut aged, if !closing => {
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                    }
                    _ = changed(&mut changes), if !closing => {
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            };
            if let Err(e) = r {
                tracing::debug!(%peer, "connection: {e}");
            }
        });
    }
}

/// A component's certificate, renewed and revoked at the control
/// service's word (see `ferry_api::certs`): `GET /pki`, `POST
/// /pki/request`, `PUT /pki/certificate`, `PUT /pki/crl`, served to the
/// control role only. Nest under the API prefix.
pub fn pki_routes(pki: crate::tls::Pki) -> axum::Router {
    use axum::routing::{get, post, put};
    use ferry_api::certs::{CertInstall, CertRenewal, CrlInstall};
    type P = State<crate::tls::Pki>;
    fn refused(e: crate::tls::TlsError) -> ErrorResponse {
        ErrorResponse(ApiError::invalid("certificate", e.to_string()))
    }
    axum::Router::new()
        .route("/pki", get(|State(p): P| async move { axum::Json(pki_status(&p)) }))
        .route(
            "/pki/request",
            post(|State(p): P| async move {
                let request = p.signing_request().map_err(refused)?;
                tracing::info!(event = "certificate_request", "made a new key and its signing request");
                Ok::<_, ErrorResponse>(axum::Json(CertRenewal {
                    certificate: p.certificate_pem(),
                    request,
                }))
            }),
        )
        .route(
            "/pki/certificate",
            put(|State(p): P, ApiJson(c): ApiJson<CertInstall>| async move {
                p.install(&c.certificate).map_err(refused)?;
                tracing::info!(event = "certificate_renewed", serial = %p.serial().unwrap_or_default(), "a new certificate is in force");
                Ok::<_, ErrorResponse>(axum::Json(pki_status(&p)))
            }),
        )
        .route(
            "/pki/crl",
            put(|State(p): P, ApiJson(c): ApiJson<CrlInstall>| async move {
                let n = p.install_crl(&c.crl).map_err(refused)?;
                tracing::info!(event = "crl_installed", number = n, "revocation list in force");
                Ok::<_, ErrorResponse>(axum::Json(pki_status(&p)))
            }),
        )
        .layer(axum::middleware::from_fn_with_state(
            PeerAuth::Certificates(&[crate::tls::Role::Control]),
            require_peer,
        ))
        .with_state(pki)
}

/// What [`pki_routes`] answers about `pki`.
pub fn pki_status(pki: &crate::tls::Pki) -> ferry_api::certs::PkiStatus {
    ferry_api::certs::PkiStatus {
        identity: pki.identity.to_string(),
        serial: pki.serial().unwrap_or_default(),
        expires_ms: pki.expires_ms(),
        crl_number: pki.crl_number(),
    }
}
