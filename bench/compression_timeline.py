#!/usr/bin/env python3
"""Where a move's time goes on the wire: Ferry's `--option compression` and QEMU's own
multifd + zstd (by hand over QMP, as in bench/compression.py), one lab, alternating.

host1's migration NIC (the lab's nic1) is read every 2 ms from /proc/PID/net/dev of a
process in host1's namespace (its agent) while each contender moves a fresh guest host1 →
host2. Printed per move: its transfer time (as bench/compression.py counts it), the wire's
first to last byte, and that span cut in four — the first 20 MiB, the next 20, the bulk and
the last 55 MiB (a sixth, a sixth and a quarter of the wire when that is smaller, as for
compressible memory) — then the MiB on the wire every ~20 ms over the first 400 ms (or
every --curve-ms ÷ 20 over the first --curve-ms).

    sudo python3 bench/compression_timeline.py [--rounds 3] [--rate 1gbit]
        [--kind random] [--curve-ms 400] [the guest options of bench/compression.py]

Uses $FERRY_BIN (as bench/compression.py: labqemu.default_ferry unless set); brings the lab up
and down.
"""
import argparse, subprocess, threading, time

import compression
from labqemu import FERRY, agent_pids, lab_nic
import labqemu  # noqa: E402


class Wire:
    """Bytes a namespace's NIC has sent, sampled every 2 ms in a thread."""

    def __init__(self, pid, nic):
        self.pid, self.nic, self.s, self.stop = pid, nic, [], False
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def tx(self):
        for line in open(f"/proc/{self.pid}/net/dev"):
            name, _, rest = line.partition(":")
            if name.strip() == self.nic:
                return int(rest.split()[8])
        raise SystemExit(f"no NIC {self.nic} in /proc/{self.pid}/net/dev")

    def run(self):
        while not self.stop:
            self.s.append((time.time(), self.tx()))
            time.sleep(0.002)

    def done(self, curve_ms=400):
        self.stop = True
        self.t.join()
        b0, b1 = self.s[0][1], self.s[-1][1]
        mib = (b1 - b0) / 2**20

        def at(m):
            return next(t for t, b in self.s if b - b0 >= m * 2**20)
        first = next(t for t, b in self.s if b - b0 > 256 << 10)
        last = [t for t, b in self.s if b1 - b > 64 << 10][-1]
        # one point per ~1/20 of the span (samples are ~2 ms apart)
        curve = [(round((t - first) * 1000), (b - b0) / 2**20)
                 for t, b in self.s if first - 0.01 <= t <= first + curve_ms / 1000][::max(curve_ms // 40, 1)]
        head, tail = min(20, mib / 6), min(55, mib / 4)
        return {"wire_s": last - first, "mib": mib, "head": head, "tail": tail, "first": at(head) - first,
                "next": at(2 * head) - at(head), "bulk": at(mib - tail) - at(2 * head),
                "last": last - at(mib - tail), "curve": curve}


def main():
    ap = argparse.ArgumentParser()
    compression.guest_options(ap)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--kind", default="random", choices=["random", "compressible"])
    ap.add_argument("--curve-ms", type=int, default=400)
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    subprocess.run([FERRY, "lab", "up", "--replace", "--hosts", "2", "--nics", "2", "--rate", a.rate, *labqemu.cpus_flag(a)],
                   check=True, capture_output=True)
    agent = agent_pids(["host1"])[0]
    nic = lab_nic("host1", "nic1")
    names = ["ferry compression", "qemu zstd"]
    for rnd in range(a.rounds):
        for c in names[rnd % 2:] + names[:rnd % 2]:
            w = Wire(agent, nic)
            time.sleep(0.05)
            r = compression.ferry_move(a.kind, a) if c.startswith("ferry") else compression.qemu_move(a.kind, c, a)
            t = w.done(a.curve_ms)
            print(f"round {rnd + 1} {c}: {r['secs']:.3f} s, guest downtime {r['downtime']} ms; wire first→last "
                  f"byte {t['wire_s']:.3f} s ({t['mib']:.1f} MiB): first {t['head']:.0f} MiB {t['first']:.3f}, "
                  f"next {t['head']:.0f} {t['next']:.3f}, bulk {t['bulk']:.3f}, last {t['tail']:.0f} MiB "
                  f"{t['last']:.3f}", flush=True)
            print("    ms:MiB " + " ".join(f"{ms}:{m:.1f}" for ms, m in t["curve"]), flush=True)
    subprocess.run([FERRY, "lab", "down"], capture_output=True)


if __name__ == "__main__":
    main()
