//! What a host grants guests: the host resources a VM's spec may name, as
//! `agent.toml` lists them and hosts report them (`HostInfo::grants`).
//!
//! The agent checks a spec against its grants with every path resolved on
//! the host (`ferry_agent::grants`); the control service checks the same
//! lists first, by each path as written ([`lexically_inside`]), so a spec
//! the host will refuse is refused before anything is asked of the host.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{ApiError, VmSpec};

/// The lists an administrator keeps in `agent.toml`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostGrants {
    /// Directories whose files guests may use as `path` drives.
    #[serde(default)]
    pub drive_dirs: Vec<PathBuf>,
    /// Directories whose files guests may boot as a kernel or initramfs.
    #[serde(default)]
    pub kernel_dirs: Vec<PathBuf>,
    /// Linux bridges guests' NICs may join.
    #[serde(default)]
    pub bridges: Vec<String>,
}

/// One resource a spec names that this host does not grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub field: String,
    pub value: String,
    pub key: &'static str,
    pub allowed: Vec<String>,
}

impl Refusal {
    pub fn into_error(self, host: &str) -> ApiError {
        ApiError::NotGranted {
            host: host.into(),
            field: self.field,
            value: self.value,
            key: self.key.into(),
            allowed: self.allowed,
        }
    }
}

/// True when path `p`, as written, lies inside one of `dirs` (not one of
/// them itself). Paths in a valid spec are absolute and have no `..`.
pub fn lexically_inside(p: &str, dirs: &[PathBuf]) -> bool {
    let p = Path::new(p);
    dirs.iter().any(|d| p.starts_with(d) && p != d)
}

fn shown(dirs: &[PathBuf]) -> Vec<String> {
    dirs.iter().map(|d| d.display().to_string()).collect()
}

impl HostGrants {
    /// The first resource of `spec` this host does not grant (None: all are).
    /// `machines` is what QEMU there lists (None: not known, not checked);
    /// `inside(path, dirs)` says whether a path lies inside the directories.
    pub fn refusal_by(
        &self,
        spec: &VmSpec,
        machines: Option<&[String]>,
        inside: &dyn Fn(&str, &[PathBuf]) -> bool,
    ) -> Option<Refusal> {
        if let Some(m) = machines {
            if !m.iter().any(|x| x == &spec.machine) {
                let mut q35: Vec<String> = m
                    .iter()
                    .filter(|x| x.as_str() == "q35" || x.starts_with("pc-q35-"))
                    .cloned()
                    .collect();
                q35.sort();
                return Some(Refusal {
                    field: "machine".into(),
                    value: spec.machine.clone(),
                    key: "qemu",
                    allowed: q35,
                });
            }
        }
        for (i, d) in spec.drives.iter().enumerate() {
            if let Some(p) = &d.path {
                if !inside(p, &self.drive_dirs) {
                    return Some(Refusal {
                        field: format!("drives[{i}].path"),
                        value: p.clone(),
                        key: "drive_dirs",
                        allowed: shown(&self.drive_dirs),
                    });
                }
            }
        }
        if let Some(k) = &spec.kernel {
            let files = [
                ("kernel.kernel", Some(&k.kernel)),
                ("kernel.initrd", k.initrd.as_ref()),
            ];
            for (field, p) in files {
                if let Some(p) = p {
                    if !inside(p, &self.kernel_dirs) {
                        return Some(Refusal {
                            field: field.into(),
                            value: p.clone(),
                            key: "kernel_dirs",
                            allowed: shown(&self.kernel_dirs),
                        });
                    }
                }
            }
        }
        for (i, n) in spec.nics.iter().enumerate() {
            if !self.bridges.contains(&n.bridge) {
                return Some(Refusal {
                    field: format!("nics[{i}].bridge"),
                    value: n.bridge.clone(),
                    key: "bridges",
                    allowed: self.bridges.clone(),
                });
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_control_service_judges_paths_as_written() {
        let dirs = vec![PathBuf::from("/srv/vms")];
        assert!(lexically_inside("/srv/vms/a.img", &dirs));
        assert!(!lexically_inside("/srv/vms", &dirs));
        assert!(!lexically_inside("/srv/vmsx/a.img", &dirs));
        assert!(!lexically_inside("/etc/shadow", &dirs));
        let g = HostGrants {
            drive_dirs: dirs,
            ..Default::default()
        };
        let mut s = VmSpec::workload("v", 256 << 20, 0, 0);
        s.drives.push(crate::hardware::Drive {
            path: Some("/etc/ferry/ca/ca-key.pem".into()),
            ..Default::default()
        });
        let r = g.refusal_by(&s, None, &lexically_inside).unwrap();
        assert_eq!((r.field.as_str(), r.key), ("drives[0].path", "drive_dirs"));
        assert_eq!(r.allowed, vec!["/srv/vms"]);
    }
}
