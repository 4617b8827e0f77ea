#!/usr/bin/env python3
"""What this host's kernel charges to give a process fresh memory: the CPU seconds to touch every
4 KiB of a new anonymous mapping, with 4 KiB pages and with transparent huge pages asked for
(`madvise(MADV_HUGEPAGE)`, as QEMU does for guest RAM). A target QEMU loading a migration pays
this for every page it writes, so it bounds how fast any contender's target loads.

Rounds alternate the two kinds; before each, --rest seconds idle (a host that just freed memory
hands it back warm; one that has been idle a while may not, e.g. a virtual machine whose
hypervisor took freed pages back).

    python3 bench/fault_cost.py [--mib 600] [--rounds 3] [--rest 3]
"""
import argparse, ctypes, mmap, resource, statistics, time

MADV_HUGEPAGE = 14


def private(size):
    """A new anonymous mapping, private as guest RAM is (a shared anonymous
    mapping is shmem, which THP leaves alone)."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def touch_cpu(m, size, value):
    """CPU seconds to write `value` into every 4 KiB of `m`."""
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for off in range(0, size, 4096):
        m[off] = value
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def touch(mib, huge):
    size = mib << 20
    m = private(size)
    if huge:
        buf = (ctypes.c_char * size).from_buffer(m)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.madvise(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), MADV_HUGEPAGE):
            raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE)")
        del buf
    cpu = touch_cpu(m, size, 1)
    m.close()
    return cpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rest", type=float, default=3.0)
    a = ap.parse_args()
    # the Python loop alone, on memory already faulted in: subtracted from each run
    warm = private(a.mib << 20)
    touch_cpu(warm, a.mib << 20, 1)
    loop = touch_cpu(warm, a.mib << 20, 2)
    warm.close()
    runs = {"4 KiB pages": [], "huge pages asked": []}
    for rnd in range(a.rounds):
        kinds = list(runs) if rnd % 2 == 0 else list(reversed(runs))
        for k in kinds:
            time.sleep(a.rest)
            cpu = max(touch(a.mib, k != "4 KiB pages") - loop, 0.0)
            runs[k].append(cpu)
            print(f"round {rnd + 1} {k}: {cpu:.3f} CPU-s for {a.mib} MiB", flush=True)
    print(f"the touching loop alone: {loop:.3f} CPU-s (subtracted)")
    for k, v in runs.items():
        med = statistics.median(v)
        print(f"{k}: median {med:.3f} CPU-s for {a.mib} MiB, {med / a.mib * 1024:.2f} CPU-s per GiB; "
              f"every run {', '.join(f'{x:.3f}' for x in v)}")


if __name__ == "__main__":
    main()
