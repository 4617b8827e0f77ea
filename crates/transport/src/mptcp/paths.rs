//! Dropping a dead path at once, on both ends of an MPTCP session.
//!
//! Left alone, the kernel keeps sending into a subflow whose link is gone
//! until its retransmission timer fires and backs off (RTO ≥ 200 ms,
//! doubling), and marks it stale only after `net.mptcp.stale_loss_cnt`
//! such timeouts. A single handed-off connection suffers most: what sits
//! unacknowledged on the dead subflow is a hole the receiver must wait for,
//! so its window fills and the live subflow idles too.
//!
//! Each session runs a watcher that acts on the first sign instead:
//! - **Its own link** ([`LinkEvents`]): a netlink socket subscribed to link
//!   and IPv4 address changes wakes the watcher the moment a NIC loses its
//!   carrier or its address (sysfs is read on every wake as the state of
//!   record, and every [`WATCH_EVERY`] in any case).
//! - **Silence** (the source, which sends): a subflow with segments
//!   outstanding and no ACK for [`silent_limit`] while another subflow of
//!   the same connection is acknowledged — cut further on, where this host
//!   sees no carrier change.
//!
//! Acting means: every subflow of the session on that NIC is destroyed
//! (`SOCK_DESTROY` through `ss -K`, which the kernel answers by moving the
//! subflow's unacknowledged data to the others at once), and, for a link
//! that went down, the NIC's path-manager endpoint is deleted so that peers
//! get RM_ADDR and drop their end of it too. When the link is back the
//! endpoint is added again (ADD_ADDR); the rejoin logic of the session
//! (`due_rejoins`) has the NIC join every connection again. Each removal and
//! each re-join is a [`PathChange`] the agent reports.

use ferry_api::util::now_ms;
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

pub use ferry_api::types::PathChange;

use super::*;

/// The watcher looks at least this often, with or without a netlink wake-up.
pub const WATCH_EVERY: Duration = Duration::from_millis(20);
/// A subflow is never called silent sooner than this.
pub const SILENT_MIN: Duration = Duration::from_millis(200);

/// How long a subflow may wait on an ACK, data outstanding, before it is
/// called dead: three round trips, at least [`SILENT_MIN`], at most the
/// kernel's own first timeout (a shaped queue can hold a few ms of data;
/// a dead path returns nothing at all).
pub fn silent_limit(sf: &Subflow) -> Duration {
    let rtts = Duration::from_micros(3 * sf.rtt_us as u64);
    let rto = Duration::from_micros(sf.rto_us as u64);
    rtts.max(SILENT_MIN).min(rto.max(SILENT_MIN))
}

/// Whether `sf` is silent while `others` (the same connection's other
/// subflows) show the connection itself is alive: one of them was
/// acknowledged more recently than `sf`'s own limit, or has nothing out.
/// Silent: data outstanding, no ACK for the limit, and either nothing sent
/// for the limit either or the retransmission timer already fired unanswered
/// (its retransmissions count as sends) — a subflow that was idle and has
/// just been given data has not waited a round trip yet, however old its
/// last ACK.
pub fn silent_among(sf: &Subflow, others: &[&Subflow]) -> bool {
    let limit = silent_limit(sf).as_millis() as u32;
    // no round trip measured yet: a join still in its handshake, not a path that died
    sf.rtt_us > 0
        && sf.unacked > 0
        && sf.last_ack_ms >= limit
        && (sf.last_sent_ms >= limit || sf.backoff > 0)
        && others
            .iter()
            .any(|o| o.local.ip() != sf.local.ip() && (o.last_ack_ms < limit || o.unacked == 0))
}

/// The reason given for a silent subflow's removal.
pub fn silence_reason(sf: &Subflow) -> String {
    format!(
        "no ACK for {} ms with {} segments outstanding (rtt {} ms, rto {} ms, backoff {})",
        sf.last_ack_ms,
        sf.unacked,
        sf.rtt_us / 1000,
        sf.rto_us / 1000,
        sf.backoff
    )
}

/// One change netlink announced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetEvent {
    /// `RTM_NEWLINK`/`RTM_DELLINK`: interface `index`, whether it is running
    /// (`IFF_UP` and `IFF_LOWER_UP`).
    Link { index: u32, running: bool },
    /// `RTM_NEWADDR`/`RTM_DELADDR` of an IPv4 address.
    Addr {
        index: u32,
        addr: Ipv4Addr,
        removed: bool,
    },
}

const RTMGRP_LINK: u32 = 1;
const RTMGRP_IPV4_IFADDR: u32 = 0x10;
const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const RTM_NEWADDR: u16 = 20;
const RTM_DELADDR: u16 = 21;
const NLMSG_HDR: usize = 16;
const IFINFOMSG: usize = 16;
const IFADDRMSG: usize = 8;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
pub(super) const IFF_UP: u32 = 0x1;
const IFF_LOWER_UP: u32 = 0x10000;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

fn u16_at(b: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(off..off + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(off..off + 4)?.try_into().ok()?))
}

/// The link and address changes in one datagram of `NETLINK_ROUTE`
/// messages; anything else, or anything truncated, is skipped.
pub fn parse_messages(mut b: &[u8]) -> Vec<NetEvent> {
    let mut out = Vec::new();
    while b.len() >= NLMSG_HDR {
        let Some(len) = u32_at(b, 0).map(|l| l as usize) else {
            break;
        };
        if len < NLMSG_HDR || len > b.len() {
            break;
        }
        let kind = u16_at(b, 4).unwrap_or(0);
        let body = &b[NLMSG_HDR..len];
        match kind {
            RTM_NEWLINK | RTM_DELLINK if body.len() >= IFINFOMSG => {
                let index = u32_at(body, 4).unwrap_or(0);
                let flags = u32_at(body, 8).unwrap_or(0);
                let running =
                    kind == RTM_NEWLINK && flags & IFF_UP != 0 && flags & IFF_LOWER_UP != 0;
                out.push(NetEvent::Link { index, running });
            }
            RTM_NEWADDR | RTM_DELADDR if body.len() >= IFADDRMSG => {
                let family = body[0];
                let index = u32_at(body, 4).unwrap_or(0);
                let mut attrs = &body[IFADDRMSG..];
                let mut addr = None;
                while attrs.len() >= 4 {
                    let alen = u16_at(attrs, 0).unwrap_or(0) as usize;
                    let atype = u16_at(attrs, 2).unwrap_or(0);
                    if alen < 4 || alen > attrs.len() {
                        break;
                    }
                    if (atype == IFA_LOCAL || (atype == IFA_ADDRESS && addr.is_none())) && alen == 8
                    {
                        addr = Some(Ipv4Addr::new(attrs[4], attrs[5], attrs[6], attrs[7]));
                    }
                    attrs = &attrs[align4(alen).min(attrs.len())..];
                }
                if let (Some(addr), true) = (addr, family == libc::AF_INET as u8) {
                    out.push(NetEvent::Addr {
                        index,
                        addr,
                        removed: kind == RTM_DELADDR,
                    });
                }
            }
            _ => {}
        }
        b = &b[align4(len).min(b.len())..];
    }
    out
}

/// A `NETLINK_ROUTE` socket subscribed to link and IPv4 address changes.
pub struct LinkEvents {
    fd: OwnedFd,
}

impl LinkEvents {
    pub fn open() -> std::io::Result<LinkEvents> {
        // SAFETY: plain socket(2); the descriptor is owned at once.
        let raw = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            )
        };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: raw is a descriptor just returned to us.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sockaddr_nl is plain data; zeroed is valid.
        let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        sa.nl_family = libc::AF_NETLINK as u16;
        sa.nl_groups = RTMGRP_LINK | RTMGRP_IPV4_IFADDR;
        // SAFETY: sa is a valid sockaddr_nl of the given size.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sa as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(LinkEvents { fd })
    }

    /// What arrives within `wait` (nothing when it passes quietly).
    pub fn next(&self, wait: Duration) -> Vec<NetEvent> {
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let ready = unsafe { libc::poll(&mut pfd, 1, wait.as_millis() as i32) };
        if ready <= 0 {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        // until drained, or the kernel dropped messages (ENOBUFS): sysfs,
        // read on every wake, still has the state
        while let Ok(n @ 1..) = self.recv_now(&mut buf) {
            out.extend(parse_messages(&buf[..n]));
        }
        out
    }

    /// Whether anything arrived since the last look, without waiting: any
    /// message, or messages the kernel dropped (`ENOBUFS`); each is read.
    pub fn changed(&self) -> bool {
        let mut any = false;
        let mut buf = [0u8; 8192];
        loop {
            match self.recv_now(&mut buf) {
                Ok(0) => return any,
                Ok(_) => any = true,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return any,
                // ENOBUFS: changes were lost, so something changed
                Err(_) => any = true,
            }
        }
    }

    /// One datagram, if one is queued.
    fn recv_now(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        // SAFETY: buf is valid for its length.
        let n = unsafe {
            libc::recv(
                self.fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }
}

/// Destroys one subflow of this host, `local` → `remote`: `SOCK_DESTROY`
/// through `ss -K` on its exact addresses and ports, so that no other socket
/// of the NIC (a carrier, an NBD connection) is touched. The kernel aborts
/// it and moves what it held to the connection's other subflows.
pub fn destroy_subflow(local: SocketAddr, remote: SocketAddr) -> Result<(), String> {
    let (src, dst) = (local.to_string(), remote.to_string());
    ferry_api::util::run_command("ss", &["-K", "-t", "-H", "src", &src, "dst", &dst]).map(|_| ())
}

fn drop_subflow(nic: &str, sf: &Subflow) {
    if let Err(e) = destroy_subflow(sf.local, sf.remote) {
        // the kernel's own retransmission timer will move its data, later
        tracing::warn!(%nic, local = %sf.local, remote = %sf.remote, error = %e,
            "destroying a dead subflow failed");
    }
}

/// Deletes the path-manager endpoint of `addr`, if there is one: the kernel
/// closes the subflows from it and tells peers (RM_ADDR).
pub fn withdraw(addr: IpAddr) -> Result<(), String> {
    let a = addr.to_string();
    if let Some((id, _)) = endpoints()?.into_iter().find(|(_, x)| *x == a) {
        // gone already if another session withdrew it
        let _ = ip(&["mptcp", "endpoint", "delete", "id", &id]);
    }
    Ok(())
}

/// Per NIC, what the watcher did and saw.
#[derive(Default)]
pub(super) struct PathState {
    /// The link as last read (`None` before the first reading).
    pub up: Option<bool>,
    /// Subflows on this NIC were removed and none has been seen carrying since.
    pub removed: bool,
    /// The endpoint was withdrawn for a link down and is not back yet.
    pub withdrawn: bool,
    /// The last reading found a subflow on it.
    pub carried: bool,
    /// Its link came back: have it joined at once (the source asks the
    /// target to announce its address; a source cannot take joins).
    pub rejoin_now: bool,
}

/// Whether a NIC's link is up ([`link_up`]) and it holds its address.
pub(super) fn nic_running(nic: &str, addr: IpAddr) -> bool {
    link_up(nic) && has_address(nic, addr)
}

fn has_address(nic: &str, addr: IpAddr) -> bool {
    // SAFETY: getifaddrs fills a list we free below; we only read it.
    unsafe {
        let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut list) != 0 {
            return true; // unknown: the carrier decides
        }
        let mut found = false;
        let mut p = list;
        while !p.is_null() {
            let ifa = &*p;
            if !ifa.ifa_addr.is_null()
                && (*ifa.ifa_addr).sa_family == libc::AF_INET as u16
                && std::ffi::CStr::from_ptr(ifa.ifa_name).to_bytes() == nic.as_bytes()
            {
                let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                let a = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                if IpAddr::V4(a) == addr {
                    found = true;
                    break;
                }
            }
            p = ifa.ifa_next;
        }
        libc::freeifaddrs(list);
        found
    }
}

impl Spliced {
    /// Watches this session's NICs until it closes ([`crate::mptcp::paths`]).
    /// `source`: this side sends the migration and also judges silence.
    pub(super) fn watch_paths(&self, source: bool) {
        let me = self.clone();
        std::thread::spawn(move || {
            let events = match LinkEvents::open() {
                Ok(e) => Some(e),
                Err(e) => {
                    tracing::warn!(error = %e, "no netlink link events; NIC links polled every 20 ms");
                    None
                }
            };
            let side = if source { "source" } else { "target" };
            while !me.inner.closed.load(Ordering::Relaxed) {
                match &events {
                    Some(ev) => {
                        let _ = ev.next(WATCH_EVERY);
                    }
                    None => std::thread::sleep(WATCH_EVERY),
                }
                if me.inner.closed.load(Ordering::Relaxed) {
                    break;
                }
                me.look(source, side);
            }
            // leave the host as the session found it: endpoints withdrawn for
            // a link that is up again go back
            me.restore_endpoints(side);
        });
    }

    fn look(&self, source: bool, side: &str) {
        let flows = self.open_flows();
        let mut changes = Vec::new();
        {
            let mut paths = lock(&self.inner.paths);
            for (nic, addr) in &self.inner.nics {
                let st = paths.entry(nic.clone()).or_default();
                let running = nic_running(nic, *addr);
                let was = st.up.replace(running);
                let mine = |sf: &&Subflow| sf.local.ip() == *addr;
                let carrying = flows
                    .iter()
                    .any(|(_, sfs)| sfs.iter().filter(mine).any(|sf| !sf.stalled()));
                let any = flows.iter().any(|(_, sfs)| sfs.iter().any(|sf| mine(&sf)));
                let carried = std::mem::replace(&mut st.carried, any);
                if running && carried && !any && !st.removed && !flows.is_empty() {
                    // closed without this side acting: RM_ADDR from the peer
                    // (its NIC lost), or the kernel gave up on it
                    st.removed = true;
                    changes.push((
                        nic.clone(),
                        "removed",
                        "the subflow closed (the peer withdrew its address, or the kernel gave up on it)"
                            .to_string(),
                        now_ms(),
                    ));
                }
                if !running && was != Some(false) {
                    let why = if link_up(nic) {
                        "address removed from the NIC"
                    } else {
                        "link down (carrier lost)"
                    };
                    let mut had = false;
                    for sf in flows.iter().flat_map(|(_, sfs)| sfs.iter().filter(mine)) {
                        had = true;
                        drop_subflow(nic, sf);
                    }
                    // removed when its subflows are gone; the endpoint's
                    // withdrawal (for joins to come) is after
                    let at = now_ms();
                    if let Err(e) = withdraw(*addr) {
                        tracing::warn!(%nic, error = %e, "withdrawing the MPTCP endpoint failed");
                    }
                    st.withdrawn = true;
                    if had || was == Some(true) {
                        st.removed = true;
                        changes.push((nic.clone(), "removed", why.to_string(), at));
                    }
                    continue;
                }
                if running && was == Some(false) {
                    st.rejoin_now = true;
                }
                if running && st.withdrawn {
                    match add_endpoint(nic, *addr) {
                        Ok(()) => st.withdrawn = false,
                        Err(e) => {
                            tracing::warn!(%nic, error = %e, "adding the MPTCP endpoint back failed")
                        }
                    }
                }
                if running && st.removed && carrying {
                    st.removed = false;
                    let why = if was == Some(false) || st.withdrawn {
                        "link up again; subflow joined"
                    } else {
                        "subflow joined again"
                    };
                    changes.push((nic.clone(), "re-added", why.to_string(), now_ms()));
                }
                if !source || !running {
                    continue;
                }
                // silence: cut somewhere this host cannot see
                for (_, sfs) in &flows {
                    for sf in sfs.iter().filter(mine) {
                        let others: Vec<&Subflow> = sfs.iter().filter(|o| *o != sf).collect();
                        if silent_among(sf, &others) {
                            drop_subflow(nic, sf);
                            if !std::mem::replace(&mut st.removed, true) {
                                changes.push((
                                    nic.clone(),
                                    "removed",
                                    silence_reason(sf),
                                    now_ms(),
                                ));
                            }
                        }
                    }
                }
            }
        }
        if changes.is_empty() {
            return;
        }
        let mut log = lock(&self.inner.changes);
        for (nic, action, reason, at) in changes {
            tracing::info!(%nic, action, %reason, side, "MPTCP path");
            log.push(PathChange {
                at_unix_ms: at,
                nic,
                action: action.into(),
                reason,
                side: side.into(),
            });
        }
    }

    fn restore_endpoints(&self, side: &str) {
        for (nic, addr) in &self.inner.nics {
            let withdrawn = lock(&self.inner.paths)
                .get(nic)
                .is_some_and(|s| s.withdrawn);
            if withdrawn && nic_running(nic, *addr) {
                if let Err(e) = add_endpoint(nic, *addr) {
                    tracing::warn!(%nic, side, error = %e, "adding the MPTCP endpoint back failed");
                }
            }
        }
    }

    /// Every path change so far, oldest first.
    pub fn path_changes(&self) -> Vec<PathChange> {
        lock(&self.inner.changes).clone()
    }
}

/// Per NIC, the watcher's state.
pub(super) type PathStates = BTreeMap<String, PathState>;

#[cfg(test)]
mod tests {
    use super::*;

    fn nlmsg(kind: u16, body: &[u8]) -> Vec<u8> {
        let len = NLMSG_HDR + body.len();
        let mut m = Vec::new();
        m.extend_from_slice(&(len as u32).to_ne_bytes());
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(&[0u8; 10]);
        m.extend_from_slice(body);
        while m.len() % 4 != 0 {
            m.push(0);
        }
        m
    }

    fn link(index: u32, flags: u32) -> Vec<u8> {
        let mut b = vec![0u8; 4];
        b.extend_from_slice(&index.to_ne_bytes());
        b.extend_from_slice(&flags.to_ne_bytes());
        b.extend_from_slice(&[0u8; 4]);
        b
    }

    fn addr(index: u32, a: [u8; 4]) -> Vec<u8> {
        let mut b = vec![libc::AF_INET as u8, 24, 0, 0];
        b.extend_from_slice(&index.to_ne_bytes());
        // IFA_ADDRESS then IFA_LOCAL (the local one wins), then a label
        for t in [IFA_ADDRESS, IFA_LOCAL] {
            b.extend_from_slice(&8u16.to_ne_bytes());
            b.extend_from_slice(&t.to_ne_bytes());
            b.extend_from_slice(&a);
        }
        b.extend_from_slice(&9u16.to_ne_bytes());
        b.extend_from_slice(&3u16.to_ne_bytes());
        b.extend_from_slice(b"eth4\0\0\0\0");
        b
    }

    #[test]
    fn link_and_address_changes_are_read_from_a_datagram() {
        let mut d = nlmsg(RTM_NEWLINK, &link(7, IFF_UP | IFF_LOWER_UP));
        d.extend(nlmsg(RTM_NEWLINK, &link(8, IFF_UP)));
        d.extend(nlmsg(RTM_DELADDR, &addr(7, [198, 18, 2, 11])));
        d.extend(nlmsg(RTM_DELLINK, &link(9, IFF_UP | IFF_LOWER_UP)));
        assert_eq!(
            parse_messages(&d),
            vec![
                NetEvent::Link {
                    index: 7,
                    running: true
                },
                // up, but no carrier: what a pulled cable looks like
                NetEvent::Link {
                    index: 8,
                    running: false
                },
                NetEvent::Addr {
                    index: 7,
                    addr: Ipv4Addr::new(198, 18, 2, 11),
                    removed: true
                },
                NetEvent::Link {
                    index: 9,
                    running: false
                },
            ]
        );
    }

    #[test]
    fn truncated_or_lying_messages_are_skipped() {
        let good = nlmsg(RTM_NEWLINK, &link(3, IFF_UP | IFF_LOWER_UP));
        // a length past the datagram, a length below the header, a cut body
        let mut long = good.clone();
        long[0..4].copy_from_slice(&1000u32.to_ne_bytes());
        assert!(parse_messages(&long).is_empty());
        let mut short = good.clone();
        short[0..4].copy_from_slice(&4u32.to_ne_bytes());
        assert!(parse_messages(&short).is_empty());
        assert!(parse_messages(&good[..20]).is_empty());
        // an attribute claiming more than is there ends that message only
        let mut a = addr(2, [10, 0, 0, 1]);
        a[8..10].copy_from_slice(&200u16.to_ne_bytes());
        let mut d = nlmsg(RTM_NEWADDR, &a);
        d.extend(good);
        assert_eq!(
            parse_messages(&d),
            vec![NetEvent::Link {
                index: 3,
                running: true
            }]
        );
    }

    fn sf(local: &str, unacked: u32, last_ack_ms: u32, rtt_us: u32) -> Subflow {
        Subflow::sample(local, unacked, last_ack_ms, rtt_us)
    }

    #[test]
    fn a_subflow_is_silent_only_while_another_is_acknowledged() {
        let dead = sf("198.18.2.11:40000", 30, 250, 2_000);
        let live = sf("198.18.1.11:40001", 40, 3, 2_000);
        let idle = sf("198.18.1.11:40001", 0, 5_000, 2_000);
        let blocked = sf("198.18.1.11:40001", 40, 900, 2_000);
        assert!(silent_among(&dead, &[&live]));
        assert!(silent_among(&dead, &[&idle]));
        // every subflow waiting: the receiver (or everything) is stuck, not one path
        assert!(!silent_among(&dead, &[&blocked]));
        // alone: nothing to compare with; the session's stall check covers it
        assert!(!silent_among(&dead, &[]));
        // idle for seconds, then just given data: not silent before a round trip
        let woken = Subflow {
            last_sent_ms: 1,
            ..sf("198.18.2.11:40000", 10, 5_000, 2_000)
        };
        assert!(!silent_among(&woken, &[&live]));
        // retransmitting into a dead path: its timer fired, no ACK came
        let retrying = Subflow {
            backoff: 1,
            ..woken.clone()
        };
        assert!(silent_among(&retrying, &[&live]));
        // a join still in its handshake has no round trip yet: not a dead path
        assert!(!silent_among(
            &sf("198.18.2.11:40002", 1, 2_000_000, 0),
            &[&live]
        ));
        // a slow path is given three of its round trips
        let slow = sf("198.18.2.11:40000", 30, 250, 100_000);
        assert_eq!(silent_limit(&slow), Duration::from_millis(204));
        assert!(silent_among(&slow, &[&live]));
        // not yet at 200 ms
        assert!(!silent_among(
            &sf("198.18.2.11:40000", 30, 150, 2_000),
            &[&live]
        ));
        assert!(silence_reason(&dead).contains("no ACK for 250 ms with 30 segments"));
    }
}
