//! Rolling drain of the cluster: the planner (pure, unit-tested) and its
//! runner. The run's [`RollingStatus`] is the control service's durable
//! state (`cluster` key `rolling`), written at every change; a control
//! service that starts finds a run still `running` and carries it on:
//! - a host `draining` when the service stopped is drained again once no
//!   move is in flight anywhere (moves the agents carried on alone settle
//!   first), so no VM is asked to move twice at once;
//! - a host in `maintenance` waits to be resumed, as before.
//!
//! With several control instances on one state (etcd), one carries the run
//! out (`owner`, refreshed at every write, at least once a second); another
//! takes it over when the owner has written nothing for [`ORPHANED`]. A
//! single instance (SQLite) takes its own run up again at once.
//!
//! Which host next, and where its VMs go: the next pending host whose VMs
//! fit on the hosts that are up and take VMs, preferring hosts already done
//! (a VM placed on a host still pending would move twice) — so memory on
//! the pending hosts stays free for the drains still to come. No host
//! starts while `max_hosts_down` hosts are draining, in maintenance, down,
//! or drained by hand.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use ferry_api::drain::{DrainEvent, DrainRequest};
use ferry_api::rolling::{
    DrainProgress, Phase, RollingHost, RollingRequest, RollingState, RollingStatus,
};
use ferry_api::util::now_ms;
use ferry_api::{ApiError, HostEntry};
use futures::StreamExt;

use crate::{drain, lock, Control};

/// The key of the run in the control service's durable state.
pub const KEY: &str = "rolling";
/// How often the runner looks at the cluster, and runs a hook.
const TICK: Duration = Duration::from_secs(1);
const HOOK_EVERY: Duration = Duration::from_secs(3);
/// Where hooks are, unless the control service's `hooks_dir` says.
pub const DEFAULT_HOOKS_DIR: &str = "/etc/ferry/hooks";

/// The program a hook's name stands for: `dir/NAME`, a regular executable
/// file that only its owner (root, or the service's own user) may change,
/// in a directory nobody else may write to either. Anything else is
/// refused, naming the field and the directory.
pub fn resolve_hook(dir: &std::path::Path, name: &str) -> Result<std::path::PathBuf, ApiError> {
    use std::os::unix::fs::MetadataExt;
    ferry_api::rolling::validate_hook_name(name)?;
    let me = own_uid();
    let safe = |m: &std::fs::Metadata| (m.uid() == 0 || m.uid() == me) && m.mode() & 0o022 == 0;
    let refuse = |why: String| ApiError::invalid("hook", format!("{name}: {why}"));
    let d = std::fs::metadata(dir)
        .map_err(|e| refuse(format!("the hooks directory {}: {e}", dir.display())))?;
    if !d.is_dir() || !safe(&d) {
        return Err(refuse(format!(
            "the hooks directory {} must be a directory writable by its owner (root) only",
            dir.display()
        )));
    }
    let path = dir.join(name);
    let m = std::fs::symlink_metadata(&path)
        .map_err(|_| refuse(format!("no program of that name in {}", dir.display())))?;
    if !m.is_file() || m.mode() & 0o111 == 0 || !safe(&m) {
        return Err(refuse(format!(
            "{} must be an executable regular file (not a link) writable by its owner (root) only",
            path.display()
        )));
    }
    Ok(path)
}

/// This process's user id, from `/proc/self` (no libc call needed).
fn own_uid() -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(0)
}
const HOOK_TIMEOUT: Duration = Duration::from_secs(60);
/// A run whose owner wrote nothing for this long is taken over.
pub const ORPHANED: Duration = Duration::from_secs(15);

/// A host as the planner sees it.
#[derive(Debug, Clone, Default)]
pub struct HostView {
    pub name: String,
    /// No heartbeat for a while: down, and counted so.
    pub down: bool,
    /// Answered this look (one slow answer is not a host down, but no VM
    /// is placed on it meanwhile).
    pub reachable: bool,
    /// Marked draining (by this run or by hand).
    pub draining: bool,
    pub memory_free: u64,
    /// Its VMs (name, memory), skeletons of incoming moves left out.
    pub vms: Vec<(String, u64)>,
    /// A move into it or out of it is in flight.
    pub incoming: bool,
}

impl HostView {
    pub fn of(h: &HostEntry) -> HostView {
        let info = h.info.as_ref();
        HostView {
            name: h.name.clone(),
            down: h.down,
            reachable: h.reachable,
            draining: h.draining,
            memory_free: info.map(|i| i.memory_free).unwrap_or(0),
            vms: info
                .map(|i| {
                    i.vms
                        .iter()
                        .filter(|v| v.state != "incoming")
                        .map(|v| (v.name.clone(), v.spec.memory))
                        .collect()
                })
                .unwrap_or_default(),
            incoming: info
                .is_some_and(|i| i.vms.iter().any(|v| v.state == "incoming" || v.migrating)),
        }
    }
}

/// What the run does next.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Drain `host` onto `to`.
    Start { host: String, to: Vec<String> },
    /// Nothing to start now, and why.
    Wait(String),
    /// Every host done.
    Finished,
    /// `host` cannot be drained even with every other host up: the run fails.
    Blocked { host: String, reason: String },
}

/// Hosts down now: the run's draining or maintenance hosts, and hosts down
/// or draining by themselves (`except` left out).
pub fn down_now(st: &RollingStatus, view: &[HostView], except: Option<&str>) -> Vec<String> {
    let mut out: BTreeSet<String> = st
        .hosts
        .iter()
        .filter(|h| h.phase.down())
        .map(|h| h.host.clone())
        .collect();
    for v in view {
        let mine = st.hosts.iter().find(|h| h.host == v.name);
        // a host done or pending in this run and draining is drained by hand
        let by_itself = v.down || (v.draining && mine.is_none_or(|h| !h.phase.down()));
        if by_itself {
            out.insert(v.name.clone());
        }
    }
    if let Some(e) = except {
        out.remove(e);
    }
    out.into_iter().collect()
}

/// What of `host`'s VMs no host of `to` can take, with why: (VM, reason).
pub type LeftOver<'a> = &'a dyn Fn(&str, &[String]) -> Vec<(String, String)>;

/// [`LeftOver`] by memory alone (the most free first), no rules.
pub fn by_memory(view: &[HostView]) -> impl Fn(&str, &[String]) -> Vec<(String, String)> + '_ {
    move |host, to| {
        let Some(me) = view.iter().find(|v| v.name == host) else {
            return Vec::new();
        };
        let mut t: Vec<(String, u64)> = view
            .iter()
            .filter(|v| to.contains(&v.name))
            .map(|v| (v.name.clone(), v.memory_free))
            .collect();
        let (_, left) = drain::plan(&me.vms, &mut t);
        left.into_iter().map(|u| (u.vm, u.reason)).collect()
    }
}

/// The next step of a rolling drain; `left_over` says what of a host's
/// VMs the others cannot take (the placement engine, with the rules).
pub fn next(st: &RollingStatus, view: &[HostView], left_over: LeftOver) -> Next {
    if st.hosts.iter().all(|h| h.phase == Phase::Done) {
        return Next::Finished;
    }
    let Some(cand) = st.hosts.iter().find(|h| h.phase == Phase::Pending) else {
        return Next::Wait("hosts in maintenance to be resumed".into());
    };
    let Some(me) = view.iter().find(|v| v.name == cand.host) else {
        return Next::Wait(format!("{} does not answer", cand.host));
    };
    if me.down || !me.reachable {
        return Next::Wait(format!("{} does not answer", cand.host));
    }
    let down = down_now(st, view, Some(&cand.host));
    if down.len() as u32 >= st.request.max_hosts_down {
        return Next::Wait(format!(
            "{} {} down; at most {} at once",
            down.join(", "),
            if down.len() == 1 { "is" } else { "are" },
            st.request.max_hosts_down
        ));
    }
    let phase = |n: &str| st.hosts.iter().find(|h| h.host == n).map(|h| h.phase);
    let takes = |v: &&HostView| {
        v.name != cand.host
            && !v.down
            && v.reachable
            && !v.draining
            && !phase(&v.name).is_some_and(Phase::down)
    };
    let fits = |hosts: &[&HostView]| {
        let to: Vec<String> = hosts.iter().map(|v| v.name.clone()).collect();
        left_over(&cand.host, &to)
    };
    let done: Vec<&HostView> = view
        .iter()
        .filter(takes)
        .filter(|v| phase(&v.name) == Some(Phase::Done))
        .collect();
    if !done.is_empty() && fits(&done).is_empty() {
        return Next::Start {
            host: cand.host.clone(),
            to: done.iter().map(|v| v.name.clone()).collect(),
        };
    }
    let up: Vec<&HostView> = view.iter().filter(takes).collect();
    let left = fits(&up);
    if left.is_empty() {
        return Next::Start {
            host: cand.host.clone(),
            to: up.iter().map(|v| v.name.clone()).collect(),
        };
    }
    let why = left
        .iter()
        .map(|(vm, reason)| format!("{vm}: {reason}"))
        .collect::<Vec<_>>()
        .join("; ");
    if down.is_empty() {
        Next::Blocked {
            host: cand.host.clone(),
            reason: format!("{}'s VMs fit on no other host ({why})", cand.host),
        }
    } else {
        Next::Wait(format!(
            "{}'s VMs fit only once {} is back ({why})",
            cand.host,
            down.join(", ")
        ))
    }
}

/// The run as this control instance knows it, and the hosts whose drain
/// runs in this process.
pub struct Rolling {
    /// This instance's name as an owner.
    me: String,
    status: tokio::sync::Mutex<Option<RollingStatus>>,
    active: std::sync::Mutex<BTreeSet<String>>,
    runner: std::sync::atomic::AtomicBool,
    last_hook: std::sync::Mutex<std::collections::BTreeMap<String, std::time::Instant>>,
}

impl Default for Rolling {
    fn default() -> Self {
        Rolling {
            me: format!(
                "{}:{}:{}",
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .unwrap_or_default()
                    .trim(),
                std::process::id(),
                now_ms()
            ),
            status: Default::default(),
            active: Default::default(),
            runner: Default::default(),
            last_hook: Default::default(),
        }
    }
}

impl Control {
    /// `POST /cluster/rolling`: starts a run (refused while one runs).
    pub(crate) async fn start_rolling(
        self: &Arc<Self>,
        req: RollingRequest,
    ) -> Result<RollingStatus, ApiError> {
        let known: Vec<String> = self.hosts.keys().cloned().collect();
        req.check(&known)?;
        if let Some(h) = &req.hook {
            resolve_hook(&self.hooks_dir, h)?;
        }
        let mut cur = self.rolling.status.lock().await;
        if cur.is_none() {
            *cur = self.store.cluster(KEY).await?;
        }
        if let Some(st) = cur.as_ref().filter(|s| s.state == RollingState::Running) {
            return Err(ApiError::Conflict {
                reason: format!(
                    "a rolling drain runs since {} ms ago (`ferry cluster drain-rolling --stop` ends it)",
                    now_ms().saturating_sub(st.started_ms)
                ),
            });
        }
        let order = if req.hosts.is_empty() {
            known
        } else {
            req.hosts.clone()
        };
        let st = RollingStatus {
            hosts: order.iter().map(|h| RollingHost::pending(h)).collect(),
            request: req,
            state: RollingState::Running,
            started_ms: now_ms(),
            ended_ms: None,
            message: None,
            most_down: 0,
            owner: Some(self.rolling.me.clone()),
            owner_ms: now_ms(),
        };
        self.store.put_cluster(KEY, &st).await?;
        self.log(
            "rolling",
            "cluster",
            serde_json::json!({ "started": order, "max_hosts_down": st.request.max_hosts_down }),
        );
        *cur = Some(st.clone());
        drop(cur);
        self.clone().spawn_rolling();
        Ok(st)
    }

    /// `GET /cluster/rolling`: the run (the last one if none runs). Read
    /// from the durable state unless this instance carries it out.
    pub(crate) async fn rolling_status(&self) -> Result<Option<RollingStatus>, ApiError> {
        let mut cur = self.rolling.status.lock().await;
        if cur.is_none() || !self.runs_rolling() {
            *cur = self.store.cluster(KEY).await?;
        }
        Ok(cur.clone())
    }

    fn runs_rolling(&self) -> bool {
        self.rolling
            .runner
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// `DELETE /cluster/rolling`: no host starts draining any more; a drain
    /// running finishes, hosts stay as they are.
    pub(crate) async fn stop_rolling(&self) -> Result<RollingStatus, ApiError> {
        let st = self
            .update_rolling(|st| {
                if st.state == RollingState::Running {
                    st.state = RollingState::Stopped;
                    st.ended_ms = Some(now_ms());
                    st.message = Some("stopped: hosts stay as they are".into());
                }
            })
            .await?;
        st.ok_or_else(|| ApiError::not_found("rolling drain", "cluster"))
    }

    /// At the service's start and every heartbeat: carries on a run the
    /// state says is running when it is this instance's, or no instance
    /// has written it for [`ORPHANED`], or no other instance can exist.
    pub async fn resume_rolling(self: &Arc<Self>) {
        if self.runs_rolling() {
            return;
        }
        match self.rolling_status().await {
            Ok(Some(st)) if st.state == RollingState::Running => {
                let mine = st.owner.as_deref() == Some(self.rolling.me.as_str());
                let silent = now_ms().saturating_sub(st.owner_ms) > ORPHANED.as_millis() as u64;
                if mine || silent || !self.store.shared() {
                    tracing::info!(
                        "carrying on the rolling drain started at {} (owner was {:?})",
                        st.started_ms,
                        st.owner
                    );
                    self.clone().spawn_rolling();
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!("rolling drain state: {e}"),
        }
    }

    fn spawn_rolling(self: Arc<Self>) {
        use std::sync::atomic::Ordering;
        if self.rolling.runner.swap(true, Ordering::SeqCst) {
            return;
        }
        tokio::spawn(async move {
            while self.rolling_tick().await {
                tokio::time::sleep(TICK).await;
            }
            self.rolling.runner.store(false, Ordering::SeqCst);
        });
    }

    /// Applies `f` to the run and writes it down; returns it.
    async fn update_rolling(
        &self,
        f: impl FnOnce(&mut RollingStatus),
    ) -> Result<Option<RollingStatus>, ApiError> {
        let mut cur = self.rolling.status.lock().await;
        if cur.is_none() {
            *cur = self.store.cluster(KEY).await?;
        }
        let Some(st) = cur.as_mut() else {
            return Ok(None);
        };
        f(st);
        st.owner = Some(self.rolling.me.clone());
        st.owner_ms = now_ms();
        self.store.put_cluster(KEY, &*st).await?;
        Ok(Some(st.clone()))
    }

    /// One look at the cluster; false once the run is over.
    async fn rolling_tick(self: &Arc<Self>) -> bool {
        let st = match self.rolling_status().await {
            Ok(Some(st)) if st.state == RollingState::Running => st,
            Ok(_) => return false,
            Err(e) => {
                tracing::warn!("rolling drain state: {e}");
                return true;
            }
        };
        let entries = self.list_hosts().await;
        let view: Vec<HostView> = entries.iter().map(HostView::of).collect();
        let draining = lock(&self.draining).clone();
        // hosts in maintenance: resumed by hand, or by the hook
        for h in st.hosts.iter().filter(|h| h.phase == Phase::Maintenance) {
            let how = if !draining.contains(&h.host) {
                Some("resumed".to_string())
            } else if let Some(hook) = &st.request.hook {
                self.run_hook(&h.host, hook).await
            } else {
                None
            };
            if let Some(how) = how {
                if !self.set_phase(&h.host, Phase::Done, Some(how)).await {
                    return true;
                }
            }
        }
        // drains this process does not run (a restart came between)
        let flying = view.iter().any(|v| v.incoming);
        for h in st.hosts.iter().filter(|h| h.phase == Phase::Draining) {
            if lock(&self.rolling.active).contains(&h.host) {
                continue;
            }
            if flying {
                let _ = self
                    .update_rolling(|s| {
                        s.message = Some(format!(
                            "waiting for moves in flight to settle before draining {} again",
                            h.host
                        ))
                    })
                    .await;
                return true;
            }
            let to = view
                .iter()
                .filter(|v| v.name != h.host && !v.down && v.reachable && !v.draining)
                .map(|v| v.name.clone())
                .collect();
            self.clone().spawn_host_drain(h.host.clone(), to);
        }
        let st = match self.rolling_status().await {
            Ok(Some(st)) => st,
            _ => return true,
        };
        let down = down_now(&st, &view, None).len() as u32;
        // the placement engine's word, the rules kept, as a drain would place
        let cluster = match self.placement_config().await {
            Ok(config) => self.cluster_of(&entries, config),
            Err(e) => {
                tracing::warn!("rolling drain: the placement rules: {e}");
                return true;
            }
        };
        let left_over = |host: &str, to: &[String]| {
            let names: Vec<String> = cluster
                .vms
                .iter()
                .filter(|v| v.host.as_deref() == Some(host))
                .map(|v| v.name.clone())
                .collect();
            let (_, refused) = crate::placement::Engine::new(&cluster)
                .place(&names, &|h| to.iter().any(|t| t == h));
            refused
                .into_iter()
                .map(|r| {
                    let why = format!("no host keeps its rules and has room: {r}");
                    (r.vm, why)
                })
                .collect()
        };
        let decision = next(&st, &view, &left_over);
        let r = self
            .update_rolling(|s| {
                s.most_down = s.most_down.max(down);
                match &decision {
                    Next::Finished => {
                        s.state = RollingState::Done;
                        s.ended_ms = Some(now_ms());
                        s.message = Some(format!("{} hosts drained and resumed", s.hosts.len()));
                    }
                    Next::Blocked { host, reason } => {
                        s.state = RollingState::Failed;
                        s.ended_ms = Some(now_ms());
                        s.message = Some(reason.clone());
                        if let Some(h) = s.host_mut(host) {
                            h.reason = Some(reason.clone());
                        }
                    }
                    Next::Wait(why) => s.message = Some(why.clone()),
                    Next::Start { host, .. } => {
                        s.message = Some(format!("draining {host}"));
                        if let Some(h) = s.host_mut(host) {
                            h.phase = Phase::Draining;
                            h.draining_ms = Some(now_ms());
                        }
                    }
                }
            })
            .await;
        if let Err(e) = r {
            tracing::warn!("rolling drain state: {e}");
            return true;
        }
        match decision {
            Next::Start { host, to } => {
                self.log(
                    "rolling",
                    &host,
                    serde_json::json!({ "phase": "draining", "to": to }),
                );
                self.clone().spawn_host_drain(host, to);
                true
            }
            Next::Finished | Next::Blocked { .. } => {
                self.log(
                    "rolling",
                    "cluster",
                    serde_json::json!({ "ended": format!("{decision:?}") }),
                );
                false
            }
            Next::Wait(_) => true,
        }
    }

    /// Moves a host to `phase`, logged; false if the state could not be written.
    async fn set_phase(&self, host: &str, phase: Phase, reason: Option<String>) -> bool {
        let r = self
            .update_rolling(|s| {
                if let Some(h) = s.host_mut(host) {
                    h.phase = phase;
                    let now = Some(now_ms());
                    match phase {
                        Phase::Maintenance => h.maintenance_ms = now,
                        Phase::Done => h.done_ms = now,
                        _ => {}
                    }
                    h.progress = None;
                    if reason.is_some() {
                        h.reason = reason.clone();
                    }
                }
                if phase == Phase::Failed {
                    s.state = RollingState::Failed;
                    s.ended_ms = Some(now_ms());
                    s.message = reason.clone();
                }
            })
            .await;
        match r {
            Ok(_) => {
                self.log(
                    "rolling",
                    host,
                    serde_json::json!({ "phase": phase, "reason": reason }),
                );
                true
            }
            Err(e) => {
                tracing::warn!("rolling drain state: {e}");
                false
            }
        }
    }

    /// Runs the hook for `host` (at most every few seconds); Some when it
    /// said the host is healthy, which resumes it.
    async fn run_hook(&self, host: &str, hook: &str) -> Option<String> {
        {
            let mut last = lock(&self.rolling.last_hook);
            if last.get(host).is_some_and(|t| t.elapsed() < HOOK_EVERY) {
                return None;
            }
            last.insert(host.into(), std::time::Instant::now());
        }
        match self.run_hook_for(hook, host).await {
            Ok(()) => {
                if let Err(e) = self.resume_host(host).await {
                    tracing::warn!(%host, "resuming after the hook: {e}");
                    return None;
                }
                Some(format!("the hook `{hook}` reported it healthy"))
            }
            Err(why) => {
                tracing::info!(%host, "hook `{hook}`: {why}");
                None
            }
        }
    }

    /// Runs the hook `hook` for `host` (no shell, `FERRY_HOST` set, within
    /// [`HOOK_TIMEOUT`]): `Ok` on exit status 0, else why not.
    pub(crate) async fn run_hook_for(&self, hook: &str, host: &str) -> Result<(), String> {
        // resolved again each time: the directory is the admin's to change
        let program = resolve_hook(&self.hooks_dir, hook).map_err(|e| e.to_string())?;
        let run = tokio::process::Command::new(&program)
            .env_clear()
            .env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            )
            .env("FERRY_HOST", host)
            .current_dir("/")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .status();
        match tokio::time::timeout(HOOK_TIMEOUT, run).await {
            Ok(Ok(s)) if s.success() => Ok(()),
            Ok(Ok(s)) => Err(format!("it ended with {s}")),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("it ran over {} s", HOOK_TIMEOUT.as_secs())),
        }
    }

    /// One host's drain, its events folded into the run's status.
    fn spawn_host_drain(self: Arc<Self>, host: String, to: Vec<String>) {
        lock(&self.rolling.active).insert(host.clone());
        tokio::spawn(async move {
            let outcome = self.drain_for_rolling(&host, to).await;
            let (phase, reason) = match outcome {
                Ok(()) => (Phase::Maintenance, None),
                Err(why) => (Phase::Failed, Some(why)),
            };
            // a run stopped meanwhile keeps the host where its drain left it
            let running = matches!(
                self.rolling_status().await,
                Ok(Some(s)) if s.state == RollingState::Running
            );
            if running || phase == Phase::Maintenance {
                self.set_phase(&host, phase, reason).await;
            }
            lock(&self.rolling.active).remove(&host);
        });
    }

    async fn drain_for_rolling(
        self: &Arc<Self>,
        host: &str,
        to: Vec<String>,
    ) -> Result<(), String> {
        let st = self
            .rolling_status()
            .await
            .map_err(|e| e.to_string())?
            .ok_or("no rolling drain")?;
        let req = DrainRequest {
            to,
            max_parallel: st.request.max_parallel,
            option: st.request.option,
        };
        let _ = self
            .update_rolling(|s| {
                if let Some(h) = s.host_mut(host) {
                    h.drains += 1;
                    h.progress = Some(DrainProgress::default());
                }
            })
            .await;
        let mut events = self
            .clone()
            .drain(host.to_string(), req)
            .await
            .map_err(|e| format!("its drain did not start: {e}"))?;
        while let Some(ev) = events.next().await {
            lock(&self.recorder).drain(host, &ev);
            let done = matches!(ev, DrainEvent::Done(_));
            let r = self
                .update_rolling(|s| {
                    let Some(h) = s.host_mut(host) else { return };
                    let p = h.progress.get_or_insert_with(Default::default);
                    match &ev {
                        DrainEvent::Plan { moves, limit, .. } => {
                            p.planned = moves.len() as u32;
                            p.limit = *limit;
                        }
                        DrainEvent::Limit { limit, .. } => p.limit = *limit,
                        DrainEvent::Started { vm, .. } => p.running.push(vm.clone()),
                        DrainEvent::Moved(d) => {
                            p.moved += 1;
                            p.running.retain(|v| *v != d.vm);
                            h.moved.push(d.clone());
                        }
                        DrainEvent::Failed { vm, .. } => p.running.retain(|v| v != vm),
                        DrainEvent::Done(r) => {
                            h.left = r.unplaceable.iter().chain(&r.failed).cloned().collect();
                        }
                        _ => {}
                    }
                })
                .await;
            if let Err(e) = r {
                tracing::warn!("rolling drain state: {e}");
            }
            if done {
                break;
            }
        }
        let st = self
            .rolling_status()
            .await
            .map_err(|e| e.to_string())?
            .ok_or("no rolling drain")?;
        let left = st
            .hosts
            .iter()
            .find(|h| h.host == host)
            .map(|h| h.left.clone())
            .unwrap_or_default();
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{} stayed on {host}, running: {}",
                left.iter()
                    .map(|u| u.vm.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                left.iter()
                    .map(|u| format!("{}: {}", u.vm, u.reason))
                    .collect::<Vec<_>>()
                    .join("; ")
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hooks_are_programs_in_the_admins_directory() {
        use std::os::unix::fs::PermissionsExt;
        let d = std::env::temp_dir().join(format!("ferry-hooks-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        let write = |name: &str, mode: u32| {
            let p = d.join(name);
            std::fs::write(&p, "#!/bin/sh\nexit 0\n").unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        };
        write("healthy", 0o755);
        write("shared", 0o777);
        write("plain", 0o644);
        std::os::unix::fs::symlink("/bin/true", d.join("link")).unwrap();
        assert_eq!(resolve_hook(&d, "healthy").unwrap(), d.join("healthy"));
        for (name, says) in [
            ("shared", "writable by its owner"),
            ("plain", "executable"),
            ("link", "not a link"),
            ("none", "no program"),
            ("../healthy", "not a hook's name"),
            ("sh -c id", "not a hook's name"),
        ] {
            let e = resolve_hook(&d, name).unwrap_err().to_string();
            assert!(e.contains("hook") && e.contains(says), "{name}: {e}");
        }
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = resolve_hook(&d, "healthy").unwrap_err().to_string();
        assert!(e.contains("hooks directory"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    const G: u64 = 1 << 30;

    fn view(name: &str, free: u64, vms: &[(&str, u64)]) -> HostView {
        HostView {
            name: name.into(),
            reachable: true,
            memory_free: free,
            vms: vms.iter().map(|(n, m)| (n.to_string(), *m)).collect(),
            ..Default::default()
        }
    }

    fn status(phases: &[(&str, Phase)], max_down: u32) -> RollingStatus {
        RollingStatus {
            request: RollingRequest {
                max_hosts_down: max_down,
                ..Default::default()
            },
            state: RollingState::Running,
            hosts: phases
                .iter()
                .map(|(h, p)| RollingHost {
                    phase: *p,
                    ..RollingHost::pending(h)
                })
                .collect(),
            started_ms: 0,
            ended_ms: None,
            message: None,
            most_down: 0,
            owner: None,
            owner_ms: 0,
        }
    }

    #[test]
    fn one_host_at_a_time_in_order_onto_hosts_already_done() {
        use Phase::*;
        let v = vec![
            view("h1", 4 * G, &[("a", G)]),
            view("h2", 4 * G, &[("b", G)]),
            view("h3", 4 * G, &[("c", G)]),
        ];
        let st = status(&[("h1", Pending), ("h2", Pending), ("h3", Pending)], 1);
        assert_eq!(
            next(&st, &v, &by_memory(&v)),
            Next::Start {
                host: "h1".into(),
                to: vec!["h2".into(), "h3".into()]
            }
        );
        // h1 in maintenance: nothing else starts with max 1 down
        let st = status(&[("h1", Maintenance), ("h2", Pending), ("h3", Pending)], 1);
        assert!(matches!(next(&st, &v, &by_memory(&v)), Next::Wait(w) if w.contains("h1")));
        // with 2 allowed, h2 goes, onto h3 only
        let st2 = status(&[("h1", Maintenance), ("h2", Pending), ("h3", Pending)], 2);
        assert_eq!(
            next(&st2, &v, &by_memory(&v)),
            Next::Start {
                host: "h2".into(),
                to: vec!["h3".into()]
            }
        );
        // h1 done: h2's VMs go to h1 alone (no second move for them)
        let st = status(&[("h1", Done), ("h2", Pending), ("h3", Pending)], 1);
        assert_eq!(
            next(&st, &v, &by_memory(&v)),
            Next::Start {
                host: "h2".into(),
                to: vec!["h1".into()]
            }
        );
        let st = status(&[("h1", Done), ("h2", Done), ("h3", Done)], 1);
        assert_eq!(next(&st, &v, &by_memory(&v)), Next::Finished);
    }

    #[test]
    fn a_host_whose_vms_a_rule_keeps_is_blocked_naming_the_rule() {
        use Phase::*;
        let v = vec![view("h1", 4 * G, &[("db", G)]), view("h2", 4 * G, &[])];
        let st = status(&[("h1", Pending), ("h2", Pending)], 1);
        // what the engine says of a VM whose strict host rule names h1 alone
        let asked = std::cell::RefCell::new(Vec::new());
        let pinned = |host: &str, to: &[String]| {
            asked.borrow_mut().push((host.to_string(), to.to_vec()));
            vec![(
                "db".to_string(),
                "h2: strict host-affinity rule pin".to_string(),
            )]
        };
        assert!(
            matches!(next(&st, &v, &pinned), Next::Blocked { host, reason }
            if host == "h1" && reason.contains("db: h2: strict host-affinity rule pin"))
        );
        assert_eq!(
            asked.borrow()[0],
            ("h1".to_string(), vec!["h2".to_string()])
        );
    }

    #[test]
    fn a_host_down_or_drained_by_hand_counts_and_a_vm_too_big_blocks() {
        use Phase::*;
        let mut v = vec![
            view("h1", 4 * G, &[("a", G)]),
            view("h2", 4 * G, &[]),
            view("h3", 4 * G, &[]),
        ];
        v[2].down = true;
        let st = status(&[("h1", Pending), ("h2", Pending)], 1);
        assert!(matches!(next(&st, &v, &by_memory(&v)), Next::Wait(w) if w.contains("h3")));
        v[2].down = false;
        v[1].draining = true;
        assert!(matches!(next(&st, &v, &by_memory(&v)), Next::Wait(w) if w.contains("h2")));
        v[1].draining = false;
        // a VM larger than any other host's free memory: the run fails
        // before the host is touched, naming the VM
        let v = vec![view("h1", 4 * G, &[("big", 3 * G)]), view("h2", 2 * G, &[])];
        let st = status(&[("h1", Pending), ("h2", Pending)], 1);
        assert!(
            matches!(next(&st, &v, &by_memory(&v)), Next::Blocked { host, reason }
            if host == "h1" && reason.contains("big"))
        );
        // the done host is full: the pending ones take the rest
        let v = vec![
            view("h1", G / 2, &[]),
            view("h2", 4 * G, &[("b", G)]),
            view("h3", 4 * G, &[]),
        ];
        let st = status(&[("h1", Done), ("h2", Pending), ("h3", Pending)], 1);
        assert_eq!(
            next(&st, &v, &by_memory(&v)),
            Next::Start {
                host: "h2".into(),
                to: vec!["h1".into(), "h3".into()]
            }
        );
    }
}
