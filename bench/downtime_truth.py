#!/usr/bin/env python3
"""Ferry's reported guest downtime against QEMU's own run-state events, per move.

The lab's hosts share this machine's wall clock, so the guest's real blackout can be read
from the two QEMUs: the source's `STOP` event (its vCPUs paused) to the target's `RESUME`
(its vCPUs about to run), each stamped by its QEMU. The agents log every QMP event at debug
level (`FERRY_LOG=info,ferry_agent::qmp=debug`, set here for the lab's agents). Each move's
report (`guest_downtime_ms`) is printed beside that span: the report must never be below it
(counted from before the pause, until RUN is answered after the `cont`), and should be
near it. One guest, moved back and forth --moves times.

    sudo python3 bench/downtime_truth.py [--moves 40] [--rate 1gbit] [--nics 1] [--cpus split]
        [--memory 512M --fill 256M] [--dirty-rate 0] [--option auto]

A real host pair has two clocks; this check is for the lab, where there is one.
"""
import argparse, json, os, re, statistics, subprocess, sys

import labqemu
from downtime import pct

FERRY = labqemu.FERRY
# this build's line, or the one builds of before wrote for any event
STOP = re.compile(r"(?:QMP STOP event timestamp=|event=STOP \{ data: STOP, timestamp: )"
                  r"Timestamp \{ seconds: (\d+), microseconds: (\d+)")
RESUME = re.compile(r"(?:QMP RESUME event timestamp=|event=RESUME \{ data: RESUME, timestamp: )"
                    r"Timestamp \{ seconds: (\d+), microseconds: (\d+)")


def ferry(*args, check=True):
    r = subprocess.run([FERRY, *args], capture_output=True, text=True)
    if check and r.returncode:
        sys.exit(f"ferry {' '.join(args)}: {r.stderr.strip()}")
    return r


def last_stamp(host, pattern):
    """The last time `pattern` matched in the host agent's log, in seconds since the epoch."""
    last = None
    with open(f"/run/ferry/lab/{host}/agent.log", errors="replace") as f:
        for line in f:
            m = pattern.search(line)
            if m:
                last = int(m.group(1)) + int(m.group(2)) / 1e6
    return last


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moves", type=int, default=40)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--nics", default="1")
    labqemu.add_cpus_option(ap, default="split")
    ap.add_argument("--memory", default="512M")
    ap.add_argument("--fill", default="256M")
    ap.add_argument("--dirty-rate", default="0")
    ap.add_argument("--option", default="auto")
    a = ap.parse_args()
    os.environ["FERRY_LOG"] = "info,ferry_agent::qmp=debug"
    ferry("lab", "up", "--replace", "--hosts", "2", "--nics", a.nics, "--rate", a.rate, *labqemu.cpus_flag(a))
    ferry("vm", "rm", "dt", check=False)
    ferry("vm", "create", "dt", "--host", "host1", "--memory", a.memory, "--fill", a.fill,
          "--dirty-rate", a.dirty_rate)
    at, rows = "host1", []
    for i in range(a.moves):
        to = "host2" if at == "host1" else "host1"
        out = ferry("vm", "move", "dt", "--to", to, "--option", a.option, "--json", check=False)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        if r.get("event") != "completed":
            sys.exit(f"move {i + 1} failed: {r}")
        stop, resume = last_stamp(at, STOP), last_stamp(to, RESUME)
        if stop is None or resume is None or not 0 < resume - stop < 10:
            sys.exit(f"move {i + 1}: no STOP on {at} and RESUME on {to} in the agents' logs ({stop}, {resume})")
        truth = (resume - stop) * 1000
        rows.append((r["guest_downtime_ms"], truth))
        print(f"#{i + 1} {at}->{to}: reported {r['guest_downtime_ms']} ms, QEMU STOP->RESUME {truth:.1f} ms",
              file=sys.stderr, flush=True)
        at = to
    c = json.loads(ferry("vm", "check", "dt", "--json", check=False).stdout or "{}")
    ferry("vm", "rm", "dt", check=False)
    rep, tru = [r for r, _ in rows], [t for _, t in rows]
    over = [r - t for r, t in rows]
    below = sum(1 for r, t in rows if r < int(t))
    print(f"\n{len(rows)} moves, {a.nics} NIC pair(s) at {a.rate}, --cpus {a.cpus or 'shared'}, {a.memory} guest "
          f"({a.fill} filled, dirtying {a.dirty_rate}/s), --option {a.option}; "
          f"guest {'intact' if c.get('intact') and c.get('advancing') else 'NOT INTACT'}\n")
    print("| measure | p50 / p95 / max ms |")
    print("|---|---|")
    print(f"| reported `guest_downtime_ms` | {pct(rep, 50)} / {pct(rep, 95)} / {max(rep)} |")
    print(f"| QEMU STOP (source) -> RESUME (target) | {pct(tru, 50):.1f} / {pct(tru, 95):.1f} / {max(tru):.1f} |")
    print(f"| reported less QEMU's span | {pct(over, 50):.1f} / {pct(over, 95):.1f} / {max(over):.1f} "
          f"(median {statistics.median(over):.1f}) |")
    print(f"\nmoves reported below QEMU's span: {below} of {len(rows)}")
    if below:
        sys.exit(1)


if __name__ == "__main__":
    main()
