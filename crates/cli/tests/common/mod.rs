//! Helpers for the lab integration tests: they drive the real `ferry` binary
//! against a real lab (network namespaces, QEMU guests), so they need root,
//! QEMU ≥ 9 and iproute2. They are `#[ignore]`d: `cargo test` lists them as
//! ignored; `cargo test -- --include-ignored` (as `scripts/run test` and CI
//! do) runs them, and a missing requirement fails them.

#![allow(dead_code, clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;

pub const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

/// Where `ferry lab up` keeps its state (agents' state directories).
pub const LAB: &str = "/run/ferry/lab";

/// Why the lab cannot run here, if it cannot.
fn missing() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (network namespaces, tc)".into());
    }
    let v = Command::new("qemu-system-x86_64").arg("--version").output();
    let Ok(v) = v else {
        return Some("qemu-system-x86_64 is not installed".into());
    };
    let text = String::from_utf8_lossy(&v.stdout);
    let major: u32 = text
        .split("version ")
        .nth(1)
        .and_then(|s| s.split('.').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    if major < 9 {
        return Some(format!(
            "needs QEMU >= 9 (found: {})",
            text.lines().next().unwrap_or("?")
        ));
    }
    if Command::new("ip").arg("-V").output().is_err() {
        return Some("iproute2 is not installed".into());
    }
    None
}

/// Lab tests are `#[ignore]`d (so a plain `cargo test` lists them as
/// ignored, never as passed); run with `--include-ignored`, they fail at once,
/// naming what is missing, when the lab cannot run here.
pub fn require_lab() {
    if let Some(why) = missing() {
        panic!("this lab test cannot run here: {why}");
    }
}

/// Tests in one binary share one lab; they take turns.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

pub fn ferry(args: &[&str]) -> Output {
    let out = Command::new(FERRY)
        .args(args)
        .output()
        .expect("running ferry");
    eprintln!(
        "$ ferry {}\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs ferry and requires success.
pub fn ferry_ok(args: &[&str]) -> String {
    let out = ferry(args);
    assert!(
        out.status.success(),
        "ferry {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn ferry_json(args: &[&str]) -> Value {
    let mut a = args.to_vec();
    a.push("--json");
    serde_json::from_str(&ferry_ok(&a)).expect("ferry --json printed JSON")
}

/// Brings up this binary's lab once (replacing any earlier lab), links at 1 Gbit/s.
pub fn lab(hosts: u32, nics: u32) {
    lab_at(hosts, nics, "1gbit");
}

/// Brings up this binary's lab once, links at `rate`.
pub fn lab_at(hosts: u32, nics: u32, rate: &str) {
    lab_with(hosts, nics, rate, 1);
}

/// Brings up this binary's lab once, links at `rate`, with `storage_nodes`
/// storage nodes (storage1, storage2, …).
pub fn lab_with(hosts: u32, nics: u32, rate: &str, storage_nodes: u32) {
    static UP: OnceLock<()> = OnceLock::new();
    UP.get_or_init(|| {
        ferry_ok(&[
            "lab",
            "up",
            "--replace",
            "--hosts",
            &hosts.to_string(),
            "--nics",
            &nics.to_string(),
            "--rate",
            rate,
            "--host-memory",
            "6G",
            "--storage-nodes",
            &storage_nodes.to_string(),
        ]);
    });
}

/// `ferry vm check NAME --json`, which exits 1 when the guest is not OK.
pub fn check(name: &str) -> Value {
    let out = ferry(&["vm", "check", name, "--json"]);
    serde_json::from_slice(&out.stdout).expect("check JSON")
}

pub fn assert_intact_on(name: &str, host: &str) {
    let c = check(name);
    assert_eq!(c["host"], host, "{name} should run on {host}: {c}");
    assert_eq!(c["running"], true, "{c}");
    assert_eq!(c["advancing"], true, "{c}");
    assert_eq!(c["intact"], true, "{c}");
    assert_eq!(c["errors"], 0, "{c}");
}

/// Moves a VM with `--option OPTION --json`, calling `during` once when the migration has
/// transferred at least `at_bytes`. Returns the final event.
pub fn move_with(
    name: &str,
    to: &str,
    option: &str,
    at_bytes: u64,
    during: impl FnOnce(),
) -> Value {
    move_when(
        name,
        to,
        option,
        |ev| ev["transferred"].as_u64().unwrap_or(0) >= at_bytes,
        during,
    )
}

/// Moves a VM with `--option OPTION --json`, calling `during` once at the first progress
/// event `when` accepts. Returns the final event.
pub fn move_when(
    name: &str,
    to: &str,
    option: &str,
    when: impl Fn(&Value) -> bool,
    during: impl FnOnce(),
) -> Value {
    let mut child = Command::new(FERRY)
        .args(["vm", "move", name, "--to", to, "--option", option, "--json"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn ferry vm move");
    let stdout = child.stdout.take().expect("stdout");
    let mut during = Some(during);
    let mut last = Value::Null;
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("read event");
        let ev: Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad event line {line}: {e}"));
        if ev["event"] == "progress" && when(&ev) {
            if let Some(f) = during.take() {
                eprintln!("injecting failure at {line}");
                f();
            }
        }
        if ev["event"] != "progress" {
            eprintln!("{line}");
        }
        last = ev;
    }
    child.wait().expect("ferry vm move exits");
    assert!(
        during.is_none(),
        "the migration of {name} ended before the moment to inject its failure"
    );
    last
}

pub fn move_vm(name: &str, to: &str, option: &str) -> Value {
    let out = ferry(&["vm", "move", name, "--to", to, "--option", option, "--json"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let last = text.lines().last().expect("at least one event");
    serde_json::from_str(last).expect("final event")
}

/// PIDs of the guest QEMUs in a host's namespace.
pub fn qemu_pids(host: &str) -> Vec<i32> {
    let out = Command::new("ip")
        .args(["netns", "pids", host])
        .output()
        .expect("ip netns pids");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().parse::<i32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm"))
                .is_ok_and(|c| c.trim() == "qemu-system-x86")
        })
        // a guest's QEMU, not the agent's short-lived probes of what QEMU
        // can do (run when an agent starts)
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("guest="))
        })
        .collect()
}

/// The events of `kind` about `subject` (of the newest 2000), asked with
/// `ferry PREFIX… events` (`--control URL` for one control instance).
pub fn events_matching(prefix: &[&str], kind: &str, subject: &str) -> Vec<Value> {
    let mut args = prefix.to_vec();
    args.extend(["events", "--limit", "2000"]);
    ferry_json(&args)
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["kind"] == kind && e["subject"] == subject)
        .cloned()
        .collect()
}

/// Whether QEMU process `pid` runs guest `vm`.
pub fn runs_guest(pid: i32, vm: &str) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| {
            String::from_utf8_lossy(&c)
                .replace('\0', " ")
                .contains(&format!("guest={vm},"))
        })
        .unwrap_or(false)
}

pub fn host_info(host: &str) -> Value {
    let hosts = ferry_json(&["host", "list"]);
    hosts
        .as_array()
        .expect("hosts")
        .iter()
        .find(|h| h["name"] == host)
        .cloned()
        .expect("host listed")
}

/// Removes a VM if it exists (cleanup between tests).
pub fn remove_vm(name: &str) {
    let _ = ferry(&["vm", "rm", name]);
}

/// Removes a VM when dropped, so a failing test leaves no guest behind.
pub struct VmGuard(pub &'static str);

impl VmGuard {
    /// Creates a VM (removing a leftover of the same name first).
    pub fn create(name: &'static str, host: &str, memory: &str, fill: &str) -> VmGuard {
        remove_vm(name);
        ferry_ok(&[
            "vm", "create", name, "--host", host, "--memory", memory, "--fill", fill,
        ]);
        VmGuard(name)
    }
}

impl Drop for VmGuard {
    fn drop(&mut self) {
        remove_vm(self.0);
    }
}

/// Restarts a host's agent (SIGKILL, then start) with failpoints armed (""
/// for none). Its VMs outlive it and the new agent takes them back.
pub fn restart_agent_with(host: &str, failpoints: &str) {
    let out = Command::new(FERRY)
        .args(["lab", "restart-agent", host])
        .env("FERRY_FAILPOINTS", failpoints)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "restart-agent {host}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A host's agent restarted with fail points armed, and restarted without
/// them when this is dropped (whatever the test did in between).
pub struct Armed(&'static str);

impl Armed {
    pub fn at(host: &'static str, failpoints: &str) -> Armed {
        restart_agent_with(host, failpoints);
        Armed(host)
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        restart_agent_with(self.0, "");
    }
}

pub fn vm_entries(name: &str) -> Vec<serde_json::Value> {
    ferry_json(&["vm", "list"])
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["name"] == name)
        .cloned()
        .collect()
}

/// Waits until `name` runs intact on `host` and no QEMU is left on `gone`.
pub fn wait_settled_on(name: &str, host: &str, gone: &str, within: Duration) {
    let t0 = Instant::now();
    loop {
        // not found while only a skeleton has it: try again
        let out = ferry(&["vm", "check", name, "--json"]);
        let c: serde_json::Value =
            serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
        if c["host"] == host
            && c["intact"] == true
            && c["advancing"] == true
            && qemu_pids(gone).is_empty()
        {
            return;
        }
        assert!(
            t0.elapsed() < within,
            "{name} not settled on {host} within {within:?}: {c}; QEMUs on {gone}: {:?}",
            qemu_pids(gone)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Times the guest's vCPUs were started by a QEMU, from its log.
pub fn runs_in(log: &Path) -> usize {
    let text =
        std::fs::read_to_string(log).unwrap_or_else(|e| panic!("reading {}: {e}", log.display()));
    text.lines()
        .filter(|l| l.contains("vm_state_notify running 1"))
        .count()
}

/// The one file in `dir` whose name starts with `prefix` and ends with `suffix`.
pub fn one_file(dir: &str, prefix: &str, suffix: &str) -> PathBuf {
    let found: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy();
            n.starts_with(prefix) && n.ends_with(suffix)
        })
        .collect();
    assert_eq!(found.len(), 1, "{dir}/{prefix}*{suffix}: {found:?}");
    found.into_iter().next().unwrap()
}

fn lab_host(host: &str) -> u32 {
    ferry_lab::topology::host_index(host).unwrap_or_else(|| panic!("{host} is not a lab host"))
}

/// `host`'s own name for its NIC on lab fabric `k` (host1's are `ens1f0`,
/// `ens1f1`; host2's `eth4`, `eth5`; host3's `enp3s0`, `enp4s0`). Lab
/// commands take `nicK` as well; what agents report is the real name.
pub fn nic(host: &str, k: u32) -> String {
    ferry_lab::topology::nic_name(lab_host(host), k)
}

/// The address of `host`'s NIC on lab fabric `k`.
pub fn nic_addr(host: &str, k: u32) -> String {
    ferry_lab::topology::nic_addr(lab_host(host), k)
}

/// The last `n` lines of a host agent's log, for a failing test's report.
pub fn agent_log_tail(host: &str, n: usize) -> String {
    let text = std::fs::read_to_string(format!("{LAB}/{host}/agent.log")).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// SIGKILLs a host's agent (its pid file from `ferry lab up`) and waits until
/// it is gone.
pub fn kill_agent(host: &str) {
    let pid: i32 = std::fs::read_to_string(format!("{LAB}/{host}/agent.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: kill(2) with a pid and a signal has no memory effects.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    for _ in 0..200 {
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if state.is_empty()
            || state
                .rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("agent of {host} (pid {pid}) survived SIGKILL");
}

/// A `FERRYDSK` block as the workload guest writes it (see
/// `crates/lab/guest/workload.c`): (seed, seq) when intact.
pub fn disk_block(b: &[u8]) -> Option<(u64, u64)> {
    fn mix(mut x: u64) -> u64 {
        x = x.wrapping_add(0x9E3779B97F4A7C15);
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D049BB133111EB);
        x ^ (x >> 31)
    }
    let w = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
    if &b[..8] != b"FERRYDSK" {
        return None;
    }
    let (seed, seq) = (w(1), w(2));
    (3..512)
        .all(|i| w(i) == mix(seed ^ (seq << 20) ^ i as u64))
        .then_some((seed, seq))
}

/// Positions in the workload guest's journal ring (see workload.c).
pub const JOURNAL_RING: u64 = 32;

/// The journal ring of the guest with `seed` in a raw disk image's bytes:
/// the sequence number at each ring position (None: not intact).
pub fn journal_ring(data: &[u8], seed: u64) -> Vec<Option<u64>> {
    const SLOTS: u64 = 64;
    let base = (SLOTS + (seed % SLOTS) * JOURNAL_RING) * 4096;
    (0..JOURNAL_RING)
        .map(|k| {
            let off = (base + k * 4096) as usize;
            disk_block(&data[off..off + 4096])
                .filter(|(s, _)| *s == seed)
                .map(|(_, q)| q)
        })
        .collect()
}

/// Which of the guest's last 32 acknowledged writes up to `last` are not in
/// `ring` (each must be there, or a later write in its ring position).
pub fn ring_missing(ring: &[Option<u64>], last: u64) -> Vec<u64> {
    (last.saturating_sub(JOURNAL_RING - 1).max(1)..=last)
        .filter(|s| {
            !matches!(ring[(s % JOURNAL_RING) as usize],
                Some(q) if q >= *s && q % JOURNAL_RING == s % JOURNAL_RING)
        })
        .collect()
}

/// The directories of VM `name` on `host` (it, and its incoming and moved
/// copies), newest console first.
pub fn vm_dirs(host: &str, name: &str) -> Vec<PathBuf> {
    let dir = Path::new(LAB).join(host).join("vms");
    let mut found: Vec<(std::time::SystemTime, PathBuf)> = Vec::new();
    for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        if n != name && !n.starts_with(&format!("{name}.")) && !n.starts_with(&format!("{name}-")) {
            continue;
        }
        if let Ok(m) = std::fs::metadata(e.path().join("console.log")).and_then(|m| m.modified()) {
            found.push((m, e.path()));
        }
    }
    found.sort();
    found.into_iter().rev().map(|(_, p)| p).collect()
}

/// The newest console of VM `name` on `host`.
pub fn console(host: &str, name: &str) -> String {
    vm_dirs(host, name)
        .first()
        .map(|d| std::fs::read_to_string(d.join("console.log")).unwrap_or_default())
        .unwrap_or_default()
}

/// Asks the QEMU of VM `name` on `host` one QMP `command` on its second
/// monitor (`handoff.sock`, which the agent opens only to hand a socket
/// over), as anyone with root on the host could: its `return`, or a panic
/// naming the error. The newest directory of the VM ([`vm_dirs`]) whose
/// monitor answers.
pub fn qemu_monitor(host: &str, name: &str, command: &str) -> Value {
    use std::io::Write;
    for d in vm_dirs(host, name) {
        let Ok(s) = std::os::unix::net::UnixStream::connect(d.join("handoff.sock")) else {
            continue;
        };
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut lines = BufReader::new(&s);
        // the greeting, then each command's reply (events skipped)
        let reply = |lines: &mut BufReader<&std::os::unix::net::UnixStream>| loop {
            let mut line = String::new();
            assert!(
                lines.read_line(&mut line).unwrap() > 0,
                "QEMU closed its monitor"
            );
            let v: Value = serde_json::from_str(&line).unwrap();
            if v.get("event").is_none() {
                return v;
            }
        };
        reply(&mut lines);
        for c in ["qmp_capabilities", command] {
            (&s).write_all(format!("{{\"execute\":\"{c}\"}}\n").as_bytes())
                .unwrap();
            let v = reply(&mut lines);
            if let Some(e) = v.get("error") {
                panic!("{c} on {}: {e}", d.display());
            }
            if c == command {
                return v["return"].clone();
            }
        }
    }
    panic!("no QEMU monitor of {name} on {host} answers")
}

/// (own seq, errors, peers as (seed, seq)).
pub type DiskLine = (u64, u64, Vec<(u64, u64)>);

/// The last `FERRY-DISK dev=vda` line of a guest.
pub fn last_disk_line(host: &str, name: &str) -> Option<DiskLine> {
    let text = console(host, name);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with("FERRY-DISK dev=vda "))?;
    let field = |k: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .unwrap_or("")
            .to_string()
    };
    let peers = field("peers")
        .split(',')
        .filter_map(|p| p.split_once(':'))
        .filter_map(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
        .collect();
    Some((
        field("seq").parse().ok()?,
        field("errors").parse().ok()?,
        peers,
    ))
}

/// Waits until guest `name` on `host` has read a block written by the guest
/// with `peer_seed` at a sequence above `after`; returns that sequence.
pub fn wait_for_peer(host: &str, name: &str, peer_seed: u64, after: u64) -> u64 {
    let t0 = Instant::now();
    loop {
        if let Some((_, errors, peers)) = last_disk_line(host, name) {
            assert_eq!(
                errors,
                0,
                "{name} saw disk errors:\n{}",
                console(host, name)
            );
            if let Some((_, seq)) = peers.iter().find(|(s, q)| *s == peer_seed && *q > after) {
                return *seq;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{name} on {host} never read seed {peer_seed}'s writes past {after}:\n{}",
            console(host, name)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// SIGKILLs the lab service whose pid is in `/run/ferry/lab/control/NAME.pid`
/// (`storage`, `storage2`, `control`).
pub fn kill_lab_service(name: &str) {
    let path = format!("/run/ferry/lab/control/{name}.pid");
    let pid: i32 = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .trim()
        .parse()
        .unwrap();
    // SAFETY: kill(2) of a lab service, a process the lab started.
    assert_eq!(
        unsafe { libc::kill(pid, libc::SIGKILL) },
        0,
        "{name} (pid {pid})"
    );
}

/// Disk `disk` as `ferry disk list` shows it, and the whole list (for messages).
pub fn disk_entry(disk: &str) -> (Value, Value) {
    let listed = ferry_json(&["disk", "list"]);
    let d = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == disk)
        .unwrap_or_else(|| panic!("disk {disk} is not listed: {listed}"))
        .clone();
    (d, listed)
}

/// A guest's own `seq`, once its disk line shows it past `after` with no error.
pub fn seq_past(host: &str, vm: &str, after: u64) -> u64 {
    let t0 = Instant::now();
    loop {
        match last_disk_line(host, vm) {
            Some((seq, 0, _)) if seq > after => return seq,
            Some((_, e, _)) if e > 0 => panic!("{vm} saw disk errors:\n{}", console(host, vm)),
            _ => {}
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{vm} on {host} wrote nothing past {after}:\n{}",
            console(host, vm)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `curl` to `url` with `args`; (HTTP status or 0 when no answer, body).
pub fn curl(url: &str, args: &[&str]) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "-m", "10", "-o", "-", "-w", "\n%{http_code}"])
        .args(args)
        .arg(url)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    eprintln!("curl {args:?} {url} -> {code} {body}");
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// `ferry` with the token in `token_file`.
pub fn ferry_as(token_file: &str, args: &[&str]) -> std::process::Output {
    let mut a = vec!["--token-file", token_file];
    a.extend_from_slice(args);
    ferry(&a)
}
