//! The NBD server: handshake, then transmission, one task per connection.
//!
//! With TLS (the storage node's `nbd_tls = "require"`), the server is in
//! the spec's TLS-required mode: before `NBD_OPT_STARTTLS` it answers every
//! option but `ABORT` with `NBD_REP_ERR_TLS_REQD` (and closes on
//! `EXPORT_NAME`, which has no error reply); after it, the TLS handshake
//! (client certificate of the cluster required) and the usual haggling over
//! TLS, where the catalog decides per export from the client certificate's
//! identity ([`Peer`]) and refuses with `NBD_REP_ERR_POLICY` naming why.
//!
//! Every request is checked ([`proto::check_request`]) and queued with the
//! QoS scheduler through the connection's [`Attachment`]. A request the
//! scheduler dispatches at once and the page cache serves without waiting
//! (`RWF_NOWAIT` reads and plain writes) is carried out inline and answered
//! by the connection's own task; any other — queued by QoS, a cache miss,
//! FUA, flush, trim, write-zeroes — runs on the blocking pool and its reply
//! comes back to the connection task. Replies go out in completion order
//! (the cookie matches them up), batched into one flush whenever no further
//! request is already buffered. A bad request gets the spec's error and the
//! connection goes on; a request that leaves the stream out of step (bad
//! magic, an unskippable payload) ends that connection only. Writes fully
//! received are carried out even if the client is gone by then: nothing
//! acknowledged, or about to be, is lost.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{
    AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter,
};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use super::proto::{self, Command, RequestError};
use crate::export::Export;
use crate::qos::{Permit, Ticket};

/// How long a client may take over the whole handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// Requests one connection may have in progress at once.
pub const MAX_IN_PROGRESS: usize = 256;
/// Bytes of reads and writes one connection may have in progress at once:
/// past it no further request is read until replies go out, so a client
/// holds at most this plus one request's payload ([`proto::MAX_PAYLOAD`])
/// of the node's memory per connection.
pub const MAX_IN_FLIGHT_BYTES: u64 = 64 << 20;
/// Connections one client address may hold, and all clients together.
pub const MAX_CONNECTIONS_PER_CLIENT: usize = 512;
pub const MAX_CONNECTIONS: usize = 4096;

/// What NBD takes from its clients, and whether it offers them structured
/// replies: `[nbd_limits]` in `storage.toml`, each key with the default above.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NbdLimits {
    /// Requests one connection may have in progress (`max_requests_in_progress`).
    pub max_requests_in_progress: usize,
    /// Bytes of reads and writes one connection may have in progress
    /// (`max_bytes_in_progress`).
    pub max_bytes_in_progress: u64,
    /// Connections one client address may hold (`max_connections_per_client`).
    pub max_connections_per_client: usize,
    /// Connections all clients together may hold (`max_connections`).
    pub max_connections: usize,
    /// Whether a client that asks for structured replies gets them
    /// (`structured_replies`). This server sends no holes and no block
    /// status, so all they add is an error's text on a failed READ; each
    /// READ reply then costs the client four receives where a simple reply
    /// costs two. Off by default ([`STRUCTURED_REPLIES`]).
    pub structured_replies: bool,
}

/// Structured replies are not offered unless configured: a READ answered
/// with a simple reply costs the client half the receives (measured in
/// BENCHMARKS, "NBD against the device it serves").
pub const STRUCTURED_REPLIES: bool = false;

impl Default for NbdLimits {
    fn default() -> Self {
        NbdLimits {
            max_requests_in_progress: MAX_IN_PROGRESS,
            max_bytes_in_progress: MAX_IN_FLIGHT_BYTES,
            max_connections_per_client: MAX_CONNECTIONS_PER_CLIENT,
            max_connections: MAX_CONNECTIONS,
            structured_replies: STRUCTURED_REPLIES,
        }
    }
}

impl NbdLimits {
    /// Refuses limits no client could work within, naming the key.
    pub fn validate(&self) -> Result<(), ferry_api::ApiError> {
        let floor = |key: &str, v: u64, min: u64| {
            ferry_net::server::at_least(&format!("nbd_limits.{key}"), v, min)
        };
        floor(
            "max_requests_in_progress",
            self.max_requests_in_progress as u64,
            1,
        )?;
        // one request's largest payload must fit
        floor(
            "max_bytes_in_progress",
            self.max_bytes_in_progress,
            proto::MAX_PAYLOAD as u64,
        )?;
        floor(
            "max_connections_per_client",
            self.max_connections_per_client as u64,
            1,
        )?;
        floor("max_connections", self.max_connections as u64, 1)
    }
}

/// What a connection is bound to after the handshake: an export, and the
/// flow its requests are admitted under. Dropping it ends the flow's use.
pub trait Attachment: Send + Sync + 'static {
    fn export(&self) -> &Arc<Export>;
    /// Queues a request of `bytes` with the QoS scheduler.
    fn request(&self, bytes: u64) -> Ticket;
    /// Why this connection may no longer be served (its peer was fenced:
    /// the grant it opened under was revoked), checked before every
    /// request is carried out, however late it arrives.
    fn fenced(&self) -> Option<String> {
        None
    }
}

/// Who is at the other end of a connection.
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    /// The client certificate's identity, once TLS is up; `None` on a
    /// server without TLS.
    pub identity: Option<ferry_net::tls::Identity>,
    /// For a VM's certificate (role `vm`, named for the VM): the host whose
    /// agent signed it.
    pub vm_host: Option<String>,
}

/// Why an export is not served to a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No such export (`NBD_REP_ERR_UNKNOWN`).
    Unknown(String),
    /// It exists, and this peer may not open it (`NBD_REP_ERR_POLICY`).
    Policy(String),
}

impl Refusal {
    fn reply_type(&self) -> u32 {
        match self {
            Refusal::Unknown(_) => proto::REP_ERR_UNKNOWN,
            Refusal::Policy(_) => proto::REP_ERR_POLICY,
        }
    }
    fn message(&self) -> &str {
        match self {
            Refusal::Unknown(m) | Refusal::Policy(m) => m,
        }
    }
}

/// The exports a server offers.
pub trait Catalog: Send + Sync + 'static {
    /// Export names `peer` may open, for `NBD_OPT_LIST`.
    fn list(&self, peer: &Peer) -> Vec<String>;
    /// Size and read-only flag of an export name, without attaching.
    fn describe(&self, name: &str, peer: &Peer) -> Result<(u64, bool), Refusal>;
    /// Attaches a connection from `peer` to export `name`.
    fn attach(&self, name: &str, peer: &Peer) -> Result<Box<dyn Attachment>, Refusal>;
}

#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("protocol: {0}")]
    Protocol(String),
    #[error("handshake took longer than {0:?}")]
    Timeout(Duration),
    #[error("TLS: {0}")]
    Tls(std::io::Error),
    #[error("fenced: {0}")]
    Fenced(String),
    #[error("the client's certificate no longer passes: {0}")]
    Revoked(String),
}

/// TLS for the NBD server: the handshake's acceptor and, where the
/// certificates in force can change, the PKI they come from. At each change
/// ([`ferry_net::tls::Pki::changes`]: a revocation list, the CA, the node's
/// certificate) every connection's client chain is checked again
/// ([`ferry_net::tls::Pki::nbd_client_passes`]); one that no longer passes
/// (a revoked host, or a VM whose agent was revoked) ends its connection,
/// and the others go on undisturbed.
#[derive(Clone)]
pub struct Tls {
    pub acceptor: tokio_rustls::TlsAcceptor,
    pub pki: Option<ferry_net::tls::Pki>,
}

/// A connection's client chain, checked again at each change in force.
struct Recheck {
    pki: ferry_net::tls::Pki,
    changes: tokio::sync::watch::Receiver<u64>,
    chain: Vec<tokio_rustls::rustls::pki_types::CertificateDer<'static>>,
    /// When the handshake checked it (Unix seconds): its dates are judged
    /// as then.
    at: u64,
}

impl Recheck {
    /// Why the chain no longer passes, if something changed since the
    /// last look; `None` if it passes or nothing changed.
    fn now(&mut self) -> Option<String> {
        if !self.changes.has_changed().unwrap_or(false) {
            return None;
        }
        self.changes.borrow_and_update();
        self.pki.nbd_client_passes(&self.chain, self.at).err()
    }

    /// Waits for a change after which the chain no longer passes.
    async fn failed(&mut self) -> String {
        loop {
            if self.changes.changed().await.is_err() {
                return std::future::pending().await;
            }
            if let Err(why) = self.pki.nbd_client_passes(&self.chain, self.at) {
                return why;
            }
        }
    }
}

/// Why a connection's client no longer passes, once it does not (never
/// without a [`Recheck`]).
async fn no_longer_passes(r: &mut Option<Recheck>) -> String {
    match r {
        Some(r) => r.failed().await,
        None => std::future::pending().await,
    }
}

fn transmission_flags(read_only: bool) -> u16 {
    let mut f = proto::TF_HAS_FLAGS
        | proto::TF_SEND_FLUSH
        | proto::TF_SEND_FUA
        | proto::TF_SEND_TRIM
        | proto::TF_SEND_WRITE_ZEROES
        | proto::TF_CAN_MULTI_CONN;
    if read_only {
        f |= proto::TF_READ_ONLY;
    }
    f
}

/// Serves NBD on `listener` until the task is dropped; with `tls`, in the
/// TLS-required mode. A client past `limits.max_connections_per_client` (or
/// everyone past `limits.max_connections`) is closed at once, before the
/// handshake; the others are served on.
pub async fn serve(
    listener: TcpListener,
    catalog: Arc<dyn Catalog>,
    tls: Option<Tls>,
    limits: NbdLimits,
) {
    let table = ferry_net::server::ConnectionTable::new(
        limits.max_connections,
        limits.max_connections_per_client,
    );
    let mut said = std::time::Instant::now() - Duration::from_secs(2);
    loop {
        let (sock, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!("nbd accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let slot = match table.admit(peer.ip()) {
            Ok(s) => s,
            Err(why) => {
                if said.elapsed() >= Duration::from_secs(1) {
                    tracing::warn!(%peer, "nbd connection refused: {why}");
                    said = std::time::Instant::now();
                }
                continue;
            }
        };
        let _ = sock.set_nodelay(true);
        let (cat, tls) = (catalog.clone(), tls.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let r = match tls {
                Some(tls) => serve_tls_connection(sock, peer, cat, tls, limits).await,
                None => serve_connection(sock, peer, cat, limits).await,
            };
            if let Err(e) = r {
                tracing::info!("nbd client {peer}: {e}");
            }
        });
    }
}

/// Serves one client connection without TLS: handshake, then transmission.
pub async fn serve_connection<S>(
    sock: S,
    addr: SocketAddr,
    catalog: Arc<dyn Catalog>,
    limits: NbdLimits,
) -> Result<(), ConnError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let peer = Peer {
        addr,
        identity: None,
        vm_host: None,
    };
    let (rd, wr) = tokio::io::split(sock);
    let mut rd = BufReader::with_capacity(256 << 10, rd);
    let mut wr = BufWriter::with_capacity(256 << 10, wr);
    let neg = tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        let no_zeroes = greet(&mut rd, &mut wr).await?;
        options(
            &mut rd, &mut wr, &peer, &*catalog, no_zeroes, false, &limits,
        )
        .await
    })
    .await
    .map_err(|_| ConnError::Timeout(HANDSHAKE_TIMEOUT))??;
    let Some((att, structured)) = neg else {
        return Ok(());
    };
    transmission(rd, wr, Arc::from(att), structured, limits, None).await
}

/// Serves one client connection in TLS-required mode: greeting and
/// options in clear until `STARTTLS`, the TLS handshake, then options and
/// transmission over TLS.
pub async fn serve_tls_connection<S>(
    mut sock: S,
    addr: SocketAddr,
    catalog: Arc<dyn Catalog>,
    tls: Tls,
    limits: NbdLimits,
) -> Result<(), ConnError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let deadline = tokio::time::Instant::now() + HANDSHAKE_TIMEOUT;
    let timeout = ConnError::Timeout(HANDSHAKE_TIMEOUT);
    // unbuffered in clear: no byte of the TLS handshake may be read early
    let no_zeroes = match tokio::time::timeout_at(deadline, async {
        let (rd, wr) = &mut tokio::io::split(&mut sock);
        let nz = greet(rd, wr).await?;
        Ok::<_, ConnError>((nz, until_starttls(rd, wr).await?))
    })
    .await
    {
        Err(_) => return Err(timeout),
        Ok(r) => match r? {
            (nz, true) => nz,
            (_, false) => return Ok(()),
        },
    };
    // told of a change from before the handshake on: none slips between
    let changes = tls.pki.as_ref().map(|p| (p.clone(), p.changes()));
    let tls = tokio::time::timeout_at(deadline, tls.acceptor.accept(sock))
        .await
        .map_err(|_| ConnError::Timeout(HANDSHAKE_TIMEOUT))?
        .map_err(ConnError::Tls)?;
    let certs = tls.get_ref().1.peer_certificates();
    let (identity, vm_host) = certs
        .and_then(ferry_net::tls::vm_identity)
        .map_or((None, None), |(id, host)| (Some(id), host));
    let mut recheck = match (changes, certs) {
        (Some((pki, changes)), Some(c)) => Some(Recheck {
            pki,
            changes,
            chain: c.iter().map(|c| c.clone().into_owned()).collect(),
            at: ferry_api::util::now_ms() / 1000,
        }),
        _ => None,
    };
    let peer = Peer {
        addr,
        identity,
        vm_host,
    };
    let (rd, wr) = tokio::io::split(tls);
    let mut rd = BufReader::with_capacity(256 << 10, rd);
    let mut wr = BufWriter::with_capacity(256 << 10, wr);
    let neg = tokio::time::timeout_at(
        deadline,
        options(&mut rd, &mut wr, &peer, &*catalog, no_zeroes, true, &limits),
    )
    .await
    .map_err(|_| ConnError::Timeout(HANDSHAKE_TIMEOUT))??;
    let Some((att, structured)) = neg else {
        return Ok(());
    };
    if let Some(why) = recheck.as_mut().and_then(Recheck::now) {
        return Err(ConnError::Revoked(why));
    }
    transmission(rd, wr, Arc::from(att), structured, limits, recheck).await
}

/// Options before TLS in TLS-required mode. `true`: STARTTLS was
/// acknowledged (TLS begins); `false`: the client left.
async fn until_starttls<R, W>(rd: &mut R, wr: &mut W) -> Result<bool, ConnError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    loop {
        let mut h = [0u8; 16];
        match rd.read_exact(&mut h).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(false),
            Err(e) => return Err(e.into()),
        }
        let (opt, len) = proto::parse_option_header(&h).map_err(ConnError::Protocol)?;
        let reply = |kind: u32, data: &[u8]| proto::option_reply(opt, kind, data);
        let data = option_data(rd, len).await?;
        match opt {
            proto::OPT_STARTTLS if data.as_deref() == Some(&[]) => {
                wr.write_all(&reply(proto::REP_ACK, &[])).await?;
                wr.flush().await?;
                return Ok(true);
            }
            proto::OPT_STARTTLS => {
                wr.write_all(&reply(proto::REP_ERR_INVALID, b"STARTTLS takes no data"))
                    .await?;
            }
            proto::OPT_ABORT => {
                wr.write_all(&reply(proto::REP_ACK, &[])).await?;
                wr.flush().await?;
                return Ok(false);
            }
            // no error reply exists for it: the spec says to close
            proto::OPT_EXPORT_NAME => {
                return Err(ConnError::Protocol(
                    "EXPORT_NAME before STARTTLS on a server that requires TLS".into(),
                ))
            }
            _ => {
                wr.write_all(&reply(
                    proto::REP_ERR_TLS_REQD,
                    b"this server requires TLS: send NBD_OPT_STARTTLS first",
                ))
                .await?;
            }
        }
        wr.flush().await?;
    }
}

/// Reads an option's data, or skips it when too large (then `None`).
async fn option_data<R: AsyncRead + Unpin>(
    rd: &mut R,
    len: u32,
) -> Result<Option<Vec<u8>>, ConnError> {
    if len > proto::MAX_OPTION {
        if len > proto::MAX_OPTION_SKIP {
            return Err(ConnError::Protocol(format!("option of {len} bytes")));
        }
        tokio::io::copy(&mut rd.take(len as u64), &mut tokio::io::sink()).await?;
        return Ok(None);
    }
    let mut d = vec![0u8; len as usize];
    rd.read_exact(&mut d).await?;
    Ok(Some(d))
}

/// The fixed-newstyle greeting and the client's flags; returns whether
/// the client asked for no zeroes.
async fn greet<R, W>(rd: &mut R, wr: &mut W) -> Result<bool, ConnError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    wr.write_all(&proto::greeting()).await?;
    wr.flush().await?;
    let cflags = rd.read_u32().await?;
    if cflags & !(proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES) != 0 {
        return Err(ConnError::Protocol(format!(
            "unknown client flags {cflags:#x}"
        )));
    }
    if cflags & proto::FLAG_C_FIXED_NEWSTYLE == 0 {
        return Err(ConnError::Protocol(
            "client does not speak fixed newstyle".into(),
        ));
    }
    Ok(cflags & proto::FLAG_C_NO_ZEROES != 0)
}

/// The option haggling. `Ok(None)`: the client left (ABORT or close).
/// `tls`: the connection is already over TLS.
async fn options<R, W>(
    rd: &mut R,
    wr: &mut W,
    peer: &Peer,
    catalog: &dyn Catalog,
    no_zeroes: bool,
    tls: bool,
    limits: &NbdLimits,
) -> Result<Option<(Box<dyn Attachment>, bool)>, ConnError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut structured = false;
    loop {
        let mut h = [0u8; 16];
        match rd.read_exact(&mut h).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e.into()),
        }
        let (opt, len) = proto::parse_option_header(&h).map_err(ConnError::Protocol)?;
        let reply = |kind: u32, data: &[u8]| proto::option_reply(opt, kind, data);
        let Some(data) = option_data(rd, len).await? else {
            if opt == proto::OPT_EXPORT_NAME {
                return Err(ConnError::Protocol("export name too long".into()));
            }
            wr.write_all(&reply(proto::REP_ERR_TOO_BIG, b"option data too large"))
                .await?;
            wr.flush().await?;
            continue;
        };
        match opt {
            proto::OPT_EXPORT_NAME => {
                // no way to report an error here but to close
                let name = proto::parse_name(&data).map_err(ConnError::Protocol)?;
                let att = catalog.attach(&name, peer).map_err(|r| {
                    ConnError::Protocol(format!("export '{name}': {}", r.message()))
                })?;
                let e = att.export();
                wr.write_all(&proto::export_name_reply(
                    e.size(),
                    transmission_flags(false),
                    no_zeroes,
                ))
                .await?;
                wr.flush().await?;
                return Ok(Some((att, structured)));
            }
            proto::OPT_ABORT => {
                wr.write_all(&reply(proto::REP_ACK, &[])).await?;
                wr.flush().await?;
                return Ok(None);
            }
            proto::OPT_LIST => {
                if !data.is_empty() {
                    wr.write_all(&reply(proto::REP_ERR_INVALID, b"LIST takes no data"))
                        .await?;
                } else {
                    for n in catalog.list(peer) {
                        wr.write_all(&reply(proto::REP_SERVER, &proto::server_entry(&n)))
                            .await?;
                    }
                    wr.write_all(&reply(proto::REP_ACK, &[])).await?;
                }
            }
            proto::OPT_STARTTLS => {
                let msg: &[u8] = if tls {
                    b"TLS is already on"
                } else {
                    b"this server has no TLS"
                };
                let kind = if tls {
                    proto::REP_ERR_INVALID
                } else {
                    proto::REP_ERR_UNSUP
                };
                wr.write_all(&reply(kind, msg)).await?;
            }
            proto::OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    wr.write_all(&reply(
                        proto::REP_ERR_INVALID,
                        b"STRUCTURED_REPLY takes no data",
                    ))
                    .await?;
                } else if !limits.structured_replies {
                    wr.write_all(&reply(
                        proto::REP_ERR_UNSUP,
                        b"structured replies are off on this node (nbd_limits.structured_replies)",
                    ))
                    .await?;
                } else {
                    structured = true;
                    wr.write_all(&reply(proto::REP_ACK, &[])).await?;
                }
            }
            proto::OPT_INFO | proto::OPT_GO => match proto::parse_info_request(&data) {
                Err(msg) => {
                    wr.write_all(&reply(proto::REP_ERR_INVALID, msg.as_bytes()))
                        .await?;
                }
                Ok((name, infos)) => {
                    let described = catalog.describe(&name, peer);
                    let attached = match (&described, opt) {
                        (Ok(_), proto::OPT_GO) => catalog.attach(&name, peer).map(Some),
                        (Ok(_), _) => Ok(None),
                        (Err(r), _) => Err(r.clone()),
                    };
                    let (size, ro, att) = match (described, attached) {
                        (Ok((size, ro)), Ok(att)) => (size, ro, att),
                        (_, Err(r)) | (Err(r), _) => {
                            tracing::info!(peer = %peer.addr, identity = ?peer.identity, export = %name, "refused: {}", r.message());
                            wr.write_all(&reply(r.reply_type(), r.message().as_bytes()))
                                .await?;
                            wr.flush().await?;
                            continue;
                        }
                    };
                    let size = att.as_ref().map_or(size, |a| a.export().size());
                    wr.write_all(&reply(
                        proto::REP_INFO,
                        &proto::info_export(size, transmission_flags(ro)),
                    ))
                    .await?;
                    wr.write_all(&reply(proto::REP_INFO, &proto::info_block_size()))
                        .await?;
                    if infos.contains(&proto::INFO_NAME) {
                        wr.write_all(&reply(proto::REP_INFO, &proto::info_name(&name)))
                            .await?;
                    }
                    wr.write_all(&reply(proto::REP_ACK, &[])).await?;
                    wr.flush().await?;
                    if let Some(a) = att {
                        return Ok(Some((a, structured)));
                    }
                }
            },
            other => {
                let msg = format!("option {other} is not supported");
                wr.write_all(&reply(proto::REP_ERR_UNSUP, msg.as_bytes()))
                    .await?;
            }
        }
        wr.flush().await?;
    }
}

/// One reply, handed from a request's task to the writer task.
enum Reply {
    Ok {
        cookie: u64,
    },
    Data {
        cookie: u64,
        offset: u64,
        data: Vec<u8>,
    },
    Err {
        cookie: u64,
        code: u32,
        msg: String,
        read: bool,
    },
}

fn io_code(e: &std::io::Error) -> u32 {
    match e.raw_os_error() {
        Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG) => proto::ENOSPC,
        Some(libc::EPERM | libc::EROFS) => proto::EPERM,
        _ => proto::EIO,
    }
}

async fn transmission<R, W>(
    mut rd: BufReader<R>,
    mut wr: BufWriter<W>,
    att: Arc<dyn Attachment>,
    structured: bool,
    limits: NbdLimits,
    mut recheck: Option<Recheck>,
) -> Result<(), ConnError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    // Requests the scheduler admits at once and the page cache answers at
    // once (RWF_NOWAIT) are served inline, in this task; the rest go to a
    // task of their own and come back as replies on `rx`.
    // each reply comes back with the bytes its request held
    let (tx, mut rx) = mpsc::unbounded_channel::<(u64, Reply)>();
    let mut pending = 0usize;
    let mut in_flight = 0u64;
    let result: Result<(), ConnError> = async {
        loop {
            while let Ok((b, r)) = rx.try_recv() {
                pending -= 1;
                in_flight -= b;
                write_reply(&mut wr, r, structured).await?;
            }
            let full = pending >= limits.max_requests_in_progress
                || in_flight >= limits.max_bytes_in_progress;
            if full || rd.buffer().is_empty() {
                // nothing pipelined (or no room): send what is ready, then
                // wait for input or a reply
                wr.flush().await?;
                tokio::select! {
                    r = rd.fill_buf(), if !full => {
                        if r?.is_empty() {
                            return Ok(());
                        }
                    }
                    Some((b, r)) = rx.recv() => {
                        pending -= 1;
                        in_flight -= b;
                        write_reply(&mut wr, r, structured).await?;
                        continue;
                    }
                    // an idle connection ends too
                    why = no_longer_passes(&mut recheck) => return Err(ConnError::Revoked(why)),
                }
            }
            let mut h = [0u8; proto::REQUEST_LEN];
            match rd.read_exact(&mut h).await {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e.into()),
            }
            let req = proto::parse_request(&h).map_err(|e| ConnError::Protocol(e.to_string()))?;
            let export = att.export().clone();
            let cmd = match proto::check_request(&req, export.size(), false) {
                Ok(c) => c,
                Err(RequestError::Fatal(m)) => return Err(ConnError::Protocol(m)),
                Err(RequestError::Reply { code, msg }) => {
                    if req.kind == proto::CMD_WRITE {
                        // keep the stream in step: drop the refused payload
                        let mut t = (&mut rd).take(req.length as u64);
                        tokio::io::copy(&mut t, &mut tokio::io::sink()).await?;
                    }
                    let read = req.kind == proto::CMD_READ;
                    write_reply(
                        &mut wr,
                        Reply::Err {
                            cookie: req.cookie,
                            code,
                            msg,
                            read,
                        },
                        structured,
                    )
                    .await?;
                    continue;
                }
            };
            if cmd == Command::Disconnect {
                return Ok(());
            }
            let payload = if let Command::Write { .. } = cmd {
                let mut d = vec![0u8; req.length as usize];
                // a client vanishing mid-payload: nothing half-written
                rd.read_exact(&mut d).await?;
                d
            } else {
                Vec::new()
            };
            // refused, and the connection closed: a fenced host's request,
            // or one whose certificate no longer passes, is never carried out
            let refused = match att.fenced() {
                Some(why) => Some((why.clone(), ConnError::Fenced(why))),
                None => recheck.as_mut().and_then(Recheck::now).map(|why| {
                    let e = ConnError::Revoked(why);
                    (e.to_string(), e)
                }),
            };
            if let Some((msg, e)) = refused {
                write_reply(
                    &mut wr,
                    Reply::Err {
                        cookie: req.cookie,
                        code: proto::EPERM,
                        msg,
                        read: cmd == Command::Read,
                    },
                    structured,
                )
                .await?;
                return Err(e);
            }
            let bytes = match cmd {
                Command::Read | Command::Write { .. } => req.length as u64,
                _ => 0,
            };
            let mut ticket = att.request(bytes);
            if let Some(permit) = ticket.ready() {
                if let Some(reply) = execute_nowait(&export, cmd, &req, &payload) {
                    drop(permit);
                    write_reply(&mut wr, reply, structured).await?;
                    continue;
                }
                pending += 1;
                in_flight += bytes;
                spawn_blocking_io(tx.clone(), export, cmd, req, payload, permit);
                continue;
            }
            pending += 1;
            in_flight += bytes;
            let tx = tx.clone();
            let gate = att.clone();
            tokio::spawn(async move {
                match ticket.wait().await {
                    // fenced while it waited for its turn
                    Some(_) if gate.fenced().is_some() => {
                        let _ = tx.send((
                            bytes,
                            Reply::Err {
                                cookie: req.cookie,
                                code: proto::EPERM,
                                msg: gate.fenced().unwrap_or_default(),
                                read: cmd == Command::Read,
                            },
                        ));
                    }
                    Some(permit) => spawn_blocking_io(tx, export, cmd, req, payload, permit),
                    None => {
                        let _ = tx.send((
                            bytes,
                            Reply::Err {
                                cookie: req.cookie,
                                code: proto::EIO,
                                msg: "the flow was removed".into(),
                                read: cmd == Command::Read,
                            },
                        ));
                    }
                }
            });
        }
    }
    .await;
    // finish what is in progress (a disconnect waits for every reply); writes
    // already received complete even when the client is gone
    while pending > 0 {
        let Some((_, r)) = rx.recv().await else {
            break;
        };
        pending -= 1;
        if result.is_ok() {
            let _ = write_reply(&mut wr, r, structured).await;
        }
    }
    let _ = wr.flush().await;
    let _ = wr.shutdown().await;
    result
}

/// Carries out a request on the blocking pool; its reply goes to `tx`.
fn spawn_blocking_io(
    tx: mpsc::UnboundedSender<(u64, Reply)>,
    export: Arc<Export>,
    cmd: Command,
    req: proto::Request,
    payload: Vec<u8>,
    permit: Permit,
) {
    let bytes = match cmd {
        Command::Read | Command::Write { .. } => req.length as u64,
        _ => 0,
    };
    tokio::task::spawn_blocking(move || {
        let reply = execute(&export, cmd, &req, payload);
        drop(permit);
        let _ = tx.send((bytes, reply));
    });
}

/// The inline path: a READ or plain WRITE the page cache takes without waiting.
fn execute_nowait(e: &Export, cmd: Command, req: &proto::Request, payload: &[u8]) -> Option<Reply> {
    match cmd {
        Command::Read => {
            let mut data = vec![0u8; req.length as usize];
            match e.read_nowait(&mut data, req.offset) {
                Ok(true) => Some(Reply::Data {
                    cookie: req.cookie,
                    offset: req.offset,
                    data,
                }),
                _ => None,
            }
        }
        Command::Write { fua: false } => match e.write_nowait(payload, req.offset) {
            Ok(true) => Some(Reply::Ok { cookie: req.cookie }),
            _ => None,
        },
        _ => None,
    }
}

fn execute(e: &Export, cmd: Command, req: &proto::Request, payload: Vec<u8>) -> Reply {
    let cookie = req.cookie;
    let r = match cmd {
        Command::Read => {
            let mut data = vec![0u8; req.length as usize];
            return match e.read_at(&mut data, req.offset) {
                Ok(()) => Reply::Data {
                    cookie,
                    offset: req.offset,
                    data,
                },
                Err(err) => Reply::Err {
                    cookie,
                    code: io_code(&err),
                    msg: format!("read: {err}"),
                    read: true,
                },
            };
        }
        Command::Write { fua } => e.write_at(&payload, req.offset, fua),
        Command::Flush => e.flush(),
        Command::Trim { fua } => e.trim(req.offset, req.length as u64, fua),
        Command::WriteZeroes { fua, no_hole } => {
            e.write_zeroes(req.offset, req.length as u64, no_hole, fua)
        }
        Command::Disconnect => Ok(()),
    };
    match r {
        Ok(()) => Reply::Ok { cookie },
        Err(err) => Reply::Err {
            cookie,
            code: io_code(&err),
            msg: err.to_string(),
            read: false,
        },
    }
}

async fn write_reply<W: AsyncWrite + Unpin>(
    wr: &mut W,
    r: Reply,
    structured: bool,
) -> std::io::Result<()> {
    match r {
        Reply::Ok { cookie } => wr.write_all(&proto::simple_reply(0, cookie)).await,
        Reply::Data {
            cookie,
            offset,
            data,
        } if structured => {
            let h = proto::chunk_header(
                proto::REPLY_FLAG_DONE,
                proto::REPLY_TYPE_OFFSET_DATA,
                cookie,
                8 + data.len() as u32,
            );
            wr.write_all(&h).await?;
            wr.write_all(&offset.to_be_bytes()).await?;
            wr.write_all(&data).await
        }
        Reply::Data { cookie, data, .. } => {
            wr.write_all(&proto::simple_reply(0, cookie)).await?;
            wr.write_all(&data).await
        }
        // a READ with structured replies must never get a simple reply
        Reply::Err {
            cookie,
            code,
            msg,
            read,
        } if structured && read => wr.write_all(&proto::error_chunk(cookie, code, &msg)).await,
        Reply::Err { cookie, code, .. } => wr.write_all(&proto::simple_reply(code, cookie)).await,
    }
}
