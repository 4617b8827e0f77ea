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
//! | `NAME` | a source record unreadable, guest paused | yes | adopted paused and in doubt (the record may be its) |
//! | `NAME.in-ID` | target `waiting` | any | QEMU killed (it never ran), its partial local drives removed, record `discarded` |
//! | `NAME.in-ID` | target `running` (or forgotten once its source was done) | yes | adopted; `cont` if it was paused (RUN was received) |
//! | `NAME.in-ID` | target record unreadable | yes | adopted paused and in doubt: it may or may not have been told to run |
//! | `NAME.in-ID` | target `discarded` | any | QEMU killed, directory removed |
//! | any | any | no | directory removed (its QEMU log kept) |
//!
//! A QEMU whose process lives but whose QMP does not answer is left alone
//! and logged: it may be a guest still running, and nothing here may kill it.

use std::path::Path;
use std::sync::Arc;

use crate::commit::{target_may_forget, Record, Side, SourcePhase, TargetPhase};
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
    /// Was told to run (or ran so long ago its record is forgotten): adopt.
    Adopt,
    /// Its record cannot be read: adopt as it is (paused), in doubt.
    Doubt,
}

/// A target record as found at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found {
    Phase(TargetPhase),
    /// No record (written before the skeleton, so: forgotten after its
    /// source was done with it).
    None,
    /// A record that exists but cannot be read.
    Unreadable,
}

fn incoming_fate(record: Found) -> IncomingFate {
    match record {
        Found::Phase(TargetPhase::Waiting) => IncomingFate::Discard { record: true },
        Found::Phase(TargetPhase::Discarded) => IncomingFate::Discard { record: false },
        // the directory of a guest that ran here stays `.in-ID` for its life
        Found::Phase(TargetPhase::Running) | Found::None => IncomingFate::Adopt,
        Found::Unreadable => IncomingFate::Doubt,
    }
}

impl Agent {
    /// At start: adopt the QEMUs left running, then settle what the journal
    /// left open. Committed source records are settled by the periodic
    /// settler. Settled records older than a week are forgotten.
    pub async fn recover(&self) {
        let (records, errors) = self.moves.journal.all();
        let mut unreadable = Vec::new();
        for e in errors {
            tracing::error!(error = %e, "unreadable migration record: its migration stays in doubt");
            unreadable.extend(e.record());
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
                DirKind::Vm(vm) => {
                    let unreadable_source: Vec<&str> = unreadable
                        .iter()
                        .filter(|(_, source)| *source)
                        .map(|(id, _)| id.as_str())
                        .collect();
                    self.recover_vm(dir, vm, &records, &unreadable_source).await
                }
                DirKind::Incoming { vm, id } => {
                    let phase = records.iter().find_map(|r| match r.side {
                        Side::Target(p) if r.migration_id == id => Some(p),
                        _ => None,
                    });
                    let found = match phase {
                        Some(p) => Found::Phase(p),
                        None if unreadable.iter().any(|(u, source)| u == id && !*source) => {
                            Found::Unreadable
                        }
                        None => Found::None,
                    };
                    self.recover_incoming(dir, vm, id, found).await
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
    }

    /// Settled records older than a week are forgotten; a target's
    /// `running` one only once its source says it is done with it.
    pub async fn forget_settled(&self) {
        for rec in self.moves.journal.prune(PRUNE_AFTER_SECS) {
            let said = self
                .source_said((&rec.peer, &rec.peer_url), &rec.migration_id)
                .await;
            if target_may_forget(said) {
                self.moves.journal.forget(&rec);
            }
        }
    }

    fn record(&self, id: &str, side: Side) {
        if let Err(e) = self.moves.journal.update(id, side) {
            tracing::error!(migration = id, error = %e, "recording a migration settled at restart");
        }
    }

    /// A VM that ran here: adopt it; a migration it was the source of and
    /// that never committed is cancelled and the guest resumed.
    async fn recover_vm(&self, dir: &Path, vm: &str, records: &[Record], unreadable: &[&str]) {
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
            None if !unreadable.is_empty() => {
                // a guest paused by a migration whose record is unreadable
                // may have moved: it stays paused until someone looks
                let paused = q.qmp.status().await.map(|s| !s.running).unwrap_or(true);
                if paused {
                    doubt = Some(format!(
                        "paused, and the migration record(s) {} cannot be read; left paused",
                        unreadable.join(", ")
                    ));
                }
            }
            None => {}
        }
        self.adopt_slot(vm, q, doubt).await;
    }

    /// A migration target's QEMU: adopt the guest that was told to run,
    /// kill a skeleton that never did.
    async fn recover_incoming(&self, dir: &Path, vm: &str, id: &str, found: Found) {
        match incoming_fate(found) {
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
            IncomingFate::Doubt => {
                let Some(q) = self.adopt_dir(dir, vm, &format!(".{id}.target")).await else {
                    return;
                };
                tracing::error!(vm, migration = id, "restart: this host's record of the migration cannot be read; the guest is left as it is, in doubt");
                let why = format!(
                    "the record of incoming migration {id} cannot be read; left as it is (ferry vm resolve {vm})"
                );
                self.adopt_slot(vm, q, Some(why)).await;
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
            incoming_fate(Found::Phase(TargetPhase::Waiting)),
            IncomingFate::Discard { record: true }
        );
        assert_eq!(
            incoming_fate(Found::Phase(TargetPhase::Discarded)),
            IncomingFate::Discard { record: false }
        );
        assert_eq!(
            incoming_fate(Found::Phase(TargetPhase::Running)),
            IncomingFate::Adopt
        );
        assert_eq!(incoming_fate(Found::None), IncomingFate::Adopt);
        // an unreadable record is no answer: never resumed, never killed
        assert_eq!(incoming_fate(Found::Unreadable), IncomingFate::Doubt);
    }
}
