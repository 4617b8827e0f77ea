#!/usr/bin/env python3
"""What the two agents themselves spend on one move, per data path: CPU seconds and context
switches of both agents' processes (every thread; not their QEMUs; CPU from the scheduler's
per-thread clock, in ns), read from /proc just before and just after `ferry vm move`, beside the
move's transfer time. --idle N also measures both agents over N quiet seconds (heartbeats only);
--warm measures a move that is not the agents' first since they started.

A 2-host × 2-NIC lab shaped to --rate; per round, every (build, option) pair moves a fresh guest
host1 → host2, the pairs' order rotating from round to round; before each move both hosts' agents
are started again from that build (guests outlive agents; each guest is removed after its move).
`tcp` shows the agents' own work around a move they do not relay (QEMU's own TCP), `mptcp` a
handed-off socket, `compression` and `multichannel` Ferry's carriers, whose relay adds to it.
Prints every run and the medians per (build, option).

    sudo python3 bench/agent_cpu.py [--options tcp,mptcp,compression] [--rounds 3] [--rate 1gbit]
        [--kind compressible] [--bins BIN[,BIN2…]] [--cpus split] [--idle SECONDS]
        [the guest options of bench/compression.py]

--bins: Ferry builds to compare (copies outside target/, as for bench/compression_ab.py); the
first also brings the lab up. Default: $FERRY_BIN. --with-control: the control service restarts
from each build too.
"""
import argparse, os, statistics, subprocess, time

import compression
import labqemu
from compression_ab import agents_from


def move(binary, option, a):
    """One fresh guest moved host1 → host2 with `option` by `binary`'s agents (bench/
    compression.py's move); its transfer time and the agents' CPU and switches over it."""
    compression.FERRY = labqemu.FERRY = binary
    r = compression.ferry_move(a.kind, a, option)
    return {"ms": round(r["secs"] * 1000), "src": r["agents"][0], "dst": r["agents"][1],
            "switches": r["switches"], "path": r["path"]}


def label(b, bins):
    """A build's name in the table: its file's name, or its path where two builds share one."""
    name = os.path.basename(b)
    return b if sum(os.path.basename(x) == name for x in bins) > 1 else name


def main():
    ap = argparse.ArgumentParser()
    compression.guest_options(ap)
    ap.add_argument("--options", default="tcp,mptcp,compression")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--kind", default="compressible", choices=["random", "compressible"])
    ap.add_argument("--bins", default=labqemu.FERRY)
    labqemu.add_cpus_option(ap)
    ap.add_argument("--idle", type=float, default=0,
                    help="also measure both agents over this many seconds with nothing asked of "
                         "them but the control service's heartbeats, after each build's restart")
    ap.add_argument("--with-control", action="store_true",
                    help="restart the control service from each build too (needed when the builds' "
                         "control service and agents must match)")
    ap.add_argument("--warm", action="store_true",
                    help="before each measured move, one unmeasured move of a small guest (256 MiB, "
                         "64 MiB filled) host1 → host2 by the same agents: the measured move is then "
                         "not the first since they started (connections kept, code touched, pools "
                         "grown), as every move of a drain but its first")
    a = ap.parse_args()
    bins = labqemu.builds_of(a.bins)
    subprocess.run([bins[0], "lab", "up", "--replace", "--hosts", "2", "--nics", "2", "--rate", a.rate,
                    *labqemu.cpus_flag(a)],
                   check=True, capture_output=True)
    pairs = [(b, o) for b in bins for o in a.options.split(",")]
    runs = {p: [] for p in pairs}
    idle = {p: [] for p in pairs}
    for rnd in range(a.rounds):
        for b, o in pairs[rnd % len(pairs):] + pairs[:rnd % len(pairs)]:
            agents_from(b, control=a.with_control)
            if a.idle:
                time.sleep(2)  # past the restart's own start-up work
                _, cpu, sw = labqemu.agents_spend(lambda: time.sleep(a.idle))
                idle[(b, o)].append((sum(cpu) / a.idle * 1000, sw / a.idle))
                print(f"round {rnd + 1} {b} idle: {idle[(b, o)][-1][0]:.2f} ms of CPU per s (both agents), "
                      f"{idle[(b, o)][-1][1]:.0f} context switches per s", flush=True)
            if a.warm:
                move(b, o, argparse.Namespace(**{**vars(a), "memory": "256M", "fill": "64M"}))
            r = move(b, o, a)
            runs[(b, o)].append(r)
            print(f"round {rnd + 1} {b} {o}: {r['ms']} ms ({r['path']}), agents {r['src'] + r['dst']:.3f} "
                  f"CPU-s (source {r['src']:.3f}, target {r['dst']:.3f}), {r['switches']} context switches",
                  flush=True)
    subprocess.run([bins[0], "lab", "down"], capture_output=True)
    print("| build | option | transfer ms | agents CPU-s | source | target | context switches |"
          + (" idle ms of CPU per s | idle switches per s |" if a.idle else ""))
    print("|---|---|---|---|---|---|---|" + ("---|---|" if a.idle else ""))
    for (b, o), rs in runs.items():
        med = lambda k: statistics.median(r[k] for r in rs)
        both = statistics.median(r["src"] + r["dst"] for r in rs)
        row = (f"| {label(b, bins)} | {o} | {med('ms'):.0f} | {both:.3f} | {med('src'):.3f} | "
               f"{med('dst'):.3f} | {med('switches'):.0f} |")
        if a.idle:
            row += (f" {statistics.median(i[0] for i in idle[(b, o)]):.2f} |"
                    f" {statistics.median(i[1] for i in idle[(b, o)]):.0f} |")
        print(row)


if __name__ == "__main__":
    main()
