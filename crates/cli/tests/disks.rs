//! VM disks from Ferry's storage service, in the lab (needs root and QEMU;
//! see `common`): a disk hot-plugged into two running guests (a guest
//! cluster's shared disk), each guest reading what the other wrote through
//! QEMU's NBD client, one flow per VM; then a live migration of one guest
//! with its disk attached.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// Every sequence number of the guest with `peer_seed` that guest `name`
/// on `host` read, in the order it read them.
fn peer_history(host: &str, name: &str, peer_seed: u64) -> Vec<u64> {
    console(host, name)
        .lines()
        .filter(|l| l.starts_with("FERRY-DISK dev=vda "))
        .filter_map(|l| {
            let peers = l
                .split_whitespace()
                .find_map(|w| w.strip_prefix("peers="))?;
            peers
                .split(',')
                .filter_map(|p| p.split_once(':'))
                .find(|(s, _)| s.parse() == Ok(peer_seed))
                .and_then(|(_, q)| q.parse().ok())
        })
        .collect()
}

fn flows() -> Vec<Value> {
    ferry_json(&["qos", "flow", "list"])
        .as_array()
        .unwrap()
        .clone()
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn a_shared_disk_serves_two_guests_and_follows_a_migration() {
    require_lab();
    let _g = serial();
    lab(2, 1);
    let _ = ferry(&["disk", "rm", "quorum"]);
    for (name, host, seed) in [("gc1", "host1", "3"), ("gc2", "host2", "5")] {
        remove_vm(name);
        ferry_ok(&[
            "vm", "create", name, "--host", host, "--memory", "256M", "--fill", "96M", "--seed",
            seed,
        ]);
    }
    let _guards = (VmGuard("gc1"), VmGuard("gc2"));
    ferry_ok(&["disk", "create", "quorum", "--size", "64M"]);
    let a = ferry_json(&["disk", "attach", "quorum", "gc1"]);
    assert_eq!(a["spec"]["disks"][0]["disk"], "quorum", "{a}");
    ferry_ok(&["disk", "attach", "quorum", "gc2"]);

    // each guest reads what the other wrote (QEMU's NBD client, both ways)
    let s1 = wait_for_peer("host2", "gc2", 3, 0);
    wait_for_peer("host1", "gc1", 5, 0);

    // one flow per VM per disk, with the initiator's host
    let f = flows();
    for (vm, host) in [("gc1", "host1"), ("gc2", "host2")] {
        let flow = f
            .iter()
            .find(|x| x["id"] == format!("quorum/{vm}"))
            .unwrap_or_else(|| panic!("no flow for {vm}: {f:?}"));
        assert_eq!(flow["host"], host, "{flow}");
        assert_eq!(flow["initiator"], vm, "{flow}");
        assert_eq!(flow["status"], "Ok", "{flow}");
    }
    // policies through the control service reach the node's flows
    let _ = ferry(&["qos", "policy", "rm", "quorum-cap"]);
    ferry_ok(&[
        "qos",
        "policy",
        "new",
        "quorum-cap",
        "--type",
        "aggregated",
        "--max-iops",
        "2000",
        "--max-bandwidth",
        "50M",
    ]);
    ferry_ok(&["disk", "set", "quorum", "--policy", "quorum-cap"]);
    let out = ferry(&[
        "qos",
        "policy",
        "new",
        "bad",
        "--type",
        "dedicated",
        "--min-iops",
        "900",
        "--max-iops",
        "500",
    ]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("min_iops"),
        "the error names the field"
    );
    let out = ferry(&["qos", "policy", "new", "bad", "--type", "sometimes"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a wrong CLI argument is a usage error"
    );
    ferry_ok(&["qos", "policy", "set", "quorum-cap", "--max-iops", "1500"]);
    for f in flows().iter().filter(|f| f["disk"] == "quorum") {
        assert_eq!(f["policy"], "quorum-cap", "{f}");
        assert_eq!(f["max_iops"], 1500, "{f}");
        assert_eq!(f["max_bandwidth"], 50 << 20, "{f}");
    }
    // an attached disk cannot be removed
    let out = ferry(&["disk", "rm", "quorum"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("open connections"));

    // live migration with the disk attached: the target QEMU opens it too
    let done = move_vm("gc1", "host2", "tcp");
    assert_eq!(done["event"], "completed", "{done}");
    assert_intact_on("gc1", "host2");
    // gc1 keeps writing from host2 and gc2 keeps reading it
    wait_for_peer("host2", "gc2", 3, s1 + 4);
    // one copy wrote at a time: every block of gc1's that gc2 read, before,
    // across and after the switch-over, carries a sequence number at least
    // as new as the one before (a resumed source after the target had
    // written would write older numbers again)
    std::thread::sleep(Duration::from_secs(3));
    let seen = peer_history("host2", "gc2", 3);
    assert!(
        seen.len() >= 5 && seen.last() > Some(&(s1 + 4)),
        "too few reads of gc1's block across the move: {seen:?}"
    );
    assert!(
        seen.windows(2).all(|w| w[1] >= w[0]),
        "gc1's writes went back in time (two writers): {seen:?}"
    );
    // the target's console starts empty: wait for gc1's first report from host2
    let t0 = Instant::now();
    let (seq, errors, _) = loop {
        if let Some(l) = last_disk_line("host2", "gc1") {
            break l;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "gc1 writes on host2:\n{}",
            console("host2", "gc1")
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    assert_eq!(errors, 0);
    assert!(seq > 0);
    std::thread::sleep(Duration::from_millis(1500));
    let f = flows();
    let flow = f.iter().find(|x| x["id"] == "quorum/gc1").unwrap();
    assert_eq!(flow["host"], "host2", "the flow follows the VM: {flow}");
    assert_eq!(
        flow["connections"], 1,
        "the source's connection is closed: {flow}"
    );
    // the control service's metrics saw the migration pass through
    let token = std::fs::read_to_string("/run/ferry/lab/admin.token").unwrap();
    let out = std::process::Command::new("curl")
        .args([
            "-sf",
            "--cacert",
            "/run/ferry/lab/pki/ca/ca-cert.pem",
            "-H",
            &format!("Authorization: Bearer {}", token.trim()),
        ])
        .arg("https://127.0.0.1:7700/metrics")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "ferry_migration_state{vm=\"gc1\",source=\"host1\",target=\"host2\"} 1",
        "ferry_migration_downtime_seconds{vm=\"gc1\",source=\"host1\",target=\"host2\"}",
        &format!("ferry_nic_transmit_bytes_total{{host=\"host1\",nic=\"{}\"}}", nic("host1", 1)),
        "ferry_storage_flow_iops{flow=\"quorum/gc2\",disk=\"quorum\",node=\"storage1\",initiator=\"gc2\",host=\"host2\"}",
    ] {
        assert!(text.contains(want), "metrics lack {want}:\n{text}");
    }
    ferry_ok(&["disk", "set", "quorum", "--no-policy"]);
    ferry_ok(&["qos", "policy", "rm", "quorum-cap"]);
}

/// The journal ring of the guest with `seed` in a raw disk file.
fn ring_in(file: &std::path::Path, seed: u64) -> Vec<Option<u64>> {
    journal_ring(&std::fs::read(file).unwrap(), seed)
}

/// The VM list entry of `name`.
fn vm_entry(name: &str) -> Value {
    vm_entries(name)
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("{name} is not listed"))
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn a_storage_outage_pauses_the_guest_and_loses_no_acknowledged_write() {
    require_lab();
    let _g = serial();
    lab(2, 1);
    let (vm, disk, seed) = ("sp1", "journal", 9u64);
    remove_vm(vm);
    let _ = ferry(&["disk", "rm", disk]);
    ferry_ok(&[
        "vm", "create", vm, "--host", "host1", "--memory", "256M", "--fill", "64M", "--seed", "9",
    ]);
    let _guard = VmGuard(vm);
    ferry_ok(&["disk", "create", disk, "--size", "16M"]);
    ferry_ok(&["disk", "attach", disk, vm]);
    let before = seq_past("host1", vm, 4);

    // the storage node stops for 10 s
    kill_lab_service("storage");
    let outage = Instant::now();

    // the guest pauses (after QEMU's 5 s of reconnecting), naming its storage
    let paused = loop {
        let v = vm_entry(vm);
        if v["storage_pause"]["state"] == "paused" {
            break v;
        }
        assert!(
            outage.elapsed() < Duration::from_secs(9),
            "{vm} did not pause for its storage: {v}\n{}",
            agent_log_tail("host1", 20)
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    assert_eq!(paused["state"], "io-error", "{paused}");
    let storage = paused["storage_pause"]["storage"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(storage.starts_with("storage1 ("), "{storage}");
    let listed = ferry_ok(&["vm", "list"]);
    assert!(listed.contains("paused: storage (storage1"), "{listed}");
    // a move of a guest waiting for its storage is refused, saying so
    let out = ferry(&["vm", "move", vm, "--to", "host2"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("paused: storage"), "{err}");
    // paused, the guest acknowledges nothing
    let during = last_disk_line("host1", vm).unwrap().0;
    std::thread::sleep(Duration::from_secs(10).saturating_sub(outage.elapsed()));
    ferry_ok(&["lab", "restart", "storage"]);

    // it runs on by itself once the node answers
    let back = Instant::now();
    let resumed = loop {
        let v = vm_entry(vm);
        if v["storage_pause"]["state"] == "resumed" && v["state"] == "running" {
            break v;
        }
        assert!(
            back.elapsed() < Duration::from_secs(15),
            "{vm} did not resume: {v}"
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    assert_eq!(resumed["state"], "running", "{resumed}");
    let p = &resumed["storage_pause"];
    let paused_ms = p["until_ms"].as_u64().unwrap() - p["since_ms"].as_u64().unwrap();
    assert!(
        (3_000..20_000).contains(&paused_ms),
        "paused for {paused_ms} ms: {p}"
    );
    // the event log is written at the control service's heartbeat, which
    // may come up to a round after the agent's list says resumed
    let logged = Instant::now();
    loop {
        let events = ferry_json(&["events", "--limit", "200"]);
        let kinds: Vec<&str> = events
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["subject"] == vm)
            .filter_map(|e| e["kind"].as_str())
            .collect();
        if kinds.contains(&"storage_pause") && kinds.contains(&"storage_resume") {
            break;
        }
        assert!(
            logged.elapsed() < Duration::from_secs(15),
            "no storage_pause and storage_resume of {vm} logged: {events}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }

    // the guest's own verifier: it writes on, and every write read back intact
    let t1 = Instant::now();
    let last = loop {
        let (seq, errors, _) = last_disk_line("host1", vm).unwrap();
        assert_eq!(errors, 0, "{}", console("host1", vm));
        if seq > before.max(during) + 5 {
            break seq;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(30),
            "{vm} stopped writing at {seq}"
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    // and from outside: the disk file holds each of the last 32 acknowledged
    // writes (or a later one in its ring position), every block intact
    let file = std::path::Path::new("/run/ferry/lab/storage1/disks").join(format!("{disk}.img"));
    let mut tries = 0;
    loop {
        let ring = ring_in(&file, seed);
        let missing = ring_missing(&ring, last);
        if missing.is_empty() {
            break;
        }
        // a block being rewritten as it was read: read again
        tries += 1;
        assert!(
            tries < 5,
            "acknowledged writes missing from {}: {missing:?} (ring {ring:?})",
            file.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_intact_on(vm, "host1");

    // the disk grows while the guest writes: the guest sees the new size at
    // once; shrinking is refused
    let grown = ferry_json(&["disk", "resize", disk, "--size", "32M"]);
    assert_eq!(grown["size"], 32 << 20, "{grown}");
    let t2 = Instant::now();
    loop {
        let text = console("host1", vm);
        let size = text
            .lines()
            .rev()
            .find(|l| l.starts_with("FERRY-DISK dev=vda "))
            .and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix("size=")))
            .and_then(|v| v.parse::<u64>().ok());
        if size == Some(32 << 20) {
            break;
        }
        assert!(
            t2.elapsed() < Duration::from_secs(10),
            "the guest sees {size:?} bytes"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let out = ferry(&["disk", "resize", disk, "--size", "16M"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("shrinking"));
    let (_, errors, _) = last_disk_line("host1", vm).unwrap();
    assert_eq!(errors, 0, "{}", console("host1", vm));

    // a backup while the guest writes holds one instant of its journal: 32
    // consecutive writes, the last between what it reported before and after
    let dir = std::env::temp_dir().join(format!("ferry-backups-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let full = dir.join("journal-full.img");
    let seen_before = last_disk_line("host1", vm).unwrap().0;
    let j = ferry_json(&["disk", "backup", disk, "--to", full.to_str().unwrap()]);
    let seen_after = last_disk_line("host1", vm).unwrap().0;
    assert_eq!(j["state"], "done", "{j}");
    let ring = ring_in(&full, seed);
    // (positions not written yet read as None: the ring fills in 32 writes)
    let mut seqs: Vec<u64> = ring.iter().flatten().copied().collect();
    seqs.sort_unstable();
    let n = *seqs.last().unwrap();
    let want: Vec<u64> = (n.saturating_sub(31).max(1)..=n).collect();
    assert_eq!(seqs, want, "not one instant: {ring:?}");
    assert!(
        (seen_before..=seen_after + 2).contains(&n),
        "backup's instant {n} outside {seen_before}..={seen_after}"
    );
    // an incremental one copies what the guest wrote since: its journal
    std::thread::sleep(Duration::from_secs(2));
    let inc = dir.join("journal-inc.img");
    let i = ferry_json(&[
        "disk",
        "backup",
        disk,
        "--to",
        inc.to_str().unwrap(),
        "--incremental",
    ]);
    assert_eq!(i["state"], "done", "{i}");
    assert_eq!(i["base"], full.to_str().unwrap(), "{i}");
    // (its slot block and its journal ring: at most four 64 KiB granules)
    let ib = i["bytes_total"].as_u64().unwrap();
    assert!(
        ib > 0 && ib <= 4 << 16,
        "incremental copied {ib} bytes: {i}"
    );
    // a checkpoint; reverting it under the guest is refused, naming it
    let cp = ferry_json(&["disk", "checkpoint", "create", disk, "cp1"]);
    assert_eq!(cp["state"], "done", "{cp}");
    let listed = ferry_json(&["disk", "checkpoint", "list", disk]);
    assert_eq!(listed[0]["name"], "cp1", "{listed}");
    let out = ferry(&["disk", "checkpoint", "revert", disk, "cp1"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("attached to {vm} on host1")), "{err}");
    ferry_ok(&["disk", "checkpoint", "rm", disk, "cp1"]);
    let (_, errors, _) = last_disk_line("host1", vm).unwrap();
    assert_eq!(errors, 0, "{}", console("host1", vm));
    let _ = std::fs::remove_dir_all(&dir);
}
