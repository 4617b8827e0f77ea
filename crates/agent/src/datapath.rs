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
    /// URI for the target's `migrate-incoming`, on the chosen NIC's address,
    /// on a free migration port (where traffic classes recognize live
    /// migration); read back by [`DataPath::source_uri`].
    fn incoming_uri(&self, nic_addr: &str) -> Result<String, String>;
    /// URI the source QEMU sends to, from the address QEMU reports listening on.
    fn source_uri(&self, host: &str, port: &str) -> String;
}

/// QEMU's own migration stream over one TCP connection on one NIC.
pub struct QemuTcp;

impl DataPath for QemuTcp {
    fn name(&self) -> &'static str {
        "qemu-tcp"
    }
    fn incoming_uri(&self, nic_addr: &str) -> Result<String, String> {
        let addr = nic_addr
            .parse()
            .map_err(|_| format!("{nic_addr:?} is not an IP address"))?;
        // never port 0: a port outside the migration block escapes the bandwidth classes
        let port = ferry_api::bandwidth::free_migration_port(addr, rand::random())
            .map_err(|e| format!("no free migration port on {nic_addr}: {e}"))?;
        Ok(format!("tcp:{nic_addr}:{port}"))
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
        let uri = d.incoming_uri("127.0.0.1").unwrap();
        assert!(d.incoming_uri("nic1").unwrap_err().contains("nic1"));
        let port: u16 = uri.rsplit(':').next().unwrap().parse().unwrap();
        assert_eq!(
            port & ferry_api::bandwidth::MIGRATION_PORT_MASK,
            ferry_api::bandwidth::MIGRATION_PORT_BASE,
            "{uri}"
        );
        assert_eq!(
            d.source_uri("198.18.1.12", "40000"),
            "tcp:198.18.1.12:40000"
        );
    }
}
