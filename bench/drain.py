#!/usr/bin/env python3
"""Drain time vs the ideal, and `auto` vs fixed simultaneous-migration limits.

Each run: a fresh lab (3 hosts × 2 NICs, links shaped to --rate), --vms guests
on host1, then `ferry host drain host1 --max-parallel L`. Ideal = Σ bytes moved
÷ the drained host's usable link rate (2 NICs × rate; the targets together have
more). Reported: drain time, ideal, time ÷ ideal, the limits auto chose.

    sudo python3 bench/drain.py [--vms 6] [--memory 512M] [--fill 384M] [--rate 1gbit]
"""
import argparse, json, os, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FERRY = os.environ.get("FERRY_BIN", os.path.join(ROOT, "target", "debug", "ferry"))


def ferry(*args, check=True):
    out = subprocess.run([FERRY, *args], capture_output=True, text=True)
    if check and out.returncode not in (0,):
        sys.exit(f"ferry {' '.join(args)} failed: {out.stderr}")
    return out.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vms", type=int, default=6)
    ap.add_argument("--memory", default="512M")
    ap.add_argument("--fill", default="384M")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--limits", default="1,2,4,8,auto")
    a = ap.parse_args()
    rate = float(a.rate.replace("gbit", "e9").replace("mbit", "e6"))
    rows = []
    for limit in a.limits.split(","):
        ferry("lab", "up", "--replace", "--hosts", "3", "--nics", "2", "--rate", a.rate)
        procs = [subprocess.Popen([FERRY, "vm", "create", f"dr{i}", "--host", "host1", "--memory", a.memory,
                                   "--fill", a.fill, "--dirty-rate", "4M"], stdout=subprocess.DEVNULL)
                 for i in range(a.vms)]
        for p in procs:
            if p.wait() != 0:
                sys.exit("vm create failed")
        out = ferry("host", "drain", "host1", "--max-parallel", limit, "--json")
        done = json.loads(out.strip().splitlines()[-1])
        assert done["event"] == "done" and len(done["moved"]) == a.vms, done
        secs = done["total_ms"] / 1000
        ideal = done["bytes"] * 8 / (2 * rate)
        rows.append((limit, secs, ideal, done["bytes"], done["limits"]))
        print(f"limit {limit}: {secs:.1f} s, ideal {ideal:.1f} s, ratio {secs / ideal:.2f}, limits {done['limits']}",
              file=sys.stderr)
    ferry("lab", "down")
    print(f"| --max-parallel | drain s | MiB moved | ideal s (Σ bytes ÷ 2 × {a.rate}) | drain ÷ ideal | limits used |")
    print("|---|---|---|---|---|---|")
    for limit, secs, ideal, b, used in rows:
        print(f"| {limit} | {secs:.1f} | {b / 2**20:.0f} | {ideal:.1f} | {secs / ideal:.2f} | {used} |")
    fixed = [r[1] for r in rows if r[0] != "auto"]
    auto = [r[1] for r in rows if r[0] == "auto"]
    if auto and fixed:
        best = min(fixed)
        print(f"\nauto ÷ best fixed: {auto[0] / best:.2f}")


if __name__ == "__main__":
    main()
