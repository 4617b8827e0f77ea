#!/usr/bin/env python3
"""The fault matrix: each fault injected into live migrations (or drains)
TRIALS times in the lab, and what became of every guest.

    python3 bench/faults.py [--trials 20] [--only NAME[,NAME…]] [--rate 300mbit]

Faults (NAME):
  src-agent-kill    the source agent SIGKILLed mid-pre-copy, started again
  tgt-agent-kill    the target agent SIGKILLed mid-pre-copy, started again
  tgt-qemu-kill     the target QEMU SIGKILLed mid-pre-copy
  control-kill      the control service SIGKILLed mid-drain, started again,
                    the drain run again to its end
  nic-flap          a migration NIC of the source down/up every 2 s through a move
  postcopy-cut      every migration NIC of the target down for 3 s in post-copy
  storage-restart   the storage node SIGKILLed and started again while two
                    guests write to their disks over NBD
  mgmt-cut          the management link between the control service and the
                    target agent cut for 5 s during a drain
  host-power-off    host1 powered off under two HA guests writing their
                    disks (bench/ha.py's trial, two guests)
  host-isolate      host1 cut from the management network under them
  leader-kill       host1 powered off with the control service run as three
                    instances on etcd, the leader SIGKILLed once it judged
                    host1 failed; the next leader finishes the failover
For the host faults a guest counts as completed when it runs on exactly one
other host with its disk written there, and is lost otherwise; a double
writer (a disk error, a second QEMU, a disk open from two hosts) is an
integrity error.

After each trial every guest must run on exactly one host (after `vm
resolve` where a move was left in doubt) and pass its check (QEMU running,
its workload advancing, no page wrong); for storage-restart its disk writer
must see every block it wrote back (no acknowledged write lost). Printed:
per fault, trials, moves completed, rolled back, VMs lost (running nowhere
or twice), guest integrity errors, disk errors; then the table as JSON.

Needs the lab (root, QEMU >= 9, iproute2); uses target/debug/ferry
(FERRY_BIN to override). Each trial takes 15-60 s.
"""
import argparse, json, os, signal, subprocess, sys, threading, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FERRY = os.environ.get("FERRY_BIN", os.path.join(ROOT, "target", "debug", "ferry"))
LAB = "/run/ferry/lab"


def ferry(*args, check=True, timeout=300):
    r = subprocess.run([FERRY, *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"ferry {' '.join(args)}: {r.stderr.strip()}")
    return r


def fj(*args):
    return json.loads(ferry(*args, "--json").stdout)


def kill_pidfile(path):
    try:
        pid = int(open(path).read().strip())
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass


def entries(vm):
    return [v for v in fj("vm", "list") if v["name"] == vm]


def qemu_pid(host, vm, incoming):
    """The QEMU of `vm` inside `host`'s namespace (the skeleton if `incoming`)."""
    pids = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout.split()
    for p in pids:
        try:
            cmd = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"qemu-system-x86_64") and f"guest={vm},".encode() in b" ".join(cmd):
            if (b"defer" in cmd) == incoming:
                return int(p)
    return None


class Move:
    """`ferry vm move … --json` in the background; its events as they come."""

    def __init__(self, vm, to, *flags):
        self.p = subprocess.Popen([FERRY, "vm", "move", vm, "--to", to, "--json", *flags],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.events, self.done = [], threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            try:
                self.events.append(json.loads(line))
            except ValueError:
                pass
        self.p.wait()
        self.done.set()

    def wait_for(self, pred, timeout=120):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if any(pred(e) for e in self.events):
                return True
            if self.done.is_set():
                return False
            time.sleep(0.05)
        return False

    def finish(self, timeout=300):
        self.done.wait(timeout)
        return self.events[-1] if self.events else {"event": "none", "stderr": self.p.stderr.read()}


def copying(e, at_least=32 << 20):
    return e.get("event") == "progress" and e.get("transferred", 0) >= at_least


class Lab:
    def __init__(self, rate):
        self.rate = rate
        ferry("lab", "up", "--replace", "--hosts", "3", "--nics", "2", "--rate", rate, timeout=600)

    def settle(self, vms, within=90):
        """Waits until every VM runs on exactly one host; resolves moves in
        doubt. Returns {vm: host or None (lost) or 'twice'}."""
        t0 = time.time()
        where = {}
        while time.time() - t0 < within:
            where = {}
            for vm in vms:
                try:
                    e = entries(vm)
                except RuntimeError:
                    e = None
                if e is None:
                    where[vm] = "unknown"
                    continue
                running = [x["host"] for x in e if x["state"] == "running"]
                if len(e) == 1 and len(running) == 1:
                    where[vm] = running[0]
                else:
                    where[vm] = None if not running else ("twice" if len(running) > 1 else "unsettled")
                    if any(x["state"] not in ("running",) for x in e):
                        ferry("vm", "resolve", vm, check=False)
            if all(w not in (None, "unknown", "unsettled", "twice") for w in where.values()):
                return where
            time.sleep(1)
        return where

    def check(self, vm):
        try:
            c = fj("vm", "check", vm)
            return c.get("intact") and c.get("running") and c.get("errors", 0) == 0
        except RuntimeError:
            return False

    def vm(self, name, host, memory="384M", fill="256M", dirty="16M", seed=1):
        ferry("vm", "rm", name, check=False)
        ferry("vm", "create", name, "--host", host, "--memory", memory, "--fill", fill, "--dirty-rate", dirty,
              "--seed", str(seed))

    def rm(self, *vms):
        for v in vms:
            ferry("vm", "rm", v, check=False)

    def restart_agent(self, host):
        for _ in range(20):
            if ferry("lab", "restart-agent", host, check=False).returncode == 0:
                break
            time.sleep(0.5)
        t0 = time.time()
        while time.time() - t0 < 30:
            hs = {h["name"]: h for h in fj("host", "list")}
            if hs.get(host, {}).get("reachable"):
                return
            time.sleep(0.5)


def outcome(result, source, target, where):
    """completed / rolled back / lost for one move."""
    if where in (None, "twice", "unknown", "unsettled"):
        return "lost"
    if where == target:
        return "completed"
    if where == source:
        return "rolled back"
    return "lost"


# ---- the faults: each returns [(vm, source, target, where, intact, disk_errors)] ----

def agent_kill(lab, trial, side):
    vm = f"fa{trial}"
    lab.vm(vm, "host1")
    m = Move(vm, "host2", "--option", "multichannel")
    m.wait_for(copying)
    host = "host1" if side == "src" else "host2"
    kill_pidfile(f"{LAB}/{host}/agent.pid")
    time.sleep(1)
    lab.restart_agent(host)
    m.finish()
    where = lab.settle([vm])[vm]
    ok = lab.check(vm) if where not in (None, "twice", "unknown", "unsettled") else False
    lab.rm(vm)
    return [(vm, "host1", "host2", where, ok, 0)]


def tgt_qemu_kill(lab, trial):
    vm = f"fq{trial}"
    lab.vm(vm, "host1")
    m = Move(vm, "host2", "--option", "multichannel")
    m.wait_for(copying)
    pid = qemu_pid("host2", vm, incoming=True)
    if pid:
        os.kill(pid, signal.SIGKILL)
    m.finish()
    where = lab.settle([vm])[vm]
    ok = lab.check(vm)
    lab.rm(vm)
    return [(vm, "host1", "host2", where, ok, 0)]


def nic_flap(lab, trial):
    vm = f"fn{trial}"
    lab.vm(vm, "host1")
    m = Move(vm, "host2", "--option", "multichannel")
    stop = threading.Event()

    def flap():
        up = True
        while not stop.is_set():
            stop.wait(2)
            up = not up
            ferry("lab", "link", "host1", "nic1", "up" if up else "down", check=False)
        ferry("lab", "link", "host1", "nic1", "up", check=False)

    t = threading.Thread(target=flap)
    t.start()
    m.finish()
    stop.set()
    t.join()
    where = lab.settle([vm])[vm]
    ok = lab.check(vm)
    lab.rm(vm)
    return [(vm, "host1", "host2", where, ok, 0)]


def postcopy_cut(lab, trial):
    vm = f"fp{trial}"
    lab.vm(vm, "host1", memory="384M", fill="160M", dirty="64M")
    m = Move(vm, "host3", "--option", "multichannel", "--postcopy", "allow", "--throttle", "forbid")
    if m.wait_for(lambda e: e.get("event") == "step" and e.get("step") == "postcopy", timeout=180):
        for k in ("nic1", "nic2"):
            ferry("lab", "link", "host3", k, "down", check=False)
        time.sleep(3)
        for k in ("nic1", "nic2"):
            ferry("lab", "link", "host3", k, "up", check=False)
    m.finish()
    where = lab.settle([vm])[vm]
    ok = lab.check(vm)
    lab.rm(vm)
    return [(vm, "host1", "host3", where, ok, 0)]


def drain_with(lab, trial, fault):
    """Two guests on host1, drained to host2 while `fault` strikes; the
    drain is run again until host1 is empty."""
    vms = [f"fd{trial}a", f"fd{trial}b"]
    for v in vms:
        lab.vm(v, "host1")
    d = subprocess.Popen([FERRY, "host", "drain", "host1", "--to", "host2", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # the drain is under way once a VM is copying
    t0 = time.time()
    while time.time() - t0 < 60:
        try:
            if any(v.get("state") == "incoming" for v in fj("vm", "list")):
                break
        except RuntimeError:
            pass
        time.sleep(0.2)
    fault()
    try:
        d.wait(240)
    except subprocess.TimeoutExpired:
        d.kill()
    where = lab.settle(vms)
    # run the drain again to its end (it takes up what is left)
    for _ in range(3):
        if all(w == "host2" for w in where.values()):
            break
        ferry("host", "drain", "host1", "--to", "host2", check=False, timeout=600)
        where = lab.settle(vms)
    ferry("host", "resume", "host1", check=False)
    res = [(v, "host1", "host2", where[v], lab.check(v), 0) for v in vms]
    lab.rm(*vms)
    return res


def control_kill(lab, trial):
    def fault():
        kill_pidfile(f"{LAB}/control/control.pid")
        time.sleep(1)
        ferry("lab", "restart", "control")
        t0 = time.time()
        while time.time() - t0 < 20 and ferry("host", "list", check=False).returncode != 0:
            time.sleep(0.3)
    return drain_with(lab, trial, fault)


def mgmt_cut(lab, trial):
    def fault():
        ferry("lab", "link", "host2", "mgmt0", "down")
        time.sleep(5)
        ferry("lab", "link", "host2", "mgmt0", "up")
    return drain_with(lab, trial, fault)


def storage_restart(lab, trial):
    """Two guests writing to a shared disk (each its own blocks, checked
    by the other and by itself); the storage node is killed and started
    again; every guest's writer must report no error afterwards and keep
    writing."""
    disk, vms = f"fs{trial}", [f"fs{trial}a", f"fs{trial}b"]
    ferry("disk", "rm", disk, check=False)
    ferry("disk", "create", disk, "--size", "64M")
    # distinct seeds: each guest writes its own block of the shared disk
    for seed, (v, h) in enumerate(zip(vms, ("host1", "host2")), start=1):
        lab.vm(v, h, memory="256M", fill="64M", dirty="1M", seed=seed)
        ferry("disk", "attach", disk, v)
    time.sleep(5)
    before = {v: disk_line(v) for v in vms}
    kill_pidfile(f"{LAB}/control/storage.pid")
    time.sleep(2)
    ferry("lab", "restart", "storage")
    # writers resume once QEMU reconnects; allow it a while
    t0 = time.time()
    after = dict(before)
    while time.time() - t0 < 60:
        after = {v: disk_line(v) for v in vms}
        if all(after[v] and before[v] and after[v][0] > before[v][0] + 3 for v in vms):
            break
        time.sleep(1)
    where = lab.settle(vms)
    res = []
    for v in vms:
        # every error the guest's disk writer saw, before the fault too
        errs = after[v][1] if after[v] else -1
        if errs:
            print(f"  {v}: " + "; ".join(disk_errors_seen(v)), flush=True)
        # and it saw the other guest's block: both wrote through the restart
        progressed = bool(after[v] and before[v] and after[v][0] > before[v][0] and after[v][2])
        res.append((v, where[v], where[v], where[v], lab.check(v) and progressed, errs if errs >= 0 else 1))
    lab.rm(*vms)
    ferry("disk", "rm", disk, check=False)
    return res


HA_GUESTS = ["hab1", "hab2"]


def ha_failover(lab, trial, fault, during=None):
    """bench/ha.py's trial with two HA guests on host1; `during`, if given,
    runs alongside it (from the fault on)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import ha
    ha.GUESTS = HA_GUESTS
    side = threading.Thread(target=during, daemon=True) if during else None
    if side:
        side.start()
    times, lost, doubles = ha.trial(fault)
    if side:
        side.join(timeout=120)
    for d in doubles:
        print(f"  {d}", flush=True)
    res = []
    for g in HA_GUESTS:
        double = any(d.startswith(f"{g}:") for d in doubles)
        where = None if g in lost else "elsewhere"
        res.append((g, "host1", "elsewhere", where, not double, 0))
    return res


def leader_kill(lab, trial):
    ferry("lab", "control", "up", "--instances", "3")

    def kill_leader():
        t0 = time.time()
        while time.time() - t0 < 60:
            evs = fj("--control", "https://127.0.0.1:7701", "events", "--limit", "200")
            if any(e["kind"] == "host_failed" and e["subject"] == "host1" and e["at_ms"] / 1000 > t0 - 1
                   for e in evs):
                break
            time.sleep(0.2)
        leader = fj("--control", "https://127.0.0.1:7701", "cluster", "control")["leader"]
        n = int(leader.removeprefix("control"))
        kill_pidfile(f"{LAB}/control/control{'' if n == 1 else n}.pid")
        print(f"  leader {leader} killed", flush=True)
        time.sleep(1)
        ferry("lab", "restart", "control", "--instance", str(n))

    return ha_failover(lab, trial, "power-off", during=kill_leader)


def disk_line(vm):
    """(seq, errors, peers) of the newest FERRY-DISK line on the VM's console."""
    best = None
    for h in ("host1", "host2", "host3"):
        d = f"{LAB}/{h}/vms"
        for n in os.listdir(d) if os.path.isdir(d) else []:
            if n == vm or n.startswith(vm + "."):
                p = os.path.join(d, n, "console.log")
                try:
                    lines = [l for l in open(p, errors="replace") if l.startswith("FERRY-DISK ")]
                except OSError:
                    continue
                if lines:
                    f = dict(w.split("=", 1) for w in lines[-1].split() if "=" in w)
                    try:
                        best = (int(f.get("seq", 0)), int(f.get("errors", 0)), f.get("peers", ""))
                    except ValueError:
                        pass
    return best


def disk_errors_seen(vm):
    out = []
    for h in ("host1", "host2", "host3"):
        d = f"{LAB}/{h}/vms"
        for n in os.listdir(d) if os.path.isdir(d) else []:
            if n == vm or n.startswith(vm + "."):
                try:
                    out += [l.strip() for l in open(os.path.join(d, n, "console.log"), errors="replace")
                            if "FERRY-DISK-ERROR" in l or "I/O error" in l][:8]
                except OSError:
                    pass
    return out


FAULTS = {
    "src-agent-kill": lambda lab, t: agent_kill(lab, t, "src"),
    "tgt-agent-kill": lambda lab, t: agent_kill(lab, t, "tgt"),
    "tgt-qemu-kill": tgt_qemu_kill,
    "control-kill": control_kill,
    "nic-flap": nic_flap,
    "postcopy-cut": postcopy_cut,
    "storage-restart": storage_restart,
    "mgmt-cut": mgmt_cut,
    "host-power-off": lambda lab, t: ha_failover(lab, t, "power-off"),
    "host-isolate": lambda lab, t: ha_failover(lab, t, "isolation"),
    # last: it leaves the control service as three instances on etcd
    "leader-kill": leader_kill,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--only", default="")
    ap.add_argument("--rate", default="300mbit")
    a = ap.parse_args()
    names = [n for n in a.only.split(",") if n] or list(FAULTS)
    for n in names:
        if n not in FAULTS:
            sys.exit(f"no fault named '{n}' ({', '.join(FAULTS)})")
    lab = Lab(a.rate)
    table = {}
    for n in names:
        row = {"trials": 0, "completed": 0, "rolled_back": 0, "vms_lost": 0, "integrity_errors": 0,
               "disk_errors": 0, "guests": 0}
        for t in range(a.trials):
            try:
                results = FAULTS[n](lab, t)
            except Exception as e:  # a trial that could not run is reported, not hidden
                print(f"{n} trial {t + 1}: could not run: {e}", flush=True)
                row.setdefault("not_run", 0)
                row["not_run"] += 1
                continue
            row["trials"] += 1
            for vm, src, tgt, where, intact, disk_errors in results:
                row["guests"] += 1
                o = outcome(None, src, tgt, where)
                if n == "storage-restart":
                    o = "completed" if where not in (None, "twice", "unknown", "unsettled") else "lost"
                key = {"completed": "completed", "rolled back": "rolled_back", "lost": "vms_lost"}[o]
                row[key] += 1
                if o != "lost" and not intact:
                    row["integrity_errors"] += 1
                row["disk_errors"] += max(disk_errors, 0)
                print(f"{n} trial {t + 1}: {vm} {o} (on {where}), intact {bool(intact)}, "
                      f"disk errors {disk_errors}", flush=True)
        table[n] = row
    print()
    print(f"{'fault':16} {'trials':>6} {'guests':>6} {'completed':>9} {'rolled back':>11} "
          f"{'VMs lost':>8} {'integrity err':>13} {'disk err':>8}")
    for n, r in table.items():
        print(f"{n:16} {r['trials']:>6} {r['guests']:>6} {r['completed']:>9} {r['rolled_back']:>11} "
              f"{r['vms_lost']:>8} {r['integrity_errors']:>13} {r['disk_errors']:>8}"
              + (f"  ({r['not_run']} not run)" if r.get("not_run") else ""))
    print(json.dumps(table))
    bad = any(r["vms_lost"] or r["integrity_errors"] or r["disk_errors"] or r.get("not_run") for r in table.values())
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
