//! The services' configuration files, through the real `ferry` binary: a
//! file with an unknown key, a NIC that does not exist or a network that
//! matches nothing is refused at start naming the file and the key; `ferry
//! cluster init` writes files the services accept. Needs no root.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::path::Path;
use std::process::Command;

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

/// A fresh directory, removed with what is in it when the test ends.
struct Scratch(tempfile::TempDir);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        self.0.path()
    }
}

fn scratch(name: &str) -> Scratch {
    Scratch(
        tempfile::Builder::new()
            .prefix(&format!("ferry-config-{name}-"))
            .tempdir()
            .unwrap(),
    )
}

/// `ferry agent --config FILE --check-config` with `body` as the file;
/// returns (success, stdout + stderr).
fn check_agent(dir: &std::path::Path, body: &str) -> (bool, String, String) {
    let file = dir.join("agent.toml");
    std::fs::write(&file, body).unwrap();
    let out = Command::new(FERRY)
        .args([
            "agent",
            "--config",
            file.to_str().unwrap(),
            "--check-config",
        ])
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const BASE: &str = "name = \"h1\"\nlisten = \"127.0.0.1:7800\"\nmemory = \"1G\"\n";

#[test]
fn an_agent_file_with_an_unknown_key_is_refused_naming_it() {
    let d = scratch("unknown");
    let (ok, _, err) = check_agent(&d, &format!("{BASE}nic = [\"lo\"]\n"));
    assert!(!ok);
    assert!(
        err.contains(&format!("{}: ", d.join("agent.toml").display())),
        "{err}"
    );
    assert!(err.contains("unknown field `nic`"), "{err}");
}

#[test]
fn limits_that_cannot_work_or_are_unknown_are_refused_naming_them() {
    let d = scratch("limits");
    let (ok, _, err) = check_agent(&d, &format!("{BASE}[limits]\nmax_header_bytes = 10\n"));
    assert!(!ok);
    assert!(
        err.contains("limits.max_header_bytes") && err.contains("4096"),
        "{err}"
    );
    let (ok, _, err) = check_agent(&d, &format!("{BASE}[limits]\nmax_conections = 10\n"));
    assert!(!ok);
    assert!(err.contains("unknown field `max_conections`"), "{err}");
    let (ok, _, err) = check_agent(
        &d,
        &format!("{BASE}[limits]\nmax_connections = 8\nmax_connections_per_client = 64\n"),
    );
    assert!(!ok);
    assert!(err.contains("limits.max_connections_per_client"), "{err}");
    let (ok, _, err) = check_agent(&d, &format!("{BASE}[limits]\nheader_timeout_secs = 5\n"));
    assert!(ok, "{err}");
    // the agent's own: a reorder window below twice the replay limit, a
    // guest-agent reply that is no size
    let (ok, _, err) = check_agent(&d, &format!("{BASE}reorder_window = \"1M\"\n"));
    assert!(
        !ok && err.contains("reorder_window") && err.contains("8192K"),
        "{err}"
    );
    let (ok, _, err) = check_agent(&d, &format!("{BASE}guest_agent_max_reply = \"lots\"\n"));
    assert!(!ok && err.contains("guest_agent_max_reply"), "{err}");
    let (ok, _, err) = check_agent(
        &d,
        &format!("{BASE}reorder_window = \"32M\"\nguest_agent_max_reply = \"1M\"\n"),
    );
    assert!(ok, "{err}");
}

#[test]
fn a_nic_that_does_not_exist_is_refused_naming_it() {
    let d = scratch("nic");
    let (ok, _, err) = check_agent(&d, &format!("{BASE}nics = [\"ferry-no-nic9\"]\n"));
    assert!(!ok);
    assert!(
        err.contains("key `nics`: no interface named 'ferry-no-nic9' on this host"),
        "{err}"
    );
}

#[test]
fn a_network_that_matches_nothing_is_refused_naming_it() {
    let d = scratch("net");
    let (ok, _, err) = check_agent(&d, &format!("{BASE}networks = [\"203.0.113.0/24\"]\n"));
    assert!(!ok);
    assert!(
        err.contains("key `networks`: 203.0.113.0/24 matches no address of this host"),
        "{err}"
    );
    let (ok, _, err) = check_agent(&d, &format!("{BASE}reserved_memory = \"lots\"\n"));
    assert!(!ok, "{err}");
}

#[test]
fn a_good_file_resolves_with_flags_over_keys() {
    let d = scratch("good");
    let (ok, out, err) = check_agent(&d, &format!("{BASE}networks = [\"127.0.0.0/8\"]\n"));
    assert!(ok, "{err}");
    assert!(out.contains("name: \"h1\""), "{out}");
    assert!(out.contains("127.0.0.0"), "{out}");
    let file = d.join("agent.toml");
    let out = Command::new(FERRY)
        .args([
            "agent",
            "--config",
            file.to_str().unwrap(),
            "--check-config",
            "--name",
            "h9",
        ])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("name: \"h9\""));
}

/// `ferry cluster init --dir DIR` with `hosts` as `--host` values.
fn cluster_init(dir: &std::path::Path, hosts: &[&str]) -> std::process::Output {
    let mut c = Command::new(FERRY);
    c.args(["cluster", "init", "--dir", dir.to_str().unwrap()]);
    for h in hosts {
        c.args(["--host", h]);
    }
    c.output().unwrap()
}

#[test]
fn cluster_init_writes_a_credential_and_files_the_services_accept() {
    let d = scratch("init");
    let out = cluster_init(&d, &["a1=127.0.0.1", "a2=127.0.0.2:7801"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(d.join("cluster.token"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let control = std::fs::read_to_string(d.join("control.toml")).unwrap();
    assert!(
        control.contains("a2 = \"https://127.0.0.2:7801\""),
        "{control}"
    );
    // an agent file made by init, with its NICs listed, is accepted
    let agent = std::fs::read_to_string(d.join("agent-a1.toml")).unwrap();
    let agent = agent.replace("nics = []", "nics = [\"lo\"]").replace(
        "credential = \"/etc/ferry/cluster.token\"",
        &format!(
            "credential = \"{}\"\nmemory = \"1G\"",
            d.join("cluster.token").display()
        ),
    );
    let (ok, out, err) = check_agent(&d, &agent);
    assert!(ok, "{err}");
    assert!(out.contains("\"lo\""), "{out}");
    // a second init does not silently replace the credential
    let again = cluster_init(&d, &["a1=127.0.0.1"]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));
    // the CA's key and the first admin token are the owner's only; each
    // host has its certificate
    for f in [
        "ca/ca-key.pem",
        "admin.token",
        "pki/control/key.pem",
        "pki/admin/key.pem",
        "hosts/a1/pki/agent/key.pem",
    ] {
        let mode = std::fs::metadata(d.join(f)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{f}");
    }
    assert!(d.join("hosts/a2/pki/agent/cert.pem").exists());
    assert!(d.join("hosts/a2/pki/ca-cert.pem").exists());
    assert!(d.join("pki/ca-cert.pem").exists());
}

/// The control service made by `cluster init` serves TLS with its
/// certificate; the CLI verifies it against the cluster CA and brings the
/// admin token; another CA's CLI, plain HTTP and a wrong token get nothing.
#[test]
fn the_control_service_speaks_tls_and_takes_the_admin_token_from_init() {
    let d = scratch("tls");
    let st = cluster_init(&d, &["a1=127.0.0.1"]);
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let path = |f: &str| d.join(f).display().to_string();
    let mut control = Command::new(FERRY)
        .args(["control", "--config", &path("control.toml")])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--token-file", &path("cluster.token")])
        .args([
            "--tls-dir",
            &path("pki/control"),
            "--admin-token",
            &path("admin.token"),
        ])
        .args(["--state", &path("state.db")])
        .stderr(std::fs::File::create(d.join("control.log")).unwrap())
        .spawn()
        .unwrap();
    let url = format!("https://127.0.0.1:{port}");
    let cli = |ca: &str, token: &str, control: &str, args: &[&str]| {
        Command::new(FERRY)
            .args(["--control", control, "--ca", ca, "--token-file", token])
            .args(args)
            .output()
            .unwrap()
    };
    let t0 = std::time::Instant::now();
    let listed = loop {
        let out = cli(
            &path("ca/ca-cert.pem"),
            &path("admin.token"),
            &url,
            &["token", "list", "--json"],
        );
        if out.status.success() {
            break String::from_utf8_lossy(&out.stdout).to_string();
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(10),
            "control over TLS: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert!(
        listed.contains("\"admin\"") && listed.contains("\"role\": \"admin\""),
        "{listed}"
    );
    // a read-only token made by the admin reads and cannot change
    let out = cli(
        &path("ca/ca-cert.pem"),
        &path("admin.token"),
        &url,
        &["token", "create", "ro", "--role", "read-only", "--json"],
    );
    assert!(out.status.success());
    let made: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    std::fs::write(d.join("ro.token"), made["token"].as_str().unwrap()).unwrap();
    let out = cli(
        &path("ca/ca-cert.pem"),
        &path("ro.token"),
        &url,
        &["cluster", "set", "--encryption", "off"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("needs role admin"),
        "{err}"
    );
    // a CA that did not sign the control service's certificate
    let other = scratch("tls-other");
    let st = cluster_init(&other, &["a1=127.0.0.1"]);
    assert!(st.status.success());
    let out = cli(
        &other.join("ca/ca-cert.pem").display().to_string(),
        &path("admin.token"),
        &url,
        &["token", "list"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("control service is unavailable"),
        "{err}"
    );
    // plain HTTP to the TLS port, and a wrong token
    let out = cli(
        &path("ca/ca-cert.pem"),
        &path("admin.token"),
        &format!("http://127.0.0.1:{port}"),
        &["token", "list"],
    );
    assert!(!out.status.success());
    let out = cli(
        &path("ca/ca-cert.pem"),
        &path("cluster.token"),
        &url,
        &["token", "list"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("unknown API token"),
        "{err}"
    );
    let _ = control.kill();
    let _ = control.wait();
    // init ran on the control host: the service says the CA's key is beside it
    let said = std::fs::read_to_string(d.join("control.log")).unwrap();
    assert!(said.contains("CA's key is on this server"), "{said}");
}

/// Every file under `dir`, relative to it.
fn files_under(dir: &std::path::Path) -> Vec<String> {
    let mut out = vec![];
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap().display().to_string());
            }
        }
    }
    out.sort();
    out
}

/// `cluster init --admin-machine`: the CA's key stays in DIR/ca; the control
/// host's and each host's bundles hold no CA key. A control service run from
/// its bundle is renewed by `cluster rotate-certs` from the admin's
/// directory (the one host, not running, is named as not renewed), and the
/// CLI still verifies it afterwards.
#[test]
fn init_on_an_admin_machine_keeps_the_ca_key_there_and_rotation_renews_from_it() {
    let d = scratch("admin-machine");
    let out = Command::new(FERRY)
        .args(["cluster", "init", "--admin-machine", "--dir"])
        .arg(d.as_os_str())
        .args(["--host", "a1=127.0.0.1:9"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let control_files = files_under(&d.join("control"));
    let host_files = files_under(&d.join("hosts/a1"));
    for f in [
        "control.toml",
        "cluster.token",
        "admin.token",
        "pki/ca-cert.pem",
        "pki/control/cert.pem",
        "pki/control/key.pem",
    ] {
        assert!(
            control_files.contains(&f.to_string()),
            "{f}: {control_files:?}"
        );
    }
    for f in [
        "agent.toml",
        "cluster.token",
        "pki/ca-cert.pem",
        "pki/agent/key.pem",
    ] {
        assert!(host_files.contains(&f.to_string()), "{f}: {host_files:?}");
    }
    for f in control_files.iter().chain(&host_files) {
        assert!(!f.contains("ca-key"), "a server's bundle holds {f}");
    }
    assert!(d.join("ca/ca-key.pem").exists());
    assert!(!d.join("control.toml").exists());

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let c = |f: &str| d.join("control").join(f).display().to_string();
    let log = d.join("control.log");
    let mut control = Command::new(FERRY)
        .args(["control", "--config", &c("control.toml")])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--token-file", &c("cluster.token")])
        .args(["--tls-dir", &c("pki/control")])
        .args(["--admin-token", &c("admin.token")])
        .args(["--state", &c("state.db")])
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let here = |f: &str| d.join(f).display().to_string();
    let cli = |args: &[&str]| {
        Command::new(FERRY)
            .args(["--control", &format!("https://127.0.0.1:{port}")])
            .args(["--ca", &here("pki/ca-cert.pem")])
            .args(["--token-file", &here("admin.token")])
            .args(args)
            .output()
            .unwrap()
    };
    let t0 = std::time::Instant::now();
    while !cli(&["cluster", "show"]).status.success() {
        assert!(t0.elapsed() < std::time::Duration::from_secs(10));
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let serial =
        |pem: &str| ferry_net::tls::serial_of_pem(&std::fs::read_to_string(pem).unwrap()).unwrap();
    let before = serial(&c("pki/control/cert.pem"));
    let out = cli(&["cluster", "rotate-certs", "--ca-dir", &here("ca"), "--json"]);
    // the host does not run: named, exit status 1; the control service renewed
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let results: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let of = |name: &str| {
        results
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["component"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("{name} missing: {results}"))
    };
    assert!(of("host:a1")["error"].is_string(), "{results}");
    let renewed = of("control");
    assert!(renewed["error"].is_null(), "{renewed}");
    let after = serial(&c("pki/control/cert.pem"));
    assert_ne!(after, before);
    assert_eq!(renewed["status"]["serial"], after.as_str());
    // the CLI verifies the new certificate against the same CA
    let out = cli(&["cluster", "show", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = control.kill();
    let _ = control.wait();
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(!said.contains("CA's key is on this server"), "{said}");
}
