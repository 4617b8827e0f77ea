//! High availability in the lab: a host powered off has its HA VMs booted
//! elsewhere (its disk fenced first) and its other VMs shown stopped; an
//! agent killed and restarted starts no failover; a host cut from the
//! management network stops its HA guests itself before they start
//! elsewhere, and rejoins cleanly; a fence hook powers a host off before
//! its HA VMs on a shared file restart; `vm stop|start|reboot|shutdown`.
//!
//! Needs root, QEMU ≥ 9 and iproute2; `#[ignore]`d, run by `scripts/run
//! test` and CI.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

fn vm(name: &str) -> Value {
    ferry_json(&["vm", "list"])
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .cloned()
        .unwrap_or(Value::Null)
}

fn health(host: &str) -> String {
    ferry_json(&["host", "list"])
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["name"] == host)
        .map(|h| h["health"].as_str().unwrap_or("").to_string())
        .unwrap_or_default()
}

fn events_of(kind: &str, subject: &str) -> Vec<Value> {
    events_matching(&[], kind, subject)
}

/// Waits until `name` runs on a host other than `from`; returns that host.
/// `each` is called every round before the VM is found elsewhere.
fn wait_elsewhere(name: &str, from: &str, within: Duration, mut each: impl FnMut()) -> String {
    let t0 = Instant::now();
    loop {
        let v = vm(name);
        if v["state"] == "running" && v["host"] != from {
            return v["host"].as_str().unwrap().to_string();
        }
        each();
        assert!(
            t0.elapsed() < within,
            "{name} did not run elsewhere within {within:?}: {v}\n{}",
            ferry_ok(&["events", "--limit", "40"])
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn wait_health(host: &str, want: &str, within: Duration) {
    let t0 = Instant::now();
    while health(host) != want {
        assert!(
            t0.elapsed() < within,
            "{host} is not {want} within {within:?}: {}",
            health(host)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; run with --include-ignored"]
fn a_fence_hook_powers_a_host_off_before_its_unfenceable_vms_restart() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    remove_vm("fvm");
    // the admin's power-off program: here it pulls the lab host's cord
    let hooks = std::path::Path::new("/run/ferry/lab/control/hooks");
    let called = "/run/ferry/lab/control/fence-called";
    let _ = std::fs::remove_file(called);
    let hook = hooks.join("fence-lab");
    std::fs::write(
        &hook,
        format!("#!/bin/sh\necho \"$FERRY_HOST\" >> {called}\nexec {FERRY} lab host \"$FERRY_HOST\" off\n"),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    // a name the hooks directory does not hold is refused, naming the field
    let out = ferry(&["cluster", "set", "--fence-hook", "no-such-hook"]);
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && text.contains("fence_hook"),
        "{text}"
    );
    ferry_ok(&["cluster", "set", "--fence-hook", "fence-lab"]);
    assert_eq!(ferry_json(&["cluster", "show"])["fence_hook"], "fence-lab");

    // an HA guest on a shared file: only a power-off fences it (the
    // workload's kernel booted as any kernel, so it may have drives)
    let shared = std::path::Path::new("/run/ferry/lab/shared");
    let image = ferry_ok(&["lab", "image"]);
    let image = image
        .split("guest image: ")
        .nth(1)
        .and_then(|r| r.split(" (").next())
        .unwrap();
    for f in ["vmlinux", "initrd.cpio"] {
        std::fs::copy(std::path::Path::new(image).join(f), shared.join(f)).unwrap();
    }
    let data = shared.join("fence-vm.raw");
    let f = std::fs::File::create(&data).unwrap();
    f.set_len(32 << 20).unwrap();
    ferry_ok(&[
        "vm",
        "create",
        "fvm",
        "--host",
        "host3",
        "--memory",
        "256M",
        "--kernel",
        &shared.join("vmlinux").display().to_string(),
        "--initrd",
        &shared.join("initrd.cpio").display().to_string(),
        "--append",
        "console=ttyS0 quiet cryptomgr.notests ferry.fill=0 ferry.dirty=0 ferry.verify=1 ferry.seed=41",
        "--ha",
        "--drive",
        &format!("path={},format=raw", data.display()),
    ]);
    let _v = VmGuard("fvm");
    let before = seq_past("host3", "fvm", 1);
    std::thread::sleep(Duration::from_secs(2));

    // host3 cut from the management network: alive, but unmanaged
    ferry_ok(&["lab", "host", "host3", "isolate", "--network", "management"]);
    let t0 = Instant::now();
    let to = wait_elsewhere("fvm", "host3", Duration::from_secs(90), || {});
    eprintln!(
        "fvm runs on {to} {:?} after host3's management was cut",
        t0.elapsed()
    );
    let said = std::fs::read_to_string(called).unwrap();
    assert_eq!(said.trim(), "host3", "the hook was run once, for host3");
    assert_eq!(events_of("host_powered_off", "host3").len(), 1);
    // the hook powered host3 off: no QEMU of it there
    assert!(qemu_pids("host3").is_empty());
    // the guest writes its shared disk on from where it was
    let after = seq_past(&to, "fvm", 0);
    assert!(after > 0 && before > 0, "fvm writes its disk on {to}");

    ferry_ok(&["lab", "host", "host3", "on"]);
    wait_health("host3", "ok", Duration::from_secs(30));
    ferry_ok(&["cluster", "set", "--fence-hook", ""]);
    assert!(ferry_json(&["cluster", "show"])["fence_hook"].is_null());
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; run with --include-ignored"]
fn failed_hosts_have_their_ha_vms_run_elsewhere_never_twice() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    // the storage fence alone: no power-off hook left from another test
    ferry_ok(&["cluster", "set", "--fence-hook", ""]);
    for v in ["ha1", "plain1", "ha2"] {
        remove_vm(v);
    }
    let disk = "ha-disk";
    let _ = ferry(&["disk", "rm", disk]);
    ferry_ok(&[
        "vm",
        "create",
        "ha1",
        "--host",
        "host1",
        "--memory",
        "256M",
        "--fill",
        "64M",
        "--seed",
        "31",
        "--ha",
        "--priority",
        "500",
    ]);
    let _a = VmGuard("ha1");
    ferry_ok(&["disk", "create", disk, "--size", "32M"]);
    ferry_ok(&["disk", "attach", disk, "ha1"]);
    ferry_ok(&[
        "vm", "create", "plain1", "--host", "host1", "--memory", "256M", "--fill", "64M",
    ]);
    let _p = VmGuard("plain1");
    ferry_ok(&[
        "vm", "create", "ha2", "--host", "host2", "--memory", "256M", "--fill", "64M", "--seed",
        "33", "--ha",
    ]);
    let _b = VmGuard("ha2");
    let before = seq_past("host1", "ha1", 2);
    assert_eq!(vm("ha1")["ha"]["enabled"], true);
    assert_eq!(vm("ha1")["ha"]["priority"], 500);
    // the leases are renewed and the agents know their HA guests
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(host_info("host1")["info"]["lease"]["state"], "leased");

    // 1. a pulled power cord
    let t0 = Instant::now();
    ferry_ok(&["lab", "host", "host1", "off"]);
    let to = wait_elsewhere("ha1", "host1", Duration::from_secs(60), || {});
    let took = t0.elapsed();
    eprintln!("ha1 runs on {to} {took:?} after host1 was powered off");
    // its disk: written on from where the old copy stopped, by the new one
    let after = seq_past(&to, "ha1", 0);
    assert!(after > 0, "ha1 writes its disk on {to}");
    assert_eq!(health("host1"), "failed");
    let failed = events_of("host_failed", "host1");
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(!events_of("vm_fenced", "ha1").is_empty());
    let r = events_of("ha_restart", "ha1");
    assert_eq!(r.len(), 1, "one restart: {r:?}");
    assert_eq!(r[0]["detail"]["from"], "host1");
    // the non-HA VM is shown stopped, with why
    let p = vm("plain1");
    assert_eq!(p["state"], "stopped", "{p}");
    assert!(
        p["stopped_because"]
            .as_str()
            .unwrap()
            .contains("host1 failed"),
        "{p}"
    );
    // started elsewhere only on an admin's word that host1 is off
    let out = ferry(&["vm", "start", "plain1", "--host", "host2"]);
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && text.contains("--confirm-powered-off"),
        "{text}"
    );
    ferry_ok(&[
        "vm",
        "start",
        "plain1",
        "--host",
        "host2",
        "--confirm-powered-off",
    ]);
    let p = vm("plain1");
    assert_eq!(
        (p["state"].as_str(), p["host"].as_str()),
        (Some("running"), Some("host2")),
        "{p}"
    );
    // a grant generation was raised: host1 can open nothing of ha1's now
    let access: Vec<Value> = serde_json::from_str(&curl_storage("/access")).unwrap();
    let a = access.iter().find(|a| a["vm"] == "ha1").unwrap();
    assert_eq!(a["hosts"], serde_json::json!([to.clone()]), "{a}");
    assert!(a["generation"].as_u64().unwrap() >= 1, "{a}");
    let _ = before;

    // back on: rejoins, runs nothing of what moved
    ferry_ok(&["lab", "host", "host1", "on"]);
    wait_health("host1", "ok", Duration::from_secs(30));
    assert!(!events_of("host_rejoined", "host1").is_empty());
    assert!(qemu_pids("host1").is_empty());

    // 2. an agent killed and restarted: no failover
    let pid = vm("ha2")["pid"].clone();
    kill_agent("host2");
    std::thread::sleep(Duration::from_secs(1));
    ferry_ok(&["lab", "restart-agent", "host2"]);
    std::thread::sleep(Duration::from_secs(10));
    assert!(events_of("host_failed", "host2").is_empty());
    let v = vm("ha2");
    assert_eq!(v["host"], "host2", "{v}");
    assert_eq!(v["pid"], pid, "the same QEMU runs on");
    assert_eq!(v["state"], "running");

    // 3. management cut: host2 stops ha2 itself before it starts elsewhere
    ferry_ok(&["lab", "host", "host2", "isolate", "--network", "management"]);
    let t0 = Instant::now();
    let to2 = wait_elsewhere("ha2", "host2", Duration::from_secs(60), || {});
    eprintln!(
        "ha2 runs on {to2} {:?} after host2's management was cut",
        t0.elapsed()
    );
    // by the time it runs elsewhere, host2 runs no QEMU of it
    assert!(
        !qemu_pids("host2").iter().any(|p| runs_guest(*p, "ha2")),
        "host2 still runs ha2's QEMU while ha2 runs on {to2}"
    );
    let fenced = events_of("host_failed", "host2");
    assert_eq!(fenced.len(), 1);
    assert!(
        fenced[0]["detail"]["evidence"]
            .as_str()
            .unwrap()
            .contains("stopped its HA guests"),
        "{fenced:?}"
    );
    ferry_ok(&["lab", "host", "host2", "on"]);
    wait_health("host2", "ok", Duration::from_secs(30));
    let v = vm("ha2");
    assert_eq!(v["host"], to2, "{v}");
    assert_eq!(host_info("host2")["info"]["lease"]["state"], "leased");

    // 4. lifecycle: a stopped VM keeps its definition and placement
    let out = ferry_ok(&["vm", "stop", "ha2"]);
    assert!(out.contains("stopped"), "{out}");
    let v = vm("ha2");
    assert_eq!(v["state"], "stopped", "{v}");
    assert_eq!(v["desired"], "stopped");
    assert_eq!(v["host"], to2);
    ferry_ok(&["vm", "start", "ha2"]);
    let v = vm("ha2");
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(v["host"], to2);
    ferry_ok(&["vm", "reboot", "ha2"]);
    // the workload guest has no ACPI handler: stopped at the timeout
    let r = ferry_json(&["vm", "shutdown", "ha2", "--timeout", "2"]);
    assert_eq!(r["how"], "stopped", "{r}");
    let out = ferry(&["vm", "stop", "ha2"]);
    assert!(!out.status.success(), "a stopped VM cannot be stopped");
    // a bad policy names its field
    let out = ferry(&["vm", "set", "ha1", "--priority", "5000"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("ha.priority"),
        "{out:?}"
    );
    ferry_ok(&["vm", "rm", "ha2"]);
    assert!(vm("ha2").is_null());
}

/// Whether QEMU process `pid` runs guest `vm`.
/// The storage node's REST answer at `path`, with the control service's certificate.
fn curl_storage(path: &str) -> String {
    let pki = "/run/ferry/lab/pki";
    let (status, body) = curl(
        &format!("https://198.18.0.1:7900/api/v1{path}"),
        &[
            "--cacert",
            &format!("{pki}/ca/ca-cert.pem"),
            "--cert",
            &format!("{pki}/control/cert.pem"),
            "--key",
            &format!("{pki}/control/key.pem"),
        ],
    );
    assert_eq!(status, 200, "{body}");
    body
}
