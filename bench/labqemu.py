"""Helpers the benchmarks share: the ferry CLI, sizes, CPU time of a process,
and QEMU started and driven by hand over QMP in a lab namespace (the same
command line, kernel, initramfs and workload as Ferry's guests)."""
import json, os, socket, subprocess, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_ferry():
    """The `ferry` binary a benchmark measures: $FERRY_BIN when set, else the release build
    (`cargo build --release -p ferry-cli`: what scripts/package installs), else the test build
    with a warning on stderr: the workspace's dev profile is `opt-level = 1`, and its relay, codecs
    and sealing are slower than what users run."""
    if os.environ.get("FERRY_BIN"):
        return os.environ["FERRY_BIN"]
    release = os.path.join(ROOT, "target", "release", "ferry")
    if os.path.exists(release):
        return release
    print("bench: no target/release/ferry; measuring the opt-level 1 test build target/debug/ferry "
          "(cargo build --release -p ferry-cli for figures users would see)", file=sys.stderr)
    return os.path.join(ROOT, "target", "debug", "ferry")


FERRY = default_ferry()

REPORTING = "/sys/module/page_reporting/parameters"


def reporting_passes():
    """The kernel's count of free page reporting passes, or None where it has no such count."""
    try:
        return int(open(f"{REPORTING}/passes").read())
    except (OSError, ValueError):
        return None


def settle_memory(min_secs, quiet=2.5, most=60.0):
    """Waits min_secs, then, on a machine that hands free memory back to its hypervisor (virtio-balloon
    free page reporting with a pass count), until no reporting pass has run for `quiet` seconds:
    until the kernel has handed back what it will of the memory freed before, so every move's
    target starts from the same state. Here a pass runs every ~2 s while there is memory to hand
    back, so a guest removed a moment ago leaves memory that a move's target touches tens of
    times faster than memory handed back (bench/first_touch.py). Returns the seconds waited."""
    t0 = time.time()
    time.sleep(min_secs)
    last, since = reporting_passes(), time.time()
    if last is None:
        return time.time() - t0
    while time.time() - since < quiet:
        if time.time() - t0 > most:
            print(f"bench: free page reporting still busy after {most:.0f} s; moving on", file=sys.stderr)
            break
        time.sleep(0.25)
        now = reporting_passes()
        if now != last:
            last, since = now, time.time()
    return time.time() - t0


TICK = os.sysconf("SC_CLK_TCK")


def ferry(*args):
    out = subprocess.run([FERRY, *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"ferry {' '.join(args)} failed: {out.stderr}")
    return out.stdout


_LINKS = None


def _links():
    global _LINKS
    if _LINKS is None:
        _LINKS = json.loads(ferry("lab", "status", "--json"))["links"]
    return _LINKS


def lab_nic(host, nic):
    """A lab host's own name for its NIC `nic` (`nicK` is the one on fabric K;
    host1's are ens1f0/ens1f1, host2's eth4/eth5, …; a real name is returned as is)."""
    if nic.startswith("nic") and nic[3:].isdigit():
        k = int(nic[3:])
        for l in _links():
            if l["host"] == host and l["fabric"] == k:
                return l["nic"]
        sys.exit(f"no NIC on fabric {k} on {host}")
    return nic


def nic_tx(host, nic):
    """Bytes a lab host's NIC (`nicK` or its own name) has transmitted."""
    out = subprocess.run(["ip", "-n", host, "-s", "-j", "link", "show", lab_nic(host, nic)],
                         capture_output=True, text=True)
    return json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"]


def lab_addr(host, k):
    """The address of a lab host's NIC on fabric `k`."""
    for l in _links():
        if l["host"] == host and l["fabric"] == k:
            return l["address"]
    sys.exit(f"no NIC on fabric {k} on {host}")


def size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1].upper(), 1)
    return int(float(s.rstrip("KMGkmg")) * mult)


def rate(s):
    return float(s.replace("gbit", "e9").replace("mbit", "e6"))


def cpu_seconds(pid):
    """User + system CPU time of a process (all its threads), or None once it is gone."""
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(f[11]) + int(f[12])) / TICK


def executable(path, option):
    """`path`, given by `option`, or exit naming both when it is not an executable."""
    if not os.access(path, os.X_OK):
        sys.exit(f"{option}: {path} is not an executable")
    return path


def builds_of(csv, option="--bins"):
    """The Ferry builds a bench compares (`A,B,…`), each checked to be an executable."""
    return [executable(b, option) for b in csv.split(",")]


def agent_pids(hosts):
    return [int(open(f"/run/ferry/lab/{h}/agent.pid").read().strip()) for h in hosts]


def context_switches(pid):
    """Voluntary and involuntary context switches of every thread of `pid`."""
    n = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            for line in open(f"/proc/{pid}/task/{t}/status"):
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    n += int(line.split()[1])
        except OSError:
            pass  # a thread that ended between the listing and the read
    return n


def thread_cpu_ns(pid):
    """{thread id: nanoseconds on a CPU} of every live thread of `pid`, from the scheduler's own
    clock (`/proc/PID/task/TID/schedstat`): exact, where /proc/PID/stat counts 10 ms ticks."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tids:
        try:
            out[t] = int(open(f"/proc/{pid}/task/{t}/schedstat").read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return out


def spent_since(pid, before):
    """CPU seconds `pid`'s threads spent since `before` (a `thread_cpu_ns` of it): a thread
    that ended meanwhile loses what it spent after `before`, one that started counts whole."""
    return sum(ns - before.get(t, 0) for t, ns in thread_cpu_ns(pid).items()) / 1e9


def agents_spend(run, hosts=("host1", "host2")):
    """Calls `run()`; returns its result, the CPU seconds each of `hosts`' agents spent over
    it (every thread, not their QEMUs) and their context switches in all."""
    pids = agent_pids(hosts)
    cpu0, sw0 = [thread_cpu_ns(p) for p in pids], [context_switches(p) for p in pids]
    r = run()
    cpu = [spent_since(p, c) for p, c in zip(pids, cpu0)]
    return r, cpu, sum(context_switches(p) - s for p, s in zip(pids, sw0))


def qemu_pids(hosts=("host1", "host2")):
    """Every QEMU running in the lab namespaces of `hosts`."""
    pids = []
    for h in hosts:
        for p in subprocess.run(["ip", "netns", "pids", h], capture_output=True, text=True).stdout.split():
            try:
                if open(f"/proc/{p}/comm").read().startswith("qemu-system"):
                    pids.append(int(p))
            except OSError:
                pass
    return pids


class Cpu:
    """CPU time of every QEMU and agent on `hosts` since it was made, by sampling
    (a process that ends keeps what was last sampled of it).

    The processes are listed when it is made and again at `total()`; `sample()`
    reads only /proc for those it knows. Listing them takes `ip netns pids`
    per host, and doing that at every sample (every 20 ms in a QEMU-by-hand
    move) cost ~1.2 CPU-s over a 5 s move on these 2 cores — taken from the
    contender being measured."""

    def __init__(self, hosts=("host1", "host2")):
        self.hosts = hosts
        self.base, self.last = {}, {}
        for p in qemu_pids(hosts) + agent_pids(hosts):
            self.base[p] = self.last[p] = cpu_seconds(p) or 0.0

    def sample(self):
        for p in self.last:
            c = cpu_seconds(p)
            if c is not None:
                self.last[p] = c

    def total(self):
        # a process started since: counted from 0
        for p in qemu_pids(self.hosts) + agent_pids(self.hosts):
            self.base.setdefault(p, 0.0)
            self.last.setdefault(p, 0.0)
        self.sample()
        return sum(self.last[p] - self.base[p] for p in self.last)


def wait_migration(q, poll=0.1, each=None):
    """Polls QMP `query-migrate` on the source until it ends; calls `each()`
    after every poll; returns the last answer."""
    while True:
        info = q.cmd("query-migrate")
        if each:
            each()
        if info.get("status") in ("completed", "failed", "cancelled"):
            return info
        time.sleep(poll)


class Qmp:
    def __init__(self, path, timeout=None):
        for _ in range(100):
            try:
                self.s = socket.socket(socket.AF_UNIX)
                self.s.connect(path)
                break
            except OSError:
                time.sleep(0.1)
        self.s.settimeout(timeout)
        self.f = self.s.makefile("rw")
        json.loads(self.f.readline())  # greeting
        self.cmd("qmp_capabilities")

    def cmd(self, command, **args):
        self.f.write(json.dumps({"execute": command, "arguments": args}) + "\n")
        self.f.flush()
        while True:
            msg = json.loads(self.f.readline())
            if "return" in msg:
                return msg["return"]
            if "error" in msg:
                raise RuntimeError(f"{command}: {msg['error']}")


def host_cpus(host):
    """The CPUs `ferry lab up --cpus` gave `host` (a CPU list), or None when it shares the machine's."""
    st = json.loads(ferry("lab", "status", "--json"))
    return next((a.get("cpus") for a in st["agents"] if a["host"] == host), None)


def qemu(ns, d, img, mem, fill, dirty, incoming, compressible=False):
    """Starts QEMU in namespace `ns` (`ip netns exec` execs it: the pid is QEMU's), on the CPUs
    the lab gave that host when it was brought up with --cpus (as the agent's QEMUs are), so a
    QEMU by hand borrows no other host's core either."""
    os.makedirs(d, exist_ok=True)
    # the agent's own argument builder: the baseline runs the very QEMU a Ferry move runs
    spec = {"name": "bench", "memory": mem, "fill": fill, "dirty_rate": dirty, "verify_rate": 32 << 20, "seed": 1,
            "compressible": compressible}
    built = ferry("qemu-args", "--spec", json.dumps(spec), "--dir", d, *(["--incoming"] if incoming else []))
    cpus = host_cpus(ns)
    pin = ["taskset", "-c", cpus] if cpus else []
    args = ["ip", "netns", "exec", ns, *pin, *json.loads(built)]
    p = subprocess.Popen(args, stderr=open(f"{d}/qemu.log", "w"))
    q = Qmp(f"{d}/qmp.sock")
    if not incoming:
        q.cmd("cont")  # the agent's command line starts every guest paused (-S)
    return p, q


def run_target(q):
    """Starts a skeleton's guest (started paused, `-S`, as an agent's) once its
    migration has loaded, as an agent does at the commit; waits until it runs."""
    while q.cmd("query-migrate").get("status") != "completed":
        time.sleep(0.005)
    q.cmd("cont")
    while q.cmd("query-status")["status"] != "running":
        time.sleep(0.005)


def wait_ready(console):
    for _ in range(600):
        if os.path.exists(console) and "FERRY tick=" in open(console).read():
            return
        time.sleep(0.1)
    sys.exit("guest did not start its workload")


def add_cpus_option(ap, default=""):
    """`--cpus` for a bench that brings a lab up: each lab host's agent and QEMUs (and a QEMU by
    hand started with `qemu`, which reads the lab's sets) on CPUs of its own."""
    ap.add_argument("--cpus", default=default,
                    help="`ferry lab up --cpus`: split, or host1=0,host2=1 (default: hosts share the machine's CPUs)")


def cpus_flag(a):
    """The `ferry lab up` arguments for a bench's `--cpus`."""
    return ["--cpus", a.cpus] if a.cpus else []
