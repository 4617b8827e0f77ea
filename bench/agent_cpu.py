#!/usr/bin/env python3
"""What the two agents themselves spend on one move, per data path: CPU seconds and context
switches of both agents' processes (every thread; not their QEMUs), read from /proc just before
and just after `ferry vm move`, beside the move's transfer time.

A 2-host × 2-NIC lab shaped to --rate; per round, every (build, option) pair moves a fresh guest
host1 → host2, the pairs' order rotating from round to round; before each move both hosts' agents
are started again from that build (guests outlive agents; each guest is removed after its move).
`tcp` shows the agents' own work around a move they do not relay (QEMU's own TCP), `mptcp` a
handed-off socket, `compression` and `multichannel` Ferry's carriers, whose relay adds to it.
Prints every run and the medians per (build, option).

    sudo python3 bench/agent_cpu.py [--options tcp,mptcp,compression] [--rounds 3] [--rate 1gbit]
        [--kind compressible] [--bins BIN[,BIN2…]] [the guest options of bench/compression.py]

--bins: Ferry builds to compare (copies outside target/, as for bench/compression_ab.py); the
first also brings the lab up. Default: $FERRY_BIN.
"""
import argparse, json, os, statistics, subprocess, sys, time

import compression
import labqemu
from compression_ab import agents_from


def switches(pid):
    """Voluntary and involuntary context switches of every thread of `pid`."""
    n = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            for line in open(f"/proc/{pid}/task/{t}/status"):
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    n += int(line.split()[1])
        except OSError:
            pass  # a thread that ended between the listing and the read
    return n


def move(binary, option, a):
    """One fresh guest moved host1 → host2 with `option`; the agents' CPU and switches over it."""
    subprocess.run([binary, "vm", "rm", "cb"], capture_output=True)
    extra = ["--compressible"] if a.kind == "compressible" else []
    subprocess.run([binary, "vm", "create", "cb", "--host", "host1", "--memory", a.memory, "--fill", a.fill,
                    "--dirty-rate", a.dirty_rate, *extra], check=True, capture_output=True)
    time.sleep(2)
    pids = labqemu.agent_pids(["host1", "host2"])
    cpu0, sw0 = [labqemu.cpu_seconds(p) for p in pids], [switches(p) for p in pids]
    out = subprocess.run([binary, "vm", "move", "cb", "--to", "host2", "--option", option, "--json"],
                         capture_output=True, text=True)
    cpu = [labqemu.cpu_seconds(p) - c for p, c in zip(pids, cpu0)]
    sw = sum(switches(p) - s for p, s in zip(pids, sw0))
    subprocess.run([binary, "vm", "rm", "cb"], capture_output=True)
    try:
        r = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        sys.exit(f"{option}: no move report: {out.stderr.strip()}")
    if r.get("event") != "completed" or not r["check"]["intact"]:
        sys.exit(f"{option}: move failed or guest not intact: {r}")
    return {"ms": r["transfer_ms"], "src": cpu[0], "dst": cpu[1], "switches": sw, "path": r["data_path"]}


def main():
    ap = argparse.ArgumentParser()
    compression.guest_options(ap)
    ap.add_argument("--options", default="tcp,mptcp,compression")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--kind", default="compressible", choices=["random", "compressible"])
    ap.add_argument("--bins", default=labqemu.FERRY)
    a = ap.parse_args()
    bins = a.bins.split(",")
    for b in bins:
        if not os.access(b, os.X_OK):
            sys.exit(f"--bins: {b} is not an executable")
    subprocess.run([bins[0], "lab", "up", "--replace", "--hosts", "2", "--nics", "2", "--rate", a.rate],
                   check=True, capture_output=True)
    pairs = [(b, o) for b in bins for o in a.options.split(",")]
    runs = {p: [] for p in pairs}
    for rnd in range(a.rounds):
        for b, o in pairs[rnd % len(pairs):] + pairs[:rnd % len(pairs)]:
            agents_from(b)
            r = move(b, o, a)
            runs[(b, o)].append(r)
            print(f"round {rnd + 1} {b} {o}: {r['ms']} ms ({r['path']}), agents {r['src'] + r['dst']:.2f} "
                  f"CPU-s (source {r['src']:.2f}, target {r['dst']:.2f}), {r['switches']} context switches",
                  flush=True)
    subprocess.run([bins[0], "lab", "down"], capture_output=True)
    print("| build | option | transfer ms | agents CPU-s | source | target | context switches |")
    print("|---|---|---|---|---|---|---|")
    for (b, o), rs in runs.items():
        med = lambda k: statistics.median(r[k] for r in rs)
        both = statistics.median(r["src"] + r["dst"] for r in rs)
        print(f"| {os.path.basename(b)} | {o} | {med('ms'):.0f} | {both:.2f} | {med('src'):.2f} | "
              f"{med('dst'):.2f} | {med('switches'):.0f} |")


if __name__ == "__main__":
    main()
