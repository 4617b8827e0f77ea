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
    ApiError, CheckResult, CpuReport, HostInfo, IncomingReply, IncomingRequest, IncomingStatus,
    MigrateRequest, MigrationEvent, MigrationProgress, MigrationReport, QemuCodecReport, VmSpec,
};
use ferry_net::client::Client;
use tokio::sync::mpsc;

mod auto;
mod copy_loop;
pub mod disks;
mod settle;
mod target;

use crate::commit::{
    source_next, Record, Side, SourceAction, SourceEvent, SourcePhase, TargetAnswer,
};
use crate::convergence;
use crate::host::{error_chain, nics, Agent, Role};
use crate::qemu::QemuVm;
use crate::qmp::MigrationParameters;
use auto::{auto_choice, own_channels, qemu_compresses, relay_fits, sample_memory};
use ferry_api::{CarrierReport, Convergence, MigrationOption};
pub(crate) use settle::resume_guest;
use target::answer_of;

/// This host's CPUs.
fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Consecutive failed polls of the target agent before giving up on it.
pub const TARGET_POLL_FAILURES: u32 = 2;
/// QEMU's largest downtime limit: pause-and-copy sets it so the next
/// iteration switches over whatever remains.
const PAUSE_DOWNTIME_MS: u64 = 2_000_000;
const POLL: Duration = Duration::from_millis(100);
/// How often QEMU is asked once the end is near.
const END_POLL: Duration = Duration::from_millis(10);
/// Bytes left from which the end is near (an idle guest switches over as
/// its first pass ends: polled at `POLL`, up to 100 ms of its blackout
/// would pass before the commit even began).
const END_NEAR_BYTES: u64 = 64 << 20;

struct Failure {
    step: &'static str,
    reason: String,
    /// An API error to pass through as is (e.g. `InsufficientMemory`).
    passthrough: Option<ApiError>,
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
    (tx_before, nics): (&BTreeMap<String, u64>, &crate::NicSelection),
    phase: &str,
) -> MigrationEvent {
    let (nic_tx_bytes, carriers_up) = match plan {
        Plan::Tcp { .. } => (delta(tx_before, &nic_tx(nics)), None),
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
async fn poll_target(
    target: &Client,
    id: &str,
    failures: &mut u32,
    step: &'static str,
) -> Result<(), Failure> {
    match target
        .get::<IncomingStatus>(&format!("/incoming/{id}"), Duration::from_secs(2))
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

fn delta(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(n, a)| (n.clone(), a.saturating_sub(*before.get(n).unwrap_or(a))))
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
            let outcome = agent.migrate(&id, &spec, &vm, &req, &events, started).await;
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
                    let error = f.passthrough.unwrap_or_else(|| ApiError::MigrationFailed {
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

    async fn migrate(
        &self,
        id: &str,
        spec: &VmSpec,
        vm: &Arc<QemuVm>,
        req: &MigrateRequest,
        ev: &Events,
        started: Instant,
    ) -> Result<MigrationReport, Failure> {
        if req.encrypt_carriers
            && matches!(
                req.option,
                MigrationOption::Tcp | MigrationOption::Mptcp | MigrationOption::MptcpRelay
            )
        {
            return Err(Failure {
                step: "establish",
                reason: String::new(),
                after: AfterCommit::No,
                passthrough: Some(ApiError::invalid(
                    "option",
                    format!(
                        "{} sends the stream's bytes as they are and this cluster encrypts \
                         migrations (encrypt_carriers): use multichannel, compression or auto",
                        req.option.name()
                    ),
                )),
            });
        }
        // 1. establish
        let target = Client::new(
            &format!("agent {}", req.target),
            &req.target_url,
            self.client_auth.clone(),
        );
        let tinfo: HostInfo =
            target
                .get("/host", Duration::from_secs(5))
                .await
                .map_err(|e| match e {
                    ApiError::Unauthorized { .. } => fail(
                        "permission",
                        format!(
                            "{} refused this host ({})",
                            req.target,
                            if self.pki.is_some() {
                                "its certificate"
                            } else {
                                "the cluster credential"
                            }
                        ),
                    ),
                    e => fail("establish", e.to_string()),
                })?;
        if tinfo.name != req.target {
            return Err(fail(
                "establish",
                format!(
                    "the agent at {} is {}, not {}",
                    req.target_url, tinfo.name, req.target
                ),
            ));
        }
        ev.step(
            "establish",
            format!(
                "{} → {} (agent {})",
                self.cfg.name, req.target, req.target_url
            ),
        )
        .await;
        // 2. permission
        ev.step(
            "permission",
            if self.pki.is_some() {
                format!(
                    "mutual TLS: {}'s certificate verified, this host's accepted",
                    req.target
                )
            } else {
                format!(
                    "{} accepted the cluster credential (insecure HTTP)",
                    req.target
                )
            },
        )
        .await;
        // 3. memory + 4. skeleton (the target reserves before it starts anything)
        ev.step(
            "memory",
            format!(
                "{} has {} bytes free; the VM needs {}",
                req.target, tinfo.memory_free, spec.memory
            ),
        )
        .await;
        // which NIC here reaches which NIC there, probed (cached while no link changes)
        let paths = crate::probe::usable(&self.paths_for_move(&tinfo).await, &self.nics());
        let reachable_nics: Vec<String> = paths.iter().map(|p| p.peer_nic.clone()).collect();
        let shared = reachable_nics.len();
        // compression is tried (only when it wins) for auto and compression
        let compress = match req.option {
            MigrationOption::Auto | MigrationOption::Compression => {
                ferry_transport::CompressMode::Adaptive
            }
            _ => ferry_transport::CompressMode::Off,
        };
        // shared-nothing: the VM's local drives are mirrored before its memory
        let copies = disks::local_copies(&self.cfg.qemu, spec)
            .await
            .map_err(|e| fail("establish", e))?;
        let mut conv = req.convergence;
        let mut disk_note = String::new();
        if !copies.is_empty() && conv.postcopy {
            // the mirrors end with the guest paused before the switch-over
            conv.postcopy = false;
            if conv.at_expiry == Some(ferry_api::AtExpiry::Postcopy) {
                conv.at_expiry = Some(ferry_api::AtExpiry::Pause);
            }
            disk_note = "; post-copy off: local drives are copied before the switch-over".into();
        }
        let mut auto_note = String::new();
        // a sample of guest memory and the idle CPU, read once
        let mut sampled: Option<(Option<f64>, Option<f64>)> = None;
        let option = match req.option {
            MigrationOption::Auto if shared > 1 => {
                let mptcp = ferry_transport::mptcp::available();
                let (ratio, idle) = if mptcp && !req.encrypt_carriers {
                    let s = (sample_memory(vm, spec.memory).await, self.idle_now().await);
                    sampled = Some(s);
                    s
                } else {
                    (None, None)
                };
                // the links this move would use, and whether the idle CPU
                // could relay them at that rate
                let used: Vec<String> = paths.iter().map(|p| p.nic.clone()).collect();
                let link_bits = self.link_bits(used).await;
                let cpus = cpus();
                let relay_room = idle
                    .filter(|i| relay_fits(*i, cpus, link_bits))
                    .map(|_| link_bits);
                let (o, why) = auto_choice(req.encrypt_carriers, mptcp, ratio, idle, relay_room);
                auto_note = format!("; auto: {why}");
                o
            }
            // sealed carriers need Ferry's transport, even over one NIC
            MigrationOption::Auto if req.encrypt_carriers => MigrationOption::Compression,
            MigrationOption::Auto => MigrationOption::Tcp,
            o => o,
        };
        // a move that may compress over Ferry's carriers: does QEMU compress
        // in its multifd channels (post-copy has one stream, no multifd)
        let takes = |f: &str| tinfo.features.iter().any(|x| x == f);
        let carriers = matches!(
            option,
            MigrationOption::Multichannel | MigrationOption::Compression
        );
        // compression's one link: the first pair probed to work. `auto`'s
        // carriers over several NICs (drains among them) keep QEMU's zstd for
        // memory that compresses: zstd on memory that does not is measured on
        // one link only (BENCHMARKS.md), so their rate counts as unknown (0)
        let compression_link = if option == MigrationOption::Compression {
            self.first_link_bits(&paths).await
        } else {
            0
        };
        let (qemu_zstd, sample_ratio) = if compress == ferry_transport::CompressMode::Adaptive
            && carriers
            && !conv.postcopy
            && takes(ferry_api::FEATURE_QEMU_ZSTD)
        {
            let (ratio, idle) = match sampled {
                Some(s) => s,
                None => (sample_memory(vm, spec.memory).await, self.idle_now().await),
            };
            sampled = Some((ratio, idle));
            let (mut level, mut why) = qemu_compresses(ratio, idle, cpus(), compression_link);
            if level.is_some() {
                // a QEMU built without zstd refuses it: its pages go as they are
                let asked = vm
                    .qmp
                    .set_parameters(MigrationParameters {
                        multifd_compression: Some(crate::qmp::multifd_compression(true)),
                        ..Default::default()
                    })
                    .await;
                if let Err(e) = asked {
                    level = None;
                    why =
                        format!("QEMU sends pages as they are: it cannot compress with zstd ({e})");
                }
            }
            auto_note.push_str(&format!("; {why}"));
            (level, ratio)
        } else {
            (None, None)
        };
        // compression whose pages QEMU sends as they are, over a link faster
        // than the spare CPU loads them: QEMU's own channels, no relay
        let qemu_channels = match sampled {
            Some((ratio, idle))
                if option == MigrationOption::Compression
                    && qemu_zstd.is_none()
                    && !req.encrypt_carriers
                    && !conv.postcopy
                    && copies.is_empty()
                    && takes(ferry_api::FEATURE_QEMU_CHANNELS) =>
            {
                match own_channels(ratio, idle, cpus(), compression_link) {
                    Some(why) => {
                        auto_note.push_str(&format!("; {why}"));
                        true
                    }
                    None => false,
                }
            }
            _ => false,
        };
        let option = if qemu_channels {
            MigrationOption::Tcp
        } else {
            option
        };
        // the record exists before the target hears of the migration: a
        // target that asks always finds an answer
        self.journal
            .write(&Record {
                migration_id: id.into(),
                vm: spec.name.clone(),
                peer: req.target.clone(),
                peer_url: req.target_url.clone(),
                side: Side::Source(SourcePhase::Copying),
                updated: 0,
                sealed: req.encrypt_carriers,
            })
            .map_err(|e| fail("memory", error_chain(&e)))?;
        // Ferry's carriers keep each stream within a window of what the target
        // QEMU has taken: when it loads slower than the links deliver (what
        // QEMU compressed, or a CPU-bound target) its backlog stays small
        let stream_windows = carriers && !qemu_channels && takes(ferry_api::FEATURE_STREAM_WINDOWS);
        let session: [u8; 16] = rand::random();
        let disk_session: [u8; 16] = rand::random();
        // a host-dependent CPU model: the target compares its own expansion
        let cpu_expansion = if crate::hardware::HOST_DEPENDENT_MODELS.contains(&spec.cpu.as_str()) {
            self.cpu_catalog()
                .await
                .ok()
                .and_then(|c| c.expansions.get(&spec.cpu).cloned())
        } else {
            None
        };
        let incoming = IncomingRequest {
            source_url: self.cfg.url.clone(),
            migration_id: id.into(),
            source: self.cfg.name.clone(),
            spec: spec.clone(),
            ticket: req.ticket.clone(),
            reachable_nics,
            option,
            session: Some(ferry_transport::session_to_hex(&session)),
            postcopy: conv.postcopy,
            sealed: req.encrypt_carriers,
            cpu_expansion,
            local_disks: disks::requests(&copies),
            disk_session: (!copies.is_empty())
                .then(|| ferry_transport::session_to_hex(&disk_session)),
            qemu_zstd,
            stream_windows,
            qemu_channels,
        };
        let reply: IncomingReply = target
            .post("/incoming", &incoming, Duration::from_secs(30))
            .await
            .map_err(|e| match e {
                e @ (ApiError::InsufficientMemory { .. } | ApiError::HostCannotRun { .. }) => {
                    Failure {
                        step: "memory",
                        reason: e.to_string(),
                        passthrough: Some(e),
                        after: AfterCommit::No,
                    }
                }
                e => fail("skeleton", e.to_string()),
            })?;
        let waits_on = if reply.carriers.is_empty() {
            format!("{} ({})", reply.uri, reply.nic)
        } else {
            let c: Vec<String> = reply
                .carriers
                .iter()
                .map(|c| format!("{} {}", c.nic, c.address))
                .collect();
            format!("a local socket; carriers accepted on {}", c.join(", "))
        };
        ev.step(
            "skeleton",
            format!(
                "QEMU on {} waits on {waits_on}{auto_note}{disk_note}",
                req.target
            ),
        )
        .await;
        // 4b. shared-nothing: every local drive in step with its copy there
        let mut mirror = if copies.is_empty() {
            None
        } else {
            let carriers = carrier_pairs(&reply.disk_carriers, &paths);
            if carriers.is_empty() {
                self.roll_back(id, vm, &target, None).await;
                return Err(fail("disks", "no NIC pair to carry the disks' copy"));
            }
            // disk bytes never cross a network in clear: sealed whatever
            // the cluster's encrypt_carriers says of memory
            let keys = ferry_transport::Keys {
                secret: self.cred.secret(),
                sealed: disks::SEALED,
            };
            let started_mirror = disks::DiskMirror::start(
                &vm.qmp,
                disk_session,
                &keys,
                disks::mirror_sock(&vm.dir, id),
                carriers,
                copies,
                self.cfg.reorder_window,
            )
            .await;
            let mut m = match started_mirror {
                Ok(m) => m,
                Err(e) => {
                    self.roll_back(id, vm, &target, None).await;
                    return Err(fail("disks", e));
                }
            };
            if let Err(f) = self.copy_disks(id, &mut m, vm, &target, ev, started).await {
                m.abort(&vm.qmp).await;
                self.roll_back(id, vm, &target, None).await;
                return Err(f);
            }
            Some(m)
        };

        // a failure here rolls back below, the disks' copy with it
        let plan: Result<Plan, Failure> = async {
            Ok(match option {
                MigrationOption::Mptcp | MigrationOption::MptcpRelay => {
                    let sock = vm.dir.join(format!("out-{id}.sock"));
                    let mine = self.nics();
                    // the target's listener takes every address; the connection
                    // starts on the first pair probed to work
                    let first = reply.carriers.iter().find_map(|c| {
                        let (p, remote) = own_endpoint(&c.nic, &c.address, &paths).ok()?;
                        Some((p.address.parse().ok()?, remote))
                    });
                    let Some((local, remote)) = first else {
                        return Err(fail("connection", "no NIC pair to carry the migration"));
                    };
                    let nic_addrs: Vec<(String, std::net::IpAddr)> = mine
                        .iter()
                        .filter_map(|n| Some((n.name.clone(), n.address.parse().ok()?)))
                        .collect();
                    let started = ferry_transport::mptcp::prepare_host(&nic_addrs)
                        .map_err(|e| e.to_string())
                        .and_then(|_| {
                            if option == MigrationOption::Mptcp {
                                // QEMU gets the socket itself (see `transfer`)
                                ferry_transport::Spliced::source_handoff(
                                    session,
                                    self.cred.secret(),
                                    local,
                                    remote,
                                    nic_addrs,
                                )
                            } else {
                                ferry_transport::Spliced::source(
                                    session,
                                    self.cred.secret(),
                                    sock.clone(),
                                    local,
                                    remote,
                                    nic_addrs,
                                )
                            }
                            .map_err(|e| error_chain(&e))
                        });
                    match started {
                        Ok(s) => Plan::Multichannel {
                            session: ferry_transport::Carriers::Mptcp(s),
                            sock,
                            option: option.name(),
                            qemu_zstd: None,
                        },
                        Err(e) => {
                            return Err(fail("connection", e));
                        }
                    }
                }
                MigrationOption::Multichannel | MigrationOption::Compression => {
                    let sock = vm.dir.join(format!("out-{id}.sock"));
                    // compression is the one-NIC option: the target's first carrier
                    let offered = if option == MigrationOption::Compression {
                        &reply.carriers[..reply.carriers.len().min(1)]
                    } else {
                        &reply.carriers[..]
                    };
                    let carriers = carrier_pairs(offered, &paths);
                    if carriers.is_empty() {
                        return Err(fail("connection", "no NIC pair to carry the migration"));
                    }
                    let keys = ferry_transport::Keys {
                        secret: self.cred.secret(),
                        sealed: req.encrypt_carriers,
                    };
                    match ferry_transport::Session::source(session, &keys, sock.clone(), carriers)
                        .await
                    {
                        Ok(s) => {
                            s.set_reorder_window(self.cfg.reorder_window);
                            s.set_compression(compress);
                            s.set_windows(stream_windows);
                            if qemu_zstd.is_some() {
                                // until QEMU's own figures come in
                                s.set_expansion(1.0 / sample_ratio.unwrap_or(1.0));
                            }
                            Plan::Multichannel {
                                session: ferry_transport::Carriers::Ferry(s),
                                sock,
                                option: option.name(),
                                qemu_zstd,
                            }
                        }
                        Err(e) => {
                            return Err(fail("connection", error_chain(&e)));
                        }
                    }
                }
                _ => Plan::Tcp {
                    uri: tcp_uri(&reply, &paths).map_err(|why| {
                        fail(
                            "connection",
                            format!("refused the target's listener: {why}"),
                        )
                    })?,
                    nic: reply.nic.clone(),
                    multifd: qemu_channels,
                },
            })
        }
        .await;
        let result = match plan {
            Ok(plan) => {
                let r = self
                    .transfer(
                        id,
                        &req.target,
                        spec,
                        vm,
                        &target,
                        ev,
                        &plan,
                        conv,
                        started,
                        mirror.as_mut(),
                    )
                    .await;
                (r, Some(plan))
            }
            Err(f) => (Err(f), None),
        };
        let (result, plan) = result;
        // whether a failure is before or after the commit is the journal's
        // to say, not the step's that failed
        let before_commit = match &result {
            Ok(_) => false,
            Err(_) => matches!(
                self.journal.read(id, true),
                Ok(None)
                    | Ok(Some(Record {
                        side: Side::Source(SourcePhase::Copying),
                        ..
                    }))
            ),
        };
        if let Some(m) = mirror.as_mut() {
            if before_commit {
                m.abort(&vm.qmp).await
            } else {
                m.close()
            }
        }
        let Some(plan) = plan else {
            let Err(f) = result else {
                unreachable!("no plan, no transfer")
            };
            self.roll_back(id, vm, &target, None).await;
            return Err(f);
        };
        let session = match &plan {
            Plan::Multichannel { session, .. } => Some(session),
            Plan::Tcp { .. } => None,
        };
        let outcome = match result {
            Ok(report) => Ok(report),
            Err(f) if before_commit => {
                self.roll_back(id, vm, &target, session).await;
                Err(f)
            }
            Err(f) => Err(self.failed_after_commit(id, spec, req, ev, f).await),
        };
        if let Plan::Multichannel { session, sock, .. } = &plan {
            session.close();
            let _ = std::fs::remove_file(sock);
        }
        outcome
    }

    /// Steps 5-10; on error the caller rolls back.
    #[allow(clippy::too_many_arguments)]
    async fn transfer(
        &self,
        id: &str,
        target_name: &str,
        spec: &VmSpec,
        vm: &Arc<QemuVm>,
        target: &Client,
        ev: &Events,
        plan: &Plan,
        conv: Convergence,
        started: Instant,
        mut mirror: Option<&mut disks::DiskMirror>,
    ) -> Result<MigrationReport, Failure> {
        // 5. connection
        let qmp = &vm.qmp;
        let q = |step: &'static str| move |e: crate::qmp::QmpError| fail(step, error_chain(&e));
        // post-copy and multifd do not mix in QEMU: with post-copy allowed,
        // Ferry's transport carries QEMU's one stream over every NIC instead
        // a handed-off MPTCP socket carries QEMU's one stream: no multifd either
        let handoff = match plan {
            Plan::Multichannel { session, .. } => session.handoff_fd(),
            Plan::Tcp { .. } => None,
        };
        let multifd = match plan {
            Plan::Multichannel { .. } => !conv.postcopy && handoff.is_none(),
            Plan::Tcp { multifd, .. } => *multifd,
        };
        let qemu_zstd = match plan {
            Plan::Multichannel { qemu_zstd, .. } => qemu_zstd.filter(|_| multifd),
            Plan::Tcp { .. } => None,
        };
        qmp.set_capabilities(&[
            ("multifd", multifd),
            ("auto-converge", conv.throttle),
            ("postcopy-ram", conv.postcopy),
            // shared-nothing: QEMU waits, guest paused, while the mirrors end
            ("pause-before-switchover", mirror.is_some()),
        ])
        .await
        .map_err(q("connection"))?;
        // the downtime the guest sees is QEMU's and then the switch-over:
        // QEMU gets what the switch-over leaves (see crate::downtime)
        let (switchover, overshoot) = self.switchovers.expect(target_name);
        let mut dplan = crate::downtime::DowntimePlan::new(
            conv.max_downtime_ms,
            conv.downtime_auto && !conv.postcopy && mirror.is_none(),
            switchover + END_POLL.as_millis() as u64,
            overshoot,
        );
        qmp.set_parameters(MigrationParameters {
            // Ferry paces migrations itself; QEMU's 128 MiB/s default would cap fast links
            max_bandwidth: Some(100 << 30),
            downtime_limit: Some(dplan.limit_ms),
            multifd_channels: multifd.then_some(MULTIFD_CHANNELS),
            multifd_compression: multifd
                .then(|| crate::qmp::multifd_compression(qemu_zstd.is_some())),
            multifd_zstd_level: qemu_zstd,
            cpu_throttle_initial: conv.throttle.then_some(20),
            cpu_throttle_increment: conv.throttle.then_some(10),
            ..Default::default()
        })
        .await
        .map_err(q("connection"))?;
        let tx_before = nic_tx(&self.cfg.nics);
        let (uri, detail) = match plan {
            Plan::Tcp { uri, nic, multifd } => (
                uri.clone(),
                if *multifd {
                    format!(
                        "QEMU's own {MULTIFD_CHANNELS} multifd channels straight to {uri} over {nic}"
                    )
                } else {
                    format!("QEMU's TCP stream to {uri} over {nic}")
                },
            ),
            Plan::Multichannel { session, sock, .. } => {
                // carriers come up in the background; give them a moment so the
                // first frames do not all go to whichever dialled first (MPTCP
                // connections open as QEMU connects)
                let framed = matches!(session, ferry_transport::Carriers::Ferry(_));
                for _ in 0..if framed { 20 } else { 0 } {
                    let st = session.stats();
                    if st.healthy == st.carriers.len() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(25)).await;
                }
                let names: Vec<String> = session
                    .stats()
                    .carriers
                    .iter()
                    .map(|c| c.nic.clone())
                    .collect();
                let how = if handoff.is_some() {
                    "QEMU's one stream written straight into an MPTCP socket the agents opened"
                        .to_string()
                } else if let Some(level) = qemu_zstd {
                    format!("{MULTIFD_CHANNELS} multifd channels compressed by QEMU (zstd {level})")
                } else if multifd {
                    format!("{MULTIFD_CHANNELS} multifd channels")
                } else {
                    "QEMU's one stream (post-copy allowed)".to_string()
                };
                (
                    format!("unix:{}", sock.display()),
                    format!(
                        "Ferry transport ({}) over {} ({} up), {how}",
                        data_path_of(session),
                        names.join(", "),
                        session.stats().healthy,
                    ),
                )
            }
        };
        let t_migrate = Instant::now();
        let cpu_at_start = (
            crate::host::own_cpu(),
            crate::host::process_cpu(vm.pid).unwrap_or_default(),
        );
        match handoff {
            Some(fd) => {
                let monitor = vm.dir.join(crate::qemu::HANDOFF_SOCK);
                tokio::task::spawn_blocking(move || {
                    crate::qmp::hand_socket(&monitor, fd, crate::qmp::HandTo::Migrate)
                })
                .await
                .map_err(|e| fail("connection", e.to_string()))?
                .map_err(q("connection"))?
            }
            None => qmp.migrate(&uri).await.map_err(q("connection"))?,
        }
        ev.step("connection", detail).await;

        // 6-8. copy, iterate, blackout
        let timeout = conv.timeout(spec.memory);
        // the timeout measures convergence: it starts when the first pass
        // over memory is done (that pass is a plain copy at the path's rate,
        // watched by the stall watchdog), so a slow or shared path does not
        // fail a guest that would converge
        let mut copy = copy_loop::CopyLoop::new(
            copy_loop::Policy {
                postcopy: conv.postcopy,
                throttle: conv.throttle,
                expiry: conv.expiry(),
                timeout,
                max_downtime_ms: conv.max_downtime_ms,
            },
            Instant::now(),
        );
        let mut rounds = convergence::Rounds::default();
        let mut max_throttle = 0u64;
        let mut last_sample = (Instant::now(), 0u64);
        let mut target_failures = 0u32;
        let mut last_target_poll = Instant::now();
        let (mut copy_seen, mut iterate_seen, mut blackout_seen) = (false, false, false);
        let mut carriers_up_seen = None;
        // the commit record is written (post-copy commits before it starts)
        let mut committed = false;
        let mut run_answer: Option<IncomingStatus> = None;
        let mut last_run_try = Instant::now() - Duration::from_secs(60);
        let mut postcopy_paused: Option<Instant> = None;
        let mut last_recover = Instant::now() - RECOVER_EVERY;
        let mut recover_failed: Option<String> = None;
        // what a recovery needs to know of this move
        let rec = Record {
            migration_id: id.into(),
            vm: spec.name.clone(),
            peer: target_name.into(),
            peer_url: String::new(),
            side: Side::Source(SourcePhase::Committed),
            updated: 0,
            sealed: matches!(plan, Plan::Multichannel { session, .. } if session.sealed()),
        };
        let mut postcopy_moved = (Instant::now(), 0u64);
        let lost = |why: String| Failure {
            step: "postcopy",
            reason: why,
            passthrough: None,
            after: AfterCommit::Lost,
        };
        let in_doubt = |why: String| Failure {
            step: "run",
            reason: why,
            passthrough: None,
            after: AfterCommit::InDoubt,
        };
        let mut near_end = false;
        let mut paths_seen = 0;
        // QEMU's send threads' CPU while it compresses (they end with the
        // migration, so the last reading while they ran is kept)
        let mut qemu_send_cpu = Duration::ZERO;
        let mut qemu_ratio_from = (0u64, 0u64);
        let info = loop {
            // near the end (the last pass, or QEMU paused) QEMU is asked every
            // END_POLL, so the commit follows its completion within that
            let asked = Instant::now();
            let info = loop {
                tokio::time::sleep(if near_end { END_POLL } else { POLL }).await;
                let info = match qmp.query_migrate().await {
                    Ok(i) => i,
                    Err(e) if committed => return Err(lost(error_chain(&e))),
                    Err(e) => return Err(fail("copy", error_chain(&e))),
                };
                if qemu_zstd.is_some() {
                    qemu_send_cpu =
                        qemu_send_cpu.max(crate::host::threads_cpu(vm.pid, "mig/src/send_"));
                    // the windows count what QEMU's bytes expand to: its ratio
                    // over the last MiB or more it wrote
                    if let (
                        Some(r),
                        Plan::Multichannel {
                            session: ferry_transport::Carriers::Ferry(s),
                            ..
                        },
                    ) = (&info.ram, plan)
                    {
                        let (normal, written) = (
                            r.normal_bytes.saturating_sub(qemu_ratio_from.0),
                            r.multifd_bytes.saturating_sub(qemu_ratio_from.1),
                        );
                        if written >= 1 << 20 {
                            s.set_expansion(normal as f64 / written as f64);
                            qemu_ratio_from = (r.normal_bytes, r.multifd_bytes);
                        }
                    }
                }
                let st = info.status.as_deref().unwrap_or_default();
                if !near_end || asked.elapsed() >= POLL || !matches!(st, "active" | "device") {
                    break info;
                }
            };
            near_end = match info.status.as_deref() {
                Some("device") => true,
                Some("active") => info
                    .ram
                    .as_ref()
                    .is_some_and(|r| r.remaining <= END_NEAR_BYTES),
                _ => false,
            };
            let status = info.status.clone().unwrap_or_default();
            let ram = info.ram.clone().unwrap_or_default();
            if status.starts_with("postcopy") {
                copy.entered_postcopy();
            }
            // paths dropped or taken again since the last look, as they happened
            if let Plan::Multichannel { session, .. } = plan {
                for c in session.path_changes().into_iter().skip(paths_seen) {
                    paths_seen += 1;
                    ev.send(MigrationEvent::Path(c)).await;
                }
            }
            let broke = |why: String| {
                if committed {
                    lost(why)
                } else {
                    fail("copy", why)
                }
            };
            if status == "pre-switchover" {
                // the guest is paused: each local drive ends in step with its
                // copy, then QEMU sends the device state
                if let Some(m) = mirror.as_deref_mut() {
                    let t0 = Instant::now();
                    m.complete(qmp).await.map_err(|e| fail("blackout", e))?;
                    tracing::info!(
                        ms = t0.elapsed().as_millis() as u64,
                        "disk copies completed in step"
                    );
                }
                qmp.migrate_continue().await.map_err(q("blackout"))?;
                continue;
            }
            match status.as_str() {
                "completed" => break info,
                "failed" => {
                    let why = info.error_desc.unwrap_or_else(|| "failed".into());
                    return Err(broke(format!("QEMU: {why}")));
                }
                "cancelled" | "cancelling" => {
                    return Err(broke("QEMU cancelled the migration".into()))
                }
                _ => {}
            }
            let now = Instant::now();
            let page = if ram.page_size == 0 {
                4096
            } else {
                ram.page_size
            };
            let dirty_rate = (ram.dirty_pages_rate * page) as f64;
            let throttle = info.cpu_throttle_percentage.unwrap_or(0);
            max_throttle = max_throttle.max(throttle);
            let decided = copy.observe(
                &copy_loop::Sample {
                    transferred: ram.transferred,
                    dirty_sync_count: ram.dirty_sync_count,
                    dirty_rate,
                    expected_downtime_ms: info.expected_downtime,
                    throttle_pct: throttle,
                },
                now,
            );
            let path_rate = decided.path_rate;
            let rates = decided.rates();
            if status == "active" && !copy.pausing() {
                if let Some(l) = dplan.on_round(ram.dirty_sync_count) {
                    qmp.set_parameters(MigrationParameters {
                        downtime_limit: Some(l),
                        ..Default::default()
                    })
                    .await
                    .map_err(q("copy"))?;
                    tracing::info!(vm = %spec.name, round = ram.dirty_sync_count, limit_ms = l, "downtime limit raised");
                }
            }
            match decided.action {
                copy_loop::Action::Continue => {}
                copy_loop::Action::StartPostcopy => {
                    // post-copy is after the commit by definition: the target
                    // gets the device state and runs before it has every page
                    let st: IncomingStatus = target
                        .get(&format!("/incoming/{id}"), Duration::from_secs(5))
                        .await
                        .map_err(|e| {
                            fail("postcopy", format!("the target does not answer: {e}"))
                        })?;
                    if !(st.qemu_alive && st.phase == "waiting") {
                        return Err(fail(
                            "postcopy",
                            format!(
                                "the target is not waiting ({}, QEMU {})",
                                st.phase, st.qemu_status
                            ),
                        ));
                    }
                    self.set_source_phase(id, SourcePhase::Committed)
                        .map_err(|e| fail("postcopy", e.to_string()))?;
                    committed = true;
                    ev.step(
                        "commit",
                        format!(
                            "commit recorded on {} before post-copy: from now on only {target_name} may run {}",
                            self.cfg.name, spec.name
                        ),
                    )
                    .await;
                    crate::failpoint::hit("source-after-commit");
                    // refused, QEMU never switches: the journal's commit is
                    // then settled as one QEMU never acted on (see `settle`)
                    let refused = match crate::failpoint::hit("source-start-postcopy") {
                        Some(crate::failpoint::Action::Fail) => {
                            Some("refused at fail point source-start-postcopy".to_string())
                        }
                        _ => qmp.start_postcopy().await.err().map(|e| error_chain(&e)),
                    };
                    if let Some(why) = refused {
                        return Err(lost(format!("QEMU refused to start post-copy: {why}")));
                    }
                    copy.entered_postcopy();
                    let detail = format!(
                        "pre-copy does not converge ({rates}); the guest now runs on the target, pages follow on demand"
                    );
                    ev.step("postcopy", detail).await;
                }
                copy_loop::Action::PauseAndCopy => {
                    // pause-and-copy: QEMU stops the guest at its next iteration and
                    // copies what remains; the downtime is remaining ÷ path rate
                    qmp.set_parameters(MigrationParameters {
                        downtime_limit: Some(PAUSE_DOWNTIME_MS),
                        ..Default::default()
                    })
                    .await
                    .map_err(q("copy"))?;
                    let pause = convergence::drain_time(ram.remaining, path_rate)
                        .map(|d| format!("~{:.1} s", d.as_secs_f64()))
                        .unwrap_or_else(|| "unknown time".into());
                    ev.step(
                        "pause-and-copy",
                        format!(
                            "pre-copy did not converge within {} s after the first pass ({rates}); the guest is paused while the remaining {} MB are copied ({pause})",
                            timeout.as_secs(),
                            ram.remaining / 1_000_000
                        ),
                    )
                    .await;
                }
                copy_loop::Action::NotConverging => {
                    let advice = if conv.throttle {
                        "allow post-copy"
                    } else {
                        "allow throttling or post-copy"
                    };
                    return Err(fail(
                        "copy",
                        format!(
                            "pre-copy did not converge within {} s after the first pass: {rates}; {advice}",
                            timeout.as_secs()
                        ),
                    ));
                }
                copy_loop::Action::Stalled => {
                    let path = match plan {
                        Plan::Tcp { nic, .. } => format!("the data path over {nic} is down"),
                        Plan::Multichannel { session, .. } => {
                            format!("every carrier is down ({} carriers)", session.kind())
                        }
                    };
                    return Err(fail(
                        "copy",
                        format!(
                            "no bytes moved for {} s: {path}",
                            copy_loop::STALL_TIMEOUT.as_secs()
                        ),
                    ));
                }
            }
            if copy.in_postcopy() {
                // RUN: the target has the device state (or soon will) and
                // waits, paused, for it; asked again every 2 s until it answers
                if run_answer.is_none() && last_run_try.elapsed() >= Duration::from_secs(2) {
                    last_run_try = Instant::now();
                    if let Ok(st) = self
                        .send_run_within(target, id, Duration::from_secs(2))
                        .await
                    {
                        if answer_of(&st) == TargetAnswer::Running {
                            run_answer = Some(st);
                            crate::failpoint::hit("source-postcopy-running");
                        }
                    }
                }
                // post-copy pushes every remaining page in the background: a
                // stream that moves nothing for a minute is broken, not idle
                if ram.transferred != postcopy_moved.1 || status != "postcopy-active" {
                    postcopy_moved = (now, ram.transferred);
                } else if now - postcopy_moved.0 > POSTCOPY_STALL_LIMIT {
                    return Err(lost(format!(
                        "post-copy moved no byte for {} s; the guest waits on {target_name} for \
                         its pages",
                        POSTCOPY_STALL_LIMIT.as_secs()
                    )));
                }
                if status == "postcopy-paused" {
                    // the stream broke: a new one over any path up, tried
                    // again as paths return; the source QEMU keeps every page
                    let since = *postcopy_paused.get_or_insert(now);
                    if now - last_recover >= RECOVER_EVERY {
                        last_recover = now;
                        match self.recover_postcopy(&rec, target, vm).await {
                            Ok(how) => {
                                recover_failed = None;
                                ev.step("postcopy-recover", how).await;
                            }
                            Err(why) if recover_failed.as_deref() != Some(why.as_str()) => {
                                ev.send(MigrationEvent::Warning {
                                    message: format!(
                                        "post-copy's stream broke; {} waits paused for its pages; \
                                         recovering: {why}",
                                        spec.name
                                    ),
                                })
                                .await;
                                recover_failed = Some(why);
                            }
                            Err(_) => {}
                        }
                    }
                    if now - since > POSTCOPY_PAUSED_LIMIT {
                        return Err(lost(format!(
                            "post-copy's stream broke and no new one held for {} s; the guest \
                             waits paused on {target_name}, and this host keeps trying to resume it",
                            POSTCOPY_PAUSED_LIMIT.as_secs()
                        )));
                    }
                } else {
                    postcopy_paused = None;
                }
                // nothing can be rolled back now: wait for QEMU, whatever the path does
                let p = progress_event(
                    &info,
                    &ram,
                    started,
                    path_rate,
                    plan,
                    (&tx_before, &self.cfg.nics),
                    "postcopy",
                );
                ev.send(p).await;
                continue;
            }
            if now - last_target_poll >= Duration::from_secs(1) {
                last_target_poll = now;
                poll_target(target, id, &mut target_failures, "copy").await?;
            }
            if !copy_seen && status == "active" {
                copy_seen = true;
                ev.step(
                    "copy",
                    format!("dirty tracking on; first pass over {} bytes", ram.total),
                )
                .await;
            }
            if !iterate_seen && ram.dirty_sync_count > 1 {
                iterate_seen = true;
                ev.step(
                    "iterate",
                    "re-sending pages dirtied during the first pass".into(),
                )
                .await;
            }
            if !blackout_seen && (status == "device" || status == "pre-switchover") {
                blackout_seen = true;
                ev.step(
                    "blackout",
                    "source paused; sending the last dirty pages and device state".into(),
                )
                .await;
            }
            let dt = (now - last_sample.0).as_secs_f64().max(1e-3);
            let throughput = ram.transferred.saturating_sub(last_sample.1) as f64 / dt;
            last_sample = (now, ram.transferred);
            let (nic_tx_bytes, carriers_up) = match plan {
                Plan::Tcp { .. } => (delta(&tx_before, &nic_tx(&self.cfg.nics)), None),
                Plan::Multichannel { session, .. } => {
                    if let Some(why) = session.failure() {
                        return Err(fail("copy", format!("transport: {why}")));
                    }
                    let st = match session {
                        ferry_transport::Carriers::Mptcp(s) => {
                            let (st, due) = s.tick();
                            self.ask_rejoins(id, (target_name, target), due);
                            st
                        }
                        _ => session.stats(),
                    };
                    (carrier_bytes(&st), Some(st.healthy))
                }
            };
            // a lost NIC: tell QEMU the bandwidth it really has now, so the
            // switch-over it plans still fits the downtime target
            if let (Some(up), Some(before)) = (carriers_up, carriers_up_seen) {
                // the rate over the last 2 s: a cut NIC can stop everything for a moment
                let rate = path_rate.max(throughput);
                if up < before && rate > 0.0 {
                    let now_bw = (rate * up as f64 / before as f64) as u64;
                    if let Err(e) = qmp
                        .set_parameters(MigrationParameters {
                            avail_switchover_bandwidth: Some(now_bw.max(1 << 20)),
                            ..Default::default()
                        })
                        .await
                    {
                        // the switch-over would be planned on the old bandwidth: say so
                        ev.send(MigrationEvent::Warning {
                            message: format!(
                                "QEMU refused the bandwidth left after a carrier loss: {}",
                                error_chain(&e)
                            ),
                        })
                        .await;
                    }
                    ev.send(MigrationEvent::Warning {
                        message: format!("a carrier went down: {up} of {before} up; QEMU told to plan switch-over at {} MB/s", now_bw >> 20),
                    })
                    .await;
                }
            }
            if carriers_up.is_some() {
                carriers_up_seen = carriers_up;
            }
            let (eta, converging) = if copy.pausing() {
                (convergence::drain_time(ram.remaining, path_rate), None)
            } else {
                rounds.observe(ram.dirty_sync_count, ram.remaining);
                match convergence::predict(
                    ram.remaining,
                    path_rate,
                    dirty_rate,
                    rounds.ratio(),
                    Duration::from_millis(conv.max_downtime_ms),
                ) {
                    Some(p) => (p.eta, Some(p.converging)),
                    None => (None, None),
                }
            };
            // the mirrors keep the copies in step meanwhile; one that fails
            // ends the move (the guest keeps its own disks)
            let disks = match mirror.as_deref_mut() {
                Some(m) if status != "pre-switchover" && status != "device" => {
                    Some(m.progress(qmp).await.map_err(|e| fail("copy", e))?)
                }
                _ => None,
            };
            ev.send(MigrationEvent::Progress(MigrationProgress {
                elapsed_ms: started.elapsed().as_millis() as u64,
                status,
                transferred: ram.transferred,
                remaining: ram.remaining,
                total: ram.total,
                throughput,
                dirty_rate: ram.dirty_pages_rate * page,
                rounds: ram.dirty_sync_count,
                expected_downtime_ms: info.expected_downtime,
                eta_ms: eta.map(|d| d.as_millis() as u64),
                converging,
                nic_tx_bytes,
                carriers_up,
                phase: if info.status.as_deref() == Some("device") {
                    "blackout".into()
                } else if copy.pausing() {
                    "pause-and-copy".into()
                } else {
                    "precopy".into()
                },
                throttle_pct: throttle,
                disks,
            }))
            .await;
        };
        let ram = info.ram.clone().unwrap_or_default();
        // the carriers as they were when QEMU finished (the target closes its
        // end once the guest runs there)
        let carriers_at_end = match plan {
            Plan::Multichannel { session, .. } => Some(session.stats()),
            Plan::Tcp { .. } => None,
        };
        if !blackout_seen {
            ev.step(
                "blackout",
                format!(
                    "source paused for {} ms of downtime",
                    info.downtime.unwrap_or(0)
                ),
            )
            .await;
        }
        // 9. the commit point. Both guests are paused: the source since the
        // blackout, the target since it started (-S). Everything that can be
        // checked without running the target is checked now; any failure
        // here rolls back and the source resumes.
        let t_completed = Instant::now();
        // after a post-copy's commit nothing rolls back: an unreadable console
        // only leaves the check without the source's last counter
        let tick_before = match self.console_tick(vm) {
            Ok(t) => t,
            Err(e) if committed => {
                tracing::warn!(error = %e, "reading the source console after the commit");
                None
            }
            Err(e) => {
                return Err(fail(
                    "final-check",
                    format!("reading the source console: {e}"),
                ))
            }
        };
        let t_tick = Instant::now();
        let mut switch_parts: Vec<(&str, u64)> = Vec::new();
        let on_target = if committed {
            None
        } else {
            let ready: IncomingStatus = target
                .post(
                    &format!("/incoming/{id}/ready"),
                    &serde_json::json!({}),
                    Duration::from_secs(40),
                )
                .await
                .map_err(|e| fail("commit", format!("the target is not ready: {e}")))?;
            let t_ready = Instant::now();
            self.set_source_phase(id, SourcePhase::Committed)
                .map_err(|e| fail("commit", e.to_string()))?;
            switch_parts.push(("tick", (t_tick - t_completed).as_millis() as u64));
            switch_parts.push(("ready", (t_ready - t_tick).as_millis() as u64));
            switch_parts.push(("record", t_ready.elapsed().as_millis() as u64));
            ev.step(
                "commit",
                format!(
                    "{} loaded everything, paused; commit recorded on {}: from now on only {} may run {}",
                    target_name, self.cfg.name, target_name, spec.name
                ),
            )
            .await;
            crate::failpoint::hit("source-after-commit");
            Some(ready)
        };
        // RUN: the target starts the guest (in post-copy it was sent already)
        let t_run = Instant::now();
        let ran = match run_answer {
            Some(st) => st,
            None => match self.send_run(target, id).await {
                Ok(st) => st,
                Err(why) => return Err(in_doubt(why)),
            },
        };
        match source_next(SourcePhase::Committed, SourceEvent::Answer(answer_of(&ran))).1 {
            SourceAction::Finish => {}
            SourceAction::AbortAndResume => {
                // the target's skeleton is gone and never ran: the only copy is here
                return Err(fail(
                    "run",
                    format!(
                        "{target_name} lost its skeleton before it ran ({})",
                        ran.qemu_status
                    ),
                ));
            }
            _ => {
                return Err(in_doubt(format!(
                    "{target_name} answered RUN with {}",
                    ran.phase
                )))
            }
        }
        let t_running = Instant::now();
        switch_parts.push(("run", (t_running - t_run).as_millis() as u64));
        tracing::info!(vm = %spec.name, parts = ?switch_parts, "switch-over");
        // the guest's blackout: from the source's pause (QEMU's completion
        // less its downtime, QEMU's clock started at `migrate`) until RUN
        // was answered; never less than QEMU's figure plus the switch-over
        let downtime_ms = info.downtime.unwrap_or(0);
        let switchover_ms = (t_running - t_completed).as_millis() as u64;
        let guest_downtime_ms = if committed {
            // post-copy: the target ran at the commit; QEMU's figure is its pause
            downtime_ms
        } else {
            let since_migrate = (t_running - t_migrate).as_millis() as u64;
            let stopped_at = info.total_time.unwrap_or(0).saturating_sub(downtime_ms);
            since_migrate
                .saturating_sub(stopped_at)
                .max(downtime_ms + switchover_ms)
        };
        if !committed && !copy.pausing() {
            // the switch-over, and QEMU's own overshoot of its limit (its
            // bandwidth estimate, the last round's dirtying): the next move
            // there leaves room for both
            self.switchovers.record(
                target_name,
                guest_downtime_ms.saturating_sub(downtime_ms),
                downtime_ms,
                dplan.limit_ms,
            );
        }
        if guest_downtime_ms > conv.max_downtime_ms && !copy.pausing() && !committed {
            ev.send(MigrationEvent::Warning {
                message: format!(
                    "the guest saw {guest_downtime_ms} ms of downtime, over the {} ms asked: QEMU {downtime_ms} ms \
                     (limit {} ms), then {} ms until {target_name} ran it ({} ms expected); the next move to \
                     {target_name} plans for that",
                    conv.max_downtime_ms,
                    dplan.limit_ms,
                    guest_downtime_ms.saturating_sub(downtime_ms),
                    dplan.switchover_ms
                ),
            })
            .await;
        }
        // this agent (all of it) and the source QEMU, from `migrate` to here
        let cpu_source = crate::host::own_cpu().saturating_sub(cpu_at_start.0)
            + crate::host::process_cpu(vm.pid)
                .unwrap_or_default()
                .saturating_sub(cpu_at_start.1);

        // 10. cleanup on the source (its QEMU stops, the record says Done)
        // and 11. the guest check on the running target (a report, never a
        // rollback), side by side: neither needs the other
        // a tick past the source's last counts: the target's console is its own
        let check_path = match tick_before {
            Some(t) => format!("/vms/{}/check?after={t}", spec.name),
            None => format!("/vms/{}/check", spec.name),
        };
        let t_end = Instant::now();
        let ms = move || t_end.elapsed().as_millis() as u64;
        let (cleanup_ms, (checked, check_ms)) = tokio::join!(
            async {
                self.finish_source(&spec.name, id).await;
                ms()
            },
            async {
                let r = target
                    .get::<CheckResult>(&check_path, Duration::from_secs(30))
                    .await;
                (r, ms())
            }
        );
        tracing::info!(vm = %spec.name, cleanup_ms, check_ms, "cleanup and guest check");
        ev.step(
            "cleanup",
            format!("source QEMU on {} stopped and removed", self.cfg.name),
        )
        .await;
        let check: CheckResult = match checked {
            Ok(c) => c,
            Err(e) => CheckResult {
                vm: spec.name.clone(),
                host: target_name.to_string(),
                qemu_status: "unknown".into(),
                tick_first: None,
                tick_last: None,
                sweeps: None,
                errors: 0,
                problems: vec![format!("the check could not run: {e}")],
                running: false,
                advancing: false,
                intact: false,
                vcpu_ms: None,
                guest_agent: None,
            },
        };
        let went_back = matches!((tick_before, check.tick_last), (Some(b), Some(a)) if a <= b);
        if check.ok() && !went_back {
            ev.step(
                "final-check",
                match check.vcpu_ms {
                    Some(ms) => format!(
                        "{} runs the guest: vCPUs used {ms} ms during the check{}",
                        check.host,
                        match check.guest_agent {
                            Some(true) => "; guest agent answers, its clock advances",
                            _ => "",
                        }
                    ),
                    None => format!(
                        "{} runs the guest: its counter went from {}{} to {}, {} integrity errors",
                        check.host,
                        tick_before.or(check.tick_first).unwrap_or(0),
                        if tick_before.is_some() {
                            format!(" (its last on {})", self.cfg.name)
                        } else {
                            String::new()
                        },
                        check.tick_last.unwrap_or(0),
                        check.errors
                    ),
                },
            )
            .await;
        } else {
            let why = if went_back {
                format!(
                    "guest counter went back from {} to {}",
                    tick_before.unwrap_or(0),
                    check.tick_last.unwrap_or(0)
                )
            } else {
                check.summary()
            };
            ev.send(MigrationEvent::Warning {
                message: format!(
                    "the guest moved and runs on {target_name}, but its check failed: {why}"
                ),
            })
            .await;
        }
        let on_target = on_target.unwrap_or(ran);

        let qemu_total_ms = info.total_time.unwrap_or(0);
        // rates over the time until the target ran: QEMU's own total ends when
        // the last byte is handed to the data path, not when it has arrived
        let transfer_ms = (t_running - t_migrate).as_millis() as u64;
        let per_sec = |b: u64| {
            if transfer_ms > 0 {
                b as f64 * 1000.0 / transfer_ms as f64
            } else {
                0.0
            }
        };
        let (option, data_path, nic_tx_bytes, carriers, frames_resent, compression) = match plan {
            Plan::Tcp { multifd, .. } => (
                if *multifd { "compression" } else { "tcp" },
                if *multifd { "qemu-multifd" } else { "qemu-tcp" },
                delta(&tx_before, &nic_tx(&self.cfg.nics)),
                Vec::new(),
                0,
                Default::default(),
            ),
            Plan::Multichannel {
                session, option, ..
            } => {
                let st = carriers_at_end.unwrap_or_else(|| session.stats());
                let carriers = st
                    .carriers
                    .iter()
                    .map(|c| CarrierReport {
                        nic: c.nic.clone(),
                        up: c.up,
                        tx_bytes: c.tx_bytes,
                        connects: c.connects,
                        failures: c.failures,
                        frames_requeued: c.frames_requeued,
                        last_failure: c.last_failure.clone(),
                    })
                    .collect();
                (
                    *option,
                    data_path_of(session),
                    carrier_bytes(&st),
                    carriers,
                    st.frames_resent,
                    st.compression.clone(),
                )
            }
        };
        Ok(MigrationReport {
            vm: spec.name.clone(),
            from: self.cfg.name.clone(),
            to: check.host.clone(),
            status: "completed".into(),
            data_path: data_path.into(),
            option: option.into(),
            total_ms: started.elapsed().as_millis() as u64,
            running_ms: (t_running - started).as_millis() as u64,
            qemu_total_ms,
            transfer_ms,
            switchover_ms,
            setup_ms: info.setup_time.unwrap_or(0),
            downtime_ms,
            guest_downtime_ms,
            max_downtime_ms: conv.max_downtime_ms,
            downtime_limit_ms: dplan.limit_ms,
            downtime_reason: if committed {
                "post-copy: the guest ran on the target at the commit".into()
            } else if copy.pausing() {
                "pause-and-copy: pre-copy did not converge in time".into()
            } else {
                dplan.reason()
            },
            bytes_transferred: ram.transferred,
            throughput: per_sec(ram.transferred),
            nic_rates: nic_tx_bytes
                .iter()
                .map(|(n, b)| (n.clone(), per_sec(*b)))
                .collect(),
            nic_tx_bytes,
            carriers,
            frames_resent,
            path_changes: match plan {
                Plan::Multichannel { session, .. } => session.path_changes(),
                Plan::Tcp { .. } => Vec::new(),
            },
            compression_ratio: compression.ratio(),
            frames_compressed: compression.frames_compressed,
            codecs: compression.codecs.clone(),
            qemu_codec: qemu_zstd.map(|level| QemuCodecReport {
                codec: format!("zstd:{level}"),
                raw_bytes: ram.normal_bytes,
                sent_bytes: ram.multifd_bytes,
                ratio: ram.normal_bytes as f64 / ram.multifd_bytes.max(1) as f64,
                cpu_s: qemu_send_cpu.as_secs_f64(),
            }),
            rounds: ram.dirty_sync_count,
            phase: if copy.in_postcopy() {
                "postcopy".into()
            } else if copy.pausing() {
                "pause-and-copy".into()
            } else {
                "precopy".into()
            },
            max_throttle_pct: max_throttle,
            // per GiB of guest memory moved: QEMU counts compressed bytes as transferred
            cpu: CpuReport::new(
                cpu_source,
                on_target.cpu_ms,
                ram.transferred.max(ram.normal_bytes),
            ),
            encrypted: matches!(plan, Plan::Multichannel { session, .. } if session.sealed()),
            disks: mirror.as_deref().map(|m| m.reports()).unwrap_or_default(),
            disk_nic_tx_bytes: mirror.as_deref().map(|m| m.nic_bytes()).unwrap_or_default(),
            tick_before,
            check,
        })
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
        match self.idle.idle() {
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
        let rec = match self.journal.read(id, true) {
            Ok(Some(r)) => r,
            Ok(None) => unreachable!("a move with no record is before its commit"),
            Err(e) => {
                let why = format!("this host's record of the move cannot be read: {e}");
                if let Some(s) = self.state.lock().await.vms.get_mut(&spec.name) {
                    s.doubt = Some(why.clone());
                }
                f.after = AfterCommit::InDoubt;
                f.passthrough = Some(ApiError::MigrationInDoubt {
                    vm: spec.name.clone(),
                    source_host: self.cfg.name.clone(),
                    target: req.target.clone(),
                    reason: format!("{}; {why}", f.reason),
                });
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
                f.passthrough = Some(ApiError::MigrationFailed {
                    vm: spec.name.clone(),
                    step: f.step.into(),
                    reason,
                    running_on: req.target.clone(),
                });
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
                f.passthrough = Some(ApiError::MigrationInDoubt {
                    vm: spec.name.clone(),
                    source_host: self.cfg.name.clone(),
                    target: req.target.clone(),
                    reason,
                });
            }
            SourcePhase::Committed => {
                f.after = AfterCommit::Lost;
                f.passthrough = Some(ApiError::MigrationLost {
                    vm: spec.name.clone(),
                    target: req.target.clone(),
                    reason,
                });
            }
        }
        f
    }

    /// Before the commit: records Aborted, cancels QEMU's migration, tells
    /// the target to discard its skeleton (which never ran: it waits paused
    /// for a RUN that will not come, and asks this host if nobody tells it),
    /// and makes sure the guest runs here again.
    async fn roll_back(
        &self,
        id: &str,
        vm: &Arc<QemuVm>,
        target: &Client,
        session: Option<&ferry_transport::Carriers>,
    ) {
        // never past the commit, whoever asks
        match self.journal.read(id, true) {
            Ok(Some(Record {
                side: Side::Source(SourcePhase::Copying),
                ..
            })) => {}
            other => {
                tracing::error!(migration = id, record = ?other.map(|r| r.map(|r| r.side)), "not rolled back: the journal does not say copying");
                return;
            }
        }
        if let Err(e) = self.set_source_phase(id, SourcePhase::Aborted) {
            // the record still says Copying: a target asking hears "copying"
            // and waits; this agent's next start records Aborted
            tracing::error!(error = %e, "recording the rollback");
        }
        let qmp = &vm.qmp;
        let _ = qmp.migrate_cancel().await;
        // QEMU's sockets end at this agent, so cancelling never waits on a dead link
        if let Some(s) = session {
            s.close();
        }
        for _ in 0..40 {
            match qmp.query_migrate().await.ok().and_then(|i| i.status) {
                Some(s)
                    if s == "active"
                        || s == "cancelling"
                        || s == "device"
                        || s == "setup"
                        || s == "pre-switchover" =>
                {
                    tokio::time::sleep(Duration::from_millis(250)).await
                }
                _ => break,
            }
        }
        if let Err(e) = target
            .delete::<serde_json::Value>(&format!("/incoming/{id}"), Duration::from_secs(5))
            .await
        {
            tracing::warn!(error = %e, "could not tell the target to discard its skeleton; it will ask");
        }
        resume_guest(vm).await;
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
        let Some(pp) = self.paths.get(peer) else {
            return;
        };
        let reached = |pairs: &[ferry_api::NicPath], nic: &str| {
            pairs
                .iter()
                .find(|p| p.nic == nic && p.reachable)
                .map(|p| p.peer_nic.clone())
        };
        let stale = due.iter().any(|nic| reached(&pp.pairs, nic).is_none());
        let (cache, mine) = (self.paths.clone(), self.nics());
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
