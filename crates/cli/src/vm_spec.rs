//! A VM's spec from a TOML file (`ferry vm create NAME --spec vm.toml`) and
//! from flags: the same fields either way, flags winning.
//!
//! The file holds [`VmSpec`]'s fields (see docs/vm-spec.md); sizes may be
//! written as users write them (`memory = "1G"`), and the VM's name comes
//! from the command line.

use std::path::{Path, PathBuf};

use ferry_api::hardware::{Board, CloudInit, Drive, DriveFormat, Firmware, GuestNic, KernelBoot};
use ferry_api::size::parse_size;
use ferry_api::{ApiError, VmSpec};

/// Flags for a user's VM: hardware beyond memory.
#[derive(clap::Args, Default, Clone)]
pub struct HardwareArgs {
    /// A spec file (TOML) with any of the fields below; flags override it.
    #[arg(long)]
    pub spec: Option<PathBuf>,
    #[arg(long)]
    pub vcpus: Option<u32>,
    /// Machine type (q35 or pc-q35-X.Y).
    #[arg(long)]
    pub machine: Option<String>,
    /// The machine's own devices: lean (the default: no SMBus, VMware port
    /// or TPR patching, and SATA only for a cloud-init seed) or full (q35
    /// as QEMU makes it, as VMs created before boards had).
    #[arg(long, value_enum)]
    pub board: Option<BoardArg>,
    /// CPU model (qemu64, Skylake-Server-v4, host, max, …).
    #[arg(long)]
    pub cpu: Option<String>,
    /// kernel (direct boot), bios (SeaBIOS) or uefi (OVMF).
    #[arg(long, value_enum)]
    pub firmware: Option<FirmwareArg>,
    /// Kernel for direct boot (a path every host sees).
    #[arg(long)]
    pub kernel: Option<String>,
    #[arg(long)]
    pub initrd: Option<String>,
    /// Kernel command line.
    #[arg(long)]
    pub append: Option<String>,
    /// A drive, repeatable, first boots: `disk=NAME` (a Ferry disk),
    /// `path=/shared/x.qcow2`, `nbd=nbd://HOST:PORT/EXPORT` or
    /// `local=NAME[,size=10G]` (a file of the host's own, which moves with
    /// the VM), then `,format=raw|qcow2` and `,readonly` as needed.
    #[arg(long = "drive")]
    pub drives: Vec<String>,
    /// A NIC, repeatable: `bridge=BR,mac=52:54:00:…`.
    #[arg(long = "nic")]
    pub nics: Vec<String>,
    /// cloud-init user-data file (a NoCloud seed is attached as a CD-ROM).
    #[arg(long)]
    pub user_data: Option<PathBuf>,
    /// cloud-init meta-data file.
    #[arg(long)]
    pub meta_data: Option<PathBuf>,
    /// Give the guest a qemu-guest-agent channel (checked after every move).
    #[arg(long)]
    pub guest_agent: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BoardArg {
    Lean,
    Full,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FirmwareArg {
    Kernel,
    Bios,
    Uefi,
}

/// Size fields a spec file may write as `"1G"`.
const SIZE_FIELDS: [&str; 4] = ["memory", "fill", "dirty_rate", "verify_rate"];

/// Reads a spec file into a spec named `name`; errors name the file and field.
pub fn read_spec_file(path: &Path, name: &str) -> Result<VmSpec, ApiError> {
    let field = format!("--spec {}", path.display());
    let text =
        std::fs::read_to_string(path).map_err(|e| ApiError::invalid(&field, e.to_string()))?;
    spec_from_toml(&text, name).map_err(|e| match e {
        ApiError::InvalidArgument { field: f, reason } => {
            ApiError::invalid(&format!("{} in {}", f, path.display()), reason)
        }
        e => e,
    })
}

/// Parses a spec file's text (the name comes from the command line).
pub fn spec_from_toml(text: &str, name: &str) -> Result<VmSpec, ApiError> {
    let mut v: toml::Table = toml::from_str(text)
        .map_err(|e| ApiError::invalid("spec", e.to_string().trim_end().to_string()))?;
    if v.contains_key("name") {
        return Err(ApiError::invalid(
            "name",
            "the VM's name is given on the command line, not in the spec file",
        ));
    }
    v.insert("name".into(), toml::Value::String(name.into()));
    for f in SIZE_FIELDS {
        if let Some(toml::Value::String(s)) = v.get(f) {
            let n = parse_size(f, s)?;
            v.insert(f.into(), toml::Value::Integer(n as i64));
        }
    }
    for (f, d) in [("fill", 0), ("dirty_rate", 0)] {
        v.entry(f).or_insert(toml::Value::Integer(d));
    }
    if !v.contains_key("memory") {
        return Err(ApiError::invalid(
            "memory",
            "the spec needs memory (e.g. memory = \"1G\")",
        ));
    }
    let spec: VmSpec = toml::Value::Table(v)
        .try_into()
        .map_err(|e: toml::de::Error| ApiError::invalid("spec", e.message().to_string()))?;
    Ok(spec)
}

/// `key=value,key=value,flag` as one flag's value.
fn key_values(flag: &str, s: &str) -> Result<Vec<(String, String)>, ApiError> {
    s.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => Ok((k.trim().to_string(), v.trim().to_string())),
            None if p == "readonly" => Ok((p.to_string(), "true".to_string())),
            None => Err(ApiError::invalid(
                flag,
                format!("'{p}' in '{s}' is not KEY=VALUE"),
            )),
        })
        .collect()
}

pub fn parse_drive(s: &str) -> Result<Drive, ApiError> {
    let mut d = Drive::default();
    for (k, v) in key_values("--drive", s)? {
        match k.as_str() {
            "disk" => d.disk = Some(v),
            "path" => d.path = Some(v),
            "nbd" => d.nbd = Some(v),
            "local" => d.local = Some(v),
            "size" => d.size = Some(ferry_api::size::parse_size("--drive", &v)?),
            "format" => {
                d.format = match v.as_str() {
                    "raw" => DriveFormat::Raw,
                    "qcow2" => DriveFormat::Qcow2,
                    _ => {
                        return Err(ApiError::invalid(
                            "--drive",
                            format!("format '{v}' is neither raw nor qcow2"),
                        ))
                    }
                }
            }
            "readonly" => d.readonly = v != "false" && v != "off",
            _ => {
                return Err(ApiError::invalid(
                    "--drive",
                    format!("unknown key '{k}' (disk, path, nbd, local, size, format, readonly)"),
                ))
            }
        }
    }
    Ok(d)
}

pub fn parse_nic(s: &str) -> Result<GuestNic, ApiError> {
    let (mut bridge, mut mac) = (None, None);
    for (k, v) in key_values("--nic", s)? {
        match k.as_str() {
            "bridge" => bridge = Some(v),
            "mac" => mac = Some(v),
            _ => {
                return Err(ApiError::invalid(
                    "--nic",
                    format!("unknown key '{k}' (bridge, mac)"),
                ))
            }
        }
    }
    match (bridge, mac) {
        (Some(bridge), Some(mac)) => Ok(GuestNic { bridge, mac }),
        _ => Err(ApiError::invalid(
            "--nic",
            format!("'{s}' needs bridge=BR,mac=MAC"),
        )),
    }
}

impl HardwareArgs {
    /// True when any flag makes this a user's VM rather than a workload guest.
    pub fn any(&self) -> bool {
        self.spec.is_some()
            || self.kernel.is_some()
            || self.firmware.is_some()
            || !self.drives.is_empty()
    }

    /// Applies the flags over `spec`.
    pub fn apply(&self, spec: &mut VmSpec) -> Result<(), ApiError> {
        if let Some(v) = self.vcpus {
            spec.vcpus = v;
        }
        if let Some(m) = &self.machine {
            spec.machine = m.clone();
        }
        if let Some(b) = self.board {
            spec.board = Some(match b {
                BoardArg::Lean => Board::Lean,
                BoardArg::Full => Board::Full,
            });
        }
        if let Some(c) = &self.cpu {
            spec.cpu = c.clone();
        }
        if let Some(f) = self.firmware {
            spec.firmware = match f {
                FirmwareArg::Kernel => Firmware::Kernel,
                FirmwareArg::Bios => Firmware::Bios,
                FirmwareArg::Uefi => Firmware::Uefi,
            };
        }
        if let Some(k) = &self.kernel {
            spec.kernel = Some(KernelBoot {
                kernel: k.clone(),
                initrd: None,
                append: String::new(),
            });
        }
        if self.initrd.is_some() || self.append.is_some() {
            let k = spec.kernel.as_mut().ok_or_else(|| {
                ApiError::invalid("--initrd", "--initrd and --append need a --kernel")
            })?;
            if let Some(i) = &self.initrd {
                k.initrd = Some(i.clone());
            }
            if let Some(a) = &self.append {
                k.append = a.clone();
            }
        }
        if !self.drives.is_empty() {
            spec.drives = self
                .drives
                .iter()
                .map(|d| parse_drive(d))
                .collect::<Result<_, _>>()?;
        }
        if !self.nics.is_empty() {
            spec.nics = self
                .nics
                .iter()
                .map(|n| parse_nic(n))
                .collect::<Result<_, _>>()?;
        }
        if self.user_data.is_some() || self.meta_data.is_some() {
            let read = |flag: &str, p: &Option<PathBuf>| -> Result<String, ApiError> {
                match p {
                    Some(p) => std::fs::read_to_string(p)
                        .map_err(|e| ApiError::invalid(flag, format!("{}: {e}", p.display()))),
                    None => Ok(String::new()),
                }
            };
            spec.cloud_init = Some(CloudInit {
                user_data: read("--user-data", &self.user_data)?,
                meta_data: read("--meta-data", &self.meta_data)?,
                network_config: None,
                redacted: false,
            });
        }
        if self.guest_agent {
            spec.guest_agent = true;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEBIAN: &str = r##"
memory = "512M"
vcpus = 1
cpu = "qemu64"
firmware = "kernel"
guest_agent = true

[kernel]
kernel = "/var/cache/ferry/debian/vmlinuz"
initrd = "/var/cache/ferry/debian/initrd.img"
append = "console=ttyS0 root=/dev/vda rw"

[[drives]]
disk = "deb-root"

[[drives]]
path = "/srv/shared/data.qcow2"
format = "qcow2"

[[nics]]
bridge = "br-guest"
mac = "52:54:00:c0:ff:01"

[cloud_init]
user_data = "#cloud-config\n"
meta_data = "instance-id: deb1\n"
"##;

    #[test]
    fn a_spec_file_reads_into_a_spec() {
        let s = spec_from_toml(DEBIAN, "deb1").unwrap();
        assert_eq!(s.name, "deb1");
        assert_eq!(s.memory, 512 << 20);
        assert_eq!(s.drives[0].disk.as_deref(), Some("deb-root"));
        assert_eq!(s.drives[1].format, DriveFormat::Qcow2);
        assert_eq!(s.nics[0].bridge, "br-guest");
        assert!(s.guest_agent && !s.is_workload());
        s.validate().unwrap();
    }

    #[test]
    fn the_packaged_example_is_a_valid_spec() {
        let s = spec_from_toml(
            include_str!("../../../packaging/examples/vm-debian.toml"),
            "web1",
        )
        .unwrap();
        s.validate().unwrap();
        assert_eq!(s.firmware, Firmware::Uefi);
        assert!(s.cloud_init.unwrap().user_data.starts_with("#cloud-config"));
    }

    #[test]
    fn spec_file_errors_name_the_field() {
        let e = spec_from_toml("memory = \"512M\"\ncpus = 2\n", "a")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cpus"), "{e}");
        let e = spec_from_toml("memory = \"lots\"\n", "a")
            .unwrap_err()
            .to_string();
        assert!(e.contains("memory"), "{e}");
        let e = spec_from_toml("memory = \"1G\"\nboard = \"tiny\"\n", "a")
            .unwrap_err()
            .to_string();
        assert!(e.contains("tiny") && e.contains("lean"), "{e}");
        let s = spec_from_toml("memory = \"1G\"\nboard = \"full\"\n", "a").unwrap();
        assert_eq!(s.board, Some(Board::Full));
        // none in the file: the control service gives a new VM `lean`
        assert_eq!(
            spec_from_toml("memory = \"1G\"\n", "a").unwrap().board,
            None
        );
        let e = spec_from_toml("name = \"x\"\nmemory = \"1G\"\n", "a")
            .unwrap_err()
            .to_string();
        assert!(e.contains("command line"), "{e}");
        let mut s = spec_from_toml(DEBIAN, "deb1").unwrap();
        s.nics[0].mac = "01:00:5e:00:00:01".into();
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .contains("nics[0].mac"));
    }

    #[test]
    fn flags_build_drives_and_nics() {
        let d = parse_drive("path=/srv/a.qcow2,format=qcow2,readonly").unwrap();
        assert_eq!(d.path.as_deref(), Some("/srv/a.qcow2"));
        assert!(d.readonly && d.format == DriveFormat::Qcow2);
        assert!(parse_drive("disk=a,format=vmdk")
            .unwrap_err()
            .to_string()
            .contains("vmdk"));
        let l = parse_drive("local=data.qcow2,size=1G,format=qcow2").unwrap();
        assert_eq!(l.local.as_deref(), Some("data.qcow2"));
        assert_eq!(l.size, Some(1 << 30));
        assert!(parse_drive("local=a,size=lots")
            .unwrap_err()
            .to_string()
            .contains("--drive"));
        let n = parse_nic("bridge=br0,mac=52:54:00:00:00:01").unwrap();
        assert_eq!(n.bridge, "br0");
        assert!(parse_nic("bridge=br0")
            .unwrap_err()
            .to_string()
            .contains("mac"));
    }
}
