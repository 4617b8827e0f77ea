#!/usr/bin/env python3
"""Drain time vs the ideal, and `auto` vs fixed simultaneous-migration limits.

Each run: a fresh lab (3 hosts × 2 NICs, links shaped to --rate), --vms guests
on host1, then `ferry host drain host1 --max-parallel L [--option O]`. Ideal =
Σ bytes moved (QEMU's count) ÷ the drained host's usable link rate (2 NICs ×
rate; the targets together have more). Reported: drain time, ideal, time ÷
ideal, the bytes host1's interfaces sent (less than QEMU's count when frames
were compressed), the links' use (those bytes ÷ rate ÷ time), the limits
auto chose. --options runs each limit once per option, alternating.

    sudo python3 bench/drain.py [--vms 6] [--memory 512M] [--fill 384M] [--rate 1gbit]
                                [--limits 1,2,4,8,auto] [--options auto,mptcp]
"""
import argparse, json, subprocess, sys
import labqemu  # noqa: E402

FERRY = labqemu.FERRY


def ferry(*args, check=True):
    out = subprocess.run([FERRY, *args], capture_output=True, text=True)
    if check and out.returncode not in (0,):
        sys.exit(f"ferry {' '.join(args)} failed: {out.stderr}")
    return out.stdout


def host1_tx():
    """Bytes sent by every interface of host1's namespace but lo."""
    out = subprocess.run(["ip", "netns", "exec", "host1", "sh", "-c",
                          "cat /sys/class/net/*/statistics/tx_bytes; cat /sys/class/net/lo/statistics/tx_bytes"],
                         capture_output=True, text=True, check=True).stdout.split()
    return sum(int(x) for x in out[:-1]) - int(out[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vms", type=int, default=6)
    ap.add_argument("--memory", default="512M")
    ap.add_argument("--fill", default="384M")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--limits", default="1,2,4,8,auto")
    ap.add_argument("--options", default="auto")
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    rate = float(a.rate.replace("gbit", "e9").replace("mbit", "e6"))
    rows = []
    for limit in a.limits.split(","):
        for option in a.options.split(","):
            ferry("lab", "up", "--replace", "--hosts", "3", "--nics", "2", "--rate", a.rate, *labqemu.cpus_flag(a))
            procs = [subprocess.Popen([FERRY, "vm", "create", f"dr{i}", "--host", "host1", "--memory", a.memory,
                                       "--fill", a.fill, "--dirty-rate", "4M"], stdout=subprocess.DEVNULL)
                     for i in range(a.vms)]
            for p in procs:
                if p.wait() != 0:
                    sys.exit("vm create failed")
            tx0 = host1_tx()
            out = ferry("host", "drain", "host1", "--max-parallel", limit, "--option", option, "--json")
            wire = host1_tx() - tx0
            done = json.loads(out.strip().splitlines()[-1])
            assert done["event"] == "done" and len(done["moved"]) == a.vms, done
            secs = done["total_ms"] / 1000
            ideal = done["bytes"] * 8 / (2 * rate)
            use = wire * 8 / (2 * rate) / secs
            rows.append((limit, option, secs, ideal, done["bytes"], wire, use, done["limits"]))
            print(f"limit {limit} {option}: {secs:.1f} s, ideal {ideal:.1f} s, ratio {secs / ideal:.2f}, "
                  f"wire {wire / 2**20:.0f} MiB, links used {use:.3f}, limits {done['limits']}", file=sys.stderr)
    ferry("lab", "down")
    print(f"| --max-parallel | --option | drain s | MiB moved | MiB sent by host1 | ideal s (Σ bytes ÷ 2 × {a.rate}) "
          f"| drain ÷ ideal | links' use | limits used |")
    print("|---|---|---|---|---|---|---|---|---|")
    for limit, option, secs, ideal, b, wire, use, used in rows:
        print(f"| {limit} | {option} | {secs:.1f} | {b / 2**20:.0f} | {wire / 2**20:.0f} | {ideal:.1f} "
              f"| {secs / ideal:.2f} | {use:.3f} | {used} |")
    for option in a.options.split(","):
        fixed = [r[2] for r in rows if r[0] != "auto" and r[1] == option]
        auto = [r[2] for r in rows if r[0] == "auto" and r[1] == option]
        if auto and fixed:
            print(f"\n--option {option}: auto ÷ best fixed: {auto[0] / min(fixed):.2f}")


if __name__ == "__main__":
    main()
