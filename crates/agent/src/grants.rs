//! What this host grants guests: the host resources a VM's spec may name.
//!
//! A spec comes from a caller — an operator through the control service, or
//! a peer agent handing over a migration — and none of them is this host's
//! administrator. So every host resource a spec names is checked against
//! the lists in `agent.toml`, here, on the host that is about to start the
//! VM, whatever the caller checked before:
//!
//! | spec field | agent.toml key | granted when |
//! |---|---|---|
//! | `drives[i].path` | `drive_dirs` | the file, symlinks resolved, lies inside a listed directory |
//! | `kernel.kernel`, `kernel.initrd` | `kernel_dirs` | the same |
//! | `nics[i].bridge` | `bridges` | the bridge is listed |
//! | `machine` | — | QEMU here lists the machine type (`query-machines`) |
//! | `cpu` | `cpu_models` | see [`crate::hardware::cpu_problem`] |
//!
//! Every list is empty by default: a host grants nothing it was not told
//! to. A path is compared after resolving symlinks, and must be written as
//! its resolved form: a symlink inside a granted directory that points out
//! of it is refused, and QEMU opens exactly the file that was checked.

use std::path::{Path, PathBuf};

pub use ferry_api::grants::{HostGrants as Grants, Refusal};
use ferry_api::VmSpec;

/// True when `p`, resolved, is a file inside one of `dirs` (resolved) and
/// `p` is already written in its resolved form. A path that does not
/// exist is judged by where it would be (the caller then says it is
/// missing): whether a file exists outside the grants is never told.
fn inside(p: &str, dirs: &[PathBuf]) -> bool {
    let dirs: Vec<PathBuf> = dirs
        .iter()
        .map(|d| std::fs::canonicalize(d).unwrap_or_else(|_| d.clone()))
        .collect();
    let within = |real: &Path| dirs.iter().any(|d| real.starts_with(d) && real != d);
    match std::fs::canonicalize(p) {
        Ok(real) => real == Path::new(p) && within(&real),
        Err(_) => within(Path::new(p)),
    }
}

/// The first resource of `spec` this host does not grant, every path
/// resolved here (None: all are granted).
pub fn refusal(g: &Grants, spec: &VmSpec, machines: Option<&[String]>) -> Option<Refusal> {
    g.refusal_by(spec, machines, &inside)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_api::hardware::{Drive, GuestNic, KernelBoot};

    fn spec() -> VmSpec {
        VmSpec::workload("v", 256 << 20, 0, 0)
    }

    #[test]
    fn nothing_is_granted_by_default() {
        let g = Grants::default();
        let mut s = spec();
        assert_eq!(refusal(&g, &s, None), None);
        s.nics.push(GuestNic {
            bridge: "ferry-mgmt".into(),
            mac: "52:54:00:00:00:01".into(),
        });
        let r = refusal(&g, &s, None).unwrap();
        assert_eq!((r.field.as_str(), r.key), ("nics[0].bridge", "bridges"));
        let e = r.into_error("host1").to_string();
        assert!(e.contains("grants none") && e.contains("ferry-mgmt"), "{e}");
    }

    #[test]
    fn paths_must_resolve_inside_a_granted_directory() {
        let root = tempfile::tempdir().unwrap();
        let vm = root.path().join("vm");
        std::fs::create_dir(&vm).unwrap();
        let real = std::fs::canonicalize(&vm).unwrap();
        std::fs::write(real.join("a.img"), b"x").unwrap();
        std::fs::write(root.path().join("secret"), b"x").unwrap();
        std::os::unix::fs::symlink(root.path().join("secret"), real.join("link.img")).unwrap();
        let g = Grants {
            drive_dirs: vec![vm.clone()],
            ..Default::default()
        };
        let with = |p: &str| {
            let mut s = spec();
            s.firmware = ferry_api::hardware::Firmware::Bios;
            s.drives.push(Drive {
                path: Some(p.into()),
                ..Default::default()
            });
            refusal(&g, &s, None)
        };
        assert_eq!(with(&real.join("a.img").display().to_string()), None);
        // missing, but where a granted file would be: for the caller to name
        assert_eq!(with(&real.join("none.img").display().to_string()), None);
        for bad in [
            "/etc/shadow".to_string(),
            real.join("link.img").display().to_string(),
            "/nonexistent/none.img".to_string(),
            real.display().to_string(),
            format!("{}/../vm/a.img", real.display()),
        ] {
            let r = with(&bad).unwrap_or_else(|| panic!("{bad} granted"));
            assert_eq!(r.field, "drives[0].path", "{bad}");
            assert_eq!(r.allowed, vec![vm.display().to_string()]);
        }
    }

    #[test]
    fn kernels_and_machines() {
        let g = Grants::default();
        let mut s = spec();
        s.kernel = Some(KernelBoot {
            kernel: "/boot/vmlinuz".into(),
            initrd: None,
            append: String::new(),
        });
        assert_eq!(refusal(&g, &s, None).unwrap().key, "kernel_dirs");
        let s = spec();
        let known = vec!["q35".to_string(), "pc-q35-9.2".into(), "pc".into()];
        assert_eq!(refusal(&g, &s, Some(&known)), None);
        let mut s = spec();
        s.machine = "pc-q35-1.0".into();
        let r = refusal(&g, &s, Some(&known)).unwrap();
        assert_eq!(r.field, "machine");
        assert_eq!(r.allowed, vec!["pc-q35-9.2", "q35"]);
    }
}
