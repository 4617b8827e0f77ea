//! Starting and stopping QEMU for one VM.
//!
//! A VM is one `qemu-system-x86_64` process with: the lab kernel booted
//! directly (`-kernel vmlinux`, PVH), the workload's parameters on the kernel
//! command line, the serial console written to `console.log`, and QMP on a
//! unix socket. A skeleton VM on a migration target is the same command line
//! plus `-incoming defer`, so both ends always agree on the device model.
//!
//! QEMU outlives the agent: it runs in its own session (`setsid`), is never
//! killed when the agent exits, and leaves in its directory everything a
//! restarted agent needs to take it back ([`adopt`]): `vm.json` (the spec,
//! the pid and the process's start time, so a recycled pid is never taken
//! for it), `qemu.pid` and the QMP socket. Which copy of a migrating guest
//! may run is decided by the journal, not by processes dying together (see
//! [`crate::commit`] and `Agent::recover`).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use ferry_api::hardware::Board;
use ferry_api::VmSpec;

use crate::qmp::{Qmp, QmpError};

/// QEMU's run state for a VM stopped by a disk's error policy.
pub const IO_ERROR: &str = "io-error";

#[derive(Debug, thiserror::Error)]
pub enum QemuError {
    #[error("Cannot prepare VM directory {path}")]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("Cannot start {binary}")]
    Spawn {
        binary: String,
        #[source]
        source: std::io::Error,
    },
    #[error("QEMU exited during start-up: {log}")]
    Exited { log: String },
    #[error("Cannot record the VM in {path}")]
    Record {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{dir}: {why}")]
    NotAdoptable { dir: PathBuf, why: String },
    #[error("Cannot build the cloud-init seed: {0}")]
    Seed(String),
    #[error("Cannot confine QEMU: {0}")]
    Confine(String),
    #[error("Cannot put tap {tap} on bridge {bridge}: {why}")]
    Tap {
        tap: String,
        bridge: String,
        why: String,
    },
    #[error(transparent)]
    Qmp(#[from] QmpError),
}

/// How this host runs QEMU.
#[derive(Debug, Clone)]
pub struct QemuConfig {
    pub binary: String,
    /// `tcg` or `kvm`.
    pub accel: String,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    /// UEFI firmware for `firmware = "uefi"` guests.
    pub ovmf: crate::hardware::Ovmf,
    /// The host's certificate directory: every NBD disk is opened over TLS
    /// with it (QEMU object `tls-creds-x509` [`NBD_TLS`]); `None` under
    /// `--insecure-http`.
    pub tls_dir: Option<PathBuf>,
    /// How long a guest's I/O waits for a lost NBD connection before the
    /// guest is paused for its storage (QEMU's NBD `reconnect-delay`).
    pub storage_pause_after: Duration,
    /// Where local drives live: `local_disks/VM/NAME` (the agent's
    /// `STATE_DIR/disks`).
    pub local_disks: PathBuf,
    /// Each QEMU confined (see [`crate::confine`]); `None`: QEMU runs as
    /// the agent's user (`confine_qemu = false`).
    pub confine: Option<crate::confine::Confinement>,
}

impl QemuConfig {
    /// QEMU as `qemu` under TCG, no TLS and no confinement, local drives
    /// in `local_disks`: for tests that start no QEMU.
    #[cfg(test)]
    pub(crate) fn for_tests(local_disks: PathBuf) -> QemuConfig {
        QemuConfig {
            tls_dir: None,
            binary: "qemu".into(),
            accel: "tcg".into(),
            kernel: "/k".into(),
            initrd: "/i".into(),
            ovmf: Default::default(),
            storage_pause_after: STORAGE_PAUSE_AFTER,
            local_disks,
            confine: None,
        }
    }

    /// The file of local drive `name` of VM `vm`.
    pub fn local_disk(&self, vm: &str, name: &str) -> PathBuf {
        self.local_disks.join(vm).join(name)
    }
}

/// The id of QEMU's TLS credentials for NBD.
pub const NBD_TLS: &str = "ferry-tls";
/// A confined QEMU's copy of the NBD client credentials, in its directory.
pub const NBD_TLS_DIR: &str = "nbd-tls";

/// How long a guest's disk I/O waits for a lost NBD connection by default
/// (QEMU reconnects on its own and reruns what was in flight) before the
/// guest is paused for its storage (see [`crate::resilience`]).
pub const STORAGE_PAUSE_AFTER: Duration = Duration::from_secs(5);

/// The error policy of every disk device: a failed request stops the VM
/// (run state `io-error`) and is kept for a retry on `cont`; the guest
/// never sees the error (see [`crate::resilience`]).
pub const DISK_ERROR_POLICY: &str = "werror=stop,rerror=stop";

/// An NBD blockdev `file` node for `host:port`/`export`, over TLS when the
/// host has a certificate, reconnecting for [`QemuConfig::storage_pause_after`].
pub fn nbd_node(cfg: &QemuConfig, host: &str, port: u16, export: &str) -> serde_json::Value {
    let mut n = serde_json::json!({
        "driver": "nbd",
        "server": {"type": "inet", "host": host, "port": port.to_string()},
        "export": export,
        "reconnect-delay": cfg.storage_pause_after.as_secs().max(1),
    });
    if cfg.tls_dir.is_some() {
        n["tls-creds"] = NBD_TLS.into();
    }
    n
}

/// Where one of a VM's block nodes reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backing {
    Nbd {
        host: String,
        port: u16,
        export: String,
    },
    /// A file on this host (shared storage).
    File(String),
    /// A local drive: a file of this host's own (`QemuConfig::local_disk`).
    Local { vm: String, name: String },
}

/// One block node Ferry gives a VM: `disk{i}` for each Ferry disk plugged
/// (raw over NBD), `drive{i}` for each drive of a user's VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockNode {
    pub name: String,
    pub driver: &'static str,
    pub read_only: bool,
    pub backing: Backing,
}

impl BlockNode {
    /// Disk `i` of the spec's plugged disks; `None` for a URI
    /// `VmSpec::validate` refuses before any launch.
    pub fn disk(i: usize, d: &ferry_api::DiskPlug) -> Option<BlockNode> {
        let (host, port, export) = d.parse_uri().ok()?;
        Some(BlockNode {
            name: format!("disk{i}"),
            driver: "raw",
            read_only: false,
            backing: Backing::Nbd { host, port, export },
        })
    }

    /// Drive `i` of a user's VM; `None` for a Ferry disk the control
    /// service did not resolve.
    pub fn drive(i: usize, d: &ferry_api::hardware::Drive, vm: &str) -> Option<BlockNode> {
        let backing = match (&d.nbd, &d.path, &d.local) {
            (Some(uri), _, _) => {
                let (host, port, export) = ferry_api::parse_nbd_uri(uri).ok()?;
                Backing::Nbd { host, port, export }
            }
            (None, Some(p), _) => Backing::File(p.clone()),
            (None, None, Some(name)) => Backing::Local {
                vm: vm.to_string(),
                name: name.clone(),
            },
            (None, None, None) => return None,
        };
        Some(BlockNode {
            name: format!("drive{i}"),
            driver: d.format.as_str(),
            read_only: d.readonly,
            backing,
        })
    }

    /// Its `file` child: an NBD node ([`nbd_node`]) or a local file.
    pub fn file(&self, cfg: &QemuConfig) -> serde_json::Value {
        match &self.backing {
            Backing::Nbd { host, port, export } => nbd_node(cfg, host, *port, export),
            Backing::File(p) => serde_json::json!({"driver": "file", "filename": p}),
            Backing::Local { vm, name } => serde_json::json!({
                "driver": "file",
                "filename": cfg.local_disk(vm, name).display().to_string(),
            }),
        }
    }

    /// The whole `-blockdev` node. A qcow2 image's backing file is never
    /// opened: the name in its header is the image writer's, not a grant
    /// of this host (see [`crate::grants`]).
    pub fn blockdev(&self, cfg: &QemuConfig) -> serde_json::Value {
        let mut n = serde_json::json!({
            "driver": self.driver,
            "node-name": self.name,
            "read-only": self.read_only,
            "file": self.file(cfg),
        });
        if self.driver == "qcow2" {
            n["backing"] = serde_json::Value::Null;
        }
        n
    }
}

/// Every block node of a VM, disks then drives.
pub fn block_nodes(spec: &VmSpec) -> Vec<BlockNode> {
    let disks = spec
        .disks
        .iter()
        .enumerate()
        .filter_map(|(i, d)| BlockNode::disk(i, d));
    let drives = spec
        .drives
        .iter()
        .enumerate()
        .filter_map(|(i, d)| BlockNode::drive(i, d, &spec.name));
    disks.chain(drives).collect()
}

/// A running QEMU and its QMP session.
pub struct QemuVm {
    pub dir: PathBuf,
    pub pid: u32,
    /// The process's start time (see [`VmRecord::started`]).
    started: u64,
    pub qmp: Qmp,
    /// This agent's child (reaped by it), or `None` for a QEMU adopted from
    /// an agent that ran before it.
    child: tokio::sync::Mutex<Option<tokio::process::Child>>,
    /// The uid and gid QEMU runs as, when confined.
    pub owner: Option<(u32, u32)>,
    /// Its cgroup (below each controller's root), when confined.
    cgroup: Option<PathBuf>,
    /// Its uid and seccomp filtering as read once they were final (see
    /// [`QemuVm::confinement`]).
    confined: std::sync::OnceLock<(u32, bool)>,
}

/// What a VM's directory says about it (`vm.json`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct VmRecord {
    pub spec: VmSpec,
    pub pid: u32,
    /// The process's start time (`/proc/PID/stat` field 22, clock ticks
    /// since boot): a pid reused by another process does not match.
    pub started: u64,
    /// Confined: the uid and gid QEMU runs as.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<(u32, u32)>,
    /// Confined: its cgroup, below each controller's root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<PathBuf>,
}

pub const RECORD_FILE: &str = "vm.json";

impl QemuVm {
    pub fn console_path(&self) -> PathBuf {
        self.dir.join("console.log")
    }

    /// True while the QEMU process has not exited.
    pub async fn alive(&self) -> bool {
        match &mut *self.child.lock().await {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => start_time(self.pid) == Some(self.started),
        }
    }

    /// Asks QEMU to quit, then kills it if it has not exited within 3 s.
    pub async fn stop(&self) {
        let _ = self.qmp.quit().await;
        if !self.wait_gone(Duration::from_secs(3)).await {
            self.kill().await;
        }
        self.leave_cgroup();
    }

    fn leave_cgroup(&self) {
        if let Some(g) = &self.cgroup {
            crate::confine::leave_cgroup(g);
        }
    }

    /// Kills QEMU at once (a skeleton being discarded) and waits until it is gone.
    pub async fn kill(&self) {
        match &mut *self.child.lock().await {
            Some(c) => {
                let _ = c.kill().await;
            }
            None => kill_verified(self.pid, self.started).await,
        }
        self.leave_cgroup();
    }

    /// Waits up to `wait` for the process to exit; true once it has.
    async fn wait_gone(&self, wait: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if !self.alive().await {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Rewrites `vm.json` with `spec` (a disk was plugged).
    pub async fn record(&self, spec: &VmSpec) -> Result<(), QemuError> {
        write_record(
            &self.dir,
            &VmRecord {
                spec: spec.clone(),
                pid: self.pid,
                started: self.started,
                owner: self.owner,
                cgroup: self.cgroup.clone(),
            },
        )
    }
}

/// SIGKILLs process `pid` if it is still the one that started at `started`,
/// and waits (up to 5 s) until it is gone.
async fn kill_verified(pid: u32, started: u64) {
    if start_time(pid) != Some(started) {
        return;
    }
    // SAFETY: kill(2) with a pid checked to be this QEMU (its start time
    // matches) has no memory effects.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    for _ in 0..100 {
        if start_time(pid) != Some(started) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The start time of process `pid` (clock ticks since boot), `None` when
/// there is no such process or it has exited (a zombie).
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let f = crate::facts::stat_fields(&stat)?;
    // f[0] is field 3 (state); field 22 (starttime) is f[19]
    if f.first() == Some(&"Z") || f.first() == Some(&"X") {
        return None;
    }
    f.get(19)?.parse().ok()
}

/// Writes `vm.json` in `dir` (fsynced, then renamed into place).
fn write_record(dir: &Path, rec: &VmRecord) -> Result<(), QemuError> {
    use std::io::Write;
    let path = dir.join(RECORD_FILE);
    let tmp = dir.join(format!("{RECORD_FILE}.tmp"));
    let err = |source| QemuError::Record {
        path: path.clone(),
        source,
    };
    let body = serde_json::to_vec_pretty(rec).map_err(|e| err(e.into()))?;
    let mut f = std::fs::File::create(&tmp).map_err(err)?;
    f.write_all(&body).map_err(err)?;
    f.sync_all().map_err(err)?;
    std::fs::rename(&tmp, &path).map_err(err)
}

/// Reads `vm.json` in `dir`.
pub fn read_record(dir: &Path) -> Result<VmRecord, QemuError> {
    let path = dir.join(RECORD_FILE);
    let bad = |why: String| QemuError::NotAdoptable {
        dir: dir.into(),
        why,
    };
    let text = std::fs::read_to_string(&path).map_err(|e| bad(format!("{RECORD_FILE}: {e}")))?;
    serde_json::from_str(&text).map_err(|e| bad(format!("{RECORD_FILE}: {e}")))
}

/// Takes back the QEMU a previous agent started in `dir`: its process must
/// still be the one `vm.json` names, and its QMP must answer.
pub async fn adopt(dir: &Path) -> Result<(VmRecord, QemuVm), QemuError> {
    let rec = read_record(dir)?;
    let bad = |why: String| QemuError::NotAdoptable {
        dir: dir.into(),
        why,
    };
    match start_time(rec.pid) {
        Some(t) if t == rec.started => {}
        Some(_) => return Err(bad(format!("pid {} is another process now", rec.pid))),
        None => return Err(bad(format!("QEMU (pid {}) has exited", rec.pid))),
    }
    let qmp = Qmp::connect(&dir.join("qmp.sock"), Duration::from_secs(5)).await?;
    let vm = QemuVm {
        dir: dir.into(),
        pid: rec.pid,
        started: rec.started,
        qmp,
        child: tokio::sync::Mutex::new(None),
        owner: rec.owner,
        cgroup: rec.cgroup.clone(),
        confined: Default::default(),
    };
    Ok((rec, vm))
}

/// Kills the QEMU `vm.json` in `dir` names, if it still runs (a VM that
/// cannot be adopted, e.g. its QMP does not answer).
pub async fn kill_recorded(dir: &Path) {
    if let Ok(rec) = read_record(dir) {
        kill_verified(rec.pid, rec.started).await;
    }
}

/// The workload guest's kernel command line. `cryptomgr.notests`: the
/// kernel skips its crypto algorithms' self-tests at boot, which this guest
/// never relies on; under TCG they are a quarter of its boot (2.45 s to its
/// first tick without, 1.8 s with).
fn kernel_cmdline(spec: &VmSpec) -> String {
    format!(
        "console=ttyS0 quiet cryptomgr.notests ferry.fill={} ferry.dirty={} ferry.verify={} ferry.seed={}{}",
        spec.fill,
        spec.dirty_rate,
        spec.verify_rate,
        spec.seed,
        if spec.compressible {
            " ferry.compressible=1"
        } else {
            ""
        }
    )
}

/// The second QMP monitor's socket, in the VM's directory.
pub const HANDOFF_SOCK: &str = "handoff.sock";

/// The tap device of a VM's NIC `i`: made by QEMU (it lives as long as
/// QEMU does), put on its bridge by the agent. The name is the same on every
/// host, derived from the VM's name.
pub fn tap_name(vm: &str, i: usize) -> String {
    let mut h: u32 = 0x811c9dc5;
    for b in vm.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x01000193);
    }
    format!("fy{h:08x}n{i}")
}

/// The file name of a VM's UEFI variable store, in its directory.
pub const OVMF_VARS: &str = "OVMF_VARS.fd";
/// The cloud-init seed, in the VM's directory.
pub const SEED_ISO: &str = "seed.iso";
/// The guest agent's channel, in the VM's directory.
pub const QGA_SOCK: &str = "qga.sock";

/// How the guest boots: QEMU arguments for its firmware or kernel.
fn boot_args(cfg: &QemuConfig, spec: &VmSpec, dir: &Path) -> Vec<String> {
    use ferry_api::hardware::Firmware;
    match (spec.firmware, &spec.kernel) {
        (Firmware::Kernel, None) => vec![
            "-kernel".into(),
            cfg.kernel.display().to_string(),
            "-initrd".into(),
            cfg.initrd.display().to_string(),
            "-append".into(),
            kernel_cmdline(spec),
        ],
        (Firmware::Kernel, Some(k)) => {
            let mut a = vec!["-kernel".to_string(), k.kernel.clone()];
            if let Some(i) = &k.initrd {
                a.extend(["-initrd".to_string(), i.clone()]);
            }
            a.extend(["-append".to_string(), k.append.clone()]);
            a
        }
        (Firmware::Bios, _) => Vec::new(),
        (Firmware::Uefi, _) => vec![
            "-drive".into(),
            format!(
                "if=pflash,unit=0,format=raw,readonly=on,file={}",
                cfg.ovmf.code.display()
            ),
            "-drive".into(),
            format!(
                "if=pflash,unit=1,format=raw,file={}",
                dir.join(OVMF_VARS).display()
            ),
        ],
    }
}

/// Drives, NICs, the cloud-init seed and the guest agent's channel.
fn device_args(cfg: &QemuConfig, spec: &VmSpec, dir: &Path) -> Vec<String> {
    let mut a = Vec::new();
    for (i, d) in spec.drives.iter().enumerate() {
        let Some(node) = BlockNode::drive(i, d, &spec.name) else {
            continue;
        };
        // firmware boots the first drive (a direct kernel boot has its own)
        let boot = if i == 0 && spec.firmware != ferry_api::hardware::Firmware::Kernel {
            ",bootindex=0"
        } else {
            ""
        };
        a.extend([
            "-blockdev".to_string(),
            node.blockdev(cfg).to_string(),
            "-device".to_string(),
            format!("virtio-blk-pci,drive=drive{i},id=vdrive{i}{boot},{DISK_ERROR_POLICY}"),
        ]);
    }
    for (i, n) in spec.nics.iter().enumerate() {
        // confined, QEMU gets the tap the agent opened (see `crate::confine`)
        let tap = match cfg.confine {
            Some(_) => format!("tap,id=net{i},fd={}", crate::confine::TAP_FD + i as i32),
            None => format!(
                "tap,id=net{i},ifname={},script=no,downscript=no",
                tap_name(&spec.name, i)
            ),
        };
        a.extend([
            "-netdev".to_string(),
            tap,
            "-device".to_string(),
            format!("virtio-net-pci,netdev=net{i},mac={},id=nic{i}", n.mac),
        ]);
    }
    if spec.cloud_init.is_some() {
        let seed = serde_json::json!({
            "driver": "raw",
            "node-name": "seed",
            "read-only": true,
            "file": {"driver": "file", "filename": dir.join(SEED_ISO).display().to_string()},
        });
        a.extend([
            "-blockdev".to_string(),
            seed.to_string(),
            "-device".to_string(),
            "ide-cd,drive=seed,bus=ide.0,id=seedcd".to_string(),
        ]);
    }
    if spec.guest_agent {
        a.extend([
            "-chardev".to_string(),
            format!(
                "socket,id=qga0,path={},server=on,wait=off",
                dir.join(QGA_SOCK).display()
            ),
            "-device".to_string(),
            "virtio-serial-pci,id=vser0".to_string(),
            "-device".to_string(),
            "virtserialport,bus=vser0.0,chardev=qga0,name=org.qemu.guest_agent.0".to_string(),
        ]);
    }
    a
}

/// `-machine`: the spec's machine type with its board's devices (see
/// [`Board`]). A lean board keeps SATA only for a cloud-init seed's CD.
fn machine_arg(spec: &VmSpec) -> String {
    match spec.board.unwrap_or(Board::Full) {
        Board::Full => spec.machine.clone(),
        Board::Lean if spec.cloud_init.is_some() => {
            format!("{},smbus=off,vmport=off", spec.machine)
        }
        Board::Lean => format!("{},smbus=off,sata=off,vmport=off", spec.machine),
    }
}

/// The QEMU arguments for a VM; identical on source and target but for
/// `-incoming`. QEMU starts paused (`-S`): a new VM runs once its taps are
/// on their bridges, a skeleton on the commit's RUN.
pub fn qemu_args(cfg: &QemuConfig, spec: &VmSpec, dir: &Path, incoming: bool) -> Vec<String> {
    args_with(cfg, spec, dir, incoming, None)
}

/// Where the agent's QEMU finds its QMP socket, listening: the agent binds
/// `qmp.sock` and hands QEMU the socket at this descriptor, so the agent
/// connects at once (QEMU greets once it is up) instead of trying every
/// few milliseconds until QEMU has made the socket; later connections (an
/// agent restarted) use the path as before.
const QMP_FD: std::os::fd::RawFd = crate::confine::TAP_FD - 1;
// neither stdio nor a tap's
const _: () = assert!(QMP_FD > 2 && QMP_FD < crate::confine::TAP_FD);

/// [`qemu_args`], with QMP on a listening socket QEMU is handed at
/// `qmp_fd` (see [`QMP_FD`]) when given.
fn args_with(
    cfg: &QemuConfig,
    spec: &VmSpec,
    dir: &Path,
    incoming: bool,
    qmp_fd: Option<std::os::fd::RawFd>,
) -> Vec<String> {
    let p = |name: &str| dir.join(name).display().to_string();
    let mut a: Vec<String> = [
        "-name",
        &format!("guest={},debug-threads=on", spec.name),
        "-machine",
        &machine_arg(spec),
        "-accel",
        &cfg.accel,
        "-cpu",
        &spec.cpu,
        "-smp",
        &spec.vcpus.to_string(),
        "-m",
        &format!("{}M", spec.memory >> 20),
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(boot_args(cfg, spec, dir));
    if spec.board == Some(Board::Lean) {
        // no TPR patching (a device of its own, for 32-bit guests of CPUs
        // without TPR shadowing)
        a.extend(["-global".to_string(), "apic-common.vapic=off".to_string()]);
    }
    if let Some(t) = &cfg.tls_dir {
        // confined, QEMU reads its own credentials (see `give_vm`): a VM
        // certificate its agent signed, which QEMU's own check (chained to
        // the CA) would refuse; the storage node checks the chain
        let (t, check) = match cfg.confine {
            Some(_) => (dir.join(NBD_TLS_DIR), ",sanity-check=off"),
            None => (t.clone(), ""),
        };
        a.extend([
            "-object".to_string(),
            format!(
                "tls-creds-x509,id={NBD_TLS},dir={},endpoint=client,verify-peer=on{check}",
                t.display()
            ),
        ]);
    }
    if cfg.confine.is_some() {
        a.extend(["-sandbox".to_string(), crate::confine::SANDBOX.to_string()]);
    }
    a.extend(
        [
            "-chardev",
            // appended to, so that the agent can rotate it (see `guest::rotate`)
            &format!("file,id=con0,path={},append=on", p("console.log")),
            "-serial",
            "chardev:con0",
            "-pidfile",
            &p("qemu.pid"),
            // a second monitor for handing QEMU a socket (see `qmp::hand_socket`)
            "-chardev",
            &format!(
                "socket,id=handoff,path={},server=on,wait=off",
                p(HANDOFF_SOCK)
            ),
            "-mon",
            "chardev=handoff,mode=control",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    a.extend(match qmp_fd {
        Some(fd) => [
            "-chardev".to_string(),
            format!("socket,id=ferry-qmp,fd={fd},server=on,wait=off"),
            "-mon".to_string(),
            "chardev=ferry-qmp,mode=control".to_string(),
        ]
        .to_vec(),
        None => vec![
            "-qmp".to_string(),
            format!("unix:{},server=on,wait=off", p("qmp.sock")),
        ],
    });
    // hot-plug ports for disks (native PCIe hot-plug: the guest has no ACPI hot-plug)
    a.extend([
        "-global".to_string(),
        "ICH9-LPC.acpi-pci-hotplug-with-bridge-support=off".to_string(),
    ]);
    for i in 0..ferry_api::MAX_VM_DISKS {
        a.extend([
            "-device".to_string(),
            format!(
                "pcie-root-port,id=rp{i},bus=pcie.0,chassis={},slot={}",
                i + 1,
                i + 1
            ),
        ]);
    }
    for (i, d) in spec.disks.iter().enumerate() {
        let Some(node) = BlockNode::disk(i, d) else {
            continue; // refused by VmSpec::validate before any launch
        };
        a.extend([
            "-blockdev".to_string(),
            node.blockdev(cfg).to_string(),
            "-device".to_string(),
            format!("virtio-blk-pci,drive=disk{i},id=vd{i},bus=rp{i},{DISK_ERROR_POLICY}"),
        ]);
    }
    a.extend(device_args(cfg, spec, dir));
    // every run-state change goes to qemu.log ("vm_state_notify running 1"),
    // stamped with the wall clock: the record of whether, and when, a
    // guest's vCPUs ran on this host
    a.extend(["-trace".to_string(), "enable=vm_state_notify".to_string()]);
    a.extend(["-msg".to_string(), "timestamp=on".to_string()]);
    a.push("-S".to_string());
    if incoming {
        // a skeleton stays paused after the memory has arrived: its vCPUs
        // start only on the commit's RUN (see `commit`)
        a.extend(["-incoming".to_string(), "defer".to_string()]);
    }
    a
}

/// Writes the cloud-init NoCloud seed (an ISO 9660 image labelled
/// `cidata`) into `dir`.
fn write_seed(c: &ferry_api::hardware::CloudInit, dir: &Path) -> Result<(), QemuError> {
    let src = dir.join("seed");
    let io = |e: std::io::Error| QemuError::Seed(format!("{}: {e}", src.display()));
    std::fs::create_dir_all(&src).map_err(io)?;
    std::fs::write(src.join("user-data"), &c.user_data).map_err(io)?;
    std::fs::write(src.join("meta-data"), &c.meta_data).map_err(io)?;
    let mut files = vec!["user-data", "meta-data"];
    if let Some(n) = &c.network_config {
        std::fs::write(src.join("network-config"), n).map_err(io)?;
        files.push("network-config");
    }
    let out = dir.join(SEED_ISO).display().to_string();
    let mut tried = Vec::new();
    for (tool, pre) in [("genisoimage", vec![]), ("xorriso", vec!["-as", "mkisofs"])] {
        let r = std::process::Command::new(tool)
            .args(pre)
            .args([
                "-quiet", "-output", &out, "-volid", "cidata", "-joliet", "-rock",
            ])
            .args(&files)
            .current_dir(&src)
            .output();
        match r {
            Ok(o) if o.status.success() => return Ok(()),
            Ok(o) => tried.push(format!(
                "{tool}: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(e) => tried.push(format!("{tool}: {e}")),
        }
    }
    Err(QemuError::Seed(format!(
        "no ISO writer worked (install genisoimage): {}",
        tried.join("; ")
    )))
}

/// Puts VM NIC taps on their bridges (with the bridge's MTU), up.
async fn plug_taps(spec: &VmSpec) -> Result<(), QemuError> {
    for (i, n) in spec.nics.iter().enumerate() {
        let tap = tap_name(&spec.name, i);
        let mtu = std::fs::read_to_string(format!("/sys/class/net/{}/mtu", n.bridge))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "1500".into());
        let out = tokio::process::Command::new("ip")
            .args([
                "link", "set", "dev", &tap, "master", &n.bridge, "mtu", &mtu, "up",
            ])
            .output()
            .await;
        let why = match out {
            Ok(o) if o.status.success() => continue,
            Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_string(),
            Err(e) => format!("running ip: {e}"),
        };
        return Err(QemuError::Tap {
            tap,
            bridge: n.bridge.clone(),
            why,
        });
    }
    Ok(())
}

/// Starts QEMU for `spec` in `dir` (created fresh) and connects QMP.
pub async fn launch(
    cfg: &QemuConfig,
    spec: &VmSpec,
    dir: &Path,
    incoming: bool,
) -> Result<QemuVm, QemuError> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).map_err(|source| QemuError::Dir {
        path: dir.into(),
        source,
    })?;
    let log = std::fs::File::create(dir.join("qemu.log")).map_err(|source| QemuError::Dir {
        path: dir.into(),
        source,
    })?;
    if let Some(c) = &spec.cloud_init {
        write_seed(c, dir)?;
    }
    if spec.firmware == ferry_api::hardware::Firmware::Uefi {
        std::fs::copy(&cfg.ovmf.vars, dir.join(OVMF_VARS)).map_err(|source| QemuError::Dir {
            path: cfg.ovmf.vars.clone(),
            source,
        })?;
    }
    let confined = match &cfg.confine {
        Some(c) => {
            let parent = dir.parent().unwrap_or(dir);
            let uid = crate::confine::allocate_uid(recorded_uids(parent), c.uid_base)
                .map_err(confine_err)?;
            let given = give_vm(cfg, spec, dir, (uid, uid));
            match given {
                Ok(taps) => Some((c, (uid, uid), taps)),
                Err(e) => {
                    crate::confine::settled(uid);
                    return Err(e);
                }
            }
        }
        None => None,
    };
    let spawned = spawn(cfg, spec, dir, incoming, log, confined.as_ref());
    if let Some((_, (uid, _), _)) = &confined {
        crate::confine::settled(*uid);
    }
    let (mut child, record) = spawned?;
    let pid = record.pid;
    let sock = dir.join("qmp.sock");
    let qmp = tokio::select! {
        r = Qmp::connect(&sock, Duration::from_secs(10)) => r,
        _ = child.wait() => {
            let log = std::fs::read_to_string(dir.join("qemu.log")).unwrap_or_default();
            return Err(QemuError::Exited { log: log.trim().chars().take(500).collect() });
        }
    };
    let qmp = match qmp {
        Ok(q) => q,
        Err(e) => {
            let _ = child.kill().await;
            return Err(e.into());
        }
    };
    let ready = async {
        plug_taps(spec).await?;
        if !incoming {
            qmp.cont().await?;
        }
        Ok::<_, QemuError>(())
    };
    if let Err(e) = ready.await {
        let _ = child.kill().await;
        return Err(e);
    }
    Ok(QemuVm {
        dir: dir.into(),
        pid,
        qmp,
        started: record.started,
        child: tokio::sync::Mutex::new(Some(child)),
        owner: record.owner,
        cgroup: record.cgroup,
        confined: Default::default(),
    })
}

impl QemuVm {
    /// The uid QEMU runs as and whether seccomp filters it
    /// ([`crate::confine::is_confined`]); `None` once it has exited. A
    /// process that is not root and filtered stays so (a filter is never
    /// lifted, and it cannot regain uid 0), so that answer is read from
    /// `/proc/PID/status` once; any other is read again each time.
    pub fn confinement(&self) -> Option<(u32, bool)> {
        if let Some(c) = self.confined.get() {
            return std::path::Path::new(&format!("/proc/{}", self.pid))
                .exists()
                .then_some(*c);
        }
        let c = crate::confine::is_confined(self.pid)?;
        if c.0 != 0 && c.1 {
            let _ = self.confined.set(c);
        }
        Some(c)
    }

    /// Lets this VM's QEMU connect to the unix socket at `path`, which the
    /// agent listens on (a migration's or a disk copy's local end).
    pub fn give_socket(&self, path: &Path) -> Result<(), String> {
        match self.owner {
            Some(o) => crate::confine::give(path, o, 0o600).map_err(|e| e.to_string()),
            None => Ok(()),
        }
    }
}

/// The QEMU uids the VM directories in `vms` record.
fn recorded_uids(vms: &Path) -> std::collections::BTreeSet<u32> {
    std::fs::read_dir(vms)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| read_record(&e.path()).ok()?.owner.map(|(uid, _)| uid))
        .collect()
}

fn confine_err(e: crate::confine::ConfineError) -> QemuError {
    QemuError::Confine(e.to_string())
}

/// Gives a confined VM's QEMU (`owner`) what it uses: its directory, its
/// drives, its copy of the NBD client credentials; opens its taps.
fn give_vm(
    cfg: &QemuConfig,
    spec: &VmSpec,
    dir: &Path,
    owner: (u32, u32),
) -> Result<Vec<std::os::fd::OwnedFd>, QemuError> {
    use crate::confine::{give, traversable};
    let e = confine_err;
    // QEMU passes through the VMs' directory to its own, lists nothing
    for d in dir.ancestors().skip(1).take(2) {
        traversable(d).map_err(e)?;
    }
    if let Some(t) = &cfg.tls_dir {
        let copy = dir.join(NBD_TLS_DIR);
        std::fs::create_dir_all(&copy).map_err(|source| QemuError::Dir {
            path: copy.clone(),
            source,
        })?;
        // its own key and a certificate naming this VM, signed by the
        // agent: it opens this VM's disks and nothing else
        ferry_net::tls::Pki::load(t)
            .and_then(|p| p.vm_credentials(&spec.name, &copy))
            .map_err(|e| QemuError::Confine(format!("the VM's NBD certificate: {e}")))?;
        for f in ["ca-cert.pem", "client-cert.pem", "client-key.pem"] {
            give(&copy.join(f), owner, 0o600).map_err(e)?;
        }
        give(&copy, owner, 0o700).map_err(e)?;
    }
    for entry in std::fs::read_dir(dir).map_err(|source| QemuError::Dir {
        path: dir.into(),
        source,
    })? {
        let p = entry
            .map_err(|source| QemuError::Dir {
                path: dir.into(),
                source,
            })?
            .path();
        if p.is_file() {
            give(&p, owner, 0o600).map_err(e)?;
        }
    }
    give(dir, owner, 0o700).map_err(e)?;
    for (i, d) in spec.drives.iter().enumerate() {
        let Some(node) = BlockNode::drive(i, d, &spec.name) else {
            continue;
        };
        let file = match node.backing {
            Backing::File(f) => PathBuf::from(f),
            Backing::Local { vm, name } => {
                let f = cfg.local_disk(&vm, &name);
                // through the disks' directory and the VM's, as to its own directory
                for d in f.ancestors().skip(1).take(2) {
                    traversable(d).map_err(e)?;
                }
                f
            }
            _ => continue,
        };
        give(&file, owner, if node.read_only { 0o400 } else { 0o600 }).map_err(e)?;
    }
    spec.nics
        .iter()
        .enumerate()
        .map(|(i, _)| crate::confine::open_tap(&tap_name(&spec.name, i)).map_err(e))
        .collect()
}

/// Starts the QEMU process (confined: as its user, with its taps, in its
/// cgroup) and writes its record.
fn spawn(
    cfg: &QemuConfig,
    spec: &VmSpec,
    dir: &Path,
    incoming: bool,
    log: std::fs::File,
    confined: Option<&(
        &crate::confine::Confinement,
        (u32, u32),
        Vec<std::os::fd::OwnedFd>,
    )>,
) -> Result<(tokio::process::Child, VmRecord), QemuError> {
    use std::os::fd::{AsFd, AsRawFd};
    let qmp_path = dir.join("qmp.sock");
    let _ = std::fs::remove_file(&qmp_path);
    let setup = |what: String| {
        move |source| QemuError::Spawn {
            binary: format!("{} ({what})", cfg.binary),
            source,
        }
    };
    // each descriptor the child puts at a fixed number is first copied
    // above those numbers: no dup2 there overwrites one still to be placed
    // (the listener bound here is closed as soon as it is copied)
    let qmp = std::os::unix::net::UnixListener::bind(&qmp_path)
        .and_then(|l| above_placed(l.as_fd()))
        .map_err(setup(format!("its QMP socket {}", qmp_path.display())))?;
    let taps: Vec<std::os::fd::OwnedFd> = confined
        .map(|(_, _, t)| t.iter().map(|f| above_placed(f.as_fd())).collect())
        .transpose()
        .map_err(setup("its taps' copies".into()))?
        .unwrap_or_default();
    let qmp_fd = qmp.as_raw_fd();
    let mut cmd = tokio::process::Command::new(&cfg.binary);
    cmd.args(args_with(cfg, spec, dir, incoming, Some(QMP_FD)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    let owner = confined.map(|(_, o, _)| *o);
    let groups: Vec<libc::gid_t> = match confined {
        Some(_) => crate::confine::device_groups(),
        None => Vec::new(),
    };
    let tap_fds: Vec<i32> = taps.iter().map(|f| f.as_raw_fd()).collect();
    // its own session: a signal to the agent's process group (a terminal's
    // ^C, a service manager stopping the agent) never reaches the guest;
    // confined, its taps at their numbers and its own user
    // SAFETY: between fork and exec only async-signal-safe calls (setsid,
    // dup2, setgroups, setgid, setuid) on values computed before the fork.
    unsafe {
        cmd.pre_exec(move || {
            libc::setsid();
            // dup2 leaves the new descriptor without close-on-exec
            if libc::dup2(qmp_fd, QMP_FD) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            for (i, fd) in tap_fds.iter().enumerate() {
                if libc::dup2(*fd, crate::confine::TAP_FD + i as i32) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if let Some((uid, gid)) = owner {
                if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setgid(gid) != 0
                    || libc::setuid(uid) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|source| QemuError::Spawn {
        binary: cfg.binary.clone(),
        source,
    })?;
    // QEMU holds its copies
    drop((qmp, taps));
    let pid = child.id().unwrap_or(0);
    let cgroup = confined.map(|(c, ..)| c.cgroup.join(&spec.name));
    if let Some(g) = &cgroup {
        if let Err(e) = crate::confine::join_cgroup(g, spec, pid) {
            let _ = child.start_kill();
            return Err(confine_err(e));
        }
    }
    let record = VmRecord {
        spec: spec.clone(),
        pid,
        started: start_time(pid).unwrap_or(0),
        owner,
        cgroup,
    };
    if let Err(e) = write_record(dir, &record) {
        let _ = child.start_kill();
        return Err(e);
    }
    Ok((child, record))
}

/// The least number [`above_placed`] copies a descriptor to: above
/// [`QMP_FD`] and every tap's (a VM takes at most 4 NICs).
const PLACED_BELOW: std::os::fd::RawFd = crate::confine::TAP_FD + 150;
const _: () = assert!(QMP_FD < PLACED_BELOW);

/// A copy of `fd` at [`PLACED_BELOW`] or above (closed on exec), so that
/// placing QEMU's descriptors at their numbers in the child never
/// overwrites one still to be placed: the agent's own descriptors may be
/// anywhere, a tap's at 99 or 101 among them.
fn above_placed(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) makes a new descriptor of a valid one
    // this process holds; the new one is owned by nothing else.
    let n = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, PLACED_BELOW) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above, `n` is a new descriptor owned here alone
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(n) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_to_place_are_copied_above_every_placed_number() {
        use std::os::fd::{AsFd, AsRawFd};
        let f = std::fs::File::open("/proc/self/stat").unwrap();
        let c = above_placed(f.as_fd()).unwrap();
        assert!(c.as_raw_fd() >= PLACED_BELOW && f.as_raw_fd() < PLACED_BELOW);
        // the same file, closed on exec
        // SAFETY: F_GETFD on a descriptor held by `c`
        let flags = unsafe { libc::fcntl(c.as_raw_fd(), libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
        let ino = |fd: i32| std::fs::metadata(format!("/proc/self/fd/{fd}")).unwrap();
        use std::os::unix::fs::MetadataExt as _;
        assert_eq!(ino(c.as_raw_fd()).ino(), ino(f.as_raw_fd()).ino());
    }

    fn cfg() -> QemuConfig {
        QemuConfig::for_tests("/state/disks".into())
    }

    fn spec() -> VmSpec {
        VmSpec {
            seed: 7,
            ..VmSpec::workload("vm1", 1 << 30, 768 << 20, 20 << 20)
        }
    }

    #[test]
    fn the_agents_qemu_gets_its_qmp_socket_handed_and_a_hand_run_one_its_path() {
        let d = Path::new("/d");
        let handed = args_with(&cfg(), &spec(), d, false, Some(QMP_FD)).join(" ");
        assert!(
            handed.contains(&format!(
                "-chardev socket,id=ferry-qmp,fd={QMP_FD},server=on,wait=off -mon chardev=ferry-qmp,mode=control"
            )),
            "{handed}"
        );
        assert!(!handed.contains(" -qmp "), "{handed}");
        let by_hand = qemu_args(&cfg(), &spec(), d, false).join(" ");
        assert!(
            by_hand.contains("-qmp unix:/d/qmp.sock,server=on,wait=off"),
            "{by_hand}"
        );
        assert!(!by_hand.contains("ferry-qmp"), "{by_hand}");
    }

    #[test]
    fn a_lean_board_leaves_out_the_chipsets_extras_and_a_board_less_spec_keeps_them() {
        let d = Path::new("/d");
        let args = |s: &VmSpec| qemu_args(&cfg(), s, d, false).join(" ");
        let lean = args(&spec());
        assert!(
            lean.contains("-machine q35,smbus=off,sata=off,vmport=off "),
            "{lean}"
        );
        assert!(lean.contains("-global apic-common.vapic=off"), "{lean}");
        // the hot-plug ports stay: disks are plugged into them while it runs
        assert_eq!(
            lean.matches("pcie-root-port").count(),
            ferry_api::MAX_VM_DISKS
        );
        // a VM created before boards had a name keeps QEMU's full q35
        // (a move's target must build what the source runs)
        for board in [None, Some(Board::Full)] {
            let full = args(&VmSpec { board, ..spec() });
            assert!(full.contains("-machine q35 "), "{full}");
            assert!(!full.contains("vapic") && !full.contains("sata="), "{full}");
        }
        // a cloud-init seed is a CD on the SATA controller
        let mut seeded = spec();
        seeded.cloud_init = Some(ferry_api::hardware::CloudInit {
            user_data: "#cloud-config\n".into(),
            meta_data: String::new(),
            network_config: None,
            redacted: false,
        });
        let seeded = args(&seeded);
        assert!(
            seeded.contains("-machine q35,smbus=off,vmport=off "),
            "{seeded}"
        );
        assert!(seeded.contains("bus=ide.0"), "{seeded}");
    }

    #[test]
    fn skeleton_differs_only_by_incoming() {
        let d = Path::new("/d");
        let src = qemu_args(&cfg(), &spec(), d, false);
        let dst = qemu_args(&cfg(), &spec(), d, true);
        assert_eq!(&dst[..src.len()], &src[..]);
        assert_eq!(&dst[src.len()..], ["-incoming", "defer"]);
        assert_eq!(src.last().unwrap(), "-S");
    }

    #[test]
    fn a_users_vm_gets_its_drives_nics_seed_and_agent() {
        use ferry_api::hardware::*;
        let mut s = VmSpec::workload("deb1", 512 << 20, 0, 0);
        s.cpu = "max".into();
        s.firmware = Firmware::Uefi;
        s.drives = vec![
            Drive {
                nbd: Some("nbd://198.18.0.1:10809/root/deb1".into()),
                format: DriveFormat::Qcow2,
                ..Default::default()
            },
            Drive {
                path: Some("/srv/shared/data.img".into()),
                readonly: true,
                ..Default::default()
            },
        ];
        s.nics = vec![GuestNic {
            bridge: "br-guest".into(),
            mac: "52:54:00:aa:00:01".into(),
        }];
        s.cloud_init = Some(CloudInit {
            user_data: "#cloud-config\n".into(),
            meta_data: "instance-id: deb1\n".into(),
            network_config: None,
            redacted: false,
        });
        s.guest_agent = true;
        let a = qemu_args(&cfg(), &s, Path::new("/d"), false).join(" ");
        for want in [
            "-cpu max",
            "if=pflash,unit=0,format=raw,readonly=on,file=/usr/share/OVMF/OVMF_CODE_4M.fd",
            "file=/d/OVMF_VARS.fd",
            r#""driver":"qcow2""#,
            r#""export":"root/deb1""#,
            "virtio-blk-pci,drive=drive0,id=vdrive0,bootindex=0,werror=stop,rerror=stop",
            r#""reconnect-delay":5"#,
            r#""filename":"/srv/shared/data.img""#,
            &format!("tap,id=net0,ifname={},script=no", tap_name("deb1", 0)),
            "virtio-net-pci,netdev=net0,mac=52:54:00:aa:00:01",
            "ide-cd,drive=seed,bus=ide.0",
            "name=org.qemu.guest_agent.0",
        ] {
            assert!(a.contains(want), "{want} not in {a}");
        }
        assert!(!a.contains("-kernel"), "{a}");
        assert!(tap_name("a-thirty-two-character-vm-name-x", 3).len() <= 15);
    }

    #[test]
    fn workload_parameters_reach_the_kernel_cmdline() {
        let a = qemu_args(&cfg(), &spec(), Path::new("/d"), false);
        let line = &a[a.iter().position(|x| x == "-append").unwrap() + 1];
        assert!(
            line.contains("ferry.fill=805306368")
                && line.contains("ferry.seed=7")
                && line.contains("cryptomgr.notests"),
            "{line}"
        );
        assert!(a.contains(&"1024M".to_string()));
    }
}
