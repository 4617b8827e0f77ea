//! The VM registry room: every VM this host runs or receives, its slot, its
//! memory reservation, its directory, its console and its check.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ferry_api::{ApiError, CheckResult, VmInfo, VmSpec};

use crate::facts::cpu_of_stat;
use crate::guest::{read_tail, GuestCheck, Reading};
use crate::host::{Agent, Role, VmSlot, VM_OVERHEAD};
use crate::qemu::{self, QemuVm};
use ferry_api::util::error_chain;

impl Agent {
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
        spec.validate()?;
        self.preflight(&spec, None).await?;
        self.reserve(&spec, Role::Starting).await?;
        let made = match crate::local_disk::ensure(&self.cfg.qemu, &spec).await {
            Ok(m) => m,
            Err(e) => {
                self.release(&spec.name).await;
                return Err(e);
            }
        };
        let dir = self.vm_dir(&spec.name, "");
        match qemu::launch(&self.cfg.qemu, &spec, &dir, false).await {
            Ok(vm) => {
                let vm = Arc::new(vm);
                // a workload guest is ready once it ticks; any other once QEMU runs it
                let ready = if spec.is_workload() {
                    wait_workload(self.guest.as_ref(), &vm, BOOT_TIMEOUT).await
                } else {
                    Ok(())
                };
                if let Err(e) = ready {
                    vm.kill().await;
                    self.release(&spec.name).await;
                    crate::local_disk::remove(&made);
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
                crate::local_disk::remove(&made);
                Err(ApiError::internal(format!(
                    "starting QEMU for {}: {}",
                    spec.name,
                    error_chain(&e)
                )))
            }
        }
    }

    pub(crate) async fn vm_info(
        &self,
        spec: &VmSpec,
        role: &Role,
        qemu: Option<&Arc<QemuVm>>,
    ) -> VmInfo {
        self.vm_info_with(spec, role, qemu, None, None, None).await
    }

    pub(crate) async fn vm_info_with(
        &self,
        spec: &VmSpec,
        role: &Role,
        qemu: Option<&Arc<QemuVm>>,
        in_doubt: Option<String>,
        problem: Option<String>,
        storage_pause: Option<ferry_api::StoragePause>,
    ) -> VmInfo {
        let state = match (role, qemu) {
            (Role::Starting, _) => "starting".to_string(),
            (Role::Incoming { .. }, _) => "incoming".to_string(),
            (Role::Running, Some(q)) => match q.qmp.status_seen().await {
                Ok(s) => s.status,
                Err(_) if !q.alive().await => "exited".to_string(),
                Err(_) => "unreachable".to_string(),
            },
            (Role::Running, None) => "unknown".to_string(),
        };
        VmInfo {
            name: spec.name.clone(),
            host: self.cfg.name.clone(),
            // a listing never carries the seed's user data
            spec: spec.redacted(),
            state,
            pid: qemu.map(|q| q.pid),
            in_doubt,
            problem,
            accel: self.cfg.qemu.accel.clone(),
            storage_pause,
            migrating: false,
            confinement: qemu.and_then(|q| {
                let (uid, seccomp) = q.confinement()?;
                Some(ferry_api::VmConfinement {
                    uid,
                    seccomp,
                    cgroups: crate::confine::cgroups_of(q.pid),
                })
            }),
            moves_encrypted: None,
            desired: None,
            ha: None,
            stopped_because: None,
            // a skeleton's QEMU is not the guest yet: its CPU and bytes
            // are the move's, and listed under the guest's name beside the
            // source's they would restart the balancer's count each beat
            usage: match (role, qemu) {
                (Role::Running, Some(q)) => self.usage(spec, q).await,
                _ => None,
            },
        }
    }

    /// What `q` has used: its process's CPU time and memory, its guest's
    /// NIC and disk bytes, its last measured dirty rate.
    async fn usage(&self, spec: &VmSpec, q: &QemuVm) -> Option<ferry_api::VmUsage> {
        let mut u = usage_of(q.pid)?;
        let taps: u64 = (0..spec.nics.len())
            .map(|i| tap_bytes(&crate::qemu::tap_name(&spec.name, i)))
            .sum();
        u.io_bytes = taps + q.qmp.block_io_bytes().await.unwrap_or(0);
        u.dirty_bps = ferry_api::util::lock(&self.facts.dirty)
            .get(&spec.name)
            .copied();
        Some(u)
    }

    /// Measures each running guest's dirty page rate, one guest at a time,
    /// every [`ferry_api::DIRTY_SAMPLE_EVERY_S`] s: QEMU's page sampling
    /// over one second. A guest being moved is left alone (its rate is the
    /// migration's own business then).
    pub async fn sample_dirty_rates(&self) {
        let every = Duration::from_secs(ferry_api::DIRTY_SAMPLE_EVERY_S);
        loop {
            crate::facts::tick(every).await;
            let running: Vec<(String, Arc<QemuVm>)> = {
                let st = self.state.lock().await;
                st.vms
                    .iter()
                    .filter(|(_, s)| matches!(s.role, Role::Running) && !s.migrating)
                    .filter_map(|(n, s)| Some((n.clone(), s.qemu.clone()?)))
                    .collect()
            };
            let names: Vec<&String> = running.iter().map(|(n, _)| n).collect();
            ferry_api::util::lock(&self.facts.dirty).retain(|k, _| names.contains(&k));
            for (name, q) in running {
                // never during a migration, on either side: a post-copy
                // target's pages may not be there yet, and hashing one
                // waits for it (QMP with it)
                let settled = match q.qmp.query_migrate().await {
                    Ok(m) => settled_migration(m.status.as_deref()),
                    Err(_) => false,
                };
                if !settled || q.qmp.calc_dirty_rate(1_000).await.is_err() {
                    continue;
                }
                tokio::time::sleep(Duration::from_millis(1_200)).await;
                if let Ok(Some(bps)) = q.qmp.dirty_rate().await {
                    ferry_api::util::lock(&self.facts.dirty).insert(name, bps);
                }
            }
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
                        s.storage_pause.clone(),
                        s.migrating,
                    )
                })
                .collect()
        };
        let mut out = Vec::new();
        for (spec, role, q, doubt, problem, pause, migrating) in slots {
            let mut info = self
                .vm_info_with(&spec, &role, q.as_ref(), doubt, problem, pause)
                .await;
            info.migrating = migrating;
            out.push(info);
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
        let spec = self
            .state
            .lock()
            .await
            .vms
            .get(name)
            .map(|s| s.spec.clone());
        if let Some(q) = self.release(name).await {
            q.stop().await;
            self.remove_vm_dir(&q.dir, &format!("{name}.removed"));
        }
        // its local drives go with it (they exist nowhere else)
        if let Some(spec) = spec {
            crate::local_disk::remove(&crate::local_disk::paths(&self.cfg.qemu, &spec));
        }
        tracing::info!(vm = name, "vm removed");
        Ok(())
    }

    /// Stops, shuts down or resets a VM running here. A stopped VM is
    /// forgotten here (the control service keeps its definition) and keeps
    /// its local drives.
    pub async fn vm_action(
        &self,
        name: &str,
        action: ferry_api::ha::Action,
        req: &ferry_api::ha::ActionRequest,
    ) -> Result<ferry_api::ha::Stopped, ApiError> {
        use ferry_api::ha::{Action, DEFAULT_SHUTDOWN_S, MAX_SHUTDOWN_S};
        let t0 = std::time::Instant::now();
        {
            let st = self.state.lock().await;
            if st.vms.get(name).is_some_and(|s| s.migrating) {
                return Err(ApiError::Conflict {
                    reason: format!("vm {name} is migrating"),
                });
            }
        }
        let (spec, q) = self.running_vm(name).await?;
        let mut via = None;
        let how = match action {
            Action::Reboot => {
                q.qmp.system_reset().await.map_err(ApiError::internal)?;
                tracing::info!(vm = name, "vm reset");
                "reset"
            }
            Action::Stop | Action::Shutdown => {
                let mut how = "stopped";
                if action == Action::Shutdown {
                    let secs = req.timeout_s.unwrap_or(DEFAULT_SHUTDOWN_S);
                    if secs == 0 || secs > MAX_SHUTDOWN_S {
                        return Err(ApiError::invalid(
                            "timeout_s",
                            format!("{secs} is outside 1..={MAX_SHUTDOWN_S}"),
                        ));
                    }
                    // the guest agent's own shutdown when it has one, else ACPI
                    let sock = q.dir.join(crate::qemu::QGA_SOCK);
                    let agent = match spec.guest_agent {
                        true => match crate::qga::Qga::connect(&sock, Duration::from_secs(3)).await
                        {
                            Ok(mut a) => a.shutdown().await.is_ok(),
                            Err(e) => {
                                tracing::info!(vm = name, "guest agent: {e}; ACPI instead");
                                false
                            }
                        },
                        false => false,
                    };
                    if !agent {
                        q.qmp.system_powerdown().await.map_err(ApiError::internal)?;
                    }
                    via = Some(if agent { "guest-agent" } else { "acpi" }.to_string());
                    let deadline = t0 + Duration::from_secs(secs);
                    while !powered_off(&q).await && std::time::Instant::now() < deadline {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    if powered_off(&q).await {
                        how = "powered_off";
                    } else {
                        tracing::warn!(
                            vm = name,
                            secs,
                            "the guest did not power off in time: stopped"
                        );
                    }
                }
                if let Some(q) = self.release(name).await {
                    q.stop().await;
                    self.remove_vm_dir(&q.dir, &format!("{name}.stopped"));
                }
                tracing::info!(vm = name, how, "vm stopped");
                how
            }
            Action::Start | Action::Restart => {
                return Err(ApiError::invalid(
                    "action",
                    format!(
                        "'{}' is the control service's (an agent boots a VM by POST /vms)",
                        action.as_str()
                    ),
                ))
            }
        };
        Ok(ferry_api::ha::Stopped {
            vm: name.into(),
            host: self.cfg.name.clone(),
            how: how.into(),
            via,
            took_ms: t0.elapsed().as_millis() as u64,
        })
    }

    /// Checks a running guest; a failure is kept on the VM (`problem` in
    /// `vm list`) until a check passes.
    /// `after`: the guest's last tick before it came here (see [`check`]).
    pub async fn check_vm(&self, name: &str, after: Option<u64>) -> Result<CheckResult, ApiError> {
        let (spec, q) = self.running_vm(name).await?;
        let r = check(
            self.guest.as_ref(),
            &self.cfg.name,
            &spec,
            &q,
            Duration::from_secs(8),
            after,
        )
        .await;
        let problem = (!r.ok()).then(|| r.summary());
        if let Some(slot) = self.state.lock().await.vms.get_mut(name) {
            slot.problem = problem;
        }
        Ok(r)
    }

    /// The last `max` bytes of a running VM's serial console.
    pub async fn console_tail(
        &self,
        name: &str,
        max: u64,
    ) -> Result<ferry_api::ConsoleTail, ApiError> {
        let (_, q) = self.running_vm(name).await?;
        let path = q.console_path();
        let unavailable = |e: std::io::Error| ApiError::Unavailable {
            what: format!("{name}'s console log ({})", path.display()),
            reason: e.to_string(),
        };
        let size = std::fs::metadata(&path).map_err(unavailable)?.len();
        let text = read_tail(&path, max.clamp(1, 1 << 20)).map_err(unavailable)?;
        Ok(ferry_api::ConsoleTail {
            vm: name.into(),
            host: self.cfg.name.clone(),
            size,
            text,
        })
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

    /// Keeps every guest's console log within `console_log_max` (see
    /// [`crate::guest::rotate`]): a guest printing without end fills no disk.
    pub async fn rotate_consoles(&self) {
        let logs: Vec<(String, PathBuf)> = {
            let st = self.state.lock().await;
            st.vms
                .iter()
                .filter_map(|(n, s)| Some((n.clone(), s.qemu.as_ref()?.console_path())))
                .collect()
        };
        for (vm, log) in logs {
            match crate::guest::rotate(&log, self.cfg.console_log_max) {
                Ok(true) => {
                    tracing::info!(%vm, max = self.cfg.console_log_max, "console log rotated")
                }
                Ok(false) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(%vm, "rotating the console log: {e}"),
            }
        }
    }
}

/// Whether QEMU's migration state (`query-migrate`'s status, on a source
/// or a target) leaves its guest memory whole and still: no migration, or
/// one that ended.
fn settled_migration(status: Option<&str>) -> bool {
    matches!(
        status,
        None | Some("none" | "completed" | "cancelled" | "failed")
    )
}

/// Bytes a tap carried both ways (0 for one that is not there).
fn tap_bytes(tap: &str) -> u64 {
    let sys = std::path::Path::new("/sys/class/net").join(tap);
    crate::facts::read_u64(sys.join("statistics/rx_bytes"))
        + crate::facts::read_u64(sys.join("statistics/tx_bytes"))
}

/// Time a new guest has to boot and fill its memory.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(180);

/// What process `pid` has used: CPU time from `/proc/PID/stat` (fields 14
/// and 15, in clock ticks), resident memory from `/proc/PID/statm`.
pub fn usage_of(pid: u32) -> Option<ferry_api::VmUsage> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // the command may hold spaces and parentheses: fields follow the last ')'
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf reads a constant of the running system
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: as above
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;
    Some(ferry_api::VmUsage {
        cpu_ms: ticks * 1000 / hz,
        rss: pages * page,
        io_bytes: 0,
        dirty_bps: None,
    })
}

/// Waits until the guest workload prints its first tick (it has filled its
/// memory and runs), so a created VM is ready to check or move.
async fn wait_workload(
    guest: &dyn GuestCheck,
    vm: &QemuVm,
    timeout: Duration,
) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let state = guest.read(&read_tail(&vm.console_path(), 64 << 10).unwrap_or_default());
        if !state.problems.is_empty() {
            return Err(state.problems.join(" | "));
        }
        if state.last.is_some() || !guest.has_progress() {
            return Ok(());
        }
        if !vm.alive().await {
            return Err("QEMU exited".into());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("no workload tick within {} s", timeout.as_secs()));
        }
        tokio::time::sleep(BOOT_POLL).await;
    }
}

/// How often a booting guest's console is looked at for its first tick: a
/// create returns that much later at most.
const BOOT_POLL: Duration = Duration::from_millis(50);

/// How often the check looks at the guest again: a move's report (and a
/// drain's end) waits for it.
const CHECK_POLL: Duration = Duration::from_millis(50);

/// Has the workload's counter advanced: past the first tick seen during
/// the check, or past `after` (its last tick on the host it came from)?
fn counted(
    first: Option<crate::guest::Progress>,
    last: Option<crate::guest::Progress>,
    after: Option<u64>,
) -> bool {
    match (first, last) {
        (Some(a), Some(b)) if b.tick > a.tick => true,
        (_, Some(b)) => after.is_some_and(|n| b.tick > n),
        _ => false,
    }
}

/// Checks a guest: QEMU's run state, the guest advancing, and no integrity
/// error or panic on its console (as `guest` reads it).
///
/// "Advancing" is the workload's counter for the lab's workload guest
/// (waits up to `wait` for a tick, then a newer one — or for one past
/// `after`, the last tick the guest printed elsewhere: a guest just moved
/// here prints to a console of its own on this host, so a tick past the
/// source's last is one it counted here); for any other guest,
/// CPU time spent by its vCPU threads during the check. A guest with the
/// guest agent must also answer `guest-ping`, and its clock
/// (`guest-get-time`) must move forward.
pub async fn check(
    guest: &dyn GuestCheck,
    host: &str,
    spec: &VmSpec,
    q: &QemuVm,
    wait: Duration,
    after: Option<u64>,
) -> CheckResult {
    let workload = spec.is_workload() && guest.has_progress();
    let counted = |first, last| counted(first, last, after);
    let qemu_status = match q.qmp.status().await {
        Ok(s) => s.status,
        Err(_) => "unreachable".into(),
    };
    let deadline = tokio::time::Instant::now() + wait;
    let path = q.console_path();
    // an unreadable console is a failed check, never a skipped one
    let mut unreadable = None;
    let mut read = || match read_tail(&path, 256 << 10) {
        Ok(text) => guest.read(&text),
        Err(e) => {
            unreadable = Some(format!("console {} unreadable: {e}", path.display()));
            Reading::default()
        }
    };
    let mut first = None;
    let mut state = read();
    // the workload's counter says whether it advances; any other guest, its vCPUs' CPU
    let vcpu_start = if workload { None } else { vcpu_cpu(q).await };
    let mut vcpu_ms = None;
    loop {
        if first.is_none() {
            first = state.last;
        }
        let advanced = if workload {
            counted(first, state.last)
        } else {
            let now = vcpu_cpu(q).await;
            vcpu_ms = match (vcpu_start, now) {
                (Some(a), Some(b)) => Some(b.saturating_sub(a).as_millis() as u64),
                _ => None,
            };
            vcpu_ms.is_some_and(|ms| ms > 0)
        };
        // a problem on the console does not end the check: a guest that
        // reported a soft lockup may run on, and `advancing` says whether it does
        if advanced || tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(CHECK_POLL).await;
        state = read();
    }
    if let Some(why) = unreadable {
        state.problems.push(why);
    }
    let guest_agent = if spec.guest_agent {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let r = ask_guest_agent(q, left.max(Duration::from_secs(3))).await;
        if let Err(why) = &r {
            state.problems.push(format!("guest agent: {why}"));
        }
        Some(r.is_ok())
    } else {
        None
    };
    // integrity errors since boot are in the tick's counter; a panic stops the ticks
    let last = state.last;
    let errors = if workload {
        last.map(|t| t.errors).unwrap_or(0)
    } else {
        0
    };
    let running = qemu_status == "running";
    let advancing = if workload {
        counted(first, last)
    } else {
        vcpu_ms.is_some_and(|ms| ms > 0)
    };
    CheckResult {
        vm: spec.name.clone(),
        host: host.into(),
        running,
        qemu_status,
        tick_first: first.filter(|_| workload).map(|t| t.tick),
        tick_last: last.filter(|_| workload).map(|t| t.tick),
        sweeps: last.filter(|_| workload).map(|t| t.sweeps),
        errors,
        advancing,
        intact: errors == 0
            && state.problems.is_empty()
            && (!workload || last.is_some())
            && running,
        problems: state.problems,
        vcpu_ms,
        guest_agent,
    }
}

/// CPU time the VM's vCPU threads have used so far (`query-cpus-fast`
/// names them; `/proc/PID/task/TID/stat` counts them).
async fn vcpu_cpu(q: &QemuVm) -> Option<Duration> {
    let vcpus = q.qmp.vcpus().await.ok()?;
    let mut total = Duration::ZERO;
    for v in vcpus {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/task/{}/stat", q.pid, v.thread_id)).ok()?;
        total += cpu_of_stat(&stat)?;
    }
    Some(total)
}

/// The guest turned itself off: QEMU exited (or is a zombie not yet
/// reaped), reports the `shutdown` run state, or has stopped answering QMP.
async fn powered_off(q: &QemuVm) -> bool {
    if !q.alive().await {
        return true;
    }
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", q.pid)).unwrap_or_default();
    if stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .trim_start()
        .starts_with('Z')
    {
        return true;
    }
    // once asked to power off, a QMP that no longer answers is a QEMU
    // leaving its main loop (closing its devices)
    match q.qmp.status().await {
        Ok(s) => s.status == "shutdown",
        Err(_) => true,
    }
}

/// The guest agent answers a ping and its clock moves forward.
async fn ask_guest_agent(q: &QemuVm, wait: Duration) -> Result<(), String> {
    let sock = q.dir.join(crate::qemu::QGA_SOCK);
    let mut a = crate::qga::Qga::connect(&sock, wait)
        .await
        .map_err(|e| e.to_string())?;
    a.ping().await.map_err(|e| e.to_string())?;
    let t0 = a.time_ns().await.map_err(|e| e.to_string())?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t1 = a.time_ns().await.map_err(|e| e.to_string())?;
    if t1 > t0 {
        Ok(())
    } else {
        Err(format!("its clock did not advance ({t0} then {t1})"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dirty_rates_are_sampled_only_outside_a_migration() {
        for quiet in [
            None,
            Some("none"),
            Some("completed"),
            Some("cancelled"),
            Some("failed"),
        ] {
            assert!(settled_migration(quiet), "{quiet:?}");
        }
        for busy in [
            "setup",
            "active",
            "device",
            "postcopy-active",
            "postcopy-paused",
            "postcopy-recover",
            "pre-switchover",
            "wait-unplug",
        ] {
            assert!(!settled_migration(Some(busy)), "{busy}");
        }
    }

    #[test]
    fn a_counter_advances_past_the_first_tick_seen_or_the_sources_last() {
        let t = |tick| {
            Some(crate::guest::Progress {
                tick,
                ..Default::default()
            })
        };
        assert!(counted(t(5), t(6), None));
        assert!(!counted(t(5), t(5), None), "one tick is no progress");
        assert!(!counted(None, None, Some(4)));
        // a guest just moved here: its first tick on this console is past the source's last
        assert!(counted(t(5), t(5), Some(4)));
        assert!(!counted(t(4), t(4), Some(4)), "the source's own last tick");
        assert!(!counted(t(3), t(3), Some(4)), "a counter gone back");
    }
}
