"""Helpers the benchmarks share: the ferry CLI, sizes, CPU time of a process,
and QEMU started and driven by hand over QMP in a lab namespace (the same
command line, kernel, initramfs and workload as Ferry's guests)."""
import json, os, socket, subprocess, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FERRY = os.environ.get("FERRY_BIN", os.path.join(ROOT, "target", "debug", "ferry"))
TICK = os.sysconf("SC_CLK_TCK")


def ferry(*args):
    out = subprocess.run([FERRY, *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"ferry {' '.join(args)} failed: {out.stderr}")
    return out.stdout


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


def agent_pids(hosts):
    return [int(open(f"/run/ferry/lab/{h}/agent.pid").read().strip()) for h in hosts]


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

    def cmd(self, name, **args):
        self.f.write(json.dumps({"execute": name, "arguments": args}) + "\n")
        self.f.flush()
        while True:
            msg = json.loads(self.f.readline())
            if "return" in msg:
                return msg["return"]
            if "error" in msg:
                raise RuntimeError(f"{name}: {msg['error']}")


def qemu(ns, d, img, mem, fill, dirty, incoming):
    """Starts QEMU in namespace `ns` (`ip netns exec` execs it: the pid is QEMU's)."""
    os.makedirs(d, exist_ok=True)
    args = ["ip", "netns", "exec", ns, "qemu-system-x86_64", "-name", "guest=bench", "-machine", "q35",
            "-accel", "tcg", "-cpu", "qemu64", "-smp", "1", "-m", f"{mem >> 20}M", "-nodefaults",
            "-no-user-config", "-display", "none", "-kernel", f"{img}/vmlinux", "-initrd", f"{img}/initrd.cpio",
            "-append", f"console=ttyS0 quiet ferry.fill={fill} ferry.dirty={dirty} ferry.verify={32 << 20} ferry.seed=1",
            "-chardev", f"file,id=con0,path={d}/console.log", "-serial", "chardev:con0",
            "-qmp", f"unix:{d}/qmp.sock,server=on,wait=off"]
    if incoming:
        args += ["-incoming", "defer"]
    p = subprocess.Popen(args, stderr=open(f"{d}/qemu.log", "w"))
    return p, Qmp(f"{d}/qmp.sock")


def wait_ready(console):
    for _ in range(600):
        if os.path.exists(console) and "FERRY tick=" in open(console).read():
            return
        time.sleep(0.1)
    sys.exit("guest did not start its workload")
