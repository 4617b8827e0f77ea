//! Live migration: seed 000's checklist around one commit point, carried out
//! by the source agent with the target agent, QEMU doing the memory copy.
//!
//! ```text
//!  source agent                                   target agent          may run
//!  1 establish   GET  /host ───────────────────────▶ (credential checked)   source
//!  2 permission  (a refused credential ends here)                           source
//!  3 memory      journal: copying; POST /incoming ─▶ reserve or refuse;     source
//!                                                    journal: waiting
//!  4 skeleton                                        QEMU -S -incoming defer source
//!                ◀─────────────────── uri ────────── migrate-incoming …
//!  4b disks      blockdev-mirror ═ NBD over carriers ═▶ export of each     source
//!                local drive (shared-nothing, see `disks`), until ready
//!  5 connection  QMP migrate uri ══ QEMU stream ══▶                         source
//!  6 copy        query-migrate every 100 ms; the copy loop decides          source
//!  7 iterate     (dirty-sync-count > 1)                                     source
//!  8 blackout    QEMU pauses the source and sends the rest                  nobody
//!  9 commit      POST /incoming/ID/ready ──────────▶ loaded, still paused?  nobody
//!                journal: committed (fsync) ═══ the commit point ═══
//!                POST /incoming/ID/run ────────────▶ journal: running; cont target
//! 10 cleanup     quit source QEMU; journal: done                            target
//! 11 final-check GET /vms/NAME/check ──────────────▶ a report, not a rollback
//! ```
//!
//! Before the commit record any failure rolls back (`roll_back`): the target
//! cannot have run, since it runs only on RUN. After it the source never
//! resumes on its own judgement; a RUN without answer leaves the move in
//! doubt, settled by `settle` or the target asking (see [`crate::commit`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_api::{
    ApiError, IncomingStatus, MigrateRequest, MigrationEvent, MigrationProgress, VmSpec,
};
use ferry_net::client::Client;
use tokio::sync::mpsc;

mod auto;
mod copy_loop;
pub mod disks;
mod finish;
pub mod qemu_tls;
mod sequence;
mod settle;
mod source;
mod target;
mod watch;

use crate::commit::{Record, Side, SourcePhase};
use crate::convergence;
use crate::host::{nics, Agent, Role};
use crate::qemu::QemuVm;
pub(crate) use settle::resume_guest;
use target::answer_of;

/// This host's CPUs.
fn cpus() -> usize {
    crate::facts::host_cpus()
}

/// Consecutive failed polls of the target agent before giving up on it.
pub const TARGET_POLL_FAILURES: u32 = 2;
/// QEMU's largest downtime limit: pause-and-copy sets it so the next
/// iteration switches over whatever remains.
const PAUSE_DOWNTIME_MS: u64 = 2_000_000;
const POLL: Duration = Duration::from_millis(100);
/// What the downtime plan leaves between QEMU's completion and the
/// commit's start: its `MIGRATION` event, one `query-migrate`, and the
/// scheduling of both on a busy host.
const COMMIT_SLACK: Duration = Duration::from_millis(10);
/// Bytes left from which the end is near: the carriers' windows narrow,
/// the low-water mark is set, and READY is asked early.
const END_NEAR_BYTES: u64 = 64 << 20;

struct Failure {
    step: &'static str,
    reason: String,
    /// An API error to pass through as is (e.g. `InsufficientMemory`).
    passthrough: Option<Box<ApiError>>,
    /// Where the failure leaves the commit point.
    after: AfterCommit,
}

/// A failure before the commit rolls back; after it, it never does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AfterCommit {
    /// Before the commit: roll back, the source resumes.
    No,
    /// RUN's answer is lost: both stay paused until the target answers.
    InDoubt,
    /// Post-copy broke: the guest's state is on the target.
    Lost,
}

/// Post-copy broke after its commit: the guest's state is on the target.
fn lost(reason: String) -> Failure {
    Failure {
        step: "postcopy",
        reason,
        passthrough: None,
        after: AfterCommit::Lost,
    }
}

/// RUN's answer is lost: both stay paused until the target answers.
fn in_doubt(reason: String) -> Failure {
    Failure {
        step: "run",
        reason,
        passthrough: None,
        after: AfterCommit::InDoubt,
    }
}

fn fail(step: &'static str, reason: impl Into<String>) -> Failure {
    Failure {
        step,
        reason: reason.into(),
        passthrough: None,
        after: AfterCommit::No,
    }
}

/// After post-copy's stream broke, this long in `postcopy-paused` ends the
/// move as lost; the settler goes on recovering it.
const POSTCOPY_PAUSED_LIMIT: Duration = Duration::from_secs(120);
/// How often a paused post-copy is tried on a new stream.
const RECOVER_EVERY: Duration = Duration::from_secs(2);
/// Post-copy that moves no byte for this long is broken (it ends as lost).
const POSTCOPY_STALL_LIMIT: Duration = Duration::from_secs(60);

struct Events(mpsc::Sender<MigrationEvent>);

impl Events {
    async fn send(&self, e: MigrationEvent) {
        // a departed listener does not stop the migration
        let _ = self.0.send(e).await;
    }
    async fn step(&self, step: &str, detail: String) {
        tracing::info!(step, %detail, "migration step");
        self.send(MigrationEvent::Step {
            step: step.into(),
            detail,
        })
        .await;
    }
}

/// True for the options whose bytes go in Ferry's frames over its own
/// carriers (which seal them); the others carry QEMU's bytes as they are
/// (and QEMU's own TLS encrypts them).
pub(crate) fn carried_by_ferry(o: ferry_api::MigrationOption) -> bool {
    use ferry_api::MigrationOption;
    matches!(
        o,
        MigrationOption::Multichannel | MigrationOption::Compression
    )
}

/// How the migration's bytes travel.
enum Plan {
    /// QEMU's own TCP stream to the target QEMU over one NIC; with
    /// `multifd`, its multifd channels (`compression` when the CPU is the
    /// limit, see `auto::own_channels`).
    Tcp {
        uri: String,
        nic: String,
        multifd: bool,
    },
    /// QEMU multifd into a local socket, carried by Ferry's transport
    /// (either carrier kind).
    Multichannel {
        session: ferry_transport::Carriers,
        sock: std::path::PathBuf,
        /// `multichannel`, `compression` or `mptcp`.
        option: &'static str,
        /// QEMU compresses in its multifd channels with zstd at this level.
        qemu_zstd: Option<u8>,
    },
}

/// A progress event while in post-copy (the pre-copy loop builds its own).
fn progress_event(
    info: &crate::qmp::MigrationInfo,
    ram: &crate::qmp::RamStats,
    started: Instant,
    rate: f64,
    plan: &Plan,
    tx_before: &BTreeMap<String, u64>,
    phase: &str,
) -> MigrationEvent {
    let (nic_tx_bytes, carriers_up) = match plan {
        Plan::Tcp { .. } => (tx_since(tx_before), None),
        Plan::Multichannel { session, .. } => {
            let st = session.stats();
            (carrier_bytes(&st), Some(st.healthy))
        }
    };
    let page = if ram.page_size == 0 {
        4096
    } else {
        ram.page_size
    };
    MigrationEvent::Progress(MigrationProgress {
        elapsed_ms: started.elapsed().as_millis() as u64,
        status: info.status.clone().unwrap_or_default(),
        transferred: ram.transferred,
        remaining: ram.remaining,
        total: ram.total,
        throughput: rate,
        dirty_rate: ram.dirty_pages_rate * page,
        rounds: ram.dirty_sync_count,
        expected_downtime_ms: info.expected_downtime,
        eta_ms: crate::convergence::drain_time(ram.remaining, rate).map(|d| d.as_millis() as u64),
        converging: None,
        nic_tx_bytes,
        carriers_up,
        phase: phase.into(),
        throttle_pct: info.cpu_throttle_percentage.unwrap_or(0),
        disks: None,
    })
}

/// What carries a session's bytes, as the report names it.
fn data_path_of(session: &ferry_transport::Carriers) -> &'static str {
    match session {
        ferry_transport::Carriers::Ferry(_) => "ferry-transport",
        ferry_transport::Carriers::Mptcp(s) if s.handoff_fd().is_some() => "ferry-mptcp",
        ferry_transport::Carriers::Mptcp(_) => "ferry-mptcp-relay",
    }
}

/// The carriers a source dials: for each of the target's listeners that a
/// probed pair reaches, (local NIC, its address, the listener's address).
/// A listener is dialled only at an address the source knows (see
/// [`own_endpoint`]); any other is dropped.
fn carrier_pairs(
    offered: &[ferry_api::CarrierEndpoint],
    paths: &[ferry_api::NicPath],
) -> Vec<(String, std::net::IpAddr, std::net::SocketAddr)> {
    offered
        .iter()
        .filter_map(|c| {
            let (p, addr) = own_endpoint(&c.nic, &c.address, paths).ok()?;
            Some((p.nic.clone(), p.address.parse().ok()?, addr))
        })
        .collect()
}

/// Where the source connects for a listener the target says it opened on
/// its NIC `nic` at `said`: the address this source probed that NIC at,
/// and the port only when it lies in the migration block. The target's
/// words pick a port; the source's own knowledge makes the address.
fn own_endpoint<'a>(
    nic: &str,
    said: &str,
    paths: &'a [ferry_api::NicPath],
) -> Result<(&'a ferry_api::NicPath, std::net::SocketAddr), String> {
    use ferry_api::bandwidth::{MIGRATION_PORT_BASE, MIGRATION_PORT_MASK};
    let addr: std::net::SocketAddr = said
        .parse()
        .map_err(|_| format!("'{}' is not an address:port", said.escape_debug()))?;
    let p = paths.iter().find(|p| p.peer_nic == nic).ok_or_else(|| {
        format!(
            "no probed path reaches the target's NIC '{}'",
            nic.escape_debug()
        )
    })?;
    let known: std::net::IpAddr = p
        .peer_address
        .parse()
        .map_err(|_| format!("the probed address of {nic} is '{}'", p.peer_address))?;
    if addr.ip() != known {
        return Err(format!("{said} is not {nic}'s probed address {known}"));
    }
    if addr.port() & MIGRATION_PORT_MASK != MIGRATION_PORT_BASE & MIGRATION_PORT_MASK {
        return Err(format!(
            "port {} lies outside the migration block {MIGRATION_PORT_BASE}+256",
            addr.port()
        ));
    }
    Ok((p, std::net::SocketAddr::new(known, addr.port())))
}

/// The URI the source QEMU sends its stream to, built here from the
/// target's reply (`tcp:ADDRESS:PORT` on NIC `nic`): never the reply's
/// text itself, which QEMU would run (`exec:`) or open (`file:`).
fn tcp_uri(
    reply: &ferry_api::IncomingReply,
    paths: &[ferry_api::NicPath],
) -> Result<String, String> {
    let said = reply.uri.strip_prefix("tcp:").ok_or_else(|| {
        format!(
            "the target answered '{}', not a tcp: URI",
            reply.uri.escape_debug()
        )
    })?;
    let (_, addr) = own_endpoint(&reply.nic, said, paths)?;
    Ok(crate::datapath::DataPath::source_uri(
        &crate::datapath::QemuTcp,
        &addr.ip().to_string(),
        &addr.port().to_string(),
    ))
}

/// One look at the target while the source copies (`step`): its QEMU gone
/// fails at once, its agent silent [`TARGET_POLL_FAILURES`] times in a row.
/// The target answers from its QEMU's process, without asking QEMU, which
/// answers late while it loads: the look does not hold up the watch.
async fn poll_target(
    target: &Client,
    id: &str,
    failures: &mut u32,
    step: &'static str,
) -> Result<(), Failure> {
    match target
        .get::<IncomingStatus>(
            &format!("/incoming/{id}?qemu=alive"),
            Duration::from_secs(2),
        )
        .await
    {
        Ok(s) if !s.qemu_alive => Err(fail(step, "the target QEMU exited")),
        Ok(_) => {
            *failures = 0;
            Ok(())
        }
        Err(e) => {
            *failures += 1;
            if *failures >= TARGET_POLL_FAILURES {
                return Err(fail(step, format!("lost the target agent: {e}")));
            }
            Ok(())
        }
    }
}

/// Multifd channels per multichannel migration (streams over the carriers).
pub const MULTIFD_CHANNELS: u64 = 4;

/// Bytes each NIC of `before` sent since then: one sysfs read per NIC,
/// polled through the move (no address dump; the NICs were chosen at the
/// start).
fn tx_since(before: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    before
        .iter()
        .map(|(n, b)| {
            let now = crate::facts::read_u64(
                std::path::Path::new("/sys/class/net")
                    .join(n)
                    .join("statistics/tx_bytes"),
            );
            (n.clone(), now.saturating_sub(*b))
        })
        .collect()
}

/// Payload bytes per NIC from a session's carriers.
fn carrier_bytes(st: &ferry_transport::SessionStats) -> BTreeMap<String, u64> {
    st.carriers
        .iter()
        .map(|c| (c.nic.clone(), c.tx_bytes))
        .collect()
}

fn nic_tx(sel: &crate::NicSelection) -> BTreeMap<String, u64> {
    nics(sel)
        .into_iter()
        .map(|n| (n.name, n.tx_bytes))
        .collect()
}

impl Agent {
    /// Starts moving VM `name` to `req.target`; returns the event stream.
    /// Refuses at once (nothing started) if the VM is unknown or already moving.
    pub async fn start_migration(
        self: &Arc<Self>,
        name: &str,
        req: MigrateRequest,
    ) -> Result<mpsc::Receiver<MigrationEvent>, ApiError> {
        req.convergence.check()?;
        if req.target == self.cfg.name {
            return Err(ApiError::invalid(
                "to",
                format!("vm {name} already runs on {}", req.target),
            ));
        }
        let (spec, vm) = {
            let mut st = self.state.lock().await;
            let slot = st
                .vms
                .get_mut(name)
                .ok_or_else(|| ApiError::not_found("vm", name))?;
            if slot.migrating {
                return Err(ApiError::Conflict {
                    reason: format!("vm {name} is already migrating"),
                });
            }
            let (Role::Running, Some(q)) = (&slot.role, &slot.qemu) else {
                return Err(ApiError::Conflict {
                    reason: format!("vm {name} is not running here"),
                });
            };
            // a guest waiting for its storage moves once it runs again
            if let Some(p) = slot.storage_pause.as_ref().filter(|p| p.active()) {
                return Err(ApiError::Conflict {
                    reason: format!(
                        "vm {name} is {}; it moves once its storage answers",
                        p.describe(ferry_api::util::now_ms())
                    ),
                });
            }
            if matches!(q.qmp.status().await, Ok(s) if s.status == crate::qemu::IO_ERROR) {
                return Err(ApiError::Conflict {
                    reason: format!(
                        "vm {name} is paused: storage (a disk's I/O failed); it moves once its storage answers"
                    ),
                });
            }
            if let Some(h) = &slot.held {
                return Err(ApiError::Conflict {
                    reason: format!(
                        "vm {name} is held while its disk {} changes storage node; it moves once that is done",
                        h.disk
                    ),
                });
            }
            slot.migrating = true;
            (slot.spec.clone(), q.clone())
        };
        let (tx, rx) = mpsc::channel(64);
        let agent = self.clone();
        tokio::spawn(async move {
            let events = Events(tx);
            let started = Instant::now();
            let id = format!("{:016x}", rand::random::<u64>());
            agent.live(&id, true);
            let outcome = source::Move::new(&agent, &id, (&spec, &vm), &req, &events, started)
                .run()
                .await;
            agent.live(&id, false);
            match outcome {
                Ok(report) => {
                    tracing::info!(vm = %spec.name, to = %req.target, total_ms = report.total_ms, downtime_ms = report.downtime_ms, "migration completed");
                    events
                        .send(MigrationEvent::Completed(Box::new(report)))
                        .await;
                }
                Err(f) => {
                    if f.after == AfterCommit::No {
                        if let Some(s) = agent.state.lock().await.vms.get_mut(&spec.name) {
                            s.migrating = false;
                        }
                    }
                    tracing::warn!(vm = %spec.name, step = f.step, reason = %f.reason, "migration failed");
                    let error =
                        f.passthrough
                            .map(|e| *e)
                            .unwrap_or_else(|| ApiError::MigrationFailed {
                                vm: spec.name.clone(),
                                step: f.step.into(),
                                reason: f.reason,
                                running_on: agent.cfg.name.clone(),
                            });
                    events.send(MigrationEvent::Failed { error }).await;
                }
            }
        });
        Ok(rx)
    }

    /// 4b. Shared-nothing: waits until every local drive is in step with
    /// its copy on the target (the mirrors `ready`), with progress events
    /// (phase `disks`: `transferred`/`total` count the disks' bytes). Fails
    /// on a mirror's error, a copy that stops moving, or a lost target.
    async fn copy_disks(
        &self,
        id: &str,
        m: &mut disks::DiskMirror,
        vm: &QemuVm,
        target: &Client,
        ev: &Events,
        started: Instant,
    ) -> Result<(), Failure> {
        ev.step(
            "disks",
            format!(
                "mirroring {} into the target's copies over {} carriers (blockdev-mirror over NBD)",
                m.describe(),
                m.session.stats().carriers.len()
            ),
        )
        .await;
        let t0 = Instant::now();
        let mut moved = (t0, 0u64);
        // the least left to copy so far, and when it was seen
        let mut least = (t0, u64::MAX);
        let mut sample = (t0, 0u64);
        let mut last_target_poll = t0;
        let mut target_failures = 0u32;
        loop {
            tokio::time::sleep(POLL).await;
            if let Some(why) = m.session.failure() {
                return Err(fail("disks", format!("transport: {why}")));
            }
            let p = m.progress(&vm.qmp).await.map_err(|e| fail("disks", e))?;
            let now = Instant::now();
            let st = m.session.stats();
            if p.done != moved.1 {
                moved = (now, p.done);
            } else if !p.ready && now - moved.0 > disks::MIRROR_STALL {
                return Err(fail(
                    "disks",
                    format!(
                        "the disks' copy moved no byte for {} s ({} of {} carriers up)",
                        disks::MIRROR_STALL.as_secs(),
                        st.healthy,
                        st.carriers.len()
                    ),
                ));
            }
            // bytes moving but what is left not shrinking: the guest
            // rewrites its drives faster than the links copy them
            let left = p.total.saturating_sub(p.done);
            if left < least.1 {
                least = (now, left);
            } else if !p.ready && now - least.0 > disks::MIRROR_NOT_CONVERGING {
                return Err(fail(
                    "disks",
                    format!(
                        "the disks' copy does not converge: {} left, no less than {} s ago (the guest rewrites its drives faster than {} carriers copy them)",
                        ferry_api::size::human_bytes(left),
                        disks::MIRROR_NOT_CONVERGING.as_secs(),
                        st.healthy
                    ),
                ));
            }
            if now - last_target_poll >= Duration::from_secs(1) {
                last_target_poll = now;
                poll_target(target, id, &mut target_failures, "disks").await?;
            }
            let dt = (now - sample.0).as_secs_f64().max(1e-3);
            let throughput = p.done.saturating_sub(sample.1) as f64 / dt;
            sample = (now, p.done);
            ev.send(MigrationEvent::Progress(MigrationProgress {
                elapsed_ms: started.elapsed().as_millis() as u64,
                status: if p.ready { "ready" } else { "mirroring" }.into(),
                transferred: p.done,
                remaining: left,
                total: p.total,
                throughput,
                dirty_rate: 0,
                rounds: 0,
                expected_downtime_ms: None,
                eta_ms: convergence::drain_time(left, throughput).map(|d| d.as_millis() as u64),
                converging: None,
                nic_tx_bytes: carrier_bytes(&st),
                carriers_up: Some(st.healthy),
                phase: "disks".into(),
                throttle_pct: 0,
                disks: Some(p.clone()),
            }))
            .await;
            if p.ready {
                ev.step(
                    "disks",
                    format!(
                        "every local drive in step with its copy after {:.1} s ({} moved); the guest's writes now go to both",
                        t0.elapsed().as_secs_f64(),
                        ferry_api::size::human_bytes(p.done)
                    ),
                )
                .await;
                return Ok(());
            }
        }
    }

    /// The link rates of `nics` here, summed (bits per second; 0 unknown).
    async fn link_bits(&self, nics: Vec<String>) -> u64 {
        let classes = self.classes.clone();
        tokio::task::spawn_blocking(move || {
            ferry_api::util::lock(&classes)
                .status("")
                .nics
                .iter()
                .filter(|n| n.up && nics.contains(&n.nic))
                .map(|n| n.link_rate)
                .sum()
        })
        .await
        .unwrap_or(0)
    }

    /// The rate of the one NIC `compression` takes: the first pair probed to work.
    async fn first_link_bits(&self, paths: &[ferry_api::NicPath]) -> u64 {
        self.link_bits(paths.iter().take(1).map(|p| p.nic.clone()).collect())
            .await
    }

    /// The idle CPU share: the last second's, or (an agent just started)
    /// watched now for 300 ms.
    async fn idle_now(&self) -> Option<f64> {
        match self.facts.idle.idle_now() {
            Some(i) => Some(i),
            None => tokio::task::spawn_blocking(|| {
                ferry_transport::compress::idle_share(Duration::from_millis(300))
            })
            .await
            .ok()
            .flatten(),
        }
    }

    /// A move that failed with its commit recorded (or its record
    /// unreadable): never rolled back. Settled at once if it can be (QEMU
    /// never switched, the target runs the whole guest), else left in doubt
    /// (RUN unanswered) or lost (post-copy broke) for the settler.
    async fn failed_after_commit(
        &self,
        id: &str,
        spec: &VmSpec,
        req: &MigrateRequest,
        ev: &Events,
        mut f: Failure,
    ) -> Failure {
        let rec = match self.moves.journal.read(id, true) {
            Ok(Some(r)) => r,
            Ok(None) => unreachable!("a move with no record is before its commit"),
            Err(e) => {
                let why = format!("this host's record of the move cannot be read: {e}");
                if let Some(s) = self.state.lock().await.vms.get_mut(&spec.name) {
                    s.doubt = Some(why.clone());
                }
                f.after = AfterCommit::InDoubt;
                f.passthrough = Some(Box::new(ApiError::MigrationInDoubt {
                    vm: spec.name.clone(),
                    source_host: self.cfg.name.clone(),
                    target: req.target.clone(),
                    reason: format!("{}; {why}", f.reason),
                }));
                return f;
            }
        };
        let (phase, detail) = match rec.side {
            Side::Source(SourcePhase::Committed) => self.settle_once(&rec).await,
            Side::Source(p) => (p, String::new()),
            Side::Target(_) => unreachable!("read as the source's record"),
        };
        let reason = if detail.is_empty() {
            f.reason.clone()
        } else {
            format!("{}; {detail}", f.reason)
        };
        match phase {
            SourcePhase::Aborted | SourcePhase::Copying => {
                f.after = AfterCommit::No;
                f.reason = reason;
            }
            SourcePhase::Done => {
                f.passthrough = Some(Box::new(ApiError::MigrationFailed {
                    vm: spec.name.clone(),
                    step: f.step.into(),
                    reason,
                    running_on: req.target.clone(),
                }));
            }
            SourcePhase::Committed if f.after == AfterCommit::InDoubt => {
                ev.step(
                    "in-doubt",
                    format!(
                        "{} did not answer RUN: {} stays paused here and runs on neither host until {} answers",
                        req.target, spec.name, req.target
                    ),
                )
                .await;
                f.passthrough = Some(Box::new(ApiError::MigrationInDoubt {
                    vm: spec.name.clone(),
                    source_host: self.cfg.name.clone(),
                    target: req.target.clone(),
                    reason,
                }));
            }
            SourcePhase::Committed => {
                f.after = AfterCommit::Lost;
                f.passthrough = Some(Box::new(ApiError::MigrationLost {
                    vm: spec.name.clone(),
                    target: req.target.clone(),
                    reason,
                }));
            }
        }
        f
    }

    /// Before the commit: records Aborted, cancels QEMU's migration, makes
    /// sure the guest runs here again, then tells the target to discard its
    /// skeleton (which never ran: it waits paused for a RUN that will not
    /// come, and asks this host if nobody tells it).
    async fn roll_back(
        &self,
        id: &str,
        vm: &Arc<QemuVm>,
        target: &Client,
        session: Option<&ferry_transport::Carriers>,
    ) {
        // never past the commit, whoever asks
        let t0 = Instant::now();
        match self.moves.journal.read(id, true) {
            Ok(Some(Record {
                side: Side::Source(SourcePhase::Copying),
                ..
            })) => {}
            other => {
                tracing::error!(migration = id, record = ?other.map(|r| r.map(|r| r.side)), "not rolled back: the journal does not say copying");
                return;
            }
        }
        let checked_ms = t0.elapsed().as_millis() as u64;
        // the guest first, the record after: a paused guest waits on
        // nothing but QEMU here (no fsync, no coarse sleep), which is what
        // `downtime::pause_deadline`'s reserve is kept for
        let qmp = &vm.qmp;
        let _ = qmp.migrate_cancel().await;
        // QEMU's sockets end at this agent, so cancelling never waits on a dead link
        if let Some(s) = session {
            s.close();
        }
        // looked at often, for at most 10 s: a guest paused for the
        // blackout waits on this
        for _ in 0..10_000 {
            match qmp.query_migrate().await.ok().and_then(|i| i.status) {
                Some(s)
                    if s == "active"
                        || s == "cancelling"
                        || s == "device"
                        || s == "setup"
                        || s == "pre-switchover" =>
                {
                    tokio::time::sleep(Duration::from_millis(1)).await
                }
                _ => break,
            }
        }
        // the skeleton never runs without RUN, which comes only after a
        // Committed record: resuming here before recording the abort is
        // safe, and a restart that reads Copying rolls back again
        resume_guest(vm).await;
        tracing::info!(
            migration = id,
            ms = t0.elapsed().as_millis() as u64,
            checked_ms,
            "source guest resumed after the move was given up"
        );
        if let Err(e) = self.set_source_phase(id, SourcePhase::Aborted) {
            // the record still says Copying: a target asking hears "copying"
            // and waits; this agent's next start records Aborted
            tracing::error!(error = %e, "recording the rollback");
        }
        if let Err(e) = target
            .delete::<serde_json::Value>(&format!("/incoming/{id}"), Duration::from_secs(5))
            .await
        {
            tracing::warn!(error = %e, "could not tell the target to discard its skeleton; it will ask");
        }
    }
}

impl Agent {
    /// Source side, `mptcp` kind: asks the target to announce again the
    /// address of the NIC that each NIC of this host with its link up but no
    /// subflow (`due`, from `Spliced::tick`) was probed to reach. A NIC that
    /// was down when the pairs were probed has none yet: the pairs are
    /// probed again first. The requests run on their own.
    fn ask_rejoins(&self, id: &str, (peer, target): (&str, &Client), due: Vec<String>) {
        if due.is_empty() {
            return;
        }
        let Some(pp) = self.facts.paths.get(peer) else {
            return;
        };
        let reached = |pairs: &[ferry_api::NicPath], nic: &str| {
            pairs
                .iter()
                .find(|p| p.nic == nic && p.reachable)
                .map(|p| p.peer_nic.clone())
        };
        let stale = due.iter().any(|nic| reached(&pp.pairs, nic).is_none());
        let (cache, mine) = (self.facts.paths.clone(), self.nics());
        let (me, secret) = (self.cfg.name.clone(), self.cred.secret().to_vec());
        let (peer, target) = (peer.to_string(), target.clone());
        let path = format!("/incoming/{id}/rejoin");
        tokio::spawn(async move {
            let pairs = if stale {
                let probe = crate::probe::refresh(
                    &cache,
                    (&me, &secret),
                    &mine,
                    &peer,
                    &pp.peer_nics,
                    pp.port,
                );
                probe.await
            } else {
                pp.pairs
            };
            for nic in due {
                let Some(peer_nic) = reached(&pairs, &nic) else {
                    tracing::warn!(%nic, "no NIC of the target answers a probe from it; no rejoin");
                    continue;
                };
                let r: Result<serde_json::Value, _> = target
                    .post(
                        &path,
                        &ferry_api::RejoinRequest {
                            nic: peer_nic.clone(),
                        },
                        Duration::from_secs(3),
                    )
                    .await;
                match r {
                    Ok(_) => {
                        tracing::info!(%nic, %peer_nic, "asked the target to announce its address again")
                    }
                    Err(e) => tracing::warn!(%nic, error = %e, "rejoin request failed"),
                }
            }
        });
    }
}
