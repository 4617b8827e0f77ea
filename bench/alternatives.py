#!/usr/bin/env python3
"""Ferry multichannel vs what users would build from the same two NICs.

One lab (2 hosts × 2 NICs shaped to --rate), one guest size, each path run
undisturbed, then with one of the source's NICs cut at 40% of the guest's
filled memory and held down for the rest of the move ("held"), and — Ferry's
two kinds and QEMU over MPTCP, the paths that survive a cut — cut and restored
--restore-after seconds later while the move goes on ("restored"). The NIC
cut is nic2, or for `qemu tcp`, which uses only nic1, nic1 (a cut of a NIC it
does not use would prove nothing) — and for the active-backup team, nic1, its
active NIC. Paths:

- ferry: `ferry vm move --option multichannel` (Ferry's carriers over both NICs)
- ferry mptcp: `ferry vm move --option mptcp` (kernel MPTCP managed by Ferry:
  one connection per QEMU channel, spliced, subflows re-joined)
- qemu tcp: QEMU's own stream to the peer's nic1 address (one NIC)
- qemu multifd / ecmp: QEMU multifd (4 channels) to the peer's team address,
  an ECMP route hashing connections on layer 4 (`ferry lab team ecmp`; this
  kernel has no bonding driver)
- qemu multifd / active-backup: QEMU multifd (4 channels) to the peer's team
  address routed over one fabric at a time, a monitor per host moving the
  route when its probes over the active fabric go unanswered for 300 ms
  (`ferry lab team active-backup`: a bond's active-backup mode with its ARP
  monitor, which this kernel lacks)
- qemu multifd / mptcp: QEMU multifd (4 channels) with `"mptcp": true`, the
  kernel path manager adding a subflow over nic2 (`ferry lab team mptcp`)

QEMU paths are driven by hand over QMP with the same guest (kernel, initramfs,
workload) as Ferry's. Reported: transfer time (migrate → target running),
bytes, throughput ÷ (NICs × rate), CPU-seconds per GiB of every QEMU and Ferry
agent process on both hosts from `migrate` to the target running (QEMU runs:
sampled every 100 ms, so up to 0.1 s of the source QEMU is missed; Ferry: the
move report's own `cpu`, same span), and for a cut: whether it completed, the time from the
cut until the aggregate rate is back to ≥ 90% of the remaining link, and — the link
restored --restore-after seconds after the cut, while the move goes on — the time
from the restore until the cut NIC carries ≥ 50% of its link rate again.

With --trials N (default 10) every cut case of the paths that survive a cut
(Ferry's two kinds, QEMU over MPTCP) runs N times, and a second table gives
p50 / p95 / max of the time back to 90% (cut held) and of the re-join (cut
restored), and for `ferry mptcp` the time from the cut to the agent's removal
of the dead subflow (its `path` event). Where the time goes without Ferry is
shown by sampling the kernel's own view of the dead subflow of QEMU over MPTCP
(`ss -ti` on the source: its RTO, backoff and unacknowledged segments) until
the kernel closes it or the move ends.

    sudo python3 bench/alternatives.py [--rate 500mbit] [--mtu 1500] [--memory 1280M] [--fill 1G]
                                       [--trials 10] [--only LABEL]
"""
import argparse, json, os, subprocess, sys, threading, time

from labqemu import FERRY, Cpu, ferry, nic_tx, lab_addr, lab_nic, qemu, rate, run_target, size, wait_ready
import labqemu  # noqa: E402

HOSTS = ("host1", "host2")
def nic1_addr(host):
    return lab_addr(host, 1)


class Recovery:
    """The surviving NIC's transmit counter (what left the host, not what QEMU
    or Ferry handed to a socket) → time from the cut until it carries ≥ 90% of
    its link rate over 300 ms."""

    def __init__(self, link, host, nic, cut_nic=None):
        self.link, self.host, self.nic, self.cut_nic = link, host, nic, cut_nic
        self.samples, self.cut_at, self.back = [], None, None
        self.restored_at, self.rejoined, self.cut_samples = None, None, []
        # counters read every 20 ms from a thread of its own, whatever the
        # caller's loop does (progress events come every 100 ms)
        self.lock, self.running = threading.Lock(), True
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while self.running:
            self.add()
            time.sleep(0.02)

    def stop(self):
        self.running = False

    def _reached(self, samples, nic, since, share):
        """Adds a sample of `nic`'s transmit counter; the start of the first
        300 ms window after `since` carrying ≥ `share` of the link, or None."""
        t = time.time()
        b = nic_tx(self.host, nic)
        samples.append((t, b))
        old = [s for s in samples if s[0] <= t - 0.3]
        if old and old[-1][0] >= since:
            t0, b0 = old[-1]
            if (b - b0) * 8 / (t - t0) >= share * self.link:
                return t0
        return None

    def add(self):
        with self.lock:
            self._add()

    def _add(self):
        if self.cut_at is not None and self.back is None:
            t0 = self._reached(self.samples, self.nic, self.cut_at, 0.9)
            if t0 is not None:
                self.back = t0 - self.cut_at
        if self.restored_at is not None and self.rejoined is None and self.cut_nic:
            t0 = self._reached(self.cut_samples, self.cut_nic, self.restored_at, 0.5)
            if t0 is not None:
                self.rejoined = t0 - self.restored_at

    def restore_due(self, after):
        """The cut NIC should come back now (once, `after` seconds after the cut)."""
        return (after is not None and self.cut_at is not None and self.restored_at is None
                and time.time() - self.cut_at >= after)


class DeadSubflow:
    """The kernel's own view of the source's subflows on the cut NIC, sampled
    with `ss -ti` every 50 ms from the cut: when it last had data
    outstanding, its RTO and backoff, and when it was gone."""

    def __init__(self, host, addr):
        self.host, self.addr, self.log, self.gone = host, addr, [], None

    def sample(self, since):
        out = subprocess.run(["ip", "netns", "exec", self.host, "ss", "-tniH", "src", self.addr],
                             capture_output=True, text=True).stdout
        t = time.time() - since
        flows = [l for l in out.splitlines() if "tcp-ulp-mptcp" in l or "rto:" in l]
        if not flows:
            if self.gone is None and self.log:
                self.gone = t
            return
        w = out.replace("\n", " ").split()
        get = lambda k: next((x.split(":", 1)[1] for x in w if x.startswith(k + ":")), "-")
        self.log.append((t, get("rto"), get("backoff"), get("unacked")))

    def summary(self):
        if not self.log:
            return "no subflow on the cut NIC seen"
        pick = [self.log[0]] + [e for i, e in enumerate(self.log[1:], 1) if e[1:] != self.log[i - 1][1:]]
        steps = ", ".join(f"{t * 1000:.0f} ms rto {r} backoff {b} unacked {u}" for t, r, b, u in pick[:8])
        end = f"closed by the kernel {self.gone * 1000:.0f} ms after the cut" if self.gone else "still open"
        return f"{steps}; {end}"


def cut(host, down, nic="nic2"):
    ferry("lab", "link", host, nic, "down" if down else "up")


def ferry_move(vm, to, cut_bytes, link, option="multichannel", restore_after=None):
    frm = "host1" if to == "host2" else "host2"
    cpu, rec = Cpu(), Recovery(link, frm, "nic1", "nic2")
    p = subprocess.Popen([FERRY, "vm", "move", vm, "--to", to, "--option", option, "--json"],
                         stdout=subprocess.PIPE, text=True)
    last = None
    for line in p.stdout:
        last = json.loads(line)
        cpu.sample()
        if last["event"] == "progress":
            rec.add()
            if cut_bytes and rec.cut_at is None and last["transferred"] >= cut_bytes:
                cut(frm, True)
                rec.cut_at = time.time()
            if rec.restore_due(restore_after):
                cut(frm, False)
                rec.restored_at = time.time()
    p.wait()
    rec.stop()
    if cut_bytes and rec.restored_at is None:
        cut(frm, False)
    done = last["event"] == "completed" and last["check"]["intact"]
    secs = last.get("transfer_ms", 0) / 1000
    # the report's own figure covers the same span as the direct runs' (migrate → target
    # running): both QEMUs and both agents; sampling here would also count the cleanup
    rep = last.get("cpu", {})
    used = rep["source_s"] + rep["target_s"] if rep.get("target_s") is not None else cpu.total()
    removed = None
    if rec.cut_at is not None:
        gone = [c for c in last.get("path_changes", []) if c["action"] == "removed"
                and c["nic"] == lab_nic(frm, "nic2") and c["at_unix_ms"] / 1000 >= rec.cut_at - 0.05]
        if gone:
            removed = gone[0]["at_unix_ms"] / 1000 - rec.cut_at
            print(f"  {option}: {gone[0]['nic']} removed {removed * 1000:.0f} ms after the cut: "
                  f"{gone[0]['reason']}", file=sys.stderr)
    return {"done": done, "secs": secs, "bytes": last.get("bytes_transferred", 0), "cpu": used,
            "removed": removed, "path": last.get("data_path"), "back": rec.back, "rejoined": rec.rejoined, "restored": rec.restored_at is not None,
            "how": "completed, intact" if done else last.get("error", last)}


def direct_move(img, src, frm, to, kind, a, cut_bytes, link, restore_after=None):
    """Migrates `src` (QEMU on `frm`) to a new QEMU on `to`; returns (new src, result)."""
    d = f"/run/ferry/bench/{to}"
    subprocess.run(["rm", "-rf", d])
    cut_nic = "nic1" if kind in ("tcp", "ab") else "nic2"
    cpu, rec = Cpu(), Recovery(link, frm, "nic2" if cut_nic == "nic1" else "nic1", cut_nic)
    dp, dq = qemu(to, d, img, size(a.memory), size(a.fill), size(a.dirty_rate), True)
    sp, sq = src
    caps = [{"capability": "multifd", "state": kind != "tcp"}]
    for q in (sq, dq):
        q.cmd("migrate-set-capabilities", capabilities=caps)
        q.cmd("migrate-set-parameters", **{"multifd-channels": 4})
    sq.cmd("migrate-set-parameters", **{"max-bandwidth": 100 << 30, "downtime-limit": 300})
    host = {"tcp": nic1_addr(to), "mptcp": nic1_addr(to), "ecmp": a.team[to], "ab": a.team[to]}[kind]
    addr = {"transport": "socket", "type": "inet", "host": host, "port": "0"}
    listen = dict(addr)
    if kind == "mptcp":
        addr["mptcp"] = listen["mptcp"] = True
        # subflows join on the target's other addresses: listen on all of them
        listen["host"] = "0.0.0.0"
    dq.cmd("migrate-incoming", channels=[{"channel-type": "main", "addr": listen}])
    port = dq.cmd("query-migrate")["socket-address"][0]["port"]
    t0 = time.time()
    sq.cmd("migrate", channels=[{"channel-type": "main", "addr": dict(addr, port=str(port))}])
    moved_at, last_moved, info, how = time.time(), 0, {}, None
    dead = DeadSubflow(frm, lab_addr(frm, 2)) if kind == "mptcp" else None
    while True:
        info = sq.cmd("query-migrate")
        now = time.time()
        cpu.sample()
        if dead and rec.cut_at is not None and rec.restored_at is None and now - rec.cut_at < 5:
            dead.sample(rec.cut_at)
        ram = info.get("ram", {})
        if ram:
            if ram["transferred"] > last_moved:
                moved_at, last_moved = now, ram["transferred"]
            rec.add()
            if cut_bytes and rec.cut_at is None and ram["transferred"] >= cut_bytes:
                cut(frm, True, cut_nic)
                rec.cut_at = now
            if rec.restore_due(restore_after):
                cut(frm, False, cut_nic)
                rec.restored_at = time.time()
        if info.get("status") in ("completed", "failed", "cancelled"):
            break
        if now - moved_at > a.stall:
            how = f"stalled {a.stall:.0f} s with no byte moved"
            break
        time.sleep(0.1)
    rec.stop()
    if how is None and info["status"] == "completed":
        run_target(dq)
        secs = time.time() - t0
        used = cpu.total()
        sq.cmd("quit")
        sp.wait()
        if cut_bytes and rec.restored_at is None:
            cut(frm, False, cut_nic)
        if dead and cut_bytes:
            print(f"  kernel, dead subflow: {dead.summary()}", file=sys.stderr)
        return (dp, dq), {"done": True, "removed": dead.gone if dead else None, "secs": secs, "bytes": info["ram"]["transferred"], "cpu": used,
                          "back": rec.back, "rejoined": rec.rejoined, "restored": rec.restored_at is not None,
                          "how": "completed"}
    # failed or stalled: cancel (bounded), then start over from a fresh source guest
    if how is None:
        how = f"QEMU: {info.get('status')} {info.get('error-desc', '')}".strip()
    sq.s.settimeout(10)
    try:
        sq.cmd("migrate_cancel")
        t1 = time.time()
        while sq.cmd("query-migrate").get("status") not in ("cancelled", "failed", "completed"):
            if time.time() - t1 > 10:
                raise TimeoutError
            time.sleep(0.1)
        how += "; migrate_cancel took effect"
    except (TimeoutError, OSError):
        how += "; migrate_cancel did not return within 10 s"
    for p in (sp, dp):
        p.kill()
        p.wait()
    if cut_bytes and rec.restored_at is None:
        cut(frm, False, cut_nic)
    return None, {"done": False, "removed": None, "secs": time.time() - t0, "bytes": 0, "cpu": cpu.total(), "back": rec.back,
                  "rejoined": rec.rejoined, "restored": rec.restored_at is not None, "how": how}


def fresh_source(img, a, at):
    d = f"/run/ferry/bench/{at}"
    subprocess.run(["rm", "-rf", d])
    s = qemu(at, d, img, size(a.memory), size(a.fill), size(a.dirty_rate), False)
    wait_ready(f"{d}/console.log")
    time.sleep(2)
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="500mbit")
    ap.add_argument("--mtu", default="1500", help="every NIC's MTU")
    ap.add_argument("--memory", default="1280M")
    ap.add_argument("--fill", default="1G")
    ap.add_argument("--dirty-rate", default="8M")
    ap.add_argument("--stall", type=float, default=20.0)
    ap.add_argument("--only", default="",
                    help="run only the paths whose label contains this (e.g. 'mptcp')")
    ap.add_argument("--trials", type=int, default=10,
                    help="runs of each cut case of the paths that survive a cut")
    ap.add_argument("--restore-after", type=float, default=3.0,
                    help="restore the cut NIC this many seconds after the cut, mid-move")
    labqemu.add_cpus_option(ap)
    a = ap.parse_args()
    link = rate(a.rate)
    cut_bytes = int(size(a.fill) * 0.4)
    ferry("lab", "up", "--replace", "--hosts", "2", "--nics", "2", "--rate", a.rate, "--mtu", a.mtu, *labqemu.cpus_flag(a))
    img = ferry("lab", "image").split("guest image: ")[1].split(" ")[0]
    rows = []
    # Ferry: there and back, the way back with a cut
    ferry("vm", "create", "alt", "--host", "host1", "--memory", a.memory, "--fill", a.fill,
          "--dirty-rate", a.dirty_rate)
    ra = a.restore_after
    at = "host1"
    cases = [("no", None)] + [("held", None)] * a.trials + [("restored", ra)] * a.trials
    for option, label in (("multichannel", "ferry multichannel"), ("mptcp", "ferry mptcp")):
        if a.only not in label:
            continue
        for how, restore in cases:
            to = "host2" if at == "host1" else "host1"
            rows.append((label, 2, how, ferry_move("alt", to, cut_bytes if how != "no" else 0, link, option, restore)))
            print(label, how, rows[-1][3], file=sys.stderr)
            at = to
    ferry("vm", "rm", "alt")
    # QEMU by hand over each alternative
    for kind, label, nics in (("tcp", "qemu tcp (one NIC)", 1), ("ecmp", "qemu multifd / ecmp team", 2),
                              ("ab", "qemu multifd / active-backup team", 2),
                              ("mptcp", "qemu multifd / mptcp", 2)):
        if a.only not in label:
            continue
        team = {"tcp": "none", "ecmp": "ecmp", "ab": "active-backup", "mptcp": "mptcp"}[kind]
        out = ferry("lab", "team", team)
        a.team = dict(l.split(": migrate to ") for l in out.strip().splitlines() if ": migrate to " in l)
        src, at = fresh_source(img, a, "host1"), "host1"
        runs = cases if kind == "mptcp" else [("no", None), ("held", None)]
        for how, restore in runs:
            if src is None:
                src, at = fresh_source(img, a, "host1"), "host1"
            to = "host2" if at == "host1" else "host1"
            src, r = direct_move(img, src, at, to, kind, a, cut_bytes if how != "no" else 0, link, restore)
            rows.append((label, nics, how, r))
            print(label, how, r, file=sys.stderr)
            at = to
            time.sleep(2)
        if src is not None:
            src[1].cmd("quit")
            src[0].wait()
    ferry("lab", "team", "none")
    ferry("lab", "down")
    print(f"| path | NIC cut at 40% | outcome | transfer s | MiB | Mbit/s | ÷ (2 × {a.rate}) | CPU s/GiB (QEMU + agents, both hosts) | cut → ≥ 90% of one link, s | restored after {ra:.0f} s → ≥ 50% of its link, s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, nics, how, r in rows:
        with_cut = how != "no"
        gib = r["bytes"] / 2**30
        mbit = r["bytes"] * 8 / r["secs"] / 1e6 if r["done"] else 0
        back = f"{r['back']:.2f}" if r["back"] is not None else ("—" if not with_cut else "never")
        if how != "restored":
            rejoin = "—"
        elif r["rejoined"] is not None:
            rejoin = f"{r['rejoined']:.2f}"
        else:
            rejoin = "never" if r["restored"] else "move ended first"
        nic = "nic1" if label.startswith("qemu tcp") or "active-backup" in label else "nic2"
        cut_col = {"no": "no", "held": f"{nic}, held", "restored": f"{nic}, back after {ra:.0f} s"}[how]
        print(f"| {label} | {cut_col} | {r['how']} | {r['secs']:.2f} | {r['bytes'] / 2**20:.0f} | "
              f"{mbit:.0f} | {mbit * 1e6 / (2 * link):.3f} | {r['cpu'] / gib if gib else float('nan'):.2f} | {back} | {rejoin} |")
    print()
    print(f"Recovery over {a.trials} trials (s; p50 / p95 / max; \"never\" counts as the move's end)")
    print()
    print("| path | cut held: back to ≥ 90% of one link | cut restored: ≥ 50% of its link again | "
          "dead subflow removed after the cut | throughput ÷ links, no cut |")
    print("|---|---|---|---|---|")
    for label in ("ferry multichannel", "ferry mptcp", "qemu multifd / mptcp"):
        mine = [(how, r) for l, _, how, r in rows if l == label]
        if not mine:
            continue
        held = [r["back"] if r["back"] is not None else r["secs"] for how, r in mine if how == "held"]
        rest = [r["rejoined"] for how, r in mine if how == "restored" and r["rejoined"] is not None]
        never = sum(1 for how, r in mine if how == "restored" and r["restored"] and r["rejoined"] is None)
        gone = [r["removed"] for how, r in mine if how != "no" and r.get("removed") is not None]
        free = [r["bytes"] * 8 / r["secs"] / (2 * link) for how, r in mine if how == "no" and r["done"]]
        rj = stats3(rest) + (f" ({never} never)" if never else "")
        print(f"| {label} | {stats3(held)} | {rj} | {stats3(gone)} | "
              f"{', '.join(f'{x:.3f}' for x in free) or '—'} |")


def stats3(xs):
    """p50 / p95 / max of xs, or a dash."""
    if not xs:
        return "—"
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]
    return f"{pick(0.5):.2f} / {pick(0.95):.2f} / {xs[-1]:.2f}"


if __name__ == "__main__":
    main()
