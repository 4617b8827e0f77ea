//! The attack suite: every boundary tried the way an attacker would, through
//! the public paths — the CLI and REST with an operator's or a read-only
//! user's token, an agent's API with a peer agent's certificate, the
//! control service with no credential at all, and a guest misbehaving from
//! inside its VM. Each attempt must be refused with an error that names
//! what was wrong, be logged, and leave nothing behind: no file read or
//! written, no process started, no VM changed. SECURITY.md lists who may do
//! what; each case here names the hole it closes.
//!
//! Needs root, QEMU ≥ 9, iproute2, curl and qemu-img; `#[ignore]`d, run by
//! `scripts/run test` and CI.

#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const PKI: &str = "/run/ferry/lab/pki";
const SHARED: &str = "/run/ferry/lab/shared";
const CA_KEY: &str = "/run/ferry/lab/pki/ca/ca-key.pem";

fn ca() -> String {
    format!("{PKI}/ca/ca-cert.pem")
}

/// A scratch directory of this test run, removed when dropped.
fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("ferry-attacks-")
        .tempdir()
        .unwrap()
}

/// An API token of `role`, written to a file in `dir`.
fn token(dir: &Path, role: &str) -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!("att-{role}-{}-{n}", std::process::id());
    let t = ferry_json(&["token", "create", &name, "--role", role]);
    let p = dir.join(format!("{role}.token"));
    std::fs::write(&p, t["token"].as_str().unwrap()).unwrap();
    p.display().to_string()
}

/// stderr of a command that must have failed.
fn refused(out: &std::process::Output) -> String {
    assert!(
        !out.status.success(),
        "the attempt succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Everything a VM named `vm` would leave on `host`: its directory, under
/// any suffix (skeletons are `VM.in-ID`).
fn leftovers(host: &str, vm: &str) -> Vec<PathBuf> {
    let dir = Path::new(LAB).join(host).join("vms");
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n == vm || n.starts_with(&format!("{vm}.")))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Asserts an attempt to create `vm` on host1 left nothing: no VM listed,
/// no directory, no more QEMUs than `qemus` before it.
fn nothing_started(vm: &str, qemus: usize) {
    let listed = ferry_json(&["vm", "list"]);
    assert!(
        !listed.as_array().unwrap().iter().any(|v| v["name"] == vm),
        "{vm} is listed: {listed}"
    );
    assert_eq!(leftovers("host1", vm), Vec::<PathBuf>::new());
    assert_eq!(qemu_pids("host1").len(), qemus, "a QEMU was started");
}

/// The refused events the control service logged since `after` (ms).
fn refusals_since(after: u64) -> Vec<Value> {
    let ev = ferry_json(&["events", "--limit", "500"]);
    ev.as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "refused" && e["at_ms"].as_u64().unwrap_or(0) >= after)
        .cloned()
        .collect()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Waits until the event log has a refusal since `after` whose reason
/// contains `says` (events are written in the background).
fn logged(after: u64, says: &str) {
    let t0 = Instant::now();
    loop {
        let r = refusals_since(after);
        if r.iter().any(|e| e["detail"].to_string().contains(says)) {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "no refusal saying {says:?} logged: {r:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// An operator is not root on a host: every host resource a spec names is
/// the host's to grant, and every string reaching QEMU is checked.
#[test]
#[ignore = "lab: needs root, QEMU >= 9, iproute2, curl and qemu-img; run with --include-ignored"]
fn an_operator_cannot_reach_the_hosts_files_bridges_or_qemus_options() {
    require_lab();
    let _g = serial();
    lab(3, 1);
    let dir = scratch();
    let op = token(dir.path(), "operator");
    let qemus = qemu_pids("host1").len();
    let t0 = now_ms();
    let create = |extra: &[&str]| {
        let mut a = vec![
            "vm", "create", "att1", "--host", "host1", "--memory", "256M",
        ];
        a.extend_from_slice(extra);
        ferry_as(&op, &a)
    };
    // 1. the cluster CA's key as a guest's disk (the first hole)
    let e = refused(&create(&[
        "--firmware",
        "bios",
        "--drive",
        &format!("path={CA_KEY}"),
    ]));
    assert!(
        e.contains("does not grant drives[0].path")
            && e.contains("drive_dirs")
            && e.contains(SHARED),
        "{e}"
    );
    nothing_started("att1", qemus);
    logged(t0, "drives[0].path");
    // 2. the same through a symlink inside the granted directory
    std::fs::create_dir_all(SHARED).unwrap();
    let link = Path::new(SHARED).join(format!("att-link-{}.img", std::process::id()));
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(CA_KEY, &link).unwrap();
    let e = refused(&create(&[
        "--firmware",
        "bios",
        "--drive",
        &format!("path={}", link.display()),
    ]));
    assert!(e.contains("does not grant drives[0].path"), "{e}");
    std::fs::remove_file(&link).unwrap();
    nothing_started("att1", qemus);
    // 3. /etc/shadow as the kernel QEMU loads
    let e = refused(&create(&["--kernel", "/etc/shadow"]));
    assert!(
        e.contains("kernel.kernel") && e.contains("kernel_dirs"),
        "{e}"
    );
    nothing_started("att1", qemus);
    // 4. options spliced onto -machine
    let e = refused(&create(&[
        "--machine",
        "pc-q35-9.2,accel=kvm,memory-backend=x",
    ]));
    assert!(e.contains("Invalid machine"), "{e}");
    // 5. a machine type QEMU does not have
    let e = refused(&create(&["--machine", "pc-q35-99.9"]));
    assert!(e.contains("does not grant machine = 'pc-q35-99.9'"), "{e}");
    // 6. options spliced onto -cpu
    let e = refused(&create(&["--cpu", "max,+vmx"]));
    assert!(e.contains("Invalid cpu"), "{e}");
    // 7. a NIC on a bridge the host does not give guests
    let e = refused(&create(&[
        "--nic",
        "bridge=ferry-mgmt,mac=52:54:00:66:00:01",
    ]));
    assert!(
        e.contains("does not grant nics[0].bridge = 'ferry-mgmt'") && e.contains("br-guest"),
        "{e}"
    );
    nothing_started("att1", qemus);
    // 8. a qcow2 image whose backing file is the CA's key
    let img = Path::new(SHARED).join(format!("att-{}.qcow2", std::process::id()));
    let made = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b", CA_KEY])
        .arg(&img)
        .arg("64M")
        .status()
        .unwrap();
    assert!(made.success());
    let e = refused(&create(&[
        "--firmware",
        "bios",
        "--drive",
        &format!("path={},format=qcow2", img.display()),
    ]));
    assert!(e.contains("backing file") && e.contains(CA_KEY), "{e}");
    std::fs::remove_file(&img).unwrap();
    nothing_started("att1", qemus);
    logged(t0, "backing file");
}

/// Hooks are programs an admin put in a directory, never a shell string,
/// and naming one is an admin's act.
#[test]
#[ignore = "lab: needs root, QEMU >= 9, iproute2, curl and qemu-img; run with --include-ignored"]
fn a_rolling_drain_hook_runs_no_shell_and_is_an_admins() {
    require_lab();
    let _g = serial();
    lab(3, 1);
    let dir = scratch();
    let op = token(dir.path(), "operator");
    let canary = dir.path().join("pwned");
    let cmd = format!("touch {}", canary.display());
    let t0 = now_ms();
    // 9. an operator's shell command as a hook
    let e = refused(&ferry_as(
        &op,
        &["cluster", "drain-rolling", "--hook", &cmd],
    ));
    assert!(e.contains("needs role admin"), "{e}");
    logged(t0, "start a rolling drain with a hook");
    // 10. an admin's shell command, and a path out of the hooks directory
    for h in [cmd.as_str(), "../../../bin/sh", "/bin/sh"] {
        let e = refused(&ferry(&["cluster", "drain-rolling", "--hook", h]));
        assert!(e.contains("not a hook's name"), "{h}: {e}");
    }
    // 11. a name the hooks directory does not hold
    let e = refused(&ferry(&[
        "cluster",
        "drain-rolling",
        "--hook",
        "reboot-all",
    ]));
    assert!(
        e.contains("reboot-all") && e.contains("/run/ferry/lab/control/hooks"),
        "{e}"
    );
    std::thread::sleep(Duration::from_secs(4));
    assert!(!canary.exists(), "a hook ran");
    // no rolling drain runs and no host was drained
    let st = ferry(&["cluster", "drain-rolling", "--status", "--json"]);
    let text = String::from_utf8_lossy(&st.stdout);
    assert!(!text.contains("\"running\""), "{text}");
    for h in ferry_json(&["host", "list"]).as_array().unwrap() {
        assert_ne!(h["draining"], true, "{h}");
    }
}

/// Secrets in a spec are write-only: nobody reads a guest's first-boot
/// user data back, and what holds guest data is its owner's alone.
#[test]
#[ignore = "lab: needs root, QEMU >= 9, iproute2, curl and qemu-img; run with --include-ignored"]
fn user_data_is_write_only_and_guest_files_are_private() {
    require_lab();
    let _g = serial();
    lab(3, 1);
    let dir = scratch();
    let op = token(dir.path(), "operator");
    let ro = token(dir.path(), "read-only");
    let secret = format!("password-{}", std::process::id());
    let ud = dir.path().join("user-data");
    std::fs::write(&ud, format!("#cloud-config\npassword: {secret}\n")).unwrap();
    remove_vm("att2");
    let out = ferry_as(
        &op,
        &[
            "vm",
            "create",
            "att2",
            "--host",
            "host1",
            "--memory",
            "256M",
            "--fill",
            "32M",
            "--user-data",
        ]
        .iter()
        .copied()
        .chain([ud.to_str().unwrap()])
        .collect::<Vec<_>>(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _vm = VmGuard("att2");
    // 12-13. the operator who wrote it and a read-only user list the VM: no secret
    for t in [&op, &ro] {
        let out = ferry_as(t, &["vm", "list", "--json"]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && text.contains("att2"), "{text}");
        assert!(!text.contains(&secret), "{t} reads the user data: {text}");
        assert!(text.contains("\"redacted\": true"), "{text}");
    }
    // 14. nor through REST, nor a peer agent asking host1 for its VMs
    let ro_secret = std::fs::read_to_string(&ro).unwrap();
    let (st, body) = curl(
        "https://127.0.0.1:7700/api/v1/vms",
        &[
            "--cacert",
            &ca(),
            "-H",
            &format!("Authorization: Bearer {ro_secret}"),
        ],
    );
    assert!(
        st == 200 && body.contains("att2") && !body.contains(&secret),
        "{body}"
    );
    let (st, body) = as_peer("host2", "GET", "https://198.18.0.11:7800/api/v1/host", None);
    assert!(
        st == 200 && body.contains("att2") && !body.contains(&secret),
        "{body}"
    );
    // 15. a listing's spec fed back cannot make a VM with an empty seed
    let listed = ferry_json(&["vm", "list"]);
    let spec = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "att2")
        .unwrap()["spec"]
        .clone();
    let mut spec = spec;
    spec["name"] = json!("att3");
    let (st, body) = curl(
        "https://127.0.0.1:7700/api/v1/vms",
        &[
            "--cacert",
            &ca(),
            "-H",
            &format!(
                "Authorization: Bearer {}",
                std::fs::read_to_string(&op).unwrap()
            ),
            "-H",
            "content-type: application/json",
            "-d",
            &json!({"host": "host1", "spec": spec}).to_string(),
        ],
    );
    assert!(
        st == 400 && body.contains("cloud_init.redacted"),
        "{st} {body}"
    );
    // 16. the VM's files — its record (with the seed), the seed, the console — are root's alone
    let vmdir = Path::new(LAB).join("host1/vms/att2");
    for f in ["vm.json", "seed.iso", "console.log", "qemu.log"] {
        let p = vmdir.join(f);
        let mode =
            std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&p).unwrap().permissions());
        assert_eq!(mode & 0o077, 0, "{} is mode {mode:o}", p.display());
    }
    // 17. a read-only user reads no console (a guest may print its secrets there)
    let e = refused(&ferry_as(&ro, &["vm", "console", "att2"]));
    assert!(e.contains("needs role operator"), "{e}");
}

/// curl arguments for host `h`'s agent certificate.
fn peer(h: &str) -> Vec<String> {
    vec![
        "--cacert".into(),
        ca(),
        "--cert".into(),
        format!("{PKI}/{h}/cert.pem"),
        "--key".into(),
        format!("{PKI}/{h}/key.pem"),
    ]
}

/// `curl` with a peer agent's certificate and a JSON body.
fn as_peer(h: &str, method: &str, url: &str, body: Option<&Value>) -> (u16, String) {
    let mut a = peer(h);
    a.extend(["-X".into(), method.into()]);
    if let Some(b) = body {
        a.extend([
            "-H".into(),
            "content-type: application/json".into(),
            "-d".into(),
            b.to_string(),
        ]);
    }
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    curl(url, &a)
}

fn incoming(id: &str, source: &str, spec: Value, ticket: Option<Value>) -> Value {
    json!({
        "migration_id": id,
        "source": source,
        "spec": spec,
        "ticket": ticket,
        "reachable_nics": [nic("host1", 1)],
        "option": "tcp",
        "source_url": format!("https://198.18.0.1{}:7800", &source[4..]),
        "key": "5a".repeat(32),
    })
}

/// A move ticket signed with the key of `signer`'s certificate in the lab
/// (`control`: the control service's, as it signs them).
fn ticket(signer: &str, spec: &Value, source: &str, target: &str) -> Value {
    let pki = ferry_net::tls::Pki::load(&Path::new(PKI).join(signer)).unwrap();
    let spec: ferry_api::VmSpec = serde_json::from_value(spec.clone()).unwrap();
    let t = pki.ticket_signer().unwrap();
    serde_json::to_value(t.sign(&spec, source, target, ferry_net::ticket::now_ms())).unwrap()
}

fn workload(name: &str) -> Value {
    serde_json::to_value(ferry_api::VmSpec::workload(name, 256 << 20, 32 << 20, 0)).unwrap()
}

/// One compromised host (one agent's certificate) is not the cluster: what
/// it sends another agent is validated, bound to its own name, and it acts
/// only on migrations it is the source of.
#[test]
#[ignore = "lab: needs root, QEMU >= 9, iproute2, curl and qemu-img; run with --include-ignored"]
fn a_peer_agent_cannot_escalate_through_another_agent() {
    require_lab();
    let _g = serial();
    lab(3, 1);
    let url = |p: &str| format!("https://198.18.0.11:7800/api/v1{p}");
    let canary = tempfile::Builder::new()
        .prefix("ferry-attack-canary-")
        .tempdir()
        .unwrap();
    std::fs::write(canary.path().join("keep"), b"x").unwrap();
    let qemus = qemu_pids("host1").len();
    // 18. a migration id that walks out of the agent's state directory
    let walk = format!("../../../../..{}", canary.path().display());
    let (st, body) = as_peer(
        "host2",
        "POST",
        &url("/incoming"),
        Some(&incoming(&walk, "host2", workload("att4"), None)),
    );
    assert!(st == 400 && body.contains("migration_id"), "{st} {body}");
    assert!(canary.path().join("keep").exists());
    // 19. a migration handed over in another host's name
    let id = format!("{:016x}", u64::from(std::process::id()) << 20 | 0xa77);
    let (st, body) = as_peer(
        "host2",
        "POST",
        &url("/incoming"),
        Some(&incoming(&id, "host3", workload("att4"), None)),
    );
    assert!(st == 403 && body.contains("host3"), "{st} {body}");
    // 19b. a move the control service did not order: no ticket, a ticket the
    // peer signed itself, a real ticket for another target
    let w = workload("att4");
    for (t, says) in [
        (None, "no ticket"),
        (
            Some(ticket("host2", &w, "host2", "host1")),
            "not the cluster's control service",
        ),
        (
            Some(ticket("control", &w, "host2", "host3")),
            "for target 'host3'",
        ),
    ] {
        let (st, body) = as_peer(
            "host2",
            "POST",
            &url("/incoming"),
            Some(&incoming(&id, "host2", w.clone(), t)),
        );
        assert!(
            st == 403 && body.contains("bad_ticket") && body.contains(says),
            "{says}: {st} {body}"
        );
    }
    assert_eq!(leftovers("host1", "att4"), Vec::<PathBuf>::new());
    // 20. a spec naming a file the host does not grant, through a peer
    let mut spec = workload("att4");
    spec["firmware"] = json!("bios");
    spec["fill"] = json!(0);
    spec["dirty_rate"] = json!(0);
    spec["drives"] = json!([{"path": CA_KEY}]);
    let (st, body) = as_peer(
        "host2",
        "POST",
        &url("/incoming"),
        Some(&incoming(
            &id,
            "host2",
            spec.clone(),
            Some(ticket("control", &spec, "host2", "host1")),
        )),
    );
    assert!(
        st == 403 && body.contains("not_granted") && body.contains("drive_dirs"),
        "{st} {body}"
    );
    assert_eq!(leftovers("host1", "att4"), Vec::<PathBuf>::new());
    assert_eq!(qemu_pids("host1").len(), qemus);
    // 21. ids that are not a migration's on every id route
    for (m, p) in [
        ("GET", "/migrations/..%2f..%2fhost1%2fvm.json"),
        ("GET", "/incoming/zz"),
        ("POST", "/incoming/0123/run"),
        ("DELETE", "/incoming/..%2F..%2Fvms"),
    ] {
        let (st, body) = as_peer("host2", m, &url(p), None);
        assert!(
            st == 400 && body.contains("migration_id"),
            "{m} {p}: {st} {body}"
        );
    }
    // 22. a real skeleton from host2, with the control service's ticket;
    // host3 may neither read nor discard it
    let good = ticket("control", &w, "host2", "host1");
    let (st, body) = as_peer(
        "host2",
        "POST",
        &url("/incoming"),
        Some(&incoming(&id, "host2", w.clone(), Some(good.clone()))),
    );
    assert_eq!(st, 200, "{body}");
    // the reply's URI is only a port to the source: it builds its own (see migration/mod.rs)
    assert!(body.contains("\"uri\":\"tcp:198.1"), "{body}");
    // 22b. the same ticket again, for a second skeleton: one ticket, one move
    let id2 = format!("{:016x}", u64::from(std::process::id()) << 20 | 0xa78);
    let (st, body) = as_peer(
        "host2",
        "POST",
        &url("/incoming"),
        Some(&incoming(&id2, "host2", w.clone(), Some(good))),
    );
    assert!(st == 403 && body.contains("already used"), "{st} {body}");
    // 22c. its source's looks: QEMU asked, or (`?qemu=alive`) only its process
    // seen; any other answer to `qemu` is refused by name
    let status = |q: &str| as_peer("host2", "GET", &url(&format!("/incoming/{id}{q}")), None);
    let (st, body) = status("");
    assert!(
        st == 200 && body.contains("\"qemu_alive\":true") && body.contains("\"inmigrate\""),
        "{body}"
    );
    let (st, body) = status("?qemu=alive");
    assert!(
        st == 200 && body.contains("\"qemu_alive\":true") && body.contains("\"unasked\""),
        "{body}"
    );
    let (st, body) = status("?qemu=status%27");
    assert!(
        st == 400 && body.contains("qemu") && body.contains("not 'alive'"),
        "{st} {body}"
    );
    for m in ["GET", "DELETE"] {
        let (st, body) = as_peer("host3", m, &url(&format!("/incoming/{id}")), None);
        assert!(
            st == 403 && body.contains("the migration's source, host2"),
            "{m}: {st} {body}"
        );
    }
    let (st, body) = as_peer("host3", "POST", &url(&format!("/incoming/{id}/run")), None);
    assert_eq!(st, 403, "{body}");
    // its source discards it: nothing left
    let (st, body) = as_peer("host2", "DELETE", &url(&format!("/incoming/{id}")), None);
    assert_eq!(st, 200, "{body}");
    let t0 = Instant::now();
    while !leftovers("host1", "att4").is_empty() || qemu_pids("host1").len() != qemus {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the skeleton stayed"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // 23. a peer agent may not use the control service's routes
    let (st, body) = as_peer("host2", "POST", &url("/vms"), Some(&workload("att5")));
    assert_eq!(st, 403, "{body}");
}

/// Nobody without a credential gets anything, cannot hold every
/// connection, and cannot push the audit trail out of the event log.
#[test]
#[ignore = "lab: needs root, QEMU >= 9, iproute2, curl and qemu-img; run with --include-ignored"]
fn an_unauthenticated_client_gets_nothing_and_floods_nothing() {
    require_lab();
    let _g = serial();
    lab(3, 1);
    // 24. no token
    let (st, _) = curl("https://127.0.0.1:7700/api/v1/vms", &["--cacert", &ca()]);
    assert_eq!(st, 401);
    // 25. no client certificate at an agent: no TLS session
    let (st, _) = curl("https://198.18.0.11:7800/api/v1/host", &["--cacert", &ca()]);
    assert_eq!(st, 0);
    // 26. a flood of refused requests: the real events stay in the log
    ferry_ok(&["host", "resume", "host3"]);
    let t0 = now_ms();
    std::thread::sleep(Duration::from_millis(20));
    let mut args = vec!["-s", "-o", "/dev/null", "--cacert"];
    let ca = ca();
    args.push(&ca);
    let urls: Vec<String> = (0..200)
        .map(|i| format!("https://127.0.0.1:7700/api/v1/hosts/h{i}/resume"))
        .collect();
    let out = Command::new("curl")
        .args(&args)
        .args(urls.iter().flat_map(|u| ["-X", "POST", u.as_str()]))
        .output()
        .unwrap();
    assert!(out.status.success());
    std::thread::sleep(Duration::from_millis(500));
    let refused = refusals_since(t0);
    assert!(
        refused.len() as u64 <= ferry_control::limits::REFUSALS_SHOWN + 1,
        "{} refusals logged one by one: {refused:?}",
        refused.len()
    );
    let events = ferry_json(&["events", "--limit", "50"]);
    assert!(
        events
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == "command" && e["detail"]["action"] == "resume host host3"),
        "the real event was pushed out: {events}"
    );
    // 27. one client holding connections open without a word: past its share, closed at once
    let limits = ferry_net::server::Limits::default();
    let held: Vec<std::net::TcpStream> = (0..limits.per_client)
        .map(|_| std::net::TcpStream::connect("127.0.0.1:7700").unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut extra = std::net::TcpStream::connect("127.0.0.1:7700").unwrap();
    extra
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let _ = extra.write_all(b"\x16\x03\x01\x00\x05hello");
    let mut buf = [0u8; 16];
    let t = Instant::now();
    let n = extra.read(&mut buf).unwrap_or(0);
    assert_eq!(n, 0, "the connection past the cap was served");
    assert!(t.elapsed() < Duration::from_secs(4), "not closed at once");
    drop(held);
    std::thread::sleep(Duration::from_millis(500));
    ferry_ok(&["host", "list"]);
}

/// An empty or short admin token file would be a token anyone can guess:
/// the control service refuses to start on one.
#[test]
#[ignore = "lab: needs root, QEMU >= 9, iproute2, curl and qemu-img; run with --include-ignored"]
fn an_empty_admin_token_file_is_refused_at_start() {
    require_lab();
    let _g = serial();
    let dir = scratch();
    let cred = dir.path().join("cluster.token");
    ferry_api::auth::Credential::generate()
        .store(&cred)
        .unwrap();
    for (i, text) in ["", "\n", "short"].iter().enumerate() {
        let admin = dir.path().join(format!("admin{i}.token"));
        std::fs::write(&admin, text).unwrap();
        // 28. started on it, it stops at once, naming the file's key
        let out = Command::new(FERRY)
            .args([
                "control",
                "--insecure-http",
                "--listen",
                "127.0.0.1:0",
                "--token-file",
            ])
            .arg(&cred)
            .arg("--admin-token")
            .arg(&admin)
            .arg("--state")
            .arg(dir.path().join(format!("state{i}.db")))
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && e.contains("admin_token"),
            "{text:?}: {e}"
        );
    }
}

/// A guest printing without end fills no disk: its console log is rotated.
#[test]
#[ignore = "lab: needs root, QEMU >= 9, iproute2, curl and qemu-img; run with --include-ignored"]
fn a_guest_flooding_its_console_fills_no_disk() {
    require_lab();
    let _g = serial();
    lab(3, 1);
    // host3's agent keeps consoles to 64 KiB
    let local = Path::new(LAB).join("host3/agent.local.toml");
    std::fs::write(&local, "console_log_max = \"64K\"\n").unwrap();
    ferry_ok(&["lab", "restart-agent", "host3"]);
    // the lab's kernel and an initramfs whose /init only prints
    let img = ferry_lab::image::ensure(false).unwrap();
    let kernel = Path::new(SHARED).join("att-vmlinux");
    std::fs::copy(&img.kernel, &kernel).unwrap();
    let mut initrd = std::fs::read(&img.initrd).unwrap();
    let init = "#!/bin/sh\nmount -t devtmpfs dev /dev\nL=flood-flood-flood-flood-flood-flood-flood-flood-flood-flood\n\
                while :; do echo $L$L$L$L$L$L$L$L; done >/dev/ttyS0\n";
    initrd.extend(ferry_lab::cpio::build(&[ferry_lab::cpio::Entry::File {
        path: "init",
        mode: 0o755,
        data: init.as_bytes(),
    }]));
    let initrd_path = Path::new(SHARED).join("att-flood.cpio");
    std::fs::write(&initrd_path, initrd).unwrap();
    remove_vm("att6");
    ferry_ok(&[
        "vm",
        "create",
        "att6",
        "--host",
        "host3",
        "--memory",
        "256M",
        "--kernel",
        kernel.to_str().unwrap(),
        "--initrd",
        initrd_path.to_str().unwrap(),
        "--append",
        "console=ttyS0 quiet",
    ]);
    let _vm = VmGuard("att6");
    let log = Path::new(LAB).join("host3/vms/att6/console.log");
    let older = Path::new(LAB).join("host3/vms/att6/console.log.1");
    // 29. the guest prints for 20 s; the log never holds more than its cap
    // and the few seconds between two rotations
    let t0 = Instant::now();
    let mut most = 0u64;
    while t0.elapsed() < Duration::from_secs(20) {
        let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        most = most.max(size(&log) + size(&older));
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(older.exists(), "the console was never rotated");
    eprintln!("console of a flooding guest: at most {most} bytes on disk");
    assert!(most < 4 << 20, "{most} bytes");
    let listed = ferry_json(&["vm", "list"]);
    let me = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "att6")
        .cloned();
    assert_eq!(me.unwrap()["state"], "running", "the guest was stopped");
    drop(_vm);
    std::fs::remove_file(&local).unwrap();
    ferry_ok(&["lab", "restart-agent", "host3"]);
    let _ = std::fs::remove_file(kernel);
    let _ = std::fs::remove_file(initrd_path);
}
