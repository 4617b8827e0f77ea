//! Pumps: moving one direction of a stream between QEMU's socket and the
//! MPTCP connection: toward the network by splice through a pipe (or by
//! copies); from the network by batched reads into a queue the agent holds
//! ([`pump_from_net`]).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::session::set_rcvlowat;

/// Bytes one stream may hold in the agent on their way from the network to
/// QEMU ([`pump_from_net`]). Measured: relaying 1 GiB guests over 4 multifd
/// channels, a channel's queue peaked at 44–150 MiB in most moves and at
/// 260 MiB once (12 moves); with 64 MiB, 2 moves in 16 still stalled.
pub(super) const FROM_NET_QUEUE: usize = 256 << 20;
/// Bytes read or copied per call.
const READ_BUF: usize = 256 << 10;

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
    /// From the network: the most bytes the agent held at once for QEMU.
    pub(super) queued_peak: AtomicU64,
}

/// What a stream's reader has taken from the network and QEMU has not yet:
/// buffers in order, their bytes, and whether the reader is done (the
/// network side ended or failed).
#[derive(Default)]
struct Queue {
    bufs: std::collections::VecDeque<Vec<u8>>,
    bytes: usize,
    done: Option<std::io::Result<()>>,
}

/// Moves bytes from the MPTCP connection `net` to QEMU's socket `to` until
/// `net` ends, then ends `to`'s sending side.
///
/// A reader thread takes what arrives as it arrives (in batches,
/// [`recv_batch`]) into a queue of up to `limit` bytes ([`FROM_NET_QUEUE`]); this
/// thread writes the queue to QEMU. The connection is drained while QEMU is
/// not reading, instead of its receive buffer filling. QEMU's multifd
/// target threads stop reading at each sync point until every channel has
/// reached it, and the source meanwhile hands its pages to the channels that
/// still take them, so a channel can run a long way ahead of the slowest.
/// Left to the kernel, that channel's receive window closes; with several
/// MPTCP connections over the same subflows, such a connection has been
/// seen never to reopen (Linux 6.18: the receiver holding data it dropped
/// at the MPTCP level, the sender probing a zero window with 4 KiB every
/// 200 ms). Relayed moves of a 1 GiB guest failed that way in about one in
/// five; with this queue none did in 28.
pub(super) fn pump_from_net(
    net: Arc<TcpStream>,
    to: RawFd,
    flow: &Flow,
    epoch: Instant,
    limit: usize,
) -> std::io::Result<()> {
    let ms = || epoch.elapsed().as_millis() as u64 + 1;
    let q = Arc::new((Mutex::new(Queue::default()), std::sync::Condvar::new()));
    let reader = {
        let (q, net) = (q.clone(), net.clone());
        std::thread::spawn(move || {
            let r = read_into(net.as_raw_fd(), &q, limit);
            let (m, cv) = &*q;
            lock(m).done = Some(r);
            cv.notify_all();
        })
    };
    let (m, cv) = &*q;
    let result = loop {
        let buf = {
            let mut g = lock(m);
            loop {
                if !g.bufs.is_empty() {
                    flow.queued_peak
                        .fetch_max(g.bytes as u64, Ordering::Relaxed);
                    break g.bufs.pop_front();
                }
                if g.done.is_some() {
                    break None;
                }
                g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        };
        let Some(buf) = buf else {
            break lock(m).done.take().unwrap_or(Ok(()));
        };
        flow.waiting_since.store(ms(), Ordering::Relaxed);
        if let Err(e) = write_all(to, &buf, flow, &ms) {
            // the reader may be blocked on the network: wake it
            let _ = net.shutdown(std::net::Shutdown::Read);
            break Err(e);
        }
        let mut g = lock(m);
        g.bytes -= buf.len();
        if g.bytes == 0 {
            flow.waiting_since.store(0, Ordering::Relaxed);
        }
        cv.notify_all();
    };
    {
        // a reader waiting for room must see the writer gone
        let mut g = lock(m);
        g.done.get_or_insert(Ok(()));
        cv.notify_all();
    }
    let _ = reader.join();
    result?;
    // SAFETY: shutdown on an fd the caller keeps open.
    unsafe { libc::shutdown(to, libc::SHUT_WR) };
    Ok(())
}

/// The reader of [`pump_from_net`]: batches from `fd` into the queue, while
/// it holds less than `limit` bytes, until `fd` ends or the writer is gone.
fn read_into(
    fd: RawFd,
    q: &(Mutex<Queue>, std::sync::Condvar),
    limit: usize,
) -> std::io::Result<()> {
    let (m, cv) = q;
    let batched = set_rcvlowat(fd, BATCH);
    let mut spare: Option<Vec<u8>> = None;
    loop {
        {
            let mut g = lock(m);
            while g.bytes >= limit && g.done.is_none() {
                g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            if g.done.is_some() {
                return Ok(());
            }
        }
        let mut buf = spare.take().unwrap_or_else(|| vec![0u8; READ_BUF]);
        let n = if batched {
            recv_batch(fd, &mut buf)?
        } else {
            // SAFETY: buf is valid for its length.
            cvt(unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) })?
        };
        if n == 0 {
            return Ok(());
        }
        // what the queue holds stays within twice the bytes it counts: a
        // short read is copied out and its buffer read into again
        let buf = if n < READ_BUF / 2 {
            let part = buf[..n].to_vec();
            spare = Some(buf);
            part
        } else {
            buf.truncate(n);
            buf
        };
        let mut g = lock(m);
        g.bytes += n;
        g.bufs.push_back(buf);
        cv.notify_all();
    }
}

/// Writes all of `buf` to `to`, counting progress in `flow`.
fn write_all(to: RawFd, buf: &[u8], flow: &Flow, ms: &dyn Fn() -> u64) -> std::io::Result<()> {
    let mut off = 0;
    while off < buf.len() {
        // SAFETY: the range lies inside buf.
        let m = cvt(unsafe { libc::write(to, buf[off..].as_ptr().cast(), buf.len() - off) })?;
        if m == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        off += m;
        flow.bytes.fetch_add(m as u64, Ordering::Relaxed);
        flow.waiting_since.store(ms(), Ordering::Relaxed);
    }
    Ok(())
}

/// Moves bytes from QEMU's socket `from` to the network connection `to`
/// until `from` ends, then ends `to`'s sending side. Splices through a pipe
/// when `splice_it` (copying where a kernel refuses to splice these
/// sockets); else copies.
pub(super) fn pump(
    from: RawFd,
    to: RawFd,
    flow: &Flow,
    epoch: Instant,
    splice_it: bool,
) -> std::io::Result<()> {
    let ms = || epoch.elapsed().as_millis() as u64 + 1;
    let (pr, pw) = pipe()?;
    let mut copy = !splice_it;
    let mut buf: Vec<u8> = vec![0u8; if copy { READ_BUF } else { 0 }];
    loop {
        let n = if copy {
            // SAFETY: buf is valid for its length.
            cvt(unsafe { libc::read(from, buf.as_mut_ptr().cast(), buf.len()) })?
        } else {
            match splice(from, pw.as_raw_fd(), CHUNK) {
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    copy = true;
                    buf = vec![0u8; READ_BUF];
                    continue;
                }
                r => r?,
            }
        };
        if n == 0 {
            break;
        }
        flow.waiting_since.store(ms(), Ordering::Relaxed);
        if copy {
            write_all(to, &buf[..n], flow, &ms)?;
        } else {
            let mut left = n;
            while left > 0 {
                let m = splice(pr.as_raw_fd(), to, left)?;
                if m == 0 {
                    return Err(std::io::ErrorKind::WriteZero.into());
                }
                left -= m;
                flow.bytes.fetch_add(m as u64, Ordering::Relaxed);
                flow.waiting_since.store(ms(), Ordering::Relaxed);
            }
        }
        flow.waiting_since.store(0, Ordering::Relaxed);
    }
    // SAFETY: shutdown on an fd the caller keeps open.
    unsafe { libc::shutdown(to, libc::SHUT_WR) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::os::unix::net::UnixStream;

    /// A loopback TCP pair standing for the MPTCP connection: (sender, receiver).
    fn tcp_pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").expect("a loopback listener");
        let a = TcpStream::connect(l.local_addr().expect("its address")).expect("a connection");
        let (b, _) = l.accept().expect("accepted");
        (a, b)
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 4093) as u8).collect()
    }

    #[test]
    fn from_the_network_the_queue_drains_the_connection_while_qemu_waits() {
        let (mut sender, receiver) = tcp_pair();
        let (qemu, agent_side) = UnixStream::pair().expect("a unix pair");
        let flow = Arc::new(Flow::default());
        let f = flow.clone();
        let pump = std::thread::spawn(move || {
            pump_from_net(
                Arc::new(receiver),
                agent_side.as_raw_fd(),
                &f,
                Instant::now(),
                64 << 20,
            )
        });
        // 24 MiB, far beyond the sockets' buffers, while "QEMU" reads nothing
        let data = pattern(24 << 20);
        let (done, sent) = std::sync::mpsc::channel();
        let d = data.clone();
        std::thread::spawn(move || {
            sender.write_all(&d).expect("sending");
            drop(sender);
            let _ = done.send(());
        });
        sent.recv_timeout(std::time::Duration::from_secs(20))
            .expect("the sender stayed blocked: the connection was not drained while QEMU waited");
        let mut got = Vec::new();
        (&qemu)
            .read_to_end(&mut got)
            .expect("QEMU's side reads to the end");
        pump.join()
            .expect("the pump thread")
            .expect("the pump ends cleanly");
        assert!(
            got == data,
            "bytes lost or reordered: {} of {}",
            got.len(),
            data.len()
        );
        assert_eq!(flow.bytes.load(Ordering::Relaxed), data.len() as u64);
        let peak = flow.queued_peak.load(Ordering::Relaxed);
        assert!(
            peak >= 8 << 20,
            "the queue held only {peak} bytes while QEMU waited"
        );
    }

    #[test]
    fn from_the_network_the_queue_stops_at_its_limit() {
        let (mut sender, receiver) = tcp_pair();
        sender.set_nonblocking(true).expect("non-blocking");
        let (qemu, agent_side) = UnixStream::pair().expect("a unix pair");
        let flow = Arc::new(Flow::default());
        let f = flow.clone();
        let limit = 1 << 20;
        let pump = std::thread::spawn(move || {
            pump_from_net(
                Arc::new(receiver),
                agent_side.as_raw_fd(),
                &f,
                Instant::now(),
                limit,
            )
        });
        // write until the connection pushes back: the queue stopped taking
        let data = pattern(64 << 20);
        let mut sent = 0;
        let mut idle = 0;
        while sent < data.len() && idle < 50 {
            match sender.write(&data[sent..]) {
                Ok(n) => {
                    sent += n;
                    idle = 0;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    idle += 1;
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err(e) => panic!("sending: {e}"),
            }
        }
        assert!(
            sent < data.len(),
            "all {sent} bytes taken: the queue has no limit"
        );
        sender.set_nonblocking(false).expect("blocking");
        let rest = data[sent..].to_vec();
        let writer = std::thread::spawn(move || {
            sender
                .write_all(&rest)
                .expect("the rest sent once QEMU reads");
        });
        let mut got = Vec::new();
        (&qemu)
            .read_to_end(&mut got)
            .expect("QEMU's side reads to the end");
        writer.join().expect("the writer");
        pump.join()
            .expect("the pump thread")
            .expect("the pump ends cleanly");
        assert!(got == data, "bytes lost or reordered");
        let peak = flow.queued_peak.load(Ordering::Relaxed) as usize;
        assert!(
            peak <= limit + READ_BUF,
            "the queue held {peak} bytes, over its limit {limit}"
        );
    }
}
