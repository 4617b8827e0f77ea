//! The lab's Debian guest: built from Debian packages by
//! `guest/debian-image.sh` (mmdebstrap, then `mkfs.ext4 -d`), cached under
//! the cache key of the script itself, so a change to the script builds a
//! new image next to the old one.
//!
//! A real guest for tests and the demo: systemd, udev, qemu-guest-agent and
//! a TCP echo service on port 7000. Its disk (an MBR, a SYSLINUX boot
//! partition, an ext4 root; made without loop devices or mounts) is imported
//! into a Ferry storage disk and served over NBD, so every host sees it;
//! SeaBIOS boots it as it would a cloud image. Its address comes from the
//! cloud-init seed the spec attaches.

use std::path::PathBuf;

use crate::LabError;

const SCRIPT: &str = include_str!("../guest/debian-image.sh");

/// The TCP port the guest's echo service listens on.
pub const ECHO_PORT: u16 = 7000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DebianImage {
    pub dir: PathBuf,
    /// The raw disk: MBR, boot partition, root partition.
    pub disk: PathBuf,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
}

/// A VM of this guest: booted by SeaBIOS from `disk` (a Ferry disk holding
/// the image), one NIC on the lab's guest bridge, its address `addr/24` in
/// the cloud-init seed's network-config, the guest agent on.
pub fn spec(name: &str, disk: &str, addr: &str, mac: &str) -> ferry_api::VmSpec {
    use ferry_api::hardware::{CloudInit, Drive, Firmware, GuestNic};
    let mut s = ferry_api::VmSpec::workload(name, 512 << 20, 0, 0);
    s.firmware = Firmware::Bios;
    s.drives.push(Drive {
        disk: Some(disk.into()),
        ..Default::default()
    });
    s.nics.push(GuestNic {
        bridge: crate::topology::GUEST_BRIDGE.into(),
        mac: mac.into(),
    });
    s.cloud_init = Some(CloudInit {
        user_data: "#cloud-config\n".into(),
        meta_data: format!("instance-id: {name}\nlocal-hostname: {name}\n"),
        network_config: Some(format!(
            "version: 2\nethernets:\n  nic0:\n    match:\n      macaddress: \"{mac}\"\n    addresses: [{addr}/24]\n"
        )),
        redacted: false,
    });
    s.guest_agent = true;
    s
}

fn image_in(dir: PathBuf) -> DebianImage {
    DebianImage {
        disk: dir.join("disk.img"),
        kernel: dir.join("vmlinuz"),
        initrd: dir.join("initrd.img"),
        dir,
    }
}

fn image_dir() -> PathBuf {
    let key = crate::image::fnv1a(&[SCRIPT.as_bytes()]);
    crate::cache_dir()
        .join("debian")
        .join(format!("bookworm-{key:016x}"))
}

/// The cached image, if it was built.
pub fn cached() -> Option<DebianImage> {
    let img = image_in(image_dir());
    (img.disk.exists() && img.kernel.exists() && img.initrd.exists()).then_some(img)
}

/// An exclusive `flock` on `path` (created if missing), held until the
/// returned file is dropped.
fn build_lock(path: &std::path::Path) -> Result<std::fs::File, LabError> {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| LabError::io(path, e))?;
    loop {
        // SAFETY: flock on a descriptor this File owns; no memory is involved.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(f);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(LabError::io(path, e));
        }
    }
}

/// Returns the cached image, building it first if needed (about a minute;
/// needs root, mmdebstrap and Debian's archive through apt). A second
/// caller while a build is under way (`scripts/run test` builds it beside
/// the lab tests) waits for that build and takes its image.
pub fn ensure(rebuild: bool) -> Result<DebianImage, LabError> {
    let dir = image_dir();
    std::fs::create_dir_all(&dir).map_err(|e| LabError::io(&dir, e))?;
    let _lock = build_lock(&dir.join("build.lock"))?;
    if !rebuild {
        if let Some(img) = cached() {
            return Ok(img);
        }
    }
    let script = dir.join("debian-image.sh");
    std::fs::write(&script, SCRIPT).map_err(|e| LabError::io(&script, e))?;
    let out = std::process::Command::new("bash")
        .arg(&script)
        .arg(&dir)
        .output()
        .map_err(|source| LabError::Spawn {
            cmd: format!("bash {}", script.display()),
            source,
        })?;
    let log = dir.join("build.log");
    let _ = std::fs::write(
        &log,
        [out.stdout.as_slice(), out.stderr.as_slice()].concat(),
    );
    if !out.status.success() {
        let tail: String = String::from_utf8_lossy(&out.stderr)
            .lines()
            .rev()
            .take(8)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        return Err(LabError::Image(format!(
            "building the Debian guest failed (log: {}):\n{tail}",
            log.display()
        )));
    }
    cached().ok_or_else(|| LabError::Image(format!("{} made no image", script.display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_second_builder_waits_for_the_first() {
        let path = std::env::temp_dir().join(format!("ferry-build-lock-{}", std::process::id()));
        let first = build_lock(&path).unwrap();
        let got = Arc::new(AtomicBool::new(false));
        let second = {
            let (path, got) = (path.clone(), got.clone());
            std::thread::spawn(move || {
                let _l = build_lock(&path).unwrap();
                got.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !got.load(Ordering::SeqCst),
            "took the lock while it was held"
        );
        drop(first);
        second.join().unwrap();
        assert!(got.load(Ordering::SeqCst));
        std::fs::remove_file(&path).unwrap();
    }
}
