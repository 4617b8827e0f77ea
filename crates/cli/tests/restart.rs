//! VMs outlive their agent: an agent SIGKILLed with guests running leaves
//! them running, its successor takes them back (same QEMU, same pid) and
//! moves them; an agent SIGKILLed mid-pre-copy, on either side, leaves the
//! guest running intact on exactly one host once the agents are back, with
//! no QEMU left over.
//! Needs root and QEMU ≥ 9 (see common/mod.rs); the tests are #[ignore]d and
//! scripts/run test includes them.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use std::time::Duration;

use common::*;

/// Links slow enough that a move's pre-copy lasts seconds.
const RATE: &str = "200mbit";

/// The workload's last counter, read from the guest's console file (no
/// agent needed).
fn console_tick(host: &str, vm: &str) -> u64 {
    let path = format!("{LAB}/{host}/vms/{vm}/console.log");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let log = ferry_lab::console::parse_log(&text);
    assert!(log.problems.is_empty(), "{vm}: {:?}", log.problems);
    log.last.unwrap_or_else(|| panic!("{vm}: no tick yet")).tick
}

fn pid_of(vm: &str) -> u64 {
    let e = vm_entries(vm);
    assert_eq!(e.len(), 1, "{vm}: {e:?}");
    e[0]["pid"]
        .as_u64()
        .unwrap_or_else(|| panic!("{vm} has no pid: {e:?}"))
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn guests_outlive_a_killed_agent_and_its_successor_takes_them_back() {
    require_lab();
    let _g = serial();
    lab_at(3, 2, RATE);
    let _a = VmGuard::create("rs1", "host1", "256M", "128M");
    let _b = VmGuard::create("rs2", "host1", "256M", "128M");
    let pids = (pid_of("rs1"), pid_of("rs2"));
    let before = (console_tick("host1", "rs1"), console_tick("host1", "rs2"));
    kill_agent("host1");
    std::thread::sleep(Duration::from_secs(4));
    // no agent on host1 now: the guests run on and count
    assert_eq!(qemu_pids("host1").len(), 2, "{:?}", qemu_pids("host1"));
    let during = (console_tick("host1", "rs1"), console_tick("host1", "rs2"));
    assert!(
        during.0 > before.0 && during.1 > before.1,
        "counters stopped without the agent: {before:?} → {during:?}"
    );
    restart_agent_with("host1", "");
    // the same QEMUs, listed and checked by the new agent
    assert_eq!((pid_of("rs1"), pid_of("rs2")), pids);
    assert_intact_on("rs1", "host1");
    assert_intact_on("rs2", "host1");
    let r = move_vm("rs1", "host2", "multichannel");
    assert_eq!(r["event"], "completed", "{r}");
    assert_intact_on("rs1", "host2");
    assert_intact_on("rs2", "host1");
    assert_eq!(qemu_pids("host1").len(), 1);
}

/// Starts a move of a 384 MiB guest from host1 to host2, SIGKILLs `victim`'s
/// agent once 48 MiB have crossed, restarts it, and checks that the guest
/// settles intact on exactly one host with no QEMU left on the other.
fn kill_mid_precopy(vm: &'static str, victim: &str) -> String {
    let _g = VmGuard::create(vm, "host1", "384M", "256M");
    let victim2 = victim.to_string();
    let _ = move_with(vm, "host2", "multichannel", 48 << 20, move || {
        kill_agent(&victim2)
    });
    restart_agent_with(victim, "");
    // a target's skeleton asks its source after 10 s; give both sides time
    let t0 = std::time::Instant::now();
    loop {
        let c = check(vm);
        let host = c["host"].as_str().unwrap_or("").to_string();
        let other = if host == "host1" { "host2" } else { "host1" };
        if c["intact"] == true
            && c["advancing"] == true
            && qemu_pids(other).is_empty()
            && vm_entries(vm).len() == 1
        {
            assert_eq!(qemu_pids(&host).len(), 1, "{vm} has one QEMU on {host}");
            return host;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(90),
            "{vm} did not settle on one host: {c}; entries {:?}; QEMUs host1 {:?} host2 {:?}",
            vm_entries(vm),
            qemu_pids("host1"),
            qemu_pids("host2")
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn source_agent_killed_mid_precopy_leaves_one_intact_guest() {
    require_lab();
    let _g = serial();
    lab_at(3, 2, RATE);
    // never committed: the restarted source cancels and resumes; the
    // skeleton learns `aborted` and is discarded
    assert_eq!(kill_mid_precopy("rs3", "host1"), "host1");
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn target_agent_killed_mid_precopy_leaves_one_intact_guest() {
    require_lab();
    let _g = serial();
    lab_at(3, 2, RATE);
    // the carriers die with the target agent: the source rolls back; the
    // restarted target kills its skeleton (it never ran)
    assert_eq!(kill_mid_precopy("rs4", "host2"), "host1");
}
