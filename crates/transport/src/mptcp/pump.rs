//! Pumps: moving one direction of a stream between QEMU's socket and the
//! MPTCP connection, by splice through a pipe or by batched copies.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::session::set_rcvlowat;

use super::*;

pub(super) fn cvt(r: isize) -> std::io::Result<usize> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

pub(super) fn splice(from: RawFd, to: RawFd, len: usize) -> std::io::Result<usize> {
    loop {
        // SAFETY: plain fds, no offsets.
        let r = unsafe {
            libc::splice(
                from,
                std::ptr::null_mut(),
                to,
                std::ptr::null_mut(),
                len,
                libc::SPLICE_F_MOVE | libc::SPLICE_F_MORE,
            )
        };
        match cvt(r) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// Waits up to `ms` (-1: for ever) for `fd` to read as ready.
pub(super) fn poll_in(fd: RawFd, ms: i32) -> std::io::Result<()> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: one pollfd, valid for the call.
        match cvt(unsafe { libc::poll(&mut p, 1, ms) } as isize) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            r => return r.map(|_| ()),
        }
    }
}

/// Reads what `fd` has now; `None` when it has nothing.
pub(super) fn recv_now(fd: RawFd, buf: &mut [u8]) -> std::io::Result<Option<usize>> {
    loop {
        // SAFETY: buf is valid for its length.
        let r = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        match cvt(r) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
            r => return r.map(Some),
        }
    }
}

/// Reads from a connection in batches: once [`BATCH`] bytes are queued or
/// [`BATCH_WAIT_MS`] passed; with nothing queued then, for its next byte
/// (the low-water mark lowered meanwhile, so that byte is read at once).
pub(super) fn recv_batch(fd: RawFd, buf: &mut [u8]) -> std::io::Result<usize> {
    poll_in(fd, BATCH_WAIT_MS)?;
    loop {
        if let Some(n) = recv_now(fd, buf)? {
            return Ok(n);
        }
        if !set_rcvlowat(fd, 1) {
            return Err(std::io::Error::last_os_error());
        }
        poll_in(fd, -1)?;
        let n = recv_now(fd, buf)?;
        if !set_rcvlowat(fd, BATCH) {
            return Err(std::io::Error::last_os_error());
        }
        if let Some(n) = n {
            return Ok(n);
        }
    }
}

pub(super) fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: fds has room for two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both are fresh descriptors this function owns.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // a bigger pipe means fewer calls; the default size works too
    // SAFETY: fcntl on an fd we own.
    unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, CHUNK as libc::c_int) };
    Ok((r, w))
}

/// One direction of a stream, as the session watches it.
#[derive(Default)]
pub(super) struct Flow {
    pub(super) bytes: AtomicU64,
    /// While bytes wait to be sent: ms (since the session started) of the
    /// last progress; 0 when nothing waits.
    pub(super) waiting_since: AtomicU64,
}

/// Moves bytes from `from` to `to` until `from` ends, then ends `to`'s
/// sending side. Splices through a pipe when `splice_it` (copying where a
/// kernel refuses to splice these sockets); else copies, and `from_net`
/// reads in batches ([`recv_batch`]).
pub(super) fn pump(
    from: RawFd,
    to: RawFd,
    flow: &Flow,
    epoch: Instant,
    splice_it: bool,
    from_net: bool,
) -> std::io::Result<()> {
    let ms = || epoch.elapsed().as_millis() as u64 + 1;
    let (pr, pw) = pipe()?;
    let mut copy = !splice_it;
    let mut buf: Vec<u8> = vec![0u8; if copy { 256 << 10 } else { 0 }];
    // from the network, copying: in batches where the socket takes a low-water mark
    let batched = copy && from_net && set_rcvlowat(from, BATCH);
    loop {
        let n = if batched {
            recv_batch(from, &mut buf)?
        } else if copy {
            // SAFETY: buf is valid for its length.
            cvt(unsafe { libc::read(from, buf.as_mut_ptr().cast(), buf.len()) })?
        } else {
            match splice(from, pw.as_raw_fd(), CHUNK) {
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    copy = true;
                    buf = vec![0u8; 256 << 10];
                    continue;
                }
                r => r?,
            }
        };
        if n == 0 {
            break;
        }
        flow.waiting_since.store(ms(), Ordering::Relaxed);
        let mut left = n;
        while left > 0 {
            let m = if copy {
                let off = n - left;
                // SAFETY: the range lies inside buf.
                cvt(unsafe { libc::write(to, buf[off..].as_ptr().cast(), left) })?
            } else {
                splice(pr.as_raw_fd(), to, left)?
            };
            if m == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            left -= m;
            flow.bytes.fetch_add(m as u64, Ordering::Relaxed);
            flow.waiting_since.store(ms(), Ordering::Relaxed);
        }
        flow.waiting_since.store(0, Ordering::Relaxed);
    }
    // SAFETY: shutdown on an fd the caller keeps open.
    unsafe { libc::shutdown(to, libc::SHUT_WR) };
    Ok(())
}
