#!/usr/bin/env python3
"""Two builds of Ferry's agents against each other and QEMU's own multifd + zstd, in one lab.

For a change to the transport or the codec chooser: the rows of bench/compression.py move a
few tens of milliseconds from run to run, so a build is judged only beside the one it
changes, in the same lab, the same hour, the contenders alternating. Per round, QEMU zstd
(by hand over QMP, as in bench/compression.py) and a `ferry vm move --option compression` (or
--option's) under each build's agents, the order rotating; before each Ferry move both hosts' agents are
killed and started again from that build (`ferry lab restart-agent`; guests outlive agents,
and every guest is removed after its move). Prints every run and the medians.

    sudo python3 bench/compression_ab.py --old OLD_BIN --new NEW_BIN [--rounds 4]
        [--rate 1gbit] [--kind random] [--encryption on|off] [--option compression] [the guest options of bench/compression.py]

--encryption sets the cluster's `encryption` for Ferry's moves (on, the default: Ferry's frames
sealed, QEMU's own channels in TLS); QEMU by hand matches it: multifd + zstd with its own TLS
(`qemu zstd tls`) when on, in clear when off. --option picks the builds' `ferry vm move --option`
(`compression` unless given). Each run's CPU seconds are printed beside
its time: for Ferry both agents' and QEMUs' (the move report's), for QEMU by hand both QEMUs';
for Ferry also both agents' own, in brackets (from /proc, over the `ferry vm move`: the relay,
the move's control work and the CLI's requests it serves), and the source's CPU spent compressing
and screening frames for noise (the move report's codecs' `cpu_s`).

OLD_BIN and NEW_BIN must be copies outside target/ (a running agent holds its binary).
"""
import argparse, os, statistics, subprocess, sys, time

import compression
import labqemu
from faults import LAB, kill_pidfile


def stop_pidfile(path):
    """SIGKILLs the daemon a pid file names and waits (10 s at most) until it has exited with
    every thread: its leader a zombie is not enough, the others may still hold its sockets."""
    try:
        pid = int(open(path).read().strip())
    except (OSError, ValueError):
        return
    kill_pidfile(path)
    until = time.time() + 10
    while time.time() < until:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            if state == "Z" and len(os.listdir(f"/proc/{pid}/task")) <= 1:
                return
        except (OSError, IndexError):
            return
        time.sleep(0.02)


def agents_from(binary, hosts=("host1", "host2"), control=False):
    """Restarts every lab agent from `binary`, and with `control` the control service and the
    first storage node too (builds whose services must match, as with move tickets)."""
    for h in hosts:
        kill_pidfile(f"{LAB}/{h}/agent.pid")
    time.sleep(0.5)
    for h in hosts:
        subprocess.run([binary, "lab", "restart-agent", h], check=True, capture_output=True)
    if control:
        # stopped here, whatever the build's own `lab restart` waits for: a
        # successor started while the old threads still hold its sockets fails
        for name in ("storage", "control"):
            stop_pidfile(f"{LAB}/control/{name}.pid")
        # the storage node too (a storage node takes only the grants of its own build)
        subprocess.run([binary, "lab", "restart", "storage"], capture_output=True)
        subprocess.run([binary, "lab", "restart", "control"], check=True, capture_output=True)
        for _ in range(100):
            if subprocess.run([binary, "host", "list"], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        else:
            sys.exit(f"{binary}: the control service did not answer after its restart")
    time.sleep(1)


def builds_of(a):
    """--old and --new, each checked to be an executable."""
    return {"old": labqemu.executable(a.old, "--old"), "new": labqemu.executable(a.new, "--new")}


def main():
    ap = argparse.ArgumentParser()
    compression.guest_options(ap)
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--kind", default="random", choices=["random", "compressible"])
    ap.add_argument("--encryption", choices=("on", "off"), default="on")
    ap.add_argument("--option", default="compression",
                    help="the `ferry vm move --option` of both builds' moves (compression, auto, tcp, ...)")
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    builds = builds_of(a)
    subprocess.run([a.new, "lab", "up", "--replace", "--hosts", "2", "--nics", "2", "--rate", a.rate, *labqemu.cpus_flag(a)],
                   check=True, capture_output=True)
    subprocess.run([a.new, "cluster", "set", "--encryption", a.encryption], check=True,
                   capture_output=True)
    qemu = "qemu zstd tls" if a.encryption == "on" else "qemu zstd"
    runs = {qemu: [], "old": [], "new": []}
    cpu = {c: [] for c in runs}
    agents = {c: [] for c in runs}
    codec_cpu = {c: [] for c in runs}
    names = list(runs)
    for rnd in range(a.rounds):
        for c in names[rnd % 3:] + names[:rnd % 3]:
            if c == qemu:
                r = compression.qemu_move(a.kind, c, a)
                relay = ""
            else:
                agents_from(builds[c])
                compression.FERRY = labqemu.FERRY = builds[c]
                r = compression.ferry_move(a.kind, a, a.option)
                used = sum(r["agents"])
                agents[c].append(used)
                codec_cpu[c].append(r["codec_cpu"])
                relay = f" (agents {used:.3f}, compressing {r['codec_cpu']:.3f})"
            runs[c].append(r["secs"])
            cpu[c].append(r["cpu"])
            print(f"round {rnd + 1} {c}: {r['secs']:.3f} s, {r['cpu']:.2f} CPU-s{relay}, "
                  f"guest downtime {r['downtime']} ms {r['codecs']}", flush=True)
    subprocess.run([a.new, "lab", "down"], capture_output=True)
    base = statistics.median(runs[qemu])
    for c in names:
        m = statistics.median(runs[c])
        relay = (f" (both agents {statistics.median(agents[c]):.3f}, the source compressing "
                 f"{statistics.median(codec_cpu[c]):.3f})" if agents[c] else "")
        print(f"{c}: median {m:.3f} s ({m / base:.3f} × {qemu}), "
              f"{statistics.median(cpu[c]):.2f} CPU-s{relay}; every run "
              + ", ".join(f"{x:.3f} s {y:.2f} CPU-s" for x, y in zip(runs[c], cpu[c])))


if __name__ == "__main__":
    main()
