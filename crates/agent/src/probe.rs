//! Which NIC of this host reaches which NIC of a peer: measured, not read
//! from an address plan.
//!
//! Every agent answers probes on its probe port (UDP, default 7801, every
//! address). A prober sends a datagram from a socket bound to one local NIC
//! (`SO_BINDTODEVICE` and the NIC's address) to one address of the peer;
//! the responder answers naming the interface the datagram *arrived on*
//! (hosts answer for all their addresses on every NIC, so the address alone
//! would not say which wire carried it):
//!
//! ```text
//! prober    → responder: "FERRY-PROBE 1 " NONCE " " PROBER-HOST "\n"
//! responder → prober:    "FERRY-PROBE 1 " HOST " " NIC " " MAC "\n"
//!   NONCE  32 hex digits, fresh per probe
//!   NIC    the responder's interface the request arrived on (IP_PKTINFO)
//!   MAC    64 hex digits: HMAC-SHA256(cluster secret,
//!          "ferry-probe-1" NONCE " " HOST " " NIC)
//! ```
//!
//! A datagram is at most [`MAX_LINE`] bytes; anything else is ignored. A
//! probe is sent up to [`TRIES`] times, [`TRY_TIMEOUT`] apart. A pair (local
//! NIC, peer NIC) is reachable when a probe from the local NIC arrived on
//! the peer NIC and its answer's MAC proves the peer holds the cluster
//! credential. Results are cached per peer and probed again as soon as a
//! link changes on either side; past [`PROBE_TTL`] with no link changed, a
//! move uses them as they are while they are probed again behind it (a
//! probe that finds a pair unreachable waits out its [`TRIES`]); validation
//! (`POST /paths/probe`) probes afresh whatever is cached. A move that
//! must probe waits only until the answers [`cover`] both hosts; pairs that
//! never answer (across separate fabrics) are probed on behind it.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use ferry_api::{NicInfo, NicPath};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::net::UdpSocket;

pub const MAX_LINE: usize = 256;
pub const TRIES: u32 = 3;
pub const TRY_TIMEOUT: Duration = Duration::from_millis(300);
/// Probes older than this are taken again before they are used.
pub const PROBE_TTL: Duration = Duration::from_secs(30);
const VERSION: &str = "FERRY-PROBE 1";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    #[error("connect from {nic}: {why}")]
    Connect { nic: String, why: String },
    #[error("no answer to {TRIES} probes")]
    Timeout,
    #[error("malformed answer: {0}")]
    Malformed(String),
    #[error("the answer's MAC is wrong: the peer does not hold the cluster credential")]
    BadMac,
    #[error("answered by {host}, not the host probed")]
    Elsewhere { host: String },
}

fn mac(secret: &[u8], nonce: &str, host: &str, nic: &str) -> String {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
    m.update(b"ferry-probe-1");
    m.update(nonce.as_bytes());
    m.update(b" ");
    m.update(host.as_bytes());
    m.update(b" ");
    m.update(nic.as_bytes());
    m.finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:@".contains(&b))
}

/// Parses a probe request line: the nonce.
fn parse_request(line: &str) -> Option<String> {
    request_nonce(line, VERSION)
}

/// The nonce of a request line `VERSION NONCE HOST`.
fn request_nonce(line: &str, version: &str) -> Option<String> {
    let rest = line.strip_suffix('\n')?.strip_prefix(version)?;
    let mut f = rest.split(' ').skip(1);
    let (nonce, host) = (f.next()?, f.next()?);
    (f.next().is_none()
        && nonce.len() == 32
        && nonce.bytes().all(|b| b.is_ascii_hexdigit())
        && is_token(host))
    .then(|| nonce.to_string())
}

/// Parses an answer line: (host, nic, mac).
fn parse_answer(line: &str) -> Result<(String, String, String), ProbeError> {
    let bad = || ProbeError::Malformed(line.trim_end().chars().take(80).collect());
    let rest = line
        .strip_suffix('\n')
        .and_then(|l| l.strip_prefix(VERSION))
        .and_then(|l| l.strip_prefix(' '))
        .ok_or_else(bad)?;
    let f: Vec<&str> = rest.split(' ').collect();
    match f[..] {
        [host, nic, mac] if is_token(host) && is_token(nic) && mac.len() == 64 => {
            Ok((host.into(), nic.into(), mac.into()))
        }
        _ => Err(bad()),
    }
}

/// Answers probes until the process ends (a thread of its own: it reads
/// each datagram's arrival interface with `recvmsg`).
pub fn respond(
    sock: std::net::UdpSocket,
    host: String,
    secret: Vec<u8>,
    lease: impl Fn() -> ferry_api::ha::LeaseState,
) {
    use std::os::fd::AsRawFd;
    let fd = sock.as_raw_fd();
    let on: libc::c_int = 1;
    // SAFETY: a live UDP socket; the option value is an int of the size given.
    unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_IP,
            libc::IP_PKTINFO,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
    loop {
        let Some((line, from, ifindex)) = recv_with_ifindex(fd) else {
            continue;
        };
        if let Some(nonce) = alive::parse_request(&line) {
            let v = lease();
            let answer = alive::answer(&secret, &nonce, &host, &v);
            let _ = sock.send_to(answer.as_bytes(), from);
            continue;
        }
        let Some(nonce) = parse_request(&line) else {
            continue;
        };
        let Some(nic) = if_name(ifindex) else {
            continue;
        };
        let answer = format!(
            "{VERSION} {host} {nic} {}\n",
            mac(&secret, &nonce, &host, &nic)
        );
        let _ = sock.send_to(answer.as_bytes(), from);
    }
}

/// Liveness probes: is a host's agent alive, and what of its HA lease?
///
/// ```text
/// prober    → responder: "FERRY-ALIVE 1 " NONCE " " PROBER-HOST "\n"
/// responder → prober:    "FERRY-ALIVE 1 " HOST " " STATE " " SINCE " " MAC "\n"
///   STATE  leased | unleased | fenced (see crate::lease)
///   SINCE  milliseconds since its lease was last renewed, or "-"
///   MAC    64 hex digits: HMAC-SHA256(cluster secret,
///          "ferry-alive-1" NONCE " " HOST " " STATE " " SINCE)
/// ```
///
/// Sent on the same port as path probes, from a connected socket: a host
/// whose kernel answers "port unreachable" is up with its agent down.
pub mod alive {
    use super::*;

    const ALIVE: &str = "FERRY-ALIVE 1";

    /// What a probe of one address found.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Heard {
        Agent {
            state: String,
            since_ms: Option<u64>,
        },
        AgentDown,
        Silent,
    }

    fn mac(secret: &[u8], nonce: &str, host: &str, state: &str, since: &str) -> String {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        m.update(b"ferry-alive-1");
        for (i, part) in [nonce, host, state, since].iter().enumerate() {
            if i > 0 {
                m.update(b" ");
            }
            m.update(part.as_bytes());
        }
        ferry_api::util::hex(&m.finalize().into_bytes())
    }

    pub fn parse_request(line: &str) -> Option<String> {
        request_nonce(line, ALIVE)
    }

    pub fn answer(secret: &[u8], nonce: &str, host: &str, v: &ferry_api::ha::LeaseState) -> String {
        let since = v
            .since_renewal_ms
            .map(|s| s.to_string())
            .unwrap_or_else(|| "-".into());
        let m = mac(secret, nonce, host, &v.state, &since);
        format!("{ALIVE} {host} {} {since} {m}\n", v.state)
    }

    /// Parses and checks an answer for `nonce` from `peer`.
    pub fn check_answer(
        secret: &[u8],
        nonce: &str,
        peer: &str,
        line: &str,
    ) -> Result<Heard, ProbeError> {
        let bad = || ProbeError::Malformed(line.trim_end().chars().take(80).collect());
        let rest = line
            .strip_suffix('\n')
            .and_then(|l| l.strip_prefix(ALIVE))
            .and_then(|l| l.strip_prefix(' '))
            .ok_or_else(bad)?;
        let f: Vec<&str> = rest.split(' ').collect();
        let [host, state, since, got] = f[..] else {
            return Err(bad());
        };
        if !is_token(host)
            || !["leased", "unleased", "fenced"].contains(&state)
            || (since != "-" && since.parse::<u64>().is_err())
        {
            return Err(bad());
        }
        if got != mac(secret, nonce, host, state, since) {
            return Err(ProbeError::BadMac);
        }
        if host != peer {
            return Err(ProbeError::Elsewhere { host: host.into() });
        }
        Ok(Heard::Agent {
            state: state.into(),
            since_ms: since.parse().ok(),
        })
    }

    /// Probes `peer`'s agent at `addr` ([`TRIES`] times, [`TRY_TIMEOUT`] apart).
    pub async fn probe(me: &str, secret: &[u8], peer: &str, addr: SocketAddr) -> Heard {
        let Ok(sock) = UdpSocket::bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0)).await
        else {
            return Heard::Silent;
        };
        if sock.connect(addr).await.is_err() {
            return Heard::Silent;
        }
        let nonce = ferry_api::util::hex(&rand::random::<[u8; 16]>());
        let request = format!("{ALIVE} {nonce} {me}\n");
        let mut buf = [0u8; MAX_LINE];
        let mut refused = false;
        for _ in 0..TRIES {
            if let Err(e) = sock.send(request.as_bytes()).await {
                refused |= e.kind() == std::io::ErrorKind::ConnectionRefused;
                tokio::time::sleep(TRY_TIMEOUT).await;
                continue;
            }
            let deadline = tokio::time::Instant::now() + TRY_TIMEOUT;
            while let Ok(r) = tokio::time::timeout_at(deadline, sock.recv(&mut buf)).await {
                match r {
                    Ok(n) => {
                        let Ok(line) = std::str::from_utf8(&buf[..n]) else {
                            continue;
                        };
                        if let Ok(h) = check_answer(secret, &nonce, peer, line) {
                            return h;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                        refused = true;
                        break;
                    }
                    Err(_) => break,
                }
            }
        }
        if refused {
            Heard::AgentDown
        } else {
            Heard::Silent
        }
    }

    /// Probes every address at once: an agent's answer wins, then a
    /// refusal (the host is up), else silence.
    pub async fn probe_any(
        me: &str,
        secret: &[u8],
        peer: &str,
        addrs: &[SocketAddr],
    ) -> (Heard, Option<SocketAddr>) {
        let all =
            futures::future::join_all(addrs.iter().map(|a| probe(me, secret, peer, *a))).await;
        let mut best = (Heard::Silent, None);
        for (h, a) in all.into_iter().zip(addrs) {
            match (&h, &best.0) {
                (Heard::Agent { .. }, Heard::Agent { .. }) => {}
                (Heard::Agent { .. }, _) | (Heard::AgentDown, Heard::Silent) => {
                    best = (h, Some(*a))
                }
                _ => {}
            }
        }
        best
    }
}

/// One datagram: its text, its sender and the interface it arrived on.
fn recv_with_ifindex(fd: std::os::fd::RawFd) -> Option<(String, SocketAddr, u32)> {
    let mut buf = [0u8; MAX_LINE];
    // room for one in_pktinfo control message, u64-aligned
    let mut control = [0u64; 16];
    // SAFETY: zeroed plain C structs.
    let mut from: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: zeroed plain C struct, filled in below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = (&mut from as *mut libc::sockaddr_in).cast();
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: every pointer in `msg` points to a live buffer of the length given.
    let n = unsafe { libc::recvmsg(fd, &mut msg, 0) };
    if n <= 0 || msg.msg_flags & libc::MSG_TRUNC != 0 {
        return None;
    }
    let mut ifindex = None;
    // SAFETY: the CMSG macros walk the control buffer recvmsg filled, within msg_controllen.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::IPPROTO_IP && (*c).cmsg_type == libc::IP_PKTINFO {
                let info = libc::CMSG_DATA(c) as *const libc::in_pktinfo;
                ifindex = Some(std::ptr::read_unaligned(info).ipi_ifindex as u32);
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    let text = String::from_utf8(buf[..n as usize].to_vec()).ok()?;
    let ip = Ipv4Addr::from(u32::from_be(from.sin_addr.s_addr));
    let from = SocketAddr::new(IpAddr::V4(ip), u16::from_be(from.sin_port));
    Some((text, from, ifindex?))
}

fn if_name(index: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: the buffer holds IF_NAMESIZE bytes, as if_indextoname requires.
    let p = unsafe { libc::if_indextoname(index, buf.as_mut_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: if_indextoname wrote a NUL-terminated name into `buf`.
    Some(
        unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// Probes `peer` at `peer_addr` from local `nic` (`local`). Returns the
/// peer's NIC the probe arrived on, and the round trip.
pub async fn probe(
    me: &str,
    secret: &[u8],
    (nic, local): (&str, Ipv4Addr),
    (peer, peer_addr): (&str, SocketAddr),
) -> Result<(String, Duration), ProbeError> {
    let connect = |why: String| ProbeError::Connect {
        nic: nic.into(),
        why,
    };
    let std_sock = std::net::UdpSocket::bind(SocketAddr::new(IpAddr::V4(local), 0))
        .map_err(|e| connect(e.to_string()))?;
    bind_to_device(&std_sock, nic).map_err(|e| connect(format!("SO_BINDTODEVICE: {e}")))?;
    std_sock
        .set_nonblocking(true)
        .map_err(|e| connect(e.to_string()))?;
    let sock = UdpSocket::from_std(std_sock).map_err(|e| connect(e.to_string()))?;
    let nonce: String = rand::random::<[u8; 16]>()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let request = format!("{VERSION} {nonce} {me}\n");
    let mut buf = [0u8; MAX_LINE];
    for _ in 0..TRIES {
        let t0 = Instant::now();
        sock.send_to(request.as_bytes(), peer_addr)
            .await
            .map_err(|e| connect(e.to_string()))?;
        let deadline = tokio::time::Instant::now() + TRY_TIMEOUT;
        // answers to earlier tries, or anything else, are skipped
        while let Ok(r) = tokio::time::timeout_at(deadline, sock.recv_from(&mut buf)).await {
            let (n, from) = r.map_err(|e| connect(e.to_string()))?;
            if from != peer_addr {
                continue;
            }
            let Ok(line) = std::str::from_utf8(&buf[..n]) else {
                continue;
            };
            let (host, got_nic, got_mac) = parse_answer(line)?;
            if got_mac != mac(secret, &nonce, &host, &got_nic) {
                return Err(ProbeError::BadMac);
            }
            if host != peer {
                return Err(ProbeError::Elsewhere { host });
            }
            return Ok((got_nic, t0.elapsed()));
        }
    }
    Err(ProbeError::Timeout)
}

fn bind_to_device(sock: &impl std::os::fd::AsRawFd, nic: &str) -> std::io::Result<()> {
    let name = std::ffi::CString::new(nic)
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: the fd is a live socket; the option value is a NUL-terminated
    // interface name of the length given.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_BINDTODEVICE,
            name.as_ptr().cast(),
            name.as_bytes_with_nul().len() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// What was probed to one peer, and against which link states.
#[derive(Debug, Clone)]
pub struct PeerPaths {
    pub at: Instant,
    /// (local NIC, up) when probed: a change means probe again.
    pub local_links: Vec<(String, bool)>,
    /// The peer's NICs when probed.
    pub peer_nics: Vec<NicInfo>,
    /// The peer's probe port.
    pub port: u16,
    pub pairs: Vec<NicPath>,
}

impl PeerPaths {
    /// Taken with these local and peer NICs, their links as they are now?
    pub fn same_links(&self, local: &[NicInfo], peer: &[NicInfo]) -> bool {
        self.local_links == links(local) && peer_links(&self.peer_nics) == peer_links(peer)
    }

    /// Still good for these local and peer NICs?
    pub fn fresh(&self, local: &[NicInfo], peer: &[NicInfo]) -> bool {
        self.at.elapsed() < PROBE_TTL && self.same_links(local, peer)
    }
}

pub fn links(nics: &[NicInfo]) -> Vec<(String, bool)> {
    nics.iter().map(|n| (n.name.clone(), n.up)).collect()
}

pub fn peer_links(nics: &[NicInfo]) -> Vec<(String, String, bool)> {
    nics.iter()
        .map(|n| (n.name.clone(), n.address.clone(), n.up))
        .collect()
}

/// One probe's outcome: (local NIC, peer NIC probed, the peer NIC it
/// arrived on and the round trip, or why not).
type Outcome = (NicInfo, NicInfo, Result<(String, Duration), String>);

/// Probes every (local NIC, peer NIC address) at once. A pair (local NIC,
/// peer NIC) is reachable when a probe from the local NIC arrived on the
/// peer NIC, whichever of the peer's addresses it was sent to.
///
/// `covered` is called once, as soon as the answers so far [`cover`] both
/// hosts (every NIC up on either side is in a reachable pair), with the
/// pairs known then (the others `still being probed`): a move need not wait
/// out the tries of pairs that never answer — on two separate fabrics half
/// the pairs are such — to learn which pairs it uses. The full result is
/// returned when every probe is done.
pub async fn probe_all(
    me: &str,
    secret: &[u8],
    local: &[NicInfo],
    peer: &str,
    peer_nics: &[NicInfo],
    port: u16,
    mut covered: Option<Box<dyn FnOnce(PeerPaths) + Send>>,
) -> PeerPaths {
    use futures::StreamExt;
    let mut jobs = futures::stream::FuturesUnordered::new();
    for l in local {
        for p in peer_nics {
            let (Ok(la), Ok(pa)) = (l.address.parse::<Ipv4Addr>(), p.address.parse::<Ipv4Addr>())
            else {
                continue;
            };
            let (l, p) = (l.clone(), p.clone());
            let (me, secret, peer) = (me.to_string(), secret.to_vec(), peer.to_string());
            jobs.push(async move {
                let r = if !l.up {
                    Err("link down".to_string())
                } else {
                    probe(
                        &me,
                        &secret,
                        (&l.name, la),
                        (&peer, SocketAddr::new(IpAddr::V4(pa), port)),
                    )
                    .await
                    .map_err(|e| e.to_string())
                };
                (l, p, r)
            });
        }
    }
    let paths = |results: &[Outcome], missing: &str| PeerPaths {
        at: Instant::now(),
        local_links: links(local),
        peer_nics: peer_nics.to_vec(),
        port,
        pairs: assemble(local, peer, peer_nics, results, missing),
    };
    let mut results: Vec<Outcome> = Vec::new();
    while let Some(r) = jobs.next().await {
        results.push(r);
        if !jobs.is_empty() && covered.is_some() {
            let so_far = paths(&results, "still being probed");
            if cover(&so_far.pairs, local, peer_nics) {
                if let Some(f) = covered.take() {
                    f(so_far);
                }
            }
        }
    }
    paths(&results, "not probed")
}

/// The pairs as the outcomes so far show them; a pair with no outcome yet
/// is unreachable with the error `missing`.
fn assemble(
    local: &[NicInfo],
    peer: &str,
    peer_nics: &[NicInfo],
    results: &[Outcome],
    missing: &str,
) -> Vec<NicPath> {
    let mut pairs = Vec::new();
    for l in local {
        for p in peer_nics {
            // every probe from l that arrived on p, to whichever address
            let arrived = results
                .iter()
                .filter(|(a, _, r)| a.name == l.name && matches!(r, Ok((n, _)) if *n == p.name))
                .filter_map(|(_, _, r)| r.as_ref().ok().map(|(_, d)| d.as_micros() as u64))
                .min();
            let direct = results
                .iter()
                .find(|(a, b, _)| a.name == l.name && b.name == p.name)
                .map(|(_, _, r)| r);
            let error = match (arrived, direct) {
                (Some(_), _) => None,
                (None, Some(Ok((other, _)))) => Some(format!(
                    "probes to {} arrive on {peer}'s {other}",
                    p.address
                )),
                (None, Some(Err(e))) => Some(e.clone()),
                (None, None) => Some(missing.into()),
            };
            pairs.push(NicPath {
                nic: l.name.clone(),
                address: l.address.clone(),
                peer: peer.to_string(),
                peer_nic: p.name.clone(),
                peer_address: p.address.clone(),
                reachable: arrived.is_some(),
                rtt_us: arrived,
                error,
                age_ms: 0,
            });
        }
    }
    pairs
}

/// Do these pairs cover both hosts: every NIC up here reaches a NIC of
/// the peer, and every NIC up there is reached from one here?
pub fn cover(pairs: &[NicPath], local: &[NicInfo], peer_nics: &[NicInfo]) -> bool {
    let reached = |f: &dyn Fn(&NicPath) -> bool| pairs.iter().any(|p| p.reachable && f(p));
    local
        .iter()
        .filter(|n| n.up)
        .all(|n| reached(&|p| p.nic == n.name))
        && peer_nics
            .iter()
            .filter(|n| n.up)
            .all(|n| reached(&|p| p.peer_nic == n.name))
}

/// Probes every pair to `peer` (see [`probe_all`]) and caches the result
/// in `cache`; returns the pairs as soon as they cover both hosts (the
/// rest are probed on behind the caller, and cached when done), or when
/// every probe is done.
pub async fn refresh(
    cache: &std::sync::Arc<PathCache>,
    (me, secret): (&str, &[u8]),
    local: &[NicInfo],
    peer: &str,
    peer_nics: &[NicInfo],
    port: u16,
) -> Vec<NicPath> {
    let (tx, rx) = tokio::sync::oneshot::channel::<Vec<NicPath>>();
    let tx = std::sync::Arc::new(std::sync::Mutex::new(Some(tx)));
    let answer = move |pairs: Vec<NicPath>| {
        if let Some(tx) = ferry_api::util::lock(&tx).take() {
            let _ = tx.send(pairs);
        }
    };
    let (early_cache, early_peer, early_answer) = (cache.clone(), peer.to_string(), answer.clone());
    let covered: Box<dyn FnOnce(PeerPaths) + Send> = Box::new(move |p: PeerPaths| {
        let pairs = p.pairs.clone();
        early_cache.put(&early_peer, p);
        early_answer(pairs);
    });
    let (cache, me, secret) = (cache.clone(), me.to_string(), secret.to_vec());
    let (local, peer, peer_nics) = (local.to_vec(), peer.to_string(), peer_nics.to_vec());
    tokio::spawn(async move {
        let p = probe_all(&me, &secret, &local, &peer, &peer_nics, port, Some(covered)).await;
        let reach = p.pairs.iter().filter(|x| x.reachable).count();
        tracing::info!(
            peer,
            pairs = p.pairs.len(),
            reachable = reach,
            "NIC pairs probed"
        );
        let pairs = p.pairs.clone();
        cache.put(&peer, p);
        answer(pairs);
    });
    rx.await.unwrap_or_default()
}

/// Every peer's pairs, by peer name.
#[derive(Default)]
pub struct PathCache(std::sync::Mutex<BTreeMap<String, PeerPaths>>);

impl PathCache {
    pub fn get(&self, peer: &str) -> Option<PeerPaths> {
        ferry_api::util::lock(&self.0).get(peer).cloned()
    }

    pub fn put(&self, peer: &str, p: PeerPaths) {
        ferry_api::util::lock(&self.0).insert(peer.to_string(), p);
    }

    /// Every pair known, with its age.
    pub fn all(&self) -> Vec<NicPath> {
        ferry_api::util::lock(&self.0)
            .values()
            .flat_map(|pp| {
                let age = pp.at.elapsed().as_millis() as u64;
                pp.pairs.iter().cloned().map(move |mut p| {
                    p.age_ms = age;
                    p
                })
            })
            .collect()
    }
}

/// The pairs to use toward a peer: reachable, and the local NIC up now.
/// Each peer NIC is reached from one local NIC, spread so that two peer
/// NICs use two local NICs where they can.
pub fn usable(pairs: &[NicPath], local: &[NicInfo]) -> Vec<NicPath> {
    let up = |n: &str| local.iter().any(|l| l.name == n && l.up);
    let mut by_peer: BTreeMap<&str, Vec<&NicPath>> = BTreeMap::new();
    for p in pairs.iter().filter(|p| p.reachable && up(&p.nic)) {
        by_peer.entry(&p.peer_nic).or_default().push(p);
    }
    let mut used: Vec<String> = Vec::new();
    let mut out = Vec::new();
    for (_, cands) in by_peer {
        let pick = cands
            .iter()
            .find(|p| !used.contains(&p.nic))
            .or(cands.first())
            .copied();
        if let Some(p) = pick {
            used.push(p.nic.clone());
            out.push(p.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn request_and_answer_lines_parse_strictly() {
        let nonce = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            parse_request(&format!("FERRY-PROBE 1 {nonce} host1\n")).as_deref(),
            Some(nonce)
        );
        for bad in [
            format!("FERRY-PROBE 1 {nonce} host1"),
            format!("FERRY-PROBE 2 {nonce} host1\n"),
            format!("FERRY-PROBE 1 {nonce} host1 x\n"),
            "FERRY-PROBE 1 zz host1\n".to_string(),
            format!("FERRY-PROBE 1 {nonce} bad/name\n"),
        ] {
            assert_eq!(parse_request(&bad), None, "{bad}");
        }
        let m = mac(b"s", nonce, "host2", "eth4");
        assert_eq!(m.len(), 64);
        assert_eq!(
            parse_answer(&format!("FERRY-PROBE 1 host2 eth4 {m}\n")).unwrap(),
            ("host2".into(), "eth4".into(), m.clone())
        );
        assert!(parse_answer("FERRY-PROBE 1 host2 eth4\n").is_err());
        assert!(parse_answer(&format!("HTTP/1.1 host2 eth4 {m}\n")).is_err());
        assert_ne!(mac(b"other", nonce, "host2", "eth4"), m);
        assert_ne!(mac(b"s", nonce, "host2", "eth5"), m);
    }

    fn pair(nic: &str, peer_nic: &str, reachable: bool) -> NicPath {
        NicPath {
            nic: nic.into(),
            address: String::new(),
            peer: "p".into(),
            peer_nic: peer_nic.into(),
            peer_address: String::new(),
            reachable,
            rtt_us: None,
            error: None,
            age_ms: 0,
        }
    }

    fn nic(name: &str, up: bool) -> NicInfo {
        NicInfo {
            name: name.into(),
            fabric: 0,
            network: String::new(),
            address: String::new(),
            mtu: 1500,
            up,
            tx_bytes: 0,
            rx_bytes: 0,
        }
    }

    #[test]
    fn usable_pairs_spread_over_local_nics() {
        // two NICs on one switch: each reaches both peer NICs
        let pairs = [
            pair("a", "x", true),
            pair("a", "y", true),
            pair("b", "x", true),
            pair("b", "y", true),
        ];
        let u = usable(&pairs, &[nic("a", true), nic("b", true)]);
        let got: Vec<_> = u
            .iter()
            .map(|p| (p.nic.as_str(), p.peer_nic.as_str()))
            .collect();
        assert_eq!(got, [("a", "x"), ("b", "y")]);
        // a local NIC down, an unreachable pair: left out
        let u = usable(
            &[
                pair("a", "x", true),
                pair("b", "y", true),
                pair("c", "z", false),
            ],
            &[nic("a", false), nic("b", true), nic("c", true)],
        );
        assert_eq!(u.len(), 1);
        assert_eq!(u[0].peer_nic, "y");
    }

    #[test]
    fn pairs_cover_both_hosts_when_every_nic_up_is_in_a_reachable_pair() {
        let (local, peer) = (
            [nic("a", true), nic("b", true)],
            [nic("x", true), nic("y", true)],
        );
        // two fabrics: a–x and b–y answer; a–y and b–x never will
        let two = [pair("a", "x", true), pair("b", "y", true)];
        assert!(cover(&two, &local, &peer));
        // one answer so far: b and y not yet
        assert!(!cover(&two[..1], &local, &peer));
        // a reaches both peer NICs but b nothing: not covered
        let one_sided = [
            pair("a", "x", true),
            pair("a", "y", true),
            pair("b", "y", false),
        ];
        assert!(!cover(&one_sided, &local, &peer));
        // a NIC that is down need not be reached
        assert!(cover(
            &two[..1],
            &[nic("a", true), nic("b", false)],
            &[nic("x", true), nic("y", false)]
        ));
    }

    fn no_lease() -> ferry_api::ha::LeaseState {
        ferry_api::ha::LeaseState {
            state: "unleased".into(),
            since_renewal_ms: None,
            fenced_vms: vec![],
        }
    }

    #[tokio::test]
    async fn a_liveness_probe_tells_an_agent_from_a_bare_kernel_and_a_forgery() {
        use alive::Heard;
        let lease = || ferry_api::ha::LeaseState {
            state: "leased".into(),
            since_renewal_ms: Some(300),
            fenced_vms: vec![],
        };
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let at = sock.local_addr().unwrap();
        std::thread::spawn(move || respond(sock, "peer1".into(), b"secret".to_vec(), lease));
        match alive::probe("me", b"secret", "peer1", at).await {
            Heard::Agent { state, since_ms } => {
                assert_eq!(state, "leased");
                assert!(since_ms.unwrap() < 5_000);
            }
            h => panic!("{h:?}"),
        }
        // an answer under another secret is no answer
        assert_eq!(
            alive::probe("me", b"other", "peer1", at).await,
            Heard::Silent
        );
        // nor one from a host other than the one probed
        assert_eq!(
            alive::probe("me", b"secret", "peer2", at).await,
            Heard::Silent
        );
        // a port nobody listens on: the kernel answers, no agent does
        let free = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let closed = free.local_addr().unwrap();
        drop(free);
        assert_eq!(
            alive::probe("me", b"secret", "peer1", closed).await,
            Heard::AgentDown
        );
        // a forged line is refused by its MAC
        let line = "FERRY-ALIVE 1 peer1 fenced 10 0000000000000000000000000000000000000000000000000000000000000000\n";
        assert!(matches!(
            alive::check_answer(b"secret", "n", "peer1", line),
            Err(ProbeError::BadMac)
        ));
        assert!(alive::check_answer(b"secret", "n", "peer1", "FERRY-ALIVE 1 x\n").is_err());
    }

    #[tokio::test]
    async fn pairs_that_cover_both_hosts_are_known_before_silent_ones_time_out() {
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = sock.local_addr().unwrap().port();
        std::thread::spawn(move || respond(sock, "peer1".into(), b"secret".to_vec(), no_lease));
        // the peer's second address takes probes and never answers; its NIC is down
        let _quiet = std::net::UdpSocket::bind(("127.0.0.2", port)).unwrap();
        // the responder answers once its thread has set IP_PKTINFO: wait for that
        let at = SocketAddr::from(([127, 0, 0, 1], port));
        probe("me", b"secret", ("lo", Ipv4Addr::LOCALHOST), ("peer1", at))
            .await
            .unwrap();
        let mut lo = nic("lo", true);
        lo.address = "127.0.0.1".into();
        let mut ghost = nic("ghost", false);
        ghost.address = "127.0.0.2".into();
        let early = std::sync::Arc::new(std::sync::Mutex::new(None));
        let seen = early.clone();
        let t0 = Instant::now();
        let covered: Box<dyn FnOnce(PeerPaths) + Send> = Box::new(move |p: PeerPaths| {
            *seen.lock().unwrap() = Some((t0.elapsed(), p.pairs));
        });
        let local = [lo.clone()];
        let full = probe_all(
            "me",
            b"secret",
            &local,
            "peer1",
            &[lo, ghost],
            port,
            Some(covered),
        )
        .await;
        let took = t0.elapsed();
        let (at, pairs) = early
            .lock()
            .unwrap()
            .take()
            .expect("covered before the end");
        assert!(
            at < TRY_TIMEOUT && took >= TRY_TIMEOUT * TRIES,
            "{at:?} {took:?}"
        );
        let error = |pairs: &[NicPath], to: &str| {
            let p = pairs.iter().find(|p| p.peer_nic == to).unwrap();
            (p.reachable, p.error.clone().unwrap_or_default())
        };
        assert_eq!(error(&pairs, "lo"), (true, String::new()));
        assert_eq!(error(&pairs, "ghost"), (false, "still being probed".into()));
        assert_eq!(
            error(&full.pairs, "ghost"),
            (false, ProbeError::Timeout.to_string())
        );
    }

    #[tokio::test]
    async fn a_probe_over_loopback_proves_the_peer_and_names_its_nic() {
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = sock.local_addr().unwrap().port();
        std::thread::spawn(move || respond(sock, "peer1".into(), b"secret".to_vec(), no_lease));
        let at = SocketAddr::from(([127, 0, 0, 1], port));
        let lo = ("lo", Ipv4Addr::LOCALHOST);
        let (nic, _) = probe("me", b"secret", lo, ("peer1", at)).await.unwrap();
        assert_eq!(nic, "lo", "the arrival interface");
        assert_eq!(
            probe("me", b"wrong", lo, ("peer1", at)).await,
            Err(ProbeError::BadMac)
        );
        assert!(matches!(
            probe("me", b"secret", lo, ("peer2", at)).await,
            Err(ProbeError::Elsewhere { host }) if host == "peer1"
        ));
        // nothing answering: no answer after every try
        let quiet = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let quiet_at = quiet.local_addr().unwrap();
        assert_eq!(
            probe("me", b"secret", lo, ("peer1", quiet_at)).await,
            Err(ProbeError::Timeout)
        );
    }
}
