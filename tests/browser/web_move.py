#!/usr/bin/python3
"""Browser test of the control service's web page, in headless Chromium
driven over WebDriver (Selenium + chromium-driver): sign in as an operator
with the sign-in form (the token never in a URL, the session cookie out of
the page's reach), start a move with its button, watch the per-NIC graph of
the source host rise while the VM moves over both NICs, see the move finish;
sign out, sign in as a read-only user, see the buttons disabled and a
request forged from the page refused (403 without the CSRF token, 403 for
the role with it); a disk made, given a QoS policy, grown and deleted from the page; events as sentences;
validate the hosts (a row per check, host and NIC);
create a VM from the page's form (a refused spec shows
the server's reason) and remove it from its row (confirmed); on a phone-sized screen (390 px) nothing reaches past
its edge; keep a screenshot of each page.

Needs root (a lab), QEMU and chromium; run by `scripts/run test` after the
cargo tests. Screenshots: target/artifacts/web-*.png.

    sudo /usr/bin/python3 tests/browser/web_move.py
"""
import json, os, subprocess, sys, time

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AXE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vendor", "axe-core-4.14.1", "axe.min.js")
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
    operator = json.loads(ferry("token", "create", f"web-op-{os.getpid()}", "--role", "operator", "--json"))["token"]
    reader = json.loads(ferry("token", "create", f"web-ro-{os.getpid()}", "--role", "read-only", "--json"))["token"]
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
    def sign_in(token):
        wait("the sign-in form", lambda: d.find_element(By.ID, "login").is_displayed(), 10)
        d.find_element(By.ID, "token").send_keys(token)
        d.find_element(By.ID, "sign-in").click()
        wait("the console after signing in", lambda: d.find_element(By.ID, "console").is_displayed(), 10)
        if token in d.current_url or token in d.page_source:
            sys.exit("FAIL: the token is in the URL or the page")
        if "ferry_session" in d.execute_script("return document.cookie"):
            sys.exit("FAIL: the session cookie is readable by the page (not HttpOnly)")

    def accessible(page):
        """axe-core on the page as it is: no serious or critical violation."""
        if not d.execute_script("return !!window.axe"):
            d.execute_script(open(AXE).read())
        found = d.execute_async_script("""
            const done = arguments[0];
            axe.run(document).then(r => done(r.violations.map(v => [v.id, v.impact, v.nodes.length, v.help])));
        """)
        bad = [v for v in found if v[1] in ("serious", "critical")]
        if bad:
            sys.exit(f"FAIL: accessibility of the {page}: {bad}")
        return len(found)

    def forged(csrf):
        """A changing request made by the page's own script, as a forged one would be."""
        return d.execute_async_script("""
            const [csrf, done] = arguments;
            const h = {"Content-Type": "application/json"};
            if (csrf) h["X-Ferry-CSRF"] = window.ferry.session.csrf;
            fetch("/api/v1/hosts/host1/resume", {method: "POST", headers: h, credentials: "same-origin"})
              .then(async r => done([r.status, (await r.json()).code]));
        """, csrf)

    try:
        d.get("https://127.0.0.1:7700/")
        wait("the sign-in form", lambda: d.find_element(By.ID, "login").is_displayed(), 10)
        d.save_screenshot(os.path.join(ART, "web-sign-in.png"))
        minor = accessible("sign-in page")
        sign_in(operator)
        role = d.execute_script("return window.ferry.session.role")
        if role != "operator":
            sys.exit(f"FAIL: signed in as {role}, not operator")
        wait("the page polls the API", lambda: d.execute_script("return window.ferry.polls") >= 3, 20)
        wait("a graph per host", lambda: len(d.find_elements(By.CSS_SELECTOR, "#host-host1 canvas")) > 0, 10)
        minor += accessible("console")
        rates = lambda: d.execute_script("return window.ferry.peakRates")
        idle = max(rates().get(k, 0) for k in keys)
        # the move's options as the CLI's flags: Ferry's carriers, 500 ms at most
        Select(d.find_element(By.ID, "move-option")).select_by_value("multichannel")
        d.find_element(By.ID, "move-downtime").send_keys("500")
        Select(d.find_element(By.ID, "to-web1")).select_by_value("host2")
        d.find_element(By.ID, "move-web1").click()
        wait("the move to finish", lambda: d.execute_script("return (window.ferry.moves.web1 || {}).done"), 180)
        events = d.execute_script("return window.ferry.moves.web1.events")
        last = events[-1]
        if last.get("event") != "completed":
            sys.exit(f"FAIL: the move did not complete: {json.dumps(last)[:500]}")
        if (last.get("option"), last.get("max_downtime_ms")) != ("multichannel", 500):
            sys.exit(f"FAIL: the move's options did not reach it: option {last.get('option')}, "
                     f"max downtime {last.get('max_downtime_ms')} ms")
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
        # the report the page showed is the API's: its downtime is the move's
        downtime = f"downtime {last.get('guest_downtime_ms') or last.get('downtime_ms')} ms"
        shown = d.find_element(By.ID, "move-status").text
        if downtime not in shown:
            sys.exit(f"FAIL: the page's downtime is not the report's: {shown!r} vs {json.dumps(last)[:300]}")
        # the migration's panel: the round, transfer against dirtying, each step, then the report
        report = wait("the migration's report", lambda: d.execute_script("return window.ferry.lastReport"), 10)
        if downtime not in report or "the links' ideal" not in report:
            sys.exit(f"FAIL: the migration report on the page: {report!r}")
        steps = [li.text for li in d.find_elements(By.CSS_SELECTOR, "#migration-steps li")]
        facts = d.find_element(By.ID, "migration-facts").text
        if not any(s.startswith("commit") for s in steps) or "dirtying" not in facts or "round" not in facts:
            sys.exit(f"FAIL: the migration panel: steps {steps}, facts {facts!r}")
        d.save_screenshot(os.path.join(ART, "web-migration.png"))
        # the NIC graphs were pushed (Server-Sent Events), not polled
        if d.execute_script("return window.ferry.pushes || 0") < 3:
            sys.exit("FAIL: no host updates pushed to the page")

        # a drain from its button: every move listed, each reaching done, the limit and why shown
        d.find_element(By.ID, "drain-host2").click()
        wait("the drain to finish", lambda: d.execute_script("return (window.ferry.drain || {}).done"), 180)
        drained = d.execute_script(
            "return Object.values(window.ferry.drain.moves).map(m => [m.vm, m.state])")
        rows = d.find_elements(By.CSS_SELECTOR, "#drain-moves tbody tr")
        if not drained or any(state != "done" for _, state in drained) or len(rows) != len(drained):
            sys.exit(f"FAIL: the drain's moves as the page shows them: {drained}")
        caption = d.find_element(By.ID, "drain-limit").text
        if "at once" not in caption:
            sys.exit(f"FAIL: the page does not show the drain's limit and why: {caption!r}")
        d.save_screenshot(os.path.join(ART, "web-drain.png"))
        d.find_element(By.ID, "resume-host2").click()
        wait("host2 taking VMs again", lambda: not any(
            h["name"] == "host2" and h.get("draining") for h in json.loads(ferry("host", "list", "--json"))), 15)

        # a QoS policy made from the page's form; a bad one refused with the server's reason; deleted
        def policy_rows():
            # read in one go: the table is drawn anew every 3 s
            return d.execute_script("return [...document.querySelectorAll('#policies tbody tr')].map(r => r.innerText)")

        def make_policy(name, lo, hi):
            for field, value in (("policy-name", name), ("policy-min", lo), ("policy-max", hi)):
                box = d.find_element(By.ID, field)
                box.clear()
                box.send_keys(str(value))
            d.find_element(By.ID, "policy-create").click()

        make_policy("webgold", 100, 500)
        wait("the new policy listed", lambda: any(r.startswith("webgold") for r in policy_rows()), 15)
        make_policy("webbad", 900, 500)
        bad = wait("the bad policy's reason", lambda: "min_iops" in d.find_element(By.ID, "policy-status").text
                   and d.find_element(By.ID, "policy-status").text, 10)
        if any(r.startswith("webbad") for r in policy_rows()):
            sys.exit(f"FAIL: a policy with min above max was made: {bad}")
        # a disk made from the page, given that policy from its row, grown by 1 GiB, deleted (confirmed)
        def disk_rows():
            return d.execute_script(
                "return [...document.querySelectorAll('#disks tbody tr')].map(r => [...r.cells].map(c => c.innerText))")
        d.find_element(By.ID, "disk-name").send_keys("webdisk")
        d.find_element(By.ID, "disk-create").click()
        wait("the new disk listed", lambda: any(r[0] == "webdisk" and r[6] == "primary" for r in disk_rows()), 15)
        d.execute_script("const s = document.getElementById('disk-policy-webdisk');"
                         "s.value = 'webgold'; s.dispatchEvent(new Event('change'))")
        wait("the disk's policy set", lambda: "policy webgold" in d.find_element(By.ID, "disk-status").text, 10)
        d.execute_script("document.getElementById('disk-grow-webdisk').click()")
        wait("the disk grown", lambda: any(r[0] == "webdisk" and r[2] == "2048 MiB" for r in disk_rows()), 15)
        disk = next(x for x in json.loads(ferry("disk", "list", "--json")) if x["name"] == "webdisk")
        if (disk["size"], disk["policy"]) != (2 << 30, "webgold"):
            sys.exit(f"FAIL: the disk after the page's changes: {disk}")
        d.save_screenshot(os.path.join(ART, "web-storage.png"))
        d.execute_script("document.getElementById('disk-delete-webdisk').click()")
        d.switch_to.alert.accept()
        wait("the disk gone", lambda: not any(r[0] == "webdisk" for r in disk_rows()), 15)
        # clicked in the page itself: the table may be drawn anew between a find and a click
        d.execute_script("document.getElementById('policy-delete-webgold').click()")
        wait("the policy gone", lambda: not any(r.startswith("webgold") for r in policy_rows()), 15)
        # events filtered by kind: only that kind shown
        Select(d.find_element(By.ID, "event-kind")).select_by_value("session")
        kinds = set(d.execute_script(
            "return [...document.querySelectorAll('#events tbody tr')].map(r => r.children[1].innerText)"))
        if kinds != {"session"}:
            sys.exit(f"FAIL: events filtered by kind 'session' show {kinds}")
        # events read as sentences, the detail folded under them
        Select(d.find_element(By.ID, "event-kind")).select_by_value("migration")
        lines = wait("the move in the events", lambda: [t for t in d.execute_script(
            "return [...document.querySelectorAll('#events tbody summary')].map(s => s.textContent)")
            if t.startswith("web1 moved host1 → host2 in ")], 10)
        if "downtime" not in lines[0]:
            sys.exit(f"FAIL: the move's event does not read as a sentence: {lines[0]!r}")
        Select(d.find_element(By.ID, "event-kind")).select_by_value("")

        # the checklist from the page: a row per check, host and NIC, with what was seen
        d.find_element(By.ID, "validate").click()
        said = wait("validation results", lambda: (d.find_element(By.ID, "validate-status").text
                                                   if "passed" in d.find_element(By.ID, "validate-status").text
                                                   else None), 60)
        checks = d.execute_script(
            "return [...document.querySelectorAll('#checks tbody tr')].map(r => [...r.cells].map(c => c.textContent))")
        hosts_checked = {c[2] for c in checks}
        if not {"host1", "host2"} <= hosts_checked or any(not c[0] or not c[5] for c in checks):
            sys.exit(f"FAIL: validation rows: {checks[:5]} ({said})")
        if not any(c[3] for c in checks):
            sys.exit(f"FAIL: no check names a NIC: {checks[:5]}")
        minor += accessible("validation results")

        # an operator creates a VM from the page (the workload guest, 256 MiB, on host2) ...
        d.execute_script("document.getElementById('vm-create-box').open = true")
        created = d.find_element(By.ID, "vm-create-status")
        def create(name, spec):
            d.find_element(By.ID, "vm-name").clear()
            d.find_element(By.ID, "vm-name").send_keys(name)
            Select(d.find_element(By.ID, "vm-host")).select_by_value("host2")
            d.find_element(By.ID, "vm-memory").clear()
            d.find_element(By.ID, "vm-memory").send_keys("256")
            d.find_element(By.ID, "vm-spec").clear()
            d.find_element(By.ID, "vm-spec").send_keys(spec)
            d.find_element(By.ID, "vm-create-btn").click()
            return wait(f"{name}'s creation answered", lambda: (created.text if "creat" in created.text
                                                               and "…" not in created.text else None), 90)
        said = create("web2", '{"fill": 33554432}')
        if said != "web2 created on host2":
            sys.exit(f"FAIL: creating web2 from the page: {said!r}")
        wait("web2 in the table", lambda: d.find_elements(By.ID, "remove-web2"), 15)
        # ... and a spec the server refuses shows the server's reason
        said = create("web3", '{"no_such_field": 1}')
        if "not created" not in said or "no_such_field" not in said:
            sys.exit(f"FAIL: a refused spec's reason is not shown: {said!r}")
        d.save_screenshot(os.path.join(ART, "web-create.png"))

        # an operator stops and removes a VM from its row, confirming once
        wait("web2's Remove button", lambda: d.find_elements(By.ID, "remove-web2"), 15)
        d.execute_script("document.getElementById('remove-web2').click()")
        alert = d.switch_to.alert
        if "web2" not in alert.text:
            sys.exit(f"FAIL: the confirmation does not name the VM: {alert.text!r}")
        alert.accept()
        wait("web2 gone from the table", lambda: not d.find_elements(By.ID, "remove-web2"), 20)
        if any(v["name"] == "web2" for v in json.loads(ferry("vm", "list", "--json"))):
            sys.exit("FAIL: web2 is still a VM after Remove")

        # a read-only user: every changing button disabled, the server refuses anyway
        d.find_element(By.ID, "sign-out").click()
        wait("the sign-in form after signing out", lambda: d.find_element(By.ID, "login").is_displayed(), 10)
        sign_in(reader)
        wait("the VM table", lambda: d.find_elements(By.ID, "move-web1"), 15)
        wait("the host cards", lambda: d.find_elements(By.CSS_SELECTOR, "#host-host1 button"), 15)
        # read in one go: the VM table is drawn anew every 3 s
        buttons = d.execute_script(
            "return [...document.querySelectorAll('#vms button, .host button, #policy-create, #vm-create-btn, #validate, #disk-create')]"
            ".map(b => [b.getAttribute('aria-label') || b.textContent, b.disabled])")
        enabled = [label for label, disabled in buttons if not disabled]
        if not buttons or enabled:
            sys.exit(f"FAIL: a read-only user has enabled buttons: {enabled} of {len(buttons)}")
        no_csrf, with_csrf = forged(False), forged(True)
        if no_csrf != [403, "refused"] or with_csrf != [403, "forbidden"]:
            sys.exit(f"FAIL: forged requests were not refused: without CSRF {no_csrf}, with it {with_csrf}")
        d.save_screenshot(os.path.join(ART, "web-read-only.png"))
        minor += accessible("read-only console")

        # a phone-sized screen: the page reflows, never scrolls sideways (wide
        # tables scroll in their own box), the graphs fit, the controls stay reachable
        d.set_window_size(390, 844)
        d.refresh()
        wait("the console on a phone", lambda: d.find_element(By.ID, "console").is_displayed(), 15)
        wait("the VM table on a phone", lambda: d.find_elements(By.ID, "move-web1"), 15)
        wait("a graph per host on a phone", lambda: d.find_elements(By.CSS_SELECTOR, "#host-host1 canvas"), 15)
        time.sleep(1)
        layout = d.execute_script("""
            const vw = document.documentElement.clientWidth;
            const wide = [...document.querySelectorAll('canvas, input, select, button, table')]
              .filter(e => e.offsetParent && !e.closest('.scroll'))
              .filter(e => e.getBoundingClientRect().right > vw + 1)
              .map(e => e.id || e.tagName);
            return {vw, page: document.documentElement.scrollWidth, wide};
        """)
        if layout["page"] > layout["vw"] + 1 or layout["wide"]:
            sys.exit(f"FAIL: on a 390 px screen the page is {layout['page']} px wide, past the edge: {layout['wide']}")
        d.find_element(By.ID, "move-web1").location_once_scrolled_into_view
        d.save_screenshot(os.path.join(ART, "web-phone.png"))
        minor += accessible("console on a phone")
        print(f"ok: web page moved web1 to host2; NIC peaks {', '.join(f'{k} {v:.0f} Mbit/s' for k, v in busy.items())}; "
              f"read-only user: {len(buttons)} buttons disabled, forged requests {no_csrf[0]}/{with_csrf[0]}; "
              f"a 390 px screen: nothing past its edge; "
              f"axe-core: no serious violation ({minor} minor or moderate); "
              f"screenshots in {ART}")
    finally:
        d.quit()
        for vm in ("web1", "web2", "web3"):
            subprocess.run([FERRY, "vm", "rm", vm], capture_output=True)
        subprocess.run([FERRY, "disk", "rm", "webdisk"], capture_output=True)


if __name__ == "__main__":
    main()
