//! Every VM converges: a guest dirtying memory faster than its path moves
//! it (links at 200 Mbit/s, 64 MB/s dirtied) completes with post-copy
//! allowed (as the source host's default), fails clearly naming the rates
//! with post-copy forbidden, pauses and copies at expiry when asked to, and
//! completes in post-copy with one of two NICs cut and with every path cut
//! for seconds. After post-copy's commit nothing is lost: a stream reset
//! with its paths down for 20 s is resumed on a new one, a source agent
//! killed mid-way keeps its QEMU (and the pages) until QEMU says completed,
//! and a refused switch to post-copy discards the skeleton.
//! Needs root and QEMU ≥ 9 (see common/mod.rs); the tests are #[ignore]d; scripts/run test includes them.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const RATE: &str = "200mbit";

fn busy(name: &'static str) -> VmGuard {
    remove_vm(name);
    ferry_ok(&[
        "vm",
        "create",
        name,
        "--host",
        "host1",
        "--memory",
        "384M",
        "--fill",
        "160M",
        "--dirty-rate",
        "64M",
    ]);
    VmGuard(name)
}

/// Runs a move with extra flags, calling `on_postcopy` once post-copy starts.
fn move_busy(
    name: &str,
    to: &str,
    flags: &[&str],
    on_postcopy: impl FnOnce(),
) -> (Value, Vec<Value>) {
    let mut args = vec!["vm", "move", name, "--to", to, "--json"];
    args.extend_from_slice(flags);
    let mut child = Command::new(FERRY)
        .args(&args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut hook = Some(on_postcopy);
    let mut events = Vec::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let ev: Value = serde_json::from_str(&line.unwrap()).unwrap();
        if ev["event"] != "progress" {
            eprintln!("{ev}");
        }
        if ev["event"] == "step" && ev["step"] == "postcopy" {
            if let Some(f) = hook.take() {
                f();
            }
        }
        events.push(ev);
    }
    child.wait().unwrap();
    (events.last().cloned().unwrap(), events)
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn a_busy_guest_completes_with_postcopy_allowed() {
    require_lab();
    let _g = serial();
    lab_at(3, 2, RATE);
    let _vm = busy("busy1");
    // the policy comes from the source host's defaults, not from the move
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            ferry(&[
                "host",
                "set",
                "host1",
                "--postcopy",
                "forbid",
                "--throttle",
                "allow",
                "--migration-option",
                "auto",
            ]);
        }
    }
    let _reset = Reset;
    ferry_ok(&[
        "host",
        "set",
        "host1",
        "--migration-option",
        "tcp",
        "--postcopy",
        "allow",
        "--throttle",
        "forbid",
    ]);
    let (r, events) = move_busy("busy1", "host2", &[], || {});
    assert_eq!(r["option"], "tcp", "{r}");
    assert_eq!(r["event"], "completed", "{r}");
    assert_eq!(r["phase"], "postcopy", "{r}");
    let step = events
        .iter()
        .find(|e| e["step"] == "postcopy")
        .expect("a postcopy step");
    assert!(
        step["detail"].as_str().unwrap().contains("dirties"),
        "{step}"
    );
    assert!(events
        .iter()
        .any(|e| e["event"] == "progress" && e["phase"] == "postcopy"));
    assert_intact_on("busy1", "host2");
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn a_busy_guest_fails_clearly_with_postcopy_forbidden_and_stays_on_the_source() {
    require_lab();
    let _g = serial();
    lab_at(3, 2, RATE);
    let _vm = busy("busy2");
    let (r, _) = move_busy(
        "busy2",
        "host2",
        &[
            "--option",
            "tcp",
            "--postcopy",
            "forbid",
            "--throttle",
            "forbid",
            "--timeout-per-gib",
            "20",
        ],
        || panic!("post-copy started although forbidden"),
    );
    assert_eq!(r["event"], "failed", "{r}");
    let reason = r["error"]["reason"].as_str().unwrap();
    assert!(reason.contains("did not converge within 20 s"), "{reason}");
    assert!(
        reason.contains("the guest dirties") && reason.contains("the path moves"),
        "{reason}"
    );
    assert_eq!(r["error"]["running_on"], "host1");
    assert_intact_on("busy2", "host1");
    assert!(qemu_pids("host2").is_empty(), "skeleton left on host2");
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn postcopy_survives_a_nic_cut() {
    require_lab();
    let _g = serial();
    lab_at(3, 2, RATE);
    let _vm = busy("busy3");
    let (r, _) = move_busy(
        "busy3",
        "host3",
        &[
            "--option",
            "multichannel",
            "--postcopy",
            "allow",
            "--throttle",
            "forbid",
        ],
        || {
            ferry_ok(&["lab", "link", "host3", "nic2", "down"]);
        },
    );
    ferry_ok(&["lab", "link", "host3", "nic2", "up"]);
    if r["event"] != "completed" {
        // what both transports saw, for the report
        for h in ["host1", "host3"] {
            eprintln!("--- {h} agent.log (tail) ---\n{}", agent_log_tail(h, 40));
        }
    }
    assert_eq!(r["event"], "completed", "{r}");
    assert_eq!(r["phase"], "postcopy", "{r}");
    let nic2 = r["carriers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["nic"] == nic("host1", 2).as_str())
        .unwrap()
        .clone();
    assert!(
        nic2["failures"].as_u64().unwrap() >= 1,
        "the cut was not noticed: {r}"
    );
    assert_intact_on("busy3", "host3");
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn a_busy_guest_is_paused_and_copied_at_expiry_when_chosen() {
    require_lab();
    let _g = serial();
    lab_at(3, 2, RATE);
    let _vm = busy("busy4");
    let (r, events) = move_busy(
        "busy4",
        "host2",
        &[
            "--option",
            "tcp",
            "--postcopy",
            "forbid",
            "--throttle",
            "forbid",
            "--timeout-per-gib",
            "20",
            "--at-expiry",
            "pause",
        ],
        || panic!("post-copy started although forbidden"),
    );
    assert_eq!(r["event"], "completed", "{r}");
    assert_eq!(r["phase"], "pause-and-copy", "{r}");
    let step = events
        .iter()
        .find(|e| e["step"] == "pause-and-copy")
        .expect("a pause-and-copy step");
    let detail = step["detail"].as_str().unwrap();
    assert!(
        detail.contains("did not converge within 20 s") && detail.contains("the guest dirties"),
        "{detail}"
    );
    // the prediction said so before the pause: not converging at these rates
    assert!(
        events.iter().any(|e| e["event"] == "progress"
            && e["phase"] == "precopy"
            && e["converging"] == false),
        "no progress event predicted non-convergence"
    );
    // the guest really was paused for the copy: far beyond the 300 ms target
    assert!(r["downtime_ms"].as_u64().unwrap() > 300, "{r}");
    assert_intact_on("busy4", "host2");
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn postcopy_survives_losing_every_path_for_seconds() {
    require_lab();
    let _g = serial();
    lab_at(3, 2, RATE);
    let _vm = busy("busy5");
    let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let restorer = std::sync::Arc::new(std::sync::Mutex::new(None));
    let (r, events) = {
        let cut = cut.clone();
        let restorer = restorer.clone();
        move_busy(
            "busy5",
            "host3",
            &[
                "--option",
                "multichannel",
                "--postcopy",
                "allow",
                "--throttle",
                "forbid",
            ],
            move || {
                // every path between source and target down for 3 s, in the
                // middle of post-copy: 1.5 s after the switch, when the guest
                // already runs on the target and pulls pages over the paths
                *restorer.lock().unwrap() = Some(std::thread::spawn(move || {
                    std::thread::sleep(std::time::Duration::from_millis(1500));
                    ferry_ok(&["lab", "link", "host3", "nic1", "down"]);
                    ferry_ok(&["lab", "link", "host3", "nic2", "down"]);
                    cut.store(true, std::sync::atomic::Ordering::SeqCst);
                    std::thread::sleep(std::time::Duration::from_secs(3));
                    ferry_ok(&["lab", "link", "host3", "nic1", "up"]);
                    ferry_ok(&["lab", "link", "host3", "nic2", "up"]);
                }));
            },
        )
    };
    if let Some(t) = restorer.lock().unwrap().take() {
        t.join().unwrap();
    }
    assert!(
        cut.load(std::sync::atomic::Ordering::SeqCst),
        "never reached post-copy: {r}"
    );
    assert_eq!(r["event"], "completed", "{r}");
    assert_eq!(r["phase"], "postcopy", "{r}");
    // the outage was real: at some point no carrier was up
    assert!(
        events
            .iter()
            .any(|e| e["event"] == "progress" && e["phase"] == "postcopy" && e["carriers_up"] == 0),
        "no progress event saw every carrier down"
    );
    for c in r["carriers"].as_array().unwrap() {
        assert!(c["failures"].as_u64().unwrap() >= 1, "{c}");
    }
    assert_intact_on("busy5", "host3");
}

/// A move over QEMU's own TCP stream, post-copy allowed, no throttling.
const POSTCOPY_TCP: &[&str] = &[
    "--option",
    "tcp",
    "--postcopy",
    "allow",
    "--throttle",
    "forbid",
];

/// Every TCP connection between host1 and host2's migration addresses,
/// reset at both ends (`ss -K`): a break TCP cannot ride out.
fn reset_connections_to_host2() {
    for k in 1..=2 {
        let addr = nic_addr("host2", k);
        for (ns, dir) in [("host1", "dst"), ("host2", "src")] {
            let out = Command::new("ip")
                .args(["netns", "exec", ns, "ss", "-K", "-t", dir, &addr])
                .output()
                .unwrap();
            assert!(out.status.success(), "ss -K in {ns}: {out:?}");
        }
    }
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn postcopy_whose_stream_is_reset_and_whose_paths_are_down_20_s_recovers_with_every_page() {
    require_lab();
    let _g = serial();
    lab_at(3, 2, RATE);
    let _vm = busy("busy6");
    struct Up;
    impl Drop for Up {
        fn drop(&mut self) {
            ferry(&["lab", "link", "host2", "nic1", "up"]);
            ferry(&["lab", "link", "host2", "nic2", "up"]);
        }
    }
    let _up = Up;
    let cut = std::sync::Arc::new(std::sync::Mutex::new(None));
    let (r, events) = {
        let cut = cut.clone();
        move_busy(
            "busy6",
            "host2",
            &[
                "--option",
                "tcp",
                "--postcopy",
                "allow",
                "--throttle",
                "forbid",
            ],
            move || {
                // in the middle of post-copy, with the guest running on the
                // target: QEMU's stream reset and every path of the target
                // down for 20 s
                *cut.lock().unwrap() = Some(std::thread::spawn(|| {
                    std::thread::sleep(Duration::from_millis(1500));
                    ferry_ok(&["lab", "link", "host2", "nic1", "down"]);
                    ferry_ok(&["lab", "link", "host2", "nic2", "down"]);
                    reset_connections_to_host2();
                    std::thread::sleep(Duration::from_secs(20));
                    ferry_ok(&["lab", "link", "host2", "nic1", "up"]);
                    ferry_ok(&["lab", "link", "host2", "nic2", "up"]);
                    Instant::now()
                }));
            },
        )
    };
    let restored = cut
        .lock()
        .unwrap()
        .take()
        .expect("never reached post-copy")
        .join()
        .unwrap();
    if r["event"] != "completed" {
        for h in ["host1", "host2"] {
            eprintln!("--- {h} agent.log (tail) ---\n{}", agent_log_tail(h, 40));
        }
    }
    assert_eq!(r["event"], "completed", "{r}");
    assert_eq!(r["phase"], "postcopy", "{r}");
    // QEMU saw the break, and the move resumed it on a new stream
    assert!(
        events
            .iter()
            .any(|e| e["event"] == "progress" && e["status"] == "postcopy-paused"),
        "post-copy never paused"
    );
    let resumed = events
        .iter()
        .find(|e| e["event"] == "step" && e["step"] == "postcopy-recover")
        .expect("a postcopy-recover step");
    assert!(
        resumed["detail"].as_str().unwrap().contains("resumed over"),
        "{resumed}"
    );
    // it completed only after the paths returned: nothing moved meanwhile
    assert!(restored.elapsed() < Duration::from_secs(120));
    // every page arrived: no integrity error, and the guest runs on. A vCPU
    // that faulted on a page just before the cut waited the whole 20 s for
    // it, which the guest's kernel may report as a soft lockup (its
    // threshold is 20 s): what any guest would see of such an outage, and
    // the only problem allowed here
    let t = Instant::now();
    let c = loop {
        let c = check("busy6");
        if c["advancing"] == true || t.elapsed() > Duration::from_secs(30) {
            break c;
        }
        std::thread::sleep(Duration::from_secs(2));
    };
    assert_eq!(c["host"], "host2", "{c}");
    assert_eq!(
        (&c["running"], &c["advancing"]),
        (&Value::Bool(true), &Value::Bool(true)),
        "{c}"
    );
    assert_eq!(c["errors"], 0, "{c}");
    let problems = c["problems"].as_array().unwrap();
    assert!(
        problems
            .iter()
            .all(|p| p.as_str().unwrap().contains("soft lockup")),
        "{c}"
    );
    assert!(qemu_pids("host1").is_empty(), "the source QEMU is left");
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn postcopy_whose_source_agent_is_killed_mid_way_keeps_the_source_qemu_until_completed() {
    require_lab();
    let _g = serial();
    lab_at(3, 2, RATE);
    let _armed = Armed::at("host1", "source-postcopy-running=exit");
    let _vm = busy("busy7");
    // the source agent dies once the target runs the guest, pages still
    // to come: the move's stream ends without a report
    let (r, _) = move_busy("busy7", "host2", POSTCOPY_TCP, || {});
    assert_ne!(r["event"], "completed", "{r}");
    // the source's record: an encrypted tcp move is in QEMU's own TLS, not
    // Ferry's sealed carriers, so a restarted agent may still recover its
    // post-copy stream (in TLS)
    let records: Vec<String> = std::fs::read_dir(format!("{LAB}/host1/migrations"))
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.unwrap().path()).ok())
        .filter(|t| t.contains("\"busy7\""))
        .collect();
    assert!(!records.is_empty(), "no journal record of busy7's move");
    for r in &records {
        assert!(!r.contains("\"sealed\""), "{r}");
    }
    restart_agent_with("host1", "");
    // the guest runs whole on the target; the source QEMU, which kept the
    // pages it still needed, is gone once QEMU said completed
    wait_settled_on("busy7", "host2", "host1", Duration::from_secs(120));
    assert_intact_on("busy7", "host2");
    let log = std::fs::read_to_string(format!("{LAB}/host1/agent.log")).unwrap();
    let settled = log
        .lines()
        .rfind(|l| l.contains("busy7") && l.contains("settled: host2 runs the guest"))
        .expect("settled by the restarted agent");
    assert!(settled.contains("its migration completed"), "{settled}");
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn refused_postcopy_discards_the_skeleton_and_the_source_runs_on() {
    require_lab();
    let _g = serial();
    lab_at(3, 2, RATE);
    // the commit is held past the waiting skeleton's question to its source,
    // which must not make the skeleton run: QEMU never switches
    let _armed = Armed::at(
        "host1",
        "source-after-commit=delay,source-start-postcopy=fail",
    );
    let _vm = busy("busy8");
    let (r, _) = move_busy("busy8", "host2", POSTCOPY_TCP, || {});
    assert_eq!(r["event"], "failed", "{r}");
    assert_eq!(r["error"]["running_on"], "host1", "{r}");
    let reason = r["error"]["reason"].as_str().unwrap();
    assert!(
        reason.contains("refused") && reason.contains("discarded its skeleton"),
        "{reason}"
    );
    assert_intact_on("busy8", "host1");
    assert!(qemu_pids("host2").is_empty(), "skeleton left on host2");
    let skeleton = one_file(&format!("{LAB}/host2/log"), "busy8.", ".target.qemu.log");
    assert_eq!(runs_in(&skeleton), 0, "the skeleton ran");
    let log = std::fs::read_to_string(format!("{LAB}/host2/agent.log")).unwrap();
    assert!(
        log.lines().any(|l| l.contains("busy8")
            && l.contains(
                "the source committed, but this skeleton's QEMU does not hold the guest"
            )),
        "the skeleton did not ask its source while the commit was held"
    );
}
