#!/usr/bin/python3
"""Browser test of the control service's web page, in headless Chromium
driven over WebDriver (Selenium + chromium-driver): open the page, start a
move with its button, watch the per-NIC graph of the source host rise while
the VM moves over both NICs, see the move finish, and keep a screenshot.

Needs root (a lab), QEMU and chromium; run by `scripts/run test` after the
cargo tests. Screenshot: target/artifacts/web-move.png.

    sudo /usr/bin/python3 tests/browser/web_move.py
"""
import json, os, subprocess, sys, time

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FERRY = os.environ.get("FERRY_BIN", os.path.join(ROOT, "target", "debug", "ferry"))
ART = os.path.join(ROOT, "target", "artifacts")


def ferry(*args):
    out = subprocess.run([FERRY, *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"FAIL: ferry {' '.join(args)}: {out.stderr}")
    return out.stdout


def wait(what, cond, timeout):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = cond()
        if v:
            return v
        time.sleep(0.25)
    sys.exit(f"FAIL: {what} within {timeout} s")


def main():
    os.makedirs(ART, exist_ok=True)
    # links slow enough that the move lasts several seconds of graph
    ferry("lab", "up", "--replace", "--hosts", "2", "--nics", "2", "--rate", "300mbit")
    ferry("vm", "create", "web1", "--host", "host1", "--memory", "512M", "--fill", "384M")
    token = open("/run/ferry/lab/admin.token").read().strip()
    # the browser trusts the control service's own certificate (pinned by
    # its key), as an administrator's browser would once the CA is imported
    spki = subprocess.run(
        "openssl x509 -pubkey -noout -in /run/ferry/lab/pki/control/cert.pem"
        " | openssl pkey -pubin -outform der | openssl dgst -sha256 -binary | base64",
        shell=True, check=True, capture_output=True, text=True).stdout.strip()
    # host1's NICs by their own names (the lab names them as hardware would)
    links = json.loads(ferry("lab", "status", "--json"))["links"]
    keys = [f"host1/{l['nic']}" for l in links if l["host"] == "host1"]
    opts = Options()
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1200",
              f"--ignore-certificate-errors-spki-list={spki}"):
        opts.add_argument(a)
    opts.binary_location = "/usr/bin/chromium"
    d = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    try:
        d.get(f"https://127.0.0.1:7700/#token={token}")
        wait("the page polls the API", lambda: d.execute_script("return window.ferry.polls") >= 3, 20)
        wait("a graph per host", lambda: len(d.find_elements(By.CSS_SELECTOR, "#host-host1 canvas")) > 0, 10)
        rates = lambda: d.execute_script("return window.ferry.peakRates")
        idle = max(rates().get(k, 0) for k in keys)
        Select(d.find_element(By.ID, "to-web1")).select_by_value("host2")
        d.find_element(By.ID, "move-web1").click()
        wait("the move to finish", lambda: d.execute_script("return (window.ferry.moves.web1 || {}).done"), 180)
        events = d.execute_script("return window.ferry.moves.web1.events")
        last = events[-1]
        if last.get("event") != "completed":
            sys.exit(f"FAIL: the move did not complete: {json.dumps(last)[:500]}")
        status = d.find_element(By.ID, "move-status").text
        if "moved to host2" not in status:
            sys.exit(f"FAIL: the page does not say the move finished: {status!r}")
        time.sleep(2)
        peak = rates()
        busy = {k: peak.get(k, 0) for k in keys}
        # the graph saw both NICs carry the move (multichannel), well above idle
        for k, v in busy.items():
            if v < 50 or v < 5 * max(idle, 1):
                sys.exit(f"FAIL: {k} peaked at {v:.0f} Mbit/s during the move (idle {idle:.1f})")
        shot = os.path.join(ART, "web-move.png")
        d.save_screenshot(shot)
        if os.path.getsize(shot) < 10_000:
            sys.exit("FAIL: the screenshot is empty")
        check = json.loads(ferry("vm", "check", "web1", "--json"))
        if check["host"] != "host2" or not check["intact"]:
            sys.exit(f"FAIL: web1 after the move: {check}")
        print(f"ok: web page moved web1 to host2; NIC peaks {', '.join(f'{k} {v:.0f} Mbit/s' for k, v in busy.items())}; "
              f"screenshot {shot}")
    finally:
        d.quit()
        subprocess.run([FERRY, "vm", "rm", "web1"], capture_output=True)


if __name__ == "__main__":
    main()
