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

use ferry_api::VmSpec;

use crate::qmp::{Qmp, QmpError};

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
}

/// What a VM's directory says about it (`vm.json`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct VmRecord {
    pub spec: VmSpec,
    pub pid: u32,
    /// The process's start time (`/proc/PID/stat` field 22, clock ticks
    /// since boot): a pid reused by another process does not match.
    pub started: u64,
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
    }

    /// Kills QEMU at once (a skeleton being discarded) and waits until it is gone.
    pub async fn kill(&self) {
        match &mut *self.child.lock().await {
            Some(c) => {
                let _ = c.kill().await;
            }
            None => kill_verified(self.pid, self.started).await,
        }
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
    let f = crate::host::stat_fields(&stat)?;
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

fn kernel_cmdline(spec: &VmSpec) -> String {
    format!(
        "console=ttyS0 quiet ferry.fill={} ferry.dirty={} ferry.verify={} ferry.seed={}{}",
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

/// The QEMU arguments for a VM; identical on source and target but for `-incoming`.
pub fn qemu_args(cfg: &QemuConfig, spec: &VmSpec, dir: &Path, incoming: bool) -> Vec<String> {
    let p = |name: &str| dir.join(name).display().to_string();
    let mut a: Vec<String> = [
        "-name",
        &format!("guest={},debug-threads=on", spec.name),
        "-machine",
        "q35",
        "-accel",
        &cfg.accel,
        "-cpu",
        "qemu64",
        "-smp",
        &spec.vcpus.to_string(),
        "-m",
        &format!("{}M", spec.memory >> 20),
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-kernel",
        &cfg.kernel.display().to_string(),
        "-initrd",
        &cfg.initrd.display().to_string(),
        "-append",
        &kernel_cmdline(spec),
        "-chardev",
        &format!("file,id=con0,path={}", p("console.log")),
        "-serial",
        "chardev:con0",
        "-qmp",
        &format!("unix:{},server=on,wait=off", p("qmp.sock")),
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
    .map(|s| s.to_string())
    .collect();
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
        let Ok((host, port, export)) = d.parse_uri() else {
            continue; // refused by VmSpec::validate before any launch
        };
        let blockdev = serde_json::json!({
            "driver": "raw",
            "node-name": format!("disk{i}"),
            "file": {
                "driver": "nbd",
                "server": {"type": "inet", "host": host, "port": port.to_string()},
                "export": export,
            },
        });
        a.extend([
            "-blockdev".to_string(),
            blockdev.to_string(),
            "-device".to_string(),
            format!("virtio-blk-pci,drive=disk{i},id=vd{i},bus=rp{i}"),
        ]);
    }
    // every run-state change goes to qemu.log ("vm_state_notify running 1"):
    // the record of whether, and when, a guest's vCPUs ran on this host
    a.extend(["-trace".to_string(), "enable=vm_state_notify".to_string()]);
    if incoming {
        // a skeleton stays paused after the memory has arrived: its vCPUs
        // start only on the commit's RUN (see `commit`)
        a.extend([
            "-S".to_string(),
            "-incoming".to_string(),
            "defer".to_string(),
        ]);
    }
    a
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
    let mut cmd = tokio::process::Command::new(&cfg.binary);
    cmd.args(qemu_args(cfg, spec, dir, incoming))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    // its own session: a signal to the agent's process group (a terminal's
    // ^C, a service manager stopping the agent) never reaches the guest
    // SAFETY: setsid(2) only changes the child's own session; it is
    // async-signal-safe and touches no memory shared with the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|source| QemuError::Spawn {
        binary: cfg.binary.clone(),
        source,
    })?;
    let pid = child.id().unwrap_or(0);
    let record = VmRecord {
        spec: spec.clone(),
        pid,
        started: start_time(pid).unwrap_or(0),
    };
    if let Err(e) = write_record(dir, &record) {
        let _ = child.kill().await;
        return Err(e);
    }
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
    Ok(QemuVm {
        dir: dir.into(),
        pid,
        qmp,
        started: record.started,
        child: tokio::sync::Mutex::new(Some(child)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> QemuConfig {
        QemuConfig {
            binary: "qemu".into(),
            accel: "tcg".into(),
            kernel: "/k".into(),
            initrd: "/i".into(),
        }
    }

    fn spec() -> VmSpec {
        VmSpec {
            name: "vm1".into(),
            memory: 1 << 30,
            fill: 768 << 20,
            dirty_rate: 20 << 20,
            verify_rate: 32 << 20,
            seed: 7,
            vcpus: 1,
            disks: Vec::new(),
            compressible: false,
        }
    }

    #[test]
    fn skeleton_differs_only_by_incoming() {
        let d = Path::new("/d");
        let src = qemu_args(&cfg(), &spec(), d, false);
        let dst = qemu_args(&cfg(), &spec(), d, true);
        assert_eq!(&dst[..src.len()], &src[..]);
        assert_eq!(&dst[src.len()..], ["-S", "-incoming", "defer"]);
    }

    #[test]
    fn workload_parameters_reach_the_kernel_cmdline() {
        let a = qemu_args(&cfg(), &spec(), Path::new("/d"), false);
        let line = &a[a.iter().position(|x| x == "-append").unwrap() + 1];
        assert!(
            line.contains("ferry.fill=805306368") && line.contains("ferry.seed=7"),
            "{line}"
        );
        assert!(a.contains(&"1024M".to_string()));
    }
}
