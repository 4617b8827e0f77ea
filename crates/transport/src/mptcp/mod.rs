//! The second carrier kind: kernel MPTCP, managed by Ferry.
//!
//! Every connection starts with the transport's Hello and Welcome (role 2,
//! *spliced stream*, see `protocol.rs`), so both agents prove they hold the
//! cluster credential before a byte of guest memory moves. The source opens
//! it from its first NIC to the target's per-session listener, which is bound
//! to every address so that subflows can join on any NIC. Then one of two
//! things happens to it ([`Deliver`]):
//!
//! - **Handed off** (option `mptcp`): QEMU's one migration stream uses the
//!   socket itself. Each agent passes its end to its QEMU (QMP `getfd`, then
//!   `migrate` / `migrate-incoming` with `fd:`) and keeps a descriptor of its
//!   own. QEMU writes into and reads from the kernel directly: no byte passes
//!   through an agent, which costs the agents nothing per GiB. The agents'
//!   descriptors serve to watch the subflows and to shut the socket, which
//!   ends QEMU's sends and reads at once, wherever they block.
//! - **Relayed** (option `mptcp-relay`): each of QEMU's connections (main
//!   channel, every multifd channel) ends at an agent's unix socket and
//!   gets its own MPTCP connection. Bytes move toward the network by
//!   splice(2) through a pipe; from the network they are copied in batches.
//!   MPTCP's send path copies into its own pages either way; what splicing
//!   saves is measured in `examples/splice_gain.rs`.
//!
//! The kernel spreads each connection over one subflow per NIC, moves a dead
//! subflow's data to the others, and checks it with TCP's checksums. It does
//! not use Ferry's frames, so there is no per-frame CRC, compression or sealing:
//! `auto` leaves this kind alone when the cluster encrypts carriers.
//!
//! What Ferry manages:
//! - **The path manager**: [`prepare_host`] sets subflow limits and a
//!   `signal` endpoint per NIC, so each side announces its other addresses.
//! - **Subflows re-added**: the in-kernel path manager tries a subflow once,
//!   when the peer announces an address. A subflow that failed because its
//!   link was down when the connection opened, or that later closed, is never
//!   tried again. The source watches each connection's subflows. When one of
//!   its NICs has its link up but carries no subflow of some connection for
//!   [`REJOIN_AFTER`], [`Spliced::due_rejoins`] names it, and the agent asks
//!   the target to announce its address on that fabric again
//!   ([`announce`]: RM_ADDR, then ADD_ADDR). The source then joins.
//! - **Stalls**: when a source's send has moved no byte for [`STALL_AFTER`]
//!   (every link dead), the session fails and shuts its sockets. QEMU's
//!   writes then end, and the migration is cancelled cleanly. A handed-off
//!   stream's sends are QEMU's: it counts as waiting while every subflow
//!   waits on an ACK ([`Subflow::stalled`]) or none is left.

mod path_manager;
pub mod paths;
mod pump;
mod sockopt;

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use socket2::Socket;

use crate::protocol::{
    check_confirm, confirm, decode_welcome, encode_welcome, Hello, ProtocolError, CONFIRM_LEN,
    HELLO_LEN, MAX_STREAMS, ROLE_SPLICED, STATUS_OK, STATUS_UNKNOWN_SESSION, WELCOME_LEN,
};
use crate::session::{io, lock, CarrierStats, SessionStats, TransportError};

use path_manager::*;
pub use path_manager::{announce, prepare_host};
use pump::*;
use sockopt::*;
pub use sockopt::{available, subflows, Subflow};

/// A NIC with its link up but no subflow of some connection this long is re-joined.
pub const REJOIN_AFTER: Duration = Duration::from_millis(500);
/// At most one rejoin request per NIC this often.
pub const REJOIN_EVERY: Duration = Duration::from_secs(2);
/// A send that moved no byte for this long fails the session.
pub const STALL_AFTER: Duration = Duration::from_secs(5);
const IPPROTO_MPTCP: i32 = 262;
const SOL_MPTCP: i32 = 284;
const MPTCP_TCPINFO: i32 = 2;
const MPTCP_SUBFLOW_ADDRS: i32 = 3;
/// `struct mptcp_subflow_data`, then entries of `size_user` bytes.
const SUBFLOW_DATA_LEN: usize = 16;
/// `struct mptcp_subflow_addrs`: two `sockaddr_storage`.
const SUBFLOW_ADDRS_LEN: usize = 256;
/// `struct tcp_info` up to and including `tcpi_bytes_acked`.
const TCP_INFO_LEN: usize = 128;
const TCP_INFO_BYTES_ACKED: usize = 120;
const TCP_INFO_UNACKED: usize = 24;
const TCP_INFO_LAST_ACK_RECV: usize = 56;
const TCP_INFO_LAST_DATA_SENT: usize = 44;
const TCP_INFO_LAST_DATA_RECV: usize = 52;
const TCP_INFO_RTT: usize = 68;
const TCP_INFO_RTO: usize = 8;
const TCP_INFO_BACKOFF: usize = 4;
/// Subflows read per connection.
const MAX_SUBFLOWS: usize = 16;
/// Bytes moved per splice call.
const CHUNK: usize = 1 << 20;

/// What arrives from the network is read once this much is queued
/// (`SO_RCVLOWAT`) or [`BATCH_WAIT_MS`] after the last read, whichever comes
/// first, instead of at every few segments a shaped link delivers; an idle
/// connection's next byte is read at once.
const BATCH: usize = 128 << 10;
const BATCH_WAIT_MS: i32 = 2;

/// Whether streams splice toward the network (else they copy through user
/// space). See [`set_splice`].
static SPLICE_TO_NET: AtomicBool = AtomicBool::new(true);

/// Sets whether every stream of this process splices toward the network (by
/// default it does). Splicing spares the agent's copy through user space,
/// but MPTCP's send path still copies what it is handed into its own pages,
/// so the saving is small. From the network, bytes are always copied: read
/// in batches (`BATCH`) into a queue the agent holds for QEMU
/// (`pump::pump_from_net`). `examples/splice_gain.rs` measures both
/// (BENCHMARKS.md).
pub fn set_splice(to_net: bool) {
    SPLICE_TO_NET.store(to_net, Ordering::Relaxed);
}

/// One QEMU connection carried by one MPTCP connection.
struct Stream {
    index: u16,
    net: Arc<TcpStream>,
    /// QEMU's unix connection the agent relays; `None` when QEMU was handed
    /// the MPTCP socket itself ([`Deliver::Handoff`]) and no byte passes here.
    local: Option<Arc<UnixStream>>,
    /// Toward the peer, from the peer.
    out: Arc<Flow>,
    back: Arc<Flow>,
    open: Arc<AtomicBool>,
}

/// What the session keeps of one subflow it has seen: bytes acknowledged at the last reading.
type SubflowKey = (u16, SocketAddr, SocketAddr);

/// What one NIC's subflows did, summed over the session's streams.
#[derive(Default, Clone, Copy)]
struct NicTotal {
    /// Bytes the peer acknowledged.
    bytes: u64,
    /// Subflows it has had, and those that closed while their stream went on.
    connects: u64,
    failures: u64,
}

type NicTotals = BTreeMap<String, NicTotal>;

/// A subflow waiting this long for an ACK with data outstanding counts as
/// down (its path may be cut further on, where this host cannot see it).
pub const SILENT_AFTER: Duration = Duration::from_secs(1);

#[derive(Default)]
struct NicWatch {
    /// When this NIC was first seen up without a subflow on some stream.
    lacking_since: Option<Instant>,
    /// Its link went down since it last carried normally.
    was_down: bool,
    last_rejoin: Option<Instant>,
    rejoins: u64,
}

/// Where a target session puts each authenticated stream.
pub enum Deliver {
    /// Connect it to QEMU's incoming unix socket at this path and relay
    /// bytes both ways (QEMU multifd: one MPTCP connection per channel).
    Relay(PathBuf),
    /// Give the socket itself to QEMU: this function passes it (QMP
    /// `getfd`, then `migrate-incoming`). One stream per session.
    Handoff(HandOver),
}

/// Passes an authenticated socket to QEMU and starts its incoming migration.
pub type HandOver = Box<dyn Fn(&TcpStream) -> Result<(), String> + Send + Sync>;

struct Inner {
    session: [u8; 16],
    secret: Vec<u8>,
    /// Hello nonces the target has accepted: a replay is refused.
    nonces: crate::protocol::Nonces,
    epoch: Instant,
    /// `(nic, address)` of this host's NICs the session may use.
    nics: Vec<(String, IpAddr)>,
    streams: Mutex<Vec<Stream>>,
    closed: AtomicBool,
    failure: Mutex<Option<String>>,
    listener: Mutex<Option<Arc<Socket>>>,
    /// Per subflow, bytes acknowledged at the last reading; per NIC, the sum of what its subflows carried.
    seen: Mutex<(HashMap<SubflowKey, u64>, NicTotals)>,
    watch: Mutex<BTreeMap<String, NicWatch>>,
    /// The path watcher's state per NIC, and the changes it made.
    paths: Mutex<paths::PathStates>,
    changes: Mutex<Vec<paths::PathChange>>,
}

/// One end of a migration carried over kernel MPTCP. Dropping every clone
/// does not stop it: call [`Spliced::close`].
#[derive(Clone)]
pub struct Spliced {
    inner: Arc<Inner>,
}

impl Spliced {
    fn new(session: [u8; 16], secret: &[u8], nics: Vec<(String, IpAddr)>) -> Spliced {
        Spliced {
            inner: Arc::new(Inner {
                session,
                secret: secret.to_vec(),
                nonces: Default::default(),
                epoch: Instant::now(),
                nics,
                streams: Mutex::new(Vec::new()),
                closed: AtomicBool::new(false),
                failure: Mutex::new(None),
                listener: Mutex::new(None),
                seen: Mutex::new((HashMap::new(), BTreeMap::new())),
                watch: Mutex::new(BTreeMap::new()),
                paths: Mutex::new(BTreeMap::new()),
                changes: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Source side: accept QEMU's connections on `listen` (a unix socket
    /// path) and carry each over its own MPTCP connection from `local` (the
    /// first NIC's address) to the target's listener `remote`. `nics` are
    /// this host's NICs the session may use (for subflow statistics and rejoins).
    pub fn source(
        session: [u8; 16],
        secret: &[u8],
        listen: PathBuf,
        local: IpAddr,
        remote: SocketAddr,
        nics: Vec<(String, IpAddr)>,
    ) -> Result<Spliced, TransportError> {
        // fail early, naming the reason, on a kernel without MPTCP
        mptcp_socket().map_err(io("an MPTCP socket"))?;
        let s = Spliced::new(session, secret, nics);
        let _ = std::fs::remove_file(&listen);
        let ul = UnixListener::bind(&listen).map_err(io(listen.display().to_string()))?;
        let me = s.clone();
        std::thread::spawn(move || {
            for (index, conn) in ul.incoming().enumerate() {
                if me.inner.closed.load(Ordering::Relaxed) {
                    break;
                }
                let u = match conn {
                    Ok(u) => u,
                    Err(e) => {
                        me.fail(format!("accepting QEMU connections: {e}"));
                        break;
                    }
                };
                let Ok(i) = u16::try_from(index) else { break };
                if i >= MAX_STREAMS {
                    me.fail(format!("QEMU opened more than {MAX_STREAMS} connections"));
                    break;
                }
                let me2 = me.clone();
                std::thread::spawn(move || match me2.dial(i, local, remote) {
                    Ok(net) => me2.start_stream(i, net, u),
                    Err(e) => me2.fail(crate::session::error_text(&e)),
                });
            }
        });
        // the unix listener's accept wakes on close: see `close`
        s.watch_stalls(Some(listen));
        s.watch_paths(true);
        Ok(s)
    }

    /// Source side, QEMU's stream handed off: opens one MPTCP connection
    /// from `local` (the first NIC's address) to the target's listener
    /// `remote` and proves the cluster credential on it. The agent then
    /// hands the socket ([`Spliced::handoff_fd`]) to QEMU, which writes its
    /// migration stream into it directly: no byte passes through the agent.
    /// The session keeps its own descriptor of the socket, to watch the
    /// subflows, re-join NICs, and shut the socket when the session fails or
    /// is closed (QEMU's sends then end at once, wherever they block).
    pub fn source_handoff(
        session: [u8; 16],
        secret: &[u8],
        local: IpAddr,
        remote: SocketAddr,
        nics: Vec<(String, IpAddr)>,
    ) -> Result<Spliced, TransportError> {
        let s = Spliced::new(session, secret, nics);
        let net = s.dial(0, local, remote)?;
        s.keep_handed_off(0, net);
        s.watch_stalls(None);
        s.watch_paths(true);
        Ok(s)
    }

    /// The socket of a handed-off session's stream, for QEMU; `None` when
    /// the session relays QEMU's connections instead.
    pub fn handoff_fd(&self) -> Option<RawFd> {
        lock(&self.inner.streams)
            .iter()
            .find(|s| s.local.is_none())
            .map(|s| s.net.as_raw_fd())
    }

    /// Checks for stalls every 100 ms until the session closes; then wakes
    /// the unix listener at `wake`, if any.
    fn watch_stalls(&self, wake: Option<PathBuf>) {
        let me = self.clone();
        std::thread::spawn(move || {
            while !me.inner.closed.load(Ordering::Relaxed) {
                me.check_stall();
                std::thread::sleep(Duration::from_millis(100));
            }
            if let Some(w) = wake {
                let _ = UnixStream::connect(&w);
            }
        });
    }

    fn dial(
        &self,
        index: u16,
        local: IpAddr,
        remote: SocketAddr,
    ) -> Result<TcpStream, TransportError> {
        let what = format!("MPTCP stream {index} to {remote}");
        let sock = mptcp_socket().map_err(io(&what))?;
        sock.bind(&SocketAddr::new(local, 0).into())
            .map_err(io(&what))?;
        sock.connect_timeout(&remote.into(), Duration::from_secs(2))
            .map_err(io(&what))?;
        let _ = sock.set_tcp_nodelay(true);
        let mut tcp: TcpStream = sock.into();
        let nonce: [u8; 16] = rand::random();
        let hello = Hello {
            role: ROLE_SPLICED,
            carrier: index as u8,
            session: self.inner.session,
            nonce,
            sealed: false,
        };
        let hs = |source| TransportError::Handshake {
            index: index as u8,
            nic: "mptcp".into(),
            source,
        };
        tcp.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(io(&what))?;
        let said = hello.encode(&self.inner.secret);
        tcp.write_all(&said).map_err(io(&what))?;
        let mut w = [0u8; WELCOME_LEN];
        tcp.read_exact(&mut w).map_err(io(&what))?;
        decode_welcome(&w, &nonce, &self.inner.secret).map_err(hs)?;
        tcp.write_all(&confirm(&self.inner.secret, &said, &w))
            .map_err(io(&what))?;
        tcp.set_read_timeout(None).map_err(io(&what))?;
        Ok(tcp)
    }

    /// Target side: listen on every address on a migration port; each
    /// authenticated stream goes where `deliver` says. Returns the session
    /// and the port.
    pub fn target(
        session: [u8; 16],
        secret: &[u8],
        nics: Vec<(String, IpAddr)>,
        deliver: Deliver,
    ) -> Result<(Spliced, u16), TransportError> {
        let deliver = Arc::new(deliver);
        let s = Spliced::new(session, secret, nics);
        let mut last = None;
        let mut bound = None;
        for p in ferry_api::bandwidth::migration_ports(rand::random()) {
            let sock = mptcp_socket().map_err(io("an MPTCP socket"))?;
            let addr = SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), p);
            match sock.bind(&addr.into()).and_then(|_| sock.listen(64)) {
                Ok(()) => {
                    bound = Some((sock, p));
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let (sock, port) = bound.ok_or_else(|| TransportError::Io {
            what: "an MPTCP listener on a migration port".into(),
            source: last.unwrap_or_else(|| std::io::ErrorKind::AddrInUse.into()),
        })?;
        let sock = Arc::new(sock);
        *lock(&s.inner.listener) = Some(sock.clone());
        s.watch_paths(false);
        // this host's own NICs: one whose link came back while a subflow
        // on it still waits is announced again from here
        let me = s.clone();
        std::thread::spawn(move || {
            while !me.inner.closed.load(Ordering::Relaxed) {
                for nic in me.rejoins_of(&me.read(), false) {
                    if let Some((_, addr)) = me.inner.nics.iter().find(|(n, _)| *n == nic) {
                        match announce(&nic, *addr) {
                            Ok(()) => tracing::info!(%nic, "address announced again for a re-join"),
                            Err(e) => tracing::warn!(%nic, error = %e, "re-announcing failed"),
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(250));
            }
        });
        let me = s.clone();
        std::thread::spawn(move || loop {
            let (conn, peer) = match sock.accept() {
                Ok(c) => c,
                Err(_) => break, // closed
            };
            if me.inner.closed.load(Ordering::Relaxed) {
                break;
            }
            let me2 = me.clone();
            let to = deliver.clone();
            std::thread::spawn(move || {
                if let Err(e) = me2.accept(conn.into(), &to) {
                    tracing::warn!(peer = ?peer.as_socket(), error = %e, "MPTCP stream refused");
                }
            });
        });
        Ok((s, port))
    }

    fn accept(&self, mut tcp: TcpStream, deliver: &Deliver) -> Result<(), String> {
        tcp.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        let mut b = [0u8; HELLO_LEN];
        tcp.read_exact(&mut b)
            .map_err(|e| format!("reading the Hello: {e}"))?;
        let refuse = |mut tcp: &TcpStream, status: u8, nonce: &[u8; 16], e: ProtocolError| {
            let _ = tcp.write_all(&encode_welcome(
                status,
                0,
                nonce,
                &[0; 16],
                &self.inner.secret,
            ));
            e.to_string()
        };
        let hello = match Hello::decode(&b, &self.inner.secret) {
            Ok(h) => h,
            Err((e, status)) => return Err(refuse(&tcp, status, &[0; 16], e)),
        };
        if hello.role != ROLE_SPLICED {
            return Err(refuse(
                &tcp,
                crate::protocol::STATUS_BAD_VERSION,
                &hello.nonce,
                ProtocolError::BadRole(hello.role),
            ));
        }
        if hello.session != self.inner.session {
            return Err(refuse(
                &tcp,
                STATUS_UNKNOWN_SESSION,
                &hello.nonce,
                ProtocolError::Refused("unknown session"),
            ));
        }
        // QEMU takes one handed-off stream: its first
        if matches!(deliver, Deliver::Handoff(_))
            && (hello.carrier != 0 || !lock(&self.inner.streams).is_empty())
        {
            return Err(refuse(
                &tcp,
                crate::protocol::STATUS_TOO_MANY,
                &hello.nonce,
                ProtocolError::Refused("a handed-off session carries one stream"),
            ));
        }
        if !self.inner.nonces.first_use(&hello.nonce) {
            return Err(refuse(
                &tcp,
                crate::protocol::STATUS_REPLAYED,
                &hello.nonce,
                ProtocolError::Replayed,
            ));
        }
        let answer: [u8; 16] = rand::random();
        let welcome = encode_welcome(STATUS_OK, 0, &hello.nonce, &answer, &self.inner.secret);
        tcp.write_all(&welcome).map_err(|e| e.to_string())?;
        // nothing reaches QEMU before the source proves the key on this connection
        let mut confirmed = [0u8; CONFIRM_LEN];
        tcp.read_exact(&mut confirmed)
            .map_err(|e| format!("reading the Confirm: {e}"))?;
        check_confirm(&self.inner.secret, &b, &welcome, &confirmed).map_err(|e| e.to_string())?;
        tcp.set_read_timeout(None).map_err(|e| e.to_string())?;
        let _ = tcp.set_nodelay(true);
        match deliver {
            Deliver::Relay(to) => {
                let u = UnixStream::connect(to)
                    .map_err(|e| format!("connecting to QEMU at {}: {e}", to.display()))?;
                self.start_stream(hello.carrier as u16, tcp, u);
            }
            Deliver::Handoff(hand) => {
                if let Err(e) = hand(&tcp) {
                    let _ = tcp.shutdown(std::net::Shutdown::Both);
                    self.fail(format!("handing the stream to QEMU: {e}"));
                    return Err(e);
                }
                self.keep_handed_off(0, tcp);
            }
        }
        Ok(())
    }

    fn start_stream(&self, index: u16, net: TcpStream, local: UnixStream) {
        let local = Arc::new(local);
        let s = Stream {
            index,
            net: Arc::new(net),
            local: Some(local.clone()),
            out: Arc::default(),
            back: Arc::default(),
            open: Arc::new(AtomicBool::new(true)),
        };
        let epoch = self.inner.epoch;
        // toward the peer: local → net; from the peer: net → local
        for toward in [true, false] {
            let me = self.clone();
            let (net, local, open) = (s.net.clone(), local.clone(), s.open.clone());
            let flow = if toward {
                s.out.clone()
            } else {
                s.back.clone()
            };
            let splice_it = SPLICE_TO_NET.load(Ordering::Relaxed);
            std::thread::spawn(move || {
                let r = if toward {
                    pump(local.as_raw_fd(), net.as_raw_fd(), &flow, epoch, splice_it)
                } else {
                    pump_from_net(net.clone(), local.as_raw_fd(), &flow, epoch, FROM_NET_QUEUE)
                };
                if let Err(e) = r {
                    if !me.inner.closed.load(Ordering::Relaxed) {
                        let dir = if toward { "sending" } else { "receiving" };
                        me.fail(format!("MPTCP stream {index}: {dir}: {e}"));
                    }
                }
                if !toward {
                    open.store(false, Ordering::Relaxed);
                    tracing::info!(
                        stream = index,
                        bytes = flow.bytes.load(Ordering::Relaxed),
                        peak_queued = flow.queued_peak.load(Ordering::Relaxed),
                        "MPTCP stream received to its end"
                    );
                }
                drop((net, local));
            });
        }
        self.push_stream(s);
    }

    /// A stream whose MPTCP socket QEMU holds: nothing to pump, only to
    /// watch (subflows, stalls) and to shut on failure.
    fn keep_handed_off(&self, index: u16, net: TcpStream) {
        self.push_stream(Stream {
            index,
            net: Arc::new(net),
            local: None,
            out: Arc::default(),
            back: Arc::default(),
            open: Arc::new(AtomicBool::new(true)),
        });
    }

    fn push_stream(&self, s: Stream) {
        // pushed before `closed` is read: a `close()` either sees this
        // stream in the list or has set `closed` for the check below
        let mut streams = lock(&self.inner.streams);
        if self.inner.closed.load(Ordering::Relaxed) {
            shut(&s);
        }
        streams.push(s);
    }

    fn check_stall(&self) {
        let now = self.inner.epoch.elapsed().as_millis() as u64 + 1;
        // a handed-off stream's sends are QEMU's: it waits while every
        // subflow waits on an ACK (or none is left)
        for s in lock(&self.inner.streams)
            .iter()
            .filter(|s| s.local.is_none())
        {
            let waiting = match subflows(s.net.as_raw_fd()) {
                Ok(sfs) => sfs.is_empty() || sfs.iter().all(Subflow::stalled),
                Err(_) => false,
            };
            let w = &s.out.waiting_since;
            if !waiting {
                w.store(0, Ordering::Relaxed);
            } else if w.load(Ordering::Relaxed) == 0 {
                w.store(now, Ordering::Relaxed);
            }
        }
        let stalled = lock(&self.inner.streams).iter().find_map(|s| {
            let w = s.out.waiting_since.load(Ordering::Relaxed);
            (w != 0 && now.saturating_sub(w) > STALL_AFTER.as_millis() as u64).then_some(s.index)
        });
        if let Some(i) = stalled {
            self.fail(format!(
                "MPTCP stream {i} moved no byte for {} s: every link is down",
                STALL_AFTER.as_secs()
            ));
        }
    }

    fn fail(&self, why: String) {
        tracing::error!(reason = %why, "MPTCP session failed");
        lock(&self.inner.failure).get_or_insert(why);
        self.close();
    }

    /// Why the session failed, if it did.
    pub fn failure(&self) -> Option<String> {
        lock(&self.inner.failure).clone()
    }

    /// Ends every stream (QEMU sees its connections close) and the listener.
    pub fn close(&self) {
        if self.inner.closed.swap(true, Ordering::Relaxed) {
            return;
        }
        for s in lock(&self.inner.streams).iter() {
            shut(s);
        }
        if let Some(l) = lock(&self.inner.listener).take() {
            let _ = l.shutdown(std::net::Shutdown::Both);
        }
    }

    /// One reading of the subflows of every open stream and of every NIC's
    /// link, for [`Spliced::stats`] and [`Spliced::due_rejoins`] alike.
    fn read(&self) -> Reading {
        let flows = self.open_flows();
        let links = self.inner.nics.iter().map(|(n, _)| link_up(n)).collect();
        Reading { flows, links }
    }

    /// [`Spliced::stats`] and every open stream's subflows described, from
    /// one reading: local → remote address, then what a silent subflow's
    /// removal reports ([`paths::silence_reason`]) and ms since its last send.
    pub fn stall_view(&self) -> (SessionStats, String) {
        let r = self.read();
        if r.flows.is_empty() {
            return (self.stats_of(&r), "no stream open".into());
        }
        let described = r
            .flows
            .iter()
            .map(|(i, sfs)| {
                let each: Vec<String> = sfs
                    .iter()
                    .map(|sf| {
                        format!(
                            "{} → {}: {}, last sent {} ms ago",
                            sf.local,
                            sf.remote,
                            paths::silence_reason(sf),
                            sf.last_sent_ms
                        )
                    })
                    .collect();
                let each = if each.is_empty() {
                    "no subflow".to_string()
                } else {
                    each.join(", ")
                };
                format!("stream {i}: {each}")
            })
            .collect::<Vec<_>>()
            .join("; ");
        (self.stats_of(&r), described)
    }

    /// The subflows of every open stream, by stream index.
    fn open_flows(&self) -> Vec<(u16, Vec<Subflow>)> {
        lock(&self.inner.streams)
            .iter()
            .filter(|s| s.open.load(Ordering::Relaxed))
            .filter_map(|s| Some((s.index, subflows(s.net.as_raw_fd()).ok()?)))
            .collect()
    }

    /// [`Spliced::stats`] and [`Spliced::due_rejoins`] from one reading:
    /// what the source's progress loop asks for every tick.
    pub fn tick(&self) -> (SessionStats, Vec<String>) {
        let r = self.read();
        (self.stats_of(&r), self.rejoins_of(&r, true))
    }

    /// Carriers as the framed kind reports them, one per NIC: `up` when its
    /// link is up and it carries a subflow of every open stream that is not
    /// stalled ([`Subflow::stalled`]); bytes the peer acknowledged on its
    /// subflows; `connects` subflows it has had.
    pub fn stats(&self) -> SessionStats {
        self.stats_of(&self.read())
    }

    fn stats_of(&self, r: &Reading) -> SessionStats {
        let flows = &r.flows;
        let mut seen = lock(&self.inner.seen);
        let (last, per_nic) = &mut *seen;
        let nic_of = |a: IpAddr| self.inner.nics.iter().find(|(_, x)| *x == a);
        let mut live: Vec<SubflowKey> = Vec::new();
        for (i, sfs) in flows {
            for sf in sfs {
                let key = (*i, sf.local, sf.remote);
                live.push(key);
                let before = last.insert(key, sf.bytes_acked);
                if let Some((nic, _)) = nic_of(sf.local.ip()) {
                    let e = per_nic.entry(nic.clone()).or_default();
                    e.bytes += sf.bytes_acked.saturating_sub(before.unwrap_or(0));
                    if before.is_none() {
                        e.connects += 1;
                    }
                }
            }
        }
        let gone: Vec<SubflowKey> = last.keys().filter(|k| !live.contains(k)).cloned().collect();
        for k in gone {
            last.remove(&k);
            // a subflow of a stream that ended closed with it, not failed
            let open = flows.iter().any(|(i, _)| *i == k.0);
            if let Some((nic, _)) = nic_of(k.1.ip()).filter(|_| open) {
                per_nic.entry(nic.clone()).or_default().failures += 1;
            }
        }
        let carriers: Vec<CarrierStats> = self
            .inner
            .nics
            .iter()
            .enumerate()
            .map(|(i, (nic, addr))| {
                let t = per_nic.get(nic).copied().unwrap_or_default();
                CarrierStats {
                    index: i as u8,
                    nic: nic.clone(),
                    // with every stream ended, a NIC that carried some is up while its link is
                    up: r.links[i]
                        && if flows.is_empty() {
                            t.connects > 0
                        } else {
                            flows.iter().all(|(_, sfs)| {
                                sfs.iter().any(|sf| sf.local.ip() == *addr && !sf.stalled())
                            })
                        },
                    tx_bytes: t.bytes,
                    connects: t.connects,
                    failures: t.failures,
                    ..Default::default()
                }
            })
            .collect();
        let streams = lock(&self.inner.streams);
        SessionStats {
            healthy: carriers.iter().filter(|c| c.up).count(),
            carriers,
            streams: streams.len(),
            rejoins: lock(&self.inner.watch).values().map(|w| w.rejoins).sum(),
            ..Default::default()
        }
    }

    /// Bytes QEMU handed to this side (toward the peer) and the peer's bytes
    /// delivered to QEMU, over every stream.
    pub fn bytes(&self) -> (u64, u64) {
        lock(&self.inner.streams).iter().fold((0, 0), |(o, b), s| {
            (
                o + s.out.bytes.load(Ordering::Relaxed),
                b + s.back.bytes.load(Ordering::Relaxed),
            )
        })
    }

    /// NICs of this host to re-join, at most once per NIC per
    /// [`REJOIN_EVERY`]: for [`REJOIN_AFTER`], its link is up and either
    /// some open stream has no subflow on it, or its link went down and came
    /// back and a subflow on it still waits on an ACK or has been quiet both
    /// ways (the sender's retransmission timer may have backed off for seconds). The address on
    /// that fabric should be announced again ([`announce`]: by the target
    /// itself, or by the target at the source's request).
    pub fn due_rejoins(&self) -> Vec<String> {
        self.rejoins_of(&self.read(), true)
    }

    /// [`Spliced::due_rejoins`] from `r`; with `missing` false, only NICs whose own
    /// link flapped (the target's keeper: a subflow its peer lacks is the
    /// peer's to ask for, and its link may be what is down).
    fn rejoins_of(&self, r: &Reading, missing: bool) -> Vec<String> {
        let flows = &r.flows;
        let now = Instant::now();
        let mut watch = lock(&self.inner.watch);
        let mut due = Vec::new();
        for ((nic, addr), &up) in self.inner.nics.iter().zip(&r.links) {
            let w = watch.entry(nic.clone()).or_default();
            w.was_down |= !up;
            let on_nic = |sfs: &Vec<Subflow>| {
                let mine: Vec<&Subflow> = sfs.iter().filter(|sf| sf.local.ip() == *addr).collect();
                (
                    mine.is_empty(),
                    mine.iter().any(|sf| sf.stalled() || sf.quiet()),
                )
            };
            let lacks = missing && flows.iter().any(|(_, sfs)| on_nic(sfs).0);
            let stalled = flows.iter().any(|(_, sfs)| on_nic(sfs).1);
            if !rejoin_wanted(up, w.was_down, lacks, stalled) {
                w.lacking_since = None;
                if up && !flows.is_empty() {
                    w.was_down = false;
                }
                continue;
            }
            let since = *w.lacking_since.get_or_insert(now);
            // the path watcher saw this link come back: no need to wait
            let at_once = missing
                && std::mem::take(
                    &mut lock(&self.inner.paths)
                        .entry(nic.clone())
                        .or_default()
                        .rejoin_now,
                );
            if at_once
                || (now - since >= REJOIN_AFTER
                    && w.last_rejoin.is_none_or(|t| now - t >= REJOIN_EVERY))
            {
                w.last_rejoin = Some(now);
                w.rejoins += 1;
                due.push(nic.clone());
            }
        }
        due
    }
}

/// Whether a NIC should be re-joined: its link is up and a stream lacks a
/// subflow on it, or its own link flapped and a subflow on it still waits.
/// A subflow stalled by a cut elsewhere is left to the host whose link it is.
fn rejoin_wanted(link_up: bool, was_down: bool, lacks: bool, stalled: bool) -> bool {
    link_up && (lacks || (was_down && stalled))
}

/// Subflows of every open stream (per stream index) and whether each NIC's
/// link is up, in `Inner::nics` order.
struct Reading {
    flows: Vec<(u16, Vec<Subflow>)>,
    links: Vec<bool>,
}

fn shut(s: &Stream) {
    // a handed-off socket is QEMU's too: shutting it ends QEMU's reads and
    // writes at once, wherever they block
    let _ = s.net.shutdown(std::net::Shutdown::Both);
    if let Some(l) = &s.local {
        let _ = l.shutdown(std::net::Shutdown::Both);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    /// These tests need a kernel with MPTCP (Linux ≥ 5.6, `net.mptcp.enabled`);
    /// they fail, naming it, where it is missing.
    fn need_mptcp() {
        if let Err(e) = mptcp_socket() {
            panic!("MPTCP tests need a kernel with MPTCP: {e}");
        }
    }

    fn secret() -> Vec<u8> {
        b"cluster credential for tests".to_vec()
    }

    /// A unix listener standing for the target QEMU: collects what arrives and echoes a reply.
    fn fake_qemu(dir: &std::path::Path) -> (PathBuf, std::sync::mpsc::Receiver<Vec<u8>>) {
        let path = dir.join("incoming.sock");
        let l = UnixListener::bind(&path).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let mut c = c.unwrap();
                let tx = tx.clone();
                std::thread::spawn(move || {
                    let mut got = Vec::new();
                    c.read_to_end(&mut got).unwrap();
                    c.write_all(b"done").unwrap();
                    tx.send(got).unwrap();
                });
            }
        });
        (path, rx)
    }

    /// A target session for session `[7; 16]` on loopback, its QEMU stand-in's receiver.
    fn loopback_target() -> (
        tempfile::TempDir,
        std::sync::mpsc::Receiver<Vec<u8>>,
        Spliced,
        IpAddr,
        u16,
    ) {
        need_mptcp();
        let dir = tempdir();
        let (qemu, rx) = fake_qemu(dir.path());
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let nics = vec![("lo".to_string(), lo)];
        let (t, port) = Spliced::target([7; 16], &secret(), nics, Deliver::Relay(qemu)).unwrap();
        (dir, rx, t, lo, port)
    }

    /// The source session of [`loopback_target`]'s session, and the socket
    /// its QEMU stand-ins connect to (in `dir`).
    fn loopback_source(dir: &std::path::Path, lo: IpAddr, port: u16) -> (Spliced, PathBuf) {
        let out = dir.join("out.sock");
        let nics = vec![("lo".to_string(), lo)];
        let s = Spliced::source(
            [7; 16],
            &secret(),
            out.clone(),
            lo,
            SocketAddr::new(lo, port),
            nics,
        )
        .unwrap();
        (s, out)
    }

    #[test]
    fn a_stall_view_names_each_open_streams_subflows() {
        let (dir, _rx, _t, lo, port) = loopback_target();
        let (s, out) = loopback_source(dir.path(), lo, port);
        assert_eq!(s.stall_view().1, "no stream open");
        let mut c = UnixStream::connect(&out).unwrap();
        c.write_all(&[5u8; 4096]).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut view = s.stall_view();
        while !view.1.contains(" → ") && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            view = s.stall_view();
        }
        let (stats, described) = view;
        assert!(
            described.starts_with("stream 0: 127.0.0.1:")
                && described.contains(&format!(" → 127.0.0.1:{port}: no ACK for "))
                && described.contains("segments outstanding")
                && described.contains("ms ago"),
            "{described}"
        );
        assert_eq!(stats.carriers.len(), 1, "{stats:?}");
        s.close();
    }

    #[test]
    fn streams_cross_intact_both_ways_over_loopback() {
        let (dir, rx, t, lo, port) = loopback_target();
        let (s, out) = loopback_source(dir.path(), lo, port);
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut threads = Vec::new();
        for k in 0..3u8 {
            let out = out.clone();
            let mut d = data.clone();
            d.push(k);
            threads.push(std::thread::spawn(move || {
                let mut c = UnixStream::connect(&out).unwrap();
                c.write_all(&d).unwrap();
                c.shutdown(std::net::Shutdown::Write).unwrap();
                let mut reply = Vec::new();
                c.read_to_end(&mut reply).unwrap();
                reply
            }));
        }
        let mut got: Vec<Vec<u8>> = (0..3)
            .map(|_| rx.recv_timeout(Duration::from_secs(20)).unwrap())
            .collect();
        got.sort_by_key(|g| *g.last().unwrap());
        for (k, g) in got.iter().enumerate() {
            assert_eq!(g.len(), data.len() + 1);
            assert_eq!(&g[..data.len()], &data[..], "stream {k} changed on the way");
            assert_eq!(g[data.len()], k as u8);
        }
        for t in threads {
            assert_eq!(t.join().unwrap(), b"done");
        }
        assert_eq!(s.bytes().0, 3 * (data.len() as u64 + 1));
        assert_eq!(s.bytes().1, 3 * 4);
        assert_eq!(s.failure(), None);
        assert_eq!(t.failure(), None);
        s.close();
        t.close();
    }

    #[test]
    fn a_wrong_credential_or_session_is_refused() {
        let (dir, rx, t, lo, port) = loopback_target();
        let nics = vec![("lo".to_string(), lo)];
        for (session, cred, why) in [
            ([7; 16], b"another credential".to_vec(), "credential"),
            ([8; 16], secret(), "session"),
        ] {
            let out = dir.path().join(format!("out-{why}.sock"));
            let s = Spliced::source(
                session,
                &cred,
                out.clone(),
                lo,
                SocketAddr::new(lo, port),
                nics.clone(),
            )
            .unwrap();
            let mut c = UnixStream::connect(&out).unwrap();
            let _ = c.write_all(b"guest memory");
            let deadline = Instant::now() + Duration::from_secs(10);
            while s.failure().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let f = s.failure().unwrap_or_default();
            assert!(f.contains("handshake"), "{why}: {f}");
            let mut rest = Vec::new();
            let _ = c.read_to_end(&mut rest);
            assert!(rest.is_empty(), "{why}");
        }
        assert!(
            rx.recv_timeout(Duration::from_millis(300)).is_err(),
            "nothing reached QEMU"
        );
        t.close();
    }

    /// A handoff target whose "QEMU" takes a duplicate of each socket it is handed.
    fn handoff_target() -> (Spliced, IpAddr, u16, std::sync::mpsc::Receiver<TcpStream>) {
        need_mptcp();
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let tx = Mutex::new(tx);
        let hand = Deliver::Handoff(Box::new(move |t: &TcpStream| {
            let dup = t.try_clone().map_err(|e| e.to_string())?;
            lock(&tx).send(dup).map_err(|e| e.to_string())
        }));
        let nics = vec![("lo".to_string(), lo)];
        let (t, port) = Spliced::target([7; 16], &secret(), nics, hand).unwrap();
        (t, lo, port, rx)
    }

    #[test]
    fn a_handed_off_stream_crosses_intact_and_close_ends_qemus_end() {
        let (t, lo, port, rx) = handoff_target();
        let nics = vec![("lo".to_string(), lo)];
        let s = Spliced::source_handoff([7; 16], &secret(), lo, SocketAddr::new(lo, port), nics)
            .unwrap();
        // "QEMU" on the source: its own descriptor of the handed socket
        let fd = s
            .handoff_fd()
            .expect("a handed-off session has a socket for QEMU");
        // SAFETY: dup of a descriptor the session keeps open.
        let mut qemu_out = unsafe { TcpStream::from_raw_fd(libc::dup(fd)) };
        let mut qemu_in = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 13 % 253) as u8).collect();
        let d = data.clone();
        let w = std::thread::spawn(move || {
            qemu_out.write_all(&d).unwrap();
            qemu_out
        });
        let mut got = vec![0u8; data.len()];
        qemu_in.read_exact(&mut got).unwrap();
        assert_eq!(got, data, "the stream changed on the way");
        // the return path: target QEMU to source QEMU
        qemu_in.write_all(b"ack").unwrap();
        let mut qemu_out = w.join().unwrap();
        let mut b = [0u8; 3];
        qemu_out.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"ack");
        // no byte passed through the agent, yet the subflows show what moved
        assert_eq!(s.bytes(), (0, 0));
        let st = s.stats();
        assert!(st.carriers[0].tx_bytes >= data.len() as u64 / 2, "{st:?}");
        assert_eq!(s.failure(), None);
        assert_eq!(t.failure(), None);
        // a second stream into a handed-off session is refused
        let extra = Spliced::source_handoff(
            [7; 16],
            &secret(),
            lo,
            SocketAddr::new(lo, port),
            vec![("lo".to_string(), lo)],
        );
        assert!(extra.is_err(), "a second stream was taken");
        // closing the session ends QEMU's own descriptor too: a blocked read returns
        s.close();
        let mut rest = Vec::new();
        qemu_out
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        assert_eq!(qemu_out.read_to_end(&mut rest).unwrap(), 0);
        t.close();
    }

    #[test]
    fn a_wrong_credential_gets_no_socket_handed_to_qemu() {
        let (t, lo, port, rx) = handoff_target();
        let nics = vec![("lo".to_string(), lo)];
        for (session, cred) in [
            ([7; 16], b"another credential".to_vec()),
            ([8; 16], secret()),
        ] {
            let r = Spliced::source_handoff(
                session,
                &cred,
                lo,
                SocketAddr::new(lo, port),
                nics.clone(),
            );
            let e = r
                .err()
                .map(|e| crate::session::error_text(&e))
                .unwrap_or_default();
            assert!(e.contains("handshake"), "{e}");
        }
        assert!(
            rx.recv_timeout(Duration::from_millis(300)).is_err(),
            "QEMU got a socket"
        );
        t.close();
    }

    #[test]
    fn subflow_option_layouts_read_from_a_live_connection() {
        need_mptcp();
        let l = mptcp_socket().unwrap();
        l.bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
            .unwrap();
        l.listen(1).unwrap();
        let addr = l.local_addr().unwrap().as_socket().unwrap();
        let c = mptcp_socket().unwrap();
        c.connect(&addr.into()).unwrap();
        let mut c: TcpStream = c.into();
        let (a, _) = l.accept().unwrap();
        let mut a: TcpStream = a.into();
        c.write_all(&[1u8; 100_000]).unwrap();
        let mut got = vec![0u8; 100_000];
        a.read_exact(&mut got).unwrap();
        // the last ACK may still be on its way (delayed ACKs)
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut sfs = subflows(c.as_raw_fd()).unwrap();
        while sfs.iter().any(|s| s.unacked > 0) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            sfs = subflows(c.as_raw_fd()).unwrap();
        }
        assert_eq!(sfs.len(), 1, "{sfs:?}");
        assert_eq!(sfs[0].remote, addr);
        assert_eq!(sfs[0].local, c.local_addr().unwrap());
        assert!(sfs[0].bytes_acked >= 100_000, "{sfs:?}");
        // everything acknowledged: nothing outstanding, so not stalled
        assert_eq!(sfs[0].unacked, 0, "{sfs:?}");
        assert!(!sfs[0].stalled(), "{sfs:?}");
    }

    #[test]
    fn a_subflow_waiting_on_an_ack_with_data_out_is_stalled() {
        let sf =
            |unacked, last_ack_ms| Subflow::sample("198.18.2.11:40000", unacked, last_ack_ms, 0);
        assert!(sf(10, 1500).stalled());
        // idle: nothing outstanding, however long ago the last ACK came
        assert!(!sf(0, 60_000).stalled());
        // data out, ACKs flowing
        assert!(!sf(40, 3).stalled());
        let quiet = Subflow {
            last_sent_ms: 1200,
            last_recv_ms: 1500,
            ..sf(0, 1500)
        };
        assert!(quiet.quiet() && !quiet.stalled());
        assert!(!Subflow {
            last_recv_ms: 10,
            ..quiet.clone()
        }
        .quiet());
    }

    #[test]
    fn rejoins_cover_missing_subflows_and_a_flapped_own_link_only() {
        // a stream lacks a subflow on a NIC that is up
        assert!(rejoin_wanted(true, false, true, false));
        // this host's link went down and came back, a subflow still waits
        assert!(rejoin_wanted(true, true, false, true));
        // stalled by a cut elsewhere: the other host's business
        assert!(!rejoin_wanted(true, false, false, true));
        // link down: nothing to join over
        assert!(!rejoin_wanted(false, true, true, true));
        // back and carrying
        assert!(!rejoin_wanted(true, true, false, false));
    }

    /// A fresh directory, removed when dropped.
    fn tempdir() -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix("ferry-mptcp-")
            .tempdir()
            .unwrap()
    }
}
