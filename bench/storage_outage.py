#!/usr/bin/env python3
"""A guest's I/O pause against the length of a storage outage.

    python3 bench/storage_outage.py [--outages 2,4,8,15,30] [--rounds 3]

One workload guest on host1 writes its NBD disk twice a second (each write
acknowledged before the next, each reported on its console as FERRY-DISK
seq=N). Each trial SIGKILLs the lab's storage node, keeps it down for the
outage, starts it again, and measures from the console:

  io gap      from the last write acknowledged before the kill to the first
              acknowledged after it (what the guest's application sees);
  over        io gap minus the outage: how long after the node is back the
              guest's I/O flows again;
  vm paused   whether Ferry paused the VM (outages longer than
              storage_pause_after, 5 s by default: QEMU's reconnect window),
              and for how long by Ferry's record (vm list's storage_pause).

Outage lengths alternate in rounds (each round takes every length once, in
a rotated order); medians and every run are printed, then JSON. Also
checked after each trial: the guest's writer saw no error.

Needs the lab (root, QEMU >= 9, iproute2); uses the release build (labqemu.default_ferry)
(FERRY_BIN to override). About 20 s + 2 × the outage per trial.
"""
import argparse, json, os, signal, statistics, subprocess, sys, time
import labqemu  # noqa: E402

FERRY = labqemu.FERRY
LAB = "/run/ferry/lab"
VM, DISK = "so1", "outage"


def ferry(*args, check=True):
    r = subprocess.run([FERRY, *args], capture_output=True, text=True, timeout=300)
    if check and r.returncode != 0:
        raise RuntimeError(f"ferry {' '.join(args)}: {r.stderr.strip()}")
    return r


def fj(*args):
    return json.loads(ferry(*args, "--json").stdout)


def console():
    return f"{LAB}/host1/vms/{VM}/console.log"


def disk_lines():
    """[(seq, errors)] of every FERRY-DISK line so far."""
    out = []
    try:
        for l in open(console(), errors="replace"):
            if l.startswith("FERRY-DISK "):
                f = dict(w.split("=", 1) for w in l.split() if "=" in w)
                out.append((int(f.get("seq", 0)), int(f.get("errors", 0))))
    except (OSError, ValueError):
        pass
    return out


class Watch:
    """Polls the console every 20 ms: when each new seq was first seen."""

    def __init__(self):
        self.seen = {}

    def poll(self):
        now = time.monotonic()
        for seq, _ in disk_lines():
            self.seen.setdefault(seq, now)

    def last(self):
        return max(self.seen) if self.seen else 0


def trial(outage):
    w = Watch()
    w.poll()
    # wait for a fresh write, so the kill lands just after one
    start = w.last()
    t0 = time.monotonic()
    while w.last() == start and time.monotonic() - t0 < 10:
        time.sleep(0.02)
        w.poll()
    before = w.last()
    pid = int(open(f"{LAB}/control/storage.pid").read().strip())
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    last_ack = w.seen[before]
    while time.monotonic() - t_kill < outage:
        time.sleep(0.02)
        w.poll()
    ferry("lab", "restart", "storage")
    t_back = time.monotonic()
    while w.last() <= before + 1 and time.monotonic() - t_back < 120:
        time.sleep(0.02)
        w.poll()
    # the first write acknowledged after the kill: the first seq after `before`
    after = min((s for s in w.seen if s > before), default=None)
    if after is None:
        raise RuntimeError(f"the guest wrote nothing within 120 s of the node's return")
    gap = w.seen[after] - last_ack
    e = [v for v in fj("vm", "list") if v["name"] == VM][0]
    p = e.get("storage_pause")
    paused = None
    if p and p.get("since_ms") and p.get("until_ms") and p["since_ms"] / 1000 > time.time() - (time.monotonic() - t_kill) - 1:
        paused = (p["until_ms"] - p["since_ms"]) / 1000
    errors = disk_lines()[-1][1]
    time.sleep(2)
    return {"outage_s": outage, "io_gap_s": round(gap, 2), "over_s": round(gap - outage, 2),
            "vm_paused_s": paused, "writer_errors": errors, "state": e["state"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--outages", default="2,4,8,15,30")
    ap.add_argument("--rounds", type=int, default=3)
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    outages = [float(x) for x in a.outages.split(",")]
    ferry("lab", "up", "--hosts", "1", "--nics", "1", "--replace", *labqemu.cpus_flag(a))
    ferry("vm", "rm", VM, check=False)
    ferry("disk", "rm", DISK, check=False)
    ferry("vm", "create", VM, "--host", "host1", "--memory", "256M", "--fill", "64M", "--seed", "5")
    ferry("disk", "create", DISK, "--size", "16M")
    ferry("disk", "attach", DISK, VM)
    w = Watch()
    t0 = time.monotonic()
    while w.last() < 3:
        if time.monotonic() - t0 > 60:
            sys.exit("the guest never wrote its disk")
        time.sleep(0.2)
        w.poll()
    runs = []
    for r in range(a.rounds):
        order = outages[r % len(outages):] + outages[:r % len(outages)]
        for o in order:
            res = trial(o)
            runs.append(res)
            print(f"round {r + 1}: outage {o:5.1f} s  io gap {res['io_gap_s']:6.2f} s  "
                  f"over {res['over_s']:5.2f} s  vm paused {res['vm_paused_s']}  "
                  f"errors {res['writer_errors']}", flush=True)
    print()
    print(f"{'outage':>8} {'io gap (median)':>16} {'over (median)':>14} {'vm paused (median)':>19} {'errors':>7}")
    summary = []
    for o in outages:
        rs = [x for x in runs if x["outage_s"] == o]
        gap = statistics.median(x["io_gap_s"] for x in rs)
        over = statistics.median(x["over_s"] for x in rs)
        ps = [x["vm_paused_s"] for x in rs if x["vm_paused_s"] is not None]
        pm = statistics.median(ps) if ps else None
        errs = sum(x["writer_errors"] > 0 for x in rs)
        summary.append({"outage_s": o, "io_gap_median_s": gap, "over_median_s": over,
                        "vm_paused_median_s": pm, "paused_trials": len(ps), "trials": len(rs),
                        "trials_with_errors": errs})
        print(f"{o:8.1f} {gap:16.2f} {over:14.2f} {str(round(pm, 2)) if pm is not None else '-':>19} {errs:>7}")
    print(json.dumps({"runs": runs, "summary": summary}))
    ferry("vm", "rm", VM, check=False)
    ferry("disk", "rm", DISK, check=False)
    if any(x["writer_errors"] for x in runs):
        sys.exit("the guest's writer saw errors")


if __name__ == "__main__":
    main()
