//! What splicing saves: one process carries streams over an MPTCP session on
//! loopback (source and target side, as two agents would), splicing toward
//! the network or copying (from the network it always copies, in batches,
//! into the agent's queue), and prints the process's CPU seconds per GiB for each. The unix sockets at
//! both ends stand for the two QEMUs.
//!
//!     cargo run --release -p ferry-transport --example splice_gain [GiB]

#![allow(clippy::unwrap_used)] // a measurement: a panic is its failure report

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Instant;

use ferry_transport::mptcp::{set_splice, Deliver, Spliced};

fn cpu_seconds() -> f64 {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: u is a valid rusage to fill.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// Moves `bytes` over `streams` streams; returns (CPU s, wall s).
fn run(splice_out: bool, bytes: u64, streams: u64) -> (f64, f64) {
    set_splice(splice_out);
    let dir = std::env::temp_dir().join(format!("ferry-splice-{}", rand_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    let qemu_in = dir.join("in.sock");
    let l = UnixListener::bind(&qemu_in).unwrap();
    let lo: IpAddr = "127.0.0.1".parse().unwrap();
    let nics = vec![("lo".to_string(), lo)];
    let secret = b"splice gain measurement credential";
    let session = [5u8; 16];
    let (t, port) =
        Spliced::target(session, secret, nics.clone(), Deliver::Relay(qemu_in)).unwrap();
    let out = dir.join("out.sock");
    let s = Spliced::source(
        session,
        secret,
        out.clone(),
        lo,
        SocketAddr::new(lo, port),
        nics,
    )
    .unwrap();
    let per = bytes / streams;
    let sink = std::thread::spawn(move || {
        let mut hs = Vec::new();
        for _ in 0..streams {
            let (mut c, _) = l.accept().unwrap();
            hs.push(std::thread::spawn(move || {
                let mut buf = vec![0u8; 1 << 20];
                let mut n = 0u64;
                loop {
                    let k = c.read(&mut buf).unwrap();
                    if k == 0 {
                        break n;
                    }
                    n += k as u64;
                }
            }));
        }
        hs.into_iter().map(|h| h.join().unwrap()).sum::<u64>()
    });
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    let senders: Vec<_> = (0..streams)
        .map(|_| {
            let out = out.clone();
            std::thread::spawn(move || {
                let mut c = UnixStream::connect(&out).unwrap();
                let buf = vec![0x5au8; 1 << 20];
                let mut left = per;
                while left > 0 {
                    let n = left.min(buf.len() as u64) as usize;
                    c.write_all(&buf[..n]).unwrap();
                    left -= n as u64;
                }
                c.shutdown(std::net::Shutdown::Write).unwrap();
            })
        })
        .collect();
    for h in senders {
        h.join().unwrap();
    }
    let got = sink.join().unwrap();
    assert_eq!(got, per * streams, "bytes lost");
    let r = (cpu_seconds() - cpu0, t0.elapsed().as_secs_f64());
    s.close();
    t.close();
    let _ = std::fs::remove_dir_all(&dir);
    r
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

fn main() {
    let gib: f64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(4.0);
    let bytes = (gib * (1u64 << 30) as f64) as u64;
    println!("| path | CPU s/GiB (whole process: both agents' pumps, the kernel's TCP/MPTCP on loopback, the stand-in QEMUs) | GiB/s |");
    println!("|---|---|---|");
    let modes = [
        (false, "copied both ways (from the network in batches)"),
        (true, "spliced toward the network (default), copied from it"),
    ];
    let mut rows = Vec::new();
    // twice each, interleaved, so drift affects every mode alike
    for _ in 0..2 {
        for (m, _) in modes {
            let (cpu, wall) = run(m, bytes, 4);
            rows.push((m, cpu / gib, gib / wall));
        }
    }
    for (m, label) in modes {
        let r: Vec<_> = rows.iter().filter(|r| r.0 == m).collect();
        let cpu = r.iter().map(|r| r.1).sum::<f64>() / r.len() as f64;
        let rate = r.iter().map(|r| r.2).sum::<f64>() / r.len() as f64;
        println!("| {label} | {cpu:.2} | {rate:.2} |");
    }
}
