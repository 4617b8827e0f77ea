//! Each VM's QEMU confined: a user of its own, seccomp, a cgroup of its own.
//!
//! A guest that escapes its QEMU gets what that process has, so the process
//! has little:
//! - **Its own unprivileged user.** Each VM's QEMU runs as a uid of its own
//!   (`uid_base + n`, the lowest no other VM directory of this host records;
//!   the gid is the same number), never 0. What the VM uses is given to that
//!   uid alone: its directory (0700), its local drives and `path` drives
//!   (0600), the copy of the NBD client credentials it opens its disks with,
//!   the move's TLS key. Another VM's files are another uid's, mode 0600.
//! - **Taps passed as file descriptors.** The agent opens each tap
//!   (`/dev/net/tun`, `TUNSETIFF`) and QEMU inherits it (`-netdev
//!   tap,fd=N`): QEMU needs no `CAP_NET_ADMIN`.
//! - **seccomp** (`-sandbox on` with obsolete, elevateprivileges, spawn and
//!   resourcecontrol denied): no setuid, no fork or exec, no priority or
//!   affinity changes. QEMU is started as its user already, since a sandbox
//!   that denies setuid forbids QEMU dropping privileges itself.
//! - **A cgroup** (`ferry/HOST/VM` under the memory and cpu controllers, v1
//!   or v2): memory capped at the guest's plus QEMU's own overhead, CPU at
//!   its vCPUs plus one for QEMU's other threads.
//!
//! `confine_qemu = false` in `agent.toml` runs QEMU as the agent's user, as
//! before; `vm list` then shows it "NOT CONFINED".

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use ferry_api::VmSpec;

/// Where each host's QEMU uids start by default: far above the ranges
/// distributions give users and containers' subordinate ids.
pub const UID_BASE: u32 = 4_000_000;
/// How many VMs' uids one host has.
pub const UID_RANGE: u32 = 65_536;
/// The first file descriptor a QEMU finds its taps at (tap `i` at `TAP_FD + i`).
pub const TAP_FD: RawFd = 100;
/// The group every confined QEMU is in besides its own, for the devices it
/// opens: `/dev/userfaultfd` (post-copy's target; the agent gives the
/// device to this group, mode 0660, as the unprivileged `userfaultfd`
/// syscall is off by default). It owns no file: a VM's files are mode
/// 0600/0700, so sharing it gives one VM nothing of another's. The same on
/// every host of a machine.
pub const DEVICES_GID: u32 = UID_BASE - 1;
/// The `-sandbox` argument of every confined QEMU.
pub const SANDBOX: &str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";
/// QEMU's own memory beyond the guest's: its code, device state, and the
/// TCG translation cache under emulation.
pub const MEMORY_OVERHEAD: u64 = 1 << 30;

/// How a host confines its QEMUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confinement {
    pub uid_base: u32,
    /// The cgroup directory (below each controller's root) of this host's
    /// VMs: `ferry/HOST`.
    pub cgroup: PathBuf,
}

impl Confinement {
    pub fn for_host(host: &str, uid_base: u32) -> Confinement {
        Confinement {
            uid_base,
            cgroup: Path::new("ferry").join(host),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    #[error("every QEMU uid from {base} is in use ({UID_RANGE} VMs)")]
    NoUid { base: u32 },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("opening tap {tap}: {source}")]
    Tap {
        tap: String,
        #[source]
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ConfineError + '_ {
    move |source| ConfineError::Io {
        path: path.into(),
        source,
    }
}

/// The uid for a new VM's QEMU: the lowest from `base` that is not in
/// `recorded` (the uids this host's VM directories record) and that no
/// start in flight holds.
pub fn allocate_uid(
    recorded: std::collections::BTreeSet<u32>,
    base: u32,
) -> Result<u32, ConfineError> {
    let mut used = recorded;
    used.extend(in_flight().iter().copied());
    let uid = (base..base.saturating_add(UID_RANGE))
        .find(|u| !used.contains(u))
        .ok_or(ConfineError::NoUid { base })?;
    in_flight().insert(uid);
    Ok(uid)
}

/// The start of a QEMU with `uid` is over (its record written, or failed).
pub fn settled(uid: u32) {
    in_flight().remove(&uid);
}

fn in_flight() -> std::sync::MutexGuard<'static, std::collections::BTreeSet<u32>> {
    static IN_FLIGHT: std::sync::Mutex<std::collections::BTreeSet<u32>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    IN_FLIGHT.lock().unwrap_or_else(|p| p.into_inner())
}

/// Gives `path` to `owner` alone (mode `mode`).
pub fn give(path: &Path, (uid, gid): (u32, u32), mode: u32) -> Result<(), ConfineError> {
    use std::os::unix::fs::PermissionsExt;
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).map_err(io(path))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(io(path))
}

/// Lets other users pass through `dir` (mode o+x), so a VM's QEMU reaches
/// its own directory below it; nothing in it becomes listable or readable.
pub fn traversable(dir: &Path) -> Result<(), ConfineError> {
    use std::os::unix::fs::PermissionsExt;
    let m = std::fs::metadata(dir).map_err(io(dir))?;
    let mode = m.permissions().mode();
    if mode & 0o001 == 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode | 0o011))
            .map_err(io(dir))?;
    }
    Ok(())
}

/// Opens tap `name` (created by this, removed when the last descriptor
/// closes: when its QEMU exits), with virtio-net headers.
pub fn open_tap(name: &str) -> Result<OwnedFd, ConfineError> {
    let err = |source| ConfineError::Tap {
        tap: name.into(),
        source,
    };
    if name.len() >= libc::IFNAMSIZ {
        return Err(err(std::io::ErrorKind::InvalidInput.into()));
    }
    // SAFETY: open(2) of a constant path; the descriptor is owned below.
    let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(err(std::io::Error::last_os_error()));
    }
    // SAFETY: fd is a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    #[repr(C)]
    struct IfReq {
        name: [libc::c_char; libc::IFNAMSIZ],
        flags: libc::c_short,
        _pad: [u8; 22],
    }
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short,
        _pad: [0; 22],
    };
    for (d, s) in req.name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    // SAFETY: TUNSETIFF reads and writes one struct ifreq, which IfReq lays
    // out (name, flags, padding to its 40 bytes).
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF, &mut req) };
    if r < 0 {
        return Err(err(std::io::Error::last_os_error()));
    }
    Ok(fd)
}

/// The cgroup controllers' roots this machine has: v2's one directory, or
/// v1's memory and cpu hierarchies.
fn roots() -> Vec<(PathBuf, bool)> {
    let base = Path::new("/sys/fs/cgroup");
    let v2 = std::fs::read_to_string(base.join("cgroup.controllers"))
        .is_ok_and(|c| c.split_whitespace().any(|x| x == "memory"));
    if v2 {
        return vec![(base.into(), true)];
    }
    ["memory", "cpu"]
        .iter()
        .map(|c| (base.join(c), false))
        .filter(|(p, _)| p.is_dir())
        .collect()
}

/// The supplementary groups of a confined QEMU: [`DEVICES_GID`], and the
/// group of `/dev/kvm` where there is one. Gives `/dev/userfaultfd` to
/// [`DEVICES_GID`] (mode 0660) when it is root's alone.
pub fn device_groups() -> Vec<u32> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let uffd = Path::new("/dev/userfaultfd");
    if let Ok(m) = std::fs::metadata(uffd) {
        if m.gid() != DEVICES_GID || m.permissions().mode() & 0o060 != 0o060 {
            let _ = std::os::unix::fs::chown(uffd, None, Some(DEVICES_GID));
            let _ = std::fs::set_permissions(
                uffd,
                std::fs::Permissions::from_mode(m.permissions().mode() | 0o060),
            );
        }
    }
    let mut groups = vec![DEVICES_GID];
    if let Ok(m) = std::fs::metadata("/dev/kvm") {
        if m.gid() != 0 {
            groups.push(m.gid());
        }
    }
    groups
}

/// Makes the machine's cgroup controllers visible here: an agent started in
/// a mount namespace with a fresh `/sys` (`ip netns exec`) has none, and
/// mounts memory and cpu (v1) or the unified hierarchy (v2) as the
/// machine's first process has them.
pub fn ensure_cgroupfs() -> Result<(), ConfineError> {
    if !roots().is_empty() {
        return Ok(());
    }
    let base = Path::new("/sys/fs/cgroup");
    let init =
        std::fs::read_to_string("/proc/1/mounts").map_err(io(Path::new("/proc/1/mounts")))?;
    let mount = |fstype: &str, at: &Path, data: &str| -> Result<(), ConfineError> {
        let c = |s: &str| std::ffi::CString::new(s).unwrap_or_default();
        let (src, ty, target, data) = (c(fstype), c(fstype), c(&at.display().to_string()), c(data));
        // SAFETY: mount(2) with NUL-terminated strings that outlive the call.
        let r = unsafe {
            libc::mount(
                src.as_ptr(),
                target.as_ptr(),
                ty.as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                data.as_ptr().cast(),
            )
        };
        if r != 0 {
            return Err(io(at)(std::io::Error::last_os_error()));
        }
        Ok(())
    };
    let lines: Vec<Vec<&str>> = init
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.len() >= 4)
        .collect();
    if lines
        .iter()
        .any(|f| f[2] == "cgroup2" && f[1] == "/sys/fs/cgroup")
    {
        return mount("cgroup2", base, "");
    }
    let v1: Vec<(&str, String)> = lines
        .iter()
        .filter(|f| f[2] == "cgroup")
        .filter_map(|f| {
            let controllers: Vec<&str> = f[3]
                .split(',')
                .filter(|o| !matches!(*o, "rw" | "ro" | "relatime" | "nosuid" | "nodev" | "noexec"))
                .collect();
            let name = Path::new(f[1]).file_name()?.to_str()?;
            (controllers.contains(&"memory") || controllers.contains(&"cpu"))
                .then(|| (name, controllers.join(",")))
        })
        .collect();
    if v1.is_empty() {
        return Ok(());
    }
    mount("tmpfs", base, "mode=755")?;
    for (name, controllers) in v1 {
        let at = base.join(name);
        std::fs::create_dir_all(&at).map_err(io(&at))?;
        mount("cgroup", &at, &controllers)?;
    }
    Ok(())
}

/// The memory cap of `spec`'s QEMU.
pub fn memory_limit(spec: &VmSpec) -> u64 {
    spec.memory + spec.memory / 8 + MEMORY_OVERHEAD
}

/// Puts process `pid` (`spec`'s QEMU) in its own cgroup `vm_group`
/// (`ferry/HOST/VM`, below each controller's root), memory and CPU capped.
pub fn join_cgroup(vm_group: &Path, spec: &VmSpec, pid: u32) -> Result<(), ConfineError> {
    let cpus = u64::from(spec.vcpus) + 1;
    let roots = roots();
    if roots.is_empty() {
        return Err(ConfineError::Io {
            path: "/sys/fs/cgroup".into(),
            source: std::io::Error::other(
                "no memory or cpu cgroup controller is mounted (confine_qemu = false runs \
                 QEMU without its cgroup)",
            ),
        });
    }
    for (root, v2) in roots {
        let dir = root.join(vm_group);
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        let write = |file: &str, value: String| {
            let p = dir.join(file);
            std::fs::write(&p, value).map_err(io(&p))
        };
        let is_memory = v2 || root.ends_with("memory");
        let is_cpu = v2 || root.ends_with("cpu");
        if v2 {
            // the controllers must be handed down to every level first
            let mut at = root.clone();
            for part in vm_group.parent().into_iter().flat_map(Path::iter) {
                let _ = std::fs::write(at.join("cgroup.subtree_control"), "+memory +cpu");
                at = at.join(part);
            }
            let _ = std::fs::write(at.join("cgroup.subtree_control"), "+memory +cpu");
        }
        if is_memory {
            let limit = memory_limit(spec).to_string();
            write(
                if v2 {
                    "memory.max"
                } else {
                    "memory.limit_in_bytes"
                },
                limit,
            )?;
        }
        if is_cpu {
            if v2 {
                write("cpu.max", format!("{} 100000", cpus * 100_000))?;
            } else {
                write("cpu.cfs_period_us", "100000".into())?;
                write("cpu.cfs_quota_us", (cpus * 100_000).to_string())?;
            }
        }
        write("cgroup.procs", pid.to_string())?;
    }
    Ok(())
}

/// Removes a VM's cgroup (`group/VM`) once its QEMU is gone (a cgroup with
/// a process in it stays).
pub fn leave_cgroup(vm_group: &Path) {
    for (root, _) in roots() {
        let _ = std::fs::remove_dir(root.join(vm_group));
    }
}

/// The cgroup paths process `pid` is in (`/proc/PID/cgroup`).
pub fn cgroups_of(pid: u32) -> Vec<String> {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.splitn(3, ':').nth(2).map(str::to_string))
        .collect()
}

/// Whether process `pid` runs confined: not uid 0, seccomp filtering
/// (`/proc/PID/status` `Seccomp: 2`). `None` when it has exited.
pub fn is_confined(pid: u32) -> Option<(u32, bool)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.split_whitespace().next().unwrap_or("").to_string())
    };
    let uid: u32 = field("Uid:")?.parse().ok()?;
    Some((uid, field("Seccomp:").as_deref() == Some("2")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uids_are_the_lowest_free_and_never_handed_twice_while_starting() {
        let base = 7_000_000;
        let a = allocate_uid(Default::default(), base).unwrap();
        let b = allocate_uid(Default::default(), base).unwrap();
        assert_eq!((a, b), (base, base + 1), "a start in flight holds its uid");
        settled(a);
        settled(b);
        let recorded = [base, base + 1, base + 3].into_iter().collect();
        assert_eq!(allocate_uid(recorded, base).unwrap(), base + 2);
        settled(base + 2);
        let full = (base..base + UID_RANGE).collect();
        assert!(matches!(
            allocate_uid(full, base),
            Err(ConfineError::NoUid { .. })
        ));
    }

    #[test]
    fn a_guest_gets_its_memory_and_qemus_overhead() {
        let spec = VmSpec::workload("v", 512 << 20, 0, 0);
        assert_eq!(memory_limit(&spec), (512 << 20) + (64 << 20) + (1 << 30));
    }
}
