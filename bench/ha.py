#!/usr/bin/env python3
"""High availability: a host failed under 4 HA workload guests writing their
disks, TRIALS times per fault, and how long until each guest runs elsewhere.

    python3 bench/ha.py [--trials 20] [--only power-off,isolation]

Faults:
  power-off   `ferry lab host host1 off`: every process of host1 killed
              (agent and QEMUs), its links down
  isolation   `ferry lab host host1 isolate --network management`: host1
              runs on, its guests writing, cut from the control service only

Per trial, on a fresh lab of 3 hosts × 2 NICs: 4 guests (256M, --ha) each
with its own 32M Ferry disk are made on host1 and write their disks; the
fault is injected; each guest's time is from the fault to it running on
another host with its disk counter advancing there (its console on that
host, read directly every 100 ms, showing `FERRY-DISK seq=` past 2; then
`ferry vm list` must list it running there, and exactly one QEMU of it
runs on the survivors). Reported per fault: p50 / p95 / max of those
times over every guest of every trial, VMs lost (not running elsewhere
within 90 s), and double writers:
  - the guest restarted elsewhere reports a disk error (its own block
    overwritten: a second writer of its disk), or
  - a QEMU of the guest still runs on host1 once it runs elsewhere, or
  - its disk has open NBD flows from two hosts after the restart.
Then host1 is brought back (`ferry lab host host1 on`), must rejoin healthy
and run none of them, and the guests are removed.

Needs the lab (root, QEMU >= 9, iproute2); uses the release build (labqemu.default_ferry)
(FERRY_BIN to override). A trial takes about 40 s.
"""
import argparse, json, subprocess, sys, time
import labqemu  # noqa: E402

FERRY = labqemu.FERRY
LAB = "/run/ferry/lab"
VICTIM = "host1"
GUESTS = [f"hab{i}" for i in range(1, 5)]


def ferry(*args, check=True, timeout=300):
    r = subprocess.run([FERRY, *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"ferry {' '.join(args)}: {r.stderr.strip()}")
    return r


def fj(*args):
    return json.loads(ferry(*args, "--json").stdout)


def disk_line(host, vm):
    """(seq, errors) of the guest's last FERRY-DISK line on `host`."""
    try:
        text = open(f"{LAB}/{host}/vms/{vm}/console.log", errors="replace").read()
    except OSError:
        return None
    for line in reversed(text.splitlines()):
        if line.startswith("FERRY-DISK dev=vda "):
            f = dict(w.split("=", 1) for w in line.split()[1:] if "=" in w)
            return int(f.get("seq", 0)), int(f.get("errors", 0))
    return None


def qemu_of(host, vm):
    out = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout.split()
    for p in out:
        try:
            cmd = open(f"/proc/{p}/cmdline", "rb").read()
        except OSError:
            continue
        if b"qemu-system" in cmd and f"guest={vm},".encode() in cmd:
            return int(p)
    return None


def health(host):
    return next((h.get("health") for h in fj("host", "list") if h["name"] == host), None)


def cleanup():
    for g in GUESTS:
        ferry("vm", "rm", g, check=False)
    # a disk is removed once its last NBD connection has closed
    t0 = time.time()
    left = [f"{g}-disk" for g in GUESTS]
    while left:
        left = [d for d in left if ferry("disk", "rm", d, check=False).returncode != 0
                and any(x["name"] == d for x in fj("disk", "list"))]
        if left and time.time() - t0 > 30:
            raise RuntimeError(f"disks not removed within 30 s: {left}")
        if left:
            time.sleep(1)


def setup():
    cleanup()
    for i, g in enumerate(GUESTS):
        ferry("vm", "create", g, "--host", VICTIM, "--memory", "256M", "--fill", "32M",
              "--dirty-rate", "1M", "--seed", str(40 + i), "--ha")
        ferry("disk", "create", f"{g}-disk", "--size", "32M")
        ferry("disk", "attach", f"{g}-disk", g)
    t0 = time.time()
    while any((disk_line(VICTIM, g) or (0, 0))[0] < 2 for g in GUESTS):
        if time.time() - t0 > 60:
            raise RuntimeError("the guests do not write their disks")
        time.sleep(0.3)
    time.sleep(2)  # leases renewed naming them


def trial(fault):
    setup()
    t0 = time.time()
    if fault == "power-off":
        ferry("lab", "host", VICTIM, "off")
    else:
        ferry("lab", "host", VICTIM, "isolate", "--network", "management")
    times, where, doubles = {}, {}, []
    others = [h for h in ("host2", "host3")]
    # watched where it happens: a guest's console on another host, its disk
    # counter past 2 (no API call in the loop to blur the time)
    while len(times) < len(GUESTS) and time.time() - t0 < 90:
        for g in GUESTS:
            if g in times:
                continue
            for h in others:
                dl = disk_line(h, g)
                if dl and dl[0] >= 2:
                    times[g] = time.time() - t0
                    where[g] = h
                    if dl[1] > 0:
                        doubles.append(f"{g}: disk errors on {h}")
                    if qemu_of(VICTIM, g):
                        doubles.append(f"{g}: still runs on {VICTIM} while on {h}")
        time.sleep(0.1)
    vms = {v["name"]: v for v in fj("vm", "list")}
    for g, h in where.items():
        v = vms.get(g, {})
        if v.get("host") != h or v.get("state") != "running":
            doubles.append(f"{g}: runs on {h}, listed {v.get('state')} on {v.get('host')}")
        if sum(1 for x in others if qemu_of(x, g)) != 1:
            doubles.append(f"{g}: QEMUs on {[x for x in others if qemu_of(x, g)]}")
    # a little later: no disk error, and no disk opened from two hosts
    time.sleep(2)
    for g, h in where.items():
        dl = disk_line(h, g)
        if dl and dl[1] > 0:
            doubles.append(f"{g}: disk errors on {h}")
    try:
        flows = fj("qos", "flow", "list")
    except RuntimeError:
        flows = []
    for g in GUESTS:
        hosts = {f["host"] for f in flows if f["disk"] == f"{g}-disk" and f["connections"] > 0}
        if len(hosts) > 1:
            doubles.append(f"{g}: its disk open from {sorted(hosts)}")
    lost = [g for g in GUESTS if g not in times]
    ferry("lab", "host", VICTIM, "on")
    t1 = time.time()
    while health(VICTIM) != "ok":
        if time.time() - t1 > 60:
            raise RuntimeError(f"{VICTIM} does not rejoin")
        time.sleep(0.5)
    time.sleep(3)
    for g in GUESTS:
        if qemu_of(VICTIM, g):
            doubles.append(f"{g}: runs on {VICTIM} after it rejoined")
    cleanup()
    return times, lost, sorted(set(doubles))


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return None
    k = min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--only", default="power-off,isolation")
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    ferry("lab", "up", "--replace", "--hosts", "3", "--nics", "2", *labqemu.cpus_flag(a))
    time.sleep(3)
    result = {}
    for fault in a.only.split(","):
        all_times, lost, doubles = [], [], []
        for t in range(a.trials):
            times, l, d = trial(fault)
            all_times += list(times.values())
            lost += l
            doubles += d
            print(f"{fault} trial {t + 1}: " + " ".join(f"{g}={s:.1f}s" for g, s in sorted(times.items()))
                  + (f" LOST {l}" if l else "") + (f" DOUBLE {d}" if d else ""), flush=True)
        result[fault] = {
            "trials": a.trials, "guests": a.trials * len(GUESTS),
            "p50_s": pct(all_times, 50), "p95_s": pct(all_times, 95), "max_s": max(all_times, default=None),
            "lost": len(lost), "double_writers": len(doubles), "doubles": doubles,
        }
    print()
    print(f"{'fault':<11} {'guests':>6} {'p50 s':>6} {'p95 s':>6} {'max s':>6} {'lost':>5} {'double':>6}")
    for f, r in result.items():
        fmt = lambda x: f"{x:6.1f}" if x is not None else "     -"
        print(f"{f:<11} {r['guests']:>6} {fmt(r['p50_s'])} {fmt(r['p95_s'])} {fmt(r['max_s'])} "
              f"{r['lost']:>5} {r['double_writers']:>6}")
    print(json.dumps(result))
    return 0 if all(r["lost"] == 0 and r["double_writers"] == 0 for r in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
