#!/usr/bin/env python3
"""The balancer against a greedy baseline, on the same start.

A lab of 3 hosts x 2 NICs (1 Gbit/s); 9 workload guests of different sizes,
filled memory and dirtying rates, 7 of them on host1, one each on host2 and
host3. Each round makes them afresh, lets the control service see their CPU
use for WARM seconds, then balances with one contender:

  ferry    `ferry cluster balance` (benefit per byte; moves one at a time)
  greedy   largest load first: from the most loaded host, its VM with the
           largest load (its memory share plus its CPU share, as the engine
           counts them) moves to the least loaded host, one `ferry vm move`
           at a time, until the spread is under the threshold, no move
           lowers it, or 16 moves

Both read the hosts' load and spread from `ferry cluster balance --dry-run`
(the same scoring), stop at the same threshold (0.10), and run their moves
one at a time. Reported per round and as medians over the rounds
(contenders alternate, ferry first in odd rounds): the spread before and
after, moves, bytes moved (QEMU's count from each move's report) and time.

    sudo python3 bench/balance.py [--rounds 3] [--warm 20]

Needs the lab (root, QEMU >= 9); uses the release build (labqemu.default_ferry; FERRY_BIN).
"""
import argparse, json, statistics, sys, time

# the same `ferry` runner as the HA bench (FERRY_BIN, errors raised)
from ha import ferry, fj
import labqemu  # noqa: E402
THRESHOLD = 0.10
# name, host, memory, fill, dirty rate: busy large, quiet large, and smaller ones
# (a filled guest keeps 256M for its kernel: at 1G, 128M left panics it)
GUESTS = [
    ("bg1", "host1", "1G", "768M", "8M"),
    ("bg2", "host1", "1G", "64M", "256K"),
    ("bg3", "host1", "768M", "512M", "4M"),
    ("bg4", "host1", "768M", "64M", "256K"),
    ("bg5", "host1", "512M", "256M", "2M"),
    ("bg6", "host1", "512M", "64M", "256K"),
    ("bg7", "host1", "384M", "128M", "1M"),
    ("bg8", "host2", "256M", "64M", "256K"),
    ("bg9", "host3", "256M", "64M", "256K"),
]


def cleanup():
    for g in GUESTS:
        ferry("vm", "rm", g[0], check=False)


def setup(warm):
    cleanup()
    for name, host, mem, fill, dirty in GUESTS:
        ferry("vm", "create", name, "--host", host, "--memory", mem, "--fill", fill,
              "--dirty-rate", dirty)
    time.sleep(warm)


def plan():
    return fj("cluster", "balance", "--dry-run", "--threshold", str(THRESHOLD))


def events(kind, after_ms):
    return [e for e in fj("events", "--limit", "1000")
            if e["kind"] == kind and e["at_ms"] >= after_ms]


def run_ferry():
    t0 = time.time()
    start_ms = int(t0 * 1000) - 1
    p = fj("cluster", "balance", "--threshold", str(THRESHOLD))
    if not p["moves"]:
        return 0, 0, 0.0
    while not events("balance_done", start_ms):
        if time.time() - t0 > 900:
            raise RuntimeError("the balance did not end in 15 minutes")
        time.sleep(1)
    moves = events("balance_move", start_ms)
    failed = events("balance_move_failed", start_ms)
    if failed:
        raise RuntimeError(f"balance moves failed: {failed}")
    return len(moves), sum(m["detail"]["bytes"] for m in moves), time.time() - t0


def vm_loads():
    """Per VM on each host: its load as the engine counts it, from the
    hosts' memory and the VMs' CPU time over 5 s."""
    hosts = {h["name"]: h for h in fj("host", "list")}

    def cpu():
        return {v["name"]: (v.get("usage") or {}).get("cpu_ms", 0)
                for h in hosts.values() for v in (h.get("info") or {}).get("vms", [])}
    a = cpu()
    time.sleep(5)
    hosts = {h["name"]: h for h in fj("host", "list")}
    b = cpu()
    out = {}
    for h in hosts.values():
        info = h.get("info") or {}
        total, cpus = info.get("memory_total", 1), max(1, info.get("cpus", 1))
        for v in info.get("vms", []):
            mem = (v["spec"]["memory"] + (64 << 20)) / total
            c = (b.get(v["name"], 0) - a.get(v["name"], 0)) / 5000 / cpus
            out[v["name"]] = (h["name"], mem + max(0.0, c))
    return out


def run_greedy():
    t0 = time.time()
    moved, total = set(), 0
    for _ in range(16):
        p = plan()
        if p["spread_before"] <= THRESHOLD:
            break
        loads = sorted(p["before"], key=lambda h: h["load"])
        low, high = loads[0], loads[-1]
        per_vm = vm_loads()
        cands = sorted(((l, v) for v, (h, l) in per_vm.items()
                        if h == high["host"] and v not in moved), reverse=True)
        gap = high["load"] - low["load"]
        # the largest whose move still narrows the gap
        pick = next((v for l, v in cands if l < gap), None)
        if pick is None:
            break
        # the same data path as the balancer's moves (the host's default)
        out = ferry("vm", "move", pick, "--to", low["host"], "--json").stdout
        last = json.loads(out.strip().splitlines()[-1])
        if last.get("event") != "completed":
            raise RuntimeError(f"move of {pick}: {last}")
        total += last["bytes_transferred"]
        moved.add(pick)
    return len(moved), total, time.time() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm", type=int, default=20)
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    ferry("lab", "up", "--replace", "--hosts", "3", "--nics", "2", "--host-memory", "6G", *labqemu.cpus_flag(a))
    ferry("cluster", "set", "--balance", "off")
    rows = []
    for r in range(a.rounds):
        order = ["ferry", "greedy"] if r % 2 == 0 else ["greedy", "ferry"]
        for who in order:
            setup(a.warm)
            before = plan()["spread_before"]
            moves, nbytes, secs = run_ferry() if who == "ferry" else run_greedy()
            time.sleep(3)
            after = plan()["spread_before"]
            row = {"round": r + 1, "who": who, "spread_before": before, "spread_after": after,
                   "moves": moves, "bytes": nbytes, "seconds": secs}
            rows.append(row)
            print(f"round {r + 1} {who:<6} spread {before:.3f} -> {after:.3f}  "
                  f"{moves} moves  {nbytes / 2**20:8.1f} MiB  {secs:6.1f} s", flush=True)
    cleanup()
    print()
    med = {}
    for who in ("ferry", "greedy"):
        rs = [x for x in rows if x["who"] == who]
        med[who] = {k: statistics.median(x[k] for x in rs)
                    for k in ("spread_before", "spread_after", "moves", "bytes", "seconds")}
        m = med[who]
        print(f"median {who:<6} spread {m['spread_before']:.3f} -> {m['spread_after']:.3f}  "
              f"{m['moves']} moves  {m['bytes'] / 2**20:8.1f} MiB  {m['seconds']:6.1f} s")
    if med["greedy"]["bytes"]:
        print(f"bytes ferry / greedy: {med['ferry']['bytes'] / med['greedy']['bytes']:.2f}")
    print(json.dumps({"rows": rows, "median": med}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
