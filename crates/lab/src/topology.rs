//! The lab's addressing plan and names. Pure functions, no I/O.
//!
//! ```text
//!   root namespace: bridge ferry-mgmt 198.18.0.1/24 (control service)
//!        │ fm-h<i>
//!   host<i> namespace: mgmt0 198.18.0.(10+i)   agent listens here, port 7800
//!                      NIC k: a name of host i's own  wired to fabric k
//!                      (host1 ens1f0 ens1f1, host2 eth4 eth5, host3 enp3s0 enp4s0, …)
//!                      address FABRIC_NETS[k].(10+i)/24
//!        │ h<i>n<k>
//!   ferry-fab<k> namespace: bridge br0 (an independent switch per fabric)
//! ```
//! All addresses are inside 198.18.0.0/15 (RFC 2544 benchmarking space).
//! Neither a NIC's name nor its address says which fabric it is on: the
//! agents find out by probing, as on real hosts. Only the lab itself (its
//! commands `ferry lab link|mtu|rate HOST NIC`, which also take `nicK`)
//! knows the plan.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::LabError;

pub const MGMT_BRIDGE: &str = "ferry-mgmt";
pub const CONTROL_MGMT_ADDR: &str = "198.18.0.1";
pub const AGENT_PORT: u16 = 7800;
pub const CONTROL_PORT: u16 = 7700;
pub const MAX_HOSTS: u32 = 200;
pub const MAX_NICS: u32 = 8;

/// What `ferry lab up` was asked for; stored as `lab.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabSpec {
    pub hosts: u32,
    pub nics: u32,
    /// tc rate per NIC, e.g. `1gbit`, `500mbit`.
    pub rate: String,
    pub mtu: u32,
    /// Memory each host offers to VMs, bytes.
    pub host_memory: u64,
    /// CPUs each host's agent and QEMUs are confined to (a kernel CPU
    /// list per host name); hosts not listed share the machine's.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub cpus: BTreeMap<String, String>,
}

impl LabSpec {
    pub fn validate(&self) -> Result<(), LabError> {
        if self.hosts == 0 || self.hosts > MAX_HOSTS {
            return Err(LabError::Invalid(format!(
                "--hosts {} is outside 1..{MAX_HOSTS}",
                self.hosts
            )));
        }
        if self.nics == 0 || self.nics > MAX_NICS {
            return Err(LabError::Invalid(format!(
                "--nics {} is outside 1..{MAX_NICS}",
                self.nics
            )));
        }
        if !(576..=9000).contains(&self.mtu) {
            return Err(LabError::Invalid(format!(
                "--mtu {} is outside 576..9000",
                self.mtu
            )));
        }
        parse_rate(&self.rate)?;
        Ok(())
    }

    pub fn host_names(&self) -> Vec<String> {
        (1..=self.hosts).map(host_name).collect()
    }
}

/// Parses a tc rate (`1gbit`, `500mbit`, `100kbit`) into bits per second.
pub fn parse_rate(rate: &str) -> Result<u64, LabError> {
    let r = rate.trim().to_ascii_lowercase();
    let bad = || {
        LabError::Invalid(format!(
            "--rate '{rate}' is not a rate (examples: 1gbit, 500mbit)"
        ))
    };
    if !["gbit", "mbit", "kbit"].iter().any(|u| r.ends_with(u)) {
        return Err(bad());
    }
    let bps = ferry_api::util::parse_rate_bits(&r).ok_or_else(bad)? as f64;
    if !(100_000.0..=100e9).contains(&bps) {
        return Err(bad());
    }
    Ok(bps as u64)
}

pub fn host_name(i: u32) -> String {
    format!("host{i}")
}

/// Index of `hostN`, if the name is a lab host name.
pub fn host_index(name: &str) -> Option<u32> {
    name.strip_prefix("host")?
        .parse()
        .ok()
        .filter(|i| (1..=MAX_HOSTS).contains(i))
}

pub fn fabric_ns(k: u32) -> String {
    format!("ferry-fab{k}")
}

/// Host `i`'s name for its NIC on fabric `k`: three naming schemes in
/// turn, as three kinds of server would have.
pub fn nic_name(i: u32, k: u32) -> String {
    match i % 3 {
        1 => format!("ens1f{}", k - 1),
        2 => format!("eth{}", k + 3),
        _ => format!("enp{}s0", k + 2),
    }
}

/// The fabric of host `i`'s NIC `name`: its own name, or `nicK`.
pub fn nic_index(i: u32, name: &str) -> Option<u32> {
    if let Some(k) = name
        .strip_prefix("nic")
        .and_then(|k| k.parse().ok())
        .filter(|k| (1..=MAX_NICS).contains(k))
    {
        return Some(k);
    }
    (1..=MAX_NICS).find(|k| nic_name(i, *k) == name)
}

/// The switch-side end of host `i`'s NIC `k`, inside the fabric namespace.
pub fn switch_port(i: u32, k: u32) -> String {
    format!("h{i}n{k}")
}

/// The root-namespace end of host `i`'s management link.
pub fn mgmt_port(i: u32) -> String {
    format!("fm-h{i}")
}

fn last_octet(i: u32) -> u32 {
    10 + i
}

pub fn mgmt_addr(i: u32) -> String {
    format!("198.18.0.{}", last_octet(i))
}

/// Each fabric's /24, in no order that says which fabric it is.
const FABRIC_NETS: [&str; MAX_NICS as usize] = [
    "198.19.37",
    "198.18.201",
    "198.19.112",
    "198.18.77",
    "198.19.5",
    "198.18.150",
    "198.19.240",
    "198.18.99",
];

pub fn nic_addr(i: u32, k: u32) -> String {
    format!("{}.{}", FABRIC_NETS[(k - 1) as usize], last_octet(i))
}

pub fn agent_url(i: u32) -> String {
    format!("https://{}:{AGENT_PORT}", mgmt_addr(i))
}

/// The lab's storage node runs in the root namespace on the management
/// bridge: NBD and its REST API.
/// Every host's bridge for guests' NICs.
pub const GUEST_BRIDGE: &str = "br-guest";
/// The switch joining the hosts' guest bridges.
pub const GUEST_FABRIC_NS: &str = "ferry-guestnet";
/// A machine outside the hosts, on the guests' network.
pub const CLIENT_NS: &str = "ferry-client";
/// The guests' network, /24: the client is .2, guests from .100.
pub const GUEST_NET: &str = "198.19.250";
pub const CLIENT_ADDR: &str = "198.19.250.2";

/// A guest's address on the guests' network (`n` from 0).
pub fn guest_addr(n: u32) -> String {
    format!("{GUEST_NET}.{}", 100 + n % 150)
}

pub const STORAGE_NBD_PORT: u16 = 10809;
pub const STORAGE_API_PORT: u16 = 7900;
pub const STORAGE_NODE: &str = "storage1";

pub fn storage_url() -> String {
    storage_node_url(1)
}

/// Storage node `i` (from 1): `storage<i>`, on the management bridge, at
/// ports [`STORAGE_NBD_PORT`] and [`STORAGE_API_PORT`] plus `i - 1`.
pub fn storage_node(i: u32) -> String {
    format!("storage{i}")
}

pub fn storage_ports(i: u32) -> (u16, u16) {
    let k = (i.max(1) - 1) as u16;
    (STORAGE_NBD_PORT + k, STORAGE_API_PORT + k)
}

pub fn storage_node_url(i: u32) -> String {
    format!("https://{CONTROL_MGMT_ADDR}:{}", storage_ports(i).1)
}

/// Its pid file's name under the control directory (`storage.pid` for the first).
pub fn storage_pid_name(i: u32) -> String {
    if i <= 1 {
        "storage".into()
    } else {
        storage_node(i)
    }
}

/// Every address a host of the lab can connect from, with the host's name.
pub fn peer_addresses(spec: &LabSpec) -> Vec<(std::net::IpAddr, String)> {
    let mut v = Vec::new();
    for i in 1..=spec.hosts {
        let mut addrs = vec![mgmt_addr(i)];
        addrs.extend((1..=spec.nics).map(|k| nic_addr(i, k)));
        for a in addrs {
            if let Ok(ip) = a.parse() {
                v.push((ip, host_name(i)));
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> LabSpec {
        LabSpec {
            hosts: 3,
            nics: 2,
            rate: "1gbit".into(),
            mtu: 1500,
            host_memory: 4 << 30,
            cpus: BTreeMap::new(),
        }
    }

    #[test]
    fn addresses_stay_in_benchmarking_space() {
        for i in 1..=MAX_HOSTS {
            for k in 1..=MAX_NICS {
                let a = nic_addr(i, k);
                assert!(a.starts_with("198.18.") || a.starts_with("198.19."), "{a}");
                assert!(
                    !a.starts_with("198.18.0.") && !a.starts_with("198.19.0."),
                    "{a}"
                );
                let last: u32 = a.rsplit('.').next().unwrap().parse().unwrap();
                assert!(last < 255);
            }
            assert!(mgmt_addr(i).starts_with("198.18.0."));
        }
    }

    #[test]
    fn interface_names_fit_linux_limit() {
        assert!(switch_port(MAX_HOSTS, MAX_NICS).len() <= 15);
        assert!(mgmt_port(MAX_HOSTS).len() <= 15);
        assert!(MGMT_BRIDGE.len() <= 15);
    }

    #[test]
    fn rates_parse_and_bad_ones_are_named() {
        assert_eq!(parse_rate("1gbit").unwrap(), 1_000_000_000);
        assert_eq!(parse_rate("500mbit").unwrap(), 500_000_000);
        assert!(parse_rate("fast").unwrap_err().to_string().contains("fast"));
        assert!(parse_rate("0mbit").is_err());
    }

    #[test]
    fn spec_validation_names_the_flag() {
        let mut s = spec();
        s.validate().unwrap();
        s.hosts = 0;
        assert!(s.validate().unwrap_err().to_string().contains("--hosts"));
        let mut s = spec();
        s.mtu = 10000;
        assert!(s.validate().unwrap_err().to_string().contains("--mtu"));
    }

    #[test]
    fn names_parse_back() {
        assert_eq!(host_index("host12"), Some(12));
        assert_eq!(host_index("hostx"), None);
        assert_eq!(nic_index(1, "nic2"), Some(2));
        assert_eq!(nic_index(1, "ens1f1"), Some(2));
        assert_eq!(nic_index(2, "eth4"), Some(1));
        assert_eq!(nic_index(3, "enp4s0"), Some(2));
        assert_eq!(nic_index(1, "eth4"), None);
        assert_eq!(nic_index(2, "eth0"), None);
        for i in 1..=MAX_HOSTS {
            for k in 1..=MAX_NICS {
                assert!(nic_name(i, k).len() <= 15);
                assert_eq!(nic_index(i, &nic_name(i, k)), Some(k));
            }
        }
        // three hosts, three naming schemes
        assert_ne!(nic_name(1, 1), nic_name(2, 1));
        assert_ne!(nic_name(2, 1), nic_name(3, 1));
    }
}
