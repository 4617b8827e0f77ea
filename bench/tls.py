#!/usr/bin/env python3
"""The cost of TLS: Ferry's NBD and control API with TLS vs without, and
Ferry's NBD with TLS vs nbdkit with TLS. Everything on loopback.

NBD: one 256 MiB file on tmpfs served in turn by Ferry with TLS (the lab's
default: STARTTLS required, a client certificate), Ferry in clear, and
nbdkit with TLS (--tls=require --tls-verify-peer, the same certificates);
fio's nbd engine (libnbd; `nbds://…?tls-certificates=`) runs 4K (--bs) random
reads at queue depth 32 over 2 connections. --baseline BIN adds another build's
storage node with TLS as a contender (a change measured against the build
without it). Reported per round: IOPS, and the
server's CPU seconds per million I/Os (/proc/PID/stat); then medians and the
ratios Ferry TLS ÷ Ferry clear and Ferry TLS ÷ nbdkit TLS. The contenders
alternate within each round.

Control API: a control service with TLS and one with --insecure-http (no
hosts), `GET /api/v1/events?limit=1` with an admin token: the median latency
of 300 requests on one kept-alive connection, and of 100 requests each on a
new connection (a CLI invocation's case: TCP + TLS handshake each time).

    python3 bench/tls.py [--runtime 8] [--rounds 3] [--bs 4k] [--baseline OLD_BIN]

Needs fio, libnbd-bin, nbdkit; uses target/release/ferry (FERRY_BIN to
override).
"""
import argparse, http.client, json, os, signal, ssl, statistics, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from storage import FERRY, SIZE, TOKEN, free_port, wait_port  # noqa: E402


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# fio's nbd engine may not name a certificate directory in its URI (libnbd
# refuses local files there), so it runs as `nobody` with the administrator's
# certificate where libnbd looks by default, $HOME/.pki/libnbd
NBD_HOME = None


def nbd_home(work, etc):
    import pwd, shutil
    global NBD_HOME
    NBD_HOME = os.path.join(work, "nbdhome")
    d = os.path.join(NBD_HOME, ".pki", "libnbd")
    os.makedirs(d)
    for f in ("ca-cert.pem", "client-cert.pem", "client-key.pem"):
        shutil.copy(os.path.join(etc, "pki", "admin", f), os.path.join(d, f))
    nobody = pwd.getpwnam("nobody")
    for root, dirs, files in os.walk(NBD_HOME):
        for x in dirs + files + [""]:
            os.chown(os.path.join(root, x), nobody.pw_uid, nobody.pw_gid)
    os.chmod(work, 0o755)


def fio(uri, runtime, bs="4k"):
    """Random reads of `bs`, depth 32, 2 connections: total IOPS and I/Os."""
    args = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "env", f"HOME={NBD_HOME}",
            "fio", "--ioengine=nbd", "--rw=randread", f"--bs={bs}", "--iodepth=32", f"--size={SIZE}",
            "--time_based", f"--runtime={runtime}", "--output-format=json", "--norandommap",
            "--name=j0", f"--uri={uri}", "--name=j1", f"--uri={uri}"]
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"fio {uri}: {out.stderr.strip()[-500:]}")
    v = json.loads(out.stdout[out.stdout.index("{"):])
    return sum(j["read"]["iops"] for j in v["jobs"]), sum(j["read"]["total_ios"] for j in v["jobs"])


def certs(work):
    """A cluster made by `ferry cluster init`, plus a storage node's certificate."""
    d = os.path.join(work, "etc")
    subprocess.run([FERRY, "cluster", "init", "--host", "h1=127.0.0.1", "--dir", d], check=True,
                   capture_output=True)
    subprocess.run([FERRY, "cluster", "issue-cert", "--role", "storage", "--name", "storage1",
                    "--san", "127.0.0.1", "--ca", os.path.join(d, "ca"), "--out",
                    os.path.join(d, "pki", "storage")], check=True, capture_output=True)
    return d


class Node:
    """A Ferry storage node with (`tls`) or without TLS, one disk `d`."""

    def __init__(self, work, etc, tls, backing, binary=None):
        self.dir = tempfile.mkdtemp(prefix="ferry-tls-", dir="/dev/shm")
        self.nbd, self.api = free_port(), free_port()
        tok = os.path.join(work, "token")
        with open(tok, "w") as f:
            f.write(TOKEN)
        cmd = [binary or FERRY, "storage", "serve", "--dir", self.dir, "--nbd-listen", f"127.0.0.1:{self.nbd}",
               "--api-listen", f"127.0.0.1:{self.api}", "--token-file", tok]
        cmd += ["--tls-dir", os.path.join(etc, "pki", "storage")] if tls else ["--insecure-http"]
        self.p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.api)
        # the disk, made through the REST API as the control service would
        body = json.dumps({"name": "d", "size": SIZE}).encode()
        if tls:
            ctx = ssl.create_default_context(cafile=os.path.join(etc, "pki", "ca-cert.pem"))
            ctx.load_cert_chain(os.path.join(etc, "pki", "control", "cert.pem"),
                                os.path.join(etc, "pki", "control", "key.pem"))
            c = http.client.HTTPSConnection("127.0.0.1", self.api, context=ctx)
            headers = {}
        else:
            c = http.client.HTTPConnection("127.0.0.1", self.api)
            headers = {"Authorization": f"Bearer {TOKEN}"}
        c.request("POST", "/api/v1/disks", body, {"Content-Type": "application/json", **headers})
        r = c.getresponse()
        if r.status != 200:
            sys.exit(f"creating the disk: {r.status} {r.read()[:300]}")
        subprocess.run(["cp", "--sparse=never", backing, os.path.join(self.dir, "disks", "d.img")], check=True)
        self.uri = f"nbds://127.0.0.1:{self.nbd}/d" if tls else f"nbd://127.0.0.1:{self.nbd}/d"

    def stop(self):
        self.p.send_signal(signal.SIGKILL)
        self.p.wait()
        subprocess.run(["rm", "-rf", self.dir])


class Nbdkit:
    def __init__(self, etc, backing):
        self.port = free_port()
        self.p = subprocess.Popen(["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(self.port), "-e", "d",
                                   "--tls=require", "--tls-verify-peer",
                                   f"--tls-certificates={os.path.join(etc, 'pki', 'storage')}",
                                   "file", backing], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)
        self.uri = f"nbds://127.0.0.1:{self.port}/d"

    def stop(self):
        self.p.kill()
        self.p.wait()


def nbd_round(kind, work, etc, backing, runtime, bs="4k", baseline=None):
    if kind == "nbdkit-tls":
        s = Nbdkit(etc, backing)
    else:
        s = Node(work, etc, kind != "ferry-clear", backing, baseline if kind == "baseline-tls" else None)
    try:
        c0 = cpu_seconds(s.p.pid)
        iops, ios = fio(s.uri, runtime, bs)
        cpu = cpu_seconds(s.p.pid) - c0
    finally:
        s.stop()
    return iops, cpu / max(ios, 1) * 1e6


def control_latency(work, etc, tls):
    port = free_port()
    tok = os.path.join(etc, "admin.token")
    cmd = [FERRY, "control", "--listen", f"127.0.0.1:{port}", "--token-file", os.path.join(etc, "cluster.token"),
           "--admin-token", tok, "--state", os.path.join(work, f"state-{tls}.db")]
    cmd += ["--tls-dir", os.path.join(etc, "pki", "control")] if tls else ["--insecure-http"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    time.sleep(0.5)
    token = open(tok).read().strip()
    ctx = ssl.create_default_context(cafile=os.path.join(etc, "pki", "ca-cert.pem"))
    conn = lambda: (http.client.HTTPSConnection("127.0.0.1", port, context=ctx) if tls
                    else http.client.HTTPConnection("127.0.0.1", port))

    def get(c):
        t = time.perf_counter()
        c.request("GET", "/api/v1/events?limit=1", headers={"Authorization": f"Bearer {token}"})
        r = c.getresponse()
        r.read()
        if r.status != 200:
            sys.exit(f"control: {r.status}")
        return (time.perf_counter() - t) * 1e3

    c = conn()
    get(c)
    kept = statistics.median(get(c) for _ in range(300))
    fresh = []
    for _ in range(100):
        t = time.perf_counter()
        c = conn()
        get(c)
        c.close()
        fresh.append((time.perf_counter() - t) * 1e3)
    p.kill()
    p.wait()
    return kept, statistics.median(fresh)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bs", default="4k", help="fio's block size for the NBD reads")
    ap.add_argument("--baseline", help="another build's ferry binary: its storage node with TLS as a contender")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="ferry-bench-tls-")
    etc = certs(work)
    nbd_home(work, etc)
    backing = os.path.join("/dev/shm", f"ferry-tls-backing-{os.getpid()}.img")
    subprocess.run(["dd", "if=/dev/urandom", f"of={backing}", "bs=1M", f"count={SIZE >> 20}"],
                   check=True, capture_output=True)
    os.chmod(backing, 0o644)
    kinds = ["ferry-tls", "ferry-clear", "nbdkit-tls"] + (["baseline-tls"] if a.baseline else [])
    res = {k: [] for k in kinds}
    try:
        for r in range(a.rounds):
            order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
            for k in order:
                iops, cpu = nbd_round(k, work, etc, backing, a.runtime, a.bs, a.baseline)
                res[k].append((iops, cpu))
                print(f"round {r + 1} {k:12} {iops:9.0f} IOPS  {cpu:6.1f} CPU-s per million I/Os", flush=True)
        med = {k: (statistics.median(i for i, _ in v), statistics.median(c for _, c in v)) for k, v in res.items()}
        print(f"\nNBD {a.bs} random read, depth 32 x 2 connections, medians:")
        for k in kinds:
            print(f"  {k:12} {med[k][0]:9.0f} IOPS  {med[k][1]:6.1f} CPU-s per million I/Os")
        print(f"  Ferry TLS / Ferry clear: {med['ferry-tls'][0] / med['ferry-clear'][0]:.2f} (IOPS)")
        print(f"  Ferry TLS / nbdkit TLS:  {med['ferry-tls'][0] / med['nbdkit-tls'][0]:.2f} (IOPS)")
        if a.baseline:
            print(f"  Ferry TLS / baseline TLS ({a.baseline}): {med['ferry-tls'][0] / med['baseline-tls'][0]:.2f} (IOPS)")
        lat = {}
        for r in range(a.rounds):
            for tls in ((True, False) if r % 2 == 0 else (False, True)):
                lat.setdefault(tls, []).append(control_latency(work, etc, tls))
        print("\ncontrol API, GET /api/v1/events?limit=1, medians of rounds (ms):")
        for tls in (True, False):
            kept = statistics.median(k for k, _ in lat[tls])
            fresh = statistics.median(f for _, f in lat[tls])
            print(f"  {'TLS  ' if tls else 'clear'}  kept-alive {kept:6.2f}   new connection {fresh:6.2f}")
    finally:
        os.unlink(backing)
        subprocess.run(["rm", "-rf", work])


if __name__ == "__main__":
    main()
