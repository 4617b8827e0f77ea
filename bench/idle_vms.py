#!/usr/bin/env python3
"""What an agent spends with guests running and nothing asked of it (the control service's
heartbeat listing them once a second, the storage watcher looking at each once a second, the
samplers), per build: CPU of host1's agent process (every thread, not its QEMUs) and its context
switches, over --seconds, with --guests idle guests on host1.

A 2-host × 1-NIC lab brought up by the first build; the guests are made once and outlive the
agents: before each measurement the agents and the control service are started again from that
build, builds alternating round by round. Prints every run and the medians.

    sudo python3 bench/idle_vms.py --bins OLD,NEW [--guests 4] [--rounds 4] [--seconds 20]
"""
import argparse, os, statistics, subprocess, time

import labqemu
from compression_ab import agents_from


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bins", required=True)
    ap.add_argument("--guests", type=int, default=4)
    ap.add_argument("--memory", default="256M")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20)
    a = ap.parse_args()
    bins = labqemu.builds_of(a.bins)
    subprocess.run([bins[0], "lab", "up", "--replace", "--hosts", "2", "--nics", "1"],
                   check=True, capture_output=True)
    names = [f"idle{i}" for i in range(a.guests)]
    for n in names:
        subprocess.run([bins[0], "vm", "create", n, "--host", "host1", "--memory", a.memory],
                       check=True, capture_output=True)
    runs = {b: [] for b in bins}
    for rnd in range(a.rounds):
        for b in bins[rnd % len(bins):] + bins[:rnd % len(bins)]:
            agents_from(b, control=True)
            time.sleep(3)  # past the restart's own work (reattaching the guests)
            _, cpu, switches = labqemu.agents_spend(lambda: time.sleep(a.seconds), hosts=("host1",))
            r = (cpu[0] / a.seconds * 1000, switches / a.seconds)
            runs[b].append(r)
            print(f"round {rnd + 1} {os.path.basename(b)}: {r[0]:.2f} ms of CPU per s, "
                  f"{r[1]:.0f} context switches per s", flush=True)
    for n in names:
        subprocess.run([bins[0], "vm", "rm", n], capture_output=True)
    subprocess.run([bins[0], "lab", "down"], capture_output=True)
    print(f"| build | host1's agent, {a.guests} idle guests: ms of CPU per s (every round) | median | "
          "context switches per s |")
    print("|---|---|---|---|")
    for b, rs in runs.items():
        print(f"| {os.path.basename(b)} | {', '.join(f'{r[0]:.2f}' for r in rs)} | "
              f"{statistics.median(r[0] for r in rs):.2f} | {statistics.median(r[1] for r in rs):.0f} |")


if __name__ == "__main__":
    main()
