#!/usr/bin/env python3
"""Storage live migration: `ferry disk move` of a fully written disk, in use
by a writing guest, between the lab's two storage nodes over a link shaped
to a known rate, against `nbdcopy` (libnbd) copying the same bytes between
the same two nodes over the same link: the plain copy a user could run
instead, with the disk offline.

    python3 bench/disk_move.py [--disk 1G] [--rate 400mbit] [--rounds 3]

The "link" between the nodes: both run in the root namespace on the
management bridge, so their traffic to each other goes through `lo`; an HTB
class on `lo` holds what goes to either node's NBD port (10809, 10810) to
`--rate`, and only that (the guests reach the nodes over their own veths).

Each round: Ferry moves the disk to the other node (alternating direction),
while a workload guest writes it twice a second; then nbdcopy copies a
second disk of the same contents storage1 → storage2 over NBD with TLS
(an administrator's certificate). Reported per trial: the bytes the copy
carried, the time, and throughput ÷ link rate (1.0: the link's limit);
Ferry's rounds and the guest's pause for its final round. Medians and every
trial, then JSON.

Needs the lab (root, QEMU >= 9, iproute2), nbdcopy, and a built ferry
(labqemu.default_ferry: FERRY_BIN, else the release build).
"""
import argparse, json, os, statistics, subprocess, sys, time

from labqemu import ferry, rate, size
import labqemu  # noqa: E402

LAB = "/run/ferry/lab"
DISK, COPY, VM = "bench-move", "bench-copy", "bmv"
PORTS = (10809, 10810)


def sh(*a):
    subprocess.run(a, check=True)


def shape(bps):
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    sh("tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "99")
    sh("tc", "class", "add", "dev", "lo", "parent", "1:", "classid", "1:99", "htb", "rate", "100gbit",
       "quantum", "200000")
    sh("tc", "class", "add", "dev", "lo", "parent", "1:", "classid", "1:10", "htb",
       "rate", f"{bps}bit", "ceil", f"{bps}bit", "quantum", "200000")
    for p in PORTS:
        sh("tc", "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "u32",
           "match", "ip", "dport", str(p), "0xffff", "flowid", "1:10")


def unshape():
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)


def fill(node, disk, nbytes):
    """Random data over the whole disk file, written before anyone opens it."""
    path = f"{LAB}/{node}/disks/{disk}.img"
    sh("dd", "if=/dev/urandom", f"of={path}", "bs=4M", f"count={nbytes >> 22}", "conv=notrunc,fsync",
       "status=none")


def disk_node(disk):
    for d in json.loads(ferry("disk", "list", "--json")):
        if d["name"] == disk:
            return d["node"]
    sys.exit(f"no disk {disk}")


def ferry_trial(to):
    out = subprocess.run([labqemu.FERRY, "disk", "move", DISK,
                          "--to", to, "--json"], capture_output=True, text=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    if m["phase"] != "done":
        sys.exit(f"disk move failed: {m}")
    return {"s": (m["finished_ms"] - m["started_ms"]) / 1000, "bytes": m["push"]["bytes_sent"],
            "rounds": m["push"]["rounds"], "pause_ms": m["guest_pause_ms"], "final_ms": m["push"]["final_ms"]}


def nbdcopy_trial():
    pki = f"{LAB}/pki/admin"
    uri = lambda port: (f"nbds://198.18.0.1:{port}/{COPY}?tls-certificates={pki}")
    t0 = time.monotonic()
    # storage1's copy of the disk to storage2's: each node serves one of them
    sh("nbdcopy", "--flush", uri(10809).replace(COPY, COPY + "-src"), uri(10810))
    s = time.monotonic() - t0
    return {"s": s}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--disk", default="1G")
    ap.add_argument("--rate", default="400mbit")
    ap.add_argument("--rounds", type=int, default=3)
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    nbytes, bps = size(a.disk), rate(a.rate)
    ferry("lab", "up", "--replace", "--hosts", "1", "--nics", "1", "--storage-nodes", "2", "--host-memory", "2G", *labqemu.cpus_flag(a))
    ferry("disk", "create", DISK, "--size", a.disk, "--node", "storage1")
    fill("storage1", DISK, nbytes)
    ferry("disk", "create", COPY + "-src", "--size", a.disk, "--node", "storage1")
    fill("storage1", COPY + "-src", nbytes)
    ferry("disk", "create", COPY, "--size", a.disk, "--node", "storage2")
    ferry("vm", "create", VM, "--host", "host1", "--memory", "256M", "--fill", "64M", "--seed", "31")
    ferry("disk", "attach", DISK, VM)
    time.sleep(3)
    shape(bps)
    trials = {"ferry": [], "nbdcopy": []}
    try:
        for r in range(a.rounds):
            to = "storage2" if disk_node(DISK) == "storage1" else "storage1"
            f = ferry_trial(to)
            f["ratio"] = (f["bytes"] * 8 / f["s"]) / bps
            f["to"] = to
            trials["ferry"].append(f)
            n = nbdcopy_trial()
            n["bytes"] = nbytes
            n["ratio"] = (nbytes * 8 / n["s"]) / bps
            trials["nbdcopy"].append(n)
            print(f"round {r + 1}: ferry → {to} {f['s']:.1f} s {f['ratio']:.3f} of the link "
                  f"({f['rounds']} rounds, guest paused {f['pause_ms']} ms); nbdcopy {n['s']:.1f} s "
                  f"{n['ratio']:.3f}", flush=True)
    finally:
        unshape()
        subprocess.run([labqemu.FERRY, "vm", "rm", VM], capture_output=True)
    for k, v in trials.items():
        print(f"{k}: throughput ÷ link rate median {statistics.median(t['ratio'] for t in v):.3f}, every trial "
              + ", ".join(f"{t['ratio']:.3f}" for t in v))
    print(json.dumps({"disk": nbytes, "rate_bps": bps, "trials": trials}))


if __name__ == "__main__":
    main()
