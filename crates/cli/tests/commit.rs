//! The commit point in the lab: faults injected at exact steps of a move
//! (`FERRY_FAILPOINTS` in an agent's environment, see the agent's
//! `failpoint` module) and what each leaves behind — never two running
//! copies. Whether a QEMU's vCPUs ever ran is read from its own log: every
//! QEMU traces its run-state changes (`vm_state_notify running 1`), and the
//! agent keeps the log of every QEMU it removes under `STATE_DIR/log/`.
//! After the commit, an unreadable record is no answer (nothing resumes or
//! runs on it), and `vm resolve --target-lost` is the operator's way out
//! when the target host is gone for good.
//! Needs root and QEMU ≥ 9 (see common/mod.rs); the tests are #[ignore]d and
//! scripts/run test includes them.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

/// A host's agent, sent SIGCONT when this is dropped: whatever a test does
/// after freezing it (a `stop` fail point), the agent is not left frozen.
struct Thaw(String);

impl Thaw {
    fn of(host: &str) -> Thaw {
        let pid = std::fs::read_to_string(format!("{LAB}/{host}/agent.pid")).unwrap();
        Thaw(pid.trim().to_string())
    }

    fn now(&self) {
        let _ = Command::new("kill").args(["-CONT", &self.0]).status();
    }
}

impl Drop for Thaw {
    fn drop(&mut self) {
        self.now()
    }
}

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
    let thaw = Thaw::of("host2");
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
    thaw.now();
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

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn an_unreadable_target_record_leaves_the_source_paused_in_doubt_and_nothing_runs_twice() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    // the target agent dies at RUN, before it records running: in doubt
    restart_agent_with("host2", "target-before-run=exit");
    let _vm = VmGuard::create("cp4", "host1", "384M", "256M");
    let r = move_vm("cp4", "host2", "tcp");
    assert_eq!(r["error"]["code"], "migration_in_doubt", "{r}");
    // its journal is damaged while it is down
    let skeleton = one_file(&format!("{LAB}/host2/vms"), "cp4.in-", "");
    let id = skeleton.file_name().unwrap().to_string_lossy()["cp4.in-".len()..].to_string();
    let record = PathBuf::from(format!("{LAB}/host2/migrations/{id}.target.json"));
    let kept = std::fs::read(&record).unwrap();
    std::fs::write(&record, b"{\"migration_id\": ").unwrap();
    restart_agent_with("host2", "");
    struct Restore(PathBuf, Vec<u8>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let _ = std::fs::write(&self.0, &self.1);
            restart_agent_with("host2", "");
        }
    }
    let restore = Restore(record, kept);
    // the settler and the skeleton both ask for longer than the skeleton's
    // 10 s: an unreadable record is no answer, never "never ran"
    std::thread::sleep(Duration::from_secs(14));
    assert_eq!(
        runs_in(&skeleton.join("qemu.log")),
        0,
        "the skeleton ran on an unreadable record"
    );
    assert_eq!(
        runs_in(Path::new(&format!("{LAB}/host1/vms/cp4/qemu.log"))),
        1,
        "the source resumed on an unreadable answer"
    );
    let src = vm_entries("cp4")
        .into_iter()
        .find(|v| v["host"] == "host1")
        .expect("listed on host1");
    assert!(src["in_doubt"].is_string(), "{src}");
    let out = ferry(&["vm", "resolve", "cp4"]);
    assert_eq!(out.status.code(), Some(1), "resolve settled it: {out:?}");
    // the record readable again: the skeleton never ran, so it goes and the
    // source runs the guest
    drop(restore);
    wait_settled_on("cp4", "host1", "host2", Duration::from_secs(60));
    assert_eq!(
        runs_in(Path::new(&format!("{LAB}/host1/vms/cp4/qemu.log"))),
        2
    );
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn resolve_target_lost_after_the_target_host_is_gone_resumes_the_guest_on_the_source() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    restart_agent_with("host2", "target-before-run=stop");
    let _vm = VmGuard::create("cp5", "host1", "384M", "256M");
    let r = move_vm("cp5", "host2", "tcp");
    assert_eq!(r["error"]["code"], "migration_in_doubt", "{r}");
    // host2 is gone for good: its agent and its QEMUs killed, its links cut
    struct Back;
    impl Drop for Back {
        fn drop(&mut self) {
            for nic in ["mgmt0", "nic1", "nic2"] {
                ferry(&["lab", "link", "host2", nic, "up"]);
            }
            restart_agent_with("host2", "");
        }
    }
    let _back = Back;
    kill_agent("host2");
    for pid in qemu_pids("host2") {
        // SAFETY: kill(2) with a pid and a signal has no memory effects.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    for nic in ["mgmt0", "nic1", "nic2"] {
        ferry_ok(&["lab", "link", "host2", nic, "down"]);
    }
    // asking settles nothing: the target does not answer
    let out = ferry(&["vm", "resolve", "cp5"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    // the way out needs the operator's confirmation, and says why
    let out = ferry(&["vm", "resolve", "cp5", "--target-lost", "host2"]);
    assert_ne!(out.status.code(), Some(0), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--confirm-powered-off") && err.contains("two copies"),
        "{err}"
    );
    let out = ferry(&[
        "vm",
        "resolve",
        "cp5",
        "--target-lost",
        "host2",
        "--confirm-powered-off",
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let reports: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(reports[0]["phase"], "aborted", "{reports}");
    assert_eq!(reports[0]["host"], "host1", "{reports}");
    assert_intact_on("cp5", "host1");
    // stopped for the switch-over, resumed once by the operator's word
    assert_eq!(
        runs_in(Path::new(&format!("{LAB}/host1/vms/cp5/qemu.log"))),
        2
    );
    // logged, with who said so
    let events = ferry_json(&["events", "--limit", "50"]);
    let events = events.as_array().unwrap();
    assert!(
        events
            .iter()
            .any(|e| e["kind"] == "migration-target-lost" && e["subject"] == "cp5"),
        "no migration-target-lost event"
    );
    assert!(
        events.iter().any(|e| e["kind"] == "command"
            && e["subject"]
                .as_str()
                .unwrap_or("")
                .contains("declare host2 lost")),
        "the command and its author are not in the log"
    );
    let log = std::fs::read_to_string(format!("{LAB}/host1/agent.log")).unwrap();
    assert!(log.contains("the operator declared the target lost"));
}

/// The wall-clock times (s) in a QEMU log's run-state lines (`-msg
/// timestamp=on`: `PID@SECONDS.MICROS:vm_state_notify running …`) whose
/// text contains `what`.
fn run_state_times(log: &Path, what: &str) -> Vec<f64> {
    let text =
        std::fs::read_to_string(log).unwrap_or_else(|e| panic!("reading {}: {e}", log.display()));
    text.lines()
        .filter(|l| l.contains(what))
        .filter_map(|l| {
            let (_, rest) = l.split_once('@')?;
            rest.split_once(':')?.0.parse().ok()
        })
        .collect()
}

/// How long a source QEMU that booted, paused once for a switch-over and
/// ran again kept its guest paused, ms, by its own log.
fn paused_once_ms(log: &Path) -> f64 {
    let paused = run_state_times(log, "running 0 reason 7 (finish-migrate)");
    let ran = run_state_times(log, "vm_state_notify running 1");
    assert_eq!((paused.len(), ran.len()), (1, 2), "{}", log.display());
    let ms = (ran[1] - paused[0]) * 1000.0;
    eprintln!("the source QEMU's guest was paused {ms:.1} ms");
    ms
}

/// The last event of a `vm move --json` that was given up in its blackout:
/// failed at step `blackout`, the guest still on `host`; its reason.
fn given_up_on(out: &std::process::Output, host: &str) -> String {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let r: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(r["event"], "failed", "{r}");
    assert_eq!(r["error"]["step"], "blackout", "{r}");
    assert_eq!(r["error"]["running_on"], host, "{r}");
    r["error"]["reason"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// Writes and fsyncs the lab's file system without pause until dropped:
/// a host whose disk is busy, where every fsync waits its turn.
struct BusyDisk {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl BusyDisk {
    fn start() -> BusyDisk {
        use std::io::Write;
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let path = PathBuf::from(format!("{LAB}/busy-disk"));
        let writer = std::thread::spawn(move || {
            let chunk = vec![0x5au8; 1 << 20];
            while !flag.load(Ordering::Relaxed) {
                let mut f = std::fs::File::create(&path).expect("the busy disk's file");
                for _ in 0..64 {
                    f.write_all(&chunk).expect("writing the busy disk's file");
                }
                f.sync_all().expect("syncing the busy disk's file");
            }
            let _ = std::fs::remove_file(&path);
        });
        BusyDisk {
            stop,
            writer: Some(writer),
        }
    }
}

impl Drop for BusyDisk {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn a_switch_over_past_the_maximum_is_given_up_and_the_guest_resumes_within_it() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    // the target agent freezes when asked READY, its QEMU loaded: the
    // switch-over cannot end, however the move was planned
    let armed = Armed::at("host2", "target-at-ready=stop");
    let thaw = Thaw::of("host2");
    let _vm = VmGuard::create("cp6", "host1", "384M", "256M");
    // and the source's disk busy: resuming the guest waits on no fsync
    let busy = BusyDisk::start();
    let out = ferry(&[
        "vm",
        "move",
        "cp6",
        "--to",
        "host2",
        "--option",
        "tcp",
        "--max-downtime",
        "200ms",
        "--json",
    ]);
    drop(busy);
    let why = given_up_on(&out, "host1");
    assert!(
        why.contains("host2 had not loaded everything") && why.contains("at most 200 ms"),
        "{why}"
    );
    // QEMU's own clock: paused for the switch-over, running again within
    // the maximum asked
    let log = PathBuf::from(format!("{LAB}/host1/vms/cp6/qemu.log"));
    let blackout_ms = paused_once_ms(&log);
    assert!(
        blackout_ms > 0.0 && blackout_ms <= 200.0,
        "the guest was paused {blackout_ms:.1} ms; the source agent's last lines:\n{}",
        agent_log_tail("host1", 30)
    );
    assert_intact_on("cp6", "host1");
    // the target thaws: it hears the move was given up and drops its
    // skeleton, which never ran
    thaw.now();
    let t0 = std::time::Instant::now();
    let skeleton = loop {
        let left: Vec<_> = std::fs::read_dir(format!("{LAB}/host2/vms"))
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        if !left
            .iter()
            .any(|n| n.to_string_lossy().starts_with("cp6.in-"))
        {
            break one_file(&format!("{LAB}/host2/log"), "cp6.", ".target.qemu.log");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the skeleton stayed: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    assert_eq!(
        runs_in(&skeleton),
        0,
        "the target ran: {}",
        skeleton.display()
    );
    assert_eq!(vm_entries("cp6").len(), 1, "{:?}", vm_entries("cp6"));
    drop(armed);
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn a_last_pass_held_past_the_maximum_is_cut_and_the_guest_resumes_within_it() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    remove_vm("cp7");
    ferry_ok(&[
        "vm",
        "create",
        "cp7",
        "--host",
        "host1",
        "--memory",
        "384M",
        "--fill",
        "256M",
        "--dirty-rate",
        "30M",
    ]);
    let _vm = VmGuard("cp7");
    struct Links;
    impl Drop for Links {
        fn drop(&mut self) {
            for nic in ["nic1", "nic2"] {
                ferry(&["lab", "link", "host1", nic, "up"]);
            }
        }
    }
    let _links = Links;
    // a maximum of 3 s: QEMU stops the guest right after its first pass,
    // with tens of MB left to send
    let mv = Command::new(FERRY)
        .args([
            "vm",
            "move",
            "cp7",
            "--to",
            "host2",
            "--option",
            "tcp",
            "--max-downtime",
            "3s",
            "--json",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // the moment QEMU pauses the guest (its own log), the migration links
    // go down: its last pass cannot end
    let log = PathBuf::from(format!("{LAB}/host1/vms/cp7/qemu.log"));
    let t0 = std::time::Instant::now();
    while run_state_times(&log, "running 0 reason 7 (finish-migrate)").is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(60), "QEMU never paused");
        std::thread::sleep(Duration::from_millis(2));
    }
    for nic in ["nic1", "nic2"] {
        ferry_ok(&["lab", "link", "host1", nic, "down"]);
    }
    let out = mv.wait_with_output().unwrap();
    let why = given_up_on(&out, "host1");
    assert!(
        why.contains("QEMU was still sending the last pass") && why.contains("at most 3000 ms"),
        "{why}"
    );
    let blackout_ms = paused_once_ms(&log);
    assert!(
        blackout_ms > 0.0 && blackout_ms <= 3000.0,
        "the guest was paused {blackout_ms:.1} ms"
    );
    drop(_links);
    assert_intact_on("cp7", "host1");
    assert_eq!(vm_entries("cp7").len(), 1, "{:?}", vm_entries("cp7"));
}
