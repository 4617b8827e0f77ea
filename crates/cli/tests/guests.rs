//! Users' own VMs in the lab: the Debian guest (built from Debian packages,
//! booted by SeaBIOS from a Ferry storage disk over NBD, its address from a
//! cloud-init seed, a NIC on the guests' bridge, the guest agent) moves host1 → host2 → host1 while a client outside the
//! hosts keeps one TCP connection to it; a move to a host that lacks the
//! bridge, a disk path or the CPU model is refused before anything starts.
//! The same disk also boots from OVMF (UEFI) and moves, its variable store
//! with it.
//!
//! Needs root, QEMU ≥ 9, iproute2, ovmf and mmdebstrap (it builds the Debian guest
//! if it is not cached); `#[ignore]`d, run by `scripts/run test` and CI.

#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;

const GUEST_ADDR: &str = "198.19.250.100";
const ECHO_PORT: u16 = 7000;
const UEFI_ADDR: &str = "198.19.250.101";
const SHARED: &str = "/run/ferry/lab/shared";

/// Connects to `addr` from inside network namespace `ns` (the socket keeps
/// the namespace it was made in; the thread that made it ends).
fn connect_in(ns: &str, addr: &str, port: u16, within: Duration) -> TcpStream {
    let (ns, addr) = (ns.to_string(), addr.to_string());
    std::thread::spawn(move || {
        let f = std::fs::File::open(format!("/run/netns/{ns}")).unwrap();
        // SAFETY: setns on this thread only, with a namespace fd we hold open.
        let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns into {ns}");
        let deadline = Instant::now() + within;
        loop {
            let sa = format!("{addr}:{port}").parse().unwrap();
            match TcpStream::connect_timeout(&sa, Duration::from_secs(2)) {
                Ok(s) => return s,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(250));
                }
                Err(e) => panic!("cannot reach {addr}:{port} from {ns}: {e}"),
            }
        }
    })
    .join()
    .unwrap()
}

/// A client holding one TCP connection to the guest's echo service: it
/// sends a counter every 100 ms and reads each one back.
struct EchoClient {
    stop: Arc<AtomicBool>,
    sent: Arc<Mutex<u64>>,
    /// (counters echoed in order, longest gap between two echoes, error)
    reader: std::thread::JoinHandle<(Vec<u64>, Duration, Option<String>)>,
    writer: std::thread::JoinHandle<Option<String>>,
}

impl EchoClient {
    fn start(s: TcpStream) -> EchoClient {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(Mutex::new(0u64));
        let mut w = s.try_clone().unwrap();
        let (stop2, sent2) = (stop.clone(), sent.clone());
        let writer = std::thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                let mut n = sent2.lock().unwrap();
                if let Err(e) = w.write_all(format!("{}\n", *n).as_bytes()) {
                    return Some(format!("write: {e}"));
                }
                *n += 1;
                drop(n);
                std::thread::sleep(Duration::from_millis(100));
            }
            None
        });
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let stop3 = stop.clone();
        let reader = std::thread::spawn(move || {
            let mut r = BufReader::new(s);
            let mut got = Vec::new();
            let mut gap = Duration::ZERO;
            let mut last = Instant::now();
            let mut line = String::new();
            loop {
                line.clear();
                match r.read_line(&mut line) {
                    Ok(0) => return (got, gap, Some("the connection closed".into())),
                    Ok(_) => {
                        gap = gap.max(last.elapsed());
                        last = Instant::now();
                        got.push(line.trim().parse().unwrap_or(u64::MAX));
                    }
                    Err(e) if stop3.load(Ordering::Relaxed) => {
                        let _ = e;
                        return (got, gap, None);
                    }
                    Err(e) => return (got, gap, Some(format!("read: {e}"))),
                }
            }
        });
        EchoClient {
            stop,
            sent,
            reader,
            writer,
        }
    }

    /// Stops sending, waits for the last echoes, and checks the stream:
    /// every counter back, in order, no error. Returns the longest gap.
    fn finish(self) -> Duration {
        self.stop.store(true, Ordering::Relaxed);
        let werr = self.writer.join().unwrap();
        let sent = *self.sent.lock().unwrap();
        let (got, gap, rerr) = self.reader.join().unwrap();
        assert_eq!(werr, None, "the client's writes failed");
        let expected: Vec<u64> = (0..sent).collect();
        assert!(
            got.len() as u64 == sent && got == expected,
            "sent {sent} counters, {} came back (first missing or out of order: {:?}); reader: {rerr:?}",
            got.len(),
            got.iter().zip(0..).find(|(g, i)| **g != *i)
        );
        gap
    }
}

/// The VM's directory on `host` (a moved-in VM keeps its `NAME.in-ID`).
fn vm_dir(host: &str, name: &str) -> PathBuf {
    let vms = Path::new(LAB).join(host).join("vms");
    let found: Vec<PathBuf> = std::fs::read_dir(&vms)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| {
                    let f = p.file_name().unwrap().to_string_lossy().into_owned();
                    f == name || f.starts_with(&format!("{name}.in-"))
                })
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(found.len(), 1, "{name}'s directory on {host}: {found:?}");
    found.into_iter().next().unwrap()
}

/// Runs `sh -c SCRIPT` in the guest through its guest agent, waiting for
/// the agent as long as a boot may take (the first boot's 180 s: a reset
/// or a start boots the guest again, under TCG).
fn guest_sh(host: &str, vm: &str, script: &str) -> String {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let sock = vm_dir(host, vm).join(ferry_agent::qemu::QGA_SOCK);
    rt.block_on(async {
        let mut a = ferry_agent::qga::Qga::connect(&sock, Duration::from_secs(180))
            .await
            .unwrap_or_else(|e| panic!("guest agent of {vm} on {host}: {e}"));
        let out = a
            .exec("/bin/sh", &["-c", script], Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(
            out.exit_code,
            0,
            "`{script}` in {vm}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    })
}

fn debian_image() -> PathBuf {
    let out = ferry_ok(&["lab", "image", "--debian"]);
    let dir = out
        .lines()
        .find_map(|l| l.strip_prefix("debian guest: "))
        .and_then(|l| l.split(" (").next())
        .map(PathBuf::from)
        .expect("lab image printed the Debian guest's directory");
    dir.join("disk.img")
}

/// A Debian guest's spec: `firmware` boots the Debian disk `disk`; its
/// address comes from the cloud-init seed; one NIC on the guests' bridge;
/// optionally a data disk on the shared path.
fn spec_file(
    vm: &str,
    firmware: &str,
    disk: &str,
    mac: &str,
    addr: &str,
    data: Option<&Path>,
) -> PathBuf {
    let p = std::env::temp_dir().join(format!("ferry-test-{vm}.toml"));
    let data = data
        .map(|d| format!("[[drives]]\npath = \"{}\"\n", d.display()))
        .unwrap_or_default();
    std::fs::write(
        &p,
        format!(
            r##"memory = "512M"
cpu = "qemu64"
firmware = "{firmware}"
guest_agent = true

[[drives]]
disk = "{disk}"

{data}
[[nics]]
bridge = "br-guest"
mac = "{mac}"

[cloud_init]
meta_data = "instance-id: {vm}\n"
user_data = "#cloud-config\n"
network_config = """
version: 2
ethernets:
  nic0:
    match:
      macaddress: "{mac}"
    addresses: [{addr}/24]
"""
"##
        ),
    )
    .unwrap();
    p
}

/// A refused move: fails naming `what`, leaves the guest running where it
/// was and nothing of it on `to`.
fn assert_refused(vm: &str, from: &str, to: &str, what: &str) {
    let out = ferry(&["vm", "move", vm, "--to", to, "--option", "multichannel"]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "the move to {to} was not refused");
    assert!(
        text.contains(&format!("cannot run VM {vm}")) && text.contains(what),
        "the refusal does not name {what}: {text}"
    );
    assert!(
        std::fs::read_dir(Path::new(LAB).join(to).join("vms"))
            .map(|d| d
                .flatten()
                .all(|e| !e.file_name().to_string_lossy().starts_with(vm)))
            .unwrap_or(true),
        "something of {vm} was started on {to}"
    );
    let entries = vm_entries(vm);
    assert!(
        entries.len() == 1 && entries[0]["host"] == from && entries[0]["state"] == "running",
        "{vm} is not running on {from} alone: {entries:?}"
    );
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9, iproute2, mmdebstrap; run with --include-ignored"]
fn a_debian_guest_moves_with_its_tcp_connection_alive() {
    require_lab();
    let _g = serial();
    lab_at(3, 2, "500mbit");
    let disk = debian_image();
    let _ = ferry(&["vm", "rm", "deb1"]);
    let _ = ferry(&["disk", "rm", "deb-root"]);
    ferry_ok(&["disk", "import", "deb-root", &disk.display().to_string()]);
    std::fs::create_dir_all(SHARED).unwrap();
    let data = Path::new(SHARED).join("deb1-data.img");
    let st = Command::new("qemu-img")
        .args(["create", "-q", "-f", "raw"])
        .arg(&data)
        .arg("64M")
        .status()
        .unwrap();
    assert!(st.success());
    let spec = spec_file(
        "deb1",
        "bios",
        "deb-root",
        "52:54:00:fe:00:01",
        GUEST_ADDR,
        Some(&data),
    );

    // boot: until the echo service answers from outside the hosts
    let t = Instant::now();
    let vm: serde_json::Value = serde_json::from_str(&ferry_ok(&[
        "vm",
        "create",
        "deb1",
        "--host",
        "host1",
        "--spec",
        &spec.display().to_string(),
        "--json",
    ]))
    .unwrap();
    let _vm = VmGuard("deb1");
    assert_eq!(
        vm["spec"]["drives"][0]["nbd"],
        "nbd://198.18.0.1:10809/deb-root/deb1"
    );
    let conn = connect_in(
        "ferry-client",
        GUEST_ADDR,
        ECHO_PORT,
        Duration::from_secs(180),
    );
    let accel = vm["accel"].as_str().unwrap().to_string();
    eprintln!(
        "BOOT debian guest under {accel}: echo service answered {:.1} s after create",
        t.elapsed().as_secs_f64()
    );
    let client = EchoClient::start(conn);

    // the same connection across two moves, a file written before each read after it
    for (n, (to, option)) in [("host2", "multichannel"), ("host1", "auto")]
        .iter()
        .enumerate()
    {
        let from = if *to == "host2" { "host1" } else { "host2" };
        let mark = format!("mark-{n}-{}", std::process::id());
        guest_sh(
            from,
            "deb1",
            &format!("echo {mark} > /root/mark{n} && sync"),
        );
        let r = move_vm("deb1", to, option);
        assert_eq!(r["event"], "completed", "move to {to}: {r}");
        assert_eq!(
            (r["from"].as_str(), r["to"].as_str()),
            (Some(from), Some(*to))
        );
        eprintln!(
            "MOVE debian guest {from}->{to} ({option}): total {} ms, downtime {} ms, {} bytes",
            r["total_ms"], r["downtime_ms"], r["bytes_transferred"]
        );
        let c = check("deb1");
        assert_eq!(c["host"], *to);
        assert_eq!(c["guest_agent"], true, "guest agent on {to}: {c}");
        assert!(c["vcpu_ms"].as_u64().unwrap() > 0, "{c}");
        assert_eq!(
            guest_sh(to, "deb1", &format!("cat /root/mark{n}")).trim(),
            mark
        );
    }

    // moves that cannot finish never start
    let bridge = |args: &[&str]| {
        let st = Command::new("ip")
            .args(["netns", "exec", "host3", "ip", "link"])
            .args(args)
            .status()
            .unwrap();
        assert!(st.success());
    };
    bridge(&["del", "br-guest"]);
    assert_refused("deb1", "host1", "host3", "bridge br-guest");
    bridge(&["add", "br-guest", "type", "bridge"]);

    let local = Path::new(LAB).join("host3").join("agent.local.toml");
    std::fs::write(&local, "cpu_models = [\"max\"]\n").unwrap();
    restart_agent_with("host3", "");
    let refused = std::panic::catch_unwind(|| {
        assert_refused(
            "deb1",
            "host1",
            "host3",
            "CPU model qemu64 (this host offers only max)",
        )
    });
    std::fs::remove_file(&local).unwrap();
    restart_agent_with("host3", "");
    refused.unwrap();

    let moved = data.with_extension("away");
    std::fs::rename(&data, &moved).unwrap();
    let refused = std::panic::catch_unwind(|| {
        assert_refused(
            "deb1",
            "host1",
            "host2",
            &format!("disk path {}", data.display()),
        )
    });
    std::fs::rename(&moved, &data).unwrap();
    refused.unwrap();

    // a second writer of the shared path is refused by QEMU's image locking
    let out = ferry(&[
        "vm",
        "create",
        "deb2",
        "--host",
        "host2",
        "--memory",
        "256M",
        "--firmware",
        "bios",
        "--drive",
        &format!("path={}", data.display()),
    ]);
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && text.contains("lock"), "{text}");

    let gap = client.finish();
    eprintln!(
        "TCP debian guest: one connection through 2 moves and 3 refusals, longest gap {} ms",
        gap.as_millis()
    );
    assert!(gap < Duration::from_secs(2), "longest gap {gap:?}");
    assert_intact_on("deb1", "host1");

    // its lifecycle: a reset (the guest boots again), a shutdown its guest
    // agent carries out, a start on the same host, a stop
    let uptime = || {
        guest_sh("host1", "deb1", "cut -d. -f1 /proc/uptime")
            .trim()
            .parse::<u64>()
            .unwrap()
    };
    let before = uptime();
    ferry_ok(&["vm", "reboot", "deb1"]);
    let after = uptime();
    assert!(
        after < before,
        "uptime {after} s after the reset, {before} s before"
    );
    // the guest shuts itself down at its agent's request (QEMU logs the
    // guest's shutdown); QEMU is stopped when the timeout ends
    let r = ferry_json(&["vm", "shutdown", "deb1", "--timeout", "30"]);
    assert_eq!(r["via"], "guest-agent", "{r}");
    let log = std::fs::read_to_string(format!("{LAB}/host1/log/deb1.stopped.qemu.log")).unwrap();
    assert!(
        log.contains("reason 11 (shutdown)"),
        "{r}: the guest did not shut down:\n{}",
        &log[log.len().saturating_sub(2000)..]
    );
    let listed = ferry_json(&["vm", "list"]);
    let v = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "deb1")
        .unwrap();
    assert_eq!(v["state"], "stopped", "{v}");
    assert_eq!(v["desired"], "stopped", "{v}");
    ferry_ok(&["vm", "start", "deb1"]);
    guest_sh("host1", "deb1", "true");
    let r = ferry_json(&["vm", "stop", "deb1"]);
    assert_eq!(r["how"], "stopped", "{r}");
    drop(_vm);
    ferry_ok(&["disk", "rm", "deb-root"]);
    let _ = std::fs::remove_file(&data);
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9, iproute2, mmdebstrap, ovmf; run with --include-ignored"]
fn a_uefi_debian_guest_boots_from_ovmf_and_moves() {
    require_lab();
    let _g = serial();
    lab_at(3, 2, "500mbit");
    let disk = debian_image();
    let _ = ferry(&["vm", "rm", "uefi1"]);
    let _ = ferry(&["disk", "rm", "uefi-root"]);
    ferry_ok(&["disk", "import", "uefi-root", &disk.display().to_string()]);
    let spec = spec_file(
        "uefi1",
        "uefi",
        "uefi-root",
        "52:54:00:fe:00:02",
        UEFI_ADDR,
        None,
    );

    let t = Instant::now();
    ferry_ok(&[
        "vm",
        "create",
        "uefi1",
        "--host",
        "host1",
        "--spec",
        &spec.display().to_string(),
    ]);
    let _vm = VmGuard("uefi1");
    let conn = connect_in(
        "ferry-client",
        UEFI_ADDR,
        ECHO_PORT,
        Duration::from_secs(240),
    );
    eprintln!(
        "BOOT debian guest from OVMF: echo service answered {:.1} s after create",
        t.elapsed().as_secs_f64()
    );
    let client = EchoClient::start(conn);
    // the guest itself says it was started by UEFI firmware
    let efi = "test -d /sys/firmware/efi && cat /sys/firmware/efi/fw_platform_size";
    assert_eq!(guest_sh("host1", "uefi1", efi).trim(), "64");
    // the firmware's variable store is the VM's own copy, on each host
    assert!(vm_dir("host1", "uefi1")
        .join(ferry_agent::qemu::OVMF_VARS)
        .is_file());

    let r = move_vm("uefi1", "host2", "multichannel");
    assert_eq!(r["event"], "completed", "{r}");
    eprintln!(
        "MOVE uefi guest host1->host2: total {} ms, downtime {} ms, {} bytes",
        r["total_ms"], r["downtime_ms"], r["bytes_transferred"]
    );
    let c = check("uefi1");
    assert_eq!(c["host"], "host2");
    assert_eq!(c["guest_agent"], true, "guest agent on host2: {c}");
    assert_eq!(guest_sh("host2", "uefi1", efi).trim(), "64");
    assert!(vm_dir("host2", "uefi1")
        .join(ferry_agent::qemu::OVMF_VARS)
        .is_file());
    let gap = client.finish();
    eprintln!("TCP uefi guest: longest gap {} ms", gap.as_millis());
    assert!(gap < Duration::from_secs(2), "longest gap {gap:?}");
    assert_intact_on("uefi1", "host2");
    drop(_vm);
    ferry_ok(&["disk", "rm", "uefi-root"]);
}
