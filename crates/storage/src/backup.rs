//! Backups and checkpoints of disks in use: point-in-time copies taken by
//! the storage node itself, while guests keep writing
//! ([`crate::tracking`] keeps each copy at its instant).
//!
//! - A **backup** goes to a path on the node: a sparse raw image of the
//!   disk's size holding the allocated extents (full) or the extents
//!   changed since the disk's last backup (incremental, from the dirty map
//!   [`BACKUP_MAP`]), and `PATH.json`, its [`BackupManifest`], written
//!   last: a file without its manifest is not a backup.
//! - A **checkpoint** is a full copy kept under the node's directory,
//!   `checkpoints/DISK/NAME.img` and `NAME.json`; reverting to it replaces
//!   the disk's contents, and is refused while anyone has the disk open.
//!
//! One copy job per disk at a time; the last job of each disk is kept for
//! `ferry disk backup` to follow.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_api::storage::{
    check_name, BackupManifest, BackupRequest, CheckpointInfo, CheckpointRequest, DiskInfo,
    JobInfo, JobKind, JobState,
};
use ferry_api::util::now_ms;
use ferry_api::ApiError;

use crate::export::Export;
use crate::jobs::{busy_error, Job};
use crate::node::Node;
use crate::tracking::{Started, Take};

/// The dirty map of changes since a disk's last backup.
pub const BACKUP_MAP: &str = "backup";
/// The copier's step: it takes the granule lock this long at most.
const STEP: u64 = 1 << 20;

fn manifest_path(p: &Path) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(".json");
    PathBuf::from(s)
}

/// The path a backup may be written to: absolute, in an existing
/// directory, neither it nor its manifest there yet.
fn backup_path(path: &str) -> Result<PathBuf, ApiError> {
    let p = PathBuf::from(path);
    let bad = |why: &str| ApiError::invalid("path", format!("{path}: {why}"));
    if !p.is_absolute() {
        return Err(bad("not an absolute path (a path on the storage node)"));
    }
    if p.file_name().is_none() {
        return Err(bad("names no file"));
    }
    match p.parent() {
        Some(d) if d.is_dir() => {}
        _ => return Err(bad("its directory does not exist on the storage node")),
    }
    if p.exists() || manifest_path(&p).exists() {
        return Err(bad("exists already (a backup never replaces a file)"));
    }
    Ok(p)
}

/// Allocated granules of the export's file (holes are not copied).
fn allocated(e: &Export) -> Result<crate::tracking::Bitmap, String> {
    let mut b = crate::tracking::Bitmap::default();
    for (off, len) in e.data_extents().map_err(|x| format!("{}: {x}", e.name))? {
        b.set_range(off, len);
    }
    Ok(b)
}

/// Writes `m` next to `path` (write, then rename).
fn write_manifest(path: &Path, m: &BackupManifest) -> std::io::Result<()> {
    let mp = manifest_path(path);
    let mut tmp = mp.as_os_str().to_owned();
    tmp.push(".tmp");
    let body = serde_json::to_vec_pretty(m).map_err(std::io::Error::other)?;
    std::fs::write(&tmp, body)?;
    std::fs::rename(&tmp, &mp)
}

/// Runs the background copy of `job` to its end; `finish` is told the outcome.
fn run_copy(
    export: Arc<Export>,
    job: Arc<Job>,
    max_rate: Option<u64>,
    out: Option<File>,
    finish: impl FnOnce(Result<(), String>) + Send + 'static,
) {
    let t0 = Instant::now();
    let mut done = 0u64;
    let rate = max_rate.filter(|r| *r > 0);
    // steps of about 1/20 s at the rate, so that the rate holds within a second
    let step = rate.map_or(STEP, |r| (r / 20).clamp(crate::tracking::GRANULE, STEP));
    let r = loop {
        match job.copy.copy_next(export.file(), step) {
            Ok(0) => break Ok(()),
            Ok(n) => {
                done += n;
                if let Some(rate) = rate {
                    let due = Duration::from_secs_f64(done as f64 / rate as f64);
                    if let Some(wait) = due.checked_sub(t0.elapsed()) {
                        std::thread::sleep(wait);
                    }
                }
            }
            Err(e) => break Err(e),
        }
    };
    export.tracking.finish_copy(&job.copy);
    let r = r.and_then(|()| match &out {
        Some(f) => f.sync_all().map_err(|e| format!("flushing the copy: {e}")),
        None => Ok(()),
    });
    finish(r);
}

impl Node {
    fn export_of(&self, disk: &str) -> Result<Arc<Export>, ApiError> {
        self.with_disk(disk, |e| e.clone())
    }

    /// Starts a point-in-time copy of `disk` into a new file at `path`.
    fn start_job(
        self: &Arc<Self>,
        disk: &str,
        kind: JobKind,
        target: String,
        path: PathBuf,
        max_rate: Option<u64>,
        done: impl FnOnce(&Arc<Node>, &Path, &BackupManifest) -> std::io::Result<()> + Send + 'static,
    ) -> Result<JobInfo, ApiError> {
        let export = self.export_of(disk)?;
        let mut jobs = ferry_api::util::lock(&self.jobs.jobs);
        if let Some(j) = jobs.get(disk).map(|j| j.info()) {
            if j.state == JobState::Running {
                return Err(busy_error(&j));
            }
        }
        let base = match kind {
            JobKind::IncrementalBackup => {
                let last = ferry_api::util::lock(&self.jobs.last_backup)
                    .get(disk)
                    .cloned();
                match (last, export.tracking.dirty_bytes(BACKUP_MAP)) {
                    (Some(l), Some(_)) => Some(l),
                    _ => {
                        return Err(ApiError::Conflict {
                            reason: format!(
                                "disk {disk} has no full backup that this node tracked changes since (none taken since the node started): take a full backup first"
                            ),
                        })
                    }
                }
            }
            _ => None,
        };
        let out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| ApiError::invalid("path", format!("{}: {e}", path.display())))?;
        let size = export.size();
        if let Err(e) = out.set_len(size) {
            let _ = std::fs::remove_file(&path);
            return Err(ApiError::internal(format!("{}: {e}", path.display())));
        }
        let sink = out.try_clone().map_err(ApiError::internal)?;
        let take_alloc = || allocated(&export);
        let (take, reset) = match kind {
            JobKind::Backup => (Take::Granules(&take_alloc), Some(BACKUP_MAP)),
            JobKind::IncrementalBackup => (Take::ChangedSince(BACKUP_MAP), Some(BACKUP_MAP)),
            JobKind::Checkpoint => (Take::Granules(&take_alloc), None),
        };
        let Started { copy, previous } =
            match export
                .tracking
                .start_copy(size, take, reset, Box::new(sink))
            {
                Ok(s) => s,
                Err(e) => {
                    let _ = std::fs::remove_file(&path);
                    return Err(ApiError::internal(e));
                }
            };
        let info = JobInfo {
            disk: disk.to_string(),
            node: self.cfg.name.clone(),
            kind,
            target,
            state: JobState::Running,
            instant_ms: now_ms(),
            finished_ms: None,
            size,
            bytes_total: copy.total,
            bytes_done: 0,
            bytes_preserved: 0,
            base: base.clone(),
            error: None,
        };
        let job = Arc::new(Job {
            info: Mutex::new(info),
            copy,
        });
        jobs.insert(disk.to_string(), job.clone());
        drop(jobs);
        tracing::info!(disk, ?kind, path = %path.display(), "copy started");

        let node = self.clone();
        let disk = disk.to_string();
        let (j2, e2) = (job.clone(), export.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("copy-{disk}"))
            .spawn(move || {
                run_copy(e2, j2.clone(), max_rate, Some(out), move |r| {
                    let manifest = {
                        let i = ferry_api::util::lock(&j2.info);
                        BackupManifest {
                            disk: disk.clone(),
                            node: node.cfg.name.clone(),
                            kind,
                            instant_ms: i.instant_ms,
                            size,
                            extents: j2.copy.extents.clone(),
                            base: i.base.clone(),
                        }
                    };
                    let r = r.and_then(|()| {
                        done(&node, &path, &manifest).map_err(|e| format!("manifest: {e}"))
                    });
                    let mut i = ferry_api::util::lock(&j2.info);
                    i.finished_ms = Some(now_ms());
                    match r {
                        Ok(()) => {
                            i.state = JobState::Done;
                            if kind != JobKind::Checkpoint {
                                ferry_api::util::lock(&node.jobs.last_backup)
                                    .insert(disk.clone(), path.display().to_string());
                            }
                            tracing::info!(disk, path = %path.display(), "copy done");
                        }
                        Err(e) => {
                            tracing::warn!(disk, path = %path.display(), "copy failed: {e}");
                            i.state = JobState::Failed;
                            i.error = Some(e);
                            let _ = std::fs::remove_file(&path);
                            if kind != JobKind::Checkpoint {
                                export.tracking.restore_dirty(BACKUP_MAP, previous);
                            }
                        }
                    }
                })
            });
        if let Err(e) = spawned {
            return Err(ApiError::internal(format!("starting the copy: {e}")));
        }
        Ok(job.info())
    }

    /// `ferry disk backup`: starts it and answers at once (follow it with [`Node::job`]).
    pub fn backup(self: &Arc<Self>, disk: &str, req: &BackupRequest) -> Result<JobInfo, ApiError> {
        self.export_of(disk)?;
        let path = backup_path(&req.path)?;
        let kind = if req.incremental {
            JobKind::IncrementalBackup
        } else {
            JobKind::Backup
        };
        self.start_job(
            disk,
            kind,
            path.display().to_string(),
            path,
            req.max_rate,
            |_, p, m| write_manifest(p, m),
        )
    }

    /// The last copy job of `disk`.
    pub fn job(&self, disk: &str) -> Result<JobInfo, ApiError> {
        self.export_of(disk)?;
        ferry_api::util::lock(&self.jobs.jobs)
            .get(disk)
            .map(|j| j.info())
            .ok_or_else(|| ApiError::not_found("copy job of disk", disk))
    }

    fn checkpoint_dir(&self, disk: &str) -> PathBuf {
        self.cfg.dir.join("checkpoints").join(disk)
    }

    pub fn create_checkpoint(
        self: &Arc<Self>,
        disk: &str,
        req: &CheckpointRequest,
    ) -> Result<JobInfo, ApiError> {
        check_name("checkpoint", &req.name)?;
        self.export_of(disk)?;
        let dir = self.checkpoint_dir(disk);
        std::fs::create_dir_all(&dir)
            .map_err(|e| ApiError::internal(format!("{}: {e}", dir.display())))?;
        let path = dir.join(format!("{}.img", req.name));
        if path.exists() || manifest_path(&path).exists() {
            return Err(ApiError::AlreadyExists {
                kind: format!("checkpoint of disk {disk}"),
                name: req.name.clone(),
            });
        }
        self.start_job(
            disk,
            JobKind::Checkpoint,
            req.name.clone(),
            path,
            req.max_rate,
            |_, p, m| write_manifest(p, m),
        )
    }

    pub fn list_checkpoints(&self, disk: &str) -> Result<Vec<CheckpointInfo>, ApiError> {
        self.export_of(disk)?;
        let running = self
            .jobs
            .running(disk)
            .filter(|j| j.kind == JobKind::Checkpoint);
        let mut out = Vec::new();
        let Ok(rd) = std::fs::read_dir(self.checkpoint_dir(disk)) else {
            return Ok(out);
        };
        for ent in rd.flatten() {
            let p = ent.path();
            let Some(name) = p
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".img"))
            else {
                continue;
            };
            match read_manifest(&p) {
                Ok(m) => out.push(ready_checkpoint(name, &m)),
                Err(_) => {
                    if let Some(j) = running.as_ref().filter(|j| j.target == name) {
                        out.push(CheckpointInfo {
                            disk: disk.to_string(),
                            name: name.to_string(),
                            instant_ms: j.instant_ms,
                            size: j.size,
                            bytes: j.bytes_total,
                            ready: false,
                        });
                    }
                }
            }
        }
        out.sort_by_key(|c| (c.instant_ms, c.name.clone()));
        Ok(out)
    }

    fn checkpoint(&self, disk: &str, name: &str) -> Result<(PathBuf, BackupManifest), ApiError> {
        check_name("checkpoint", name)?;
        self.export_of(disk)?;
        let p = self.checkpoint_dir(disk).join(format!("{name}.img"));
        if let Some(j) = self.jobs.running(disk).filter(|j| j.target == name) {
            return Err(ApiError::Conflict {
                reason: format!(
                    "checkpoint {name} of disk {disk} is still being taken ({} of {} bytes)",
                    j.bytes_done, j.bytes_total
                ),
            });
        }
        let m = read_manifest(&p)
            .map_err(|_| ApiError::not_found(&format!("checkpoint of disk {disk}"), name))?;
        Ok((p, m))
    }

    pub fn remove_checkpoint(&self, disk: &str, name: &str) -> Result<CheckpointInfo, ApiError> {
        let (p, m) = self.checkpoint(disk, name)?;
        let gone = |e: std::io::Error| ApiError::internal(format!("{}: {e}", p.display()));
        std::fs::remove_file(manifest_path(&p)).map_err(gone)?;
        std::fs::remove_file(&p).map_err(gone)?;
        Ok(ready_checkpoint(name, &m))
    }

    /// Replaces the disk's contents (and size) with the checkpoint's.
    /// Refused while any connection has the disk open, naming whose.
    pub fn revert_checkpoint(&self, disk: &str, name: &str) -> Result<DiskInfo, ApiError> {
        let (p, m) = self.checkpoint(disk, name)?;
        self.jobs.busy(disk)?;
        let open: Vec<String> = self
            .list_flows()
            .into_iter()
            .filter(|f| f.disk == disk && f.connections > 0)
            .map(|f| format!("{} ({} connections)", f.initiator, f.connections))
            .collect();
        if !open.is_empty() {
            return Err(ApiError::Conflict {
                reason: format!(
                    "disk {disk} is open by {}: reverting it would change the disk under them (detach it first)",
                    open.join(", ")
                ),
            });
        }
        let export = self.export_of(disk)?;
        let src =
            File::open(&p).map_err(|e| ApiError::internal(format!("{}: {e}", p.display())))?;
        {
            let _frozen = export.tracking.freeze();
            export
                .replace_with(&src, m.size, &m.extents)
                .map_err(|e| ApiError::internal(format!("reverting {disk} to {name}: {e}")))?;
        }
        export.tracking.all_changed(m.size);
        tracing::info!(disk, checkpoint = name, "disk reverted");
        self.persist_and_describe(disk)
    }
}

/// A checkpoint whose manifest is written.
fn ready_checkpoint(name: &str, m: &BackupManifest) -> CheckpointInfo {
    CheckpointInfo {
        disk: m.disk.clone(),
        name: name.to_string(),
        instant_ms: m.instant_ms,
        size: m.size,
        bytes: m.extents.iter().map(|e| e.1).sum(),
        ready: true,
    }
}

fn read_manifest(p: &Path) -> std::io::Result<BackupManifest> {
    let b = std::fs::read(manifest_path(p))?;
    serde_json::from_slice(&b).map_err(std::io::Error::other)
}
