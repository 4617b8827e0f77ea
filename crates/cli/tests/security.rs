//! Trust nothing on the wire, in the lab (which runs with TLS on, as any
//! installed cluster): API tokens and their roles at the control service;
//! agents and storage nodes reachable only with a certificate of the
//! cluster; NBD only over TLS, each VM's disk only to the host it is placed
//! on (and, during a move, its target).
//!
//! Needs root, QEMU ≥ 9, iproute2, curl and nbdinfo (libnbd-bin);
//! `#[ignore]`d, run by `scripts/run test` and CI.

#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

const PKI: &str = "/run/ferry/lab/pki";
const NBD: &str = "198.18.0.1:10809";

/// `nbdinfo` of `uri`: (success, the server's error messages).
fn nbdinfo(uri: &str) -> (bool, String) {
    // libnbd shows the server's own error text only in its debug output
    let out = Command::new("nbdinfo")
        .arg(uri)
        .env("LIBNBD_DEBUG", "1")
        .output()
        .unwrap();
    let said: Vec<String> = String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter_map(|l| {
            l.split_once("server error message: ")
                .map(|(_, m)| m.to_string())
        })
        .chain(
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .filter(|l| l.starts_with("nbdinfo:"))
                .map(str::to_string),
        )
        .collect();
    let text = said.join("\n");
    eprintln!("nbdinfo {uri}: ok {} {text}", out.status.success());
    (out.status.success(), text)
}

fn nbds(export: &str, cert: &str) -> String {
    format!("nbds://{NBD}/{export}?tls-certificates={PKI}/{cert}")
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9, iproute2, curl and nbdinfo; run with --include-ignored"]
fn tokens_roles_certificates_and_nbd_access_are_enforced() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    let dir = std::env::temp_dir().join(format!("ferry-security-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };

    // ---- tokens and roles at the control service ----------------------------
    let _ = ferry(&["token", "revoke", "sec-ro"]);
    let _ = ferry(&["token", "revoke", "sec-op"]);
    let made = |name: &str, role: &str| -> String {
        let out = ferry(&["token", "create", name, "--role", role, "--json"]);
        if !out.status.success() {
            // a name stays taken after revocation: a fresh one per run
            let n = format!("{name}-{}", std::process::id());
            return ferry_json(&["token", "create", &n, "--role", role])["token"]
                .as_str()
                .unwrap()
                .to_string();
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["token"].as_str().unwrap().to_string()
    };
    let ro = file("ro.token", &made("sec-ro", "read-only"));
    let op_secret = made("sec-op", "operator");
    let op = file("op.token", &op_secret);
    let wrong = file("wrong.token", "ferry_00000000000000000000000000000000");
    // a changing route: resume a host
    let change = ["host", "resume", "host3"];
    let code = |out: &std::process::Output| String::from_utf8_lossy(&out.stderr).to_string();
    let none = file("none.token", "");
    let e = code(&ferry_as(&none, &change));
    assert!(e.contains("API token"), "no token: {e}");
    let e = code(&ferry_as(&wrong, &change));
    assert!(e.contains("unknown API token"), "wrong token: {e}");
    let e = code(&ferry_as(&ro, &change));
    assert!(e.contains("needs role operator"), "read-only: {e}");
    assert!(
        ferry_as(&ro, &["vm", "list"]).status.success(),
        "read-only reads"
    );
    assert!(ferry_as(&op, &change).status.success(), "operator resumes");
    let e = code(&ferry_as(&op, &["token", "list"]));
    assert!(e.contains("needs role admin"), "{e}");
    // declaring a host lost can run two copies if it is not: an admin's word
    let lost = [
        "vm",
        "resolve",
        "sec-none",
        "--target-lost",
        "host2",
        "--confirm-powered-off",
    ];
    let e = code(&ferry_as(&op, &lost));
    assert!(
        e.contains("needs role admin"),
        "operator declaring a host lost: {e}"
    );
    ferry_ok(&["token", "revoke", "sec-op"]);
    let e = code(&ferry_as(&op, &change));
    assert!(e.contains("was revoked"), "revoked token: {e}");
    // the same through plain HTTP status codes
    let url = "https://127.0.0.1:7700/api/v1/hosts/host3/resume";
    let ca = format!("{PKI}/ca/ca-cert.pem");
    let bearer = |t: &str| format!("Authorization: Bearer {t}");
    let ro_secret = std::fs::read_to_string(&ro).unwrap();
    for (hdr, want) in [
        (None, 401),
        (Some(bearer("ferry_wrong")), 401),
        (Some(bearer(&op_secret)), 401),
        (Some(bearer(&ro_secret)), 403),
    ] {
        let mut args = vec!["--cacert", &ca, "-X", "POST"];
        if let Some(h) = &hdr {
            args.extend(["-H", h.as_str()]);
        }
        assert_eq!(curl(url, &args).0, want, "{hdr:?}");
    }
    // every refusal and every change is in the event log, with the token
    std::thread::sleep(Duration::from_millis(300));
    let events = ferry_json(&["events", "--limit", "200"]);
    let ev = events.as_array().unwrap();
    let count = |kind: &str, f: &dyn Fn(&serde_json::Value) -> bool| {
        ev.iter()
            .filter(|e| e["kind"] == kind && f(&e["detail"]))
            .count()
    };
    assert!(count("refused", &|d| d["status"] == 401) >= 5, "{events}");
    assert!(
        count("refused", &|d| d["status"] == 403 && d["by"] == "sec-ro") >= 2,
        "{events}"
    );
    assert!(
        count("command", &|d| d["by"] == "sec-op"
            && d["action"] == "resume host host3")
            >= 1,
        "{events}"
    );
    assert!(
        count("command", &|d| d["by"] == "admin"
            && d["action"] == "revoke token sec-op")
            >= 1,
        "{events}"
    );

    // ---- agents and storage nodes: certificates of the cluster only ----------
    let admin_token = std::fs::read_to_string(format!("{LAB}/admin.token")).unwrap();
    for url in [
        "https://198.18.0.11:7800/api/v1/host",
        "https://198.18.0.1:7900/api/v1/disks",
    ] {
        // no client certificate: no TLS session, even with the admin's token
        let (st, _) = curl(url, &["--cacert", &ca, "-H", &bearer(admin_token.trim())]);
        assert_eq!(st, 0, "{url} answered without a client certificate");
        // plain HTTP to the TLS port: no HTTP answer
        let (st, _) = curl(&url.replace("https", "http"), &[]);
        assert_eq!(st, 0, "{url} answered plain HTTP");
        // a certificate of the cluster with the wrong role: 403
        let cert = format!("{PKI}/admin/cert.pem");
        let key = format!("{PKI}/admin/key.pem");
        let (st, body) = curl(url, &["--cacert", &ca, "--cert", &cert, "--key", &key]);
        assert_eq!(st, 403, "{url}: {body}");
    }
    // the control service's certificate gets in
    let (st, _) = curl(
        "https://198.18.0.11:7800/api/v1/host",
        &[
            "--cacert",
            &ca,
            "--cert",
            &format!("{PKI}/control/cert.pem"),
            "--key",
            &format!("{PKI}/control/key.pem"),
        ],
    );
    assert_eq!(st, 200);
    // a peer agent may ask another for /host, not create VMs on it
    let (st, body) = curl(
        "https://198.18.0.12:7800/api/v1/vms",
        &[
            "--cacert",
            &ca,
            "--cert",
            &format!("{PKI}/host1/cert.pem"),
            "--key",
            &format!("{PKI}/host1/key.pem"),
            "-H",
            "content-type: application/json",
            "-d",
            r#"{"name":"evil","memory":268435456,"fill":0,"dirty_rate":0}"#,
        ],
    );
    assert_eq!(st, 403, "{body}");

    // ---- NBD: TLS only, a VM's disk only to its host ------------------------
    let _ = ferry(&["vm", "rm", "sec1"]);
    let _ = ferry(&["disk", "rm", "secd"]);
    ferry_ok(&["disk", "create", "secd", "--size", "64M"]);
    let _vm = VmGuard::create("sec1", "host1", "256M", "64M");
    ferry_ok(&["disk", "attach", "secd", "sec1"]);
    let export = "secd/sec1";
    // in clear: refused, the server requires TLS
    let (ok, text) = nbdinfo(&format!("nbd://{NBD}/{export}"));
    assert!(!ok && text.contains("this server requires TLS"), "{text}");
    // TLS without a client certificate: no session
    let (ok, _) = nbdinfo(&format!(
        "nbds://{NBD}/{export}?tls-certificates={}",
        dir.join("empty").display()
    ));
    assert!(!ok);
    // host1 runs sec1: its certificate opens the disk; host2's cannot
    assert!(nbdinfo(&nbds(export, "host1")).0, "host1 opens sec1's disk");
    let (ok, text) = nbdinfo(&nbds(export, "host2"));
    assert!(!ok && text.contains("not placed on host2"), "{text}");
    // nor the disk without a VM, nor another VM's name it does not run
    let (ok, _) = nbdinfo(&nbds("secd", "host2"));
    assert!(!ok);
    // an administrator's certificate opens any export
    assert!(nbdinfo(&nbds(export, "admin")).0);
    // nor another disk under the name of a VM it does run: grants are per
    // (disk, VM, host)
    let _ = ferry(&["disk", "rm", "secx"]);
    ferry_ok(&["disk", "create", "secx", "--size", "16M"]);
    let (ok, text) = nbdinfo(&nbds("secx/sec1", "host1"));
    assert!(
        !ok && text.contains("not one of VM sec1's disks (secd)"),
        "{text}"
    );
    // sec1's QEMU holds a certificate of its own, signed by host1's agent,
    // not host1's key: it opens sec1's disk and no other export
    let creds = format!("{LAB}/host1/vms/sec1/nbd-tls");
    assert_ne!(
        std::fs::read(format!("{creds}/client-key.pem")).unwrap(),
        std::fs::read(format!("{PKI}/host1/key.pem")).unwrap()
    );
    let as_vm = |export: &str| nbdinfo(&format!("nbds://{NBD}/{export}?tls-certificates={creds}"));
    assert!(as_vm(export).0, "sec1's own certificate opens its disk");
    let (ok, text) = as_vm("secx/sec1");
    assert!(!ok && text.contains("not one of VM sec1's disks"), "{text}");
    let (ok, text) = as_vm("secx/other");
    assert!(
        !ok && text.contains("VM sec1's certificate opens only its own disks"),
        "{text}"
    );
    let (ok, _) = as_vm("secx");
    assert!(!ok);
    ferry_ok(&["disk", "rm", "secx"]);

    // the grant follows the VM: after a move host2 opens it and host1 not
    let r = move_vm("sec1", "host2", "multichannel");
    assert_eq!(r["event"], "completed", "{r}");
    assert_intact_on("sec1", "host2");
    let t0 = Instant::now();
    loop {
        let (h1, _) = nbdinfo(&nbds(export, "host1"));
        let (h2, _) = nbdinfo(&nbds(export, "host2"));
        if h2 && !h1 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "access did not follow sec1 to host2 (host1 {h1}, host2 {h2})"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    drop(_vm);
    ferry_ok(&["disk", "rm", "secd"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The workload guest's page `page` as first written (generation 0) by a
/// guest with `seed`: its first two words (see `guest/workload.c`), the
/// marker looked for on the wire.
fn page_marker(seed: u64, page: u64) -> [u8; 16] {
    fn mix(mut x: u64) -> u64 {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 31)
    }
    let b = mix(seed ^ (page << 24)) | 1;
    let mut m = [0u8; 16];
    m[..8].copy_from_slice(&b.to_le_bytes());
    m[8..].copy_from_slice(&b.wrapping_add(0xD6E8_FEB8_6659_FD93).to_le_bytes());
    m
}

/// How many of the guest's first `pages` page markers occur in `bytes`.
fn markers_in(bytes: &[u8], seed: u64, pages: u64) -> usize {
    let markers: std::collections::HashMap<[u8; 8], [u8; 8]> = (0..pages)
        .map(|p| {
            let m = page_marker(seed, p);
            (m[..8].try_into().unwrap(), m[8..].try_into().unwrap())
        })
        .collect();
    // a cheap first look (a bit per top 16 bits) before the map
    let mut maybe = vec![false; 1 << 16];
    for k in markers.keys() {
        maybe[u16::from_le_bytes([k[6], k[7]]) as usize] = true;
    }
    let mut found = std::collections::HashSet::new();
    for i in 0..bytes.len().saturating_sub(16) {
        if !maybe[u16::from_le_bytes([bytes[i + 6], bytes[i + 7]]) as usize] {
            continue;
        }
        let head: [u8; 8] = bytes[i..i + 8].try_into().unwrap();
        if markers
            .get(&head)
            .is_some_and(|t| t[..] == bytes[i + 8..i + 16])
        {
            found.insert(head);
        }
    }
    found.len()
}

/// tcpdump on every migration fabric's switch while `f` runs; the bytes
/// captured.
fn captured(f: impl FnOnce()) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let dumps: Vec<(std::path::PathBuf, std::process::Child)> = ["ferry-fab1", "ferry-fab2"]
        .iter()
        .map(|ns| {
            let file = dir.path().join(format!("{ns}.pcap"));
            let child = Command::new("ip")
                .args([
                    "netns", "exec", ns, "tcpdump", "-i", "any", "-s", "0", "-U", "-w",
                ])
                .arg(&file)
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("tcpdump (scripts/install-deps installs it)");
            (file, child)
        })
        .collect();
    std::thread::sleep(Duration::from_millis(800));
    f();
    std::thread::sleep(Duration::from_millis(500));
    let mut all = Vec::new();
    for (file, mut child) in dumps {
        // SAFETY: SIGINT to our own child, so tcpdump flushes its file
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        let _ = child.wait();
        all.extend(std::fs::read(&file).unwrap_or_default());
    }
    all
}

/// The QEMU of VM `name` (its pid from `vm list`).
fn qemu_of(name: &str) -> (u32, serde_json::Value) {
    let vms = ferry_json(&["vm", "list"]);
    let v = vms
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("{name} not listed: {vms}"))
        .clone();
    (v["pid"].as_u64().unwrap() as u32, v)
}

/// Runs `cat FILE` as `uid` (a VM's QEMU user): true when it could read it.
fn readable_as(uid: u32, file: &str) -> bool {
    let out = Command::new("setpriv")
        .args([
            "--reuid",
            &uid.to_string(),
            "--regid",
            &uid.to_string(),
            "--clear-groups",
            "cat",
            file,
        ])
        .output()
        .unwrap();
    eprintln!(
        "as uid {uid}: cat {file}: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    out.status.success()
}

/// Guest memory never crosses the migration network in clear by default
/// (and the capture that shows it would see it: the same move with
/// encryption turned off is caught); every QEMU runs as its own user under
/// seccomp in its own cgroup, and cannot read another VM's files nor the
/// host's keys.
#[test]
#[ignore = "lab: needs root, QEMU >= 9, iproute2, tcpdump and setpriv; run with --include-ignored"]
fn guest_memory_is_never_on_the_wire_in_clear_and_qemu_is_confined() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    const SEED: u64 = 0x005E_C0DE;
    for n in ["wire1", "wire2"] {
        remove_vm(n);
    }
    ferry_ok(&[
        "vm",
        "create",
        "wire1",
        "--host",
        "host1",
        "--memory",
        "256M",
        "--fill",
        "64M",
        "--dirty-rate",
        "0",
        "--seed",
        &SEED.to_string(),
    ]);
    ferry_ok(&[
        "vm",
        "create",
        "wire2",
        "--host",
        "host1",
        "--memory",
        "192M",
        "--fill",
        "16M",
        "--dirty-rate",
        "0",
        "--drive",
        "local=scratch.raw,size=1M",
    ]);
    let _guards = (VmGuard("wire1"), VmGuard("wire2"));

    // confined, as read from /proc and as the listing says
    let (pid1, v1) = qemu_of("wire1");
    let (pid2, _) = qemu_of("wire2");
    let status = std::fs::read_to_string(format!("/proc/{pid1}/status")).unwrap();
    let uid1: u32 = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    let uid2 = ferry_agent::confine::is_confined(pid2).unwrap().0;
    assert!(uid1 != 0 && uid2 != 0 && uid1 != uid2, "uids {uid1} {uid2}");
    assert!(
        status
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["Seccomp:", "2"]),
        "no seccomp filter: {status}"
    );
    let cgroups = std::fs::read_to_string(format!("/proc/{pid1}/cgroup")).unwrap();
    assert!(cgroups.contains("ferry/host1/wire1"), "{cgroups}");
    assert_eq!(v1["confinement"]["uid"], uid1, "{v1}");
    assert_eq!(v1["moves_encrypted"], true, "{v1}");
    // what an escaped guest of wire1 could reach: its own files, nothing else
    let vms = "/run/ferry/lab/host1/vms";
    assert!(readable_as(uid1, &format!("{vms}/wire1/console.log")));
    for other in [
        format!("{vms}/wire2/console.log"),
        format!("{vms}/wire2/nbd-tls/client-key.pem"),
        "/run/ferry/lab/host1/disks/wire2/scratch.raw".to_string(),
        format!("{PKI}/host1/key.pem"),
        format!("{PKI}/ca/ca-key.pem"),
    ] {
        assert!(std::path::Path::new(&other).exists(), "{other}");
        assert!(
            !readable_as(uid1, &other),
            "wire1's QEMU user reads {other}"
        );
    }

    // the capture sees guest memory when the cluster lets it go in clear
    ferry_ok(&["cluster", "set", "--encryption", "off"]);
    let mut r = serde_json::Value::Null;
    let clear = captured(|| r = move_vm("wire1", "host2", "tcp"));
    ferry_ok(&["cluster", "set", "--encryption", "on"]);
    assert_eq!(
        (r["event"].as_str(), r["encryption"].as_str()),
        (Some("completed"), Some("off")),
        "{r}"
    );
    let seen = markers_in(&clear, SEED, 4096);
    eprintln!(
        "in clear: {seen} of 4096 page markers in {} bytes",
        clear.len()
    );
    assert!(
        seen > 100,
        "only {seen} of 4096 page markers in {} bytes captured in clear",
        clear.len()
    );

    // a default move: not one marker
    let mut r = serde_json::Value::Null;
    let sealed = captured(|| r = move_vm("wire1", "host1", "auto"));
    assert_eq!(
        (r["event"].as_str(), r["encrypted"].as_bool()),
        (Some("completed"), Some(true)),
        "{r}"
    );
    assert!(
        sealed.len() > 64 << 20,
        "the capture missed the move: {} bytes",
        sealed.len()
    );
    let seen = markers_in(&sealed, SEED, 4096);
    eprintln!(
        "encrypted ({}): {seen} page markers in {} bytes",
        r["encryption"],
        sealed.len()
    );
    assert_eq!(seen, 0, "guest memory on the wire");
    assert_intact_on("wire1", "host1");
    // QEMU's own stream, in its TLS keyed by the move
    let mut r = serde_json::Value::Null;
    let tls = captured(|| r = move_vm("wire1", "host2", "tcp"));
    assert_eq!(
        (r["event"].as_str(), r["encryption"].as_str()),
        (Some("completed"), Some("qemu-tls")),
        "{r}"
    );
    let seen = markers_in(&tls, SEED, 4096);
    eprintln!("qemu-tls: {seen} page markers in {} bytes", tls.len());
    assert!(
        tls.len() > 64 << 20,
        "the capture missed the move: {} bytes",
        tls.len()
    );
    assert_eq!(seen, 0, "guest memory on the wire");
    assert_intact_on("wire1", "host2");

    // every guest's QEMU in the cluster: not root, seccomp on
    for v in ferry_json(&["vm", "list"]).as_array().unwrap() {
        assert!(
            v["confinement"]["uid"].as_u64().is_some_and(|u| u != 0)
                && v["confinement"]["seccomp"] == true,
            "{v}"
        );
    }
}

/// curl arguments presenting the certificate in `dir`.
fn with_cert(dir: &str) -> Vec<String> {
    vec![
        "--cacert".into(),
        format!("{PKI}/ca/ca-cert.pem"),
        "--cert".into(),
        format!("{dir}/cert.pem"),
        "--key".into(),
        format!("{dir}/key.pem"),
    ]
}

fn curl_with(dir: &str, url: &str) -> u16 {
    let a = with_cert(dir);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    curl(url, &a).0
}

/// Each host's certificate serial, as the control service lists hosts.
fn host_serials() -> std::collections::BTreeMap<String, String> {
    ferry_json(&["host", "list"])
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            (
                h["name"].as_str().unwrap().to_string(),
                h["info"]["certificate_serial"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect()
}

/// The storage node's certificate serial and revocation list, as it says.
fn storage_pki() -> serde_json::Value {
    let a = with_cert(&format!("{PKI}/control"));
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let (code, body) = curl("https://198.18.0.1:7900/api/v1/pki", &a);
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// `ferry cluster rotate-certs` in the middle of a drain: every component
/// gets a new certificate, every move of the drain succeeds (those after
/// the rotation with tickets signed by the control service's new key), no
/// VM is lost. Then `ferry cluster revoke` of a host's old certificate:
/// agents, the storage node and the control service all refuse it at the
/// handshake, and say so in their logs.
#[test]
#[ignore = "lab: needs root, QEMU >= 9, iproute2 and curl; run with --include-ignored"]
fn certificates_rotate_during_a_drain_and_a_revoked_one_is_refused_everywhere() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    let _ = ferry(&["host", "resume", "host1"]);
    let vms = [
        VmGuard::create("rot1", "host1", "384M", "256M"),
        VmGuard::create("rot2", "host1", "384M", "256M"),
        VmGuard::create("rot3", "host1", "384M", "256M"),
    ];
    let before = host_serials();
    let storage_before = storage_pki();
    // a copy of host3's certificate as it is now, to revoke later
    let old = std::env::temp_dir().join(format!("ferry-old-host3-{}", std::process::id()));
    std::fs::create_dir_all(&old).unwrap();
    for f in ["cert.pem", "key.pem"] {
        std::fs::copy(format!("{PKI}/host3/{f}"), old.join(f)).unwrap();
    }
    let old = old.display().to_string();
    let agent1 = "https://198.18.0.11:7800/api/v1/host";
    assert_eq!(curl_with(&old, agent1), 200);

    let mut drain = Command::new(FERRY)
        .args([
            "host",
            "drain",
            "host1",
            "--max-parallel",
            "1",
            "--option",
            "tcp",
            "--json",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut events: Vec<serde_json::Value> = vec![];
    let mut rotated: Option<serde_json::Value> = None;
    use std::io::BufRead as _;
    for line in std::io::BufReader::new(drain.stdout.take().unwrap()).lines() {
        let ev: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
        eprintln!("{ev}");
        // rotate while the first move copies memory
        if rotated.is_none() && ev["event"] == "progress" {
            let out = ferry(&[
                "cluster",
                "rotate-certs",
                "--ca-dir",
                &format!("{PKI}/ca"),
                "--days",
                "30",
                "--json",
            ]);
            eprintln!("{}", String::from_utf8_lossy(&out.stderr));
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stdout)
            );
            rotated = Some(serde_json::from_slice(&out.stdout).unwrap());
        }
        events.push(ev);
    }
    assert!(drain.wait().unwrap().success());
    let rotated = rotated.expect("the drain ended before any progress");
    let renewed: std::collections::BTreeSet<&str> = rotated
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            assert!(r["error"].is_null(), "{r}");
            r["component"].as_str().unwrap()
        })
        .collect();
    assert_eq!(
        renewed,
        [
            "control",
            "host:host1",
            "host:host2",
            "host:host3",
            "storage:storage1"
        ]
        .into_iter()
        .collect()
    );
    // the drain: every move done, none failed, moves started after the rotation
    let done = events.last().unwrap();
    assert_eq!(done["event"], "done", "{done}");
    assert_eq!(done["moved"].as_array().unwrap().len(), 3, "{done}");
    assert!(done["failed"].as_array().unwrap().is_empty(), "{done}");
    let starts = events.iter().filter(|e| e["event"] == "started").count();
    assert_eq!(starts, 3, "one attempt each");
    for m in done["moved"].as_array().unwrap() {
        assert_intact_on(m["vm"].as_str().unwrap(), m["to"].as_str().unwrap());
    }
    // every certificate is new, on disk and in force
    let after = host_serials();
    for (h, s) in &before {
        assert!(!s.is_empty(), "{h} lists no serial");
        assert_ne!(after[h], *s, "{h} kept its certificate");
        let on_disk = ferry_net::tls::serial_of_pem(
            &std::fs::read_to_string(format!("{PKI}/{h}/cert.pem")).unwrap(),
        )
        .unwrap();
        assert_eq!(after[h], on_disk);
    }
    assert_ne!(storage_pki()["serial"], storage_before["serial"]);
    // a VM moves again after the rotation, back to host1
    ferry_ok(&["host", "resume", "host1"]);
    let back = move_vm(vms[0].0, "host1", "tcp");
    assert_eq!(back["event"], "completed", "{back}");
    assert_intact_on(vms[0].0, "host1");

    // ---- revocation --------------------------------------------------------
    // the old certificate is still within its dates: it gets in until revoked
    assert_eq!(curl_with(&old, agent1), 200);
    let listed = ferry_json(&[
        "cluster",
        "revoke",
        "--cert",
        &format!("{old}/cert.pem"),
        "--ca-dir",
        &format!("{PKI}/ca"),
    ]);
    for r in listed.as_array().unwrap() {
        assert!(r["error"].is_null(), "{r}");
        assert!(r["status"]["crl_number"].as_u64().unwrap() >= 1, "{r}");
    }
    // refused at the handshake by every agent, the storage node and the
    // control service; host3's new certificate still gets in
    for url in [
        agent1,
        "https://198.18.0.12:7800/api/v1/host",
        "https://198.18.0.1:7900/api/v1/disks",
        "https://127.0.0.1:7700/api/v1/hosts",
    ] {
        assert_eq!(curl_with(&old, url), 0, "{url} took a revoked certificate");
        // the same server answers the renewed one (a refusal by role is an answer)
        assert_ne!(curl_with(&format!("{PKI}/host3"), url), 0, "{url}");
    }
    assert_eq!(curl_with(&format!("{PKI}/host3"), agent1), 200);
    assert!(
        agent_log_tail("host1", 400).contains("Revoked"),
        "host1's log does not name the refusal"
    );
    // the list grows: each revocation keeps the earlier ones
    let number = ferry_json(&["cluster", "crl"])["number"].as_u64().unwrap();
    let out = ferry(&[
        "cluster",
        "revoke",
        "--serial",
        "0badc0de",
        "--ca-dir",
        &format!("{PKI}/ca"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let crl = ferry_json(&["cluster", "crl"]);
    assert_eq!(crl["number"].as_u64().unwrap(), number + 1, "{crl}");
    let serials = crl["serials"].as_array().unwrap();
    assert!(serials.iter().any(|s| s == "0badc0de"), "{crl}");
    assert!(serials.len() >= 2, "{crl}");
    assert_eq!(curl_with(&old, agent1), 0);
    let _ = std::fs::remove_dir_all(&old);
}
