//! Write tracking on an export: which parts of a disk changed since a point
//! (dirty maps), and point-in-time copies of a disk that guests keep writing
//! (copy-before-write).
//!
//! Every change to an export — WRITE, TRIM, WRITE_ZEROES, from any connection
//! — first passes [`Tracking::before_write`], which
//! 1. marks the range in every dirty map, and
//! 2. for every point-in-time copy still running, preserves the range's old
//!    contents in the copy (once per [`GRANULE`]) before the write may land;
//!
//! and holds a read side of the *gate* until the change is in the file. A
//! copy starts ([`Tracking::start_copy`]) holding the gate's write side: no
//! change is half done at its instant, so the copy is exactly the disk at
//! that instant — what a crash at that instant would have left (crash
//! consistent). A background copier ([`PointInTime::copy_next`]) then takes
//! each granule still pending; the granule lock makes "preserve, then write"
//! and "copy" exclude each other.
//!
//! Dirty maps are in memory only: after a restart of the node nothing is
//! known of what changed, and whoever needs one (an incremental backup)
//! starts again from a full copy.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

/// The unit of tracking and copying: 64 KiB.
pub const GRANULE: u64 = 64 << 10;

/// One bit per granule.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bitmap {
    words: Vec<u64>,
}

impl Bitmap {
    /// Every granule of the first `size` bytes set.
    pub fn full(size: u64) -> Bitmap {
        let mut b = Bitmap::default();
        b.set_range(0, size);
        b
    }

    pub fn get(&self, g: u64) -> bool {
        let (w, bit) = ((g / 64) as usize, g % 64);
        self.words.get(w).is_some_and(|x| x & (1 << bit) != 0)
    }

    pub fn set(&mut self, g: u64) {
        let (w, bit) = ((g / 64) as usize, g % 64);
        if w >= self.words.len() {
            self.words.resize(w + 1, 0);
        }
        self.words[w] |= 1 << bit;
    }

    pub fn clear(&mut self, g: u64) {
        let (w, bit) = ((g / 64) as usize, g % 64);
        if let Some(x) = self.words.get_mut(w) {
            *x &= !(1 << bit);
        }
    }

    /// Sets every granule that `[offset, offset + len)` touches.
    pub fn set_range(&mut self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        for g in offset / GRANULE..(offset + len).div_ceil(GRANULE) {
            self.set(g);
        }
    }

    /// Whether any granule `[offset, offset + len)` touches is set.
    pub fn any_in(&self, offset: u64, len: u64) -> bool {
        len > 0 && (offset / GRANULE..(offset + len).div_ceil(GRANULE)).any(|g| self.get(g))
    }

    pub fn union(&mut self, other: &Bitmap) {
        if other.words.len() > self.words.len() {
            self.words.resize(other.words.len(), 0);
        }
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a |= b;
        }
    }

    /// Only the granules also set in `other`.
    pub fn intersect(&mut self, other: &Bitmap) {
        for (i, a) in self.words.iter_mut().enumerate() {
            *a &= other.words.get(i).copied().unwrap_or(0);
        }
    }

    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// The first set granule at or after `from`.
    pub fn next_set(&self, from: u64) -> Option<u64> {
        let mut w = (from / 64) as usize;
        let mut mask = !0u64 << (from % 64);
        while w < self.words.len() {
            let x = self.words[w] & mask;
            if x != 0 {
                return Some(w as u64 * 64 + u64::from(x.trailing_zeros()));
            }
            w += 1;
            mask = !0;
        }
        None
    }

    /// Runs of set granules as byte extents `(offset, len)`, the last one cut at `size`.
    pub fn extents(&self, size: u64) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        let mut g = 0;
        while let Some(s) = self.next_set(g) {
            let mut e = s + 1;
            while self.get(e) {
                e += 1;
            }
            let (off, end) = (s * GRANULE, (e * GRANULE).min(size));
            if off < end {
                out.push((off, end - off));
            }
            g = e;
        }
        out
    }
}

/// Where a point-in-time copy puts the disk's bytes: at the same offsets.
pub trait Sink: Send + Sync {
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()>;
}

impl Sink for File {
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.write_all_at(data, offset)
    }
}

#[derive(Debug, Default)]
struct Progress {
    /// Granules of the instant not yet in the sink.
    pending: Bitmap,
    /// Bytes put in the sink (by the copier or before a write).
    copied: u64,
    /// Bytes preserved because a write came first.
    preserved: u64,
    failed: Option<String>,
}

/// A copy of (part of) a disk as it was at one instant.
pub struct PointInTime {
    /// The disk's size at the instant.
    pub size: u64,
    /// What is copied: byte extents of the instant's pending granules.
    pub extents: Vec<(u64, u64)>,
    pub total: u64,
    sink: Box<dyn Sink>,
    progress: Mutex<Progress>,
}

/// How far a copy is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyStatus {
    pub total: u64,
    pub copied: u64,
    pub preserved: u64,
}

impl PointInTime {
    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        ferry_api::util::lock(&self.progress)
    }

    pub fn status(&self) -> CopyStatus {
        let p = self.progress();
        CopyStatus {
            total: self.total,
            copied: p.copied,
            preserved: p.preserved,
        }
    }

    /// Copies granule `g` (holding the progress lock) from `src`.
    fn take(&self, p: &mut Progress, src: &File, g: u64, buf: &mut Vec<u8>) -> io::Result<u64> {
        let off = g * GRANULE;
        let n = GRANULE.min(self.size.saturating_sub(off)) as usize;
        buf.resize(n, 0);
        read_full(src, buf, off)?;
        self.sink.write_at(buf, off)?;
        p.pending.clear(g);
        p.copied += n as u64;
        Ok(n as u64)
    }

    /// Preserves the instant's contents of `[offset, offset + len)` before
    /// a write changes them. An error fails the copy, never the write.
    fn preserve(&self, src: &File, offset: u64, len: u64) {
        let mut p = self.progress();
        if p.failed.is_some() || !p.pending.any_in(offset, len) {
            return;
        }
        let mut buf = Vec::new();
        for g in offset / GRANULE..(offset + len).div_ceil(GRANULE) {
            if !p.pending.get(g) {
                continue;
            }
            match self.take(&mut p, src, g, &mut buf) {
                Ok(n) => p.preserved += n,
                Err(e) => {
                    p.failed = Some(format!("copying before a write at {}: {e}", g * GRANULE));
                    return;
                }
            }
        }
    }

    fn needs(&self, offset: u64, len: u64) -> bool {
        let p = self.progress();
        p.failed.is_none() && p.pending.any_in(offset, len)
    }

    /// Copies up to `max` bytes of what is still pending; `Ok(0)` when done.
    pub fn copy_next(&self, src: &File, max: u64) -> Result<u64, String> {
        let mut p = self.progress();
        if let Some(e) = &p.failed {
            return Err(e.clone());
        }
        let mut done = 0;
        let mut buf = Vec::new();
        let mut from = 0;
        while done < max.max(1) {
            let Some(g) = p.pending.next_set(from) else {
                break;
            };
            match self.take(&mut p, src, g, &mut buf) {
                Ok(n) => done += n,
                Err(e) => {
                    let msg = format!("copying {}: {e}", g * GRANULE);
                    p.failed = Some(msg.clone());
                    return Err(msg);
                }
            }
            from = g + 1;
        }
        Ok(done)
    }
}

fn read_full(f: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], offset + done as u64)? {
            0 => {
                buf[done..].fill(0);
                break;
            }
            n => done += n,
        }
    }
    Ok(())
}

#[derive(Default)]
struct Inner {
    dirty: BTreeMap<String, Bitmap>,
    copies: Vec<Arc<PointInTime>>,
}

/// The tracking state of one export.
#[derive(Default)]
pub struct Tracking {
    gate: RwLock<()>,
    inner: Mutex<Inner>,
    /// Whether there is any dirty map or copy (else a write skips `inner`).
    active: AtomicBool,
}

impl std::fmt::Debug for Tracking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.inner();
        f.debug_struct("Tracking")
            .field("dirty", &inner.dirty.keys().collect::<Vec<_>>())
            .field("copies", &inner.copies.len())
            .finish()
    }
}

/// Held from [`Tracking::before_write`] until the change is in the file.
pub struct WriteGuard<'a> {
    _gate: RwLockReadGuard<'a, ()>,
}

/// What a new copy takes at its instant.
pub enum Take<'a> {
    /// The granules this finds at the instant (e.g. the allocated parts of
    /// the disk: found while no change is under way).
    Granules(&'a dyn Fn() -> Result<Bitmap, String>),
    /// The granules marked in dirty map `name` (which then starts empty
    /// again); refused when the map does not exist.
    ChangedSince(&'a str),
}

/// A copy just started.
pub struct Started {
    pub copy: Arc<PointInTime>,
    /// The dirty map `reset` named, as it was before the copy started
    /// (`None`: it did not exist); to give back if the copy fails.
    pub previous: Option<Bitmap>,
}

impl Tracking {
    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        ferry_api::util::lock(&self.inner)
    }

    /// Readies `[offset, offset + len)` of `src` for a change. `None` only
    /// when `may_block` is false and old contents must first be copied (or
    /// a copy is starting): then do it the blocking way.
    pub fn before_write(
        &self,
        src: &File,
        offset: u64,
        len: u64,
        may_block: bool,
    ) -> Option<WriteGuard<'_>> {
        let gate = if may_block {
            self.gate.read().unwrap_or_else(|e| e.into_inner())
        } else {
            self.gate.try_read().ok()?
        };
        // set under the gate's write side, so seen by every later reader
        if !self.active.load(Ordering::Acquire) {
            return Some(WriteGuard { _gate: gate });
        }
        let copies = {
            let mut inner = self.inner();
            for m in inner.dirty.values_mut() {
                m.set_range(offset, len);
            }
            if inner.copies.is_empty() {
                return Some(WriteGuard { _gate: gate });
            }
            inner.copies.clone()
        };
        for c in &copies {
            if c.needs(offset, len) {
                if !may_block {
                    return None;
                }
                c.preserve(src, offset, len);
            }
        }
        Some(WriteGuard { _gate: gate })
    }

    /// Starts a point-in-time copy of `src` (of `size` bytes) into `sink`.
    /// With `reset`, dirty map `reset` starts empty at the same instant.
    pub fn start_copy(
        &self,
        size: u64,
        take: Take<'_>,
        reset: Option<&str>,
        sink: Box<dyn Sink>,
    ) -> Result<Started, String> {
        let _frozen = self.gate.write().unwrap_or_else(|e| e.into_inner());
        let mut inner = self.inner();
        let mut pending = match take {
            Take::Granules(find) => find()?,
            Take::ChangedSince(name) => inner
                .dirty
                .get(name)
                .cloned()
                .ok_or_else(|| format!("no change tracking for '{name}'"))?,
        };
        pending.intersect(&Bitmap::full(size));
        let previous = match reset {
            Some(name) => inner.dirty.insert(name.to_string(), Bitmap::default()),
            None => None,
        };
        let extents = pending.extents(size);
        let copy = Arc::new(PointInTime {
            size,
            total: extents.iter().map(|e| e.1).sum(),
            extents,
            sink,
            progress: Mutex::new(Progress {
                pending,
                ..Progress::default()
            }),
        });
        inner.copies.push(copy.clone());
        self.active.store(true, Ordering::Release);
        Ok(Started { copy, previous })
    }

    /// A copy ended (done or failed): writes no longer wait for it.
    pub fn finish_copy(&self, copy: &Arc<PointInTime>) {
        let mut inner = self.inner();
        inner.copies.retain(|c| !Arc::ptr_eq(c, copy));
        if inner.copies.is_empty() && inner.dirty.is_empty() {
            self.active.store(false, Ordering::Release);
        }
    }

    /// Gives back what a failed copy took from dirty map `name`: the
    /// changes it should have carried are still to be carried.
    pub fn restore_dirty(&self, name: &str, previous: Option<Bitmap>) {
        let mut inner = self.inner();
        match previous {
            None => {
                inner.dirty.remove(name);
            }
            Some(mut p) => {
                if let Some(now) = inner.dirty.get(name) {
                    p.union(now);
                }
                inner.dirty.insert(name.to_string(), p);
                self.active.store(true, Ordering::Release);
            }
        }
    }

    /// Starts dirty map `name`, empty (replacing one of that name): every
    /// change from now on marks it.
    pub fn start_map(&self, name: &str) {
        // under the gate: no change is half done without marking it
        let _frozen = self.gate.write().unwrap_or_else(|e| e.into_inner());
        let mut inner = self.inner();
        inner.dirty.insert(name.to_string(), Bitmap::default());
        self.active.store(true, Ordering::Release);
    }

    /// Takes what dirty map `name` marks, leaving it empty: a change after
    /// this marks it again. A change marks the map before it lands, so a
    /// range read after this holds every change the taken map marked.
    pub fn take_map(&self, name: &str) -> Option<Bitmap> {
        let mut inner = self.inner();
        inner.dirty.get_mut(name).map(std::mem::take)
    }

    /// Ends dirty map `name`.
    pub fn end_map(&self, name: &str) {
        let mut inner = self.inner();
        inner.dirty.remove(name);
        if inner.copies.is_empty() && inner.dirty.is_empty() {
            self.active.store(false, Ordering::Release);
        }
    }

    /// Marks the whole disk changed in every dirty map (its contents were replaced).
    pub fn all_changed(&self, size: u64) {
        for m in self.inner().dirty.values_mut() {
            m.set_range(0, size);
        }
    }

    /// Whether dirty map `name` exists, and how many bytes it marks.
    pub fn dirty_bytes(&self, name: &str) -> Option<u64> {
        self.inner().dirty.get(name).map(|b| b.count() * GRANULE)
    }

    /// Waits for every change in progress, and holds new ones off while
    /// the guard lives (contents replaced under no connection, say).
    pub fn freeze(&self) -> std::sync::RwLockWriteGuard<'_, ()> {
        self.gate.write().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn bitmap_ranges_runs_and_sets() {
        let mut b = Bitmap::default();
        b.set_range(GRANULE - 1, 2); // touches granules 0 and 1
        b.set_range(10 * GRANULE, GRANULE); // exactly granule 10
        assert!(b.get(0) && b.get(1) && !b.get(2) && b.get(10) && !b.get(11));
        assert_eq!(b.count(), 3);
        assert_eq!(b.next_set(2), Some(10));
        assert_eq!(b.next_set(11), None);
        assert_eq!(
            b.extents(10 * GRANULE + 100),
            vec![(0, 2 * GRANULE), (10 * GRANULE, 100)]
        );
        let mut c = Bitmap::full(3 * GRANULE);
        c.intersect(&b);
        assert_eq!(c.extents(u64::MAX), vec![(0, 2 * GRANULE)]);
        c.union(&b);
        assert_eq!(c, b);
        assert!(!b.any_in(2 * GRANULE, 8 * GRANULE));
        assert!(b.any_in(2 * GRANULE, 8 * GRANULE + 1));
        assert!(!b.any_in(0, 0));
    }

    struct Mem(Mutex<Vec<u8>>);
    impl Sink for Arc<Mem> {
        fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
            let mut v = self.0.lock().unwrap();
            v[offset as usize..offset as usize + data.len()].copy_from_slice(data);
            Ok(())
        }
    }

    fn tmpfile(bytes: &[u8]) -> File {
        let p = std::env::temp_dir().join(format!(
            "ferry-tracking-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::write(&p, bytes).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        std::fs::remove_file(&p).unwrap();
        f
    }

    /// Writes `byte` over granule `g` the way an export does.
    fn write(t: &Tracking, f: &File, g: u64, byte: u8) {
        let _w = t.before_write(f, g * GRANULE, GRANULE, true).unwrap();
        f.write_all_at(&vec![byte; GRANULE as usize], g * GRANULE)
            .unwrap();
    }

    #[test]
    fn a_copy_is_the_instant_whatever_is_written_after() {
        let size = 8 * GRANULE;
        let f = tmpfile(&vec![1u8; size as usize]);
        let t = Tracking::default();
        let mem = Arc::new(Mem(Mutex::new(vec![0; size as usize])));
        let s = t
            .start_copy(
                size,
                Take::Granules(&|| Ok(Bitmap::full(size))),
                Some("backup"),
                Box::new(mem.clone()),
            )
            .unwrap();
        assert_eq!(s.previous, None);
        // writes land on granules 3 and 5 before the copier gets to them
        write(&t, &f, 3, 2);
        write(&t, &f, 5, 2);
        write(&t, &f, 3, 3); // a second write is not preserved again
        assert_eq!(s.copy.status().preserved, 2 * GRANULE);
        while s.copy.copy_next(&f, 3 * GRANULE).unwrap() > 0 {
            write(&t, &f, 7, 4);
        }
        t.finish_copy(&s.copy);
        assert_eq!(s.copy.status().copied, size);
        assert!(mem.0.lock().unwrap().iter().all(|b| *b == 1));
        // the dirty map holds what changed since the instant
        assert_eq!(t.dirty_bytes("backup"), Some(3 * GRANULE));
        // and an incremental copy takes just that
        let mem2 = Arc::new(Mem(Mutex::new(vec![0; size as usize])));
        let s2 = t
            .start_copy(
                size,
                Take::ChangedSince("backup"),
                Some("backup"),
                Box::new(mem2.clone()),
            )
            .unwrap();
        assert_eq!(
            s2.copy.extents,
            vec![
                (3 * GRANULE, GRANULE),
                (5 * GRANULE, GRANULE),
                (7 * GRANULE, GRANULE)
            ]
        );
        while s2.copy.copy_next(&f, u64::MAX).unwrap() > 0 {}
        t.finish_copy(&s2.copy);
        let m = mem2.0.lock().unwrap();
        assert_eq!(m[(3 * GRANULE) as usize], 3);
        assert_eq!(m[(7 * GRANULE) as usize], 4);
        assert_eq!(m[0], 0, "unchanged granules are not copied");
        assert_eq!(t.dirty_bytes("backup"), Some(0));
        // a failed copy gives its changes back, with those made meanwhile
        write(&t, &f, 0, 5);
        t.restore_dirty("backup", s2.previous);
        assert_eq!(t.dirty_bytes("backup"), Some(4 * GRANULE));
        assert!(t
            .start_copy(
                size,
                Take::ChangedSince("other"),
                None,
                Box::new(mem.clone())
            )
            .is_err());
    }

    #[test]
    fn the_inline_path_steps_aside_when_old_contents_must_be_kept() {
        let f = tmpfile(&[0u8; 2 * GRANULE as usize]);
        let t = Tracking::default();
        assert!(t.before_write(&f, 0, 512, false).is_some());
        let mem = Arc::new(Mem(Mutex::new(vec![0; 2 * GRANULE as usize])));
        let s = t
            .start_copy(
                2 * GRANULE,
                Take::Granules(&|| Ok(Bitmap::full(GRANULE))),
                None,
                Box::new(mem),
            )
            .unwrap();
        assert!(t.before_write(&f, 0, 512, false).is_none());
        assert!(t.before_write(&f, GRANULE, 512, false).is_some());
        t.finish_copy(&s.copy);
        assert!(t.before_write(&f, 0, 512, false).is_some());
    }
}
