//! A session on the relays' runtime: once a process sets one
//! (`relay::set_runtime`, as the agent does), a session's carriers and
//! streams run there, so bytes flow while the runtime that started the
//! session is not polled at all. Its own test binary, since the runtime is
//! set once per process. No privileges.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Duration;

use ferry_transport::{relay, Keys, Session};

const LO: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

#[test]
fn a_session_carries_bytes_on_the_relays_runtime_while_its_callers_runtime_sleeps() {
    let relays = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("relay-test")
        .enable_all()
        .build()
        .unwrap();
    assert!(relay::set_runtime(relays.handle().clone()));
    assert!(
        !relay::set_runtime(relays.handle().clone()),
        "a second runtime is refused: the first stays"
    );
    let dir = tempfile::tempdir().unwrap();
    let (qemu_sock, src_sock) = (dir.path().join("qemu.sock"), dir.path().join("src.sock"));
    // the target's QEMU, a plain thread
    let qemu = UnixListener::bind(&qemu_sock).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (mut u, _) = qemu.accept().unwrap();
        let mut got = Vec::new();
        u.read_to_end(&mut got).unwrap();
        tx.send(got).unwrap();
    });
    let keys = Keys {
        secret: b"0123456789abcdef0123456789abcdef",
        sealed: true,
    };
    // the caller: a one-thread runtime, polled only inside block_on
    let caller = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (source, target) = caller.block_on(async {
        let nics = vec![("nic1".to_string(), LO), ("nic2".to_string(), LO)];
        let (target, bound) = Session::target([3; 16], &keys, nics, qemu_sock)
            .await
            .unwrap();
        let dial = bound.into_iter().map(|(nic, a)| (nic, LO, a)).collect();
        let source = Session::source([3; 16], &keys, src_sock.clone(), dial)
            .await
            .unwrap();
        (source, target)
    });
    // from here on the caller's runtime is never polled again: only the
    // relays' runtime can accept, dial, seal, carry and deliver
    let data: Vec<u8> = (0..4u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let sent = data.clone();
    std::thread::spawn(move || {
        let mut u = UnixStream::connect(&src_sock).unwrap();
        u.write_all(&sent).unwrap();
        u.shutdown(std::net::Shutdown::Write).unwrap();
    });
    let got = rx
        .recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|e| {
            panic!(
                "the stream never arrived ({e}): source {:?}, target {:?}",
                source.stats(),
                target.stats()
            )
        });
    assert_eq!(got.len(), data.len(), "length");
    assert!(got == data, "bytes differ");
    assert!(
        source.stats().carriers.iter().all(|c| c.up),
        "{:?}",
        source.stats()
    );
    source.close();
    target.close();
}
