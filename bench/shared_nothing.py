#!/usr/bin/env python3
"""Shared-nothing live migration: a VM with a 2 GiB local qcow2 drive, moved
by Ferry over 1, 2 and 3 NICs, against QEMU's own shared-nothing migration
driven by hand over QMP (what libvirt does): the target exports its empty
copy from its NBD server over TCP, the source runs `blockdev-mirror` into it
over one TCP connection, then migrates the memory over one TCP stream with
`pause-before-switchover`, ends the mirror in step, and lets QEMU finish.

    python3 bench/shared_nothing.py [--nics 1,2,3] [--rate 250mbit] [--disk 2G] [--rounds 3]

Every trial starts from the same image: a fully written qcow2 (random data,
so nothing on the path can shrink it), copied to the source host. Both
contenders run the same QEMU with the same command line (`ferry qemu-args`)
and the same workload guest (256 MiB, 128 MiB filled, 1 MiB/s dirtied,
writing its disk twice a second). For each NIC count a lab of that many
NICs is brought up; within it the contenders alternate, round after round.

Reported per trial: total time (from the request to the guest running on the
target: Ferry's report's running_ms, which leaves out the cleanup and final
check that follow; its total_ms with them is printed too), bytes moved (the disk's virtual size plus the memory QEMU sent), and
time ÷ (bytes ÷ Σ link rate) — 1.0 is the links' limit. QEMU's baseline uses
one NIC whatever the lab has: that is what one TCP stream gets. Medians and
every trial are printed, then JSON.

Needs the lab (root, QEMU >= 9, iproute2) and a built ferry
(labqemu.default_ferry: FERRY_BIN, else the release build).
"""
import argparse, json, os, statistics, subprocess, sys, time

from labqemu import Qmp, ferry, lab_addr, rate, size, wait_ready
import labqemu  # noqa: E402

LAB = "/run/ferry/lab"
BENCH = "/run/ferry/bench"
VM = "snb"
DRIVE = "data.qcow2"
TEMPLATE = "/var/tmp/ferry-bench-shared-nothing.qcow2"
MEMORY, FILL, DIRTY = "256M", "128M", "1M"
NBD_PORT = 10810


def template(disk):
    """A fully written qcow2 of `disk` bytes (random data), made once."""
    if os.path.exists(TEMPLATE) and json.loads(subprocess.check_output(
            ["qemu-img", "info", "--output=json", TEMPLATE]))["virtual-size"] == disk:
        return
    raw = TEMPLATE + ".raw"
    subprocess.run(["dd", "if=/dev/urandom", f"of={raw}", "bs=4M", f"count={disk >> 22}", "status=none"],
                   check=True)
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, TEMPLATE], check=True)
    os.remove(raw)


def place(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    subprocess.run(["cp", TEMPLATE, path], check=True)


def ferry_trial(disk, nics):
    src = f"{LAB}/host1/disks/{VM}/{DRIVE}"
    place(src)
    ferry("vm", "create", VM, "--host", "host1", "--memory", MEMORY, "--fill", FILL, "--dirty-rate", DIRTY,
          "--drive", f"local={DRIVE},format=qcow2")
    time.sleep(2)
    out = subprocess.run([labqemu.FERRY, "vm", "move", VM, "--to", "host2",
                          "--option", "auto", "--json"],
                         capture_output=True, text=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    ferry("vm", "rm", VM)
    if r.get("event") != "completed":
        sys.exit(f"ferry move failed: {r}")
    disk_bytes = sum(d["size"] for d in r["disks"])
    # the same measure as QEMU's: until the guest runs on the target (the
    # report's total_ms also counts the source's cleanup and the final check)
    return {"total_ms": r["running_ms"], "with_check_ms": r["total_ms"],
            "bytes": disk_bytes + r["bytes_transferred"],
            "disk_ready_ms": r["disks"][0]["ready_ms"], "downtime_ms": r["downtime_ms"],
            "disk_nic_bytes": r.get("disk_nic_tx_bytes", {})}


def spec():
    return {"name": "bench", "memory": size(MEMORY), "fill": size(FILL), "dirty_rate": size(DIRTY),
            "verify_rate": 32 << 20, "seed": 1, "drives": [{"local": DRIVE, "format": "qcow2"}]}


def start_qemu(ns, d, incoming):
    built = ferry("qemu-args", "--spec", json.dumps(spec()), "--dir", d, *(["--incoming"] if incoming else []))
    p = subprocess.Popen(["ip", "netns", "exec", ns, *json.loads(built)], stdout=subprocess.DEVNULL,
                         stderr=open(f"{d}/qemu.log", "w"))
    return p, Qmp(f"{d}/qmp.sock")


def wait_jobs(q, pred, what, within=600):
    t0 = time.time()
    while True:
        jobs = q.cmd("query-block-jobs")
        if pred(jobs):
            return jobs
        for j in jobs:
            if j.get("error"):
                sys.exit(f"{what}: {j}")
        if time.time() - t0 > within:
            sys.exit(f"{what}: not within {within} s: {jobs}")
        time.sleep(0.05)


def direct_trial(disk):
    """QEMU alone: NBD export on the target, blockdev-mirror over one TCP
    connection, memory over one TCP stream, pause-before-switchover."""
    sd, td = f"{BENCH}/host1", f"{BENCH}/host2"
    subprocess.run(["rm", "-rf", sd, td])
    for d in (sd, td):
        os.makedirs(d)
    place(f"{sd}/disks/bench/{DRIVE}")
    sp, sq = start_qemu("host1", sd, False)
    sq.cmd("cont")
    wait_ready(f"{sd}/console.log")
    time.sleep(2)
    addr = lab_addr("host2", 1)
    t0 = time.time()
    os.makedirs(f"{td}/disks/bench")
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", f"{td}/disks/bench/{DRIVE}", str(disk)], check=True)
    tp, tq = start_qemu("host2", td, True)
    tq.cmd("nbd-server-start", addr={"type": "inet", "data": {"host": addr, "port": str(NBD_PORT)}})
    tq.cmd("block-export-add", type="nbd", id="drive0", **{"node-name": "drive0"}, name="drive0", writable=True)
    tq.cmd("migrate-incoming", uri=f"tcp:{addr}:0")
    port = tq.cmd("query-migrate")["socket-address"][0]["port"]
    sq.cmd("blockdev-add", driver="nbd", **{"node-name": "mirror0"},
           server={"type": "inet", "host": addr, "port": str(NBD_PORT)}, export="drive0")
    sq.cmd("blockdev-mirror", **{"job-id": "m0", "auto-dismiss": False}, device="drive0", target="mirror0",
           sync="full")
    wait_jobs(sq, lambda js: all(j["ready"] for j in js), "mirror")
    t_ready = time.time()
    sq.cmd("migrate-set-capabilities", capabilities=[{"capability": "pause-before-switchover", "state": True}])
    sq.cmd("migrate-set-parameters", **{"max-bandwidth": 100 << 30, "downtime-limit": 300})
    sq.cmd("migrate", uri=f"tcp:{addr}:{port}")
    while True:
        info = sq.cmd("query-migrate")
        st = info.get("status")
        if st == "pre-switchover":
            sq.cmd("block-job-cancel", device="m0")
            wait_jobs(sq, lambda js: all(j["status"] == "concluded" for j in js), "mirror end")
            sq.cmd("job-dismiss", id="m0")
            sq.cmd("migrate-continue", state="pre-switchover")
        elif st in ("completed", "failed", "cancelled"):
            break
        time.sleep(0.02)
    if st != "completed":
        sys.exit(f"direct migration failed: {info}")
    while tq.cmd("query-migrate").get("status") != "completed":
        time.sleep(0.005)
    tq.cmd("nbd-server-stop")
    tq.cmd("cont")
    while tq.cmd("query-status")["status"] != "running":
        time.sleep(0.005)
    total = (time.time() - t0) * 1000
    for q, p in ((sq, sp), (tq, tp)):
        q.cmd("quit")
        p.wait()
    subprocess.run(["rm", "-rf", sd, td])
    return {"total_ms": total, "bytes": disk + info["ram"]["transferred"],
            "disk_ready_ms": (t_ready - t0) * 1000, "downtime_ms": info["downtime"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nics", default="1,2,3")
    ap.add_argument("--rate", default="250mbit")
    ap.add_argument("--disk", default="2G")
    ap.add_argument("--rounds", type=int, default=3)
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    disk = size(a.disk)
    template(disk)
    rows = []
    for n in [int(x) for x in a.nics.split(",")]:
        ferry("lab", "up", "--replace", "--hosts", "2", "--nics", str(n), "--rate", a.rate, *labqemu.cpus_flag(a))
        ferry("lab", "image")
        line = n * rate(a.rate)
        for rnd in range(a.rounds):
            order = ["ferry", "qemu"] if rnd % 2 == 0 else ["qemu", "ferry"]
            for who in order:
                m = ferry_trial(disk, n) if who == "ferry" else direct_trial(disk)
                # QEMU's one TCP stream has one link whatever the lab has
                links = line if who == "ferry" else rate(a.rate)
                m.update(who=who, nics=n, round=rnd + 1,
                         ratio=m["total_ms"] / 1000 / (m["bytes"] * 8 / line),
                         ratio_own_links=m["total_ms"] / 1000 / (m["bytes"] * 8 / links))
                rows.append(m)
                print(json.dumps(m), flush=True)
    print(f"\n| NICs × {a.rate} | contender | total s (median) | disk in step s | downtime ms | GiB moved | "
          f"time ÷ (bytes ÷ Σ link rate) | every trial | Ferry faster by |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in sorted({r["nics"] for r in rows}):
        med = {}
        for who in ("ferry", "qemu"):
            rs = [r for r in rows if r["nics"] == n and r["who"] == who]
            if not rs:
                continue
            med[who] = statistics.median(r["total_ms"] for r in rs)
            every = ", ".join(f"{r['ratio']:.3f}" for r in rs)
            faster = f"{med['qemu'] / med['ferry']:.2f}×" if who == "qemu" and "ferry" in med else ""
            name = "Ferry" if who == "ferry" else "QEMU mirror + migrate, one TCP stream"
            print(f"| {n} | {name} | {med[who] / 1000:.1f} | "
                  f"{statistics.median(r['disk_ready_ms'] for r in rs) / 1000:.1f} | "
                  f"{statistics.median(r['downtime_ms'] for r in rs):.0f} | "
                  f"{statistics.median(r['bytes'] for r in rs) / 2**30:.2f} | "
                  f"{statistics.median(r['ratio'] for r in rs):.3f} | {every} | {faster} |")
    print(json.dumps(rows))
    ferry("lab", "down")


if __name__ == "__main__":
    main()
