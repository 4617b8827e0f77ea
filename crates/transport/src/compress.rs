//! Compression that only uses idle CPU, and only when it wins.
//!
//! The source compresses a DATA frame (LZ4 block, [`crate::protocol::FLAG_LZ4`])
//! when all of these hold at that moment:
//! - the link is the bottleneck: frames are queued waiting for a carrier
//!   (when carriers keep up, compressing only adds latency and CPU);
//! - the host's CPU is idle enough: at least [`MIN_IDLE`] of it over the
//!   last quarter second (`/proc/stat`), so compression never takes CPU
//!   from the guests or QEMU;
//! - the data compresses: a frame that shrinks by less than 10% is sent as
//!   it is, and the next [`SKIP_AFTER_MISS`] frames of that stream are not
//!   even tried (one in 8 keeps probing, so a stream that becomes
//!   compressible is noticed; each stream keeps its own count, so QEMU's
//!   main channel does not hold back its multifd channels).
//!
//! `Always` compresses every frame that shrinks, whatever the link and CPU
//! (for tests and measurements).

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// Idle CPU share needed to compress.
pub const MIN_IDLE: f64 = 0.2;
/// Frames of the same stream sent plain, untried, after one that did not compress.
pub const SKIP_AFTER_MISS: u32 = 7;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Off,
    Adaptive,
    Always,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompressionStats {
    /// Payload bytes offered to the compressor (uncompressed).
    pub raw_bytes: u64,
    /// What was sent for them.
    pub sent_bytes: u64,
    pub frames_compressed: u64,
    pub frames_plain: u64,
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
/// plain: LZ4 over 64 KiB blocks of its non-zero 4 KiB pages (QEMU sends a
/// zero page as a flag, never its bytes). `None` when every page is zero.
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
        packed += lz4_flex::block::compress(&bytes).len().min(bytes.len());
    }
    Some(packed as f64 / raw as f64)
}

/// Idle share of all CPUs over `over`, from `/proc/stat`.
pub fn idle_share(over: Duration) -> Option<f64> {
    let a = cpu_times()?;
    std::thread::sleep(over);
    let b = cpu_times()?;
    let total = b.1.saturating_sub(a.1);
    (total > 0).then(|| b.0.saturating_sub(a.0) as f64 / total as f64)
}

/// Idle share of all CPUs since the previous sample (at most every 250 ms).
struct CpuIdle {
    last: Mutex<(Instant, u64, u64, f64)>,
}

/// `(idle, total)` CPU time of all CPUs since boot, in clock ticks (`/proc/stat`).
pub(crate) fn cpu_times() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    let line = s.lines().next()?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal
    let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
    Some((idle, v.iter().take(8).sum()))
}

impl CpuIdle {
    fn new() -> CpuIdle {
        let (i, t) = cpu_times().unwrap_or((0, 0));
        CpuIdle {
            last: Mutex::new((Instant::now(), i, t, 0.0)),
        }
    }

    fn idle(&self) -> f64 {
        let mut l = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if l.0.elapsed() >= Duration::from_millis(250) {
            if let Some((i, t)) = cpu_times() {
                let (di, dt) = (i.saturating_sub(l.1), t.saturating_sub(l.2));
                let frac = if dt == 0 { l.3 } else { di as f64 / dt as f64 };
                *l = (Instant::now(), i, t, frac);
            }
        }
        l.3
    }
}

pub struct Compressor {
    mode: AtomicU8,
    cpu: CpuIdle,
    raw_bytes: AtomicU64,
    sent_bytes: AtomicU64,
    frames_compressed: AtomicU64,
    frames_plain: AtomicU64,
}

impl Default for Compressor {
    fn default() -> Self {
        Compressor {
            mode: AtomicU8::new(0),
            cpu: CpuIdle::new(),
            raw_bytes: AtomicU64::new(0),
            sent_bytes: AtomicU64::new(0),
            frames_compressed: AtomicU64::new(0),
            frames_plain: AtomicU64::new(0),
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

    /// The payload to send for `raw` and its raw length if compressed (else
    /// 0). `skip` is the stream's own count of frames left untried.
    pub fn pack(&self, raw: Bytes, link_bound: bool, skip: &mut u32) -> (Bytes, u32) {
        let mode = self.mode();
        let tried = match mode {
            Mode::Off => false,
            Mode::Always => true,
            Mode::Adaptive => {
                link_bound && {
                    if *skip > 0 {
                        *skip -= 1;
                        false
                    } else {
                        self.cpu.idle() >= MIN_IDLE
                    }
                }
            }
        };
        if mode != Mode::Off {
            self.raw_bytes
                .fetch_add(raw.len() as u64, Ordering::Relaxed);
        }
        let out = if tried {
            let packed = lz4_flex::block::compress(&raw);
            if packed.len() * 10 < raw.len() * 9 {
                Some((Bytes::from(packed), raw.len() as u32))
            } else {
                if mode == Mode::Adaptive {
                    *skip = SKIP_AFTER_MISS;
                }
                None
            }
        } else {
            None
        };
        let (payload, raw_len) = out.unwrap_or((raw, 0));
        if mode != Mode::Off {
            self.sent_bytes
                .fetch_add(payload.len() as u64, Ordering::Relaxed);
            if raw_len > 0 {
                self.frames_compressed.fetch_add(1, Ordering::Relaxed);
            } else {
                self.frames_plain.fetch_add(1, Ordering::Relaxed);
            }
        }
        (payload, raw_len)
    }

    pub fn stats(&self) -> CompressionStats {
        CompressionStats {
            raw_bytes: self.raw_bytes.load(Ordering::Relaxed),
            sent_bytes: self.sent_bytes.load(Ordering::Relaxed),
            frames_compressed: self.frames_compressed.load(Ordering::Relaxed),
            frames_plain: self.frames_plain.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compressible() -> Bytes {
        Bytes::from((0..65536u32).map(|i| (i % 13) as u8).collect::<Vec<_>>())
    }

    fn random() -> Bytes {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        Bytes::from(
            (0..65536)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect::<Vec<_>>(),
        )
    }

    #[test]
    fn off_sends_as_is_and_always_compresses_what_shrinks() {
        let c = Compressor::default();
        let mut skip = 0;
        let (p, raw) = c.pack(compressible(), true, &mut skip);
        assert_eq!((p.len(), raw), (65536, 0));
        c.set_mode(Mode::Always);
        let (p, raw) = c.pack(compressible(), false, &mut skip);
        assert_eq!(raw, 65536);
        assert!(p.len() < 4096, "{}", p.len());
        let (p, raw) = c.pack(random(), false, &mut skip);
        assert_eq!(
            (p.len(), raw),
            (65536, 0),
            "incompressible is sent as it is"
        );
        let s = c.stats();
        assert_eq!((s.frames_compressed, s.frames_plain), (1, 1));
        assert!(s.ratio() > 1.5);
    }

    #[test]
    fn adaptive_never_compresses_when_the_link_keeps_up() {
        let c = Compressor::default();
        let mut skip = 0;
        c.set_mode(Mode::Adaptive);
        for _ in 0..10 {
            assert_eq!(c.pack(compressible(), false, &mut skip).1, 0);
        }
    }

    #[test]
    fn adaptive_backs_off_after_a_miss_and_probes_again() {
        let c = Compressor::default();
        let mut skip = 0;
        c.set_mode(Mode::Adaptive);
        // force "idle" so only the data decides
        *c.cpu.last.lock().unwrap() = (Instant::now(), 0, 0, 1.0);
        assert_eq!(c.pack(random(), true, &mut skip).1, 0);
        // the next SKIP_AFTER_MISS frames are not tried, even compressible ones
        for _ in 0..SKIP_AFTER_MISS {
            assert_eq!(c.pack(compressible(), true, &mut skip).1, 0);
        }
        assert_eq!(c.pack(compressible(), true, &mut skip).1, 65536);
    }

    #[test]
    fn adaptive_leaves_a_busy_cpu_alone() {
        let c = Compressor::default();
        let mut skip = 0;
        c.set_mode(Mode::Adaptive);
        *c.cpu.last.lock().unwrap() = (Instant::now(), 0, 0, 0.05);
        assert_eq!(c.pack(compressible(), true, &mut skip).1, 0);
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
}
