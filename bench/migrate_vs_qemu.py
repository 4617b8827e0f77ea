#!/usr/bin/env python3
"""Ferry's live migration vs the same QEMU migration driven by hand over QMP.

Both run in one lab, on the same link (one NIC shaped to --rate), with the same
guest (kernel, initramfs, workload, memory, fill, dirty rate) and the same QEMU
parameters (max-bandwidth unlimited, downtime-limit 300 ms). Reported per run:
total time, QEMU's migration time, downtime, bytes, throughput, and
QEMU time / (bytes / link rate). Needs root and a built ferry binary.

    sudo python3 bench/migrate_vs_qemu.py [--runs 3] [--memory 1G] [--fill 768M]
"""
import argparse, json, subprocess, sys, time

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
    a = ap.parse_args()
    rate_bps = float(a.rate.replace("gbit", "e9").replace("mbit", "e6"))
    mem, fill, dirty = size(a.memory), size(a.fill), size(a.dirty_rate)
    ferry("lab", "up", "--replace", "--hosts", "2", "--nics", "1", "--rate", a.rate)
    img = ferry("lab", "image").split("guest image: ")[1].split(" ")[0]
    rows = []
    # Ferry
    ferry("vm", "create", "bench", "--host", "host1", "--memory", a.memory, "--fill", a.fill, "--dirty-rate", a.dirty_rate)
    ferry("vm", "check", "bench")
    hosts = ["host2", "host1"]
    for i in range(a.runs):
        r = json.loads(ferry("vm", "move", "bench", "--to", hosts[i % 2], "--json").strip().splitlines()[-1])
        assert r["event"] == "completed", r
        rows.append(("ferry", r["total_ms"], r["qemu_total_ms"], r["downtime_ms"], r["bytes_transferred"]))
    ferry("vm", "rm", "bench")
    # QEMU by hand over QMP, same link
    src = qemu("host1", "/run/ferry/bench/host1", img, mem, fill, dirty, False)
    wait_ready("/run/ferry/bench/host1/console.log")
    time.sleep(2)
    addrs = {h: lab_addr(h, 1) for h in ("host1", "host2")}
    at = "host1"
    for i in range(a.runs):
        to = hosts[i % 2]
        src, m = direct_run(img, at, to, addrs[to], mem, fill, dirty, src)
        rows.append(("qemu-direct", m["total_ms"], m["qemu_total_ms"], m["downtime_ms"], m["bytes"]))
        at = to
        time.sleep(2)
    src[1].cmd("quit")
    print(f"| path | run | total s | QEMU s | downtime ms | moved MiB | Mbit/s | QEMU time ÷ (bytes ÷ {a.rate}) |")
    print("|---|---|---|---|---|---|---|---|")
    sums = {}
    for n, (who, total, qt, down, b) in enumerate(rows):
        ideal = b * 8 / rate_bps * 1000
        ratio = qt / ideal
        sums.setdefault(who, []).append((total, qt, down, ratio))
        print(f"| {who} | {n % a.runs + 1} | {total / 1000:.2f} | {qt / 1000:.2f} | {down} | {b / 2**20:.0f} | {b * 8 / qt / 1000:.0f} | {ratio:.3f} |")
    f = [sum(x) / len(x) for x in zip(*sums["ferry"])]
    q = [sum(x) / len(x) for x in zip(*sums["qemu-direct"])]
    print(f"\nmeans: ferry total {f[0]/1000:.2f} s, QEMU time {f[1]/1000:.2f} s, downtime {f[2]:.0f} ms, ratio {f[3]:.3f}")
    print(f"       direct total {q[0]/1000:.2f} s, QEMU time {q[1]/1000:.2f} s, downtime {q[2]:.0f} ms, ratio {q[3]:.3f}")
    print(f"ferry ÷ direct: total {f[0]/q[0]:.2f}, QEMU time {f[1]/q[1]:.2f}")
    ferry("lab", "down")


if __name__ == "__main__":
    main()
