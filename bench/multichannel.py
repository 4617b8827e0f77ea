#!/usr/bin/env python3
"""One migration over 1, 2 and 3 NICs through Ferry's transport, vs QEMU's own
TCP stream over one NIC, and a NIC cut mid-move — all in one run, same guest.

For each run: transfer time (QEMU's migrate → target guest running), bytes,
throughput ÷ (NICs × link rate), QEMU downtime + switch-over, and the CPU time
the two Ferry agents spent per GiB moved (the transport's own cost; QEMU's is
the same for every option that uses multifd). Needs root and a built ferry.

    sudo python3 bench/multichannel.py [--rate 1gbit] [--memory 1280M] [--fill 1G]
"""
import argparse, json, os, subprocess, sys, time

from labqemu import lab_nic
import labqemu  # noqa: E402

FERRY = labqemu.FERRY
TICK = os.sysconf("SC_CLK_TCK")


def ferry(*args, check=True):
    out = subprocess.run([FERRY, *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        sys.exit(f"ferry {' '.join(args)} failed: {out.stderr}")
    return out.stdout


def agent_cpu():
    total = 0.0
    for h in ("host1", "host2"):
        pid = open(f"/run/ferry/lab/{h}/agent.pid").read().strip()
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        total += (int(f[11]) + int(f[12])) / TICK
    return total


def where(vm):
    return [v for v in json.loads(ferry("vm", "list", "--json")) if v["name"] == vm][0]["host"]


def move(vm, option, cut=None):
    where_from = where(vm)
    to = "host2" if where_from == "host1" else "host1"
    cpu0 = agent_cpu()
    p = subprocess.Popen([FERRY, "vm", "move", vm, "--to", to, "--option", option, "--json"],
                         stdout=subprocess.PIPE, text=True)
    events, cut_at, down_seen, recovered = [], None, None, None
    for line in p.stdout:
        ev = json.loads(line)
        events.append(ev)
        if ev["event"] != "progress":
            continue
        if cut and cut_at is None and ev["transferred"] >= cut[2]:
            ferry("lab", "link", to, cut[1], "down")
            cut_at = ev["elapsed_ms"]
        if cut_at is not None and down_seen is None and ev.get("carriers_up") == 1:
            down_seen = ev["elapsed_ms"]
        # back to >= 90% of the remaining link, measured by the surviving NIC's bytes
        if cut_at is not None and recovered is None and len(events) > 3:
            prev = [e for e in events if e["event"] == "progress"][-3]
            dt = (ev["elapsed_ms"] - prev["elapsed_ms"]) / 1000
            n1 = lab_nic(where_from, "nic1")
            b = ev["nic_tx_bytes"].get(n1, 0) - prev["nic_tx_bytes"].get(n1, 0)
            if ev["elapsed_ms"] > cut_at and dt > 0 and b * 8 / dt >= 0.9 * RATE:
                recovered = ev["elapsed_ms"]
    p.wait()
    if cut:
        ferry("lab", "link", to, cut[1], "up")
    r = events[-1]
    assert r["event"] == "completed", r
    r["agent_cpu_s"] = agent_cpu() - cpu0
    r["cut"] = (cut_at, down_seen, recovered) if cut else None
    return r


def row(label, nics, r):
    gib = r["bytes_transferred"] / 2**30
    ratio = r["bytes_transferred"] * 8 / (r["transfer_ms"] / 1000) / (nics * RATE)
    per = ", ".join(f"{n} {b / 2**20:.0f}" for n, b in sorted(r["nic_tx_bytes"].items()) if b > 2**20)
    print(f"| {label} | {r['option']} | {nics} | {r['transfer_ms'] / 1000:.2f} | {r['bytes_transferred'] / 2**20:.0f} | "
          f"{r['throughput'] * 8 / 1e6:.0f} | {ratio:.3f} | {r['downtime_ms']} + {r['switchover_ms']} | "
          f"{r['agent_cpu_s'] / gib:.2f} | {per} |")


def main():
    global RATE
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--memory", default="1280M")
    ap.add_argument("--fill", default="1G")
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    RATE = float(a.rate.replace("gbit", "e9").replace("mbit", "e6"))
    print(f"| run | option | NICs | transfer s | MiB | Mbit/s | ÷ (NICs × {a.rate}) | downtime + switch-over ms | agents' CPU s/GiB | MiB per NIC |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for nics in (1, 2, 3):
        ferry("lab", "up", "--replace", "--hosts", "2", "--nics", str(nics), "--rate", a.rate, *labqemu.cpus_flag(a))
        ferry("vm", "create", "mb", "--host", "host1", "--memory", a.memory, "--fill", a.fill, "--dirty-rate", "8M")
        if nics == 1:
            row("QEMU tcp, one NIC", 1, move("mb", "tcp"))
        row(f"multichannel, {nics} NIC{'s' if nics > 1 else ''}", nics, move("mb", "multichannel"))
        if nics == 2:
            row("QEMU tcp, one of the two NICs", 1, move("mb", "tcp"))
            r = move("mb", "multichannel", cut=("host2", "nic2", int(size(a.fill) * 0.4)))
            row("multichannel, nic2 cut at 40%", 2, r)
            cut_at, down, rec = r["cut"]
            print(f"\ncut at {cut_at} ms: carrier down seen at {down} ms (+{down - cut_at if down else None}), "
                  f"nic1 at >= 90% of its link from {rec} ms (+{rec - cut_at if rec else None}); guest intact: {r['check']['intact']}\n")
        ferry("vm", "rm", "mb")
    ferry("lab", "down")


def size(s):
    return int(float(s.rstrip("KMGkmg")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1].upper(), 1))


if __name__ == "__main__":
    main()
