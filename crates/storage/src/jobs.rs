//! The tables of a node's copy jobs, which the node holds and its copy
//! work fills: backup and checkpoint jobs ([`crate::backup`]) and pushes to
//! other nodes ([`crate::remote`]), and how a replica is recorded with its
//! disk. Below the node: it knows nothing of it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use ferry_api::storage::{JobInfo, JobKind, JobState, PushInfo, PushKind, PushState};
use ferry_api::util::{lock, now_ms};
use ferry_api::ApiError;
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, watch};

use crate::tracking::PointInTime;

pub(crate) struct Job {
    pub(crate) info: Mutex<JobInfo>,
    pub(crate) copy: Arc<PointInTime>,
}

impl Job {
    pub(crate) fn info(&self) -> JobInfo {
        let mut i = ferry_api::util::lock(&self.info).clone();
        let s = self.copy.status();
        i.bytes_done = s.copied;
        i.bytes_preserved = s.preserved;
        i
    }
}

/// The node's copy jobs, and each disk's last backup.
#[derive(Default)]
pub struct Jobs {
    pub(crate) jobs: Mutex<BTreeMap<String, Arc<Job>>>,
    /// Disk → path of its last backup (the base of the next incremental).
    pub(crate) last_backup: Mutex<BTreeMap<String, String>>,
}

impl Jobs {
    /// The job running on `disk`, if any.
    pub fn running(&self, disk: &str) -> Option<JobInfo> {
        let jobs = ferry_api::util::lock(&self.jobs);
        let j = jobs.get(disk)?;
        let i = j.info();
        (i.state == JobState::Running).then_some(i)
    }

    /// Refuses while a job runs on `disk`, naming it.
    pub fn busy(&self, disk: &str) -> Result<(), ApiError> {
        match self.running(disk) {
            Some(j) => Err(busy_error(&j)),
            None => Ok(()),
        }
    }
}

pub(crate) fn busy_error(j: &JobInfo) -> ApiError {
    ApiError::Conflict {
        reason: format!(
            "disk {} is busy: {} to {} is at {} of {} bytes",
            j.disk,
            kind_name(j.kind),
            j.target,
            j.bytes_done,
            j.bytes_total
        ),
    }
}

pub(crate) fn kind_name(k: JobKind) -> &'static str {
    match k {
        JobKind::Backup => "a backup",
        JobKind::IncrementalBackup => "an incremental backup",
        JobKind::Checkpoint => "a checkpoint",
    }
}

/// A replica as recorded with its disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaRecord {
    pub to: String,
    pub uri: String,
    pub every_ms: u64,
}

/// What the push task is told from outside.
pub(crate) enum Order {
    Run,
    Cancel,
}

/// Where a move's final round answers.
pub(crate) type FinalReply = oneshot::Sender<Result<PushInfo, String>>;

pub(crate) struct Push {
    pub(crate) info: Mutex<PushInfo>,
    pub(crate) order: watch::Sender<Order>,
    /// A move waiting in step: asks for its final round.
    pub(crate) finish: Mutex<Option<oneshot::Sender<FinalReply>>>,
}

impl Push {
    pub(crate) fn info(&self) -> PushInfo {
        let mut i = lock(&self.info).clone();
        i.lag_ms = i.synced_ms.map(|s| now_ms().saturating_sub(s));
        i
    }

    pub(crate) fn update(&self, f: impl FnOnce(&mut PushInfo)) {
        f(&mut lock(&self.info));
    }
}

/// The node's pushes, by disk.
#[derive(Default)]
pub struct Pushes {
    pub(crate) map: Mutex<BTreeMap<String, Arc<Push>>>,
}

pub(crate) fn map_name(to: &str) -> String {
    format!("push:{to}")
}

pub(crate) fn ended(s: PushState) -> bool {
    matches!(
        s,
        PushState::Done | PushState::Cancelled | PushState::Failed
    )
}

/// Whether a push still copies: running, or a replica between failed
/// rounds (it tries again).
pub(crate) fn copying(i: &PushInfo) -> bool {
    !ended(i.state) || (i.kind == PushKind::Replica && i.state == PushState::Failed)
}
