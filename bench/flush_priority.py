#!/usr/bin/env python3
"""A journal record's flush on a busy disk, at the best-effort and the real-time I/O class.

What the agent's switch-over records do (crates/agent/src/commit.rs, `Journal::write`): one
512-byte sector overwritten in place and `fdatasync`ed. Here the same write is timed --samples
times while another process writes --writer-mib MiB and fsyncs them, in a loop, to the same
file system; each sample's class (`ioprio_set(2)`: best effort level 4, the default, or real
time level 0, what the agent asks for) is drawn at random, so both see the same writeback.
Prints p50 / p90 / p99 / max per class, quiet (no writer) first.

    sudo python3 bench/flush_priority.py [--samples 600] [--writer-mib 300] [--dir /var/tmp]

Needs root (the real-time class takes CAP_SYS_ADMIN or CAP_SYS_NICE). The scheduler of the
disk decides what a class changes (`cat /sys/block/DEV/queue/scheduler`: mq-deadline and BFQ
honour it, none does not).
"""
import argparse, ctypes, os, random, subprocess, sys, time

from downtime import pct

SYS_IOPRIO_SET = 251  # x86_64
WHO_THREAD = 1
CLASS = {"best-effort": (2, 4), "real-time": (1, 0)}
libc = ctypes.CDLL(None, use_errno=True)


def ioprio(cls, level):
    if libc.syscall(SYS_IOPRIO_SET, WHO_THREAD, 0, (cls << 13) | level) != 0:
        sys.exit(f"ioprio_set: {os.strerror(ctypes.get_errno())} (root needed for the real-time class)")


def start_disk_writer(path, mib):
    """Another process writing `mib` MiB to `path` and fsyncing them, in a loop; returns the
    function that stops it and removes the file."""
    writer = subprocess.Popen(
        ["bash", "-c", f"while :; do dd if=/dev/zero of={path} bs=1M count={mib} conv=fsync status=none; done"],
        start_new_session=True)

    def stop():
        if writer.poll() is None:
            os.killpg(writer.pid, 9)
            writer.wait()
        if os.path.exists(path):
            os.remove(path)
    return stop


def run(label, samples, fd, writer=None):
    stop = start_disk_writer(*writer) if writer else None
    try:
        if stop:
            time.sleep(1)
        order = list(CLASS) * (samples // 2)
        random.shuffle(order)
        got = {c: [] for c in CLASS}
        for c in order:
            ioprio(*CLASS[c])
            t = time.monotonic()
            os.pwrite(fd, c[:1].encode() * 512, 0)
            os.fdatasync(fd)
            got[c].append((time.monotonic() - t) * 1000)
            time.sleep(0.02)
    finally:
        if stop:
            stop()
    for c, v in got.items():
        print(f"| {label} | {c} | {len(v)} | {pct(v, 50):.1f} / {pct(v, 90):.1f} / {pct(v, 99):.1f} / {max(v):.1f} |",
              flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--writer-mib", type=int, default=300)
    ap.add_argument("--dir", default="/var/tmp")
    a = ap.parse_args()
    rec, big = os.path.join(a.dir, "flush-priority.rec"), os.path.join(a.dir, "flush-priority.writer")
    fd = os.open(rec, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, b" " * 512, 0)
        os.fsync(fd)
        print("| disk | class | samples | flush ms p50 / p90 / p99 / max |")
        print("|---|---|---|---|")
        run("quiet", 40, fd)
        run(f"a writer of {a.writer_mib} MiB per fsync", a.samples, fd, (big, a.writer_mib))
    finally:
        os.close(fd)
        os.remove(rec)


if __name__ == "__main__":
    main()
