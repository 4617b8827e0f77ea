//! Starting and stopping QEMU for one VM.
//!
//! A VM is one `qemu-system-x86_64` process with: the lab kernel booted
//! directly (`-kernel vmlinux`, PVH), the workload's parameters on the kernel
//! command line, the serial console written to `console.log`, and QMP on a
//! unix socket. A skeleton VM on a migration target is the same command line
//! plus `-incoming defer`, so both ends always agree on the device model.
//! QEMU gets `PR_SET_PDEATHSIG`: if the agent dies, its QEMUs die with it, so a
//! dead agent can never leave a half-migrated twin running.

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
    pub qmp: Qmp,
    child: tokio::sync::Mutex<tokio::process::Child>,
}

impl QemuVm {
    pub fn console_path(&self) -> PathBuf {
        self.dir.join("console.log")
    }

    /// True while the QEMU process has not exited.
    pub async fn alive(&self) -> bool {
        matches!(self.child.lock().await.try_wait(), Ok(None))
    }

    /// Asks QEMU to quit, then kills it if it has not exited within 3 s.
    pub async fn stop(&self) {
        let _ = self.qmp.quit().await;
        let mut child = self.child.lock().await;
        if tokio::time::timeout(Duration::from_secs(3), child.wait())
            .await
            .is_err()
        {
            let _ = child.kill().await;
        }
    }

    /// Kills QEMU at once (a skeleton being discarded) and reaps it.
    pub async fn kill(&self) {
        let _ = self.child.lock().await.kill().await;
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
        .stderr(log)
        .kill_on_drop(true);
    // SAFETY: prctl(PR_SET_PDEATHSIG) only sets a flag on the child; it is
    // async-signal-safe and touches no memory shared with the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|source| QemuError::Spawn {
        binary: cfg.binary.clone(),
        source,
    })?;
    let pid = child.id().unwrap_or(0);
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
        child: tokio::sync::Mutex::new(child),
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
