//! The placement engine's I/O (the engine itself is [`crate::placement`]):
//! the rules, groups and labels kept in the store (key `placement`), the
//! cluster state gathered for the engine from the hosts' listings, and the
//! balancer's moves.
//!
//! - A rule, group or label change is checked before it is kept: alone,
//!   against the other rules, and for feasibility (every VM of the cluster
//!   could still be placed from scratch); a refusal names the conflict.
//! - `vm create` without a host asks the engine; with one, the engine checks
//!   it breaks no strict rule. `vm move` is checked the same way.
//! - The balancer plans from the VMs' CPU use over the last
//!   [`USAGE_WINDOW_MS`] (from the QEMU processes' CPU time each heartbeat
//!   reads) and their memory, and runs its moves one at a time.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;

use ferry_api::ha::Health;
use ferry_api::placement::{
    BalanceMove, BalancePlan, BalanceRequest, HostGroup, LabelUpdate, PlacementConfig,
    PlacementStatus, PlannedPlacement, Rule, COOLDOWN_MAX_MS, COOLDOWN_MS, DEFAULT_THRESHOLD,
    HOLD_ROUNDS,
};
use ferry_api::util::{lock, now_ms};
use ferry_api::{ApiError, HostEntry, MigrationEvent};
use futures::StreamExt;

use crate::placement::{self, Cluster, Engine};
use crate::Control;

/// Store key of the [`PlacementConfig`].
pub const PLACEMENT_KEY: &str = "placement";
/// The window a VM's CPU use is averaged over.
pub const USAGE_WINDOW_MS: u64 = 60_000;
/// What the balancer assumes a move gets of the links when no host says
/// more: 1 Gbit/s.
pub const DEFAULT_LINK_BPS: f64 = 125e6;
/// What a live migration gets of a host's links, bytes/s: its up NICs at
/// their rate, under the live-migration class's hard cap (percent of each
/// NIC, or a rate for the whole host); [`DEFAULT_LINK_BPS`] when the host
/// does not say its NICs' rate.
pub fn move_bps(info: &ferry_api::HostInfo) -> f64 {
    use ferry_api::bandwidth::{Cap, TrafficClass};
    let Some(rate) = info.nic_rate.filter(|r| *r > 0) else {
        return DEFAULT_LINK_BPS;
    };
    let up = info.nics.iter().filter(|n| n.up).count().max(1) as f64;
    let all = rate as f64 / 8.0 * up;
    match info
        .bandwidth
        .get(TrafficClass::LiveMigration)
        .and_then(|c| c.max)
    {
        Some(Cap::Percent(p)) => all * p as f64 / 100.0,
        Some(Cap::BitsPerSec(b)) => all.min(b as f64 / 8.0),
        None => all,
    }
}

/// Moves one balance plans at most.
pub const MAX_BALANCE_MOVES: usize = 16;

/// The balancer's state.
#[derive(Default)]
pub struct Balancer {
    /// A balance's moves are running.
    pub running: bool,
    /// Checks running with the spread over the threshold.
    pub over: u32,
    /// When the automatic balancer checks next (Unix ms).
    pub next_ms: u64,
    /// VM → (moved again no earlier than, Unix ms; its cooldown, ms).
    pub cooldown: HashMap<String, (u64, u64)>,
}

impl Balancer {
    /// Starts `vm`'s cooldown, twice the last one (up to the most).
    pub fn cooled(&mut self, vm: &str, now: u64) {
        let last = self.cooldown.get(vm).map(|c| c.1);
        let next = last.map_or(COOLDOWN_MS, |l| (l * 2).min(COOLDOWN_MAX_MS));
        self.cooldown.insert(vm.to_string(), (now + next, next));
    }
}

/// Per VM: (when, its QEMU's CPU time in ms, its guest's NIC and disk
/// bytes) over the window.
#[derive(Default)]
pub struct Usage {
    samples: HashMap<String, VecDeque<(u64, u64, u64)>>,
}

impl Usage {
    /// Notes the CPU time each VM's QEMU has used, as listed now.
    pub fn note(&mut self, now: u64, hosts: &[HostEntry]) {
        let mut seen = std::collections::HashSet::new();
        for v in hosts
            .iter()
            .filter_map(|h| h.info.as_ref())
            .flat_map(|i| &i.vms)
        {
            // a move's skeleton is not the guest: only its source counts
            let Some(u) = v.usage.as_ref().filter(|_| v.state != "incoming") else {
                continue;
            };
            let q = self.samples.entry(v.name.clone()).or_default();
            // a VM restarted or moved starts its count again
            if q.back()
                .is_some_and(|&(_, c, io)| c > u.cpu_ms || io > u.io_bytes)
            {
                q.clear();
            }
            q.push_back((now, u.cpu_ms, u.io_bytes));
            while q.len() > 2
                && q.front()
                    .is_some_and(|&(t, _, _)| now - t > USAGE_WINDOW_MS)
            {
                q.pop_front();
            }
            seen.insert(v.name.as_str());
        }
        self.samples.retain(|k, _| seen.contains(k.as_str()));
    }

    /// (cores, bytes/s of guest traffic) a VM used over the window (0
    /// until two samples).
    pub fn rates(&self, vm: &str) -> (f64, f64) {
        match self.samples.get(vm) {
            Some(q) if q.len() >= 2 => {
                let (t0, c0, io0) = q[0];
                let (t1, c1, io1) = q[q.len() - 1];
                if t1 > t0 {
                    let ms = (t1 - t0) as f64;
                    ((c1 - c0) as f64 / ms, (io1 - io0) as f64 * 1000.0 / ms)
                } else {
                    (0.0, 0.0)
                }
            }
            _ => (0.0, 0.0),
        }
    }
}

impl Control {
    pub(crate) async fn placement_config(&self) -> Result<PlacementConfig, ApiError> {
        Ok(self
            .store
            .cluster::<PlacementConfig>(PLACEMENT_KEY)
            .await?
            .unwrap_or_default())
    }

    pub(crate) async fn placement_status(&self) -> Result<PlacementStatus, ApiError> {
        let c = self.placement_cluster().await?;
        let broken = placement::strict_breaks(&c, &Engine::new(&c).assignment())
            .into_iter()
            .map(|(_, why)| why)
            .collect();
        Ok(PlacementStatus {
            config: c.config,
            broken,
        })
    }

    /// The cluster as the engine sees it: hosts that answer (taking VMs
    /// when healthy, not draining, not down), their VMs, the rules.
    pub(crate) fn cluster_of(&self, entries: &[HostEntry], config: PlacementConfig) -> Cluster {
        let draining = lock(&self.draining).clone();
        let usage = lock(&self.usage);
        let mut c = Cluster {
            config,
            ..Default::default()
        };
        for e in entries {
            let Some(info) = &e.info else { continue };
            c.hosts.push(placement::Host {
                name: e.name.clone(),
                free: info.memory_free,
                total: info.memory_total,
                cpus: info.cpus.max(1),
                net_bps: info.nic_rate.unwrap_or(0) as f64 / 8.0 * info.nics.len() as f64,
                takes_vms: e.reachable
                    && !e.down
                    && !e.draining
                    && !draining.contains(&e.name)
                    && e.health == Health::Ok,
            });
            for v in &info.vms {
                let (cpu, net) = usage.rates(&v.name);
                c.vms.push(placement::Vm {
                    name: v.name.clone(),
                    host: Some(e.name.clone()),
                    memory: v.spec.memory + crate::drain::VM_OVERHEAD,
                    cpu,
                    net,
                    resident: v
                        .usage
                        .as_ref()
                        .map(|u| u.rss.min(v.spec.memory))
                        .unwrap_or(v.spec.memory),
                    // as QEMU measured it; a workload guest's own figure
                    // until the first sample
                    dirty: v
                        .usage
                        .as_ref()
                        .and_then(|u| u.dirty_bps)
                        .unwrap_or(v.spec.dirty_rate) as f64,
                });
            }
        }
        c
    }

    pub(crate) async fn placement_cluster(&self) -> Result<Cluster, ApiError> {
        let config = self.placement_config().await?;
        let entries = self.list_hosts().await;
        Ok(self.cluster_of(&entries, config))
    }

    /// Where a new VM (`name`, `memory` of RAM) goes: on `host` if given
    /// (refused if that breaks a strict rule), else where the engine puts it.
    pub(crate) async fn place_new(
        &self,
        name: &str,
        memory: u64,
        host: Option<&str>,
    ) -> Result<PlannedPlacement, ApiError> {
        let config = self.placement_config().await?;
        if let (Some(h), true) = (host, config.rules.is_empty()) {
            // no rule to keep: the host named, as asked
            return Ok(PlannedPlacement {
                vm: name.into(),
                to: h.into(),
                breaks: Vec::new(),
            });
        }
        let mut c = self.cluster_of(&self.list_hosts().await, config);
        c.vms.retain(|v| v.name != name);
        c.vms.push(placement::Vm::placed(name, "", memory));
        if let Some(h) = host {
            // the host the caller named, whatever its memory says (the
            // agent checks that): only the rules are the engine's here
            for x in &mut c.hosts {
                if x.name == h {
                    x.free = x.free.max(memory + crate::drain::VM_OVERHEAD);
                    x.takes_vms = true;
                }
            }
        }
        placement::place_one(&c, name, &|h| host.is_none_or(|want| want == h)).map_err(|r| {
            match host {
                Some(h) => ApiError::Conflict {
                    reason: format!("VM {name} may not run on {h}: {r}"),
                },
                None => ApiError::Conflict {
                    reason: format!("no host may run VM {name}: {r}"),
                },
            }
        })
    }

    /// Another host for a VM whose move failed, among `left`: the
    /// engine's choice on the cluster as it is now.
    pub(crate) async fn place_again(&self, vm: &str, left: &[String]) -> Option<String> {
        let c = self.placement_cluster().await.ok()?;
        placement::place_one(&c, vm, &|h| left.iter().any(|l| l == h))
            .ok()
            .map(|p| p.to)
    }

    /// Refuses a move of `vm` to `to` that breaks a strict rule.
    pub(crate) async fn check_move(&self, vm: &str, to: &str) -> Result<(), ApiError> {
        let config = self.placement_config().await?;
        if config.rules.is_empty() {
            return Ok(());
        }
        let mut c = self.cluster_of(&self.list_hosts().await, config);
        for x in &mut c.hosts {
            if x.name == to {
                x.takes_vms = true;
                x.free = u64::MAX / 4;
            }
        }
        let mut e = Engine::new(&c);
        let (_, refused) = e.place(&[vm.to_string()], &|h| h == to);
        match refused.into_iter().next() {
            Some(r) => Err(ApiError::Conflict {
                reason: format!("VM {vm} may not move to {to}: {r}"),
            }),
            None => Ok(()),
        }
    }

    /// Keeps `next` if it holds together and can be met on the cluster.
    async fn save_placement(&self, next: PlacementConfig) -> Result<PlacementConfig, ApiError> {
        let entries = self.list_hosts().await;
        let hosts: Vec<String> = entries.iter().map(|e| e.name.clone()).collect();
        next.check(&hosts)?;
        for g in &next.groups {
            for h in &g.hosts {
                self.host(h)?;
            }
        }
        let c = self.cluster_of(&entries, next.clone());
        placement::feasible(&c).map_err(|r| ApiError::Conflict {
            reason: format!("the rules leave VM {} no host the cluster has: {r}", r.vm),
        })?;
        self.store.put_cluster(PLACEMENT_KEY, &next).await?;
        Ok(next)
    }

    pub(crate) async fn create_rule(&self, rule: Rule) -> Result<PlacementConfig, ApiError> {
        rule.validate()?;
        let mut c = self.placement_config().await?;
        if c.rules.iter().any(|r| r.name == rule.name) {
            return Err(ApiError::AlreadyExists {
                kind: "rule".into(),
                name: rule.name,
            });
        }
        let name = rule.name.clone();
        let what = rule.describe();
        c.rules.push(rule);
        let c = self.save_placement(c).await?;
        self.log("rule_created", &name, serde_json::json!({ "rule": what }));
        Ok(c)
    }

    pub(crate) async fn remove_rule(&self, name: &str) -> Result<PlacementConfig, ApiError> {
        let mut c = self.placement_config().await?;
        let before = c.rules.len();
        c.rules.retain(|r| r.name != name);
        if c.rules.len() == before {
            return Err(ApiError::not_found("rule", name));
        }
        // fewer rules are always feasible
        self.store.put_cluster(PLACEMENT_KEY, &c).await?;
        self.log("rule_removed", name, serde_json::Value::Null);
        Ok(c)
    }

    pub(crate) async fn create_group(&self, group: HostGroup) -> Result<PlacementConfig, ApiError> {
        group.validate()?;
        let mut c = self.placement_config().await?;
        let name = group.name.clone();
        // made again: redefined (its rules are checked against the new members)
        c.groups.retain(|g| g.name != group.name);
        c.groups.push(group);
        let c = self.save_placement(c).await?;
        self.log("group_set", &name, serde_json::Value::Null);
        Ok(c)
    }

    pub(crate) async fn remove_group(&self, name: &str) -> Result<PlacementConfig, ApiError> {
        let mut c = self.placement_config().await?;
        if c.group(name).is_none() {
            return Err(ApiError::not_found("host group", name));
        }
        let users: Vec<&str> = c
            .rules
            .iter()
            .filter(|r| r.group.as_deref() == Some(name))
            .map(|r| r.name.as_str())
            .collect();
        if !users.is_empty() {
            return Err(ApiError::Conflict {
                reason: format!("group {name} is used by rule {}", users.join(", ")),
            });
        }
        c.groups.retain(|g| g.name != name);
        self.store.put_cluster(PLACEMENT_KEY, &c).await?;
        self.log("group_removed", name, serde_json::Value::Null);
        Ok(c)
    }

    pub(crate) async fn set_labels(
        &self,
        host: &str,
        u: LabelUpdate,
    ) -> Result<BTreeMap<String, String>, ApiError> {
        self.host(host)?;
        for (k, v) in &u.set {
            ferry_api::placement::validate_label(k, v)?;
        }
        let mut c = self.placement_config().await?;
        let labels = c.labels.entry(host.to_string()).or_default();
        for k in &u.unset {
            labels.remove(k);
        }
        labels.extend(u.set.clone());
        let now = labels.clone();
        if now.is_empty() {
            c.labels.remove(host);
        }
        self.save_placement(c).await?;
        self.log("labels_set", host, serde_json::json!({ "labels": now }));
        Ok(now)
    }

    /// The balancer: a plan, and unless `dry_run`, its moves run one at a
    /// time in the background (events `balance_move`, `balance_done`).
    pub(crate) async fn balance(
        self: &std::sync::Arc<Self>,
        req: BalanceRequest,
    ) -> Result<BalancePlan, ApiError> {
        let threshold = req.threshold.unwrap_or(DEFAULT_THRESHOLD);
        if !(0.0..=1.0).contains(&threshold) {
            return Err(ApiError::invalid(
                "threshold",
                "must be 0..1 (a spread of host load)",
            ));
        }
        let entries = self.list_hosts().await;
        let mut plan = self.plan_balance(&entries, threshold).await?;
        if req.dry_run || plan.moves.is_empty() {
            return Ok(plan);
        }
        if let Some(why) = self.drain_running() {
            return Err(ApiError::Conflict {
                reason: format!(
                    "{why}; balance once it is done (its moves take the migration budget)"
                ),
            });
        }
        if !self.claim_balancer() {
            return Err(ApiError::Conflict {
                reason: "a balance is running (ferry events shows its moves)".into(),
            });
        }
        plan.started = true;
        self.run_balance(plan.moves.clone(), false);
        Ok(plan)
    }

    async fn plan_balance(
        &self,
        entries: &[HostEntry],
        threshold: f64,
    ) -> Result<BalancePlan, ApiError> {
        let config = self.placement_config().await?;
        // a VM being moved, started or stopped stays where it is, as does
        // one in its cooldown
        let now = now_ms();
        let cooling: Vec<String> = lock(&self.balancer)
            .cooldown
            .iter()
            .filter(|(_, c)| c.0 > now)
            .map(|(v, _)| v.clone())
            .collect();
        let busy: Vec<String> = entries
            .iter()
            .filter_map(|h| h.info.as_ref())
            .flat_map(|i| &i.vms)
            .filter(|v| v.migrating || v.state != "running")
            .map(|v| v.name.clone())
            .chain(cooling)
            .collect();
        let c = self.cluster_of(entries, config);
        // the slowest host's share: a move's time is bounded by its ends
        let link_bps = entries
            .iter()
            .filter_map(|e| e.info.as_ref())
            .map(move_bps)
            .fold(f64::INFINITY, f64::min);
        let link_bps = if link_bps.is_finite() {
            link_bps
        } else {
            DEFAULT_LINK_BPS
        };
        Ok(Engine::new(&c).balance(
            threshold,
            link_bps,
            &|vm| busy.iter().any(|b| b == vm),
            MAX_BALANCE_MOVES,
        ))
    }

    /// A drain running, which owns the hosts' migration budget (its limit
    /// per host, tuned as it goes): the balancer waits for it.
    fn drain_running(&self) -> Option<String> {
        let draining = lock(&self.draining);
        let mut hosts: Vec<&String> = draining.iter().collect();
        hosts.sort();
        hosts.first().map(|h| format!("{h} is draining"))
    }

    /// Takes the balancer for one run; false if one runs.
    fn claim_balancer(&self) -> bool {
        let mut b = lock(&self.balancer);
        !std::mem::replace(&mut b.running, true)
    }

    /// Runs `moves` one at a time in the background; `auto`: each VM moved
    /// starts (or doubles) its cooldown.
    fn run_balance(self: &std::sync::Arc<Self>, moves: Vec<BalanceMove>, auto: bool) {
        let me = self.clone();
        tokio::spawn(async move {
            let (mut done, mut bytes) = (0usize, 0u64);
            let mut stopped = None;
            for m in moves {
                // a drain begun meanwhile takes the migration budget
                if let Some(why) = me.drain_running() {
                    stopped = Some(why);
                    break;
                }
                match me.balance_move(&m.vm, &m.to).await {
                    Ok(b) => {
                        done += 1;
                        bytes += b;
                        me.log(
                            "balance_move",
                            &m.vm,
                            serde_json::json!({ "from": m.from, "to": m.to, "bytes": b,
                                                "predicted_bytes": m.bytes, "auto": auto }),
                        );
                    }
                    Err(e) => me.log(
                        "balance_move_failed",
                        &m.vm,
                        serde_json::json!({ "from": m.from, "to": m.to, "reason": e.to_string() }),
                    ),
                }
                if auto {
                    lock(&me.balancer).cooled(&m.vm, now_ms());
                }
            }
            lock(&me.balancer).running = false;
            me.log(
                "balance_done",
                "cluster",
                serde_json::json!({ "moved": done, "bytes": bytes, "auto": auto, "stopped": stopped }),
            );
        });
    }

    /// The automatic balancer's check (the leader, each heartbeat): every
    /// `balance_every_s`, a plan; moves once the spread was over the
    /// threshold [`HOLD_ROUNDS`] checks running, or at once to mend a
    /// strict rule.
    pub(crate) async fn auto_balance(self: &std::sync::Arc<Self>, hosts: &[HostEntry]) {
        let Ok(s) = self.cluster_settings().await else {
            return;
        };
        let now = now_ms();
        {
            let mut b = lock(&self.balancer);
            if !s.balance_auto {
                b.over = 0;
                return;
            }
            if b.running || now < b.next_ms {
                return;
            }
            if self.drain_running().is_some() {
                // checks count again from zero once the drain is done
                b.over = 0;
                return;
            }
            b.next_ms = now + s.balance_every_s * 1000;
        }
        let threshold = s.balance_threshold_pct as f64 / 100.0;
        let plan = match self.plan_balance(hosts, threshold).await {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!("balance: {e}");
                return;
            }
        };
        let mends = plan.moves.iter().any(|m| m.mends.is_some());
        {
            let mut b = lock(&self.balancer);
            if plan.moves.is_empty() {
                b.over = 0;
                return;
            }
            b.over += 1;
            if b.over < HOLD_ROUNDS && !mends {
                return;
            }
            b.over = 0;
        }
        if !self.claim_balancer() {
            return;
        }
        self.log(
            "balance_auto",
            "cluster",
            serde_json::json!({ "spread_before": plan.spread_before, "spread_after": plan.spread_after,
                                "threshold": threshold, "moves": plan.moves.len() }),
        );
        self.run_balance(plan.moves, true);
    }

    /// One balance move, to its end; the bytes it sent.
    async fn balance_move(&self, vm: &str, to: &str) -> Result<u64, ApiError> {
        self.check_move(vm, to).await?;
        self.refuse_draining(to)?;
        let (_, info) = self.locate(vm).await?;
        crate::refuse_storage_paused(&info)?;
        let mut events = self
            .begin_migration(&info, to, None, Default::default())
            .await?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3_600);
        while let Ok(Some(ev)) = tokio::time::timeout_at(deadline, events.next()).await {
            match ev? {
                MigrationEvent::Completed(r) => return Ok(r.bytes_transferred),
                MigrationEvent::Failed { error } => return Err(error),
                _ => {}
            }
        }
        Err(ApiError::internal(format!(
            "the move of {vm} ended without a result"
        )))
    }

    /// Notes each VM's CPU time for the balancer (every instance, each heartbeat).
    pub(crate) fn note_usage(&self, hosts: &[HostEntry]) {
        lock(&self.usage).note(now_ms(), hosts);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Host `host` listing VM `a` in `state`, its QEMU having used
    /// `cpu_ms` and moved `io_bytes`.
    fn listed(host: &str, state: &str, cpu_ms: u64, io_bytes: u64) -> HostEntry {
        let mut info: ferry_api::HostInfo = serde_json::from_value(serde_json::json!({
            "name": host, "agent_url": "", "memory_total": 0, "memory_reserved": 0,
            "memory_free": 0, "nics": [], "vms": []
        }))
        .unwrap();
        let mut v: ferry_api::VmInfo = serde_json::from_value(serde_json::json!({
            "name": "a", "host": host, "spec": ferry_api::VmSpec::workload("a", 1 << 30, 0, 0),
            "state": state, "pid": null, "accel": "tcg"
        }))
        .unwrap();
        v.usage = Some(ferry_api::VmUsage {
            cpu_ms,
            rss: 0,
            io_bytes,
            dirty_bps: None,
        });
        info.vms.push(v);
        HostEntry {
            name: host.into(),
            agent_url: String::new(),
            reachable: true,
            down: false,
            last_heartbeat_ms: None,
            draining: false,
            settings: None,
            error: None,
            info: Some(info),
            health: Health::Ok,
        }
    }

    #[test]
    fn usage_is_rates_over_the_window_and_restarts_with_the_vm() {
        let mut u = Usage::default();
        let entry = |cpu_ms, io_bytes| listed("h1", "running", cpu_ms, io_bytes);
        u.note(0, &[entry(0, 0)]);
        assert_eq!(u.rates("a"), (0.0, 0.0));
        u.note(10_000, &[entry(5_000, 50_000_000)]);
        let (cores, bps) = u.rates("a");
        assert!((cores - 0.5).abs() < 1e-9);
        assert!((bps - 5e6).abs() < 1e-3);
        // restarted: its count starts again
        u.note(20_000, &[entry(100, 10)]);
        assert_eq!(u.rates("a"), (0.0, 0.0));
        u.note(30_000, &[]);
        assert_eq!(u.rates("a"), (0.0, 0.0));
    }

    #[test]
    fn a_moving_vms_skeleton_does_not_restart_its_count() {
        let mut u = Usage::default();
        // the source's QEMU has run long; the target's skeleton has just begun
        let beat = |t: u64| {
            [
                listed("h1", "running", 5_000 + t / 2, 0),
                listed("h2", "incoming", t / 100, 0),
            ]
        };
        u.note(0, &beat(0));
        u.note(10_000, &beat(10_000));
        let (cores, _) = u.rates("a");
        assert!((cores - 0.5).abs() < 1e-9, "the source's rate: {cores}");
    }

    #[test]
    fn a_move_gets_the_up_nics_under_the_migration_cap() {
        let mut info: ferry_api::HostInfo = serde_json::from_value(serde_json::json!({
            "name": "h1", "agent_url": "", "memory_total": 0, "memory_reserved": 0,
            "memory_free": 0, "vms": [],
            "nics": [
                {"name": "n1", "fabric": 1, "address": "", "mtu": 1500, "up": true, "tx_bytes": 0, "rx_bytes": 0},
                {"name": "n2", "fabric": 2, "address": "", "mtu": 1500, "up": false, "tx_bytes": 0, "rx_bytes": 0}
            ]
        }))
        .unwrap();
        assert_eq!(move_bps(&info), DEFAULT_LINK_BPS, "no rate said");
        info.nic_rate = Some(800_000_000);
        assert_eq!(move_bps(&info), 100e6, "one NIC up of two");
        info.nics[1].up = true;
        assert_eq!(move_bps(&info), 200e6);
        use ferry_api::bandwidth::{BandwidthPolicy, Cap, ClassLimits, TrafficClass};
        let capped = |max| BandwidthPolicy {
            classes: vec![ClassLimits {
                class: TrafficClass::LiveMigration,
                max: Some(max),
                min_pct: 0,
            }],
        };
        info.bandwidth = capped(Cap::Percent(50));
        assert_eq!(move_bps(&info), 100e6, "half of each NIC");
        info.bandwidth = capped(Cap::BitsPerSec(400_000_000));
        assert_eq!(move_bps(&info), 50e6, "a rate for the whole host");
    }

    #[test]
    fn a_vm_moved_by_the_balancer_cools_down_longer_each_time() {
        let mut b = Balancer::default();
        b.cooled("a", 0);
        assert_eq!(b.cooldown["a"], (COOLDOWN_MS, COOLDOWN_MS));
        b.cooled("a", 1_000);
        assert_eq!(b.cooldown["a"].1, 2 * COOLDOWN_MS);
        for _ in 0..10 {
            b.cooled("a", 0);
        }
        assert_eq!(b.cooldown["a"].1, COOLDOWN_MAX_MS);
    }
}
