#!/usr/bin/env python3
"""Builds of Ferry's agents against each other on the switch-over: guest-seen downtime and its parts.

One lab (two hosts, --nics NIC pairs shaped to --rate, CPUs split with --cpus), one workload
guest (idle unless --dirty-rate) moved back and forth. Per round, each build's agents are started
on both hosts (`ferry lab restart-agent`; the guest outlives them), the order rotating, and the
guest is moved --moves times under them. Per build: p50 / p95 / p99 / max of the report's
`guest_downtime_ms` (the source's pause to RUN answered), p50 / p95 / max of each of its
`downtime_parts` (qemu, tick, ready, record, run), the hold before the switch-over (`hold_ms`,
and how many moves' holds ran out before the target caught up), and the median transfer
(`migrate` to the target running) and total times. The guest is checked intact at the end.

    sudo python3 bench/switchover_ab.py --old OLD_BIN --new NEW_BIN [--rounds 5] [--moves 10]
        [--rate 1gbit] [--nics 1] [--cpus split] [--memory 512M --fill 256M] [--dirty-rate 0]
        [--option tcp|auto|…] [--compressible] [--max-downtime 100ms] [--disk-writer MIB]
    sudo python3 bench/switchover_ab.py --bins BIN1,BIN2[,…] [the options above]
    sudo python3 bench/switchover_ab.py --boards full,lean [--new BIN] [the options above]

With --boards, one build (--new, default labqemu.default_ferry's) and one guest per board
(`vm create --board`), moved in turns the same way: the boards are the contenders. Only the
guest whose turn it is runs (`vm stop` and `vm start` between turns).

With --disk-writer, another process writes MIB MiB to the machine's disk and fsyncs them, in a
loop, for the whole run (the lab hosts' journals are on that disk): the switch-over's records
then flush behind its writeback. With --max-downtime, each move asks that maximum; a move given
up for it (the guest resumed on its source) is counted, not a failure.

Builds must be copies outside target/ (a running agent holds its binary); the lab and the guest
are made by the last one's CLI (--new's).
"""
import argparse, atexit, json, os, statistics, subprocess, sys, time

import labqemu

from compression_ab import agents_from, builds_of
from downtime import pct
from flush_priority import start_disk_writer


def run(binary, *args, check=True):
    r = subprocess.run([binary, *args], capture_output=True, text=True)
    if check and r.returncode:
        sys.exit(f"ferry {' '.join(args)}: {r.stderr.strip()}")
    return r


def where(binary, vm):
    for v in json.loads(run(binary, "vm", "list", "--json").stdout):
        if v["name"] == vm and v["state"] != "incoming":
            return v["host"]
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old")
    ap.add_argument("--new")
    ap.add_argument("--bins", help="builds, comma-separated, instead of --old and --new")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--moves", type=int, default=10)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--nics", default="1")
    labqemu.add_cpus_option(ap, default="split")
    ap.add_argument("--memory", default="512M")
    ap.add_argument("--fill", default="256M")
    ap.add_argument("--dirty-rate", default="0", help="the guest's --dirty-rate (default 0: idle)")
    ap.add_argument("--option", default="tcp", help="each move's --option (auto: the cluster's choice)")
    ap.add_argument("--compressible", action="store_true",
                    help="the guest's memory compresses (~7x), as `vm create --compressible`")
    ap.add_argument("--max-downtime", help="each move's --max-downtime, in ms (100ms; default: `auto`)")
    ap.add_argument("--disk-writer", type=int, metavar="MIB",
                    help="another process writes and fsyncs MIB MiB to the disk, in a loop, throughout")
    ap.add_argument("--boards", help="boards as the contenders (full,lean): one guest each, one build")
    a = ap.parse_args()
    if a.max_downtime and not (a.max_downtime.endswith("ms") and a.max_downtime[:-2].isdigit()):
        sys.exit(f"--max-downtime: {a.max_downtime!r} is not milliseconds (100ms)")
    boards = {}
    if a.boards:
        a.new = a.new or labqemu.FERRY
        boards = {f"board {b}": b for b in a.boards.split(",")}
        if len(boards) < 2:
            sys.exit("--boards: give two boards or more")
        builds = {name: a.new for name in boards}
    elif a.bins:
        builds = {os.path.basename(b): b for b in labqemu.builds_of(a.bins)}
        if len(builds) < 2:
            sys.exit("--bins: give two builds or more, with names of their own")
        a.new = list(builds.values())[-1]
    elif a.old and a.new:
        builds = builds_of(a)
    else:
        sys.exit("give --old and --new, or --bins")
    up = ["lab", "up", "--replace", "--hosts", "2", "--nics", a.nics, "--rate", a.rate, *labqemu.cpus_flag(a)]
    run(a.new, *up)
    # one guest per board (the lab's one otherwise), each on the host it starts on
    guests = {b: f"sw-{boards[b]}" for b in builds} if boards else {b: "sw" for b in builds}
    for b, vm in guests.items():
        run(a.new, "vm", "rm", vm, check=False)
        run(a.new, "vm", "create", vm, "--host", "host1", "--memory", a.memory, "--fill", a.fill,
            "--dirty-rate", a.dirty_rate,
            *(["--board", boards[b]] if boards else []),
            *(["--compressible"] if a.compressible else []))
    got = {b: [] for b in builds}
    gave_up = {b: 0 for b in builds}
    names = list(builds)
    intact = "intact"
    stop_writer = None
    if a.disk_writer:
        stop_writer = start_disk_writer("/var/tmp/switchover-ab.writer", a.disk_writer)
        atexit.register(stop_writer)
    for rnd in range(a.rounds):
        for b in names[rnd % len(names):] + names[:rnd % len(names)]:
            if not boards:
                agents_from(builds[b])
            vm = guests[b]
            if boards:
                # one guest runs at a time: a running one's workload would
                # take its host's CPU from the other's moves
                for other in guests.values():
                    if other != vm:
                        run(a.new, "vm", "stop", other, check=False)
                run(a.new, "vm", "start", vm, check=False)
                time.sleep(5)
            for i in range(a.moves):
                to = "host2" if where(a.new, vm) == "host1" else "host1"
                out = run(a.new, "vm", "move", vm, "--to", to, "--option", a.option, "--json",
                          *(["--max-downtime", a.max_downtime] if a.max_downtime else []),
                          check=False)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                err = r.get("error") or {}
                if r.get("event") == "failed" and err.get("step") == "blackout" \
                        and err.get("running_on") != to:
                    gave_up[b] += 1
                    print(f"round {rnd + 1} {b} #{i + 1}: given up: {err.get('reason')}",
                          file=sys.stderr, flush=True)
                    continue
                if r.get("event") != "completed":
                    sys.exit(f"{b}: move failed: {r}")
                if not (r.get("check") or {}).get("intact"):
                    sys.exit(f"{b}: the guest's check after the move failed: {r.get('check')}")
                got[b].append(r)
                parts = " ".join(f"{p['part']} {p['ms']}" for p in r.get("downtime_parts", []))
                hold = (f", held {r['hold_ms']} ms{'' if r.get('hold_caught_up') else ' (not caught up)'}"
                        if "hold_ms" in r else "")
                print(f"round {rnd + 1} {b} #{i + 1}: guest {r['guest_downtime_ms']} ms ({parts}){hold}, "
                      f"total {r['total_ms']} ms", file=sys.stderr, flush=True)
            if boards:
                # checked before the next turn stops it
                c = json.loads(run(a.new, "vm", "check", vm, "--json", check=False).stdout or "{}")
                if not (c.get("intact") and c.get("advancing")):
                    intact = f"{vm} NOT INTACT"
    if stop_writer:
        stop_writer()
    for vm in sorted(set(guests.values())):
        if not boards:
            c = json.loads(run(a.new, "vm", "check", vm, "--json", check=False).stdout or "{}")
            if not (c.get("intact") and c.get("advancing")):
                intact = f"{vm} NOT INTACT"
        run(a.new, "vm", "rm", vm, check=False)
    part_names = ["qemu", "tick", "ready", "record", "run"]
    print(f"\n{a.rounds} rounds x {a.moves} moves per build, {a.nics} NIC pair(s) at {a.rate}, "
          f"--cpus {a.cpus or 'shared'}, {a.memory} guest ({a.fill} filled{', compressible' if a.compressible else ''}, "
          f"dirtying {a.dirty_rate}/s), "
          f"--option {a.option}"
          f"{f', --max-downtime {a.max_downtime}' if a.max_downtime else ''}"
          f"{f', a writer of {a.disk_writer} MiB per fsync' if a.disk_writer else ''}; guest {intact}\n")
    print("| build | moves | guest downtime p50 / p95 / p99 / max ms | "
          + " | ".join(f"{p} p50 / p95 / max" for p in part_names)
          + " | over the maximum | given up | held p50 / p95 / max ms (not caught up) | transfer p50 s | total p50 s |")
    print("|---|---|---|" + "---|" * len(part_names) + "---|---|---|---|---|")
    # the maximum each move asked: --max-downtime, or `auto`'s 300 ms
    limit = int(a.max_downtime.removesuffix("ms")) if a.max_downtime else 300
    for b, rs in got.items():
        if not rs:
            print(f"| {b} | 0 | – |" + " – |" * len(part_names) + f" – | {gave_up[b]} | – | – | – |")
            continue
        g = [r["guest_downtime_ms"] for r in rs]
        parts = {p: [] for p in part_names}
        for r in rs:
            for p in r.get("downtime_parts", []):
                if p["part"] in parts:
                    parts[p["part"]].append(p["ms"])
        cols = " | ".join(f"{pct(v, 50)} / {pct(v, 95)} / {max(v)}" if v else "-" for v in parts.values())
        tot = statistics.median(r["total_ms"] for r in rs) / 1000
        xfer = statistics.median(r["transfer_ms"] for r in rs) / 1000
        h = [r["hold_ms"] for r in rs if "hold_ms" in r]
        held = (f"{pct(h, 50)} / {pct(h, 95)} / {max(h)} ({sum(1 for r in rs if r.get('hold_caught_up') is False)})"
                if h else "–")
        print(f"| {b} | {len(rs)} | {pct(g, 50)} / {pct(g, 95)} / {pct(g, 99)} / {max(g)} | {cols} | "
              f"{sum(1 for x in g if x > limit)} | {gave_up[b]} | {held} | {xfer:.2f} | {tot:.2f} |")


if __name__ == "__main__":
    main()
