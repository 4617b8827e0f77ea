//! The lab itself: up, status, link cuts, down — also of a half-made lab.
//! Needs root (see common/mod.rs); the tests are #[ignore]d; scripts/run test includes them.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;

fn link_state(status: &serde_json::Value, host: &str, nic: &str) -> String {
    status["links"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["host"] == host && l["nic"] == nic)
        .map(|l| l["state"].as_str().unwrap().to_string())
        .unwrap_or_else(|| panic!("{host} {nic} not in status"))
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn lab_up_status_link_cut_and_down() {
    require_lab();
    let _g = serial();
    ferry_ok(&[
        "lab",
        "up",
        "--replace",
        "--hosts",
        "2",
        "--nics",
        "3",
        "--rate",
        "500mbit",
        "--mtu",
        "9000",
        "--cpus",
        "split",
    ]);
    // a second `lab up` without --replace is refused
    let out = ferry(&["lab", "up"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("already up"));

    let st = ferry_json(&["lab", "status"]);
    assert_eq!(st["links"].as_array().unwrap().len(), 6);
    for l in st["links"].as_array().unwrap() {
        assert_eq!(l["mtu"], 9000, "{l}");
        assert_eq!(l["state"], "UP", "{l}");
        let a = l["address"].as_str().unwrap();
        assert!(a.starts_with("198.18.") || a.starts_with("198.19."), "{l}");
    }
    let agents = st["agents"].as_array().unwrap();
    assert_eq!(agents.len(), 2, "one agent per host: {st}");
    assert!(agents.iter().all(|a| a["running"] == true), "{st}");
    // --cpus split: each agent runs only on its host's CPUs, which the
    // other host's do not include (on a machine of at least two)
    let cpus = |h: &str| {
        let a = agents.iter().find(|a| a["host"] == h).unwrap();
        assert_eq!(
            a["cpus_allowed"], a["cpus"],
            "{h}'s agent runs outside its CPUs: {st}"
        );
        ferry_lab::cpuset::parse_list(a["cpus"].as_str().unwrap()).unwrap()
    };
    let (c1, c2) = (cpus("host1"), cpus("host2"));
    if ferry_lab::cpuset::online().unwrap().len() >= 2 {
        assert!(c1.iter().all(|c| !c2.contains(c)), "hosts share CPUs: {st}");
    }
    // and so do its QEMUs, every thread of them
    ferry_ok(&[
        "vm", "create", "pin1", "--host", "host2", "--memory", "256M",
    ]);
    let pids = qemu_pids("host2");
    assert_eq!(pids.len(), 1, "one guest QEMU on host2");
    let tasks = std::fs::read_dir(format!("/proc/{}/task", pids[0])).unwrap();
    let mut n = 0;
    for t in tasks.flatten() {
        let tid: u32 = t.file_name().to_string_lossy().parse().unwrap();
        let allowed = ferry_lab::cpuset::allowed(tid).unwrap_or_default();
        let allowed = ferry_lab::cpuset::parse_list(&allowed).unwrap();
        assert!(
            allowed.iter().all(|c| c2.contains(c)),
            "QEMU thread {tid} may run on {allowed:?}, outside host2's {c2:?}"
        );
        n += 1;
    }
    assert!(n > 1, "QEMU has threads");
    ferry_ok(&["vm", "rm", "pin1"]);
    // a wrong --cpus is refused, naming what was wrong, and leaves the lab as it is
    let out = ferry(&[
        "lab",
        "up",
        "--replace",
        "--hosts",
        "2",
        "--cpus",
        "host9=0",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("host9"), "{err}");
    assert!(ferry_json(&["lab", "status"])["agents"][0]["running"] == true);
    // shaped: tbf at 500mbit on the host side of each NIC
    let tc = std::process::Command::new("ip")
        .args(["netns", "exec", "host1", "tc", "qdisc", "show", "dev"])
        .arg(nic("host1", 2))
        .output()
        .unwrap();
    let tc = String::from_utf8_lossy(&tc.stdout);
    assert!(tc.contains("tbf") && tc.contains("500Mbit"), "{tc}");

    ferry_ok(&["lab", "link", "host2", "nic3", "down"]);
    assert_ne!(
        link_state(&ferry_json(&["lab", "status"]), "host2", &nic("host2", 3)),
        "UP"
    );
    let hosts = ferry_json(&["host", "list"]);
    let h2 = hosts
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["name"] == "host2")
        .unwrap();
    let nic3 = h2["info"]["nics"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == nic("host2", 3).as_str())
        .unwrap();
    assert_eq!(nic3["up"], false, "the agent sees the cut: {nic3}");
    ferry_ok(&["lab", "link", "host2", "nic3", "up"]);
    assert_eq!(
        link_state(&ferry_json(&["lab", "status"]), "host2", &nic("host2", 3)),
        "UP"
    );

    ferry_ok(&["lab", "down"]);
    let ns = String::from_utf8_lossy(
        &std::process::Command::new("ip")
            .args(["netns", "list"])
            .output()
            .unwrap()
            .stdout,
    )
    .into_owned();
    assert!(
        !ns.contains("host1") && !ns.contains("ferry-fab"),
        "namespaces left: {ns}"
    );
    let out = ferry(&["lab", "status"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("No lab is up"));
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn lab_down_removes_a_half_made_lab() {
    require_lab();
    let _g = serial();
    ferry_ok(&["lab", "down"]);
    // what a crash part-way through `lab up` leaves behind
    let ip = |args: &[&str]| {
        assert!(
            std::process::Command::new("ip")
                .args(args)
                .status()
                .unwrap()
                .success(),
            "ip {args:?}"
        )
    };
    ip(&["link", "add", "ferry-mgmt", "type", "bridge"]);
    ip(&["netns", "add", "host1"]);
    ip(&["netns", "add", "ferry-fab1"]);
    ip(&[
        "link", "add", "fm-h1", "type", "veth", "peer", "name", "mgmt0", "netns", "host1",
    ]);
    let out = ferry_ok(&["lab", "down"]);
    assert!(out.contains("lab removed"), "{out}");
    let ns = String::from_utf8_lossy(
        &std::process::Command::new("ip")
            .args(["netns", "list"])
            .output()
            .unwrap()
            .stdout,
    )
    .into_owned();
    assert!(!ns.contains("host1") && !ns.contains("ferry-fab1"), "{ns}");
    let links = String::from_utf8_lossy(
        &std::process::Command::new("ip")
            .args(["link", "show"])
            .output()
            .unwrap()
            .stdout,
    )
    .into_owned();
    assert!(
        !links.contains("ferry-mgmt") && !links.contains("fm-h1"),
        "{links}"
    );
    // and a lab comes up cleanly afterwards
    ferry_ok(&["lab", "up", "--hosts", "1", "--nics", "1"]);
    ferry_ok(&["lab", "down"]);
}

/// This host's route to a peer's team address, as `ip route` prints it.
fn team_route(host: &str, peer_team_addr: &str) -> String {
    let out = std::process::Command::new("ip")
        .args(["-n", host, "route", "show", peer_team_addr])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A ping between the two hosts' team addresses (from host1's).
fn team_ping() -> bool {
    std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            "host1",
            "ping",
            "-c",
            "1",
            "-W",
            "1",
            "-I",
            "198.19.0.11",
            "198.19.0.12",
        ])
        .output()
        .unwrap()
        .status
        .success()
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn active_backup_team_moves_both_ends_off_a_cut_link() {
    require_lab();
    let _g = serial();
    lab_at(2, 2, "500mbit");
    let out = ferry_ok(&["lab", "team", "active-backup"]);
    assert!(out.contains("host1: migrate to 198.19.0.11"), "{out}");
    assert!(out.contains("monitors started"), "{out}");
    assert!(team_route("host1", "198.19.0.12").contains(&format!("dev {}", nic("host1", 1))));
    assert!(team_route("host2", "198.19.0.11").contains(&format!("dev {}", nic("host2", 1))));
    assert!(team_ping(), "the team addresses reach each other over nic1");
    // host1's active cable pulled: both ends move to fabric 2, as a bond's ARP
    // monitor would make them
    ferry_ok(&["lab", "link", "host1", "nic1", "down"]);
    let t0 = std::time::Instant::now();
    while !(team_route("host1", "198.19.0.12").contains(&format!("dev {}", nic("host1", 2)))
        && team_route("host2", "198.19.0.11").contains(&format!("dev {}", nic("host2", 2))))
    {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(3),
            "routes not moved 3 s after the cut: host1 {:?}, host2 {:?}",
            team_route("host1", "198.19.0.12"),
            team_route("host2", "198.19.0.11")
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(team_ping(), "the team addresses reach each other over nic2");
    let log = std::fs::read_to_string("/run/ferry/lab/host2/team-monitor.log").unwrap();
    assert!(log.contains("route moved to fabric 2"), "{log}");
    ferry_ok(&["lab", "link", "host1", "nic1", "up"]);
    // `team none` stops the monitors and removes the team's routes
    ferry_ok(&["lab", "team", "none"]);
    assert!(!std::path::Path::new("/run/ferry/lab/host1/team-monitor.pid").exists());
    assert_eq!(team_route("host1", "198.19.0.12"), "");
    let monitors: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains("lab team-monitor"))
        .collect();
    assert!(monitors.is_empty(), "monitors left running: {monitors:?}");
    ferry_ok(&["lab", "down"]);
}
