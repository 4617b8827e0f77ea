#!/usr/bin/env python3
"""Ferry's `--option compression` against QEMU's own compression: QEMU `multifd` with
`multifd-compression zstd`, and plain QEMU `tcp`, both driven by hand over QMP — same lab,
same guest (the agent's own QEMU command line), same link.

Per link rate (a 2-host × 2-NIC lab shaped to it; "10gbit" is in effect unshaped: the two
cores are the limit), per guest memory (`compressible`: the workload's pattern, ~10-50×
depending on the codec; `random`: every word differs), --rounds rounds; in each round every
contender moves a fresh guest host1 → host2, the contenders' order rotating from round to
round. Reported per contender: the median transfer time (QMP `migrate` → target guest
running; for Ferry the move report's `transfer_ms`, the same span), bytes that left host1's
migration NICs (all --nics of them), and CPU-seconds per GiB of guest memory moved (every QEMU and agent on both hosts,
sampled from /proc over the move; for Ferry the report's own `cpu`), and each contender's
time ÷ QEMU zstd's (Ferry's ÷ `qemu zstd tls`'s when that runs and Ferry encrypts); the downtime each guest saw (from the source pausing to the target
running: for Ferry the report's `guest_downtime_ms`, counted the same way by hand — QEMU
by hand switches over as soon as the rest fits its 300 ms `downtime-limit`, Ferry's
default `--max-downtime auto` copies on for the smallest blackout); for Ferry how it compressed
(QEMU's own zstd in its multifd channels, when Ferry asked for it, and Ferry's frame codecs;
or QEMU's own multifd channels when Ferry found the CPU, not the link, the limit).
Every guest is checked intact on the target (its workload's own verification: 0 integrity
errors).

    sudo python3 bench/compression.py [--memory 768M] [--fill 512M] [--rates 200mbit,1gbit,10gbit]
        [--rounds 3] [--qemu-channels 2] [--zstd-level 1] [--nics 2] [--cpus split] [--settle 2]
        [--contenders "qemu tcp,qemu zstd,ferry compression,ferry auto"] [--encryption on|off]

`qemu zstd tls` (not run by default) is QEMU's multifd + zstd with QEMU's own TLS (a pre-shared
key) on every channel: with it among the contenders and Ferry's moves encrypted (the cluster's
default; --encryption off turns it off for the run), Ferry's ratio is taken against it, the
like-for-like contender; otherwise against QEMU's zstd in clear. `ferry tcp` (not run by default
either) is Ferry's `tcp` option, QEMU's one stream: what `auto` took over one NIC pair before it
learned to seal on its own carriers. A Ferry contender may end in a maximum downtime:
`ferry compression 300ms` moves with `--max-downtime 300ms` (QEMU by hand's limit) rather than
`auto`'s smallest blackout, to show what that blackout costs in time.

--cpus gives each lab host CPUs of its own (`ferry lab up --cpus`); the QEMUs by hand run on
their host's too. --nics 1 measures `auto` over one NIC pair. Every contender waits, its guest
up, before its move starts: --settle seconds (2 unless given), then, where the machine hands
freed memory back to its hypervisor, until it has stopped doing so (see settle), so every
target loads into memory in the same state.
"""
import argparse, json, os, re, statistics, subprocess, sys, time

import labqemu

from labqemu import FERRY, Cpu, agents_spend, ferry, lab_addr, nic_tx, qemu, run_target, size, wait_migration, wait_ready


def lab_tx(a):
    """Bytes every migration NIC of host1 has transmitted (all --nics of them: `auto` spreads a
    move over several, QEMU by hand uses nic1)."""
    return sum(nic_tx("host1", f"nic{k}") for k in range(1, int(getattr(a, "nics", 2)) + 1))


def console_errors(path):
    """The workload's last reported integrity error count, and whether it still ticks."""
    ticks = re.findall(r"FERRY tick=(\d+) .* errors=(\d+)", open(path, errors="replace").read())
    return (int(ticks[-1][1]), len(ticks)) if ticks else (None, 0)


def ferry_move(kind, a, option="compression", max_downtime=None):
    """A fresh guest moved host1 → host2 by `ferry vm move --option OPTION` (and
    `--max-downtime MAX_DOWNTIME` when given), checked intact; with both agents' CPU seconds
    (source, target) and context switches over the move."""
    subprocess.run([FERRY, "vm", "rm", "cb"], capture_output=True)
    extra = ["--compressible"] if kind == "compressible" else []
    ferry("vm", "create", "cb", "--host", "host1", "--memory", a.memory, "--fill", a.fill,
          "--dirty-rate", a.dirty_rate, *extra)
    settle(a)
    tx0 = lab_tx(a)
    out, agents, switches = agents_spend(lambda: subprocess.run(
        [FERRY, "vm", "move", "cb", "--to", "host2", "--option", option, "--json",
         *(["--max-downtime", max_downtime] if max_downtime else [])], capture_output=True, text=True))
    wire = lab_tx(a) - tx0
    subprocess.run([FERRY, "vm", "rm", "cb"], capture_output=True)
    try:
        r = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        sys.exit(f"ferry move ({option}): no move report: {out.stderr.strip()}")
    if r.get("event") != "completed" or not r["check"]["intact"]:
        sys.exit(f"ferry move failed or guest not intact: {r}")
    codecs = "frames: " + ", ".join(f"{c['codec']} {c['share'] * 100:.0f}%" for c in r.get("codecs", [])
                                    if c["share"] >= 0.01)
    q = r.get("qemu_codec")
    if q:
        codecs = f"QEMU {q['codec']} {q['ratio']:.1f}× ({q['cpu_s']:.2f} CPU-s); {codecs}"
    if r["data_path"] == "qemu-multifd":
        # the CPU was the limit: QEMU's own channels, no frames (see docs/transport.md)
        codecs = "QEMU's own multifd channels, pages as they are"
    # the source's CPU spent on compressing and on screening for noise (the codecs' `cpu_s`)
    codec_cpu = sum(c["cpu_s"] for c in r.get("codecs", []))
    return {"secs": r["transfer_ms"] / 1000, "wire": wire, "cpu": r["cpu"]["source_s"] + r["cpu"]["target_s"],
            "codec_cpu": codec_cpu, "codecs": codecs, "downtime": r["guest_downtime_ms"], "path": r["data_path"], "agents": agents,
            "switches": switches}


def set_encryption(on):
    """The cluster's `encryption` for Ferry's moves from now on."""
    ferry("cluster", "set", "--encryption", "on" if on else "off")


def cpu_has_aes():
    """The CPU has AES and carry-less multiply (the agents' rule for QEMU's TLS priority)."""
    with open("/proc/cpuinfo") as f:
        flags = next((l.split() for l in f if l.startswith(("flags", "Features"))), [])
    return "aes" in flags and ("pclmulqdq" in flags or "pmull" in flags)


AES_FIRST = "NORMAL:-CHACHA20-POLY1305:+CHACHA20-POLY1305"


def write_dh_params(d):
    """RFC 7919 `ffdhe2048` as `dh-params.pem` in a QEMU TLS server's directory: QEMU then does
    not search for a prime of its own at `object-add`."""
    subprocess.run(["openssl", "genpkey", "-genparam", "-algorithm", "DH", "-pkeyopt", "group:ffdhe2048",
                    "-out", f"{d}/dh-params.pem"], check=True)


def psk_creds(end, d, priority=None):
    """QEMU's `tls-creds-psk` object for `end` (client or server) over the key directory `d`,
    with a GnuTLS `priority` when given."""
    creds = {"qom-type": "tls-creds-psk", "id": "tls0", "endpoint": end, "dir": d}
    if end == "client":
        creds["username"] = "ferry"
    if priority:
        creds["priority"] = priority
    return creds


def qemu_tls(sq, dq):
    """QEMU's own TLS on a migration by hand: `tls-creds-psk` with a fresh pre-shared key, the
    source the client and the target the server, set up as Ferry's agents set up theirs (what a
    user can do too): fixed DH parameters (RFC 7919 `ffdhe2048`, so the target does not search
    for a prime) and, where the CPU has AES, GnuTLS's AES-GCM before ChaCha20."""
    psk = "/run/ferry/bench/qemu-psk"
    subprocess.run(["rm", "-rf", psk])
    os.makedirs(psk, mode=0o700)
    with open(f"{psk}/keys.psk", "w") as f:
        f.write("ferry:" + os.urandom(32).hex() + "\n")
    write_dh_params(psk)
    priority = AES_FIRST if cpu_has_aes() else None
    for q, end in ((sq, "client"), (dq, "server")):
        q.cmd("object-add", **psk_creds(end, psk, priority))
        q.cmd("migrate-set-parameters", **{"tls-creds": "tls0"})


def qemu_move(kind, contender, a):
    """A QEMU started by hand on host1 migrated to a new one on host2: `tcp` or multifd + zstd
    (`qemu zstd`); a contender whose name ends in ` tls` (`qemu zstd tls`, `qemu tls`) with QEMU's
    own TLS on every channel."""
    src_d, dst_d = "/run/ferry/bench/cb-src", "/run/ferry/bench/cb-dst"
    subprocess.run(["rm", "-rf", src_d, dst_d])
    comp = kind == "compressible"
    mem, fill, dirty = size(a.memory), size(a.fill), size(a.dirty_rate)
    sp, sq = qemu("host1", src_d, None, mem, fill, dirty, False, comp)
    wait_ready(f"{src_d}/console.log")
    time.sleep(2)
    dp, dq = qemu("host2", dst_d, None, mem, fill, dirty, True, comp)
    zstd = contender.startswith("qemu zstd")
    for q in (sq, dq):
        q.cmd("migrate-set-capabilities", capabilities=[{"capability": "multifd", "state": zstd}])
        if zstd:
            q.cmd("migrate-set-parameters", **{"multifd-channels": a.qemu_channels,
                                                "multifd-compression": "zstd",
                                                "multifd-zstd-level": a.zstd_level})
    if contender.endswith(" tls"):
        qemu_tls(sq, dq)
    sq.cmd("migrate-set-parameters", **{"max-bandwidth": 100 << 30, "downtime-limit": 300})
    addr = {"transport": "socket", "type": "inet", "host": lab_addr("host2", 1), "port": "0"}
    dq.cmd("migrate-incoming", channels=[{"channel-type": "main", "addr": dict(addr)}])
    port = dq.cmd("query-migrate")["socket-address"][0]["port"]
    settle(a)
    cpu, tx0 = Cpu(), lab_tx(a)
    t0 = time.time()
    sq.cmd("migrate", channels=[{"channel-type": "main", "addr": dict(addr, port=str(port))}])
    info = wait_migration(sq, 0.02, cpu.sample)
    if info["status"] != "completed":
        sys.exit(f"{contender}: QEMU migration {info['status']}: {info.get('error-desc')}")
    run_target(dq)
    secs = time.time() - t0
    # the guest's blackout as Ferry's report counts it: from the source's pause
    # (QEMU's completion less its downtime, QEMU's clock started at `migrate`)
    # until the target runs
    downtime = round(secs * 1000 - (info["total-time"] - info["downtime"]))
    used, wire = cpu.total(), lab_tx(a) - tx0
    time.sleep(1.5)
    errors, ticks = console_errors(f"{dst_d}/console.log")
    for p, q in ((sp, sq), (dp, dq)):
        try:
            q.cmd("quit")
        except (OSError, RuntimeError, ValueError):
            pass
        p.wait()
    if errors != 0:
        sys.exit(f"{contender}: guest not intact on the target (errors={errors})")
    return {"secs": secs, "wire": wire, "cpu": used, "codecs": "", "downtime": downtime}


CONTENDERS = ("qemu tcp", "qemu zstd", "ferry compression", "ferry auto")
KNOWN = CONTENDERS + ("qemu zstd tls", "ferry tcp")


def settle(a):
    """Waits, every contender alike, its guest up, before its move starts (--settle seconds at
    least, then labqemu.settle_memory).

    The target's QEMU touches its guest's memory for the first time as the pages arrive. On a
    machine that is itself a VM handing freed memory back to its hypervisor (virtio-balloon
    free page reporting), memory freed a moment ago is touched tens of times faster than memory
    already handed back (bench/first_touch.py), and the kernel hands it back in passes ~2 s
    apart. Which contender's target got the memory of the guests removed just before then
    moved a row by half. After the wait every target starts from the same state."""
    labqemu.settle_memory(max(getattr(a, "settle", 2.0), 0.0))


def guest_options(ap):
    """The guest and QEMU-by-hand options a compression bench takes."""
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds every contender waits at least before its move (see settle)")
    ap.add_argument("--memory", default="768M")
    ap.add_argument("--fill", default="512M")
    ap.add_argument("--dirty-rate", default="1M")
    ap.add_argument("--qemu-channels", type=int, default=2)
    ap.add_argument("--zstd-level", type=int, default=1)


def main():
    ap = argparse.ArgumentParser()
    guest_options(ap)
    ap.add_argument("--rates", default="200mbit,1gbit,10gbit")
    ap.add_argument("--kinds", default="compressible,random")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--nics", default="2")
    ap.add_argument("--encryption", choices=("on", "off"), default="on",
                    help="the cluster's encryption for Ferry's moves (`ferry cluster set --encryption`)")
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    contenders = a.contenders.split(",")
    for c in contenders:
        if c not in KNOWN and not re.fullmatch(r"ferry (compression|auto|tcp) \d+ms", c):
            ap.error(f"--contenders: unknown contender {c!r} (known: {', '.join(KNOWN)}; a Ferry "
                     f"contender may end in a maximum downtime, e.g. `ferry compression 300ms`)")
    # Ferry's like-for-like QEMU: zstd with TLS when Ferry's moves are encrypted and that
    # contender runs, zstd in clear otherwise
    base_of = "qemu zstd tls" if a.encryption == "on" and "qemu zstd tls" in contenders else "qemu zstd"
    gib = size(a.memory) / (1 << 30)
    rows = []
    for rate in a.rates.split(","):
        ferry("lab", "up", "--replace", "--hosts", "2", "--nics", a.nics, "--rate", rate,
              *labqemu.cpus_flag(a))
        set_encryption(a.encryption == "on")
        for kind in a.kinds.split(","):
            runs = {c: [] for c in contenders}
            for rnd in range(a.rounds):
                order = contenders[rnd % len(contenders):] + contenders[:rnd % len(contenders)]
                for c in order:
                    r = (ferry_move(kind, a, *c.split()[1:]) if c.startswith("ferry ")
                         else qemu_move(kind, c, a))
                    runs[c].append(r)
                    print(f"{rate} {kind} round {rnd + 1} {c}: {r['secs']:.2f} s, {r['wire'] / 2**20:.1f} MiB "
                          f"on the wire, {r['cpu']:.2f} CPU-s, guest downtime {r['downtime']} ms {r['codecs']}",
                          file=sys.stderr, flush=True)
            med = {c: statistics.median(x["secs"] for x in runs[c]) for c in contenders}
            for c in contenders:
                # QEMU by hand ÷ QEMU zstd in clear; Ferry ÷ its like-for-like
                base = med.get("qemu zstd" if c.startswith("qemu") else base_of)
                rows.append((rate, kind, c, med[c], [x["secs"] for x in runs[c]],
                             statistics.median(x["wire"] for x in runs[c]) / 2**20,
                             statistics.median(x["cpu"] for x in runs[c]) / gib,
                             med[c] / base if base else None, runs[c][-1]["codecs"],
                             [x["downtime"] for x in runs[c] if x["downtime"] is not None]))
    ferry("lab", "down")
    print(f"# Ferry's moves: encryption {a.encryption}; Ferry's ratio is ÷ {base_of}, QEMU's ÷ qemu zstd")
    print("| link | memory | contender | median s | every run s | MiB on the wire | CPU s/GiB | ÷ QEMU (above) "
          "| guest downtime ms | codecs (last run) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rate, kind, c, m, every, wire, cpu, ratio, codecs, downs in rows:
        shown = f"{ratio:.2f}" if ratio is not None else "—"
        print(f"| {rate} | {kind} | {c} | {m:.2f} | {', '.join(f'{x:.2f}' for x in every)} | {wire:.1f} | "
              f"{cpu:.2f} | {shown} | {', '.join(map(str, downs)) or '—'} | {codecs or '—'} |")


if __name__ == "__main__":
    main()
