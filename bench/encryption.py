#!/usr/bin/env python3
"""What encryption costs a move: encrypted ÷ clear, and Ferry encrypted ÷ QEMU's own TLS.

Per link rate (a lab of 2 hosts × 2 NICs shaped to it) and guest kind (memory that compresses
or not), each round moves a fresh guest host1 → host2 with every contender, the order rotating
round by round:
- `tcp` (QEMU's one stream; encrypted: QEMU's TLS 1.3 keyed by the move), `multichannel` (2 NICs,
  Ferry's carriers; encrypted: every frame sealed) and `mptcp` (the socket handed to QEMU;
  encrypted: QEMU's TLS over it), each with the cluster's `encryption` on and off;
- QEMU by hand, one stream with its own TLS (`tls-creds-psk`), the same guest and link: what a
  user gets from QEMU alone when encrypting.
The time is the move's `transfer_ms` (from `migrate` to the target guest running), for QEMU by
hand the same span. Every guest is checked intact on the target. Prints every run, the medians
and the ratios.

    sudo python3 bench/encryption.py [--rates 400mbit,1gbit] [--kinds compressible,random]
        [--rounds 3] [--memory 512M] [--fill 384M]
"""
import argparse, statistics

import compression
from labqemu import ferry
import labqemu  # noqa: E402

OPTIONS = ("tcp", "multichannel", "mptcp")


def qemu_tls_move(kind, a):
    """QEMU started by hand on host1, migrated with its own TLS (a pre-shared key) to a new one
    on host2 (bench/compression.py's QEMU by hand, one stream)."""
    return compression.qemu_move(kind, "qemu tls", a)["secs"]


def contenders():
    c = [(o, enc) for o in OPTIONS for enc in (True, False)]
    return c + [("qemu-tls", True)]


def run(contender, kind, a):
    option, enc = contender
    if option == "qemu-tls":
        return qemu_tls_move(kind, a), "qemu by hand, TLS"
    compression.set_encryption(enc)
    r = compression.ferry_move(kind, a, option)
    return r["secs"], r["path"]


def name(c):
    return c[0] if c[0] == "qemu-tls" else f"{c[0]} {'encrypted' if c[1] else 'clear'}"


def main():
    ap = argparse.ArgumentParser()
    compression.guest_options(ap)
    ap.set_defaults(memory="512M", fill="384M")
    ap.add_argument("--rates", default="400mbit,1gbit")
    ap.add_argument("--kinds", default="compressible,random")
    ap.add_argument("--rounds", type=int, default=3)
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    results = {}
    for rate in a.rates.split(","):
        ferry("lab", "up", "--replace", "--hosts", "2", "--nics", "2", "--rate", rate, "--host-memory", "4G", *labqemu.cpus_flag(a))
        for kind in a.kinds.split(","):
            cs = contenders()
            for rnd in range(a.rounds):
                order = cs[rnd % len(cs):] + cs[:rnd % len(cs)]
                for c in order:
                    secs, path = run(c, kind, a)
                    results.setdefault((rate, kind, name(c)), []).append(secs)
                    print(f"{rate} {kind} round {rnd + 1}: {name(c):24} {secs:6.2f} s  ({path})", flush=True)
        compression.set_encryption(True)
    print("\nmedians (s) and ratios, every run above:")
    for rate in a.rates.split(","):
        for kind in a.kinds.split(","):
            med = {n: statistics.median(v) for (r, k, n), v in results.items() if (r, k) == (rate, kind)}
            print(f"{rate} {kind}:")
            for o in OPTIONS:
                e, c = med[f"{o} encrypted"], med[f"{o} clear"]
                print(f"  {o:13} encrypted {e:6.2f}  clear {c:6.2f}  encrypted ÷ clear {e / c:.2f}")
            print(f"  qemu by hand with TLS {med['qemu-tls']:6.2f}  "
                  f"ferry tcp encrypted ÷ qemu TLS {med['tcp encrypted'] / med['qemu-tls']:.2f}  "
                  f"ferry multichannel encrypted ÷ qemu TLS {med['multichannel encrypted'] / med['qemu-tls']:.2f}")


if __name__ == "__main__":
    main()
