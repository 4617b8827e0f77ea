// Ferry's web page: everything through the control service's REST API
// (/api/v1), the same API the CLI uses. The browser signs in once with an
// API token (POST /api/v1/session) and keeps an HttpOnly session cookie; the
// token is never stored by the page nor put in a URL. Changing requests
// carry the session's CSRF token.
"use strict";

const WINDOW_S = 120;
// shared with tests: latest and peak per-NIC rates, last move's events
const ferry = (window.ferry = { nicRates: {}, peakRates: {}, moves: {}, polls: 0, session: null });

// what each role may do (the server refuses anything else anyway)
const OPERATES = ["operator", "admin"];
const canOperate = () => ferry.session && OPERATES.includes(ferry.session.role);

// Hosts and their NIC counters, pushed by the control service each second
// (Server-Sent Events; the browser reconnects when a stream ends).
let watch = null;
function watchHosts() {
  if (watch) watch.close();
  watch = new EventSource("/api/v1/watch/hosts");
  watch.addEventListener("hosts", (e) => {
    updateHosts(JSON.parse(e.data));
    ferry.pushes = (ferry.pushes || 0) + 1;
    ferry.polls++;
  });
  watch.addEventListener("error", (e) => {
    if (e.data) showError(new Error(JSON.parse(e.data).message));
  });
}

function signedOut(why) {
  if (watch) watch.close();
  watch = null;
  ferry.session = null;
  document.getElementById("console").hidden = true;
  document.getElementById("who").hidden = true;
  document.getElementById("login").hidden = false;
  document.getElementById("login-error").textContent = why || "";
  document.getElementById("token").focus();
}

function signedIn(s) {
  ferry.session = s;
  // buttons are drawn for the role signed in: the host cards are made anew,
  // and nothing of the last user's work stays on the page
  document.getElementById("hosts").innerHTML = "";
  for (const k of Object.keys(series)) delete series[k];
  for (const r of vmRows.values()) r.tr.remove();
  vmRows.clear();
  document.querySelector("#checks tbody").innerHTML = "";
  // the page's fixed controls, for this user's role (rows draw their own)
  for (const id of ["policy-create", "disk-create", "vm-create-btn", "validate"]) mayOperate(document.getElementById(id));
  for (const id of ["validate-status", "vm-create-status"]) document.getElementById(id).textContent = "";
  document.getElementById("migration").hidden = true;
  document.getElementById("drain-moves").hidden = true;
  for (const id of ["move-status", "drain-status", "drain-limit"]) document.getElementById(id).textContent = "";
  document.getElementById("login").hidden = true;
  document.getElementById("console").hidden = false;
  document.getElementById("who").hidden = false;
  document.getElementById("who-name").textContent = `Signed in as ${s.name} (${s.role})`;
  watchHosts();
  refresh();
}

async function api(method, path, body) {
  const headers = { "Content-Type": "application/json" };
  if (method !== "GET" && ferry.session) headers["X-Ferry-CSRF"] = ferry.session.csrf;
  const r = await fetch(path, {
    method,
    headers,
    credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (r.status === 401) {
    const e = await r.json().catch(() => ({}));
    signedOut(e.message || "Signed out");
    throw new Error("not signed in");
  }
  if (!r.ok) {
    const e = await r.json().catch(() => ({ message: r.statusText }));
    throw new Error(e.message || r.statusText);
  }
  return r;
}

async function get(path) {
  return (await api("GET", path)).json();
}

// Reads an NDJSON event stream, calling on(event) per line.
async function stream(path, body, on) {
  const r = await api("POST", path, body);
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, i).trim();
      buf = buf.slice(i + 1);
      if (line) on(JSON.parse(line));
    }
  }
}

// A button for what only an operator (or admin) may do: shown disabled,
// with why, to a read-only user.
function operatorButton(text, label) {
  const b = el("button", text);
  b.type = "button";
  b.setAttribute("aria-label", label);
  return mayOperate(b);
}

// A control that changes something: disabled, saying why, for a role that
// may not (the server refuses it anyway).
function mayOperate(c) {
  c.disabled = !canOperate();
  c.title = c.disabled ? `needs the operator role; ${ferry.session ? ferry.session.name + " is " + ferry.session.role : "not signed in"}` : "";
  return c;
}

// A form field's value, trimmed.
function field(id) {
  return document.getElementById(id).value.trim();
}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

// A table row of `cells` (text or nodes), appended to `tbody` if one is given.
function row(tbody, cells) {
  const tr = el("tr");
  for (const c of cells) {
    const td = el("td");
    if (c instanceof Node) td.appendChild(c);
    else td.textContent = c;
    tr.appendChild(td);
  }
  if (tbody) tbody.appendChild(tr);
  return tr;
}

const mib = (b) => (b / 1048576).toFixed(0) + " MiB";

// ---- hosts and NIC graphs -----------------------------------------------------

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];

// A graph's width: as asked, or what a narrow screen has room for.
function fitWidth(w) {
  return Math.max(240, Math.min(w, document.documentElement.clientWidth - 40));
}

// uPlot options for the last WINDOW_S seconds, one line per name in its own
// colour (named in the legend; values show while the pointer is over the
// plot), every other line dashed so lines carrying the same values both show.
function lastMinutes(names, unit, width, height, axis) {
  return {
    width: fitWidth(width),
    height,
    scales: {
      x: { range: (u, min, max) => [max - WINDOW_S, max] },
      y: { range: (u, min, max) => [0, Math.max(10, max * 1.1)] },
    },
    legend: { live: true },
    series: [
      { label: "time", value: (u, v) => (v == null ? "" : new Date(v * 1000).toLocaleTimeString()) },
      ...names.map((k, i) => ({
        label: k,
        stroke: COLORS[i % COLORS.length],
        width: 2,
        dash: i % 2 ? [8, 4] : undefined,
        value: (u, v) => (v == null ? "" : v.toFixed(0) + " " + unit),
      })),
    ],
    axes: [{ label: "time" }, { size: 60, label: axis || unit }],
  };
}

const prev = {}; // host/nic -> {t, bytes}
const series = {}; // host -> {t: [], nics: {nic: []}, plot, card}

function nicCard(h) {
  const card = el("div", undefined, "host");
  card.id = "host-" + h.name;
  const title = el("div");
  card.appendChild(title);
  const buttons = el("div");
  const drain = operatorButton("Drain", `Drain ${h.name}`);
  drain.id = "drain-" + h.name;
  drain.onclick = () => drainHost(h.name);
  const resume = operatorButton("Resume", `Resume ${h.name}`);
  resume.id = "resume-" + h.name;
  resume.onclick = () => api("POST", `/api/v1/hosts/${h.name}/resume`).then(refresh, showError);
  buttons.append(drain, resume);
  card.appendChild(buttons);
  const plotDiv = el("div");
  card.appendChild(plotDiv);
  document.getElementById("hosts").appendChild(card);
  return { card, title, plotDiv };
}

function updateHosts(hosts) {
  const now = Date.now() / 1000;
  for (const h of hosts) {
    let s = series[h.name];
    if (!s) {
      s = series[h.name] = { t: [], nics: {}, plot: null, ...nicCard(h) };
    }
    const state = h.down ? "DOWN" : h.reachable ? "up" : "unreachable";
    const info = h.info;
    s.title.innerHTML = "";
    s.title.append(
      el("b", h.name + " "),
      el("span", state + (h.draining ? ", draining" : ""), h.down ? "down" : h.draining ? "warn" : "ok"),
      el("span", info ? ` · ${mib(info.memory_free)} free · ${info.vms.length} VMs` : "")
    );
    if (!info) continue;
    s.t.push(now);
    for (const n of info.nics) {
      const key = h.name + "/" + n.name;
      const bytes = n.tx_bytes + n.rx_bytes;
      const p = prev[key];
      const rate = p && now > p.t ? ((bytes - p.bytes) * 8) / (now - p.t) / 1e6 : 0;
      prev[key] = { t: now, bytes };
      (s.nics[n.name] = s.nics[n.name] || []).push(Math.max(0, rate));
      ferry.nicRates[key] = rate;
      ferry.peakRates[key] = Math.max(ferry.peakRates[key] || 0, rate);
    }
    while (s.t.length && s.t[0] < now - WINDOW_S) {
      s.t.shift();
      for (const k in s.nics) s.nics[k].shift();
    }
    const names = Object.keys(s.nics).sort();
    const data = [s.t, ...names.map((k) => s.nics[k])];
    if (s.plot && s.plotNames !== names.join(",")) {
      s.plot.destroy();
      s.plot = null;
    }
    if (!s.plot && names.length) {
      s.plotNames = names.join(",");
      s.plot = new uPlot(lastMinutes(names, "Mbit/s", 420, 160), data, s.plotDiv);
    } else if (s.plot) {
      s.plot.setData(data);
    }
  }
}

// ---- VMs, moves and drains ----------------------------------------------------

// VM rows by name, each drawn again only when what it shows changes: the
// table is refreshed every 3 s, and rebuilding every row of 200 VMs each
// time held the page's main thread ~100 ms (and reset a target the user
// had picked).
const vmRows = new Map();

function updateVms(vms, hosts) {
  const tbody = document.querySelector("#vms tbody");
  const up = hosts.filter((h) => !h.down).map((h) => h.name);
  const seen = new Set();
  let prev = null;
  for (const v of vms) {
    seen.add(v.name);
    const sig = JSON.stringify([v.host, vmState(v), v.spec.memory, up, canOperate()]);
    let r = vmRows.get(v.name);
    if (!r || r.sig !== sig) {
      const tr = vmRow(v, up);
      if (r) r.tr.replaceWith(tr);
      r = { tr, sig };
      vmRows.set(v.name, r);
    }
    const want = prev ? prev.nextSibling : tbody.firstChild;
    if (r.tr !== want) tbody.insertBefore(r.tr, want);
    prev = r.tr;
  }
  for (const [name, r] of vmRows) {
    if (!seen.has(name)) {
      r.tr.remove();
      vmRows.delete(name);
    }
  }
}

function vmRow(v, up) {
  const sel = el("select");
  sel.id = "to-" + v.name;
  for (const h of up) if (h !== v.host) sel.appendChild(new Option(h, h));
  sel.setAttribute("aria-label", `Move ${v.name} to`);
  const btn = operatorButton("Move", `Move ${v.name}`);
  btn.id = "move-" + v.name;
  btn.onclick = () => moveVm(v.name, sel.value);
  const host = el("span", v.host);
  host.id = "vm-host-" + v.name;
  // stops the guest and removes the VM, as `ferry vm rm`: asked once more
  const rm = operatorButton("Remove", `Stop and remove ${v.name}`);
  rm.id = "remove-" + v.name;
  rm.onclick = () => {
    if (!confirm(`Stop ${v.name} and remove it from ${v.host}?`)) return;
    const status = document.getElementById("move-status");
    api("DELETE", `/api/v1/vms/${encodeURIComponent(v.name)}`).then(
      () => {
        status.textContent = `${v.name} stopped and removed`;
        refresh();
      },
      (e) => {
        status.textContent = `${v.name} not removed: ${e.message}`;
      },
    );
  };
  const actions = el("span");
  actions.append(btn, rm);
  return row(null, [v.name, host, vmState(v), mib(v.spec.memory), sel, actions]);
}

// "paused: storage (storage1 (198.18.0.2:10809), since 12:00:01 UTC, 42s)"
function vmState(v) {
  const p = v.storage_pause;
  if (!p || p.state === "resumed") return v.state;
  const since = new Date(p.since_ms).toISOString().slice(11, 19) + " UTC";
  const secs = Math.round(((p.until_ms || Date.now()) - p.since_ms) / 1000);
  return p.state === "paused"
    ? `paused: storage (${p.storage}, since ${since}, ${secs}s)`
    : `stopped: storage (${p.storage}) did not answer for ${secs}s`;
}

// ---- a migration as it runs ----------------------------------------------------

const mbit = (bytesPerS) => ((bytesPerS * 8) / 1e6).toFixed(0) + " Mbit/s";

// The migration panel: transfer against dirty rate, bytes left, the round,
// the expected downtime, each decision as it is taken, then the report.
function migrationPanel(vm, from, to) {
  const section = document.getElementById("migration");
  section.hidden = false;
  document.getElementById("migration-title").textContent = `Migration of ${vm}: ${from} → ${to}`;
  document.getElementById("migration-steps").innerHTML = "";
  document.getElementById("migration-report").textContent = "";
  const plotDiv = document.getElementById("migration-plot");
  plotDiv.innerHTML = "";
  const data = [[], [], []];
  const plot = new uPlot(
    {
      width: fitWidth(460),
      height: 180,
      scales: { x: { time: false }, y: { range: (u, min, max) => [0, Math.max(10, max * 1.1)] } },
      series: [
        { label: "s", value: (u, v) => (v == null ? "" : v.toFixed(1)) },
        { label: "transfer", stroke: "#1f77b4", width: 2, value: (u, v) => (v == null ? "" : v.toFixed(0) + " Mbit/s") },
        { label: "dirtying", stroke: "#d62728", width: 2, value: (u, v) => (v == null ? "" : v.toFixed(0) + " Mbit/s") },
      ],
      axes: [{ label: "seconds since start" }, { size: 60, label: "Mbit/s" }],
    },
    data,
    plotDiv
  );
  const facts = (pairs) => {
    const dl = document.getElementById("migration-facts");
    dl.innerHTML = "";
    for (const [k, v] of pairs) dl.append(el("dt", k), el("dd", v));
  };
  const step = (text) => {
    const ol = document.getElementById("migration-steps");
    const li = el("li", text);
    ol.appendChild(li);
    li.scrollIntoView({ block: "nearest" });
  };
  return {
    progress(ev) {
      data[0].push(ev.elapsed_ms / 1000);
      data[1].push((ev.throughput * 8) / 1e6);
      data[2].push((ev.dirty_rate * 8) / 1e6);
      plot.setData(data);
      facts([
        ["phase", ev.phase + (ev.status ? ` (${ev.status})` : "")],
        ["round", String(ev.rounds)],
        ["sent", mib(ev.transferred)],
        ["left", mib(ev.remaining) + (ev.total ? ` of ${mib(ev.total)}` : "")],
        ["transfer", mbit(ev.throughput)],
        ["dirtying", mbit(ev.dirty_rate)],
        ["expected downtime", ev.expected_downtime_ms != null ? ev.expected_downtime_ms + " ms" : "—"],
        ["switch-over in", ev.eta_ms != null ? (ev.eta_ms / 1000).toFixed(1) + " s" : "—"],
        ...Object.entries(ev.nic_tx_bytes || {}).map(([n, b]) => [`sent on ${n}`, mib(b)]),
      ]);
    },
    step,
    async report(ev) {
      // the links' ideal: the bytes over the rate of the source's NICs that carried them
      let ideal = "";
      try {
        const bw = await get("/api/v1/bandwidth");
        const host = (bw.hosts || []).find((h) => h.host === ev.from);
        const used = Object.keys(ev.nic_tx_bytes || {});
        const rate = host ? host.nics.filter((n) => used.includes(n.nic)).reduce((a, n) => a + n.link_rate, 0) : 0;
        if (rate > 0) {
          const secs = (ev.bytes_transferred * 8) / rate;
          ideal = `, ${(ev.transfer_ms / 1000 / secs).toFixed(2)} × the links' ideal (${(secs).toFixed(1)} s at ${(rate / 1e6).toFixed(0)} Mbit/s)`;
        }
      } catch (e) {
        // no rates known: the ratio is left out
      }
      const r = document.getElementById("migration-report");
      r.textContent =
        `Done: downtime ${ev.guest_downtime_ms || ev.downtime_ms} ms (QEMU ${ev.downtime_ms} ms, ${ev.downtime_reason || "—"}), ` +
        `total ${(ev.total_ms / 1000).toFixed(1)} s, copying ${(ev.transfer_ms / 1000).toFixed(1)} s${ideal}; ` +
        `${mib(ev.bytes_transferred)} over ${ev.data_path} (${ev.option}), ${ev.rounds} rounds`;
      ferry.lastReport = r.textContent;
    },
  };
}

// The move's request from the options form: what is left blank is left to
// the source host's defaults, as with the CLI's flags.
function moveRequest(to) {
  const req = { to };
  if (field("move-option")) req.option = field("move-option");
  const c = {};
  if (field("move-downtime")) c.max_downtime_ms = Number(field("move-downtime"));
  if (field("move-postcopy")) c.postcopy = field("move-postcopy") === "true";
  if (field("move-throttle")) c.throttle = field("move-throttle") === "true";
  if (field("move-expiry")) c.at_expiry = field("move-expiry");
  if (field("move-timeout")) c.timeout_per_gib_s = Number(field("move-timeout"));
  if (Object.keys(c).length) req.convergence = c;
  return req;
}

async function moveVm(vm, to) {
  const status = document.getElementById("move-status");
  const m = (ferry.moves[vm] = { to, events: [], done: false });
  const from = (document.getElementById("vm-host-" + vm) || {}).textContent || "";
  const panel = migrationPanel(vm, from, to);
  status.textContent = `moving ${vm} to ${to}…`;
  try {
    await stream(`/api/v1/vms/${vm}/move`, moveRequest(to), (ev) => {
      m.events.push(ev);
      if (ev.event === "progress") panel.progress(ev);
      if (ev.event === "step") panel.step(`${ev.step}: ${ev.detail}`);
      if (ev.event === "warning") panel.step(`warning: ${ev.message}`);
      if (ev.event === "path") panel.step(`${ev.nic} ${ev.action}: ${ev.reason}`);
      if (ev.event === "completed") panel.report(ev);
      if (ev.event === "failed") panel.step(`failed: ${ev.error.message}`);
      if (ev.event === "step") status.textContent = `${vm} → ${to}: ${ev.step} — ${ev.detail}`;
      if (ev.event === "path") status.textContent = `${vm} → ${to}: ${ev.nic} ${ev.action} — ${ev.reason}`;
      if (ev.event === "progress") {
        const pct = ev.total ? ((100 * ev.transferred) / ev.total).toFixed(0) : "?";
        status.textContent = `${vm} → ${to}: ${ev.phase} ${mib(ev.transferred)} moved (${pct}%), ${((ev.throughput * 8) / 1e6).toFixed(0)} Mbit/s`;
      }
      if (ev.event === "completed")
        status.textContent = `${vm} moved to ${to} in ${(ev.total_ms / 1000).toFixed(1)} s, downtime ${ev.guest_downtime_ms || ev.downtime_ms} ms`;
      if (ev.event === "failed") status.textContent = `${vm} did not move: ${ev.error.message}`;
    });
  } catch (e) {
    status.textContent = `${vm} did not move: ${e.message}`;
  }
  m.done = true;
  refresh();
}

// A drain as it goes: every move queued, running, done, retried or failed,
// and the limit the scheduler chose with its reason.
async function drainHost(host) {
  const status = document.getElementById("drain-status");
  const table = document.getElementById("drain-moves");
  const tbody = table.querySelector("tbody");
  const d = (ferry.drain = { host, moves: {}, limits: [], done: null });
  tbody.innerHTML = "";
  table.hidden = false;
  document.getElementById("drain-limit").textContent = `Drain of ${host}`;
  status.textContent = `draining ${host}…`;
  const show = (vm, fields) => {
    const m = (d.moves[vm] = d.moves[vm] || { vm, to: "", state: "queued", progress: "", result: "" });
    Object.assign(m, fields);
    if (!m.row) {
      m.row = row(tbody, ["", "", "", "", ""]);
      m.row.id = "drain-move-" + vm;
    }
    const cells = m.row.children;
    [m.vm, m.to, m.state, m.progress, m.result].forEach((v, i) => (cells[i].textContent = v));
    cells[2].className = m.state === "done" ? "ok" : m.state === "failed" ? "down" : m.state === "queued" ? "" : "warn";
  };
  try {
    await stream(`/api/v1/hosts/${host}/drain`, {}, (ev) => {
      if (ev.event === "plan") {
        for (const m of ev.moves) show(m.vm, { to: m.to });
        for (const u of ev.unplaceable) show(u.vm, { state: "stays", result: u.reason });
      }
      if (ev.event === "limit") {
        d.limits.push(ev);
        document.getElementById("drain-limit").textContent = `Drain of ${host}: ${ev.limit} at once — ${ev.reason}`;
      }
      if (ev.event === "started") show(ev.vm, { to: ev.to, state: ev.attempt > 1 ? `running (attempt ${ev.attempt})` : "running" });
      if (ev.event === "progress" && ev.total)
        show(ev.vm, { progress: `${mib(ev.transferred)} sent, ${mib(ev.remaining)} left` });
      if (ev.event === "retry") show(ev.vm, { state: `retrying on ${ev.next}`, result: `${ev.failed_on}: ${ev.reason}` });
      if (ev.event === "failed") show(ev.vm, { state: "failed", result: ev.reason });
      if (ev.event === "moved")
        show(ev.vm, { to: ev.to, state: "done", progress: mib(ev.bytes), result: `${(ev.total_ms / 1000).toFixed(1)} s, downtime ${ev.downtime_ms} ms` });
      if (ev.event === "done") {
        d.done = ev;
        status.textContent = `${host} drained in ${(ev.total_ms / 1000).toFixed(1)} s: ${ev.moved.length} moved, ${ev.failed.length} failed, ${ev.unplaceable.length} stayed`;
      }
      if (ev.event === "warning") status.textContent = `${host}: ${ev.message}`;
    });
  } catch (e) {
    status.textContent = `drain of ${host}: ${e.message}`;
  }
  refresh();
}

// ---- storage and events ---------------------------------------------------------

// flow -> IOPS samples, with their times, for the flows' graph
const flowSeries = { t: [], flows: {}, plot: null, names: "" };

function updateQos(policies, flows) {
  const pb = document.querySelector("#policies tbody");
  pb.innerHTML = "";
  for (const p of policies) {
    const del = operatorButton("Delete", `Delete policy ${p.name}`);
    del.id = "policy-delete-" + p.name;
    del.onclick = () =>
      api("DELETE", `/api/v1/qos/policies/${encodeURIComponent(p.name)}`).then(refresh, (e) => policyStatus(e.message));
    row(pb, [p.name, p.kind, p.min_iops || "-", p.max_iops || "-", p.max_bandwidth ? mib(p.max_bandwidth) + "/s" : "-", del]);
  }
  const fb = document.querySelector("#flows tbody");
  fb.innerHTML = "";
  for (const f of flows) {
    const st = el("span", f.status, f.status === "Ok" ? "ok" : "down");
    row(fb, [f.id, f.host, f.policy || "-", f.iops.toFixed(0), (f.bandwidth / 1e6).toFixed(1), f.latency_us.toFixed(0), f.min_iops, f.max_iops, st]);
  }
  updateFlowPlot(flows);
}

// Each flow's IOPS over the last two minutes, one line per flow.
function updateFlowPlot(flows) {
  const now = Date.now() / 1000;
  const s = flowSeries;
  s.t.push(now);
  for (const f of flows) {
    if (!s.flows[f.id]) s.flows[f.id] = s.t.slice(0, -1).map(() => null);
    s.flows[f.id].push(f.iops);
  }
  for (const k of Object.keys(s.flows)) if (s.flows[k].length < s.t.length) s.flows[k].push(null);
  while (s.t.length && s.t[0] < now - WINDOW_S) {
    s.t.shift();
    for (const k in s.flows) s.flows[k].shift();
  }
  const names = Object.keys(s.flows).sort();
  if (!names.length) return;
  if (s.plot && s.names !== names.join(",")) {
    s.plot.destroy();
    s.plot = null;
  }
  const data = [s.t, ...names.map((k) => s.flows[k])];
  if (!s.plot) {
    s.names = names.join(",");
    s.plot = new uPlot(lastMinutes(names, "IOPS", 560, 180, "IOPS (8 KiB)"), data, document.getElementById("flows-plot"));
  } else {
    s.plot.setData(data);
  }
}

function policyStatus(text) {
  document.getElementById("policy-status").textContent = text;
}

document.getElementById("policy-form").onsubmit = async (ev) => {
  ev.preventDefault();
  const num = (id) => Math.max(0, Math.round(Number(document.getElementById(id).value) || 0));
  const policy = {
    name: field("policy-name"),
    kind: document.getElementById("policy-kind").value,
    min_iops: num("policy-min"),
    max_iops: num("policy-max"),
    max_bandwidth: num("policy-mbps") * 1e6,
  };
  try {
    await api("POST", "/api/v1/qos/policies", policy);
    policyStatus(`policy ${policy.name} created`);
    refresh();
  } catch (e) {
    // the server names what was wrong
    policyStatus(e.message);
  }
};

// An event as a sentence, from its kind and detail (the kinds the control
// service logs; any other says its detail in short).
function sentence(e) {
  const d = e.detail || {};
  const secs = (ms) => (ms / 1000).toFixed(1) + " s";
  switch (e.kind) {
    case "migration":
      return d.event === "completed"
        ? `${e.subject} moved ${d.source} → ${d.target} in ${secs(d.total_ms)} over ${d.option}, ` +
            `downtime ${d.guest_downtime_ms ?? d.downtime_ms} ms`
        : `${e.subject} did not move ${d.source} → ${d.target}: ${(d.error || {}).message || "failed"}`;
    case "drain":
      return `${e.subject} drained in ${secs(d.total_ms || 0)}: ${(d.moved || []).length} moved` +
        `${(d.failed || []).length ? `, ${d.failed.length} failed` : ""}` +
        `${(d.unplaceable || []).length ? `, ${d.unplaceable.length} with no host to take them` : ""}`;
    case "resume":
      return `${e.subject} resumed: takes VMs again`;
    case "host_down":
      return `${e.subject} stopped answering: nothing is scheduled onto it`;
    case "host_up":
      return `${e.subject} answers again`;
    case "storage_down":
      return `storage node ${e.subject} stopped answering`;
    case "storage_up":
      return `storage node ${e.subject} answers again`;
    case "refused":
      return d.by
        ? `${d.by} (${d.role}) was refused "${d.action}": it needs ${d.needs}`
        : `a request to ${e.subject} was refused (${d.status}): ${d.reason}`;
    case "command":
      return `${d.by} (${d.role}): ${d.action}`;
    case "session":
      return `${e.subject} ${d.action || "session"}`;
    case "settings":
      return `settings of ${e.subject} changed`;
    case "storage":
      return `${d.action || "storage"} ${e.subject}`;
    case "token":
      return d.revoked ? `token ${e.subject} revoked` : `token ${e.subject} created`;
    default: {
      const j = JSON.stringify(d);
      return `${e.kind} ${e.subject}: ${j.length > 80 ? j.slice(0, 79) + "…" : j}`;
    }
  }
}

// Events as sentences, the detail folded; filtered by kind and by host or VM.
let lastEvents = [];
function updateEvents(events) {
  lastEvents = events;
  const kinds = document.getElementById("event-kind");
  const have = new Set([...kinds.options].map((o) => o.value));
  for (const k of [...new Set(events.map((e) => e.kind))].sort()) if (!have.has(k)) kinds.appendChild(new Option(k, k));
  const kind = kinds.value;
  const subject = document.getElementById("event-subject").value.trim().toLowerCase();
  const shown = events.filter(
    (e) => (!kind || e.kind === kind) && (!subject || (e.subject + " " + JSON.stringify(e.detail)).toLowerCase().includes(subject))
  );
  const tb = document.querySelector("#events tbody");
  tb.innerHTML = "";
  for (const e of shown.slice(-15).reverse()) {
    // a sentence; the whole detail folded under it
    const fold = el("details");
    fold.append(el("summary", sentence(e)), el("pre", JSON.stringify(e.detail, null, 2)));
    row(tb, [new Date(e.at_ms).toLocaleTimeString(), e.kind, e.subject, fold]);
  }
}
document.getElementById("event-kind").onchange = () => updateEvents(lastEvents);
document.getElementById("event-subject").oninput = () => updateEvents(lastEvents);

function showError(e) {
  document.getElementById("error").textContent = e.message;
}

// ---- storage nodes and disks ------------------------------------------------------

function diskStatus(text) {
  document.getElementById("disk-status").textContent = text;
}

// A disk's policy set (or cleared, blank) from its row.
function diskPolicy(d, policies) {
  const sel = el("select");
  sel.id = "disk-policy-" + d.name;
  sel.setAttribute("aria-label", `Storage QoS policy of ${d.name}`);
  sel.appendChild(new Option("none", ""));
  for (const p of policies) sel.appendChild(new Option(p.name, p.name));
  sel.value = d.policy || "";
  mayOperate(sel);
  sel.onchange = () =>
    api("PUT", `/api/v1/disks/${encodeURIComponent(d.name)}/policy`, { policy: sel.value || null }).then(
      () => diskStatus(`${d.name}: policy ${sel.value || "none"}`),
      (e) => diskStatus(`${d.name}: ${e.message}`),
    );
  return sel;
}

function updateStorage(nodes, disks, policies) {
  const nb = document.querySelector("#nodes tbody");
  nb.innerHTML = "";
  for (const n of nodes) {
    row(nb, [n.name, n.url, el("span", n.reachable ? "yes" : `no: ${n.error || ""}`, n.reachable ? "ok" : "down"), n.disks]);
  }
  const pick = document.getElementById("disk-node");
  const names = ["", ...nodes.map((n) => n.name)];
  if ([...pick.options].map((o) => o.value).join() !== names.join()) {
    pick.innerHTML = "";
    pick.appendChild(new Option("any", ""));
    for (const n of nodes) pick.appendChild(new Option(n.name, n.name));
  }
  const db = document.querySelector("#disks tbody");
  // a policy list open under the user's hand is not redrawn
  if (db.contains(document.activeElement)) return;
  db.innerHTML = "";
  for (const d of disks) {
    // {"kind": "primary"} or {"kind": "replica", "of": "disk1"}, …
    const role = typeof d.role === "string"
      ? d.role
      : [d.role.kind, ...Object.entries(d.role).filter(([k]) => k !== "kind").map(([k, v]) => `${k} ${v}`)].join(" ");
    const grow = operatorButton("Grow", `Grow ${d.name} by 1 GiB`);
    grow.id = "disk-grow-" + d.name;
    grow.onclick = () =>
      api("PUT", `/api/v1/disks/${encodeURIComponent(d.name)}/size`, { size: d.size + 1073741824 }).then(
        () => { diskStatus(`${d.name} grown to ${mib(d.size + 1073741824)}`); refresh(); },
        (e) => diskStatus(`${d.name}: ${e.message}`),
      );
    const del = operatorButton("Delete", `Delete disk ${d.name}`);
    del.id = "disk-delete-" + d.name;
    del.onclick = () => {
      if (!confirm(`Delete disk ${d.name} and every byte on it?`)) return;
      api("DELETE", `/api/v1/disks/${encodeURIComponent(d.name)}`).then(
        () => { diskStatus(`${d.name} deleted`); refresh(); },
        (e) => diskStatus(`${d.name}: ${e.message}`),
      );
    };
    const actions = el("span");
    actions.append(grow, del);
    row(db, [d.name, d.node, mib(d.size), d.write_through ? "yes" : "no", diskPolicy(d, policies), d.connections, role, actions]);
  }
}

document.getElementById("disk-form").onsubmit = async (ev) => {
  ev.preventDefault();
  const req = {
    name: field("disk-name"),
    size: Number(field("disk-size")) * 1073741824,
    write_through: document.getElementById("disk-wt").checked,
  };
  if (field("disk-node")) req.node = field("disk-node");
  try {
    await api("POST", "/api/v1/disks", req);
    diskStatus(`${req.name} created`);
    refresh();
  } catch (e) {
    diskStatus(`${req.name} not created: ${e.message}`);
  }
};

// ---- validation ----------------------------------------------------------------

// POST /api/v1/validate: every check with its host, NIC and peer, what was
// seen and the fix; failures first.
document.getElementById("validate").onclick = async () => {
  const status = document.getElementById("validate-status");
  const throughput = document.getElementById("validate-throughput").checked;
  status.textContent = "validating…";
  try {
    const r = await (await api("POST", "/api/v1/validate", { throughput_ms: throughput ? 1000 : 0 })).json();
    const order = { fail: 0, warn: 1, not_available: 2, pass: 3 };
    const cls = { fail: "down", warn: "warn", not_available: "na", pass: "ok" };
    const tb = document.querySelector("#checks tbody");
    tb.innerHTML = "";
    for (const c of [...r.checks].sort((a, b) => order[a.status] - order[b.status])) {
      row(tb, [el("span", c.status.replace("_", " "), cls[c.status]), c.check, c.host, c.nic || "", c.peer || "", c.observed, c.fix || ""]);
    }
    status.textContent = `${r.hosts.length} hosts: ${r.passed} passed, ${r.warned} warned, ${r.failed} failed, ${r.not_available} not available here`;
  } catch (e) {
    status.textContent = `validation not run: ${e.message}`;
  }
};

// ---- creating a VM ---------------------------------------------------------------

// The create form's host list: the hosts up, the choice kept across refreshes.
function updateCreateHosts(hosts) {
  const sel = document.getElementById("vm-host");
  const up = hosts.filter((h) => !h.down && !h.draining).map((h) => h.name);
  if ([...sel.options].map((o) => o.value).join() !== up.join()) {
    const keep = sel.value;
    sel.innerHTML = "";
    for (const h of up) sel.appendChild(new Option(h, h));
    if (up.includes(keep)) sel.value = keep;
  }
}

// POST /api/v1/vms with the spec as `ferry vm create --spec` takes it; the
// server's refusal is shown as it is (it names the field).
document.getElementById("vm-create").onsubmit = async (ev) => {
  ev.preventDefault();
  const status = document.getElementById("vm-create-status");
  let spec = {};
  if (field("vm-spec")) {
    try {
      spec = JSON.parse(field("vm-spec"));
    } catch (e) {
      status.textContent = `the spec is not JSON: ${e.message}`;
      return;
    }
  }
  spec.name = field("vm-name");
  spec.memory = Number(field("vm-memory")) * 1048576;
  spec.fill ??= 0;
  spec.dirty_rate ??= 0;
  status.textContent = `creating ${spec.name} on ${field("vm-host")}…`;
  try {
    await api("POST", "/api/v1/vms", { host: field("vm-host"), spec });
    status.textContent = `${spec.name} created on ${field("vm-host")}`;
    refresh();
  } catch (e) {
    status.textContent = `${spec.name} not created: ${e.message}`;
  }
};

async function refresh() {
  try {
    const [hosts, vms] = await Promise.all([get("/api/v1/hosts"), get("/api/v1/vms")]);
    updateVms(vms, hosts);
    updateCreateHosts(hosts);
    const up = hosts.filter((h) => !h.down).length;
    document.getElementById("summary").textContent = `${hosts.length} hosts (${up} up), ${vms.length} VMs`;
    document.getElementById("error").textContent = "";
    ferry.polls++;
  } catch (e) {
    showError(e);
  }
  try {
    const [policies, flows, events] = await Promise.all([get("/api/v1/qos/policies"), get("/api/v1/qos/flows"), get("/api/v1/events?limit=50")]);
    updateQos(policies, flows);
    updateEvents(events);
    const [nodes, disks] = await Promise.all([get("/api/v1/storage/nodes"), get("/api/v1/disks")]);
    updateStorage(nodes, disks, policies);
  } catch (e) {
    // no storage node registered: the section stays empty
  }
}

document.getElementById("login").onsubmit = async (ev) => {
  ev.preventDefault();
  const input = document.getElementById("token");
  const r = await fetch("/api/v1/session", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    credentials: "same-origin",
    body: JSON.stringify({ token: input.value.trim() }),
  });
  input.value = "";
  const body = await r.json().catch(() => ({}));
  if (r.ok) signedIn(body);
  else signedOut(body.message || r.statusText);
};

document.getElementById("sign-out").onclick = async () => {
  await api("DELETE", "/api/v1/session").catch(() => {});
  signedOut("Signed out");
};

// a session this browser already has, else the sign-in form
fetch("/api/v1/session", { credentials: "same-origin" })
  .then((r) => (r.ok ? r.json().then(signedIn) : signedOut()))
  .catch(() => signedOut());

setInterval(() => ferry.session && refresh(), 3000);
