//! Storage: disks (NBD exports), storage QoS policies and flows.
//!
//! A *disk* is a raw file on a storage node, served over NBD. A *flow* is one
//! initiator's use of one disk: one per VM per disk (or per client address
//! for clients outside Ferry). A *policy* bounds flows in normalized IOPS (an
//! I/O of up to `normalization` bytes counts as one, a larger one as
//! `ceil(len / normalization)`) and bytes per second; whichever limit is
//! reached first limits the flow.

use serde::{Deserialize, Serialize};

use crate::ApiError;

/// Default IOPS normalization size: 8 KiB.
pub const DEFAULT_NORMALIZATION: u64 = 8 << 10;
/// Largest disk a storage node creates: 16 TiB.
pub const MAX_DISK_SIZE: u64 = 16 << 40;

/// Disks, policies and initiators are named like VMs (they appear in paths
/// and NBD export names): 1–32 of `a-z 0-9 -`.
pub use crate::types::validate_name as check_name;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskCreateRequest {
    pub name: String,
    pub size: u64,
    /// Every write is durable before it is acknowledged (O_DSYNC).
    #[serde(default)]
    pub write_through: bool,
    /// Storage node to create it on (default: the first).
    #[serde(default)]
    pub node: Option<String>,
}

/// `ferry disk attach DISK VM`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskAttachRequest {
    pub vm: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskResizeRequest {
    pub size: u64,
}

/// `policy: None` clears the disk's policy (its flows run unlimited).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskSetRequest {
    pub policy: Option<String>,
}

/// `ferry disk backup DISK --to PATH`: a crash-consistent copy of the disk
/// as it was when the request arrived, written by its storage node to
/// `path` (on the node; absolute, not existing yet) as a sparse raw image,
/// with a manifest `PATH.json` written last.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackupRequest {
    pub path: String,
    /// Only what changed since the disk's last backup (the file holds those
    /// extents, holes elsewhere; its manifest lists them and the base).
    #[serde(default)]
    pub incremental: bool,
    /// Bytes per second the background copy may read (default: unlimited);
    /// writes racing the copy are preserved at once whatever the rate.
    #[serde(default)]
    pub max_rate: Option<u64>,
}

/// `ferry disk checkpoint create DISK NAME`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointRequest {
    pub name: String,
    #[serde(default)]
    pub max_rate: Option<u64>,
}

/// What a point-in-time copy job is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobKind {
    Backup,
    IncrementalBackup,
    Checkpoint,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Running,
    Done,
    Failed,
}

/// A disk's copy job (the last one of each disk is kept until the next).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobInfo {
    pub disk: String,
    pub node: String,
    pub kind: JobKind,
    /// The backup's path, or the checkpoint's name.
    pub target: String,
    pub state: JobState,
    /// The instant the copy is of (ms since the epoch).
    pub instant_ms: u64,
    pub finished_ms: Option<u64>,
    /// The disk's size at the instant.
    pub size: u64,
    /// Bytes to copy (allocated, or changed since the base) and copied so far.
    pub bytes_total: u64,
    pub bytes_done: u64,
    /// Of those, bytes copied ahead of a guest's write to them.
    pub bytes_preserved: u64,
    /// An incremental backup's base: the previous backup's path.
    pub base: Option<String>,
    pub error: Option<String>,
}

/// The manifest next to a backup (`PATH.json`) or checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackupManifest {
    pub disk: String,
    pub node: String,
    pub kind: JobKind,
    pub instant_ms: u64,
    pub size: u64,
    /// Byte extents the file holds; elsewhere it is a hole: zero for a full
    /// backup, unchanged since `base` for an incremental one.
    pub extents: Vec<(u64, u64)>,
    pub base: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointInfo {
    pub disk: String,
    pub name: String,
    pub instant_ms: u64,
    pub size: u64,
    /// Bytes the checkpoint holds (allocated extents of the disk).
    pub bytes: u64,
    /// False while it is being taken.
    pub ready: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskInfo {
    pub name: String,
    pub node: String,
    pub size: u64,
    pub write_through: bool,
    pub policy: Option<String>,
    /// NBD URI of the export, e.g. `nbd://198.18.0.1:10809/data1`.
    pub uri: String,
    /// Open NBD connections.
    pub connections: u32,
    /// What this copy of the disk is on its node (`primary` is the disk).
    #[serde(default)]
    pub role: DiskRole,
}

/// What a node's copy of a disk is. Only a `primary` is served to guests;
/// the others are written by another node ([`PushInfo`]) or kept aside.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum DiskRole {
    /// The disk itself.
    #[default]
    Primary,
    /// Being copied here by node `from` for `ferry disk move`.
    Incoming { from: String },
    /// An asynchronous replica of the disk on node `of`.
    Replica { of: String },
    /// The disk moved to (or failed over to) node `to`: this copy is no
    /// longer served and waits to be removed.
    Retired { to: String },
}

impl DiskRole {
    pub fn is_primary(&self) -> bool {
        matches!(self, DiskRole::Primary)
    }
}

/// `POST /disks/{d}/incoming` on a storage node: an empty copy of a disk of
/// node `from` that `from` will write (a move's target or a replica).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IncomingDiskRequest {
    pub from: String,
    pub size: u64,
    #[serde(default)]
    pub write_through: bool,
    /// The disk's policy, applied when this copy becomes the disk.
    #[serde(default)]
    pub policy: Option<String>,
    /// A replica (kept) rather than a move's target.
    #[serde(default)]
    pub replica: bool,
}

/// `POST /disks/{d}/activate`: this copy becomes the disk.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActivateRequest {
    /// The copy is a replica taking over from a primary that is gone
    /// (refused for a replica otherwise, and for a move's copy with it).
    #[serde(default)]
    pub failover: bool,
}

/// What a push to another node is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PushKind {
    /// `ferry disk move`: copy until in step, then a final copy with writes held.
    Move,
    /// `ferry disk replicate`: the changes, every `every_ms`.
    Replica,
}

/// `POST /disks/{d}/push` on the disk's node: copy it to node `to`, whose
/// export `uri` (an `incoming` copy made for it) is written over NBD.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PushRequest {
    pub to: String,
    pub uri: String,
    pub kind: PushKind,
    /// Replica: the period of its rounds (ms).
    #[serde(default)]
    pub every_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PushState {
    /// The first full copy, or a round of changes, under way.
    Copying,
    /// A move whose remaining changes are small: ready to finish.
    InStep,
    /// A replica between rounds.
    Idle,
    /// A move finished: the target holds the disk as of its final copy.
    Done,
    Failed,
    Cancelled,
}

/// A push as its source node sees it (`GET /disks/{d}/push`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PushInfo {
    pub disk: String,
    pub node: String,
    pub to: String,
    pub kind: PushKind,
    pub state: PushState,
    /// Rounds completed (the first is the full copy).
    pub rounds: u64,
    /// Bytes sent in all rounds.
    pub bytes_sent: u64,
    /// Bytes the current (or last) round carries, and has carried.
    pub round_total: u64,
    pub round_done: u64,
    /// Bytes changed since the last round started and not yet sent.
    pub dirty_bytes: u64,
    /// Bytes per second over the last round.
    pub rate: f64,
    /// The target holds every write acknowledged before this instant (ms
    /// since the epoch): the start of the last complete round.
    pub synced_ms: Option<u64>,
    /// Now − `synced_ms` (ms), when there is one.
    pub lag_ms: Option<u64>,
    pub every_ms: Option<u64>,
    /// The final copy's length (writes held), for a finished move.
    pub final_ms: Option<u64>,
    pub error: Option<String>,
}

/// `ferry disk move DISK --to NODE`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskMoveRequest {
    pub to: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DiskMovePhase {
    /// Copying while guests write (rounds of changes).
    Copy,
    /// Guests held, the last changes copied, connections switched.
    Switch,
    Done,
    /// Failed before its commit: the disk stays on the old node.
    Failed,
}

/// A disk move as the control service runs it (`GET /disks/{d}/move`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DiskMoveInfo {
    pub disk: String,
    pub from: String,
    pub to: String,
    pub phase: DiskMovePhase,
    pub started_ms: u64,
    pub finished_ms: Option<u64>,
    pub size: u64,
    /// The source node's push (bytes, rounds, rate).
    pub push: Option<PushInfo>,
    /// VMs with the disk open ("VM on HOST"), switched at the end.
    pub vms: Vec<String>,
    /// How long the guests were held for the final copy and switch (ms).
    pub guest_pause_ms: Option<u64>,
    pub error: Option<String>,
}

/// `ferry disk replicate DISK --to NODE --every 30s`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaRequest {
    pub to: String,
    pub every_ms: u64,
}

/// `POST /vms/{vm}/disks/{d}/switch` on an agent: the disk is now served
/// at `uri` (a new connection swapped in, the VM's spec updated); a VM the
/// agent held for it runs again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskSwitchRequest {
    /// `None`: keep the connection (a move that failed), only release.
    #[serde(default)]
    pub uri: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Every flow gets the minimum and maximum on its own.
    Dedicated,
    /// All the policy's flows share one minimum and one maximum.
    Aggregated,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    pub name: String,
    pub kind: PolicyKind,
    /// Reserved normalized IOPS (0: none).
    #[serde(default)]
    pub min_iops: u64,
    /// Normalized IOPS cap (0: none).
    #[serde(default)]
    pub max_iops: u64,
    /// Bytes per second cap (0: none).
    #[serde(default)]
    pub max_bandwidth: u64,
}

impl Policy {
    pub fn validate(&self) -> Result<(), ApiError> {
        check_name("name", &self.name)?;
        if self.max_iops != 0 && self.min_iops > self.max_iops {
            return Err(ApiError::invalid(
                "min_iops",
                format!(
                    "minimum {} is above maximum {} IOPS",
                    self.min_iops, self.max_iops
                ),
            ));
        }
        const MAX: u64 = 10_000_000;
        for (f, v) in [("min_iops", self.min_iops), ("max_iops", self.max_iops)] {
            if v > MAX {
                return Err(ApiError::invalid(f, format!("{v} is above {MAX} IOPS")));
            }
        }
        if self.max_bandwidth != 0 && self.max_bandwidth < 4096 {
            return Err(ApiError::invalid(
                "max_bandwidth",
                format!(
                    "{} B/s is below one 4 KiB I/O per second",
                    self.max_bandwidth
                ),
            ));
        }
        Ok(())
    }
}

/// `ferry qos policy set`: fields left out keep their value.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyUpdate {
    #[serde(default)]
    pub min_iops: Option<u64>,
    #[serde(default)]
    pub max_iops: Option<u64>,
    #[serde(default)]
    pub max_bandwidth: Option<u64>,
}

impl PolicyUpdate {
    pub fn apply(&self, p: &Policy) -> Policy {
        Policy {
            name: p.name.clone(),
            kind: p.kind,
            min_iops: self.min_iops.unwrap_or(p.min_iops),
            max_iops: self.max_iops.unwrap_or(p.max_iops),
            max_bandwidth: self.max_bandwidth.unwrap_or(p.max_bandwidth),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QosSettings {
    /// IOPS normalization size in bytes (power of two, 512 B – 1 MiB).
    pub normalization: u64,
}

impl QosSettings {
    pub fn validate(&self) -> Result<(), ApiError> {
        let n = self.normalization;
        if !(512..=1 << 20).contains(&n) || !n.is_power_of_two() {
            return Err(ApiError::invalid(
                "normalization",
                format!("{n} is not a power of two between 512 and 1048576"),
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FlowStatus {
    Ok,
    /// Has a minimum, asks for at least that, and does not get it.
    InsufficientThroughput,
    /// Its disk names a policy that no longer exists: the flow runs unlimited.
    UnknownPolicyId,
    /// The initiator's connection is gone (kept for a while to be seen).
    LostCommunication,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlowInfo {
    /// `DISK/INITIATOR`.
    pub id: String,
    pub disk: String,
    pub node: String,
    /// VM name when the client named one (export `DISK/VM`), else its address.
    pub initiator: String,
    /// Host the initiator runs on, when known, else its address.
    pub host: String,
    pub policy: Option<String>,
    pub connections: u32,
    /// Normalized IOPS over the last second.
    pub iops: f64,
    /// Bytes per second over the last second.
    pub bandwidth: f64,
    /// Mean service latency (queue + I/O) over the last second, µs.
    pub latency_us: f64,
    /// Normalized IOPS the flow asked for over the last second (served or queued).
    pub demand_iops: f64,
    /// Share of the last second the flow had requests waiting in the scheduler.
    pub backlogged: f64,
    pub min_iops: u64,
    pub max_iops: u64,
    pub max_bandwidth: u64,
    pub status: FlowStatus,
}

/// A storage node as the control service sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StorageNodeEntry {
    pub name: String,
    pub url: String,
    /// It answered this round of heartbeats.
    pub reachable: bool,
    pub error: Option<String>,
    /// Disks it serves (when reachable).
    pub disks: u32,
}

/// A per-flow allocation set from outside (the cluster-wide policy manager):
/// it overrides what the node derives from the disk's policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Allocation {
    #[serde(default)]
    pub min_iops: u64,
    #[serde(default)]
    pub max_iops: u64,
    #[serde(default)]
    pub max_bandwidth: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_are_checked() {
        let p = Policy {
            name: "gold".into(),
            kind: PolicyKind::Dedicated,
            min_iops: 250,
            max_iops: 500,
            max_bandwidth: 100 << 20,
        };
        assert!(p.validate().is_ok());
        let bad = Policy {
            min_iops: 600,
            ..p.clone()
        };
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("min_iops") && e.contains("600"), "{e}");
        assert!(Policy {
            max_bandwidth: 10,
            ..p.clone()
        }
        .validate()
        .is_err());
        let upd = PolicyUpdate {
            max_iops: Some(800),
            ..Default::default()
        };
        assert_eq!(upd.apply(&p).max_iops, 800);
        assert_eq!(upd.apply(&p).min_iops, 250);
    }

    #[test]
    fn normalization_must_be_a_power_of_two() {
        assert!(QosSettings {
            normalization: 8192
        }
        .validate()
        .is_ok());
        assert!(QosSettings {
            normalization: 3000
        }
        .validate()
        .is_err());
        assert!(QosSettings { normalization: 256 }.validate().is_err());
    }

    #[test]
    fn unknown_fields_are_refused() {
        let e = serde_json::from_str::<Policy>(r#"{"name":"a","kind":"dedicated","min_iop":5}"#)
            .unwrap_err();
        assert!(e.to_string().contains("min_iop"));
    }
}

/// `PUT /access/{vm}` on a storage node: the hosts whose certificates may
/// open the VM's exports `DISK/VM`, for these disks only; no hosts forgets
/// the VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessRequest {
    pub hosts: Vec<String>,
    /// The Ferry disks the VM uses; an export of any other is refused.
    #[serde(default)]
    pub disks: Vec<String>,
}

/// A VM's NBD access on a storage node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccessInfo {
    pub vm: String,
    pub hosts: Vec<String>,
    #[serde(default)]
    pub disks: Vec<String>,
    /// Raised each time a host loses the VM: connections opened under an
    /// earlier generation by a host no longer listed are refused (fenced).
    #[serde(default)]
    pub generation: u64,
}
