//! The migration data path: how QEMU's migration stream gets from the source
//! host to the target host.
//!
//! A data path decides two things: the URI the skeleton QEMU on the target
//! listens on, and the URI the source QEMU sends to. [`QemuTcp`] is QEMU's own
//! single TCP stream over one NIC (the "TCP/IP" performance option of seed
//! 000). Ferry's own transport (carriers over every NIC, failover, compression)
//! implements the same trait: its target side listens on a local unix socket
//! relayed from the carriers, its source side hands QEMU a local unix socket.

/// Chooses where a migration's bytes go.
pub trait DataPath: Send + Sync {
    /// Name reported in migration reports (`qemu-tcp`, …).
    fn name(&self) -> &'static str;
    /// URI for the target's `migrate-incoming`, on the chosen NIC's address.
    /// Port 0 lets QEMU pick a free port, read back by [`DataPath::source_uri`].
    fn incoming_uri(&self, nic_addr: &str) -> String;
    /// URI the source QEMU sends to, from the address QEMU reports listening on.
    fn source_uri(&self, host: &str, port: &str) -> String;
}

/// QEMU's own migration stream over one TCP connection on one NIC.
pub struct QemuTcp;

impl DataPath for QemuTcp {
    fn name(&self) -> &'static str {
        "qemu-tcp"
    }
    fn incoming_uri(&self, nic_addr: &str) -> String {
        format!("tcp:{nic_addr}:0")
    }
    fn source_uri(&self, host: &str, port: &str) -> String {
        format!("tcp:{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_uris() {
        let d = QemuTcp;
        assert_eq!(d.incoming_uri("198.18.1.12"), "tcp:198.18.1.12:0");
        assert_eq!(
            d.source_uri("198.18.1.12", "40000"),
            "tcp:198.18.1.12:40000"
        );
    }
}
