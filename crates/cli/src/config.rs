//! The services' configuration files: `/etc/ferry/agent.toml`,
//! `control.toml` and `storage.toml` (every key in `docs/config.md`).
//!
//! A file is read whole and strictly: an unknown key, a value of the wrong
//! type or a value that cannot hold on this host is refused at start, naming
//! the file, the key and what is wrong. Command-line flags override the file.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Where the packaged services look for their files.
pub const ETC: &str = "/etc/ferry";
/// The cluster credential every service reads by default.
pub const DEFAULT_CREDENTIAL: &str = "/etc/ferry/cluster.token";
/// Where the certificates live on a machine (see `ferry_net::tls`): one
/// directory per service (`agent`, `control`, `storage`, `admin`) and the
/// cluster CA's certificate `ca-cert.pem` (the CLI's trust root).
pub const PKI: &str = "/etc/ferry/pki";
/// An administrator's certificate for NBD clients (`ferry disk import`).
pub const DEFAULT_ADMIN_TLS_DIR: &str = "/etc/ferry/pki/admin";
/// The first admin API token, made by `ferry cluster init`; the CLI's default.
pub const DEFAULT_ADMIN_TOKEN: &str = "/etc/ferry/admin.token";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: cannot read it: {source}")]
    Read {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error("{file}: {message}")]
    Parse { file: PathBuf, message: String },
    #[error("{file}: key `{key}`: {why}")]
    Key {
        file: PathBuf,
        key: &'static str,
        why: String,
    },
}

/// Reads `path` as `T`. A file given explicitly must exist; the default
/// file may be absent (then every key takes its default). Returns the file
/// read, if any, for naming it in later errors.
pub fn load<T: DeserializeOwned + Default>(
    explicit: Option<&Path>,
    default: &str,
) -> Result<(T, PathBuf), ConfigError> {
    let path = explicit
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(default));
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if explicit.is_none() && e.kind() == std::io::ErrorKind::NotFound => {
            return Ok((T::default(), path))
        }
        Err(source) => return Err(ConfigError::Read { file: path, source }),
    };
    parse(&text, &path).map(|t| (t, path))
}

pub fn parse<T: DeserializeOwned>(text: &str, file: &Path) -> Result<T, ConfigError> {
    toml::from_str(text).map_err(|e| ConfigError::Parse {
        file: file.into(),
        // toml's message names the key and points at the line
        message: e.to_string().trim_end().to_string(),
    })
}

/// `/etc/ferry/agent.toml`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentFile {
    /// This host's name in the cluster (default: the system host name).
    pub name: Option<String>,
    /// The agent's API address (default `0.0.0.0:7800`).
    pub listen: Option<SocketAddr>,
    /// The URL peers and the control service reach the agent at (default:
    /// `https://LISTEN`, with this host's name when LISTEN is 0.0.0.0;
    /// `http://` under `insecure_http`).
    pub url: Option<String>,
    /// The cluster credential file (default `/etc/ferry/cluster.token`).
    pub credential: Option<PathBuf>,
    /// This service's certificate directory (default `/etc/ferry/pki/SERVICE`).
    pub tls_dir: Option<PathBuf>,
    /// Plain HTTP with the cluster credential instead of TLS (debugging only).
    pub insecure_http: Option<bool>,
    /// VMs, journal, logs (default `/var/lib/ferry/agent`).
    pub state_dir: Option<PathBuf>,
    /// QEMU binary (default `qemu-system-x86_64`).
    pub qemu: Option<String>,
    /// `auto` (the default: KVM when it runs guests here, else TCG), `kvm` or `tcg`.
    pub accel: Option<String>,
    /// Memory offered to VMs (e.g. `48G`); default: the host's memory less
    /// `reserved_memory`.
    pub memory: Option<String>,
    /// Memory kept for the host itself when `memory` is not given (default `2G`).
    pub reserved_memory: Option<String>,
    /// Migration NICs by interface name.
    #[serde(default)]
    pub nics: Vec<String>,
    /// Migration NICs by network: every interface with an address in one.
    #[serde(default)]
    pub networks: Vec<String>,
    /// A NIC for storage traffic, when separate.
    pub storage_nic: Option<String>,
    /// The NICs' rate when sysfs cannot tell (e.g. `10gbit`).
    pub nic_rate: Option<String>,
    /// Where the agent answers NIC probes from peers (default 7801, every address).
    pub probe_port: Option<u16>,
    /// Guest kernel and initramfs for workload guests.
    pub kernel: Option<PathBuf>,
    pub initrd: Option<PathBuf>,
    /// The CPU models this host offers guests (default: every model QEMU
    /// can run here); a move to this host of a VM with another is refused.
    pub cpu_models: Option<Vec<String>>,
    /// Directories whose files guests may use as `path` drives (absolute;
    /// default: none).
    #[serde(default)]
    pub drive_dirs: Vec<PathBuf>,
    /// Directories whose files guests may boot as a kernel or initramfs
    /// (absolute; default: none).
    #[serde(default)]
    pub kernel_dirs: Vec<PathBuf>,
    /// Linux bridges guests' NICs may join (default: none).
    #[serde(default)]
    pub bridges: Vec<String>,
    /// A guest's console log is rotated past this size (default `8M`; one
    /// older generation is kept).
    pub console_log_max: Option<String>,
    /// UEFI firmware code (default `/usr/share/OVMF/OVMF_CODE_4M.fd`).
    pub ovmf_code: Option<PathBuf>,
    /// UEFI variable store template (default `/usr/share/OVMF/OVMF_VARS_4M.fd`).
    pub ovmf_vars: Option<PathBuf>,
    /// How long a guest's disk I/O waits for unreachable NBD storage before
    /// the guest is paused (default `5s`; QEMU reconnects meanwhile).
    pub storage_pause_after: Option<String>,
    /// A guest paused for its storage this long is stopped (default `30m`).
    pub storage_pause_max: Option<String>,
    /// The longest answer line taken from a guest agent (default `4M`).
    pub guest_agent_max_reply: Option<String>,
    /// Bytes one transport stream may hold out of order before its session
    /// fails (default `64M`, at least `8M`).
    pub reorder_window: Option<String>,
    /// Each VM's QEMU runs as a user of its own, under seccomp, in a cgroup
    /// of its own (default `true`); `false` runs QEMU as the agent's user.
    pub confine_qemu: Option<bool>,
    /// The first uid of this host's QEMUs (default 4000000; 65536 are used).
    pub qemu_uid_base: Option<u32>,
    /// What the agent's API takes from its clients (`[limits]`).
    #[serde(default)]
    pub limits: ferry_net::server::Limits,
}

/// `/etc/ferry/control.toml`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlFile {
    /// The API address (default `127.0.0.1:7700`).
    pub listen: Option<SocketAddr>,
    pub credential: Option<PathBuf>,
    /// This service's certificate directory (default `/etc/ferry/pki/SERVICE`).
    pub tls_dir: Option<PathBuf>,
    /// Plain HTTP with the cluster credential instead of TLS (debugging only).
    pub insecure_http: Option<bool>,
    /// The first admin API token, taken up at start unless a token named
    /// `admin` was ever made (default `/etc/ferry/admin.token`).
    pub admin_token: Option<PathBuf>,
    /// SQLite state file (default `/var/lib/ferry/control/state.db`).
    pub state: Option<PathBuf>,
    /// Or etcd, shared by every control instance: `etcds://HOST:PORT[,…]`
    /// (TLS, client certificate), or `etcd://` to a loopback address.
    pub store: Option<String>,
    /// Certificate directory for `etcds://` (default: the control
    /// service's own, `tls_dir`).
    pub store_tls: Option<PathBuf>,
    /// This instance's name among several sharing etcd (default
    /// `HOSTNAME:PORT`), as the leader key and `cluster control` show it.
    pub instance: Option<String>,
    /// Hosts: name → agent URL.
    #[serde(default)]
    pub hosts: BTreeMap<String, String>,
    /// Storage nodes: name → API URL.
    #[serde(default)]
    pub storage: BTreeMap<String, String>,
    /// The programs a rolling drain may run as hooks, by name (default
    /// `/etc/ferry/hooks`; root's to fill).
    pub hooks_dir: Option<PathBuf>,
    /// Event streams (`/watch`) one token may hold open at once (default 16).
    pub max_streams_per_token: Option<usize>,
    /// What the API takes from its clients (`[limits]`).
    #[serde(default)]
    pub limits: ferry_net::server::Limits,
}

/// `/etc/ferry/storage.toml`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorageFile {
    /// The node's name (default `storage1`).
    pub name: Option<String>,
    /// Disks and state (default `/var/lib/ferry/storage`).
    pub dir: Option<PathBuf>,
    pub nbd_listen: Option<SocketAddr>,
    pub api_listen: Option<SocketAddr>,
    /// Address clients reach NBD at, for disk URIs (default: `nbd_listen`).
    pub nbd_address: Option<String>,
    pub credential: Option<PathBuf>,
    /// This service's certificate directory (default `/etc/ferry/pki/SERVICE`).
    pub tls_dir: Option<PathBuf>,
    /// Plain HTTP with the cluster credential instead of TLS (debugging only).
    pub insecure_http: Option<bool>,
    /// NBD over TLS: `require` (the default with TLS on) or `off`.
    pub nbd_tls: Option<String>,
    /// Normalized IOPS the backing store sustains (0: no limit).
    pub capacity_iops: Option<u64>,
    /// Client address → host name (flows are shown per host).
    #[serde(default)]
    pub peers: BTreeMap<String, String>,
    /// What the node's API takes from its clients (`[limits]`).
    #[serde(default)]
    pub limits: ferry_net::server::Limits,
    /// What NBD takes from its clients (`[nbd_limits]`).
    #[serde(default)]
    pub nbd_limits: ferry_storage::nbd::server::NbdLimits,
}

/// Checks `networks` and `nics` of an agent file against this host.
pub fn nic_selection(
    file: &Path,
    nics: &[String],
    networks: &[String],
) -> Result<ferry_agent::NicSelection, ConfigError> {
    let mut sel = ferry_agent::NicSelection {
        names: nics.to_vec(),
        networks: Vec::new(),
    };
    for n in networks {
        sel.networks.push(n.parse().map_err(|why| ConfigError::Key {
            file: file.into(),
            key: "networks",
            why,
        })?);
    }
    sel.check().map_err(|e| ConfigError::Key {
        file: file.into(),
        key: match e {
            ferry_agent::host::NicSelectionError::NoMatch { .. } => "networks",
            _ => "nics",
        },
        why: e.to_string(),
    })?;
    Ok(sel)
}

/// The credential file: the flag, the file's key, `/etc/ferry/cluster.token`.
pub fn credential(flag: Option<&PathBuf>, file: Option<&PathBuf>) -> PathBuf {
    flag.or(file)
        .cloned()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CREDENTIAL))
}

/// Reads the cluster credential: the flag, the file's key, or the default.
pub fn load_credential(
    flag: Option<&PathBuf>,
    file: Option<&PathBuf>,
) -> anyhow::Result<ferry_api::auth::Credential> {
    use anyhow::Context;
    let path = credential(flag, file);
    ferry_api::auth::Credential::load(&path)
        .with_context(|| format!("reading the cluster credential {}", path.display()))
}

/// The host's memory (`MemTotal` of /proc/meminfo), bytes.
pub fn host_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// The system's host name.
pub fn system_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn agent(text: &str) -> Result<AgentFile, ConfigError> {
        parse(text, Path::new("/etc/ferry/agent.toml"))
    }

    #[test]
    fn a_full_agent_file_parses() {
        let f = agent(
            r#"
name = "host1"
listen = "10.0.0.11:7800"
credential = "/etc/ferry/cluster.token"
state_dir = "/var/lib/ferry/agent"
qemu = "/usr/bin/qemu-system-x86_64"
accel = "kvm"
reserved_memory = "4G"
nics = ["ens1f0", "ens1f1"]
networks = ["10.10.0.0/24"]
storage_nic = "ens2f0"
nic_rate = "10gbit"
"#,
        )
        .unwrap();
        assert_eq!(f.name.as_deref(), Some("host1"));
        assert_eq!(f.nics, ["ens1f0", "ens1f1"]);
        assert_eq!(f.listen, Some("10.0.0.11:7800".parse().unwrap()));
    }

    #[test]
    fn an_unknown_key_is_refused_with_the_file_and_the_key() {
        let e = agent("name = \"h\"\nnic = [\"eth0\"]\n")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("/etc/ferry/agent.toml: "), "{e}");
        assert!(e.contains("unknown field `nic`"), "{e}");
        assert!(e.contains("line 2"), "{e}");
    }

    #[test]
    fn a_value_of_the_wrong_type_is_refused() {
        let e = agent("listen = \"not an address\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("listen"), "{e}");
        let e = agent("nics = \"eth0\"\n").unwrap_err().to_string();
        assert!(e.contains("nics") || e.contains("sequence"), "{e}");
    }

    #[test]
    fn a_nic_or_network_the_host_lacks_is_named() {
        let f = Path::new("/etc/ferry/agent.toml");
        let e = nic_selection(f, &["ferry-no-such-nic0".into()], &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(
                "/etc/ferry/agent.toml: key `nics`: no interface named 'ferry-no-such-nic0'"
            ),
            "{e}"
        );
        let e = nic_selection(f, &[], &["203.0.113.0/24".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("key `networks`: 203.0.113.0/24 matches no address"),
            "{e}"
        );
        let e = nic_selection(f, &[], &["10.0.0.0".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("key `networks`: '10.0.0.0' is not a network"),
            "{e}"
        );
        assert!(nic_selection(f, &["lo".into()], &[]).is_ok());
    }

    #[test]
    fn control_and_storage_files_parse_strictly() {
        let c: ControlFile = parse(
            "listen = \"0.0.0.0:7700\"\n[hosts]\nhost1 = \"http://10.0.0.11:7800\"\n",
            Path::new("c.toml"),
        )
        .unwrap();
        assert_eq!(c.hosts["host1"], "http://10.0.0.11:7800");
        assert!(parse::<ControlFile>("hosts = 3\n", Path::new("c.toml")).is_err());
        let s: StorageFile = parse(
            "name = \"s1\"\ncapacity_iops = 5000\n[peers]\n\"10.0.0.11\" = \"host1\"\n",
            Path::new("s.toml"),
        )
        .unwrap();
        assert_eq!(s.capacity_iops, Some(5000));
        let e = parse::<StorageFile>("capacity = 1\n", Path::new("s.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `capacity`"), "{e}");
    }

    #[test]
    fn the_packaged_examples_parse() {
        let p = Path::new("example");
        let a: AgentFile =
            parse(include_str!("../../../packaging/examples/agent.toml"), p).unwrap();
        assert_eq!(a.nics, ["ens1f0", "ens1f1"]);
        let c: ControlFile =
            parse(include_str!("../../../packaging/examples/control.toml"), p).unwrap();
        assert_eq!(c.hosts.len(), 2);
        let s: StorageFile =
            parse(include_str!("../../../packaging/examples/storage.toml"), p).unwrap();
        assert_eq!(s.peers.len(), 2);
    }

    #[test]
    fn a_missing_default_file_means_defaults_but_a_named_one_must_exist() {
        let (f, _) = load::<AgentFile>(None, "/nonexistent/ferry/agent.toml").unwrap();
        assert_eq!(f, AgentFile::default());
        let e = load::<AgentFile>(Some(Path::new("/nonexistent/agent.toml")), ETC).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("/nonexistent/agent.toml: cannot read it"),
            "{e}"
        );
    }
}
