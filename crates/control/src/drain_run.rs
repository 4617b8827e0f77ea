//! Running a drain: the plan and the self-tuning limit of [`crate::drain`]
//! carried out with live migrations, progress sampled from their events.

use std::time::Duration;

use ferry_api::drain::{
    DrainEvent, DrainReport, DrainRequest, DrainedVm, MigrationLimit, PlannedMove, Unplaceable,
};
use ferry_api::{ApiError, MigrationEvent};
use futures::stream::BoxStream;
use futures::StreamExt;
use std::sync::Arc;

use crate::*;

impl Control {
    /// Drains `host`: plan, then move with a self-tuning limit, retrying
    /// failed moves elsewhere. The host takes no VMs from the start.
    pub(crate) async fn drain(
        self: Arc<Self>,
        host: String,
        req: DrainRequest,
    ) -> Result<BoxStream<'static, DrainEvent>, ApiError> {
        self.host(&host)?;
        for t in &req.to {
            self.host(t)?;
            if *t == host {
                return Err(ApiError::invalid(
                    "to",
                    format!("{host} cannot drain onto itself"),
                ));
            }
        }
        let entries = self.list_hosts().await;
        let source = entries
            .iter()
            .find(|h| h.name == host)
            .and_then(|h| h.info.clone())
            .ok_or_else(|| ApiError::unavailable(format!("agent {host}"), "does not answer"))?;
        lock(&self.draining).insert(host.clone());
        self.store.set_draining(&host, true).await?;
        let draining = lock(&self.draining).clone();
        let mut targets: Vec<(String, u64)> = entries
            .iter()
            .filter(|h| h.name != host && !draining.contains(&h.name) && !h.down)
            .filter(|h| req.to.is_empty() || req.to.contains(&h.name))
            .filter_map(|h| Some((h.name.clone(), h.info.as_ref()?.memory_free)))
            .collect();
        let vms: Vec<(String, u64)> = source
            .vms
            .iter()
            .filter(|v| v.state != "incoming")
            .map(|v| (v.name.clone(), v.spec.memory))
            .collect();
        // the placement engine's plan: every rule kept, the most free memory
        let cluster = self.cluster_of(&entries, self.placement_config().await?);
        let names: Vec<String> = vms.iter().map(|v| v.0.clone()).collect();
        let allowed: Vec<String> = targets.iter().map(|t| t.0.clone()).collect();
        let (planned, refused) = crate::placement::Engine::new(&cluster)
            .place(&names, &|h| allowed.iter().any(|a| a == h));
        let memory_of = |vm: &str| vms.iter().find(|v| v.0 == vm).map(|v| v.1).unwrap_or(0);
        let mut soft_breaks = Vec::new();
        let moves: Vec<PlannedMove> = planned
            .into_iter()
            .map(|p| {
                let memory = memory_of(&p.vm);
                if let Some(t) = targets.iter_mut().find(|t| t.0 == p.to) {
                    t.1 = t.1.saturating_sub(memory + drain::VM_OVERHEAD);
                }
                for b in &p.breaks {
                    soft_breaks.push(DrainEvent::Warning {
                        message: format!("{} goes to {} breaking {b}", p.vm, p.to),
                    });
                }
                PlannedMove {
                    vm: p.vm,
                    memory,
                    to: p.to,
                }
            })
            .collect();
        let unplaceable: Vec<Unplaceable> = refused
            .into_iter()
            .map(|r| Unplaceable {
                memory: memory_of(&r.vm),
                reason: format!("no target keeps its rules and has room: {r}"),
                vm: r.vm,
            })
            .collect();
        let limit_setting = req
            .max_parallel
            .or_else(|| {
                lock(&self.settings)
                    .get(&host)
                    .and_then(|s| s.max_migrations)
            })
            .unwrap_or_default();
        let warnings: Vec<DrainEvent> = {
            let last = self.last_validation.lock().await;
            let mut to: Vec<&str> = moves.iter().map(|m| m.to.as_str()).collect();
            to.sort();
            to.dedup();
            to.iter()
                .flat_map(|t| {
                    last.as_ref()
                        .map(|r| r.failed_paths(&host, t))
                        .unwrap_or_default()
                })
                .map(|c| DrainEvent::Warning {
                    message: failed_path_warning(c),
                })
                .collect()
        };
        let (tx, rx) = tokio::sync::mpsc::channel::<DrainEvent>(256);
        for w in warnings.into_iter().chain(soft_breaks) {
            let _ = tx.send(w).await;
        }
        let me = self.clone();
        tokio::spawn(async move {
            me.run_drain(
                host,
                req.option,
                moves,
                unplaceable,
                targets,
                limit_setting,
                tx,
            )
            .await;
        });
        Ok(
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) })
                .boxed(),
        )
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_drain(
        self: Arc<Self>,
        host: String,
        option: Option<ferry_api::MigrationOption>,
        moves: Vec<PlannedMove>,
        unplaceable: Vec<Unplaceable>,
        mut targets: Vec<(String, u64)>,
        setting: MigrationLimit,
        tx: tokio::sync::mpsc::Sender<DrainEvent>,
    ) {
        let started = std::time::Instant::now();
        let mut auto = drain::AutoLimit::with_capacity(match setting {
            MigrationLimit::Auto => self.drain_capacity(&host, option).await,
            MigrationLimit::Fixed(_) => None,
        });
        let (limit, mut limits) = match setting {
            MigrationLimit::Auto => (auto.limit, vec![auto.want]),
            MigrationLimit::Fixed(n) => (n, vec![n]),
        };
        let _ = tx
            .send(DrainEvent::Plan {
                moves: moves.clone(),
                unplaceable: unplaceable.clone(),
                limit,
            })
            .await;
        if setting == MigrationLimit::Auto {
            let links = match auto.capacity() {
                Some(c) => format!("; the links carry {:.0} Mbit/s", c * 8.0 / 1e6),
                None => String::new(),
            };
            let reason = format!(
                "auto: {} at once to start, one more each time it pays, up to {limit}{links}",
                auto.want
            );
            let _ = tx
                .send(DrainEvent::Limit {
                    limit: auto.want,
                    reason,
                })
                .await;
        }
        // the drained host's `/bandwidth`, once a second: its CPU busy share
        // (a drain the CPU limits says so) and, every 2 s while classes are
        // set, each class's rate per NIC
        let cpu: Arc<std::sync::Mutex<Option<f64>>> = Default::default();
        let watch = {
            let me = self.clone();
            let (host, tx, cpu) = (host.clone(), tx.clone(), cpu.clone());
            tokio::spawn(async move {
                for tick in 1u64.. {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    let Ok(c) = me.host(&host) else { break };
                    let Ok(b) = c
                        .get::<ferry_api::bandwidth::HostBandwidth>("/bandwidth", AGENT_TIMEOUT)
                        .await
                    else {
                        continue;
                    };
                    *lock(&cpu) = b.cpu_busy;
                    if tick % 2 == 0 && !me.bandwidth_policy().classes.is_empty() {
                        let ev = DrainEvent::Classes {
                            host: host.clone(),
                            nics: b.nics,
                        };
                        if tx.send(ev).await.is_err() {
                            break;
                        }
                    }
                }
            })
        };
        let mut queue: std::collections::VecDeque<(PlannedMove, u32, Vec<String>)> =
            moves.into_iter().map(|m| (m, 1, Vec::new())).collect();
        let mut running = tokio::task::JoinSet::new();
        let (mut moved, mut failed) = (Vec::new(), Vec::new());
        // what each running move reports, and the bytes finished ones sent
        let samples: Samples = Default::default();
        let mut setup_seen = std::collections::HashSet::new();
        let mut sent_done = 0u64;
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let allowed = match setting {
                MigrationLimit::Fixed(n) => n,
                MigrationLimit::Auto => {
                    if let Some(b) = *lock(&cpu) {
                        auto.observe_cpu(b);
                    }
                    let (sent, runs) = {
                        let s = lock(&samples);
                        for (vm, x) in s.iter() {
                            if let Some(d) = x.setup.filter(|_| !setup_seen.contains(vm)) {
                                auto.observe_setup(d);
                                setup_seen.insert(vm.clone());
                            }
                        }
                        let lead = auto.lead();
                        let sent = sent_done + s.values().map(|x| x.sent).sum::<u64>();
                        (
                            sent,
                            s.values().map(|x| x.running(lead)).collect::<Vec<_>>(),
                        )
                    };
                    let (allowed, change) = auto.tick(std::time::Instant::now(), sent, &runs);
                    if let Some((l, reason)) = change {
                        if limits.last() != Some(&l) {
                            limits.push(l);
                        }
                        let _ = tx.send(DrainEvent::Limit { limit: l, reason }).await;
                    }
                    allowed
                }
            };
            while running.len() < allowed as usize {
                let Some((m, attempt, tried)) = queue.pop_front() else {
                    break;
                };
                lock(&samples).insert(m.vm.clone(), Sample::default());
                let _ = tx
                    .send(DrainEvent::Started {
                        vm: m.vm.clone(),
                        to: m.to.clone(),
                        attempt,
                    })
                    .await;
                let me = self.clone();
                let tx2 = tx.clone();
                let samples = samples.clone();
                running.spawn(async move {
                    let r = me.drain_one(&m, option, &tx2, &samples).await;
                    (m, attempt, tried, r)
                });
            }
            if running.is_empty() {
                break;
            }
            let joined = tokio::select! {
                j = running.join_next() => j,
                _ = tick.tick() => continue,
            };
            let Some(joined) = joined else {
                break;
            };
            let Ok((m, attempt, mut tried, result)) = joined else {
                continue;
            };
            if let Some(last) = lock(&samples).remove(&m.vm) {
                sent_done += match &result {
                    Ok(r) => r.bytes_transferred,
                    Err(_) => last.sent,
                };
            }
            match result {
                Ok(r) => {
                    let d = DrainedVm {
                        vm: m.vm.clone(),
                        to: m.to.clone(),
                        attempts: attempt,
                        total_ms: r.total_ms,
                        transfer_ms: r.transfer_ms,
                        downtime_ms: r.guest_downtime_ms.max(r.downtime_ms),
                        bytes: r.bytes_transferred,
                    };
                    let _ = tx.send(DrainEvent::Moved(d.clone())).await;
                    moved.push(d);
                }
                Err(e) => {
                    let need = m.memory + drain::VM_OVERHEAD;
                    // the failed target's reservation is free again
                    if let Some(t) = targets.iter_mut().find(|t| t.0 == m.to) {
                        t.1 += need;
                    }
                    tried.push(m.to.clone());
                    let next = if attempt < drain::MAX_ATTEMPTS {
                        let left: Vec<String> = targets
                            .iter()
                            .filter(|t| !tried.contains(&t.0))
                            .map(|t| t.0.clone())
                            .collect();
                        self.place_again(&m.vm, &left).await
                    } else {
                        None
                    };
                    match next {
                        Some(to) => {
                            if let Some(t) = targets.iter_mut().find(|t| t.0 == to) {
                                t.1 = t.1.saturating_sub(need);
                            }
                            let _ = tx
                                .send(DrainEvent::Retry {
                                    vm: m.vm.clone(),
                                    failed_on: m.to.clone(),
                                    reason: e.to_string(),
                                    next: to.clone(),
                                })
                                .await;
                            queue.push_back((PlannedMove { to, ..m }, attempt + 1, tried));
                        }
                        None => {
                            // a migration error already says where the VM runs
                            let reason = match &e {
                                ApiError::MigrationFailed { .. } => e.to_string(),
                                _ => format!("{e}; it keeps running on {host}"),
                            };
                            let _ = tx
                                .send(DrainEvent::Failed {
                                    vm: m.vm.clone(),
                                    reason: reason.clone(),
                                })
                                .await;
                            failed.push(Unplaceable {
                                vm: m.vm,
                                memory: m.memory,
                                reason,
                            });
                        }
                    }
                }
            }
        }
        let report = DrainReport {
            host,
            bytes: moved.iter().map(|d| d.bytes).sum(),
            moved,
            unplaceable,
            failed,
            total_ms: started.elapsed().as_millis() as u64,
            limits,
        };
        watch.abort();
        let _ = tx.send(DrainEvent::Done(report)).await;
    }

    /// What the drained host's links carry for `option`, bytes/s: every NIC
    /// up, or (tcp, one NIC per migration) the fastest; `None` if unknown.
    async fn drain_capacity(
        &self,
        host: &str,
        option: Option<ferry_api::MigrationOption>,
    ) -> Option<f64> {
        let (option, _) = self
            .migration_policy(host, option, Default::default())
            .ok()?;
        let b: ferry_api::bandwidth::HostBandwidth = self
            .host(host)
            .ok()?
            .get("/bandwidth", AGENT_TIMEOUT)
            .await
            .ok()?;
        let rates = b
            .nics
            .iter()
            .filter(|n| n.up)
            .map(|n| n.link_rate as f64 / 8.0);
        let c = match option {
            ferry_api::MigrationOption::Tcp => rates.fold(0.0, f64::max),
            _ => rates.sum(),
        };
        (c > 0.0).then_some(c)
    }

    /// One move of a drain, forwarding its progress (at most twice a second).
    async fn drain_one(
        &self,
        m: &PlannedMove,
        option: Option<ferry_api::MigrationOption>,
        tx: &tokio::sync::mpsc::Sender<DrainEvent>,
        samples: &Samples,
    ) -> Result<ferry_api::MigrationReport, ApiError> {
        let began = std::time::Instant::now();
        // a drain may move onto hosts only it reserved, so no draining check here
        let (_, info) = self.locate(&m.vm).await?;
        crate::refuse_storage_paused(&info)?;
        let mut events = self
            .begin_migration(&info, &m.to, option, Default::default())
            .await?;
        let mut last = std::time::Instant::now() - Duration::from_secs(1);
        let mut copying_since = None;
        let mut setup = None;
        while let Some(ev) = events.next().await {
            let ev = ev?;
            if let MigrationEvent::Progress(p) = &ev {
                if p.status != "active" {
                    copying_since = None;
                } else if copying_since.is_none() && p.transferred > 0 {
                    copying_since = Some(std::time::Instant::now());
                    setup.get_or_insert(began.elapsed());
                }
                let progress = SampledProgress {
                    active: p.status == "active",
                    finished: matches!(
                        p.status.as_str(),
                        "device" | "completed" | "postcopy-active"
                    ) || matches!(
                        p.phase.as_str(),
                        "postcopy" | "pause-and-copy" | "blackout"
                    ),
                    rounds: p.rounds,
                    remaining: p.remaining,
                    throughput: p.throughput,
                    eta: p.eta_ms.map(Duration::from_millis),
                    copying_since,
                };
                lock(samples).insert(
                    m.vm.clone(),
                    Sample {
                        sent: p.transferred,
                        progress: Some(progress),
                        setup,
                    },
                );
            }
            match ev {
                MigrationEvent::Progress(p) if last.elapsed() >= Duration::from_millis(500) => {
                    last = std::time::Instant::now();
                    let _ = tx
                        .send(DrainEvent::Progress {
                            vm: m.vm.clone(),
                            transferred: p.transferred,
                            remaining: p.remaining,
                            total: p.total,
                        })
                        .await;
                }
                MigrationEvent::Completed(r) => return Ok(*r),
                MigrationEvent::Failed { error } => return Err(error),
                _ => {}
            }
        }
        Err(ApiError::internal(format!(
            "the migration of {} ended without a result",
            m.vm
        )))
    }
}

/// A running move of a drain, as its progress last said.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    /// Bytes QEMU has sent.
    sent: u64,
    /// The latest progress, once there is one.
    progress: Option<SampledProgress>,
    /// From the move's start to QEMU copying (establish, skeleton, connection).
    setup: Option<Duration>,
}

#[derive(Debug, Clone, Copy)]
struct SampledProgress {
    active: bool,
    finished: bool,
    rounds: u64,
    remaining: u64,
    throughput: f64,
    eta: Option<Duration>,
    copying_since: Option<std::time::Instant>,
}

impl Sample {
    pub(crate) fn running(&self, lead: Duration) -> drain::Running {
        match &self.progress {
            None => drain::Running::default(),
            Some(p) => drain::Running::from_progress(
                p.active,
                p.finished,
                p.rounds,
                p.remaining,
                p.throughput,
                p.eta,
                lead,
                p.copying_since.map(|t| t.elapsed()).unwrap_or_default(),
            ),
        }
    }
}

type Samples = Arc<std::sync::Mutex<std::collections::HashMap<String, Sample>>>;
