//! The source after its commit: RUN, a migration in doubt, `ferry vm
//! resolve` and the periodic settler
//! (see [`crate::commit`] for the rules; what an agent finds at start is
//! [`crate::recover`]'s).

use std::sync::Arc;
use std::time::Duration;

use ferry_api::client::Client;
use ferry_api::{ApiError, IncomingStatus, ResolveReport, SourceStatus};

use super::target::answer_of;
use crate::commit::{source_next, wire_name, Record, Side, SourceAction, SourceEvent, SourcePhase};
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
        let mut l = ferry_api::util::lock(&self.live);
        if on {
            l.insert(id.to_string());
        } else {
            l.remove(id);
        }
    }

    fn is_live(&self, id: &str) -> bool {
        ferry_api::util::lock(&self.live).contains(id)
    }

    /// Rewrites the source record of `id` with a new phase (fsynced).
    pub(super) fn set_source_phase(&self, id: &str, phase: SourcePhase) -> Result<(), ApiError> {
        self.journal
            .update(id, Side::Source(phase))
            .map(|_| ())
            .map_err(|e| ApiError::internal(error_chain(&e)))
    }

    /// `GET /migrations/{id}`: what this host, as source, recorded.
    pub fn source_status(&self, id: &str) -> Result<SourceStatus, ApiError> {
        let rec = self
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

    /// One attempt to settle a committed migration: ask the target, send RUN
    /// if it waits, then finish (it runs) or resume (it never ran and never
    /// will). Returns the phase after and what happened.
    async fn settle_once(&self, rec: &Record) -> (SourcePhase, String) {
        let target = Client::new(
            &format!("agent {}", rec.peer),
            &rec.peer_url,
            self.client_auth.clone(),
        );
        let asked = target
            .get::<IncomingStatus>(
                &format!("/incoming/{}", rec.migration_id),
                Duration::from_secs(2),
            )
            .await;
        let mut event = match &asked {
            Ok(st) => SourceEvent::Answer(answer_of(st)),
            Err(ApiError::NotFound { .. }) => {
                SourceEvent::Answer(crate::commit::TargetAnswer::NeverRan)
            }
            Err(_) => SourceEvent::NoAnswer,
        };
        let mut action = source_next(SourcePhase::Committed, event).1;
        if action == SourceAction::SendRun {
            event = match self
                .send_run_within(&target, &rec.migration_id, Duration::from_secs(5))
                .await
            {
                Ok(st) => SourceEvent::Answer(answer_of(&st)),
                Err(_) => SourceEvent::NoAnswer,
            };
            action = source_next(SourcePhase::Committed, event).1;
        }
        match action {
            SourceAction::Finish => {
                self.finish_source(&rec.vm, &rec.migration_id).await;
                tracing::info!(vm = %rec.vm, migration = %rec.migration_id, "settled: {} runs the guest", rec.peer);
                (
                    SourcePhase::Done,
                    format!("{} runs the guest; the source QEMU is stopped", rec.peer),
                )
            }
            SourceAction::AbortAndResume => {
                if let Err(e) = self.set_source_phase(&rec.migration_id, SourcePhase::Aborted) {
                    return (SourcePhase::Committed, format!("recording: {e}"));
                }
                let q = {
                    let mut st = self.state.lock().await;
                    st.vms.get_mut(&rec.vm).and_then(|s| {
                        s.migrating = false;
                        s.doubt = None;
                        s.qemu.clone()
                    })
                };
                let how = match q {
                    Some(q) => {
                        resume_guest(&q).await;
                        "the guest resumed here"
                    }
                    None => "no source QEMU is left here",
                };
                tracing::warn!(vm = %rec.vm, migration = %rec.migration_id, "settled: {} never ran the guest; {how}", rec.peer);
                (
                    SourcePhase::Aborted,
                    format!(
                        "{} never ran the guest and its skeleton is gone: {how}",
                        rec.peer
                    ),
                )
            }
            _ => {
                let why = match asked {
                    Err(e) => format!("{} does not answer: {e}", rec.peer),
                    Ok(st) => format!("{} answered {} but not RUN", rec.peer, st.phase),
                };
                if let Some(s) = self.state.lock().await.vms.get_mut(&rec.vm) {
                    s.doubt = Some(format!("committed to {}; {why}", rec.peer));
                }
                (SourcePhase::Committed, why)
            }
        }
    }

    /// Run every 2 s: committed migrations no live move is finishing (their
    /// RUN's answer was lost, or this agent restarted) are settled.
    pub async fn settle_committed(&self) {
        for rec in self.journal.all().0 {
            if rec.side == Side::Source(SourcePhase::Committed) && !self.is_live(&rec.migration_id)
            {
                self.settle_once(&rec).await;
            }
        }
    }

    /// `ferry vm resolve`: shows and settles, now, any migration of `vm`
    /// in doubt on this host, as source or as target.
    pub async fn resolve_vm(self: &Arc<Self>, vm: &str) -> Result<Vec<ResolveReport>, ApiError> {
        let mut out = Vec::new();
        for rec in self.journal.all().0 {
            if rec.vm != vm || rec.side != Side::Source(SourcePhase::Committed) {
                continue;
            }
            let (phase, detail) = self.settle_once(&rec).await;
            out.push(ResolveReport {
                vm: vm.into(),
                host: self.cfg.name.clone(),
                side: "source".into(),
                migration_id: rec.migration_id.clone(),
                phase_before: wire_name(SourcePhase::Committed),
                phase: wire_name(phase),
                in_doubt: phase == SourcePhase::Committed,
                detail,
            });
        }
        let waiting = {
            let st = self.state.lock().await;
            st.vms.get(vm).and_then(|s| match &s.role {
                Role::Incoming {
                    migration_id,
                    source_url,
                    ..
                } => Some((migration_id.clone(), source_url.clone())),
                _ => None,
            })
        };
        if let Some((id, source_url)) = waiting {
            let detail = self.ask_source(vm, &id, &source_url).await;
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
