//! Makes and removes the lab network with `ip` and `tc` (see [`crate::topology`]).
//!
//! Creation is ordered so that a crash part-way leaves only named objects that
//! [`destroy`] finds by name: namespaces `host*`, `ferry-fab*`, `ferry-guestnet` and
//! `ferry-client`, root links
//! `fm-h*` and the bridge `ferry-mgmt`. `destroy` never fails on something
//! already gone, so it cleans up a half-made lab as well as a whole one.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::topology::*;
use crate::{run, LabError};

fn ip(args: &[&str]) -> Result<String, LabError> {
    run("ip", args)
}

fn in_ns(ns: &str, args: &[&str]) -> Result<String, LabError> {
    let mut a = vec!["-n", ns];
    a.extend_from_slice(args);
    ip(&a)
}

fn shape(ns: &str, dev: &str, rate: &str) -> Result<(), LabError> {
    // tbf: a token bucket per link end; burst sized for up to ~10 Gbit/s.
    run(
        "ip",
        &[
            "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
            "burst", "512kb", "latency", "20ms",
        ],
    )
    .map(|_| ())
}

/// Creates the network of a lab. The caller ensures no lab is up.
pub fn create(spec: &LabSpec) -> Result<(), LabError> {
    spec.validate()?;
    let mtu = spec.mtu.to_string();
    ip(&["link", "add", MGMT_BRIDGE, "type", "bridge"])?;
    ip(&[
        "addr",
        "add",
        &format!("{CONTROL_MGMT_ADDR}/24"),
        "dev",
        MGMT_BRIDGE,
    ])?;
    ip(&["link", "set", MGMT_BRIDGE, "up"])?;
    for k in 1..=spec.nics {
        let fab = fabric_ns(k);
        ip(&["netns", "add", &fab])?;
        in_ns(&fab, &["link", "set", "lo", "up"])?;
        in_ns(&fab, &["link", "add", "br0", "type", "bridge"])?;
        in_ns(&fab, &["link", "set", "br0", "mtu", &mtu])?;
        in_ns(&fab, &["link", "set", "br0", "up"])?;
    }
    for i in 1..=spec.hosts {
        let h = host_name(i);
        ip(&["netns", "add", &h])?;
        in_ns(&h, &["link", "set", "lo", "up"])?;
        // management link: mgmt0 in the host, fm-h<i> on the root bridge
        let mp = mgmt_port(i);
        ip(&[
            "link", "add", &mp, "type", "veth", "peer", "name", "mgmt0", "netns", &h,
        ])?;
        ip(&["link", "set", &mp, "master", MGMT_BRIDGE, "up"])?;
        in_ns(
            &h,
            &[
                "addr",
                "add",
                &format!("{}/24", mgmt_addr(i)),
                "dev",
                "mgmt0",
            ],
        )?;
        in_ns(&h, &["link", "set", "mgmt0", "up"])?;
        for k in 1..=spec.nics {
            let (fab, nic, port) = (fabric_ns(k), nic_name(i, k), switch_port(i, k));
            in_ns(
                &h,
                &[
                    "link", "add", &nic, "mtu", &mtu, "type", "veth", "peer", "name", &port,
                    "netns", &fab,
                ],
            )?;
            in_ns(
                &fab,
                &["link", "set", &port, "mtu", &mtu, "master", "br0", "up"],
            )?;
            in_ns(
                &h,
                &[
                    "addr",
                    "add",
                    &format!("{}/24", nic_addr(i, k)),
                    "dev",
                    &nic,
                ],
            )?;
            in_ns(&h, &["link", "set", &nic, "up"])?;
            shape(&h, &nic, &spec.rate)?;
            shape(&fab, &port, &spec.rate)?;
        }
    }
    create_guest_network(spec)
}

/// The guests' network: a bridge [`GUEST_BRIDGE`] on every host, joined by
/// the guest fabric (a bridge in [`GUEST_FABRIC_NS`]), and a client
/// namespace [`CLIENT_NS`] on it that talks to guests from outside the
/// hosts. Unshaped: it carries the guests' own traffic, not migrations.
fn create_guest_network(spec: &LabSpec) -> Result<(), LabError> {
    ip(&["netns", "add", GUEST_FABRIC_NS])?;
    in_ns(GUEST_FABRIC_NS, &["link", "set", "lo", "up"])?;
    in_ns(GUEST_FABRIC_NS, &["link", "add", "br0", "type", "bridge"])?;
    in_ns(GUEST_FABRIC_NS, &["link", "set", "br0", "up"])?;
    for i in 1..=spec.hosts {
        let h = host_name(i);
        add_guest_bridge(&h)?;
        let port = format!("gh{i}");
        in_ns(
            &h,
            &[
                "link",
                "add",
                "guest0",
                "type",
                "veth",
                "peer",
                "name",
                &port,
                "netns",
                GUEST_FABRIC_NS,
            ],
        )?;
        in_ns(&h, &["link", "set", "guest0", "master", GUEST_BRIDGE, "up"])?;
        in_ns(
            GUEST_FABRIC_NS,
            &["link", "set", &port, "master", "br0", "up"],
        )?;
    }
    ip(&["netns", "add", CLIENT_NS])?;
    in_ns(CLIENT_NS, &["link", "set", "lo", "up"])?;
    in_ns(
        CLIENT_NS,
        &[
            "link",
            "add",
            "eth0",
            "type",
            "veth",
            "peer",
            "name",
            "gcl",
            "netns",
            GUEST_FABRIC_NS,
        ],
    )?;
    in_ns(
        GUEST_FABRIC_NS,
        &["link", "set", "gcl", "master", "br0", "up"],
    )?;
    in_ns(
        CLIENT_NS,
        &["addr", "add", &format!("{CLIENT_ADDR}/24"), "dev", "eth0"],
    )?;
    in_ns(CLIENT_NS, &["link", "set", "eth0", "up"])?;
    Ok(())
}

/// Makes host `h`'s guest bridge (as an administrator would have).
pub fn add_guest_bridge(h: &str) -> Result<(), LabError> {
    in_ns(h, &["link", "add", GUEST_BRIDGE, "type", "bridge"])?;
    // forward at once: a moved guest's frames must not wait out STP learning
    in_ns(
        h,
        &[
            "link",
            "set",
            GUEST_BRIDGE,
            "type",
            "bridge",
            "stp_state",
            "0",
            "forward_delay",
            "0",
        ],
    )?;
    in_ns(h, &["link", "set", GUEST_BRIDGE, "up"])?;
    if let Ok(out) = in_ns(h, &["-o", "link", "show", "guest0"]) {
        if !out.is_empty() {
            in_ns(h, &["link", "set", "guest0", "master", GUEST_BRIDGE, "up"])?;
        }
    }
    Ok(())
}

/// Lab namespaces present on this machine.
pub fn lab_namespaces() -> Vec<String> {
    let out = ip(&["netns", "list"]).unwrap_or_default();
    out.lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| {
            host_index(n).is_some()
                || n.starts_with("ferry-fab")
                || *n == GUEST_FABRIC_NS
                || *n == CLIENT_NS
        })
        .map(str::to_string)
        .collect()
}

/// PIDs of processes inside a namespace.
pub fn namespace_pids(ns: &str) -> Vec<i32> {
    ip(&["netns", "pids", ns])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Removes everything a lab made, whole or half-made. Kills every process in
/// the lab namespaces first (agents, QEMU). Returns what it removed.
pub fn destroy() -> Vec<String> {
    let mut removed = Vec::new();
    for ns in lab_namespaces() {
        for pid in namespace_pids(&ns) {
            // SAFETY: kill(2) with a plain pid and signal has no memory effects.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        if ip(&["netns", "del", &ns]).is_ok() {
            removed.push(format!("namespace {ns}"));
        }
    }
    let links = ip(&["-o", "link", "show"]).unwrap_or_default();
    for l in links.lines() {
        let name = l
            .split(':')
            .nth(1)
            .map(|s| s.trim().split('@').next().unwrap_or("").to_string());
        if let Some(name) = name {
            if (name.starts_with("fm-h") || name == MGMT_BRIDGE)
                && ip(&["link", "del", &name]).is_ok()
            {
                removed.push(format!("link {name}"));
            }
        }
    }
    removed
}

/// The (host index, NIC index) of a lab NIC, or an error naming what is unknown.
fn locate(spec: &LabSpec, host: &str, nic: &str) -> Result<(u32, u32), LabError> {
    let i = host_index(host)
        .filter(|i| *i <= spec.hosts)
        .ok_or_else(|| {
            LabError::Invalid(format!(
                "no lab host named '{host}' (host1..host{})",
                spec.hosts
            ))
        })?;
    let k = nic_index(i, nic)
        .filter(|k| *k <= spec.nics)
        .ok_or_else(|| {
            let names: Vec<String> = (1..=spec.nics).map(|k| nic_name(i, k)).collect();
            LabError::Invalid(format!(
                "no NIC named '{nic}' on {host} ({}, or nic1..nic{})",
                names.join(", "),
                spec.nics
            ))
        })?;
    Ok((i, k))
}

/// Sets the MTU of a host's NIC on the host side only, as a host configured
/// differently from the rest would be.
pub fn set_mtu(spec: &LabSpec, host: &str, nic: &str, mtu: u32) -> Result<(), LabError> {
    let (i, k) = locate(spec, host, nic)?;
    if !(576..=9000).contains(&mtu) {
        return Err(LabError::Invalid(format!("MTU {mtu} is outside 576..9000")));
    }
    in_ns(
        host,
        &["link", "set", &nic_name(i, k), "mtu", &mtu.to_string()],
    )
    .map(|_| ())
}

/// Reshapes both directions of one host NIC's link.
pub fn set_rate(spec: &LabSpec, host: &str, nic: &str, rate: &str) -> Result<(), LabError> {
    let (i, k) = locate(spec, host, nic)?;
    parse_rate(rate)?;
    shape(host, &nic_name(i, k), rate)?;
    shape(&fabric_ns(k), &switch_port(i, k), rate)
}

/// Cuts (`up = false`) or restores a host NIC's link at the switch side, as
/// pulling a cable would: the host sees its carrier go down. `mgmt0`, the
/// management NIC, cuts the host off from the control service and the
/// storage node.
pub fn set_link(spec: &LabSpec, host: &str, nic: &str, up: bool) -> Result<(), LabError> {
    if nic == "mgmt0" {
        let i = host_index(host)
            .filter(|i| *i <= spec.hosts)
            .ok_or_else(|| LabError::Invalid(format!("no lab host named '{host}'")))?;
        return ip(&["link", "set", &mgmt_port(i), if up { "up" } else { "down" }]).map(|_| ());
    }
    let (i, k) = locate(spec, host, nic)?;
    let port = switch_port(i, k);
    if up {
        // back in its bridge too, after a silent cut
        return in_ns(
            &fabric_ns(k),
            &["link", "set", &port, "master", "br0", "up"],
        )
        .map(|_| ());
    }
    in_ns(&fabric_ns(k), &["link", "set", &port, "down"]).map(|_| ())
}

/// Cuts a host NIC's path where neither host can see it: the switch stops
/// forwarding its port (taken out of the fabric's bridge) while both ends
/// keep their carrier, as a failed switch or a cut further on would.
/// [`set_link`] up restores it.
pub fn set_link_silent(spec: &LabSpec, host: &str, nic: &str) -> Result<(), LabError> {
    if nic == "mgmt0" {
        return Err(LabError::Invalid(
            "a silent cut is for migration NICs; cut mgmt0 with 'down'".into(),
        ));
    }
    let (i, k) = locate(spec, host, nic)?;
    in_ns(
        &fabric_ns(k),
        &["link", "set", &switch_port(i, k), "nomaster"],
    )
    .map(|_| ())
}

/// One link as `ferry lab status` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LinkStatus {
    pub host: String,
    pub nic: String,
    pub fabric: u32,
    pub address: String,
    pub mtu: u32,
    pub rate: String,
    /// Operational state seen inside the host (`UP`, `LOWERLAYERDOWN`, …).
    pub state: String,
    pub tx_bytes: u64,
    pub rx_bytes: u64,
}

/// Reads every host NIC's state with `ip -j`.
pub fn status(spec: &LabSpec) -> Vec<LinkStatus> {
    let mut out = Vec::new();
    for i in 1..=spec.hosts {
        let h = host_name(i);
        let json = in_ns(&h, &["-j", "-s", "link", "show"]).unwrap_or_else(|_| "[]".into());
        let links: Vec<serde_json::Value> = serde_json::from_str(&json).unwrap_or_default();
        for k in 1..=spec.nics {
            let nic = nic_name(i, k);
            let l = links.iter().find(|l| l["ifname"] == nic.as_str());
            let stat = |dir: &str| {
                l.and_then(|l| l["stats64"][dir]["bytes"].as_u64())
                    .unwrap_or(0)
            };
            out.push(LinkStatus {
                host: h.clone(),
                nic: nic.clone(),
                fabric: k,
                address: nic_addr(i, k),
                mtu: l.and_then(|l| l["mtu"].as_u64()).unwrap_or(0) as u32,
                rate: spec.rate.clone(),
                state: l
                    .and_then(|l| l["operstate"].as_str())
                    .unwrap_or("MISSING")
                    .to_string(),
                tx_bytes: stat("tx"),
                rx_bytes: stat("rx"),
            });
        }
    }
    out
}

/// The lab's state directory and its files.
pub struct LabDir(pub PathBuf);

impl LabDir {
    pub fn default_path() -> Self {
        LabDir(crate::run_dir().join("lab"))
    }
    pub fn spec_path(&self) -> PathBuf {
        self.0.join("lab.json")
    }
    /// The first admin API token (the CLI's default in a lab).
    pub fn admin_token_path(&self) -> PathBuf {
        self.0.join("admin.token")
    }
    /// The lab's certificates: `pki/ca` (the cluster CA), `pki/control`,
    /// `pki/storage1`, `pki/hostN`, `pki/admin`.
    pub fn pki_path(&self) -> PathBuf {
        self.0.join("pki")
    }
    pub fn ca_cert_path(&self) -> PathBuf {
        self.pki_path().join("ca").join("ca-cert.pem")
    }
    pub fn token_path(&self) -> PathBuf {
        self.0.join("cluster.token")
    }
    pub fn host_dir(&self, host: &str) -> PathBuf {
        self.0.join(host)
    }
    /// Storage every lab host mounts (it is one machine): the one directory
    /// the lab's agents grant guests for `path` drives and kernels.
    pub fn shared_path(&self) -> PathBuf {
        self.0.join("shared")
    }
    pub fn control_dir(&self) -> PathBuf {
        self.0.join("control")
    }
    pub fn load_spec(&self) -> Result<LabSpec, LabError> {
        let p = self.spec_path();
        let s = std::fs::read_to_string(&p).map_err(|_| LabError::NotUp)?;
        serde_json::from_str(&s).map_err(|e| LabError::Invalid(format!("{}: {e}", p.display())))
    }
    pub fn store_spec(&self, spec: &LabSpec) -> Result<(), LabError> {
        let p = self.spec_path();
        let s = serde_json::to_string_pretty(spec).map_err(|e| LabError::Invalid(e.to_string()))?;
        std::fs::write(&p, s).map_err(|e| LabError::io(&p, e))
    }
}

/// Starts `exe args…` detached (own session), inside namespace `ns` if given,
/// with stdout and stderr appended to `log`, and in the cgroup whose
/// `cgroup.procs` file is `join` if given (before it runs: whatever it
/// starts is born there too). Returns its pid.
pub fn spawn_daemon(
    ns: Option<&str>,
    exe: &Path,
    args: &[String],
    log: &Path,
    join: Option<&Path>,
) -> Result<u32, LabError> {
    use std::os::unix::process::CommandExt;
    let logf = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| LabError::io(log, e))?;
    let logf2 = logf.try_clone().map_err(|e| LabError::io(log, e))?;
    let mut cmd = match ns {
        Some(ns) => {
            let mut c = std::process::Command::new("ip");
            c.args(["netns", "exec", ns]).arg(exe);
            c
        }
        None => std::process::Command::new(exe),
    };
    cmd.args(args)
        .stdin(std::process::Stdio::null())
        .stdout(logf)
        .stderr(logf2);
    let join = join
        .map(|p| {
            std::ffi::CString::new(p.as_os_str().as_encoded_bytes())
                .map_err(|_| LabError::Invalid(format!("{} has a NUL byte", p.display())))
        })
        .transpose()?;
    // SAFETY: setsid, getpid, open, write and close are async-signal-safe;
    // the path was made before the fork and the digits go to the stack.
    unsafe {
        cmd.pre_exec(move || {
            libc::setsid();
            if let Some(procs) = &join {
                let mut digits = [0u8; 12];
                let mut at = digits.len();
                let mut pid = libc::getpid() as u32;
                loop {
                    at -= 1;
                    digits[at] = b'0' + (pid % 10) as u8;
                    pid /= 10;
                    if pid == 0 {
                        break;
                    }
                }
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let n = digits.len() - at;
                let w = libc::write(fd, digits[at..].as_ptr().cast(), n);
                let e = std::io::Error::last_os_error();
                libc::close(fd);
                if w != n as isize {
                    return Err(e);
                }
            }
            Ok(())
        });
    }
    let child = cmd.spawn().map_err(|source| LabError::Spawn {
        cmd: exe.display().to_string(),
        source,
    })?;
    Ok(child.id())
}

/// Which of a host's networks `isolate` cuts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Network {
    /// The control service's calls to its agent (port 7800 on mgmt0).
    Management,
    /// Its migration fabrics (every fabric NIC).
    Migration,
    /// Its NBD and storage REST traffic (ports 10809 and 7900 on mgmt0).
    Storage,
    All,
}

/// Rule preferences of isolation (policy routing in the host's namespace:
/// what it sends that way is dropped; no packet filter needed).
const ISOLATION_PREFS: std::ops::RangeInclusive<u32> = 90..=99;

fn host_ns(spec: &LabSpec, host: &str) -> Result<u32, LabError> {
    host_index(host)
        .filter(|i| *i <= spec.hosts)
        .ok_or_else(|| {
            LabError::Invalid(format!(
                "no lab host named '{host}' (host1..host{})",
                spec.hosts
            ))
        })
}

/// Cuts one of a host's networks while its processes run on: what the
/// host sends there is dropped (replies included), so the others see it
/// silent there and nowhere else.
pub fn isolate(spec: &LabSpec, host: &str, net: Network) -> Result<(), LabError> {
    host_ns(spec, host)?;
    let mgmt = "198.18.0.0/24";
    let mut rules: Vec<Vec<String>> = Vec::new();
    let rule = |pref: u32, rest: &[&str]| -> Vec<String> {
        let mut r = vec![
            "rule".to_string(),
            "add".into(),
            "pref".into(),
            pref.to_string(),
        ];
        r.extend(rest.iter().map(|s| s.to_string()));
        r.push("blackhole".into());
        r
    };
    if matches!(net, Network::Management) {
        rules.push(rule(90, &["to", mgmt, "ipproto", "tcp", "sport", "7800"]));
    }
    if matches!(net, Network::Storage) {
        rules.push(rule(91, &["to", mgmt, "ipproto", "tcp", "dport", "10809"]));
        rules.push(rule(92, &["to", mgmt, "ipproto", "tcp", "dport", "7900"]));
    }
    if matches!(net, Network::All) {
        rules.push(rule(93, &["to", mgmt]));
    }
    if matches!(net, Network::Migration | Network::All) {
        for k in 1..=spec.nics {
            let net = format!(
                "{}.0/24",
                crate::topology::nic_addr(1, k)
                    .rsplit_once('.')
                    .map(|x| x.0)
                    .unwrap_or("")
            );
            rules.push(rule(93 + k.min(6), &["to", &net]));
        }
    }
    for r in rules {
        let a: Vec<&str> = r.iter().map(String::as_str).collect();
        in_ns(host, &a)?;
    }
    Ok(())
}

/// Removes every isolation of a host.
pub fn rejoin(spec: &LabSpec, host: &str) -> Result<(), LabError> {
    host_ns(spec, host)?;
    for pref in ISOLATION_PREFS {
        // a preference may hold several rules
        while in_ns(host, &["rule", "del", "pref", &pref.to_string()]).is_ok() {}
    }
    Ok(())
}

/// A pulled power cord: every process of the host's namespace killed (its
/// agent and QEMUs), its links down. [`power_on`] brings the links back;
/// the caller starts its agent.
pub fn power_off(spec: &LabSpec, host: &str) -> Result<usize, LabError> {
    let i = host_ns(spec, host)?;
    let pids = namespace_pids(host);
    for pid in &pids {
        // SAFETY: kill(2) with a plain pid and signal has no memory effects.
        unsafe { libc::kill(*pid, libc::SIGKILL) };
    }
    ip(&["link", "set", &mgmt_port(i), "down"])?;
    for k in 1..=spec.nics {
        in_ns(&fabric_ns(k), &["link", "set", &switch_port(i, k), "down"])?;
    }
    Ok(pids.len())
}

pub fn power_on(spec: &LabSpec, host: &str) -> Result<(), LabError> {
    let i = host_ns(spec, host)?;
    rejoin(spec, host)?;
    ip(&["link", "set", &mgmt_port(i), "up"])?;
    for k in 1..=spec.nics {
        in_ns(
            &fabric_ns(k),
            &["link", "set", &switch_port(i, k), "master", "br0", "up"],
        )?;
    }
    Ok(())
}
