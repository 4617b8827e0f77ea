#!/usr/bin/env python3
"""Ferry's two carrier kinds against each other, and what `auto` picks.

One lab (2 hosts × 2 NICs shaped to --rate). Three cases, each a guest of
--memory with --fill of non-zero memory moved with `--option multichannel`
(Ferry's own carriers), `--option mptcp` (QEMU handed an MPTCP socket managed by Ferry) and
`--option auto`, one after the other, back and forth between the hosts:

- idle: random memory, nothing else running.
- compressible: memory LZ4 shrinks (`--compressible`), nothing else running.
- busy CPU: random memory, and one CPU-bound process per core (the lab's
  hosts share this machine's cores) for the whole case.

Reported per move: transfer time (`migrate` → target running), throughput ÷
(2 × rate), CPU-seconds per GiB (the move report's `cpu`: both QEMUs and both
agents), and for `auto` the choice with its reason (from the skeleton step).

    sudo python3 bench/carriers.py [--rate 500mbit] [--memory 1280M] [--fill 1G]
"""
import argparse, json, os, subprocess, sys

from labqemu import FERRY, ferry, rate
import labqemu  # noqa: E402


def move(vm, to, option):
    p = subprocess.run([FERRY, "vm", "move", vm, "--to", to, "--option", option, "--json"],
                       capture_output=True, text=True)
    events = [json.loads(l) for l in p.stdout.splitlines() if l.strip()]
    last = events[-1]
    if last.get("event") != "completed" or not last["check"]["intact"]:
        sys.exit(f"{option} move failed: {last}")
    why = ""
    for e in events:
        if e.get("event") == "step" and e.get("step") == "skeleton" and "auto:" in e.get("detail", ""):
            why = e["detail"].split("auto:", 1)[1].strip()
    return last, why


def hogs(n):
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="500mbit")
    ap.add_argument("--memory", default="1280M")
    ap.add_argument("--fill", default="1G")
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    link = rate(a.rate)
    ferry("lab", "up", "--replace", "--hosts", "2", "--nics", "2", "--rate", a.rate, *labqemu.cpus_flag(a))
    rows = []
    at = "host1"
    for case, compressible, busy in (("idle", False, False), ("compressible", True, False),
                                     ("busy CPU", False, True)):
        extra = ["--compressible"] if compressible else []
        ferry("vm", "create", "kinds", "--host", at, "--memory", a.memory, "--fill", a.fill,
              "--dirty-rate", "8M", *extra)
        running = hogs(os.cpu_count() or 2) if busy else []
        try:
            for option in ("multichannel", "mptcp", "auto"):
                to = "host2" if at == "host1" else "host1"
                r, why = move("kinds", to, option)
                at = to
                secs = r["transfer_ms"] / 1000
                mbit = r["bytes_transferred"] * 8 / secs / 1e6
                gib = r["bytes_transferred"] / 2**30
                row = (case, option, r["option"], secs, mbit * 1e6 / (2 * link), r["cpu"]["per_gib_s"],
                       r.get("compression_ratio", 1.0), why)
                print(row, file=sys.stderr)
                rows.append(row)
        finally:
            for h in running:
                h.kill()
                h.wait()
        ferry("vm", "rm", "kinds")
    ferry("lab", "down")
    print(f"| case | asked | carried by | transfer s | QEMU bytes/s ÷ (2 × {a.rate}) | CPU s/GiB | LZ4 ratio | auto's reason |")
    print("|---|---|---|---|---|---|---|---|")
    for case, asked, got, secs, ratio, cpu, lz4, why in rows:
        print(f"| {case} | {asked} | {got} | {secs:.2f} | {ratio:.3f} | {cpu:.2f} | {lz4:.2f} | {why or '—'} |")


if __name__ == "__main__":
    main()
