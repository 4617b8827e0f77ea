//! The commit point in the lab: faults injected at exact steps of a move
//! (`FERRY_FAILPOINTS` in an agent's environment, see the agent's
//! `failpoint` module) and what each leaves behind — never two running
//! copies. Whether a QEMU's vCPUs ever ran is read from its own log: every
//! QEMU traces its run-state changes (`vm_state_notify running 1`), and the
//! agent keeps the log of every QEMU it removes under `STATE_DIR/log/`.
//! Needs root and QEMU ≥ 9 (see common/mod.rs); the tests are #[ignore]d and
//! scripts/run test includes them.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn target_qemu_killed_before_the_commit_resumes_the_source_and_the_target_never_ran() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    restart_agent_with("host2", "target-at-ready=kill-qemu");
    let _vm = VmGuard::create("cp1", "host1", "384M", "256M");
    let r = move_vm("cp1", "host2", "tcp");
    restart_agent_with("host2", "");
    assert_eq!(r["event"], "failed", "{r}");
    assert_eq!(r["error"]["step"], "commit", "{r}");
    assert_eq!(r["error"]["running_on"], "host1", "{r}");
    assert_intact_on("cp1", "host1");
    // the skeleton's own log: loaded, killed, never started
    let log = one_file(&format!("{LAB}/host2/log"), "cp1.", ".target.qemu.log");
    assert_eq!(runs_in(&log), 0, "the target ran: {}", log.display());
    // the source was stopped for the switch-over and resumed once: boot + resume
    assert_eq!(
        runs_in(Path::new(&format!("{LAB}/host1/vms/cp1/qemu.log"))),
        2
    );
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn target_agent_frozen_at_run_leaves_the_move_in_doubt_and_sigcont_settles_it_on_the_target() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    restart_agent_with("host2", "target-before-run=stop");
    let _vm = VmGuard::create("cp2", "host1", "384M", "256M");
    let r = move_vm("cp2", "host2", "tcp");
    let pid = std::fs::read_to_string(format!("{LAB}/host2/agent.pid")).unwrap();
    let pid = pid.trim().to_string();
    let cont = || {
        let _ = Command::new("kill").args(["-CONT", &pid]).status();
    };
    // whatever happens below, the agent is not left frozen
    struct Thaw<F: Fn()>(F);
    impl<F: Fn()> Drop for Thaw<F> {
        fn drop(&mut self) {
            (self.0)()
        }
    }
    let _thaw = Thaw(cont);
    assert_eq!(r["event"], "failed", "{r}");
    assert_eq!(r["error"]["code"], "migration_in_doubt", "{r}");
    // shown in doubt; neither copy runs
    let on1 = vm_entries("cp2");
    let src = on1
        .iter()
        .find(|v| v["host"] == "host1")
        .expect("listed on host1");
    assert!(src["in_doubt"].is_string(), "{src}");
    assert_ne!(src["state"], "running", "{src}");
    let target_log = one_file(&format!("{LAB}/host2/vms"), "cp2.in-", "");
    assert_eq!(runs_in(&target_log.join("qemu.log")), 0);
    assert_eq!(
        runs_in(Path::new(&format!("{LAB}/host1/vms/cp2/qemu.log"))),
        1
    );
    // resolving by hand while the target is frozen keeps it in doubt (exit 1)
    let out = ferry(&["vm", "resolve", "cp2"]);
    assert_eq!(out.status.code(), Some(1), "resolve while frozen");
    assert!(String::from_utf8_lossy(&out.stdout).contains("still in doubt"));
    // the target thaws: it finishes RUN, the source learns it and stops its copy
    cont();
    wait_settled_on("cp2", "host2", "host1", Duration::from_secs(60));
    let source_log = one_file(&format!("{LAB}/host1/log"), "cp2.", ".source.qemu.log");
    assert_eq!(runs_in(&source_log), 1, "the source resumed");
    assert_eq!(runs_in(&target_log.join("qemu.log")), 1);
    assert_eq!(vm_entries("cp2").len(), 1, "{:?}", vm_entries("cp2"));
    restart_agent_with("host2", "");
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn source_agent_killed_after_its_commit_record_lets_the_target_run_once_it_is_back() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    restart_agent_with("host1", "source-after-commit=exit");
    let _vm = VmGuard::create("cp3", "host1", "384M", "256M");
    // the source agent dies mid-move: the move's stream ends without a report
    let _ = ferry(&[
        "vm", "move", "cp3", "--to", "host2", "--option", "tcp", "--json",
    ]);
    // the skeleton waits, paused: it may run only once the source's record is read
    std::thread::sleep(Duration::from_secs(3));
    let target_log = one_file(&format!("{LAB}/host2/vms"), "cp3.in-", "");
    assert_eq!(
        runs_in(&target_log.join("qemu.log")),
        0,
        "ran before the source was back"
    );
    restart_agent_with("host1", "");
    wait_settled_on("cp3", "host2", "host1", Duration::from_secs(60));
    assert_eq!(runs_in(&target_log.join("qemu.log")), 1);
    // the source QEMU outlived its agent, paused; it ran once, at boot,
    // never after, and was stopped when the target answered RUN
    let source_log = one_file(&format!("{LAB}/host1/log"), "cp3.", ".source.qemu.log");
    assert_eq!(runs_in(&source_log), 1);
}
