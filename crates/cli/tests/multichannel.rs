//! One migration over every NIC through Ferry's transport, in the lab:
//! both NICs carry it, a NIC cut mid-move is absorbed, and losing every NIC
//! leaves the guest running on the source — on Ferry's own carriers and on
//! kernel MPTCP managed by Ferry.
//! Needs root and QEMU ≥ 9 (see common/mod.rs); the tests are #[ignore]d; scripts/run test includes them.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use serde_json::Value;

fn nic_bytes(r: &Value, nic: &str) -> u64 {
    r["nic_tx_bytes"][nic].as_u64().unwrap_or(0)
}

/// Moves `vm` with `--option OPTION --json`: its final event, and the
/// skeleton step's detail (where the source gives the reasons it chose by).
fn move_explained(vm: &str, to: &str, option: &str) -> (Value, String) {
    let out = ferry(&["vm", "move", vm, "--to", to, "--option", option, "--json"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let events: Vec<Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let r = events.last().cloned().expect("at least one event");
    let skeleton = events
        .iter()
        .find(|e| e["event"] == "step" && e["step"] == "skeleton")
        .and_then(|e| e["detail"].as_str())
        .unwrap_or_else(|| panic!("no skeleton step: {text}"))
        .to_string();
    (r, skeleton)
}

/// Moves `vm` with `auto`; it must complete, for one of the reasons `why`
/// (parts of the `auto:` reason in its skeleton step), by the kind that
/// reason names.
fn auto_move(vm: &str, to: &str, why: &[&str]) -> Value {
    let (r, skeleton) = move_explained(vm, to, "auto");
    assert_eq!(r["event"], "completed", "{r}");
    let reason = skeleton
        .split("auto: ")
        .nth(1)
        .unwrap_or_else(|| panic!("no auto reason: {skeleton}"))
        .to_string();
    assert!(
        why.iter().any(|w| reason.contains(w)),
        "auto chose for another reason: {reason}"
    );
    let took = if reason.starts_with("Ferry's carriers") {
        ("multichannel", "ferry-transport")
    } else {
        ("mptcp", "ferry-mptcp")
    };
    assert_eq!(
        (r["option"].as_str(), r["data_path"].as_str()),
        (Some(took.0), Some(took.1)),
        "auto took another kind than its reason ({reason}): {r}"
    );
    r
}

/// Within 5 s of a move's end, the QEMU of `vm` on `host` has neither
/// `return-path` nor `switchover-ack` on (asked on its own monitor).
fn assert_hold_cleared(vm: &str, host: &str) {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let caps = qemu_monitor(host, vm, "query-migrate-capabilities");
        let on: Vec<&str> = caps
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| {
                c["state"] == true
                    && matches!(
                        c["capability"].as_str(),
                        Some("return-path" | "switchover-ack")
                    )
            })
            .filter_map(|c| c["capability"].as_str())
            .collect();
        if on.is_empty() {
            return;
        }
        assert!(
            std::time::Instant::now() < until,
            "{vm} on {host} still has {on:?} 5 s after its move"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn multichannel_move_spreads_over_both_nics() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    let _vm = VmGuard::create("mc1", "host1", "1G", "768M");
    let r = move_vm("mc1", "host2", "multichannel");
    assert_eq!(r["event"], "completed", "{r}");
    assert_eq!(r["option"], "multichannel");
    assert_eq!(r["data_path"], "ferry-transport");
    let (a, b) = (
        nic_bytes(&r, &nic("host1", 1)),
        nic_bytes(&r, &nic("host1", 2)),
    );
    let total = r["bytes_transferred"].as_u64().unwrap();
    // QEMU also counts zero pages it only describes; the payload is what crossed
    assert!(
        a + b >= total * 95 / 100,
        "carriers carried less than QEMU sent: {r}"
    );
    // the scheduler follows what each link drains; equal links share about equally
    assert!(
        a > total * 35 / 100 && b > total * 35 / 100,
        "unbalanced: nic1 {a}, nic2 {b} of {total}"
    );
    assert!(r["downtime_ms"].as_u64().unwrap() < 1000);
    assert_eq!(r["frames_resent"], 0);
    // a plain pre-copy over the carriers: the switch-over waited for the
    // target to load what it was sent (held by the source's carriers),
    // within the hold's bound, and the target's load then ends in QEMU's
    // own blackout (its completion waits for the target's return path)
    let held = r["hold_ms"].as_u64().expect("hold_ms");
    assert!(held <= 250, "held {held} ms: {r}");
    assert!(r["hold_caught_up"].is_boolean(), "{r}");
    // and the target clears the hold's capabilities once its QEMU has
    // completed: a later move out of it by a build that does not set them
    // would wait for an acknowledgement no target sends
    assert_hold_cleared("mc1", "host2");
    // CPU per host: both QEMUs and agents worked; per GiB is their sum ÷ GiB
    let cpu = &r["cpu"];
    let (src, dst) = (
        cpu["source_s"].as_f64().unwrap(),
        cpu["target_s"].as_f64().unwrap(),
    );
    assert!(src > 0.0 && dst > 0.0, "{cpu}");
    let per_gib = (src + dst) / (total as f64 / (1u64 << 30) as f64);
    assert!(
        (cpu["per_gib_s"].as_f64().unwrap() - per_gib).abs() < 0.01,
        "{cpu}"
    );
    let carriers = r["carriers"].as_array().unwrap();
    assert_eq!(carriers.len(), 2, "one carrier per NIC: {r}");
    assert!(
        carriers
            .iter()
            .all(|c| c["up"] == true && c["failures"] == 0),
        "{r}"
    );
    assert_intact_on("mc1", "host2");
    // and back with auto, encrypted (the default): Ferry's sealed carriers,
    // which encrypt on every NIC at once
    let r = auto_move("mc1", "host1", &["Ferry's carriers, sealed"]);
    assert!(
        nic_bytes(&r, &nic("host2", 1)) > 0 && nic_bytes(&r, &nic("host2", 2)) > 0,
        "auto used one NIC: {r}"
    );
    assert_eq!(
        (r["encrypted"].as_bool(), r["encryption"].as_str()),
        (Some(true), Some("sealed-carriers")),
        "{r}"
    );
    assert_intact_on("mc1", "host1");
    // encryption turned off by an administrator: over two healthy NICs,
    // memory that does not compress goes by the handed-off MPTCP socket, or
    // by Ferry's carriers when the idle CPU has room for their relay at the
    // links' rate; in clear, and the report says so
    let s = ferry_json(&["cluster", "set", "--encryption", "off"]);
    assert_eq!(s["encryption"], false, "{s}");
    let r = auto_move(
        "mc1",
        "host2",
        &[
            "only, so no byte passes through an agent",
            "room for the agents' relay",
        ],
    );
    ferry_ok(&["cluster", "set", "--encryption", "on"]);
    assert_eq!(
        (r["encrypted"].as_bool(), r["encryption"].as_str()),
        (Some(false), Some("off")),
        "{r}"
    );
    assert_intact_on("mc1", "host2");
    // and on again: QEMU's own stream in TLS with the move's key
    let r = move_vm("mc1", "host1", "tcp");
    assert_eq!(
        (r["event"].as_str(), r["encryption"].as_str()),
        (Some("completed"), Some("qemu-tls")),
        "{r}"
    );
    // QEMU's own stream: nothing of Ferry's to hold it
    assert!(r.get("hold_ms").is_none(), "{r}");
    assert_intact_on("mc1", "host1");
    let r = move_vm("mc1", "host2", "multichannel");
    assert_eq!(
        (r["event"].as_str(), r["encryption"].as_str()),
        (Some("completed"), Some("sealed-carriers")),
        "{r}"
    );
    assert!(
        nic_bytes(&r, &nic("host1", 1)) > 0 && nic_bytes(&r, &nic("host1", 2)) > 0,
        "{r}"
    );
    assert_intact_on("mc1", "host2");
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn a_nic_cut_mid_multichannel_move_is_absorbed() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    let _vm = VmGuard::create("mc2", "host1", "1G", "768M");
    // cut at ~40% of the guest's filled memory
    let r = move_with("mc2", "host2", "multichannel", 320 << 20, || {
        ferry_ok(&["lab", "link", "host2", "nic2", "down"]);
    });
    ferry_ok(&["lab", "link", "host2", "nic2", "up"]);
    assert_eq!(r["event"], "completed", "{r}");
    let carriers = r["carriers"].as_array().unwrap();
    let nic2 = carriers
        .iter()
        .find(|c| c["nic"] == nic("host1", 2).as_str())
        .unwrap();
    assert!(
        nic2["failures"].as_u64().unwrap() >= 1,
        "the cut was not noticed: {r}"
    );
    let nic1 = carriers
        .iter()
        .find(|c| c["nic"] == nic("host1", 1).as_str())
        .unwrap();
    assert_eq!(nic1["failures"], 0);
    // nic1 carried the rest
    assert!(
        nic_bytes(&r, &nic("host1", 1)) > nic_bytes(&r, &nic("host1", 2)),
        "{r}"
    );
    assert!(r["downtime_ms"].as_u64().unwrap() < 1000, "{r}");
    assert_intact_on("mc2", "host2");
}

#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn losing_every_nic_leaves_the_guest_on_the_source() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    let _vm = VmGuard::create("mc3", "host1", "1G", "768M");
    let r = move_with("mc3", "host3", "multichannel", 200 << 20, || {
        ferry_ok(&["lab", "link", "host3", "nic1", "down"]);
        ferry_ok(&["lab", "link", "host3", "nic2", "down"]);
    });
    ferry_ok(&["lab", "link", "host3", "nic1", "up"]);
    ferry_ok(&["lab", "link", "host3", "nic2", "up"]);
    assert_eq!(r["event"], "failed", "{r}");
    assert_eq!(r["error"]["running_on"], "host1");
    assert!(
        r["error"]["reason"]
            .as_str()
            .unwrap()
            .contains("every carrier is down"),
        "{r}"
    );
    assert_intact_on("mc3", "host1");
    assert!(qemu_pids("host3").is_empty(), "skeleton left on host3");
    // with the links back, the same VM moves
    assert_eq!(
        move_vm("mc3", "host3", "multichannel")["event"],
        "completed"
    );
    assert_intact_on("mc3", "host3");
}

/// Moves `vm` to `to` with `mptcp`, running `ferry lab link HOST NIC HOW`
/// (`cut`) once 150 MiB have moved and putting the link back after. The move
/// must complete; returns its report, the first `removed` path change of the
/// source's NIC `nic`, and how many ms after the cut that change came.
fn mptcp_move_with_cut(vm: &str, to: &str, cut: [&str; 3], nic: &str) -> (Value, Value, i64) {
    let cut_at = std::cell::Cell::new(0u64);
    let r = move_with(vm, to, "mptcp", 150 << 20, || {
        ferry_ok(&["lab", "link", cut[0], cut[1], cut[2]]);
        cut_at.set(ferry_api::util::now_ms());
    });
    ferry_ok(&["lab", "link", cut[0], cut[1], "up"]);
    assert_eq!(r["event"], "completed", "{r}");
    let removed = r["path_changes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["nic"] == nic && c["action"] == "removed")
        .cloned()
        .unwrap_or_else(|| panic!("no removal of {nic}'s subflow reported: {r}"));
    let after = removed["at_unix_ms"].as_u64().unwrap() as i64 - cut_at.get() as i64;
    (r, removed, after)
}

/// `--option mptcp` (QEMU handed the MPTCP socket): a NIC whose link is
/// down when the move starts joins once it returns (the in-kernel path
/// manager alone would never retry it), a NIC cut mid-move has its subflow
/// removed within 0.5 s and the move completes, sealed clusters refuse the clear
/// kind, and losing every NIC leaves the guest on the source; then
/// `mptcp-relay` moves it; last, a cut beyond the NICs (carriers kept) is
/// found by the source's silence rule within 1 s and the move completes.
#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn mptcp_move_rejoins_a_returning_nic_and_fails_safe() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    let _vm = VmGuard::create("mp1", "host1", "1G", "768M");
    ferry_ok(&["lab", "link", "host1", "nic2", "down"]);
    let r = move_with("mp1", "host2", "mptcp", 150 << 20, || {
        ferry_ok(&["lab", "link", "host1", "nic2", "up"]);
    });
    ferry_ok(&["lab", "link", "host1", "nic2", "up"]);
    assert_eq!(r["event"], "completed", "{r}");
    assert_eq!(r["option"], "mptcp", "{r}");
    assert_eq!(r["data_path"], "ferry-mptcp", "{r}");
    // the handed-off socket carries QEMU's TLS, keyed by the move
    assert_eq!(r["encryption"], "qemu-tls", "{r}");
    let total = r["bytes_transferred"].as_u64().unwrap();
    let carriers = r["carriers"].as_array().unwrap();
    let nic2 = carriers
        .iter()
        .find(|c| c["nic"] == nic("host1", 2).as_str())
        .unwrap();
    // nic2 came back after ~150 MiB of ~770: it must have carried a share of the rest
    let carried = nic2["tx_bytes"].as_u64().unwrap();
    assert!(
        carried > total / 8,
        "nic2 did not rejoin: {carried} of {total}: {r}"
    );
    assert!(nic2["connects"].as_u64().unwrap() >= 1, "{r}");
    assert!(r["downtime_ms"].as_u64().unwrap() < 1000, "{r}");
    assert!(r["cpu"]["per_gib_s"].as_f64().unwrap() > 0.0, "{r}");
    assert_intact_on("mp1", "host2");

    // one NIC of the source cut mid-move and kept down: the agent removes its
    // subflow at once (the kernel alone would wait out its retransmission
    // timers), the move completes over the other, and the report says when
    let nic2 = nic("host2", 2);
    let (r, removed, after) = mptcp_move_with_cut("mp1", "host1", ["host2", "nic2", "down"], &nic2);
    assert!(
        after <= 500,
        "{nic2}'s subflow removed {after} ms after the cut: {removed}"
    );
    assert!(
        removed["reason"].as_str().unwrap().contains("link down"),
        "{removed}"
    );
    assert!(r["downtime_ms"].as_u64().unwrap() < 1000, "{r}");
    assert_intact_on("mp1", "host1");

    // every NIC lost mid-move: the guest stays where it was
    let r = move_with("mp1", "host3", "mptcp", 150 << 20, || {
        ferry_ok(&["lab", "link", "host3", "nic1", "down"]);
        ferry_ok(&["lab", "link", "host3", "nic2", "down"]);
    });
    ferry_ok(&["lab", "link", "host3", "nic1", "up"]);
    ferry_ok(&["lab", "link", "host3", "nic2", "up"]);
    assert_eq!(r["event"], "failed", "{r}");
    assert_eq!(r["error"]["running_on"], "host1", "{r}");
    assert_intact_on("mp1", "host1");
    assert!(qemu_pids("host3").is_empty(), "skeleton left on host3");

    // the relayed form: QEMU multifd, each channel its own MPTCP connection
    let r = move_vm("mp1", "host2", "mptcp-relay");
    assert_eq!(r["event"], "completed", "{r}");
    assert_eq!(r["data_path"], "ferry-mptcp-relay", "{r}");
    assert_intact_on("mp1", "host2");

    // a cut neither host sees (the target's switch port stops forwarding,
    // every carrier stays up): the source finds the subflow silent while the
    // other is acknowledged, drops it, and the move completes over the other
    let (_, removed, after) =
        mptcp_move_with_cut("mp1", "host1", ["host1", "nic2", "silent"], &nic2);
    assert!(
        removed["reason"].as_str().unwrap().contains("no ACK") && after <= 1000,
        "{nic2}'s subflow removed {after} ms after the cut: {removed}"
    );
    assert_intact_on("mp1", "host1");
}

/// Bytes the source's NICs sent during the move, as its report gives them.
fn wire_bytes(r: &Value) -> u64 {
    r["nic_tx_bytes"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum()
}

/// `--option compression` on a link shaped so it is the bottleneck: a guest
/// whose memory compresses is compressed by QEMU in its multifd channels
/// (the move report says so, with its ratio and CPU) and crosses one carrier
/// within the downtime asked, intact; a guest whose memory does not is sent
/// as it is (or through QEMU's zstd, when the idle CPU covers it at the
/// link's rate), and its zero pages cost nothing on the wire.
#[test]
#[ignore = "lab: needs root, QEMU >= 9 and iproute2; scripts/run test runs it with --include-ignored"]
fn compression_shrinks_what_compresses_and_leaves_the_rest() {
    require_lab();
    let _g = serial();
    lab(3, 2);
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            ferry(&["lab", "rate", "host1", "nic1", "1gbit"]);
            ferry(&["lab", "rate", "host2", "nic1", "1gbit"]);
            ferry(&["lab", "link", "host1", "nic2", "up"]);
        }
    }
    let _restore = Restore;
    ferry_ok(&["lab", "rate", "host1", "nic1", "200mbit"]);

    remove_vm("cz1");
    ferry_ok(&[
        "vm",
        "create",
        "cz1",
        "--host",
        "host1",
        "--memory",
        "512M",
        "--fill",
        "384M",
        "--compressible",
    ]);
    let _vm = VmGuard("cz1");
    let r = move_vm("cz1", "host2", "compression");
    assert_eq!(r["event"], "completed", "{r}");
    assert_eq!(r["option"], "compression", "{r}");
    assert_eq!(r["carriers"].as_array().unwrap().len(), 1, "one NIC: {r}");
    // memory that compresses: QEMU compresses it in its multifd channels
    // (zstd 1) and reports it; Ferry's frames carry what QEMU wrote
    let q = &r["qemu_codec"];
    assert_eq!(q["codec"], "zstd:1", "QEMU compresses: {r}");
    assert!(q["ratio"].as_f64().unwrap() > 5.0, "{r}");
    assert!(q["raw_bytes"].as_u64().unwrap() >= 300 << 20, "{r}");
    assert!(q["cpu_s"].as_f64().unwrap() > 0.0, "{r}");
    let wire = wire_bytes(&r);
    assert!(wire < (384 << 20) / 5, "{wire} bytes on the wire: {r}");
    // the stream windows keep the target's loading close behind: the guest's
    // downtime stays within what was asked
    assert!(
        r["downtime_ms"].as_u64().unwrap() <= r["max_downtime_ms"].as_u64().unwrap(),
        "{r}"
    );
    let share = |r: &serde_json::Value, pick: &dyn Fn(&str) -> bool| -> f64 {
        r["codecs"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| pick(c["codec"].as_str().unwrap()))
            .map(|c| c["share"].as_f64().unwrap())
            .sum()
    };
    let all = share(&r, &|_| true);
    assert!((all - 1.0).abs() < 1e-6, "shares add up: {r}");
    assert_intact_on("cz1", "host2");
    // auto over both NICs: memory that compresses goes by Ferry's carriers
    // (with the CPU idle: the last second's share, so not the second the
    // target QEMU spent loading the move just made)
    std::thread::sleep(std::time::Duration::from_secs(2));
    // (sealed, as every move by default: compression comes before sealing)
    let r = auto_move(
        "cz1",
        "host1",
        &[
            "so frames are compressed when the link is the bottleneck",
            "Ferry's carriers, sealed",
        ],
    );
    assert!(
        r["qemu_codec"].is_object() || r["compression_ratio"].as_f64().unwrap_or(1.0) > 1.2,
        "compressible memory went uncompressed: {r}"
    );
    assert_intact_on("cz1", "host1");

    // auto over one NIC pair (host1's second link down): it samples the
    // memory as over several, and compresses what compresses
    ferry_ok(&["lab", "link", "host1", "nic2", "down"]);
    std::thread::sleep(std::time::Duration::from_secs(2));
    let (r, skeleton) = move_explained("cz1", "host2", "auto");
    ferry_ok(&["lab", "link", "host1", "nic2", "up"]);
    assert_eq!(r["event"], "completed", "{r}");
    assert!(
        skeleton.contains("auto: one NIC pair, and a memory sample compresses to"),
        "auto over one NIC pair chose for another reason: {skeleton}"
    );
    assert_eq!(r["option"], "compression", "{r}");
    assert_eq!(r["carriers"].as_array().unwrap().len(), 1, "one NIC: {r}");
    assert!(
        r["qemu_codec"].is_object() || r["compression_ratio"].as_f64().unwrap_or(1.0) > 1.2,
        "compressible memory went uncompressed over one NIC: {r}"
    );
    assert_intact_on("cz1", "host2");

    // half of its memory never written: zero pages
    remove_vm("cz2");
    ferry_ok(&[
        "vm",
        "create",
        "cz2",
        "--host",
        "host1",
        "--memory",
        "768M",
        "--fill",
        "384M",
        "--dirty-rate",
        "1M",
    ]);
    let _vm2 = VmGuard("cz2");
    let (r, skeleton) = move_explained("cz2", "host2", "compression");
    assert_eq!(r["event"], "completed", "{r}");
    // a sample of random memory does not compress: QEMU compresses it all
    // the same when the spare CPU covers zstd on every page at the link's
    // 200 Mbit/s (an idle CPU does), else sends its pages as they are; the
    // skeleton step says which, and the report agrees
    match r.get("qemu_codec") {
        Some(q) => {
            assert_eq!(q["codec"], "zstd:1", "{r}");
            assert!(q["ratio"].as_f64().unwrap() < 1.5, "random pages: {r}");
            assert!(
                skeleton.contains("although a memory sample compresses to")
                    && skeleton.contains("200 Mbit/s"),
                "the reason is given: {skeleton}"
            );
        }
        None => assert!(
            skeleton.contains("QEMU sends pages as they are"),
            "the reason is given: {skeleton}"
        ),
    }
    assert!(
        r["compression_ratio"].as_f64().unwrap() < 1.2,
        "random memory does not compress: {r}"
    );
    // (what compresses in it — the guest's kernel and its own code — is compressed)
    assert!(
        share(&r, &|c| c == "none") > 0.75,
        "random memory is sent as it is: {r}"
    );
    // QEMU leaves the zero pages out, and Ferry's frames add nothing back:
    // payloads plus their 32-byte headers are no more than QEMU's bytes
    let qemu = r["bytes_transferred"].as_u64().unwrap();
    assert!(
        qemu < (384 << 20) * 12 / 10 + (64 << 20),
        "QEMU sent {qemu} bytes for 384 MiB written of 768 MiB: {r}"
    );
    let wire = wire_bytes(&r);
    let frames: u64 = r["codecs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["frames"].as_u64().unwrap())
        .sum();
    if r.get("qemu_codec").is_some() {
        // QEMU compressed what compresses: Ferry's frames gain little on
        // top, and the wire is QEMU's bytes plus framing (Ethernet, IP and
        // TCP at MTU 1500: ~4.6%; Ferry's headers: 32 bytes per frame)
        assert!(
            wire <= qemu * 106 / 100,
            "{wire} bytes in {frames} frames on the wire for QEMU's {qemu}: {r}"
        );
    } else {
        assert!(
            wire + 32 * frames <= qemu,
            "{wire} bytes in {frames} frames on the wire for QEMU's {qemu}: {r}"
        );
    }
    assert_intact_on("cz2", "host2");

    // back over an unshaped link (10 Gbit/s as the NICs say): faster than
    // a few cores load pages, so the CPU is the limit. Encrypted (the
    // cluster's default) the move stays on Ferry's sealed carriers: QEMU's
    // own channels would seal every page in QEMU's TLS, dearer than the
    // agents' sealing
    ferry_ok(&["lab", "rate", "host1", "nic1", "10gbit"]);
    ferry_ok(&["lab", "rate", "host2", "nic1", "10gbit"]);
    std::thread::sleep(std::time::Duration::from_secs(2));
    let (r, skeleton) = move_explained("cz2", "host1", "compression");
    assert_eq!(r["event"], "completed", "{r}");
    assert_eq!(
        (
            r["option"].as_str(),
            r["data_path"].as_str(),
            r["encryption"].as_str()
        ),
        (
            Some("compression"),
            Some("ferry-transport"),
            Some("sealed-carriers")
        ),
        "{skeleton}: {r}"
    );
    assert!(
        !skeleton.contains("QEMU's own multifd channels"),
        "an encrypted move keeps the carriers: {skeleton}"
    );
    assert!(
        r["downtime_ms"].as_u64().unwrap() <= r["max_downtime_ms"].as_u64().unwrap(),
        "{r}"
    );
    assert_intact_on("cz2", "host1");

    // in clear, the agents' relay would only take from the CPU: QEMU's own
    // multifd channels carry the move
    ferry_ok(&["cluster", "set", "--encryption", "off"]);
    let (r, skeleton) = move_explained("cz2", "host2", "compression");
    ferry_ok(&["cluster", "set", "--encryption", "on"]);
    assert_eq!(r["event"], "completed", "{r}");
    assert_eq!(r["option"], "compression", "{r}");
    assert_eq!(r["encryption"], "off", "{r}");
    // (idle − 20%) × CPUs ÷ 3.5 CPU-s per GiB: up to 4 CPUs load less than
    // 10 Gbit/s of pages however idle they are
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus <= 4 {
        assert_eq!(r["data_path"], "qemu-multifd", "{skeleton}: {r}");
    }
    if r["data_path"] == "qemu-multifd" {
        assert!(
            skeleton.contains("QEMU's own multifd channels")
                && skeleton.contains("the CPU is the limit"),
            "the reason is given: {skeleton}"
        );
        assert!(r.get("qemu_codec").is_none(), "pages as they are: {r}");
        assert!(r["carriers"].as_array().unwrap().is_empty(), "{r}");
    } else {
        assert_eq!(r["data_path"], "ferry-transport", "{skeleton}: {r}");
    }
    assert!(
        r["downtime_ms"].as_u64().unwrap() <= r["max_downtime_ms"].as_u64().unwrap(),
        "{r}"
    );
    assert_intact_on("cz2", "host2");
}
