//! `ferry host validate`: the speed checklist as software.
//!
//! The control service gathers [`HostFacts`] from every agent, has agents
//! probe every path (host pair × fabric) with don't-fragment pings and a
//! short throughput test, and judges it all in [`evaluate`] — a pure
//! function, unit-tested below — into rows naming host, NIC, peer and fix.
//! Consistency is judged across all hosts even when one host is asked about.

use std::collections::BTreeMap;

use ferry_api::validation::*;

/// A path probe from `host`'s `nic` to `peer` on `fabric`.
#[derive(Debug, Clone)]
pub struct PathResult {
    pub host: String,
    pub peer: String,
    pub nic: String,
    pub peer_addr: String,
    pub result: Result<PathProbeResult, String>,
}

/// A throughput test from `host`'s `nic` to `peer`, in bit/s.
#[derive(Debug, Clone)]
pub struct ThroughputResult {
    pub host: String,
    pub peer: String,
    pub nic: String,
    pub fabric: u32,
    pub result: Result<f64, String>,
}

/// Exit latency above which an idle state counts as deep (C1E and below).
pub const DEEP_IDLE_US: u64 = 10;
/// A path below this share of its rate (or of its fabric's median) fails.
pub const SLOW_PATH: f64 = 0.5;
/// Below this share it warns.
pub const DEGRADED_PATH: f64 = 0.75;

fn row(
    check: &str,
    host: &str,
    nic: Option<&str>,
    peer: Option<&str>,
    status: CheckStatus,
    observed: String,
    fix: Option<String>,
) -> CheckOutcome {
    CheckOutcome {
        check: check.into(),
        host: host.into(),
        nic: nic.map(str::to_string),
        peer: peer.map(str::to_string),
        status,
        observed,
        fix,
    }
}

pub fn gbit(bps: f64) -> String {
    if bps >= 1e9 {
        format!("{:.2} Gbit/s", bps / 1e9)
    } else {
        format!("{:.0} Mbit/s", bps / 1e6)
    }
}

/// The most common value, if any.
fn majority<T: Ord + Clone>(values: impl Iterator<Item = T>) -> Option<T> {
    let mut counts: BTreeMap<T, usize> = BTreeMap::new();
    for v in values {
        *counts.entry(v).or_default() += 1;
    }
    counts.into_iter().max_by_key(|(_, n)| *n).map(|(v, _)| v)
}

fn nic_of<'a>(facts: &'a [HostFacts], host: &str, nic: &str) -> Option<&'a NicFacts> {
    facts
        .iter()
        .find(|f| f.host == host)?
        .nics
        .iter()
        .find(|n| n.name == nic)
}

/// Judges facts and probes. Rows come out grouped by check.
pub fn evaluate(
    facts: &[HostFacts],
    paths: &[PathResult],
    tputs: &[ThroughputResult],
) -> Vec<CheckOutcome> {
    let mut out = Vec::new();
    // links and MTU per NIC, MTU against the fabric's majority
    let mut fabric_mtu: BTreeMap<u32, u32> = BTreeMap::new();
    let fabrics: Vec<u32> = {
        let mut f: Vec<u32> = facts
            .iter()
            .flat_map(|h| h.nics.iter().map(|n| n.fabric))
            .collect();
        f.sort();
        f.dedup();
        f
    };
    for k in &fabrics {
        let mtus = facts
            .iter()
            .flat_map(|h| h.nics.iter())
            .filter(|n| n.fabric == *k)
            .map(|n| n.mtu);
        if let Some(m) = majority(mtus) {
            fabric_mtu.insert(*k, m);
        }
    }
    for h in facts {
        for n in &h.nics {
            let rate = match (n.nominal_rate, n.shaped_rate) {
                (Some(r), Some(s)) if s != r => {
                    format!("rated {}, shaped to {}", gbit(r as f64), gbit(s as f64))
                }
                (Some(r), _) => format!("rated {}", gbit(r as f64)),
                (None, Some(s)) => format!("shaped to {}", gbit(s as f64)),
                (None, None) => "rate unknown".into(),
            };
            if n.up {
                out.push(row(
                    "link",
                    &h.host,
                    Some(&n.name),
                    None,
                    CheckStatus::Pass,
                    format!(
                        "{} on fabric {}: up, {rate}; carries live migration",
                        n.address,
                        n.fabric_name()
                    ),
                    None,
                ));
            } else {
                out.push(row(
                    "link",
                    &h.host,
                    Some(&n.name),
                    None,
                    CheckStatus::Fail,
                    format!(
                        "{} on fabric {}: no carrier ({}); migrations avoid it",
                        n.address,
                        n.fabric_name(),
                        n.oper_state
                    ),
                    Some(format!(
                        "check the cable and switch port of {} {} (lab: `ferry lab link {} {} up`)",
                        h.host, n.name, h.host, n.name
                    )),
                ));
            }
            let want = fabric_mtu.get(&n.fabric).copied().unwrap_or(n.mtu);
            if n.mtu == want {
                out.push(row(
                    "mtu",
                    &h.host,
                    Some(&n.name),
                    None,
                    CheckStatus::Pass,
                    format!("MTU {}, as every NIC on fabric {}", n.mtu, n.fabric_name()),
                    None,
                ));
            } else {
                out.push(row(
                    "mtu",
                    &h.host,
                    Some(&n.name),
                    None,
                    CheckStatus::Fail,
                    format!(
                        "MTU {} differs from the {} the other NICs on fabric {} use",
                        n.mtu,
                        want,
                        n.fabric_name()
                    ),
                    Some(format!(
                        "on {}: ip link set dev {} mtu {want}",
                        h.host, n.name
                    )),
                ));
            }
        }
    }
    // MTU end to end, per path
    for p in paths {
        let me = nic_of(facts, &p.host, &p.nic);
        let peer_nic = me.and_then(|m| {
            facts
                .iter()
                .find(|f| f.host == p.peer)?
                .nics
                .iter()
                .find(|n| n.fabric == m.fabric)
        });
        let r = match &p.result {
            Err(e) => row(
                "mtu-path",
                &p.host,
                Some(&p.nic),
                Some(&p.peer),
                CheckStatus::Fail,
                format!("probe to {} failed: {e}", p.peer_addr),
                None,
            ),
            Ok(r) if r.largest == 0 => row(
                "mtu-path",
                &p.host,
                Some(&p.nic),
                Some(&p.peer),
                CheckStatus::Fail,
                format!(
                    "no packet reaches {} ({}), not even {} bytes: the path is down",
                    p.peer, p.peer_addr, MIN_PACKET
                ),
                Some("check both ends' links and the fabric switch".into()),
            ),
            Ok(r) if r.largest < r.size => {
                let (culprit, fix) = match peer_nic {
                    Some(pn) if pn.mtu < r.size => (
                        format!("{} {} has MTU {}", p.peer, pn.name, pn.mtu),
                        format!(
                            "make {} {} and {} {} agree (ip link set dev … mtu {})",
                            p.host,
                            p.nic,
                            p.peer,
                            pn.name,
                            r.size.max(pn.mtu)
                        ),
                    ),
                    _ => (
                        format!(
                            "something on fabric {} drops them",
                            me.map(|m| m.fabric_name()).unwrap_or_default()
                        ),
                        "check the switch ports' MTU on this fabric".into(),
                    ),
                };
                row("mtu-path", &p.host, Some(&p.nic), Some(&p.peer), CheckStatus::Fail,
                    format!("{}-byte don't-fragment packets to {} are lost; the largest that passes is {}: {culprit}", r.size, p.peer_addr, r.largest),
                    Some(fix))
            }
            Ok(r) => row(
                "mtu-path",
                &p.host,
                Some(&p.nic),
                Some(&p.peer),
                CheckStatus::Pass,
                format!(
                    "{}-byte don't-fragment packets reach {}",
                    r.size, p.peer_addr
                ),
                None,
            ),
        };
        out.push(r);
    }
    // throughput per path, against the NICs' rate and the fabric's median
    let mut medians: BTreeMap<u32, f64> = BTreeMap::new();
    for k in &fabrics {
        let mut v: Vec<f64> = tputs
            .iter()
            .filter(|t| t.fabric == *k)
            .filter_map(|t| t.result.clone().ok())
            .collect();
        v.sort_by(|a, b| a.total_cmp(b));
        if !v.is_empty() {
            medians.insert(*k, v[v.len() / 2]);
        }
    }
    for t in tputs {
        let rate = [
            nic_of(facts, &t.host, &t.nic),
            facts
                .iter()
                .find(|f| f.host == t.peer)
                .and_then(|f| f.nics.iter().find(|n| n.fabric == t.fabric)),
        ]
        .iter()
        .filter_map(|n| n.and_then(|n| n.nominal_rate))
        .min();
        let r = match &t.result {
            Err(e) => row(
                "throughput",
                &t.host,
                Some(&t.nic),
                Some(&t.peer),
                CheckStatus::Fail,
                format!("test failed: {e}"),
                None,
            ),
            Ok(bps) => {
                let of_rate = rate.map(|r| bps / r as f64);
                let of_median = medians.get(&t.fabric).map(|m| bps / m);
                let worst = of_rate
                    .into_iter()
                    .chain(of_median)
                    .fold(f64::INFINITY, f64::min);
                let what = match rate {
                    Some(r) => format!(
                        "{} = {:.0}% of the {} link rate",
                        gbit(*bps),
                        of_rate.unwrap_or(0.0) * 100.0,
                        gbit(r as f64)
                    ),
                    None => format!("{} (link rate unknown)", gbit(*bps)),
                };
                let fabric = nic_of(facts, &t.host, &t.nic)
                    .map(|n| n.fabric_name())
                    .unwrap_or_else(|| t.fabric.to_string());
                let what = match of_median {
                    Some(m) => format!("{what}, {:.0}% of the fabric {fabric} median", m * 100.0,),
                    None => what,
                };
                let status = if worst < SLOW_PATH {
                    CheckStatus::Fail
                } else if worst < DEGRADED_PATH {
                    CheckStatus::Warn
                } else {
                    CheckStatus::Pass
                };
                let fix = (status != CheckStatus::Pass).then(|| {
                    format!("look for shaping, errors or a slow port on {} {} and {} (tc qdisc show; ethtool -S)", t.host, t.nic, t.peer)
                });
                row(
                    "throughput",
                    &t.host,
                    Some(&t.nic),
                    Some(&t.peer),
                    status,
                    what,
                    fix,
                )
            }
        };
        out.push(r);
    }
    // CPU power and NIC queues, per host
    for h in facts {
        out.push(match (&h.cpu.governors.value, &h.cpu.governors.unavailable) {
            (Some(g), _) if g.iter().all(|g| g == "performance") => row("cpu-governor", &h.host, None, None, CheckStatus::Pass, "performance on every CPU".into(), None),
            (Some(g), _) => row("cpu-governor", &h.host, None, None, CheckStatus::Warn,
                format!("governors in use: {}", dedup(g).join(", ")),
                Some("cpupower frequency-set -g performance (or the BIOS 'maximum performance' profile)".into())),
            (None, why) => row("cpu-governor", &h.host, None, None, CheckStatus::NotAvailable, why.clone().unwrap_or_default(), None),
        });
        out.push(match (&h.cpu.idle_states.value, &h.cpu.idle_states.unavailable) {
            (Some(states), _) => {
                let deep: Vec<&IdleState> = states.iter().filter(|s| s.latency_us > DEEP_IDLE_US && s.enabled_on > 0).collect();
                let all = states.iter().map(|s| format!("{} ({} µs)", s.name, s.latency_us)).collect::<Vec<_>>().join(", ");
                if deep.is_empty() {
                    row("cpu-idle", &h.host, None, None, CheckStatus::Pass,
                        format!("no deep C-state enabled; states: {all}; driver {}", h.cpu.idle_driver.clone().unwrap_or_default()), None)
                } else {
                    row("cpu-idle", &h.host, None, None, CheckStatus::Warn,
                        format!("deep C-states enabled: {} (deep states and C1E cut live-migration link use from ~60% to ~20%)",
                            deep.iter().map(|s| format!("{} ({} µs, on {}/{} CPUs)", s.name, s.latency_us, s.enabled_on, s.cpus)).collect::<Vec<_>>().join(", ")),
                        Some(format!("cpupower idle-set -D {DEEP_IDLE_US}, or disable C-states/C1E in the BIOS")))
                }
            }
            (None, why) => row("cpu-idle", &h.host, None, None, CheckStatus::NotAvailable, why.clone().unwrap_or_default(), None),
        });
        for n in &h.nics {
            out.push(queue_row(&h.host, n));
            out.push(ring_row(&h.host, n));
        }
        out.push(match (&h.rdma.value, &h.rdma.unavailable) {
            (Some(devs), _) if !devs.is_empty() => row(
                "rdma",
                &h.host,
                None,
                None,
                CheckStatus::Pass,
                format!("RDMA devices: {}", devs.join(", ")),
                None,
            ),
            (_, why) => row(
                "rdma",
                &h.host,
                None,
                None,
                CheckStatus::NotAvailable,
                why.clone().unwrap_or_else(|| "no RDMA device".into()) + "; migrations use TCP",
                None,
            ),
        });
    }
    out.extend(consistency(facts));
    out
}

fn dedup(v: &[String]) -> Vec<String> {
    let mut v = v.to_vec();
    v.sort();
    v.dedup();
    v
}

fn queue_row(host: &str, n: &NicFacts) -> CheckOutcome {
    let Some(c) = &n.channels.value else {
        return row(
            "nic-channels",
            host,
            Some(&n.name),
            None,
            CheckStatus::NotAvailable,
            n.channels.unavailable.clone().unwrap_or_default(),
            None,
        );
    };
    let pairs = [
        ("rx", c.rx, c.max_rx),
        ("tx", c.tx, c.max_tx),
        ("combined", c.combined, c.max_combined),
    ];
    let low: Vec<String> = pairs
        .iter()
        .filter_map(|(k, cur, max)| match (cur, max) {
            (Some(cur), Some(max)) if cur < max => Some(format!("{k} {cur} of {max}")),
            _ => None,
        })
        .collect();
    let all: Vec<String> = pairs
        .iter()
        .filter_map(|(k, cur, max)| Some(format!("{k} {}/{}", (*cur)?, (*max)?)))
        .collect();
    if low.is_empty() {
        row(
            "nic-channels",
            host,
            Some(&n.name),
            None,
            CheckStatus::Pass,
            format!("queues at their maximum ({})", all.join(", ")),
            None,
        )
    } else {
        let fix = pairs
            .iter()
            .filter_map(|(k, _, max)| Some(format!("{k} {}", (*max)?)))
            .collect::<Vec<_>>()
            .join(" ");
        row("nic-channels", host, Some(&n.name), None, CheckStatus::Warn,
            format!("fewer queues than the NIC offers: {} (receive-side scaling spreads a migration over fewer CPUs)", low.join(", ")),
            Some(format!("on {host}: ethtool -L {} {fix}", n.name)))
    }
}

fn ring_row(host: &str, n: &NicFacts) -> CheckOutcome {
    let Some(r) = &n.rings.value else {
        return row(
            "nic-rings",
            host,
            Some(&n.name),
            None,
            CheckStatus::NotAvailable,
            n.rings.unavailable.clone().unwrap_or_default(),
            None,
        );
    };
    let small: Vec<String> = [("rx", r.rx, r.max_rx), ("tx", r.tx, r.max_tx)]
        .iter()
        .filter_map(|(k, cur, max)| match (cur, max) {
            (Some(c), Some(m)) if c * 2 <= *m => Some(format!("{k} {c} of {m}")),
            _ => None,
        })
        .collect();
    if small.is_empty() {
        row(
            "nic-rings",
            host,
            Some(&n.name),
            None,
            CheckStatus::Pass,
            "ring buffers at least half their maximum".into(),
            None,
        )
    } else {
        row(
            "nic-rings",
            host,
            Some(&n.name),
            None,
            CheckStatus::Warn,
            format!("small ring buffers: {}", small.join(", ")),
            Some(format!(
                "on {host}: ethtool -G {} rx {} tx {}",
                n.name,
                r.max_rx.unwrap_or(0),
                r.max_tx.unwrap_or(0)
            )),
        )
    }
}

/// Reads one setting of a host, as text to compare across hosts.
type Setting = fn(&HostFacts) -> String;

/// The same settings on every host: NIC count, rates, queue counts, CPU power.
fn consistency(facts: &[HostFacts]) -> Vec<CheckOutcome> {
    let mut out = Vec::new();
    let settings: Vec<(&str, Setting)> = vec![
        ("NICs", |h: &HostFacts| h.nics.len().to_string()),
        ("NIC rates", |h: &HostFacts| {
            h.nics
                .iter()
                .map(|n| n.nominal_rate.map(|r| gbit(r as f64)).unwrap_or("?".into()))
                .collect::<Vec<_>>()
                .join(",")
        }),
        ("NIC queues", |h: &HostFacts| {
            h.nics
                .iter()
                .map(|n| {
                    n.channels
                        .value
                        .as_ref()
                        .map(|c| format!("{:?}/{:?}/{:?}", c.rx, c.tx, c.combined))
                        .unwrap_or("?".into())
                })
                .collect::<Vec<_>>()
                .join(",")
        }),
        ("CPU governor", |h: &HostFacts| {
            h.cpu
                .governors
                .value
                .as_ref()
                .map(|g| dedup(g).join("+"))
                .unwrap_or("n/a".into())
        }),
        ("idle states", |h: &HostFacts| {
            h.cpu
                .idle_states
                .value
                .as_ref()
                .map(|s| {
                    s.iter()
                        .filter(|s| s.enabled_on > 0)
                        .map(|s| s.name.clone())
                        .collect::<Vec<_>>()
                        .join("+")
                })
                .unwrap_or("n/a".into())
        }),
    ];
    for (what, get) in settings {
        let values: Vec<(String, String)> =
            facts.iter().map(|h| (h.host.clone(), get(h))).collect();
        let Some(common) = majority(values.iter().map(|(_, v)| v.clone())) else {
            continue;
        };
        for (host, v) in &values {
            if *v == common {
                out.push(row(
                    "consistency",
                    host,
                    None,
                    None,
                    CheckStatus::Pass,
                    format!("{what}: {v}, as on the other hosts"),
                    None,
                ));
            } else {
                out.push(row(
                    "consistency",
                    host,
                    None,
                    None,
                    CheckStatus::Warn,
                    format!("{what}: {v}, while most hosts have {common}"),
                    Some(format!(
                        "give {host} the same {what} as the rest of the cluster"
                    )),
                ));
            }
        }
    }
    out
}

/// Fabrics found by probing. NICs joined by a pair that a probe reached
/// (either way) share a fabric. A NIC whose link is down keeps the fabric of
/// the NICs on its network. Fabrics are numbered 1… in the order of their
/// first (host, NIC). An up NIC that reaches no NIC of another host is its
/// own fabric, and a failed `reach` row names it.
pub fn assign_fabrics(
    facts: &mut [HostFacts],
    probed: &[(String, ferry_api::NicPath)],
) -> Vec<CheckOutcome> {
    let nodes: Vec<(String, String)> = facts
        .iter()
        .flat_map(|f| f.nics.iter().map(|n| (f.host.clone(), n.name.clone())))
        .collect();
    let index = |h: &str, n: &str| nodes.iter().position(|(a, b)| a == h && b == n);
    let mut parent: Vec<usize> = (0..nodes.len()).collect();
    fn root(p: &mut [usize], mut i: usize) -> usize {
        while p[i] != i {
            p[i] = p[p[i]];
            i = p[i];
        }
        i
    }
    let mut reaches = vec![false; nodes.len()];
    for (host, p) in probed.iter().filter(|(_, p)| p.reachable) {
        if let (Some(a), Some(b)) = (index(host, &p.nic), index(&p.peer, &p.peer_nic)) {
            reaches[a] = true;
            reaches[b] = true;
            let (ra, rb) = (root(&mut parent, a), root(&mut parent, b));
            parent[ra] = rb;
        }
    }
    // a NIC with no reachable pair and its link down joins the NICs on its network
    let nic_of = |i: usize| {
        let (h, n) = &nodes[i];
        facts
            .iter()
            .find(|f| f.host == *h)
            .and_then(|f| f.nics.iter().find(|x| x.name == *n))
            .cloned()
    };
    for i in 0..nodes.len() {
        let Some(me) = nic_of(i) else { continue };
        if reaches[i] || me.up || me.network.is_empty() {
            continue;
        }
        let mate = (0..nodes.len())
            .find(|&j| j != i && reaches[j] && nic_of(j).is_some_and(|o| o.network == me.network));
        if let Some(j) = mate {
            let (ri, rj) = (root(&mut parent, i), root(&mut parent, j));
            parent[ri] = rj;
        }
    }
    let mut numbers: BTreeMap<usize, u32> = BTreeMap::new();
    let mut fabric_of = Vec::with_capacity(nodes.len());
    for i in 0..nodes.len() {
        let r = root(&mut parent, i);
        let next = numbers.len() as u32 + 1;
        fabric_of.push(*numbers.entry(r).or_insert(next));
    }
    let mut rows = Vec::new();
    let hosts_with_nics = facts.iter().filter(|f| !f.nics.is_empty()).count();
    let mut i = 0;
    for f in facts.iter_mut() {
        for n in f.nics.iter_mut() {
            n.fabric = fabric_of[i];
            if n.up && !reaches[i] && hosts_with_nics > 1 {
                let tried: Vec<String> = probed
                    .iter()
                    .filter(|(h, p)| *h == f.host && p.nic == n.name)
                    .map(|(_, p)| {
                        format!(
                            "{} {}: {}",
                            p.peer,
                            p.peer_nic,
                            p.error.as_deref().unwrap_or("no answer")
                        )
                    })
                    .take(3)
                    .collect();
                rows.push(CheckOutcome {
                    check: "reach".into(),
                    host: f.host.clone(),
                    nic: Some(n.name.clone()),
                    peer: None,
                    status: CheckStatus::Fail,
                    observed: format!(
                        "{} reaches no NIC of any other host ({})",
                        n.address,
                        if tried.is_empty() {
                            "no probe answered".to_string()
                        } else {
                            tried.join("; ")
                        }
                    ),
                    fix: Some(format!(
                        "check {}'s cable, switch port and address, or leave it out of `nics` in {}'s agent.toml",
                        n.name, f.host
                    )),
                });
            }
            i += 1;
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nic(name: &str, fabric: u32, host_i: u32, mtu: u32, up: bool) -> NicFacts {
        NicFacts {
            name: name.into(),
            address: format!("198.18.{fabric}.{}", 10 + host_i),
            network: format!("198.18.{fabric}.0/24"),
            fabric,
            mtu,
            up,
            oper_state: if up {
                "up".into()
            } else {
                "lowerlayerdown".into()
            },
            nominal_rate: Some(1_000_000_000),
            shaped_rate: Some(1_000_000_000),
            channels: Probe::ok(Channels {
                max_rx: Some(2),
                max_tx: Some(2),
                rx: Some(2),
                tx: Some(2),
                ..Default::default()
            }),
            rings: Probe::unavailable("ethtool -g: Operation not supported"),
        }
    }

    fn host(i: u32, mtu1: u32, up1: bool) -> HostFacts {
        HostFacts {
            host: format!("host{i}"),
            nics: vec![nic("nic1", 1, i, mtu1, up1), nic("nic2", 2, i, 1500, true)],
            cpu: CpuFacts {
                governors: Probe::unavailable("no cpufreq"),
                idle_driver: Some("haltpoll".into()),
                idle_states: Probe::ok(vec![IdleState {
                    name: "POLL".into(),
                    latency_us: 0,
                    enabled_on: 2,
                    cpus: 2,
                }]),
            },
            rdma: Probe::unavailable("no RDMA device"),
        }
    }

    fn reached(
        h: u32,
        nic: &str,
        p: u32,
        peer_nic: &str,
        ok: bool,
    ) -> (String, ferry_api::NicPath) {
        (
            format!("host{h}"),
            ferry_api::NicPath {
                nic: nic.into(),
                address: String::new(),
                peer: format!("host{p}"),
                peer_nic: peer_nic.into(),
                peer_address: String::new(),
                reachable: ok,
                rtt_us: None,
                error: (!ok).then(|| "Network is unreachable".into()),
                age_ms: 0,
            },
        )
    }

    #[test]
    fn fabrics_come_from_probes_not_addresses() {
        // host1's NICs are in different subnets than host2's, and wired
        // crosswise: nic1 reaches host2's nic2 and nic2 reaches host2's nic1
        let mut facts = vec![host(1, 1500, true), host(2, 1500, true)];
        let probed = vec![
            reached(1, "nic1", 2, "nic2", true),
            reached(1, "nic2", 2, "nic1", true),
            reached(1, "nic1", 2, "nic1", false),
        ];
        let rows = assign_fabrics(&mut facts, &probed);
        assert!(rows.is_empty(), "{rows:?}");
        assert_eq!(facts[0].nics[0].fabric, facts[1].nics[1].fabric);
        assert_eq!(facts[0].nics[1].fabric, facts[1].nics[0].fabric);
        assert_ne!(facts[0].nics[0].fabric, facts[0].nics[1].fabric);
        assert_eq!((facts[0].nics[0].fabric, facts[0].nics[1].fabric), (1, 2));
    }

    #[test]
    fn a_nic_that_reaches_nothing_is_named_and_a_cut_one_keeps_its_network() {
        // host2's nic1 is cut (down); host1's nic2 is up but reaches nothing
        let mut facts = vec![host(1, 1500, true), host(2, 1500, false)];
        let probed = vec![
            reached(1, "nic1", 2, "nic1", false),
            reached(1, "nic2", 2, "nic2", false),
            reached(2, "nic2", 1, "nic2", false),
            reached(3, "nic1", 1, "nic1", true),
        ];
        facts.push(host(3, 1500, true));
        let rows = assign_fabrics(&mut facts, &probed);
        let named: Vec<_> = rows
            .iter()
            .map(|r| (r.host.as_str(), r.nic.as_deref().unwrap_or("")))
            .collect();
        assert_eq!(
            named,
            [("host1", "nic2"), ("host2", "nic2"), ("host3", "nic2")]
        );
        assert!(rows[0]
            .observed
            .contains("reaches no NIC of any other host"));
        assert!(rows[0].observed.contains("Network is unreachable"));
        // the cut NIC is on its network's fabric, with host1's and host3's nic1
        assert_eq!(facts[1].nics[0].fabric, facts[0].nics[0].fabric);
        assert_eq!(facts[2].nics[0].fabric, facts[0].nics[0].fabric);
    }

    fn path(h: u32, p: u32, size: u32, largest: u32) -> PathResult {
        PathResult {
            host: format!("host{h}"),
            peer: format!("host{p}"),
            nic: "nic1".into(),
            peer_addr: format!("198.18.1.{}", 10 + p),
            result: Ok(PathProbeResult {
                nic: "nic1".into(),
                peer_addr: String::new(),
                size,
                largest,
            }),
        }
    }

    fn find<'a>(
        rows: &'a [CheckOutcome],
        check: &str,
        host: &str,
        status: CheckStatus,
    ) -> Vec<&'a CheckOutcome> {
        rows.iter()
            .filter(|r| r.check == check && r.host == host && r.status == status)
            .collect()
    }

    #[test]
    fn clean_cluster_has_no_failure() {
        let facts = [
            host(1, 1500, true),
            host(2, 1500, true),
            host(3, 1500, true),
        ];
        let paths = [path(1, 2, 1500, 1500), path(2, 1, 1500, 1500)];
        let t = |h: u32, p: u32, bps: f64| ThroughputResult {
            host: format!("host{h}"),
            peer: format!("host{p}"),
            nic: "nic1".into(),
            fabric: 1,
            result: Ok(bps),
        };
        let rows = evaluate(
            &facts,
            &paths,
            &[t(1, 2, 950e6), t(1, 3, 948e6), t(2, 3, 951e6)],
        );
        assert!(
            rows.iter().all(|r| r.status != CheckStatus::Fail),
            "{rows:#?}"
        );
        assert!(rows
            .iter()
            .any(|r| r.check == "cpu-governor" && r.status == CheckStatus::NotAvailable));
        assert!(rows
            .iter()
            .any(|r| r.check == "nic-rings" && r.status == CheckStatus::NotAvailable));
    }

    #[test]
    fn mtu_mismatch_names_the_host_and_nic_that_differ() {
        let facts = [
            host(1, 1500, true),
            host(2, 1400, true),
            host(3, 1500, true),
        ];
        let rows = evaluate(&facts, &[path(1, 2, 1500, 1400)], &[]);
        let bad = find(&rows, "mtu", "host2", CheckStatus::Fail);
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].nic.as_deref(), Some("nic1"));
        assert!(bad[0].observed.contains("1400") && bad[0].observed.contains("1500"));
        assert!(find(&rows, "mtu", "host1", CheckStatus::Fail).is_empty());
        let p = find(&rows, "mtu-path", "host1", CheckStatus::Fail);
        assert!(p[0].observed.contains("host2 nic1 has MTU 1400"), "{p:?}");
    }

    #[test]
    fn a_cut_link_is_named() {
        let facts = [host(1, 1500, true), host(2, 1500, false)];
        let rows = evaluate(&facts, &[path(1, 2, 1500, 0)], &[]);
        let l = find(&rows, "link", "host2", CheckStatus::Fail);
        assert_eq!(l[0].nic.as_deref(), Some("nic1"));
        assert!(find(&rows, "mtu-path", "host1", CheckStatus::Fail)[0]
            .observed
            .contains("path is down"));
    }

    #[test]
    fn a_slow_path_is_flagged_against_rate_and_median() {
        let facts = [
            host(1, 1500, true),
            host(2, 1500, true),
            host(3, 1500, true),
        ];
        let t = |h: u32, p: u32, bps: f64| ThroughputResult {
            host: format!("host{h}"),
            peer: format!("host{p}"),
            nic: "nic1".into(),
            fabric: 1,
            result: Ok(bps),
        };
        let rows = evaluate(
            &facts,
            &[],
            &[t(1, 2, 950e6), t(1, 3, 48e6), t(2, 3, 47e6), t(2, 1, 940e6)],
        );
        let slow = find(&rows, "throughput", "host1", CheckStatus::Fail);
        assert_eq!(slow.len(), 1);
        assert_eq!(slow[0].peer.as_deref(), Some("host3"));
        assert!(
            find(&rows, "throughput", "host2", CheckStatus::Fail)[0]
                .peer
                .as_deref()
                == Some("host3")
        );
        assert_eq!(
            find(&rows, "throughput", "host1", CheckStatus::Pass).len(),
            1
        );
    }

    #[test]
    fn deep_idle_states_and_few_queues_warn() {
        let mut h = host(1, 1500, true);
        h.cpu.idle_states = Probe::ok(vec![
            IdleState {
                name: "C1".into(),
                latency_us: 2,
                enabled_on: 2,
                cpus: 2,
            },
            IdleState {
                name: "C6".into(),
                latency_us: 133,
                enabled_on: 2,
                cpus: 2,
            },
        ]);
        h.nics[0].channels = Probe::ok(Channels {
            max_rx: Some(8),
            rx: Some(1),
            ..Default::default()
        });
        let rows = evaluate(&[h], &[], &[]);
        assert!(find(&rows, "cpu-idle", "host1", CheckStatus::Warn)[0]
            .observed
            .contains("C6"));
        let q = find(&rows, "nic-channels", "host1", CheckStatus::Warn);
        assert!(
            q[0].observed.contains("rx 1 of 8")
                && q[0].fix.as_deref().unwrap().contains("ethtool -L nic1")
        );
    }

    #[test]
    fn an_odd_host_is_named_in_consistency() {
        let mut odd = host(3, 1500, true);
        odd.nics.pop();
        let rows = evaluate(&[host(1, 1500, true), host(2, 1500, true), odd], &[], &[]);
        let w = find(&rows, "consistency", "host3", CheckStatus::Warn);
        assert!(w.iter().any(|r| r.observed.starts_with("NICs: 1")), "{w:?}");
    }
}
