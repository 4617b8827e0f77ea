//! A disk: one raw file served as an NBD export.
//!
//! All connections to an export share one open file, so a flush on any of
//! them makes every completed write durable (what `CAN_MULTI_CONN` promises).
//! Durability, as the NBD spec asks:
//! - a write with FUA is written with `RWF_DSYNC`: durable before its reply;
//! - FLUSH is `fdatasync`;
//! - a write-through export is opened `O_DSYNC`: every write is durable
//!   before its reply, FUA or not.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::tracking::Tracking;

#[derive(Debug)]
pub struct Export {
    pub name: String,
    pub path: PathBuf,
    pub write_through: bool,
    file: File,
    size: AtomicU64,
    /// The file lives in memory (tmpfs): no I/O on it ever waits for a
    /// device, but tmpfs refuses `RWF_NOWAIT`, so it is read and written plainly.
    memory_backed: bool,
    /// Dirty maps and point-in-time copies: every change passes it first.
    pub tracking: Tracking,
    /// The disk lives on another node now: every change is refused (EIO).
    /// Reads and flushes are still answered, so a client can swap its
    /// connection (QEMU flushes the old one first); new ones are refused.
    retired: AtomicBool,
}

impl Export {
    /// Creates the backing file (sparse) of `size` bytes; refuses to replace one.
    pub fn create(name: &str, path: &Path, size: u64, write_through: bool) -> io::Result<Export> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        f.set_len(size)?;
        drop(f);
        Export::open(name, path, write_through)
    }

    pub fn open(name: &str, path: &Path, write_through: bool) -> io::Result<Export> {
        let mut o = std::fs::OpenOptions::new();
        o.read(true).write(true);
        if write_through {
            o.custom_flags(libc::O_DSYNC);
        }
        let file = o.open(path)?;
        let size = file.metadata()?.len();
        // SAFETY: statfs is plain data; fstatfs fills it for an fd we own.
        let memory_backed = unsafe {
            let mut st: libc::statfs = std::mem::zeroed();
            libc::fstatfs(file.as_raw_fd(), &mut st) == 0 && st.f_type == libc::TMPFS_MAGIC
        };
        Ok(Export {
            memory_backed,
            name: name.to_string(),
            path: path.to_path_buf(),
            write_through,
            file,
            size: AtomicU64::new(size),
            tracking: Tracking::default(),
            retired: AtomicBool::new(false),
        })
    }

    /// No change lands from now on. Called holding [`Tracking::freeze`],
    /// so no change is half done: each one either landed before, or sees
    /// this once it passes the gate (`Export::admit`).
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Release);
    }

    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// Readies a change of `[offset, offset + len)` ([`Tracking::before_write`]);
    /// refused once the export is retired.
    fn admit(
        &self,
        offset: u64,
        len: u64,
        may_block: bool,
    ) -> io::Result<Option<crate::tracking::WriteGuard<'_>>> {
        let g = self
            .tracking
            .before_write(&self.file, offset, len, may_block);
        if self.is_retired() {
            return Err(io::Error::other(format!(
                "disk {} is no longer served by this node (it moved)",
                self.name
            )));
        }
        Ok(g)
    }

    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    pub fn resize(&self, size: u64) -> io::Result<()> {
        self.file.set_len(size)?;
        self.size.store(size, Ordering::Release);
        Ok(())
    }

    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        // a file shrunk underneath reads as zeroes past its end
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64)? {
                0 => {
                    buf[done..].fill(0);
                    break;
                }
                n => done += n,
            }
        }
        Ok(())
    }

    pub fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        let _tracked = self.admit(offset, data.len() as u64, true)?;
        if !fua || self.write_through {
            return self.file.write_all_at(data, offset);
        }
        let mut done = 0;
        while done < data.len() {
            let rest = &data[done..];
            let iov = libc::iovec {
                iov_base: rest.as_ptr() as *mut libc::c_void,
                iov_len: rest.len(),
            };
            // SAFETY: `iov` points at `rest`, which outlives the call; the
            // kernel only reads from it.
            let n = unsafe {
                libc::pwritev2(
                    self.file.as_raw_fd(),
                    &iov,
                    1,
                    (offset + done as u64) as libc::off_t,
                    libc::RWF_DSYNC,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "pwritev2 wrote nothing",
                ));
            }
            done += n as usize;
        }
        Ok(())
    }

    /// Reads the whole range only if it needs no waiting (page cache hit,
    /// `RWF_NOWAIT`); `Ok(false)` means "do it the blocking way".
    pub fn read_nowait(&self, buf: &mut [u8], offset: u64) -> io::Result<bool> {
        if self.memory_backed && offset + buf.len() as u64 <= self.size() {
            self.read_at(buf, offset)?;
            return Ok(true);
        }
        self.rw_nowait(buf.as_mut_ptr(), buf.len(), offset, false)
    }

    /// Writes the whole range only if it needs no waiting; never for FUA or
    /// write-through (those wait for the device by definition).
    pub fn write_nowait(&self, data: &[u8], offset: u64) -> io::Result<bool> {
        if self.write_through {
            return Ok(false);
        }
        let Some(_tracked) = self.admit(offset, data.len() as u64, false)? else {
            return Ok(false);
        };
        if self.memory_backed && offset + data.len() as u64 <= self.size() {
            self.file.write_all_at(data, offset)?;
            return Ok(true);
        }
        self.rw_nowait(data.as_ptr() as *mut u8, data.len(), offset, true)
    }

    fn rw_nowait(&self, ptr: *mut u8, len: usize, offset: u64, write: bool) -> io::Result<bool> {
        if offset + len as u64 > self.size() {
            return Ok(false); // the blocking path handles a file shrunk underneath
        }

        let iov = libc::iovec {
            iov_base: ptr as *mut libc::c_void,
            iov_len: len,
        };
        let fd = self.file.as_raw_fd();
        let off = offset as libc::off_t;
        // SAFETY: `iov` describes a buffer of `len` bytes owned by the caller
        // for the duration of the call (read into for reads, read from for writes).
        let n = unsafe {
            if write {
                libc::pwritev2(fd, &iov, 1, off, libc::RWF_NOWAIT)
            } else {
                libc::preadv2(fd, &iov, 1, off, libc::RWF_NOWAIT)
            }
        };
        if n == len as isize {
            return Ok(true);
        }
        if n >= 0 {
            return Ok(false); // partial: redo it all the blocking way
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN | libc::EOPNOTSUPP | libc::EINTR) => Ok(false),
            _ => Err(e),
        }
    }

    /// The open file (for copies that read it directly).
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// Byte extents of the file that hold data (`SEEK_DATA`/`SEEK_HOLE`);
    /// where the file system cannot tell, the whole file.
    pub fn data_extents(&self) -> io::Result<Vec<(u64, u64)>> {
        let size = self.size();
        let fd = self.file.as_raw_fd();
        let mut out = Vec::new();
        let mut at = 0u64;
        while at < size {
            // SAFETY: lseek only takes integers; the fd is owned by `self.file`.
            let data = unsafe { libc::lseek(fd, at as libc::off_t, libc::SEEK_DATA) };
            if data < 0 {
                let e = io::Error::last_os_error();
                return match e.raw_os_error() {
                    Some(libc::ENXIO) => Ok(out), // nothing but a hole to the end
                    Some(libc::EINVAL | libc::EOPNOTSUPP) => Ok(vec![(0, size)]),
                    _ => Err(e),
                };
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
            if hole < 0 {
                return Err(io::Error::last_os_error());
            }
            let (s, e) = (data as u64, (hole as u64).min(size));
            if s >= e {
                break;
            }
            out.push((s, e - s));
            at = e;
        }
        Ok(out)
    }

    /// Replaces every byte with those of `src` (a copy holding `extents`,
    /// holes elsewhere) and takes its size. The caller keeps changes off.
    pub(crate) fn replace_with(
        &self,
        src: &File,
        size: u64,
        extents: &[(u64, u64)],
    ) -> io::Result<()> {
        self.file.set_len(0)?;
        self.file.set_len(size)?;
        copy_extents(src, &self.file, extents)?;
        self.file.sync_all()?;
        self.size.store(size, Ordering::Release);
        Ok(())
    }

    pub fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn fallocate(&self, mode: libc::c_int, offset: u64, len: u64) -> io::Result<()> {
        // SAFETY: fallocate only takes integers; the fd is owned by `self.file`.
        let r = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                mode,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// Discards a range (a hint: where holes cannot be punched, nothing happens).
    pub fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        let _tracked = self.admit(offset, len, true)?;
        match self.fallocate(
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset,
            len,
        ) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => return Ok(()),
            Err(e) => return Err(e),
        }
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes zeroes over a range: a punched hole unless `no_hole`, else
    /// `ZERO_RANGE`, else plain zero writes.
    pub fn write_zeroes(&self, offset: u64, len: u64, no_hole: bool, fua: bool) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        let _tracked = self.admit(offset, len, true)?;
        let keep = libc::FALLOC_FL_KEEP_SIZE;
        let tries = if no_hole {
            vec![libc::FALLOC_FL_ZERO_RANGE | keep]
        } else {
            vec![
                libc::FALLOC_FL_PUNCH_HOLE | keep,
                libc::FALLOC_FL_ZERO_RANGE | keep,
            ]
        };
        let mut done = false;
        for mode in tries {
            match self.fallocate(mode, offset, len) {
                Ok(()) => {
                    done = true;
                    break;
                }
                Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => continue,
                Err(e) => return Err(e),
            }
        }
        if !done {
            let zero = vec![0u8; (len.min(1 << 20)) as usize];
            let mut at = offset;
            while at < offset + len {
                let n = (offset + len - at).min(zero.len() as u64) as usize;
                self.file.write_all_at(&zero[..n], at)?;
                at += n as u64;
            }
        }
        if fua || self.write_through {
            self.flush()?;
        }
        Ok(())
    }
}

/// What [`copy_extents`] reads and writes at a time.
const COPY_STEP: u64 = 1 << 20;

/// Copies the extents of `src` over the same offsets of `dst`.
fn copy_extents(src: &File, dst: &File, extents: &[(u64, u64)]) -> std::io::Result<()> {
    let mut buf = vec![0u8; COPY_STEP as usize];
    for &(off, len) in extents {
        let mut at = off;
        while at < off + len {
            let n = (off + len - at).min(COPY_STEP) as usize;
            src.read_exact_at(&mut buf[..n], at)?;
            dst.write_all_at(&buf[..n], at)?;
            at += n as u64;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn write_read_trim_zero_resize() {
        let dir = std::env::temp_dir().join(format!("ferry-export-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("d.img");
        let e = Export::create("d", &p, 1 << 20, false).unwrap();
        assert!(
            Export::create("d", &p, 1 << 20, false).is_err(),
            "no silent replace"
        );
        e.write_at(&[7u8; 8192], 4096, false).unwrap();
        e.write_at(&[9u8; 100], 0, true).unwrap();
        let mut b = vec![0u8; 12288];
        e.read_at(&mut b, 0).unwrap();
        assert_eq!(&b[..100], &[9u8; 100][..]);
        assert!(b[4096..12288].iter().all(|x| *x == 7));
        e.write_zeroes(4096, 4096, false, false).unwrap();
        e.trim(8192, 4096, true).unwrap();
        e.read_at(&mut b, 0).unwrap();
        assert!(b[4096..12288].iter().all(|x| *x == 0));
        e.resize(2 << 20).unwrap();
        assert_eq!(e.size(), 2 << 20);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 2 << 20);
        let wt = Export::open("d", &p, true).unwrap();
        wt.write_at(&[1u8; 512], 0, false).unwrap();
        wt.read_at(&mut b[..512], 0).unwrap();
        assert_eq!(b[0], 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
