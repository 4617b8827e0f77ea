//! Compression that only uses idle CPU, only when it wins, and chooses how.
//!
//! The source compresses DATA frames only while the link is the bottleneck
//! (frames wait for a carrier, or did within [`LINK_BOUND_FOR`], or the
//! compression under way keeps the raw rate above what the link carries)
//! and CPU is spare (more than the [`MIN_IDLE`] share of the host's CPUs idle,
//! counting what compressing takes now). Then, per frame, it picks the
//! codec ([`choose`]) that delivers the most raw bytes per second of wall
//! time: for each of none, LZ4 and zstd at levels -1, 1 and 3, the least of
//! - the link's rate (bytes as sent, measured over 250 ms windows while
//!   frames waited for carriers) × the codec's recent ratio,
//! - the source's spare CPUs × the codec's recent speed (raw bytes per
//!   CPU-second, the compressing thread's own CPU time),
//! - the target's spare CPUs (reported in its ACKs and PINGs) × that speed ×
//!   how much faster decompression runs;
//!
//! so a slow link with idle CPUs gets the best ratio, a fast one the
//! cheapest codec or none, and a busy host none. Codecs within 1% of the
//! best count as equal and the one with the least CPU per byte wins. Every
//! [`PROBE_EVERY`]th frame is compressed with every candidate (the first
//! frames too, until each is measured), the smallest result sent: the
//! estimates come from the same bytes, so they compare fairly, and follow
//! the data as it changes. A frame that does not shrink below
//! [`SEND_BELOW`] of its size goes as it is. A frame whose bytes read as
//! noise ([`looks_like_noise`]: a sixteenth of them counted, at a third of
//! LZ4's cost) goes as it is without a codec tried on it, probe or not.
//! zstd only to a target whose Welcome says it decompresses it.
//!
//! `Always` compresses every frame that shrinks with the best ratio,
//! whatever the link and CPU (for tests and measurements).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::protocol::{Packing, SpareCpu};
use ferry_api::util::lock;

/// Idle CPU share kept free: compression spends only what is idle beyond it.
pub const MIN_IDLE: f64 = 0.2;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Off,
    Adaptive,
    Always,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompressionStats {
    /// Payload bytes offered to the compressor (uncompressed).
    pub raw_bytes: u64,
    /// What was sent for them.
    pub sent_bytes: u64,
    pub frames_compressed: u64,
    pub frames_plain: u64,
    /// Per codec (`none` for frames sent as they were).
    #[serde(default)]
    pub codecs: Vec<CodecUse>,
}

impl CompressionStats {
    /// Raw ÷ sent (1.0 when nothing was compressed).
    pub fn ratio(&self) -> f64 {
        if self.sent_bytes == 0 {
            1.0
        } else {
            self.raw_bytes as f64 / self.sent_bytes as f64
        }
    }
}

/// What a sample of memory would cost to send compressed, per byte sent
/// plain: the better of LZ4 and zstd level 1 (what the per-frame chooser
/// picks from on a slow link) over 64 KiB blocks of its non-zero 4 KiB
/// pages (QEMU sends a zero page as a flag, never its bytes). `None` when
/// every page is zero.
pub fn sample_ratio(sample: &[u8]) -> Option<f64> {
    let pages: Vec<&[u8]> = sample
        .chunks(4096)
        .filter(|p| p.iter().any(|b| *b != 0))
        .collect();
    if pages.is_empty() {
        return None;
    }
    let (mut raw, mut packed) = (0usize, 0usize);
    for block in pages.chunks(16) {
        let bytes = block.concat();
        raw += bytes.len();
        packed += [Codec::Lz4, Codec::Zstd(1)]
            .iter()
            .filter_map(|c| c.compress(&bytes).map(|p| p.len()))
            .min()
            .unwrap_or(bytes.len());
    }
    Some(packed as f64 / raw as f64)
}

/// Idle share of this host's CPUs (`cpu_times`) over `over`.
pub fn idle_share(over: Duration) -> Option<f64> {
    let a = cpu_times()?;
    std::thread::sleep(over);
    idle_between(a, cpu_times()?)
}

/// Idle share between two [`cpu_times`] samples.
fn idle_between(a: (u64, u64), b: (u64, u64)) -> Option<f64> {
    let total = b.1.saturating_sub(a.1);
    (total > 0).then(|| b.0.saturating_sub(a.0) as f64 / total as f64)
}

/// `(idle, total)` CPU time since boot, in clock ticks, of the CPUs this
/// process may run on ([`crate::cpu::own_ticks`]): the host's own when it
/// has CPUs of its own, as [`Compressor`]'s CPU count (this process's
/// available parallelism) is.
pub(crate) fn cpu_times() -> Option<(u64, u64)> {
    crate::cpu::own_ticks().map(|(busy, all)| (all - busy, all))
}

/// One frame in this many, while compression is on, is compressed with
/// every candidate, so their ratios and speeds stay measured on the data
/// as it is now, on the same bytes.
pub const PROBE_EVERY: u64 = 16;
/// A compressed payload is sent only if it is at most this share of the raw one.
pub const SEND_BELOW: f64 = 0.99;
/// Bits of order-0 entropy per byte from which a frame is taken for noise
/// ([`looks_like_noise`]): no entropy coder takes more than 0.4% off it, well
/// short of [`SEND_BELOW`].
pub const NOISE_BITS: f64 = 7.97;
/// Of every this many bytes of a frame, the noise screen reads the first
/// [`SCREEN_READS`].
const SCREEN_STRIDE: usize = 1024;
const SCREEN_READS: usize = 64;

/// Whether `raw` is noise no codec here would shrink below [`SEND_BELOW`]:
/// random data, or memory already compressed or encrypted by the guest. The
/// order-0 entropy of a sixteenth of its bytes (64 of every 1024, so every
/// 4 KiB page is seen four times), corrected for the sample's size
/// (Miller–Madow), is at least [`NOISE_BITS`]. A frame that reads as noise
/// to its bytes' histogram but repeats itself (the same random page twice
/// in 256 KiB) would have shrunk by its repeats, and goes as it is; a
/// guest's memory seldom holds such frames, and one costs only its own
/// bytes. Frames under 64 KiB are never screened. On this machine counting
/// costs 0.03 CPU-s per GiB, against 0.09 for LZ4 and 0.10–0.18 for zstd
/// (-1 to 3) on the same noise (`examples/frame_cost.rs`).
pub fn looks_like_noise(raw: &[u8]) -> bool {
    if raw.len() < 64 << 10 {
        return false;
    }
    // four tables, so that consecutive bytes do not wait on one counter
    let mut counts = [[0u32; 256]; 4];
    let mut n = 0usize;
    for chunk in raw.chunks(SCREEN_STRIDE) {
        let read = &chunk[..chunk.len().min(SCREEN_READS)];
        for q in read.chunks_exact(4) {
            counts[0][q[0] as usize] += 1;
            counts[1][q[1] as usize] += 1;
            counts[2][q[2] as usize] += 1;
            counts[3][q[3] as usize] += 1;
        }
        n += read.len() / 4 * 4;
    }
    let total = n as f64;
    let (mut bits, mut seen) = (0.0, 0u32);
    let [a, b, c, d] = &counts;
    for (((a, b), c), d) in a.iter().zip(b).zip(c).zip(d) {
        let count = a + b + c + d;
        if count > 0 {
            let p = f64::from(count) / total;
            bits -= p * p.log2();
            seen += 1;
        }
    }
    let corrected =
        bits + f64::from(seen.saturating_sub(1)) / (2.0 * total * std::f64::consts::LN_2);
    corrected >= NOISE_BITS
}
/// The link still counts as the bottleneck this long after frames last waited for a carrier.
pub const LINK_BOUND_FOR: Duration = Duration::from_secs(1);
/// Codecs whose expected rates are within this share of the best are as
/// good: the one costing least CPU per byte is taken.
pub const TIE: f64 = 0.99;
/// The window over which the link's rate, the raw rate and the CPU are measured.
const WINDOW: Duration = Duration::from_millis(250);
/// Weight of a new sample in a codec's running estimate.
const ALPHA: f64 = 0.3;
/// The link rate assumed before one was measured (1 Gbit/s).
const UNMEASURED_LINK: f64 = 125e6;

/// How a frame is compressed. The level is the sender's choice; the wire
/// carries only the format ([`Packing`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Codec {
    None,
    Lz4,
    Zstd(i8),
}

/// What the chooser picks from besides sending as is: LZ4, and zstd from
/// its fast level -1 to 3 (above 3 zstd compresses guest memory at
/// ~100 MB/s per core for a few percent more ratio; see BENCHMARKS.md).
pub const CANDIDATES: [Codec; 4] = [Codec::Lz4, Codec::Zstd(-1), Codec::Zstd(1), Codec::Zstd(3)];

impl Codec {
    pub fn name(&self) -> String {
        match self {
            Codec::None => "none".into(),
            Codec::Lz4 => "lz4".into(),
            Codec::Zstd(l) => format!("zstd:{l}"),
        }
    }

    pub fn packing(&self) -> Packing {
        match self {
            Codec::None => Packing::Plain,
            Codec::Lz4 => Packing::Lz4,
            Codec::Zstd(_) => Packing::Zstd,
        }
    }

    /// How many times faster the receiver decompresses than the sender
    /// compressed, at the least: measured on 256 KiB frames of guest memory,
    /// compressible and not, LZ4 decodes 6–20× faster than it encodes and
    /// zstd at these levels 3–12×.
    fn decode_factor(&self) -> f64 {
        match self {
            Codec::None => f64::INFINITY,
            Codec::Lz4 => 6.0,
            Codec::Zstd(_) => 3.0,
        }
    }

    /// `raw` compressed, or `None` when that is not smaller.
    pub fn compress(&self, raw: &[u8]) -> Option<Vec<u8>> {
        self.compress_timed(raw).0
    }

    /// [`Codec::compress`], and the CPU time (ns, this thread's) the
    /// compression itself took — not the zstd context made on first use.
    fn compress_timed(&self, raw: &[u8]) -> (Option<Vec<u8>>, u64) {
        thread_local! {
            static ZSTD: RefCell<Vec<(i8, zstd::bulk::Compressor<'static>)>> =
                const { RefCell::new(Vec::new()) };
        }
        let spent = |t0: u64| thread_cpu_ns().saturating_sub(t0).max(1_000);
        match self {
            Codec::None => (None, 0),
            Codec::Lz4 => {
                let t0 = thread_cpu_ns();
                let p = lz4_flex::block::compress(raw);
                ((p.len() < raw.len()).then_some(p), spent(t0))
            }
            Codec::Zstd(level) => ZSTD.with(|z| {
                let mut z = z.borrow_mut();
                let at = match z.iter().position(|(l, _)| l == level) {
                    Some(i) => i,
                    None => match zstd::bulk::Compressor::new(i32::from(*level)) {
                        Ok(c) => {
                            z.push((*level, c));
                            z.len() - 1
                        }
                        Err(_) => return (None, 0),
                    },
                };
                // no bigger than the raw bytes: what would not shrink fails early
                let mut out = Vec::with_capacity(raw.len().saturating_sub(1));
                let t0 = thread_cpu_ns();
                let done = z[at].1.compress_to_buffer(raw, &mut out).is_ok();
                (done.then_some(out), spent(t0))
            }),
        }
    }
}

/// What a codec did on recent frames.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Estimate {
    /// Raw ÷ compressed (1.0 when it did not shrink).
    pub ratio: f64,
    /// Raw bytes compressed per CPU-second.
    pub speed: f64,
    pub samples: u32,
}

/// A probe whose ratio is more than this many times the estimate's, or
/// less than its inverse, was made on memory of another kind (see
/// `Estimate::add`).
pub const OTHER_KIND: f64 = 2.0;

impl Estimate {
    /// Within a kind, moves the estimate [`ALPHA`] of the way to the
    /// probe's figures, averaging sizes (sent ÷ raw), not ratios.
    ///
    /// A probe on memory of another kind ([`OTHER_KIND`]) replaces the
    /// estimate instead. A codec's speed depends on what it compresses: on
    /// memory that does not shrink zstd gives up at 1.4 GB/s, on a guest's
    /// kernel and tables its level 3 runs at a tenth of that. Averaged, the
    /// figures of a long stretch of noise would still promise that speed
    /// for the first hundreds of frames that do shrink, and the chooser
    /// would spend more CPU on them than the link saves. A lone odd probe
    /// costs at most the [`PROBE_EVERY`] − 1 frames until the next one puts
    /// the estimate back: after a page of text among noise they are
    /// compressed for nothing and go as they are; after noise among text
    /// they go uncompressed.
    fn add(&mut self, ratio: f64, speed: f64) {
        let other_kind = self.samples > 0 && {
            let q = ratio / self.ratio;
            !(1.0 / OTHER_KIND..=OTHER_KIND).contains(&q)
        };
        if self.samples == 0 || other_kind {
            (self.ratio, self.speed) = (ratio, speed);
        } else {
            let size = 1.0 / self.ratio + ALPHA * (1.0 / ratio - 1.0 / self.ratio);
            self.ratio = 1.0 / size;
            self.speed += ALPHA * (speed - self.speed);
        }
        self.samples = self.samples.saturating_add(1);
    }
}

/// What the chooser weighs at a moment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Conditions {
    /// Bytes per second the carriers take, measured while the link was the
    /// bottleneck (0: not measured yet).
    pub wire_rate: f64,
    /// CPUs' worth this side may spend compressing: what is idle (plus what
    /// compressing takes now), less the [`MIN_IDLE`] share kept free.
    pub source_cores: f64,
    /// CPUs' worth idle on the receiver, as its ACKs and PINGs report (none
    /// from a receiver that does not report).
    pub target_cores: Option<f64>,
    /// The receiver decompresses zstd.
    pub zstd: bool,
}

/// Raw bytes per second `codec` would deliver under `c`: the least of what
/// the link carries at its ratio, what the spare CPU compresses and what the
/// receiver's decompresses. `None` for a codec not measured yet.
pub fn expected_rate(codec: Codec, est: &Estimate, c: &Conditions) -> Option<f64> {
    let link = if c.wire_rate > 0.0 {
        c.wire_rate
    } else {
        UNMEASURED_LINK
    };
    if codec == Codec::None {
        return Some(link);
    }
    if est.samples == 0 {
        return None;
    }
    let carried = link * est.ratio.max(1.0);
    let compressed = c.source_cores.max(0.0) * est.speed;
    let decompressed = c.target_cores.map_or(f64::INFINITY, |t| {
        t.max(0.0) * est.speed * codec.decode_factor()
    });
    Some(carried.min(compressed).min(decompressed))
}

/// The codec that delivers the most raw bytes per second of wall time;
/// among those within [`TIE`] of the best, the one costing least CPU per
/// byte (sending as is costs none). Returns it with its expected rate.
pub fn choose(c: &Conditions, est: &[(Codec, Estimate)]) -> (Codec, f64) {
    let mut options = vec![(
        Codec::None,
        expected_rate(Codec::None, &Estimate::default(), c).unwrap_or(0.0),
        0.0,
    )];
    for (codec, e) in est {
        if matches!(codec, Codec::Zstd(_)) && !c.zstd {
            continue;
        }
        if let Some(r) = expected_rate(*codec, e, c) {
            options.push((*codec, r, 1.0 / e.speed.max(1.0)));
        }
    }
    let best = options.iter().map(|o| o.1).fold(0.0, f64::max);
    options
        .into_iter()
        .filter(|o| o.1 >= best * TIE)
        .min_by(|a, b| a.2.total_cmp(&b.2))
        .map_or((Codec::None, 0.0), |o| (o.0, o.1))
}

/// One codec's share of a session's frames (the move report's `codecs`).
pub use ferry_api::types::CodecReport as CodecUse;

/// The measurements of the current and last window.
struct Window {
    start: Instant,
    /// `(idle, total)` CPU ticks at its start.
    ticks: Option<(u64, u64)>,
    raw: u64,
    frames: u32,
    cpu_ns: u64,
    /// DATA bytes carriers took, and how many of those frames left others
    /// waiting for a carrier (the link was the limit).
    sent: u64,
    sent_frames: u32,
    sent_waiting: u32,
    /// Receiving side: CPU spent decompressing.
    unpack_ns: u64,
}

impl Window {
    fn new() -> Window {
        Window {
            start: Instant::now(),
            ticks: cpu_times(),
            raw: 0,
            frames: 0,
            cpu_ns: 0,
            sent: 0,
            sent_frames: 0,
            sent_waiting: 0,
            unpack_ns: 0,
        }
    }
}

struct State {
    estimates: Vec<(Codec, Estimate)>,
    window: Window,
    /// Link rate (bytes as sent per second) from the last link-bound window.
    wire_rate: f64,
    /// Raw bytes per second offered over the last window.
    raw_rate: f64,
    /// Idle share of this host's CPUs over the last window.
    idle: f64,
    /// CPUs' worth spent compressing over the last window.
    own_cores: f64,
    /// CPUs' worth spent decompressing over the last window.
    unpack_cores: f64,
    last_bound: Option<Instant>,
    /// What the chooser picked for the last frame (none: not compressing).
    current: Codec,
    frames: u64,
    uses: BTreeMap<Codec, CodecUse>,
}

pub struct Compressor {
    mode: AtomicU8,
    /// The receiver decompresses zstd (its Welcome said so).
    zstd: AtomicBool,
    /// The receiver's last spare CPU report ([`SpareCpu::encode`]), 0 if none.
    peer: AtomicU64,
    cpus: u16,
    state: Mutex<State>,
}

impl Default for Compressor {
    fn default() -> Self {
        Compressor {
            mode: AtomicU8::new(0),
            zstd: AtomicBool::new(false),
            peer: AtomicU64::new(0),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get().min(4096) as u16),
            state: Mutex::new(State {
                estimates: CANDIDATES
                    .iter()
                    .map(|c| (*c, Estimate::default()))
                    .collect(),
                window: Window::new(),
                wire_rate: 0.0,
                raw_rate: 0.0,
                idle: 1.0,
                own_cores: 0.0,
                unpack_cores: 0.0,
                last_bound: None,
                current: Codec::None,
                frames: 0,
                uses: BTreeMap::new(),
            }),
        }
    }
}

/// CPU time this thread has used, in nanoseconds.
pub(crate) fn thread_cpu_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec for the call to fill.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
        return 0;
    }
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// A compressed frame ready to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packed {
    pub payload: Bytes,
    pub packing: Packing,
    /// The raw length when compressed, else 0.
    pub raw_len: u32,
}

impl Packed {
    /// `payload` sent as it is.
    pub fn plain(payload: Bytes) -> Packed {
        Packed {
            payload,
            packing: Packing::Plain,
            raw_len: 0,
        }
    }

    /// Its length once unpacked.
    pub fn raw_bytes(&self) -> usize {
        match self.packing {
            Packing::Plain => self.payload.len(),
            _ => self.raw_len as usize,
        }
    }
}

impl Compressor {
    pub fn set_mode(&self, m: Mode) {
        self.mode.store(m as u8, Ordering::Relaxed);
    }

    pub fn mode(&self) -> Mode {
        match self.mode.load(Ordering::Relaxed) {
            1 => Mode::Adaptive,
            2 => Mode::Always,
            _ => Mode::Off,
        }
    }

    /// The receiver's Welcome features ([`crate::protocol::FEATURE_ZSTD`]).
    pub fn set_peer_features(&self, features: u8) {
        self.zstd.store(
            features & crate::protocol::FEATURE_ZSTD != 0,
            Ordering::Relaxed,
        );
    }

    /// A spare-CPU report from an ACK or PING (0: none).
    pub fn set_peer_spare(&self, v: u64) {
        if SpareCpu::decode(v).is_some() {
            self.peer.store(v, Ordering::Relaxed);
        }
    }

    /// This host's spare CPU, for the ACKs and PINGs this side sends: what
    /// is idle, plus what decompressing takes now (it is the sender's to spend).
    pub fn spare(&self) -> u64 {
        let mut st = lock(&self.state);
        self.roll(&mut st);
        SpareCpu {
            idle: (st.idle + st.unpack_cores / f64::from(self.cpus)).min(1.0),
            cpus: self.cpus,
        }
        .encode()
    }

    /// A carrier took a DATA frame of `bytes` as sent; `waiting`: others
    /// still wait for a carrier.
    pub fn note_sent(&self, bytes: usize, waiting: bool) {
        let mut st = lock(&self.state);
        st.window.sent += bytes as u64;
        st.window.sent_frames += 1;
        st.window.sent_waiting += u32::from(waiting);
    }

    /// The receiving side spent `ns` of CPU decompressing a frame.
    pub fn note_unpacked(&self, ns: u64) {
        lock(&self.state).window.unpack_ns += ns;
    }

    /// Closes the window if it is over: the link's rate (if frames waited
    /// for carriers through most of it), the raw rate, idle and own CPU.
    fn roll(&self, st: &mut State) {
        let secs = st.window.start.elapsed().as_secs_f64();
        if secs < WINDOW.as_secs_f64() {
            return;
        }
        let w = std::mem::replace(&mut st.window, Window::new());
        if let Some(idle) = w
            .ticks
            .zip(st.window.ticks)
            .and_then(|(a, b)| idle_between(a, b))
        {
            st.idle = idle;
        }
        st.own_cores = w.cpu_ns as f64 / 1e9 / secs;
        st.unpack_cores = w.unpack_ns as f64 / 1e9 / secs;
        st.raw_rate = w.raw as f64 / secs;
        // what carriers took while frames waited for them: the links' rate
        if w.sent_frames > 0 && w.sent_waiting * 2 >= w.sent_frames {
            let rate = w.sent as f64 / secs;
            st.wire_rate = if st.wire_rate == 0.0 {
                rate
            } else {
                0.5 * (st.wire_rate + rate)
            };
        }
        if w.frames > 0 && self.mode() != Mode::Off {
            tracing::debug!(
                idle = st.idle,
                own_cores = st.own_cores,
                wire_rate = st.wire_rate,
                raw_rate = st.raw_rate,
                frames = w.frames,
                sent = w.sent,
                sent_waiting = w.sent_waiting,
                raw = w.raw,
                current = %st.current.name(),
                estimates = %st
                    .estimates
                    .iter()
                    .map(|(c, e)| format!("{}:{:.1}x@{:.0}MB/s", c.name(), e.ratio, e.speed / 1e6))
                    .collect::<Vec<_>>()
                    .join(" "),
                "compression window"
            );
        }
    }

    /// What the chooser would weigh now.
    fn conditions(&self, st: &State) -> Conditions {
        let cpus = f64::from(self.cpus);
        Conditions {
            wire_rate: st.wire_rate,
            // the reserve decides whether to start; once compressing, what it
            // takes is its own to keep (the host was idle enough to start)
            source_cores: if st.current == Codec::None {
                (st.idle - MIN_IDLE) * cpus
            } else {
                st.idle * cpus + st.own_cores
            }
            .max(0.0),
            target_cores: SpareCpu::decode(self.peer.load(Ordering::Relaxed)).map(|s| s.cores()),
            zstd: self.zstd.load(Ordering::Relaxed),
        }
    }

    /// The codecs to try on the next frame: none unless compressing can pay
    /// (the link is, or was just, the bottleneck, or compressing now keeps
    /// the raw rate above what the link carries, and CPU is spare); every
    /// candidate on a probe (every [`PROBE_EVERY`]th frame, or while one is
    /// not measured yet: all of them on the same bytes, so they compare
    /// fairly); else the chooser's pick.
    fn pick(&self, st: &mut State, link_bound: bool) -> Vec<Codec> {
        let mode = self.mode();
        if mode == Mode::Off {
            return Vec::new();
        }
        let now = Instant::now();
        if link_bound {
            st.last_bound = Some(now);
        }
        let mut cond = self.conditions(st);
        if mode == Mode::Always {
            // whatever the link and CPU: the best ratio
            cond = Conditions {
                wire_rate: 1.0,
                source_cores: f64::INFINITY,
                target_cores: None,
                zstd: cond.zstd,
            };
        } else {
            let recently = st
                .last_bound
                .is_some_and(|t| now.duration_since(t) < LINK_BOUND_FOR);
            let paying = st.current != Codec::None
                && st.wire_rate > 0.0
                && st.raw_rate >= 0.9 * st.wire_rate;
            if !(recently || paying) || cond.source_cores <= 0.0 {
                return Vec::new();
            }
        }
        st.frames += 1;
        let allowed: Vec<Codec> = st
            .estimates
            .iter()
            .map(|(c, _)| *c)
            .filter(|c| cond.zstd || !matches!(c, Codec::Zstd(_)))
            .collect();
        let unmeasured = st
            .estimates
            .iter()
            .any(|(c, e)| allowed.contains(c) && e.samples == 0);
        if unmeasured || st.frames.is_multiple_of(PROBE_EVERY) {
            return allowed;
        }
        match choose(&cond, &st.estimates).0 {
            Codec::None => Vec::new(),
            c => vec![c],
        }
    }

    /// The payload to send for `raw`: compressed with the codec picked for
    /// it, if that shrinks it below [`SEND_BELOW`], else as it is.
    /// `link_bound`: frames are waiting for a carrier now.
    pub fn pack(&self, raw: Bytes, link_bound: bool) -> Packed {
        let tries = {
            let mut st = lock(&self.state);
            self.roll(&mut st);
            self.pick(&mut st, link_bound)
        };
        let raw_len = raw.len();
        // noise is tried with no codec: each would spend its CPU to find so
        let (noise, screen_ns) = if tries.is_empty() {
            (false, 0)
        } else {
            let t0 = thread_cpu_ns();
            let noise = looks_like_noise(&raw);
            (noise, thread_cpu_ns().saturating_sub(t0))
        };
        // (codec, its output if smaller, CPU ns)
        let results: Vec<(Codec, Option<Vec<u8>>, u64)> = if noise {
            Vec::new()
        } else {
            tries
                .iter()
                .map(|c| {
                    let (out, ns) = c.compress_timed(&raw);
                    (*c, out, ns)
                })
                .collect()
        };
        let mut st = lock(&self.state);
        if noise && tries.len() > 1 {
            // a probe on noise: no candidate would have shrunk it; their
            // speeds stay as last measured, on memory that did shrink
            for (_, e) in st.estimates.iter_mut().filter(|(c, _)| tries.contains(c)) {
                if e.samples > 0 {
                    let speed = e.speed;
                    e.add(1.0, speed);
                }
            }
        }
        if results.len() > 1 {
            for (codec, out, ns) in &results {
                let size = out.as_ref().map_or(raw_len, Vec::len).max(1);
                if let Some((_, e)) = st.estimates.iter_mut().find(|(c, _)| c == codec) {
                    e.add(
                        raw_len as f64 / size as f64,
                        raw_len as f64 * 1e9 / *ns as f64,
                    );
                }
            }
        }
        st.current = tries.first().copied().unwrap_or(Codec::None);
        let cpu_ns: u64 = results.iter().map(|r| r.2).sum::<u64>() + screen_ns;
        if self.mode() != Mode::Off {
            for (codec, _, ns) in &results {
                st.uses.entry(*codec).or_default().cpu_s += *ns as f64 / 1e9;
            }
            if !tries.is_empty() {
                let none = st.uses.entry(Codec::None).or_default();
                none.cpu_s += screen_ns as f64 / 1e9;
                none.screened += u64::from(noise);
            }
        }
        // the smallest output, if it is small enough
        let best = results
            .into_iter()
            .filter_map(|(c, out, _)| out.map(|o| (c, o)))
            .min_by_key(|(_, o)| o.len())
            .filter(|(_, o)| (o.len() as f64) <= raw_len as f64 * SEND_BELOW);
        if let (None, Some(first), false) = (&best, tries.first(), noise) {
            st.uses.entry(*first).or_default().misses += 1;
        }
        let (used, packed) = match best {
            Some((c, out)) => (
                c,
                Packed {
                    payload: Bytes::from(out),
                    packing: c.packing(),
                    raw_len: raw_len as u32,
                },
            ),
            None => (Codec::None, Packed::plain(raw)),
        };
        let w = &mut st.window;
        w.raw += raw_len as u64;
        w.frames += 1;
        w.cpu_ns += cpu_ns;
        if self.mode() != Mode::Off {
            let u = st.uses.entry(used).or_default();
            u.frames += 1;
            u.raw_bytes += raw_len as u64;
            u.sent_bytes += packed.payload.len() as u64;
        }
        packed
    }

    /// What the chooser weighs now and what each candidate did recently.
    pub fn estimates(&self) -> (Conditions, Vec<(Codec, Estimate)>) {
        let st = lock(&self.state);
        (self.conditions(&st), st.estimates.clone())
    }

    pub fn stats(&self) -> CompressionStats {
        let st = lock(&self.state);
        let mut s = CompressionStats::default();
        for (codec, u) in &st.uses {
            s.raw_bytes += u.raw_bytes;
            s.sent_bytes += u.sent_bytes;
            if *codec == Codec::None {
                s.frames_plain += u.frames;
            } else {
                s.frames_compressed += u.frames;
            }
        }
        s.codecs = st
            .uses
            .iter()
            .filter(|(_, u)| u.frames > 0 || u.cpu_s > 0.0)
            .map(|(codec, u)| CodecUse {
                codec: codec.name(),
                share: u.raw_bytes as f64 / s.raw_bytes.max(1) as f64,
                ratio: u.raw_bytes as f64 / u.sent_bytes.max(1) as f64,
                ..u.clone()
            })
            .collect();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lab guest's `compressible` pattern: per 4 KiB page, one 8-byte
    /// word in 64 varies, the rest repeat one byte of the page's base.
    fn compressible() -> Bytes {
        let mut out = Vec::with_capacity(65536);
        for page in 0..16u64 {
            let base = (page + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            for w in 0..512u64 {
                let v = if w % 64 != 0 {
                    (base & 0xff) * 0x0101_0101_0101_0101
                } else {
                    base.wrapping_add(w.wrapping_mul(0xD6E8_FEB8_6659_FD93))
                };
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        Bytes::from(out)
    }

    fn random() -> Bytes {
        Bytes::from(noise(65536, 0))
    }

    /// Holds the measurements fixed (no window closes during the test).
    fn force(c: &Compressor, idle: f64, wire_rate: f64) {
        let mut st = lock(&c.state);
        st.idle = idle;
        st.wire_rate = wire_rate;
        st.window.start = Instant::now() + Duration::from_secs(3600);
    }

    fn unpack(p: &Packed) -> Bytes {
        let mut h = crate::protocol::Header::new(crate::protocol::Kind::Data, 0, 1, 0);
        h.packing = p.packing;
        h.raw_len = p.raw_len;
        crate::protocol::unpack_payload(&h, p.payload.clone()).unwrap()
    }

    #[test]
    fn off_sends_as_is_and_always_compresses_what_shrinks() {
        let c = Compressor::default();
        let p = c.pack(compressible(), true);
        assert_eq!(
            (p.payload.len(), p.raw_len, p.packing),
            (65536, 0, Packing::Plain)
        );
        c.set_mode(Mode::Always);
        // a target that does not take zstd gets LZ4 only
        for _ in 0..20 {
            let p = c.pack(compressible(), false);
            assert_eq!((p.raw_len, p.packing), (65536, Packing::Lz4));
            assert!(p.payload.len() < 4096, "{}", p.payload.len());
            assert_eq!(unpack(&p), compressible());
        }
        let p = c.pack(random(), false);
        assert_eq!(
            (p.payload.len(), p.raw_len),
            (65536, 0),
            "incompressible is sent as it is"
        );
        c.set_peer_features(crate::protocol::FEATURE_ZSTD);
        let packings: Vec<Packing> = (0..40)
            .map(|_| {
                let p = c.pack(compressible(), false);
                assert_eq!(unpack(&p), compressible());
                p.packing
            })
            .collect();
        assert!(
            packings.iter().filter(|p| **p == Packing::Zstd).count() > 30,
            "zstd compresses this pattern best: {packings:?}"
        );
        let s = c.stats();
        assert_eq!(s.frames_plain, 1);
        assert_eq!(s.frames_compressed, 60);
        assert!(s.ratio() > 10.0, "{s:?}");
        let share: f64 = s.codecs.iter().map(|u| u.share).sum();
        assert!((share - 1.0).abs() < 1e-9, "{s:?}");
        assert!(s.codecs.iter().any(|u| u.codec == "none" && u.frames == 1));
        assert!(s
            .codecs
            .iter()
            .any(|u| u.codec.starts_with("zstd:") && u.cpu_s > 0.0));
    }

    #[test]
    fn adaptive_never_compresses_when_the_link_keeps_up() {
        let c = Compressor::default();
        c.set_mode(Mode::Adaptive);
        force(&c, 1.0, 0.0);
        for _ in 0..10 {
            assert_eq!(c.pack(compressible(), false).raw_len, 0);
        }
    }

    #[test]
    fn adaptive_leaves_a_busy_cpu_alone() {
        let c = Compressor::default();
        c.set_mode(Mode::Adaptive);
        force(&c, 0.05, 25e6);
        assert_eq!(c.pack(compressible(), true).raw_len, 0);
    }

    #[test]
    fn adaptive_measures_every_candidate_then_keeps_to_the_best_and_notices_a_change() {
        let c = Compressor::default();
        c.set_mode(Mode::Adaptive);
        c.set_peer_features(crate::protocol::FEATURE_ZSTD);
        // a 200 Mbit/s link, the CPU idle
        force(&c, 0.95, 25e6);
        let mut used = BTreeMap::new();
        for _ in 0..64 {
            let p = c.pack(compressible(), true);
            assert_eq!(unpack(&p), compressible());
            *used.entry(format!("{:?}", p.packing)).or_insert(0) += 1;
        }
        let (_, est) = c.estimates();
        assert!(est.iter().all(|(_, e)| e.samples > 0), "{est:?}");
        assert!(used["Zstd"] >= 56, "{used:?}");
        // the same stream turns to noise: sent as it is, still probed
        let mut plain = 0;
        for _ in 0..64 {
            plain += u32::from(c.pack(random(), true).packing == Packing::Plain);
        }
        assert_eq!(plain, 64);
        let (_, est) = c.estimates();
        assert!(est.iter().all(|(_, e)| e.ratio < 1.5), "noticed: {est:?}");
        let s = c.stats();
        assert!(
            s.codecs.iter().any(|u| u.codec == "none" && u.frames >= 60),
            "{s:?}"
        );
    }

    // Recorded on this project's lab machine (2 cores): 256 KiB frames of the
    // lab guest's memory patterns, each codec's ratio and raw bytes per
    // CPU-second. Compressible: LZ4 38.7 at 4.5 GB/s, zstd -1/1/3 50.8 at
    // 4.4/4.2/2.6 GB/s; random: ratio 1.00, LZ4 1.4 GB/s, zstd 1.4-1.6 GB/s.
    fn recorded(compressible: bool) -> Vec<(Codec, Estimate)> {
        let e = |ratio, speed| Estimate {
            ratio,
            speed,
            samples: 8,
        };
        if compressible {
            vec![
                (Codec::Lz4, e(38.7, 4.5e9)),
                (Codec::Zstd(-1), e(50.8, 4.4e9)),
                (Codec::Zstd(1), e(50.8, 4.2e9)),
                (Codec::Zstd(3), e(50.8, 2.6e9)),
            ]
        } else {
            vec![
                (Codec::Lz4, e(1.0, 1.37e9)),
                (Codec::Zstd(-1), e(1.0, 1.58e9)),
                (Codec::Zstd(1), e(1.0, 1.51e9)),
                (Codec::Zstd(3), e(1.0, 1.41e9)),
            ]
        }
    }

    fn at(wire_rate: f64, source_cores: f64, target_cores: Option<f64>) -> Conditions {
        Conditions {
            wire_rate,
            source_cores,
            target_cores,
            zstd: true,
        }
    }

    #[test]
    fn a_probe_on_memory_of_another_kind_replaces_the_estimate() {
        // a long stretch of noise: zstd gives up fast
        let mut e = Estimate::default();
        for _ in 0..20 {
            e.add(1.0, 1.4e9);
        }
        // the first probe on pages that shrink 5×, at a tenth of that speed
        e.add(5.0, 170e6);
        assert_eq!((e.ratio, e.speed), (5.0, 170e6));
        // more of the same kind: averaged
        e.add(4.0, 200e6);
        assert!(e.ratio > 4.0 && e.ratio < 5.0, "{e:?}");
        assert!(e.speed > 170e6 && e.speed < 200e6, "{e:?}");
        // so at 1 Gbit/s with half a core spare, the chooser takes the cheap
        // codec for them, not the level its averaged figures would promise
        let mut est = recorded(false);
        est[0].1 = Estimate {
            ratio: 3.0,
            speed: 1.5e9,
            samples: 30,
        };
        est[3].1 = e;
        let mut averaged = e;
        averaged.speed = 1.4e9 * 0.7 + 170e6 * 0.3;
        let c = at(125e6, 0.5, Some(1.0));
        assert_eq!(choose(&c, &est).0, Codec::Lz4);
        est[3].1 = averaged;
        assert_eq!(choose(&c, &est).0, Codec::Zstd(3), "the averaged figure");
    }

    #[test]
    fn the_chooser_sends_random_memory_as_it_is_on_any_link() {
        for link in [25e6, 125e6, 1.2e9] {
            assert_eq!(
                choose(&at(link, 1.6, Some(1.6)), &recorded(false)).0,
                Codec::None,
                "{link}"
            );
        }
    }

    #[test]
    fn the_chooser_spends_idle_cpu_on_ratio_when_the_link_is_slow() {
        // 200 Mbit/s, both hosts idle: the best ratio; of equals, the cheapest
        let (c, rate) = choose(&at(25e6, 1.6, Some(1.6)), &recorded(true));
        assert_eq!(c, Codec::Zstd(-1));
        assert!((rate - 25e6 * 50.8).abs() < 1.0);
        // a target that cannot take zstd: LZ4
        let mut old = at(25e6, 1.6, None);
        old.zstd = false;
        assert_eq!(choose(&old, &recorded(true)).0, Codec::Lz4);
        // data where a higher level earns its cost on a slow link
        let mut est = recorded(true);
        est[1].1.ratio = 3.1; // zstd:-1
        est[2].1.ratio = 3.6; // zstd:1
        est[3].1 = Estimate {
            ratio: 4.0,
            speed: 180e6,
            samples: 8,
        };
        est[0].1.ratio = 2.4;
        assert_eq!(choose(&at(25e6, 1.6, Some(1.6)), &est).0, Codec::Zstd(3));
        // at 1 Gbit/s that level would be the limit: a faster one wins
        assert_eq!(choose(&at(125e6, 1.6, Some(1.6)), &est).0, Codec::Zstd(1));
    }

    #[test]
    fn the_chooser_spends_nothing_when_the_cpu_is_the_limit() {
        let mut est = recorded(true);
        for (_, e) in &mut est {
            e.speed = 400e6;
        }
        // unshaped (10 Gbit/s), a fifth of a core spare: compressing is slower
        assert_eq!(choose(&at(1.2e9, 0.2, Some(1.6)), &est).0, Codec::None);
        // no spare CPU at all on the source, or on the target
        assert_eq!(choose(&at(25e6, 0.0, Some(1.6)), &est).0, Codec::None);
        assert_eq!(choose(&at(25e6, 1.6, Some(0.0)), &est).0, Codec::None);
        // a busy target caps the codecs that decompress slowly
        let (c, _) = choose(&at(125e6, 1.6, Some(0.1)), &est);
        assert_eq!(c, Codec::Lz4, "LZ4 decodes at twice zstd's speed");
    }

    #[test]
    fn a_sample_ratio_skips_zero_pages_and_tells_text_from_noise() {
        assert_eq!(sample_ratio(&vec![0u8; 64 << 10]), None);
        let text: Vec<u8> = b"guest page with a pattern "
            .iter()
            .cycle()
            .take(64 << 10)
            .copied()
            .collect();
        let noise = random();
        let r_text = sample_ratio(&text).unwrap();
        let r_noise = sample_ratio(&noise).unwrap();
        assert!(r_text < 0.2, "{r_text}");
        assert!(r_noise > 0.95 && r_noise <= 1.0, "{r_noise}");
        // zero pages among random ones change nothing: they are never sent
        let mut mixed = noise.to_vec();
        mixed.extend(vec![0u8; 256 << 10]);
        let r_mixed = sample_ratio(&mixed).unwrap();
        assert!((r_mixed - r_noise).abs() < 1e-9, "{r_mixed} vs {r_noise}");
    }

    /// Noise of `len` bytes (a different stream per `seed`).
    fn noise(len: usize, seed: u64) -> Vec<u8> {
        let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ seed.wrapping_mul(0xD6E8_FEB8_6659_FD93);
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect()
    }

    /// The screen takes noise for noise, and nothing that any codec here
    /// shrinks below SEND_BELOW: memory that compresses, noise with a page
    /// of zeros in four, half noise and half text, ASCII text.
    #[test]
    fn the_noise_screen_tells_noise_from_what_a_codec_shrinks() {
        const FRAME: usize = 256 << 10;
        for seed in 0..8 {
            let n = noise(FRAME, seed);
            assert!(looks_like_noise(&n), "seed {seed}");
            for c in [Codec::Lz4, Codec::Zstd(-1), Codec::Zstd(1), Codec::Zstd(3)] {
                let size = c.compress(&n).map_or(FRAME, |p| p.len());
                assert!(
                    size as f64 > FRAME as f64 * SEND_BELOW,
                    "{c:?} shrank noise"
                );
            }
        }
        let mut zero_pages = noise(FRAME, 9);
        for page in zero_pages.chunks_mut(4096).step_by(4) {
            page.fill(0);
        }
        let mut half = noise(FRAME / 2, 10);
        half.extend(compressible().iter().cycle().take(FRAME / 2));
        let text: Vec<u8> = b"the guest's kernel, its tables and its page cache "
            .iter()
            .cycle()
            .take(FRAME)
            .copied()
            .collect();
        let shrink: Vec<(&str, Vec<u8>)> = vec![
            (
                "compressible",
                compressible().iter().cycle().take(FRAME).copied().collect(),
            ),
            ("noise with a zero page in four", zero_pages),
            ("half noise, half compressible", half),
            ("text", text),
        ];
        for (what, frame) in &shrink {
            assert!(!looks_like_noise(frame), "{what} taken for noise");
            let best = Codec::Lz4.compress(frame).map_or(FRAME, |p| p.len());
            assert!(
                (best as f64) < FRAME as f64 * SEND_BELOW,
                "{what}: LZ4 shrinks it"
            );
        }
        // the smallest frame judged, and one too short to judge
        for seed in 12..20 {
            assert!(looks_like_noise(&noise(64 << 10, seed)), "seed {seed}");
        }
        assert!(!looks_like_noise(&noise(32 << 10, 11)));
    }

    /// Noise goes as it is without a codec tried on it, probes included: no
    /// codec's CPU grows and no miss is counted; a probe on it leaves every
    /// measured codec's ratio at 1 and its speed as it was. Memory that
    /// shrinks is compressed again from the next probe on.
    #[test]
    fn noise_is_sent_as_it_is_without_trying_a_codec() {
        let c = Compressor::default();
        c.set_peer_features(crate::protocol::FEATURE_ZSTD);
        c.set_mode(Mode::Always);
        let text = || {
            Bytes::from(
                compressible()
                    .iter()
                    .cycle()
                    .take(256 << 10)
                    .copied()
                    .collect::<Vec<u8>>(),
            )
        };
        for _ in 0..PROBE_EVERY {
            assert_ne!(c.pack(text(), true).packing, Packing::Plain);
        }
        let before = c.stats();
        let speeds: Vec<f64> = c.estimates().1.iter().map(|(_, e)| e.speed).collect();
        for i in 0..2 * PROBE_EVERY {
            let raw = Bytes::from(noise(256 << 10, 100 + i));
            let p = c.pack(raw.clone(), true);
            assert_eq!((p.packing, &p.payload), (Packing::Plain, &raw));
        }
        let after = c.stats();
        let cpu = |s: &CompressionStats, codec: &str| {
            s.codecs
                .iter()
                .find(|u| u.codec == codec)
                .map_or((0.0, 0, 0), |u| (u.cpu_s, u.misses, u.screened))
        };
        for codec in ["lz4", "zstd:-1", "zstd:1", "zstd:3"] {
            let (b, a) = (cpu(&before, codec), cpu(&after, codec));
            assert_eq!((a.0, a.1), (b.0, b.1), "{codec} was tried on noise");
        }
        // screened: the frames the chooser still meant to compress, until a
        // probe found noise, and the probes; after it, nothing is tried
        let screened = cpu(&after, "none").2;
        assert!((2..=PROBE_EVERY + 2).contains(&screened), "{screened}");
        for ((codec, e), speed) in c.estimates().1.iter().zip(speeds) {
            if *codec != Codec::None {
                assert_eq!((e.ratio, e.speed), (1.0, speed), "{codec:?}");
            }
        }
        // the next probe on memory that shrinks brings the codecs back
        let packed: Vec<bool> = (0..2 * PROBE_EVERY)
            .map(|_| c.pack(text(), true).packing != Packing::Plain)
            .collect();
        let first = packed.iter().position(|p| *p).expect("compressed again");
        assert!(first < PROBE_EVERY as usize, "{packed:?}");
        assert!(packed[first..].iter().all(|p| *p), "{packed:?}");
    }
}
