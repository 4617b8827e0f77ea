#!/usr/bin/env python3
"""Where the two agents' CPU goes over one move, by phase: the first 0.3 s after `ferry vm move`
(the request, the target's skeleton, the source's first steps), the last 0.5 s before the command
returns (the end of the copy, the switch-over, the check, the cleanup), and the middle, per second,
beside what the same agents spend per second with the guest running and nothing asked (heartbeats
listing it, samplers). CPU of both agents' processes (every thread, not their QEMUs), from the
scheduler's per-thread clock, sampled every 20 ms.

A 2-host × 2-NIC lab at --rate, brought up by $FERRY_BIN; per round one fresh guest moved
host1 → host2 with --option, then removed. Prints every round and the medians.

    sudo python3 bench/agent_phases.py [--rounds 5] [--option tcp] [--memory 768M] [--fill 512M]
"""
import argparse, json, statistics, subprocess, threading, time

import labqemu

GUEST = "phases"


class AgentClocks:
    """CPU milliseconds each of `pids` has spent so far, by sampling every thread: a thread that
    ends (a runtime's blocking thread idle long enough) keeps what was last sampled of it, so a
    later reading never falls below an earlier one."""

    def __init__(self, pids):
        self.threads = {p: {} for p in pids}

    def read(self):
        for p, seen in self.threads.items():
            seen.update(labqemu.thread_cpu_ns(p))
        return [sum(seen.values()) / 1e6 for seen in self.threads.values()]


def ferry(*args, check=True):
    return subprocess.run([labqemu.FERRY, *args], check=check, capture_output=True, text=True)


def one_round(a):
    ferry("vm", "rm", GUEST, check=False)
    ferry("vm", "create", GUEST, "--host", "host1", "--memory", a.memory, "--fill", a.fill)
    time.sleep(4)  # past the boot's and the fill's own work
    clocks = AgentClocks(labqemu.agent_pids(("host1", "host2")))
    before = clocks.read()
    time.sleep(a.idle)
    idle = [(x - y) / a.idle for x, y in zip(clocks.read(), before)]
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((time.monotonic(), clocks.read()))
            time.sleep(0.02)

    t = threading.Thread(target=sample)
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    r = ferry("vm", "move", GUEST, "--to", "host2", "--option", a.option, "--json")
    t1 = time.monotonic()
    time.sleep(0.1)
    stop.set()
    t.join()
    ferry("vm", "rm", GUEST, check=False)
    report = json.loads(r.stdout.strip().splitlines()[-1])

    def at(when):
        return min(samples, key=lambda s: abs(s[0] - when))[1]

    s0, s1, e0, e1 = at(t0), at(t0 + 0.3), at(t1 - 0.5), at(t1)
    middle = (t1 - 0.5) - (t0 + 0.3)
    diff = lambda x, y: [b - a for a, b in zip(x, y)]
    return {
        "wall_s": t1 - t0,
        "transfer_ms": report.get("transfer_ms"),
        "start_ms": diff(s0, s1),
        "middle_ms_per_s": [d / middle for d in diff(s1, e0)],
        "end_ms": diff(e0, e1),
        "total_ms": diff(s0, e1),
        "idle_ms_per_s": idle,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--option", default="tcp")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--memory", default="768M")
    ap.add_argument("--fill", default="512M")
    ap.add_argument("--idle", type=float, default=3.0,
                    help="seconds the agents are measured with the guest running before the move")
    a = ap.parse_args()
    subprocess.run([labqemu.FERRY, "lab", "up", "--replace", "--hosts", "2", "--nics", "2",
                    "--rate", a.rate], check=True, capture_output=True)
    rows = []
    for rnd in range(a.rounds):
        row = one_round(a)
        rows.append(row)
        print(f"round {rnd + 1}: " + json.dumps({k: (round(v, 2) if isinstance(v, float) else
                                                     v if not isinstance(v, list) else
                                                     [round(x, 2) for x in v])
                                                 for k, v in row.items()}), flush=True)
    subprocess.run([labqemu.FERRY, "lab", "down"], capture_output=True)
    print("| agent | start ms (0.3 s) | middle ms per s | end ms (0.5 s) | total ms | idle ms per s |")
    print("|---|---|---|---|---|---|")
    for i, name in enumerate(("source", "target")):
        med = lambda k: statistics.median(r[k][i] for r in rows)
        print(f"| {name} | {med('start_ms'):.1f} | {med('middle_ms_per_s'):.2f} | {med('end_ms'):.1f} | "
              f"{med('total_ms'):.1f} | {med('idle_ms_per_s'):.2f} |")
    print(f"move: {statistics.median(r['wall_s'] for r in rows):.2f} s from the command to its answer "
          f"(median of {len(rows)})")


if __name__ == "__main__":
    main()
