//! Shared-nothing live migration, in the lab (needs root and QEMU; see
//! `common`): a workload guest whose 1 GiB qcow2 drive is a file of its
//! host's own, writing to it all along. Its move to host2 with the target
//! agent killed mid-mirror leaves guest and disk intact on host1 and, once
//! that agent is back, nothing on host2; so does its move with the source
//! agent killed mid-mirror, once that one is back; its move with one of two NICs cut
//! mid-mirror completes, and the copy on host2 holds every byte written
//! before the move and every write the guest acknowledged.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// Slow enough that the disks' copy lasts seconds.
const RATE: &str = "200mbit";
const VM: &str = "sn1";
/// The workload guest's seed when none is given (its journal's slot).
const SEED: u64 = 1;
/// Pattern regions written before the guest starts: (offset MiB, byte).
const REGIONS: [(u64, u8); 12] = [
    (64, 0x41),
    (120, 0x42),
    (200, 0x43),
    (280, 0x44),
    (360, 0x45),
    (440, 0x46),
    (520, 0x47),
    (600, 0x48),
    (680, 0x49),
    (760, 0x4a),
    (840, 0x4b),
    (1000, 0x4c),
];
const REGION_MIB: u64 = 16;

fn disk_on(host: &str) -> PathBuf {
    Path::new(LAB)
        .join(host)
        .join("disks")
        .join(VM)
        .join("data.qcow2")
}

/// `qemu-io` on `file`; a read shares the image with the QEMU that has it.
fn qemu_io(file: &Path, cmd: &str) -> String {
    let shared: &[&str] = if cmd.starts_with("read") {
        &["-U", "-r"]
    } else {
        &[]
    };
    let out = Command::new("qemu-io")
        .args(shared)
        .args(["-f", "qcow2", "-c", cmd])
        .arg(file)
        .output()
        .expect("qemu-io (qemu-utils)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "qemu-io {cmd} {}: {text}",
        file.display()
    );
    text
}

/// Every pattern region of `file` reads back as written.
fn assert_regions(file: &Path) {
    for (mib, byte) in REGIONS {
        let text = qemu_io(file, &format!("read -P {byte} {mib}M {REGION_MIB}M"));
        assert!(
            !text.contains("verification failed"),
            "{} at {mib} MiB: {text}",
            file.display()
        );
    }
}

/// The guest's last reported write sequence and error count on `host`
/// (waiting for its first report there).
fn last_disk_seq(host: &str) -> (u64, u64) {
    let t0 = Instant::now();
    loop {
        if let Some(r) = disk_report(host) {
            return r;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "{VM} on {host} reported no disk write"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn disk_report(host: &str) -> Option<(u64, u64)> {
    let dir = Path::new(LAB).join(host).join("vms");
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        if n != VM && !n.starts_with(&format!("{VM}.")) {
            continue;
        }
        let p = e.path().join("console.log");
        if let Ok(m) = std::fs::metadata(&p).and_then(|m| m.modified()) {
            if best.as_ref().is_none_or(|(t, _)| m > *t) {
                best = Some((m, p));
            }
        }
    }
    let text = std::fs::read_to_string(best?.1).ok()?;
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with("FERRY-DISK dev=vda "))?;
    let field = |k: &str| -> u64 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .and_then(|v| v.parse().ok())
            .unwrap()
    };
    Some((field("seq"), field("errors")))
}

/// Reads the guest's journal ring from the image on `host` (converted to
/// raw while the guest runs on): each of the last 32 writes up to `seq` is
/// there, intact (or a later write in its ring position).
fn assert_journal(host: &str, seq: u64) {
    let raw = std::env::temp_dir().join(format!("ferry-{VM}-journal.raw"));
    for tries in 0.. {
        let _ = std::fs::remove_file(&raw);
        let out = Command::new("qemu-img")
            .args(["convert", "-U", "-f", "qcow2", "-O", "raw"])
            .arg(disk_on(host))
            .arg(&raw)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let ring = journal_ring(&std::fs::read(&raw).unwrap(), SEED);
        let missing = ring_missing(&ring, seq);
        let _ = std::fs::remove_file(&raw);
        if missing.is_empty() {
            return;
        }
        // a block being rewritten as it was read: read again
        assert!(
            tries < 4,
            "acknowledged writes missing on {host}: {missing:?} (ring {ring:?})"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn disks_copied(ev: &Value, at_least: u64) -> bool {
    ev["phase"] == "disks" && ev["transferred"].as_u64().unwrap_or(0) >= at_least
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn a_vm_on_local_disks_moves_through_a_lost_target_and_a_cut_nic() {
    require_lab();
    let _g = serial();
    lab_at(2, 2, RATE);
    remove_vm(VM);
    for h in ["host1", "host2"] {
        let _ = std::fs::remove_dir_all(disk_on(h).parent().unwrap());
    }
    // the drive exists before the VM: 1 GiB qcow2, 192 MiB of it written
    let file = disk_on("host1");
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    let out = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&file)
        .arg("1G")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (mib, byte) in REGIONS {
        qemu_io(&file, &format!("write -P {byte} {mib}M {REGION_MIB}M"));
    }
    ferry_ok(&[
        "vm",
        "create",
        VM,
        "--host",
        "host1",
        "--memory",
        "384M",
        "--fill",
        "128M",
        "--dirty-rate",
        "2M",
        "--drive",
        "local=data.qcow2,format=qcow2",
    ]);
    let _vm = VmGuard(VM);
    // a drive named but absent, with no size to make it, is refused naming it
    let out = ferry(&[
        "vm",
        "create",
        "sn-missing",
        "--host",
        "host1",
        "--memory",
        "256M",
        "--drive",
        "local=none.qcow2,format=qcow2",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("drives[0].local") && err.contains("give a size"),
        "{err}"
    );
    let t0 = Instant::now();
    while last_disk_seq("host1").0 < 4 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the guest does not write its disk"
        );
        std::thread::sleep(Duration::from_millis(250));
    }

    // 1. the target agent killed mid-mirror: the move fails, the guest runs
    // on host1 on its own disk; once host2's agent is back, it keeps nothing
    let last = move_when(
        VM,
        "host2",
        "multichannel",
        |ev| disks_copied(ev, 32 << 20),
        || kill_agent("host2"),
    );
    assert_eq!(last["event"], "failed", "{last}");
    let msg = last.to_string();
    assert!(
        msg.contains("disks"),
        "the failure names the disks' step: {msg}"
    );
    assert_intact_on(VM, "host1");
    assert_regions(&file);
    let (seq, errors) = last_disk_seq("host1");
    assert_eq!(errors, 0);
    assert_journal("host1", seq);
    restart_agent_with("host2", "");
    let t1 = Instant::now();
    while !qemu_pids("host2").is_empty() || disk_on("host2").exists() {
        assert!(
            t1.elapsed() < Duration::from_secs(30),
            "host2 kept its skeleton {:?} or its partial copy ({})",
            qemu_pids("host2"),
            disk_on("host2").exists()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(file.exists(), "the source's drive must stay");

    // 2. the source agent killed mid-mirror: once it is back, the guest runs
    // on host1 on its own drive (the mirror it left is removed: the next
    // move adds one of the same name), and host2 learns the move was
    // aborted and drops its skeleton and partial copy
    let _ = move_when(
        VM,
        "host2",
        "multichannel",
        |ev| disks_copied(ev, 32 << 20),
        || kill_agent("host1"),
    );
    restart_agent_with("host1", "");
    let t2 = Instant::now();
    loop {
        let c = check(VM);
        if c["host"] == "host1"
            && c["intact"] == true
            && c["advancing"] == true
            && qemu_pids("host2").is_empty()
            && !disk_on("host2").exists()
        {
            break;
        }
        assert!(
            t2.elapsed() < Duration::from_secs(60),
            "{VM} did not settle on host1: {c}; QEMUs on host2 {:?}; copy on host2: {}",
            qemu_pids("host2"),
            disk_on("host2").exists()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_regions(&file);

    // 3. one of two NICs cut mid-mirror: the copy goes on over the other,
    // the move completes, the drive lives on host2 alone
    let cut = nic("host1", 2);
    let last = move_when(
        VM,
        "host2",
        "multichannel",
        |ev| disks_copied(ev, 32 << 20),
        || {
            ferry_ok(&["lab", "link", "host1", &cut, "down"]);
        },
    );
    ferry_ok(&["lab", "link", "host1", &cut, "up"]);
    assert_eq!(last["event"], "completed", "{last}");
    let r = &last;
    let disks = r["disks"].as_array().unwrap();
    assert_eq!(disks.len(), 1, "{r}");
    assert_eq!(disks[0]["size"], 1u64 << 30, "{r}");
    let per_nic = r["disk_nic_tx_bytes"].as_object().unwrap();
    assert!(
        per_nic.values().all(|b| b.as_u64().unwrap() > 0),
        "the disks' copy used both NICs before the cut: {r}"
    );
    // the memory's own bytes are counted apart
    assert!(r["bytes_transferred"].as_u64().unwrap() < 384 << 20, "{r}");
    let (seq, errors) = last_disk_seq("host2");
    assert_eq!(errors, 0);
    assert_journal("host2", seq);
    assert_regions(&disk_on("host2"));
    assert_intact_on(VM, "host2");
    assert!(
        !file.exists(),
        "host1's copy goes once the guest runs on host2"
    );
}
