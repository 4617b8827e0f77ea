#!/usr/bin/env python3
"""What a first touch of fresh memory costs on this machine, by how long it lay free before.

A migration's target QEMU writes its guest's memory for the first time as the pages arrive, so
the kernel hands it free pages and clears them. On a bare-metal host that costs ~25 ms per
512 MiB. A machine that is itself a virtual machine may hand free memory back to its
hypervisor (virtio-balloon free page reporting, `/sys/module/page_reporting`); the next first
touch of such memory then waits for the hypervisor to back it again, tens of times slower.
Which contender of a bench gets memory freed a moment ago and which gets memory freed seconds
ago then decides a row (bench/compression.py's `--settle`).

Per gap: maps SIZE of anonymous memory (transparent huge pages asked for, as QEMU asks for
its guest's RAM), writes one byte per 4 KiB page, unmaps it, and waits GAP seconds before the
next; --rounds times over the gaps, every time printed, then the median per gap.

    python3 bench/first_touch.py [--size 512M] [--gaps 0,0.5,1,2,4,8] [--rounds 3]
    python3 bench/first_touch.py --watch [--size 1536M] [--seconds 12]

--watch instead frees SIZE at once and prints, every half second, how much of it the kernel has
handed back so far (the reporting's own `reported_kib` and `passes`).

Needs no root; touches at most SIZE at a time.
"""
import argparse, mmap, os, statistics, time


def size(s):
    """'512M' → bytes (K, M, G suffixes)."""
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1].upper()]) if s[-1].upper() in mult else int(s)


def touch(n):
    """Seconds to write the first byte of every 4 KiB page of n fresh bytes."""
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    t = time.perf_counter()
    for off in range(0, n, 4096):
        m[off] = 1
    dt = time.perf_counter() - t
    m.close()
    return dt


REPORTING = "/sys/module/page_reporting/parameters"


def reported():
    """(MiB handed back since boot, passes), or None where the kernel does not count them."""
    try:
        return (int(open(f"{REPORTING}/reported_kib").read()) // 1024,
                int(open(f"{REPORTING}/passes").read()))
    except (OSError, ValueError):
        return None


def watch(n, seconds):
    """Frees n bytes at once and prints how much the kernel has handed back since, every 0.5 s."""
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for off in range(0, n, 4096):
        m[off] = 1
    time.sleep(3)
    base = reported()
    if base is None:
        print("this kernel does not count reported memory")
        return
    t0 = time.time()
    m.close()
    while time.time() - t0 < seconds:
        time.sleep(0.5)
        now = reported()
        print(f"{time.time() - t0:5.1f} s after the free: {now[0] - base[0]} MiB handed back in "
              f"{now[1] - base[1]} passes", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default=None)
    ap.add_argument("--gaps", default="0,0.5,1,2,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--watch", action="store_true")
    ap.add_argument("--seconds", type=float, default=12)
    a = ap.parse_args()
    order = f"{REPORTING}/page_reporting_order"
    if os.path.exists(order):
        print(f"free page reporting: on, order {open(order).read().strip()}")
    else:
        print("free page reporting: not in this kernel")
    if a.watch:
        watch(size(a.size or "1536M"), a.seconds)
        return
    n, gaps = size(a.size or "512M"), [float(g) for g in a.gaps.split(",")]
    touch(n)  # the first touch of the run: memory of unknown age
    seen = {g: [] for g in gaps}
    for r in range(a.rounds):
        for g in gaps:
            time.sleep(g)
            ms = touch(n) * 1000
            seen[g].append(ms)
            print(f"round {r + 1}: {a.size} freed {g} s before: {ms:.0f} ms", flush=True)
    for g in gaps:
        print(f"freed {g} s before: median {statistics.median(seen[g]):.0f} ms; every run "
              + ", ".join(f"{x:.0f}" for x in seen[g]))


if __name__ == "__main__":
    main()
