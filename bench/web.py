#!/usr/bin/python3
"""The web console's weight, its time to first render, and whether it keeps up with a big
cluster: 20 hosts and 200 VMs.

1. Brings up a 2-host lab with one VM and reads, through the control service's REST API,
   what a real agent reports (`/api/v1/hosts` → each host's `info`, `/api/v1/vms`,
   `/api/v1/bandwidth`).
2. Takes the lab down and starts 20 stand-in agents on 127.0.0.1 (one thread each): every
   one answers `/host`, `/vms` and `/bandwidth` with those reports renamed (host01…host20,
   10 VMs each: vm001…vm200), its NIC counters advancing at a few hundred Mbit/s so the
   graphs move. A control service (`ferry control`, insecure HTTP on 127.0.0.1:7797) is
   configured with the 20 hosts and reads them as it reads real agents.
3. Headless Chromium (Selenium) loads the console with an empty cache: the page's weight
   (bytes transferred, as sent and as decoded, from the Resource Timing API), first
   contentful paint; signs in; time until all 200 VMs and 20 host graphs are drawn; then
   30 s of the console running (hosts pushed every second, the VM and event tables redrawn
   every 3 s): the interval between animation frames (median, p95, p99, worst) and the
   long tasks (> 50 ms) the main thread ran. Then the page loaded again with a warm cache.

    sudo /usr/bin/python3 bench/web.py [--seconds 30]
"""
import argparse, copy, json, os, statistics, subprocess, sys, tempfile, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from labqemu import FERRY, ferry  # noqa: E402

HOSTS, PER_HOST, PORT0, CONTROL = 20, 10, 7820, 7797


def api(path, token):
    out = subprocess.run(["curl", "-sk", "--fail", "-H", f"Authorization: Bearer {token}",
                          f"https://127.0.0.1:7700{path}"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"GET {path}: {out.stderr}")
    return json.loads(out.stdout)


def capture():
    """What a real agent reports, read through the lab's control service."""
    ferry("lab", "up", "--replace", "--hosts", "2", "--nics", "2")
    ferry("vm", "create", "sample", "--host", "host1", "--memory", "256M", "--fill", "64M")
    token = open("/run/ferry/lab/admin.token").read().strip()
    time.sleep(2)
    hosts = api("/api/v1/hosts", token)
    vms = api("/api/v1/vms", token)
    bw = api("/api/v1/bandwidth", token)
    ferry("vm", "rm", "sample")
    ferry("lab", "down")
    info = next(h["info"] for h in hosts if h["name"] == "host1" and h.get("info"))
    vm = next(v for v in vms if v["name"] == "sample")
    band = next(h for h in bw["hosts"] if h["host"] == "host1")
    return info, vm, band


def rename(value, old, new):
    """`value` with every string equal to or containing `old` renamed."""
    if isinstance(value, dict):
        return {k: rename(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [rename(v, old, new) for v in value]
    if isinstance(value, str):
        return value.replace(old, new)
    return value


def stand_in(index, info, vm, band, t0):
    name = f"host{index + 1:02d}"
    host_info = rename(info, "host1", name)
    vms = []
    for k in range(PER_HOST):
        v = rename(vm, "host1", name)
        v = rename(v, "sample", f"vm{index * PER_HOST + k + 1:03d}")
        vms.append(v)

    def counters(value, secs):
        """NIC byte counters advancing at 100–400 Mbit/s, per host and NIC."""
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if k in ("tx_bytes", "rx_bytes") and isinstance(v, int):
                    out[k] = v + int(secs * (100 + 15 * index) * 1e6 / 8)
                else:
                    out[k] = counters(v, secs)
            return out
        if isinstance(value, list):
            return [counters(v, secs) for v in value]
        return value

    class Agent(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            path = self.path.split("?")[0].removeprefix("/api/v1")
            now = time.time() - t0
            if path == "/host":
                body = counters(host_info, now)
            elif path == "/vms":
                body = vms
            elif path == "/bandwidth":
                body = counters(rename(band, "host1", name), now)
            else:
                self.send_response(404)
                body = {"code": "not_found", "message": f"{path}: not on this stand-in agent"}
                data = json.dumps(body).encode()
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = ThreadingHTTPServer(("127.0.0.1", PORT0 + index), Agent)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return name, srv


PERF = """
const nav = performance.getEntriesByType('navigation')[0];
// the page's own files (API calls made once signed in are counted apart)
const res = performance.getEntriesByType('resource').filter(e => new URL(e.name).pathname.startsWith('/ui/'));
const all = [nav, ...res];
const fcp = performance.getEntriesByType('paint').find(p => p.name === 'first-contentful-paint');
return {
  transferred: all.reduce((a, e) => a + e.transferSize, 0),
  encoded: all.reduce((a, e) => a + e.encodedBodySize, 0),
  decoded: all.reduce((a, e) => a + e.decodedBodySize, 0),
  files: all.map(e => [e.name.replace(location.origin, ''), e.transferSize, e.decodedBodySize]),
  fcp: fcp ? fcp.startTime : null,
  loaded: nav.loadEventEnd,
};
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=30)
    a = ap.parse_args()
    info, vm, band = capture()
    t0 = time.time()
    agents = [stand_in(i, info, vm, band, t0) for i in range(HOSTS)]
    d = tempfile.mkdtemp(prefix="ferry-web-bench-")
    token, cred = os.path.join(d, "admin.token"), os.path.join(d, "cluster.token")
    open(token, "w").write("ferry_" + os.urandom(16).hex() + "\n")
    open(cred, "w").write(os.urandom(32).hex() + "\n")
    hosts = "\n".join(f'{n} = "http://127.0.0.1:{PORT0 + i}"' for i, (n, _) in enumerate(agents))
    conf = os.path.join(d, "control.toml")
    open(conf, "w").write(f'listen = "127.0.0.1:{CONTROL}"\nstate = "{d}/state.db"\nadmin_token = "{token}"\n'
                          f'credential = "{cred}"\ninsecure_http = true\n[hosts]\n{hosts}\n')
    control = subprocess.Popen([FERRY, "control", "--config", conf], stdout=subprocess.DEVNULL,
                               stderr=open(os.path.join(d, "control.log"), "w"))
    opts = Options()
    for o in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,800"):
        opts.add_argument(o)
    opts.binary_location = "/usr/bin/chromium"
    drv = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    try:
        time.sleep(1.5)
        url = f"http://127.0.0.1:{CONTROL}/"
        drv.get(url)
        time.sleep(1)
        cold = drv.execute_script(PERF)
        t_sign = time.time()
        drv.find_element(By.ID, "token").send_keys(open(token).read().strip())
        drv.find_element(By.ID, "sign-in").click()
        drawn = None
        while time.time() - t_sign < 30:
            rows = drv.execute_script("return document.querySelectorAll('#vms tbody tr').length")
            graphs = drv.execute_script("return document.querySelectorAll('#hosts canvas').length")
            if rows >= HOSTS * PER_HOST and graphs >= HOSTS:
                drawn = time.time() - t_sign
                break
            time.sleep(0.05)
        if drawn is None:
            sys.exit(f"the console never showed {HOSTS * PER_HOST} VMs and {HOSTS} graphs "
                     f"(rows {rows}, graphs {graphs})")
        drv.execute_script("""
            window.__frames = []; let last = performance.now();
            const f = t => { window.__frames.push(t - last); last = t; requestAnimationFrame(f); };
            requestAnimationFrame(f);
            window.__long = [];
            new PerformanceObserver(l => { for (const e of l.getEntries()) window.__long.push(e.duration); })
              .observe({type: 'longtask'});
            window.__api0 = performance.getEntriesByType('resource').length;
        """)
        time.sleep(a.seconds)
        frames = drv.execute_script("return window.__frames")
        longs = drv.execute_script("return window.__long")
        api_bytes = drv.execute_script(
            "return performance.getEntriesByType('resource').slice(window.__api0)"
            ".reduce((a, e) => a + e.transferSize, 0)")
        drv.get(url)
        time.sleep(1)
        warm = drv.execute_script(PERF)
    finally:
        drv.quit()
        control.terminate()
        control.wait()
        for _, srv in agents:
            srv.shutdown()
    frames.sort()
    q = lambda p: frames[min(len(frames) - 1, int(p * len(frames)))]
    print(f"console with {HOSTS} hosts and {HOSTS * PER_HOST} VMs, headless Chromium, 1280×800\n")
    print("| load | bytes transferred | bytes decoded | first contentful paint | load event |")
    print("|---|---|---|---|---|")
    for what, p in (("first (empty cache)", cold), ("again (cached)", warm)):
        print(f"| {what} | {p['transferred'] / 1024:.1f} KiB | {p['decoded'] / 1024:.1f} KiB | "
              f"{p['fcp']:.0f} ms | {p['loaded']:.0f} ms |")
    print("\nfiles on the first load (path, transferred, decoded):")
    for name, t, dec in cold["files"]:
        print(f"- `{name}` {t} B, {dec} B")
    print(f"\nsigned in → {HOSTS * PER_HOST} VM rows and {HOSTS} host graphs drawn: {drawn * 1000:.0f} ms")
    print(f"\n{a.seconds} s running ({len(frames)} frames): frame interval median {statistics.median(frames):.1f} ms, "
          f"p95 {q(0.95):.1f} ms, p99 {q(0.99):.1f} ms, worst {frames[-1]:.1f} ms; "
          f"long tasks (> 50 ms): {len(longs)}"
          + (f", longest {max(longs):.0f} ms" if longs else "")
          + f"; API and pushed bytes {api_bytes / 1024 / a.seconds:.1f} KiB/s")


if __name__ == "__main__":
    main()
