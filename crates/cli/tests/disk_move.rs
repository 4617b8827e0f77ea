//! Disks that change storage node under running guests, in the lab (needs
//! root and QEMU; see `common`), with two storage nodes:
//! - `ferry disk move` of a disk shared by two guests on two hosts, both
//!   writing: nothing lost, the QoS flows continue on the new node;
//! - a replica, and its failover with the primary's node killed: the
//!   replica holds every write older than its reported lag.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const LAB: &str = "/run/ferry/lab";

fn disk_file(node: &str, disk: &str) -> std::path::PathBuf {
    std::path::Path::new(LAB)
        .join(node)
        .join("disks")
        .join(format!("{disk}.img"))
}

/// 1 MiB regions of a recognisable pattern, at every 2 MiB of `len` bytes.
fn pattern(len: usize) -> Vec<(usize, Vec<u8>)> {
    (0..len / (2 << 20))
        .skip(5) // the guests' slots and journal rings live in the first 8.5 MiB
        .map(|k| {
            let off = k * (2 << 20);
            let data = (0..1 << 20)
                .map(|i| ((i as u64 * 2654435761 + k as u64 * 97) >> 7) as u8)
                .collect();
            (off, data)
        })
        .collect()
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn a_shared_disk_moves_between_storage_nodes_under_two_writing_guests() {
    require_lab();
    let _g = serial();
    lab_with(2, 1, "1gbit", 2);
    let disk = "moving";
    let _ = ferry(&["disk", "rm", disk]);
    let (s1, s2) = (21u64, 22u64);
    for (vm, host, seed) in [("mv1", "host1", s1), ("mv2", "host2", s2)] {
        remove_vm(vm);
        ferry_ok(&[
            "vm",
            "create",
            vm,
            "--host",
            host,
            "--memory",
            "256M",
            "--fill",
            "64M",
            "--seed",
            &seed.to_string(),
        ]);
    }
    let (_a, _b) = (VmGuard("mv1"), VmGuard("mv2"));
    ferry_ok(&["disk", "create", disk, "--size", "128M"]);
    // data the guests never touch, written before anyone opens the disk
    let regions = pattern(128 << 20);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(disk_file("storage1", disk))
            .unwrap();
        for (off, d) in &regions {
            f.write_all_at(d, *off as u64).unwrap();
        }
    }
    let _ = ferry(&["qos", "policy", "rm", "move-cap"]);
    ferry_ok(&[
        "qos",
        "policy",
        "new",
        "move-cap",
        "--type",
        "dedicated",
        "--max-iops",
        "4000",
    ]);
    ferry_ok(&["disk", "set", disk, "--policy", "move-cap"]);
    ferry_ok(&["disk", "attach", disk, "mv1"]);
    ferry_ok(&["disk", "attach", disk, "mv2"]);
    let before = wait_for_peer("host1", "mv1", s2, 0);
    wait_for_peer("host2", "mv2", s1, 0);

    // bad requests name what is wrong
    let out = ferry(&["disk", "move", disk, "--to", "storage9"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success() && err.contains("storage9"), "{err}");
    let out = ferry(&["disk", "move", disk, "--to", "storage1"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success() && err.contains("already"), "{err}");

    // the move, both guests writing throughout
    let out = ferry_ok(&["disk", "move", disk, "--to", "storage2", "--json"]);
    let last: Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(last["phase"], "done", "{out}");
    assert_eq!(last["from"], "storage1");
    let vms = last["vms"].as_array().unwrap();
    assert_eq!(vms.len(), 2, "both guests held and switched: {last}");
    let pause = last["guest_pause_ms"].as_u64().unwrap();
    assert!(pause < 5_000, "guests paused {pause} ms: {last}");
    let push = &last["push"];
    assert_eq!(push["state"], "done", "{last}");
    assert!(
        push["bytes_sent"].as_u64().unwrap() >= regions.len() as u64 * (1 << 20),
        "the written regions were copied: {last}"
    );
    let (d, listed) = disk_entry(disk);
    assert_eq!(d["node"], "storage2", "{listed}");
    assert_eq!(d["policy"], "move-cap", "the policy came along: {d}");
    assert!(
        !disk_file("storage1", disk).exists(),
        "the old node's copy is gone"
    );

    // both guests keep writing and reading each other's writes, on storage2
    let after1 = wait_for_peer("host1", "mv1", s2, before + 4);
    wait_for_peer("host2", "mv2", s1, after1);
    let t0 = Instant::now();
    loop {
        let flows: Vec<Value> = ferry_json(&["qos", "flow", "list"])
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["disk"] == disk && f["node"] == "storage2" && f["connections"] == 1)
            .cloned()
            .collect();
        let live = flows
            .iter()
            .filter(|f| f["iops"].as_f64().unwrap() > 0.0 && f["policy"] == "move-cap")
            .count();
        if live == 2 && flows.iter().all(|f| f["max_iops"] == 4000) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "the QoS flows did not continue on storage2: {flows:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }

    // from outside: every region, and each guest's last acknowledged writes
    let s1_seq = seq_past("host1", "mv1", 0);
    let s2_seq = seq_past("host2", "mv2", 0);
    let data = std::fs::read(disk_file("storage2", disk)).unwrap();
    for (off, d) in &regions {
        assert!(
            &data[*off..*off + d.len()] == d.as_slice(),
            "region at {off} differs on storage2"
        );
    }
    for (vm, s, last) in [("mv1", s1, s1_seq), ("mv2", s2, s2_seq)] {
        let missing = ring_missing(&journal_ring(&data, s), last);
        assert!(
            missing.is_empty(),
            "{vm}: acknowledged writes {missing:?} not on storage2"
        );
    }
    for vm in ["mv1", "mv2"] {
        assert_intact_on(vm, if vm == "mv1" { "host1" } else { "host2" });
    }
    let _ = ferry(&["disk", "set", disk, "--no-policy"]);
    let _ = ferry(&["qos", "policy", "rm", "move-cap"]);
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn a_replica_fails_over_holding_every_write_older_than_its_lag() {
    require_lab();
    let _g = serial();
    lab_with(2, 1, "1gbit", 2);
    let (vm, disk) = ("rp1", "replicated");
    let _ = ferry(&["disk", "rm", disk]);
    let seed = 23u64;
    remove_vm(vm);
    ferry_ok(&[
        "vm", "create", vm, "--host", "host1", "--memory", "256M", "--fill", "64M", "--seed", "23",
    ]);
    let _v = VmGuard(vm);
    ferry_ok(&[
        "disk", "create", disk, "--size", "32M", "--node", "storage1",
    ]);
    ferry_ok(&["disk", "attach", disk, vm]);
    seq_past("host1", vm, 2);
    let out = ferry(&[
        "disk",
        "replicate",
        disk,
        "--to",
        "storage2",
        "--every",
        "100ms",
    ]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success() && err.contains("every"), "{err}");
    ferry_ok(&[
        "disk",
        "replicate",
        disk,
        "--to",
        "storage2",
        "--every",
        "2s",
    ]);

    // watch the guest's acknowledged writes (seen at host times) for a while
    let mut seen: Vec<(u64, u64)> = Vec::new();
    let t0 = Instant::now();
    let status = loop {
        if let Some((seq, 0, _)) = last_disk_line("host1", vm) {
            seen.push((ferry_api::util::now_ms(), seq));
        }
        let st = ferry_json(&["disk", "replica", "status", disk]);
        let p = st[0].clone();
        if t0.elapsed() > Duration::from_secs(7) && p["rounds"].as_u64().unwrap_or(0) >= 3 {
            break p;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no replica rounds: {st}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(status["to"], "storage2", "{status}");
    let synced = status["synced_ms"].as_u64().unwrap();
    let lag = status["lag_ms"].as_u64().unwrap();
    assert!(lag < 5_000, "lag {lag} ms with a 2 s period: {status}");

    // the primary's node dies
    kill_lab_service("storage");
    std::thread::sleep(Duration::from_millis(500));
    let down = ferry_json(&["disk", "replica", "status", disk]);
    assert_eq!(down[0]["state"], "failed", "{down}");
    assert_eq!(down[0]["synced_ms"].as_u64(), Some(synced), "{down}");

    // every write acknowledged before the replica's synced instant is on it
    let required = seen
        .iter()
        .filter(|(t, _)| *t <= synced)
        .map(|(_, s)| *s)
        .max()
        .expect("writes seen before the last sync");
    let replica = std::fs::read(disk_file("storage2", disk)).unwrap();
    let missing = ring_missing(&journal_ring(&replica, seed), required);
    assert!(
        missing.is_empty(),
        "writes {missing:?} (acknowledged before {synced}, lag {lag} ms) are not on the replica"
    );

    // failover: the replica is the disk; the guest writes to it
    let d = ferry_json(&["disk", "replica", "failover", disk]);
    assert_eq!(d["node"], "storage2", "{d}");
    let t1 = Instant::now();
    loop {
        let v = &vm_entries(vm)[0];
        if v["state"] == "running"
            && v["spec"]["disks"][0]["uri"]
                .as_str()
                .is_some_and(|u| u.contains(":10810/"))
        {
            break;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(30),
            "{vm} not on the replica: {v}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    seq_past("host1", vm, 0);
    let pre = std::fs::read(disk_file("storage2", disk)).unwrap();
    let before = journal_ring(&pre, seed)
        .iter()
        .flatten()
        .max()
        .copied()
        .unwrap_or(0);
    let t2 = Instant::now();
    loop {
        let now = std::fs::read(disk_file("storage2", disk)).unwrap();
        if journal_ring(&now, seed)
            .iter()
            .flatten()
            .max()
            .copied()
            .unwrap_or(0)
            > before
        {
            break;
        }
        assert!(
            t2.elapsed() < Duration::from_secs(20),
            "{vm} never wrote the replica"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    assert_intact_on(vm, "host1");
    // storage1 back: the lab's node again, for the tests after this one
    ferry_ok(&["lab", "restart", "storage"]);
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn a_move_whose_target_node_dies_leaves_the_disk_where_it_was() {
    require_lab();
    let _g = serial();
    lab_with(2, 1, "1gbit", 2);
    let (vm, disk, seed) = ("mf1", "stays", 24u64);
    let _ = ferry(&["disk", "rm", disk]);
    remove_vm(vm);
    ferry_ok(&[
        "vm", "create", vm, "--host", "host1", "--memory", "256M", "--fill", "64M", "--seed", "24",
    ]);
    let _v = VmGuard(vm);
    ferry_ok(&["disk", "create", disk, "--size", "1G", "--node", "storage1"]);
    // a disk full of data: its copy takes a few seconds
    let status = std::process::Command::new("dd")
        .args([
            "if=/dev/urandom",
            &format!("of={}", disk_file("storage1", disk).display()),
            "bs=4M",
            "count=256",
            "conv=notrunc",
            "status=none",
        ])
        .status()
        .unwrap();
    assert!(status.success());
    ferry_ok(&["disk", "attach", disk, vm]);
    let before = seq_past("host1", vm, 2);

    // the move starts; once it has sent something, storage2 dies
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["disk", "move", disk, "--to", "storage2", "--json"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    let mut last = Value::Null;
    for l in lines.by_ref() {
        last = serde_json::from_str(&l.unwrap()).unwrap();
        if last["push"]["bytes_sent"].as_u64().unwrap_or(0) > 0 {
            break;
        }
    }
    assert_eq!(last["phase"], "copy", "the copy was under way: {last}");
    kill_lab_service("storage2");
    for l in lines {
        last = serde_json::from_str(&l.unwrap()).unwrap();
    }
    assert!(
        !child.wait().unwrap().success(),
        "the move reports its failure"
    );
    assert_eq!(last["phase"], "failed", "{last}");
    assert!(
        last["error"].as_str().unwrap().contains("storage2"),
        "{last}"
    );

    // the disk is served by storage1 as before: listed there (storage2 left
    // out while it does not answer), the guest writing it without a pause
    let (d, listed) = disk_entry(disk);
    assert_eq!(d["node"], "storage1", "{listed}");
    assert_eq!(d["role"]["kind"], "primary", "{d}");
    let last_seq = seq_past("host1", vm, before + 4);
    let v = &vm_entries(vm)[0];
    assert_eq!(v["state"], "running", "{v}");
    assert!(
        v["spec"]["disks"][0]["uri"]
            .as_str()
            .unwrap()
            .contains(":10809/"),
        "{v}"
    );
    let data = std::fs::read(disk_file("storage1", disk)).unwrap();
    let missing = ring_missing(&journal_ring(&data, seed), last_seq);
    assert!(missing.is_empty(), "writes {missing:?} not on storage1");

    // storage2 back: its partial copy is replaced by the next move, which succeeds
    ferry_ok(&["lab", "restart", "storage", "--node", "2"]);
    let t0 = Instant::now();
    let out = loop {
        let out = ferry(&["disk", "move", disk, "--to", "storage2", "--json"]);
        if out.status.success() || t0.elapsed() > Duration::from_secs(20) {
            break out;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let done: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(
        done["phase"],
        "done",
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    seq_past("host1", vm, last_seq);
    assert_intact_on(vm, "host1");
}
