//! Live migration in the lab, end to end through the `ferry` CLI: real
//! namespaces, real QEMU guests, real links shaped to 1 Gbit/s.
//! Needs root and QEMU ≥ 9 (see common/mod.rs); the tests are #[ignore]d; scripts/run test includes them.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn vm_with_1gib_filled_moves_host1_host2_three_times_intact() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    let _vm = VmGuard::create("big1", "host1", "1280M", "1G");
    assert_intact_on("big1", "host1");
    let mut at = "host1";
    for round in 1..=3 {
        for to in ["host2", "host1"] {
            let r = move_vm("big1", to, "tcp");
            assert_eq!(r["event"], "completed", "round {round} to {to}: {r}");
            assert_eq!(r["status"], "completed");
            assert_eq!((r["from"].as_str(), r["to"].as_str()), (Some(at), Some(to)));
            let downtime = r["downtime_ms"].as_u64().expect("downtime_ms");
            assert!(downtime < 1000, "downtime {downtime} ms");
            // the guest's downtime in its parts: QEMU's blackout first, then
            // the switch-over's steps, within what the guest saw
            let parts = r["downtime_parts"].as_array().expect("downtime_parts");
            let names: Vec<&str> = parts.iter().map(|p| p["part"].as_str().unwrap()).collect();
            assert_eq!(names, ["qemu", "tick", "ready", "record", "run"], "{r}");
            assert_eq!(parts[0]["ms"].as_u64(), Some(downtime), "{r}");
            let sum: u64 = parts.iter().map(|p| p["ms"].as_u64().unwrap()).sum();
            assert!(sum <= r["guest_downtime_ms"].as_u64().unwrap(), "{r}");
            assert!(r["bytes_transferred"].as_u64().unwrap() >= 1 << 30, "{r}");
            // at least a GiB moved at no more than the 1 Gbit/s line rate
            let (total_ms, throughput) = (
                r["total_ms"].as_u64().unwrap(),
                r["throughput"].as_f64().unwrap(),
            );
            assert!(
                total_ms >= 8_000,
                "1 GiB over 1 Gbit/s in {total_ms} ms: {r}"
            );
            assert!(
                throughput > 50e6 && throughput <= 1.25e8 * 1.02,
                "throughput {throughput} B/s: {r}"
            );
            assert!(
                r["nic_tx_bytes"][nic(at, 1)].as_u64().unwrap() >= 1 << 30,
                "{r}"
            );
            // the counter kept advancing across the switch-over, and the guest verified itself
            let before = r["tick_before"].as_u64().expect("tick_before");
            assert!(r["check"]["tick_last"].as_u64().unwrap() > before, "{r}");
            assert_eq!(r["check"]["intact"], true);
            assert_intact_on("big1", to);
            assert!(
                qemu_pids(at).is_empty(),
                "source QEMU on {at} was not cleaned up"
            );
            at = to;
        }
    }
    // the guest has verified its whole filled memory at least once since boot
    assert!(check("big1")["sweeps"].as_u64().unwrap() >= 1);
}

/// The `-machine` argument of the QEMU running guest `vm` inside `host`.
fn machine_of(host: &str, vm: &str) -> String {
    for pid in qemu_pids(host) {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<String> = String::from_utf8_lossy(&cmdline)
            .split('\0')
            .map(str::to_string)
            .collect();
        if args.iter().any(|a| a.starts_with(&format!("guest={vm},"))) {
            let at = args.iter().position(|a| a == "-machine").expect("-machine");
            let vapic = args.iter().any(|a| a == "apic-common.vapic=off");
            return format!("{}{}", args[at + 1], if vapic { " vapic=off" } else { "" });
        }
    }
    panic!("no QEMU for {vm} on {host}");
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn a_new_vm_gets_the_lean_board_and_a_full_board_vm_keeps_its_own_across_a_move() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    let _lean = VmGuard::create("lean1", "host1", "256M", "64M");
    remove_vm("full1");
    ferry_ok(&[
        "vm", "create", "full1", "--host", "host1", "--memory", "256M", "--fill", "64M", "--board",
        "full",
    ]);
    let _full = VmGuard("full1");
    let lean = "q35,smbus=off,sata=off,vmport=off vapic=off";
    for (vm, board, machine) in [("lean1", "lean", lean), ("full1", "full", "q35")] {
        let listed = ferry_json(&["vm", "list"]);
        let spec = &listed
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == vm)
            .unwrap()["spec"];
        assert_eq!(spec["board"], board, "{listed}");
        assert_eq!(machine_of("host1", vm), machine);
        // the target's skeleton is built to the same board, or QEMU could
        // not load the source's devices
        let r = move_vm(vm, "host2", "tcp");
        assert_eq!(r["event"], "completed", "{vm}: {r}");
        assert_eq!(machine_of("host2", vm), machine);
        assert_intact_on(vm, "host2");
    }
    let bad = ferry(&[
        "vm", "create", "bad1", "--host", "host1", "--memory", "256M", "--board", "tiny",
    ]);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("tiny") && err.contains("lean"), "{err}");
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn a_move_goes_on_when_its_command_is_interrupted_and_anyone_follows_it() {
    require_lab();
    let _g = serial();
    lab(2, 1);
    let _vm = VmGuard::create("op1", "host1", "512M", "384M");
    // the command that starts it is killed a second in (384 MiB at 1 Gbit/s takes ~3 s)
    let mut cli = std::process::Command::new(FERRY)
        .args(["vm", "move", "op1", "--to", "host2", "--json"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_secs(1));
    cli.kill().unwrap();
    let _ = cli.wait();
    // the control service lists the move, started by the lab's admin token, and runs it to its end
    let newest = || {
        ferry_json(&["operations"])
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["subject"] == "op1")
            .cloned()
            .expect("op1's move listed")
    };
    let first = newest();
    assert_eq!(
        (
            first["kind"].as_str(),
            first["source"].as_str(),
            first["target"].as_str()
        ),
        (Some("migration"), Some("host1"), Some("host2")),
        "{first}"
    );
    assert_eq!(first["by"], "admin", "{first}");
    let t0 = std::time::Instant::now();
    while newest()["state"] == "running" {
        assert!(t0.elapsed().as_secs() < 120, "op1's move still running");
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    let id = first["id"].as_str().unwrap();
    let op = ferry_json(&["operations", id]);
    assert_eq!(op["state"], "completed", "{op}");
    let events = op["events"].as_array().unwrap();
    assert_eq!(events.len() as u64, op["event_count"].as_u64().unwrap());
    assert_eq!(events.first().unwrap()["event"], "step", "{op}");
    assert_eq!(events.last().unwrap()["event"], "completed", "{op}");
    assert_intact_on("op1", "host2");
    // the guest's console, read on its new host
    let tail = ferry_json(&["vm", "console", "op1", "--bytes", "4K"]);
    assert_eq!(tail["host"], "host2", "{tail}");
    assert!(
        tail["text"].as_str().unwrap().contains("FERRY tick="),
        "{tail}"
    );
    // (the target's QEMU writes a console of its own from the switch-over on)
    let text = tail["text"].as_str().unwrap();
    assert!(text.len() <= 4096, "{tail}");
    assert!(
        tail["size"].as_u64().unwrap() >= text.len() as u64,
        "{tail}"
    );
    // an operation that is not one is named
    let out = ferry(&["operations", "migration-0-0"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("migration-0-0"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn move_to_a_host_without_memory_is_refused_before_anything_starts() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    let _vm = VmGuard::create("mem1", "host1", "512M", "256M");
    // host3 offers 6G; this leaves it less than mem1 needs
    let _filler = VmGuard::create("filler", "host3", "5800M", "32M");
    let qemus_before = qemu_pids("host3").len();
    let r = move_vm("mem1", "host3", "tcp");
    assert_eq!(r["event"], "failed", "{r}");
    assert_eq!(r["error"]["code"], "insufficient_memory", "{r}");
    assert_eq!(r["error"]["host"], "host3");
    assert_eq!(
        qemu_pids("host3").len(),
        qemus_before,
        "a skeleton was started on host3"
    );
    assert_intact_on("mem1", "host1");
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn target_agent_killed_mid_migration_leaves_guest_running_on_source() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    let _vm = VmGuard::create("ka1", "host1", "640M", "512M");
    let r = move_with("ka1", "host2", "tcp", 64 << 20, || {
        let pid = std::fs::read_to_string("/run/ferry/lab/host2/agent.pid").expect("agent pid");
        assert!(std::process::Command::new("kill")
            .args(["-9", pid.trim()])
            .status()
            .unwrap()
            .success());
    });
    assert_eq!(r["event"], "failed", "{r}");
    assert_eq!(r["error"]["running_on"], "host1", "{r}");
    assert_intact_on("ka1", "host1");
    // the skeleton outlives its agent, paused; the restarted agent finds its
    // `waiting` record and kills it: it never ran
    ferry_ok(&["lab", "restart-agent", "host2"]);
    assert!(
        qemu_pids("host2").is_empty(),
        "the skeleton survived its agent's restart"
    );
    let log = one_file(&format!("{LAB}/host2/log"), "ka1.", ".target.qemu.log");
    assert_eq!(runs_in(&log), 0, "the skeleton ran");
    // and the VM can still move once the agent is back
    assert_eq!(move_vm("ka1", "host2", "tcp")["event"], "completed");
    assert_intact_on("ka1", "host2");
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn target_qemu_killed_mid_migration_leaves_guest_running_on_source() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    let _vm = VmGuard::create("kq1", "host1", "640M", "512M");
    let r = move_with("kq1", "host3", "tcp", 64 << 20, || {
        let pids = qemu_pids("host3");
        assert_eq!(pids.len(), 1, "expected one skeleton QEMU on host3");
        assert!(std::process::Command::new("kill")
            .args(["-9", &pids[0].to_string()])
            .status()
            .unwrap()
            .success());
    });
    assert_eq!(r["event"], "failed", "{r}");
    assert_eq!(r["error"]["running_on"], "host1");
    assert_intact_on("kq1", "host1");
    let h3 = host_info("host3");
    assert!(
        h3["info"]["vms"].as_array().unwrap().is_empty(),
        "skeleton left on host3: {h3}"
    );
    assert_eq!(
        h3["info"]["memory_reserved"], 0,
        "memory still reserved on host3: {h3}"
    );
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn link_cut_mid_migration_leaves_guest_running_on_source() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    let _vm = VmGuard::create("lc1", "host1", "640M", "512M");
    let r = move_with("lc1", "host2", "tcp", 64 << 20, || {
        ferry_ok(&["lab", "link", "host2", "nic1", "down"]);
    });
    ferry_ok(&["lab", "link", "host2", "nic1", "up"]);
    assert_eq!(r["event"], "failed", "{r}");
    assert_eq!(r["error"]["step"], "copy");
    assert!(
        r["error"]["reason"]
            .as_str()
            .unwrap()
            .contains(&nic("host2", 1)),
        "{r}"
    );
    assert_eq!(r["error"]["running_on"], "host1");
    assert_intact_on("lc1", "host1");
    assert!(qemu_pids("host2").is_empty(), "skeleton left on host2");
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn unknown_names_and_bad_sizes_are_clear_errors() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    let cases: [(&[&str], &str); 6] = [
        (
            &["vm", "move", "no-such-vm", "--to", "host2"],
            "No vm named 'no-such-vm'",
        ),
        (
            &["vm", "create", "e1", "--host", "host9", "--memory", "512M"],
            "No host named 'host9'",
        ),
        (
            &["vm", "create", "e1", "--host", "host1", "--memory", "12Q"],
            "Invalid --memory",
        ),
        (
            &[
                "vm", "create", "e1", "--host", "host1", "--memory", "512M", "--fill", "1G",
            ],
            "Invalid --fill",
        ),
        (&["vm", "check", "ghost"], "No vm named 'ghost'"),
        (
            &["lab", "link", "host1", "nic9", "down"],
            "no NIC named 'nic9'",
        ),
    ];
    for (args, want) in cases {
        let out = ferry(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: expected '{want}' in: {err}");
    }
    let _vm = VmGuard::create("e2", "host1", "256M", "64M");
    let out = ferry(&["vm", "move", "e2", "--to", "host1"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("already runs on host1"));
    let out = ferry(&[
        "vm", "create", "e2", "--host", "host2", "--memory", "256M", "--fill", "64M",
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("already exists"));
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn a_dead_agent_is_detected_and_its_host_takes_no_vms() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    let pid = std::fs::read_to_string("/run/ferry/lab/host3/agent.pid").expect("agent pid");
    assert!(std::process::Command::new("kill")
        .args(["-9", pid.trim()])
        .status()
        .unwrap()
        .success());
    std::thread::sleep(std::time::Duration::from_millis(3500));
    let h = host_info("host3");
    assert_eq!(h["down"], true, "{h}");
    assert!(h["last_heartbeat_ms"].as_u64().unwrap() >= 3000, "{h}");
    let out = ferry(&[
        "vm", "create", "dead1", "--host", "host3", "--memory", "256M",
    ]);
    assert!(!out.status.success(), "a VM was scheduled onto a dead host");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("host3") && err.contains("has not answered"),
        "{err}"
    );
    ferry_ok(&["lab", "restart-agent", "host3"]);
    let t0 = std::time::Instant::now();
    while host_info("host3")["down"] != false {
        assert!(t0.elapsed().as_secs() < 10, "host3 never came back");
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
}
