#!/usr/bin/env python3
"""Storage traffic's share of a NIC during a drain, with and without bandwidth classes.

Each scenario: a fresh lab (3 hosts × 2 NICs at --rate), --vms guests on host1,
nbdkit (memory plugin) on host2's nic1 address as a storage peer. `ferry host
drain host1 --max-parallel 4` starts; 3 s later fio writes 1 MiB blocks to the
NBD export from host1 for --fio-secs (host1 → host2 over nic1, the same NIC the
migrations' carriers use). Scenarios: no classes; classes (live-migration
--max 60% --min 30%, storage --min 40%); and both again with host1's nic2 cut
while fio runs, so nic1 carries everything (put back when fio ends). Reported: storage Mbit/s and its
share of nic1, the live-migration class's rate on nic1 (from `ferry bandwidth
list`, sampled each second while fio runs), drain time.

    sudo python3 bench/bandwidth.py [--vms 4] [--memory 512M] [--fill 384M] [--rate 300mbit]
"""
import argparse, json, subprocess, sys, threading, time

from labqemu import lab_addr, lab_nic
import labqemu  # noqa: E402

FERRY = labqemu.FERRY


def ferry(*args, check=True):
    out = subprocess.run([FERRY, *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        sys.exit(f"ferry {' '.join(args)} failed: {out.stderr}")
    return out.stdout


def fio(secs):
    out = subprocess.run(["ip", "netns", "exec", "host1", "fio", "--name=storage", "--ioengine=nbd",
                          f"--uri=nbd://{lab_addr('host2', 1)}:10809/", "--rw=write", "--bs=1M", "--iodepth=8",
                          "--size=4G", "--time_based", f"--runtime={secs}", "--output-format=json"],
                         capture_output=True, text=True)
    s = out.stdout
    d = json.loads(s[s.index("{"):])
    return d["jobs"][0]["write"]["bw"] * 8 * 1024  # KiB/s → bit/s


def lm_rate_nic1():
    try:
        r = json.loads(ferry("bandwidth", "list", "--json", check=False))
    except ValueError:
        return None
    for h in r["hosts"]:
        if h["host"] == "host1":
            for n in h["nics"]:
                if n["nic"] == lab_nic("host1", "nic1"):
                    for c in n["classes"]:
                        if c["class"] == "live-migration":
                            return c["tx_rate"]
    return None


def scenario(a, classes, cut):
    ferry("lab", "up", "--replace", "--hosts", "3", "--nics", "2", "--rate", a.rate, *labqemu.cpus_flag(a))
    nbd = subprocess.Popen(["ip", "netns", "exec", "host2", "nbdkit", "-f", "-p", "10809", "-i", lab_addr("host2", 1),
                            "memory", "4G"])
    if classes:
        ferry("bandwidth", "set", "--class", "live-migration", "--max", "60%", "--min", "30%")
        ferry("bandwidth", "set", "--class", "storage", "--min", "40%")
    procs = [subprocess.Popen([FERRY, "vm", "create", f"bw{i}", "--host", "host1", "--memory", a.memory,
                               "--fill", a.fill, "--dirty-rate", "4M"], stdout=subprocess.DEVNULL)
             for i in range(a.vms)]
    for p in procs:
        if p.wait() != 0:
            sys.exit("vm create failed")
    result = {}

    def drain():
        out = ferry("host", "drain", "host1", "--max-parallel", "4", "--json", check=False)
        if a.events:
            with open(a.events, "a") as f:
                f.write(out)
        result["done"] = json.loads(out.strip().splitlines()[-1])

    t = threading.Thread(target=drain)
    t.start()
    time.sleep(3)
    if cut:
        ferry("lab", "link", "host1", "nic2", "down")
    samples = []
    stop = threading.Event()

    def sample():
        while not stop.wait(1.0):
            r = lm_rate_nic1()
            if r is not None:
                samples.append(r)

    s = threading.Thread(target=sample)
    s.start()
    storage = fio(a.fio_secs)
    stop.set()
    s.join()
    if cut:
        # the cable goes back once the storage share is measured
        ferry("lab", "link", "host1", "nic2", "up")
    t.join()
    nbd.kill()
    done = result["done"]
    assert done["event"] == "done" and len(done["moved"]) == a.vms, done
    lm = sum(samples) / len(samples) if samples else None
    return storage, lm, done["total_ms"] / 1000


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vms", type=int, default=4)
    ap.add_argument("--memory", default="512M")
    ap.add_argument("--fill", default="384M")
    ap.add_argument("--rate", default="300mbit")
    ap.add_argument("--fio-secs", type=int, default=10)
    ap.add_argument("--only", help="run one scenario: none, classes, none-cut, classes-cut")
    ap.add_argument("--events", help="append each drain's NDJSON events to this file")
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    rate = float(a.rate.replace("gbit", "e9").replace("mbit", "e6"))
    rows = []
    all_ = {"none": (False, False), "classes": (True, False), "none-cut": (False, True), "classes-cut": (True, True)}
    for key, (classes, cut) in all_.items():
        if a.only and a.only != key:
            continue
        storage, lm, secs = scenario(a, classes, cut)
        name = ("classes" if classes else "no classes") + (", nic2 cut" if cut else "")
        print(f"{name}: storage {storage / 1e6:.0f} Mbit/s ({storage / rate:.2f} of nic1), "
              f"drain {secs:.1f} s", file=sys.stderr)
        rows.append((name, storage, lm, secs))
    ferry("lab", "down")
    print(f"| scenario | storage Mbit/s | storage ÷ nic1 rate | live-migration class on nic1, Mbit/s | drain s |")
    print("|---|---|---|---|---|")
    for name, storage, lm, secs in rows:
        lm_s = f"{lm / 1e6:.0f}" if lm is not None else "- (no classes)"
        print(f"| {name} | {storage / 1e6:.0f} | {storage / rate:.2f} | {lm_s} | {secs:.1f} |")


if __name__ == "__main__":
    main()
