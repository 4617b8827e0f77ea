//! The storage service against real NBD peers: libnbd's `nbdinfo` and
//! `nbdcopy`, QEMU's NBD client (`qemu-io`), fio's nbd engine, and raw
//! hostile clients; QoS accuracy measured by fio. These run a storage node
//! on loopback (no root) and need those tools: such tests are `#[ignore]`d
//! (`--include-ignored` runs them, and a missing tool fails them).

#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

/// Tests that need the NBD peers are `#[ignore]`d; included, they fail at
/// once naming a missing tool.
fn require_tools() {
    let missing: Vec<&str> = ["nbdinfo", "nbdcopy", "qemu-io", "fio"]
        .into_iter()
        .filter(|t| Command::new(t).arg("--version").output().is_err())
        .collect();
    assert!(
        missing.is_empty(),
        "missing {} (apt install libnbd-bin qemu-utils fio)",
        missing.join(", ")
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One HTTP/1.1 request with the bearer credential: (status, raw body).
fn http(port: u16, method: &str, path: &str, token: &str, body: Option<Value>) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status: u16 = out[9..12].parse().unwrap();
    (
        status,
        out.split("\r\n\r\n").nth(1).unwrap_or("").to_string(),
    )
}

/// A storage node on loopback, killed on drop.
struct Node {
    dir: PathBuf,
    nbd: u16,
    api: u16,
    token: String,
    capacity: u64,
    name: String,
    /// More arguments to `ferry storage serve` (such as `--config FILE`).
    extra: Vec<String>,
    child: Option<Child>,
}

impl Node {
    fn start(test: &str, capacity: u64) -> Node {
        let dir = std::env::temp_dir().join(format!("ferry-storage-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let token = "0123456789abcdef0123456789abcdef".to_string();
        std::fs::write(dir.join("token"), &token).unwrap();
        let mut n = Node {
            dir,
            nbd: free_port(),
            api: free_port(),
            token,
            capacity,
            name: "storage1".into(),
            extra: Vec::new(),
            child: None,
        };
        n.spawn();
        n
    }

    fn spawn(&mut self) {
        let log = std::fs::File::create(self.dir.join("node.log")).unwrap();
        let child = Command::new(FERRY)
            .args([
                "storage",
                "serve",
                "--dir",
                &self.dir.join("node").display().to_string(),
                "--nbd-listen",
                &format!("127.0.0.1:{}", self.nbd),
                "--api-listen",
                &format!("127.0.0.1:{}", self.api),
                "--token-file",
                &self.dir.join("token").display().to_string(),
                "--capacity-iops",
                &self.capacity.to_string(),
                "--name",
                &self.name,
                // this suite tests NBD and QoS against real peers in clear;
                // NBD over TLS is tested in the lab (tests/security.rs)
                "--insecure-http",
            ])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let t0 = Instant::now();
        while TcpStream::connect(("127.0.0.1", self.api)).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "storage node did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A second node named `name` sharing this test's directory layout.
    fn start_named(test: &str, name: &str) -> Node {
        let mut n = Node::start(test, 0);
        n.kill();
        n.name = name.to_string();
        n.spawn();
        n
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill(); // SIGKILL
            let _ = c.wait();
        }
    }

    fn uri(&self, export: &str) -> String {
        format!("nbd://127.0.0.1:{}/{export}", self.nbd)
    }

    /// One REST call: (status, JSON body).
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let (status, body) = http(
            self.api,
            method,
            &format!("/api/v1{path}"),
            &self.token,
            body,
        );
        // chunked or not, the JSON is the line that parses
        let v = body
            .lines()
            .find_map(|l| serde_json::from_str(l).ok())
            .unwrap_or(Value::Null);
        (status, v)
    }

    fn ok(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let (s, v) = self.call(method, path, body);
        assert!(s < 300, "{method} {path}: {s} {v}");
        v
    }

    fn disk(&self, name: &str, size: u64, write_through: bool) {
        self.ok(
            "POST",
            "/disks",
            Some(json!({"name": name, "size": size, "write_through": write_through})),
        );
    }

    fn flows(&self) -> Vec<Value> {
        self.ok("GET", "/qos/flows", None)
            .as_array()
            .unwrap()
            .clone()
    }

    fn flow(&self, id: &str) -> Value {
        self.flows()
            .into_iter()
            .find(|f| f["id"] == id)
            .unwrap_or_else(|| panic!("no flow {id}"))
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd} {args:?} failed:\n{text}");
    text
}

#[test]
#[ignore = "needs nbdinfo, nbdcopy, qemu-io and fio; scripts/run test runs it with --include-ignored"]
fn libnbd_qemu_and_fio_read_and_write_disks() {
    require_tools();
    let node = Node::start("interop", 0);
    node.disk("d1", 64 << 20, false);
    node.disk("d2", 8 << 20, false);

    let list = run("nbdinfo", &["--list", &node.uri("")]);
    assert!(
        list.contains("export=\"d1\"") && list.contains("export=\"d2\""),
        "{list}"
    );
    let info = run("nbdinfo", &["--json", &node.uri("d1")]);
    let info: Value = serde_json::from_str(&info).unwrap();
    let e = &info["exports"][0];
    assert_eq!(e["export-size"], 64 << 20);
    assert_eq!(e["can_multi_conn"], true);
    assert_eq!(e["can_fua"], true);
    assert_eq!(e["block_size_maximum"], 32 << 20);
    assert_eq!(info["protocol"], "newstyle-fixed");
    // simple replies unless configured (nbd_limits.structured_replies)
    assert_eq!(info["structured"], false, "{info}");

    // nbdcopy, four connections, both ways
    let data: Vec<u8> = (0..64u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let src = node.dir.join("in.bin");
    let dst = node.dir.join("out.bin");
    std::fs::write(&src, &data).unwrap();
    run(
        "nbdcopy",
        &[
            "--connections=4",
            &src.display().to_string(),
            &node.uri("d1"),
        ],
    );
    run(
        "nbdcopy",
        &[
            "--connections=4",
            &node.uri("d1"),
            &dst.display().to_string(),
        ],
    );
    assert!(
        std::fs::read(&dst).unwrap() == data,
        "nbdcopy round trip differs"
    );

    // QEMU's client: writes with FUA, zeroes, discard, flush, reads checking patterns
    let q = run(
        "qemu-io",
        &[
            "-f",
            "raw",
            &node.uri("d2"),
            "-c",
            "write -P 0xab -f 1M 1M",
            "-c",
            "write -P 0x11 0 64k",
            "-c",
            "write -z 0 32k",
            "-c",
            "discard 1M 64k",
            "-c",
            "flush",
            "-c",
            "read -P 0 0 32k",
            "-c",
            "read -P 0x11 32k 32k",
            "-c",
            "read -P 0 1M 64k",
            "-c",
            "read -P 0xab 1088k 960k",
        ],
    );
    assert!(!q.contains("Pattern verification failed"), "{q}");

    // fio's nbd engine (libnbd), random read/write with checksums
    let f = run(
        "fio",
        &[
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={}", node.uri("d1")),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=16M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_state_save=0",
            "--output-format=json",
        ],
    );
    let f: Value = serde_json::from_str(&f[f.find('{').unwrap()..]).unwrap();
    assert_eq!(f["jobs"][0]["error"], 0, "{f}");
    assert!(
        f["jobs"][0]["read"]["io_bytes"].as_u64().unwrap() >= 16 << 20,
        "verified reads: {f}"
    );

    // resize through the API; clients see the new size
    node.ok("PUT", "/disks/d2/size", Some(json!({"size": 16 << 20})));
    let info: Value = serde_json::from_str(&run("nbdinfo", &["--json", &node.uri("d2")])).unwrap();
    assert_eq!(info["exports"][0]["export-size"], 16 << 20);
}

// ---- raw client for hostile requests ---------------------------------------

struct Raw(TcpStream);

impl Raw {
    /// Fixed-newstyle handshake up to options.
    fn open(node: &Node) -> Raw {
        let mut s = TcpStream::connect(("127.0.0.1", node.nbd)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut g = [0u8; 18];
        s.read_exact(&mut g).unwrap();
        assert_eq!(&g[0..8], b"NBDMAGIC");
        s.write_all(&3u32.to_be_bytes()).unwrap(); // FIXED_NEWSTYLE | NO_ZEROES
        Raw(s)
    }

    fn option(&mut self, opt: u32, data: &[u8]) -> (u32, Vec<u8>) {
        let mut m = b"IHAVEOPT".to_vec();
        m.extend_from_slice(&opt.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        self.0.write_all(&m).unwrap();
        self.reply()
    }

    fn reply(&mut self) -> (u32, Vec<u8>) {
        let mut h = [0u8; 20];
        self.0.read_exact(&mut h).unwrap();
        let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        let mut d = vec![0u8; len as usize];
        self.0.read_exact(&mut d).unwrap();
        (kind, d)
    }

    /// GO to `export` (no structured replies): returns the export size.
    fn go(node: &Node, export: &str) -> (Raw, u64) {
        let mut r = Raw::open(node);
        let mut d = (export.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(export.as_bytes());
        d.extend_from_slice(&0u16.to_be_bytes());
        let mut size = 0;
        let (mut kind, mut data) = r.option(7, &d);
        while kind == 3 {
            if data[0..2] == [0, 0] {
                size = u64::from_be_bytes(data[2..10].try_into().unwrap());
            }
            (kind, data) = r.reply();
        }
        assert_eq!(
            kind,
            1,
            "GO not acknowledged: {kind:#x} {}",
            String::from_utf8_lossy(&data)
        );
        (r, size)
    }

    fn request(
        &mut self,
        flags: u16,
        kind: u16,
        cookie: u64,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) {
        let mut m = 0x2560_9513u32.to_be_bytes().to_vec();
        m.extend_from_slice(&flags.to_be_bytes());
        m.extend_from_slice(&kind.to_be_bytes());
        m.extend_from_slice(&cookie.to_be_bytes());
        m.extend_from_slice(&offset.to_be_bytes());
        m.extend_from_slice(&len.to_be_bytes());
        m.extend_from_slice(payload);
        self.0.write_all(&m).unwrap();
    }

    /// A simple reply: (error, cookie).
    fn simple(&mut self) -> (u32, u64) {
        let mut h = [0u8; 16];
        self.0.read_exact(&mut h).unwrap();
        assert_eq!(&h[0..4], &0x6744_6698u32.to_be_bytes());
        (
            u32::from_be_bytes(h[4..8].try_into().unwrap()),
            u64::from_be_bytes(h[8..16].try_into().unwrap()),
        )
    }

    fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.0.read(&mut b), Ok(0) | Err(_))
    }
}

#[test]
#[ignore = "needs nbdinfo, nbdcopy, qemu-io and fio; scripts/run test runs it with --include-ignored"]
fn structured_replies_when_configured_carry_reads_to_libnbd_and_qemu() {
    require_tools();
    let mut node = Node::start("structured", 0);
    node.kill();
    let conf = node.dir.join("storage.toml");
    std::fs::write(&conf, "[nbd_limits]\nstructured_replies = true\n").unwrap();
    node.extra = vec!["--config".into(), conf.display().to_string()];
    node.spawn();
    node.disk("d", 8 << 20, false);
    let info: Value = serde_json::from_str(&run("nbdinfo", &["--json", &node.uri("d")])).unwrap();
    assert_eq!(info["structured"], true, "{info}");
    // QEMU's client reads patterns back through structured replies
    let q = run(
        "qemu-io",
        &[
            "-f",
            "raw",
            &node.uri("d"),
            "-c",
            "write -P 0x5c 64k 1M",
            "-c",
            "read -P 0x5c 64k 1M",
            "-c",
            "read -P 0 0 64k",
        ],
    );
    assert!(!q.contains("Pattern verification failed"), "{q}");
    // libnbd's, over two connections, byte for byte
    let out = node.dir.join("out.bin");
    run(
        "nbdcopy",
        &[
            "--connections=2",
            &node.uri("d"),
            &out.display().to_string(),
        ],
    );
    let got = std::fs::read(&out).unwrap();
    assert!(got[..64 << 10].iter().all(|b| *b == 0));
    assert!(got[64 << 10..(64 << 10) + (1 << 20)]
        .iter()
        .all(|b| *b == 0x5c));
    // a value of the wrong type is refused at start, naming the key
    node.kill();
    std::fs::write(&conf, "[nbd_limits]\nstructured_replies = \"yes\"\n").unwrap();
    let mut child = Command::new(FERRY)
        .args(["storage", "serve", "--config"])
        .arg(&conf)
        .args(["--dir", &node.dir.join("node").display().to_string()])
        .args(["--nbd-listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0"])
        .arg("--insecure-http")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            panic!("a node with a bad structured_replies started");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("structured_replies"),
        "{err}"
    );
}

#[test]
#[ignore = "needs nbdinfo, nbdcopy, qemu-io and fio; scripts/run test runs it with --include-ignored"]
fn hostile_clients_get_the_spec_errors_and_others_are_served() {
    require_tools();
    let node = Node::start("hostile", 0);
    node.disk("d", 1 << 20, false);
    let good = vec![0x5au8; 4096];

    // unknown client flags: the server closes
    let mut s = TcpStream::connect(("127.0.0.1", node.nbd)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut g = [0u8; 18];
    s.read_exact(&mut g).unwrap();
    s.write_all(&0x8000_0001u32.to_be_bytes()).unwrap();
    assert!(
        Raw(s).closed(),
        "unknown client flags must end the connection"
    );

    // options: unknown → ERR_UNSUP, oversized → ERR_TOO_BIG, bad GO → ERR_INVALID,
    // unknown export → ERR_UNKNOWN, LIST with data → ERR_INVALID; the session goes on
    let mut r = Raw::open(&node);
    assert_eq!(r.option(99, b"").0, (1 << 31) + 1);
    assert_eq!(r.option(3, &vec![0u8; 100 << 10]).0, (1 << 31) + 9);
    assert_eq!(r.option(7, &[0, 0, 1, 0, b'x']).0, (1 << 31) + 3);
    let mut d = 4u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"nope\0\0");
    assert_eq!(r.option(7, &d).0, (1 << 31) + 6);
    assert_eq!(r.option(3, b"x").0, (1 << 31) + 3);
    let (kind, data) = r.option(3, b"");
    assert_eq!((kind, &data[4..]), (2, &b"d"[..]));
    assert_eq!(r.reply().0, 1);

    // transmission: each bad request gets its error, the connection stays usable
    let (mut r, size) = Raw::go(&node, "d");
    assert_eq!(size, 1 << 20);
    r.request(0, 1, 1, 0, 4096, &good);
    assert_eq!(r.simple(), (0, 1));
    r.request(0, 0, 2, size, 512, &[]); // read past the end
    assert_eq!(r.simple(), (22, 2));
    r.request(0, 1, 3, size - 100, 4096, &good); // write past the end, payload skipped
    assert_eq!(r.simple(), (28, 3));
    r.request(0, 42, 4, 0, 0, &[]); // unknown command
    assert_eq!(r.simple(), (22, 4));
    r.request(1 << 7, 3, 5, 0, 0, &[]); // unknown flag on flush
    assert_eq!(r.simple(), (22, 5));
    r.request(0, 0, 6, u64::MAX - 10, 4096, &[]); // offset overflow
    assert_eq!(r.simple(), (22, 6));
    r.request(0, 0, 7, 0, 4096, &[]); // and still a good read
    assert_eq!(r.simple(), (0, 7));
    let mut back = vec![0u8; 4096];
    r.0.read_exact(&mut back).unwrap();
    assert_eq!(back, good);
    // an oversized write cannot be skipped: disconnected
    r.request(0, 1, 8, 0, 64 << 20, &[]);
    assert!(r.closed(), "an oversized write must end the connection");

    // a bad magic: disconnected
    let (mut r, _) = Raw::go(&node, "d");
    r.0.write_all(&[0xde; 28]).unwrap();
    assert!(r.closed());

    // a client that vanishes halfway through a write payload
    let (mut r, _) = Raw::go(&node, "d");
    r.request(0, 1, 9, 8192, 4096, &[]);
    r.0.write_all(&[0x77; 1000]).unwrap();
    drop(r);

    // a client that never finishes its handshake does not block others;
    // everyone else is still served and nothing written was lost
    let _idle = TcpStream::connect(("127.0.0.1", node.nbd)).unwrap();
    let out = node.dir.join("check.bin");
    run("nbdcopy", &[&node.uri("d"), &out.display().to_string()]);
    let disk = std::fs::read(&out).unwrap();
    assert_eq!(&disk[..4096], &good[..], "acknowledged write lost");
    assert!(
        disk[8192..12288].iter().all(|b| *b == 0),
        "half-received write was applied"
    );
    let (s, v) = node.call("GET", "/disks", None);
    assert_eq!(s, 200, "{v}");
}

#[test]
#[ignore = "needs nbdinfo, nbdcopy, qemu-io and fio; scripts/run test runs it with --include-ignored"]
fn write_through_writes_survive_sigkill() {
    require_tools();
    let mut node = Node::start("wt", 0);
    node.disk("wt", 4 << 20, true);
    let (mut r, _) = Raw::go(&node, "wt");
    // 256 writes, each acknowledged before the next; then SIGKILL at once
    for i in 0..256u64 {
        let block = vec![(i as u8) ^ 0xa5; 4096];
        r.request(0, 1, i, i * 4096, 4096, &block);
        assert_eq!(r.simple(), (0, i));
    }
    node.kill();
    node.spawn();
    let out = node.dir.join("after.bin");
    run("nbdcopy", &[&node.uri("wt"), &out.display().to_string()]);
    let disk = std::fs::read(&out).unwrap();
    for i in 0..256usize {
        assert!(
            disk[i * 4096..(i + 1) * 4096]
                .iter()
                .all(|b| *b == (i as u8) ^ 0xa5),
            "acknowledged write {i} is not on disk after SIGKILL"
        );
    }
    let d = node.ok("GET", "/disks", None);
    assert_eq!(d[0]["write_through"], true, "{d}");
}

// ---- QoS, measured with fio ----------------------------------------------------

/// Runs one fio job per (name, uri) for `secs`; returns read IOPS and bytes/s per job.
fn fio(jobs: &[(&str, String)], bs: &str, secs: u32) -> Vec<(f64, f64)> {
    fio_ramped(jobs, bs, secs, 1)
}

/// [`fio`] with `ramp` seconds left out of the measurement.
fn fio_ramped(jobs: &[(&str, String)], bs: &str, secs: u32, ramp: u32) -> Vec<(f64, f64)> {
    let mut args = vec![
        "--ioengine=nbd".to_string(),
        "--rw=randread".to_string(),
        format!("--bs={bs}"),
        "--iodepth=16".to_string(),
        "--size=32M".to_string(),
        "--time_based".to_string(),
        format!("--runtime={secs}"),
        format!("--ramp_time={ramp}"),
        "--output-format=json".to_string(),
    ];
    for (name, uri) in jobs {
        args.push(format!("--name={name}"));
        args.push(format!("--uri={uri}"));
    }
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run("fio", &argv);
    let v: Value = serde_json::from_str(&out[out.find('{').unwrap()..]).unwrap();
    v["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| {
            (
                j["read"]["iops"].as_f64().unwrap(),
                j["read"]["bw_bytes"].as_f64().unwrap(),
            )
        })
        .collect()
}

#[test]
#[ignore = "needs nbdinfo, nbdcopy, qemu-io and fio; scripts/run test runs it with --include-ignored"]
fn qos_limits_hold_and_the_seed_policy_is_limited_by_what_is_reached_first() {
    require_tools();
    let node = Node::start("limits", 0);
    node.disk("d", 64 << 20, false);
    node.ok(
        "POST",
        "/qos/policies",
        Some(json!({"name": "cap", "kind": "dedicated", "max_iops": 500})),
    );
    node.ok("PUT", "/disks/d/policy", Some(json!({"policy": "cap"})));
    let r = fio(&[("capped", node.uri("d/vm1"))], "4k", 6);
    let iops = r[0].0;
    assert!(
        (iops - 500.0).abs() <= 25.0,
        "max 500 IOPS: fio measured {iops:.0}"
    );

    // seed 004: min 250, max 500, max 100 MB/s
    node.ok(
        "POST",
        "/qos/policies",
        Some(json!({"name": "demo", "kind": "dedicated", "min_iops": 250, "max_iops": 500, "max_bandwidth": 100 << 20})),
    );
    node.ok("PUT", "/disks/d/policy", Some(json!({"policy": "demo"})));
    let small = fio(&[("small", node.uri("d/vm1"))], "4k", 6)[0];
    assert!(
        (small.0 - 500.0).abs() <= 25.0,
        "4K I/O: IOPS-limited at 500, got {:.0}",
        small.0
    );
    assert!(
        small.1 < 0.1 * (100 << 20) as f64,
        "4K I/O stays far below 100 MB/s"
    );
    // with a 1 MiB normalization a 1 MiB I/O counts once: 500 IOPS would be
    // 500 MiB/s, so the 100 MiB/s cap is what is reached first
    node.ok(
        "PUT",
        "/qos/settings",
        Some(json!({"normalization": 1 << 20})),
    );
    let large = fio(&[("large", node.uri("d/vm1"))], "1m", 6)[0];
    let mibs = large.1 / (1 << 20) as f64;
    assert!(
        (mibs - 100.0).abs() <= 5.0,
        "1M I/O: bandwidth-limited at 100 MiB/s, got {mibs:.1}"
    );
    assert!(large.0 < 450.0, "IOPS below the cap: {:.0}", large.0);
    node.ok("PUT", "/qos/settings", Some(json!({"normalization": 8192})));

    // Aggregated: two flows of one disk share one 600 IOPS pool
    node.ok(
        "POST",
        "/qos/policies",
        Some(json!({"name": "pool", "kind": "aggregated", "max_iops": 600})),
    );
    node.ok("PUT", "/disks/d/policy", Some(json!({"policy": "pool"})));
    let r = fio(
        &[("a", node.uri("d/vma")), ("b", node.uri("d/vmb"))],
        "4k",
        6,
    );
    let total = r[0].0 + r[1].0;
    assert!((total - 600.0).abs() <= 30.0, "aggregated total {total:.0}");
    for (i, (iops, _)) in r.iter().enumerate() {
        assert!(
            (iops - 300.0).abs() <= 45.0,
            "flow {i} got {iops:.0} of the shared 600"
        );
    }
    let f = node.flow("d/vma");
    assert_eq!(f["policy"], "pool");
    assert_eq!(f["max_iops"], 600);

    // an allocation from outside (the cluster-wide manager's lever) overrides the policy
    let uri = node.uri("d/vma");
    let bg = std::thread::spawn(move || fio(&[("alloc", uri)], "4k", 6));
    std::thread::sleep(Duration::from_millis(500));
    let f = node.ok(
        "PUT",
        "/qos/allocations",
        Some(json!({"flow": "d/vma", "allocation": {"max_iops": 250}})),
    );
    assert_eq!(f["max_iops"], 250, "{f}");
    let iops = bg.join().unwrap()[0].0;
    assert!(
        (iops - 250.0).abs() <= 15.0,
        "allocated 250 IOPS: fio measured {iops:.0}"
    );
    let (s, v) = node.call(
        "PUT",
        "/qos/allocations",
        Some(json!({"flow": "nope/x", "allocation": null})),
    );
    assert_eq!(s, 404, "{v}");
    let f = node.ok(
        "PUT",
        "/qos/allocations",
        Some(json!({"flow": "d/vma", "allocation": null})),
    );
    assert_eq!(f["max_iops"], 600, "back to the policy: {f}");
}

#[test]
#[ignore = "needs nbdinfo, nbdcopy, qemu-io and fio; scripts/run test runs it with --include-ignored"]
fn a_reservation_holds_against_busy_neighbours_and_statuses_follow() {
    require_tools();
    // a node whose backing store sustains 4000 normalized IOPS: five busy
    // flows would get 800 each; the reserved one must keep its 1000
    let node = Node::start("reserve", 4000);
    for d in ["r", "n1", "n2", "n3", "n4"] {
        node.disk(d, 64 << 20, false);
    }
    node.ok(
        "POST",
        "/qos/policies",
        Some(json!({"name": "gold", "kind": "dedicated", "min_iops": 1000})),
    );
    node.ok("PUT", "/disks/r/policy", Some(json!({"policy": "gold"})));
    let jobs: Vec<(&str, String)> = ["r", "n1", "n2", "n3", "n4"]
        .iter()
        .map(|d| (*d, node.uri(&format!("{d}/vm-{d}"))))
        .collect();
    let r = fio(&jobs, "4k", 8);
    let reserved = r[0].0;
    let total: f64 = r.iter().map(|x| x.0).sum();
    assert!(
        reserved >= 950.0,
        "min 1000: got {reserved:.0} (all: {r:?})"
    );
    assert!(total <= 4000.0 * 1.05, "capacity 4000 exceeded: {total:.0}");
    assert!(total >= 3600.0, "capacity left unused: {total:.0}");

    // a minimum above what the node can give: InsufficientThroughput while busy
    node.ok(
        "PUT",
        "/qos/policies/gold",
        Some(json!({"name": "gold", "kind": "dedicated", "min_iops": 5000})),
    );
    let uri = node.uri("r/vm-r");
    let bg = std::thread::spawn(move || fio(&[("r", uri)], "4k", 7));
    std::thread::sleep(Duration::from_secs(5));
    let f = node.flow("r/vm-r");
    assert_eq!(f["status"], "InsufficientThroughput", "{f}");
    assert_eq!(f["min_iops"], 5000);
    // the policy removed under it: the flow runs unlimited, UnknownPolicyId
    node.ok("DELETE", "/qos/policies/gold", None);
    std::thread::sleep(Duration::from_millis(1500));
    let f = node.flow("r/vm-r");
    assert_eq!(f["status"], "UnknownPolicyId", "{f}");
    assert_eq!(f["min_iops"], 0);
    bg.join().unwrap();
    // the client is gone
    std::thread::sleep(Duration::from_millis(500));
    let f = node.flow("r/vm-r");
    assert_eq!(f["status"], "LostCommunication", "{f}");
    assert_eq!(f["host"], "127.0.0.1");
}

#[test]
fn bad_requests_to_the_api_name_what_was_wrong() {
    let node = Node::start("api", 0);
    let cases = [
        (
            "POST",
            "/disks",
            json!({"name": "a/b", "size": 4096}),
            "name",
        ),
        (
            "POST",
            "/disks",
            json!({"name": "ok", "size": 1000}),
            "size",
        ),
        (
            "POST",
            "/disks",
            json!({"name": "ok", "size": 4096, "colour": 1}),
            "colour",
        ),
        (
            "POST",
            "/qos/policies",
            json!({"name": "p", "kind": "dedicated", "min_iops": 900, "max_iops": 500}),
            "min_iops",
        ),
        (
            "POST",
            "/qos/policies",
            json!({"name": "p", "kind": "sometimes"}),
            "sometimes",
        ),
        (
            "PUT",
            "/qos/settings",
            json!({"normalization": 3000}),
            "normalization",
        ),
        ("PUT", "/disks/none/policy", json!({"policy": null}), "none"),
    ];
    for (m, p, body, word) in cases {
        let (s, v) = node.call(m, p, Some(body));
        assert!((400..500).contains(&s), "{m} {p}: {s} {v}");
        assert!(
            v["message"].as_str().unwrap_or("").contains(word),
            "{m} {p}: {v}"
        );
    }
    node.disk("busy", 1 << 20, false);
    let (mut r, _) = Raw::go(&node, "busy");
    let (s, v) = node.call("DELETE", "/disks/busy", None);
    assert_eq!(s, 409, "{v}");
    r.request(0, 2, 0, 0, 0, &[]); // NBD_CMD_DISC
    assert!(r.closed());
    std::thread::sleep(Duration::from_millis(200));
    node.ok("DELETE", "/disks/busy", None);
}

#[test]
#[ignore = "needs nbdinfo, nbdcopy, qemu-io and fio; scripts/run test runs it with --include-ignored"]
fn the_policy_manager_holds_an_aggregated_policy_across_two_nodes() {
    require_tools();
    let s1 = Node::start_named("pm1", "s1");
    let mut s2 = Node::start_named("pm2", "s2");
    // a control service in front of both nodes (no hosts needed)
    let port = free_port();
    let log = std::fs::File::create(s1.dir.join("control.log")).unwrap();
    let mut control = Command::new(FERRY)
        .args([
            "control",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--token-file",
            &s1.dir.join("token").display().to_string(),
            "--storage",
            &format!("s1=http://127.0.0.1:{}", s1.api),
            "--storage",
            &format!("s2=http://127.0.0.1:{}", s2.api),
            "--state",
            &s1.dir.join("control.db").display().to_string(),
            "--admin-token",
            &s1.dir.join("token").display().to_string(),
            "--insecure-http",
        ])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let via = |args: &[&str]| {
        let out = Command::new(FERRY)
            .args(args)
            .env("FERRY_CONTROL", format!("http://127.0.0.1:{port}"))
            .env("FERRY_TOKEN_FILE", s1.dir.join("token"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "ferry {args:?}: {text}");
        text
    };
    let t0 = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(50));
    }
    // one VM's two disks, one on each node, under one Aggregated policy
    via(&["disk", "create", "sys", "--size", "64M", "--node", "s1"]);
    via(&["disk", "create", "data", "--size", "64M", "--node", "s2"]);
    via(&[
        "qos",
        "policy",
        "new",
        "vmcap",
        "--type",
        "aggregated",
        "--max-iops",
        "600",
    ]);
    via(&["disk", "set", "sys", "--policy", "vmcap"]);
    via(&["disk", "set", "data", "--policy", "vmcap"]);
    let list = via(&["disk", "list"]);
    assert!(list.contains("s1") && list.contains("s2"), "{list}");
    // both flows busy: each node alone would give 600; together they get 600
    let jobs = [("sys", s1.uri("sys/vm1")), ("data", s2.uri("data/vm1"))];
    let iops: Vec<f64> = fio_ramped(&jobs, "4k", 8, 4).iter().map(|x| x.0).collect();
    let total: f64 = iops.iter().sum();
    assert!(
        (total - 600.0).abs() <= 60.0,
        "aggregated across two nodes: {iops:?}"
    );
    for i in &iops {
        assert!(*i > 150.0, "both flows keep a share: {iops:?}");
    }
    let f = s1.flow("sys/vm1");
    assert!(
        f["max_iops"].as_u64().unwrap() < 600,
        "node s1 holds a part: {f}"
    );
    // the cluster's metrics show both nodes' flows, with units in the names
    let (status, text) = http(port, "GET", "/metrics", &s1.token, None);
    assert_eq!(status, 200, "{text}");
    for want in [
        "# TYPE ferry_storage_flow_iops gauge",
        "ferry_storage_flow_iops{flow=\"sys/vm1\",disk=\"sys\",node=\"s1\"",
        "ferry_storage_flow_bandwidth_bytes_per_second{flow=\"data/vm1\",disk=\"data\",node=\"s2\"",
        "ferry_storage_flow_status{flow=\"sys/vm1\",node=\"s1\",status=\"LostCommunication\"} 1",
    ] {
        assert!(text.contains(want), "metrics lack {want}:\n{text}");
    }
    let (status, _) = http(
        port,
        "GET",
        "/metrics",
        "wrong-token-wrong-token-wrong-tok",
        None,
    );
    assert_eq!(status, 401, "metrics need the credential");
    // a storage node that stops answering is seen and logged
    s2.kill();
    let t0 = Instant::now();
    loop {
        let nodes: Value = serde_json::from_str(&via(&["storage", "list", "--json"])).unwrap();
        let down = nodes
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["name"] == "s2" && n["reachable"] == false);
        let logged = via(&["events", "--json"]).contains("storage_down");
        if down && logged {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "s2's loss not seen: {nodes}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let _ = control.kill();
    let _ = control.wait();
}

// ---- backups and checkpoints -------------------------------------------------

/// Block `b` of a ring of `RING_BLOCKS` 4 KiB blocks: the number of the
/// write that last wrote it (0: never written).
const RING_BLOCKS: u64 = 256;

fn ring_values(file: &std::path::Path) -> Vec<u64> {
    let data = std::fs::read(file).unwrap();
    (0..RING_BLOCKS as usize)
        .map(|b| {
            let blk = &data[b * 4096..(b + 1) * 4096];
            let v = u64::from_le_bytes(blk[..8].try_into().unwrap());
            assert!(
                blk.chunks(8).all(|w| w == v.to_le_bytes()),
                "block {b} of {} is torn",
                file.display()
            );
            v
        })
        .collect()
}

/// Whether `ring` is the ring exactly as it stood after write `n` (writes
/// numbered from 1, write `k` to block `k % RING_BLOCKS`, one at a time).
fn ring_after(n: u64) -> Vec<u64> {
    (0..RING_BLOCKS)
        .map(|b| {
            if n < b || (b == 0 && n < RING_BLOCKS) {
                0
            } else {
                n - (n - b) % RING_BLOCKS
            }
        })
        .collect()
}

fn write_block(r: &mut Raw, cookie: u64, offset: u64, value: u64) {
    let payload: Vec<u8> = value.to_le_bytes().repeat(512);
    r.request(0, 1, cookie, offset, 4096, &payload);
    assert_eq!(r.simple(), (0, cookie), "write at {offset}");
}

fn wait_job(node: &Node, disk: &str) -> Value {
    let t0 = Instant::now();
    loop {
        let j = node.ok("GET", &format!("/disks/{disk}/job"), None);
        if j["state"] != "running" {
            return j;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "job stuck: {j}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn backups_and_checkpoints_hold_the_disk_at_their_instant_under_a_busy_writer() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    let node = Node::start("backup", 0);
    node.disk("b", 4 << 20, false);
    let img = node.dir.join("node/disks/b.img");

    // one writer, one write at a time: write k puts k in block k % 256
    let stop = Arc::new(AtomicBool::new(false));
    let (issued, acked) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let writer = {
        let (stop, issued, acked) = (stop.clone(), issued.clone(), acked.clone());
        let (mut r, size) = Raw::go(&node, "b");
        assert_eq!(size, 4 << 20);
        std::thread::spawn(move || {
            let mut k = 0;
            while !stop.load(Ordering::Relaxed) {
                k += 1;
                issued.store(k, Ordering::SeqCst);
                write_block(&mut r, k, (k % RING_BLOCKS) * 4096, k);
                acked.store(k, Ordering::SeqCst);
            }
            r
        })
    };
    while acked.load(Ordering::SeqCst) < 2 * RING_BLOCKS {
        std::thread::sleep(Duration::from_millis(10));
    }

    // a full backup, slowed to one 64 KiB granule a second: the writer, which
    // preserves a granule the copier has not reached by writing into it,
    // rewrites the whole ring before the copier's second step
    let full = node.dir.join("full.img");
    let before = acked.load(Ordering::SeqCst);
    let j = node.ok(
        "POST",
        "/disks/b/backups",
        Some(json!({"path": full.display().to_string(), "max_rate": 64 << 10})),
    );
    let started = issued.load(Ordering::SeqCst);
    assert_eq!(j["state"], "running", "{j}");
    assert_eq!(j["kind"], "backup");
    assert_eq!(j["bytes_total"], 1 << 20, "only allocated data: {j}");
    let j = wait_job(&node, "b");
    assert_eq!(j["state"], "done", "{j}");
    // every block of the ring rewritten while the copy ran: a copy that
    // mixed instants could not then pass the check below
    let during = acked.load(Ordering::SeqCst);
    assert!(
        during > started + RING_BLOCKS,
        "the writer did not race the copy ({started} → {during})"
    );
    assert!(
        j["bytes_preserved"].as_u64().unwrap() > 0,
        "no write reached a granule before the copier: {j}"
    );
    // the backup is the ring as it stood after one single write n*, taken
    // between the request and its answer
    let got = ring_values(&full);
    let n = *got.iter().max().unwrap();
    assert!(
        (before..=started).contains(&n),
        "backup's instant {n} not within {before}..={started}"
    );
    assert_eq!(got, ring_after(n), "the backup is not one instant");
    let m: Value =
        serde_json::from_slice(&std::fs::read(node.dir.join("full.img.json")).unwrap()).unwrap();
    assert_eq!(m["kind"], "backup");
    assert_eq!(m["extents"], json!([[0, 1 << 20]]), "{m}");
    use std::os::unix::fs::MetadataExt;
    let allocated = std::fs::metadata(&full).unwrap().blocks() * 512;
    assert!(allocated <= 1 << 20, "holes copied: {allocated} bytes");

    stop.store(true, Ordering::Relaxed);
    let mut r = writer.join().unwrap();
    let incremental = |name: &str| -> (Value, Value) {
        let p = node.dir.join(name);
        node.ok(
            "POST",
            "/disks/b/backups",
            Some(json!({"path": p.display().to_string(), "incremental": true})),
        );
        let j = wait_job(&node, "b");
        assert_eq!(j["state"], "done", "{j}");
        assert_eq!(j["kind"], "incremental_backup");
        let m = std::fs::read(node.dir.join(format!("{name}.json"))).unwrap();
        (j, serde_json::from_slice(&m).unwrap())
    };
    // what the writer wrote after the full backup's instant: the ring
    let (j, m1) = incremental("inc1.img");
    assert_eq!(j["base"], full.display().to_string());
    assert_eq!(m1["extents"], json!([[0, 1 << 20]]), "{m1}");
    // three writes since: the next one copies their granules only
    for (i, off) in [0u64, 2 << 20, (3 << 20) + 4096].into_iter().enumerate() {
        write_block(&mut r, 1_000_000 + i as u64, off, 7_000 + i as u64);
    }
    let (j, m2) = incremental("inc2.img");
    assert_eq!(j["bytes_total"], 3 * 65536, "{j}");
    assert_eq!(j["base"], node.dir.join("inc1.img").display().to_string());
    assert_eq!(
        m2["extents"],
        json!([[0, 65536], [2 << 20, 65536], [3 << 20, 65536]]),
        "{m2}"
    );
    // the full backup with both increments laid over it is the disk now
    let mut restored = std::fs::read(&full).unwrap();
    for (name, m) in [("inc1.img", &m1), ("inc2.img", &m2)] {
        let data = std::fs::read(node.dir.join(name)).unwrap();
        for e in m["extents"].as_array().unwrap() {
            let (o, l) = (
                e[0].as_u64().unwrap() as usize,
                e[1].as_u64().unwrap() as usize,
            );
            restored[o..o + l].copy_from_slice(&data[o..o + l]);
        }
    }
    assert!(
        restored == std::fs::read(&img).unwrap(),
        "full + increments ≠ disk"
    );

    // a checkpoint; the disk changes; revert is refused while it is open
    let j = node.ok("POST", "/disks/b/checkpoints", Some(json!({"name": "c1"})));
    assert_eq!(j["kind"], "checkpoint");
    assert_eq!(wait_job(&node, "b")["state"], "done");
    let at_checkpoint = std::fs::read(&img).unwrap();
    write_block(&mut r, 2_000_000, 4096, 99);
    let (s, e) = node.call("POST", "/disks/b/checkpoints/c1/revert", None);
    assert_eq!(s, 409, "{e}");
    assert!(e["message"].as_str().unwrap().contains("is open by"), "{e}");
    drop(r);
    let t0 = Instant::now();
    let reverted = loop {
        let (s, v) = node.call("POST", "/disks/b/checkpoints/c1/revert", None);
        if s == 200 {
            break v;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "{s} {v}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(reverted["size"], 4 << 20);
    assert!(
        std::fs::read(&img).unwrap() == at_checkpoint,
        "revert did not restore"
    );
    let cps = node.ok("GET", "/disks/b/checkpoints", None);
    assert_eq!(cps[0]["name"], "c1");
    assert_eq!(cps[0]["ready"], true);
    node.ok("DELETE", "/disks/b/checkpoints/c1", None);
    assert_eq!(node.ok("GET", "/disks/b/checkpoints", None), json!([]));

    // bad requests name what was wrong
    let bad = |body: Value, path: &str, status: u16, says: &str| {
        let (s, e) = node.call("POST", path, Some(body));
        assert_eq!(s, status, "{e}");
        let msg = e["message"].as_str().unwrap_or_default().to_string();
        assert!(msg.contains(says), "{msg}");
    };
    bad(
        json!({"path": "rel.img"}),
        "/disks/b/backups",
        400,
        "absolute",
    );
    let existing = full.display().to_string();
    bad(
        json!({"path": existing}),
        "/disks/b/backups",
        400,
        "exists already",
    );
    let nodir = "/nonexistent-dir/x.img";
    bad(json!({"path": nodir}), "/disks/b/backups", 400, "directory");
    node.disk("fresh", 1 << 20, false);
    let p = node.dir.join("fresh.img").display().to_string();
    bad(
        json!({"path": p, "incremental": true}),
        "/disks/fresh/backups",
        409,
        "take a full backup first",
    );
    assert!(
        !node.dir.join("fresh.img").exists(),
        "a refused backup left a file"
    );
    bad(
        json!({"name": "Bad Name"}),
        "/disks/b/checkpoints",
        400,
        "checkpoint",
    );
    bad(
        json!({"path": "/tmp/x", "bogus": 1}),
        "/disks/b/backups",
        400,
        "bogus",
    );
}
