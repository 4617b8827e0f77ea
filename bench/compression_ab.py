#!/usr/bin/env python3
"""Two builds of Ferry's agents against each other and QEMU's own multifd + zstd, in one lab.

For a change to the transport or the codec chooser: the rows of bench/compression.py move a
few tens of milliseconds from run to run, so a build is judged only beside the one it
changes, in the same lab, the same hour, the contenders alternating. Per round, QEMU zstd
(by hand over QMP, as in bench/compression.py) and a `--option compression` move under
each build's agents, the order rotating; before each Ferry move both hosts' agents are
killed and started again from that build (`ferry lab restart-agent`; guests outlive agents,
and every guest is removed after its move). Prints every run and the medians.

    sudo python3 bench/compression_ab.py --old OLD_BIN --new NEW_BIN [--rounds 4]
        [--rate 1gbit] [--kind random] [the guest options of bench/compression.py]

OLD_BIN and NEW_BIN must be copies outside target/ (a running agent holds its binary).
"""
import argparse, os, statistics, subprocess, sys, time

import compression
import labqemu
from faults import LAB, kill_pidfile


def agents_from(binary, hosts=("host1", "host2")):
    """Restarts every lab agent from `binary`."""
    for h in hosts:
        kill_pidfile(f"{LAB}/{h}/agent.pid")
    time.sleep(0.5)
    for h in hosts:
        subprocess.run([binary, "lab", "restart-agent", h], check=True, capture_output=True)
    time.sleep(1)


def main():
    ap = argparse.ArgumentParser()
    compression.guest_options(ap)
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--kind", default="random", choices=["random", "compressible"])
    a = ap.parse_args()
    builds = {"old": a.old, "new": a.new}
    for name, b in builds.items():
        if not os.access(b, os.X_OK):
            sys.exit(f"--{name} {b}: not an executable")
    subprocess.run([a.new, "lab", "up", "--replace", "--hosts", "2", "--nics", "2", "--rate", a.rate],
                   check=True, capture_output=True)
    runs = {"qemu zstd": [], "old": [], "new": []}
    names = list(runs)
    for rnd in range(a.rounds):
        for c in names[rnd % 3:] + names[:rnd % 3]:
            if c == "qemu zstd":
                r = compression.qemu_move(a.kind, c, a)
            else:
                agents_from(builds[c])
                compression.FERRY = labqemu.FERRY = builds[c]
                r = compression.ferry_move(a.kind, a)
            runs[c].append(r["secs"])
            print(f"round {rnd + 1} {c}: {r['secs']:.3f} s, guest downtime {r['downtime']} ms {r['codecs']}",
                  flush=True)
    subprocess.run([a.new, "lab", "down"], capture_output=True)
    base = statistics.median(runs["qemu zstd"])
    for c in names:
        m = statistics.median(runs[c])
        print(f"{c}: median {m:.3f} s ({m / base:.3f} × QEMU zstd), every run "
              + ", ".join(f"{x:.3f}" for x in runs[c]))


if __name__ == "__main__":
    main()
