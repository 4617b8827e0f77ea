//! Steps 9-11 of a move: the commit (post-copy's before QEMU switches,
//! pre-copy's with both guests paused), RUN, the source's cleanup, the guest
//! check on the target, and the report.

use std::time::{Duration, Instant};

use ferry_api::{
    CarrierReport, CheckResult, CpuReport, DowntimePart, IncomingStatus, MigrationEvent,
    MigrationReport, QemuCodecReport,
};

use super::sequence::Outcome;
use super::source::Move;
use super::watch::Hold;
use super::{carrier_bytes, data_path_of, fail, in_doubt, Failure, Plan};
use crate::commit::{source_next, SourceAction, SourceEvent, SourcePhase};
use crate::host::error_chain;

/// What the steps from the end of QEMU's copy on learn.
#[derive(Default)]
pub(super) struct End {
    /// The source console's last counter (None: not readable after a
    /// post-copy commit).
    pub tick_before: Option<u64>,
    pub t_completed: Option<Instant>,
    pub t_tick: Option<Instant>,
    /// READY's answer (pre-copy).
    pub ready: Option<IncomingStatus>,
    /// RUN's answer.
    pub ran: Option<IncomingStatus>,
    pub t_running: Option<Instant>,
    /// When the target's vCPUs started, as its RUN answer dates it on the
    /// source's clock (`t_running` for a target that does not say).
    pub t_resumed: Option<Instant>,
    /// The switch-over's parts, ms.
    pub switch_parts: Vec<(&'static str, u64)>,
    /// The carriers as they were when QEMU finished (the target closes its
    /// end once the guest runs there).
    pub carriers_at_end: Option<ferry_transport::SessionStats>,
}

impl Move<'_> {
    /// Post-copy is after the commit by definition: the target gets the
    /// device state and runs before it has every page. It must wait, paused.
    pub(super) async fn postcopy_check(&mut self) -> Result<Outcome, Failure> {
        let st: IncomingStatus = self
            .target
            .get(&format!("/incoming/{}", self.id), Duration::from_secs(5))
            .await
            .map_err(|e| fail("postcopy", format!("the target does not answer: {e}")))?;
        if !(st.qemu_alive && st.phase == "waiting") {
            return Err(fail(
                "postcopy",
                format!(
                    "the target is not waiting ({}, QEMU {})",
                    st.phase, st.qemu_status
                ),
            ));
        }
        Ok(Outcome::Done)
    }

    /// The commit, recorded before QEMU switches to post-copy.
    pub(super) async fn postcopy_commit(&mut self) -> Result<Outcome, Failure> {
        self.agent
            .set_source_phase(self.id, SourcePhase::Committed)
            .map_err(|e| fail("postcopy", e.to_string()))?;
        self.committed = true;
        self.ev
            .step(
                "commit",
                format!(
                    "commit recorded on {} before post-copy: from now on only {} may run {}",
                    self.agent.cfg.name, self.req.target, self.spec.name
                ),
            )
            .await;
        crate::failpoint::pass("source-after-commit").await;
        Ok(Outcome::Done)
    }

    /// `migrate-start-postcopy`. Refused, QEMU never switches: the journal's
    /// commit is then settled as one QEMU never acted on (see `settle`).
    pub(super) async fn postcopy_start(&mut self) -> Result<Outcome, Failure> {
        let refused = match crate::failpoint::hit("source-start-postcopy") {
            Some(crate::failpoint::Action::Fail) => {
                Some("refused at fail point source-start-postcopy".to_string())
            }
            _ => self
                .vm
                .qmp
                .start_postcopy()
                .await
                .err()
                .map(|e| error_chain(&e)),
        };
        if let Some(why) = refused {
            return Err(super::lost(format!(
                "QEMU refused to start post-copy: {why}"
            )));
        }
        let w = self.watch.as_mut().expect("the Stream step ran");
        w.copy.entered_postcopy();
        let detail = format!(
            "pre-copy does not converge ({}); the guest now runs on the target, pages follow on demand",
            w.rates_text()
        );
        self.ev.step("postcopy", detail).await;
        Ok(Outcome::Done)
    }

    /// Step 9, QEMU completed: the source console's last counter read. Before
    /// the commit an unreadable console fails the move (it rolls back);
    /// after a post-copy's commit it only leaves the check without it.
    pub(super) async fn tick(&mut self) -> Result<Outcome, Failure> {
        self.end.carriers_at_end = match self.plan_ref() {
            Plan::Multichannel { session, .. } => Some(session.stats()),
            Plan::Tcp { .. } => None,
        };
        if !self.blackout_seen() {
            let downtime = self.qemu_info().downtime.unwrap_or(0);
            self.ev
                .step(
                    "blackout",
                    format!("source paused for {downtime} ms of downtime"),
                )
                .await;
        }
        self.end.t_completed = Some(Instant::now());
        self.end.tick_before = match self.agent.console_tick(self.vm) {
            Ok(t) => t,
            Err(e) if self.committed => {
                tracing::warn!(error = %e, "reading the source console after the commit");
                None
            }
            Err(e) => {
                return Err(fail(
                    "final-check",
                    format!("reading the source console: {e}"),
                ))
            }
        };
        self.end.t_tick = Some(Instant::now());
        Ok(Outcome::Done)
    }

    /// Both guests are paused, the source since the blackout, the target
    /// since it started (-S): has the target loaded everything?
    pub(super) async fn ready(&mut self) -> Result<Outcome, Failure> {
        // READY was most likely asked in the last pass already
        let early = self.watch.as_mut().and_then(|w| w.early_ready.take());
        // no later than the pause's deadline: past it the guest resumes here
        let left = self.pause_left().unwrap_or(Duration::MAX);
        let asked = tokio::time::timeout(left, async {
            let answered = match early {
                Some(e) => e.answer().await.ok(),
                None => None,
            };
            match answered {
                Some(st) => Ok(st),
                None => super::watch::ask_ready(&self.target, self.id)
                    .await
                    .map_err(|e| fail("commit", format!("the target is not ready: {e}"))),
            }
        })
        .await;
        let ready: IncomingStatus = match asked {
            Ok(r) => r?,
            Err(_) => {
                let what = format!("{} had not loaded everything", self.req.target);
                return Err(self.overrun(&what));
            }
        };
        self.end.ready = Some(ready);
        let t_tick = self.end.t_tick.expect("the Tick step ran");
        let t_completed = self.end.t_completed.expect("the Tick step ran");
        self.end
            .switch_parts
            .push(("tick", (t_tick - t_completed).as_millis() as u64));
        self.end
            .switch_parts
            .push(("ready", t_tick.elapsed().as_millis() as u64));
        Ok(Outcome::Done)
    }

    /// The commit point: `committed`, fsynced. From here only the target
    /// may run the guest.
    pub(super) async fn commit(&mut self) -> Result<Outcome, Failure> {
        let t0 = Instant::now();
        self.agent
            .set_source_phase(self.id, SourcePhase::Committed)
            .map_err(|e| fail("commit", e.to_string()))?;
        self.end
            .switch_parts
            .push(("record", t0.elapsed().as_millis() as u64));
        let target = &self.req.target;
        self.ev
            .step(
                "commit",
                format!(
                    "{target} loaded everything, paused; commit recorded on {}: from now on only {target} may run {}",
                    self.agent.cfg.name, self.spec.name
                ),
            )
            .await;
        crate::failpoint::pass("source-after-commit").await;
        Ok(Outcome::Done)
    }

    /// RUN: the target starts the guest (in post-copy it was sent already).
    /// Unanswered, the move is in doubt; a target that lost its skeleton
    /// before it ran leaves the only copy here (the settler resumes it).
    pub(super) async fn send_run(&mut self) -> Result<Outcome, Failure> {
        let t_run = Instant::now();
        let answered = self.watch.as_mut().and_then(|w| w.run_answer.take());
        let ran = match answered {
            Some(st) => st,
            None => self
                .agent
                .send_run(&self.target, self.id)
                .await
                .map_err(in_doubt)?,
        };
        let target = &self.req.target;
        let answer = super::answer_of(&ran);
        match source_next(SourcePhase::Committed, SourceEvent::Answer(answer)).1 {
            SourceAction::Finish => {}
            SourceAction::AbortAndResume => {
                return Err(fail(
                    "run",
                    format!(
                        "{target} lost its skeleton before it ran ({})",
                        ran.qemu_status
                    ),
                ));
            }
            _ => {
                return Err(in_doubt(format!(
                    "{target} answered RUN with {}",
                    ran.phase
                )))
            }
        }
        let t_running = Instant::now();
        // the target's vCPUs started before its answer came, by as long as
        // its own clocks say (the answer's way back is not taken off)
        let t_resumed = ran
            .resumed_us_ago
            .and_then(|us| t_running.checked_sub(Duration::from_micros(us)))
            .map_or(t_running, |r| r.max(t_run));
        self.end
            .switch_parts
            .push(("run", (t_resumed - t_run).as_millis() as u64));
        tracing::info!(vm = %self.spec.name, parts = ?self.end.switch_parts, "switch-over");
        self.end.t_running = Some(t_running);
        self.end.t_resumed = Some(t_resumed);
        self.end.ran = Some(ran);
        Ok(Outcome::Ran(answer))
    }

    /// QEMU's figures when it completed.
    pub(super) fn qemu_info(&self) -> &crate::qmp::MigrationInfo {
        self.watch
            .as_ref()
            .and_then(|w| w.info.as_ref())
            .expect("the Copy step completed")
    }

    /// The guest's blackout: from the source's pause until the target's
    /// vCPUs started (RUN's answer less the time the target says passed
    /// since: see `t_resumed`). The pause is dated by QEMU's events on this
    /// host (its `STOP`, or its completion less its downtime, whichever is
    /// earlier);
    /// without them, by QEMU's `total_time` less its downtime counted from
    /// the agent's `migrate` (which is earlier than QEMU's own start, so
    /// this is an upper bound, and the events' date is never taken past
    /// it). Never less than QEMU's figure plus the switch-over. Post-copy:
    /// the target ran at the commit; QEMU's figure is its pause.
    fn guest_downtime_ms(&self) -> u64 {
        let info = self.qemu_info();
        let downtime_ms = info.downtime.unwrap_or(0);
        if self.committed {
            return downtime_ms;
        }
        let t_resumed = self.end.t_resumed.expect("the Run step ran");
        let t_completed = self.end.t_completed.expect("the Tick step ran");
        let t_migrate = self.stream.as_ref().expect("the Stream step ran").t_migrate;
        let since_migrate = (t_resumed - t_migrate).as_millis() as u64;
        let stopped_at = info.total_time.unwrap_or(0).saturating_sub(downtime_ms);
        let by_total_time = since_migrate.saturating_sub(stopped_at);
        let by_events = self.qemu_dated_pause(downtime_ms, t_migrate).map(|p| {
            t_resumed
                .saturating_duration_since(p)
                .as_micros()
                .div_ceil(1000) as u64
        });
        by_events
            .map_or(by_total_time, |e| e.min(by_total_time))
            .max(downtime_ms + (t_resumed - t_completed).as_millis() as u64)
    }

    /// The switch-over and QEMU's own overshoot of its limit are kept for
    /// the next move there; a guest that saw more than it asked is told.
    async fn learn_downtime(&mut self, guest_downtime_ms: u64) {
        let pausing = self.watch.as_ref().is_some_and(|w| w.copy.pausing());
        if self.committed || pausing {
            return;
        }
        let downtime_ms = self.qemu_info().downtime.unwrap_or(0);
        let target = self.req.target.clone();
        let dplan = &self.stream.as_ref().expect("the Stream step ran").dplan;
        self.agent.moves.switchovers.record(
            &target,
            guest_downtime_ms.saturating_sub(downtime_ms),
            downtime_ms,
            dplan.limit_ms,
        );
        let max = self.chosen().conv.max_downtime_ms;
        if guest_downtime_ms > max {
            let message = format!(
                "the guest saw {guest_downtime_ms} ms of downtime, over the {max} ms asked: QEMU {downtime_ms} ms \
                 (limit {} ms), then {} ms until {target} ran it ({} ms expected); the next move to \
                 {target} plans for that",
                dplan.limit_ms,
                guest_downtime_ms.saturating_sub(downtime_ms),
                dplan.switchover_ms
            );
            self.ev.send(MigrationEvent::Warning { message }).await;
        }
    }

    /// Steps 10 and 11: cleanup on the source (its QEMU stops, the record says
    /// Done) and the guest check on the running target (a report, never a
    /// rollback), side by side: neither needs the other. Then the report.
    pub(super) async fn cleanup(&mut self) -> Result<Outcome, Failure> {
        let guest_downtime_ms = self.guest_downtime_ms();
        self.learn_downtime(guest_downtime_ms).await;
        // this agent (all of it) and the source QEMU, from `migrate` to here
        let at_start = self
            .stream
            .as_ref()
            .expect("the Stream step ran")
            .cpu_at_start;
        let cpu_source = crate::host::own_cpu().saturating_sub(at_start.0)
            + crate::host::process_cpu(self.vm.pid)
                .unwrap_or_default()
                .saturating_sub(at_start.1);
        // a tick past the source's last counts: the target's console is its own
        let name = &self.spec.name;
        let check_path = match self.end.tick_before {
            Some(t) => format!("/vms/{name}/check?after={t}"),
            None => format!("/vms/{name}/check"),
        };
        let t_end = Instant::now();
        let ms = move || t_end.elapsed().as_millis() as u64;
        let (cleanup_ms, (checked, check_ms)) = tokio::join!(
            async {
                self.agent.finish_source(name, self.id).await;
                ms()
            },
            async {
                let r = self
                    .target
                    .get::<CheckResult>(&check_path, Duration::from_secs(30))
                    .await;
                (r, ms())
            }
        );
        tracing::info!(vm = %name, cleanup_ms, check_ms, "cleanup and guest check");
        self.ev
            .step(
                "cleanup",
                format!("source QEMU on {} stopped and removed", self.agent.cfg.name),
            )
            .await;
        let check = checked.unwrap_or_else(|e| CheckResult {
            vm: name.clone(),
            host: self.req.target.clone(),
            qemu_status: "unknown".into(),
            tick_first: None,
            tick_last: None,
            sweeps: None,
            errors: 0,
            problems: vec![format!("the check could not run: {e}")],
            running: false,
            advancing: false,
            intact: false,
            vcpu_ms: None,
            guest_agent: None,
        });
        self.say_check(&check).await;
        self.report = Some(self.report(check, guest_downtime_ms, cpu_source));
        Ok(Outcome::Done)
    }

    /// The guest check's result: a step when the guest runs intact there,
    /// a warning otherwise (the guest moved either way).
    async fn say_check(&self, check: &CheckResult) {
        let tick_before = self.end.tick_before;
        let went_back = matches!((tick_before, check.tick_last), (Some(b), Some(a)) if a <= b);
        if check.ok() && !went_back {
            let detail = match check.vcpu_ms {
                Some(ms) => format!(
                    "{} runs the guest: vCPUs used {ms} ms during the check{}",
                    check.host,
                    match check.guest_agent {
                        Some(true) => "; guest agent answers, its clock advances",
                        _ => "",
                    }
                ),
                None => format!(
                    "{} runs the guest: its counter went from {}{} to {}, {} integrity errors",
                    check.host,
                    tick_before.or(check.tick_first).unwrap_or(0),
                    if tick_before.is_some() {
                        format!(" (its last on {})", self.agent.cfg.name)
                    } else {
                        String::new()
                    },
                    check.tick_last.unwrap_or(0),
                    check.errors
                ),
            };
            self.ev.step("final-check", detail).await;
        } else {
            let why = if went_back {
                format!(
                    "guest counter went back from {} to {}",
                    tick_before.unwrap_or(0),
                    check.tick_last.unwrap_or(0)
                )
            } else {
                check.summary()
            };
            self.ev
                .send(MigrationEvent::Warning {
                    message: format!(
                        "the guest moved and runs on {}, but its check failed: {why}",
                        self.req.target
                    ),
                })
                .await;
        }
    }

    /// What the data path carried: (option, data path, bytes per NIC,
    /// carriers, frames resent, Ferry's compression).
    fn carried(&self) -> Carried {
        match self.plan_ref() {
            Plan::Tcp { multifd, .. } => Carried {
                option: if *multifd { "compression" } else { "tcp" },
                data_path: if *multifd { "qemu-multifd" } else { "qemu-tcp" },
                nic_tx_bytes: self.tx_since_start(),
                carriers: Vec::new(),
                frames_resent: 0,
                compression: Default::default(),
            },
            Plan::Multichannel {
                session, option, ..
            } => {
                let st = self
                    .end
                    .carriers_at_end
                    .clone()
                    .unwrap_or_else(|| session.stats());
                Carried {
                    option,
                    data_path: data_path_of(session),
                    nic_tx_bytes: carrier_bytes(&st),
                    carriers: st
                        .carriers
                        .iter()
                        .map(|c| CarrierReport {
                            nic: c.nic.clone(),
                            up: c.up,
                            tx_bytes: c.tx_bytes,
                            connects: c.connects,
                            failures: c.failures,
                            frames_requeued: c.frames_requeued,
                            last_failure: c.last_failure.clone(),
                        })
                        .collect(),
                    frames_resent: st.frames_resent,
                    compression: st.compression.clone(),
                }
            }
        }
    }

    fn report(
        &self,
        check: CheckResult,
        guest_downtime_ms: u64,
        cpu_source: Duration,
    ) -> MigrationReport {
        let info = self.qemu_info();
        let ram = info.ram.clone().unwrap_or_default();
        let w = self.watch.as_ref().expect("the Stream step ran");
        let stream = self.stream.as_ref().expect("the Stream step ran");
        let t_running = self.end.t_running.expect("the Run step ran");
        let t_completed = self.end.t_completed.expect("the Tick step ran");
        let on_target = self.end.ready.as_ref().or(self.end.ran.as_ref());
        // rates over the time until the target ran: QEMU's own total ends when
        // the last byte is handed to the data path, not when it has arrived
        let transfer_ms = (t_running - stream.t_migrate).as_millis() as u64;
        let per_sec = |b: u64| {
            if transfer_ms > 0 {
                b as f64 * 1000.0 / transfer_ms as f64
            } else {
                0.0
            }
        };
        let c = self.carried();
        let plan = self.plan_ref();
        let mirror = self.mirror.as_ref();
        let encryption = match plan {
            Plan::Multichannel { session, .. } if session.sealed() => "sealed-carriers",
            _ if self.qemu_tls => "qemu-tls",
            _ => "off",
        };
        MigrationReport {
            vm: self.spec.name.clone(),
            from: self.agent.cfg.name.clone(),
            to: check.host.clone(),
            status: "completed".into(),
            data_path: c.data_path.into(),
            option: c.option.into(),
            total_ms: self.started.elapsed().as_millis() as u64,
            running_ms: (t_running - self.started).as_millis() as u64,
            qemu_total_ms: info.total_time.unwrap_or(0),
            transfer_ms,
            switchover_ms: (t_running - t_completed).as_millis() as u64,
            setup_ms: info.setup_time.unwrap_or(0),
            downtime_ms: info.downtime.unwrap_or(0),
            guest_downtime_ms,
            max_downtime_ms: self.chosen().conv.max_downtime_ms,
            downtime_limit_ms: stream.dplan.limit_ms,
            hold_ms: w
                .hold
                .as_ref()
                .and_then(Hold::held)
                .map(|(d, _)| d.as_millis() as u64),
            hold_caught_up: w.hold.as_ref().and_then(Hold::held).map(|(_, c)| c),
            downtime_parts: if self.committed {
                Vec::new()
            } else {
                std::iter::once(("qemu", info.downtime.unwrap_or(0)))
                    .chain(self.end.switch_parts.iter().copied())
                    .map(|(part, ms)| DowntimePart {
                        part: part.into(),
                        ms,
                    })
                    .collect()
            },
            downtime_reason: if self.committed {
                "post-copy: the guest ran on the target at the commit".into()
            } else if w.copy.pausing() {
                "pause-and-copy: pre-copy did not converge in time".into()
            } else {
                stream.dplan.reason()
            },
            bytes_transferred: ram.transferred,
            throughput: per_sec(ram.transferred),
            nic_rates: c
                .nic_tx_bytes
                .iter()
                .map(|(n, b)| (n.clone(), per_sec(*b)))
                .collect(),
            nic_tx_bytes: c.nic_tx_bytes,
            carriers: c.carriers,
            frames_resent: c.frames_resent,
            path_changes: match plan {
                Plan::Multichannel { session, .. } => session.path_changes(),
                Plan::Tcp { .. } => Vec::new(),
            },
            compression_ratio: c.compression.ratio(),
            frames_compressed: c.compression.frames_compressed,
            codecs: c.compression.codecs.clone(),
            qemu_codec: stream.qemu_zstd.map(|level| QemuCodecReport {
                codec: format!("zstd:{level}"),
                raw_bytes: ram.normal_bytes,
                sent_bytes: ram.multifd_bytes,
                ratio: ram.normal_bytes as f64 / ram.multifd_bytes.max(1) as f64,
                cpu_s: w.qemu_send_cpu.as_secs_f64(),
            }),
            rounds: ram.dirty_sync_count,
            phase: if w.copy.in_postcopy() {
                "postcopy".into()
            } else if w.copy.pausing() {
                "pause-and-copy".into()
            } else {
                "precopy".into()
            },
            max_throttle_pct: w.max_throttle,
            // per GiB of guest memory moved: QEMU counts compressed bytes as transferred
            cpu: CpuReport::new(
                cpu_source,
                on_target.and_then(|t| t.cpu_ms),
                ram.transferred.max(ram.normal_bytes),
            ),
            encrypted: encryption != "off",
            encryption: encryption.into(),
            disks: mirror.map(|m| m.reports()).unwrap_or_default(),
            disk_nic_tx_bytes: mirror.map(|m| m.nic_bytes()).unwrap_or_default(),
            tick_before: self.end.tick_before,
            check,
        }
    }
}

/// What a move's data path carried, for its report.
struct Carried {
    option: &'static str,
    data_path: &'static str,
    nic_tx_bytes: std::collections::BTreeMap<String, u64>,
    carriers: Vec<CarrierReport>,
    frames_resent: u64,
    compression: ferry_transport::CompressionStats,
}
