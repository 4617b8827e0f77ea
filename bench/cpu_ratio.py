#!/usr/bin/env python3
"""CPU per GiB of Ferry's carrier kinds and `auto`, as a ratio to QEMU over
kernel MPTCP, in rounds.

One lab (2 hosts × 2 NICs shaped to --rate). Each round moves the same guest
(kernel, initramfs, workload; --memory, --fill, --dirty-rate) undisturbed:

- with Ferry: `--option multichannel` (Ferry's carriers), `--option mptcp`
  (QEMU handed an MPTCP socket managed by Ferry: no byte through an agent),
  `--option mptcp-relay` (QEMU multifd relayed by the agents over MPTCP) and
  `--option auto`, one guest moved there and back (CPU: the move report's
  `cpu`, both QEMUs and both agents);
- by hand: QEMU multifd (4 channels) with `"mptcp": true` to the peer, the
  in-kernel path manager adding a subflow per NIC (`ferry lab team mptcp`;
  CPU: both QEMUs, sampled every 100 ms, plus the agents, idle).

Only one guest runs at a time. Every ratio divides by the QEMU-over-MPTCP
move of the same round; rounds show how far two-core figures swing. Most of
each move's CPU is the target QEMU faulting in the guest's memory, and on this
virtual machine that costs more the longer the memory went untouched: the
first move after a guest starts cost 15-25% more than the next in trial runs.
So each round starts with a move that is not counted, and the Ferry paths
take turns at going first. mptcp against multichannel and mptcp-relay is
what sparing the agents' copies gains.

    sudo python3 bench/cpu_ratio.py [--rounds 3] [--rate 500mbit] [--memory 1280M] [--fill 1G]
"""
import argparse, statistics, sys, time

import alternatives as alt
from labqemu import ferry, rate, size
import labqemu  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", default="500mbit")
    ap.add_argument("--memory", default="1280M")
    ap.add_argument("--fill", default="1G")
    ap.add_argument("--dirty-rate", default="8M")
    ap.add_argument("--stall", type=float, default=20.0)
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    link = rate(a.rate)
    ferry("lab", "up", "--replace", "--hosts", "2", "--nics", "2", "--rate", a.rate, *labqemu.cpus_flag(a))
    img = ferry("lab", "image").split("guest image: ")[1].split(" ")[0]
    out = ferry("lab", "team", "mptcp")
    a.team = dict(l.split(": migrate to ") for l in out.strip().splitlines() if ": migrate to " in l)
    rounds = []
    for n in range(1, a.rounds + 1):
        row = {}
        ferry("vm", "create", "ratio", "--host", "host1", "--memory", a.memory, "--fill", a.fill,
              "--dirty-rate", a.dirty_rate)
        time.sleep(2)
        warm = alt.ferry_move("ratio", "host2", 0, link, "multichannel")
        if not warm["done"]:
            sys.exit(f"round {n}: the first move failed: {warm['how']}")
        at = "host2"
        paths = ["multichannel", "mptcp", "mptcp-relay", "auto"]
        k = (n - 1) % len(paths)
        for option in paths[k:] + paths[:k]:
            to = "host2" if at == "host1" else "host1"
            r = alt.ferry_move("ratio", to, 0, link, option)
            if not r["done"]:
                sys.exit(f"round {n}: ferry {option} failed: {r['how']}")
            row[f"ferry {option}"] = r
            print(n, option, r, file=sys.stderr)
            at = to
        ferry("vm", "rm", "ratio")
        src = alt.fresh_source(img, a, "host1")
        src, r = alt.direct_move(img, src, "host1", "host2", "mptcp", a, 0, link)
        if not r["done"]:
            sys.exit(f"round {n}: QEMU over MPTCP failed: {r['how']}")
        row["qemu multifd / mptcp"] = r
        print(n, "qemu mptcp", r, file=sys.stderr)
        src[1].cmd("quit")
        src[0].wait()
        rounds.append(row)
    ferry("lab", "team", "none")
    ferry("lab", "down")

    def per_gib(r):
        return r["cpu"] / (r["bytes"] / 2**30)

    print(f"| round | path | carried by | transfer s | ÷ (2 × {a.rate}) | CPU s/GiB | ÷ QEMU over MPTCP, same round |")
    print("|---|---|---|---|---|---|---|")
    ratios = {}
    for n, row in enumerate(rounds, 1):
        base = per_gib(row["qemu multifd / mptcp"])
        for path, r in row.items():
            mbit = r["bytes"] * 8 / r["secs"] / 1e6
            ratio = per_gib(r) / base
            ratios.setdefault(path, []).append(ratio)
            print(f"| {n} | {path} | {r.get('path') or 'qemu'} | {r['secs']:.2f} | {mbit * 1e6 / (2 * link):.3f} | {per_gib(r):.2f} | {ratio:.2f} |")
    print()
    print("| path | ÷ QEMU over MPTCP: each round | median |")
    print("|---|---|---|")
    for path, rs in ratios.items():
        if path.startswith("qemu"):
            continue
        print(f"| {path} | {', '.join(f'{x:.2f}' for x in rs)} | {statistics.median(rs):.2f} |")


if __name__ == "__main__":
    main()
