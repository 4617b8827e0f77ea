#!/usr/bin/env python3
"""`--option compression` vs `--option tcp`, on compressible and on random guest memory,
on a slow link and on an unshaped one.

Each cell: a fresh guest on host1 (--memory, --fill; `--compressible` fills memory with a
pattern LZ4 shrinks ~7x, else every word differs), moved to host2 with each option in turn
(tcp first, then compression, then back is not needed: a new guest per move). Links: a
3-host × 2-NIC lab at each --rates value ("10gbit" is in effect unshaped: the two cores are
the limit). Reported: transfer time (QEMU's first byte to the target running), compression
÷ tcp, the compression ratio the transport reports, and CPU-seconds per GiB (the move
report's `cpu`: both QEMUs and both agents).

    sudo python3 bench/compression.py [--memory 1280M] [--fill 1G] [--rates 200mbit,10gbit]
"""
import argparse, json, os, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FERRY = os.environ.get("FERRY_BIN", os.path.join(ROOT, "target", "debug", "ferry"))


def ferry(*args, check=True):
    out = subprocess.run([FERRY, *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        sys.exit(f"ferry {' '.join(args)} failed: {out.stderr}")
    return out.stdout


def move(name, option, compressible, a):
    ferry("vm", "rm", name, check=False)
    extra = ["--compressible"] if compressible else []
    ferry("vm", "create", name, "--host", "host1", "--memory", a.memory, "--fill", a.fill,
          "--dirty-rate", "1M", *extra)
    out = ferry("vm", "move", name, "--to", "host2", "--option", option, "--json", check=False)
    r = json.loads(out.strip().splitlines()[-1])
    ferry("vm", "rm", name, check=False)
    if r.get("event") != "completed":
        sys.exit(f"{option} move failed: {r}")
    if not r["check"]["intact"]:
        sys.exit(f"guest not intact after {option}: {r['check']}")
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--memory", default="1280M")
    ap.add_argument("--fill", default="1G")
    ap.add_argument("--rates", default="200mbit,10gbit")
    a = ap.parse_args()
    rows = []
    for rate in a.rates.split(","):
        ferry("lab", "up", "--replace", "--hosts", "3", "--nics", "2", "--rate", rate)
        for compressible in (True, False):
            t = move("cb-tcp", "tcp", compressible, a)
            c = move("cb-lz4", "compression", compressible, a)
            row = (rate, "compressible" if compressible else "random", t["transfer_ms"] / 1000,
                   c["transfer_ms"] / 1000, c["compression_ratio"], c["frames_compressed"],
                   t["cpu"]["per_gib_s"], c["cpu"]["per_gib_s"])
            print(f"{row[0]} {row[1]}: tcp {row[2]:.1f} s, compression {row[3]:.1f} s "
                  f"({row[3] / row[2]:.2f}), ratio {row[4]:.2f}", file=sys.stderr)
            rows.append(row)
    ferry("lab", "down")
    print("| link | memory | tcp s | compression s | compression ÷ tcp | bytes ratio | frames compressed | CPU s/GiB tcp | CPU s/GiB compression |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rate, mem, ts, cs, ratio, frames, tcpu, ccpu in rows:
        print(f"| {rate} | {mem} | {ts:.1f} | {cs:.1f} | {cs / ts:.2f} | {ratio:.2f} | {frames} | {tcpu:.2f} | {ccpu:.2f} |")


if __name__ == "__main__":
    main()
