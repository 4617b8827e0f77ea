#!/usr/bin/python3
"""Browser test of the control service's web console, in headless Chromium
driven over WebDriver (Selenium + chromium-driver): sign in as an operator
with the sign-in form (the token never in a URL, the session cookie out of
the page's reach); start a move with its button and follow it on its own
page (#/operation/ID) — the per-NIC graph of the source rises on both NICs,
the report's downtime is the API's, and the page reloaded after the end
rebuilds the same report from the operation; drain a host from its card
and see every move reach done on the drain's page; the list of migrations
and drains; a VM's page with its moves and its console's end; a host's
page with its NICs and its own checks; storage: policies made, edited and
refused with the server's reason, a disk made, given a policy, grown,
attached to a running VM and its flow's IOPS (and latency) line drawn
under that policy; events as sentences, filtered; the checklist per host
and NIC; a rolling drain started and stopped; as an administrator, a
bandwidth class, a cluster setting and a host's settings set and put back,
and the attached disk backed up live to a new file; a VM created from the
form (a refused spec shows the server's reason) and removed from its row;
a read-only user sees every changing control disabled, a forged request
refused (403 without the CSRF token, 403 for the role with it) and a
console refused; on a phone-sized screen (390 px) nothing reaches past its
edge on five pages; axe-core finds no serious violation on any page; a
screenshot of each page.

Needs root (a lab), QEMU and chromium; run by `scripts/run test` after the
cargo tests. Screenshots: target/artifacts/web-*.png.

    sudo /usr/bin/python3 tests/browser/web_move.py
"""
import json, os, subprocess, sys, time

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.common.exceptions import NoAlertPresentException
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

    backup_file = f"/tmp/ferry-web-backup-{os.getpid()}.img"

    def alert_now():
        try:
            return d.switch_to.alert
        except NoAlertPresentException:
            return None

    def goto(fragment):
        """A page of the console by its address, as a link or a bookmark would open it."""
        d.execute_script("location.hash = arguments[0]", fragment)
        page = "page-" + (fragment.strip("#/").split("/")[0] or "overview")
        wait(f"the page {fragment}", lambda: d.find_element(By.ID, page).is_displayed(), 10)

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
        # the move's own page, by its operation's id
        wait("the migration's page", lambda: "#/operation/migration-" in d.current_url, 30)
        move_url = d.current_url
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
        check = json.loads(ferry("vm", "check", "web1", "--json"))
        if check["host"] != "host2" or not check["intact"]:
            sys.exit(f"FAIL: web1 after the move: {check}")
        # the report the page showed is the API's: its downtime is the move's
        op_id = move_url.split("#/operation/")[1]
        api_op = json.loads(ferry("operations", op_id, "--json"))
        api_last = (api_op.get("events") or [{}])[-1]
        if api_op.get("state") != "completed" or api_last.get("event") != "completed" or api_op.get("by") != f"web-op-{os.getpid()}":
            sys.exit(f"FAIL: the operation as the API has it: {json.dumps(api_op)[:400]}")
        downtime = f"downtime {api_last.get('guest_downtime_ms') or api_last.get('downtime_ms')} ms"
        shown = d.find_element(By.ID, "move-status").text
        if downtime not in shown:
            sys.exit(f"FAIL: the page's downtime is not the report's: {shown!r} vs {json.dumps(api_last)[:300]}")
        # the migration's page: the round, transfer against dirtying, each step, then the report
        def migration_page():
            report = wait("the migration's report", lambda: d.execute_script("return window.ferry.lastReport"), 15)
            if downtime not in report or "the links' ideal" not in report:
                sys.exit(f"FAIL: the migration report on the page: {report!r}")
            steps = [li.text for li in d.find_elements(By.CSS_SELECTOR, "#migration-steps li")]
            facts = d.find_element(By.ID, "migration-facts").text
            if not any(s.startswith("commit") for s in steps) or "dirtying" not in facts or "round" not in facts:
                sys.exit(f"FAIL: the migration page: steps {steps}, facts {facts!r}")
            return report
        migration_page()
        shot = os.path.join(ART, "web-migration.png")
        d.save_screenshot(shot)
        if os.path.getsize(shot) < 10_000:
            sys.exit("FAIL: the screenshot is empty")
        minor += accessible("migration's page")
        # the NIC graphs were pushed (Server-Sent Events), not polled
        if d.execute_script("return window.ferry.pushes || 0") < 3:
            sys.exit("FAIL: no host updates pushed to the page")
        # the page's address is the migration's: loaded afresh, it tells the same story
        d.get("about:blank")
        d.get(move_url)
        wait("the console after reloading", lambda: d.find_element(By.ID, "console").is_displayed(), 15)
        migration_page()

        # a drain from its host's card: its page lists every move, each reaching done, the limit and why
        d.get("https://127.0.0.1:7700/#/")
        wait("host2's card", lambda: d.find_elements(By.ID, "drain-host2"), 15)
        d.find_element(By.ID, "drain-host2").click()
        wait("the drain's page", lambda: "#/operation/drain-" in d.current_url, 30)
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
        # pushed, not polled: the page's VM list follows the drain to its end by itself
        wait("the pushed VM list after the drain", lambda: d.execute_script(
            "return window.ferry.vms.map(v => [v.name, v.host, v.state].join(' '))") == ["web1 host1 running"], 10)
        goto("#/")
        d.find_element(By.ID, "resume-host2").click()
        wait("host2 taking VMs again", lambda: not any(
            h["name"] == "host2" and h.get("draining") for h in json.loads(ferry("host", "list", "--json"))), 15)

        # the list of migrations and drains, each a link to its page
        goto("#/operations")
        ops = wait("the operations listed", lambda: (lambda r: r if len(r) >= 2 else None)(d.execute_script(
            "return [...document.querySelectorAll('#operations tbody tr')].map(r => r.innerText)")), 15)
        if not any("move web1" in r and "host1 → host2" in r and "completed" in r for r in ops) or \
                not any("drain host2" in r and "completed" in r for r in ops):
            sys.exit(f"FAIL: the operations page: {ops}")
        d.save_screenshot(os.path.join(ART, "web-operations.png"))

        # a VM's page: its moves (both, with their downtime) and the end of its console
        goto("#/vm/web1")
        def history():
            return d.execute_script(
                "return [...document.querySelectorAll('#vm-history tbody tr')].map(r => [...r.cells].map(c => c.innerText))")
        moves = wait("web1's moves", lambda: (lambda h: h if len(h) >= 2 else None)(history()), 20)
        if not any(m[1] == "host1 → host2" and m[3] == downtime.split(" ", 1)[1] for m in moves) or \
                not any(m[1] == "host2 → host1" for m in moves):
            sys.exit(f"FAIL: web1's moves on its page: {moves} (expected host1 → host2 with {downtime})")
        console_text = wait("web1's console", lambda: (lambda t: t if "FERRY" in t else None)(
            d.find_element(By.ID, "vm-console").text), 20)
        minor += accessible("VM's page")
        d.save_screenshot(os.path.join(ART, "web-vm.png"))

        # a host's page: its NICs with fabric, address, MTU and link; its VMs; its own checks
        goto("#/host/host1")
        nic_rows = wait("host1's NICs", lambda: d.execute_script(
            "return [...document.querySelectorAll('#host-nics tbody tr')].map(r => [...r.cells].map(c => c.innerText))"), 15)
        lab_nics = {l["nic"]: l for l in links if l["host"] == "host1"}
        if sorted(r[0] for r in nic_rows) != sorted(lab_nics) or \
                any(r[3] != str(lab_nics[r[0]]["mtu"]) or r[4] != "up" for r in nic_rows):
            sys.exit(f"FAIL: host1's NICs on its page: {nic_rows} (the lab: {lab_nics})")
        if "web1" not in d.find_element(By.ID, "host-vms").text:
            sys.exit(f"FAIL: host1's page does not list web1: {d.find_element(By.ID, 'host-vms').text!r}")
        d.find_element(By.ID, "host-validate").click()
        wait("host1's checks", lambda: "passed" in d.find_element(By.ID, "host-status").text, 60)
        host_checks = d.execute_script(
            "return [...document.querySelectorAll('#host-checks tbody tr')].map(r => [...r.cells].map(c => c.innerText))")
        if not host_checks or not any(c[2] for c in host_checks):
            sys.exit(f"FAIL: host1's checks on its page: {host_checks[:5]}")
        d.save_screenshot(os.path.join(ART, "web-host.png"))
        minor += accessible("host's page")

        # storage: a QoS policy made from the page's form; a bad one refused with the server's reason
        goto("#/storage")
        def policy_rows():
            # read in one go: the table may be drawn anew
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
        # edited from its row: the form saves its limits
        d.execute_script("document.getElementById('policy-edit-webgold').click()")
        box = d.find_element(By.ID, "policy-max")
        box.clear()
        box.send_keys("800")
        d.find_element(By.ID, "policy-create").click()
        wait("the policy saved", lambda: "webgold saved" in d.find_element(By.ID, "policy-status").text, 10)
        gold = next(p for p in json.loads(ferry("qos", "policy", "list", "--json")) if p["name"] == "webgold")
        if (gold["min_iops"], gold["max_iops"]) != (100, 800):
            sys.exit(f"FAIL: the edited policy: {gold}")
        # a disk made from the page, given that policy from its row, grown by 1 GiB, attached to web1
        def disk_rows():
            return d.execute_script(
                "return [...document.querySelectorAll('#disks tbody tr')].map(r => [...r.cells].map(c => c.innerText))")
        def make_disk(name):
            box = d.find_element(By.ID, "disk-name")
            box.clear()
            box.send_keys(name)
            d.find_element(By.ID, "disk-create").click()
            wait(f"{name} listed", lambda: any(r[0] == name and r[6] == "primary" for r in disk_rows()), 15)
        make_disk("webdisk")
        d.execute_script("const s = document.getElementById('disk-policy-webdisk');"
                         "s.value = 'webgold'; s.dispatchEvent(new Event('change'))")
        wait("the disk's policy set", lambda: "policy webgold" in d.find_element(By.ID, "disk-status").text, 10)
        d.execute_script("document.getElementById('disk-grow-webdisk').click()")
        wait("the disk grown", lambda: any(r[0] == "webdisk" and r[2] == "2048 MiB" for r in disk_rows()), 15)
        disk = next(x for x in json.loads(ferry("disk", "list", "--json")) if x["name"] == "webdisk")
        if (disk["size"], disk["policy"]) != (2 << 30, "webgold"):
            sys.exit(f"FAIL: the disk after the page's changes: {disk}")
        d.execute_script("const s = document.getElementById('disk-attach-to-webdisk'); s.value = 'web1';"
                         "document.getElementById('disk-attach-webdisk').click()")
        wait("the disk attached", lambda: "webdisk attached to web1" in d.find_element(By.ID, "disk-status").text, 60)
        # the guest reads and writes it: its flow, under the policy, drawn as an IOPS line
        flow = wait("web1's flow on webdisk", lambda: next((f for f in d.execute_script("return window.ferry.flows || []")
                                                            if f["id"] == "webdisk/web1" and f["policy"] == "webgold"), None), 30)
        if (flow["min_iops"], flow["max_iops"]) != (100, 800):
            sys.exit(f"FAIL: the flow's limits are not its policy's: {flow}")
        line = wait("the flow's IOPS line", lambda: (lambda v: v if v and max(x or 0 for x in v) > 0 else None)(
            d.execute_script("return (window.ferry.flowSeries.iops['webdisk/web1'] || null)")), 30)
        legend = d.find_element(By.ID, "flows-plot").text
        if "webdisk/web1" not in legend or not d.find_elements(By.CSS_SELECTOR, "#flows-plot canvas"):
            sys.exit(f"FAIL: the flows' graph has no line for webdisk/web1: {legend!r}")
        # the same flows' latency over time, picked from the graph's list
        Select(d.find_element(By.ID, "flow-metric")).select_by_value("latency")
        wait("the flows' latency graph", lambda: d.execute_script("return window.ferry.flowSeries.names") == "latency:webdisk/web1"
             and d.find_elements(By.CSS_SELECTOR, "#flows-plot canvas"), 10)
        Select(d.find_element(By.ID, "flow-metric")).select_by_value("iops")
        d.save_screenshot(os.path.join(ART, "web-storage.png"))
        minor += accessible("storage page")
        # a second disk deleted (confirmed), a second policy deleted
        make_disk("webdisk2")
        d.execute_script("document.getElementById('disk-delete-webdisk2').click()")
        d.switch_to.alert.accept()
        wait("the disk gone", lambda: not any(r[0] == "webdisk2" for r in disk_rows()), 15)
        make_policy("webtmp", 0, 300)
        wait("webtmp listed", lambda: any(r.startswith("webtmp") for r in policy_rows()), 15)
        # clicked in the page itself: the table may be drawn anew between a find and a click
        d.execute_script("document.getElementById('policy-delete-webtmp').click()")
        wait("the policy gone", lambda: not any(r.startswith("webtmp") for r in policy_rows()), 15)

        # events filtered by kind: only that kind shown
        goto("#/events")
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
        d.save_screenshot(os.path.join(ART, "web-events.png"))
        Select(d.find_element(By.ID, "event-kind")).select_by_value("")

        # the checklist from the page: a row per check, host and NIC, with what was seen
        goto("#/validation")
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
        d.save_screenshot(os.path.join(ART, "web-validation.png"))
        minor += accessible("validation results")

        # the cluster: a rolling drain started and stopped by the operator; bandwidth
        # classes and cluster settings are an administrator's (disabled here, saying so)
        goto("#/cluster")
        for control in ("bw-set", "cluster-save"):
            c = d.find_element(By.ID, control)
            if c.is_enabled() or "needs the admin role" not in (c.get_attribute("title") or ""):
                sys.exit(f"FAIL: {control} is not an administrator's for an operator: {c.get_attribute('title')!r}")
        # host2 holds no VM now: its rolling drain reaches maintenance, then is stopped from the page
        d.find_element(By.ID, "rolling-list").send_keys("host2")
        d.find_element(By.ID, "rolling-start").click()
        d.switch_to.alert.accept()
        def rolling_rows():
            return d.execute_script("return [...document.querySelectorAll('#rolling-hosts tbody tr')].map(r => r.innerText)")
        wait("host2 in maintenance", lambda: any(r.startswith("host2") and "maintenance" in r for r in rolling_rows()), 60)
        d.find_element(By.ID, "rolling-stop").click()
        wait("the rolling drain stopped", lambda: "stopped" in d.find_element(By.ID, "rolling-state").text, 15)
        # an administrator sets a class's cap and a setting, then puts both back
        d.find_element(By.ID, "sign-out").click()
        sign_in(open("/run/ferry/lab/admin.token").read().strip())
        wait("the cluster page", lambda: d.find_element(By.ID, "page-cluster").is_displayed(), 10)
        Select(d.find_element(By.ID, "bw-class")).select_by_value("live-migration")
        def set_class(pct):
            box = d.find_element(By.ID, "bw-max")
            box.clear()
            box.send_keys(str(pct))
            d.find_element(By.ID, "bw-set").click()
        def classes():
            return json.loads(ferry("bandwidth", "list", "--json"))["policy"]["classes"]
        set_class(80)
        wait("the class listed", lambda: any(r.startswith("live-migration") and "80%" in r for r in d.execute_script(
            "return [...document.querySelectorAll('#bw-classes tbody tr')].map(r => r.innerText)")), 15)
        if not any(c["class"] == "live-migration" and c.get("max") == {"percent": 80} for c in classes()):
            sys.exit(f"FAIL: the bandwidth policy after the page set it: {classes()}")
        d.save_screenshot(os.path.join(ART, "web-cluster.png"))
        minor += accessible("cluster page")
        set_class(0)
        wait("the class cleared", lambda: not any(c["class"] == "live-migration" and c.get("max") for c in classes()), 15)
        was = json.loads(ferry("cluster", "show", "--json"))["encryption"]
        for want in (not was, was):
            box = d.find_element(By.ID, "cluster-encrypt")
            if box.is_selected() != want:
                box.click()
            d.find_element(By.ID, "cluster-save").click()
            wait("the setting saved", lambda: json.loads(ferry("cluster", "show", "--json"))["encryption"] == want, 10)
        # a live backup of the attached disk to a new file on its node (an administrator's), followed to its end
        goto("#/storage")
        wait("webdisk's Back up button enabled", lambda: d.find_elements(By.ID, "disk-backup-webdisk")
             and d.find_element(By.ID, "disk-backup-webdisk").is_enabled(), 15)
        d.execute_script("setTimeout(() => document.getElementById('disk-backup-webdisk').click(), 0)")
        ask = wait("the backup's question", alert_now, 5)
        ask.send_keys(backup_file)
        ask.accept()
        said = wait("the backup's end", lambda: (lambda t: t if ": done," in t or ": failed" in t or "not backed up" in t else None)(
            d.find_element(By.ID, "disk-status").text), 60)
        if ": done," not in said or not os.path.getsize(backup_file):
            sys.exit(f"FAIL: webdisk's backup from the page: {said!r}")
        goto("#/host/host2")
        d.find_element(By.ID, "host-max").send_keys("2")
        d.find_element(By.ID, "host-save").click()
        wait("host2's settings saved", lambda: next(h for h in json.loads(ferry("host", "list", "--json"))
                                                    if h["name"] == "host2").get("settings", {}).get("max_migrations") == {"fixed": 2}, 10)
        d.find_element(By.ID, "sign-out").click()
        sign_in(operator)
        goto("#/")
        wait("host2's card", lambda: d.find_elements(By.ID, "resume-host2"), 15)
        d.find_element(By.ID, "resume-host2").click()
        wait("host2 taking VMs again", lambda: not any(
            h["name"] == "host2" and h.get("draining") for h in json.loads(ferry("host", "list", "--json"))), 15)

        # an operator creates a VM from the page (the workload guest, 256 MiB, on host2) ...
        d.execute_script("document.getElementById('vm-create-box').open = true")
        created = d.find_element(By.ID, "vm-create-status")
        def create(name, spec):
            d.find_element(By.ID, "vm-name").clear()
            d.find_element(By.ID, "vm-name").send_keys(name)
            # offered once the pushed hosts say host2 takes VMs again
            wait("host2 offered", lambda: d.find_elements(By.CSS_SELECTOR, "#vm-host option[value=host2]"), 10)
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
        goto("#/storage")
        wait("the disks' rows", lambda: d.find_elements(By.ID, "disk-grow-webdisk"), 15)
        # read in one go: the VM table is drawn anew every 3 s
        buttons = d.execute_script(
            "return [...document.querySelectorAll('#vms button, .host button, #policies button, #disks button, #disks select[id^=disk-policy], "
            "#policy-create, #vm-create-btn, #validate, #disk-create, #vm-move, #bw-set, #cluster-save, #rolling-start, #rolling-stop, "
            "#host-drain, #host-resume, #host-validate, #host-save')]"
            ".map(b => [b.getAttribute('aria-label') || b.textContent, b.disabled])")
        enabled = [label for label, disabled in buttons if not disabled]
        if not buttons or enabled:
            sys.exit(f"FAIL: a read-only user has enabled buttons: {enabled} of {len(buttons)}")
        no_csrf, with_csrf = forged(False), forged(True)
        if no_csrf != [403, "refused"] or with_csrf != [403, "forbidden"]:
            sys.exit(f"FAIL: forged requests were not refused: without CSRF {no_csrf}, with it {with_csrf}")
        # a console is an operator's to read: refused to this user, said so on the VM's page
        console_status = d.execute_async_script(
            "const done = arguments[0]; fetch('/api/v1/vms/web1/console', {credentials: 'same-origin'}).then(r => done(r.status))")
        goto("#/vm/web1")
        said = wait("the VM page's word on the console", lambda: d.find_element(By.ID, "vm-console").text, 10)
        if console_status != 403 or "operator's" not in said:
            sys.exit(f"FAIL: a read-only user and web1's console: {console_status}, {said!r}")
        d.save_screenshot(os.path.join(ART, "web-read-only.png"))
        minor += accessible("read-only console")

        # a phone-sized screen: the page reflows, never scrolls sideways (wide
        # tables scroll in their own box), the graphs fit, the controls stay reachable
        d.set_window_size(390, 844)
        d.get("https://127.0.0.1:7700/#/")
        d.refresh()  # the same document at another fragment is not loaded anew
        wait("the console on a phone", lambda: d.find_element(By.ID, "console").is_displayed(), 15)
        wait("the VM table on a phone", lambda: d.find_elements(By.ID, "move-web1"), 15)
        wait("a graph per host on a phone", lambda: d.find_elements(By.CSS_SELECTOR, "#host-host1 canvas"), 15)
        for fragment, ready in (("#/", "move-web1"), ("#/vm/web1", "vm-console"), ("#/storage", "disk-grow-webdisk"),
                                ("#/operation/" + op_id, "migration-report"), ("#/cluster", "rolling-start")):
            goto(fragment)
            wait(f"{fragment} on a phone", lambda: d.find_elements(By.ID, ready), 15)
            time.sleep(1)
            layout = d.execute_script("""
                const vw = document.documentElement.clientWidth;
                const wide = [...document.querySelectorAll('canvas, input, select, button, table, pre')]
                  .filter(e => e.offsetParent && !e.closest('.scroll'))
                  .filter(e => e.getBoundingClientRect().right > vw + 1)
                  .map(e => e.id || e.tagName);
                return {vw, page: document.documentElement.scrollWidth, wide};
            """)
            if layout["page"] > layout["vw"] + 1 or layout["wide"]:
                sys.exit(f"FAIL: on a 390 px screen {fragment} is {layout['page']} px wide, past the edge: {layout['wide']}")
            minor += accessible(f"{fragment} on a phone")
        goto("#/")
        d.find_element(By.ID, "move-web1").location_once_scrolled_into_view
        d.save_screenshot(os.path.join(ART, "web-phone.png"))
        print(f"ok: web page moved web1 to host2; NIC peaks {', '.join(f'{k} {v:.0f} Mbit/s' for k, v in busy.items())}; "
              f"read-only user: {len(buttons)} buttons disabled, forged requests {no_csrf[0]}/{with_csrf[0]}; "
              f"a 390 px screen: nothing past its edge on 5 pages; "
              f"axe-core: no serious violation ({minor} minor or moderate); "
              f"screenshots in {ART}")
    finally:
        d.quit()
        for vm in ("web1", "web2", "web3"):
            subprocess.run([FERRY, "vm", "rm", vm], capture_output=True)
        for disk in ("webdisk", "webdisk2"):
            subprocess.run([FERRY, "disk", "rm", disk], capture_output=True)
        subprocess.run([FERRY, "host", "set", "host2", "--max-migrations", "auto"], capture_output=True)
        for f in (backup_file, backup_file + ".json"):
            if os.path.exists(f):
                os.remove(f)
        for policy in ("webgold", "webtmp"):
            subprocess.run([FERRY, "qos", "policy", "rm", policy], capture_output=True)


if __name__ == "__main__":
    main()
