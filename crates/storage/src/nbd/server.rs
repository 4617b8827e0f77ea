//! The NBD server: handshake, then transmission, one task per connection.
//!
//! Every request is checked ([`proto::check_request`]), admitted by the QoS
//! scheduler through the connection's [`Attachment`], carried out on the
//! blocking pool, and answered by the connection's writer task in completion
//! order (NBD replies may come out of order; the cookie matches them up).
//! A bad request gets the spec's error and the connection goes on; a request
//! that leaves the stream out of step (bad magic, an unskippable payload)
//! ends that connection only. Writes fully received are carried out even if
//! the client is gone by then: nothing acknowledged, or about to be, is lost.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Semaphore};

use super::proto::{self, Command, RequestError};
use crate::export::Export;
use crate::qos::Permit;

/// How long a client may take over the whole handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// Requests one connection may have in progress at once.
pub const MAX_IN_PROGRESS: usize = 256;

/// What a connection is bound to after the handshake: an export, and the
/// flow its requests are admitted under. Dropping it ends the flow's use.
pub trait Attachment: Send + Sync + 'static {
    fn export(&self) -> &Arc<Export>;
    /// Waits for the QoS scheduler; `None` if the flow is gone.
    fn admit(&self, bytes: u64) -> futures::future::BoxFuture<'_, Option<Permit>>;
}

/// The exports a server offers.
pub trait Catalog: Send + Sync + 'static {
    /// Export names for `NBD_OPT_LIST`.
    fn list(&self) -> Vec<String>;
    /// Size and read-only flag of an export name, without attaching.
    fn describe(&self, name: &str) -> Option<(u64, bool)>;
    /// Attaches a connection from `peer` to export `name`.
    fn attach(&self, name: &str, peer: SocketAddr) -> Option<Box<dyn Attachment>>;
}

#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("protocol: {0}")]
    Protocol(String),
    #[error("handshake took longer than {0:?}")]
    Timeout(Duration),
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

/// Serves NBD on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, catalog: Arc<dyn Catalog>) {
    loop {
        let (sock, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!("nbd accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = sock.set_nodelay(true);
        let cat = catalog.clone();
        tokio::spawn(async move {
            if let Err(e) = serve_connection(sock, peer, cat).await {
                tracing::info!("nbd client {peer}: {e}");
            }
        });
    }
}

/// Serves one client connection: handshake, then transmission.
pub async fn serve_connection<S>(
    sock: S,
    peer: SocketAddr,
    catalog: Arc<dyn Catalog>,
) -> Result<(), ConnError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (rd, wr) = tokio::io::split(sock);
    let mut rd = BufReader::with_capacity(256 << 10, rd);
    let mut wr = BufWriter::with_capacity(256 << 10, wr);
    let neg = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        handshake(&mut rd, &mut wr, peer, &*catalog),
    )
    .await
    .map_err(|_| ConnError::Timeout(HANDSHAKE_TIMEOUT))??;
    let Some((att, structured)) = neg else {
        return Ok(());
    };
    transmission(rd, wr, Arc::from(att), structured).await
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

/// The fixed-newstyle handshake. `Ok(None)`: the client left (ABORT or close).
pub async fn handshake<R, W>(
    rd: &mut R,
    wr: &mut W,
    peer: SocketAddr,
    catalog: &dyn Catalog,
) -> Result<Option<(Box<dyn Attachment>, bool)>, ConnError>
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
    let no_zeroes = cflags & proto::FLAG_C_NO_ZEROES != 0;
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
                let Some(att) = catalog.attach(&name, peer) else {
                    return Err(ConnError::Protocol(format!("no export '{name}'")));
                };
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
                    for n in catalog.list() {
                        wr.write_all(&reply(proto::REP_SERVER, &proto::server_entry(&n)))
                            .await?;
                    }
                    wr.write_all(&reply(proto::REP_ACK, &[])).await?;
                }
            }
            proto::OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    wr.write_all(&reply(
                        proto::REP_ERR_INVALID,
                        b"STRUCTURED_REPLY takes no data",
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
                    let Some((size, ro)) = catalog.describe(&name) else {
                        let msg = format!("no export named '{name}'");
                        wr.write_all(&reply(proto::REP_ERR_UNKNOWN, msg.as_bytes()))
                            .await?;
                        wr.flush().await?;
                        continue;
                    };
                    let att = if opt == proto::OPT_GO {
                        match catalog.attach(&name, peer) {
                            Some(a) => Some(a),
                            None => {
                                let msg = format!("export '{name}' went away");
                                wr.write_all(&reply(proto::REP_ERR_UNKNOWN, msg.as_bytes()))
                                    .await?;
                                wr.flush().await?;
                                continue;
                            }
                        }
                    } else {
                        None
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
    mut rd: R,
    wr: W,
    att: Arc<dyn Attachment>,
    structured: bool,
) -> Result<(), ConnError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel::<Reply>();
    let writer = tokio::spawn(write_replies(wr, rx, structured));
    let slots = Arc::new(Semaphore::new(MAX_IN_PROGRESS));
    let result = loop {
        let mut h = [0u8; proto::REQUEST_LEN];
        match rd.read_exact(&mut h).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break Ok(()),
            Err(e) => break Err(e.into()),
        }
        let req = match proto::parse_request(&h) {
            Ok(r) => r,
            Err(e) => break Err(ConnError::Protocol(e.to_string())),
        };
        let export = att.export().clone();
        let cmd = match proto::check_request(&req, export.size(), false) {
            Ok(c) => c,
            Err(RequestError::Fatal(m)) => break Err(ConnError::Protocol(m)),
            Err(RequestError::Reply { code, msg }) => {
                if req.kind == proto::CMD_WRITE {
                    // keep the stream in step: drop the refused payload
                    let mut t = (&mut rd).take(req.length as u64);
                    if let Err(e) = tokio::io::copy(&mut t, &mut tokio::io::sink()).await {
                        break Err(e.into());
                    }
                }
                let _ = tx.send(Reply::Err {
                    cookie: req.cookie,
                    code,
                    msg,
                    read: req.kind == proto::CMD_READ,
                });
                continue;
            }
        };
        if cmd == Command::Disconnect {
            break Ok(());
        }
        let payload = if let Command::Write { .. } = cmd {
            let mut d = vec![0u8; req.length as usize];
            if let Err(e) = rd.read_exact(&mut d).await {
                // the client vanished mid-request: nothing half-written
                break Err(e.into());
            }
            d
        } else {
            Vec::new()
        };
        let Ok(slot) = slots.clone().acquire_owned().await else {
            break Ok(());
        };
        let att = att.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let bytes = match cmd {
                Command::Read | Command::Write { .. } => req.length as u64,
                _ => 0,
            };
            let Some(permit) = att.admit(bytes).await else {
                let _ = tx.send(Reply::Err {
                    cookie: req.cookie,
                    code: proto::EIO,
                    msg: "the flow was removed".into(),
                    read: cmd == Command::Read,
                });
                return;
            };
            let r = tokio::task::spawn_blocking(move || execute(&export, cmd, &req, payload)).await;
            drop(permit);
            drop(slot);
            let reply = match r {
                Ok(reply) => reply,
                Err(e) => Reply::Err {
                    cookie: req.cookie,
                    code: proto::EIO,
                    msg: format!("request task failed: {e}"),
                    read: cmd == Command::Read,
                },
            };
            let _ = tx.send(reply);
        });
    };
    // finish what is in progress (a disconnect waits for every reply)
    drop(tx);
    let _ = writer.await;
    result
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

async fn write_replies<W: AsyncWrite + Unpin>(
    mut wr: W,
    mut rx: mpsc::UnboundedReceiver<Reply>,
    structured: bool,
) -> std::io::Result<()> {
    while let Some(first) = rx.recv().await {
        let mut next = Some(first);
        // batch whatever is ready into one flush
        while let Some(r) = next {
            match r {
                Reply::Ok { cookie } => wr.write_all(&proto::simple_reply(0, cookie)).await?,
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
                    wr.write_all(&data).await?;
                }
                Reply::Data { cookie, data, .. } => {
                    wr.write_all(&proto::simple_reply(0, cookie)).await?;
                    wr.write_all(&data).await?;
                }
                // a READ with structured replies must never get a simple reply
                Reply::Err {
                    cookie,
                    code,
                    msg,
                    read,
                } if structured && read => {
                    wr.write_all(&proto::error_chunk(cookie, code, &msg))
                        .await?
                }
                Reply::Err { cookie, code, .. } => {
                    wr.write_all(&proto::simple_reply(code, cookie)).await?
                }
            }
            next = rx.try_recv().ok();
        }
        wr.flush().await?;
    }
    wr.flush().await?;
    wr.shutdown().await
}
