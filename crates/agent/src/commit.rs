//! The commit point of a live migration: which side may run the guest,
//! decided once, written down, and never taken back.
//!
//! ```text
//!  source (journal)                       target (journal)
//!  Copying ─── only the source may run ─── Waiting (QEMU -S: paused, never ran)
//!     │  memory arrived, both paused, target loaded and reachable
//!     ▼
//!  Committed ── write + fsync ── RUN ────▶ Running (written, then `cont`)
//!     │  ◀─────────────── ran ────────────── │
//!     ▼
//!  Done (source QEMU stopped)
//!
//!  any failure before Committed: Aborted (written), then the source resumes;
//!  the target discards its paused skeleton when told or when it asks.
//! ```
//!
//! Rules:
//! 1. The target's vCPUs start only on RUN, and RUN is sent only after the
//!    source's Committed record is on disk. So before that record only the
//!    source may run; after it, only the target.
//! 2. The source resumes only from Copying (→ Aborted), or from Committed
//!    when the target *proves* it never ran and never can (its skeleton is
//!    gone and its journal has no Running record).
//! 3. A RUN whose answer is lost leaves the migration **in doubt**: the source
//!    stays paused and asks the target until one of them answers.
//! 4. A waiting target asks the source; Committed or Done → it runs, Aborted
//!    or unknown → it discards, no answer → it waits (in doubt). It runs
//!    only a skeleton whose QEMU holds the guest ([`skeleton_holds_guest`],
//!    the event's `holds_guest`): a post-copy's commit is recorded before
//!    QEMU switches, and a skeleton asked in between, or whose source's QEMU
//!    never switched, waits for RUN or for the source's settling to discard
//!    it ([`TargetAction::AwaitGuest`]).
//!
//! This module holds the decisions only ([`source_next`], [`target_next`]) and
//! the journal that persists them; the agent performs the actions. The tests
//! check every interleaving of messages lost, duplicated, reordered and agent
//! restarts against the rule "never two copies, never one the other lost".

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The source's record of one outgoing migration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SourcePhase {
    /// Before the commit: the source alone may run the guest.
    Copying,
    /// The commit record is written: the target alone may run the guest.
    Committed,
    /// Given up before the target ran: the source runs the guest.
    Aborted,
    /// The target runs the guest; the source's QEMU is gone.
    Done,
}

/// The target's record of one incoming migration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TargetPhase {
    /// A paused skeleton that has never run.
    Waiting,
    /// Told to run (written before `cont`): the guest may have run here.
    Running,
    /// Discarded without ever running.
    Discarded,
}

/// What the target says when the source asks about a migration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TargetAnswer {
    /// Its skeleton is paused and alive.
    Waiting,
    /// It runs (or ran) the guest.
    Running,
    /// It has no skeleton and no Running record: it never ran and never will.
    NeverRan,
}

/// What the source says when the target asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SourceAnswer {
    Copying,
    Committed,
    Aborted,
    Done,
    /// No record of this migration (never started, or long forgotten).
    Unknown,
}

impl From<SourcePhase> for SourceAnswer {
    fn from(p: SourcePhase) -> Self {
        match p {
            SourcePhase::Copying => SourceAnswer::Copying,
            SourcePhase::Committed => SourceAnswer::Committed,
            SourcePhase::Aborted => SourceAnswer::Aborted,
            SourcePhase::Done => SourceAnswer::Done,
        }
    }
}

/// What happens to the source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceEvent {
    /// Something failed (copy, checks, a lost agent, a bad answer).
    Failed,
    /// Both sides paused, the target loaded everything and answers: commit.
    Ready,
    /// The target answered (RUN's reply, or a question asked later).
    Answer(TargetAnswer),
    /// No answer from the target (RUN or a question timed out).
    NoAnswer,
    /// The source agent started again and found this record.
    Restarted,
}

/// What the source must do, in order, after a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceAction {
    /// Nothing to do.
    None,
    /// Write Aborted, tell the target to discard, resume the source guest.
    AbortAndResume,
    /// Write Committed (fsync), then send RUN to the target.
    CommitAndRun,
    /// Send RUN again (the target waits, paused).
    SendRun,
    /// The target runs the guest: stop the source QEMU, write Done.
    Finish,
    /// In doubt: stay paused, ask the target again later.
    AskLater,
}

/// The source's decision table.
pub fn source_next(phase: SourcePhase, ev: SourceEvent) -> (SourcePhase, SourceAction) {
    use SourceAction as A;
    use SourceEvent as E;
    use SourcePhase as P;
    match (phase, ev) {
        (P::Copying, E::Failed | E::Restarted) => (P::Aborted, A::AbortAndResume),
        (P::Copying, E::Ready) => (P::Committed, A::CommitAndRun),
        // before the commit no answer changes anything: the copy loop decides
        (P::Copying, E::Answer(_) | E::NoAnswer) => (P::Copying, A::None),
        (P::Committed, E::Answer(TargetAnswer::Running)) => (P::Done, A::Finish),
        (P::Committed, E::Answer(TargetAnswer::Waiting)) => (P::Committed, A::SendRun),
        // the target's skeleton is gone and it never ran: the only copy is here
        (P::Committed, E::Answer(TargetAnswer::NeverRan)) => (P::Aborted, A::AbortAndResume),
        (P::Committed, E::Failed | E::NoAnswer | E::Restarted | E::Ready) => {
            (P::Committed, A::AskLater)
        }
        (P::Aborted, _) => (P::Aborted, A::None),
        (P::Done, _) => (P::Done, A::None),
    }
}

/// Where the source's own QEMU stands, read with `query-migrate` and
/// `query-status` after the commit record (it decides what the record may
/// not: whether the source's copy of the guest is whole and may still run,
/// and whether its QEMU may be stopped).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SourceQemu {
    /// The migration completed: the target holds every page and device.
    Completed,
    /// In post-copy: the target holds the device state and fetches missing
    /// pages from here. `paused`: the stream broke (QEMU `postcopy-paused`).
    Postcopy { paused: bool },
    /// No migration in flight and none completed (QEMU never switched, or
    /// its migration was cancelled before it did): this copy is whole.
    NotSwitched,
    /// Pre-copy still running, perhaps with a switch to post-copy asked:
    /// cancel it, then look again.
    Active,
    /// No QEMU here any more.
    Gone,
    /// Its QMP does not answer.
    Unknown,
}

/// What the source does about a committed migration, given the target's
/// answer (None: no answer) and its own QEMU. The commit record alone
/// cannot say: post-copy commits before QEMU switches, and QEMU may refuse
/// the switch or the agent may die before it asks.
///
/// | target says | source QEMU | action |
/// |---|---|---|
/// | running | completed, gone | finish: stop the source QEMU, record done |
/// | running | post-copy paused | recover post-copy over a path still up |
/// | running | post-copy, unknown, not switched | wait (its pages may still be needed) |
/// | waiting | completed, post-copy, gone | send RUN |
/// | waiting | not switched | discard the target, then record aborted; the source runs |
/// | never ran | completed, not switched, gone | record aborted, resume the source |
/// | never ran | post-copy | wait: the operator decides (`vm resolve --target-lost`) |
/// | any | active | cancel QEMU's migration and look again |
/// | no answer | any | wait, in doubt |
pub fn after_commit(answer: Option<TargetAnswer>, q: SourceQemu) -> AfterCommitAction {
    use AfterCommitAction as A;
    use SourceQemu as Q;
    use TargetAnswer as T;
    match (answer, q) {
        (_, Q::Active) => A::CancelAndLook,
        (None, _) | (_, Q::Unknown) => A::AskLater,
        (Some(T::Running), Q::Completed | Q::Gone) => A::Finish,
        (Some(T::Running), Q::Postcopy { paused: true }) => A::Recover,
        (Some(T::Running), Q::Postcopy { paused: false } | Q::NotSwitched) => A::AskLater,
        (Some(T::Waiting), Q::Completed | Q::Postcopy { .. } | Q::Gone) => A::SendRun,
        (Some(T::Waiting), Q::NotSwitched) => A::DiscardTarget,
        (Some(T::NeverRan), Q::Completed | Q::NotSwitched | Q::Gone) => A::AbortAndResume,
        (Some(T::NeverRan), Q::Postcopy { .. }) => A::AskLater,
    }
}

/// What [`after_commit`] decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterCommitAction {
    /// The target runs the whole guest: stop the source QEMU, record Done.
    Finish,
    /// Send RUN (the target waits, paused, with the whole state or the
    /// device state of a post-copy).
    SendRun,
    /// Post-copy's stream broke: open a new one (`migrate-recover` there,
    /// `migrate resume` here).
    Recover,
    /// QEMU never switched: tell the target to discard its skeleton; once it
    /// confirms, record Aborted (the source's copy runs on).
    DiscardTarget,
    /// The target never ran and never will: record Aborted, resume here.
    AbortAndResume,
    /// QEMU's pre-copy is still running: cancel it and look again.
    CancelAndLook,
    /// In doubt or waiting for QEMU: stay as is, look again later.
    AskLater,
}

/// What happens to the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetEvent {
    /// RUN from the source.
    Run,
    /// The source says it rolled back: discard.
    Abort,
    /// The source answered a question (`said` None: no answer);
    /// `holds_guest`: this skeleton's QEMU holds the guest
    /// ([`skeleton_holds_guest`]), asked when the source says it committed.
    SourceSaid {
        said: Option<SourceAnswer>,
        holds_guest: bool,
    },
    /// The skeleton's QEMU is gone (it exited, was killed, or died with a
    /// restarted agent).
    QemuGone,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetAction {
    None,
    /// Write Running (fsync), then `cont` the guest and adopt it; answer ran.
    RecordAndRun,
    /// Already running: answer ran again.
    AnswerRunning,
    /// Kill the paused skeleton, write Discarded; answer never-ran.
    Discard,
    /// Discarded before: answer never-ran.
    AnswerNeverRan,
    /// Refuse to discard: the guest may have run here.
    RefuseAbort,
    /// In doubt: stay paused, ask the source again later.
    AskLater,
    /// The source committed, but this skeleton's QEMU does not hold the
    /// guest (a post-copy's record comes before QEMU's switch): stay paused
    /// for RUN, or for the source's settling to discard it (rule 4).
    AwaitGuest,
}

/// The target's decision table.
pub fn target_next(phase: TargetPhase, ev: TargetEvent) -> (TargetPhase, TargetAction) {
    use SourceAnswer as S;
    use TargetAction as A;
    use TargetEvent as E;
    use TargetPhase as P;
    match (phase, ev) {
        (
            P::Waiting,
            E::Run
            | E::SourceSaid {
                said: Some(S::Committed | S::Done),
                holds_guest: true,
            },
        ) => (P::Running, A::RecordAndRun),
        (
            P::Waiting,
            E::SourceSaid {
                said: Some(S::Committed | S::Done),
                holds_guest: false,
            },
        ) => (P::Waiting, A::AwaitGuest),
        (
            P::Waiting,
            E::Abort
            | E::QemuGone
            | E::SourceSaid {
                said: Some(S::Aborted | S::Unknown),
                ..
            },
        ) => (P::Discarded, A::Discard),
        (
            P::Waiting,
            E::SourceSaid {
                said: Some(S::Copying),
                ..
            },
        ) => (P::Waiting, A::None),
        (P::Waiting, E::SourceSaid { said: None, .. }) => (P::Waiting, A::AskLater),
        (P::Running, E::Run) => (P::Running, A::AnswerRunning),
        (P::Running, E::Abort) => (P::Running, A::RefuseAbort),
        (P::Running, _) => (P::Running, A::None),
        (P::Discarded, E::Run) => (P::Discarded, A::AnswerNeverRan),
        (P::Discarded, _) => (P::Discarded, A::None),
    }
}

/// Whether a skeleton whose QEMU's incoming migration is in `status` (its
/// `query-migrate`) holds the guest: QEMU completed the load, or switched to
/// post-copy (the device state loaded, pages follow on demand). Any other
/// status (`setup`, `active`: pre-copy's pages still arriving; unknown: no
/// answer) is a skeleton that cannot run the guest, whatever the source
/// recorded: a source's Committed then does not make it run (rule 4).
pub fn skeleton_holds_guest(status: Option<&str>) -> bool {
    matches!(status, Some(s) if s == "completed" || s.starts_with("postcopy"))
}

/// The answer a target gives about a migration, from its phase (None: no record).
pub fn target_answer(phase: Option<TargetPhase>) -> TargetAnswer {
    match phase {
        Some(TargetPhase::Waiting) => TargetAnswer::Waiting,
        Some(TargetPhase::Running) => TargetAnswer::Running,
        Some(TargetPhase::Discarded) | None => TargetAnswer::NeverRan,
    }
}

/// One migration as written in an agent's journal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub migration_id: String,
    pub vm: String,
    /// The other host's name and agent URL.
    pub peer: String,
    pub peer_url: String,
    #[serde(flatten)]
    pub side: Side,
    /// Unix seconds of the last change.
    pub updated: u64,
    /// Source: the move's carriers were sealed (a post-copy recovery over
    /// QEMU's own stream would not be, so it is not done).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sealed: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "side", content = "phase", rename_all = "kebab-case")]
pub enum Side {
    Source(SourcePhase),
    Target(TargetPhase),
}

impl Side {
    fn file_suffix(&self) -> &'static str {
        match self {
            Side::Source(_) => "source",
            Side::Target(_) => "target",
        }
    }
}

/// A phase or an answer as it crosses the wire (`committed`, `never-ran`, …):
/// its serde name, the one spelling the API and the journal share.
pub fn wire_name<T: Serialize>(v: T) -> String {
    serde_json::to_value(v)
        .ok()
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default()
}

/// The phase or answer a wire name stands for.
pub fn from_wire_name<T: serde::de::DeserializeOwned>(name: &str) -> Option<T> {
    serde_json::from_value(serde_json::Value::String(name.into())).ok()
}

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("migration journal {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("migration journal {path}: {source}")]
    Format {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("migration journal {path}: no such record")]
    Missing { path: PathBuf },
}

impl JournalError {
    /// The migration and side of the record this error is about, from its
    /// file's name (`ID.source.json`: (ID, true)).
    pub fn record(&self) -> Option<(String, bool)> {
        let path = match self {
            JournalError::Io { path, .. }
            | JournalError::Format { path, .. }
            | JournalError::Missing { path } => path,
        };
        let name = path.file_name()?.to_str()?.strip_suffix(".json")?;
        let (id, side) = name.rsplit_once('.')?;
        match side {
            "source" => Some((id.to_string(), true)),
            "target" => Some((id.to_string(), false)),
            _ => None,
        }
    }
}

/// A record's file is one disk sector long, its JSON padded with spaces, so
/// that a later phase can overwrite it in place ([`Journal::write`]).
pub const RECORD_BYTES: usize = 512;

/// A record's readers and writers in this process take turns, by file: a
/// read beside an overwrite could see half of each, and a reader sees a
/// phase only once it is durable (a target told `committed` may run). Only
/// the same file's turns wait on each other: one record's slow `fsync` holds
/// up no other move's.
static BUSY: std::sync::Mutex<std::collections::BTreeSet<PathBuf>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());
static FREED: std::sync::Condvar = std::sync::Condvar::new();

/// The turn of the record file at `path`, until dropped.
struct Turn(PathBuf);

fn turn(path: &Path) -> Turn {
    let mut busy = ferry_api::util::lock(&BUSY);
    while busy.contains(path) {
        busy = FREED.wait(busy).unwrap_or_else(|e| e.into_inner());
    }
    busy.insert(path.to_path_buf());
    Turn(path.to_path_buf())
}

impl Drop for Turn {
    fn drop(&mut self) {
        ferry_api::util::lock(&BUSY).remove(&self.0);
        FREED.notify_all();
    }
}

/// Migration records on disk, one file each, durable before a decision is
/// acted on: `STATE_DIR/migrations/ID.{source,target}.json`.
#[derive(Debug, Clone)]
pub struct Journal {
    dir: PathBuf,
    /// The migrations whose source record is `committed`, as this process
    /// wrote them (None until a first full read): what the settler asks
    /// for every 2 s, without reading every record kept for a week.
    committed: std::sync::Arc<std::sync::Mutex<Option<std::collections::BTreeSet<String>>>>,
}

pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Journal {
    pub fn new(state_dir: &Path) -> Journal {
        Journal {
            dir: state_dir.join("migrations"),
            committed: Default::default(),
        }
    }

    fn path(&self, id: &str, side: &Side) -> PathBuf {
        self.dir.join(format!("{id}.{}.json", side.file_suffix()))
    }

    /// Writes `rec` durably. A record's first write makes its file: a
    /// temporary file, fsync, rename, fsync of the directory. A later phase
    /// (`committed` in the switch-over, `running` at RUN) overwrites that
    /// file's one sector in place and `fdatasync`s it: no inode, block or
    /// name changes, so the filesystem flushes the data and the device's
    /// cache without committing its own journal, which on a busy disk waits
    /// behind everyone else's metadata (BENCHMARKS.md, "The commit record
    /// written in place"). A sector is written whole or not at all, the
    /// assumption PostgreSQL makes of its 512-byte control file; were it
    /// ever torn, the record would read as unreadable, which every reader
    /// takes for no answer, never for a phase. Readers in this process wait
    /// for a write of the same record to be durable (`turn`).
    pub fn write(&self, rec: &Record) -> Result<(), JournalError> {
        use std::io::Write;
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| JournalError::Io { path, source }
        };
        let path = self.path(&rec.migration_id, &rec.side);
        let mut rec = rec.clone();
        rec.updated = now_secs();
        let mut body = serde_json::to_vec(&rec).map_err(|source| JournalError::Format {
            path: path.clone(),
            source,
        })?;
        if body.len() < RECORD_BYTES {
            body.resize(RECORD_BYTES - 1, b' ');
            body.push(b'\n');
        }
        if !Self::overwrite(&path, &body).map_err(io(&path))? {
            std::fs::create_dir_all(&self.dir).map_err(io(&self.dir))?;
            let tmp = path.with_extension("tmp");
            let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
            f.write_all(&body).map_err(io(&tmp))?;
            f.sync_all().map_err(io(&tmp))?;
            let _turn = turn(&path);
            std::fs::rename(&tmp, &path).map_err(io(&path))?;
            std::fs::File::open(&self.dir)
                .and_then(|d| d.sync_all())
                .map_err(io(&self.dir))?;
        }
        if let Side::Source(phase) = rec.side {
            self.note_committed(&rec.migration_id, phase == SourcePhase::Committed);
        }
        Ok(())
    }

    /// Overwrites the record file at `path` with `body` in place, when both
    /// are one sector long, at the real-time I/O class
    /// ([`crate::io_priority`]); false when there is no such file (a first
    /// write, or a record an older agent wrote at another length).
    fn overwrite(path: &Path, body: &[u8]) -> std::io::Result<bool> {
        use std::os::unix::fs::FileExt;
        if body.len() != RECORD_BYTES {
            return Ok(false);
        }
        let f = match std::fs::OpenOptions::new().write(true).open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(e),
        };
        if f.metadata()?.len() != RECORD_BYTES as u64 {
            return Ok(false);
        }
        let _turn = turn(path);
        // in the switch-over the guest waits on this flush: ahead of the
        // writeback of everything else on the disk
        let (written, _) = crate::io_priority::realtime(|| {
            f.write_all_at(body, 0)?;
            f.sync_data()
        });
        written?;
        Ok(true)
    }

    /// Keeps the index of committed source records in step with a write
    /// or a removal.
    fn note_committed(&self, id: &str, committed: bool) {
        if let Some(set) = ferry_api::util::lock(&self.committed).as_mut() {
            if committed {
                set.insert(id.to_string());
            } else {
                set.remove(id);
            }
        }
    }

    /// Every source record in its `committed` phase: the full read once,
    /// then only those records (the index follows this process's writes).
    pub fn committed_sources(&self) -> Vec<Record> {
        let committed = |r: &Record| r.side == Side::Source(SourcePhase::Committed);
        // the index exists before the full read, so a commit written
        // meanwhile is noted by the write itself, not lost between the two
        let first = {
            let mut index = ferry_api::util::lock(&self.committed);
            let first = index.is_none();
            index.get_or_insert_with(Default::default);
            first
        };
        if first {
            let found: Vec<String> = self
                .all()
                .0
                .into_iter()
                .filter(committed)
                .map(|r| r.migration_id)
                .collect();
            ferry_api::util::lock(&self.committed)
                .get_or_insert_with(Default::default)
                .extend(found);
        }
        let ids = ferry_api::util::lock(&self.committed)
            .clone()
            .unwrap_or_default();
        ids.iter()
            .filter_map(|id| self.read(id, true).ok().flatten())
            .filter(committed)
            .collect()
    }

    /// Moves the record of migration `id` on `side`'s side to `side`'s phase
    /// (durably, as [`Journal::write`]); returns the record as written.
    pub fn update(&self, id: &str, side: Side) -> Result<Record, JournalError> {
        let mut rec = self
            .read_side(id, &side)?
            .ok_or_else(|| JournalError::Missing {
                path: self.path(id, &side),
            })?;
        rec.side = side;
        self.write(&rec)?;
        Ok(rec)
    }

    /// The record of migration `id` on the source side, or the target side, if any.
    pub fn read(&self, id: &str, source_side: bool) -> Result<Option<Record>, JournalError> {
        let side = if source_side {
            Side::Source(SourcePhase::Copying)
        } else {
            Side::Target(TargetPhase::Waiting)
        };
        self.read_side(id, &side)
    }

    /// The record of migration `id` on the side of `side` (its phase ignored).
    fn read_side(&self, id: &str, side: &Side) -> Result<Option<Record>, JournalError> {
        let path = self.path(id, side);
        let read = {
            let _turn = turn(&path);
            std::fs::read(&path)
        };
        match read {
            Ok(b) => serde_json::from_slice(&b)
                .map(Some)
                .map_err(|source| JournalError::Format { path, source }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(JournalError::Io { path, source }),
        }
    }

    /// Every record (unreadable files are reported, not skipped silently).
    pub fn all(&self) -> (Vec<Record>, Vec<JournalError>) {
        let (mut out, mut errs) = (Vec::new(), Vec::new());
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return (out, errs);
        };
        for e in rd.flatten() {
            let path = e.path();
            if path.extension().and_then(|x| x.to_str()) != Some("json") {
                continue;
            }
            let read = {
                let _turn = turn(&path);
                std::fs::read(&path)
            };
            match read {
                Ok(b) => match serde_json::from_slice(&b) {
                    Ok(r) => out.push(r),
                    Err(source) => errs.push(JournalError::Format { path, source }),
                },
                Err(source) => errs.push(JournalError::Io { path, source }),
            }
        }
        out.sort_by(|a: &Record, b| a.migration_id.cmp(&b.migration_id));
        (out, errs)
    }

    /// Forgets settled records older than `age_secs`, except a target's
    /// `running` ones: without its record a target answers "never ran", so
    /// those are returned instead, to be forgotten ([`Journal::forget`]) only
    /// once their source says it is done with them.
    pub fn prune(&self, age_secs: u64) -> Vec<Record> {
        let cutoff = now_secs().saturating_sub(age_secs);
        let mut ask = Vec::new();
        for r in self.all().0 {
            if r.updated >= cutoff {
                continue;
            }
            match r.side {
                Side::Source(SourcePhase::Aborted | SourcePhase::Done)
                | Side::Target(TargetPhase::Discarded) => self.forget(&r),
                Side::Target(TargetPhase::Running) => ask.push(r),
                _ => {}
            }
        }
        ask
    }

    /// Removes one record.
    pub fn forget(&self, r: &Record) {
        let _ = std::fs::remove_file(self.path(&r.migration_id, &r.side));
        if matches!(r.side, Side::Source(_)) {
            self.note_committed(&r.migration_id, false);
        }
    }
}

/// Whether a target may forget its `running` record, given what its source
/// said (None: no answer): only once the source is done with it, or has
/// itself forgotten it (a source never forgets a committed record).
pub fn target_may_forget(source: Option<SourceAnswer>) -> bool {
    matches!(source, Some(SourceAnswer::Done | SourceAnswer::Unknown))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeSet, HashSet, VecDeque};

    #[test]
    fn only_a_skeleton_with_the_guest_runs_on_the_sources_commit() {
        for s in [
            "completed",
            "postcopy-active",
            "postcopy-paused",
            "postcopy-recover",
        ] {
            assert!(skeleton_holds_guest(Some(s)), "{s}");
        }
        for s in ["none", "setup", "active", "failed", "cancelled"] {
            assert!(!skeleton_holds_guest(Some(s)), "{s}");
        }
        assert!(!skeleton_holds_guest(None), "QEMU's status unknown");
    }

    #[test]
    #[allow(clippy::unwrap_used)] // a panic is the failure report
    fn the_settlers_index_follows_writes_removals_and_a_first_full_read() {
        // a directory of its own: the tests of this module run side by side
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let rec = |id: &str, side| Record {
            migration_id: id.into(),
            vm: "vm".into(),
            peer: "host2".into(),
            peer_url: "https://198.18.0.12:7800".into(),
            side,
            updated: 0,
            sealed: false,
        };
        let ids = |j: &Journal| -> Vec<String> {
            j.committed_sources()
                .into_iter()
                .map(|r| r.migration_id)
                .collect()
        };
        let earlier = Journal::new(&dir);
        earlier
            .write(&rec("a", Side::Source(SourcePhase::Committed)))
            .unwrap();
        earlier
            .write(&rec("b", Side::Source(SourcePhase::Done)))
            .unwrap();
        earlier
            .write(&rec("c", Side::Target(TargetPhase::Running)))
            .unwrap();
        // a restarted agent: the first question reads every record
        let j = Journal::new(&dir);
        assert_eq!(ids(&j), ["a"]);
        j.write(&rec("d", Side::Source(SourcePhase::Committed)))
            .unwrap();
        assert_eq!(ids(&j), ["a", "d"]);
        j.update("a", Side::Source(SourcePhase::Done)).unwrap();
        assert_eq!(ids(&j), ["d"]);
        j.forget(&rec("d", Side::Source(SourcePhase::Committed)));
        assert!(ids(&j).is_empty());
        // a record changed behind the index is not taken for committed
        j.write(&rec("e", Side::Source(SourcePhase::Committed)))
            .unwrap();
        earlier
            .write(&rec("e", Side::Source(SourcePhase::Aborted)))
            .unwrap();
        assert!(ids(&j).is_empty());
    }

    #[test]
    #[allow(clippy::unwrap_used)] // a panic is the failure report
    fn a_later_phase_overwrites_its_sector_in_place_and_older_or_longer_records_are_replaced() {
        use std::os::unix::fs::MetadataExt;
        let tmp = tempfile::tempdir().unwrap();
        let j = Journal::new(tmp.path());
        let rec = |id: &str, vm: &str, side| Record {
            migration_id: id.into(),
            vm: vm.into(),
            peer: "host2".into(),
            peer_url: "https://198.18.0.12:7800".into(),
            side,
            updated: 0,
            sealed: true,
        };
        let file = |id: &str| tmp.path().join(format!("migrations/{id}.source.json"));
        let phase = |id: &str| j.read(id, true).unwrap().unwrap().side;

        j.write(&rec("a", "vm", Side::Source(SourcePhase::Copying)))
            .unwrap();
        let first = std::fs::metadata(file("a")).unwrap();
        assert_eq!(first.len(), RECORD_BYTES as u64);
        j.update("a", Side::Source(SourcePhase::Committed)).unwrap();
        let after = std::fs::metadata(file("a")).unwrap();
        assert_eq!(after.ino(), first.ino(), "the commit was written in place");
        assert_eq!(after.len(), RECORD_BYTES as u64);
        assert_eq!(phase("a"), Side::Source(SourcePhase::Committed));
        assert!(!file("a").with_extension("tmp").exists());

        // a record an older agent wrote (pretty, of its own length) is read,
        // and its next phase replaces the file whole
        let old =
            serde_json::to_vec_pretty(&rec("b", "vm", Side::Source(SourcePhase::Copying))).unwrap();
        std::fs::write(file("b"), &old).unwrap();
        let before = std::fs::metadata(file("b")).unwrap().ino();
        j.update("b", Side::Source(SourcePhase::Committed)).unwrap();
        let meta = std::fs::metadata(file("b")).unwrap();
        assert_ne!(
            meta.ino(),
            before,
            "an older record is replaced, not patched"
        );
        assert_eq!(meta.len(), RECORD_BYTES as u64);
        assert_eq!(phase("b"), Side::Source(SourcePhase::Committed));

        // a record longer than a sector is always replaced whole
        let long = "v".repeat(RECORD_BYTES);
        j.write(&rec("c", &long, Side::Source(SourcePhase::Copying)))
            .unwrap();
        let before = std::fs::metadata(file("c")).unwrap().ino();
        j.update("c", Side::Source(SourcePhase::Committed)).unwrap();
        assert_ne!(std::fs::metadata(file("c")).unwrap().ino(), before);
        let back = j.read("c", true).unwrap().unwrap();
        assert_eq!(
            (back.vm, back.side),
            (long, Side::Source(SourcePhase::Committed))
        );
    }

    /// A source's record of migration `id`, copying.
    fn copying(id: &str) -> Record {
        Record {
            migration_id: id.into(),
            vm: "vm".into(),
            peer: "host2".into(),
            peer_url: "https://198.18.0.12:7800".into(),
            side: Side::Source(SourcePhase::Copying),
            updated: 0,
            sealed: false,
        }
    }

    #[test]
    #[allow(clippy::unwrap_used)] // a panic is the failure report
    fn a_records_turn_holds_up_its_own_readers_and_no_others() {
        let tmp = tempfile::tempdir().unwrap();
        let j = Journal::new(tmp.path());
        for id in ["a", "b"] {
            j.write(&copying(id)).unwrap();
        }
        // a's write under way (its fsync, say)
        let held = turn(&j.path("a", &Side::Source(SourcePhase::Copying)));
        assert!(j.read("b", true).unwrap().is_some(), "b is read at once");
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = j.clone();
        std::thread::spawn(move || tx.send(reader.read("a", true).unwrap().is_some()));
        assert!(
            rx.recv_timeout(std::time::Duration::from_millis(200))
                .is_err(),
            "a's reader waits for a's write"
        );
        drop(held);
        assert!(rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap());
    }

    #[test]
    #[allow(clippy::unwrap_used)] // a panic is the failure report
    fn a_read_beside_an_overwrite_sees_one_whole_record() {
        let tmp = tempfile::tempdir().unwrap();
        let j = Journal::new(tmp.path());
        // the two phases' names differ (`copying`, `committed`), so a read
        // of half of each is no record
        j.write(&copying("m")).unwrap();
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let (j, done) = (j.clone(), done.clone());
            std::thread::spawn(move || {
                let mut reads = 0u32;
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    j.read("m", true).expect("a whole record");
                    reads += 1;
                }
                reads
            })
        };
        for i in 0..200 {
            let p = if i % 2 == 0 {
                SourcePhase::Committed
            } else {
                SourcePhase::Copying
            };
            j.update("m", Side::Source(p)).unwrap();
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(reader.join().unwrap() > 0);
    }

    #[test]
    fn source_decisions() {
        use SourceAction as A;
        use SourceEvent as E;
        use SourcePhase as P;
        let cases = [
            (P::Copying, E::Failed, P::Aborted, A::AbortAndResume),
            (P::Copying, E::Restarted, P::Aborted, A::AbortAndResume),
            (P::Copying, E::Ready, P::Committed, A::CommitAndRun),
            (P::Copying, E::NoAnswer, P::Copying, A::None),
            // the RUN's answer lost, or any failure after the commit: in doubt, never resume
            (P::Committed, E::NoAnswer, P::Committed, A::AskLater),
            (P::Committed, E::Failed, P::Committed, A::AskLater),
            (P::Committed, E::Restarted, P::Committed, A::AskLater),
            (
                P::Committed,
                E::Answer(TargetAnswer::Running),
                P::Done,
                A::Finish,
            ),
            (
                P::Committed,
                E::Answer(TargetAnswer::Waiting),
                P::Committed,
                A::SendRun,
            ),
            (
                P::Committed,
                E::Answer(TargetAnswer::NeverRan),
                P::Aborted,
                A::AbortAndResume,
            ),
            (
                P::Aborted,
                E::Answer(TargetAnswer::Running),
                P::Aborted,
                A::None,
            ),
            (P::Done, E::Failed, P::Done, A::None),
        ];
        for (p, e, want_p, want_a) in cases {
            assert_eq!(source_next(p, e), (want_p, want_a), "{p:?} on {e:?}");
        }
    }

    /// The source's answer `a`, heard by a skeleton that holds the guest.
    fn said(a: Option<SourceAnswer>) -> TargetEvent {
        TargetEvent::SourceSaid {
            said: a,
            holds_guest: true,
        }
    }

    #[test]
    fn target_decisions() {
        use SourceAnswer as S;
        use TargetAction as A;
        use TargetEvent as E;
        use TargetPhase as P;
        let cases = [
            (P::Waiting, E::Run, P::Running, A::RecordAndRun),
            (
                P::Waiting,
                said(Some(S::Committed)),
                P::Running,
                A::RecordAndRun,
            ),
            (P::Waiting, said(Some(S::Done)), P::Running, A::RecordAndRun),
            (P::Waiting, E::Abort, P::Discarded, A::Discard),
            (P::Waiting, E::QemuGone, P::Discarded, A::Discard),
            (P::Waiting, said(Some(S::Aborted)), P::Discarded, A::Discard),
            (P::Waiting, said(Some(S::Unknown)), P::Discarded, A::Discard),
            (P::Waiting, said(Some(S::Copying)), P::Waiting, A::None),
            (P::Waiting, said(None), P::Waiting, A::AskLater),
            // rule 4: committed, but this skeleton's QEMU has not the guest
            (
                P::Waiting,
                E::SourceSaid {
                    said: Some(S::Committed),
                    holds_guest: false,
                },
                P::Waiting,
                A::AwaitGuest,
            ),
            (
                P::Waiting,
                E::SourceSaid {
                    said: Some(S::Aborted),
                    holds_guest: false,
                },
                P::Discarded,
                A::Discard,
            ),
            (P::Running, E::Run, P::Running, A::AnswerRunning),
            (P::Running, E::Abort, P::Running, A::RefuseAbort),
            (P::Discarded, E::Run, P::Discarded, A::AnswerNeverRan),
        ];
        for (p, e, want_p, want_a) in cases {
            assert_eq!(target_next(p, e), (want_p, want_a), "{p:?} on {e:?}");
        }
    }

    // ---- every interleaving ----

    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
    enum Msg {
        Run,
        Abort,
        AskTarget,
        TargetSaid(TargetAnswer),
        AskSource,
        SourceSaid(SourceAnswer),
    }

    /// The two agents, their QEMUs and the network between them.
    #[derive(Debug, Clone, PartialEq, Eq, Hash)]
    struct World {
        s: SourcePhase,
        /// None: the target never heard of it (its record is written with the skeleton).
        t: Option<TargetPhase>,
        /// The source guest runs now / the target guest has ever run.
        source_runs: bool,
        target_ran: bool,
        /// The source QEMU (paused after the copy) still exists.
        source_qemu: bool,
        /// The target skeleton's QEMU exists.
        target_qemu: bool,
        /// Messages in flight (a set: duplicates merge, any order, any loss).
        net: BTreeSet<Msg>,
        restarts: u8,
        kills: u8,
        /// The source gave the move up and resumed its guest; its `aborted`
        /// is not recorded yet (`roll_back` resumes first, then records).
        rolling_back: bool,
    }

    impl World {
        fn start() -> World {
            World {
                s: SourcePhase::Copying,
                t: Some(TargetPhase::Waiting),
                // the guest is paused for the switch-over once the memory has arrived
                source_runs: false,
                target_ran: false,
                source_qemu: true,
                target_qemu: true,
                net: BTreeSet::new(),
                restarts: 0,
                kills: 0,
                rolling_back: false,
            }
        }

        fn source_acts(&mut self, a: SourceAction) {
            match a {
                SourceAction::None | SourceAction::AskLater => {}
                SourceAction::AbortAndResume => {
                    self.net.insert(Msg::Abort);
                    if self.source_qemu {
                        self.source_runs = true;
                    }
                }
                SourceAction::CommitAndRun | SourceAction::SendRun => {
                    self.net.insert(Msg::Run);
                }
                SourceAction::Finish => {
                    self.source_qemu = false;
                    self.source_runs = false;
                }
            }
        }

        fn source_on(&mut self, e: SourceEvent) {
            let (p, a) = source_next(self.s, e);
            self.s = p;
            self.source_acts(a);
        }

        fn target_on(&mut self, e: TargetEvent) {
            let Some(t) = self.t else {
                // no record: RUN finds nothing, so the source hears "never ran"
                if e == TargetEvent::Run {
                    self.net.insert(Msg::TargetSaid(TargetAnswer::NeverRan));
                }
                return;
            };
            let (p, a) = target_next(t, e);
            self.t = Some(p);
            match a {
                TargetAction::RecordAndRun => {
                    if self.target_qemu {
                        self.target_ran = true;
                    }
                    self.net.insert(Msg::TargetSaid(TargetAnswer::Running));
                }
                TargetAction::AnswerRunning => {
                    self.net.insert(Msg::TargetSaid(TargetAnswer::Running));
                }
                TargetAction::Discard => {
                    self.target_qemu = false;
                    if e == TargetEvent::Run {
                        self.net.insert(Msg::TargetSaid(TargetAnswer::NeverRan));
                    }
                }
                TargetAction::AnswerNeverRan => {
                    self.net.insert(Msg::TargetSaid(TargetAnswer::NeverRan));
                }
                TargetAction::RefuseAbort | TargetAction::None => {}
                TargetAction::AskLater | TargetAction::AwaitGuest => {}
            }
        }

        /// Message `m` arrives (it leaves the network) and its receiver acts.
        fn deliver(&mut self, m: Msg) {
            self.net.remove(&m);
            match m {
                Msg::Run => self.target_on(TargetEvent::Run),
                Msg::Abort => self.target_on(TargetEvent::Abort),
                Msg::AskTarget => {
                    let a = target_answer(self.t);
                    self.net.insert(Msg::TargetSaid(a));
                }
                Msg::TargetSaid(a) => self.source_on(SourceEvent::Answer(a)),
                Msg::AskSource => {
                    self.net.insert(Msg::SourceSaid(self.s.into()));
                }
                // pre-copy: the source commits only after READY found the
                // skeleton loaded, so one told Committed holds the guest
                Msg::SourceSaid(a) => self.target_on(said(Some(a))),
            }
        }

        /// Every next world.
        fn next(&self) -> Vec<World> {
            let mut out = Vec::new();
            let mut push = |f: &dyn Fn(&mut World)| {
                let mut w = self.clone();
                f(&mut w);
                out.push(w);
            };
            // the source's own decisions; giving up is two steps: the guest
            // resumes, then `aborted` is recorded (and the target told)
            if self.s == SourcePhase::Copying && !self.rolling_back {
                push(&|w| w.source_on(SourceEvent::Ready));
                push(&|w| {
                    w.rolling_back = true;
                    w.source_runs = w.source_qemu;
                });
            }
            if self.s == SourcePhase::Copying && self.rolling_back {
                push(&|w| {
                    w.rolling_back = false;
                    w.source_on(SourceEvent::Failed);
                });
            }
            // timeouts: a lost RUN answer, the source asking, the target asking
            if self.s == SourcePhase::Committed {
                push(&|w| w.source_on(SourceEvent::NoAnswer));
                push(&|w| {
                    w.net.insert(Msg::AskTarget);
                });
            }
            if self.t == Some(TargetPhase::Waiting) {
                push(&|w| {
                    w.net.insert(Msg::AskSource);
                });
                push(&|w| w.target_on(said(None)));
            }
            // each message delivered, or lost
            for m in &self.net {
                let m = *m;
                push(&move |w| {
                    w.net.remove(&m);
                });
                push(&move |w| w.deliver(m));
            }
            // crashes: an agent restarts with its journal; a waiting skeleton's
            // QEMU dies (with its agent, or killed)
            if self.restarts < 2 {
                push(&|w| {
                    w.restarts += 1;
                    w.rolling_back = false;
                    w.source_on(SourceEvent::Restarted);
                });
                push(&|w| {
                    w.restarts += 1;
                    if w.t == Some(TargetPhase::Waiting) {
                        w.target_qemu = false;
                        w.target_on(TargetEvent::QemuGone);
                    }
                });
            }
            if self.kills < 1 && self.target_qemu && self.t == Some(TargetPhase::Waiting) {
                push(&|w| {
                    w.kills += 1;
                    w.target_qemu = false;
                    w.target_on(TargetEvent::QemuGone);
                });
            }
            out
        }

        fn settled(&self) -> bool {
            matches!(
                (self.s, self.t),
                (SourcePhase::Done, Some(TargetPhase::Running))
                    | (SourcePhase::Aborted, Some(TargetPhase::Discarded) | None)
            )
        }
    }

    /// Explores every reachable world: no two copies ever, and from every
    /// world, delivering messages (no more loss) settles it with the guest
    /// alive on exactly one host.
    #[test]
    fn no_interleaving_runs_two_copies_or_loses_the_guest() {
        let mut seen = HashSet::new();
        let mut queue = VecDeque::from([World::start()]);
        while let Some(w) = queue.pop_front() {
            if !seen.insert(w.clone()) {
                continue;
            }
            // safety: the source never runs once the target has run
            assert!(!(w.source_runs && w.target_ran), "two copies ran: {w:?}");
            // the target ran only after the source's commit record
            if w.target_ran {
                assert!(
                    matches!(w.s, SourcePhase::Committed | SourcePhase::Done),
                    "target ran without a commit: {w:?}"
                );
            }
            // liveness: with a working network and no more crashes, it settles
            let settled = settle(w.clone());
            assert!(settled.settled(), "never settles from {w:?}: {settled:?}");
            let alive = settled.source_runs || (settled.target_ran && settled.target_qemu);
            assert!(alive, "guest lost: {w:?} settles as {settled:?}");
            queue.extend(w.next());
        }
        assert!(seen.len() > 500, "explored only {} worlds", seen.len());
    }

    /// Runs a world to its end with every message delivered and each side
    /// asking the other when it waits.
    fn settle(mut w: World) -> World {
        for _ in 0..50 {
            if w.settled() && w.net.is_empty() {
                return w;
            }
            if let Some(m) = w.net.iter().next().copied() {
                w.deliver(m);
                continue;
            }
            match (w.s, w.t) {
                (SourcePhase::Copying, _) if w.rolling_back => {
                    w.rolling_back = false;
                    w.source_on(SourceEvent::Failed);
                }
                (SourcePhase::Copying, _) => w.source_on(SourceEvent::Ready),
                (SourcePhase::Committed, _) => {
                    w.net.insert(Msg::AskTarget);
                }
                (_, Some(TargetPhase::Waiting)) => {
                    w.net.insert(Msg::AskSource);
                }
                _ => {}
            }
        }
        w
    }

    // ---- after the commit: post-copy, restarts, unreadable and forgotten records ----

    /// The source QEMU's migration, as far as the rules need it.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    enum Mig {
        /// Pre-copy running, the source guest runs.
        Precopy,
        /// Post-copy: the target has the device state; `paused`: stream broke.
        Post { paused: bool },
        /// Pre-copy completed: the target has everything, source paused.
        Completed,
        /// Cancelled before any switch: the source copy is whole.
        Cancelled,
        /// The source QEMU was stopped.
        Quit,
    }

    /// One post-copy (or pre-copy) move, both agents, both QEMUs.
    #[derive(Debug, Clone, PartialEq, Eq, Hash)]
    struct After {
        s: SourcePhase,
        /// The source agent's live move drives it (false: the settler does).
        live: bool,
        mig: Mig,
        /// `migrate-start-postcopy` accepted, QEMU not yet switched.
        switch_asked: bool,
        /// None: the target forgot its record.
        t: Option<TargetPhase>,
        t_readable: bool,
        target_qemu: bool,
        source_runs: bool,
        target_ran: bool,
        /// Every page has reached the target.
        target_whole: bool,
        restarts: u8,
        breaks: u8,
    }

    impl After {
        fn start() -> After {
            After {
                s: SourcePhase::Copying,
                live: true,
                mig: Mig::Precopy,
                switch_asked: false,
                t: Some(TargetPhase::Waiting),
                t_readable: true,
                target_qemu: true,
                source_runs: true,
                target_ran: false,
                target_whole: false,
                restarts: 0,
                breaks: 0,
            }
        }

        /// What the target answers (None: no answer).
        fn answer(&self) -> Option<TargetAnswer> {
            if !self.t_readable {
                return None;
            }
            Some(match self.t {
                Some(TargetPhase::Waiting) if self.target_qemu => TargetAnswer::Waiting,
                Some(TargetPhase::Running) => TargetAnswer::Running,
                _ => TargetAnswer::NeverRan,
            })
        }

        fn source_qemu(&self) -> SourceQemu {
            match self.mig {
                Mig::Precopy => SourceQemu::Active,
                Mig::Post { paused } => SourceQemu::Postcopy { paused },
                Mig::Completed => SourceQemu::Completed,
                Mig::Cancelled => SourceQemu::NotSwitched,
                Mig::Quit => SourceQemu::Gone,
            }
        }

        /// The skeleton's QEMU holds the guest: post-copy switched, or
        /// pre-copy completed.
        fn has_state(&self) -> bool {
            matches!(self.mig, Mig::Post { .. } | Mig::Completed)
                || (self.mig == Mig::Quit && self.target_whole)
        }

        /// RUN reaches the target: it runs once it holds the device state.
        fn run(&mut self) {
            if self.t == Some(TargetPhase::Waiting) && self.target_qemu && self.has_state() {
                self.t = Some(TargetPhase::Running);
                self.target_ran = true;
            }
        }

        /// The waiting skeleton asks its source and acts on the answer, as
        /// the target's decision table says (rule 4).
        fn skeleton_asks(&mut self) {
            let e = TargetEvent::SourceSaid {
                said: Some(self.s.into()),
                holds_guest: self.has_state(),
            };
            let (p, a) = target_next(TargetPhase::Waiting, e);
            match a {
                TargetAction::RecordAndRun => {
                    self.t = Some(p);
                    self.target_ran = true;
                }
                TargetAction::Discard => {
                    self.t = Some(p);
                    self.target_qemu = false;
                }
                _ => {}
            }
        }

        fn resume_source(&mut self) {
            if self.mig != Mig::Quit {
                self.source_runs = true;
            }
        }

        /// One look by the settler (or a failed live move settling at once).
        fn settle_step(&mut self) {
            if self.s != SourcePhase::Committed {
                return;
            }
            match after_commit(self.answer(), self.source_qemu()) {
                AfterCommitAction::CancelAndLook => {
                    if self.switch_asked {
                        // the cancel may come after QEMU took the switch
                        self.mig = Mig::Post { paused: false };
                        self.source_runs = false;
                    } else {
                        self.mig = Mig::Cancelled;
                    }
                    self.switch_asked = false;
                }
                AfterCommitAction::Finish => {
                    self.mig = Mig::Quit;
                    self.source_runs = false;
                    self.s = SourcePhase::Done;
                }
                AfterCommitAction::SendRun => self.run(),
                AfterCommitAction::Recover => self.mig = Mig::Post { paused: false },
                AfterCommitAction::DiscardTarget => {
                    if self.t == Some(TargetPhase::Waiting) {
                        self.t = Some(TargetPhase::Discarded);
                        self.target_qemu = false;
                        self.s = SourcePhase::Aborted;
                        self.resume_source();
                    }
                }
                AfterCommitAction::AbortAndResume => {
                    self.s = SourcePhase::Aborted;
                    self.resume_source();
                }
                AfterCommitAction::AskLater => {}
            }
        }

        fn next(&self) -> Vec<After> {
            let mut out = Vec::new();
            let mut push = |f: &dyn Fn(&mut After)| {
                let mut w = self.clone();
                f(&mut w);
                out.push(w);
            };
            // the live move
            if self.live {
                match self.s {
                    SourcePhase::Copying if self.mig == Mig::Precopy => {
                        // pre-copy: QEMU completes, the target loaded it all,
                        // then the record (`ready` checked first)
                        push(&|w| {
                            w.mig = Mig::Completed;
                            w.source_runs = false;
                            w.target_whole = true;
                            w.s = SourcePhase::Committed;
                        });
                        // post-copy: the record before the switch
                        push(&|w| w.s = SourcePhase::Committed);
                        // a failure before the commit rolls back
                        push(&|w| {
                            w.mig = Mig::Cancelled;
                            w.s = SourcePhase::Aborted;
                            w.live = false;
                            if w.t == Some(TargetPhase::Waiting) {
                                w.t = Some(TargetPhase::Discarded);
                                w.target_qemu = false;
                            }
                        });
                    }
                    SourcePhase::Committed => {
                        if self.mig == Mig::Precopy && !self.switch_asked {
                            // QEMU takes the request, or refuses it (the move
                            // then fails and settles from the journal)
                            push(&|w| w.switch_asked = true);
                            push(&|w| {
                                w.live = false;
                                w.settle_step();
                            });
                        }
                        push(&|w| w.run());
                        // any failure from here is settled from the journal
                        push(&|w| {
                            w.live = false;
                            w.settle_step();
                        });
                        if self.mig == (Mig::Post { paused: true }) {
                            push(&|w| w.settle_step());
                        }
                        if self.mig == Mig::Completed && self.target_ran {
                            push(&|w| {
                                w.mig = Mig::Quit;
                                w.s = SourcePhase::Done;
                            });
                        }
                    }
                    _ => {}
                }
            } else {
                push(&|w| w.settle_step());
            }
            // QEMU on its own
            if self.switch_asked && self.mig == Mig::Precopy {
                push(&|w| {
                    w.mig = Mig::Post { paused: false };
                    w.switch_asked = false;
                    w.source_runs = false;
                });
            }
            if self.mig == (Mig::Post { paused: false }) {
                if self.breaks < 2 {
                    push(&|w| {
                        w.breaks += 1;
                        w.mig = Mig::Post { paused: true };
                    });
                }
                if self.target_ran {
                    push(&|w| {
                        w.mig = Mig::Completed;
                        w.target_whole = true;
                    });
                }
            }
            // faults: the source agent restarts (its live move is gone), the
            // target's record becomes unreadable and readable again, its
            // skeleton's QEMU dies before it ran
            if self.restarts < 2 {
                push(&|w| {
                    w.restarts += 1;
                    w.live = false;
                    if w.s == SourcePhase::Copying {
                        // restart before the commit: aborted, resumed
                        w.s = SourcePhase::Aborted;
                        if w.mig == Mig::Precopy {
                            w.mig = Mig::Cancelled;
                        }
                        w.resume_source();
                    }
                });
            }
            push(&|w| w.t_readable = !w.t_readable);
            // a skeleton waiting long asks its source, at any moment
            if self.t == Some(TargetPhase::Waiting) && self.target_qemu {
                push(&|w| w.skeleton_asks());
            }
            if self.t == Some(TargetPhase::Waiting) && self.target_qemu {
                push(&|w| {
                    w.target_qemu = false;
                    w.t = Some(TargetPhase::Discarded);
                });
            }
            // the target forgets a running record once its source lets it
            if self.t == Some(TargetPhase::Running)
                && target_may_forget(self.t_readable.then_some(self.s.into()))
            {
                push(&|w| w.t = None);
            }
            out
        }

        fn check(&self) {
            assert!(
                !(self.source_runs && self.target_ran),
                "two copies ran: {self:?}"
            );
            // the source QEMU holds pages the running target still needs
            if self.target_ran && !self.target_whole {
                assert!(self.mig != Mig::Quit, "a needed page destroyed: {self:?}");
            }
            if self.target_ran {
                assert!(
                    matches!(self.s, SourcePhase::Committed | SourcePhase::Done),
                    "target ran without a commit: {self:?}"
                );
            }
        }

        fn settled(&self) -> bool {
            match self.s {
                SourcePhase::Done => self.target_ran && self.target_whole,
                SourcePhase::Aborted => self.source_runs && !self.target_ran,
                _ => false,
            }
        }

        /// No more faults, records readable: the settler and QEMU go on.
        fn finish(mut self) -> After {
            self.t_readable = true;
            self.live = false;
            if self.s == SourcePhase::Copying {
                // a move not yet committed that stops here rolls back
                self.s = SourcePhase::Aborted;
                if self.mig == Mig::Precopy {
                    self.mig = Mig::Cancelled;
                }
                self.resume_source();
            }
            for _ in 0..20 {
                if self.settled() {
                    break;
                }
                if self.switch_asked && self.mig == Mig::Precopy {
                    self.mig = Mig::Post { paused: false };
                    self.switch_asked = false;
                    self.source_runs = false;
                }
                self.settle_step();
                if self.s == SourcePhase::Committed
                    && self.answer() == Some(TargetAnswer::NeverRan)
                    && matches!(self.mig, Mig::Post { .. })
                {
                    // the skeleton died after QEMU switched, before it ran:
                    // the settler waits for the operator, whose way out
                    // (`vm resolve --target-lost`) is sound because the
                    // target never ran
                    assert!(!self.target_ran, "{self:?}");
                    self.s = SourcePhase::Aborted;
                    self.mig = Mig::Cancelled;
                    self.resume_source();
                }
                if self.mig == (Mig::Post { paused: false }) && self.target_ran {
                    self.mig = Mig::Completed;
                    self.target_whole = true;
                }
                self.check();
            }
            self
        }
    }

    /// Every world after the commit — post-copy asked and refused, its
    /// stream broken and recovered, agents restarted at every step, the
    /// target's record unreadable, records forgotten — keeps one copy,
    /// never destroys a page the running copy needs, and settles with the
    /// guest whole on one host once the faults stop.
    #[test]
    fn after_the_commit_no_world_runs_two_copies_or_loses_a_page() {
        let mut seen = HashSet::new();
        let mut queue = VecDeque::from([After::start()]);
        let mut in_doubt_while_unreadable = 0;
        while let Some(w) = queue.pop_front() {
            if !seen.insert(w.clone()) {
                continue;
            }
            w.check();
            if !w.t_readable && w.s == SourcePhase::Committed && !w.live {
                // no answer: the source neither resumes nor finishes
                let mut x = w.clone();
                x.settle_step();
                if x.answer().is_none() {
                    assert_eq!(x.s, SourcePhase::Committed, "{w:?} → {x:?}");
                    in_doubt_while_unreadable += 1;
                }
            }
            let end = w.clone().finish();
            assert!(end.settled(), "never settles from {w:?}: {end:?}");
            queue.extend(w.next());
        }
        assert!(seen.len() > 200, "explored only {} worlds", seen.len());
        assert!(in_doubt_while_unreadable > 0);
    }

    #[test]
    fn after_commit_decisions() {
        use AfterCommitAction as A;
        use SourceQemu as Q;
        use TargetAnswer as T;
        // the source QEMU stops only once its migration completed
        assert_eq!(after_commit(Some(T::Running), Q::Completed), A::Finish);
        assert_eq!(
            after_commit(Some(T::Running), Q::Postcopy { paused: false }),
            A::AskLater
        );
        assert_eq!(
            after_commit(Some(T::Running), Q::Postcopy { paused: true }),
            A::Recover
        );
        // QEMU refused post-copy: the target is discarded, the source runs on
        assert_eq!(
            after_commit(Some(T::Waiting), Q::NotSwitched),
            A::DiscardTarget
        );
        assert_eq!(after_commit(Some(T::Waiting), Q::Active), A::CancelAndLook);
        // no answer is never "never ran"
        for q in [
            Q::Completed,
            Q::NotSwitched,
            Q::Gone,
            Q::Postcopy { paused: true },
        ] {
            assert_eq!(after_commit(None, q), A::AskLater, "{q:?}");
        }
        assert_eq!(
            after_commit(Some(T::NeverRan), Q::Postcopy { paused: true }),
            A::AskLater
        );
        assert!(target_may_forget(Some(SourceAnswer::Done)));
        assert!(!target_may_forget(Some(SourceAnswer::Committed)));
        assert!(!target_may_forget(None));
    }

    #[test]
    fn journal_round_trips_and_replaces_atomically() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let j = Journal::new(&dir);
        let mut r = Record {
            migration_id: "abc".into(),
            vm: "vm1".into(),
            peer: "host2".into(),
            peer_url: "http://h2".into(),
            side: Side::Source(SourcePhase::Copying),
            updated: 0,
            sealed: false,
        };
        j.write(&r).unwrap();
        r.side = Side::Source(SourcePhase::Committed);
        j.write(&r).unwrap();
        let back = j.read("abc", true).unwrap().unwrap();
        assert_eq!(back.side, Side::Source(SourcePhase::Committed));
        // update keeps the rest of the record; a missing one is an error naming it
        let done = j.update("abc", Side::Source(SourcePhase::Done)).unwrap();
        assert_eq!(
            (done.vm.as_str(), done.side),
            ("vm1", Side::Source(SourcePhase::Done))
        );
        let e = j
            .update("abc", Side::Target(TargetPhase::Running))
            .unwrap_err();
        assert!(e.to_string().contains("abc.target.json"), "{e}");
        assert_eq!(wire_name(SourcePhase::Committed), "committed");
        assert_eq!(
            from_wire_name::<SourceAnswer>("aborted"),
            Some(SourceAnswer::Aborted)
        );
        assert_eq!(from_wire_name::<SourceAnswer>("nonsense"), None);
        assert!(back.updated > 0);
        assert_eq!(j.read("abc", false).unwrap(), None);
        // a damaged file is reported, not skipped
        std::fs::write(dir.join("migrations/bad.source.json"), b"{").unwrap();
        let (all, errs) = j.all();
        assert_eq!(all.len(), 1);
        assert_eq!(errs.len(), 1);
        assert!(
            errs[0].to_string().contains("bad.source.json"),
            "{}",
            errs[0]
        );
    }
}
