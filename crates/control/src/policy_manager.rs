//! The cluster-wide storage policy manager: turns policies that span storage
//! nodes into per-flow allocations each node enforces on its own.
//!
//! A node alone can hold a Dedicated policy (each flow gets the policy's
//! numbers) and an Aggregated policy whose flows all live on it (one pool).
//! An Aggregated policy whose flows live on several nodes — a VM with disks
//! on two nodes, a guest cluster spread out — needs a referee: every second
//! the nodes report each flow's demand, and [`allocate`] splits the policy's
//! minimum and maximum between its flows:
//!
//! - **maximum**: in proportion to demand, every flow keeping a floor of
//!   `max × FLOOR / n` so an idle flow can grow back; the parts sum to the
//!   policy's maximum;
//! - **minimum**: flows asking less than an even share get what they ask;
//!   what they leave is split evenly among the others (water-filling), so
//!   the parts sum to the policy's minimum and no flow is reserved more
//!   than it asks while another is short;
//! - **bandwidth**: split like the maximum.
//!
//! Pure and deterministic: the same code serves the control service and the
//! simulation that times it at 1,000 hosts and 10,000 flows.

use std::collections::BTreeMap;

use ferry_api::storage::{Allocation, Policy, PolicyKind};

/// Share of a split maximum kept evenly spread whatever the demand.
pub const FLOOR: f64 = 0.1;

/// One flow as a storage node reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowDemand {
    pub flow: String,
    pub node: String,
    pub policy: Option<String>,
    /// Normalized IOPS asked for over the last second.
    pub demand_iops: f64,
}

/// The allocation of each flow under an Aggregated policy that spans nodes,
/// keyed by (node, flow). Flows under Dedicated policies, under none, or
/// under an Aggregated policy on one node only are left to their node and do
/// not appear.
pub fn allocate(
    policies: &BTreeMap<String, Policy>,
    flows: &[FlowDemand],
) -> BTreeMap<(String, String), Allocation> {
    let mut by_policy: BTreeMap<&str, Vec<&FlowDemand>> = BTreeMap::new();
    for f in flows {
        if let Some(p) = f.policy.as_deref() {
            if policies
                .get(p)
                .is_some_and(|p| p.kind == PolicyKind::Aggregated)
            {
                by_policy.entry(p).or_default().push(f);
            }
        }
    }
    let mut out = BTreeMap::new();
    for (name, fs) in by_policy {
        let Some(p) = policies.get(name) else {
            continue;
        };
        // a policy whose flows all live on one node is that node's own pool
        if fs.iter().all(|f| f.node == fs[0].node) {
            continue;
        }
        let demands: Vec<f64> = fs.iter().map(|f| f.demand_iops.max(0.0)).collect();
        let maxes = split_max(p.max_iops as f64, &demands);
        let bws = split_max(p.max_bandwidth as f64, &demands);
        let mins = split_min(p.min_iops as f64, &demands);
        for (i, f) in fs.iter().enumerate() {
            out.insert(
                (f.node.clone(), f.flow.clone()),
                Allocation {
                    min_iops: mins[i].floor() as u64,
                    max_iops: maxes[i].ceil() as u64,
                    max_bandwidth: bws[i].ceil() as u64,
                },
            );
        }
    }
    out
}

/// Splits a cap (0: none) in proportion to demand above an even floor.
fn split_max(cap: f64, demands: &[f64]) -> Vec<f64> {
    let n = demands.len();
    if cap <= 0.0 || n == 0 {
        return vec![0.0; n];
    }
    let floor = cap * FLOOR / n as f64;
    let rest = cap - floor * n as f64;
    let total: f64 = demands.iter().sum();
    demands
        .iter()
        .map(|d| {
            if total > 0.0 {
                floor + rest * d / total
            } else {
                cap / n as f64
            }
        })
        .collect()
}

/// Splits a reservation by water-filling over demand.
fn split_min(min: f64, demands: &[f64]) -> Vec<f64> {
    let n = demands.len();
    let mut out = vec![0.0; n];
    if min <= 0.0 || n == 0 {
        return out;
    }
    let mut left = min;
    let mut open: Vec<usize> = (0..n).collect();
    // flows asking less than an even share are satisfied; repeat with the rest
    loop {
        let share = left / open.len() as f64;
        let (small, big): (Vec<usize>, Vec<usize>) =
            open.iter().partition(|&&i| demands[i] < share);
        if small.is_empty() {
            for i in big {
                out[i] = share;
            }
            return out;
        }
        for i in small {
            out[i] = demands[i];
            left -= demands[i];
        }
        if big.is_empty() {
            // everyone is satisfied; the unused reservation is spread evenly
            let extra = left / n as f64;
            for o in out.iter_mut() {
                *o += extra;
            }
            return out;
        }
        open = big;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn policy(name: &str, kind: PolicyKind, min: u64, max: u64) -> Policy {
        Policy {
            name: name.into(),
            kind,
            min_iops: min,
            max_iops: max,
            max_bandwidth: 0,
        }
    }

    fn flow(flow: &str, node: &str, policy: &str, demand: f64) -> FlowDemand {
        FlowDemand {
            flow: flow.into(),
            node: node.into(),
            policy: Some(policy.into()),
            demand_iops: demand,
        }
    }

    #[test]
    fn an_aggregated_policy_holds_across_two_nodes() {
        let mut ps = BTreeMap::new();
        ps.insert(
            "agg".into(),
            policy("agg", PolicyKind::Aggregated, 300, 1000),
        );
        ps.insert("ded".into(), policy("ded", PolicyKind::Dedicated, 100, 200));
        // one VM's two disks on two nodes, busy at 3:1
        let flows = vec![
            flow("d1/vm", "storage1", "agg", 900.0),
            flow("d2/vm", "storage2", "agg", 300.0),
            flow("d3/other", "storage1", "ded", 500.0),
        ];
        let a = allocate(&ps, &flows);
        assert_eq!(a.len(), 2, "dedicated flows stay with their node: {a:?}");
        let a1 = a[&("storage1".to_string(), "d1/vm".to_string())];
        let a2 = a[&("storage2".to_string(), "d2/vm".to_string())];
        // the maximum is split, in proportion to demand above the floor
        let sum = a1.max_iops + a2.max_iops;
        assert!((1000..=1002).contains(&sum), "{a1:?} {a2:?}");
        assert!(a1.max_iops > 2 * a2.max_iops, "{a1:?} {a2:?}");
        assert!(a2.max_iops >= 50, "the floor keeps a share: {a2:?}");
        // the minimum is split evenly when both ask for more than half
        assert_eq!((a1.min_iops, a2.min_iops), (150, 150));
    }

    #[test]
    fn a_reservation_goes_where_it_is_asked_for() {
        let d = split_min(300.0, &[20.0, 500.0, 1000.0]);
        assert_eq!(d[0], 20.0);
        assert!(
            (d[1] - 140.0).abs() < 1e-9 && (d[2] - 140.0).abs() < 1e-9,
            "{d:?}"
        );
        let d = split_min(300.0, &[10.0, 20.0]);
        let total: f64 = d.iter().sum();
        assert!((total - 300.0).abs() < 1e-9, "{d:?}");
        let d = split_min(300.0, &[0.0, 0.0, 0.0]);
        assert!(d.iter().all(|x| (*x - 100.0).abs() < 1e-9), "{d:?}");
    }

    #[test]
    fn idle_flows_split_a_cap_evenly() {
        let d = split_max(600.0, &[0.0, 0.0]);
        assert_eq!(d, vec![300.0, 300.0]);
        assert_eq!(split_max(0.0, &[5.0]), vec![0.0]);
    }

    #[test]
    fn splits_always_sum_to_the_policy() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(6);
        for _ in 0..500 {
            let n = rng.gen_range(1..20);
            let demands: Vec<f64> = (0..n)
                .map(|_| {
                    if rng.gen_bool(0.2) {
                        0.0
                    } else {
                        rng.gen_range(0.0..5000.0)
                    }
                })
                .collect();
            let cap = rng.gen_range(1.0..10000.0);
            let s: f64 = split_max(cap, &demands).iter().sum();
            assert!((s - cap).abs() < 1e-6 * cap, "{s} vs {cap}");
            let m: Vec<f64> = split_min(cap, &demands);
            let s: f64 = m.iter().sum();
            assert!((s - cap).abs() < 1e-6 * cap, "{s} vs {cap}");
            for (i, x) in m.iter().enumerate() {
                assert!(
                    *x >= 0.0 && (*x >= demands[i].min(cap / n as f64) - 1e-6),
                    "{m:?} {demands:?}"
                );
            }
        }
    }
}
