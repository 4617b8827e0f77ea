//! Host and network validation: the speed checklist of seeds 000 and 002 as
//! data. Agents report facts ([`HostFacts`]) and run probes (MTU, throughput);
//! the control service turns them into [`CheckOutcome`]s, each naming the
//! host, NIC and peer it is about and the fix.

use serde::{Deserialize, Serialize};

/// Smallest IP packet every IPv4 path must carry.
pub const MIN_PACKET: u32 = 576;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckStatus {
    Pass,
    /// Could not be checked here; `observed` says why. Never a pass.
    NotAvailable,
    Warn,
    Fail,
}

impl CheckStatus {
    pub fn label(self) -> &'static str {
        match self {
            CheckStatus::Pass => "pass",
            CheckStatus::Warn => "warn",
            CheckStatus::Fail => "FAIL",
            CheckStatus::NotAvailable => "n/a",
        }
    }
}

/// One row of `ferry host validate`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckOutcome {
    /// `mtu`, `mtu-path`, `link`, `throughput`, `cpu-governor`, `cpu-idle`,
    /// `nic-channels`, `nic-rings`, `rdma`, `consistency`.
    pub check: String,
    pub host: String,
    pub nic: Option<String>,
    pub peer: Option<String>,
    pub status: CheckStatus,
    pub observed: String,
    pub fix: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ValidationReport {
    pub hosts: Vec<String>,
    pub checks: Vec<CheckOutcome>,
    pub passed: usize,
    pub warned: usize,
    pub failed: usize,
    pub not_available: usize,
}

impl ValidationReport {
    pub fn new(hosts: Vec<String>, checks: Vec<CheckOutcome>) -> Self {
        let count = |s| checks.iter().filter(|c| c.status == s).count();
        ValidationReport {
            passed: count(CheckStatus::Pass),
            warned: count(CheckStatus::Warn),
            failed: count(CheckStatus::Fail),
            not_available: count(CheckStatus::NotAvailable),
            hosts,
            checks,
        }
    }

    /// Failed path checks between two hosts (either direction).
    pub fn failed_paths(&self, a: &str, b: &str) -> Vec<&CheckOutcome> {
        self.checks
            .iter()
            .filter(|c| c.status == CheckStatus::Fail && c.peer.is_some())
            .filter(|c| {
                let p = c.peer.as_deref().unwrap_or_default();
                (c.host == a && p == b) || (c.host == b && p == a)
            })
            .collect()
    }
}

/// A fact that may not be readable on this host, with the reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Probe<T> {
    pub value: Option<T>,
    pub unavailable: Option<String>,
}

impl<T> Probe<T> {
    pub fn ok(v: T) -> Self {
        Probe {
            value: Some(v),
            unavailable: None,
        }
    }
    pub fn unavailable(why: impl Into<String>) -> Self {
        Probe {
            value: None,
            unavailable: Some(why.into()),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Channels {
    pub max_rx: Option<u32>,
    pub max_tx: Option<u32>,
    pub max_combined: Option<u32>,
    pub rx: Option<u32>,
    pub tx: Option<u32>,
    pub combined: Option<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rings {
    pub max_rx: Option<u32>,
    pub max_tx: Option<u32>,
    pub rx: Option<u32>,
    pub tx: Option<u32>,
}

impl NicFacts {
    /// The fabric as shown to people: the NIC's network, else its number.
    pub fn fabric_name(&self) -> String {
        if self.network.is_empty() {
            self.fabric.to_string()
        } else {
            self.network.clone()
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicFacts {
    pub name: String,
    pub address: String,
    pub fabric: u32,
    /// Its IPv4 network (`10.10.0.0/24`), how its fabric is shown.
    #[serde(default)]
    pub network: String,
    pub mtu: u32,
    /// Carrier present.
    pub up: bool,
    pub oper_state: String,
    /// The NIC's rated speed (link speed, or the rate it was provisioned at), bit/s.
    pub nominal_rate: Option<u64>,
    /// A `tbf` shaping rate on the NIC, if any, bit/s.
    pub shaped_rate: Option<u64>,
    pub channels: Probe<Channels>,
    pub rings: Probe<Rings>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdleState {
    pub name: String,
    pub latency_us: u64,
    /// CPUs on which this state is enabled, of `cpus`.
    pub enabled_on: u32,
    pub cpus: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuFacts {
    pub governors: Probe<Vec<String>>,
    pub idle_driver: Option<String>,
    pub idle_states: Probe<Vec<IdleState>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostFacts {
    pub host: String,
    pub nics: Vec<NicFacts>,
    pub cpu: CpuFacts,
    /// RDMA devices (`/sys/class/infiniband`).
    pub rdma: Probe<Vec<String>>,
}

/// Agent: find the largest don't-fragment packet that passes to a peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathProbeRequest {
    pub nic: String,
    pub peer_addr: String,
    /// The size to try first (the NIC's MTU).
    pub size: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathProbeResult {
    pub nic: String,
    pub peer_addr: String,
    pub size: u32,
    /// Largest IP packet that passed with DF set; 0 when none did.
    pub largest: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinkRequest {
    pub nic: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SinkReply {
    pub address: String,
    pub port: u16,
    /// The transport session the sender must join (32 hex digits).
    pub session: String,
}

/// What a throughput sink received, timed from first to last byte.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SinkResult {
    pub bytes: u64,
    pub duration_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendRequest {
    pub nic: String,
    pub peer_addr: String,
    pub port: u16,
    pub session: String,
    pub duration_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendResult {
    pub bytes: u64,
}
