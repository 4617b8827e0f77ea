//! The host an agent runs: its VMs, its memory budget, its NICs, and the
//! guest check ("is this guest intact and still running?").
//!
//! Memory is reserved under the state lock before any QEMU starts, so two
//! concurrent requests can never overcommit a host: a VM being created or
//! arriving by migration holds its reservation from the first moment.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ferry_api::{ApiError, CheckResult, HostInfo, NicInfo, VmInfo, VmSpec};
use ferry_lab::console;

use crate::qemu::{self, QemuVm};
use crate::AgentConfig;

/// Host memory QEMU itself needs per VM beyond guest RAM.
pub const VM_OVERHEAD: u64 = 64 << 20;

/// What a VM slot is doing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// QEMU is being started.
    Starting,
    /// Running here.
    Running,
    /// A skeleton waiting for (or receiving) a migration.
    Incoming {
        migration_id: String,
        source: String,
        /// The source agent's URL, to ask it what became of the migration.
        source_url: String,
        /// The skeleton's directory.
        dir: PathBuf,
        /// When the skeleton was asked for.
        since: std::time::Instant,
        /// This agent's CPU time when the skeleton was asked for.
        agent_cpu_at_start: Duration,
    },
}

pub struct VmSlot {
    pub spec: VmSpec,
    pub role: Role,
    pub qemu: Option<Arc<QemuVm>>,
    /// An outgoing migration is under way.
    pub migrating: bool,
    /// A skeleton's transport session (multichannel), closed with it.
    pub transport: Option<ferry_transport::Carriers>,
    /// A migration of this VM is in doubt here (see [`crate::commit`]).
    pub doubt: Option<String>,
    /// The last guest check after a migration failed: why.
    pub problem: Option<String>,
}

impl VmSlot {
    pub fn new(spec: VmSpec, role: Role, qemu: Option<Arc<QemuVm>>) -> VmSlot {
        VmSlot {
            spec,
            role,
            qemu,
            migrating: false,
            transport: None,
            doubt: None,
            problem: None,
        }
    }
}

#[derive(Default)]
pub struct HostState {
    pub vms: BTreeMap<String, VmSlot>,
}

impl HostState {
    pub fn reserved(&self) -> u64 {
        self.vms.values().map(|v| v.spec.memory + VM_OVERHEAD).sum()
    }
}

pub struct Agent {
    pub cfg: AgentConfig,
    pub cred: ferry_api::auth::Credential,
    pub state: tokio::sync::Mutex<HostState>,
    pub sinks: crate::validate::Sinks,
    /// Bandwidth classes on this host's NICs.
    pub classes: Arc<std::sync::Mutex<crate::classes::Classes>>,
    /// Every migration's commit record (see [`crate::commit`]).
    pub journal: crate::commit::Journal,
    /// Migrations a move of this process is driving now (by id).
    pub live: std::sync::Mutex<std::collections::BTreeSet<String>>,
}

impl Agent {
    pub fn new(cfg: AgentConfig, cred: ferry_api::auth::Credential) -> Arc<Agent> {
        Arc::new(Agent {
            cred,
            journal: crate::commit::Journal::new(&cfg.state_dir),
            live: Default::default(),
            state: Default::default(),
            sinks: Default::default(),
            classes: Arc::new(std::sync::Mutex::new(crate::classes::Classes::new(
                cfg.nic_rate,
            ))),
            cfg,
        })
    }

    pub fn vm_dir(&self, name: &str, suffix: &str) -> PathBuf {
        self.cfg
            .state_dir
            .join("vms")
            .join(format!("{name}{suffix}"))
    }

    /// Reserves memory and a name for a VM that is about to start. Fails with
    /// `InsufficientMemory` or `AlreadyExists` before anything starts.
    pub async fn reserve(&self, spec: &VmSpec, role: Role) -> Result<(), ApiError> {
        spec.validate()?;
        let mut st = self.state.lock().await;
        if st.vms.contains_key(&spec.name) {
            return Err(ApiError::AlreadyExists {
                kind: "vm".into(),
                name: spec.name.clone(),
            });
        }
        let available = self.cfg.memory.saturating_sub(st.reserved());
        let needed = spec.memory + VM_OVERHEAD;
        if needed > available {
            return Err(ApiError::InsufficientMemory {
                host: self.cfg.name.clone(),
                needed,
                available,
            });
        }
        st.vms
            .insert(spec.name.clone(), VmSlot::new(spec.clone(), role, None));
        Ok(())
    }

    /// Drops a reservation and returns its QEMU, if any, for the caller to stop.
    pub async fn release(&self, name: &str) -> Option<Arc<QemuVm>> {
        self.state
            .lock()
            .await
            .vms
            .remove(name)
            .and_then(|s| s.qemu)
    }

    /// Creates and boots a VM.
    pub async fn create_vm(&self, spec: VmSpec) -> Result<VmInfo, ApiError> {
        self.reserve(&spec, Role::Starting).await?;
        let dir = self.vm_dir(&spec.name, "");
        match qemu::launch(&self.cfg.qemu, &spec, &dir, false).await {
            Ok(vm) => {
                let vm = Arc::new(vm);
                if let Err(e) = wait_workload(&vm, BOOT_TIMEOUT).await {
                    vm.kill().await;
                    self.release(&spec.name).await;
                    return Err(ApiError::internal(format!(
                        "vm {} did not start its workload: {e}",
                        spec.name
                    )));
                }
                let mut st = self.state.lock().await;
                if let Some(slot) = st.vms.get_mut(&spec.name) {
                    slot.qemu = Some(vm.clone());
                    slot.role = Role::Running;
                }
                drop(st);
                tracing::info!(vm = %spec.name, pid = vm.pid, "vm started");
                Ok(self.vm_info(&spec, &Role::Running, Some(&vm)).await)
            }
            Err(e) => {
                self.release(&spec.name).await;
                Err(ApiError::internal(format!(
                    "starting QEMU for {}: {}",
                    spec.name,
                    error_chain(&e)
                )))
            }
        }
    }

    async fn vm_info(&self, spec: &VmSpec, role: &Role, qemu: Option<&Arc<QemuVm>>) -> VmInfo {
        self.vm_info_with(spec, role, qemu, None, None).await
    }

    async fn vm_info_with(
        &self,
        spec: &VmSpec,
        role: &Role,
        qemu: Option<&Arc<QemuVm>>,
        in_doubt: Option<String>,
        problem: Option<String>,
    ) -> VmInfo {
        let state = match (role, qemu) {
            (Role::Starting, _) => "starting".to_string(),
            (Role::Incoming { .. }, _) => "incoming".to_string(),
            (Role::Running, Some(q)) => match q.qmp.status().await {
                Ok(s) => s.status,
                Err(_) if !q.alive().await => "exited".to_string(),
                Err(_) => "unreachable".to_string(),
            },
            (Role::Running, None) => "unknown".to_string(),
        };
        VmInfo {
            name: spec.name.clone(),
            host: self.cfg.name.clone(),
            spec: spec.clone(),
            state,
            pid: qemu.map(|q| q.pid),
            in_doubt,
            problem,
        }
    }

    pub async fn list_vms(&self) -> Vec<VmInfo> {
        let slots: Vec<_> = {
            let st = self.state.lock().await;
            st.vms
                .values()
                .map(|s| {
                    (
                        s.spec.clone(),
                        s.role.clone(),
                        s.qemu.clone(),
                        s.doubt.clone(),
                        s.problem.clone(),
                    )
                })
                .collect()
        };
        let mut out = Vec::new();
        for (spec, role, q, doubt, problem) in slots {
            out.push(
                self.vm_info_with(&spec, &role, q.as_ref(), doubt, problem)
                    .await,
            );
        }
        out
    }

    /// The running VM `name` (not a skeleton, not starting).
    pub async fn running_vm(&self, name: &str) -> Result<(VmSpec, Arc<QemuVm>), ApiError> {
        let st = self.state.lock().await;
        match st.vms.get(name) {
            Some(VmSlot {
                spec,
                role: Role::Running,
                qemu: Some(q),
                ..
            }) => Ok((spec.clone(), q.clone())),
            Some(_) => Err(ApiError::Conflict {
                reason: format!("vm {name} is not running here yet"),
            }),
            None => Err(ApiError::not_found("vm", name)),
        }
    }

    /// Hot-plugs an NBD disk into a running VM; the disk joins the VM's spec,
    /// so a migration target starts with it plugged.
    pub async fn plug_disk(
        &self,
        name: &str,
        plug: ferry_api::DiskPlug,
    ) -> Result<VmInfo, ApiError> {
        let (host, port, export) = plug.parse_uri()?;
        let mut st = self.state.lock().await;
        let slot = st
            .vms
            .get_mut(name)
            .ok_or_else(|| ApiError::not_found("vm", name))?;
        let q = match (&slot.role, &slot.qemu, slot.migrating) {
            (Role::Running, Some(q), false) => q.clone(),
            _ => {
                return Err(ApiError::Conflict {
                    reason: format!("vm {name} is not running here, or is migrating"),
                })
            }
        };
        if slot.spec.disks.iter().any(|d| d.disk == plug.disk) {
            return Err(ApiError::AlreadyExists {
                kind: format!("disk of vm {name}"),
                name: plug.disk,
            });
        }
        let index = slot.spec.disks.len();
        if index >= ferry_api::MAX_VM_DISKS {
            return Err(ApiError::invalid(
                "disk",
                format!("vm {name} has {index} disks, the most it takes"),
            ));
        }
        q.qmp
            .plug_disk(index, &host, port, &export)
            .await
            .map_err(|e| ApiError::unavailable(format!("plugging {} into {name}", plug.disk), e))?;
        slot.spec.disks.push(plug);
        let spec = slot.spec.clone();
        drop(st);
        tracing::info!(vm = %name, disks = spec.disks.len(), "disk plugged");
        Ok(self.vm_info(&spec, &Role::Running, Some(&q)).await)
    }

    pub async fn remove_vm(&self, name: &str) -> Result<(), ApiError> {
        {
            let st = self.state.lock().await;
            match st.vms.get(name) {
                None => return Err(ApiError::not_found("vm", name)),
                Some(s) if s.migrating || s.role != Role::Running => {
                    return Err(ApiError::Conflict {
                        reason: format!("vm {name} is migrating"),
                    })
                }
                Some(_) => {}
            }
        }
        if let Some(q) = self.release(name).await {
            q.stop().await;
            self.remove_vm_dir(&q.dir, &format!("{name}.removed"));
        }
        tracing::info!(vm = name, "vm removed");
        Ok(())
    }

    /// Checks a running guest; a failure is kept on the VM (`problem` in
    /// `vm list`) until a check passes.
    pub async fn check_vm(&self, name: &str) -> Result<CheckResult, ApiError> {
        let (_, q) = self.running_vm(name).await?;
        let r = check(&self.cfg.name, name, &q, Duration::from_secs(8)).await;
        let problem = (!r.ok()).then(|| r.summary());
        if let Some(slot) = self.state.lock().await.vms.get_mut(name) {
            slot.problem = problem;
        }
        Ok(r)
    }

    /// Removes a VM's directory, keeping its QEMU log (every run-state change
    /// is traced there) as `STATE_DIR/log/LABEL.qemu.log`.
    pub fn remove_vm_dir(&self, dir: &std::path::Path, label: &str) {
        let logs = self.cfg.state_dir.join("log");
        if std::fs::create_dir_all(&logs).is_ok() {
            let _ = std::fs::copy(dir.join("qemu.log"), logs.join(format!("{label}.qemu.log")));
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    pub async fn host_info(&self) -> HostInfo {
        let vms = self.list_vms().await;
        let reserved = self.state.lock().await.reserved();
        HostInfo {
            name: self.cfg.name.clone(),
            agent_url: self.cfg.url.clone(),
            memory_total: self.cfg.memory,
            memory_reserved: reserved,
            memory_free: self.cfg.memory.saturating_sub(reserved),
            nics: nics(),
            vms,
            bandwidth: ferry_api::util::lock(&self.classes).policy().clone(),
        }
    }

    /// Sets the bandwidth policy and applies it at once.
    pub async fn set_bandwidth(
        &self,
        p: ferry_api::bandwidth::BandwidthPolicy,
    ) -> Result<ferry_api::bandwidth::HostBandwidth, ApiError> {
        p.check()?;
        let classes = self.classes.clone();
        let host = self.cfg.name.clone();
        tokio::task::spawn_blocking(move || {
            let mut c = ferry_api::util::lock(&classes);
            c.set_policy(p);
            c.reconcile();
            c.status(&host)
        })
        .await
        .map_err(ApiError::internal)
    }

    pub async fn bandwidth(&self) -> Result<ferry_api::bandwidth::HostBandwidth, ApiError> {
        let classes = self.classes.clone();
        let host = self.cfg.name.clone();
        tokio::task::spawn_blocking(move || ferry_api::util::lock(&classes).status(&host))
            .await
            .map_err(ApiError::internal)
    }
}

/// Time a new guest has to boot and fill its memory.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(180);

/// Waits until the guest workload prints its first tick (it has filled its
/// memory and runs), so a created VM is ready to check or move.
async fn wait_workload(vm: &QemuVm, timeout: Duration) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let state = console::parse_log(
            &console::read_tail(&vm.console_path(), 64 << 10).unwrap_or_default(),
        );
        if !state.problems.is_empty() {
            return Err(state.problems.join(" | "));
        }
        if state.last.is_some() {
            return Ok(());
        }
        if !vm.alive().await {
            return Err("QEMU exited".into());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("no workload tick within {} s", timeout.as_secs()));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Logs `message` once per `key` for the life of the agent.
fn warn_once(key: &str, message: &str) {
    static SEEN: std::sync::Mutex<std::collections::BTreeSet<String>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    if ferry_api::util::lock(&SEEN).insert(key.to_string()) {
        tracing::warn!("{message}");
    }
}

pub use ferry_api::util::error_chain;

fn read_u64(path: PathBuf) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// This host's migration NICs: interfaces named `nic*` with an IPv4 address,
/// read from `getifaddrs` and sysfs in the agent's own network namespace
/// (no process spawned: progress reads them every tick).
pub fn nics() -> Vec<NicInfo> {
    let mut out: Vec<NicInfo> = ipv4_addrs()
        .into_iter()
        .filter_map(|(name, ip)| {
            ferry_lab::topology::nic_index(&name)?;
            let address = ip.to_string();
            let sys = PathBuf::from("/sys/class/net").join(&name);
            // a NIC whose fabric is unknown is never paired by default
            let Some(fabric) = ferry_lab::topology::fabric_of_addr(&address) else {
                warn_once(
                    &name,
                    &format!(
                        "NIC {name} ({address}) is on no known fabric: not used for migrations"
                    ),
                );
                return None;
            };
            Some(NicInfo {
                fabric,
                address,
                mtu: read_u64(sys.join("mtu")) as u32,
                up: read_u64(sys.join("carrier")) == 1,
                tx_bytes: read_u64(sys.join("statistics/tx_bytes")),
                rx_bytes: read_u64(sys.join("statistics/rx_bytes")),
                name,
            })
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Every interface with an IPv4 address, with its first one.
fn ipv4_addrs() -> Vec<(String, std::net::Ipv4Addr)> {
    let mut out: Vec<(String, std::net::Ipv4Addr)> = Vec::new();
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: on success `list` heads a list getifaddrs allocated; it is read
    // only until the freeifaddrs below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return out;
    }
    let mut cur = list;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of that list; an IPv4 `ifa_addr` points to
        // a sockaddr_in and `ifa_name` to a NUL-terminated name.
        unsafe {
            let i = &*cur;
            if !i.ifa_addr.is_null() && i32::from((*i.ifa_addr).sa_family) == libc::AF_INET {
                let sin = &*(i.ifa_addr as *const libc::sockaddr_in);
                let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                let name = std::ffi::CStr::from_ptr(i.ifa_name)
                    .to_string_lossy()
                    .into_owned();
                if !out.iter().any(|(n, _)| *n == name) {
                    out.push((name, ip));
                }
            }
            cur = i.ifa_next;
        }
    }
    // SAFETY: `list` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(list) };
    out
}

/// Checks a guest: QEMU's run state, the workload's counter advancing over
/// the check, and no integrity error or panic on its console. Waits up to
/// `wait` for a tick, then for a newer one.
pub async fn check(host: &str, name: &str, q: &QemuVm, wait: Duration) -> CheckResult {
    let qemu_status = match q.qmp.status().await {
        Ok(s) => s.status,
        Err(_) => "unreachable".into(),
    };
    let deadline = tokio::time::Instant::now() + wait;
    let path = q.console_path();
    // an unreadable console is a failed check, never a skipped one
    let mut unreadable = None;
    let mut read = || match console::read_tail(&path, 256 << 10) {
        Ok(text) => console::parse_log(&text),
        Err(e) => {
            unreadable = Some(format!("console {} unreadable: {e}", path.display()));
            console::parse_log("")
        }
    };
    let mut first = None;
    let mut state = read();
    loop {
        if first.is_none() {
            first = state.last;
        }
        let advanced = matches!((first, state.last), (Some(a), Some(b)) if b.tick > a.tick);
        if advanced || !state.problems.is_empty() || tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        state = read();
    }
    if let Some(why) = unreadable {
        state.problems.push(why);
    }
    // integrity errors since boot are in the tick's counter; a panic stops the ticks
    let last = state.last;
    let errors = last.map(|t| t.errors).unwrap_or(0);
    CheckResult {
        vm: name.into(),
        host: host.into(),
        running: qemu_status == "running",
        qemu_status,
        tick_first: first.map(|t| t.tick),
        tick_last: last.map(|t| t.tick),
        sweeps: last.map(|t| t.sweeps),
        errors,
        advancing: matches!((first, last), (Some(a), Some(b)) if b.tick > a.tick),
        intact: errors == 0 && state.problems.is_empty() && last.is_some(),
        problems: state.problems,
    }
}

/// User + system CPU time of a process (every thread), from `/proc/PID/stat`;
/// `None` once it is gone.
pub fn process_cpu(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    cpu_of_stat(&stat)
}

/// This agent's own CPU time.
pub fn own_cpu() -> Duration {
    process_cpu(std::process::id()).unwrap_or_default()
}

/// utime + stime (fields 14 and 15) of a `/proc/PID/stat` line; the command
/// name in parentheses may itself contain spaces and parentheses.
fn cpu_of_stat(stat: &str) -> Option<Duration> {
    let f: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf only reads a constant of the running system
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some(Duration::from_micros(ticks * 1_000_000 / hz))
}

#[cfg(test)]
mod cpu_tests {
    use super::*;

    #[test]
    fn interface_addresses_come_from_getifaddrs() {
        let all = ipv4_addrs();
        assert!(
            all.iter()
                .any(|(n, ip)| n == "lo" && *ip == std::net::Ipv4Addr::LOCALHOST),
            "lo with 127.0.0.1 missing from {all:?}"
        );
    }

    #[test]
    fn stat_lines_with_odd_names_parse() {
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
        let line = format!(
            "42 (qemu (x) y) S 1 42 42 0 -1 4194560 100 0 0 0 {} {} 0 0 20 0 1 0",
            3 * hz,
            hz
        );
        assert_eq!(cpu_of_stat(&line), Some(Duration::from_secs(4)));
        assert_eq!(cpu_of_stat("garbage"), None);
        assert!(process_cpu(std::process::id()).is_some());
    }
}
