//! Several control instances on the lab's etcd: one leads, and killing it
//! in the middle of a failover leaves the failover to the next leader, which
//! finishes it — every HA VM of the failed host runs again, once.
//!
//! Needs root, QEMU ≥ 9, iproute2 and etcd (package etcd-server);
//! `#[ignore]`d, run by `scripts/run test` and CI.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const INSTANCES: u16 = 3;

fn url(port: u16) -> String {
    format!("https://127.0.0.1:{port}")
}

/// `ferry --control URL ARGS… --json`.
fn at(port: u16, args: &[&str]) -> Value {
    let u = url(port);
    let mut a = vec!["--control", u.as_str()];
    a.extend_from_slice(args);
    ferry_json(&a)
}

/// The leader's instance number (1 for `control1`, at port 7700) as
/// `port` sees it, once it has one.
fn leader_seen_by(port: u16, within: Duration) -> u16 {
    let t0 = Instant::now();
    loop {
        let st = at(port, &["cluster", "control"]);
        if let Some(l) = st["leader"].as_str() {
            return l.trim_start_matches("control").parse().unwrap();
        }
        assert!(t0.elapsed() < within, "no leader within {within:?}: {st}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn events(port: u16, kind: &str, subject: &str) -> Vec<Value> {
    events_matching(&["--control", &url(port)], kind, subject)
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9, iproute2 and etcd; run with --include-ignored"]
fn killing_the_leader_mid_failover_leaves_it_to_the_next() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    let out = ferry_ok(&[
        "lab",
        "control",
        "up",
        "--instances",
        &INSTANCES.to_string(),
    ]);
    assert!(out.contains("leader"), "{out}");
    // every instance names the same leader, and exactly one leads
    let leader = leader_seen_by(7700, Duration::from_secs(10));
    let leading: Vec<u16> = (0..INSTANCES)
        .filter(|i| at(7700 + i, &["cluster", "control"])["leading"] == true)
        .map(|i| i + 1)
        .collect();
    assert_eq!(leading, vec![leader]);
    for i in 0..INSTANCES {
        assert_eq!(leader_seen_by(7700 + i, Duration::from_secs(5)), leader);
    }
    let survivor = 7700 + (leader % INSTANCES); // another instance's port

    let disk = "leader-disk";
    for v in ["lead1", "lead2"] {
        ferry_ok(&[
            "--control",
            &url(survivor),
            "vm",
            "create",
            v,
            "--host",
            "host3",
            "--memory",
            "256M",
            "--fill",
            "32M",
            "--ha",
        ]);
    }
    let _a = VmGuard("lead1");
    let _b = VmGuard("lead2");
    ferry_ok(&["disk", "create", disk, "--size", "32M"]);
    ferry_ok(&["disk", "attach", disk, "lead1"]);
    seq_past("host3", "lead1", 1);
    std::thread::sleep(Duration::from_secs(2));

    // host3 loses its power; once the leader has judged it failed, the
    // leader dies too
    ferry_ok(&["lab", "host", "host3", "off"]);
    let t0 = Instant::now();
    while events(survivor, "host_failed", "host3").is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "host3 was not judged failed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let pidfile = if leader == 1 {
        "/run/ferry/lab/control/control.pid".to_string()
    } else {
        format!("/run/ferry/lab/control/control{leader}.pid")
    };
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: kill(2) with a pid and a signal has no memory effects.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let restarted_before = ["lead1", "lead2"]
        .iter()
        .filter(|v| !events(survivor, "ha_restart", v).is_empty())
        .count();
    eprintln!("leader control{leader} killed {restarted_before} restart(s) into the failover");

    // another instance leads, and finishes the failover
    let t1 = Instant::now();
    let next = loop {
        let l = at(survivor, &["cluster", "control"]);
        if l["leader"].is_string() && l["leader"] != format!("control{leader}") {
            break l["leader"].as_str().unwrap().to_string();
        }
        assert!(t1.elapsed() < Duration::from_secs(15), "no new leader: {l}");
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!("{next} leads {:?} after the kill", t1.elapsed());
    for v in ["lead1", "lead2"] {
        let t = Instant::now();
        let host = loop {
            let list = at(survivor, &["vm", "list"]);
            let me = list
                .as_array()
                .unwrap()
                .iter()
                .find(|x| x["name"] == v)
                .cloned()
                .unwrap_or(Value::Null);
            if me["state"] == "running" && me["host"] != "host3" {
                break me["host"].as_str().unwrap().to_string();
            }
            assert!(
                t.elapsed() < Duration::from_secs(90),
                "{v} does not run elsewhere: {me}"
            );
            std::thread::sleep(Duration::from_millis(500));
        };
        // once: one QEMU of it in the whole lab, one restart event
        let copies: usize = ["host1", "host2", "host3"]
            .iter()
            .map(|h| {
                qemu_pids(h)
                    .into_iter()
                    .filter(|p| runs_guest(*p, v))
                    .count()
            })
            .sum();
        assert_eq!(copies, 1, "{v} runs {copies} times");
        // one restart event: a VM the killed leader booted and did not
        // record yet is found running by the next one, which writes it
        // once it has judged the host failed itself
        let t = Instant::now();
        while events(survivor, "ha_restart", v).is_empty() {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "{v} runs on {host} with no ha_restart event"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        std::thread::sleep(Duration::from_secs(2));
        let r = events(survivor, "ha_restart", v);
        assert_eq!(r.len(), 1, "{v} restarted once: {r:?}");
        eprintln!("{v} runs on {host}");
    }
    // the disk is written on from the new host
    let host = at(survivor, &["vm", "list"])
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["name"] == "lead1")
        .unwrap()["host"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(seq_past(&host, "lead1", 0) > 0);
    assert!(!events(survivor, "leader", &next).is_empty());

    // the killed instance comes back as a follower
    ferry_ok(&[
        "lab",
        "restart",
        "control",
        "--instance",
        &leader.to_string(),
    ]);
    let back = 7700 + leader - 1;
    let t2 = Instant::now();
    loop {
        let st = ferry(&["--control", &url(back), "cluster", "control", "--json"]);
        if st.status.success() {
            let st: Value = serde_json::from_slice(&st.stdout).unwrap();
            assert_eq!(st["leading"], false, "{st}");
            assert_eq!(st["leader"], next.as_str());
            break;
        }
        assert!(t2.elapsed() < Duration::from_secs(20));
        std::thread::sleep(Duration::from_millis(300));
    }
    ferry_ok(&["lab", "host", "host3", "on"]);
    let _ = ferry(&["--control", &url(survivor), "disk", "detach", disk, "lead1"]);
}
