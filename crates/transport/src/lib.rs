//! Ferry's transport: one live migration over every NIC.
//!
//! QEMU's migration connections (the main channel and each multifd channel)
//! end at a unix socket of the source agent and start again at the target
//! agent, which connects them to the target QEMU. In between, each is a
//! *stream*, cut into frames and carried over *carriers* — TCP connections
//! bound to each NIC — in proportion to what each carrier drains now, put
//! back in order by the receiver, kept in a replay buffer until acknowledged
//! and resent on the others when a carrier dies.
//!
//! - [`protocol`]: the wire format, versioned and authenticated, every field checked.
//! - [`seal`]: carriers encrypted and authenticated per frame, when the cluster asks.
//! - [`session`]: carriers, streams, scheduling, replay and failover.
//! - [`relay`]: the runtime a session's tasks run on.
//! - [`mptcp`]: the other carrier kind — kernel MPTCP, one connection per
//!   stream, spliced, its subflows managed by Ferry.

pub mod compress;
pub mod cpu;
pub mod mptcp;
pub mod protocol;
pub mod relay;
pub mod seal;
pub mod session;

pub use compress::{CompressionStats, Mode as CompressMode};
pub use mptcp::{Deliver, Spliced};
pub use session::{CarrierStats, Keys, Session, SessionStats, TransportError};

/// A migration's carriers, of either kind, as the agents drive them.
#[derive(Clone)]
pub enum Carriers {
    /// Ferry's own: framed carriers per NIC ([`Session`]).
    Ferry(Session),
    /// Kernel MPTCP managed by Ferry ([`Spliced`]): QEMU's one stream
    /// handed the socket, or QEMU's connections relayed.
    Mptcp(Spliced),
}

impl Carriers {
    /// `ferry` or `mptcp`.
    pub fn kind(&self) -> &'static str {
        match self {
            Carriers::Ferry(_) => "ferry",
            Carriers::Mptcp(_) => "mptcp",
        }
    }
    pub fn stats(&self) -> SessionStats {
        match self {
            Carriers::Ferry(s) => s.stats(),
            Carriers::Mptcp(s) => s.stats(),
        }
    }
    /// Paths (carriers, or MPTCP subflows per NIC) dropped and taken again
    /// so far, oldest first.
    pub fn path_changes(&self) -> Vec<ferry_api::types::PathChange> {
        match self {
            Carriers::Ferry(s) => s.path_changes(),
            Carriers::Mptcp(s) => s.path_changes(),
        }
    }
    /// Why nothing moves, as far as the carriers can tell: how many are up
    /// and, for kernel MPTCP, each open stream's subflows (for a move that
    /// fails on a stall, so that its report says which path held it).
    pub fn stall_detail(&self) -> String {
        let (st, subflows) = match self {
            Carriers::Ferry(s) => (s.stats(), None),
            Carriers::Mptcp(s) => {
                let (st, described) = s.stall_view();
                (st, Some(described))
            }
        };
        let up = if st.healthy == 0 {
            format!("every carrier is down ({} carriers)", self.kind())
        } else {
            format!(
                "{} of {} {} carriers up, yet nothing moved",
                st.healthy,
                st.carriers.len(),
                self.kind()
            )
        };
        match subflows {
            None => up,
            Some(described) => format!("{up}; {described}"),
        }
    }
    pub fn failure(&self) -> Option<String> {
        match self {
            Carriers::Ferry(s) => s.failure(),
            Carriers::Mptcp(s) => s.failure(),
        }
    }
    /// Everything this side sent has been acknowledged (Ferry's carriers;
    /// kernel MPTCP sockets flush their own buffers when shut).
    pub fn drained(&self) -> bool {
        match self {
            Carriers::Ferry(s) => s.undelivered() == 0,
            Carriers::Mptcp(_) => true,
        }
    }

    /// Closes once everything this side sent has stayed acknowledged for
    /// `quiet` (what its local end writes last may still be on the way),
    /// or after `within` in any case.
    pub async fn close_when_drained(
        &self,
        quiet: std::time::Duration,
        within: std::time::Duration,
    ) {
        let deadline = tokio::time::Instant::now() + within;
        let mut drained_since: Option<tokio::time::Instant> = None;
        while tokio::time::Instant::now() < deadline {
            let now = tokio::time::Instant::now();
            if !self.drained() {
                drained_since = None;
            } else if now - *drained_since.get_or_insert(now) >= quiet {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        self.close();
    }
    pub fn close(&self) {
        match self {
            Carriers::Ferry(s) => s.close(),
            Carriers::Mptcp(s) => s.close(),
        }
    }
    /// The socket QEMU is to be handed, when the session carries QEMU's
    /// stream without relaying it.
    pub fn handoff_fd(&self) -> Option<std::os::fd::RawFd> {
        match self {
            Carriers::Mptcp(s) => s.handoff_fd(),
            Carriers::Ferry(_) => None,
        }
    }
    /// Every frame sealed (only Ferry's own carriers seal).
    pub fn sealed(&self) -> bool {
        matches!(self, Carriers::Ferry(s) if s.sealed())
    }
}

/// A session id (or a session key) as text, two hex digits a byte, as
/// agents pass it in their API.
pub fn session_to_hex(id: &[u8]) -> String {
    ferry_api::util::hex(id)
}

/// Parses [`session_to_hex`]'s form of a session id; anything else is `None`.
pub fn session_from_hex(s: &str) -> Option<[u8; 16]> {
    bytes_from_hex(s)
}

/// Parses [`session_to_hex`]'s form of a session key; anything else is `None`.
pub fn key_from_hex(s: &str) -> Option<[u8; 32]> {
    bytes_from_hex(s)
}

fn bytes_from_hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    ferry_api::util::unhex(s)?.try_into().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_ids_round_trip_and_bad_text_is_refused() {
        let id = [0xab; 16];
        assert_eq!(session_from_hex(&session_to_hex(&id)), Some(id));
        let signed = format!("+{}", "a".repeat(31));
        for bad in ["", "ab", &"z".repeat(32), &"a".repeat(33), &signed] {
            assert_eq!(session_from_hex(bad), None, "{bad}");
        }
        let key = [0x5c; 32];
        assert_eq!(key_from_hex(&session_to_hex(&key)), Some(key));
        assert_eq!(key_from_hex(&session_to_hex(&id)), None, "an id is no key");
    }
}
