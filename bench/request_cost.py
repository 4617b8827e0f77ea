#!/usr/bin/env python3
"""What the control service's limits cost a request: the same requests served by two builds' control
services, alternating round by round, on one lab.

Each round restarts the lab's control service from one build (`BIN lab restart control`, on the
same configuration and state), waits until it answers, then times
- `keep-alive`: --requests sequential `GET /api/v1/cluster` (an authenticated read that asks no
  agent) over one TLS connection;
- `new-conn`: --connections times a new TLS connection and one such request.
Prints every run and, per build, the median per-request time of each, and the ratio of the second
build to the first.

    sudo python3 bench/request_cost.py --bins OLD,NEW [--rounds 5] [--requests 400] [--connections 100]

--bins: Ferry builds (copies outside target/, as for bench/compression_ab.py); the first also brings
the lab up (2 hosts × 1 NIC).
"""
import argparse, http.client, ssl, statistics, subprocess, sys, time
import labqemu  # noqa: E402

LAB = "/run/ferry/lab"


def run(binary, *args):
    out = subprocess.run([binary, *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{binary} {' '.join(args)} failed: {out.stderr}")
    return out.stdout


def context():
    ctx = ssl.create_default_context(cafile=f"{LAB}/pki/ca/ca-cert.pem")
    ctx.check_hostname = False
    return ctx


def ask(conn, token):
    conn.request("GET", "/api/v1/cluster", headers={"Authorization": f"Bearer {token}"})
    r = conn.getresponse()
    body = r.read()
    if r.status != 200:
        sys.exit(f"GET /api/v1/cluster: {r.status} {body[:200]!r}")


def ready(token, ctx, within=20):
    t0 = time.time()
    while time.time() - t0 < within:
        try:
            c = http.client.HTTPSConnection("127.0.0.1", 7700, context=ctx, timeout=5)
            ask(c, token)
            c.close()
            return
        except (OSError, http.client.HTTPException):
            time.sleep(0.2)
    sys.exit("the control service did not answer")


def keep_alive(token, ctx, n):
    c = http.client.HTTPSConnection("127.0.0.1", 7700, context=ctx, timeout=5)
    ask(c, token)  # the handshake, not timed
    t0 = time.perf_counter()
    for _ in range(n):
        ask(c, token)
    dt = time.perf_counter() - t0
    c.close()
    return dt / n


def new_connections(token, ctx, n):
    t0 = time.perf_counter()
    for _ in range(n):
        c = http.client.HTTPSConnection("127.0.0.1", 7700, context=ctx, timeout=5)
        ask(c, token)
        c.close()
    return (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bins", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--connections", type=int, default=100)
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    bins = a.bins.split(",")
    run(bins[0], "lab", "up", "--replace", "--hosts", "2", "--nics", "1", *labqemu.cpus_flag(a))
    token = open(f"{LAB}/admin.token").read().strip()
    ctx = context()
    got = {b: {"keep-alive": [], "new-conn": []} for b in bins}
    for r in range(a.rounds):
        order = bins if r % 2 == 0 else list(reversed(bins))
        for b in order:
            run(b, "lab", "restart", "control")
            ready(token, ctx)
            ka = keep_alive(token, ctx, a.requests)
            nc = new_connections(token, ctx, a.connections)
            got[b]["keep-alive"].append(ka)
            got[b]["new-conn"].append(nc)
            print(f"round {r + 1} {b}: keep-alive {ka * 1e6:.0f} µs/request, "
                  f"new connection {nc * 1e6:.0f} µs/request", flush=True)
    med = {b: {k: statistics.median(v) for k, v in got[b].items()} for b in bins}
    for b in bins:
        print(f"median {b}: keep-alive {med[b]['keep-alive'] * 1e6:.0f} µs, "
              f"new connection {med[b]['new-conn'] * 1e6:.0f} µs")
    first = bins[0]
    for b in bins[1:]:
        print(f"ratio {b} / {first}: keep-alive "
              f"{med[b]['keep-alive'] / med[first]['keep-alive']:.3f}, new connection "
              f"{med[b]['new-conn'] / med[first]['new-conn']:.3f}")
    run(bins[-1], "lab", "restart", "control")


if __name__ == "__main__":
    main()
