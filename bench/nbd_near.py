#!/usr/bin/env python3
"""Ferry's NBD server against the device it serves: 8K random reads at queue
depth 16 over 2 connections (one per fio job), on one 256 MiB file on tmpfs.

Contenders, alternated in every round:
  local   fio's io_uring engine on the file itself (no server, no socket)
  ferry   Ferry's storage node over NBD (fio's nbd engine, libnbd), simple
          replies (its default)
  ferry-sr  the same with `structured_replies = true` in [nbd_limits]
  nbdkit  nbdkit's file plugin over NBD (the same fio engine), structured
          replies on (its default)
  nbdkit-no-sr  the same with --no-sr (simple replies, as Ferry by default)
  baseline  with --baseline OLD_BIN: another build's storage node, as `ferry`
          (a change measured against the build without it, in the same rounds)
--contenders picks some of them (default: all but baseline, which is added
when --baseline is given).
Reported: the median IOPS of each, Ferry ÷ local and Ferry ÷ nbdkit, the CPU
each server spent per million I/Os (its own utime + stime, from /proc) and
what fio itself spent (its children's rusage). fio's own CPU per I/O sets a
floor for any NBD server on these cores: with a server that cost nothing, fio
could at most do (CPUs ÷ fio's CPU per I/O).

    python3 bench/nbd_near.py [--runtime 10] [--rounds 3] [--bs 8k] [--depth 16]
        [--contenders local,ferry,...] [--baseline OLD_BIN]

Needs fio, libnbd-bin, nbdkit; uses target/release/ferry (FERRY_BIN to
override; built if missing).
"""
import argparse, json, os, resource, statistics, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from labqemu import cpu_seconds  # noqa: E402
from storage import FERRY, ROOT, SIZE, Ferry, free_port, wait_port  # noqa: E402


ALL = ("local", "ferry", "ferry-sr", "nbdkit", "nbdkit-no-sr", "baseline")


def fio(targets, engine, a):
    """One fio job per target; returns the jobs' summed read IOPS and fio's
    CPU-s (user + system) over the whole run."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    args = ["fio", f"--ioengine={engine}", "--rw=randread", f"--bs={a.bs}", f"--iodepth={a.depth}",
            f"--size={SIZE}", "--time_based", f"--runtime={a.runtime}", "--ramp_time=2",
            "--output-format=json", "--norandommap"]
    for i, t in enumerate(targets):
        args += [f"--name=j{i}"] + ([f"--uri={t}"] if engine == "nbd" else [f"--filename={t}"])
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    v = json.loads(out[out.index("{"):])
    return sum(j["read"]["iops"] for j in v["jobs"]), (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)


def run(kind, backing, work, a):
    """(IOPS, server CPU-s per million I/Os or None, fio's CPU-s per million
    I/Os) for one contender. CPU is counted over the whole fio run (ramp
    included) and scaled to the timed part's share of it."""
    if kind == "local":
        t0 = time.time()
        iops, fcpu = fio([backing, backing], "io_uring", a)
        return iops, None, fcpu * (a.runtime / (time.time() - t0)) / (iops * a.runtime) * 1e6
    if kind in ("ferry", "ferry-sr", "baseline"):
        extra = ()
        if kind == "ferry-sr":
            conf = os.path.join(work, "storage-sr.toml")
            with open(conf, "w") as c:
                c.write("[nbd_limits]\nstructured_replies = true\n")
            extra = ("--config", conf)
        f = Ferry(work, os.path.dirname(backing), extra=extra, binary=a.baseline if kind == "baseline" else FERRY)
        f.disk("d", fill_from=backing)
        uri, pid, stop = f.uri("d"), f.p.pid, f.stop
    else:
        port = free_port()
        sr = ["--no-sr"] if kind == "nbdkit-no-sr" else []
        p = subprocess.Popen(["nbdkit", "-f", *sr, "-i", "127.0.0.1", "-p", str(port), "-e", "d", "file", backing],
                             stderr=subprocess.DEVNULL)
        wait_port(port)
        uri, pid, stop = f"nbd://127.0.0.1:{port}/d", p.pid, lambda: (p.kill(), p.wait())
    c0, t0 = cpu_seconds(pid), time.time()
    iops, fcpu = fio([uri, uri], "nbd", a)
    cpu, wall = cpu_seconds(pid) - c0, time.time() - t0
    stop()
    share = a.runtime / wall
    return iops, cpu * share / (iops * a.runtime) * 1e6, fcpu * share / (iops * a.runtime) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bs", default="8k")
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--contenders", default="local,ferry,ferry-sr,nbdkit,nbdkit-no-sr")
    ap.add_argument("--baseline", help="another build of ferry, run as the contender `baseline`")
    a = ap.parse_args()
    kinds = tuple(a.contenders.split(",")) + (("baseline",) if a.baseline else ())
    bad = [k for k in kinds if k not in ALL]
    if bad or "ferry" not in kinds:
        sys.exit(f"--contenders: {','.join(bad) or 'ferry is missing'} (known: {','.join(ALL)}; ferry is needed)")
    if not os.path.exists(FERRY):
        subprocess.run(["cargo", "build", "--release", "-p", "ferry-cli"], cwd=ROOT, check=True)
    work = tempfile.mkdtemp(prefix="ferry-bench-")
    backing = os.path.join("/dev/shm", f"ferry-near-{os.getpid()}.img")
    subprocess.run(["dd", "if=/dev/urandom", f"of={backing}", "bs=1M", f"count={SIZE >> 20}", "status=none"],
                   check=True)
    got = {k: [] for k in kinds}
    cpu = {k: [] for k in kinds}
    fcpu = {k: [] for k in kinds}
    print(f"# {os.uname().nodename}: {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{a.bs} random reads, QD{a.depth} × 2 jobs, tmpfs, {a.runtime} s per point, {a.rounds} rounds")
    print("# command: python3 bench/nbd_near.py " + " ".join(sys.argv[1:]))
    for r in range(a.rounds):
        order = kinds if r % 2 == 0 else tuple(reversed(kinds))
        for k in order:
            iops, per_m, fio_m = run(k, backing, work, a)
            got[k].append(iops)
            fcpu[k].append(fio_m)
            if per_m is not None:
                cpu[k].append(per_m)
            print(f"round {r + 1} {k}: {iops:.0f} IOPS, fio {fio_m:.2f}"
                  + (f", server {per_m:.2f}" if per_m is not None else "") + " CPU-s per M I/Os", flush=True)
    os.remove(backing)
    subprocess.run(["rm", "-rf", work])
    med = {k: statistics.median(v) for k, v in got.items()}
    ncpu = os.cpu_count()
    print("\n| contender | IOPS (median) | every round | server CPU-s per M I/Os | fio CPU-s per M I/Os "
          "| fio's floor (CPUs ÷ fio per I/O) |")
    print("|---|---|---|---|---|---|")
    for k in kinds:
        c = f"{statistics.median(cpu[k]):.2f}" if cpu[k] else "–"
        fm = statistics.median(fcpu[k])
        print(f"| {k} | {med[k]:.0f} | {', '.join(f'{x:.0f}' for x in got[k])} | {c} | {fm:.2f} "
              f"| {ncpu / fm * 1e6:.0f} |")
    names = {"local": "local io_uring", "nbdkit": "nbdkit", "nbdkit-no-sr": "nbdkit --no-sr",
             "ferry-sr": "Ferry with structured replies", "baseline": f"the baseline ({a.baseline})"}
    print("\n" + "; ".join(f"Ferry ÷ {names[k]}: {med['ferry'] / med[k]:.2f}" for k in kinds if k != "ferry")
          + f"; Ferry ÷ its fio floor: {med['ferry'] / (ncpu / statistics.median(fcpu['ferry']) * 1e6):.2f}")


if __name__ == "__main__":
    main()
