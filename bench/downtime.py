#!/usr/bin/env python3
"""Downtime the guest sees: Ferry's full measure and QEMU's own, per move.

Two lab hosts with 1 and then 2 NICs shaped to --rate; the workload guest
idle, and dirtying 10% and 50% of one link's rate. Each configuration moves
the guest back and forth --moves times, alternating the contenders in rounds:
the default (`--max-downtime auto`: at most 300 ms, as low as the guest
allows) and `--max-downtime 100ms`. Reported: p50 / p95 / max of
`guest_downtime_ms` (source paused -> target running, Ferry's measure) and of
QEMU's `downtime_ms`, moves over their requested maximum, moves given up
because the switch-over would have run past it (the guest resumed on its
source; not in the other columns), median total time.
The guest is checked intact at the end of each configuration.

    sudo python3 bench/downtime.py [--rate 1gbit] [--moves 20] [--memory 256M --fill 128M]
        [--nics 1,2] [--loads 0,0.1,0.5] [--cpus split] [--contenders auto,100ms] [--option tcp]
"""
import argparse, json, statistics, subprocess, sys

import labqemu

FERRY = labqemu.FERRY


def ferry(*args):
    return subprocess.run([FERRY, *args], capture_output=True, text=True)


def rate_bytes(s):
    return float(s.replace("gbit", "e9").replace("mbit", "e6")) / 8


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def where(vm):
    for v in json.loads(ferry("vm", "list", "--json").stdout):
        if v["name"] == vm and v["state"] != "incoming":
            return v["host"]
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--moves", type=int, default=20)
    ap.add_argument("--memory", default="256M")
    ap.add_argument("--fill", default="128M")
    ap.add_argument("--nics", default="1,2")
    ap.add_argument("--loads", default="0,0.1,0.5", help="dirty rate as shares of one link's rate")
    ap.add_argument("--contenders", default="auto,100ms", help="auto, 100ms or both")
    ap.add_argument("--option", help="every move with `--option OPTION` (tcp, mptcp, compression…); "
                                     "default: none (the cluster's default, auto)")
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    link = rate_bytes(a.rate)
    contenders = [c for c in [("auto", []), ("100ms", ["--max-downtime", "100ms"])] if c[0] in a.contenders.split(",")]
    if not contenders:
        sys.exit(f"--contenders: none of {a.contenders} (auto, 100ms)")
    limit = {"auto": 300, "100ms": 100}
    rows = []
    for nics in a.nics.split(","):
        up = ["lab", "up", "--replace", "--hosts", "2", "--nics", nics, "--rate", a.rate, *labqemu.cpus_flag(a)]
        if ferry(*up).returncode:
            sys.exit("lab up failed")
        for load in (float(x) for x in a.loads.split(",")):
            dirty = f"{int(link * load / 2**20)}M" if load else "0"
            ferry("vm", "rm", "dt")
            out = ferry("vm", "create", "dt", "--host", "host1", "--memory", a.memory, "--fill", a.fill,
                        "--dirty-rate", dirty)
            if out.returncode:
                sys.exit(f"vm create failed: {out.stderr}")
            got = {c: [] for c, _ in contenders}
            gave_up = {c: [] for c, _ in contenders}
            for i in range(a.moves):
                for name, flags in contenders:
                    to = "host2" if where("dt") == "host1" else "host1"
                    option = ["--option", a.option] if a.option else []
                    out = ferry("vm", "move", "dt", "--to", to, "--json", *option, *flags)
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    err = r.get("error") or {}
                    if r.get("event") == "failed" and err.get("step") == "blackout" \
                            and err.get("running_on") != to:
                        # the switch-over would have run past the maximum: given up
                        # before the commit, the guest resumed where it was
                        gave_up[name].append(err.get("reason", ""))
                        print(f"  nics={nics} load={load:.0%} {name} #{i + 1}: given up: {err.get('reason')}",
                              file=sys.stderr, flush=True)
                        continue
                    if r.get("event") != "completed":
                        sys.exit(f"move failed: {r}")
                    got[name].append(r)
                    parts = " ".join(f"{p['part']} {p['ms']}" for p in r.get("downtime_parts", []))
                    print(f"  nics={nics} load={load:.0%} {name} #{i + 1}: guest {r['guest_downtime_ms']} ms "
                          f"({parts}), QEMU {r['downtime_ms']} ms, limit {r['downtime_limit_ms']} ms, "
                          f"{r['option']}, {r['total_ms']} ms total", file=sys.stderr, flush=True)
            c = json.loads(ferry("vm", "check", "dt", "--json").stdout or "{}")
            intact = "intact" if c.get("intact") and c.get("advancing") else "NOT INTACT"
            for name, _ in contenders:
                rs = got[name]
                if not rs:
                    rows.append(f"| {nics} | {load:.0%} | {name} | – | – | – | {len(gave_up[name])} | – | – | {intact} |")
                    continue
                g = [r["guest_downtime_ms"] for r in rs]
                q = [r["downtime_ms"] for r in rs]
                over = sum(1 for x in g if x > limit[name])
                tot = statistics.median(r["total_ms"] for r in rs) / 1000
                opts = sorted({r["option"] for r in rs})
                rows.append(f"| {nics} | {'idle' if not load else f'{load:.0%} ({dirty}/s)'} | {name} | "
                            f"{pct(g, 50)} / {pct(g, 95)} / {max(g)} | {pct(q, 50)} / {pct(q, 95)} / {max(q)} | "
                            f"{over} of {len(rs)} | {len(gave_up[name])} | {tot:.2f} | {','.join(opts)} | {intact} |")
                print(rows[-1], flush=True)
    ferry("vm", "rm", "dt")
    print()
    print(f"| NICs ({a.rate} each) | guest load | --max-downtime | guest downtime p50 / p95 / max ms | "
          f"QEMU downtime p50 / p95 / max ms | over the maximum | given up | median total s | option | guest |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
