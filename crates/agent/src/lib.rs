//! Ferry's per-host agent.
//!
//! One agent runs on every host (in the lab: inside each host's network
//! namespace). It owns the host's QEMU processes and its memory budget, and it
//! carries out live migrations with peer agents:
//!
//! - [`qmp`]: typed QMP commands over the `qapi` crate, each with a deadline.
//! - [`qemu`]: starting/stopping one VM's QEMU; skeletons for migration targets.
//! - [`host`]: the host's state: VMs, reservations, NICs, the guest check.
//! - [`migration`]: the steps, source and target side, around the commit point.
//! - [`commit`]: the commit point: who may run the guest, decided and journaled.
//! - [`io_priority`]: the switch-over's records flushed at the real-time I/O class.
//! - [`guest`]: the guest check's seam (what a guest's console says).
//! - [`recover`]: at start, the QEMUs left running and the open migrations taken back.
//! - [`failpoint`]: faults injected on purpose at named steps (tests).
//! - [`convergence`]: will pre-copy converge, and when (a pure model).
//! - [`datapath`]: the seam where a migration's bytes leave QEMU (today QEMU's
//!   own TCP stream over one NIC; Ferry's multi-NIC transport plugs in here).
//! - [`probe`]: which local NIC reaches which NIC of a peer, measured.
//! - [`classes`]: bandwidth per traffic class, enforced with HTB on each NIC.
//! - [`validate`]: facts and probes for `ferry host validate`.
//! - [`api`]: the authenticated HTTP API the control service and peer agents call.

pub mod api;
pub mod bandwidth;
pub mod classes;
pub mod commit;
pub mod confine;
pub mod convergence;
pub mod datapath;
pub mod downtime;
pub mod facts;
pub mod failpoint;
pub mod fence;
pub mod grants;
pub mod guest;
pub mod hardware;
pub mod host;
pub mod io_priority;
pub mod lease;
pub mod local_disk;
pub mod migration;
pub mod peers;
pub mod probe;
pub mod qemu;
pub mod qga;
pub mod qmp;
pub mod recover;
pub mod resilience;
pub mod validate;
pub mod vm_disks;
pub mod vms;

use std::path::PathBuf;

pub use facts::{Ipv4Net, NicSelection};

/// Everything an agent is started with (`ferry agent …`).
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub name: String,
    pub listen: std::net::SocketAddr,
    /// This agent's own URL as peers reach it.
    pub url: String,
    pub state_dir: PathBuf,
    /// Memory this host offers to VMs, bytes.
    pub memory: u64,
    /// The rate this host's NICs are rated at, bit/s (when sysfs cannot tell).
    pub nic_rate: Option<u64>,
    pub qemu: qemu::QemuConfig,
    /// The interfaces that carry live migrations.
    pub nics: NicSelection,
    /// Where this agent answers NIC probes (every address).
    pub probe_port: u16,
    /// A NIC for storage traffic (NBD), if separate; its traffic classes
    /// are managed with the migration NICs'.
    pub storage_nic: Option<String>,
    /// The CPU models this host offers guests (None: every model QEMU can
    /// run here), for clusters kept to a common baseline.
    pub cpu_models: Option<Vec<String>>,
    /// Drive directories, kernel directories and bridges guests may use.
    pub grants: grants::Grants,
    /// A guest's console log is rotated past this many bytes (see
    /// [`guest::rotate`]).
    pub console_log_max: u64,
    /// A VM paused for its storage this long is stopped (see [`resilience`]).
    pub storage_pause_max: std::time::Duration,
    /// What the API takes from its clients (`[limits]` in agent.toml).
    pub limits: ferry_net::server::Limits,
    /// Bytes one transport stream may hold out of order (`reorder_window`).
    pub reorder_window: u64,
}

pub use host::Agent;
