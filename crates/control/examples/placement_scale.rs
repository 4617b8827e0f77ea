//! The placement engine at scale: 10,000 VMs placed on 1,000 hosts under
//! 1,000 rules (a third each anti-affinity pairs, affinity pairs and
//! host-affinity to a labelled quarter of the hosts; half of them strict),
//! every host checked for every VM. Then a balance of the result.
//!
//!     cargo run --release -p ferry-control --example placement_scale [ROUNDS]
//!
//! Prints each round's times and the median; checks that no strict rule
//! is broken.

use std::time::Instant;

use ferry_control::placement::{scale, strict_breaks, Engine};

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let (vms, hosts, rules) = (10_000, 1_000, 1_000);
    let mut place_s = Vec::new();
    let mut balance_s = Vec::new();
    for round in 0..rounds {
        let c = scale::cluster(vms, hosts, rules, 1 + round as u64);
        let names: Vec<String> = c.vms.iter().map(|v| v.name.clone()).collect();
        let t = Instant::now();
        let mut e = Engine::new(&c);
        let (placed, refused) = e.place(&names, &|_| true);
        let took = t.elapsed().as_secs_f64();
        let at = e.assignment();
        let broken = strict_breaks(&c, &at);
        assert!(
            broken.is_empty(),
            "strict rules broken: {:?}",
            &broken[..broken.len().min(5)]
        );
        // the placed cluster, balanced
        let mut placed_c = c.clone();
        for (v, (_, h)) in placed_c.vms.iter_mut().zip(&at) {
            v.host = h.clone();
        }
        for h in &mut placed_c.hosts {
            let used: u64 = placed_c
                .vms
                .iter()
                .filter(|v| v.host.as_deref() == Some(&h.name))
                .map(|v| v.memory)
                .sum();
            h.free = h.total.saturating_sub(used);
        }
        let t = Instant::now();
        let plan = Engine::new(&placed_c).balance(0.0, 125e6, &|_| false, 16);
        let btook = t.elapsed().as_secs_f64();
        println!(
            "round {}: placed {} refused {} in {:.3} s; balance: {} moves, spread {:.4} -> {:.4} in {:.3} s",
            round + 1,
            placed.len(),
            refused.len(),
            took,
            plan.moves.len(),
            plan.spread_before,
            plan.spread_after,
            btook
        );
        place_s.push(took);
        balance_s.push(btook);
    }
    place_s.sort_by(f64::total_cmp);
    balance_s.sort_by(f64::total_cmp);
    println!(
        "median of {rounds}: place {vms} VMs on {hosts} hosts under {rules} rules {:.3} s; balance (16 moves) {:.3} s",
        place_s[rounds / 2],
        balance_s[rounds / 2]
    );
}
