//! What an agent takes back when it starts: the QEMUs an earlier agent left
//! running (they outlive it, see [`crate::qemu`]) and the migrations its
//! journal left open (see [`crate::commit`]).
//!
//! Each directory under `STATE_DIR/vms/` is one QEMU:
//!
//! | directory | journal | QEMU alive | done at start |
//! |-----------|---------|------------|---------------|
//! | `NAME` | no open record | yes | adopted, runs on |
//! | `NAME` | source `copying` | yes | migration and local drives' mirrors cancelled, guest resumed, record `aborted` |
//! | `NAME` | source `committed` | yes | adopted paused and in doubt; the settler asks the target |
//! | `NAME.in-ID` | target `waiting` | any | QEMU killed (it never ran), its partial local drives removed, record `discarded` |
//! | `NAME.in-ID` | target `running` (or pruned) | yes | adopted; `cont` if it was paused (RUN was received) |
//! | `NAME.in-ID` | target `discarded` | any | QEMU killed, directory removed |
//! | any | any | no | directory removed (its QEMU log kept) |
//!
//! A QEMU whose process lives but whose QMP does not answer is left alone
//! and logged: it may be a guest still running, and nothing here may kill it.

use std::path::Path;
use std::sync::Arc;

use crate::commit::{Record, Side, SourcePhase, TargetPhase};
use crate::host::{error_chain, Agent, Role, VmSlot};
use crate::qemu::{self, QemuVm};

/// Settled records are forgotten after a week.
const PRUNE_AFTER_SECS: u64 = 7 * 24 * 3600;

/// What a VM directory's name says it holds.
#[derive(Debug, PartialEq, Eq)]
enum DirKind<'a> {
    /// A VM that runs (or ran) here: `NAME`.
    Vm(&'a str),
    /// A migration target: `NAME.in-ID`.
    Incoming { vm: &'a str, id: &'a str },
}

fn dir_kind(name: &str) -> DirKind<'_> {
    match name.split_once(".in-") {
        Some((vm, id)) => DirKind::Incoming { vm, id },
        None => DirKind::Vm(name),
    }
}

/// What to do with a migration target's directory at start.
#[derive(Debug, PartialEq, Eq)]
enum IncomingFate {
    /// Never ran and never will: kill, record `discarded`.
    Discard { record: bool },
    /// Was told to run (or ran so long ago its record is pruned): adopt.
    Adopt,
}

fn incoming_fate(record: Option<TargetPhase>) -> IncomingFate {
    match record {
        Some(TargetPhase::Waiting) => IncomingFate::Discard { record: true },
        Some(TargetPhase::Discarded) => IncomingFate::Discard { record: false },
        // `running` records are pruned after a week; the directory of a
        // guest that ran here stays `.in-ID` for its life
        Some(TargetPhase::Running) | None => IncomingFate::Adopt,
    }
}

impl Agent {
    /// At start: adopt the QEMUs left running, then settle what the journal
    /// left open. Committed source records are settled by the periodic
    /// settler. Settled records older than a week are forgotten.
    pub async fn recover(&self) {
        let (records, errors) = self.journal.all();
        for e in errors {
            tracing::error!(error = %e, "unreadable migration record");
        }
        let vms_dir = self.cfg.state_dir.join("vms");
        let mut dirs: Vec<_> = std::fs::read_dir(&vms_dir)
            .map(|rd| rd.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        dirs.sort();
        for dir in dirs.iter().filter(|d| d.is_dir()) {
            let Some(name) = dir.file_name().map(|n| n.to_string_lossy().into_owned()) else {
                continue;
            };
            match dir_kind(&name) {
                DirKind::Vm(vm) => self.recover_vm(dir, vm, &records).await,
                DirKind::Incoming { vm, id } => {
                    let phase = records.iter().find_map(|r| match r.side {
                        Side::Target(p) if r.migration_id == id => Some(p),
                        _ => None,
                    });
                    self.recover_incoming(dir, vm, id, phase).await
                }
            }
        }
        for rec in &records {
            match rec.side {
                Side::Source(SourcePhase::Copying) => {
                    tracing::warn!(vm = %rec.vm, migration = %rec.migration_id, "restart: a migration that never committed is aborted");
                    self.record(&rec.migration_id, Side::Source(SourcePhase::Aborted));
                }
                Side::Source(SourcePhase::Committed) => {
                    tracing::warn!(vm = %rec.vm, migration = %rec.migration_id, "restart: a committed migration is settled with {}", rec.peer);
                }
                Side::Target(TargetPhase::Waiting) => {
                    // no directory was left (the skeleton had not started),
                    // perhaps some partial copies of local drives
                    crate::local_disk::discard_partial(&self.cfg.qemu, &rec.vm, &rec.migration_id);
                    self.record(&rec.migration_id, Side::Target(TargetPhase::Discarded));
                }
                _ => {}
            }
        }
        self.journal.prune(PRUNE_AFTER_SECS);
    }

    fn record(&self, id: &str, side: Side) {
        if let Err(e) = self.journal.update(id, side) {
            tracing::error!(migration = id, error = %e, "recording a migration settled at restart");
        }
    }

    /// A VM that ran here: adopt it; a migration it was the source of and
    /// that never committed is cancelled and the guest resumed.
    async fn recover_vm(&self, dir: &Path, vm: &str, records: &[Record]) {
        let Some(q) = self.adopt_dir(dir, vm, "").await else {
            return;
        };
        let open = records.iter().find(|r| {
            r.vm == vm
                && matches!(
                    r.side,
                    Side::Source(SourcePhase::Copying | SourcePhase::Committed)
                )
        });
        let mut doubt = None;
        match open.map(|r| (r, r.side)) {
            Some((r, Side::Source(SourcePhase::Copying))) => {
                if let Err(e) = q.qmp.migrate_cancel().await {
                    tracing::warn!(vm, error = %e, "cancelling an outgoing migration at restart");
                }
                // shared-nothing: the copies of its local drives are abandoned too
                crate::migration::disks::remove_leftovers(&q.qmp).await;
                crate::migration::resume_guest(&q).await;
                tracing::warn!(vm, migration = %r.migration_id, "restart: outgoing migration cancelled before its commit; the guest runs here");
            }
            Some((r, _)) => {
                // committed: the guest may run only where the settler finds it
                doubt = Some(format!("committed to {}; settling after a restart", r.peer));
            }
            None => {}
        }
        self.adopt_slot(vm, q, doubt).await;
    }

    /// A migration target's QEMU: adopt the guest that was told to run,
    /// kill a skeleton that never did.
    async fn recover_incoming(&self, dir: &Path, vm: &str, id: &str, phase: Option<TargetPhase>) {
        match incoming_fate(phase) {
            IncomingFate::Discard { record } => {
                // the process first, the record after: `discarded` means it can never run
                qemu::kill_recorded(dir).await;
                // shared-nothing: the partial copies of its local drives go too
                crate::local_disk::discard_partial(&self.cfg.qemu, vm, id);
                self.remove_vm_dir(dir, &format!("{vm}.{id}.target"));
                if record {
                    self.record(id, Side::Target(TargetPhase::Discarded));
                }
                tracing::warn!(
                    vm,
                    migration = id,
                    "restart: a skeleton that never ran is discarded"
                );
            }
            IncomingFate::Adopt => {
                let Some(q) = self.adopt_dir(dir, vm, &format!(".{id}.target")).await else {
                    return;
                };
                // RUN was received: the guest runs here (a `cont` may have
                // been lost with the agent)
                crate::migration::resume_guest(&q).await;
                self.adopt_slot(vm, q, None).await;
            }
        }
    }

    /// Takes back the QEMU in `dir`; a dead one's directory is removed (its
    /// log kept), one that lives but cannot be reached is left alone.
    async fn adopt_dir(&self, dir: &Path, vm: &str, label: &str) -> Option<Arc<QemuVm>> {
        match qemu::adopt(dir).await {
            Ok((rec, q)) if rec.spec.name == vm => {
                tracing::info!(vm, pid = q.pid, dir = %dir.display(), "restart: QEMU adopted");
                Some(Arc::new(q))
            }
            Ok((rec, _)) => {
                tracing::error!(vm, dir = %dir.display(), "restart: vm.json names {}; left alone", rec.spec.name);
                None
            }
            Err(qemu::QemuError::Qmp(e)) => {
                tracing::error!(vm, dir = %dir.display(), error = %error_chain(&e), "restart: QEMU runs but its QMP does not answer; left alone");
                None
            }
            Err(e) => {
                tracing::warn!(vm, error = %error_chain(&e), "restart: no QEMU to adopt; directory removed");
                self.remove_vm_dir(dir, &format!("{vm}{label}.lost"));
                None
            }
        }
    }

    async fn adopt_slot(&self, vm: &str, q: Arc<QemuVm>, doubt: Option<String>) {
        let spec = match qemu::read_record(&q.dir) {
            Ok(r) => r.spec,
            Err(e) => {
                tracing::error!(vm, error = %error_chain(&e), "restart: vm.json unreadable after adoption");
                return;
            }
        };
        let mut st = self.state.lock().await;
        if st.vms.contains_key(vm) {
            tracing::error!(vm, dir = %q.dir.display(), "restart: two QEMUs claim this VM; the second is left alone");
            return;
        }
        let mut slot = VmSlot::new(spec, Role::Running, Some(q));
        slot.migrating = doubt.is_some();
        slot.doubt = doubt;
        st.vms.insert(vm.to_string(), slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directory_names_say_vm_or_target() {
        assert_eq!(dir_kind("web1"), DirKind::Vm("web1"));
        assert_eq!(
            dir_kind("web1.in-ab12"),
            DirKind::Incoming {
                vm: "web1",
                id: "ab12"
            }
        );
    }

    #[test]
    fn only_a_target_told_to_run_is_adopted() {
        assert_eq!(
            incoming_fate(Some(TargetPhase::Waiting)),
            IncomingFate::Discard { record: true }
        );
        assert_eq!(
            incoming_fate(Some(TargetPhase::Discarded)),
            IncomingFate::Discard { record: false }
        );
        assert_eq!(
            incoming_fate(Some(TargetPhase::Running)),
            IncomingFate::Adopt
        );
        assert_eq!(incoming_fate(None), IncomingFate::Adopt);
    }
}
