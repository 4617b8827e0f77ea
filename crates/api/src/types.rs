//! The nouns of the command API: hosts, NICs, VMs, checks, migrations.
//!
//! Requests carry `#[serde(deny_unknown_fields)]` so a misspelled field is a
//! clear error, not a silently ignored one. Sizes are bytes; front ends parse
//! human sizes with [`crate::size::parse_size`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ApiError;

/// One NIC of a host as its agent sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicInfo {
    /// Interface name inside the host (`ens1f0`, `eth4` …).
    pub name: String,
    /// The fabric it is wired to: NICs of two hosts on the same fabric
    /// reach each other directly. A number, the same on every host.
    pub fabric: u32,
    /// Its IPv4 network, `10.10.0.0/24`.
    #[serde(default)]
    pub network: String,
    pub address: String,
    pub mtu: u32,
    /// Carrier up (the link is not cut).
    pub up: bool,
    pub tx_bytes: u64,
    pub rx_bytes: u64,
}

/// One NIC pair between two hosts, as a probe found it: a connection
/// bound to this host's `nic` reached `peer`'s `peer_nic` (or did not).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicPath {
    pub nic: String,
    pub address: String,
    pub peer: String,
    pub peer_nic: String,
    pub peer_address: String,
    pub reachable: bool,
    /// Connect-and-answer time, microseconds (reachable pairs).
    #[serde(default)]
    pub rtt_us: Option<u64>,
    /// Why the pair does not work (unreachable pairs).
    #[serde(default)]
    pub error: Option<String>,
    /// Milliseconds since it was probed.
    #[serde(default)]
    pub age_ms: u64,
}

/// A peer an agent probes: its name and its agent's URL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerRef {
    pub name: String,
    pub url: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostInfo {
    pub name: String,
    pub agent_url: String,
    pub memory_total: u64,
    pub memory_reserved: u64,
    pub memory_free: u64,
    /// CPUs the host has (0 from an agent that does not say).
    #[serde(default)]
    pub cpus: u32,
    pub nics: Vec<NicInfo>,
    /// The rate each NIC is rated at, bit/s (the agent's `nic_rate`), when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nic_rate: Option<u64>,
    pub vms: Vec<VmInfo>,
    /// The bandwidth policy this host enforces.
    #[serde(default)]
    pub bandwidth: crate::bandwidth::BandwidthPolicy,
    /// The port this host's agent answers NIC probes on (every address).
    #[serde(default = "default_probe_port")]
    pub probe_port: u16,
    /// NIC pairs to other hosts, as last probed.
    #[serde(default)]
    pub paths: Vec<NicPath>,
    /// What this agent takes in a migration's request beyond the first
    /// version of it ([`FEATURE_QEMU_ZSTD`], [`FEATURE_STREAM_WINDOWS`],
    /// [`FEATURE_QEMU_CHANNELS`], [`FEATURE_SWITCHOVER_HOLD`]): a
    /// source asks only for what its target lists, so an agent not yet
    /// upgraded still takes moves.
    #[serde(default)]
    pub features: Vec<String>,
    /// What this host grants guests (`agent.toml`'s lists), for the control
    /// service to check a spec before it asks; absent from an agent that
    /// predates it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grants: Option<crate::grants::HostGrants>,
    /// When the agent's certificate expires (Unix ms); absent without TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate_expires_ms: Option<u64>,
    /// The agent's certificate's serial number (hex) and the revocation
    /// list it enforces; absent without TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate_serial: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crl_number: Option<u64>,
    /// Its side of the HA lease (see [`crate::ha`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<crate::ha::LeaseState>,
}

/// A certificate within this many days of its end is warned of (an event
/// `certificate_expiring`, once a day per holder).
pub const CERT_WARN_DAYS: u64 = 30;

/// The target sets `multifd-compression zstd` when asked (`IncomingRequest::qemu_zstd`).
pub const FEATURE_QEMU_ZSTD: &str = "qemu-zstd";
/// The target's carriers send WINDOW frames when asked (`IncomingRequest::stream_windows`).
pub const FEATURE_STREAM_WINDOWS: &str = "stream-windows";
/// The target's QEMU takes QEMU's own multifd channels when asked (`IncomingRequest::qemu_channels`).
pub const FEATURE_QEMU_CHANNELS: &str = "qemu-channels";
/// The target's QEMU acknowledges the switch-over on its return path when
/// asked (`IncomingRequest::switchover_ack`).
pub const FEATURE_SWITCHOVER_HOLD: &str = "switchover-hold";

pub const DEFAULT_PROBE_PORT: u16 = 7801;

fn default_probe_port() -> u16 {
    DEFAULT_PROBE_PORT
}

/// One entry of the control service's event log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub id: u64,
    /// Unix time, milliseconds.
    pub at_ms: u64,
    /// `migration`, `drain`, `resume`, `settings`, `host_down`, `host_up`, `storage`.
    pub kind: String,
    /// The VM, host, disk or policy it is about.
    pub subject: String,
    pub detail: serde_json::Value,
}

/// A host whose agent has not answered for this long is down.
pub const HOST_DEAD_AFTER_MS: u64 = 3000;

/// A host as the control service knows it: registered, and reachable or not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostEntry {
    pub name: String,
    pub agent_url: String,
    pub reachable: bool,
    /// No heartbeat for [`HOST_DEAD_AFTER_MS`]: nothing is scheduled onto it.
    #[serde(default)]
    pub down: bool,
    /// Milliseconds since the agent last answered (None: never).
    #[serde(default)]
    pub last_heartbeat_ms: Option<u64>,
    /// Drained (or draining) and not resumed: takes no VMs.
    #[serde(default)]
    pub draining: bool,
    /// Settings set with `ferry host set`, if any.
    #[serde(default)]
    pub settings: Option<crate::drain::HostSettings>,
    pub error: Option<String>,
    pub info: Option<HostInfo>,
    /// How the HA manager sees it (see [`crate::ha`]).
    #[serde(default)]
    pub health: crate::ha::Health,
}

/// What a VM is: everything needed to start it, or its skeleton on a target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmSpec {
    pub name: String,
    /// Guest RAM in bytes.
    pub memory: u64,
    /// Bytes the guest workload fills with its verifiable pattern.
    pub fill: u64,
    /// Bytes per second the workload rewrites.
    pub dirty_rate: u64,
    /// Bytes per second the workload re-verifies.
    #[serde(default = "default_verify_rate")]
    pub verify_rate: u64,
    #[serde(default = "default_seed")]
    pub seed: u64,
    #[serde(default = "default_vcpus")]
    pub vcpus: u32,
    /// Disks served over NBD, in the order they are plugged (at most
    /// [`MAX_VM_DISKS`]).
    #[serde(default)]
    pub disks: Vec<DiskPlug>,
    /// The workload fills memory with a pattern that compresses (~7x).
    #[serde(default)]
    pub compressible: bool,
    /// QEMU machine type: `q35` or a versioned `pc-q35-X.Y`.
    #[serde(default = "crate::hardware::default_machine")]
    pub machine: String,
    /// The machine's own devices (see [`crate::hardware::Board`]); none: a
    /// VM created before boards had a name, whose board is `full`. A VM
    /// created without one gets `lean`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub board: Option<crate::hardware::Board>,
    /// CPU model (`qemu64`, `Skylake-Server-v4`, `host`, …): a migration's
    /// target must offer it.
    #[serde(default = "crate::hardware::default_cpu")]
    pub cpu: String,
    #[serde(default)]
    pub firmware: crate::hardware::Firmware,
    /// The kernel booted with `firmware = "kernel"`; none: the host's
    /// workload kernel (the lab's workload guest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<crate::hardware::KernelBoot>,
    /// Disks present from boot; the first boots.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drives: Vec<crate::hardware::Drive>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nics: Vec<crate::hardware::GuestNic>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init: Option<crate::hardware::CloudInit>,
    /// A virtio-serial channel for qemu-guest-agent: the final check of a
    /// move pings it and reads the guest's clock.
    #[serde(default)]
    pub guest_agent: bool,
}

/// Most disks a VM takes (one hot-plug port each).
pub const MAX_VM_DISKS: usize = 4;

/// A disk plugged into a VM: its name and the NBD URI its QEMU opens
/// (`nbd://HOST:PORT/DISK/VM`, naming the VM so the storage node keeps one
/// flow per VM per disk).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskPlug {
    pub disk: String,
    pub uri: String,
}

impl DiskPlug {
    /// (host, port, export) of the URI.
    pub fn parse_uri(&self) -> Result<(String, u16, String), ApiError> {
        parse_nbd_uri(&self.uri)
    }
}

/// (host, port, export) of an `nbd://HOST:PORT/EXPORT` URI.
pub fn parse_nbd_uri(uri: &str) -> Result<(String, u16, String), ApiError> {
    let bad = |why: &str| ApiError::invalid("uri", format!("'{uri}' {why}"));
    let rest = uri
        .strip_prefix("nbd://")
        .ok_or_else(|| bad("is not nbd://HOST:PORT/EXPORT"))?;
    let (addr, export) = rest.split_once('/').ok_or_else(|| bad("has no export"))?;
    let (host, port) = addr.rsplit_once(':').ok_or_else(|| bad("has no port"))?;
    let port = port.parse().map_err(|_| bad("has a bad port"))?;
    if host.is_empty() || export.is_empty() {
        return Err(bad("is not nbd://HOST:PORT/EXPORT"));
    }
    Ok((host.to_string(), port, export.to_string()))
}

fn default_verify_rate() -> u64 {
    32 << 20
}
fn default_seed() -> u64 {
    1
}
fn default_vcpus() -> u32 {
    1
}

/// Smallest guest that boots the lab kernel and its workload.
pub const MIN_VM_MEMORY: u64 = 128 << 20;
/// Memory the guest kernel and initramfs keep for themselves; the fill must leave it.
pub const GUEST_OVERHEAD: u64 = 128 << 20;
/// Largest guest a spec may ask for: QEMU's x86-64 guests address 2^46
/// bytes at most without 5-level paging. What a host takes is its own
/// memory budget (its agent refuses a VM that does not fit, naming both).
pub const MAX_VM_MEMORY: u64 = 64 << 40;
/// Most vCPUs a spec may ask for: the largest `cpu-max` of QEMU's x86
/// machine types. A host's QEMU refuses more than its machine type's
/// `cpu-max` (its agent says so before anything starts).
pub const MAX_VCPUS: u32 = 4096;

/// How a VM uses a Ferry disk ([`VmSpec::disk_use`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskUse {
    /// `disks[i]`, plugged (block node `disk{i}`).
    Plugged(usize),
    /// `drives[i]` over NBD, export `DISK/VM` (block node `drive{i}`).
    Drive(usize),
}

impl VmSpec {
    /// Where this VM has Ferry disk `disk` open: plugged, or a drive on
    /// its export `DISK/VM`.
    pub fn disk_use(&self, disk: &str) -> Option<DiskUse> {
        if let Some(i) = self.disks.iter().position(|d| d.disk == disk) {
            return Some(DiskUse::Plugged(i));
        }
        self.drives
            .iter()
            .position(|d| {
                d.nbd
                    .as_deref()
                    .and_then(|u| parse_nbd_uri(u).ok())
                    .is_some_and(|(_, _, export)| export.split('/').next() == Some(disk))
            })
            .map(DiskUse::Drive)
    }

    /// The Ferry disks this VM uses: plugged, or drives on exports `DISK/VM`.
    pub fn ferry_disks(&self) -> std::collections::BTreeSet<String> {
        let drives = self.drives.iter().filter_map(|d| {
            let (_, _, export) = parse_nbd_uri(d.nbd.as_deref()?).ok()?;
            export.split('/').next().map(str::to_string)
        });
        self.disks
            .iter()
            .map(|d| d.disk.clone())
            .chain(drives)
            .collect()
    }

    /// A lab workload guest (the host's kernel and workload, memory filled
    /// with a checkable pattern), with defaults for everything else.
    pub fn workload(name: &str, memory: u64, fill: u64, dirty_rate: u64) -> VmSpec {
        VmSpec {
            name: name.into(),
            memory,
            fill,
            dirty_rate,
            verify_rate: default_verify_rate(),
            seed: default_seed(),
            vcpus: default_vcpus(),
            disks: Vec::new(),
            compressible: false,
            machine: crate::hardware::default_machine(),
            board: Some(crate::hardware::Board::Lean),
            cpu: crate::hardware::default_cpu(),
            firmware: Default::default(),
            kernel: None,
            drives: Vec::new(),
            nics: Vec::new(),
            cloud_init: None,
            guest_agent: false,
        }
    }

    /// The lab's workload guest: booted from the agent's own kernel, with
    /// no drive but local ones (it writes every virtio disk it finds).
    pub fn is_workload(&self) -> bool {
        self.firmware == crate::hardware::Firmware::Kernel
            && self.kernel.is_none()
            && self.drives.iter().all(|d| d.local.is_some())
    }

    /// The drives that are files of the host's own (they move with the VM).
    pub fn local_drives(&self) -> impl Iterator<Item = (usize, &crate::hardware::Drive)> {
        self.drives
            .iter()
            .enumerate()
            .filter(|(_, d)| d.local.is_some())
    }

    /// The spec as VM listings show it: secrets withheld (see
    /// [`crate::hardware::CloudInit`]).
    pub fn redacted(&self) -> VmSpec {
        VmSpec {
            cloud_init: self.cloud_init.as_ref().map(|c| c.redacted()),
            ..self.clone()
        }
    }

    /// Checks a spec before anything starts; errors name the offending field.
    pub fn validate(&self) -> Result<(), ApiError> {
        validate_name("name", &self.name)?;
        crate::hardware::validate(self)?;
        if self.disks.len() > MAX_VM_DISKS {
            return Err(ApiError::invalid(
                "disks",
                format!(
                    "{} disks; a VM takes at most {MAX_VM_DISKS}",
                    self.disks.len()
                ),
            ));
        }
        for d in &self.disks {
            d.parse_uri()?;
        }
        if self.memory < MIN_VM_MEMORY || self.memory > MAX_VM_MEMORY {
            return Err(ApiError::invalid(
                "memory",
                format!("{} bytes is outside 128M..64T", self.memory),
            ));
        }
        if !self.memory.is_multiple_of(1 << 20) {
            return Err(ApiError::invalid("memory", "must be a whole number of MiB"));
        }
        if self.is_workload() && self.fill + GUEST_OVERHEAD > self.memory {
            return Err(ApiError::invalid(
                "fill",
                format!(
                    "{} bytes does not fit in {} bytes of memory (the guest keeps 128M)",
                    self.fill, self.memory
                ),
            ));
        }
        if self.dirty_rate > 4 << 30 || self.verify_rate > 4 << 30 {
            return Err(ApiError::invalid(
                "dirty_rate",
                "rates above 4G/s are not supported",
            ));
        }
        if self.vcpus == 0 || self.vcpus > MAX_VCPUS {
            return Err(ApiError::invalid(
                "vcpus",
                format!("must be 1..{MAX_VCPUS} (a host's QEMU may take fewer, and says so)"),
            ));
        }
        Ok(())
    }
}

/// A migration's id as a source agent makes it: 16 lowercase hex digits.
/// Peers send ids back; anything else is refused before it names a file.
pub fn validate_migration_id(id: &str) -> Result<(), ApiError> {
    if id.len() == 16
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        Ok(())
    } else {
        Err(ApiError::invalid(
            "migration_id",
            format!(
                "'{}' is not a migration id (16 lowercase hex digits)",
                id.chars().take(64).collect::<String>().escape_debug()
            ),
        ))
    }
}

/// Names of VMs and hosts: 1-32 of `[a-z0-9-]`, starting with a letter or digit.
pub fn validate_name(field: &str, name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 32
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            field,
            format!("'{name}' must be 1-32 characters of a-z, 0-9 and '-'"),
        ))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmCreateRequest {
    /// Where it runs; empty: where the placement engine puts it.
    #[serde(default)]
    pub host: String,
    pub spec: VmSpec,
    /// Restarted elsewhere when its host fails (see [`crate::ha`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ha: Option<crate::ha::HaPolicy>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmInfo {
    pub name: String,
    pub host: String,
    pub spec: VmSpec,
    /// QEMU's run state (`running`, `paused`, `inmigrate`, …) or `unreachable`.
    pub state: String,
    pub pid: Option<u32>,
    /// A migration of this VM is in doubt here: what is known and since when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_doubt: Option<String>,
    /// The last guest check after a migration failed: why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
    /// How the host runs it: `kvm` or `tcg` (software emulation).
    #[serde(default)]
    pub accel: String,
    /// The guest's storage stopped answering: the pause now under way, or
    /// the last one (resumed, or the VM stopped), see [`StoragePause`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_pause: Option<StoragePause>,
    /// A live migration of it runs from this host now.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub migrating: bool,
    /// How its QEMU is confined, as read from `/proc` (absent: not running,
    /// or an agent that does not say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confinement: Option<VmConfinement>,
    /// Its moves are encrypted (the cluster's `encryption`; the control
    /// service says).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moves_encrypted: Option<bool>,
    /// What its owner wants of it (the control service says).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired: Option<crate::ha::Desired>,
    /// Its HA policy (the control service says).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ha: Option<crate::ha::HaPolicy>,
    /// Why it is stopped when its owner did not ask.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped_because: Option<String>,
    /// What its QEMU has used, read from the process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<VmUsage>,
}

/// What a VM's QEMU process has used: the placement engine's load.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmUsage {
    /// CPU time since it started (user and system), ms.
    pub cpu_ms: u64,
    /// Resident memory, bytes.
    pub rss: u64,
    /// Bytes its guest NICs and disks carried since it started (taps'
    /// rx + tx, block devices' reads + writes): traffic that moves with it.
    #[serde(default)]
    pub io_bytes: u64,
    /// Its guest's dirty page rate as QEMU last measured it, bytes/s
    /// (sampled every [`DIRTY_SAMPLE_EVERY_S`] s; absent before the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dirty_bps: Option<u64>,
}

/// How often an agent measures each guest's dirty page rate.
pub const DIRTY_SAMPLE_EVERY_S: u64 = 30;

/// What confines a VM's QEMU, read from its process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmConfinement {
    /// The uid QEMU runs as (0: root, not confined).
    pub uid: u32,
    /// A seccomp filter is on (`-sandbox`).
    pub seccomp: bool,
    /// Its cgroups (`/proc/PID/cgroup`), one per hierarchy.
    #[serde(default)]
    pub cgroups: Vec<String>,
}

impl VmConfinement {
    /// Confined: not root, and seccomp on.
    pub fn holds(&self) -> bool {
        self.uid != 0 && self.seccomp
    }
}

/// A guest paused because its storage stopped answering (VM storage
/// resiliency): its disk I/O is held, never failed, and it runs on when the
/// storage answers again, or is stopped when it has not within the host's
/// window.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoragePause {
    /// The storage the guest waits for: NBD endpoints (`HOST:PORT`) or
    /// `local` (a file on the host); the control service adds node names.
    pub storage: String,
    /// Unix time, milliseconds, when the guest was paused.
    pub since_ms: u64,
    pub state: PauseState,
    /// When it ended (resumed or stopped), Unix ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PauseState {
    /// Paused now, waiting for its storage.
    Paused,
    /// The storage answered again and the guest runs on.
    Resumed,
    /// The storage did not answer within the window: the VM was stopped.
    Stopped,
}

impl StoragePause {
    pub fn active(&self) -> bool {
        self.state == PauseState::Paused
    }

    /// `paused: storage (NODE, since 12:00:01 UTC, 42s)` and the like, for
    /// lists and refusals.
    pub fn describe(&self, now_ms: u64) -> String {
        let since = crate::util::clock_utc(self.since_ms);
        let end = self.until_ms.unwrap_or(now_ms);
        let took = crate::size::human_duration(std::time::Duration::from_millis(
            end.saturating_sub(self.since_ms),
        ));
        match self.state {
            PauseState::Paused => {
                format!("paused: storage ({}, since {since}, {took})", self.storage)
            }
            PauseState::Resumed => {
                format!(
                    "resumed after a storage pause ({}, at {since}, {took})",
                    self.storage
                )
            }
            PauseState::Stopped => format!(
                "stopped: storage ({}) did not answer for {took} (paused at {since})",
                self.storage
            ),
        }
    }
}

/// The answer to "is this guest intact and still running?".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckResult {
    pub vm: String,
    pub host: String,
    pub qemu_status: String,
    /// Workload counter at the start and end of the check.
    pub tick_first: Option<u64>,
    pub tick_last: Option<u64>,
    pub sweeps: Option<u64>,
    /// Integrity errors the guest counted since boot.
    pub errors: u64,
    /// Problem lines seen on the console (integrity errors, panics).
    pub problems: Vec<String>,
    pub running: bool,
    pub advancing: bool,
    pub intact: bool,
    /// A guest other than the workload: CPU time its vCPUs used during the
    /// check, ms (its "advancing").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpu_ms: Option<u64>,
    /// The guest agent answered a ping and its clock advanced (None: the
    /// VM has no guest agent channel).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_agent: Option<bool>,
}

impl CheckResult {
    pub fn ok(&self) -> bool {
        self.running && self.advancing && self.intact
    }

    /// One line: what failed (or "ok").
    pub fn summary(&self) -> String {
        if self.ok() {
            return "ok".into();
        }
        let mut why = Vec::new();
        if !self.running {
            why.push(format!("not running (QEMU: {})", self.qemu_status));
        }
        if !self.advancing {
            why.push(if self.vcpu_ms.is_some() {
                "vCPUs not advancing".to_string()
            } else {
                "counter not advancing".to_string()
            });
        }
        if !self.intact {
            why.push(format!("{} integrity errors", self.errors));
        }
        why.extend(self.problems.iter().cloned());
        format!("guest check failed on {}: {}", self.host, why.join("; "))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ValidateRequest {
    /// Hosts to validate (and the paths touching them); empty for all.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// Length of each per-path throughput test; 0 skips them.
    #[serde(default = "default_throughput_ms")]
    pub throughput_ms: u64,
}

fn default_throughput_ms() -> u64 {
    1000
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoveRequest {
    pub to: String,
    /// `None`: the source host's default (`ferry host set --migration-option`), else auto.
    #[serde(default)]
    pub option: Option<MigrationOption>,
    /// What is not chosen here comes from the source host's defaults, then
    /// from the built-in ones.
    #[serde(default)]
    pub convergence: ConvergenceChoice,
}

/// What a migration does when its pre-copy time runs out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AtExpiry {
    /// Switch to post-copy (needs post-copy allowed).
    Postcopy,
    /// Pause the guest and copy what is left: it converges, with a downtime
    /// of remaining bytes ÷ path rate.
    Pause,
    /// Cancel; the guest keeps running on the source.
    Cancel,
}

impl AtExpiry {
    pub fn name(self) -> &'static str {
        match self {
            AtExpiry::Postcopy => "postcopy",
            AtExpiry::Pause => "pause",
            AtExpiry::Cancel => "cancel",
        }
    }
}

/// What a migration may do when pre-copy does not converge, in this order:
/// let QEMU throttle the guest's vCPUs (auto-converge), then switch to
/// post-copy; past the timeout, whatever `at_expiry` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Convergence {
    #[serde(default = "yes")]
    pub throttle: bool,
    #[serde(default)]
    pub postcopy: bool,
    /// Pre-copy time allowed per GiB of guest memory (at least 20 s in all).
    #[serde(default = "default_timeout_per_gib")]
    pub timeout_per_gib_s: u64,
    /// `None`: post-copy if allowed, else cancel.
    #[serde(default)]
    pub at_expiry: Option<AtExpiry>,
    /// The most downtime the guest may see (QEMU's blackout and the
    /// switch-over until the target runs it), ms.
    #[serde(default = "default_max_downtime")]
    pub max_downtime_ms: u64,
    /// Aim below `max_downtime_ms`: the smallest downtime the guest's
    /// dirtying and the path allow, within a bounded number of extra rounds
    /// (`--max-downtime auto`, the default). `false`: switch over as soon
    /// as what remains fits `max_downtime_ms`.
    #[serde(default = "yes")]
    pub downtime_auto: bool,
}

fn yes() -> bool {
    true
}
fn one() -> f64 {
    1.0
}
fn default_timeout_per_gib() -> u64 {
    150
}
fn default_max_downtime() -> u64 {
    300
}

impl Default for Convergence {
    fn default() -> Self {
        Convergence {
            throttle: true,
            postcopy: false,
            timeout_per_gib_s: default_timeout_per_gib(),
            at_expiry: None,
            max_downtime_ms: default_max_downtime(),
            downtime_auto: true,
        }
    }
}

/// Downtime targets accepted, milliseconds.
pub const DOWNTIME_RANGE_MS: std::ops::RangeInclusive<u64> = 10..=60_000;

impl Convergence {
    /// Pre-copy time allowed for a guest of `memory` bytes.
    pub fn timeout(&self, memory: u64) -> std::time::Duration {
        let gib = memory as f64 / (1u64 << 30) as f64;
        std::time::Duration::from_secs_f64((self.timeout_per_gib_s as f64 * gib).max(20.0))
    }

    /// The choice at expiry, with its default filled in.
    pub fn expiry(&self) -> AtExpiry {
        self.at_expiry.unwrap_or(if self.postcopy {
            AtExpiry::Postcopy
        } else {
            AtExpiry::Cancel
        })
    }

    /// A policy that cannot be followed is refused, naming the field.
    pub fn check(&self) -> Result<(), ApiError> {
        if self.at_expiry == Some(AtExpiry::Postcopy) && !self.postcopy {
            return Err(ApiError::invalid(
                "at_expiry",
                "post-copy at expiry needs post-copy allowed",
            ));
        }
        if self.timeout_per_gib_s == 0 || self.timeout_per_gib_s > 3600 {
            return Err(ApiError::invalid(
                "timeout_per_gib_s",
                format!("{} is outside 1..3600", self.timeout_per_gib_s),
            ));
        }
        if !DOWNTIME_RANGE_MS.contains(&self.max_downtime_ms) {
            return Err(ApiError::invalid(
                "max_downtime_ms",
                format!(
                    "{} is outside {}..{}",
                    self.max_downtime_ms,
                    DOWNTIME_RANGE_MS.start(),
                    DOWNTIME_RANGE_MS.end()
                ),
            ));
        }
        Ok(())
    }
}

/// A convergence policy with gaps: a move's choices, or a host's defaults.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConvergenceChoice {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throttle: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub postcopy: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_per_gib_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_expiry: Option<AtExpiry>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_downtime_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downtime_auto: Option<bool>,
}

impl ConvergenceChoice {
    /// `self` where it chose, else `base`.
    pub fn or(self, base: ConvergenceChoice) -> ConvergenceChoice {
        ConvergenceChoice {
            throttle: self.throttle.or(base.throttle),
            postcopy: self.postcopy.or(base.postcopy),
            timeout_per_gib_s: self.timeout_per_gib_s.or(base.timeout_per_gib_s),
            at_expiry: self.at_expiry.or(base.at_expiry),
            max_downtime_ms: self.max_downtime_ms.or(base.max_downtime_ms),
            downtime_auto: self.downtime_auto.or(base.downtime_auto),
        }
    }

    /// The gaps filled with the built-in defaults, checked.
    pub fn resolve(self) -> Result<Convergence, ApiError> {
        let d = Convergence::default();
        let c = Convergence {
            throttle: self.throttle.unwrap_or(d.throttle),
            postcopy: self.postcopy.unwrap_or(d.postcopy),
            timeout_per_gib_s: self.timeout_per_gib_s.unwrap_or(d.timeout_per_gib_s),
            at_expiry: self.at_expiry,
            max_downtime_ms: self.max_downtime_ms.unwrap_or(d.max_downtime_ms),
            downtime_auto: self.downtime_auto.unwrap_or(d.downtime_auto),
        };
        c.check()?;
        Ok(c)
    }

    pub fn is_empty(&self) -> bool {
        *self == ConvergenceChoice::default()
    }
}

/// The performance options of seed 001, for Linux.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MigrationOption {
    /// QEMU's own single TCP stream over one NIC.
    Tcp,
    /// QEMU multifd over Ferry's transport on every healthy NIC.
    Multichannel,
    /// Ferry's transport over one NIC, frames compressed (LZ4) when that
    /// wins: the link is the bottleneck, CPU is idle, the data shrinks.
    Compression,
    /// Kernel MPTCP managed by Ferry: the agents open one authenticated
    /// MPTCP connection (a subflow per NIC) and hand the socket to QEMU,
    /// which writes its one migration stream into it; no byte passes
    /// through an agent. Subflows are re-added when a link returns; the
    /// agents shut the socket when every path is dead or the move fails.
    Mptcp,
    /// QEMU multifd relayed over kernel MPTCP: one MPTCP connection per
    /// QEMU connection, bytes spliced toward the network and copied in
    /// batches from it by the agents.
    #[serde(rename = "mptcp-relay")]
    MptcpRelay,
    /// More than one NIC pair healthy: multichannel (frames compressed
    /// when that wins), sealed when the move is encrypted; in clear,
    /// multichannel for a guest whose memory compresses, else mptcp (the
    /// source reads a sample of the guest's memory). One pair: compression
    /// when the sample compresses or the move is encrypted, else tcp.
    #[default]
    Auto,
}

impl MigrationOption {
    pub fn name(self) -> &'static str {
        match self {
            MigrationOption::Tcp => "tcp",
            MigrationOption::Multichannel => "multichannel",
            MigrationOption::Compression => "compression",
            MigrationOption::Mptcp => "mptcp",
            MigrationOption::MptcpRelay => "mptcp-relay",
            MigrationOption::Auto => "auto",
        }
    }
}

/// Source agent: move one of your VMs to the agent at `target_url`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrateRequest {
    pub target: String,
    pub target_url: String,
    #[serde(default)]
    pub option: MigrationOption,
    #[serde(default)]
    pub convergence: Convergence,
    /// Every byte of the move is encrypted and authenticated (the cluster's
    /// `encryption`, on unless an administrator turned it off): Ferry's
    /// carriers seal their frames, QEMU's own streams speak TLS.
    #[serde(default = "yes")]
    pub encryption: bool,
    /// The control service's ticket for this move, handed to the target
    /// (signed and checked by `ferry_net::ticket`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ticket: Option<Ticket>,
}

/// Settings that hold for the whole cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSettings {
    /// Live migrations and disk copies are encrypted and authenticated
    /// with a key of each move's own (on by default). Off, QEMU's streams
    /// and Ferry's memory carriers go in clear (disk copies stay sealed);
    /// every move's report and `vm list` say so.
    #[serde(default = "yes")]
    pub encryption: bool,
    /// Before `encryption`: carriers sealed when true. Read, never written;
    /// an old `false` was the old default, not a choice, and does not turn
    /// encryption off.
    #[serde(default, rename = "encrypt_carriers", skip_serializing)]
    pub legacy_encrypt_carriers: Option<bool>,
    /// The program (a name in the control service's hooks directory) that
    /// powers a failed host off (IPMI, Redfish): run with `FERRY_HOST` set
    /// before an HA VM whose drives Ferry cannot fence restarts elsewhere;
    /// exit status 0 confirms the host is off. Without one, such VMs wait
    /// for an admin's `vm start --confirm-powered-off`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence_hook: Option<String>,
    /// The balancer runs by itself (see the placement module): the leader
    /// plans every `balance_every_s`; a spread over the threshold at
    /// three checks running starts the moves (a strict rule broken, at
    /// once); a VM it moved stays put for its cooldown.
    #[serde(default)]
    pub balance_auto: bool,
    /// The spread of host load left alone, in percent.
    #[serde(default = "default_balance_threshold")]
    pub balance_threshold_pct: u32,
    /// Seconds between the automatic balancer's checks.
    #[serde(default = "default_balance_every")]
    pub balance_every_s: u64,
}

/// The placement module's default threshold (0.10), in percent.
fn default_balance_threshold() -> u32 {
    10
}

fn default_balance_every() -> u64 {
    60
}

impl Default for ClusterSettings {
    fn default() -> Self {
        ClusterSettings {
            encryption: true,
            legacy_encrypt_carriers: None,
            fence_hook: None,
            balance_auto: false,
            balance_threshold_pct: default_balance_threshold(),
            balance_every_s: default_balance_every(),
        }
    }
}

/// Changes some cluster settings; what is not given stays.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSettingsUpdate {
    #[serde(default)]
    pub encryption: Option<bool>,
    /// A hook's name; `""` removes the fence hook.
    #[serde(default)]
    pub fence_hook: Option<String>,
    #[serde(default)]
    pub balance_auto: Option<bool>,
    #[serde(default)]
    pub balance_threshold_pct: Option<u32>,
    #[serde(default)]
    pub balance_every_s: Option<u64>,
}

impl ClusterSettingsUpdate {
    /// Names the first value out of range.
    pub fn validate(&self) -> Result<(), ApiError> {
        if self.balance_threshold_pct.is_some_and(|p| p > 100) {
            return Err(ApiError::invalid(
                "balance_threshold_pct",
                "must be 0..100 (percent of host load)",
            ));
        }
        if self
            .balance_every_s
            .is_some_and(|s| !(1..=86_400).contains(&s))
        {
            return Err(ApiError::invalid(
                "balance_every_s",
                "must be 1..86400 seconds",
            ));
        }
        Ok(())
    }
}

impl ClusterSettings {
    pub fn updated(&self, u: &ClusterSettingsUpdate) -> ClusterSettings {
        ClusterSettings {
            encryption: u.encryption.unwrap_or(self.encryption),
            legacy_encrypt_carriers: None,
            fence_hook: match u.fence_hook.as_deref() {
                None => self.fence_hook.clone(),
                Some("") => None,
                Some(h) => Some(h.to_string()),
            },
            balance_auto: u.balance_auto.unwrap_or(self.balance_auto),
            balance_threshold_pct: u
                .balance_threshold_pct
                .unwrap_or(self.balance_threshold_pct),
            balance_every_s: u.balance_every_s.unwrap_or(self.balance_every_s),
        }
    }
}

/// Target agent: reserve memory and start a skeleton VM waiting for a migration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IncomingRequest {
    pub migration_id: String,
    pub source: String,
    pub spec: VmSpec,
    /// The control service's ticket for this move (signed and checked by `ferry_net::ticket`):
    /// over TLS, required.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ticket: Option<Ticket>,
    /// The target's NICs a NIC of the source, up, reaches (probed); the
    /// target listens on those.
    pub reachable_nics: Vec<String>,
    /// `tcp` or `multichannel` (never `auto`: the source decides).
    #[serde(default)]
    pub option: MigrationOption,
    /// Multichannel: the transport session id (32 hex digits).
    #[serde(default)]
    pub session: Option<String>,
    /// Post-copy may be used: the target enables it too (and then no multifd).
    #[serde(default)]
    pub postcopy: bool,
    /// Multichannel: carriers seal every frame.
    #[serde(default)]
    pub sealed: bool,
    /// The move's session key, 64 hex digits: it authenticates the
    /// carriers (and keys their sealing) and QEMU's TLS. A new one for each
    /// move, made by the source; it crosses only this call's mutual TLS.
    #[serde(default)]
    pub key: String,
    /// The two QEMUs speak TLS (a pre-shared key derived from `key`): for
    /// the options whose bytes Ferry does not frame (`tcp`, `mptcp`,
    /// `mptcp-relay`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub qemu_tls: bool,
    /// The source agent's URL: a waiting target asks it whether the
    /// migration was committed (see the agent's `commit` module).
    #[serde(default)]
    pub source_url: String,
    /// For a VM whose CPU model is `host` or `max`: the source host's
    /// expansion of it (QEMU's `query-cpu-model-expansion`, full); the
    /// target refuses unless its own is the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_expansion: Option<std::collections::BTreeMap<String, serde_json::Value>>,
    /// The VM's local drives, which the source mirrors into the target
    /// (shared-nothing migration): the target creates each file empty,
    /// `size` bytes, and exports it to the source over the session.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub local_disks: Vec<LocalDiskCopy>,
    /// With `local_disks`: the transport session (32 hex digits) that
    /// carries the disks' NBD connections, apart from the memory's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_session: Option<String>,
    /// QEMU compresses guest memory in its multifd channels with zstd at this
    /// level (the target's QEMU must decompress); absent: QEMU sends pages as
    /// they are. An agent that predates the field refuses the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qemu_zstd: Option<u8>,
    /// Ferry's carriers keep each stream within a window of what the target
    /// QEMU has taken (the transport's WINDOW frames): what the target has
    /// still to load when the source pauses stays small.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stream_windows: bool,
    /// With `tcp`: the source's QEMU opens its multifd channels straight to
    /// the target's QEMU (no carriers, no agent relays a byte); the target's
    /// QEMU expects them. `compression` takes this when the CPU, not the
    /// link, limits the move (see the agent's `migration::auto`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub qemu_channels: bool,
    /// With `stream_windows`: the target's QEMU gets QEMU's `return-path`
    /// and `switchover-ack` capabilities, so the source QEMU switches over
    /// only once its acknowledgement crosses the source agent, which holds
    /// it until the target QEMU has loaded what it was sent (the hold before
    /// the switch-over, see the agent's `migration::watch`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub switchover_ack: bool,
}

/// One local drive a migration copies (see [`IncomingRequest::local_disks`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalDiskCopy {
    /// Its index in the spec's drives (its node is `drive{index}`).
    pub drive: usize,
    /// Its virtual size in bytes.
    pub size: u64,
}

/// A shared-nothing migration's disk copy, as the source sees it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DiskCopyProgress {
    /// Bytes the mirror jobs have copied, and their total (which grows
    /// with what the guest rewrites meanwhile).
    pub done: u64,
    pub total: u64,
    /// Every disk is in step with its copy (writes now go to both).
    pub ready: bool,
}

/// One local drive a migration moved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskCopyReport {
    pub drive: usize,
    pub name: String,
    pub size: u64,
    /// Bytes the mirror moved (its `len` at the end: the whole disk plus
    /// what the guest rewrote during the copy; holes go as zero requests).
    pub bytes: u64,
    /// From the mirror's start until every disk was in step.
    pub ready_ms: u64,
}
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncomingReply {
    pub migration_id: String,
    /// Where the source QEMU sends its migration stream.
    pub uri: String,
    pub fabric: u32,
    pub nic: String,
    /// Multichannel: the target's carrier listeners, one per NIC.
    #[serde(default)]
    pub carriers: Vec<CarrierEndpoint>,
    /// Shared-nothing: the carrier listeners of the disks' session (its
    /// streams end at the skeleton's NBD server).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disk_carriers: Vec<CarrierEndpoint>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CarrierEndpoint {
    pub fabric: u32,
    pub nic: String,
    /// `address:port`
    pub address: String,
}

/// One carrier of a multichannel migration, as the source saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CarrierReport {
    pub nic: String,
    pub up: bool,
    pub tx_bytes: u64,
    pub connects: u64,
    pub failures: u64,
    pub frames_requeued: u64,
    pub last_failure: Option<String>,
}

/// A path of a migration dropped or taken again: a subflow of the handed-off
/// MPTCP socket (`mptcp` kind) or a carrier (Ferry's framed kind), per NIC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathChange {
    /// Wall-clock time of the change, ms since the Unix epoch.
    pub at_unix_ms: u64,
    /// The source host's NIC (the fabric it reaches).
    pub nic: String,
    /// `removed` or `re-added`.
    pub action: String,
    /// Why, in words: `link down (carrier lost)`, `no ACK for 240 ms with
    /// 31 segments outstanding (rtt 2 ms, rto 204 ms)`, `link up again`, …
    pub reason: String,
    /// Which host saw it: `source` or `target`.
    #[serde(default)]
    pub side: String,
}

/// One codec's part of a migration over Ferry's transport.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CodecReport {
    /// `none` (sent as it was), `lz4`, `zstd:LEVEL`.
    pub codec: String,
    /// Frames sent packed by it.
    pub frames: u64,
    /// Their bytes before packing, and as sent.
    pub raw_bytes: u64,
    pub sent_bytes: u64,
    /// Raw bytes ÷ all raw bytes of the migration.
    pub share: f64,
    /// Raw ÷ sent.
    pub ratio: f64,
    /// Source CPU-seconds spent compressing with it (tries that did not
    /// shrink included); for `none`, screening frames for noise.
    pub cpu_s: f64,
    /// Frames compressed with it that did not shrink enough and went as they were.
    pub misses: u64,
    /// `none` only: frames a codec would have been tried on, sent as they
    /// were without one because their bytes read as noise.
    #[serde(default)]
    pub screened: u64,
}

/// What QEMU's own compression did in a migration (see
/// [`MigrationReport::qemu_codec`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QemuCodecReport {
    /// `zstd:LEVEL`.
    pub codec: String,
    /// Bytes of the pages QEMU sent whole, and what its multifd channels
    /// wrote for them (compressed, with their packet headers).
    pub raw_bytes: u64,
    pub sent_bytes: u64,
    /// Raw ÷ sent.
    pub ratio: f64,
    /// CPU-seconds of QEMU's multifd send threads (compression and writes).
    pub cpu_s: f64,
}

/// Source → target agent, `mptcp` kind: announce the address of your NIC
/// `nic` again, so the source's NIC that reaches it re-joins every connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RejoinRequest {
    pub nic: String,
}

/// Source → target agent: a post-copy's stream broke; listen for a new one
/// on your NIC `nic` (`migrate-recover`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecoverRequest {
    pub nic: String,
}

/// Where the target's QEMU listens for the post-copy's new stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoverReply {
    /// `tcp:ADDRESS:PORT`, for the source's `migrate` with `resume`.
    pub uri: String,
    pub nic: String,
}

/// `POST /vms/{name}/resolve`: settle now what is in doubt. With
/// `target_lost`, the operator declares the migration's target host gone
/// for good (powered off or fenced, `confirm_powered_off`): the source
/// records the move aborted and resumes its copy of the guest.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResolveRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_lost: Option<String>,
    #[serde(default)]
    pub confirm_powered_off: bool,
    /// The operator confirms the target runs the whole guest (every page
    /// arrived) although the source QEMU never reported its post-copy
    /// completed: the source QEMU is stopped.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub target_has_all: bool,
}

impl ResolveRequest {
    /// A declared loss needs its confirmation and a host name; the two ways
    /// out exclude each other.
    pub fn check(&self) -> Result<(), crate::ApiError> {
        if self.target_has_all && self.target_lost.is_some() {
            return Err(crate::ApiError::invalid(
                "target_has_all",
                "a target declared lost cannot also run the whole guest: give one of the two",
            ));
        }
        match &self.target_lost {
            Some(h) if !self.confirm_powered_off => Err(crate::ApiError::invalid(
                "confirm_powered_off",
                format!(
                    "declaring {h} lost resumes the guest on its source: confirm that {h} is \
                     powered off or fenced (--confirm-powered-off); if {h} ran the guest and \
                     comes back, two copies would run"
                ),
            )),
            Some(h) => crate::validate_name("target_lost", h),
            None if self.confirm_powered_off => Err(crate::ApiError::invalid(
                "confirm_powered_off",
                "confirms a lost target: give the host with target_lost (--target-lost HOST)",
            )),
            None => Ok(()),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncomingStatus {
    pub migration_id: String,
    pub qemu_status: String,
    pub qemu_alive: bool,
    /// Once the guest runs: CPU the target spent on the migration, ms (its
    /// QEMU and its agent).
    #[serde(default)]
    pub cpu_ms: Option<u64>,
    /// The target's record: `waiting` (paused, never ran), `running` (told
    /// to run: the guest may have run here), `discarded` (never ran).
    #[serde(default)]
    pub phase: String,
    /// RUN's answer: how long before the answer was made the guest's vCPUs
    /// started here, µs, by this host's own clocks (its QEMU's `RESUME`
    /// event, else the `cont` returning). The source dates the end of the
    /// guest's downtime by it without comparing two hosts' clocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_us_ago: Option<u64>,
}

/// A migration as its source agent recorded it (`GET /migrations/{id}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceStatus {
    pub migration_id: String,
    pub vm: String,
    /// `copying`, `committed`, `aborted` or `done`.
    pub phase: String,
}

/// What `ferry vm resolve` found and did on one host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolveReport {
    pub vm: String,
    pub host: String,
    /// `source` or `target`.
    pub side: String,
    pub migration_id: String,
    /// The host's record before and after.
    pub phase_before: String,
    pub phase: String,
    /// Still in doubt (the other agent did not answer).
    pub in_doubt: bool,
    pub detail: String,
}

/// Where a migration is, as seen by the source.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigrationProgress {
    pub elapsed_ms: u64,
    /// QEMU's status: `setup`, `active`, `device`, `completed` …
    pub status: String,
    pub transferred: u64,
    pub remaining: u64,
    pub total: u64,
    /// Bytes per second over the last sample.
    pub throughput: f64,
    /// Bytes per second the guest dirties (QEMU's dirty page rate × page size).
    pub dirty_rate: u64,
    /// Pre-copy rounds (QEMU's dirty-sync-count).
    pub rounds: u64,
    pub expected_downtime_ms: Option<u64>,
    /// Predicted time until the switch-over: pre-copy converges when what
    /// remains fits the downtime target, remaining shrinking at (path rate −
    /// dirty rate); `None` while it is not converging (dirty ≥ path) or
    /// before rates are known. In post-copy and pause-and-copy: remaining ÷
    /// path rate.
    pub eta_ms: Option<u64>,
    /// Pre-copy converges at the current rates (`None` before they are known).
    #[serde(default)]
    pub converging: Option<bool>,
    /// Bytes sent so far per NIC (carriers' payload bytes, or the NIC counter for tcp).
    #[serde(default)]
    pub nic_tx_bytes: BTreeMap<String, u64>,
    /// Carriers up now (multichannel).
    #[serde(default)]
    pub carriers_up: Option<usize>,
    /// `precopy`, `postcopy`, `pause-and-copy` or `blackout`.
    #[serde(default)]
    pub phase: String,
    /// QEMU's vCPU throttle (auto-converge), percent.
    #[serde(default)]
    pub throttle_pct: u64,
    /// Shared-nothing: the local disks' copy (memory is counted apart).
    /// In phase `disks`, before the memory moves, `transferred`, `remaining`
    /// and `total` count the disks' bytes, and `nic_tx_bytes` the disks'
    /// carriers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disks: Option<DiskCopyProgress>,
}

/// CPU time a migration cost, per host: the QEMU process (its migration
/// and multifd threads, and its vCPUs, which run the guest meanwhile) plus
/// the Ferry agent (the transport's carriers). The agent is counted whole, so
/// with several migrations at once each is charged all of it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct CpuReport {
    pub source_s: f64,
    /// `None` when the target could not say (an agent older than this field).
    pub target_s: Option<f64>,
    /// (source + target) ÷ GiB moved.
    pub per_gib_s: Option<f64>,
}

impl CpuReport {
    pub fn new(source: std::time::Duration, target_ms: Option<u64>, bytes: u64) -> CpuReport {
        let source_s = source.as_secs_f64();
        let target_s = target_ms.map(|ms| ms as f64 / 1000.0);
        let gib = bytes as f64 / (1u64 << 30) as f64;
        CpuReport {
            source_s,
            target_s,
            per_gib_s: target_s.filter(|_| gib > 0.0).map(|t| (source_s + t) / gib),
        }
    }
}

/// One part of a guest's downtime ([`MigrationReport::downtime_parts`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DowntimePart {
    pub part: String,
    pub ms: u64,
}

/// The final report of a completed migration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigrationReport {
    pub vm: String,
    pub from: String,
    pub to: String,
    pub status: String,
    pub data_path: String,
    /// The performance option used (`tcp`, `multichannel`).
    pub option: String,
    /// From the request to the end of the final check.
    pub total_ms: u64,
    /// From the request until the guest ran on the target (RUN answered):
    /// the move without the source's cleanup and the final check after it.
    #[serde(default)]
    pub running_ms: u64,
    /// Time inside QEMU's migration (setup to completion): ends when QEMU has
    /// handed its last byte to the data path.
    pub qemu_total_ms: u64,
    /// From QEMU's `migrate` to the target guest running: every byte arrived.
    pub transfer_ms: u64,
    /// From the source seeing QEMU complete to the target guest running: the
    /// delivery of what was still in flight plus the target's load (measured on
    /// the source's clock; QEMU is polled every 100 ms, so up to that is missed).
    pub switchover_ms: u64,
    pub setup_ms: u64,
    /// QEMU's own downtime figure: from the source's pause to its last byte.
    pub downtime_ms: u64,
    /// The downtime the guest saw: from the source's pause until the target
    /// runs it (QEMU's downtime, the target's last load, the commit and RUN).
    #[serde(default)]
    pub guest_downtime_ms: u64,
    /// What the move promised (`max_downtime`), and QEMU's limit at the
    /// switch-over, with why.
    #[serde(default)]
    pub max_downtime_ms: u64,
    #[serde(default)]
    pub downtime_limit_ms: u64,
    /// The hold before the switch-over (a plain pre-copy over Ferry's
    /// carriers): from the end of QEMU's first pass over memory until the
    /// target QEMU had loaded what it was sent and the source QEMU was let
    /// switch over. The guest runs meanwhile; it is not downtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_ms: Option<u64>,
    /// Whether the target had loaded what it was sent when the hold ended
    /// (false: it ran its longest, and the target loaded the rest in the
    /// blackout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_caught_up: Option<bool>,
    #[serde(default)]
    pub downtime_reason: String,
    /// The guest's downtime in its parts, in order: `qemu` (QEMU's
    /// blackout, its pause to its last byte), then the switch-over on the
    /// source's clock: `tick` (the source guest's last counter read),
    /// `ready` (READY answered: the target loaded everything), `record` (the
    /// commit written and fsynced), `run` (RUN sent until the target's
    /// vCPUs started, as its answer dates that). Empty after a post-copy,
    /// whose target ran at the commit.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub downtime_parts: Vec<DowntimePart>,
    pub bytes_transferred: u64,
    /// Average bytes per second over `transfer_ms`.
    pub throughput: f64,
    /// Bytes sent per source NIC during the migration.
    pub nic_tx_bytes: BTreeMap<String, u64>,
    /// Average bytes per second per NIC over `transfer_ms`.
    pub nic_rates: BTreeMap<String, f64>,
    /// Multichannel: each carrier.
    pub carriers: Vec<CarrierReport>,
    /// Multichannel: frames sent again after their carrier died.
    pub frames_resent: u64,
    /// Paths dropped and taken again during the move, in order (carriers, or
    /// subflows of the `mptcp` kind), as the `path` events reported them.
    #[serde(default)]
    pub path_changes: Vec<PathChange>,
    /// Ferry's transport: uncompressed bytes ÷ bytes sent (1.0 when nothing
    /// was compressed), and how many DATA frames went compressed.
    #[serde(default = "one")]
    pub compression_ratio: f64,
    #[serde(default)]
    pub frames_compressed: u64,
    /// Ferry's transport: how frames were packed, per codec (`none`, `lz4`,
    /// `zstd:LEVEL`), with their share of the bytes, ratio and CPU.
    #[serde(default)]
    pub codecs: Vec<CodecReport>,
    /// QEMU compressed guest memory itself (in its multifd channels) before
    /// Ferry's frames carried it; `codecs` then describes what Ferry did with
    /// QEMU's already compressed output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qemu_codec: Option<QemuCodecReport>,
    /// The last phase reached: `precopy`, `postcopy` or `pause-and-copy`.
    pub phase: String,
    /// The highest vCPU throttle QEMU applied, percent.
    pub max_throttle_pct: u64,
    /// Every byte of the move was encrypted and authenticated.
    #[serde(default)]
    pub encrypted: bool,
    /// How: `sealed-carriers` (Ferry's frames, AES-256-GCM), `qemu-tls`
    /// (QEMU's own TLS 1.3, a pre-shared key of this move's), or `off`
    /// (the cluster's `encryption` is off).
    #[serde(default)]
    pub encryption: String,
    /// CPU spent moving the guest, from QEMU's `migrate` to the target guest running.
    #[serde(default)]
    pub cpu: CpuReport,
    pub rounds: u64,
    /// Shared-nothing: each local drive copied before the memory moved
    /// (`bytes_transferred` counts memory only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<DiskCopyReport>,
    /// Shared-nothing: the disks' bytes per NIC (their own carriers;
    /// `nic_tx_bytes` counts memory only).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub disk_nic_tx_bytes: BTreeMap<String, u64>,
    /// The guest's counter on the source just after the switch-over.
    pub tick_before: Option<u64>,
    /// The target's check: running, counter advancing past `tick_before`, intact.
    pub check: CheckResult,
}

/// One line of a migration's NDJSON event stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum MigrationEvent {
    /// One of the ten steps started.
    Step {
        step: String,
        detail: String,
    },
    /// Something the user should know before or during the move (e.g. a
    /// path that validation marked failed); the migration goes on.
    Warning {
        message: String,
    },
    Progress(MigrationProgress),
    /// A path (a carrier, or a subflow of the handed-off MPTCP socket) was
    /// dropped or taken again.
    Path(PathChange),
    Completed(Box<MigrationReport>),
    Failed {
        error: ApiError,
    },
}

/// The end of a guest's serial console (`GET /vms/{name}/console`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleTail {
    pub vm: String,
    pub host: String,
    /// The whole log's length in bytes; `text` is its last part.
    pub size: u64,
    /// The log's last bytes (at most what was asked), as text.
    pub text: String,
}

/// What an operation of the control service is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OperationKind {
    /// A VM's live migration (`POST /vms/{name}/move`).
    Migration,
    /// A host's drain (`POST /hosts/{host}/drain`).
    Drain,
}

/// Where an operation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OperationState {
    Running,
    /// Ended with its result: a migration completed, a drain done (its own
    /// moves may have failed; its result says).
    Completed,
    /// Ended without one: a migration failed, or the stream broke.
    Failed,
}

/// A migration or drain the control service runs, with every event it sent
/// (`GET /operations/{id}`; the list leaves `events` empty).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Operation {
    pub id: String,
    pub kind: OperationKind,
    /// The VM moved, or the host drained.
    pub subject: String,
    /// The source host (a drain: the host).
    pub source: String,
    /// A migration's target; none for a drain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// Who started it (the token's name).
    pub by: String,
    pub started_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_ms: Option<u64>,
    pub state: OperationState,
    /// How many events it has sent.
    pub event_count: usize,
    /// Its events in order, as its own stream sent them
    /// (`MigrationEvent` or `DrainEvent`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<serde_json::Value>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> VmSpec {
        VmSpec::workload("vm1", 1 << 30, 768 << 20, 20 << 20)
    }

    #[test]
    fn a_spec_from_before_the_hardware_fields_is_a_workload_guest() {
        let old = r#"{"name":"vm1","memory":1073741824,"fill":805306368,"dirty_rate":20971520}"#;
        let s: VmSpec = serde_json::from_str(old).unwrap();
        assert!(s.is_workload());
        assert_eq!((s.machine.as_str(), s.cpu.as_str()), ("q35", "qemu64"));
        s.validate().unwrap();
        // its board is the full one, and stays unnamed on the wire: an agent
        // of before boards (which refuses fields it does not know) takes it
        assert_eq!(s.board, None);
        assert!(!serde_json::to_string(&s).unwrap().contains("board"));
        let lean = serde_json::to_value(spec()).unwrap();
        assert_eq!(lean["board"], "lean");
    }

    #[test]
    fn a_users_vm_carries_no_workload_fields() {
        let mut s = spec();
        s.firmware = crate::hardware::Firmware::Bios;
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("drives"), "{e}");
        s.drives.push(crate::hardware::Drive {
            path: Some("/srv/vm1.qcow2".into()),
            format: crate::hardware::DriveFormat::Qcow2,
            ..Default::default()
        });
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("workload"), "{e}");
        s.fill = 0;
        s.dirty_rate = 0;
        s.validate().unwrap();
        s.machine = "pc-i440fx-9.0".into();
        assert!(s.validate().unwrap_err().to_string().contains("machine"));
    }

    #[test]
    fn valid_spec_passes() {
        spec().validate().unwrap();
    }

    #[test]
    fn bad_specs_name_their_field() {
        let mut s = spec();
        s.fill = s.memory;
        assert!(s.validate().unwrap_err().to_string().contains("fill"));
        let mut s = spec();
        s.memory = 1 << 20;
        assert!(s.validate().unwrap_err().to_string().contains("memory"));
        let mut s = spec();
        s.name = "Bad Name".into();
        assert!(s.validate().unwrap_err().to_string().contains("name"));
    }

    #[test]
    fn requests_refuse_unknown_fields() {
        let e = serde_json::from_str::<MoveRequest>(r#"{"to":"host2","speed":"fast"}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("speed"), "{e}");
    }

    #[test]
    fn events_are_tagged() {
        let e = MigrationEvent::Step {
            step: "reserve".into(),
            detail: "x".into(),
        };
        let s = serde_json::to_string(&e).unwrap();
        assert!(s.starts_with(r#"{"event":"step""#), "{s}");
        assert_eq!(serde_json::from_str::<MigrationEvent>(&s).unwrap(), e);
    }
}

/// A move ticket as it travels: the control service's signed claims (see
/// `ferry_net::ticket`, which signs and checks them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ticket {
    pub claims: String,
    pub signature: String,
    pub issuer: String,
}

#[cfg(test)]
mod resolve_tests {
    use super::*;

    #[test]
    fn a_declared_loss_needs_its_confirmation_and_excludes_the_other_way_out() {
        let lost = |h: &str, confirm: bool, all: bool| ResolveRequest {
            target_lost: Some(h.into()),
            confirm_powered_off: confirm,
            target_has_all: all,
        };
        assert!(ResolveRequest::default().check().is_ok());
        let e = lost("host2", false, false).check().unwrap_err().to_string();
        assert!(
            e.contains("--confirm-powered-off") && e.contains("two copies"),
            "{e}"
        );
        assert!(lost("host2", true, false).check().is_ok());
        assert!(
            lost("../x", true, false).check().is_err(),
            "a bad host name"
        );
        let e = lost("host2", true, true).check().unwrap_err().to_string();
        assert!(e.contains("one of the two"), "{e}");
        let only_confirm = ResolveRequest {
            confirm_powered_off: true,
            ..Default::default()
        };
        assert!(only_confirm
            .check()
            .unwrap_err()
            .to_string()
            .contains("--target-lost"));
        // unknown fields are refused by name
        let e = serde_json::from_str::<ResolveRequest>(r#"{"target_lost":"h","force":true}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("force"), "{e}");
    }
}
