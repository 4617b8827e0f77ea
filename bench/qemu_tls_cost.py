#!/usr/bin/env python3
"""What QEMU's own TLS costs a migration, by how it is set up: DH parameters and cipher order.

No lab: two QEMUs on loopback, the source pinned to CPU 0 and the target to CPU 1, migrating
--memory of random bytes (a private mapping of a file of random data, so every page is sent and
nothing compresses) over one TLS stream (`tls-creds-psk`). Contenders, alternating round by
round, the order reversed every other round:

- `default`: the credentials QEMU is given with nothing but the key (no `dh-params.pem`, GnuTLS's
  default cipher order);
- `dh`: the server's directory also holds RFC 7919 `ffdhe2048` (`dh-params.pem`), as Ferry's
  agents give their target QEMU;
- `dh+aes`: and `priority=NORMAL:-CHACHA20-POLY1305:+CHACHA20-POLY1305` (AES-GCM first), as the
  agents set where the CPU has AES and carry-less multiply.

Reported per contender (medians, and every round): the target's `object-add` of its credentials
(its wall time), the migration's time (`migrate` to `completed`), and the CPU seconds of the
target and the source QEMU over the migration.

    python3 bench/qemu_tls_cost.py [--rounds 5] [--memory 256M]
"""
import argparse, os, statistics, subprocess, time

from compression import AES_FIRST, cpu_has_aes, psk_creds, write_dh_params
from labqemu import Qmp, cpu_seconds, size

WORK = "/run/ferry/bench/qemu-tls-cost"
PORT = 5599


def start(name, mem, cpu, incoming):
    sock = f"{WORK}/{name}.sock"
    if os.path.exists(sock):
        os.unlink(sock)
    args = ["taskset", "-c", cpu, "qemu-system-x86_64", "-machine", "pc,memory-backend=m", "-m", str(mem >> 20),
            "-object", f"memory-backend-file,id=m,size={mem},mem-path={WORK}/random,share=off",
            "-nodefaults", "-display", "none", "-S", "-qmp", f"unix:{sock},server=on,wait=off"]
    if incoming:
        args += ["-incoming", "defer"]
    p = subprocess.Popen(args, stderr=open(f"{WORK}/{name}.log", "w"))
    return p, Qmp(sock)


def one(contender, mem):
    dirs = {"server": f"{WORK}/server", "client": f"{WORK}/client"}
    key = "ferry:" + os.urandom(32).hex() + "\n"
    for end, d in dirs.items():
        subprocess.run(["rm", "-rf", d])
        os.makedirs(d, mode=0o700)
        with open(f"{d}/keys.psk", "w") as f:
            f.write(key)
    if contender != "default":
        write_dh_params(dirs["server"])
    tp, tq = start("target", mem, "1", True)
    sp, sq = start("source", mem, "0", False)
    try:
        took = {}
        for q, end in ((tq, "server"), (sq, "client")):
            creds = psk_creds(end, dirs[end], AES_FIRST if contender == "dh+aes" else None)
            t0 = time.time()
            q.cmd("object-add", **creds)
            took[end] = time.time() - t0
            q.cmd("migrate-set-parameters", **{"tls-creds": "tls0", "max-bandwidth": 100 << 30})
        tq.cmd("migrate-incoming", uri=f"tcp:127.0.0.1:{PORT}")
        c0 = (cpu_seconds(tp.pid), cpu_seconds(sp.pid))
        t0 = time.time()
        sq.cmd("migrate", uri=f"tcp:127.0.0.1:{PORT}")
        while (st := sq.cmd("query-migrate"))["status"] not in ("completed", "failed", "cancelled"):
            time.sleep(0.01)
        secs = time.time() - t0
        while tq.cmd("query-migrate").get("status") != "completed":
            time.sleep(0.01)
        if st["status"] != "completed":
            raise SystemExit(f"{contender}: migration {st['status']}: {st.get('error-desc')}")
        return {"object_add": took["server"], "secs": secs,
                "target_cpu": cpu_seconds(tp.pid) - c0[0], "source_cpu": cpu_seconds(sp.pid) - c0[1]}
    finally:
        for p in (tp, sp):
            p.kill()
            p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--memory", default="256M")
    a = ap.parse_args()
    mem = size(a.memory)
    os.makedirs(WORK, exist_ok=True)
    with open(f"{WORK}/random", "wb") as f:
        for _ in range(mem >> 20):
            f.write(os.urandom(1 << 20))
    names = ["default", "dh"] + (["dh+aes"] if cpu_has_aes() else [])
    got = {n: [] for n in names}
    for r in range(a.rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            x = one(n, mem)
            got[n].append(x)
            print(f"  round {r + 1} {n}: object-add {x['object_add'] * 1e3:.0f} ms, migration {x['secs']:.2f} s, "
                  f"target {x['target_cpu']:.2f} CPU-s, source {x['source_cpu']:.2f} CPU-s", flush=True)
    print(f"\n{a.rounds} rounds, {a.memory} of random memory over one TLS stream on loopback, "
          f"source on CPU 0, target on CPU 1; the CPU has AES: {cpu_has_aes()}\n")
    print("| contender | target's object-add ms (median; every round) | migration s | target CPU-s | source CPU-s |")
    print("|---|---|---|---|---|")
    med = lambda n, k: statistics.median(x[k] for x in got[n])
    for n in names:
        every = ", ".join(f"{x['object_add'] * 1e3:.0f}" for x in got[n])
        print(f"| {n} | {med(n, 'object_add') * 1e3:.0f} ({every}) | {med(n, 'secs'):.2f} | "
              f"{med(n, 'target_cpu'):.2f} | {med(n, 'source_cpu'):.2f} |")
    subprocess.run(["rm", "-rf", WORK])


if __name__ == "__main__":
    main()
