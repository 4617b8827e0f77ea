//! Prometheus metrics of the whole cluster, served by the control service at
//! `GET /metrics` (text format 0.0.4, behind the cluster credential).
//!
//! Hosts and NICs come from the agents and flows from the storage nodes at
//! scrape time; migrations and drains are recorded as their events pass
//! through the control service ([`Recorder`]). Names carry their units.

use std::collections::BTreeMap;
use std::fmt::Write;

use ferry_api::drain::DrainEvent;
use ferry_api::storage::FlowInfo;
use ferry_api::{HostEntry, MigrationEvent};

/// The last known state of one migration.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MigrationGauge {
    pub source: String,
    pub target: String,
    pub transferred: u64,
    pub remaining: u64,
    pub throughput: f64,
    /// 0 running, 1 completed, 2 failed.
    pub state: u8,
    pub downtime_ms: Option<u64>,
}

/// The last known state of one drain.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DrainGauge {
    pub planned: u64,
    pub moved: u64,
    pub failed: u64,
    pub done: bool,
}

/// Migrations and drains, as seen in their event streams.
#[derive(Debug, Default)]
pub struct Recorder {
    pub migrations: BTreeMap<String, MigrationGauge>,
    pub drains: BTreeMap<String, DrainGauge>,
}

impl Recorder {
    pub fn migration(&mut self, vm: &str, source: &str, target: &str, ev: &MigrationEvent) {
        let g = self.migrations.entry(vm.to_string()).or_default();
        if g.source != source || g.target != target {
            *g = MigrationGauge {
                source: source.into(),
                target: target.into(),
                ..Default::default()
            };
        }
        match ev {
            MigrationEvent::Progress(p) => {
                g.transferred = p.transferred;
                g.remaining = p.remaining;
                g.throughput = p.throughput;
            }
            MigrationEvent::Completed(r) => {
                g.state = 1;
                g.transferred = r.bytes_transferred;
                g.remaining = 0;
                g.downtime_ms = Some(r.guest_downtime_ms.max(r.downtime_ms));
            }
            MigrationEvent::Failed { .. } => g.state = 2,
            _ => {}
        }
    }

    pub fn drain(&mut self, host: &str, ev: &DrainEvent) {
        let g = self.drains.entry(host.to_string()).or_default();
        match ev {
            DrainEvent::Plan { moves, .. } => {
                *g = DrainGauge {
                    planned: moves.len() as u64,
                    ..Default::default()
                }
            }
            DrainEvent::Moved(_) => g.moved += 1,
            DrainEvent::Failed { .. } => g.failed += 1,
            DrainEvent::Done(_) => g.done = true,
            _ => {}
        }
    }
}

/// A label value with `\`, `"` and newlines escaped.
fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn labels(pairs: &[(&str, &str)]) -> String {
    let inner: Vec<String> = pairs
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", esc(v)))
        .collect();
    format!("{{{}}}", inner.join(","))
}

/// Text exposition of metric families: (name, type, help, samples).
struct Out(String);

impl Out {
    fn family(&mut self, name: &str, kind: &str, help: &str, samples: Vec<(String, f64)>) {
        let _ = writeln!(self.0, "# HELP {name} {help}");
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
        for (l, v) in samples {
            let _ = writeln!(self.0, "{name}{l} {v}");
        }
    }
}

pub fn render(hosts: &[HostEntry], flows: &[FlowInfo], rec: &Recorder) -> String {
    let mut o = Out(String::new());
    o.family(
        "ferry_host_up",
        "gauge",
        "1 if the host's agent answers",
        hosts
            .iter()
            .map(|h| {
                (
                    labels(&[("host", &h.name)]),
                    if h.reachable { 1.0 } else { 0.0 },
                )
            })
            .collect(),
    );
    o.family(
        "ferry_host_heartbeat_age_seconds",
        "gauge",
        "Time since the host's agent last answered",
        hosts
            .iter()
            .filter_map(|h| {
                Some((
                    labels(&[("host", &h.name)]),
                    h.last_heartbeat_ms? as f64 / 1e3,
                ))
            })
            .collect(),
    );
    let infos: Vec<_> = hosts.iter().filter_map(|h| h.info.as_ref()).collect();
    o.family(
        "ferry_host_memory_free_bytes",
        "gauge",
        "Memory a host can still give VMs",
        infos
            .iter()
            .map(|i| (labels(&[("host", &i.name)]), i.memory_free as f64))
            .collect(),
    );
    let nic = |f: &dyn Fn(&ferry_api::NicInfo) -> f64| {
        infos
            .iter()
            .flat_map(|i| {
                i.nics
                    .iter()
                    .map(|n| (labels(&[("host", &i.name), ("nic", &n.name)]), f(n)))
                    .collect::<Vec<_>>()
            })
            .collect::<Vec<_>>()
    };
    o.family(
        "ferry_nic_transmit_bytes_total",
        "counter",
        "Bytes sent on a NIC",
        nic(&|n| n.tx_bytes as f64),
    );
    o.family(
        "ferry_nic_receive_bytes_total",
        "counter",
        "Bytes received on a NIC",
        nic(&|n| n.rx_bytes as f64),
    );
    let now = ferry_api::util::now_ms();
    o.family(
        "ferry_vm_storage_paused_seconds",
        "gauge",
        "How long a guest has been paused waiting for its storage (0 when it is not paused)",
        infos
            .iter()
            .flat_map(|i| i.vms.iter())
            .filter(|v| v.state != "incoming")
            .map(|v| {
                let secs = match &v.storage_pause {
                    Some(p) if p.active() => now.saturating_sub(p.since_ms) as f64 / 1e3,
                    _ => 0.0,
                };
                (labels(&[("vm", &v.name), ("host", &v.host)]), secs)
            })
            .collect(),
    );
    o.family(
        "ferry_nic_up",
        "gauge",
        "1 if the NIC has carrier",
        nic(&|n| if n.up { 1.0 } else { 0.0 }),
    );

    let mig = |f: &dyn Fn(&MigrationGauge) -> Option<f64>| {
        rec.migrations
            .iter()
            .filter_map(|(vm, g)| {
                f(g).map(|v| {
                    (
                        labels(&[("vm", vm), ("source", &g.source), ("target", &g.target)]),
                        v,
                    )
                })
            })
            .collect::<Vec<_>>()
    };
    o.family(
        "ferry_migration_transferred_bytes",
        "gauge",
        "Bytes a VM's latest migration has moved",
        mig(&|g| Some(g.transferred as f64)),
    );
    o.family(
        "ferry_migration_remaining_bytes",
        "gauge",
        "Bytes QEMU still has to send",
        mig(&|g| Some(g.remaining as f64)),
    );
    o.family(
        "ferry_migration_throughput_bytes_per_second",
        "gauge",
        "Migration throughput at the last progress report",
        mig(&|g| Some(g.throughput)),
    );
    o.family(
        "ferry_migration_state",
        "gauge",
        "0 running, 1 completed, 2 failed (the guest stays on the source)",
        mig(&|g| Some(g.state as f64)),
    );
    o.family(
        "ferry_migration_downtime_seconds",
        "gauge",
        "Downtime the guest saw in a completed migration (QEMU's blackout and the switch-over until the target ran it)",
        mig(&|g| g.downtime_ms.map(|d| d as f64 / 1000.0)),
    );
    let drain = |f: &dyn Fn(&DrainGauge) -> f64| {
        rec.drains
            .iter()
            .map(|(h, g)| (labels(&[("host", h)]), f(g)))
            .collect::<Vec<_>>()
    };
    o.family(
        "ferry_drain_planned_vms",
        "gauge",
        "VMs a drain plans to move",
        drain(&|g| g.planned as f64),
    );
    o.family(
        "ferry_drain_moved_vms",
        "gauge",
        "VMs a drain has moved",
        drain(&|g| g.moved as f64),
    );
    o.family(
        "ferry_drain_failed_vms",
        "gauge",
        "VMs a drain could not move",
        drain(&|g| g.failed as f64),
    );
    o.family(
        "ferry_drain_done",
        "gauge",
        "1 once a drain has finished",
        drain(&|g| if g.done { 1.0 } else { 0.0 }),
    );

    let flow = |f: &dyn Fn(&FlowInfo) -> f64| {
        flows
            .iter()
            .map(|x| {
                (
                    labels(&[
                        ("flow", &x.id),
                        ("disk", &x.disk),
                        ("node", &x.node),
                        ("initiator", &x.initiator),
                        ("host", &x.host),
                    ]),
                    f(x),
                )
            })
            .collect::<Vec<_>>()
    };
    o.family(
        "ferry_storage_flow_iops",
        "gauge",
        "Normalized IOPS over the last second",
        flow(&|x| x.iops),
    );
    o.family(
        "ferry_storage_flow_bandwidth_bytes_per_second",
        "gauge",
        "Bytes per second over the last second",
        flow(&|x| x.bandwidth),
    );
    o.family(
        "ferry_storage_flow_latency_seconds",
        "gauge",
        "Mean request latency (queue + I/O) over the last second",
        flow(&|x| x.latency_us / 1e6),
    );
    o.family(
        "ferry_storage_flow_min_iops",
        "gauge",
        "The flow's reservation (0: none)",
        flow(&|x| x.min_iops as f64),
    );
    o.family(
        "ferry_storage_flow_max_iops",
        "gauge",
        "The flow's IOPS limit (0: none)",
        flow(&|x| x.max_iops as f64),
    );
    o.family(
        "ferry_storage_flow_status",
        "gauge",
        "1 for the flow's current status",
        flows
            .iter()
            .map(|x| {
                let status = format!("{:?}", x.status);
                (
                    labels(&[("flow", &x.id), ("node", &x.node), ("status", &status)]),
                    1.0,
                )
            })
            .collect(),
    );
    o.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_api::storage::FlowStatus;

    fn flow(id: &str) -> FlowInfo {
        FlowInfo {
            id: id.into(),
            disk: "d".into(),
            node: "storage1".into(),
            initiator: "vm\"1".into(),
            host: "host1".into(),
            policy: None,
            connections: 1,
            iops: 250.0,
            bandwidth: 1e6,
            latency_us: 500.0,
            demand_iops: 250.0,
            backlogged: 0.0,
            min_iops: 0,
            max_iops: 500,
            max_bandwidth: 0,
            status: FlowStatus::InsufficientThroughput,
        }
    }

    #[test]
    fn families_are_typed_and_labels_escaped() {
        let mut rec = Recorder::default();
        let failed = MigrationEvent::Failed {
            error: ferry_api::ApiError::internal("x"),
        };
        rec.migration("vm1", "host1", "host2", &failed);
        rec.drain(
            "host1",
            &DrainEvent::Failed {
                vm: "x".into(),
                reason: "r".into(),
            },
        );
        let text = render(&[], &[flow("d/vm1")], &rec);
        assert!(
            text.contains("# TYPE ferry_storage_flow_iops gauge"),
            "{text}"
        );
        assert!(
            text.contains("initiator=\"vm\\\"1\""),
            "quotes escaped: {text}"
        );
        assert!(
            text.contains("ferry_storage_flow_latency_seconds{") && text.contains("} 0.0005"),
            "{text}"
        );
        assert!(
            text.contains("status=\"InsufficientThroughput\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("ferry_drain_failed_vms{host=\"host1\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("ferry_migration_state{vm=\"vm1\",source=\"host1\",target=\"host2\"} 2"),
            "{text}"
        );
        // a guest paused for its storage, and one running
        let host: HostEntry = serde_json::from_value(serde_json::json!({
            "name": "host1", "agent_url": "", "reachable": true,
            "info": {"name": "host1", "agent_url": "", "memory_total": 0, "memory_reserved": 0,
                "memory_free": 0, "nics": [], "vms": [
                {"name": "p", "host": "host1", "state": "io-error", "pid": 1,
                 "spec": {"name": "p", "memory": 134217728u64, "fill": 0, "dirty_rate": 0},
                 "storage_pause": {"storage": "storage1", "state": "paused",
                    "since_ms": ferry_api::util::now_ms() - 4_000}},
                {"name": "r", "host": "host1", "state": "running", "pid": 2,
                 "spec": {"name": "r", "memory": 134217728u64, "fill": 0, "dirty_rate": 0}}]}
        }))
        .unwrap();
        let text = render(&[host], &[], &rec);
        let paused = |vm: &str| {
            text.lines()
                .find(|l| l.starts_with(&format!("ferry_vm_storage_paused_seconds{{vm=\"{vm}\"")))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .unwrap()
        };
        assert!((3.5..60.0).contains(&paused("p")), "{text}");
        assert_eq!(paused("r"), 0.0, "{text}");
        // every sample line belongs to a family declared before it
        let mut declared = std::collections::BTreeSet::new();
        for l in text.lines() {
            if let Some(rest) = l.strip_prefix("# TYPE ") {
                declared.insert(rest.split(' ').next().unwrap_or("").to_string());
            } else if !l.starts_with('#') {
                let name = l.split(['{', ' ']).next().unwrap_or("");
                assert!(declared.contains(name), "{l}");
            }
        }
    }
}
