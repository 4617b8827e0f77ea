//! A transport session: the streams of one migration carried over every
//! carrier between two agents (see [`crate::protocol`] for the wire format).
//!
//! ```text
//!  QEMU ─unix─▶ stream reader ─▶ dispatch queue ─▶ carrier writer (nic1) ═TCP═▶ carrier reader ─▶ reorder ─▶ stream writer ─unix─▶ QEMU
//!                                 (shared, FIFO;  ─▶ carrier writer (nic2) ═TCP═▶     (per stream, by offset)
//!                                  resends first)
//! ```
//! Scheduling is pull-based: each carrier's writer takes the next frame when
//! its socket has accepted the last one and its in-flight bytes are under
//! [`CARRIER_INFLIGHT`], so every carrier carries in proportion to what it
//! drains now — no static stream-to-NIC map. Every reliable frame waits in its
//! carrier's unacked queue until acknowledged; the replay budget
//! ([`REPLAY_LIMIT`]) bounds queued plus unacked bytes, which is what pushes
//! back on QEMU. A carrier silent for [`DEAD_AFTER`] (or failing a read,
//! write or checksum) is closed and its unacked frames go back to the front of
//! the queue for the others. The source re-dials dead carriers every 250 ms.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpSocket, TcpStream, UnixListener, UnixStream};
use tokio::sync::{mpsc, Notify, Semaphore};

use crate::compress::Packed;
use crate::protocol::*;
use crate::seal::{Direction, Opener, Sealer};

/// Bytes queued or unacknowledged per session, in KiB permits. Small on
/// purpose: what QEMU counts as sent should be close to what has arrived, so
/// its switch-over planning (and its downtime figure) stay true.
pub const REPLAY_LIMIT: usize = 4 << 10;
/// Unacknowledged bytes one carrier may have in flight.
pub const CARRIER_INFLIGHT: usize = 4 << 20;
/// Bytes one stream may have waiting for its local reader before the session fails.
pub const STREAM_BUFFER_LIMIT: usize = 512 << 20;
/// Bytes one stream may hold out of order (arrived ahead of a gap, or before
/// its local end connects) before the session fails. A sender keeping to
/// [`REPLAY_LIMIT`] never has more than that unacknowledged, so this only
/// stops a peer that sends far ahead of what it was acknowledged.
pub const REORDER_LIMIT: u64 = 64 << 20;
/// The smallest reorder window that works: twice what a sender may have
/// unacknowledged ([`REPLAY_LIMIT`] KiB).
pub const MIN_REORDER_WINDOW: u64 = (2 * REPLAY_LIMIT as u64) << 10;
const REDIAL: Duration = Duration::from_millis(250);
/// How long a carrier's dial waits for the peer's SYN-ACK. A SYN sent while
/// the link was down is lost, and the kernel would resend it only after 1 s;
/// dialling again sooner lets a returning link carry within about half a
/// second (a migration fabric's round trip is far shorter).
const CONNECT_WITHIN: Duration = Duration::from_millis(400);
/// Frames waiting for a carrier from which the link counts as the bottleneck.
const LINK_BOUND_QUEUE: usize = 2;
/// A frame payload with at least this much still to arrive is read with
/// `SO_RCVLOWAT` set to what remains, so the reader wakes once for it rather
/// than once for every few segments a shaped link delivers.
const LOWAT_FROM: usize = 16 << 10;
/// Data frames per ACK a busy receiver sends (cumulative ACKs: one covers
/// them all). Well below what a carrier may have in flight
/// ([`CARRIER_INFLIGHT`] ÷ [`MAX_PAYLOAD`] = 16 frames).
const ACK_EVERY: u64 = 4;
/// How long an idle carrier writer sleeps between looks at its ACKs and
/// heartbeat when nothing wakes it.
const WRITER_TICK: Duration = Duration::from_millis(20);
/// Target, windows agreed: WINDOW frames count what QEMU has read (written,
/// less what is unread in its socket), and no event says when it reads; so
/// while bytes wait unread and no write wakes the carriers' writers, they
/// look again this often.
const LOADING_LOOK: Duration = Duration::from_millis(1);
/// The most one stream byte may stand for ([`Session::set_expansion`]).
pub const MAX_EXPANSION: f64 = 64.0;
/// The fewest bytes a windowed stream's read asks for.
const MIN_READ: usize = 4 << 10;

/// Writes all of `a` then all of `b`, gathered into as few writes as the
/// socket takes.
async fn write_two(
    w: &mut tokio::net::tcp::OwnedWriteHalf,
    a: &[u8],
    b: &[u8],
) -> std::io::Result<()> {
    let mut done = 0;
    while done < a.len() + b.len() {
        let n = if done < a.len() {
            let parts = [std::io::IoSlice::new(&a[done..]), std::io::IoSlice::new(b)];
            w.write_vectored(&parts).await?
        } else {
            w.write(&b[done - a.len()..]).await?
        };
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        done += n;
    }
    Ok(())
}

/// Writes all of `b` to a local connection shared with other tasks.
async fn write_shared(u: &UnixStream, mut b: &[u8]) -> std::io::Result<()> {
    while !b.is_empty() {
        u.writable().await?;
        match u.try_write(b) {
            Ok(n) => b = &b[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads what a local connection shared with other tasks has (0: it ended).
async fn read_shared(u: &UnixStream, buf: &mut BytesMut) -> std::io::Result<usize> {
    loop {
        u.readable().await?;
        match u.try_read_buf(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            r => return r,
        }
    }
}

/// Sets `SO_RCVLOWAT` on a TCP or MPTCP socket: it reads as ready only once `bytes`
/// are queued (or the peer closed, or the receive window filled).
pub(crate) fn set_rcvlowat(fd: std::os::fd::RawFd, bytes: usize) -> bool {
    set_int(fd, libc::SOL_SOCKET, libc::SO_RCVLOWAT, bytes)
}

/// Unsent bytes a carrier's socket may hold beyond what is in flight
/// (`TCP_NOTSENT_LOWAT`). Autotuning grows a send buffer to megabytes; at
/// the end of a migration every byte queued there is blackout the guest
/// sees after QEMU has called its copy done, so the queue stays with the
/// agent (which writes as soon as the socket takes more) and the kernel
/// keeps only what keeps the link busy.
pub const NOTSENT_LOWAT: usize = 128 << 10;

pub fn set_notsent_lowat(fd: std::os::fd::RawFd, bytes: usize) -> bool {
    set_int(fd, libc::IPPROTO_TCP, libc::TCP_NOTSENT_LOWAT, bytes)
}

fn set_int(fd: std::os::fd::RawFd, level: libc::c_int, opt: libc::c_int, v: usize) -> bool {
    let v = v.min(i32::MAX as usize) as libc::c_int;
    // SAFETY: `fd` is an open socket owned by the caller; `v` lives for the call.
    unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            &v as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        ) == 0
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("I/O on {what}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("Carrier {index} ({nic}) handshake failed")]
    Handshake {
        index: u8,
        nic: String,
        #[source]
        source: ProtocolError,
    },
}

pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> TransportError {
    let what = what.into();
    move |source| TransportError::Io { what, source }
}

/// One carrier as the session reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CarrierStats {
    pub index: u8,
    pub nic: String,
    pub up: bool,
    /// Payload bytes sent (first sends and resends).
    pub tx_bytes: u64,
    pub rx_bytes: u64,
    /// Frames this carrier had in flight when it died, resent elsewhere.
    pub frames_requeued: u64,
    pub connects: u64,
    pub failures: u64,
    /// Why the current connection attempt fails (cleared once connected).
    pub last_error: Option<String>,
    /// Why the carrier last went down.
    pub last_failure: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionStats {
    pub carriers: Vec<CarrierStats>,
    pub healthy: usize,
    pub frames_sent: u64,
    pub frames_resent: u64,
    pub streams: usize,
    /// What this side's compressor did with the DATA it sent.
    #[serde(default)]
    pub compression: crate::compress::CompressionStats,
    /// `mptcp` kind: times a NIC's subflows were re-added (its peer asked to
    /// announce its address again).
    #[serde(default)]
    pub rejoins: u64,
}

struct OutFrame {
    kind: Kind,
    stream: u16,
    id: u64,
    offset: u64,
    /// The payload as sent (compressed or not).
    data: Packed,
    permits: u32,
}

struct CarrierState {
    /// Bumped per connection; tasks of an older connection stop on mismatch.
    generation: u64,
    up: bool,
    unacked: VecDeque<OutFrame>,
    inflight: usize,
    /// Reliable frames received on the current connection.
    received: u64,
    /// Reliable frames the peer acknowledged on the current connection.
    acked_count: u64,
    stats: CarrierStats,
    kill: Arc<Notify>,
}

struct StreamIn {
    next: u64,
    pending: BTreeMap<u64, Bytes>,
    /// Bytes in `pending`.
    held: u64,
    fin: Option<u64>,
    /// The local writer, once the local end is connected.
    to_local: Option<mpsc::UnboundedSender<Option<Bytes>>>,
    /// The local connection itself: with nothing queued for the writer,
    /// in-order bytes are written straight to it by the carrier's reader.
    local: Option<Arc<UnixStream>>,
    /// Bytes queued for the local writer and not yet written.
    buffered: Arc<AtomicU64>,
    /// Bytes the local reader has taken (written to it), for WINDOW frames.
    taken: Arc<AtomicU64>,
}

impl StreamIn {
    /// Bytes in the local connection its reader has not read yet (the
    /// kernel's count, which includes each buffer's overhead: never less).
    fn unread(&self) -> u64 {
        self.local.as_ref().map_or(0, |u| {
            let mut n: libc::c_int = 0;
            // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one int; `u` owns the fd
            let r = unsafe {
                libc::ioctl(
                    std::os::fd::AsRawFd::as_raw_fd(&**u),
                    libc::TIOCOUTQ,
                    &mut n,
                )
            };
            if r == 0 {
                n.max(0) as u64
            } else {
                0
            }
        })
    }

    fn new() -> StreamIn {
        StreamIn {
            next: 0,
            pending: BTreeMap::new(),
            held: 0,
            fin: None,
            to_local: None,
            local: None,
            buffered: Arc::new(AtomicU64::new(0)),
            taken: Arc::new(AtomicU64::new(0)),
        }
    }
}

struct Inner {
    session: [u8; 16],
    secret: Vec<u8>,
    /// Hello nonces this (target) session has accepted: a replay is refused.
    nonces: Nonces,
    /// Carriers seal every frame (the cluster's `encryption`).
    sealed: bool,
    /// Target: where streams are connected to (QEMU's incoming socket).
    connect_to: Option<PathBuf>,
    queue: Mutex<VecDeque<OutFrame>>,
    queued: Notify,
    replay: Semaphore,
    next_id: AtomicU64,
    carriers: Mutex<BTreeMap<u8, CarrierState>>,
    streams_in: Mutex<HashMap<u16, StreamIn>>,
    next_stream: Mutex<u16>,
    frames_sent: AtomicU64,
    frames_resent: AtomicU64,
    closed: tokio::sync::watch::Sender<bool>,
    failure: Mutex<Option<String>>,
    compressor: crate::compress::Compressor,
    /// Stream windows agreed (protocol.rs, "Stream windows"): the target
    /// sends WINDOW frames, the source keeps within them.
    windows: AtomicBool,
    /// Source: what one stream byte stands for once loaded (f64 bits).
    expansion: AtomicU64,
    /// Source: each stream's window, counted expanded ([`STREAM_WINDOW`]
    /// until the agent narrows it for the end of a migration).
    stream_window: AtomicU64,
    /// Source: each stream's bytes the target's local reader has taken.
    taken: Mutex<HashMap<u16, u64>>,
    /// Source: each stream's bytes read from its local end (QEMU), with
    /// windows agreed: the marks [`Session::loaded`] compares with `taken`.
    read: Mutex<HashMap<u16, u64>>,
    /// Source: bytes for the local ends (QEMU's return path) held, not
    /// written, while true ([`Session::hold_local_writes`]).
    hold: tokio::sync::watch::Sender<bool>,
    window_moved: Notify,
    /// Target: the send buffer of the connections to QEMU (0: the system's).
    local_sndbuf: AtomicUsize,
    /// Bytes one stream may hold out of order before the session fails.
    reorder_window: AtomicU64,
    /// Carriers dropped and connected again, in order.
    changes: Mutex<Vec<ferry_api::types::PathChange>>,
}

/// One end of a transport session. Dropping it (or [`Session::close`]) ends
/// every task of the session.
#[derive(Clone)]
pub struct Session {
    inner: Arc<Inner>,
}

/// A listener on one of the migration ports (where traffic classes
/// recognize live migration), starting the search at a random port.
async fn bind_migration_port(addr: std::net::IpAddr) -> std::io::Result<TcpListener> {
    let mut last = None;
    for p in ferry_api::bandwidth::migration_ports(rand::random()) {
        match TcpListener::bind((addr, p)).await {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::from(std::io::ErrorKind::AddrInUse)))
}

/// What a session authenticates (and, sealed, encrypts) its carriers with.
#[derive(Clone, Copy)]
pub struct Keys<'a> {
    /// The move's own session key (see `protocol`, "Handshake").
    pub secret: &'a [u8],
    /// Seal every frame (the cluster's `encryption`).
    pub sealed: bool,
}

/// A sealed connection's keys: what this side sends, what it receives.
type Seal = (Sealer, Opener);

/// An ACK or PING carrying this side's spare CPU, sealed on a sealed connection.
fn control_frame(sealer: &mut Option<Sealer>, kind: Kind, id: u64, spare: u64, buf: &mut BytesMut) {
    buf.clear();
    let h = Header::new(kind, 0, id, spare);
    match sealer {
        Some(s) => s.frame(&h, &[], buf),
        None => encode_frame(&h, &[], buf),
    }
}

pub(crate) use ferry_api::util::lock;

impl Session {
    fn new(session: [u8; 16], keys: &Keys, connect_to: Option<PathBuf>) -> Session {
        let (closed, _) = tokio::sync::watch::channel(false);
        Session {
            inner: Arc::new(Inner {
                session,
                secret: keys.secret.to_vec(),
                nonces: Nonces::default(),
                sealed: keys.sealed,
                connect_to,
                queue: Mutex::new(VecDeque::new()),
                queued: Notify::new(),
                replay: Semaphore::new(REPLAY_LIMIT),
                next_id: AtomicU64::new(1),
                carriers: Mutex::new(BTreeMap::new()),
                streams_in: Mutex::new(HashMap::new()),
                next_stream: Mutex::new(0),
                frames_sent: AtomicU64::new(0),
                frames_resent: AtomicU64::new(0),
                closed,
                failure: Mutex::new(None),
                compressor: Default::default(),
                windows: AtomicBool::new(false),
                expansion: AtomicU64::new(1f64.to_bits()),
                stream_window: AtomicU64::new(STREAM_WINDOW),
                taken: Mutex::new(HashMap::new()),
                read: Mutex::new(HashMap::new()),
                hold: tokio::sync::watch::channel(false).0,
                window_moved: Notify::new(),
                local_sndbuf: AtomicUsize::new(0),
                reorder_window: AtomicU64::new(REORDER_LIMIT),
                changes: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Source side: accept QEMU's migration connections on `listen` (a unix
    /// socket path) and carry them over carriers from each `(nic, local
    /// address)` to the matching target address.
    pub async fn source(
        session: [u8; 16],
        keys: &Keys<'_>,
        listen: PathBuf,
        carriers: Vec<(String, std::net::IpAddr, SocketAddr)>,
    ) -> Result<Session, TransportError> {
        let s = Session::new(session, keys, None);
        let me = s.clone();
        crate::relay::run(async move { me.start_source(listen, carriers) })
            .await
            .map_err(io("the relays' runtime"))??;
        Ok(s)
    }

    /// The source's tasks: QEMU's connections accepted on `listen`, a
    /// carrier dialled per `(nic, local, remote)`.
    fn start_source(
        &self,
        listen: PathBuf,
        carriers: Vec<(String, std::net::IpAddr, SocketAddr)>,
    ) -> Result<(), TransportError> {
        let _ = std::fs::remove_file(&listen);
        let ul = UnixListener::bind(&listen).map_err(io(listen.display().to_string()))?;
        for (i, (nic, local, remote)) in carriers.into_iter().enumerate() {
            let index = i as u8;
            self.register_carrier(index, &nic);
            let me = self.clone();
            tokio::spawn(async move { me.dial_loop(index, nic, local, remote).await });
        }
        let me = self.clone();
        tokio::spawn(async move {
            let mut closed = me.inner.closed.subscribe();
            loop {
                tokio::select! {
                    r = ul.accept() => match r {
                        Ok((u, _)) => me.open_local_stream(u),
                        Err(e) => { me.fail(format!("accepting QEMU connections: {e}")); break; }
                    },
                    _ = closed.changed() => break,
                }
            }
        });
        Ok(())
    }

    /// Target side: listen on each NIC address; streams the source opens are
    /// connected to `connect_to` (QEMU's incoming unix socket). Returns the
    /// session and the bound `(nic, address)` per listener.
    pub async fn target(
        session: [u8; 16],
        keys: &Keys<'_>,
        nics: Vec<(String, std::net::IpAddr)>,
        connect_to: PathBuf,
    ) -> Result<(Session, Vec<(String, SocketAddr)>), TransportError> {
        let s = Session::new(session, keys, Some(connect_to));
        let me = s.clone();
        let bound = crate::relay::run(async move { me.start_target(nics).await })
            .await
            .map_err(io("the relays' runtime"))??;
        Ok((s, bound))
    }

    /// The target's tasks: a listener per `(nic, address)`, each accepting
    /// carriers. Returns the bound `(nic, address)` per listener.
    async fn start_target(
        &self,
        nics: Vec<(String, std::net::IpAddr)>,
    ) -> Result<Vec<(String, SocketAddr)>, TransportError> {
        let mut bound = Vec::new();
        for (nic, addr) in nics {
            let l = bind_migration_port(addr)
                .await
                .map_err(io(format!("listening on {nic} {addr}")))?;
            bound.push((nic.clone(), l.local_addr().map_err(io(nic.clone()))?));
            let me = self.clone();
            tokio::spawn(async move {
                let mut closed = me.inner.closed.subscribe();
                loop {
                    tokio::select! {
                        r = l.accept() => if let Ok((tcp, peer)) = r {
                            let me2 = me.clone();
                            let nic = nic.clone();
                            tokio::spawn(async move {
                                if let Err(e) = me2.accept_carrier(tcp, &nic).await {
                                    tracing::warn!(%peer, %nic, error = %e, "carrier refused");
                                }
                            });
                        },
                        _ = closed.changed() => break,
                    }
                }
            });
        }
        Ok(bound)
    }

    /// Every carrier frame is sealed (encrypted and authenticated).
    pub fn sealed(&self) -> bool {
        self.inner.sealed
    }

    /// Stream windows (protocol.rs, "Stream windows"), agreed by both agents
    /// before the carriers connect: the target reports what its local reader
    /// takes, the source keeps what it has read and the target has not taken
    /// under [`STREAM_WINDOW`] per stream.
    pub fn set_windows(&self, on: bool) {
        self.inner.windows.store(on, Ordering::Relaxed);
    }

    /// Source: each stream's window from now on, counted expanded (at
    /// least [`MIN_STREAM_WINDOW`], at most [`STREAM_WINDOW`]). What a
    /// window holds when the source QEMU completes is still to load on the
    /// target while the guest is paused: the agent narrows it for the last
    /// pass, when the link no longer needs the depth.
    pub fn set_stream_window(&self, bytes: u64) {
        self.inner.stream_window.store(
            bytes.clamp(MIN_STREAM_WINDOW, STREAM_WINDOW),
            Ordering::Relaxed,
        );
        self.inner.window_moved.notify_waiters();
    }

    /// Source: each stream byte stands for `x` bytes once the target has
    /// loaded it (QEMU compressed its pages `x`×); windows count bytes so
    /// expanded. Clamped to 1..=[`MAX_EXPANSION`].
    pub fn set_expansion(&self, x: f64) {
        let x = if x.is_finite() {
            x.clamp(1.0, MAX_EXPANSION)
        } else {
            1.0
        };
        self.inner.expansion.store(x.to_bits(), Ordering::Relaxed);
    }

    /// Bytes one stream may hold out of order before the session fails
    /// (the agent's `reorder_window`; default [`REORDER_LIMIT`], never
    /// below [`MIN_REORDER_WINDOW`]).
    pub fn set_reorder_window(&self, bytes: u64) {
        self.inner
            .reorder_window
            .store(bytes.max(MIN_REORDER_WINDOW), Ordering::Relaxed);
    }

    /// Target: the streams' connections to QEMU get a send buffer of `bytes`
    /// (the kernel doubles it): what waits there counts as taken.
    pub fn set_local_send_buffer(&self, bytes: usize) {
        self.inner.local_sndbuf.store(bytes, Ordering::Relaxed);
    }

    /// Source: holds (`true`) or lets go (`false`) the bytes the target
    /// sends back to the local ends: they wait in the session, in order,
    /// and are written once let go. QEMU's return path carries the
    /// switch-over's acknowledgement: held, the source QEMU keeps copying
    /// (the guest running) until the agent lets it switch over.
    pub fn hold_local_writes(&self, on: bool) {
        self.inner.hold.send_replace(on);
    }

    /// Where each stream's reading from its local end stands now (windows
    /// agreed): marks for [`Session::loaded`].
    pub fn read_marks(&self) -> HashMap<u16, u64> {
        lock(&self.inner.read).clone()
    }

    /// Waits until the target's local readers have taken every stream up to
    /// `marks` (what its WINDOW frames report: bytes QEMU has read), or
    /// until `deadline`; whether they have.
    pub async fn loaded(&self, marks: &HashMap<u16, u64>, deadline: Instant) -> bool {
        loop {
            let moved = self.inner.window_moved.notified();
            let done = {
                let t = lock(&self.inner.taken);
                marks
                    .iter()
                    .all(|(id, m)| t.get(id).copied().unwrap_or(0) >= *m)
            };
            if done {
                return true;
            }
            tokio::select! {
                _ = moved => {}
                _ = tokio::time::sleep_until(deadline.into()) => return false,
            }
        }
    }

    /// Source: waits until stream `id`, `read` bytes read from its local
    /// end, has room in its window; returns how many bytes to read next.
    /// The target's streams back to the source (QEMU's return path) have no
    /// window: nothing reports what the source's QEMU took of them.
    async fn window_room(&self, id: u16, read: u64) -> usize {
        if !self.inner.windows.load(Ordering::Relaxed) || self.inner.connect_to.is_some() {
            return MAX_PAYLOAD;
        }
        loop {
            let moved = self.inner.window_moved.notified();
            let taken = lock(&self.inner.taken).get(&id).copied().unwrap_or(0);
            let x = f64::from_bits(self.inner.expansion.load(Ordering::Relaxed));
            let window = self.inner.stream_window.load(Ordering::Relaxed) as f64;
            let out = read.saturating_sub(taken) as f64 * x;
            let room = ((window - out).max(0.0) / x) as usize;
            // a quarter of the window free (or a whole frame's worth): reads
            // stay large, not a few KiB each time the target takes a few
            let enough = ((window / 4.0 / x) as usize).clamp(MIN_READ, MAX_PAYLOAD);
            if room >= enough {
                return room.min(MAX_PAYLOAD);
            }
            moved.await;
        }
    }

    /// Source: a WINDOW frame.
    fn window(&self, stream: u16, taken: u64) {
        let mut t = lock(&self.inner.taken);
        let e = t.entry(stream).or_insert(0);
        if taken > *e {
            *e = taken;
            drop(t);
            self.inner.window_moved.notify_waiters();
        }
    }

    /// How this side compresses the DATA it sends (off by default).
    pub fn set_compression(&self, mode: crate::compress::Mode) {
        self.inner.compressor.set_mode(mode);
    }

    /// Ends every task of the session and shuts its local connections, so
    /// that a QEMU waiting on one (an NBD request, a migration stream) sees
    /// it end at once rather than waiting on a path that is gone.
    pub fn close(&self) {
        let _ = self.inner.closed.send(true);
        for c in lock(&self.inner.carriers).values() {
            c.kill.notify_waiters();
        }
        for st in lock(&self.inner.streams_in).values() {
            if let Some(u) = &st.local {
                let _ = socket2::SockRef::from(&**u).shutdown(std::net::Shutdown::Both);
            }
        }
    }

    /// Frames not yet acknowledged by the peer: queued for a carrier, or
    /// sent and unacknowledged. Zero once everything sent has arrived.
    pub fn undelivered(&self) -> usize {
        let queued = lock(&self.inner.queue).len();
        let unacked: usize = lock(&self.inner.carriers)
            .values()
            .map(|c| c.unacked.len())
            .sum();
        queued + unacked
    }

    /// Why the session failed, if it did (a stream over its buffer limit, …).
    pub fn failure(&self) -> Option<String> {
        lock(&self.inner.failure).clone()
    }

    fn fail(&self, why: String) {
        tracing::error!(reason = %why, "transport session failed");
        lock(&self.inner.failure).get_or_insert(why);
        self.close();
    }

    pub fn stats(&self) -> SessionStats {
        let carriers: Vec<CarrierStats> = lock(&self.inner.carriers)
            .values()
            .map(|c| c.stats.clone())
            .collect();
        SessionStats {
            healthy: carriers.iter().filter(|c| c.up).count(),
            carriers,
            frames_sent: self.inner.frames_sent.load(Ordering::Relaxed),
            frames_resent: self.inner.frames_resent.load(Ordering::Relaxed),
            streams: lock(&self.inner.streams_in).len(),
            compression: self.inner.compressor.stats(),
            rejoins: 0,
        }
    }

    fn register_carrier(&self, index: u8, nic: &str) {
        lock(&self.inner.carriers).insert(
            index,
            CarrierState {
                generation: 0,
                up: false,
                unacked: VecDeque::new(),
                inflight: 0,
                received: 0,
                acked_count: 0,
                stats: CarrierStats {
                    index,
                    nic: nic.into(),
                    ..Default::default()
                },
                kill: Arc::new(Notify::new()),
            },
        );
    }

    // ---- carriers ----

    async fn dial_loop(self, index: u8, nic: String, local: std::net::IpAddr, remote: SocketAddr) {
        let mut closed = self.inner.closed.subscribe();
        loop {
            if *closed.borrow() {
                return;
            }
            let up = lock(&self.inner.carriers).get(&index).is_some_and(|c| c.up);
            if !up {
                match self.dial(index, &nic, local, remote).await {
                    Ok((tcp, seal)) => self.attach(index, tcp, seal),
                    Err(e) => {
                        if let Some(c) = lock(&self.inner.carriers).get_mut(&index) {
                            c.stats.last_error = Some(error_text(&e));
                        }
                        if let TransportError::Handshake {
                            source: ProtocolError::Refused(_) | ProtocolError::BadCredential,
                            ..
                        } = e
                        {
                            self.fail(error_text(&e));
                            return;
                        }
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(REDIAL) => {}
                _ = closed.changed() => return,
            }
        }
    }

    async fn dial(
        &self,
        index: u8,
        nic: &str,
        local: std::net::IpAddr,
        remote: SocketAddr,
    ) -> Result<(TcpStream, Option<Seal>), TransportError> {
        let what = format!("carrier {index} ({nic}) to {remote}");
        let sock = TcpSocket::new_v4().map_err(io(&what))?;
        sock.bind(SocketAddr::new(local, 0)).map_err(io(&what))?;
        let mut tcp = tokio::time::timeout(CONNECT_WITHIN, sock.connect(remote))
            .await
            .map_err(|_| TransportError::Io {
                what: what.clone(),
                source: std::io::ErrorKind::TimedOut.into(),
            })?
            .map_err(io(&what))?;
        let _ = tcp.set_nodelay(true);
        set_notsent_lowat(std::os::fd::AsRawFd::as_raw_fd(&tcp), NOTSENT_LOWAT);
        let nonce: [u8; 16] = rand::random();
        let hello = Hello {
            role: ROLE_CARRIER,
            carrier: index,
            session: self.inner.session,
            nonce,
            sealed: self.inner.sealed,
        };
        let mut welcome = [0u8; WELCOME_LEN];
        let said = hello.encode(&self.inner.secret);
        let exchange = async {
            tcp.write_all(&said).await?;
            tcp.read_exact(&mut welcome).await
        };
        tokio::time::timeout(Duration::from_secs(2), exchange)
            .await
            .map_err(|_| TransportError::Io {
                what: what.clone(),
                source: std::io::ErrorKind::TimedOut.into(),
            })?
            .map_err(io(&what))?;
        let (features, answer) =
            decode_welcome(&welcome, &nonce, &self.inner.secret).map_err(|source| {
                TransportError::Handshake {
                    index,
                    nic: nic.into(),
                    source,
                }
            })?;
        // the Confirm goes ahead of the first frame, in the same flight
        tcp.write_all(&confirm(&self.inner.secret, &said, &welcome))
            .await
            .map_err(io(&what))?;
        self.inner.compressor.set_peer_features(features);
        let seal = self.inner.sealed.then(|| {
            let secret = &self.inner.secret;
            (
                {
                    let s = Sealer::new(secret, &hello, &answer, Direction::SourceToTarget);
                    if features & FEATURE_SEALED_UNCHECKED != 0 {
                        s.without_crc()
                    } else {
                        s
                    }
                },
                Opener::new(secret, &hello, &answer, Direction::TargetToSource),
            )
        });
        Ok((tcp, seal))
    }

    async fn accept_carrier(&self, mut tcp: TcpStream, nic: &str) -> Result<(), TransportError> {
        let _ = tcp.set_nodelay(true);
        set_notsent_lowat(std::os::fd::AsRawFd::as_raw_fd(&tcp), NOTSENT_LOWAT);
        let mut b = [0u8; HELLO_LEN];
        tokio::time::timeout(Duration::from_secs(2), tcp.read_exact(&mut b))
            .await
            .map_err(|_| TransportError::Io {
                what: format!("hello on {nic}"),
                source: std::io::ErrorKind::TimedOut.into(),
            })?
            .map_err(io(format!("hello on {nic}")))?;
        let target_nonce: [u8; 16] = rand::random();
        let answer = |status: u8, nonce: [u8; 16]| {
            encode_welcome(
                status,
                FEATURE_ZSTD | FEATURE_SEALED_UNCHECKED,
                &nonce,
                &target_nonce,
                &self.inner.secret,
            )
        };
        let refused = |index: u8, source: ProtocolError| TransportError::Handshake {
            index,
            nic: nic.into(),
            source,
        };
        let hello = match Hello::decode(&b, &self.inner.secret) {
            Ok(h) if h.session != self.inner.session => {
                let _ = tcp
                    .write_all(&answer(STATUS_UNKNOWN_SESSION, h.nonce))
                    .await;
                return Err(refused(
                    h.carrier,
                    ProtocolError::Refused("unknown session"),
                ));
            }
            Ok(h) if h.role != ROLE_CARRIER => {
                let _ = tcp.write_all(&answer(STATUS_BAD_VERSION, h.nonce)).await;
                return Err(refused(h.carrier, ProtocolError::BadRole(h.role)));
            }
            Ok(h) if h.sealed != self.inner.sealed => {
                let _ = tcp.write_all(&answer(STATUS_SEALING, h.nonce)).await;
                return Err(refused(
                    h.carrier,
                    ProtocolError::Refused("carrier encryption differs between the two agents"),
                ));
            }
            Ok(h) if !self.inner.nonces.first_use(&h.nonce) => {
                let _ = tcp.write_all(&answer(STATUS_REPLAYED, h.nonce)).await;
                return Err(refused(h.carrier, ProtocolError::Replayed));
            }
            Ok(h) => h,
            Err((e, status)) => {
                let _ = tcp.write_all(&answer(status, [0; 16])).await;
                return Err(refused(b[11], e));
            }
        };
        let welcome = answer(STATUS_OK, hello.nonce);
        let mut confirmed = [0u8; CONFIRM_LEN];
        let exchange = async {
            tcp.write_all(&welcome).await?;
            tcp.read_exact(&mut confirmed).await
        };
        tokio::time::timeout(Duration::from_secs(2), exchange)
            .await
            .map_err(|_| TransportError::Io {
                what: format!("confirm on {nic}"),
                source: std::io::ErrorKind::TimedOut.into(),
            })?
            .map_err(io(format!("confirm on {nic}")))?;
        check_confirm(&self.inner.secret, &b, &welcome, &confirmed)
            .map_err(|e| refused(hello.carrier, e))?;
        if !lock(&self.inner.carriers).contains_key(&hello.carrier) {
            self.register_carrier(hello.carrier, nic);
        }
        // a re-dialled carrier replaces its dead (or dying) predecessor
        self.drop_carrier(hello.carrier, None, "replaced by a new connection".into());
        let seal = self.inner.sealed.then(|| {
            let secret = &self.inner.secret;
            (
                Sealer::new(secret, &hello, &target_nonce, Direction::TargetToSource),
                Opener::new(secret, &hello, &target_nonce, Direction::SourceToTarget),
            )
        });
        self.attach(hello.carrier, tcp, seal);
        Ok(())
    }

    /// Starts the reader and writer of a fresh carrier connection.
    fn attach(&self, index: u8, tcp: TcpStream, seal: Option<Seal>) {
        let (generation, kill) = {
            let mut cs = lock(&self.inner.carriers);
            let Some(c) = cs.get_mut(&index) else { return };
            c.generation += 1;
            c.up = true;
            c.received = 0;
            c.acked_count = 0;
            c.stats.up = true;
            c.stats.connects += 1;
            if c.stats.connects > 1 {
                self.path_change(&c.stats.nic, "re-added", "carrier connected again".into());
            }
            c.stats.last_error = None;
            c.kill = Arc::new(Notify::new());
            (c.generation, c.kill.clone())
        };
        tracing::info!(carrier = index, "carrier up");
        let (r, w) = tcp.into_split();
        let (sealer, opener) = match seal {
            Some((s, o)) => (Some(s), Some(o)),
            None => (None, None),
        };
        let me = self.clone();
        let k = kill.clone();
        tokio::spawn(async move {
            let why = tokio::select! {
                e = me.read_carrier(index, generation, r, opener) => e,
                _ = k.notified() => "closed".into(),
            };
            me.drop_carrier(index, Some(generation), why);
        });
        let me = self.clone();
        tokio::spawn(async move {
            let why = tokio::select! {
                e = me.write_carrier(index, generation, w, sealer) => e,
                _ = kill.notified() => "closed".into(),
            };
            me.drop_carrier(index, Some(generation), why);
        });
        self.inner.queued.notify_waiters();
    }

    fn path_change(&self, nic: &str, action: &str, reason: String) {
        lock(&self.inner.changes).push(ferry_api::types::PathChange {
            at_unix_ms: ferry_api::util::now_ms(),
            nic: nic.to_string(),
            action: action.into(),
            reason,
            side: if self.inner.connect_to.is_some() {
                "target"
            } else {
                "source"
            }
            .into(),
        });
    }

    /// Carriers dropped and connected again so far, oldest first.
    pub fn path_changes(&self) -> Vec<ferry_api::types::PathChange> {
        lock(&self.inner.changes).clone()
    }

    /// Marks a carrier dead and puts its unacknowledged frames back at the
    /// front of the queue, oldest first.
    fn drop_carrier(&self, index: u8, generation: Option<u64>, why: String) {
        let mut cs = lock(&self.inner.carriers);
        let Some(c) = cs.get_mut(&index) else { return };
        if generation.is_some_and(|g| g != c.generation) || !c.up {
            return;
        }
        c.up = false;
        c.stats.up = false;
        c.stats.failures += 1;
        c.stats.last_failure = Some(why.clone());
        // a session ending closes its carriers: not a path lost
        if !*self.inner.closed.borrow() && why != "closed" {
            self.path_change(&c.stats.nic, "removed", why.clone());
        }
        c.kill.notify_waiters();
        let frames: Vec<OutFrame> = c.unacked.drain(..).collect();
        c.inflight = 0;
        c.stats.frames_requeued += frames.len() as u64;
        let n = frames.len();
        drop(cs);
        if n > 0 {
            let mut q = lock(&self.inner.queue);
            for f in frames.into_iter().rev() {
                q.push_front(f);
            }
            self.inner
                .frames_resent
                .fetch_add(n as u64, Ordering::Relaxed);
        }
        tracing::warn!(carrier = index, reason = %why, requeued = n, "carrier down");
        self.inner.queued.notify_waiters();
    }

    fn current(&self, index: u8, generation: u64) -> bool {
        lock(&self.inner.carriers)
            .get(&index)
            .is_some_and(|c| c.up && c.generation == generation)
    }

    async fn write_carrier(
        &self,
        index: u8,
        generation: u64,
        mut w: tokio::net::tcp::OwnedWriteHalf,
        mut sealer: Option<Sealer>,
    ) -> String {
        let mut acked_sent = 0u64;
        // target, windows agreed: each stream's count as this carrier last sent it
        let mut windows_sent: HashMap<u16, u64> = HashMap::new();
        // target, windows agreed: bytes wait unread in a QEMU socket
        let mut loading = false;
        let mut ping = 0u64;
        let mut last_tx = Instant::now();
        let mut buf = BytesMut::with_capacity(HEADER_LEN * 2);
        loop {
            // registered before looking for work: a frame queued, an ACK or a
            // WINDOW due while this writer looks wakes it (`notify_waiters`
            // wakes only futures that exist), rather than its tick ~20 ms on
            // while the link idles
            let wake = self.inner.queued.notified();
            if !self.current(index, generation) {
                return "superseded".into();
            }
            // ACK what arrived on this connection
            let received = lock(&self.inner.carriers)
                .get(&index)
                .map(|c| c.received)
                .unwrap_or(0);
            if received != acked_sent {
                buf.clear();
                control_frame(
                    &mut sealer,
                    Kind::Ack,
                    received,
                    self.inner.compressor.spare(),
                    &mut buf,
                );
                if let Err(e) = w.write_all(&buf).await {
                    return format!("write: {e}");
                }
                acked_sent = received;
                last_tx = Instant::now();
            }
            if self.inner.connect_to.is_some() && self.inner.windows.load(Ordering::Relaxed) {
                loading = false;
                let moved: Vec<(u16, u64)> = lock(&self.inner.streams_in)
                    .iter()
                    .map(|(id, st)| {
                        let unread = st.unread();
                        // a writer with bytes queued wakes this one as it
                        // writes; an idle one's bytes are read unannounced
                        loading |= unread > 0 && st.buffered.load(Ordering::Acquire) == 0;
                        (*id, st.taken.load(Ordering::Acquire).saturating_sub(unread))
                    })
                    .filter(|(id, t)| windows_sent.get(id).is_none_or(|s| t > s))
                    .collect();
                for (stream, taken) in moved {
                    buf.clear();
                    let h = Header::new(Kind::Window, stream, 0, taken);
                    match sealer.as_mut() {
                        Some(s) => s.frame(&h, &[], &mut buf),
                        None => encode_frame(&h, &[], &mut buf),
                    }
                    if let Err(e) = w.write_all(&buf).await {
                        return format!("write: {e}");
                    }
                    windows_sent.insert(stream, taken);
                    last_tx = Instant::now();
                }
            }
            // the next frame, if this carrier has room in flight
            let frame = {
                let room = lock(&self.inner.carriers)
                    .get(&index)
                    .is_some_and(|c| c.inflight < CARRIER_INFLIGHT);
                if room {
                    let mut q = lock(&self.inner.queue);
                    q.pop_front().map(|f| (f, !q.is_empty()))
                } else {
                    None
                }
            };
            match frame {
                Some((f, waiting)) => {
                    if f.kind == Kind::Data {
                        // the link's rate, as the compressor weighs it
                        self.inner
                            .compressor
                            .note_sent(f.data.payload.len(), waiting);
                    }
                    let mut h = Header::new(f.kind, f.stream, f.id, f.offset);
                    h.packing = f.data.packing;
                    h.raw_len = f.data.raw_len;
                    buf.clear();
                    // unsealed, the payload is written from where it is;
                    // sealed, it is encrypted into `buf` after the header
                    let payload = match sealer.as_mut() {
                        Some(s) => {
                            s.frame(&h, &f.data.payload, &mut buf);
                            Bytes::new()
                        }
                        None => {
                            encode_header(&h, &f.data.payload, &mut buf);
                            f.data.payload.clone()
                        }
                    };
                    let len = f.data.payload.len();
                    {
                        let mut cs = lock(&self.inner.carriers);
                        match cs.get_mut(&index) {
                            Some(c) if c.generation == generation && c.up => {
                                c.inflight += len.max(1);
                                c.stats.tx_bytes += len as u64;
                                c.unacked.push_back(f);
                            }
                            _ => {
                                drop(cs);
                                lock(&self.inner.queue).push_front(f);
                                self.inner.queued.notify_waiters();
                                return "superseded".into();
                            }
                        }
                    }
                    self.inner.frames_sent.fetch_add(1, Ordering::Relaxed);
                    // header and payload in one system call where they fit
                    if let Err(e) = write_two(&mut w, &buf, &payload).await {
                        return format!("write: {e}");
                    }
                    last_tx = Instant::now();
                }
                None => {
                    if last_tx.elapsed() >= HEARTBEAT {
                        ping += 1;
                        buf.clear();
                        control_frame(
                            &mut sealer,
                            Kind::Ping,
                            ping,
                            self.inner.compressor.spare(),
                            &mut buf,
                        );
                        if let Err(e) = w.write_all(&buf).await {
                            return format!("write: {e}");
                        }
                        last_tx = Instant::now();
                    }
                    let tick = if loading { LOADING_LOOK } else { WRITER_TICK };
                    tokio::select! {
                        _ = wake => {}
                        _ = tokio::time::sleep(tick) => {}
                    }
                }
            }
        }
    }

    async fn read_carrier(
        &self,
        index: u8,
        generation: u64,
        r: tokio::net::tcp::OwnedReadHalf,
        mut opener: Option<Opener>,
    ) -> String {
        let fd = std::os::fd::AsRawFd::as_raw_fd(r.as_ref());
        // small: what it holds beyond a header is copied once more into the payload
        let mut r = BufReader::with_capacity(4 << 10, r);
        loop {
            let mut head = [0u8; HEADER_LEN];
            match tokio::time::timeout(DEAD_AFTER, r.read_exact(&mut head)).await {
                Err(_) => return format!("silent for {} ms", DEAD_AFTER.as_millis()),
                Ok(Err(e)) => return format!("read: {e}"),
                Ok(Ok(_)) => {}
            }
            let h = match decode_header(&head) {
                Ok(h) => h,
                Err(e) => return format!("protocol: {e}"),
            };
            // filled straight from the socket, never zeroed first
            let len = h.len as usize;
            let mut payload = BytesMut::with_capacity(len);
            let read_all = async {
                // the socket's low-water mark: what is left of this payload
                // (a read may return less, so it is set again each time)
                let mut lowat = 1;
                while payload.len() < len {
                    let want = len - payload.len();
                    let from_socket = want.saturating_sub(r.buffer().len());
                    let mark = if from_socket >= LOWAT_FROM {
                        from_socket
                    } else {
                        1
                    };
                    if mark != lowat {
                        if !set_rcvlowat(fd, mark) {
                            return Err(std::io::Error::last_os_error());
                        }
                        lowat = mark;
                    }
                    if r.read_buf(&mut (&mut payload).limit(want)).await? == 0 {
                        return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
                    }
                }
                // the next header may be all that comes for a while
                if lowat != 1 && !set_rcvlowat(fd, 1) {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            };
            match tokio::time::timeout(DEAD_AFTER * 4, read_all).await {
                Err(_) => return "stalled inside a frame".into(),
                Ok(Err(e)) => return format!("read: {e}"),
                Ok(Ok(())) => {}
            }
            // a sealed connection's frames are checked by their tag, which
            // covers all the CRC does (FEATURE_SEALED_UNCHECKED)
            if opener.is_none() {
                if let Err(e) = check_crc(&head, &payload) {
                    return format!("protocol: {e}");
                }
            }
            let payload = match (opener.as_mut(), h.sealed) {
                (Some(o), _) => match o.open(&h, &head, payload) {
                    Ok(p) => p,
                    Err(e) => return format!("protocol: {e}"),
                },
                (None, true) => {
                    return format!(
                        "protocol: {}",
                        ProtocolError::SealingDiffers("sealed", "not sealed")
                    )
                }
                (None, false) => payload.freeze(),
            };
            // decompressed (and its size checked) before it is counted for the ACK
            let payload = if h.packing == Packing::Plain {
                payload
            } else {
                let t0 = crate::compress::thread_cpu_ns();
                let p = unpack_payload(&h, payload);
                self.inner
                    .compressor
                    .note_unpacked(crate::compress::thread_cpu_ns().saturating_sub(t0));
                match p {
                    Ok(p) => p,
                    Err(e) => return format!("protocol: {e}"),
                }
            };
            if !self.current(index, generation) {
                return "superseded".into();
            }
            match h.kind {
                Kind::Ping => self.inner.compressor.set_peer_spare(h.offset),
                Kind::Window if self.inner.connect_to.is_none() => self.window(h.stream, h.offset),
                Kind::Window => return "protocol: a WINDOW frame from the source".into(),
                Kind::Ack => {
                    self.inner.compressor.set_peer_spare(h.offset);
                    self.acked(index, generation, h.id)
                }
                Kind::Data | Kind::Open | Kind::Fin => {
                    let received = match lock(&self.inner.carriers).get_mut(&index) {
                        Some(c) => {
                            c.received += 1;
                            c.stats.rx_bytes += h.len as u64;
                            c.received
                        }
                        None => 0,
                    };
                    // wake the writers so this carrier's ACK goes out now:
                    // every ACK_EVERY data frames, or at once for an open or
                    // a fin (an idle writer ACKs the rest within its tick)
                    if h.kind != Kind::Data || received % ACK_EVERY == 0 {
                        self.inner.queued.notify_waiters();
                    }
                    if let Err(e) = self.received(h, payload) {
                        self.fail(e);
                        return "session failed".into();
                    }
                    // bytes written straight to the local reader: a WINDOW to send
                    if self.inner.windows.load(Ordering::Relaxed) {
                        self.inner.queued.notify_waiters();
                    }
                }
            }
        }
    }

    fn acked(&self, index: u8, generation: u64, count: u64) {
        let mut released = 0usize;
        {
            let mut cs = lock(&self.inner.carriers);
            let Some(c) = cs.get_mut(&index) else { return };
            if c.generation != generation {
                return;
            }
            // the count is cumulative per connection
            while c.acked_count < count {
                let Some(f) = c.unacked.pop_front() else {
                    break;
                };
                c.acked_count += 1;
                c.inflight = c.inflight.saturating_sub(f.data.payload.len().max(1));
                released += f.permits as usize;
            }
        }
        if released > 0 {
            self.inner.replay.add_permits(released);
        }
        self.inner.queued.notify_waiters();
    }
}

pub(crate) fn error_text(e: &TransportError) -> String {
    let mut s = e.to_string();
    let mut cur = std::error::Error::source(e);
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

// ---- streams ----

impl Session {
    /// Queues a reliable frame, waiting for replay budget first.
    async fn send_reliable(&self, kind: Kind, stream: u16, offset: u64, data: Packed) -> bool {
        // raw bytes, not bytes as sent: the budget bounds what QEMU counts
        // as sent and the target does not have yet, compressed or not
        let permits = data.raw_bytes().div_ceil(1024).max(1) as u32;
        match self.inner.replay.acquire_many(permits).await {
            Ok(p) => p.forget(),
            Err(_) => return false,
        }
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        lock(&self.inner.queue).push_back(OutFrame {
            kind,
            stream,
            id,
            offset,
            data,
            permits,
        });
        self.inner.queued.notify_waiters();
        true
    }

    /// Source: a new QEMU connection becomes a stream.
    fn open_local_stream(&self, u: UnixStream) {
        let id = {
            let mut n = lock(&self.inner.next_stream);
            if *n >= MAX_STREAMS {
                drop(n);
                self.fail(format!(
                    "QEMU opened more than {MAX_STREAMS} migration connections"
                ));
                return;
            }
            *n += 1;
            *n - 1
        };
        let me = self.clone();
        tokio::spawn(async move {
            if me
                .send_reliable(Kind::Open, id, 0, Packed::plain(Bytes::new()))
                .await
            {
                me.run_stream(id, u).await;
            }
        });
    }

    /// Carries one local connection both ways until both directions end.
    async fn run_stream(&self, id: u16, u: UnixStream) {
        let u = Arc::new(u);
        let (tx, mut rx) = mpsc::unbounded_channel::<Option<Bytes>>();
        let buffered = Arc::new(AtomicU64::new(0));
        let taken = Arc::new(AtomicU64::new(0));
        {
            let mut streams = lock(&self.inner.streams_in);
            let st = streams.entry(id).or_insert_with(StreamIn::new);
            st.to_local = Some(tx);
            st.local = Some(u.clone());
            st.buffered = buffered.clone();
            st.taken = taken.clone();
            // frames that arrived before the local end was connected
            Self::deliver_ready(st, !*self.inner.hold.borrow());
        }
        let mut closed = self.inner.closed.subscribe();
        let mut hold = self.inner.hold.subscribe();
        let writer = async {
            while let Some(item) = rx.recv().await {
                match item {
                    Some(b) => {
                        while *hold.borrow_and_update() {
                            if hold.changed().await.is_err() {
                                break;
                            }
                        }
                        if write_shared(&u, &b).await.is_err() {
                            break;
                        }
                        // counted down once written: a reader that then sees
                        // nothing queued may write the next bytes itself
                        buffered.fetch_sub(b.len() as u64, Ordering::AcqRel);
                        taken.fetch_add(b.len() as u64, Ordering::AcqRel);
                        if self.inner.windows.load(Ordering::Relaxed) {
                            // the carriers' writers send the WINDOW
                            self.inner.queued.notify_waiters();
                        }
                    }
                    None => {
                        let _ = socket2::SockRef::from(&*u).shutdown(std::net::Shutdown::Write);
                        break;
                    }
                }
            }
        };
        let reader = async {
            let mut offset = 0u64;
            loop {
                let room = self.window_room(id, offset).await;
                let mut buf = BytesMut::with_capacity(room);
                match read_shared(&u, &mut buf).await {
                    Ok(0) | Err(_) => {
                        self.send_reliable(Kind::Fin, id, offset, Packed::plain(Bytes::new()))
                            .await;
                        break;
                    }
                    Ok(n) => {
                        // the link is the bottleneck when frames wait for a carrier
                        let link_bound = lock(&self.inner.queue).len() >= LINK_BOUND_QUEUE;
                        let p = self.inner.compressor.pack(buf.freeze(), link_bound);
                        if !self.send_reliable(Kind::Data, id, offset, p).await {
                            break;
                        }
                        offset += n as u64;
                        if self.inner.windows.load(Ordering::Relaxed) {
                            lock(&self.inner.read).insert(id, offset);
                        }
                    }
                }
            }
        };
        tokio::select! {
            _ = async { tokio::join!(writer, reader) } => {}
            _ = closed.changed() => {}
        }
    }

    /// Moves a stream's in-order frames to its local writer.
    fn deliver_ready(st: &mut StreamIn, direct: bool) {
        let Some(to_local) = &st.to_local else { return };
        while let Some(mut b) = st.pending.remove(&st.next) {
            st.held -= b.len() as u64;
            st.next += b.len() as u64;
            // nothing queued (the writer idle): as much as the socket takes
            // now is written here, saving the writer task a wake-up (not
            // while held: the writer waits to be let go)
            if direct && st.buffered.load(Ordering::Acquire) == 0 {
                if let Some(Ok(n)) = st.local.as_ref().map(|u| u.try_write(&b)) {
                    st.taken.fetch_add(n as u64, Ordering::AcqRel);
                    if n == b.len() {
                        continue;
                    }
                    b = b.slice(n..);
                }
            }
            st.buffered.fetch_add(b.len() as u64, Ordering::AcqRel);
            let _ = to_local.send(Some(b));
        }
        if st.fin == Some(st.next) {
            let _ = to_local.send(None);
            st.fin = None;
        }
    }

    /// A reliable frame from a carrier.
    fn received(&self, h: Header, payload: Bytes) -> Result<(), String> {
        let mut streams = lock(&self.inner.streams_in);
        let new_stream = !streams.contains_key(&h.stream);
        if new_stream {
            // frames wait in `pending` until the local end is connected
            streams.insert(h.stream, StreamIn::new());
            if let Some(path) = self.inner.connect_to.clone() {
                let me = self.clone();
                let id = h.stream;
                tokio::spawn(async move {
                    match UnixStream::connect(&path).await {
                        Ok(u) => {
                            let size = me.inner.local_sndbuf.load(Ordering::Relaxed);
                            if size > 0 {
                                let _ = socket2::SockRef::from(&u).set_send_buffer_size(size);
                            }
                            me.run_stream(id, u).await
                        }
                        Err(e) => {
                            me.fail(format!("connecting stream {id} to {}: {e}", path.display()))
                        }
                    }
                });
            }
        }
        let Some(st) = streams.get_mut(&h.stream) else {
            return Ok(());
        };
        match h.kind {
            Kind::Data => {
                if h.offset >= st.next && !st.pending.contains_key(&h.offset) {
                    st.held += payload.len() as u64;
                    st.pending.insert(h.offset, payload);
                }
                Self::deliver_ready(st, !*self.inner.hold.borrow());
                let window = self.inner.reorder_window.load(Ordering::Relaxed);
                if st.held > window {
                    return Err(format!(
                        "stream {} holds over {} MiB out of order (offset {} while {} is awaited; reorder_window)",
                        h.stream,
                        window >> 20,
                        h.offset,
                        st.next
                    ));
                }
                if st.buffered.load(Ordering::Relaxed) as usize > STREAM_BUFFER_LIMIT {
                    return Err(format!(
                        "stream {} has over {} MiB waiting for its reader",
                        h.stream,
                        STREAM_BUFFER_LIMIT >> 20
                    ));
                }
            }
            Kind::Fin => {
                st.fin = Some(h.offset);
                Self::deliver_ready(st, !*self.inner.hold.borrow());
            }
            _ => {}
        }
        Ok(())
    }
}
