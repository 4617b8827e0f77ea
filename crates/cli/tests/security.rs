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
