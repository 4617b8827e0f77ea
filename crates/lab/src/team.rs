//! What users would build instead of Ferry's transport, from the same NICs,
//! so that the same QEMU migration can be run over each:
//!
//! - `ecmp`: a team hashing each connection onto one NIC. This kernel has no
//!   bonding driver, so the team is an ECMP route hashing on layer 4
//!   (`fib_multipath_hash_policy=1`) to a per-host team address
//!   (`198.19.0.(10+i)/32` on `lo`) with one next hop per NIC — what a
//!   `balance-xor`/LACP bond with `layer3+4` hashing does per connection.
//!   A next hop whose link is down is skipped (`ignore_routes_with_linkdown`)
//!   and so is one whose neighbour stopped answering
//!   (`fib_multipath_use_neigh`), as a bond drops a failed member.
//! - `mptcp`: kernel MPTCP with the in-kernel path manager: every host
//!   announces its NICs after the first (`signal` endpoints) and accepts its
//!   peers' announcements, so a connection to a peer's nic1 address gains one
//!   subflow per NIC. A socket opts in (QEMU: `"mptcp": true`), and the
//!   listener must take joins on every address (`0.0.0.0`): a subflow
//!   arrives at the target's nic2 address, not the one first dialled.
//! - `active-backup`: the same team address, routed over one fabric at a
//!   time (fabric 1 first). A bond in active-backup mode moves its address
//!   to a backup member when its ARP monitor stops hearing the peer; here the
//!   lab's fabrics are independent switches, so both ends must learn of a cut
//!   on one host's cable. A monitor per host ([`crate::monitor`], started by
//!   `ferry lab team active-backup`) probes every peer over every fabric and
//!   moves the route when the active fabric goes silent.
//! - `none`: removes all of them.

use crate::topology::*;
use crate::{run, LabError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TeamKind {
    Ecmp,
    ActiveBackup,
    Mptcp,
    None,
}

/// `ip` arguments routing host `i` to peer `j`'s team address over fabric
/// `k` only (the active-backup team).
pub(crate) fn backup_route(i: u32, j: u32, k: u32) -> Vec<String> {
    [
        "route".to_string(),
        "replace".into(),
        format!("{}/32", team_addr(j)),
        "via".into(),
        nic_addr(j, k),
        "dev".into(),
        nic_name(i, k),
        "src".into(),
        team_addr(i),
    ]
    .into()
}

/// The team address of host `i` (reachable over every NIC with `ecmp`).
pub fn team_addr(i: u32) -> String {
    format!("198.19.0.{}", 10 + i)
}

fn ns(host: &str, args: &[&str]) -> Result<String, LabError> {
    let mut a = vec!["-n", host];
    a.extend_from_slice(args);
    run("ip", &a)
}

fn sysctl(host: &str, key: &str, value: &str) -> Result<(), LabError> {
    run(
        "ip",
        &[
            "netns",
            "exec",
            host,
            "sysctl",
            "-qw",
            &format!("{key}={value}"),
        ],
    )
    .map(|_| ())
}

/// How many subflows a connection may add, and announcements it accepts.
fn mptcp_limits(host: &str, n: u32) -> Result<(), LabError> {
    let n = n.to_string();
    ns(
        host,
        &[
            "mptcp",
            "limits",
            "set",
            "subflows",
            &n,
            "add_addr_accepted",
            &n,
        ],
    )
    .map(|_| ())
}

/// Gives every lab host the alternative `kind` (after removing any other).
/// Returns, per host, the address a peer migrates to.
pub fn set(spec: &LabSpec, kind: TeamKind) -> Result<Vec<(String, String)>, LabError> {
    let mut out = Vec::new();
    for i in 1..=spec.hosts {
        let h = host_name(i);
        // undo whatever was there: routes and address of ecmp, mptcp endpoints
        for j in (1..=spec.hosts).filter(|j| *j != i) {
            let _ = ns(&h, &["route", "del", &format!("{}/32", team_addr(j))]);
        }
        let _ = ns(
            &h,
            &["addr", "del", &format!("{}/32", team_addr(i)), "dev", "lo"],
        );
        ns(&h, &["mptcp", "endpoint", "flush"])?;
        mptcp_limits(&h, 0)?;
        match kind {
            TeamKind::None => out.push((h, nic_addr(i, 1))),
            TeamKind::Ecmp | TeamKind::ActiveBackup => {
                for (k, v) in [
                    ("net.ipv4.fib_multipath_hash_policy", "1"),
                    ("net.ipv4.fib_multipath_use_neigh", "1"),
                    ("net.ipv4.conf.all.ignore_routes_with_linkdown", "1"),
                    ("net.ipv4.conf.all.rp_filter", "0"),
                ] {
                    sysctl(&h, k, v)?;
                }
                for k in 1..=spec.nics {
                    sysctl(
                        &h,
                        &format!("net.ipv4.conf.{}.rp_filter", nic_name(i, k)),
                        "0",
                    )?;
                    sysctl(
                        &h,
                        &format!(
                            "net.ipv4.conf.{}.ignore_routes_with_linkdown",
                            nic_name(i, k)
                        ),
                        "1",
                    )?;
                }
                ns(
                    &h,
                    &["addr", "add", &format!("{}/32", team_addr(i)), "dev", "lo"],
                )?;
                for j in (1..=spec.hosts).filter(|j| *j != i) {
                    if kind == TeamKind::ActiveBackup {
                        let args = backup_route(i, j, 1);
                        ns(&h, &args.iter().map(String::as_str).collect::<Vec<_>>())?;
                        continue;
                    }
                    let dst = format!("{}/32", team_addr(j));
                    let src = team_addr(i);
                    let mut args: Vec<String> = ["route", "replace", &dst, "src", &src]
                        .iter()
                        .map(|s| s.to_string())
                        .collect();
                    for k in 1..=spec.nics {
                        args.extend(
                            ["nexthop", "via", &nic_addr(j, k), "dev", &nic_name(i, k)]
                                .iter()
                                .map(|s| s.to_string()),
                        );
                    }
                    let args: Vec<&str> = args.iter().map(String::as_str).collect();
                    ns(&h, &args)?;
                }
                out.push((h, team_addr(i)));
            }
            TeamKind::Mptcp => {
                mptcp_limits(&h, spec.nics)?;
                for k in 2..=spec.nics {
                    ns(
                        &h,
                        &[
                            "mptcp",
                            "endpoint",
                            "add",
                            &nic_addr(i, k),
                            "dev",
                            &nic_name(i, k),
                            "signal",
                        ],
                    )?;
                }
                out.push((h, nic_addr(i, 1)));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn team_addresses_stay_in_benchmarking_space() {
        for i in 1..=9 {
            let a: std::net::Ipv4Addr = team_addr(i).parse().unwrap();
            // 198.18.0.0/15
            assert_eq!(a.octets()[0], 198);
            assert!(a.octets()[1] == 18 || a.octets()[1] == 19, "{a}");
        }
    }
}
