#!/usr/bin/env python3
"""Ferry's NBD storage service vs qemu-nbd and nbdkit (file plugin), and the
cost and accuracy of its QoS scheduler. Everything on loopback; fio's nbd
engine (libnbd) drives every server the same way.

For each backing store (a file on tmpfs, /dev/shm; and a file on disk,
/var/tmp), each server serves the same 256 MiB file in turn, and fio runs 4K
random reads and 4K random writes at queue depth 32 over 2 connections
(multi-conn: one per fio job). Reported: IOPS per server, and Ferry ÷ qemu-nbd
and Ferry ÷ nbdkit. Then, on tmpfs: Ferry with a policy far above the load
(max 10,000,000 IOPS) vs no policy (QoS overhead), a 500 IOPS cap measured by
fio, and a 1,000 IOPS minimum against four unlimited neighbours on a node
whose store sustains 4,000 IOPS.

    python3 bench/storage.py [--runtime 10] [--rounds 2]

Needs fio, libnbd-bin, nbdkit, qemu-utils; uses target/release/ferry
(FERRY_BIN to override; built if missing).
"""
import argparse, json, os, signal, socket, subprocess, sys, tempfile, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FERRY = os.environ.get("FERRY_BIN", os.path.join(ROOT, "target", "release", "ferry"))
SIZE = 256 << 20
TOKEN = "0123456789abcdef0123456789abcdef"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def wait_port(port, timeout=10):
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"nothing listens on {port}")


class Ferry:
    def __init__(self, work, backing_dir, capacity=0, extra=(), binary=None):
        self.dir = tempfile.mkdtemp(prefix="ferry-bench-", dir=backing_dir)
        self.nbd, self.api = free_port(), free_port()
        tok = os.path.join(work, "token")
        with open(tok, "w") as f:
            f.write(TOKEN)
        self.p = subprocess.Popen([binary or FERRY, "storage", "serve", "--dir", self.dir,
                                   "--nbd-listen", f"127.0.0.1:{self.nbd}", "--api-listen", f"127.0.0.1:{self.api}",
                                   "--token-file", tok, "--capacity-iops", str(capacity),
                                   "--insecure-http", *extra],
                                  stderr=subprocess.DEVNULL)
        wait_port(self.api)

    def call(self, method, path, body=None):
        req = urllib.request.Request(f"http://127.0.0.1:{self.api}/api/v1{path}", method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req) as r:
            return json.loads(r.read() or b"null")

    def disk(self, name, fill_from=None):
        self.call("POST", "/disks", {"name": name, "size": SIZE})
        path = os.path.join(self.dir, "disks", f"{name}.img")
        if fill_from:
            subprocess.run(["cp", "--sparse=never", fill_from, path], check=True)
        return path

    def uri(self, export):
        return f"nbd://127.0.0.1:{self.nbd}/{export}"

    def stop(self):
        self.p.send_signal(signal.SIGKILL)
        self.p.wait()
        subprocess.run(["rm", "-rf", self.dir])


def fio(uris, rw, runtime, bs="4k", depth=32):
    """One fio job per URI; returns per-job IOPS."""
    args = ["fio", "--ioengine=nbd", f"--rw={rw}", f"--bs={bs}", f"--iodepth={depth}", f"--size={SIZE}",
            "--time_based", f"--runtime={runtime}", "--ramp_time=2", "--output-format=json", "--norandommap"]
    for i, u in enumerate(uris):
        args += [f"--name=j{i}", f"--uri={u}"]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    v = json.loads(out[out.index("{"):])
    key = "read" if "read" in rw else "write"
    return [j[key]["iops"] for j in v["jobs"]]


def server_run(kind, backing, runtime, work):
    """Starts `kind` on a copy of `backing`; returns {rw: IOPS} over 2 connections."""
    res = {}
    if kind == "ferry":
        f = Ferry(work, os.path.dirname(backing))
        f.disk("d", fill_from=backing)
        uri = f.uri("d")
        stop = f.stop
    else:
        port = free_port()
        if kind == "qemu-nbd":
            cmd = ["qemu-nbd", "-f", "raw", "-x", "d", "-p", str(port), "-b", "127.0.0.1", "-t", "-e", "8", backing]
        else:
            cmd = ["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(port), "-e", "d", "file", backing]
        p = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
        wait_port(port)
        uri = f"nbd://127.0.0.1:{port}/d"
        stop = lambda: (p.kill(), p.wait())
    for rw in ("randread", "randwrite"):
        res[rw] = sum(fio([uri, uri], rw, runtime))
    stop()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if not os.path.exists(FERRY):
        subprocess.run(["cargo", "build", "--release", "-p", "ferry-cli"], cwd=ROOT, check=True)
    work = tempfile.mkdtemp(prefix="ferry-bench-")
    stores = {"tmpfs": "/dev/shm", "disk": "/var/tmp"}
    print(f"# {os.uname().nodename}: {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}, "
          f"fio 4K QD32 × 2 connections, {a.runtime} s per point, best of {a.rounds} rounds")
    print("\n| store | I/O | Ferry IOPS | qemu-nbd IOPS | nbdkit IOPS | Ferry ÷ qemu-nbd | Ferry ÷ nbdkit |")
    print("|---|---|---|---|---|---|---|")
    for store, d in stores.items():
        backing = os.path.join(d, f"ferry-bench-{os.getpid()}.img")
        subprocess.run(["dd", "if=/dev/urandom", f"of={backing}", "bs=1M", f"count={SIZE >> 20}", "status=none"],
                       check=True)
        best = {}
        for _ in range(a.rounds):
            for kind in ("ferry", "qemu-nbd", "nbdkit"):
                r = server_run(kind, backing, a.runtime, work)
                for rw, v in r.items():
                    best[(kind, rw)] = max(best.get((kind, rw), 0), v)
        for rw in ("randread", "randwrite"):
            f, q, n = best[("ferry", rw)], best[("qemu-nbd", rw)], best[("nbdkit", rw)]
            print(f"| {store} | 4K {rw} | {f:.0f} | {q:.0f} | {n:.0f} | {f / q:.2f} | {f / n:.2f} |")
        os.remove(backing)

    # QoS overhead and accuracy (tmpfs)
    f = Ferry(work, "/dev/shm")
    f.disk("plain")
    f.disk("limited")
    f.call("POST", "/qos/policies", {"name": "huge", "kind": "dedicated", "max_iops": 10_000_000})
    f.call("PUT", "/disks/limited/policy", {"policy": "huge"})
    plain = max(sum(fio([f.uri("plain/a"), f.uri("plain/b")], "randread", a.runtime)) for _ in range(a.rounds))
    limited = max(sum(fio([f.uri("limited/a"), f.uri("limited/b")], "randread", a.runtime))
                  for _ in range(a.rounds))
    f.call("POST", "/qos/policies", {"name": "cap", "kind": "dedicated", "max_iops": 500})
    f.call("PUT", "/disks/plain/policy", {"policy": "cap"})
    capped = fio([f.uri("plain/c")], "randread", a.runtime, depth=16)[0]
    f.stop()
    g = Ferry(work, "/dev/shm", capacity=4000)
    for d in ("r", "n1", "n2", "n3", "n4"):
        g.disk(d)
    g.call("POST", "/qos/policies", {"name": "gold", "kind": "dedicated", "min_iops": 1000})
    g.call("PUT", "/disks/r/policy", {"policy": "gold"})
    mixed = fio([g.uri(f"{d}/vm-{d}") for d in ("r", "n1", "n2", "n3", "n4")], "randread", a.runtime, depth=16)
    g.call("PUT", "/disks/r/policy", {"policy": None})
    fair = fio([g.uri(f"{d}/vm-{d}") for d in ("r", "n1", "n2", "n3", "n4")], "randread", a.runtime, depth=16)
    g.stop()
    print("\n| QoS measurement (tmpfs, 4K random reads) | result |")
    print("|---|---|")
    print(f"| no policy, 2 flows QD32 | {plain:.0f} IOPS |")
    print(f"| policy max 10,000,000 IOPS, 2 flows QD32 | {limited:.0f} IOPS |")
    print(f"| QoS overhead (1 − policy ÷ none) | {100 * (1 - limited / plain):.1f}% |")
    print(f"| max 500 IOPS, fio measured | {capped:.0f} IOPS ({100 * (capped / 500 - 1):+.1f}%) |")
    print(f"| min 1000 vs 4 unlimited neighbours, store sustains 4000 | reserved {mixed[0]:.0f}, "
          f"neighbours {', '.join(f'{x:.0f}' for x in mixed[1:])} |")
    print(f"| same five flows, no minimum | {', '.join(f'{x:.0f}' for x in fair)} |")
    subprocess.run(["rm", "-rf", work])


if __name__ == "__main__":
    main()
