//! What a user's VM is made of beyond memory and vCPUs: machine, CPU model,
//! firmware, disks, NICs on bridges, a cloud-init seed, the guest agent.
//!
//! Every field has a default that gives the lab's workload guest (direct
//! kernel boot of the agent's own kernel, no drives, no NICs), so a spec
//! written before these fields existed means what it meant then.

use serde::{Deserialize, Serialize};

use crate::ApiError;

/// How the guest boots.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Firmware {
    /// QEMU loads a kernel (and initramfs) itself: the spec's
    /// [`KernelBoot`], or the host's workload kernel when the spec has none.
    #[default]
    Kernel,
    /// SeaBIOS boots the first drive.
    Bios,
    /// OVMF (UEFI) boots the first drive; the host's OVMF files must exist.
    Uefi,
}

impl Firmware {
    pub fn as_str(self) -> &'static str {
        match self {
            Firmware::Kernel => "kernel",
            Firmware::Bios => "bios",
            Firmware::Uefi => "uefi",
        }
    }
}

/// A kernel QEMU boots directly (`firmware = "kernel"`): paths on storage
/// every host sees, checked on a migration's target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelBoot {
    pub kernel: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd: Option<String>,
    /// The kernel command line.
    #[serde(default)]
    pub append: String,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DriveFormat {
    #[default]
    Raw,
    Qcow2,
}

impl DriveFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            DriveFormat::Raw => "raw",
            DriveFormat::Qcow2 => "qcow2",
        }
    }
}

/// A disk present from boot. Exactly one of `disk` (a Ferry storage disk,
/// which the control service turns into `nbd`), `nbd`, `path` (a file or
/// block device on storage every host mounts) or `local` (a file of the
/// host's own, `STATE_DIR/disks/VM/NAME`, which moves with the VM: see
/// shared-nothing migration). The first drive boots.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Drive {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<String>,
    /// `nbd://HOST:PORT/EXPORT`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// A disk file of the host's own: its name in the agent's
    /// `STATE_DIR/disks/VM/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<String>,
    /// With `local`: the size the file is created with when it does not
    /// exist yet (bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    #[serde(default)]
    pub format: DriveFormat,
    #[serde(default)]
    pub readonly: bool,
}

/// A virtio-net NIC on a Linux bridge of the host. The agent makes its tap;
/// the MAC is the spec's, so it moves with the VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestNic {
    pub bridge: String,
    pub mac: String,
}

/// A cloud-init NoCloud seed, attached as a CD-ROM labelled `cidata`.
///
/// `user_data` is write-only: it may hold first-boot passwords and keys, so
/// no VM listing shows it — to read-only users, operators and peer agents
/// alike it reads as `""` with `redacted` set. Only the host that runs the
/// VM keeps it (it is in the seed the guest reads).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloudInit {
    pub user_data: String,
    #[serde(default)]
    pub meta_data: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_config: Option<String>,
    /// Set in listings: `user_data` was there and is not shown.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub redacted: bool,
}

impl CloudInit {
    /// The seed as a listing shows it: `user_data` withheld.
    pub fn redacted(&self) -> CloudInit {
        CloudInit {
            user_data: String::new(),
            redacted: true,
            ..self.clone()
        }
    }
}

/// The devices a q35 machine gets besides the ones the spec names. Part
/// of the guest's hardware: fixed for a VM's life (a move's target builds
/// the same board), and chosen when the VM is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Board {
    /// q35 as QEMU makes it: a SATA controller, an SMBus controller, the
    /// VMware I/O port and the TPR-patching device. A spec without a
    /// `board` (a VM created before boards had a name) has this one.
    Full,
    /// q35 without those four (SATA stays when a cloud-init seed CD needs
    /// it): each is a device the target loads while the guest is paused,
    /// and the target's load of the controllers alone takes milliseconds.
    /// New VMs get this one.
    Lean,
}

impl Board {
    pub fn as_str(self) -> &'static str {
        match self {
            Board::Full => "full",
            Board::Lean => "lean",
        }
    }
}

pub fn default_machine() -> String {
    "q35".into()
}
pub fn default_cpu() -> String {
    "qemu64".into()
}

/// Checks a MAC: six two-digit hex octets, unicast, not all zero.
pub fn validate_mac(field: &str, mac: &str) -> Result<(), ApiError> {
    let octets: Vec<_> = mac.split(':').collect();
    let parsed: Option<Vec<u8>> = (octets.len() == 6)
        .then(|| {
            octets
                .iter()
                .map(|o| {
                    (o.len() == 2)
                        .then(|| u8::from_str_radix(o, 16).ok())
                        .flatten()
                })
                .collect()
        })
        .flatten();
    let Some(bytes) = parsed else {
        return Err(ApiError::invalid(
            field,
            format!("'{mac}' is not a MAC address (six hex octets, 52:54:00:12:34:56)"),
        ));
    };
    if bytes[0] & 1 == 1 {
        return Err(ApiError::invalid(
            field,
            format!("'{mac}' is a multicast address; a NIC needs a unicast one"),
        ));
    }
    if bytes.iter().all(|b| *b == 0) {
        return Err(ApiError::invalid(
            field,
            "00:00:00:00:00:00 is not a NIC's address",
        ));
    }
    Ok(())
}

/// Interface names as Linux takes them: 1-15 characters, no '/', ':' or space.
pub fn validate_ifname(field: &str, name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 15
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'/' && b != b':');
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            field,
            format!("'{name}' is not an interface name (1-15 characters, no '/', ':' or space)"),
        ))
    }
}

/// CPU model names as QEMU lists them (`qemu64`, `Skylake-Server-v4`,
/// `host`, `max`): no options after a comma.
pub fn validate_cpu_model(cpu: &str) -> Result<(), ApiError> {
    let ok = !cpu.is_empty()
        && cpu.len() <= 64
        && cpu
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            "cpu",
            format!("'{cpu}' is not a CPU model name (see `qemu-system-x86_64 -cpu help`)"),
        ))
    }
}

/// A q35 machine type name: `q35` or `pc-q35-X.Y` (digits and dots),
/// nothing QEMU would read as an option. Whether QEMU knows it is the
/// host's to say (`query-machines`).
pub fn validate_machine(m: &str) -> Result<(), ApiError> {
    let versioned = m.strip_prefix("pc-q35-").is_some_and(|v| {
        !v.is_empty()
            && v.len() <= 16
            && v.bytes().all(|b| b.is_ascii_digit() || b == b'.')
            && !v.starts_with('.')
            && !v.ends_with('.')
    });
    if m == "q35" || versioned {
        Ok(())
    } else {
        Err(ApiError::invalid(
            "machine",
            format!(
                "'{}' is not a q35 machine type (q35 or pc-q35-X.Y)",
                m.escape_debug()
            ),
        ))
    }
}

/// How much of an image's start [`qcow2_backing`] reads.
pub const QCOW2_HEAD: usize = 64 << 10;

/// The backing file named in a qcow2 image's header, given the image's
/// first bytes (up to [`QCOW2_HEAD`]); None when `head` is not a qcow2
/// header or names none. A name past `head` (or cut by its end) still
/// counts: the image has a backing file, its name not shown.
pub fn qcow2_backing(head: &[u8]) -> Option<String> {
    if head.len() < 20 || head[0..4] != *b"QFI\xfb" {
        return None;
    }
    let off = u64::from_be_bytes(head[8..16].try_into().ok()?);
    let len = u32::from_be_bytes(head[16..20].try_into().ok()?) as u64;
    if off == 0 || len == 0 {
        return None;
    }
    let name = usize::try_from(off)
        .ok()
        .and_then(|o| head.get(o..o.checked_add(len.min(1023) as usize)?));
    Some(match name {
        Some(n) => String::from_utf8_lossy(n).into_owned(),
        None => format!("a name of {len} bytes at offset {off}"),
    })
}

/// The largest local drive Ferry creates.
pub const MAX_LOCAL_DISK: u64 = 16 << 40;

/// A local drive's file name: 1-64 of `[A-Za-z0-9._-]`, not starting with a dot.
pub fn validate_local_name(field: &str, n: &str) -> Result<(), ApiError> {
    let ok = !n.is_empty()
        && n.len() <= 64
        && !n.starts_with('.')
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            field,
            format!("'{n}' must be a file name of 1-64 characters of A-Z, a-z, 0-9, '.', '_' and '-', not starting with '.'"),
        ))
    }
}

fn validate_path(field: &str, p: &str) -> Result<(), ApiError> {
    if !p.starts_with('/') || p.contains('\0') || p.split('/').any(|c| c == "..") {
        return Err(ApiError::invalid(
            field,
            format!("'{p}' must be an absolute path without '..'"),
        ));
    }
    // QEMU's option syntax: a comma would split the argument
    if p.contains(',') {
        return Err(ApiError::invalid(field, format!("'{p}' contains a comma")));
    }
    Ok(())
}

impl Drive {
    /// Checks one drive; `i` names it in errors (`drives[0]`).
    pub fn validate(&self, i: usize) -> Result<(), ApiError> {
        let field = format!("drives[{i}]");
        let set = [&self.disk, &self.nbd, &self.path, &self.local]
            .iter()
            .filter(|x| x.is_some())
            .count();
        if set != 1 {
            return Err(ApiError::invalid(
                &field,
                "give exactly one of disk (a Ferry disk), nbd (a URI), path or local (a file of the host's own)",
            ));
        }
        if let Some(n) = &self.local {
            validate_local_name(&format!("{field}.local"), n)?;
        }
        match (self.size, &self.local) {
            (Some(_), None) => {
                return Err(ApiError::invalid(
                    &format!("{field}.size"),
                    "only a local drive is created with a size",
                ))
            }
            (Some(s), Some(_)) if s == 0 || s % 512 != 0 || s > MAX_LOCAL_DISK => {
                return Err(ApiError::invalid(
                    &format!("{field}.size"),
                    format!("{s} bytes: give a multiple of 512 bytes up to 16T"),
                ))
            }
            _ => {}
        }
        if let Some(d) = &self.disk {
            crate::validate_name(&format!("{field}.disk"), d)?;
        }
        if let Some(uri) = &self.nbd {
            crate::parse_nbd_uri(uri).map_err(|e| match e {
                ApiError::InvalidArgument { reason, .. } => {
                    ApiError::invalid(&format!("{field}.nbd"), reason)
                }
                e => e,
            })?;
        }
        if let Some(p) = &self.path {
            validate_path(&format!("{field}.path"), p)?;
        }
        Ok(())
    }
}

/// Checks the hardware fields of a spec (the VM's name is checked by the caller).
pub fn validate(spec: &crate::VmSpec) -> Result<(), ApiError> {
    validate_machine(&spec.machine)?;
    validate_cpu_model(&spec.cpu)?;
    if spec.drives.len() > 8 {
        return Err(ApiError::invalid("drives", "a VM takes at most 8 drives"));
    }
    for (i, d) in spec.drives.iter().enumerate() {
        d.validate(i)?;
    }
    if spec.nics.len() > 4 {
        return Err(ApiError::invalid("nics", "a VM takes at most 4 NICs"));
    }
    for (i, n) in spec.nics.iter().enumerate() {
        validate_ifname(&format!("nics[{i}].bridge"), &n.bridge)?;
        validate_mac(&format!("nics[{i}].mac"), &n.mac)?;
        if spec.nics[..i]
            .iter()
            .any(|o| o.mac.eq_ignore_ascii_case(&n.mac))
        {
            return Err(ApiError::invalid(
                &format!("nics[{i}].mac"),
                format!("{} is used by another NIC of this VM", n.mac),
            ));
        }
    }
    match (spec.firmware, &spec.kernel) {
        (Firmware::Kernel, Some(k)) => {
            validate_path("kernel.kernel", &k.kernel)?;
            if let Some(i) = &k.initrd {
                validate_path("kernel.initrd", i)?;
            }
        }
        (Firmware::Kernel, None) => {}
        (f, Some(_)) => {
            return Err(ApiError::invalid(
                "kernel",
                format!(
                    "a kernel is booted only with firmware = \"kernel\", not \"{}\"",
                    f.as_str()
                ),
            ))
        }
        (f, None) => {
            if spec.drives.is_empty() {
                return Err(ApiError::invalid(
                    "drives",
                    format!(
                        "firmware \"{}\" boots the first drive; the spec has none",
                        f.as_str()
                    ),
                ));
            }
        }
    }
    if !spec.is_workload() && (spec.fill != 0 || spec.dirty_rate != 0 || spec.compressible) {
        return Err(ApiError::invalid(
            "fill",
            "fill, dirty_rate and compressible belong to the lab's workload guest (no kernel, drives or firmware given)",
        ));
    }
    if let Some(c) = &spec.cloud_init {
        if c.redacted {
            return Err(ApiError::invalid(
                "cloud_init.redacted",
                "a listing's spec has no user_data: give the seed itself",
            ));
        }
        if c.user_data.len() + c.meta_data.len() > 1 << 20 {
            return Err(ApiError::invalid(
                "cloud_init",
                "the seed is larger than 1 MiB",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs() {
        assert!(validate_mac("m", "52:54:00:12:34:56").is_ok());
        for bad in [
            "52:54:00:12:34",
            "01:00:5e:00:00:01",
            "00:00:00:00:00:00",
            "zz:54:00:12:34:56",
            "525400123456",
        ] {
            let e = validate_mac("nics[0].mac", bad).unwrap_err().to_string();
            assert!(e.contains("nics[0].mac"), "{e}");
        }
    }

    #[test]
    fn interface_names_and_cpu_models() {
        assert!(validate_ifname("b", "br-guest").is_ok());
        assert!(validate_ifname("b", "a-name-too-long-x").is_err());
        assert!(validate_ifname("b", "br/0").is_err());
        assert!(validate_cpu_model("Skylake-Server-v4").is_ok());
        assert!(validate_cpu_model("host,+vmx").is_err());
    }

    #[test]
    fn listings_withhold_user_data_and_cannot_be_fed_back() {
        let mut s = crate::VmSpec::workload("web1", 256 << 20, 0, 0);
        s.firmware = Firmware::Bios;
        s.drives.push(Drive {
            disk: Some("root".into()),
            ..Default::default()
        });
        s.cloud_init = Some(CloudInit {
            user_data: "#cloud-config\npassword: hunter2\n".into(),
            meta_data: "instance-id: web1\n".into(),
            network_config: None,
            redacted: false,
        });
        assert!(validate(&s).is_ok());
        let shown = s.redacted();
        let text = serde_json::to_string(&shown).unwrap();
        assert!(
            !text.contains("hunter2") && text.contains("\"redacted\":true"),
            "{text}"
        );
        assert!(text.contains("instance-id: web1"));
        let e = validate(&shown).unwrap_err().to_string();
        assert!(e.contains("cloud_init.redacted"), "{e}");
    }

    #[test]
    fn a_qcow2_header_names_its_backing_file() {
        let mut h = vec![0u8; 512];
        h[0..4].copy_from_slice(b"QFI\xfb");
        h[8..16].copy_from_slice(&100u64.to_be_bytes());
        h[16..20].copy_from_slice(&11u32.to_be_bytes());
        h[100..111].copy_from_slice(b"/etc/shadow");
        assert_eq!(qcow2_backing(&h).as_deref(), Some("/etc/shadow"));
        // past what was read, or absurd: still a backing file
        h[8..16].copy_from_slice(&u64::MAX.to_be_bytes());
        assert!(qcow2_backing(&h).unwrap().contains("offset"));
        h[8..16].copy_from_slice(&0u64.to_be_bytes());
        assert_eq!(qcow2_backing(&h), None);
        assert_eq!(qcow2_backing(b"raw data, not qcow2"), None);
        assert_eq!(qcow2_backing(b"QFI"), None);
    }

    #[test]
    fn machine_types_carry_no_options() {
        for ok in ["q35", "pc-q35-9.2", "pc-q35-10.0"] {
            assert!(validate_machine(ok).is_ok(), "{ok}");
        }
        for bad in [
            "pc-q35-9.2,accel=kvm",
            "pc-q35-",
            "pc-q35-x",
            "pc",
            "q35,memory-backend=m",
            "pc-q35-9.2\nfoo",
            "pc-q35-.9",
        ] {
            let e = validate_machine(bad).unwrap_err().to_string();
            assert!(e.contains("machine"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_drive_names_exactly_one_source() {
        let d = Drive {
            disk: Some("root".into()),
            path: Some("/srv/a.img".into()),
            ..Default::default()
        };
        assert!(d.validate(1).unwrap_err().to_string().contains("drives[1]"));
        let d = Drive {
            path: Some("/srv/../etc/shadow".into()),
            ..Default::default()
        };
        assert!(d.validate(0).is_err());
        let d = Drive {
            nbd: Some("nbd://198.18.0.1:10809/root/vm1".into()),
            format: DriveFormat::Qcow2,
            ..Default::default()
        };
        assert!(d.validate(0).is_ok());
        let d = Drive {
            local: Some("data.qcow2".into()),
            size: Some(1 << 30),
            format: DriveFormat::Qcow2,
            ..Default::default()
        };
        assert!(d.validate(0).is_ok());
        for (local, size) in [
            ("../x", Some(1 << 30)),
            (".hidden", None),
            ("a", Some(1000)),
        ] {
            let d = Drive {
                local: Some(local.into()),
                size,
                ..Default::default()
            };
            assert!(d.validate(2).unwrap_err().to_string().contains("drives[2]"));
        }
        let d = Drive {
            path: Some("/srv/a.img".into()),
            size: Some(1 << 30),
            ..Default::default()
        };
        assert!(d
            .validate(0)
            .unwrap_err()
            .to_string()
            .contains("drives[0].size"));
    }
}
