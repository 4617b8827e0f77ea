//! A writer for the `newc` cpio format the Linux kernel unpacks as initramfs
//! (see the kernel's Documentation/driver-api/early-userspace/buffer-format.rst).
//! Only what an initramfs needs: directories, regular files, symlinks, and
//! character devices; all owned by root.

/// One entry of the archive.
pub enum Entry<'a> {
    Dir {
        path: &'a str,
        mode: u32,
    },
    File {
        path: &'a str,
        mode: u32,
        data: &'a [u8],
    },
    Symlink {
        path: &'a str,
        target: &'a str,
    },
    CharDev {
        path: &'a str,
        mode: u32,
        major: u32,
        minor: u32,
    },
}

fn pad4(out: &mut Vec<u8>) {
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

fn header(out: &mut Vec<u8>, ino: u32, mode: u32, size: usize, rdev: (u32, u32), name: &str) {
    let fields = [
        ino,
        mode,
        0,
        0,
        1,
        0,
        size as u32,
        0,
        0,
        rdev.0,
        rdev.1,
        name.len() as u32 + 1,
        0,
    ];
    out.extend_from_slice(b"070701");
    for f in fields {
        out.extend_from_slice(format!("{f:08X}").as_bytes());
    }
    out.extend_from_slice(name.as_bytes());
    out.push(0);
    pad4(out);
}

/// Builds a complete archive, trailer included.
pub fn build(entries: &[Entry<'_>]) -> Vec<u8> {
    let mut out = Vec::new();
    for (n, e) in entries.iter().enumerate() {
        let ino = n as u32 + 1;
        let (path, mode, data, rdev): (&str, u32, &[u8], (u32, u32)) = match e {
            Entry::Dir { path, mode } => (path, 0o040000 | mode, &[], (0, 0)),
            Entry::File { path, mode, data } => (path, 0o100000 | mode, data, (0, 0)),
            Entry::Symlink { path, target } => (path, 0o120777, target.as_bytes(), (0, 0)),
            Entry::CharDev {
                path,
                mode,
                major,
                minor,
            } => (path, 0o020000 | mode, &[], (*major, *minor)),
        };
        header(&mut out, ino, mode, data.len(), rdev, path);
        out.extend_from_slice(data);
        pad4(&mut out);
    }
    header(&mut out, 0, 0, 0, (0, 0), "TRAILER!!!");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn archive_is_aligned_and_terminated() {
        let a = build(&[
            Entry::Dir {
                path: "dev",
                mode: 0o755,
            },
            Entry::File {
                path: "init",
                mode: 0o755,
                data: b"#!/bin/sh\n",
            },
            Entry::Symlink {
                path: "bin/sh",
                target: "busybox",
            },
            Entry::CharDev {
                path: "dev/console",
                mode: 0o600,
                major: 5,
                minor: 1,
            },
        ]);
        assert_eq!(a.len() % 4, 0);
        assert!(a.starts_with(b"070701"));
        let text = String::from_utf8_lossy(&a);
        assert!(text.contains("TRAILER!!!"));
        assert!(text.contains("#!/bin/sh"));
        // the file entry's size field (7th field) is 10 bytes
        let at = a.windows(5).position(|w| w == b"init\0").unwrap();
        let hdr = &a[at - 110..at];
        assert_eq!(&hdr[6 + 6 * 8..6 + 7 * 8], b"0000000A");
    }

    #[test]
    #[ignore = "needs the cpio tool; scripts/run test runs it with --include-ignored"]
    fn cpio_tool_reads_it_back() {
        assert!(
            std::process::Command::new("cpio")
                .arg("--version")
                .output()
                .is_ok(),
            "cpio is not installed"
        );
        let a = build(&[
            Entry::Dir {
                path: "bin",
                mode: 0o755,
            },
            Entry::File {
                path: "bin/hello",
                mode: 0o644,
                data: b"hello\n",
            },
            Entry::Symlink {
                path: "bin/link",
                target: "hello",
            },
        ]);
        let mut child = std::process::Command::new("cpio")
            .args(["-t", "-v"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child.stdin.take().unwrap().write_all(&a).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let listing = String::from_utf8_lossy(&out.stdout);
        assert!(
            listing.contains("bin/hello") && listing.contains("bin/link -> hello"),
            "{listing}"
        );
    }
}
