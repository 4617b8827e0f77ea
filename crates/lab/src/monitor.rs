//! The active-backup team's link monitor: what a bond in `active-backup`
//! mode with an ARP monitor (`arp_interval`, `arp_ip_target`) does, for the
//! lab's hosts, whose kernel has no bonding driver.
//!
//! One runs in each host's namespace (`ferry lab team active-backup` starts
//! them). Every [`PROBE_EVERY`] it sends an ICMP echo request to every peer
//! over every fabric (a raw socket bound to that NIC). A peer's route to its
//! team address goes over one fabric, the active one; when no reply came over
//! it for [`DOWN_AFTER`] and one did over another fabric, the route is moved
//! there. Both ends of a cut link see their probes go unanswered, so both
//! move: a bond's gratuitous ARP does the same for switches that share one
//! layer-2 domain. There is no fail-back: like a bond without `primary`, the
//! route stays where it went until that fabric fails too.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use crate::team::backup_route;
use crate::topology::*;
use crate::{run, LabError};

/// How often every peer is probed over every fabric.
pub const PROBE_EVERY: Duration = Duration::from_millis(100);
/// Silence over the active fabric after which the route moves.
pub const DOWN_AFTER: Duration = Duration::from_millis(300);

const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_ECHO_REQUEST: u8 = 8;

/// The RFC 1071 checksum of `b`.
fn checksum(b: &[u8]) -> u16 {
    let mut sum: u32 = b
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An ICMP echo request with identifier `id` and sequence `seq`.
fn echo_request(id: u16, seq: u16) -> [u8; 16] {
    let mut p = [0u8; 16];
    p[0] = ICMP_ECHO_REQUEST;
    p[4..6].copy_from_slice(&id.to_be_bytes());
    p[6..8].copy_from_slice(&seq.to_be_bytes());
    p[8..16].copy_from_slice(b"ferry-ab");
    let c = checksum(&p);
    p[2..4].copy_from_slice(&c.to_be_bytes());
    p
}

/// The sender of an echo reply with identifier `id`, from an IPv4 packet as
/// a raw socket receives it (IP header first); `None` for anything else.
fn echo_reply_from(packet: &[u8], id: u16) -> Option<Ipv4Addr> {
    let ihl = usize::from(*packet.first()? & 0x0f) * 4;
    let icmp = packet.get(ihl..ihl + 8)?;
    if ihl < 20 || icmp[0] != ICMP_ECHO_REPLY || icmp[4..6] != id.to_be_bytes() {
        return None;
    }
    let src: [u8; 4] = packet.get(12..16)?.try_into().ok()?;
    Some(Ipv4Addr::from(src))
}

/// A raw ICMP socket bound to one NIC.
struct Prober {
    fabric: u32,
    fd: OwnedFd,
}

impl Prober {
    fn new(i: u32, fabric: u32) -> Result<Prober, LabError> {
        let what = format!("an ICMP socket on {}", nic_name(i, fabric));
        // SAFETY: socket(2) with constant arguments.
        let raw = unsafe {
            libc::socket(
                libc::AF_INET,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                libc::IPPROTO_ICMP,
            )
        };
        if raw < 0 {
            return Err(LabError::Socket {
                what,
                source: std::io::Error::last_os_error(),
            });
        }
        // SAFETY: a fresh descriptor this function owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let dev = nic_name(i, fabric);
        // SAFETY: `dev` outlives the call; its length is passed.
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_BINDTODEVICE,
                dev.as_ptr().cast(),
                dev.len() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(LabError::Socket {
                what,
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(Prober { fabric, fd })
    }

    /// Sends an echo request; a link that is down refuses it, which is fine.
    fn send(&self, to: Ipv4Addr, id: u16, seq: u16) {
        let p = echo_request(id, seq);
        let sa = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from(to).to_be(),
            },
            sin_zero: [0; 8],
        };
        // SAFETY: `p` and `sa` are valid for the lengths passed.
        unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                p.as_ptr().cast(),
                p.len(),
                0,
                (&sa as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
    }

    /// Senders of the echo replies waiting on the socket.
    fn replies(&self, id: u16) -> Vec<Ipv4Addr> {
        let mut out = Vec::new();
        let mut buf = [0u8; 1500];
        loop {
            // SAFETY: buf is valid for its length.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n <= 0 {
                return out;
            }
            out.extend(echo_reply_from(&buf[..n as usize], id));
        }
    }
}

/// Which fabric a peer's route should take: the active one while it answered
/// within [`DOWN_AFTER`], else the first fabric that did, else the active one.
fn choose(active: u32, fabrics: u32, alive: impl Fn(u32) -> bool) -> u32 {
    if alive(active) {
        return active;
    }
    (1..=fabrics).find(|k| alive(*k)).unwrap_or(active)
}

/// Points this host's route to peer `j`'s team address over fabric `k`.
fn route_via(i: u32, j: u32, k: u32) -> Result<(), LabError> {
    let args = backup_route(i, j, k);
    run("ip", &args.iter().map(String::as_str).collect::<Vec<_>>()).map(|_| ())
}

/// Runs host `i`'s monitor, in its own namespace, until killed.
pub fn run_monitor(spec: &LabSpec, i: u32) -> Result<(), LabError> {
    let probers: Vec<Prober> = (1..=spec.nics)
        .map(|k| Prober::new(i, k))
        .collect::<Result<_, _>>()?;
    let peers: Vec<u32> = (1..=spec.hosts).filter(|j| *j != i).collect();
    let id = (std::process::id() & 0xffff) as u16;
    let start = Instant::now();
    // last reply per (peer, fabric); none yet counts as answered at start
    let mut seen: HashMap<(u32, u32), Instant> = HashMap::new();
    let mut active: HashMap<u32, u32> = peers.iter().map(|j| (*j, 1)).collect();
    let mut seq = 0u16;
    eprintln!(
        "{}: active-backup monitor: probing {} peer(s) over {} fabric(s) every {} ms, moving after {} ms",
        host_name(i),
        peers.len(),
        spec.nics,
        PROBE_EVERY.as_millis(),
        DOWN_AFTER.as_millis()
    );
    loop {
        seq = seq.wrapping_add(1);
        for p in &probers {
            for j in &peers {
                if let Ok(a) = nic_addr(*j, p.fabric).parse() {
                    p.send(a, id, seq);
                }
            }
        }
        let until = Instant::now() + PROBE_EVERY;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let mut fds: Vec<libc::pollfd> = probers
                .iter()
                .map(|p| libc::pollfd {
                    fd: p.fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                })
                .collect();
            // SAFETY: `fds` is valid for its length.
            unsafe {
                libc::poll(
                    fds.as_mut_ptr(),
                    fds.len() as libc::nfds_t,
                    left.as_millis() as i32 + 1,
                )
            };
            let now = Instant::now();
            for p in &probers {
                for from in p.replies(id) {
                    if let Some(j) = peers
                        .iter()
                        .find(|j| nic_addr(**j, p.fabric) == from.to_string())
                    {
                        seen.insert((*j, p.fabric), now);
                    }
                }
            }
        }
        let now = Instant::now();
        for j in &peers {
            let alive = |k: u32| now - *seen.get(&(*j, k)).unwrap_or(&start) < DOWN_AFTER;
            let was = active[j];
            let k = choose(was, spec.nics, alive);
            if k != was {
                match route_via(i, *j, k) {
                    Ok(()) => {
                        eprintln!(
                            "{}: {} silent over fabric {was} for {} ms: route moved to fabric {k}",
                            host_name(i),
                            host_name(*j),
                            DOWN_AFTER.as_millis()
                        );
                        active.insert(*j, k);
                    }
                    Err(e) => eprintln!("{}: moving the route failed: {e}", host_name(i)),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echo_requests_carry_a_valid_checksum() {
        let p = echo_request(0x1234, 7);
        // a packet with its checksum in place sums to zero
        assert_eq!(checksum(&p), 0);
        assert_eq!(p[0], ICMP_ECHO_REQUEST);
        assert_eq!(&p[4..8], &[0x12, 0x34, 0, 7]);
    }

    #[test]
    fn only_our_echo_replies_are_taken() {
        let mut pkt = vec![
            0x45u8, 0, 0, 36, 0, 0, 0, 0, 64, 1, 0, 0, 198, 18, 2, 12, 198, 18, 2, 11,
        ];
        let mut icmp = echo_request(0xabcd, 1).to_vec();
        icmp[0] = ICMP_ECHO_REPLY;
        pkt.extend(&icmp);
        assert_eq!(
            echo_reply_from(&pkt, 0xabcd),
            Some(Ipv4Addr::new(198, 18, 2, 12))
        );
        // another process's reply, a request, a truncated packet
        assert_eq!(echo_reply_from(&pkt, 0x1111), None);
        pkt[20] = ICMP_ECHO_REQUEST;
        assert_eq!(echo_reply_from(&pkt, 0xabcd), None);
        assert_eq!(echo_reply_from(&pkt[..24], 0xabcd), None);
    }

    #[test]
    fn the_route_moves_only_off_a_silent_fabric_to_one_that_answers() {
        assert_eq!(choose(1, 2, |_| true), 1);
        assert_eq!(choose(1, 2, |k| k == 2), 2);
        // no fail-back while the new active one answers
        assert_eq!(choose(2, 2, |_| true), 2);
        // nothing answers: stay
        assert_eq!(choose(1, 2, |_| false), 1);
    }
}
