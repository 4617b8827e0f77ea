//! The source after its commit: RUN, a migration in doubt, `ferry vm
//! resolve` and the periodic settler
//! (see [`crate::commit`] for the rules; what an agent finds at start is
//! [`crate::recover`]'s).

use std::sync::Arc;
use std::time::Duration;

use ferry_api::{
    ApiError, HostInfo, IncomingStatus, RecoverReply, RecoverRequest, ResolveReport,
    ResolveRequest, SourceStatus,
};
use ferry_net::client::Client;

use super::target::answer_of;
use crate::commit::{
    after_commit, wire_name, AfterCommitAction, Record, Side, SourcePhase, SourceQemu, TargetAnswer,
};
use crate::host::{error_chain, Agent, Role};
use crate::qemu::QemuVm;

/// How long the source waits for RUN's answer before the migration is in doubt.
pub const RUN_TIMEOUT: Duration = Duration::from_secs(10);

/// Resumes a paused guest (a rollback before the commit).
pub(crate) async fn resume_guest(vm: &QemuVm) {
    match vm.qmp.status().await {
        Ok(s) if !s.running => {
            tracing::warn!(status = %s.status, "resuming the source guest");
            if let Err(e) = vm.qmp.cont().await {
                tracing::error!(error = %e, "could not resume the source guest");
            }
        }
        Ok(_) => {}
        Err(e) => tracing::error!(error = %e, "source QEMU does not answer"),
    }
}

/// How the source reads a target's answer (or its silence).
fn ask_target(r: Result<IncomingStatus, ApiError>) -> Result<TargetAnswer, String> {
    match r {
        Ok(st) => Ok(answer_of(&st)),
        Err(ApiError::NotFound { .. }) => Ok(TargetAnswer::NeverRan),
        Err(e) => Err(e.to_string()),
    }
}

/// Asks the target of `rec` where it stands, within `wait`.
async fn target_answer(
    target: &Client,
    rec: &Record,
    wait: Duration,
) -> Result<TargetAnswer, String> {
    ask_target(
        target
            .get::<IncomingStatus>(&format!("/incoming/{}", rec.migration_id), wait)
            .await,
    )
}

/// Where this host's QEMU of a committed migration stands.
pub(super) async fn source_qemu(q: Option<&QemuVm>) -> SourceQemu {
    let Some(q) = q else {
        return SourceQemu::Gone;
    };
    if !q.alive().await {
        return SourceQemu::Gone;
    }
    match q.qmp.query_migrate().await {
        Err(_) => SourceQemu::Unknown,
        Ok(i) => qemu_phase(i.status.as_deref()),
    }
}

/// A source QEMU's `query-migrate` status, as [`after_commit`] reads it.
fn qemu_phase(status: Option<&str>) -> SourceQemu {
    match status {
        Some("completed") => SourceQemu::Completed,
        Some("postcopy-paused") => SourceQemu::Postcopy { paused: true },
        Some(s) if s.starts_with("postcopy") => SourceQemu::Postcopy { paused: false },
        None | Some("none" | "failed" | "cancelled") => SourceQemu::NotSwitched,
        Some("setup" | "active" | "device" | "pre-switchover" | "cancelling" | "wait-unplug") => {
            SourceQemu::Active
        }
        Some(_) => SourceQemu::Unknown,
    }
}

/// Cancels a source QEMU's pre-copy and waits (up to 5 s) until it has
/// ended one way or the other (cancelled, or switched to post-copy after all).
async fn cancel_and_wait(q: &QemuVm) {
    let _ = q.qmp.migrate_cancel().await;
    for _ in 0..50 {
        let st = q.qmp.query_migrate().await.ok().and_then(|i| i.status);
        if qemu_phase(st.as_deref()) != SourceQemu::Active {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

impl Agent {
    /// The workload's last counter on a guest's console (None: no tick yet, as
    /// for guests without the workload). An unreadable console is an error.
    pub(super) fn console_tick(&self, vm: &QemuVm) -> Result<Option<u64>, String> {
        let text = crate::guest::read_tail(&vm.console_path(), 64 << 10)
            .map_err(|e| format!("{}: {e}", vm.console_path().display()))?;
        Ok(self.guest.read(&text).last.map(|t| t.tick))
    }

    /// Marks migration `id` as run by this process (the settler leaves it alone).
    pub(super) fn live(&self, id: &str, on: bool) {
        let mut l = ferry_api::util::lock(&self.moves.live);
        if on {
            l.insert(id.to_string());
        } else {
            l.remove(id);
        }
    }

    fn is_live(&self, id: &str) -> bool {
        ferry_api::util::lock(&self.moves.live).contains(id)
    }

    /// Rewrites the source record of `id` with a new phase (fsynced).
    pub(super) fn set_source_phase(&self, id: &str, phase: SourcePhase) -> Result<(), ApiError> {
        self.moves
            .journal
            .update(id, Side::Source(phase))
            .map(|_| ())
            .map_err(|e| ApiError::internal(error_chain(&e)))
    }

    /// `GET /migrations/{id}`: what this host, as source, recorded.
    pub fn source_status(&self, id: &str) -> Result<SourceStatus, ApiError> {
        let rec = self
            .moves
            .journal
            .read(id, true)
            .map_err(|e| ApiError::internal(error_chain(&e)))?
            .ok_or_else(|| ApiError::not_found("migration", id))?;
        let Side::Source(p) = rec.side else {
            return Err(ApiError::not_found("migration", id));
        };
        Ok(SourceStatus {
            migration_id: rec.migration_id,
            vm: rec.vm,
            phase: wire_name(p),
        })
    }

    /// Sends RUN; an error means no answer (the migration is then in doubt).
    pub(super) async fn send_run(
        &self,
        target: &Client,
        id: &str,
    ) -> Result<IncomingStatus, String> {
        self.send_run_within(target, id, RUN_TIMEOUT)
            .await
            .map_err(|e| format!("RUN: {e}"))
    }

    pub(super) async fn send_run_within(
        &self,
        target: &Client,
        id: &str,
        wait: Duration,
    ) -> Result<IncomingStatus, ApiError> {
        target
            .post(&format!("/incoming/{id}/run"), &serde_json::json!({}), wait)
            .await
    }

    /// The target runs the guest: stop the source QEMU (its log kept), free
    /// its memory, record Done.
    pub(super) async fn finish_source(&self, vm: &str, id: &str) {
        let spec = self.state.lock().await.vms.get(vm).map(|s| s.spec.clone());
        if let Some(q) = self.release(vm).await {
            q.stop().await;
            self.remove_vm_dir(&q.dir, &format!("{vm}.{id}.source"));
        }
        // shared-nothing: the target has its own copies of the local
        // drives, and the guest runs on them
        if let Some(spec) = spec {
            crate::local_disk::remove(&crate::local_disk::paths(&self.cfg.qemu, &spec));
        }
        if let Err(e) = self.set_source_phase(id, SourcePhase::Done) {
            tracing::error!(error = %e, "recording a finished migration");
        }
    }

    /// One attempt to settle a committed migration: ask the target and this
    /// host's QEMU, then act as [`after_commit`] decides (a RUN or a
    /// cancellation is followed by one more look). Returns the phase after
    /// and what happened.
    pub(super) async fn settle_once(&self, rec: &Record) -> (SourcePhase, String) {
        let target = self.peer_client(rec);
        let id = &rec.migration_id;
        let q = self.slot_qemu(&rec.vm).await;
        let mut answer = target_answer(&target, rec, Duration::from_secs(2)).await;
        let mut sq = source_qemu(q.as_deref()).await;
        for _ in 0..3 {
            let action = after_commit(answer.as_ref().ok().copied(), sq);
            match action {
                AfterCommitAction::CancelAndLook => {
                    if let Some(q) = &q {
                        cancel_and_wait(q).await;
                    }
                    sq = source_qemu(q.as_deref()).await;
                }
                AfterCommitAction::SendRun => {
                    answer = ask_target(
                        self.send_run_within(&target, id, Duration::from_secs(5))
                            .await,
                    );
                    // asked once more below; a target still waiting stays in doubt
                    if answer == Ok(TargetAnswer::Waiting) {
                        answer = Err(format!("{} answered RUN but does not run yet", rec.peer));
                    }
                }
                AfterCommitAction::Finish => {
                    self.finish_source(&rec.vm, id).await;
                    let how = match sq {
                        SourceQemu::Completed => {
                            "its migration completed and the source QEMU is stopped"
                        }
                        _ => "no source QEMU was left here",
                    };
                    tracing::info!(vm = %rec.vm, migration = %id, "settled: {} runs the guest; {how}", rec.peer);
                    return (
                        SourcePhase::Done,
                        format!("{} runs the guest; {how}", rec.peer),
                    );
                }
                AfterCommitAction::Recover => {
                    let Some(q) = &q else { break };
                    let why = match self.recover_postcopy(rec, &target, q).await {
                        Ok(how) => {
                            tracing::warn!(vm = %rec.vm, migration = %id, "{how}");
                            format!("{how}; the source QEMU stays until it completes")
                        }
                        Err(e) => format!(
                            "post-copy's stream is broken and could not be resumed yet ({e}); \
                             the guest waits on {} for its pages, and the source QEMU keeps them",
                            rec.peer
                        ),
                    };
                    return self.in_doubt(rec, why).await;
                }
                AfterCommitAction::DiscardTarget => {
                    let discarded = target
                        .delete::<serde_json::Value>(
                            &format!("/incoming/{id}"),
                            Duration::from_secs(10),
                        )
                        .await;
                    return match discarded {
                        Ok(_) | Err(ApiError::NotFound { .. }) => {
                            self.abort_after_commit(
                                rec,
                                q.as_deref(),
                                format!(
                                    "QEMU never switched to post-copy and {} discarded its skeleton, which never ran",
                                    rec.peer
                                ),
                            )
                            .await
                        }
                        Err(e) => {
                            self.in_doubt(
                                rec,
                                format!(
                                    "QEMU never switched to post-copy; {} did not discard its skeleton: {e}",
                                    rec.peer
                                ),
                            )
                            .await
                        }
                    };
                }
                AfterCommitAction::AbortAndResume => {
                    return self
                        .abort_after_commit(
                            rec,
                            q.as_deref(),
                            format!("{} never ran the guest and its skeleton is gone", rec.peer),
                        )
                        .await;
                }
                AfterCommitAction::AskLater => break,
            }
        }
        let why = match (&answer, sq) {
            (Err(e), _) => format!("{} gives no answer: {e}", rec.peer),
            (Ok(TargetAnswer::Running), SourceQemu::Postcopy { .. }) => format!(
                "{} runs the guest in post-copy; the source QEMU stays until its migration completes",
                rec.peer
            ),
            (Ok(TargetAnswer::NeverRan), SourceQemu::Postcopy { .. }) => format!(
                "{} never ran the guest, but this QEMU has switched to post-copy; \
                 if {} is gone for good: ferry vm resolve {} --target-lost {}",
                rec.peer, rec.peer, rec.vm, rec.peer
            ),
            (Ok(a), sq) => format!(
                "{} answered {}; the source QEMU is {sq:?}",
                rec.peer,
                wire_name(a)
            ),
        };
        self.in_doubt(rec, why).await
    }

    /// A client for the other agent of migration record `rec`.
    fn peer_client(&self, rec: &Record) -> Client {
        self.peer(&rec.peer, &rec.peer_url)
    }

    /// The QEMU in VM `vm`'s slot here: a running guest's, or a skeleton's.
    pub(super) async fn slot_qemu(&self, vm: &str) -> Option<Arc<QemuVm>> {
        self.state
            .lock()
            .await
            .vms
            .get(vm)
            .and_then(|s| s.qemu.clone())
    }

    /// Leaves a committed migration as it is, saying why on the VM.
    async fn in_doubt(&self, rec: &Record, why: String) -> (SourcePhase, String) {
        if let Some(s) = self.state.lock().await.vms.get_mut(&rec.vm) {
            s.doubt = Some(format!("committed to {}; {why}", rec.peer));
        }
        (SourcePhase::Committed, why)
    }

    /// The target never ran and never will: records Aborted, then makes
    /// sure the guest runs here.
    async fn abort_after_commit(
        &self,
        rec: &Record,
        q: Option<&QemuVm>,
        why: String,
    ) -> (SourcePhase, String) {
        if let Err(e) = self.set_source_phase(&rec.migration_id, SourcePhase::Aborted) {
            return (SourcePhase::Committed, format!("recording: {e}"));
        }
        if let Some(s) = self.state.lock().await.vms.get_mut(&rec.vm) {
            s.migrating = false;
            s.doubt = None;
        }
        let how = match q {
            Some(q) => {
                resume_guest(q).await;
                "the guest runs here"
            }
            None => "no source QEMU is left here",
        };
        tracing::warn!(vm = %rec.vm, migration = %rec.migration_id, "settled: {why}; {how}");
        (SourcePhase::Aborted, format!("{why}: {how}"))
    }

    /// A post-copy whose stream broke: the target listens anew on a NIC of
    /// its that a NIC of this host with its link up reaches, and this QEMU
    /// sends the rest there. Returns what was done.
    pub(super) async fn recover_postcopy(
        &self,
        rec: &Record,
        target: &Client,
        q: &QemuVm,
    ) -> Result<String, String> {
        if rec.sealed {
            return Err(
                "the move's carriers were sealed and QEMU's recovery stream would not be".into(),
            );
        }
        let tinfo: HostInfo = target
            .get("/host", Duration::from_secs(3))
            .await
            .map_err(|e| e.to_string())?;
        let paths = crate::probe::usable(&self.paths_for_move(&tinfo).await, &self.nics());
        let p = paths
            .first()
            .ok_or_else(|| format!("no NIC of this host with its link up reaches {}", rec.peer))?;
        let reply: RecoverReply = target
            .post(
                &format!("/incoming/{}/recover", rec.migration_id),
                &RecoverRequest {
                    nic: p.peer_nic.clone(),
                },
                Duration::from_secs(15),
            )
            .await
            .map_err(|e| e.to_string())?;
        q.qmp
            .migrate_resume(&reply.uri)
            .await
            .map_err(|e| format!("QEMU refused to resume post-copy: {}", error_chain(&e)))?;
        Ok(format!(
            "post-copy resumed over {} → {} {} ({})",
            p.nic, rec.peer, reply.nic, reply.uri
        ))
    }

    /// What `vm resolve` reports of a committed migration this host is the source of.
    fn source_report(&self, rec: &Record, phase: SourcePhase, detail: String) -> ResolveReport {
        ResolveReport {
            vm: rec.vm.clone(),
            host: self.cfg.name.clone(),
            side: "source".into(),
            migration_id: rec.migration_id.clone(),
            phase_before: wire_name(SourcePhase::Committed),
            phase: wire_name(phase),
            in_doubt: phase == SourcePhase::Committed,
            detail,
        }
    }

    /// `ferry vm resolve VM --target-has-all`: the operator says the target
    /// runs the whole guest although this QEMU never reported its post-copy
    /// completed. Done only where the target says it runs the guest.
    async fn confirm_target_has_all(&self, vm: &str) -> Vec<ResolveReport> {
        let mut out = Vec::new();
        for rec in self.moves.journal.all().0 {
            if rec.vm != vm || rec.side != Side::Source(SourcePhase::Committed) {
                continue;
            }
            let target = self.peer_client(&rec);
            let answer = target_answer(&target, &rec, Duration::from_secs(5)).await;
            let (phase, detail) = if answer == Ok(TargetAnswer::Running) {
                tracing::warn!(vm, migration = %rec.migration_id, target = %rec.peer, "the operator confirmed the target runs the whole guest: the source QEMU is stopped");
                self.finish_source(vm, &rec.migration_id).await;
                (
                    SourcePhase::Done,
                    format!(
                        "{} runs the guest and the operator confirmed it has every page: the source QEMU is stopped",
                        rec.peer
                    ),
                )
            } else {
                let why = match answer {
                    Ok(a) => format!("{} answered {}", rec.peer, wire_name(a)),
                    Err(e) => format!("{} gives no answer: {e}", rec.peer),
                };
                (
                    SourcePhase::Committed,
                    format!("not done: {why}, not that it runs the guest"),
                )
            };
            out.push(self.source_report(&rec, phase, detail));
        }
        out
    }

    /// `ferry vm resolve VM --target-lost HOST --confirm-powered-off`: the
    /// operator says the target is gone for good. Committed migrations of
    /// `vm` to `host` are recorded aborted, QEMU's migration cancelled and
    /// the guest resumed here.
    async fn declare_target_lost(&self, vm: &str, host: &str) -> Vec<ResolveReport> {
        let mut out = Vec::new();
        for rec in self.moves.journal.all().0 {
            if rec.vm != vm || rec.peer != host || rec.side != Side::Source(SourcePhase::Committed)
            {
                continue;
            }
            let q = self.slot_qemu(vm).await;
            if let Some(q) = &q {
                let _ = q.qmp.migrate_cancel().await;
            }
            tracing::warn!(vm, migration = %rec.migration_id, target = host, "the operator declared the target lost (powered off or fenced): the guest resumes here");
            let (phase, detail) = self
                .abort_after_commit(
                    &rec,
                    q.as_deref(),
                    format!("{host} declared lost by the operator (powered off or fenced)"),
                )
                .await;
            out.push(self.source_report(&rec, phase, detail));
        }
        out
    }

    /// Run every 2 s: committed migrations no live move is finishing (their
    /// RUN's answer was lost, or this agent restarted) are settled.
    pub async fn settle_committed(&self) {
        for rec in self.moves.journal.committed_sources() {
            if !self.is_live(&rec.migration_id) {
                self.settle_once(&rec).await;
            }
        }
    }

    /// `ferry vm resolve`: shows and settles, now, any migration of `vm`
    /// in doubt on this host, as source or as target.
    pub async fn resolve_vm(
        self: &Arc<Self>,
        vm: &str,
        req: &ResolveRequest,
    ) -> Result<Vec<ResolveReport>, ApiError> {
        req.check()?;
        if let Some(host) = &req.target_lost {
            return Ok(self.declare_target_lost(vm, host).await);
        }
        if req.target_has_all {
            return Ok(self.confirm_target_has_all(vm).await);
        }
        let mut out = Vec::new();
        for rec in self.moves.journal.all().0 {
            if rec.vm != vm || rec.side != Side::Source(SourcePhase::Committed) {
                continue;
            }
            let (phase, detail) = self.settle_once(&rec).await;
            out.push(self.source_report(&rec, phase, detail));
        }
        let waiting = {
            let st = self.state.lock().await;
            st.vms.get(vm).and_then(|s| match &s.role {
                Role::Incoming {
                    migration_id,
                    source,
                    source_url,
                    ..
                } => Some((migration_id.clone(), source.clone(), source_url.clone())),
                _ => None,
            })
        };
        if let Some((id, source, source_url)) = waiting {
            let detail = self.ask_source(vm, &id, (&source, &source_url)).await;
            let now = self
                .incoming_status(&id)
                .await
                .map(|s| s.phase)
                .unwrap_or_default();
            out.push(ResolveReport {
                vm: vm.into(),
                host: self.cfg.name.clone(),
                side: "target".into(),
                migration_id: id,
                phase_before: "waiting".into(),
                in_doubt: now == "waiting",
                phase: now,
                detail,
            });
        }
        Ok(out)
    }
}
