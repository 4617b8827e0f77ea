#!/usr/bin/env python3
"""A big guest and a small one moved on the same lab: the move's time per filled GiB and the
agents' peak memory, for each.

One lab (two hosts, --nics NIC pairs shaped to --rate, CPUs split with --cpus, --host-memory
offered to VMs on each host). Per round, each guest (order alternating) is created on host1 from
fresh, both agents are started again (the guest outlives them, so each agent's peak resident
memory, VmHWM, covers only adopting the guest and the move), the guest is moved to host2 with
--option and checked intact, and then removed. Per guest: the medians of the move's total time
(the command to the guest running on the target), its transfer time, both per filled GiB, QEMU's
bytes, and each agent's peak and starting resident memory; then big ÷ small.

    sudo python3 bench/big_guest.py [--rounds 3] [--rate 1gbit] [--nics 1] [--cpus split]
        [--option auto] [--big 16G,2G,4] [--small 1G,512M,1] [--host-memory 20G]

A guest is MEMORY,FILL,VCPUS. The workload guest's untouched memory is zero pages, which QEMU
sends as a flag each; its kernel's page tables for memory (64 bytes per 4 KiB page) are filled too.
"""
import argparse, json, statistics, sys, time

import labqemu
from compression_ab import agents_from
from downtime import ferry as attempt
from labqemu import ferry

GIB = 1 << 30


def memory_kib(pid, field):
    """A `VmHWM`/`VmRSS` line of /proc/PID/status, in KiB."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    sys.exit(f"/proc/{pid}/status has no {field}")


def one(kind, spec, a):
    """`spec` = (memory, fill, vcpus): created on host1, agents restarted, moved to host2."""
    memory, fill, vcpus = spec
    attempt("vm", "rm", "big")
    ferry("vm", "create", "big", "--host", "host1", "--memory", memory, "--fill", fill,
          "--vcpus", vcpus)
    agents_from(labqemu.FERRY)
    time.sleep(3)
    pids = labqemu.agent_pids(("host1", "host2"))
    start = [memory_kib(p, "VmRSS") for p in pids]
    out = attempt("vm", "move", "big", "--to", "host2", "--option", a.option, "--json")
    peak = [memory_kib(p, "VmHWM") for p in pids]
    attempt("vm", "rm", "big")
    try:
        r = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        sys.exit(f"{kind}: no move report: {out.stderr.strip()}")
    if r.get("event") != "completed" or not r["check"]["intact"]:
        sys.exit(f"{kind}: the move failed or the guest is not intact: {r}")
    filled = labqemu.size(fill) / GIB
    return {"total": r["total_ms"] / 1000, "transfer": r["transfer_ms"] / 1000,
            "total_per_gib": r["total_ms"] / 1000 / filled,
            "transfer_per_gib": r["transfer_ms"] / 1000 / filled,
            "transfer_per_moved": r["transfer_ms"] / 1000 / (r["bytes_transferred"] / GIB),
            "bytes": r["bytes_transferred"], "path": r["data_path"],
            "src_peak": peak[0] / 1024, "dst_peak": peak[1] / 1024,
            "src_start": start[0] / 1024, "dst_start": start[1] / 1024}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--nics", default="1")
    labqemu.add_cpus_option(ap, default="split")
    ap.add_argument("--option", default="auto")
    ap.add_argument("--big", default="16G,2G,4")
    ap.add_argument("--small", default="1G,512M,1")
    ap.add_argument("--host-memory", default="20G")
    a = ap.parse_args()
    guests = {}
    for kind in ("big", "small"):
        spec = getattr(a, kind).split(",")
        if len(spec) != 3:
            sys.exit(f"--{kind}: MEMORY,FILL,VCPUS, not {getattr(a, kind)!r}")
        guests[kind] = spec
    ferry("lab", "up", "--replace", "--hosts", "2", "--nics", a.nics, "--rate", a.rate,
          *labqemu.cpus_flag(a), "--host-memory", a.host_memory)
    runs = {k: [] for k in guests}
    for rnd in range(a.rounds):
        order = list(guests) if rnd % 2 == 0 else list(reversed(guests))
        for kind in order:
            r = one(kind, guests[kind], a)
            runs[kind].append(r)
            print(f"round {rnd + 1} {kind} ({','.join(guests[kind])}): total {r['total']:.2f} s, transfer "
                  f"{r['transfer']:.2f} s ({r['transfer_per_gib']:.2f} s per filled GiB), "
                  f"{r['bytes'] / GIB:.2f} GiB by QEMU over {r['path']}; agents' peak "
                  f"{r['src_peak']:.0f} / {r['dst_peak']:.0f} MiB (from {r['src_start']:.0f} / "
                  f"{r['dst_start']:.0f})", flush=True)
    attempt("lab", "down")
    med = {k: {f: statistics.median(r[f] for r in rs) for f in rs[0] if f != "path"}
           for k, rs in runs.items()}
    print(f"\n{a.rounds} rounds, {a.nics} NIC pair(s) at {a.rate}, --cpus {a.cpus}, --option {a.option}\n")
    print("| guest | total s | transfer s | total s per filled GiB | transfer s per filled GiB | "
          "QEMU GiB | transfer s per GiB QEMU moved | source agent peak MiB | target agent peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k, m in med.items():
        print(f"| {k} ({','.join(guests[k])}) | {m['total']:.2f} | {m['transfer']:.2f} | "
              f"{m['total_per_gib']:.2f} | {m['transfer_per_gib']:.2f} | {m['bytes'] / GIB:.2f} | "
              f"{m['transfer_per_moved']:.2f} | "
              f"{m['src_peak']:.0f} | {m['dst_peak']:.0f} |")
    b, s = med["big"], med["small"]
    print(f"| big ÷ small | | | {b['total_per_gib'] / s['total_per_gib']:.2f} | "
          f"{b['transfer_per_gib'] / s['transfer_per_gib']:.2f} | | "
          f"{b['transfer_per_moved'] / s['transfer_per_moved']:.2f} | "
          f"{b['src_peak'] / s['src_peak']:.2f} | {b['dst_peak'] / s['dst_peak']:.2f} |")


if __name__ == "__main__":
    main()
