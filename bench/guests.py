#!/usr/bin/env python3
"""The lab's Debian guest (systemd, guest agent, a TCP echo service; booted by
SeaBIOS from a storage disk over NBD, its address from a cloud-init seed; a NIC on the guests' bridge) against a workload guest of
the same memory, moved back and forth over the same links, alternating the two
in rounds. Per move: total and transfer time, QEMU downtime, switch-over, bytes;
for the Debian guest also the longest gap a client outside the hosts saw on its
one TCP connection (a counter sent every 100 ms, echoed back). Medians and
every run. Needs root, a built ferry and `ferry lab image --debian`.

    sudo python3 bench/guests.py [--rate 500mbit] [--rounds 3] [--option multichannel]
"""
import argparse, json, statistics, subprocess, sys, tempfile, time

import labqemu

FERRY = labqemu.FERRY
GUEST = "198.19.250.100"

CLIENT = r'''
import socket, sys, time, threading
s = socket.create_connection((sys.argv[1], 7000), timeout=60)
out = open(sys.argv[2], "w", buffering=1)
stop = open(sys.argv[3])
def rd():
    buf = b""
    while True:
        d = s.recv(4096)
        if not d:
            out.write("closed\n"); return
        buf += d
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            out.write("%d %.4f\n" % (int(line), time.time()))
threading.Thread(target=rd, daemon=True).start()
n = 0
while not stop.read():
    s.sendall(b"%d\n" % n); n += 1; time.sleep(0.1)
time.sleep(2)
out.write("sent %d\n" % n)
'''


def ferry(*args, check=True):
    out = subprocess.run([FERRY, *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        sys.exit(f"ferry {' '.join(args)} failed: {out.stderr}")
    return out.stdout


def move(vm, to, option):
    t0 = time.time()
    out = ferry("vm", "move", vm, "--to", to, "--option", option, "--json")
    r = json.loads(out.strip().splitlines()[-1])
    if r["event"] != "completed":
        sys.exit(f"move of {vm} failed: {r}")
    return t0, time.time(), r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="500mbit")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--option", default="multichannel")
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    ferry("lab", "up", "--replace", "--hosts", "2", "--nics", "2", "--rate", a.rate, *labqemu.cpus_flag(a))
    img = [l.split(": ", 1)[1].split(" (")[0] for l in ferry("lab", "image", "--debian").splitlines()
           if l.startswith("debian guest: ")][0]
    ferry("disk", "import", "bench-root", f"{img}/disk.img")
    spec = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    spec.write(f'''memory = "512M"
guest_agent = true
firmware = "bios"
[cloud_init]
user_data = "#cloud-config"
network_config = "version: 2\\nethernets:\\n  nic0:\\n    addresses: [{GUEST}/24]\\n"
[[drives]]
disk = "bench-root"
[[nics]]
bridge = "br-guest"
mac = "52:54:00:be:00:01"
''')
    spec.close()
    t = time.time()
    ferry("vm", "create", "deb", "--host", "host1", "--spec", spec.name)
    ferry("vm", "create", "wl", "--host", "host1", "--memory", "512M")
    # the client waits for the echo service: the guest has booted
    log = tempfile.NamedTemporaryFile("w", delete=False).name
    stop = tempfile.NamedTemporaryFile("w", delete=False).name
    while True:
        c = subprocess.run(["ip", "netns", "exec", "ferry-client", "python3", "-c",
                            "import socket; socket.create_connection(('%s', 7000), timeout=1)" % GUEST],
                           capture_output=True)
        if c.returncode == 0:
            break
        if time.time() - t > 240:
            sys.exit("the Debian guest did not boot in 240 s")
        time.sleep(0.5)
    boot = time.time() - t
    client = subprocess.Popen(["ip", "netns", "exec", "ferry-client", "python3", "-c", CLIENT, GUEST, log, stop])
    time.sleep(2)
    runs = {"deb": [], "wl": []}
    at = "host1"
    for rnd in range(a.rounds):
        for leg in range(2):
            to = "host2" if at == "host1" else "host1"
            order = ["deb", "wl"] if (rnd + leg) % 2 == 0 else ["wl", "deb"]
            for vm in order:
                t0, t1, r = move(vm, to, a.option)
                runs[vm].append((t0, t1, r, f"{at}->{to}"))
                time.sleep(2)
            at = to
    open(stop, "w").write("stop")
    client.wait()
    lines = open(log).read().splitlines()
    echoes = [tuple(map(float, l.split())) for l in lines if l[0].isdigit()]
    sent = int([l for l in lines if l.startswith("sent")][0].split()[1])
    closed = any(l == "closed" for l in lines)
    in_order = [int(n) for n, _ in echoes] == list(range(len(echoes)))

    def gap(t0, t1):
        ts = [ts for _, ts in echoes]
        g = [b - a for a, b in zip(ts, ts[1:]) if b >= t0 and a <= t1 + 1]
        return max(g) if g else float("nan")

    print(f"# guests: Debian vs workload guest, 512 MiB each, 2 x {a.rate}, --option {a.option}, "
          f"{a.rounds} rounds each way, alternating")
    print(f"debian boot under TCG (create -> echo service answers): {boot:.1f} s")
    print(f"client: sent {sent}, echoed {len(echoes)}, in order {in_order}, connection closed {closed}")
    print("| guest | move | total ms | transfer ms | downtime ms | switch-over ms | MiB moved | longest TCP gap ms |")
    print("|---|---|---|---|---|---|---|---|")
    for vm in ("deb", "wl"):
        for t0, t1, r, leg in runs[vm]:
            g = f"{gap(t0, t1) * 1000:.0f}" if vm == "deb" else "-"
            print(f"| {vm} | {leg} | {r['total_ms']} | {r['transfer_ms']} | {r['downtime_ms']} | "
                  f"{r['switchover_ms']} | {r['bytes_transferred'] / 2**20:.0f} | {g} |")
    print("| **median** | | | | | | | |")
    for vm in ("deb", "wl"):
        rs = [r for _, _, r, _ in runs[vm]]
        med = lambda k: statistics.median(x[k] for x in rs)
        g = f"{statistics.median(gap(t0, t1) for t0, t1, _, _ in runs[vm]) * 1000:.0f}" if vm == "deb" else "-"
        print(f"| {vm} | median of {len(rs)} | {med('total_ms'):.0f} | {med('transfer_ms'):.0f} | "
              f"{med('downtime_ms'):.0f} | {med('switchover_ms'):.0f} | "
              f"{med('bytes_transferred') / 2**20:.0f} | {g} |")
    ferry("vm", "rm", "deb", check=False)
    ferry("vm", "rm", "wl", check=False)
    ferry("disk", "rm", "bench-root", check=False)


if __name__ == "__main__":
    main()
