//! The NBD client a storage node writes another node's export with (moves
//! and replicas, [`crate::remote`]). It speaks the part of `doc/proto.md`
//! that takes:
//!
//! ```text
//! Handshake (fixed newstyle)
//!   S: u64 NBDMAGIC  u64 IHAVEOPT  u16 flags (FIXED_NEWSTYLE required)
//!   C: u32 FIXED_NEWSTYLE|NO_ZEROES
//!   [C: STARTTLS  S: ACK  — then TLS, when the node has a certificate]
//!   C: GO u32 len, name, u16 0 (no info asked: the server sends EXPORT)
//!   S: INFO{EXPORT u16 0, u64 size, u16 flags}* … ACK  | ERR_* message
//! Transmission (simple replies only: structured replies are not asked for)
//!   C: u32 0x25609513 u16 flags u16 type u64 cookie u64 offset u32 len [data]
//!   S: u32 0x67446698 u32 error u64 cookie
//! ```
//!
//! Writes are sent without waiting ([`Client::send_writes`]) and their
//! replies, in any order, matched by cookie ([`Client::wait_writes`]): a
//! writer keeps two batches in flight so the link never waits for a reply.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;

use super::proto;

/// Why a connection or a request failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Uri(String),
    #[error("the server broke the protocol: {0}")]
    Protocol(String),
    #[error("the server refused export '{export}' ({code:#x}): {message}")]
    Refused {
        export: String,
        code: u32,
        message: String,
    },
    #[error("the server answered {what} with error {code} ({})", errno_name(*code))]
    Request { what: String, code: u32 },
    #[error("TLS: {0}")]
    Tls(String),
}

fn errno_name(code: u32) -> &'static str {
    match code {
        proto::EPERM => "EPERM",
        proto::EIO => "EIO",
        proto::EINVAL => "EINVAL",
        proto::ENOSPC => "ENOSPC",
        proto::EOVERFLOW => "EOVERFLOW",
        _ => "unknown",
    }
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// An open export, in transmission.
pub struct Client {
    rd: BufReader<tokio::io::ReadHalf<Box<dyn Io>>>,
    wr: BufWriter<tokio::io::WriteHalf<Box<dyn Io>>>,
    pub export: String,
    pub size: u64,
    pub flags: u16,
    cookie: u64,
    /// Writes sent and not yet answered.
    pending: std::collections::HashSet<u64>,
}

/// Largest write sent in one request.
pub const MAX_WRITE: usize = 1 << 20;

impl Client {
    /// Opens `nbd://HOST:PORT/EXPORT`; over TLS when `tls` is given (the
    /// server's certificate must name HOST).
    pub async fn connect(
        uri: &str,
        tls: Option<Arc<ferry_net::tls::ClientConfig>>,
    ) -> Result<Client, ClientError> {
        let (host, port, export) =
            ferry_api::types::parse_nbd_uri(uri).map_err(|e| ClientError::Uri(e.to_string()))?;
        let sock = TcpStream::connect((host.as_str(), port)).await?;
        sock.set_nodelay(true)?;
        let mut io: Box<dyn Io> = Box::new(sock);
        let mut hello = [0u8; 18];
        io.read_exact(&mut hello).await?;
        let magic = u64::from_be_bytes(hello[0..8].try_into().expect("8 bytes"));
        let opt = u64::from_be_bytes(hello[8..16].try_into().expect("8 bytes"));
        let flags = u16::from_be_bytes([hello[16], hello[17]]);
        if magic != proto::NBDMAGIC || opt != proto::IHAVEOPT {
            return Err(ClientError::Protocol(format!(
                "not a newstyle NBD server (magic {magic:#x} {opt:#x})"
            )));
        }
        if flags & proto::FLAG_FIXED_NEWSTYLE == 0 {
            return Err(ClientError::Protocol("no fixed newstyle handshake".into()));
        }
        let mut cf = proto::FLAG_C_FIXED_NEWSTYLE;
        if flags & proto::FLAG_NO_ZEROES != 0 {
            cf |= proto::FLAG_C_NO_ZEROES;
        }
        io.write_all(&cf.to_be_bytes()).await?;
        if let Some(cfg) = tls {
            send_option(&mut io, proto::OPT_STARTTLS, &[]).await?;
            let (kind, data) = read_option_reply(&mut io, proto::OPT_STARTTLS).await?;
            if kind != proto::REP_ACK {
                return Err(refusal(&export, kind, &data));
            }
            let mut c = (*cfg).clone();
            c.alpn_protocols.clear();
            let name = tokio_rustls::rustls::pki_types::ServerName::try_from(host.clone())
                .map_err(|e| ClientError::Tls(format!("{host}: {e}")))?;
            let s = tokio::time::timeout(
                ferry_net::tls::HANDSHAKE_TIMEOUT,
                tokio_rustls::TlsConnector::from(Arc::new(c)).connect(name, io),
            )
            .await
            .map_err(|_| ClientError::Tls("handshake timed out".into()))?
            .map_err(|e| ClientError::Tls(e.to_string()))?;
            io = Box::new(s);
        }
        let mut go = Vec::with_capacity(export.len() + 6);
        go.extend_from_slice(&(export.len() as u32).to_be_bytes());
        go.extend_from_slice(export.as_bytes());
        go.extend_from_slice(&0u16.to_be_bytes());
        send_option(&mut io, proto::OPT_GO, &go).await?;
        let mut info = None;
        loop {
            let (kind, data) = read_option_reply(&mut io, proto::OPT_GO).await?;
            match kind {
                proto::REP_ACK => break,
                proto::REP_INFO => {
                    if data.len() >= 12
                        && u16::from_be_bytes([data[0], data[1]]) == proto::INFO_EXPORT
                    {
                        let size = u64::from_be_bytes(data[2..10].try_into().expect("8 bytes"));
                        let flags = u16::from_be_bytes([data[10], data[11]]);
                        info = Some((size, flags));
                    }
                }
                k if k & (1 << 31) != 0 => return Err(refusal(&export, k, &data)),
                k => return Err(ClientError::Protocol(format!("unexpected reply {k} to GO"))),
            }
        }
        let (size, flags) = info.ok_or_else(|| {
            ClientError::Protocol("GO acknowledged without the export's size".into())
        })?;
        if flags & proto::TF_READ_ONLY != 0 {
            return Err(ClientError::Refused {
                export,
                code: 0,
                message: "the export is read-only".into(),
            });
        }
        let (r, w) = tokio::io::split(io);
        Ok(Client {
            rd: BufReader::new(r),
            wr: BufWriter::with_capacity(MAX_WRITE + proto::REQUEST_LEN, w),
            export,
            size,
            flags,
            cookie: 0,
            pending: Default::default(),
        })
    }

    async fn send(
        &mut self,
        kind: u16,
        offset: u64,
        len: u32,
        data: &[u8],
    ) -> Result<u64, ClientError> {
        self.cookie += 1;
        let mut h = [0u8; proto::REQUEST_LEN];
        h[0..4].copy_from_slice(&proto::REQUEST_MAGIC.to_be_bytes());
        h[6..8].copy_from_slice(&kind.to_be_bytes());
        h[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        h[16..24].copy_from_slice(&offset.to_be_bytes());
        h[24..28].copy_from_slice(&len.to_be_bytes());
        self.wr.write_all(&h).await?;
        self.wr.write_all(data).await?;
        Ok(self.cookie)
    }

    /// Reads one simple reply; returns its cookie.
    async fn reply(&mut self, what: &str) -> Result<u64, ClientError> {
        let mut h = [0u8; 16];
        self.rd.read_exact(&mut h).await?;
        let magic = u32::from_be_bytes(h[0..4].try_into().expect("4 bytes"));
        let code = u32::from_be_bytes(h[4..8].try_into().expect("4 bytes"));
        let cookie = u64::from_be_bytes(h[8..16].try_into().expect("8 bytes"));
        if magic != proto::SIMPLE_REPLY_MAGIC {
            return Err(ClientError::Protocol(format!("reply magic {magic:#x}")));
        }
        if code != 0 {
            return Err(ClientError::Request {
                what: what.to_string(),
                code,
            });
        }
        Ok(cookie)
    }

    /// Sends every `(offset, bytes)` (each at most [`MAX_WRITE`]) without
    /// waiting for their replies ([`Client::wait_writes`]).
    pub async fn send_writes(&mut self, writes: &[(u64, &[u8])]) -> Result<(), ClientError> {
        for (off, data) in writes {
            if data.len() > MAX_WRITE || off + data.len() as u64 > self.size {
                return Err(ClientError::Protocol(format!(
                    "a write of {} bytes at {off} does not fit the export ({} bytes)",
                    data.len(),
                    self.size
                )));
            }
            let c = self
                .send(proto::CMD_WRITE, *off, data.len() as u32, data)
                .await?;
            self.pending.insert(c);
        }
        self.wr.flush().await?;
        Ok(())
    }

    /// Waits until at most `left` writes are unanswered; a write refused fails it.
    pub async fn wait_writes(&mut self, left: usize) -> Result<(), ClientError> {
        while self.pending.len() > left {
            let c = self.reply("a write").await?;
            if !self.pending.remove(&c) {
                return Err(ClientError::Protocol(format!(
                    "a reply to cookie {c}, never sent or answered already"
                )));
            }
        }
        Ok(())
    }

    /// Writes every `(offset, bytes)`, all in flight at once, and waits
    /// for every reply.
    pub async fn write_batch(&mut self, writes: &[(u64, &[u8])]) -> Result<(), ClientError> {
        self.send_writes(writes).await?;
        self.wait_writes(0).await
    }

    /// Everything written so far is durable on the server.
    pub async fn flush(&mut self) -> Result<(), ClientError> {
        self.wait_writes(0).await?;
        let c = self.send(proto::CMD_FLUSH, 0, 0, &[]).await?;
        self.wr.flush().await?;
        match self.reply("a flush").await? {
            got if got == c => Ok(()),
            got => Err(ClientError::Protocol(format!(
                "a reply to cookie {got} where the flush was {c}"
            ))),
        }
    }

    /// Ends the session (the server answers nothing to it).
    pub async fn disconnect(mut self) -> Result<(), ClientError> {
        self.send(proto::CMD_DISC, 0, 0, &[]).await?;
        self.wr.flush().await?;
        Ok(())
    }
}

fn refusal(export: &str, code: u32, data: &[u8]) -> ClientError {
    ClientError::Refused {
        export: export.to_string(),
        code,
        message: String::from_utf8_lossy(data).into_owned(),
    }
}

async fn send_option(io: &mut Box<dyn Io>, opt: u32, data: &[u8]) -> Result<(), ClientError> {
    let mut b = Vec::with_capacity(16 + data.len());
    b.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    io.write_all(&b).await?;
    io.flush().await?;
    Ok(())
}

/// One option reply to `opt`: (reply type, data).
async fn read_option_reply(io: &mut Box<dyn Io>, opt: u32) -> Result<(u32, Vec<u8>), ClientError> {
    let mut h = [0u8; 20];
    io.read_exact(&mut h).await?;
    let magic = u64::from_be_bytes(h[0..8].try_into().expect("8 bytes"));
    let got = u32::from_be_bytes(h[8..12].try_into().expect("4 bytes"));
    let kind = u32::from_be_bytes(h[12..16].try_into().expect("4 bytes"));
    let len = u32::from_be_bytes(h[16..20].try_into().expect("4 bytes"));
    if magic != proto::OPT_REPLY_MAGIC || got != opt {
        return Err(ClientError::Protocol(format!(
            "option reply magic {magic:#x} for option {got} (asked {opt})"
        )));
    }
    if len > proto::MAX_OPTION_SKIP {
        return Err(ClientError::Protocol(format!(
            "an option reply of {len} bytes"
        )));
    }
    let mut data = vec![0u8; len as usize];
    io.read_exact(&mut data).await?;
    Ok((kind, data))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::export::Export;
    use crate::nbd::server::{Attachment, Catalog, Peer, Refusal};
    use crate::qos::{Scheduler, Ticket};

    struct One {
        export: Arc<Export>,
        sched: Arc<Scheduler>,
    }
    struct Att(Arc<Export>, Arc<Scheduler>);
    impl Attachment for Att {
        fn export(&self) -> &Arc<Export> {
            &self.0
        }
        fn request(&self, bytes: u64) -> Ticket {
            self.1.request(1, bytes)
        }
    }
    impl Catalog for One {
        fn list(&self, _: &Peer) -> Vec<String> {
            vec!["d".into()]
        }
        fn describe(&self, name: &str, _: &Peer) -> Result<(u64, bool), Refusal> {
            if name == "d" {
                Ok((self.export.size(), false))
            } else {
                Err(Refusal::Unknown(format!("no export named '{name}'")))
            }
        }
        fn attach(&self, name: &str, p: &Peer) -> Result<Box<dyn Attachment>, Refusal> {
            self.describe(name, p)?;
            Ok(Box::new(Att(self.export.clone(), self.sched.clone())))
        }
    }

    /// An 8 MiB disk `d` in `dir`, and a catalog that offers it to anyone.
    fn one_disk(dir: &std::path::Path) -> (Arc<Export>, Arc<dyn Catalog>) {
        let export = Arc::new(Export::create("d", &dir.join("d.img"), 8 << 20, false).unwrap());
        let sched = Scheduler::new(crate::qos::Config::default());
        sched.bind(1, "p", crate::qos::Params::default());
        let cat: Arc<dyn Catalog> = Arc::new(One {
            export: export.clone(),
            sched,
        });
        (export, cat)
    }

    #[tokio::test]
    async fn writes_reach_ferrys_server_and_refusals_are_named() {
        let dir = std::env::temp_dir().join(format!("ferry-nbdc-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (export, cat) = one_disk(&dir);
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(crate::nbd::server::serve(l, cat, None, Default::default()));

        let mut c = Client::connect(&format!("nbd://{addr}/d"), None)
            .await
            .unwrap();
        assert_eq!(c.size, 8 << 20);
        let a = vec![0xabu8; MAX_WRITE];
        let b = vec![0x5au8; 4096];
        c.write_batch(&[(0, &a), (5 << 20, &b)]).await.unwrap();
        c.flush().await.unwrap();
        let mut got = vec![0u8; 4096];
        export.read_at(&mut got, 5 << 20).unwrap();
        assert_eq!(got, b);
        export.read_at(&mut got, (1 << 20) - 4096).unwrap();
        assert!(got.iter().all(|x| *x == 0xab));
        // past the end: refused before it is sent, naming the sizes
        let e = c
            .write_batch(&[(8 << 20, &b)])
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not fit"), "{e}");
        c.disconnect().await.unwrap();

        let e = Client::connect(&format!("nbd://{addr}/nope"), None)
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("nope") && e.contains("refused"), "{e}");
        let e = Client::connect("nbd://127.0.0.1/d", None)
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("port"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_revoked_agent_loses_its_and_its_vms_disk_connections_at_once_and_others_go_on() {
        use ferry_net::tls::{Authority, CertRequest, Pki, Role};
        let dir = std::env::temp_dir().join(format!("ferry-nbd-crl-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ca = Authority::create(&dir.join("ca"), "test").unwrap();
        let issue = |role, name: &str| {
            let out = dir.join(name);
            let req = CertRequest {
                role,
                name: name.into(),
                san: vec!["127.0.0.1".into()],
                days: 1,
            };
            ca.issue(&req, &out).unwrap();
            Pki::load(&out).unwrap()
        };
        let storage = issue(Role::Storage, "storage1");
        let host1 = issue(Role::Agent, "host1");
        let host2 = issue(Role::Agent, "host2");
        host1.vm_credentials("web1", &dir.join("web1")).unwrap();
        let (export, cat) = one_disk(&dir);
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let uri = format!("nbd://{}/d", l.local_addr().unwrap());
        let tls = crate::nbd::server::Tls {
            acceptor: tokio_rustls::TlsAcceptor::from(storage.nbd_server_config().unwrap()),
            pki: Some(storage.clone()),
        };
        tokio::spawn(crate::nbd::server::serve(
            l,
            cat,
            Some(tls),
            Default::default(),
        ));
        let open = |cfg| Client::connect(&uri, Some(cfg));
        let vm_tls = ferry_net::tls::client_config_from_dir(&dir.join("web1")).unwrap();
        let mut vm = open(vm_tls).await.unwrap();
        let mut h1 = open(host1.client_config().unwrap()).await.unwrap();
        let mut h2 = open(host2.client_config().unwrap()).await.unwrap();
        let data = vec![0x42u8; 4096];
        for c in [&mut vm, &mut h1, &mut h2] {
            c.write_batch(&[(0, &data)]).await.unwrap();
            c.flush().await.unwrap();
        }
        // host1's certificate revoked: the node reads the new list
        let serial = ferry_api::util::unhex(&host1.serial().unwrap()).unwrap();
        let crl = ca.revocation_list(1, &[serial]).unwrap();
        storage.install_crl(&crl).unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        // host1's connection and its VM's, idle, were ended without waiting
        // for a request (which would have been refused with EPERM)
        for (who, c) in [("web1", &mut vm), ("host1", &mut h1)] {
            match c.flush().await {
                Err(ClientError::Io(_)) => {}
                other => panic!("{who}'s connection after the revocation: {other:?}"),
            }
        }
        // host2 goes on, on the connection it had
        h2.write_batch(&[(4096, &data)]).await.unwrap();
        h2.flush().await.unwrap();
        let mut got = vec![0u8; 4096];
        export.read_at(&mut got, 4096).unwrap();
        assert_eq!(got, data);
        // and host1 cannot come back
        let e = open(host1.client_config().unwrap()).await.err().unwrap();
        assert!(e.to_string().contains("CertificateRevoked"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
