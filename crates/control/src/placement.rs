//! The placement engine: where a VM may run and where it should, under the
//! rules of [`ferry_api::placement`]. One engine for every placement Ferry
//! makes: `vm create` without `--host`, drains and rolling drains, HA
//! restarts and the balancer.
//!
//! It is a pure function of a [`Cluster`] (hosts with their free memory and
//! CPUs, VMs with where they run and what they use, the rules): no I/O, no
//! clock. The control service gathers the state and acts on the answer.
//!
//! Its promises, property-tested below:
//! - a placement or plan never breaks a strict rule;
//! - a refusal names each conflict (the rule, or the memory short, per host);
//! - a plan moves each VM at most once.
//!
//! How it chooses: a host that breaks no strict rule and has the memory,
//! then the fewest soft rules broken, then the most free memory (which
//! spreads the load). VMs with strict rules are placed first, then the
//! largest. The balancer scores hosts by CPU and memory use and takes, one
//! at a time, the move that lowers the spread of that load the most per
//! byte it would copy (a quiet small VM before a busy large one), never the
//! same VM twice.

use std::collections::HashMap;

use ferry_api::placement::{
    BalanceMove, BalancePlan, HostLoad, PlacementConfig, PlannedPlacement, RuleKind,
    MIN_IMPROVEMENT,
};
use ferry_api::size::human_bytes;

/// A host as placement sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Host {
    pub name: String,
    /// Memory VMs may still take, bytes (after what runs there now).
    pub free: u64,
    /// Memory VMs may take in all, bytes.
    pub total: u64,
    pub cpus: u32,
    /// Bytes/s its NICs carry in all (0: not known, its NIC load not counted).
    pub net_bps: f64,
    /// Healthy, not draining, answering: it may be given VMs.
    pub takes_vms: bool,
}

/// A VM as placement sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Vm {
    pub name: String,
    /// Where it runs now; `None` for a VM to place (a new one, one whose
    /// host failed).
    pub host: Option<String>,
    /// Host memory it takes (its RAM and QEMU's overhead), bytes.
    pub memory: u64,
    /// vCPU time it used over the window, in cores.
    pub cpu: f64,
    /// Bytes/s its guest NICs and disks carried over the window.
    pub net: f64,
    /// Guest memory a move copies at least, bytes.
    pub resident: u64,
    /// Bytes/s it dirties.
    pub dirty: f64,
}

#[derive(Debug, Clone, Default)]
pub struct Cluster {
    pub hosts: Vec<Host>,
    pub vms: Vec<Vm>,
    pub config: PlacementConfig,
}

/// Why a VM cannot be placed: one line per host that refused it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub vm: String,
    pub conflicts: Vec<String>,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.conflicts.is_empty() {
            write!(f, "no host takes VMs")
        } else {
            write!(f, "{}", self.conflicts.join("; "))
        }
    }
}

/// A VM placed on a host, with the soft rules that breaks: (VM, host, rules).
type Placed = (usize, usize, Vec<usize>);

/// Per rule: how many of its VMs each host has (assigned ones).
type Counts = HashMap<usize, u32>;

/// The engine over one cluster state; placements it makes are assigned as
/// it goes, so each sees the ones before.
pub struct Engine<'a> {
    cluster: &'a Cluster,
    host_ix: HashMap<&'a str, usize>,
    vm_ix: HashMap<&'a str, usize>,
    /// Where each VM is (or is planned to be).
    at: Vec<Option<usize>>,
    free: Vec<i64>,
    cpu: Vec<f64>,
    net: Vec<f64>,
    /// Rules of each VM (indices into `config.rules`).
    rules_of: Vec<Vec<usize>>,
    /// Per rule, per host: its VMs there.
    on: Vec<Counts>,
    /// Per host-rule, per host: whether the host is in the rule's group.
    in_group: Vec<Vec<bool>>,
}

/// Whether a VM may go to a host: the strict rules it would break, and the soft.
#[derive(Debug, Default)]
struct Fit {
    strict: Vec<usize>,
    soft: Vec<usize>,
    short: Option<(u64, i64)>,
}

impl Fit {
    fn allowed(&self) -> bool {
        self.strict.is_empty() && self.short.is_none()
    }
}

impl<'a> Engine<'a> {
    pub fn new(cluster: &'a Cluster) -> Engine<'a> {
        let host_ix: HashMap<&str, usize> = cluster
            .hosts
            .iter()
            .enumerate()
            .map(|(i, h)| (h.name.as_str(), i))
            .collect();
        let vm_ix: HashMap<&str, usize> = cluster
            .vms
            .iter()
            .enumerate()
            .map(|(i, v)| (v.name.as_str(), i))
            .collect();
        let mut rules_of = vec![Vec::new(); cluster.vms.len()];
        let rules = &cluster.config.rules;
        for (ri, r) in rules.iter().enumerate() {
            for v in &r.vms {
                if let Some(&vi) = vm_ix.get(v.as_str()) {
                    rules_of[vi].push(ri);
                }
            }
        }
        let in_group = rules
            .iter()
            .map(|r| match &r.group {
                Some(g) if r.kind.needs_group() => cluster
                    .hosts
                    .iter()
                    .map(|h| cluster.config.in_group(g, &h.name))
                    .collect(),
                _ => Vec::new(),
            })
            .collect();
        let mut e = Engine {
            cluster,
            host_ix,
            vm_ix,
            at: vec![None; cluster.vms.len()],
            free: cluster.hosts.iter().map(|h| h.free as i64).collect(),
            cpu: vec![0.0; cluster.hosts.len()],
            net: vec![0.0; cluster.hosts.len()],
            rules_of,
            on: vec![Counts::new(); rules.len()],
            in_group,
        };
        for (vi, v) in cluster.vms.iter().enumerate() {
            if let Some(hi) = v.host.as_deref().and_then(|h| e.host_ix.get(h)) {
                // already counted in the host's free memory
                e.at[vi] = Some(*hi);
                e.cpu[*hi] += v.cpu;
                e.net[*hi] += v.net;
                for &ri in &e.rules_of[vi] {
                    *e.on[ri].entry(*hi).or_default() += 1;
                }
            }
        }
        e
    }

    fn vm(&self, name: &str) -> Option<usize> {
        self.vm_ix.get(name).copied()
    }

    fn place_at(&mut self, vi: usize, hi: usize) {
        self.unplace(vi);
        let v = &self.cluster.vms[vi];
        self.at[vi] = Some(hi);
        self.free[hi] -= v.memory as i64;
        self.cpu[hi] += v.cpu;
        self.net[hi] += v.net;
        for &ri in &self.rules_of[vi] {
            *self.on[ri].entry(hi).or_default() += 1;
        }
    }

    fn unplace(&mut self, vi: usize) {
        if let Some(hi) = self.at[vi].take() {
            let v = &self.cluster.vms[vi];
            self.free[hi] += v.memory as i64;
            self.cpu[hi] -= v.cpu;
            self.net[hi] -= v.net;
            for &ri in &self.rules_of[vi] {
                if let Some(n) = self.on[ri].get_mut(&hi) {
                    *n -= 1;
                }
            }
        }
    }

    /// VMs of rule `ri` other than `vi` on host `hi`, and placed anywhere.
    fn others(&self, ri: usize, vi: usize, hi: usize) -> (u32, u32) {
        let here = self.on[ri].get(&hi).copied().unwrap_or(0);
        let anywhere: u32 = self.on[ri].values().sum();
        let own = self.at[vi];
        let minus = |n: u32, cond: bool| if cond { n.saturating_sub(1) } else { n };
        (minus(here, own == Some(hi)), minus(anywhere, own.is_some()))
    }

    /// Whether rule `ri` holds for VM `vi` on host `hi`.
    fn keeps(&self, ri: usize, vi: usize, hi: usize) -> bool {
        let r = &self.cluster.config.rules[ri];
        match r.kind {
            RuleKind::Affinity => {
                let (here, all) = self.others(ri, vi, hi);
                here == all
            }
            RuleKind::AntiAffinity => self.others(ri, vi, hi).0 == 0,
            RuleKind::HostAffinity => self.in_group[ri][hi],
            RuleKind::HostAntiAffinity => !self.in_group[ri][hi],
            RuleKind::Exclude => true,
        }
    }

    /// Whether `vi` may go to `hi`: the rules it would break there, and the
    /// memory short. (VMs kept together are placed as one group, each
    /// checked in turn: see [`Self::best_for_group`].)
    fn fit(&self, vi: usize, hi: usize) -> Fit {
        let need = self.cluster.vms[vi].memory;
        let mut f = Fit::default();
        for &ri in &self.rules_of[vi] {
            if !self.keeps(ri, vi, hi) {
                if self.cluster.config.rules[ri].strict {
                    f.strict.push(ri);
                } else {
                    f.soft.push(ri);
                }
            }
        }
        let free = self.free[hi]
            + if self.at[vi] == Some(hi) {
                self.cluster.vms[vi].memory as i64
            } else {
                0
            };
        if (need as i64) > free {
            f.short = Some((need, free));
        }
        f
    }

    /// Why `vi` may not go to `hi`, in words: each strict rule broken, the
    /// memory short.
    fn reasons(&self, f: &Fit, vi: usize, hi: usize) -> Vec<String> {
        let mut why: Vec<String> = f
            .strict
            .iter()
            .map(|&ri| self.conflict(ri, vi, hi))
            .collect();
        if let Some((need, free)) = f.short {
            why.push(format!(
                "needs {} of memory, {} free",
                human_bytes(need),
                human_bytes(free.max(0) as u64)
            ));
        }
        why
    }

    /// Why rule `ri` is broken for `vi` on `hi`, in words.
    fn conflict(&self, ri: usize, vi: usize, hi: usize) -> String {
        let r = &self.cluster.config.rules[ri];
        let host = &self.cluster.hosts[hi].name;
        let with: Vec<&str> = r
            .vms
            .iter()
            .filter_map(|v| self.vm(v))
            .filter(|&o| o != vi)
            .filter(|&o| match r.kind {
                RuleKind::Affinity => self.at[o].is_some() && self.at[o] != Some(hi),
                _ => self.at[o] == Some(hi),
            })
            .map(|o| self.cluster.vms[o].name.as_str())
            .collect();
        match r.kind {
            RuleKind::Affinity => format!(
                "{} keeps it with {} (on {})",
                r.describe(),
                with.join(", "),
                with.first()
                    .and_then(|v| self.vm(v))
                    .and_then(|o| self.at[o])
                    .map(|h| self.cluster.hosts[h].name.as_str())
                    .unwrap_or("-")
            ),
            RuleKind::AntiAffinity => {
                format!(
                    "{} keeps it from {} on {host}",
                    r.describe(),
                    with.join(", ")
                )
            }
            RuleKind::HostAffinity => format!(
                "{} keeps it in group {}, {host} is not",
                r.describe(),
                r.group.as_deref().unwrap_or("")
            ),
            RuleKind::HostAntiAffinity => format!(
                "{} keeps it out of group {}, {host} is in it",
                r.describe(),
                r.group.as_deref().unwrap_or("")
            ),
            RuleKind::Exclude => r.describe(),
        }
    }

    fn refusal(&self, vi: usize, allowed: &dyn Fn(usize) -> bool) -> Refusal {
        let mut conflicts = Vec::new();
        for (hi, h) in self.cluster.hosts.iter().enumerate() {
            if !allowed(hi) {
                continue;
            }
            let why = self.reasons(&self.fit(vi, hi), vi, hi);
            if !why.is_empty() {
                conflicts.push(format!("{}: {}", h.name, why.join(", ")));
            }
        }
        Refusal {
            vm: self.cluster.vms[vi].name.clone(),
            conflicts,
        }
    }

    /// The best host for VM `vi` among hosts that take VMs and pass
    /// `allowed`: no strict rule broken, the memory there, then the fewest
    /// soft rules broken, then the most free memory.
    fn best(
        &self,
        vi: usize,
        allowed: &dyn Fn(usize) -> bool,
    ) -> Result<(usize, Vec<usize>), Refusal> {
        let mut best: Option<(usize, i64, usize, Vec<usize>)> = None;
        let need = self.cluster.vms[vi].memory;
        for (hi, h) in self.cluster.hosts.iter().enumerate() {
            // the memory first: the cheapest check, and the one most refuse on
            if !h.takes_vms
                || self.free[hi] < need as i64
                || !allowed(hi)
                || self.at[vi] == Some(hi)
            {
                continue;
            }
            let f = self.fit(vi, hi);
            if !f.allowed() {
                continue;
            }
            let key = (f.soft.len(), -self.free[hi]);
            if best.as_ref().is_none_or(|b| key < (b.0, b.1)) {
                best = Some((f.soft.len(), -self.free[hi], hi, f.soft));
            }
        }
        best.map(|(_, _, hi, soft)| (hi, soft))
            .ok_or_else(|| self.refusal(vi, &|hi| self.cluster.hosts[hi].takes_vms && allowed(hi)))
    }

    fn breaks(&self, vi: usize, hi: usize, soft: &[usize]) -> Vec<String> {
        soft.iter()
            .map(|&ri| {
                format!(
                    "{}: {}",
                    self.cluster.config.rules[ri].describe(),
                    self.conflict(ri, vi, hi)
                        .split_once(" keeps ")
                        .map(|(_, w)| format!("keeps {w}"))
                        .unwrap_or_default()
                        + "; no host keeps it"
                )
            })
            .collect()
    }

    /// Places the VMs named (each one that runs somewhere moves), in the
    /// engine's order, on hosts passing `allowed`. Each is assigned as
    /// planned, so later ones see it. VMs a strict affinity rule ties
    /// together (directly or through others) move as one: to one host that
    /// takes them all, or not at all.
    pub fn place(
        &mut self,
        names: &[String],
        allowed: &dyn Fn(&str) -> bool,
    ) -> (Vec<PlannedPlacement>, Vec<Refusal>) {
        let mut order: Vec<usize> = names.iter().filter_map(|n| self.vm(n)).collect();
        order.sort_by_key(|&vi| {
            let strict = self.rules_of[vi]
                .iter()
                .filter(|&&ri| self.cluster.config.rules[ri].strict)
                .count();
            (
                std::cmp::Reverse(strict),
                std::cmp::Reverse(self.cluster.vms[vi].memory),
                vi,
            )
        });
        order.dedup();
        let from: Vec<Option<usize>> = self.at.clone();
        // what is placed leaves where it was for the rules' sake (it moves)
        let mut pending = vec![false; self.cluster.vms.len()];
        for &vi in &order {
            pending[vi] = true;
            let hi = self.at[vi];
            self.unplace(vi);
            if let Some(hi) = hi {
                // still takes its memory where it runs until it has moved
                self.free[hi] -= self.cluster.vms[vi].memory as i64;
            }
        }
        let ok: Vec<bool> = self
            .cluster
            .hosts
            .iter()
            .map(|h| h.takes_vms && allowed(&h.name))
            .collect();
        let mut planned = Vec::new();
        let mut refused = Vec::new();
        for &vi in &order {
            if !pending[vi] {
                continue;
            }
            let group = self.tied(vi, &pending);
            for &g in &group {
                pending[g] = false;
            }
            let res = if group.len() == 1 {
                self.best(vi, &|hi| ok[hi] && Some(hi) != from[vi])
                    .map(|(hi, soft)| vec![(vi, hi, soft)])
            } else {
                self.best_for_group(&group, &ok, &from)
            };
            match res {
                Ok(placed) => {
                    for (v, hi, soft) in placed {
                        let breaks = self.breaks(v, hi, &soft);
                        self.place_at(v, hi);
                        planned.push(PlannedPlacement {
                            vm: self.cluster.vms[v].name.clone(),
                            to: self.cluster.hosts[hi].name.clone(),
                            breaks,
                        });
                    }
                }
                Err(r) => {
                    for &v in &group {
                        // stays where it was, counted there again
                        if let Some(hi) = from[v] {
                            self.free[hi] += self.cluster.vms[v].memory as i64;
                            self.place_at(v, hi);
                        }
                        refused.push(Refusal {
                            vm: self.cluster.vms[v].name.clone(),
                            conflicts: r.conflicts.clone(),
                        });
                    }
                }
            }
        }
        (planned, refused)
    }

    /// `vi` and the pending VMs strict affinity rules tie to it, directly
    /// or through one another.
    fn tied(&self, vi: usize, pending: &[bool]) -> Vec<usize> {
        let mut group = vec![vi];
        let mut k = 0;
        while k < group.len() {
            let v = group[k];
            for &ri in &self.rules_of[v] {
                let r = &self.cluster.config.rules[ri];
                if !(r.strict && r.kind == RuleKind::Affinity) {
                    continue;
                }
                for o in r.vms.iter().filter_map(|n| self.vm(n)) {
                    if pending[o] && !group.contains(&o) {
                        group.push(o);
                    }
                }
            }
            k += 1;
        }
        group
    }

    /// The best host for a group of tied VMs: each placed there in turn
    /// (so each sees the others), every one allowed; fewest soft rules
    /// broken, then most free memory. A refusal says per host which VM
    /// could not follow and why.
    fn best_for_group(
        &mut self,
        group: &[usize],
        ok: &[bool],
        from: &[Option<usize>],
    ) -> Result<Vec<Placed>, Refusal> {
        let mut best: Option<((usize, i64), Vec<Placed>)> = None;
        let mut conflicts = Vec::new();
        for (hi, _) in ok.iter().enumerate().filter(|(_, ok)| **ok) {
            let free_before = self.free[hi];
            let mut placed: Vec<Placed> = Vec::new();
            let mut why = None;
            for &v in group {
                if from[v] == Some(hi) {
                    why = Some(format!("{} runs there already", self.cluster.vms[v].name));
                    break;
                }
                let f = self.fit(v, hi);
                if !f.allowed() {
                    let w = self.reasons(&f, v, hi);
                    why = Some(format!("{}: {}", self.cluster.vms[v].name, w.join(", ")));
                    break;
                }
                self.place_at(v, hi);
                placed.push((v, hi, f.soft));
            }
            for &(v, _, _) in &placed {
                self.unplace(v);
            }
            match why {
                Some(w) => conflicts.push(format!(
                    "{}: the VMs kept together cannot all go ({w})",
                    self.cluster.hosts[hi].name
                )),
                None => {
                    let soft: usize = placed.iter().map(|p| p.2.len()).sum();
                    let key = (soft, -free_before);
                    if best.as_ref().is_none_or(|b| key < b.0) {
                        best = Some((key, placed));
                    }
                }
            }
        }
        best.map(|b| b.1).ok_or_else(|| Refusal {
            vm: self.cluster.vms[group[0]].name.clone(),
            conflicts,
        })
    }

    /// Where each VM is now (or planned): VM → host.
    pub fn assignment(&self) -> Vec<(String, Option<String>)> {
        self.cluster
            .vms
            .iter()
            .enumerate()
            .map(|(vi, v)| {
                (
                    v.name.clone(),
                    self.at[vi].map(|h| self.cluster.hosts[h].name.clone()),
                )
            })
            .collect()
    }

    /// Host `hi`'s use with `v` added (`sign` 1) or taken away (−1) or as
    /// it is (0): its VMs' CPU over its cores, its memory used over its
    /// total, its VMs' traffic over its NICs.
    fn use_of(&self, hi: usize, v: Option<&Vm>, sign: f64) -> (f64, f64, f64) {
        let h = &self.cluster.hosts[hi];
        let (cpu, mem, net) = v.map_or((0.0, 0.0, 0.0), |v| {
            (v.cpu * sign, v.memory as f64 * sign, v.net * sign)
        });
        let used = (h.total as i64 - self.free[hi]).max(0) as f64 + mem;
        (
            (self.cpu[hi] + cpu) / h.cpus.max(1) as f64,
            used.max(0.0) / h.total.max(1) as f64,
            if h.net_bps > 0.0 {
                ((self.net[hi] + net) / h.net_bps).max(0.0)
            } else {
                0.0
            },
        )
    }

    /// The hosts that take VMs.
    fn takers(&self) -> impl Iterator<Item = usize> + '_ {
        self.cluster
            .hosts
            .iter()
            .enumerate()
            .filter(|(_, h)| h.takes_vms && h.total > 0)
            .map(|(hi, _)| hi)
    }

    /// Each host that takes VMs, with its load.
    fn loads(&self) -> Vec<(usize, f64)> {
        self.takers()
            .map(|hi| (hi, load(self.use_of(hi, None, 0.0))))
            .collect()
    }

    fn host_loads(&self) -> Vec<HostLoad> {
        self.takers()
            .map(|hi| {
                let used = self.use_of(hi, None, 0.0);
                let (cpu, memory, net) = used;
                HostLoad {
                    host: self.cluster.hosts[hi].name.clone(),
                    cpu,
                    memory,
                    net,
                    load: load(used),
                }
            })
            .collect()
    }

    /// The standard deviation of the hosts' loads.
    pub fn spread(&self) -> f64 {
        let l: Vec<f64> = self.loads().iter().map(|&(_, l)| l).collect();
        stddev(&l)
    }

    /// The balancer's plan: moves, best benefit per byte first, until the
    /// spread is under `threshold` or no move lowers it by
    /// [`MIN_IMPROVEMENT`]. VMs in `frozen` (an exclude rule, a cooldown, a
    /// move under way) stay. `link_bps`: what a move gets of the links.
    pub fn balance(
        &mut self,
        threshold: f64,
        link_bps: f64,
        frozen: &dyn Fn(&str) -> bool,
        max_moves: usize,
    ) -> BalancePlan {
        let before = self.host_loads();
        let spread_before = self.spread();
        let excluded: Vec<bool> = self
            .cluster
            .vms
            .iter()
            .enumerate()
            .map(|(vi, v)| {
                frozen(&v.name)
                    || self.rules_of[vi]
                        .iter()
                        .any(|&ri| self.cluster.config.rules[ri].kind == RuleKind::Exclude)
            })
            .collect();
        let mut moved = vec![false; self.cluster.vms.len()];
        let mut moves = Vec::new();
        // first, VMs that break a strict rule where they run (a rule made
        // since) go where they keep it
        for vi in 0..self.cluster.vms.len() {
            let Some(from) = self.at[vi] else { continue };
            if excluded[vi] || moves.len() >= max_moves {
                continue;
            }
            let broken: Vec<usize> = self.rules_of[vi]
                .iter()
                .copied()
                .filter(|&ri| self.cluster.config.rules[ri].strict && !self.keeps(ri, vi, from))
                .collect();
            if broken.is_empty() {
                continue;
            }
            let v = &self.cluster.vms[vi];
            let Some(bytes) = move_bytes(v, link_bps) else {
                continue;
            };
            let Ok((to, _)) = self.best(vi, &|hi| hi != from) else {
                continue;
            };
            let before = self.spread();
            let mends = self.cluster.config.rules[broken[0]].describe();
            self.place_at(vi, to);
            moved[vi] = true;
            moves.push(BalanceMove {
                vm: v.name.clone(),
                from: self.cluster.hosts[from].name.clone(),
                to: self.cluster.hosts[to].name.clone(),
                bytes,
                seconds: bytes as f64 / link_bps.max(1.0),
                benefit: self.loads().len() as f64 * (before * before - self.spread().powi(2)),
                mends: Some(mends),
            });
        }
        let why = loop {
            let spread = self.spread();
            if spread <= threshold {
                break format!("spread {spread:.3} is at most the threshold {threshold:.3}");
            }
            if moves.len() >= max_moves {
                break format!("{max_moves} moves planned, the most one round makes");
            }
            let loads = self.loads();
            let n = loads.len() as f64;
            if n < 2.0 {
                break "fewer than two hosts take VMs".into();
            }
            let pos: HashMap<usize, usize> =
                loads.iter().enumerate().map(|(k, l)| (l.0, k)).collect();
            let vals: Vec<f64> = loads.iter().map(|&(_, l)| l).collect();
            let sum: f64 = vals.iter().sum();
            let sumsq: f64 = vals.iter().map(|x| x * x).sum();
            // candidates: VMs of the hosts over the mean, toward the least
            // loaded hosts ([`BALANCE_TARGETS`] of them); a move that lowers
            // the spread much takes load from above the mean to below it
            let mean = sum / n;
            let mut targets: Vec<(usize, usize)> = loads
                .iter()
                .enumerate()
                .map(|(k, &(hi, _))| (k, hi))
                .collect();
            targets.sort_by(|a, b| vals[a.0].total_cmp(&vals[b.0]).then(a.1.cmp(&b.1)));
            targets.truncate(BALANCE_TARGETS);
            let mut best: Option<(f64, usize, usize, f64, u64)> = None;
            for (vi, v) in self.cluster.vms.iter().enumerate() {
                let Some(from) = self.at[vi] else { continue };
                if excluded[vi] || moved[vi] {
                    continue;
                }
                if pos.get(&from).is_none_or(|&k| vals[k] <= mean) {
                    continue;
                }
                let Some(bytes) = move_bytes(v, link_bps) else {
                    continue;
                };
                let Some(&pf) = pos.get(&from) else { continue };
                let from_after = load(self.use_of(from, Some(v), -1.0));
                for &(pt, to) in &targets {
                    if to == from {
                        continue;
                    }
                    let f = self.fit(vi, to);
                    // a soft rule kept where it runs stays kept
                    let soft_now = self.rules_of[vi]
                        .iter()
                        .filter(|&&ri| {
                            !self.cluster.config.rules[ri].strict && !self.keeps(ri, vi, from)
                        })
                        .count();
                    if !f.allowed() || f.soft.len() > soft_now {
                        continue;
                    }
                    let to_after = load(self.use_of(to, Some(v), 1.0));
                    let s2 = sum - vals[pf] - vals[pt] + from_after + to_after;
                    let q2 = sumsq - vals[pf].powi(2) - vals[pt].powi(2)
                        + from_after.powi(2)
                        + to_after.powi(2);
                    let after = (q2 / n - (s2 / n).powi(2)).max(0.0).sqrt();
                    // the fall of the hosts' squared deviations, Σ(load − mean)²:
                    // what one move can do, whatever the number of hosts
                    let benefit = n * (spread * spread - after * after);
                    if benefit < MIN_IMPROVEMENT {
                        continue;
                    }
                    let per_byte = benefit / bytes.max(1) as f64;
                    if best.as_ref().is_none_or(|b| per_byte > b.0) {
                        best = Some((per_byte, vi, to, benefit, bytes));
                    }
                }
            }
            let Some((_, vi, to, benefit, bytes)) = best else {
                break format!(
                    "no move lowers the spread {spread:.3} by {MIN_IMPROVEMENT} without breaking a rule"
                );
            };
            let from = self.at[vi].unwrap_or(to);
            moves.push(BalanceMove {
                vm: self.cluster.vms[vi].name.clone(),
                from: self.cluster.hosts[from].name.clone(),
                to: self.cluster.hosts[to].name.clone(),
                bytes,
                seconds: bytes as f64 / link_bps.max(1.0),
                benefit,
                mends: None,
            });
            moved[vi] = true;
            self.place_at(vi, to);
        };
        BalancePlan {
            moves,
            spread_before,
            spread_after: self.spread(),
            threshold,
            before,
            after: self.host_loads(),
            why,
            started: false,
        }
    }
}

/// Hosts a balance step tries as targets: the least loaded. All of them
/// on a cluster of up to this many.
pub const BALANCE_TARGETS: usize = 32;

/// A host's load from its CPU, memory and NIC use (each 0–1): the largest.
pub fn load((cpu, memory, net): (f64, f64, f64)) -> f64 {
    cpu.max(memory).max(net)
}

pub fn stddev(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt()
}

/// Bytes a live move of `v` puts on the wire at `bps`: its resident memory,
/// then what it dirties while that is copied, round after round (a
/// geometric series); `None` when it dirties too fast to converge without
/// throttling (over 80% of the rate).
pub fn move_bytes(v: &Vm, bps: f64) -> Option<u64> {
    let ratio = v.dirty / bps.max(1.0);
    (ratio < 0.8).then(|| (v.resident as f64 / (1.0 - ratio)) as u64)
}

impl Vm {
    /// A VM known only by its RAM (`memory`), on `host` (`""`: none yet).
    pub fn placed(name: &str, host: &str, memory: u64) -> Vm {
        Vm {
            name: name.into(),
            host: (!host.is_empty()).then(|| host.to_string()),
            memory: memory + crate::drain::VM_OVERHEAD,
            cpu: 0.0,
            net: 0.0,
            resident: memory,
            dirty: 0.0,
        }
    }
}

/// Every host `vm` may go to among those passing `allowed`, best first (the
/// engine's order: fewest soft rules broken, then most free memory): an HA
/// restart tries them in turn.
pub fn ranked(
    cluster: &Cluster,
    vm: &str,
    allowed: &dyn Fn(&str) -> bool,
) -> Result<Vec<String>, Refusal> {
    let e = Engine::new(cluster);
    let Some(vi) = e.vm(vm) else {
        return Err(Refusal {
            vm: vm.into(),
            conflicts: vec![format!("VM {vm} is not in the cluster state")],
        });
    };
    let mut ok: Vec<(usize, i64, usize)> = cluster
        .hosts
        .iter()
        .enumerate()
        .filter(|(hi, h)| h.takes_vms && allowed(&h.name) && e.at[vi] != Some(*hi))
        .filter_map(|(hi, _)| {
            let f = e.fit(vi, hi);
            f.allowed().then_some((f.soft.len(), -e.free[hi], hi))
        })
        .collect();
    if ok.is_empty() {
        return Err(e.refusal(vi, &|hi| {
            cluster.hosts[hi].takes_vms && allowed(&cluster.hosts[hi].name)
        }));
    }
    ok.sort();
    Ok(ok
        .into_iter()
        .map(|(_, _, hi)| cluster.hosts[hi].name.clone())
        .collect())
}

/// One VM to place on a cluster: the host, and the soft rules broken.
pub fn place_one(
    cluster: &Cluster,
    vm: &str,
    allowed: &dyn Fn(&str) -> bool,
) -> Result<PlannedPlacement, Refusal> {
    let mut e = Engine::new(cluster);
    let (mut p, mut r) = e.place(&[vm.to_string()], allowed);
    match (p.pop(), r.pop()) {
        (Some(p), _) => Ok(p),
        (None, Some(r)) => Err(r),
        (None, None) => Err(Refusal {
            vm: vm.into(),
            conflicts: vec![format!("VM {vm} is not in the cluster state")],
        }),
    }
}

/// Whether every VM of the cluster could be placed, from scratch, on the
/// cluster's hosts (draining and down ones too) under `config`: the feasibility check of a new
/// rule. The refusal names the VM left without a host and why.
pub fn feasible(cluster: &Cluster) -> Result<(), Refusal> {
    let mut scratch = cluster.clone();
    // every host the cluster has: one draining or down now is back later
    for h in &mut scratch.hosts {
        h.free = h.total;
        h.takes_vms = true;
    }
    let names: Vec<String> = scratch
        .vms
        .iter_mut()
        .map(|v| {
            v.host = None;
            v.name.clone()
        })
        .collect();
    let mut e = Engine::new(&scratch);
    let (_, refused) = e.place(&names, &|_| true);
    match refused.into_iter().next() {
        Some(r) => Err(r),
        None => Ok(()),
    }
}

/// The strict rules a state breaks, as (rule, VM, host) descriptions: what
/// the properties check, and what the balancer fixes first.
pub fn strict_breaks(cluster: &Cluster, at: &[(String, Option<String>)]) -> Vec<(String, String)> {
    let host = |v: &str| at.iter().find(|(n, _)| n == v).and_then(|(_, h)| h.clone());
    let mut out = Vec::new();
    for r in cluster.config.rules.iter().filter(|r| r.strict) {
        let placed: Vec<(&String, String)> = r
            .vms
            .iter()
            .filter_map(|v| host(v).map(|h| (v, h)))
            .collect();
        match r.kind {
            RuleKind::Affinity => {
                if placed.windows(2).any(|w| w[0].1 != w[1].1) {
                    out.push((r.name.clone(), format!("{}: {:?}", r.describe(), placed)));
                }
            }
            RuleKind::AntiAffinity => {
                for (i, a) in placed.iter().enumerate() {
                    if placed[i + 1..].iter().any(|b| b.1 == a.1) {
                        out.push((r.name.clone(), format!("{}: two on {}", r.describe(), a.1)));
                    }
                }
            }
            RuleKind::HostAffinity | RuleKind::HostAntiAffinity => {
                let g = r.group.as_deref().unwrap_or_default();
                for (v, h) in &placed {
                    if cluster.config.in_group(g, h) != (r.kind == RuleKind::HostAffinity) {
                        out.push((r.name.clone(), format!("{}: {v} on {h}", r.describe())));
                    }
                }
            }
            RuleKind::Exclude => {}
        }
    }
    out
}

/// A synthetic cluster for the engine at scale: `hosts` hosts (64 GiB, 16
/// cores, one in four labelled `tier=fast`), `vms` VMs of 1–8 GiB to place,
/// and `rules` rules cycling through anti-affinity pairs, affinity pairs and
/// host-affinity to the fast tier.
pub mod scale {
    use super::*;
    use ferry_api::placement::{HostGroup, Rule};

    pub fn cluster(vms: usize, hosts: usize, rules: usize, seed: u64) -> Cluster {
        let mut x = seed | 1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let g = 1u64 << 30;
        let hosts: Vec<Host> = (0..hosts)
            .map(|i| Host {
                name: format!("host{i}"),
                free: 64 * g,
                total: 64 * g,
                cpus: 16,
                net_bps: 2.5e9,
                takes_vms: true,
            })
            .collect();
        let labels = hosts
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 4 == 0)
            .map(|(_, h)| {
                (
                    h.name.clone(),
                    [("tier".to_string(), "fast".to_string())].into(),
                )
            })
            .collect();
        let vms: Vec<Vm> = (0..vms)
            .map(|i| {
                let mem = (1 + next() % 8) * g / 2;
                Vm {
                    name: format!("vm{i}"),
                    host: None,
                    memory: mem,
                    cpu: (next() % 100) as f64 / 50.0,
                    net: (next() % 20) as f64 * 1e6,
                    resident: mem / 2,
                    dirty: (next() % 50) as f64 * 1e6,
                }
            })
            .collect();
        let n = vms.len().max(2);
        let rules = (0..rules)
            .map(|i| {
                let a = (next() as usize) % n;
                let b = (a + 1 + (next() as usize) % (n - 1)) % n;
                let (kind, members, group) = match i % 3 {
                    0 => (RuleKind::AntiAffinity, vec![a, b], None),
                    1 => (RuleKind::Affinity, vec![a, b], None),
                    _ => (RuleKind::HostAffinity, vec![a], Some("fast".to_string())),
                };
                Rule {
                    name: format!("rule{i}"),
                    kind,
                    vms: members.iter().map(|m| format!("vm{m}")).collect(),
                    group,
                    strict: i % 2 == 0,
                }
            })
            .collect();
        Cluster {
            hosts,
            vms,
            config: PlacementConfig {
                rules,
                groups: vec![HostGroup {
                    name: "fast".into(),
                    hosts: vec![],
                    labels: [("tier".to_string(), "fast".to_string())].into(),
                }],
                labels,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_api::placement::{HostGroup, Rule};
    use proptest::prelude::*;

    const G: u64 = 1 << 30;

    fn host(name: &str, free: u64) -> Host {
        Host {
            name: name.into(),
            free,
            total: 8 * G,
            cpus: 2,
            net_bps: 0.0,
            takes_vms: true,
        }
    }

    fn vm(name: &str, host: Option<&str>, memory: u64) -> Vm {
        Vm {
            name: name.into(),
            host: host.map(str::to_string),
            memory,
            cpu: 0.1,
            net: 0.0,
            resident: memory / 2,
            dirty: 0.0,
        }
    }

    fn rule(name: &str, kind: RuleKind, vms: &[&str], group: Option<&str>, strict: bool) -> Rule {
        Rule {
            name: name.into(),
            kind,
            vms: vms.iter().map(|s| s.to_string()).collect(),
            group: group.map(str::to_string),
            strict,
        }
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_drain_keeps_anti_affine_vms_apart() {
        let c = Cluster {
            hosts: vec![host("h1", 6 * G), host("h2", 7 * G), host("h3", 5 * G)],
            vms: vec![vm("db1", Some("h1"), G), vm("db2", Some("h2"), G)],
            config: PlacementConfig {
                rules: vec![rule(
                    "db",
                    RuleKind::AntiAffinity,
                    &["db1", "db2"],
                    None,
                    true,
                )],
                ..Default::default()
            },
        };
        let mut e = Engine::new(&c);
        // h2 has the most memory free but runs db2
        let (p, r) = e.place(&names(&["db1"]), &|h| h != "h1");
        assert!(r.is_empty());
        assert_eq!(p[0].to, "h3");
        // with h3 gone, the drain refuses, naming the rule and the host
        let mut e = Engine::new(&c);
        let (p, r) = e.place(&names(&["db1"]), &|h| h == "h2");
        assert!(p.is_empty());
        let why = r[0].to_string();
        assert!(
            why.contains("h2: strict anti-affinity rule db keeps it from db2 on h2"),
            "{why}"
        );
    }

    #[test]
    fn a_soft_rule_is_broken_only_when_nothing_else_fits_and_says_so() {
        let c = Cluster {
            hosts: vec![host("h1", 6 * G), host("h2", 7 * G)],
            vms: vec![vm("a", Some("h1"), G), vm("b", Some("h2"), G)],
            config: PlacementConfig {
                rules: vec![rule("ab", RuleKind::AntiAffinity, &["a", "b"], None, false)],
                ..Default::default()
            },
        };
        let p = place_one(&c, "a", &|h| h != "h1").unwrap();
        assert_eq!(p.to, "h2");
        assert_eq!(p.breaks.len(), 1);
        assert!(
            p.breaks[0].contains("soft anti-affinity rule ab"),
            "{:?}",
            p.breaks
        );
    }

    #[test]
    fn vms_kept_together_go_where_all_fit() {
        let c = Cluster {
            hosts: vec![host("h1", 0), host("h2", 3 * G), host("h3", G + G / 2)],
            vms: vec![vm("app", Some("h1"), G), vm("cache", Some("h1"), G)],
            config: PlacementConfig {
                rules: vec![rule(
                    "with",
                    RuleKind::Affinity,
                    &["app", "cache"],
                    None,
                    true,
                )],
                ..Default::default()
            },
        };
        let mut e = Engine::new(&c);
        let (p, r) = e.place(&names(&["app", "cache"]), &|h| h != "h1");
        assert!(r.is_empty(), "{r:?}");
        assert!(p.iter().all(|m| m.to == "h2"), "{p:?}");
    }

    #[test]
    fn an_ha_restart_ranks_every_host_that_keeps_the_rules() {
        let c = Cluster {
            hosts: vec![host("h1", 2 * G), host("h2", 6 * G), host("h3", 4 * G)],
            vms: vec![vm("db2", Some("h2"), G), Vm::placed("db1", "", G)],
            config: PlacementConfig {
                rules: vec![rule(
                    "db",
                    RuleKind::AntiAffinity,
                    &["db1", "db2"],
                    None,
                    true,
                )],
                ..Default::default()
            },
        };
        assert_eq!(ranked(&c, "db1", &|_| true).unwrap(), vec!["h3", "h1"]);
        let r = ranked(&c, "db1", &|h| h == "h2").unwrap_err();
        assert!(r.to_string().contains("keeps it from db2 on h2"), "{r}");
    }

    #[test]
    fn host_groups_by_label() {
        let c = Cluster {
            hosts: vec![host("h1", 7 * G), host("h2", 2 * G)],
            vms: vec![vm("db", None, G)],
            config: PlacementConfig {
                rules: vec![rule(
                    "fast",
                    RuleKind::HostAffinity,
                    &["db"],
                    Some("fast"),
                    true,
                )],
                groups: vec![HostGroup {
                    name: "fast".into(),
                    hosts: vec![],
                    labels: [("storage".to_string(), "fast".to_string())].into(),
                }],
                labels: [(
                    "h2".to_string(),
                    [("storage".to_string(), "fast".to_string())].into(),
                )]
                .into(),
            },
        };
        assert_eq!(place_one(&c, "db", &|_| true).unwrap().to, "h2");
        let mut c2 = c.clone();
        c2.config.labels.clear();
        let r = place_one(&c2, "db", &|_| true).unwrap_err();
        assert!(
            r.to_string().contains("keeps it in group fast, h1 is not"),
            "{r}"
        );
        assert!(feasible(&c2).is_err());
        assert!(feasible(&c).is_ok());
    }

    #[test]
    fn the_balancer_moves_the_small_quiet_vm_first_and_stops() {
        // h1 carries big and small; h2 is empty
        let mut big = vm("big", Some("h1"), 3 * G);
        big.resident = 3 * G;
        big.dirty = 50e6;
        let mut small = vm("small", Some("h1"), 2 * G);
        small.resident = G / 4;
        let c = Cluster {
            hosts: vec![host("h1", 3 * G), host("h2", 8 * G)],
            vms: vec![big, small],
            config: PlacementConfig::default(),
        };
        let mut e = Engine::new(&c);
        let plan = e.balance(0.05, 125e6, &|_| false, 10);
        assert_eq!(plan.moves.len(), 1, "{plan:?}");
        assert_eq!(plan.moves[0].vm, "small");
        assert!(plan.spread_after < plan.spread_before);
        // balanced now: a second run plans nothing
        let mut c2 = c.clone();
        c2.vms[1].host = Some("h2".into());
        c2.hosts[0].free = 5 * G;
        c2.hosts[1].free = 6 * G;
        let plan = Engine::new(&c2).balance(0.05, 125e6, &|_| false, 10);
        assert!(plan.moves.is_empty(), "{plan:?}");
    }

    #[test]
    fn a_host_busy_on_its_nics_sheds_a_chatty_vm_not_a_quiet_one() {
        // memory and CPU even; h1's guests fill 90% of its NICs
        let mut hosts = vec![host("h1", 6 * G), host("h2", 6 * G)];
        for h in &mut hosts {
            h.net_bps = 125e6;
        }
        let mut chatty = vm("chatty", Some("h1"), G);
        chatty.net = 60e6;
        let mut chatty2 = vm("chatty2", Some("h1"), G);
        chatty2.net = 52e6;
        let quiet = vm("quiet", Some("h2"), 2 * G);
        let c = Cluster {
            hosts,
            vms: vec![chatty, chatty2, quiet],
            config: PlacementConfig::default(),
        };
        let mut e = Engine::new(&c);
        let before = e.host_loads();
        assert!((before[0].net - 0.896).abs() < 1e-9, "{before:?}");
        assert_eq!(before[0].load, before[0].net, "NIC use is h1's load");
        let plan = e.balance(0.1, 125e6, &|_| false, 10);
        assert_eq!(plan.moves.len(), 1, "{plan:?}");
        assert!(plan.moves[0].vm.starts_with("chatty"), "{plan:?}");
        assert_eq!(plan.moves[0].to, "h2");
        assert!(plan.spread_after < plan.spread_before / 2.0, "{plan:?}");
    }

    #[test]
    fn an_excluded_vm_is_never_balanced() {
        let c = Cluster {
            hosts: vec![host("h1", 3 * G), host("h2", 8 * G)],
            vms: vec![vm("a", Some("h1"), 3 * G), vm("b", Some("h1"), 2 * G)],
            config: PlacementConfig {
                rules: vec![rule("pin", RuleKind::Exclude, &["a", "b"], None, true)],
                ..Default::default()
            },
        };
        let plan = Engine::new(&c).balance(0.0, 125e6, &|_| false, 10);
        assert!(plan.moves.is_empty());
    }

    // --- properties over random clusters and rule sets ---

    fn arb_cluster() -> impl Strategy<Value = Cluster> {
        (2usize..7, 1usize..16).prop_flat_map(|(nh, nv)| {
            (
                proptest::collection::vec((1u64..9, any::<bool>(), 0u8..3), nh),
                proptest::collection::vec((0usize..nh + 1, 1u64..4, 0u32..100, 0u32..60), nv),
                proptest::collection::vec(
                    (
                        0u8..5,
                        proptest::collection::vec(0usize..nv, 1..4),
                        0u8..3,
                        any::<bool>(),
                    ),
                    0..6,
                ),
            )
                .prop_map(move |(hs, vs, rs)| {
                    let mut hosts: Vec<Host> = hs
                        .iter()
                        .enumerate()
                        .map(|(i, (gb, takes, _))| Host {
                            name: format!("h{i}"),
                            free: gb * G,
                            total: 12 * G,
                            cpus: 2,
                            net_bps: 125e6,
                            takes_vms: *takes || i == 0,
                        })
                        .collect();
                    let vms: Vec<Vm> = vs
                        .iter()
                        .enumerate()
                        .map(|(i, (h, mem, cpu, dirty))| Vm {
                            name: format!("v{i}"),
                            host: (*h < nh).then(|| format!("h{h}")),
                            memory: mem * G / 2,
                            cpu: *cpu as f64 / 100.0,
                            net: *cpu as f64 * 1e5,
                            resident: mem * G / 4,
                            dirty: *dirty as f64 * 1e6,
                        })
                        .collect();
                    for v in &vms {
                        if let Some(h) = &v.host {
                            let hh = hosts.iter_mut().find(|x| &x.name == h).unwrap();
                            hh.free = hh.free.saturating_sub(v.memory);
                        }
                    }
                    let labels = hs
                        .iter()
                        .enumerate()
                        .filter(|(_, x)| x.2 == 1)
                        .map(|(i, _)| {
                            (
                                format!("h{i}"),
                                [("tier".to_string(), "a".to_string())].into(),
                            )
                        })
                        .collect();
                    let rules = rs
                        .iter()
                        .enumerate()
                        .filter_map(|(i, (k, members, g, strict))| {
                            let kind = [
                                RuleKind::Affinity,
                                RuleKind::AntiAffinity,
                                RuleKind::HostAffinity,
                                RuleKind::HostAntiAffinity,
                                RuleKind::Exclude,
                            ][*k as usize];
                            let mut m: Vec<String> =
                                members.iter().map(|v| format!("v{v}")).collect();
                            m.sort();
                            m.dedup();
                            let r = Rule {
                                name: format!("r{i}"),
                                kind,
                                vms: m,
                                group: kind
                                    .needs_group()
                                    .then(|| ["ga", "gb", "ga"][*g as usize].to_string()),
                                strict: *strict || kind == RuleKind::Exclude,
                            };
                            r.validate().is_ok().then_some(r)
                        })
                        .collect();
                    let groups = vec![
                        HostGroup {
                            name: "ga".into(),
                            hosts: vec![],
                            labels: [("tier".to_string(), "a".to_string())].into(),
                        },
                        HostGroup {
                            name: "gb".into(),
                            hosts: vec!["h1".into()],
                            labels: Default::default(),
                        },
                    ];
                    Cluster {
                        hosts,
                        vms,
                        config: PlacementConfig {
                            rules,
                            groups,
                            labels,
                        },
                    }
                })
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        /// A drain of h0: no strict rule broken that was not broken before,
        /// each VM planned at most once, each refusal naming its conflicts.
        #[test]
        fn drains_never_break_a_strict_rule(c in arb_cluster()) {
            let before = strict_breaks(&c, &Engine::new(&c).assignment());
            let on_h0: Vec<String> = c.vms.iter().filter(|v| v.host.as_deref() == Some("h0")).map(|v| v.name.clone()).collect();
            let mut e = Engine::new(&c);
            let (planned, refused) = e.place(&on_h0, &|h| h != "h0");
            let after = strict_breaks(&c, &e.assignment());
            for b in &after {
                prop_assert!(before.iter().any(|x| x.0 == b.0), "new strict break {:?}; before {:?}", b, before);
            }
            let mut seen = std::collections::BTreeSet::new();
            for p in &planned {
                prop_assert!(seen.insert(&p.vm), "{} planned twice", p.vm);
                prop_assert!(p.to != "h0");
                let h = c.hosts.iter().find(|h| h.name == p.to).unwrap();
                prop_assert!(h.takes_vms);
            }
            for r in &refused {
                prop_assert!(on_h0.contains(&r.vm));
                let takers = c.hosts.iter().filter(|h| h.takes_vms && h.name != "h0").count();
                prop_assert_eq!(r.conflicts.len(), takers, "{}", r);
                for line in &r.conflicts {
                    prop_assert!(line.contains(" rule ") || line.contains("of memory"), "{}", line);
                }
            }
            prop_assert_eq!(planned.len() + refused.len(), on_h0.len());
            // memory never overcommitted by what was planned
            for (hi, h) in c.hosts.iter().enumerate() {
                let added: u64 = planned.iter().filter(|p| p.to == h.name).map(|p| c.vms[e.vm(&p.vm).unwrap()].memory).sum();
                prop_assert!(added <= h.free, "{} gets {} with {} free (host {})", h.name, added, h.free, hi);
            }
        }

        /// The balancer: no strict rule broken, no VM moved twice, no
        /// excluded VM moved, and the spread never rises.
        #[test]
        fn balancing_never_breaks_a_rule_or_moves_twice(c in arb_cluster()) {
            let before = strict_breaks(&c, &Engine::new(&c).assignment());
            let mut e = Engine::new(&c);
            let plan = e.balance(0.0, 125e6, &|_| false, 50);
            let after = strict_breaks(&c, &e.assignment());
            for b in &after {
                prop_assert!(before.iter().any(|x| x.0 == b.0), "new strict break {:?}", b);
            }
            let mut seen = std::collections::BTreeSet::new();
            for m in &plan.moves {
                prop_assert!(seen.insert(&m.vm), "{} moved twice", m.vm);
                prop_assert!(m.mends.is_some() || m.benefit >= MIN_IMPROVEMENT);
                let excluded = c.config.rules.iter().any(|r| r.kind == RuleKind::Exclude && r.vms.contains(&m.vm));
                prop_assert!(!excluded, "{} is excluded", m.vm);
            }
            if plan.moves.iter().all(|m| m.mends.is_none()) {
                prop_assert!(plan.spread_after <= plan.spread_before + 1e-9);
            }
        }

        /// A new VM placed is placed within the rules, or refused naming why.
        #[test]
        fn a_new_vm_keeps_the_strict_rules(c in arb_cluster()) {
            let mut c = c;
            let last = c.vms.len() - 1;
            c.vms[last].host = None;
            let name = c.vms[last].name.clone();
            let before = strict_breaks(&c, &Engine::new(&c).assignment());
            match place_one(&c, &name, &|_| true) {
                Ok(p) => {
                    let mut at = Engine::new(&c).assignment();
                    at[last].1 = Some(p.to.clone());
                    for b in strict_breaks(&c, &at) {
                        prop_assert!(before.iter().any(|x| x.0 == b.0), "new strict break {:?}", b);
                    }
                }
                Err(r) => prop_assert!(!r.conflicts.is_empty()),
            }
        }
    }

    /// Placing 10,000 VMs on 1,000 hosts under 1,000 rules, every host
    /// checked for every VM (the engine at scale; timed in
    /// `cargo run --release -p ferry-control --example placement_scale`).
    #[test]
    fn the_engine_places_a_large_cluster_within_its_rules() {
        let c = scale::cluster(2_000, 200, 200, 7);
        let names: Vec<String> = c.vms.iter().map(|v| v.name.clone()).collect();
        let mut e = Engine::new(&c);
        let (p, r) = e.place(&names, &|_| true);
        assert_eq!(p.len() + r.len(), names.len());
        assert!(p.len() > names.len() * 9 / 10, "{} placed", p.len());
        assert!(strict_breaks(&c, &e.assignment()).is_empty());
    }
}
