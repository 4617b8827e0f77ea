#!/usr/bin/env python3
"""Ferry's live migration vs the same QEMU migration driven by hand over QMP.

Both run in one lab, on the same link (one NIC shaped to --rate), with the same
guest (kernel, initramfs, workload, memory, fill, dirty rate) and the same QEMU
parameters (max-bandwidth unlimited, downtime-limit 300 ms). Reported per run:
total time, QEMU's migration time, downtime, bytes, throughput, and
QEMU time / (bytes / link rate). Ferry's move is timed three ways: to the guest running on
the target (the report's `running_ms`, what QEMU's by-hand time measures), to the end of its final
check (`total_ms`), and the `ferry vm move` command's wall clock. The contenders alternate, the
first in turn. --cpus gives each lab host CPUs of its own, the QEMUs by hand pinned the same way.
Medians. Needs root and a built ferry binary.

    sudo python3 bench/migrate_vs_qemu.py [--runs 3] [--memory 1G] [--fill 768M] [--cpus split]
"""
import argparse, json, statistics, subprocess, sys, time

import labqemu

from labqemu import ferry, lab_addr, qemu, run_target, size, wait_migration, wait_ready


def direct_run(img, src_ns, dst_ns, dst_addr, mem, fill, dirty, src):
    d = f"/run/ferry/bench/{dst_ns}"
    subprocess.run(["rm", "-rf", d])
    t0 = time.time()
    dp, dq = qemu(dst_ns, d, img, mem, fill, dirty, True)
    dq.cmd("migrate-incoming", uri=f"tcp:{dst_addr}:0")
    port = dq.cmd("query-migrate")["socket-address"][0]["port"]
    sp, sq = src
    sq.cmd("migrate-set-parameters", **{"max-bandwidth": 100 << 30, "downtime-limit": 300})
    sq.cmd("migrate", uri=f"tcp:{dst_addr}:{port}")
    info = wait_migration(sq)
    if info["status"] != "completed":
        sys.exit(f"direct migration failed: {info}")
    run_target(dq)
    total = (time.time() - t0) * 1000
    sq.cmd("quit")
    sp.wait()
    return (dp, dq), {"total_ms": total, "qemu_total_ms": info["total-time"], "downtime_ms": info["downtime"],
                      "bytes": info["ram"]["transferred"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--memory", default="1G")
    ap.add_argument("--fill", default="768M")
    ap.add_argument("--dirty-rate", default="8M")
    ap.add_argument("--rate", default="1gbit")
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    rate_bps = float(a.rate.replace("gbit", "e9").replace("mbit", "e6"))
    mem, fill, dirty = size(a.memory), size(a.fill), size(a.dirty_rate)
    ferry("lab", "up", "--replace", "--hosts", "2", "--nics", "1", "--rate", a.rate,
          *labqemu.cpus_flag(a))
    img = ferry("lab", "image").split("guest image: ")[1].split(" ")[0]
    rows = []
    ferry("vm", "create", "bench", "--host", "host1", "--memory", a.memory, "--fill", a.fill, "--dirty-rate", a.dirty_rate)
    ferry("vm", "check", "bench")
    src = qemu("host1", "/run/ferry/bench/host1", img, mem, fill, dirty, False)
    wait_ready("/run/ferry/bench/host1/console.log")
    time.sleep(2)
    addrs = {h: lab_addr(h, 1) for h in ("host1", "host2")}
    hosts = ["host2", "host1"]
    at = "host1"

    def by_ferry(i):
        t0 = time.time()
        r = json.loads(ferry("vm", "move", "bench", "--to", hosts[i % 2], "--json").strip().splitlines()[-1])
        wall = (time.time() - t0) * 1000
        assert r["event"] == "completed", r
        rows.append(("ferry", i, r["running_ms"], r["total_ms"], wall, r["qemu_total_ms"], r["downtime_ms"],
                     r["bytes_transferred"]))

    def by_hand(i):
        nonlocal src, at
        to = hosts[i % 2]
        src, m = direct_run(img, at, to, addrs[to], mem, fill, dirty, src)
        rows.append(("qemu-direct", i, m["total_ms"], m["total_ms"], m["total_ms"], m["qemu_total_ms"],
                     m["downtime_ms"], m["bytes"]))
        at = to

    # the contenders alternate, the first of each round in turn
    for i in range(a.runs):
        for f in ((by_ferry, by_hand) if i % 2 == 0 else (by_hand, by_ferry)):
            f(i)
            time.sleep(2)
    src[1].cmd("quit")
    ferry("vm", "rm", "bench")
    print(f"| path | run | to running s | total s | command s | QEMU s | downtime ms | moved MiB | Mbit/s | "
          f"QEMU time ÷ (bytes ÷ {a.rate}) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    med = {}
    for who, i, running, total, wall, qt, down, b in rows:
        ratio = qt / (b * 8 / rate_bps * 1000)
        med.setdefault(who, []).append((running, total, wall, qt, down))
        print(f"| {who} | {i + 1} | {running / 1000:.2f} | {total / 1000:.2f} | {wall / 1000:.2f} | {qt / 1000:.2f} | "
              f"{down} | {b / 2**20:.0f} | {b * 8 / qt / 1000:.0f} | {ratio:.3f} |")
    f = [statistics.median(x) for x in zip(*med["ferry"])]
    q = [statistics.median(x) for x in zip(*med["qemu-direct"])]
    print(f"\nmedians: ferry to running {f[0]/1000:.2f} s (total {f[1]/1000:.2f}, command {f[2]/1000:.2f}), "
          f"QEMU time {f[3]/1000:.2f} s, downtime {f[4]:.0f} ms")
    print(f"         direct to running {q[0]/1000:.2f} s, QEMU time {q[3]/1000:.2f} s, downtime {q[4]:.0f} ms")
    print(f"ferry ÷ direct: to running {f[0]/q[0]:.3f}, total {f[1]/q[1]:.3f}, command {f[2]/q[2]:.3f}, "
          f"QEMU time {f[3]/q[3]:.3f}")
    ferry("lab", "down")


if __name__ == "__main__":
    main()
