//! Times the cluster-wide storage policy manager on synthetic clusters: the
//! same `policy_manager::allocate` the control service runs every second.
//!
//!     cargo run --release -p ferry-control --example policy_sim [HOSTS] [FLOWS] [NODES]
//!
//! Defaults: 1,000 hosts, 10,000 flows (10 per host: VMs with disks), 50
//! storage nodes, 500 policies — a third Aggregated, spread over the nodes.

use std::collections::BTreeMap;
use std::time::Instant;

use ferry_api::storage::{Policy, PolicyKind};
use ferry_control::policy_manager::{allocate, FlowDemand};
use rand::{Rng, SeedableRng};

fn main() {
    let arg = |i: usize, d: usize| {
        std::env::args()
            .nth(i)
            .and_then(|s| s.parse().ok())
            .unwrap_or(d)
    };
    let (hosts, flows, nodes) = (arg(1, 1000), arg(2, 10_000), arg(3, 50));
    let mut rng = rand::rngs::StdRng::seed_from_u64(2026);
    let mut policies = BTreeMap::new();
    for i in 0..500 {
        let kind = if i % 3 == 0 {
            PolicyKind::Aggregated
        } else {
            PolicyKind::Dedicated
        };
        let name = format!("p{i}");
        policies.insert(
            name.clone(),
            Policy {
                name,
                kind,
                min_iops: rng.gen_range(0..2000),
                max_iops: rng.gen_range(2000..20000),
                max_bandwidth: rng.gen_range(0..1u64 << 30),
            },
        );
    }
    // each flow's VM lives on one host: flow i is VM (i mod 5·hosts), host (VM mod hosts)
    let host_of = |i: usize| (i % (hosts * 5)) % hosts;
    let demands: Vec<FlowDemand> = (0..flows)
        .map(|i| FlowDemand {
            flow: format!("disk{i}/vm{}", i % (hosts * 5)),
            node: format!("storage{}", rng.gen_range(0..nodes)),
            policy: Some(format!("p{}", rng.gen_range(0..500))),
            demand_iops: rng.gen_range(0.0..5000.0),
        })
        .collect();
    let vm_host: BTreeMap<String, usize> = (0..flows)
        .map(|i| (demands[i].flow.clone(), host_of(i)))
        .collect();
    let mut times = Vec::new();
    let (mut n, mut hosts_served) = (0, 0);
    for _ in 0..20 {
        let t = Instant::now();
        let alloc = allocate(&policies, &demands);
        // what the control service then does: each host's flows gathered to
        // push to that host's storage connections (minimum IOPS per host)
        let mut per_host: BTreeMap<usize, u64> = BTreeMap::new();
        for ((_, flow), a) in &alloc {
            if let Some(h) = vm_host.get(flow) {
                *per_host.entry(*h).or_default() += a.min_iops;
            }
        }
        n = alloc.len();
        hosts_served = per_host.len();
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    println!(
        "{hosts} hosts, {flows} flows, {nodes} storage nodes, 500 policies: {n} allocations \
         over {hosts_served} hosts; recompute and per-host gathering median {:.2} ms, max {:.2} ms (20 runs)",
        times[times.len() / 2],
        times[times.len() - 1]
    );
}
