//! `ferry host validate` in the lab: a clean lab passes; an MTU mismatch, a
//! cut link and a path shaped far below the others are each found and named;
//! a move over a failed path warns first.
//! Needs root and QEMU ≥ 9 (see common/mod.rs); the tests are #[ignore]d; scripts/run test includes them.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use serde_json::Value;

fn validate(args: &[&str]) -> (i32, Value) {
    let mut a = vec!["host", "validate"];
    a.extend_from_slice(args);
    a.push("--json");
    let out = ferry(&a);
    let v: Value = serde_json::from_slice(&out.stdout).expect("validate --json prints JSON");
    (out.status.code().unwrap_or(-1), v)
}

fn rows<'a>(r: &'a Value, check: &str, status: &str) -> Vec<&'a Value> {
    r["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["check"] == check && c["status"] == status)
        .collect()
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn validation_finds_and_names_mtu_mismatch_cut_link_and_slow_path() {
    require_lab();
    let _g = serial();
    lab(3, 2);

    // a clean lab passes: no failure, and what cannot be checked says why
    let (code, clean) = validate(&["--all"]);
    assert_eq!(code, 0, "{clean:#}");
    assert_eq!(clean["failed"], 0);
    assert!(clean["passed"].as_u64().unwrap() > 20);
    for c in rows(&clean, "throughput", "pass") {
        assert!(
            c["observed"]
                .as_str()
                .unwrap()
                .contains("of the 1.00 Gbit/s link rate"),
            "{c}"
        );
    }
    for c in clean["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["status"] == "not_available")
    {
        assert!(
            !c["observed"].as_str().unwrap().is_empty(),
            "n/a without a reason: {c}"
        );
    }

    // an MTU mismatch on one host's NIC
    ferry_ok(&["lab", "mtu", "host2", "nic1", "1400"]);
    let (code, r) = validate(&["--all", "--throughput-ms", "0"]);
    ferry_ok(&["lab", "mtu", "host2", "nic1", "1500"]);
    assert_eq!(code, 1);
    let mtu = rows(&r, "mtu", "fail");
    assert_eq!(mtu.len(), 1, "{mtu:?}");
    assert_eq!(
        (mtu[0]["host"].as_str(), mtu[0]["nic"].as_str()),
        (Some("host2"), Some(nic("host2", 1).as_str()))
    );
    let paths = rows(&r, "mtu-path", "fail");
    assert!(!paths.is_empty());
    for p in &paths {
        assert_eq!(p["peer"], "host2", "{p}");
        assert!(
            p["observed"]
                .as_str()
                .unwrap()
                .contains(&format!("host2 {} has MTU 1400", nic("host2", 1))),
            "{p}"
        );
    }

    // a cut link
    ferry_ok(&["lab", "link", "host3", "nic2", "down"]);
    let (code, r) = validate(&["host3", "--throughput-ms", "0"]);
    ferry_ok(&["lab", "link", "host3", "nic2", "up"]);
    assert_eq!(code, 1);
    let link = rows(&r, "link", "fail");
    assert_eq!(link.len(), 1, "{link:?}");
    assert_eq!(
        (link[0]["host"].as_str(), link[0]["nic"].as_str()),
        (Some("host3"), Some(nic("host3", 2).as_str()))
    );
    let mtu_fails = rows(&r, "mtu-path", "fail");
    assert!(
        !mtu_fails.is_empty(),
        "the cut path fails its MTU probe too"
    );
    assert!(mtu_fails
        .iter()
        .all(|p| p["observed"].as_str().unwrap().contains("path is down")));

    // back up: validation at once may find the NIC reaching nothing (its
    // neighbour entries failed while it was down resolve again within a
    // second or two); seconds later it reaches its peers, probed afresh
    // rather than read back from what that first probe cached
    validate(&["--all", "--throughput-ms", "0"]);
    std::thread::sleep(std::time::Duration::from_secs(3));
    let (_, r) = validate(&["host3", "--throughput-ms", "0"]);
    let reach = rows(&r, "reach", "fail");
    assert!(reach.is_empty(), "{reach:?}");

    // a path shaped far below the others
    ferry_ok(&["lab", "rate", "host1", "nic2", "50mbit"]);
    let (code, r) = validate(&["host1"]);
    assert_eq!(code, 1);
    let slow = rows(&r, "throughput", "fail");
    assert!(!slow.is_empty());
    for s in &slow {
        assert_eq!(
            (s["host"].as_str(), s["nic"].as_str()),
            (Some("host1"), Some(nic("host1", 2).as_str())),
            "{s}"
        );
    }
    let fast = rows(&r, "throughput", "pass");
    assert!(!fast.is_empty(), "nic1's paths pass");
    assert!(fast.iter().all(|p| p["nic"] == nic("host1", 1).as_str()));

    // a move between hosts whose path validation marked failed warns first
    let _vm = VmGuard::create("val1", "host1", "256M", "64M");
    let out = ferry(&[
        "vm", "move", "val1", "--to", "host2", "--option", "tcp", "--json",
    ]);
    ferry_ok(&["lab", "rate", "host1", "nic2", "1gbit"]);
    let events: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(events.first().unwrap()["event"], "warning", "{events:?}");
    assert!(events[0]["message"]
        .as_str()
        .unwrap()
        .contains(&format!("host1 {}", nic("host1", 2))));
    assert_eq!(events.last().unwrap()["event"], "completed");

    // and with the lab repaired, validation is clean again
    let (code, r) = validate(&["--all", "--throughput-ms", "500"]);
    assert_eq!(code, 0, "{r:#}");
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn validate_needs_a_known_host() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    let out = ferry(&["host", "validate", "host9"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("No host named 'host9'"));
    let out = ferry(&["host", "validate"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--all"));
}
