#!/usr/bin/env python3
"""Busy guests: Ferry's convergence policy vs QEMU's auto-converge alone.

One NIC shaped to --rate; a guest dirtying 25%, 50%, 90% and 150% of the link
rate. "auto-converge alone" = `--postcopy forbid --throttle allow` (QEMU throttles
the vCPUs, nothing else); "Ferry policy" = `--postcopy allow --throttle allow`
(throttle, then post-copy). Reported per run: outcome, total time, downtime,
phase reached, highest vCPU throttle.

    sudo python3 bench/convergence.py [--rate 200mbit] [--timeout-per-gib 120]
"""
import argparse, json, subprocess, sys
import labqemu  # noqa: E402

FERRY = labqemu.FERRY


def ferry(*args):
    out = subprocess.run([FERRY, *args], capture_output=True, text=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="200mbit")
    ap.add_argument("--timeout-per-gib", default="120")
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    rate = float(a.rate.replace("gbit", "e9").replace("mbit", "e6")) / 8  # bytes/s
    if ferry("lab", "up", "--replace", "--hosts", "2", "--nics", "1", "--rate", a.rate, *labqemu.cpus_flag(a)).returncode:
        sys.exit("lab up failed")
    print(f"| dirty rate (of {a.rate}) | policy | outcome | total s | downtime ms | phase | max throttle % |")
    print("|---|---|---|---|---|---|---|")
    for share in (0.25, 0.5, 0.9, 1.5):
        dirty = f"{int(rate * share / 2**20)}M"
        for label, flags in (("auto-converge alone", ["--postcopy", "forbid"]), ("Ferry policy", ["--postcopy", "allow"])):
            ferry("vm", "rm", "cv")
            if ferry("vm", "create", "cv", "--host", "host1", "--memory", "384M", "--fill", "256M",
                     "--dirty-rate", dirty).returncode:
                sys.exit("vm create failed")
            out = ferry("vm", "move", "cv", "--to", "host2", "--option", "tcp", "--throttle", "allow",
                        "--timeout-per-gib", a.timeout_per_gib, "--json", *flags)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            if r["event"] == "completed":
                row = ("completed", f"{r['total_ms'] / 1000:.1f}", r["downtime_ms"], r["phase"], r["max_throttle_pct"])
            else:
                reason = r["error"].get("reason", r["error"].get("message", ""))
                row = (f"failed: {reason}", "-", "-", "precopy", "-")
            check = json.loads(ferry("vm", "check", "cv", "--json").stdout or "{}")
            intact = "intact" if check.get("intact") and check.get("advancing") else "NOT INTACT"
            print(f"| {share:.0%} ({dirty}/s) | {label} | {row[0]} ({intact} on {check.get('host')}) | {row[1]} | {row[2]} | {row[3]} | {row[4]} |", flush=True)
    ferry("lab", "down")


if __name__ == "__main__":
    main()
