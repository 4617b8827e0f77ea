//! The lab guest image, built from Debian packages and cached.
//!
//! - Kernel: the package `linux-image-amd64` depends on, fetched with
//!   `apt-get download`; only `/boot/vmlinuz-*` is extracted, and its
//!   compressed payload is unpacked into the ELF `vmlinux`, which QEMU boots
//!   directly (PVH entry): no firmware, no decompression, ~half the boot time.
//! - Initramfs: busybox-static, a two-line `/init`, and the workload
//!   (`guest/workload.c`, compiled `gcc -static`), written by [`crate::cpio`].
//!   The kernel's built-in drivers (serial, PVH) are all it needs: no modules.
//!
//! The cache key covers the kernel package and the workload and init sources,
//! so a change to either builds a new image next to the old one.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};

use crate::{cpio, run, LabError};

const WORKLOAD_C: &str = include_str!("../guest/workload.c");
const INIT: &str = "#!/bin/sh\n\
mount -t proc proc /proc\n\
mount -t devtmpfs dev /dev 2>/dev/null\n\
mount -t sysfs sys /sys 2>/dev/null\n\
for m in virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio_blk; do \
/bin/busybox insmod /lib/modules/$m.ko; done\n\
exec /ferry-workload </dev/console >/dev/console 2>&1\n";
/// Bumped when the image layout changes.
const FORMAT: u32 = 3;
/// Kernel modules the guest loads (in this order) for virtio disks.
const MODULES: [&str; 6] = [
    "drivers/virtio/virtio_ring.ko",
    "drivers/virtio/virtio.ko",
    "drivers/virtio/virtio_pci_modern_dev.ko",
    "drivers/virtio/virtio_pci_legacy_dev.ko",
    "drivers/virtio/virtio_pci.ko",
    "drivers/block/virtio_blk.ko",
];

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct GuestImage {
    pub dir: PathBuf,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub kernel_package: String,
}

pub(crate) fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for b in *p {
            h ^= *b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
        h ^= 0xff;
    }
    h
}

/// The kernel package the guest uses: `FERRY_GUEST_KERNEL_PKG` or what
/// `linux-image-amd64` depends on. Asking apt costs about a second of CPU
/// (it loads its whole package cache), and every `lab up` and agent start
/// needs the answer: it is kept in the cache directory beside the images,
/// with the time apt's package lists last changed, and asked again only
/// when they have.
pub fn kernel_package() -> Result<String, LabError> {
    if let Ok(p) = std::env::var("FERRY_GUEST_KERNEL_PKG") {
        return Ok(p);
    }
    let memo = crate::cache_dir().join("guest").join("kernel-package");
    let lists = lists_changed();
    if let Some(pkg) = lists.as_deref().and_then(|l| {
        let kept = std::fs::read_to_string(&memo).ok()?;
        remembered(&kept, l)
    }) {
        return Ok(pkg);
    }
    let out = run("apt-cache", &["depends", "linux-image-amd64"])?;
    let pkg = depended_kernel(&out)
        .ok_or_else(|| LabError::Image("apt-cache knows no linux-image-amd64 dependency".into()))?;
    if let Some(l) = lists {
        // written whole then renamed: another lab command never reads half
        // of it; one that cannot be written is asked again next time
        let tmp = memo.with_extension(format!("{}", std::process::id()));
        let _ = std::fs::create_dir_all(memo.parent().unwrap_or(Path::new("/")))
            .and_then(|()| std::fs::write(&tmp, format!("{l} {pkg}\n")))
            .and_then(|()| std::fs::rename(&tmp, &memo));
        let _ = std::fs::remove_file(&tmp);
    }
    Ok(pkg)
}

/// The kernel package in `apt-cache depends linux-image-amd64`'s answer.
fn depended_kernel(out: &str) -> Option<String> {
    out.lines()
        .filter_map(|l| l.trim().strip_prefix("Depends: "))
        .find(|p| p.starts_with("linux-image-"))
        .map(str::to_string)
}

/// When apt's package lists last changed (`apt update` replaces files in
/// the directory), in ns; `None` when it cannot be told.
fn lists_changed() -> Option<String> {
    let m = std::fs::metadata("/var/lib/apt/lists")
        .ok()?
        .modified()
        .ok()?;
    Some(
        m.duration_since(std::time::UNIX_EPOCH)
            .ok()?
            .as_nanos()
            .to_string(),
    )
}

/// The package a memo `kept` ("LISTS PACKAGE") names, if it was written
/// when the lists were last changed at `lists`.
fn remembered(kept: &str, lists: &str) -> Option<String> {
    // a memo is one whole line
    let (when, pkg) = kept.strip_suffix('\n')?.split_once(' ')?;
    (when == lists && pkg.starts_with("linux-image-") && !pkg.contains(char::is_whitespace))
        .then(|| pkg.to_string())
}

fn image_dir(pkg: &str) -> PathBuf {
    let key = fnv1a(&[
        pkg.as_bytes(),
        WORKLOAD_C.as_bytes(),
        INIT.as_bytes(),
        &FORMAT.to_le_bytes(),
    ]);
    crate::cache_dir()
        .join("guest")
        .join(format!("{pkg}-{key:016x}"))
}

fn image_in(dir: PathBuf, pkg: String) -> GuestImage {
    GuestImage {
        kernel: dir.join("vmlinux"),
        initrd: dir.join("initrd.cpio"),
        dir,
        kernel_package: pkg,
    }
}

/// The cached image, if it was built.
pub fn cached() -> Result<Option<GuestImage>, LabError> {
    let pkg = kernel_package()?;
    let img = image_in(image_dir(&pkg), pkg);
    Ok((img.kernel.exists() && img.initrd.exists()).then_some(img))
}

/// Returns the cached image, building it first if needed (or if `rebuild`).
pub fn ensure(rebuild: bool) -> Result<GuestImage, LabError> {
    let pkg = kernel_package()?;
    let dir = image_dir(&pkg);
    let img = image_in(dir.clone(), pkg.clone());
    if !rebuild && img.kernel.exists() && img.initrd.exists() {
        return Ok(img);
    }
    let tmp = dir.with_extension(format!("build-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| LabError::io(&tmp, e))?;
    let result = build_into(&tmp, &pkg);
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&tmp, &dir).map_err(|e| LabError::io(&dir, e))?;
    Ok(img)
}

fn build_into(tmp: &Path, pkg: &str) -> Result<(), LabError> {
    let t = tmp
        .to_str()
        .ok_or_else(|| LabError::Image("cache path is not UTF-8".into()))?;
    run(
        "sh",
        &[
            "-c",
            &format!("cd '{t}' && apt-get download -q -o APT::Sandbox::User=root {pkg}"),
        ],
    )?;
    run(
        "sh",
        &["-c", &format!(
            "cd '{t}' && dpkg-deb --fsys-tarfile {pkg}_*.deb | tar -x --wildcards './boot/vmlinuz-*' {}",
            MODULES
                .iter()
                .map(|m| format!("'./lib/modules/*/kernel/{m}'"))
                .collect::<Vec<_>>()
                .join(" ")
        )],
    )?;
    let vmlinuz = std::fs::read_dir(tmp.join("boot"))
        .map_err(|e| LabError::io(tmp.join("boot"), e))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
        })
        .ok_or_else(|| LabError::Image(format!("{pkg} has no /boot/vmlinuz-*")))?;
    let bz = std::fs::read(&vmlinuz).map_err(|e| LabError::io(&vmlinuz, e))?;
    let elf = unpack_bzimage(&bz)?;
    std::fs::write(tmp.join("vmlinux"), elf).map_err(|e| LabError::io(tmp.join("vmlinux"), e))?;

    let src = tmp.join("workload.c");
    std::fs::write(&src, WORKLOAD_C).map_err(|e| LabError::io(&src, e))?;
    let bin = tmp.join("ferry-workload");
    run(
        "gcc",
        &[
            "-O2",
            "-static",
            "-o",
            bin.to_str().unwrap_or_default(),
            src.to_str().unwrap_or_default(),
        ],
    )?;
    let workload = std::fs::read(&bin).map_err(|e| LabError::io(&bin, e))?;
    let busybox_path = ["/usr/bin/busybox", "/bin/busybox"]
        .iter()
        .map(Path::new)
        .find(|p| p.exists())
        .ok_or_else(|| {
            LabError::Image("busybox is not installed (package busybox-static)".into())
        })?;
    let busybox = std::fs::read(busybox_path).map_err(|e| LabError::io(busybox_path, e))?;
    let mut modules = Vec::new();
    let lib = tmp.join("lib/modules");
    let kdir = std::fs::read_dir(&lib)
        .map_err(|e| LabError::io(&lib, e))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .next()
        .ok_or_else(|| LabError::Image(format!("{pkg} has no /lib/modules")))?;
    for m in MODULES {
        let p = kdir.join("kernel").join(m);
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        modules.push((
            format!("lib/modules/{name}"),
            std::fs::read(&p).map_err(|e| LabError::io(&p, e))?,
        ));
    }
    let mut entries = vec![
        cpio::Entry::Dir {
            path: "bin",
            mode: 0o755,
        },
        cpio::Entry::Dir {
            path: "dev",
            mode: 0o755,
        },
        cpio::Entry::Dir {
            path: "proc",
            mode: 0o755,
        },
        cpio::Entry::Dir {
            path: "sys",
            mode: 0o755,
        },
        cpio::Entry::CharDev {
            path: "dev/console",
            mode: 0o600,
            major: 5,
            minor: 1,
        },
        cpio::Entry::File {
            path: "bin/busybox",
            mode: 0o755,
            data: &busybox,
        },
        cpio::Entry::Symlink {
            path: "bin/sh",
            target: "busybox",
        },
        cpio::Entry::Symlink {
            path: "bin/mount",
            target: "busybox",
        },
        cpio::Entry::File {
            path: "init",
            mode: 0o755,
            data: INIT.as_bytes(),
        },
        cpio::Entry::File {
            path: "ferry-workload",
            mode: 0o755,
            data: &workload,
        },
        cpio::Entry::Dir {
            path: "lib",
            mode: 0o755,
        },
        cpio::Entry::Dir {
            path: "lib/modules",
            mode: 0o755,
        },
    ];
    for (path, data) in &modules {
        entries.push(cpio::Entry::File {
            path: path.as_str(),
            mode: 0o644,
            data,
        });
    }
    let archive = cpio::build(&entries);
    std::fs::write(tmp.join("initrd.cpio"), archive)
        .map_err(|e| LabError::io(tmp.join("initrd.cpio"), e))?;
    // keep only what QEMU needs
    for junk in ["boot", "lib", "workload.c", "ferry-workload"] {
        let _ = std::fs::remove_dir_all(tmp.join(junk))
            .or_else(|_| std::fs::remove_file(tmp.join(junk)));
    }
    for e in std::fs::read_dir(tmp)
        .map_err(|e| LabError::io(tmp, e))?
        .flatten()
    {
        if e.path().extension().is_some_and(|x| x == "deb") {
            let _ = std::fs::remove_file(e.path());
        }
    }
    let manifest = serde_json::json!({ "kernel_package": pkg, "format": FORMAT });
    std::fs::write(tmp.join("manifest.json"), manifest.to_string())
        .map_err(|e| LabError::io(tmp, e))
}

/// Extracts the ELF kernel from an x86 bzImage: the boot protocol's setup
/// header gives the compressed payload's offset and length (fields at 0x248
/// and 0x24c, protocol ≥ 2.08), which is unpacked by the matching tool.
pub fn unpack_bzimage(bz: &[u8]) -> Result<Vec<u8>, LabError> {
    let bad = |why: &str| LabError::Image(format!("not a usable bzImage: {why}"));
    if bz.len() < 0x250 || &bz[0x202..0x206] != b"HdrS" {
        return Err(bad("no setup header"));
    }
    let setup_sects = match bz[0x1f1] {
        0 => 4,
        n => n as usize,
    };
    let word =
        |at: usize| u32::from_le_bytes([bz[at], bz[at + 1], bz[at + 2], bz[at + 3]]) as usize;
    let start = (setup_sects + 1) * 512 + word(0x248);
    let end = start
        .checked_add(word(0x24c))
        .ok_or_else(|| bad("payload length overflows"))?;
    let payload = bz
        .get(start..end)
        .ok_or_else(|| bad("payload outside the file"))?;
    let tool: &[&str] = match payload {
        [0xfd, b'7', b'z', b'X', b'Z', 0, ..] => &["xz", "-dc"],
        [0x28, 0xb5, 0x2f, 0xfd, ..] => &["zstd", "-dc"],
        [0x1f, 0x8b, ..] => &["gzip", "-dc"],
        _ => return Err(bad("payload compression is not xz, zstd or gzip")),
    };
    let mut child = Command::new(tool[0])
        .args(&tool[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|source| LabError::Spawn {
            cmd: tool.join(" "),
            source,
        })?;
    let mut stdin = child.stdin.take().ok_or_else(|| bad("no stdin"))?;
    let data = payload.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&data));
    let out = child.wait_with_output().map_err(|source| LabError::Spawn {
        cmd: tool.join(" "),
        source,
    })?;
    let _ = writer.join();
    // xz may complain about padding after the stream; the ELF is what counts
    if !out.stdout.starts_with(b"\x7fELF") {
        return Err(bad("payload did not unpack to an ELF kernel"));
    }
    Ok(out.stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_non_bzimages() {
        assert!(unpack_bzimage(b"hello").is_err());
        let mut fake = vec![0u8; 0x400];
        fake[0x202..0x206].copy_from_slice(b"HdrS");
        fake[0x24c] = 0xff; // payload past the end
        assert!(unpack_bzimage(&fake)
            .unwrap_err()
            .to_string()
            .contains("outside"));
    }

    #[test]
    fn the_kernel_package_is_remembered_only_for_the_lists_it_was_asked_of() {
        let answer = "linux-image-amd64\n  Depends: linux-image-6.1.0-44-amd64\n";
        assert_eq!(
            depended_kernel(answer).as_deref(),
            Some("linux-image-6.1.0-44-amd64")
        );
        assert_eq!(depended_kernel("linux-image-amd64\n"), None);
        let kept = "1764700000123456789 linux-image-6.1.0-44-amd64\n";
        assert_eq!(
            remembered(kept, "1764700000123456789").as_deref(),
            Some("linux-image-6.1.0-44-amd64")
        );
        // apt's lists changed since: asked again
        assert_eq!(remembered(kept, "1764700000999999999"), None);
        // not a kernel package, or not one word: asked again
        assert_eq!(remembered("1 bash", "1"), None);
        assert_eq!(remembered("1 linux-image-x; rm -rf /", "1"), None);
        assert_eq!(remembered("", "1"), None);
        // cut short: not a whole line
        assert_eq!(remembered("1 linux-image-6.1", "1"), None);
    }

    #[test]
    fn cache_key_changes_with_the_kernel_package() {
        assert_ne!(image_dir("linux-image-a"), image_dir("linux-image-b"));
    }
}
