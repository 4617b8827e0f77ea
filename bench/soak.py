#!/usr/bin/env python3
"""Soak: one storage node, 256 NBD connections in 64 flows under storage QoS
policies, for a long while. Every 10 s each policy must hold (averaged over
those 10 s), no I/O may fail, and the server's memory must stay flat.

    python3 bench/soak.py [--seconds 600]

The node (loopback, --insecure-http: this measures the scheduler and the
server, not TLS) sustains 6,000 normalized IOPS (--capacity-iops). 16 disks,
each opened as 4 VMs (exports dK/vmJ: 64 flows), each flow over 4
connections (fio jobs of its nbd engine, 4K random read/write, depth 2, 25
read and 25 write IOPS each: 200 asked per flow, 12,800 in all, twice what
the node gives). Policies:
  disks 0-3   cap     dedicated, max 40 IOPS per flow
  disks 4-7   floor   dedicated, min 60 IOPS per flow
  disks 8-11  pool    aggregated, max 200 IOPS shared by its 16 flows
  disks 12-15 —       no policy
Bounds checked per 10 s window: a capped flow ≤ 1.1 × 40; a floor flow ≥
0.9 × 60 (it always asks for more); the pool's 16 flows together ≤ 1.1 ×
200. Memory: the
server's RSS at the end ≤ 1.25 × its RSS after the first minute (or the
first window in short runs) + 16 MiB.

Needs fio and libnbd (its nbd engine); uses target/release/ferry
(FERRY_BIN to override).
"""
import argparse, json, os, statistics, subprocess, sys, tempfile, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from storage import Ferry  # noqa: E402

DISK = 16 << 20


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=600)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="ferry-soak-")
    node = Ferry(work, "/dev/shm", capacity=6000)
    try:
        policies = {"cap": {"kind": "dedicated", "max_iops": 40},
                    "floor": {"kind": "dedicated", "min_iops": 60},
                    "pool": {"kind": "aggregated", "max_iops": 200}}
        for name, p in policies.items():
            node.call("POST", "/qos/policies", {"name": name, **p})
        kind = {}
        for d in range(16):
            node.call("POST", "/disks", {"name": f"d{d}", "size": DISK})
            pol = ["cap", "floor", "pool", None][d // 4]
            kind[f"d{d}"] = pol
            if pol:
                node.call("PUT", f"/disks/d{d}/policy", {"policy": pol})
        args = ["fio", "--thread", "--ioengine=nbd", "--rw=randrw", "--bs=4k", "--iodepth=2",
                "--rate_iops=25", f"--size={DISK}", "--time_based", f"--runtime={a.seconds}",
                "--output-format=json", "--norandommap", "--verify=0"]
        n = 0
        for d in range(16):
            for vm in range(4):
                for c in range(4):
                    args += [f"--name=d{d}-vm{vm}-c{c}", f"--uri={node.uri(f'd{d}/vm{vm}')}"]
                    n += 1
        print(f"soak: {n} connections, 64 flows, {a.seconds} s", flush=True)
        fio = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out = {}
        threading.Thread(target=lambda: out.update(zip(("stdout", "stderr"), fio.communicate())),
                         daemon=True).start()
        samples, violations, rss = [], [], []
        t0 = time.time()
        next_window = t0 + 20  # the first 10 s: connections open, the scheduler settles
        while fio.poll() is None and time.time() - t0 < a.seconds + 60:
            time.sleep(1)
            flows = node.call("GET", "/qos/flows")
            samples.append((time.time(), {f["id"]: f["iops"] for f in flows}))
            if time.time() >= next_window:
                window = [s for t, s in samples if t > next_window - 10]
                mean = {}
                for s in window:
                    for k, v in s.items():
                        mean[k] = mean.get(k, 0) + v / len(window)
                pools = {}
                for fid, iops in mean.items():
                    disk = fid.split("/")[0]
                    pol = kind.get(disk)
                    if pol == "cap" and iops > 44:
                        violations.append(f"{int(next_window - t0)} s: {fid} {iops:.0f} IOPS over its cap 40")
                    if pol == "floor" and iops < 54:
                        violations.append(f"{int(next_window - t0)} s: {fid} {iops:.0f} IOPS under its floor 60")
                    if pol == "pool":
                        pools["pool"] = pools.get("pool", 0) + iops
                # aggregated: one budget shared by every flow of every disk under it
                for name, iops in pools.items():
                    if iops > 220:
                        violations.append(f"{int(next_window - t0)} s: policy {name} {iops:.0f} IOPS over 200")
                rss.append(rss_kib(node.p.pid))
                flows_seen = len(mean)
                print(f"{int(next_window - t0):5d} s  flows {flows_seen}  "
                      f"cap {statistics.mean(v for k, v in mean.items() if kind.get(k.split('/')[0]) == 'cap'):5.1f}  "
                      f"floor {statistics.mean(v for k, v in mean.items() if kind.get(k.split('/')[0]) == 'floor'):5.1f}  "
                      f"pool (all) {pools.get('pool', 0):6.1f}  "
                      f"none {statistics.mean(v for k, v in mean.items() if kind.get(k.split('/')[0]) is None):5.1f}  "
                      f"RSS {rss[-1] / 1024:.1f} MiB  violations {len(violations)}", flush=True)
                next_window += 10
        fio.wait()
        time.sleep(0.5)
        v = json.loads(out["stdout"][out["stdout"].index("{"):]) if "{" in out.get("stdout", "") else {"jobs": []}
        errors = sum(j.get("error", 0) for j in v["jobs"])
        ios = sum(j["read"]["total_ios"] + j["write"]["total_ios"] for j in v["jobs"])
        base = rss[min(5, len(rss) - 1)] if rss else 0
        flat = bool(rss) and rss[-1] <= base * 1.25 + 16 * 1024
        print(f"\nsoak: {len(v['jobs'])} connections, {ios} I/Os, {errors} errors, "
              f"{len(violations)} policy violations in {len(rss)} windows, "
              f"RSS {base / 1024:.1f} -> {rss[-1] / 1024 if rss else 0:.1f} MiB ({'flat' if flat else 'GROWING'})")
        for x in violations[:20]:
            print("  " + x)
        ok = errors == 0 and not violations and flat and len(v["jobs"]) == n and fio.returncode == 0
        if fio.returncode != 0:
            print(out.get("stderr", "")[-2000:])
        sys.exit(0 if ok else 1)
    finally:
        node.stop()
        subprocess.run(["rm", "-rf", work])


if __name__ == "__main__":
    main()
