//! QMP, QEMU's control protocol, through the `qapi` crate's tokio client.
//!
//! The commands Ferry uses are declared here as small typed structs
//! implementing `qapi::Command`, with reply types that accept every field
//! QEMU 9/10 may add (unknown fields are ignored, statuses are strings), so a
//! newer QEMU cannot break decoding. Every call has a deadline: a QEMU whose
//! monitor is stuck must never stall an agent.

use std::io::{ErrorKind, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use qapi::futures::{QapiService, QmpStreamTokio};
use serde::{Deserialize, Serialize};
use tokio::io::WriteHalf;
use tokio::net::UnixStream;

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("Cannot connect to QMP socket {path}")]
    Connect {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("QMP command {command} failed: {reason}")]
    Command {
        command: &'static str,
        reason: String,
    },
    #[error("QMP command {command} got no reply within {secs} s")]
    Timeout { command: &'static str, secs: u64 },
}

type Service = QapiService<QmpStreamTokio<WriteHalf<UnixStream>>>;

macro_rules! qmp_command {
    ($ty:ident, $name:literal, $ok:ty) => {
        impl qapi::Command for $ty {
            type Ok = $ok;
            const NAME: &'static str = $name;
            const ALLOW_OOB: bool = false;
        }
        impl qapi::qmp::QmpCommand for $ty {}
    };
}

#[derive(Serialize)]
struct QueryStatus {}
#[derive(Debug, Clone, Deserialize)]
pub struct StatusInfo {
    pub status: String,
    pub running: bool,
}
qmp_command!(QueryStatus, "query-status", StatusInfo);

#[derive(Serialize)]
struct QueryMigrate {}
qmp_command!(QueryMigrate, "query-migrate", MigrationInfo);

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct RamStats {
    #[serde(default)]
    pub transferred: u64,
    #[serde(default)]
    pub remaining: u64,
    #[serde(default)]
    pub total: u64,
    #[serde(default)]
    pub dirty_pages_rate: u64,
    #[serde(default)]
    pub mbps: f64,
    #[serde(default)]
    pub dirty_sync_count: u64,
    #[serde(default)]
    pub page_size: u64,
    /// Bytes of the pages QEMU sent whole (not zero), before any compression.
    #[serde(default)]
    pub normal_bytes: u64,
    /// Bytes QEMU wrote into its multifd channels (compressed, when it compresses).
    #[serde(default)]
    pub multifd_bytes: u64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct SocketAddr {
    #[serde(default)]
    pub host: Option<String>,
    #[serde(default)]
    pub port: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct MigrationInfo {
    #[serde(default)]
    pub status: Option<String>,
    #[serde(default)]
    pub ram: Option<RamStats>,
    #[serde(default)]
    pub total_time: Option<u64>,
    #[serde(default)]
    pub expected_downtime: Option<u64>,
    #[serde(default)]
    pub downtime: Option<u64>,
    #[serde(default)]
    pub setup_time: Option<u64>,
    #[serde(default)]
    pub error_desc: Option<String>,
    #[serde(default)]
    pub socket_address: Option<Vec<SocketAddr>>,
    #[serde(default)]
    pub cpu_throttle_percentage: Option<u64>,
}

#[derive(Serialize)]
struct Migrate {
    uri: String,
    /// Post-copy recovery: continue a paused post-copy over a new stream.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    resume: bool,
}
qmp_command!(Migrate, "migrate", qapi::Empty);

/// Target of a paused post-copy: listen for the source's new stream.
#[derive(Serialize)]
struct MigrateRecover {
    uri: String,
}
qmp_command!(MigrateRecover, "migrate-recover", qapi::Empty);

/// Post-copy only: drop the stream now, as if it broke (either end).
#[derive(Serialize)]
struct MigratePause {}
qmp_command!(MigratePause, "migrate-pause", qapi::Empty);

#[derive(Serialize)]
struct MigrateIncoming {
    uri: String,
}
qmp_command!(MigrateIncoming, "migrate-incoming", qapi::Empty);

#[derive(Serialize)]
struct MigrateCancel {}
qmp_command!(MigrateCancel, "migrate_cancel", qapi::Empty);

/// The subset of `migrate-set-parameters` Ferry sets.
#[derive(Serialize, Default)]
#[serde(rename_all = "kebab-case")]
pub struct MigrationParameters {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_bandwidth: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub downtime_limit: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub multifd_channels: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_throttle_initial: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_throttle_increment: Option<u64>,
    /// Bytes per second QEMU may assume for the switch-over (QEMU ≥ 8.2).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub avail_switchover_bandwidth: Option<u64>,
    /// `none` or `zstd`: QEMU compresses in its multifd channels (both ends).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub multifd_compression: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub multifd_zstd_level: Option<u8>,
    /// The id of the TLS credentials every migration channel uses, `""`
    /// for none (see `migration::qemu_tls`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_creds: Option<String>,
}
qmp_command!(MigrationParameters, "migrate-set-parameters", qapi::Empty);

/// `multifd-compression` for a migration whose QEMUs compress with zstd or
/// send pages as they are (set on both ends, and on every move: a source
/// QEMU keeps what its last migration was given).
pub fn multifd_compression(zstd: bool) -> &'static str {
    if zstd {
        "zstd"
    } else {
        "none"
    }
}

#[derive(Serialize)]
struct Capability {
    capability: &'static str,
    state: bool,
}
#[derive(Serialize)]
struct SetCapabilities {
    capabilities: Vec<Capability>,
}
qmp_command!(SetCapabilities, "migrate-set-capabilities", qapi::Empty);

#[derive(Serialize)]
struct StartPostcopy {}
qmp_command!(StartPostcopy, "migrate-start-postcopy", qapi::Empty);

#[derive(Serialize)]
struct Cont {}
qmp_command!(Cont, "cont", qapi::Empty);

#[derive(Serialize)]
struct Stop {}
qmp_command!(Stop, "stop", qapi::Empty);

#[derive(Serialize)]
struct QueryCpusFast {}
/// One vCPU as `query-cpus-fast` reports it.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct VcpuInfo {
    pub cpu_index: u32,
    pub thread_id: u32,
}
qmp_command!(QueryCpusFast, "query-cpus-fast", Vec<VcpuInfo>);

/// `announce-self`: the guest's NICs announce their MACs (RARP, and a
/// guest-side announcement where virtio-net offers it) `rounds` times, the
/// first after `initial` ms, then `step` ms further apart each time up to
/// `max` ms.
#[derive(Serialize, Debug, Clone, Copy)]
pub struct AnnounceSelf {
    pub initial: u64,
    pub max: u64,
    pub rounds: u64,
    pub step: u64,
}
qmp_command!(AnnounceSelf, "announce-self", qapi::Empty);

/// Ferry's announce timing: the first at once, five in the first 1.1 s, so
/// a switch that missed one (a port still learning) hears the next.
pub const ANNOUNCE: AnnounceSelf = AnnounceSelf {
    initial: 1,
    max: 400,
    rounds: 5,
    step: 100,
};

#[derive(Serialize)]
struct DeviceAdd {
    driver: &'static str,
    id: String,
    drive: String,
    bus: String,
    werror: &'static str,
    rerror: &'static str,
}
qmp_command!(DeviceAdd, "device_add", qapi::Empty);

/// `blockdev-add` of a whole node given as JSON (see
/// [`crate::qemu::BlockNode`]).
#[derive(Serialize)]
#[serde(transparent)]
struct BlockdevAdd(serde_json::Value);
qmp_command!(BlockdevAdd, "blockdev-add", qapi::Empty);

/// `object-add` of an object given as JSON (`qom-type`, `id`, properties).
#[derive(Serialize)]
#[serde(transparent)]
struct ObjectAdd(serde_json::Value);
qmp_command!(ObjectAdd, "object-add", qapi::Empty);

#[derive(Serialize)]
struct ObjectDel {
    id: String,
}
qmp_command!(ObjectDel, "object-del", qapi::Empty);

#[derive(Serialize)]
struct BlockdevReopen {
    options: Vec<serde_json::Value>,
}
qmp_command!(BlockdevReopen, "blockdev-reopen", qapi::Empty);

#[derive(Serialize)]
struct BlockResize {
    #[serde(rename = "node-name")]
    node_name: String,
    size: u64,
}
qmp_command!(BlockResize, "block_resize", qapi::Empty);

#[derive(Serialize)]
struct BlockdevDel {
    #[serde(rename = "node-name")]
    node_name: String,
}
qmp_command!(BlockdevDel, "blockdev-del", qapi::Empty);

#[derive(Serialize)]
struct QueryNamedBlockNodes {
    flat: bool,
}
qmp_command!(
    QueryNamedBlockNodes,
    "query-named-block-nodes",
    Vec<BlockInserted>
);

#[derive(Serialize)]
struct QueryBlock {}
qmp_command!(QueryBlock, "query-block", Vec<BlockInfo>);

/// One block device (`query-block`).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct BlockInfo {
    #[serde(default)]
    pub qdev: Option<String>,
    /// `ok`, `failed` or `nospace`; present on devices that stop on errors.
    #[serde(default)]
    pub io_status: Option<String>,
    #[serde(default)]
    pub inserted: Option<BlockInserted>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct BlockInserted {
    #[serde(default)]
    pub node_name: Option<String>,
}

/// `blockdev-mirror`: copies node `device` (its guest-visible contents,
/// and every write made meanwhile) into node `target`; the job stays until
/// dismissed, so its outcome can be read ([`Qmp::block_jobs`]).
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct BlockdevMirror {
    job_id: String,
    device: String,
    target: String,
    sync: &'static str,
    auto_dismiss: bool,
}
qmp_command!(BlockdevMirror, "blockdev-mirror", qapi::Empty);

#[derive(Serialize)]
struct QueryBlockstats {}
qmp_command!(QueryBlockstats, "query-blockstats", Vec<BlockStatsEntry>);

/// One device's I/O counters (`query-blockstats`).
#[derive(Debug, Clone, Deserialize)]
pub struct BlockStatsEntry {
    pub stats: BlockStats,
}

#[derive(Debug, Clone, Deserialize)]
pub struct BlockStats {
    #[serde(default)]
    pub rd_bytes: u64,
    #[serde(default)]
    pub wr_bytes: u64,
}

/// `calc-dirty-rate` in page-sampling mode: hashes of sampled guest pages
/// compared over `calc-time` ms (no dirty logging, so it costs the guest
/// nothing).
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct CalcDirtyRate {
    calc_time: u64,
    calc_time_unit: &'static str,
    /// Pages sampled per GiB of guest memory.
    sample_pages: u64,
}
qmp_command!(CalcDirtyRate, "calc-dirty-rate", qapi::Empty);

#[derive(Serialize)]
struct QueryDirtyRate {}
qmp_command!(QueryDirtyRate, "query-dirty-rate", DirtyRateInfo);

/// The last `calc-dirty-rate`'s result.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct DirtyRateInfo {
    /// `unstarted`, `measuring` or `measured`.
    pub status: String,
    /// MiB/s, once measured.
    #[serde(default)]
    pub dirty_rate: Option<i64>,
}

#[derive(Serialize)]
struct QueryBlockJobs {}
qmp_command!(QueryBlockJobs, "query-block-jobs", Vec<BlockJobInfo>);

/// One block job (`query-block-jobs`).
#[derive(Debug, Clone, Deserialize)]
pub struct BlockJobInfo {
    /// The job's id.
    pub device: String,
    pub len: u64,
    pub offset: u64,
    pub ready: bool,
    /// `running`, `ready`, `concluded`, …
    pub status: String,
    /// Why a concluded job failed.
    #[serde(default)]
    pub error: Option<String>,
}

#[derive(Serialize)]
struct BlockJobCancel {
    device: String,
    force: bool,
}
qmp_command!(BlockJobCancel, "block-job-cancel", qapi::Empty);

#[derive(Serialize)]
struct JobDismiss {
    id: String,
}
qmp_command!(JobDismiss, "job-dismiss", qapi::Empty);

#[derive(Serialize)]
struct NbdServerStart {
    addr: serde_json::Value,
}
qmp_command!(NbdServerStart, "nbd-server-start", qapi::Empty);

#[derive(Serialize)]
#[serde(transparent)]
struct BlockExportAdd(serde_json::Value);
qmp_command!(BlockExportAdd, "block-export-add", qapi::Empty);

#[derive(Serialize)]
struct NbdServerStop {}
qmp_command!(NbdServerStop, "nbd-server-stop", qapi::Empty);

#[derive(Serialize)]
struct MigrateContinue {
    state: &'static str,
}
qmp_command!(MigrateContinue, "migrate-continue", qapi::Empty);

/// Guest-physical memory `[val, val + size)` written to `filename`.
#[derive(Serialize)]
struct PmemSave {
    val: u64,
    size: u64,
    filename: String,
}
qmp_command!(PmemSave, "pmemsave", qapi::Empty);

#[derive(Serialize)]
struct Quit {}
qmp_command!(Quit, "quit", qapi::Empty);

#[derive(Serialize)]
struct SystemPowerdown {}
qmp_command!(SystemPowerdown, "system_powerdown", qapi::Empty);

#[derive(Serialize)]
struct SystemReset {}
qmp_command!(SystemReset, "system_reset", qapi::Empty);

/// A negotiated QMP session with one QEMU.
pub struct Qmp {
    svc: Service,
    events: tokio::task::JoinHandle<()>,
    migration: tokio::sync::watch::Receiver<MigrationSeen>,
    /// QEMU's last `MIGRATION_PASS` (its dirty bitmap synced: pass 2 is the
    /// end of the first pass over memory), since [`Qmp::passes_from_zero`].
    passes: Arc<tokio::sync::watch::Sender<u64>>,
    /// QEMU's events read so far (see [`KnownMessages::events_seen`]).
    events_seen: Arc<std::sync::atomic::AtomicU64>,
    /// A `running` status QEMU answered: the events seen before it was
    /// asked, and when (see [`Qmp::status_seen`]).
    running_seen: std::sync::Mutex<Option<(u64, Instant)>>,
}

/// How long a `running` status stands for QEMU's without asking again, with
/// no event from QEMU since it was asked. Every way out of `running` is an
/// event (`STOP` for a pause, an I/O error, a panic, a migration's end;
/// `SHUTDOWN`, `RESET`, `SUSPEND`), and the end of the QMP stream counts as
/// one; this bounds what an event lost or a QEMU hung would leave shown.
pub const RUNNING_KEPT: Duration = Duration::from_secs(5);

/// The last `MIGRATION` event QEMU sent (with the `events` capability on),
/// and how many it has sent: a waiter wakes on the next one instead of
/// sleeping out a poll interval.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigrationSeen {
    pub count: u64,
    pub status: String,
    /// When QEMU sent it, by QEMU's own clock (the event's `timestamp`,
    /// the host's wall clock): what a waiter woken late still dates it by.
    pub sent: Option<std::time::SystemTime>,
    /// When QEMU last sent `STOP` (its vCPUs paused), by its clock; not an
    /// event waiters wake for.
    pub stopped: Option<std::time::SystemTime>,
    /// When QEMU last sent `RESUME` (starting its vCPUs), by its clock; not
    /// an event waiters wake for either.
    pub resumed: Option<std::time::SystemTime>,
}

/// Waits for QEMU's next `MIGRATION` event, or `wait` if none comes: a
/// waiter's fallback look. An event sent since the receiver last looked
/// ends the wait at once (a watch channel keeps it until it is seen), and a
/// channel whose sender is gone (the QMP connection's reader ended) waits
/// out `wait` rather than spin.
pub async fn next_event_or(
    events: &mut tokio::sync::watch::Receiver<MigrationSeen>,
    wait: Duration,
) {
    if let Ok(Err(_)) = tokio::time::timeout(wait, events.changed()).await {
        tokio::time::sleep(wait).await;
    }
}

impl MigrationSeen {
    /// The guest's pause for the blackout that QEMU's last event (a
    /// `completed`) ended, on this process's monotonic clock, dated by
    /// QEMU's own: the earlier of its last `STOP` and its completion less
    /// its `downtime_ms` (whole milliseconds: one more is taken off). None
    /// when the last event is no completion, or the dates are not
    /// plausible: before `not_before` (the migration's start), after `now`,
    /// or a minute old (the wall clock stepped).
    pub fn pause_of_completion(
        &self,
        downtime_ms: u64,
        not_before: Instant,
        now: Instant,
        wall_now: std::time::SystemTime,
    ) -> Option<Instant> {
        let on_our_clock = |t| {
            on_monotonic_clock(t, now, wall_now, Duration::from_secs(60))
                .filter(|i| *i >= not_before)
        };
        if self.status != "completed" {
            return None;
        }
        let completed = on_our_clock(self.sent?)?;
        let by_downtime = completed.checked_sub(Duration::from_millis(downtime_ms + 1))?;
        let stopped = self
            .stopped
            .and_then(on_our_clock)
            .filter(|s| *s <= completed);
        Some(stopped.map_or(by_downtime, |s| s.min(by_downtime))).filter(|p| *p >= not_before)
    }

    /// The moment, on this process's monotonic clock, QEMU sent the last
    /// event: `now` less the event's age by the wall clock. An age that is
    /// negative or of seconds (the wall clock stepped) counts as none.
    pub fn sent_instant(&self, now: Instant) -> Instant {
        self.sent
            .and_then(|t| {
                on_monotonic_clock(t, now, std::time::SystemTime::now(), Duration::from_secs(2))
            })
            .unwrap_or(now)
    }
}

/// A time QEMU stamped an event with (the host's wall clock) on this
/// process's monotonic clock: `now` less the event's age at `wall_now`.
/// None for a time after `wall_now` or `max_age` old or more (the wall
/// clock stepped).
pub fn on_monotonic_clock(
    t: std::time::SystemTime,
    now: Instant,
    wall_now: std::time::SystemTime,
    max_age: Duration,
) -> Option<Instant> {
    let age = wall_now.duration_since(t).ok().filter(|a| *a < max_age)?;
    now.checked_sub(age)
}

/// Notes when QEMU sent a run-state event (`STOP`, `RESUME`) with `set`,
/// waking no waiter for `MIGRATION` events.
fn note_run_state(
    tx: &tokio::sync::watch::Sender<MigrationSeen>,
    name: &str,
    timestamp: &qapi::Timestamp,
    set: impl FnOnce(&mut MigrationSeen, Option<std::time::SystemTime>),
) {
    tracing::debug!(?timestamp, "QMP {name} event");
    let t = event_time(timestamp);
    tx.send_if_modified(|m| {
        set(m, t);
        false
    });
}

/// An event's `timestamp` (`{"seconds", "microseconds"}` since the epoch).
fn event_time(t: &qapi::Timestamp) -> Option<std::time::SystemTime> {
    let v = serde_json::to_value(t).ok()?;
    let us = v["seconds"].as_u64()?.checked_mul(1_000_000)? + v["microseconds"].as_u64()?;
    std::time::SystemTime::UNIX_EPOCH.checked_add(Duration::from_micros(us))
}

impl Drop for Qmp {
    fn drop(&mut self) {
        self.events.abort();
    }
}

const DEFAULT_DEADLINE: Duration = Duration::from_secs(10);

/// QEMU's side of a QMP session with every event this build's schema
/// (`qapi-qmp`) does not know taken out, line by line. The `qapi` stream
/// decodes each line into the events it knows, and one line it cannot
/// decode ends the stream (tokio-util's `Framed` stops after a decode
/// error): one new event from a newer QEMU would leave every later
/// command without its reply. An unknown event is logged and dropped; the
/// greeting, replies and known events pass unchanged.
pub struct KnownMessages<R> {
    inner: R,
    /// Every event line seen, known or not, and the stream's end: what
    /// [`Qmp::status_seen`] dates a status it keeps by.
    seen: Arc<std::sync::atomic::AtomicU64>,
    /// bytes read but not yet a whole line
    partial: Vec<u8>,
    /// whole lines that passed, not yet handed on
    out: Vec<u8>,
    at: usize,
    eof: bool,
}

impl<R> KnownMessages<R> {
    pub fn new(inner: R) -> Self {
        KnownMessages {
            inner,
            seen: Arc::default(),
            partial: Vec::new(),
            out: Vec::new(),
            at: 0,
            eof: false,
        }
    }

    /// The count of QEMU's events this stream has read (and one more at
    /// its end), shared.
    pub fn events_seen(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.seen.clone()
    }

    fn saw_event(&self) {
        self.seen.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }

    /// Moves the whole lines of `partial` to `out`, leaving out the events
    /// this build does not know; counts every event before any reply read
    /// after it reaches its caller.
    fn sift(&mut self) {
        let Some(end) = self.partial.iter().rposition(|b| *b == b'\n') else {
            return;
        };
        let rest = self.partial.split_off(end + 1);
        let lines = std::mem::replace(&mut self.partial, rest);
        for line in lines.split_inclusive(|b| *b == b'\n') {
            // a reply (most lines: the watch's `query-migrate`) is looked
            // through once
            if mentions_event(line) {
                self.saw_event();
                if let Some(name) = unknown_event(line) {
                    tracing::debug!(event = %name, "QMP event this build does not know: left out");
                    continue;
                }
            }
            self.out.extend_from_slice(line);
        }
    }
}

/// Whether `line` may be an event: it has an `"event"` key (a reply that
/// merely mentions the word counts too, which only costs a look).
fn mentions_event(line: &[u8]) -> bool {
    line.windows(7).any(|w| w == b"\"event\"")
}

/// The name of an event `line` carries that `qapi-qmp` cannot decode; `None`
/// for anything else (a reply, a known event, the greeting, a line that is
/// not JSON: those are the `qapi` stream's to judge).
fn unknown_event(line: &[u8]) -> Option<String> {
    // a reply (most lines: the watch's `query-migrate`) is not parsed twice
    if !mentions_event(line) {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(line).ok()?;
    let name = v.get("event")?.as_str().unwrap_or("?").to_string();
    match serde_json::from_value::<qapi::qmp::QmpMessageAny>(v) {
        Ok(_) => None,
        Err(_) => Some(name),
    }
}

impl<R: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for KnownMessages<R> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let this = self.get_mut();
        loop {
            if this.at < this.out.len() {
                let n = buf.remaining().min(this.out.len() - this.at);
                buf.put_slice(&this.out[this.at..this.at + n]);
                this.at += n;
                if this.at == this.out.len() {
                    this.out.clear();
                    this.at = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                // what is left without a newline goes as it is
                this.out = std::mem::take(&mut this.partial);
                if this.out.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            let mut chunk = [0u8; 8192];
            let mut rb = tokio::io::ReadBuf::new(&mut chunk);
            match std::pin::Pin::new(&mut this.inner).poll_read(cx, &mut rb) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) if rb.filled().is_empty() => {
                    this.eof = true;
                    this.saw_event();
                }
                Poll::Ready(Ok(())) => {
                    this.partial.extend_from_slice(rb.filled());
                    this.sift();
                }
            }
        }
    }
}

/// Reads QEMU's messages (replies go to their callers) and publishes each
/// `MIGRATION` event; ends with the session.
async fn follow_events(
    events: qapi::futures::QapiEvents<
        QmpStreamTokio<KnownMessages<tokio::io::ReadHalf<UnixStream>>>,
    >,
    tx: tokio::sync::watch::Sender<MigrationSeen>,
    passes: Arc<tokio::sync::watch::Sender<u64>>,
) {
    use futures::StreamExt as _;
    // the service's end then ends this stream too
    if events.release().is_err() {
        return;
    }
    let mut events = Box::pin(events);
    while let Some(e) = events.next().await {
        match e {
            Ok(qapi::qmp::Event::MIGRATION { data, timestamp }) => {
                let status = serde_json::to_value(data.status)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default();
                let sent = event_time(&timestamp);
                tracing::debug!(status = %status, ?timestamp, "QMP MIGRATION event");
                tx.send_modify(|m| {
                    m.count += 1;
                    m.status = status;
                    m.sent = sent;
                });
            }
            Ok(qapi::qmp::Event::MIGRATION_PASS { data, .. }) => {
                passes.send_replace(data.pass.max(0) as u64);
            }
            Ok(qapi::qmp::Event::STOP { timestamp, .. }) => {
                note_run_state(&tx, "STOP", &timestamp, |m, t| m.stopped = t);
            }
            Ok(qapi::qmp::Event::RESUME { timestamp, .. }) => {
                note_run_state(&tx, "RESUME", &timestamp, |m, t| m.resumed = t);
            }
            Ok(other) => {
                tracing::debug!(event = ?other, "QMP event");
            }
            Err(e) => {
                tracing::debug!(error = %e, "QMP stream ended");
                break;
            }
        }
    }
}

impl Qmp {
    /// Connects to QEMU's QMP socket, retrying until `wait` has passed (QEMU
    /// creates the socket shortly after it starts).
    pub async fn connect(path: &Path, wait: Duration) -> Result<Qmp, QmpError> {
        let deadline = tokio::time::Instant::now() + wait;
        let shown = path.display().to_string();
        loop {
            let attempt = async {
                let (r, w) = tokio::io::split(UnixStream::connect(path).await?);
                let known = KnownMessages::new(r);
                let seen = known.events_seen();
                let neg = QmpStreamTokio::open_split(known, w).await?;
                Ok::<_, std::io::Error>((neg.negotiate().await?, seen))
            };
            match tokio::time::timeout(Duration::from_secs(5), attempt).await {
                Ok(Ok((stream, events_seen))) => {
                    let (svc, events) = stream.into_parts();
                    let (tx, migration) = tokio::sync::watch::channel(MigrationSeen::default());
                    let passes = Arc::new(tokio::sync::watch::channel(0).0);
                    let events = tokio::spawn(follow_events(events, tx, passes.clone()));
                    return Ok(Qmp {
                        svc,
                        events,
                        migration,
                        passes,
                        events_seen,
                        running_seen: std::sync::Mutex::new(None),
                    });
                }
                Ok(Err(e)) if tokio::time::Instant::now() >= deadline => {
                    return Err(QmpError::Connect {
                        path: shown,
                        source: e,
                    });
                }
                Err(_) if tokio::time::Instant::now() >= deadline => {
                    let e = std::io::Error::new(std::io::ErrorKind::TimedOut, "no QMP greeting");
                    return Err(QmpError::Connect {
                        path: shown,
                        source: e,
                    });
                }
                // QEMU makes its socket within tens of milliseconds
                _ => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        }
    }

    async fn call<C>(&self, cmd: C, deadline: Duration) -> Result<C::Ok, QmpError>
    where
        C: qapi::Command + qapi::qmp::QmpCommand + Send + 'static,
        C::Ok: Send,
    {
        let name = C::NAME;
        // run to its reply on its own: a command dropped while it waits
        // (a deadline, a caller that gave up) would leave its id pending
        // in the QMP service, and the next command with that id panics
        let running = tokio::spawn(self.svc.execute(cmd));
        match tokio::time::timeout(deadline, running).await {
            Ok(Ok(Ok(v))) => Ok(v),
            Ok(Ok(Err(e))) => Err(QmpError::Command {
                command: name,
                reason: e.to_string(),
            }),
            Ok(Err(e)) => Err(QmpError::Command {
                command: name,
                reason: format!("the command's task ended: {e}"),
            }),
            Err(_) => Err(QmpError::Timeout {
                command: name,
                secs: deadline.as_secs(),
            }),
        }
    }

    pub async fn status(&self) -> Result<StatusInfo, QmpError> {
        self.call(QueryStatus {}, DEFAULT_DEADLINE).await
    }

    /// QEMU's status for a listing or a watcher's round: a `running` it
    /// answered stands, unasked, until QEMU sends any event or
    /// [`RUNNING_KEPT`] passes; anything else is asked each time. A
    /// heartbeat lists every guest once a second and the storage watcher
    /// looks at each once a second: each look was a QMP round trip, the
    /// agent's CPU and QEMU's main loop, for a state that changes rarely
    /// and never without an event. A step that acts on the status (a
    /// move, a check) asks with [`Qmp::status`].
    pub async fn status_seen(&self) -> Result<StatusInfo, QmpError> {
        use std::sync::atomic::Ordering;
        // counted before asking: an event read after this makes what the
        // answer says stale, whenever the answer comes
        let seen = self.events_seen.load(Ordering::Acquire);
        let kept = *ferry_api::util::lock(&self.running_seen);
        if let Some((at_count, at)) = kept {
            if at_count == seen && at.elapsed() < RUNNING_KEPT {
                return Ok(StatusInfo {
                    status: "running".into(),
                    running: true,
                });
            }
        }
        let s = self.status().await?;
        *ferry_api::util::lock(&self.running_seen) =
            (s.status == "running").then(|| (seen, Instant::now()));
        Ok(s)
    }

    /// QEMU's `MIGRATION` events as they come (see [`MigrationSeen`]).
    pub fn migration_events(&self) -> tokio::sync::watch::Receiver<MigrationSeen> {
        self.migration.clone()
    }

    /// QEMU's passes over memory (`MIGRATION_PASS`, with the `events`
    /// capability on) from now on: counted from zero again, so that a
    /// migration's first passes are not taken for the last one's.
    pub fn passes_from_zero(&self) -> tokio::sync::watch::Receiver<u64> {
        self.passes.send_replace(0);
        self.passes.subscribe()
    }

    pub async fn query_migrate(&self) -> Result<MigrationInfo, QmpError> {
        self.call(QueryMigrate {}, DEFAULT_DEADLINE).await
    }

    pub async fn migrate(&self, uri: &str) -> Result<(), QmpError> {
        self.call(
            Migrate {
                uri: uri.into(),
                resume: false,
            },
            DEFAULT_DEADLINE,
        )
        .await
        .map(drop)
    }

    /// Source of a paused post-copy: send the rest over a new stream to
    /// `uri`, where the target listens after `migrate-recover`.
    pub async fn migrate_resume(&self, uri: &str) -> Result<(), QmpError> {
        self.call(
            Migrate {
                uri: uri.into(),
                resume: true,
            },
            DEFAULT_DEADLINE,
        )
        .await
        .map(drop)
    }

    pub async fn migrate_recover(&self, uri: &str) -> Result<(), QmpError> {
        self.call(MigrateRecover { uri: uri.into() }, DEFAULT_DEADLINE)
            .await
            .map(drop)
    }

    pub async fn migrate_pause(&self) -> Result<(), QmpError> {
        self.call(MigratePause {}, DEFAULT_DEADLINE).await.map(drop)
    }

    pub async fn migrate_incoming(&self, uri: &str) -> Result<(), QmpError> {
        self.call(MigrateIncoming { uri: uri.into() }, DEFAULT_DEADLINE)
            .await
            .map(drop)
    }

    pub async fn migrate_cancel(&self) -> Result<(), QmpError> {
        self.call(MigrateCancel {}, Duration::from_secs(5))
            .await
            .map(drop)
    }

    pub async fn object_add(&self, object: serde_json::Value) -> Result<(), QmpError> {
        self.call(ObjectAdd(object), DEFAULT_DEADLINE)
            .await
            .map(drop)
    }

    pub async fn object_del(&self, id: &str) -> Result<(), QmpError> {
        self.call(ObjectDel { id: id.into() }, DEFAULT_DEADLINE)
            .await
            .map(drop)
    }

    pub async fn set_parameters(&self, p: MigrationParameters) -> Result<(), QmpError> {
        self.call(p, DEFAULT_DEADLINE).await.map(drop)
    }

    pub async fn set_capabilities(&self, caps: &[(&'static str, bool)]) -> Result<(), QmpError> {
        let capabilities = caps
            .iter()
            .map(|(c, s)| Capability {
                capability: c,
                state: *s,
            })
            .collect();
        self.call(SetCapabilities { capabilities }, DEFAULT_DEADLINE)
            .await
            .map(drop)
    }

    pub async fn start_postcopy(&self) -> Result<(), QmpError> {
        self.call(StartPostcopy {}, DEFAULT_DEADLINE)
            .await
            .map(drop)
    }

    pub async fn cont(&self) -> Result<(), QmpError> {
        self.call(Cont {}, DEFAULT_DEADLINE).await.map(drop)
    }

    /// Pauses the guest; QEMU first completes every request in flight.
    pub async fn stop(&self) -> Result<(), QmpError> {
        self.call(Stop {}, DEFAULT_DEADLINE).await.map(drop)
    }

    pub async fn vcpus(&self) -> Result<Vec<VcpuInfo>, QmpError> {
        self.call(QueryCpusFast {}, DEFAULT_DEADLINE).await
    }

    pub async fn announce_self(&self, a: AnnounceSelf) -> Result<(), QmpError> {
        self.call(a, DEFAULT_DEADLINE).await.map(drop)
    }

    /// Hot-plugs disk number `index` (a virtio-blk on root port `rp{index}`,
    /// stopping the VM on I/O errors) reading format node `blockdev`
    /// (`disk{index}`, [`crate::qemu::BlockNode::blockdev`]).
    pub async fn plug_disk(
        &self,
        index: usize,
        blockdev: serde_json::Value,
    ) -> Result<(), QmpError> {
        self.call(BlockdevAdd(blockdev), Duration::from_secs(20))
            .await?;
        self.call(
            DeviceAdd {
                driver: "virtio-blk-pci",
                id: format!("vd{index}"),
                drive: format!("disk{index}"),
                bus: format!("rp{index}"),
                werror: "stop",
                rerror: "stop",
            },
            DEFAULT_DEADLINE,
        )
        .await
        .map(|_| ())
    }

    /// Puts a new connection under format node `node` (`driver`, e.g.
    /// `raw`): `file`, an NBD node named `file_node`, is added (connecting
    /// at once) and swapped in with `blockdev-reopen`. Used to see a grown
    /// export (NBD fixes an export's size at the handshake) and to reconnect
    /// at once to storage that answers again.
    pub async fn swap_file(
        &self,
        node: &str,
        driver: &str,
        read_only: bool,
        file: serde_json::Value,
        file_node: &str,
    ) -> Result<(), QmpError> {
        let mut file = file;
        file["node-name"] = file_node.into();
        self.call(BlockdevAdd(file), Duration::from_secs(20))
            .await?;
        let options = serde_json::json!({
            "driver": driver, "node-name": node, "file": file_node, "read-only": read_only,
        });
        let r = self
            .call(
                BlockdevReopen {
                    options: vec![options],
                },
                Duration::from_secs(20),
            )
            .await;
        if r.is_err() {
            let _ = self.blockdev_del(file_node).await;
        }
        r.map(drop)
    }

    /// Tells format node `node`'s device (and so the guest) its new size.
    pub async fn block_resize(&self, node: &str, size: u64) -> Result<(), QmpError> {
        self.call(
            BlockResize {
                node_name: node.to_string(),
                size,
            },
            DEFAULT_DEADLINE,
        )
        .await
        .map(drop)
    }

    /// Removes a node nothing uses any more (best effort).
    pub async fn blockdev_del(&self, node: &str) -> Result<(), QmpError> {
        self.call(
            BlockdevDel {
                node_name: node.to_string(),
            },
            DEFAULT_DEADLINE,
        )
        .await
        .map(drop)
    }

    /// The names of every block node.
    pub async fn block_nodes(&self) -> Result<Vec<String>, QmpError> {
        let nodes = self
            .call(QueryNamedBlockNodes { flat: true }, DEFAULT_DEADLINE)
            .await?;
        Ok(nodes.into_iter().filter_map(|n| n.node_name).collect())
    }

    /// Every block device and its I/O status.
    pub async fn query_block(&self) -> Result<Vec<BlockInfo>, QmpError> {
        self.call(QueryBlock {}, DEFAULT_DEADLINE).await
    }

    /// Bytes read and written by every block device since QEMU started.
    pub async fn block_io_bytes(&self) -> Result<u64, QmpError> {
        let stats = self.call(QueryBlockstats {}, DEFAULT_DEADLINE).await?;
        Ok(stats
            .iter()
            .map(|s| s.stats.rd_bytes + s.stats.wr_bytes)
            .sum())
    }

    /// Starts measuring the guest's dirty page rate over `ms`.
    pub async fn calc_dirty_rate(&self, ms: u64) -> Result<(), QmpError> {
        self.call(
            CalcDirtyRate {
                calc_time: ms,
                calc_time_unit: "millisecond",
                // QEMU's default, 512, sees a 256 MiB guest through 128 pages
                sample_pages: 4_096,
            },
            DEFAULT_DEADLINE,
        )
        .await
        .map(drop)
    }

    /// The last measured dirty page rate, bytes/s (`None` while measuring).
    pub async fn dirty_rate(&self) -> Result<Option<u64>, QmpError> {
        let r = self.call(QueryDirtyRate {}, DEFAULT_DEADLINE).await?;
        Ok(match (r.status.as_str(), r.dirty_rate) {
            ("measured", Some(mib)) => Some(mib.max(0) as u64 * (1 << 20)),
            _ => None,
        })
    }

    /// Adds a block node given whole as JSON.
    pub async fn blockdev_add(&self, node: serde_json::Value) -> Result<(), QmpError> {
        self.call(BlockdevAdd(node), DEFAULT_DEADLINE)
            .await
            .map(drop)
    }

    /// Starts mirroring node `device` into node `target` as job `job`
    /// (sync full; the job waits to be dismissed once it ends).
    pub async fn mirror(&self, job: &str, device: &str, target: &str) -> Result<(), QmpError> {
        self.call(
            BlockdevMirror {
                job_id: job.into(),
                device: device.into(),
                target: target.into(),
                sync: "full",
                auto_dismiss: false,
            },
            DEFAULT_DEADLINE,
        )
        .await
        .map(drop)
    }

    pub async fn block_jobs(&self) -> Result<Vec<BlockJobInfo>, QmpError> {
        self.call(QueryBlockJobs {}, DEFAULT_DEADLINE).await
    }

    /// Cancels job `job`: a ready mirror then ends in step with its target
    /// (`force` false), any other is abandoned.
    pub async fn cancel_job(&self, job: &str, force: bool) -> Result<(), QmpError> {
        self.call(
            BlockJobCancel {
                device: job.into(),
                force,
            },
            DEFAULT_DEADLINE,
        )
        .await
        .map(drop)
    }

    pub async fn dismiss_job(&self, job: &str) -> Result<(), QmpError> {
        self.call(JobDismiss { id: job.into() }, DEFAULT_DEADLINE)
            .await
            .map(drop)
    }

    /// Starts QEMU's NBD server on unix socket `path`.
    pub async fn nbd_server_start(&self, path: &Path) -> Result<(), QmpError> {
        let addr =
            serde_json::json!({"type": "unix", "data": {"path": path.display().to_string()}});
        self.call(NbdServerStart { addr }, DEFAULT_DEADLINE)
            .await
            .map(drop)
    }

    /// Exports node `node` writable as NBD export `name`.
    pub async fn export_node(&self, node: &str, name: &str) -> Result<(), QmpError> {
        let e = serde_json::json!({
            "type": "nbd", "id": name, "node-name": node, "name": name, "writable": true,
        });
        self.call(BlockExportAdd(e), DEFAULT_DEADLINE)
            .await
            .map(drop)
    }

    /// Stops QEMU's NBD server and every export (closing their clients).
    pub async fn nbd_server_stop(&self) -> Result<(), QmpError> {
        self.call(NbdServerStop {}, DEFAULT_DEADLINE)
            .await
            .map(drop)
    }

    /// Lets a migration paused before its switch-over (capability
    /// `pause-before-switchover`) go on.
    pub async fn migrate_continue(&self) -> Result<(), QmpError> {
        self.call(
            MigrateContinue {
                state: "pre-switchover",
            },
            DEFAULT_DEADLINE,
        )
        .await
        .map(drop)
    }

    /// Writes `size` bytes of guest-physical memory from `addr` to `file`.
    pub async fn pmemsave(&self, addr: u64, size: u64, file: &Path) -> Result<(), QmpError> {
        let filename = file.display().to_string();
        self.call(
            PmemSave {
                val: addr,
                size,
                filename,
            },
            DEFAULT_DEADLINE,
        )
        .await
        .map(drop)
    }

    pub async fn quit(&self) -> Result<(), QmpError> {
        self.call(Quit {}, Duration::from_secs(3)).await.map(drop)
    }

    /// Presses the guest's ACPI power button.
    pub async fn system_powerdown(&self) -> Result<(), QmpError> {
        self.call(SystemPowerdown {}, Duration::from_secs(3))
            .await
            .map(drop)
    }

    /// Resets the guest (its reset line; QEMU runs on).
    pub async fn system_reset(&self) -> Result<(), QmpError> {
        self.call(SystemReset {}, Duration::from_secs(3))
            .await
            .map(drop)
    }
}

/// Which end of a migration a handed socket is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandTo {
    /// The source: `migrate` writes the stream into it.
    Migrate,
    /// The target: `migrate-incoming` reads the stream from it.
    Incoming,
}

/// The name the handed socket gets in QEMU's monitor.
const HANDED_FD: &str = "ferry-migration";

/// Hands QEMU the connected socket `fd` and starts the migration on it:
/// QMP `getfd` with the descriptor attached (SCM_RIGHTS), then `migrate` or
/// `migrate-incoming` with `fd:` and its name. QEMU gets its own duplicate;
/// the caller keeps `fd`.
///
/// This runs on QEMU's second monitor (`qemu::HANDOFF_SOCK`), synchronously
/// (call it off the async runtime): a named descriptor belongs to the
/// monitor that received it, and the `qapi` client cannot attach one.
pub fn hand_socket(monitor: &Path, fd: RawFd, to: HandTo) -> Result<(), QmpError> {
    let connect = |source| QmpError::Connect {
        path: monitor.display().to_string(),
        source,
    };
    let s = std::os::unix::net::UnixStream::connect(monitor).map_err(connect)?;
    s.set_read_timeout(Some(DEFAULT_DEADLINE))
        .map_err(connect)?;
    let mut lines = std::io::BufReader::new(&s);
    let mut line = String::new();
    read_line(&mut lines, &mut line, "greeting")?;
    let command = match to {
        HandTo::Migrate => "migrate",
        HandTo::Incoming => "migrate-incoming",
    };
    let steps: [(&'static str, serde_json::Value, bool); 3] = [
        ("qmp_capabilities", serde_json::json!({}), false),
        ("getfd", serde_json::json!({ "fdname": HANDED_FD }), true),
        (
            command,
            serde_json::json!({ "uri": format!("fd:{HANDED_FD}") }),
            false,
        ),
    ];
    for (name, arguments, attach) in steps {
        let msg = serde_json::json!({ "execute": name, "arguments": arguments }).to_string() + "\n";
        let sent = if attach {
            send_with_fd(&s, msg.as_bytes(), fd)
        } else {
            (&s).write_all(msg.as_bytes())
        };
        sent.map_err(|e| QmpError::Command {
            command: name,
            reason: format!("sending it: {e}"),
        })?;
        // the reply; events may come first
        loop {
            read_line(&mut lines, &mut line, name)?;
            let v: serde_json::Value =
                serde_json::from_str(&line).map_err(|e| QmpError::Command {
                    command: name,
                    reason: format!("unreadable reply {line:?}: {e}"),
                })?;
            if v.get("return").is_some() {
                break;
            }
            if let Some(e) = v.get("error") {
                return Err(QmpError::Command {
                    command: name,
                    reason: e
                        .get("desc")
                        .and_then(|d| d.as_str())
                        .unwrap_or("error")
                        .to_string(),
                });
            }
        }
    }
    Ok(())
}

fn read_line(
    r: &mut impl std::io::BufRead,
    line: &mut String,
    command: &'static str,
) -> Result<(), QmpError> {
    line.clear();
    match r.read_line(line) {
        Ok(0) => Err(QmpError::Command {
            command,
            reason: "QEMU closed the monitor".into(),
        }),
        Ok(_) => Ok(()),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
            Err(QmpError::Timeout {
                command,
                secs: DEFAULT_DEADLINE.as_secs(),
            })
        }
        Err(e) => Err(QmpError::Command {
            command,
            reason: e.to_string(),
        }),
    }
}

/// Sends `bytes` in one message with descriptor `fd` attached.
fn send_with_fd(
    s: &std::os::unix::net::UnixStream,
    bytes: &[u8],
    fd: RawFd,
) -> std::io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: zeroed msghdr is valid; every pointer set below outlives sendmsg.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: control holds one cmsg of CMSG_SPACE(sizeof fd) bytes.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::copy_nonoverlapping(
            (&fd as *const RawFd).cast::<u8>(),
            libc::CMSG_DATA(c),
            std::mem::size_of::<RawFd>(),
        );
    }
    // SAFETY: msg is fully initialised above.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if (n as usize) < bytes.len() {
        // the descriptor went with the first part; the rest follows plainly
        (&*s).write_all(&bytes[n as usize..])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

    /// An empty directory for one test's monitor socket, and the socket's path in it.
    fn monitor_dir(test: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("ferry-qmp-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("qmp.sock");
        (dir, path)
    }

    /// The first client of a monitor socket at `path`, greeted as QEMU
    /// greets: its command lines, and the socket's writing half.
    async fn greeted_monitor(
        path: &std::path::Path,
    ) -> (
        tokio::io::Lines<BufReader<tokio::net::unix::OwnedReadHalf>>,
        tokio::net::unix::OwnedWriteHalf,
    ) {
        let l = tokio::net::UnixListener::bind(path).unwrap();
        let (s, _) = l.accept().await.unwrap();
        let (r, mut w) = s.into_split();
        w.write_all(b"{\"QMP\": {\"version\": {\"qemu\": {\"micro\": 0, \"minor\": 0, \"major\": 10}, \"package\": \"\"}, \"capabilities\": []}}\n")
            .await
            .unwrap();
        (BufReader::new(r).lines(), w)
    }

    /// A QMP server that answers every command in order: `query-status`
    /// with `running`, its first answer only after `late`; with `events`,
    /// an event unknown to `qapi-qmp` and a `MIGRATION` event before each
    /// `migrate-set-capabilities`' reply.
    async fn fake_qemu(path: std::path::PathBuf, late: Duration, running: bool, events: bool) {
        let (mut lines, mut w) = greeted_monitor(&path).await;
        let mut first = true;
        while let Ok(Some(line)) = lines.next_line().await {
            if events && line.contains("migrate-set-capabilities") {
                // an event no schema of this build knows (a newer QEMU's), then one it does
                w.write_all(b"{\"event\": \"FERRY_TEST_NEWER_QEMU\", \"data\": {\"x\": 1}, \"timestamp\": {\"seconds\": 1, \"microseconds\": 1}}\n")
                    .await
                    .unwrap();
                w.write_all(b"{\"event\": \"MIGRATION\", \"data\": {\"status\": \"completed\"}, \"timestamp\": {\"seconds\": 1, \"microseconds\": 2}}\n")
                    .await
                    .unwrap();
            }
            let reply = if line.contains("query-status") {
                if first {
                    first = false;
                    tokio::time::sleep(late).await;
                }
                format!(
                    "{{\"return\": {{\"status\": \"{}\", \"running\": {running}}}}}\n",
                    if running { "running" } else { "paused" }
                )
            } else {
                "{\"return\": {}}\n".to_string()
            };
            w.write_all(reply.as_bytes()).await.unwrap();
        }
    }

    #[tokio::test]
    async fn a_command_past_its_deadline_does_not_break_the_next() {
        let (dir, path) = monitor_dir("test");
        tokio::spawn(fake_qemu(
            path.clone(),
            Duration::from_millis(600),
            true,
            false,
        ));
        let q = Qmp::connect(&path, Duration::from_secs(5)).await.unwrap();
        let r = q.call(QueryStatus {}, Duration::from_millis(100)).await;
        assert!(matches!(r, Err(QmpError::Timeout { .. })), "{r:?}");
        // the late reply still belongs to the first command; the next gets its own
        let s = q
            .call(QueryStatus {}, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(s.running);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn unknown_events_are_left_out_and_lines_split_anywhere_pass_whole() {
        use tokio::io::AsyncReadExt;
        let greeting = "{\"QMP\": {\"version\": {\"qemu\": {\"micro\": 0, \"minor\": 0, \"major\": 10}, \"package\": \"\"}, \"capabilities\": []}}\n";
        let unknown = "{\"event\": \"FERRY_TEST_NEWER_QEMU\", \"data\": {}, \"timestamp\": {\"seconds\": 1, \"microseconds\": 1}}\n";
        let reply = "{\"return\": {}, \"id\": 3}\n";
        let known = "{\"event\": \"STOP\", \"timestamp\": {\"seconds\": 1, \"microseconds\": 2}}\n";
        let text = format!("{greeting}{unknown}{reply}{unknown}{known}not json, no newline");
        let (mut w, r) = tokio::io::duplex(64);
        let sent = text.clone();
        let writer = tokio::spawn(async move {
            for c in sent.as_bytes().chunks(7) {
                w.write_all(c).await.unwrap();
            }
        });
        let mut got = String::new();
        KnownMessages::new(r)
            .read_to_string(&mut got)
            .await
            .unwrap();
        writer.await.unwrap();
        assert_eq!(got, format!("{greeting}{reply}{known}not json, no newline"));
    }

    #[tokio::test]
    async fn migration_events_wake_their_waiters_and_replies_still_arrive() {
        let (dir, path) = monitor_dir("ev");
        tokio::spawn(fake_qemu(path.clone(), Duration::ZERO, false, true));
        let q = Qmp::connect(&path, Duration::from_secs(5)).await.unwrap();
        let mut ev = q.migration_events();
        assert_eq!(ev.borrow().count, 0);
        q.set_capabilities(&[("events", true)]).await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), ev.changed())
            .await
            .expect("no MIGRATION event reached the waiter")
            .unwrap();
        assert_eq!(
            *ev.borrow(),
            MigrationSeen {
                count: 1,
                status: "completed".into(),
                sent: Some(std::time::UNIX_EPOCH + Duration::from_micros(1_000_002)),
                stopped: None,
                resumed: None,
            }
        );
        // the events before its reply (one unknown to this build) took
        // nothing from the next command, and the session goes on
        assert!(!q.status().await.unwrap().running);
        assert!(!q.status().await.unwrap().running);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A monitor whose status is `status` (changed by the test), counting
    /// the `query-status` it answers, writing each line `lines` sends as
    /// it comes, and hanging up when `lines` closes.
    async fn status_monitor(
        path: std::path::PathBuf,
        status: Arc<std::sync::Mutex<&'static str>>,
        asked: Arc<std::sync::atomic::AtomicU64>,
        mut lines: tokio::sync::mpsc::UnboundedReceiver<String>,
    ) {
        let (mut commands, mut w) = greeted_monitor(&path).await;
        loop {
            tokio::select! {
                c = commands.next_line() => {
                    let Ok(Some(c)) = c else { return };
                    let reply = if c.contains("query-status") {
                        asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let st = *status.lock().unwrap();
                        format!("{{\"return\": {{\"status\": \"{st}\", \"running\": {}}}}}\n", st == "running")
                    } else {
                        "{\"return\": {}}\n".to_string()
                    };
                    w.write_all(reply.as_bytes()).await.unwrap();
                }
                e = lines.recv() => match e {
                    Some(e) => w.write_all(e.as_bytes()).await.unwrap(),
                    None => return,
                },
            }
        }
    }

    /// Waits until `q` has read an event (or the stream's end) past `from`.
    async fn events_past(q: &Qmp, from: u64) {
        let seen = || q.events_seen.load(std::sync::atomic::Ordering::Acquire);
        tokio::time::timeout(Duration::from_secs(5), async {
            while seen() == from {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
        .await
        .expect("the event was never read");
    }

    #[tokio::test]
    async fn a_running_status_stands_until_any_event_its_age_or_the_end() {
        use std::sync::atomic::Ordering::SeqCst;
        let (dir, path) = monitor_dir("seen");
        let status = Arc::new(std::sync::Mutex::new("running"));
        let asked = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (send, lines) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(status_monitor(
            path.clone(),
            status.clone(),
            asked.clone(),
            lines,
        ));
        let q = Qmp::connect(&path, Duration::from_secs(5)).await.unwrap();
        let count = || q.events_seen.load(std::sync::atomic::Ordering::Acquire);

        // running: asked once, then it stands
        for _ in 0..3 {
            assert_eq!(q.status_seen().await.unwrap().status, "running");
        }
        assert_eq!(asked.load(SeqCst), 1);

        // QEMU pauses: its STOP is read, and the next look asks
        *status.lock().unwrap() = "paused";
        let before = count();
        send.send(
            "{\"event\": \"STOP\", \"timestamp\": {\"seconds\": 1, \"microseconds\": 1}}\n"
                .to_string(),
        )
        .unwrap();
        events_past(&q, before).await;
        assert_eq!(q.status_seen().await.unwrap().status, "paused");
        assert_eq!(asked.load(SeqCst), 2);
        // anything but running is asked every time
        assert_eq!(q.status_seen().await.unwrap().status, "paused");
        assert_eq!(asked.load(SeqCst), 3);

        // an event this build's schema does not know ends a running's stand too
        *status.lock().unwrap() = "running";
        q.status_seen().await.unwrap();
        q.status_seen().await.unwrap();
        assert_eq!(asked.load(SeqCst), 4);
        let before = count();
        send.send("{\"event\": \"FERRY_TEST_NEWER_QEMU\", \"data\": {}, \"timestamp\": {\"seconds\": 1, \"microseconds\": 2}}\n".to_string())
            .unwrap();
        events_past(&q, before).await;
        q.status_seen().await.unwrap();
        assert_eq!(asked.load(SeqCst), 5);

        // a running older than RUNNING_KEPT is asked again
        *q.running_seen.lock().unwrap() = Some((count(), Instant::now() - RUNNING_KEPT));
        q.status_seen().await.unwrap();
        assert_eq!(asked.load(SeqCst), 6);
        q.status_seen().await.unwrap();
        assert_eq!(asked.load(SeqCst), 6);

        // QEMU gone: the stream's end counts as an event, and the look fails
        let before = count();
        drop(send);
        events_past(&q, before).await;
        let r = q.status_seen().await;
        assert!(r.is_err(), "a QEMU gone still shows {r:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A monitor that answers every command, keeps the descriptor that
    /// arrives with `getfd`, and reports (command names, that descriptor).
    fn fd_monitor(
        path: std::path::PathBuf,
        fail: Option<&'static str>,
    ) -> std::thread::JoinHandle<(Vec<String>, Option<std::os::fd::OwnedFd>)> {
        use std::io::Write as _;
        use std::os::fd::FromRawFd;
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n")
                .unwrap();
            let (mut names, mut got) = (Vec::new(), None);
            loop {
                let mut buf = [0u8; 4096];
                let mut control = [0u8; 64];
                let mut iov = libc::iovec {
                    iov_base: buf.as_mut_ptr().cast(),
                    iov_len: buf.len(),
                };
                // SAFETY: every pointer is valid for the call.
                let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
                msg.msg_iov = &mut iov;
                msg.msg_iovlen = 1;
                msg.msg_control = control.as_mut_ptr().cast();
                msg.msg_controllen = control.len() as _;
                // SAFETY: msg is initialised above.
                let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, 0) };
                if n <= 0 {
                    break;
                }
                // SAFETY: the kernel filled msg's control area.
                unsafe {
                    let c = libc::CMSG_FIRSTHDR(&msg);
                    if !c.is_null() && (*c).cmsg_type == libc::SCM_RIGHTS {
                        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<RawFd>());
                        got = Some(std::os::fd::OwnedFd::from_raw_fd(fd));
                    }
                }
                let v: serde_json::Value = serde_json::from_slice(&buf[..n as usize]).unwrap();
                let name = v["execute"].as_str().unwrap().to_string();
                let reply = if Some(name.as_str()) == fail {
                    "{\"error\": {\"class\": \"GenericError\", \"desc\": \"no such fd\"}}\n"
                } else {
                    // an event before the reply, as QEMU may send
                    "{\"event\": \"MIGRATION\", \"data\": {}}\n{\"return\": {}}\n"
                };
                names.push(name);
                s.write_all(reply.as_bytes()).unwrap();
            }
            (names, got)
        })
    }

    /// A pause event read late is dated by QEMU's clock; a wall clock that
    /// stepped (an event from the future, or seconds old) dates it now.
    #[test]
    fn a_completed_blackout_is_dated_from_qemus_stop_or_its_downtime_whichever_is_earlier() {
        let ms = Duration::from_millis;
        let (now, wall) = (Instant::now(), std::time::SystemTime::now());
        let start = now - ms(3000);
        let seen = |status: &str, sent_ago: u64, stop_ago: Option<u64>| MigrationSeen {
            count: 5,
            status: status.into(),
            sent: Some(wall - ms(sent_ago)),
            stopped: stop_ago.map(|a| wall - ms(a)),
            resumed: None,
        };
        // completed 20 ms ago after 3 ms of downtime; STOP 25 ms ago: the STOP
        assert_eq!(
            seen("completed", 20, Some(25)).pause_of_completion(3, start, now, wall),
            Some(now - ms(25))
        );
        // a STOP later than completion less downtime (QEMU stamps it once the
        // vCPUs are out): completion less downtime, less the ms it rounds off
        assert_eq!(
            seen("completed", 20, Some(22)).pause_of_completion(3, start, now, wall),
            Some(now - ms(24))
        );
        // no STOP seen, or one from before the migration (a paused guest)
        for stop in [None, Some(5000)] {
            assert_eq!(
                seen("completed", 20, stop).pause_of_completion(3, start, now, wall),
                Some(now - ms(24))
            );
        }
        // not a completion, a completion from the future or a minute old
        // (the wall clock stepped), or before the migration began: none
        assert_eq!(
            seen("device", 20, Some(25)).pause_of_completion(3, start, now, wall),
            None
        );
        let future = MigrationSeen {
            sent: Some(wall + ms(50)),
            ..seen("completed", 0, None)
        };
        assert_eq!(future.pause_of_completion(3, start, now, wall), None);
        assert_eq!(
            seen("completed", 61_000, None).pause_of_completion(3, start, now, wall),
            None
        );
        assert_eq!(
            seen("completed", 2999, None).pause_of_completion(3, start, now, wall),
            None
        );
    }

    #[test]
    fn an_event_read_late_is_dated_when_qemu_sent_it() {
        let now = Instant::now();
        let wall = std::time::SystemTime::now();
        let seen = |sent| MigrationSeen {
            count: 1,
            status: "device".into(),
            sent,
            stopped: None,
            resumed: None,
        };
        let late = now - seen(Some(wall - Duration::from_millis(300))).sent_instant(now);
        assert!(
            late >= Duration::from_millis(300) && late < Duration::from_millis(400),
            "{late:?}"
        );
        for sent in [
            None,
            Some(wall + Duration::from_secs(1)),
            Some(wall - Duration::from_secs(3600)),
        ] {
            assert_eq!(seen(sent).sent_instant(now), now, "{sent:?}");
        }
        let t: qapi::Timestamp =
            serde_json::from_str(r#"{"seconds": 1796323418, "microseconds": 795805}"#).unwrap();
        assert_eq!(
            event_time(&t),
            Some(std::time::UNIX_EPOCH + Duration::from_micros(1_796_323_418_795_805))
        );
    }

    #[test]
    fn a_socket_is_handed_with_getfd_then_migrate_on_it() {
        use std::io::Read as _;
        let dir = std::env::temp_dir().join(format!("ferry-qmp-fd-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("handoff.sock");
        let monitor = fd_monitor(path.clone(), None);
        let (mine, mut peer) = std::os::unix::net::UnixStream::pair().unwrap();
        hand_socket(&path, mine.as_raw_fd(), HandTo::Incoming).unwrap();
        let (names, got) = monitor.join().unwrap();
        assert_eq!(names, ["qmp_capabilities", "getfd", "migrate-incoming"]);
        // what "QEMU" received is the same socket: its writes reach the peer
        let handed = std::os::unix::net::UnixStream::from(got.expect("no descriptor arrived"));
        (&handed).write_all(b"stream").unwrap();
        let mut b = [0u8; 6];
        peer.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"stream");

        // an error reply names the command and QEMU's reason
        let path2 = dir.join("handoff2.sock");
        let monitor = fd_monitor(path2.clone(), Some("migrate"));
        let e = hand_socket(&path2, mine.as_raw_fd(), HandTo::Migrate).unwrap_err();
        assert!(
            matches!(&e, QmpError::Command { command: "migrate", reason } if reason == "no such fd"),
            "{e}"
        );
        drop(monitor);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
