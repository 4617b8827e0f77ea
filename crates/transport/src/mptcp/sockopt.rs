//! MPTCP socket options: making MPTCP sockets and reading each subflow's
//! addresses and TCP state (`MPTCP_SUBFLOW_ADDRS`, `MPTCP_TCPINFO`).

use std::net::{IpAddr, SocketAddr};
use std::os::fd::RawFd;

use socket2::{Domain, Protocol, Socket, Type};

use super::*;

pub(super) fn mptcp_socket() -> std::io::Result<Socket> {
    Socket::new(
        Domain::IPV4,
        Type::STREAM,
        Some(Protocol::from(IPPROTO_MPTCP)),
    )
    .map_err(|e| {
        if e.raw_os_error() == Some(libc::EPROTONOSUPPORT) {
            std::io::Error::other("this kernel has no MPTCP (or net.mptcp.enabled is 0)")
        } else {
            e
        }
    })
}

/// This kernel takes MPTCP sockets.
pub fn available() -> bool {
    mptcp_socket().is_ok()
}

/// One subflow of a connection, as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subflow {
    pub local: SocketAddr,
    pub remote: SocketAddr,
    /// Bytes the peer acknowledged on this subflow.
    pub bytes_acked: u64,
    /// Segments sent and not yet acknowledged, and ms since the last ACK
    /// arrived: both large means the path is dead (an idle subflow has
    /// nothing unacknowledged).
    pub unacked: u32,
    pub last_ack_ms: u32,
    /// ms since data was last sent and received on it.
    pub last_sent_ms: u32,
    pub last_recv_ms: u32,
    /// Smoothed round-trip time and retransmission timeout, µs, and how
    /// often that timeout has backed off (doubled) in a row.
    pub rtt_us: u32,
    pub rto_us: u32,
    pub backoff: u8,
}

impl Subflow {
    /// Waiting on an ACK for [`SILENT_AFTER`] or more: its path is down,
    /// wherever it was cut.
    pub fn stalled(&self) -> bool {
        self.unacked > 0 && self.last_ack_ms as u128 >= SILENT_AFTER.as_millis()
    }

    /// No data either way for [`SILENT_AFTER`]: how a receiver sees a
    /// subflow whose sender is waiting out its retransmission timer.
    pub fn quiet(&self) -> bool {
        let s = SILENT_AFTER.as_millis();
        self.last_sent_ms as u128 >= s && self.last_recv_ms as u128 >= s
    }
}

#[cfg(test)]
impl Subflow {
    /// A subflow from `local` to the target's 198.18.2.12:7500 with these
    /// readings (its last data sent when its last ACK came), for tests.
    pub(super) fn sample(local: &str, unacked: u32, last_ack_ms: u32, rtt_us: u32) -> Subflow {
        Subflow {
            local: local.parse().expect("a socket address"),
            remote: SocketAddr::from(([198, 18, 2, 12], 7500)),
            bytes_acked: 1,
            unacked,
            last_ack_ms,
            last_sent_ms: last_ack_ms,
            last_recv_ms: 0,
            rtt_us,
            rto_us: 204_000,
            backoff: 0,
        }
    }
}

pub(super) fn sockaddr_v4(b: &[u8]) -> Option<SocketAddr> {
    let family = u16::from_ne_bytes([b[0], b[1]]);
    if family != libc::AF_INET as u16 {
        return None;
    }
    let port = u16::from_be_bytes([b[2], b[3]]);
    let ip = std::net::Ipv4Addr::new(b[4], b[5], b[6], b[7]);
    Some(SocketAddr::new(IpAddr::V4(ip), port))
}

/// Reads one of MPTCP's per-subflow socket options: `(entries, entry size)`.
pub(super) fn subflow_data(
    fd: RawFd,
    opt: i32,
    size_user: usize,
) -> std::io::Result<(Vec<u8>, usize)> {
    let mut buf = vec![0u8; SUBFLOW_DATA_LEN + size_user * MAX_SUBFLOWS];
    buf[0..4].copy_from_slice(&(SUBFLOW_DATA_LEN as u32).to_ne_bytes());
    buf[12..16].copy_from_slice(&(size_user as u32).to_ne_bytes());
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: buf is valid for len bytes; the kernel writes at most len.
    let r = unsafe { libc::getsockopt(fd, SOL_MPTCP, opt, buf.as_mut_ptr().cast(), &mut len) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let n = u32::from_ne_bytes(buf[4..8].try_into().unwrap_or_default()) as usize;
    let stride = u32::from_ne_bytes(buf[12..16].try_into().unwrap_or_default()) as usize;
    let n = n
        .min(MAX_SUBFLOWS)
        .min((len as usize - SUBFLOW_DATA_LEN) / stride.max(1));
    buf.truncate(SUBFLOW_DATA_LEN + n * stride);
    Ok((buf.split_off(SUBFLOW_DATA_LEN), stride))
}

/// The subflows of one MPTCP connection (IPv4 only), read from the kernel.
pub fn subflows(fd: RawFd) -> std::io::Result<Vec<Subflow>> {
    let (addrs, a_stride) = subflow_data(fd, MPTCP_SUBFLOW_ADDRS, SUBFLOW_ADDRS_LEN)?;
    let (infos, i_stride) = subflow_data(fd, MPTCP_TCPINFO, TCP_INFO_LEN)?;
    let n = addrs.len() / a_stride.max(1);
    let mut out = Vec::new();
    for i in 0..n {
        let a = &addrs[i * a_stride..(i + 1) * a_stride];
        let (Some(local), Some(remote)) = (sockaddr_v4(&a[0..128]), sockaddr_v4(&a[128..256]))
        else {
            continue;
        };
        // the two reads walk the same list; a subflow added in between leaves
        // the counts unequal, and the bytes are then left out of this reading
        let info = (infos.len() / i_stride.max(1) == n).then(|| &infos[i * i_stride..]);
        let u32_at = |off: usize| {
            info.map(|b| u32::from_ne_bytes(b[off..off + 4].try_into().unwrap_or_default()))
                .unwrap_or(0)
        };
        let bytes_acked = info
            .map(|b| {
                let v = &b[TCP_INFO_BYTES_ACKED..TCP_INFO_BYTES_ACKED + 8];
                u64::from_ne_bytes(v.try_into().unwrap_or_default())
            })
            .unwrap_or(0);
        out.push(Subflow {
            local,
            remote,
            bytes_acked,
            unacked: u32_at(TCP_INFO_UNACKED),
            last_ack_ms: u32_at(TCP_INFO_LAST_ACK_RECV),
            last_sent_ms: u32_at(TCP_INFO_LAST_DATA_SENT),
            last_recv_ms: u32_at(TCP_INFO_LAST_DATA_RECV),
            rtt_us: u32_at(TCP_INFO_RTT),
            rto_us: u32_at(TCP_INFO_RTO),
            backoff: info.map(|b| b[TCP_INFO_BACKOFF]).unwrap_or(0),
        });
    }
    Ok(out)
}
