// Ferry's web console: everything through the control service's REST API
// (/api/v1), the same API the CLI uses. The browser signs in once with an
// API token (POST /api/v1/session) and keeps an HttpOnly session cookie; the
// token is never stored by the page nor put in a URL. Changing requests
// carry the session's CSRF token.
//
// Pages are addressed by the URL's fragment (#/, #/vm/NAME,
// #/operation/ID, #/storage, …): each can be bookmarked, reloaded or sent
// to a colleague. Hosts, VMs, storage flows and events are pushed by the
// control service (one Server-Sent Events stream, GET /watch); a migration's
// or drain's page follows its operation (GET /watch/operations/ID).
"use strict";

const WINDOW_S = 120;
// shared with tests: latest and peak per-NIC rates, moves and drains followed
const ferry = (window.ferry = { nicRates: {}, peakRates: {}, moves: {}, polls: 0, pushes: 0, session: null, hosts: [], vms: [], events: [] });

// what each role may do (the server refuses anything else anyway)
const OPERATES = ["operator", "admin"];
const canOperate = () => ferry.session && OPERATES.includes(ferry.session.role);

// ---- pushed updates -------------------------------------------------------------

// One stream for what every page shows; the browser reconnects when it ends
// (every 5 minutes, authenticated afresh).
let watch = null;
function watchCluster() {
  if (watch) watch.close();
  watch = new EventSource("/api/v1/watch?topics=hosts,vms,flows,events");
  const on = (topic, f) =>
    watch.addEventListener(topic, (e) => {
      ferry.pushes++;
      ferry.polls++;
      f(JSON.parse(e.data));
    });
  on("hosts", (hosts) => {
    const before = upHosts().join();
    ferry.hosts = hosts;
    if (page.name === "host") showHost(page.arg);
    updateHosts(hosts);
    updateSummary();
    updateCreateHosts(hosts);
    if (upHosts().join() !== before) updateVms();
  });
  on("vms", (vms) => {
    ferry.vms = vms;
    updateVms();
    updateSummary();
    if (page.name === "vm") showVm(page.arg, false);
  });
  on("flows", (flows) => updateFlows(flows));
  on("events", (events) => {
    ferry.events = events;
    updateEvents(events);
  });
  watch.addEventListener("error", (e) => {
    if (e.data) showError(new Error(JSON.parse(e.data).message));
  });
}

const upHosts = () => ferry.hosts.filter((h) => !h.down).map((h) => h.name);

function updateSummary() {
  document.getElementById("summary").textContent =
    `${ferry.hosts.length} hosts (${upHosts().length} up), ${ferry.vms.length} VMs`;
}

// ---- pages ------------------------------------------------------------------------

const PAGES = {
  overview: { title: "Overview" },
  vm: { title: "VM" },
  host: { title: "Host" },
  operations: { title: "Migrations and drains" },
  operation: { title: "Operation" },
  storage: { title: "Storage" },
  validation: { title: "Validation" },
  cluster: { title: "Cluster" },
  events: { title: "Events" },
};
const page = { name: "overview", arg: "" };
// a page's own refresh, every 10 s while it shows (what is not pushed)
let pageTimer = null;

// "#/vm/web1" → page vm, arg web1; anything unknown → the overview
function route() {
  const [, name = "", ...rest] = location.hash.replace(/^#/, "").split("/");
  page.name = PAGES[name] ? name : "overview";
  page.arg = decodeURIComponent(rest.join("/"));
  for (const sec of document.querySelectorAll("section.page")) sec.hidden = sec.id !== "page-" + page.name;
  for (const a of document.querySelectorAll("#nav a")) {
    const target = a.getAttribute("href").replace(/^#\/?/, "") || "overview";
    if (target === page.name) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  document.title = `${PAGES[page.name].title}${page.arg ? " " + page.arg : ""} · Ferry`;
  if (page.name !== "operation") stopFollowing();
  clearInterval(pageTimer);
  pageTimer = null;
  if (!ferry.session) return;
  const show = {
    vm: () => showVm(page.arg, true),
    host: () => showHost(page.arg),
    operations: showOperations,
    operation: () => showOperation(page.arg),
    storage: refreshStorage,
    cluster: refreshCluster,
  }[page.name];
  if (show) {
    show();
    if (page.name !== "operation") pageTimer = setInterval(show, 10000);
  }
}
window.addEventListener("hashchange", route);

function go(hash) {
  if (location.hash === hash) route();
  else location.hash = hash;
}

// ---- signing in -----------------------------------------------------------------

function signedOut(why) {
  if (watch) watch.close();
  watch = null;
  stopFollowing();
  ferry.session = null;
  document.getElementById("console").hidden = true;
  document.getElementById("who").hidden = true;
  document.getElementById("nav").hidden = true;
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
  // tables with controls or another user's view in them are drawn anew
  for (const t of ["checks", "host-checks", "policies", "disks", "nodes", "operations", "vm-history", "bw-classes", "bw-nics", "rolling-hosts"])
    document.querySelector(`#${t} tbody`).innerHTML = "";
  stopEditing();
  // the page's fixed controls, for this user's role (rows draw their own)
  for (const id of ["policy-create", "disk-create", "vm-create-btn", "validate", "vm-move", "rolling-start", "rolling-stop", "rule-add", "group-add", "label-save", "balance-run"])
    mayOperate(document.getElementById(id));
  for (const id of ["host-drain", "host-resume", "host-validate"]) mayOperate(document.getElementById(id));
  for (const id of ["bw-set", "cluster-save", "host-save"]) mayAdminister(document.getElementById(id));
  for (const id of ["validate-status", "vm-create-status", "vm-status", "move-status", "drain-status", "drain-limit", "policy-status", "disk-status", "bw-status", "cluster-status", "rolling-status", "host-status"])
    document.getElementById(id).textContent = "";
  document.getElementById("migration").hidden = true;
  document.getElementById("drain-moves").hidden = true;
  document.getElementById("login").hidden = true;
  document.getElementById("console").hidden = false;
  document.getElementById("who").hidden = false;
  document.getElementById("nav").hidden = false;
  document.getElementById("who-name").textContent = `Signed in as ${s.name} (${s.role})`;
  watchCluster();
  route();
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
const RANK = { "read-only": 0, operator: 1, admin: 2 };
function mayDo(c, role) {
  const ok = !!ferry.session && RANK[ferry.session.role] >= RANK[role];
  c.disabled = !ok;
  c.title = ok ? "" : `needs the ${role} role; ${ferry.session ? ferry.session.name + " is " + ferry.session.role : "not signed in"}`;
  return c;
}
const mayOperate = (c) => mayDo(c, "operator");
const mayAdminister = (c) => mayDo(c, "admin");

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

// The definition list `id` holds `pairs` of term and value (text or a node).
function drawFacts(id, pairs) {
  const dl = document.getElementById(id);
  dl.innerHTML = "";
  for (const [k, v] of pairs) {
    const dd = el("dd");
    if (v instanceof Node) dd.appendChild(v);
    else dd.textContent = v;
    dl.append(el("dt", k), dd);
  }
}

const mib = (b) => (b / 1048576).toFixed(0) + " MiB";

// ---- hosts and NIC graphs -----------------------------------------------------

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];

// A graph's width: as asked, or what a narrow screen has room for (its
// card's padding, the page's margins and a scroll bar that may yet appear).
function fitWidth(w) {
  return Math.max(240, Math.min(w, document.documentElement.clientWidth - 64));
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
  resume.onclick = () => api("POST", `/api/v1/hosts/${encodeURIComponent(h.name)}/resume`).catch(showError);
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
    const health = h.health && h.health !== "ok" ? `, ${h.health}` : "";
    const state = (h.down ? "DOWN" : h.reachable ? "up" : "unreachable") + health;
    const info = h.info;
    s.title.innerHTML = "";
    const link = el("a", h.name);
    link.href = "#/host/" + encodeURIComponent(h.name);
    const name = el("b");
    name.append(link, " ");
    s.title.append(
      name,
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

// ---- VMs ----------------------------------------------------------------------------

// VM rows by name, each drawn again only when what it shows changes: with
// 200 VMs, rebuilding every row on each update held the page's main thread
// ~100 ms (and reset a target the user had picked).
const vmRows = new Map();

function updateVms() {
  const tbody = document.querySelector("#vms tbody");
  const up = upHosts();
  const seen = new Set();
  let prev = null;
  for (const v of ferry.vms) {
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

// A select of the hosts up but `except`, labelled.
function targetSelect(id, except, label) {
  const sel = el("select");
  sel.id = id;
  for (const h of upHosts()) if (h !== except) sel.appendChild(new Option(h, h));
  sel.setAttribute("aria-label", label);
  return sel;
}

function vmRow(v) {
  const sel = targetSelect("to-" + v.name, v.host, `Move ${v.name} to`);
  const btn = operatorButton("Move", `Move ${v.name}`);
  btn.id = "move-" + v.name;
  btn.onclick = () => moveVm(v.name, sel.value);
  const host = el("span", v.host);
  host.id = "vm-host-" + v.name;
  const name = el("a", v.name);
  name.href = "#/vm/" + encodeURIComponent(v.name);
  name.id = "vm-link-" + v.name;
  // stops the guest and removes the VM, as `ferry vm rm`: asked once more
  const rm = operatorButton("Remove", `Stop and remove ${v.name}`);
  rm.id = "remove-" + v.name;
  rm.onclick = () => {
    if (!confirm(`Stop ${v.name} and remove it from ${v.host}?`)) return;
    const status = document.getElementById("vm-status");
    api("DELETE", `/api/v1/vms/${encodeURIComponent(v.name)}`).then(
      () => {
        status.textContent = `${v.name} stopped and removed`;
        refreshVms();
      },
      (e) => {
        status.textContent = `${v.name} not removed: ${e.message}`;
      },
    );
  };
  const actions = el("span");
  actions.append(...lifecycleButtons(v), btn, rm);
  return row(null, [name, host, vmState(v), mib(v.spec.memory), sel, actions]);
}

// Start a stopped VM; stop, shut down or reboot a running one (`ferry vm start|stop|…`).
function lifecycleButtons(v) {
  const act = (action, label, ask) => {
    const b = operatorButton(label, `${label} ${v.name}`);
    b.id = `${action}-${v.name}`;
    b.onclick = () => {
      if (ask && !confirm(ask)) return;
      const status = document.getElementById("vm-status");
      status.textContent = `${v.name}: ${action}…`;
      api("POST", `/api/v1/vms/${encodeURIComponent(v.name)}/${action}`, {}).then(
        (r) => {
          status.textContent = `${v.name}: ${r.how ? r.how.replace("_", " ") : action + "ed"}`;
          refreshVms();
        },
        (e) => {
          status.textContent = `${v.name}: ${action} refused: ${e.message}`;
        },
      );
    };
    return b;
  };
  if (v.state === "stopped") return [act("start", "Start")];
  if (v.state === "unknown") return [];
  return [
    act("shutdown", "Shut down", `Ask ${v.name}'s guest to power off (stopped after 60 s)?`),
    act("stop", "Stop", `Stop ${v.name} at once (the guest is not asked)?`),
    act("reboot", "Reboot", `Reset ${v.name}'s guest?`),
  ];
}

// The VMs now, not at the next push (after a change made here).
async function refreshVms() {
  try {
    ferry.vms = await get("/api/v1/vms");
    updateVms();
    updateSummary();
  } catch (e) {
    showError(e);
  }
}

// "paused: storage (storage1 (198.18.0.2:10809), since 12:00:01 UTC, 42s)"
function vmState(v) {
  const ha = v.ha && v.ha.enabled ? ` · HA ${v.ha.priority}` : "";
  if (v.state === "stopped" && v.stopped_because) return `stopped: ${v.stopped_because}${ha}`;
  const p = v.storage_pause;
  if (!p || p.state === "resumed") return v.state + ha;
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
  document.getElementById("migration").hidden = false;
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
  const facts = (pairs) => drawFacts("migration-facts", pairs);
  // what the convergence policy decided, as it shows in the progress:
  // the phase changed, auto-converge throttled the vCPUs, convergence won or lost
  let last = null;
  const decisions = (ev) => {
    const at = `${(ev.elapsed_ms / 1000).toFixed(1)} s: `;
    if (last && ev.phase !== last.phase) step(`${at}decision: ${last.phase} → ${ev.phase}`);
    if ((ev.throttle_pct || 0) !== ((last && last.throttle_pct) || 0))
      step(`${at}decision: vCPUs throttled to ${ev.throttle_pct || 0}% (auto-converge)`);
    if (ev.converging != null && (!last || last.converging !== ev.converging))
      step(`${at}${ev.converging ? "converging" : "not converging"}: transfer ${mbit(ev.throughput)}, dirtying ${mbit(ev.dirty_rate)}`);
    last = ev;
  };
  const step = (text) => {
    const ol = document.getElementById("migration-steps");
    const li = el("li", text);
    ol.appendChild(li);
    li.scrollIntoView({ block: "nearest" });
  };
  return {
    progress(ev) {
      decisions(ev);
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
        ["converging", ev.converging == null ? "—" : ev.converging ? "yes" : "no: dirtying outruns the path"],
        ["vCPU throttle", ev.throttle_pct ? ev.throttle_pct + "%" : "none"],
        ...(ev.carriers_up != null ? [["carriers up", String(ev.carriers_up)]] : []),
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

// ---- migrations and drains as operations -----------------------------------------------

// Starts a migration or drain (its POST answers with the operation's id in
// X-Ferry-Operation) and opens its page; the work goes on whatever this page
// does next.
async function startOperation(path, body) {
  const r = await api("POST", path, body);
  const id = r.headers.get("X-Ferry-Operation");
  // its page follows it; this response's copy of the events is not needed
  r.body.cancel().catch(() => {});
  if (!id) throw new Error("the control service named no operation for it");
  go("#/operation/" + encodeURIComponent(id));
  return id;
}

async function moveVm(vm, to) {
  const status = document.getElementById("vm-status");
  status.textContent = `moving ${vm} to ${to}…`;
  try {
    await startOperation(`/api/v1/vms/${encodeURIComponent(vm)}/move`, moveRequest(to));
    status.textContent = "";
  } catch (e) {
    status.textContent = `${vm} did not move: ${e.message}`;
  }
}

async function drainHost(host) {
  const status = document.getElementById("vm-status");
  try {
    await startOperation(`/api/v1/hosts/${encodeURIComponent(host)}/drain`, {});
  } catch (e) {
    status.textContent = `drain of ${host}: ${e.message}`;
  }
}

// The operation this page follows, if any.
let following = null;
function stopFollowing() {
  if (following) following.close();
  following = null;
}

const when = (ms) => new Date(ms).toLocaleTimeString();

function opLink(o, text) {
  const a = el("a", text);
  a.href = "#/operation/" + encodeURIComponent(o.id);
  return a;
}

const OP_STATE = { running: "warn", completed: "ok", failed: "down" };

async function showOperations() {
  try {
    const ops = await get("/api/v1/operations");
    const tb = document.querySelector("#operations tbody");
    tb.innerHTML = "";
    for (const o of ops) {
      const what = o.kind === "migration" ? `move ${o.subject}` : `drain ${o.subject}`;
      row(tb, [when(o.started_ms), opLink(o, what), o.target ? `${o.source} → ${o.target}` : o.source, o.by, el("span", o.state, OP_STATE[o.state])]);
    }
    if (!ops.length) row(tb, ["none since the control service started", "", "", "", ""]);
  } catch (e) {
    showError(e);
  }
}

// A migration's or drain's page: every event from the first (a page opened
// or reloaded halfway catches up), as they come, then its end.
async function showOperation(id) {
  stopFollowing();
  document.getElementById("migration").hidden = true;
  document.getElementById("drain-moves").hidden = true;
  for (const i of ["move-status", "drain-status", "drain-limit"]) document.getElementById(i).textContent = "";
  let op;
  try {
    op = (await get("/api/v1/operations")).find((o) => o.id === id);
  } catch (e) {
    showError(e);
    return;
  }
  const title = document.getElementById("operation-title");
  if (!op) {
    title.textContent = `No operation ${id}`;
    document.getElementById("move-status").textContent =
      "The control instances keep the 64 newest operations (each with its last 64 events when another instance runs it); the event log has the results of older ones.";
    return;
  }
  const view = op.kind === "migration" ? migrationView(op) : drainView(op);
  const src = new EventSource(`/api/v1/watch/operations/${encodeURIComponent(id)}`);
  following = src;
  src.addEventListener("op", (e) => view.event(JSON.parse(e.data)));
  src.addEventListener("end", (e) => {
    src.close();
    if (following === src) following = null;
    view.end(JSON.parse(e.data));
  });
  src.addEventListener("error", () => {
    // refused or gone (not a reconnect): say so
    if (src.readyState === EventSource.CLOSED) document.getElementById("move-status").textContent = `${id}: the stream was refused or ended`;
  });
}

function migrationView(op) {
  const vm = op.subject;
  const to = op.target;
  const status = document.getElementById("move-status");
  const m = (ferry.moves[vm] = { id: op.id, to, events: [], done: false });
  const panel = migrationPanel(vm, op.source, to);
  document.getElementById("operation-title").textContent = `Migration of ${vm}: ${op.source} → ${to} (started ${when(op.started_ms)} by ${op.by})`;
  status.textContent = `moving ${vm} to ${to}…`;
  return {
    event(ev) {
      m.events.push(ev);
      if (ev.event === "progress") {
        panel.progress(ev);
        const pct = ev.total ? ((100 * ev.transferred) / ev.total).toFixed(0) : "?";
        status.textContent = `${vm} → ${to}: ${ev.phase} ${mib(ev.transferred)} moved (${pct}%), ${mbit(ev.throughput)}`;
      }
      if (ev.event === "step") {
        panel.step(`${ev.step}: ${ev.detail}`);
        status.textContent = `${vm} → ${to}: ${ev.step} — ${ev.detail}`;
      }
      if (ev.event === "warning") panel.step(`warning: ${ev.message}`);
      if (ev.event === "path") {
        panel.step(`${ev.nic} ${ev.action}: ${ev.reason}`);
        status.textContent = `${vm} → ${to}: ${ev.nic} ${ev.action} — ${ev.reason}`;
      }
      if (ev.event === "completed") {
        panel.report(ev);
        status.textContent = `${vm} moved to ${to} in ${(ev.total_ms / 1000).toFixed(1)} s, downtime ${ev.guest_downtime_ms || ev.downtime_ms} ms`;
      }
      if (ev.event === "failed") {
        panel.step(`failed: ${ev.error.message}`);
        status.textContent = `${vm} did not move: ${ev.error.message}`;
      }
    },
    end(o) {
      if (o.state === "failed" && !m.events.some((e) => e.event === "failed")) status.textContent = `${vm}: the move ended without a result`;
      m.done = true;
    },
  };
}

// A drain as it goes: every move queued, running, done, retried or failed,
// and the limit the scheduler chose with its reason.
function drainView(op) {
  const host = op.subject;
  const status = document.getElementById("drain-status");
  const table = document.getElementById("drain-moves");
  const tbody = table.querySelector("tbody");
  const d = (ferry.drain = { id: op.id, host, moves: {}, limits: [], done: null });
  tbody.innerHTML = "";
  table.hidden = false;
  document.getElementById("operation-title").textContent = `Drain of ${host} (started ${when(op.started_ms)} by ${op.by})`;
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
  return {
    event(ev) {
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
    },
    end(o) {
      if (!d.done) {
        d.done = { failed: true };
        status.textContent = `drain of ${host} ended without its result (${o.state})`;
      }
    },
  };
}

// ---- a host's page -----------------------------------------------------------------

// State, maintenance, NICs with their fabric, link and MTU, settings, VMs,
// and this host's checks; drawn again with each pushed hosts' list.
function showHost(name) {
  const h = ferry.hosts.find((x) => x.name === name);
  document.getElementById("host-title").textContent = `Host ${name}`;
  if (!h) {
    drawFacts("host-facts", [["state", ferry.hosts.length ? "no such host" : "…"]]);
    return;
  }
  const info = h.info;
  const s = h.settings || {};
  const limit = s.max_migrations == null ? "auto (default)" : s.max_migrations === "auto" ? "auto" : String(s.max_migrations.fixed);
  drawFacts("host-facts", [
    ["state", h.down ? "down: no heartbeat" : h.reachable ? "up" : `unreachable: ${h.error || ""}`],
    ["maintenance", h.draining ? "drained: takes no VMs until resumed" : "no: takes VMs"],
    ["agent", h.agent_url],
    ["memory", info ? `${mib(info.memory_free)} free of ${mib(info.memory_total)}` : "—"],
    ["migrations at once", limit],
    ["performance option", s.migration_option || "auto (default)"],
    ["features", info ? (info.features || []).join(", ") || "—" : "—"],
  ]);
  const nb = document.querySelector("#host-nics tbody");
  nb.innerHTML = "";
  for (const n of info ? info.nics : []) {
    const rate = ferry.nicRates[`${name}/${n.name}`];
    row(nb, [n.name, n.network, n.address, String(n.mtu), el("span", n.up ? "up" : "down", n.up ? "ok" : "down"), rate == null ? "—" : rate.toFixed(0) + " Mbit/s"]);
  }
  const ul = document.getElementById("host-vms");
  ul.innerHTML = "";
  for (const v of ferry.vms.filter((v) => v.host === name)) {
    const li = el("li");
    const a = el("a", v.name);
    a.href = "#/vm/" + encodeURIComponent(v.name);
    li.append(a, ` (${vmState(v)}, ${mib(v.spec.memory)})`);
    ul.appendChild(li);
  }
  if (!ul.children.length) ul.appendChild(el("li", "none"));
}

document.getElementById("host-drain").onclick = () => drainHost(page.arg);
document.getElementById("host-resume").onclick = () =>
  api("POST", `/api/v1/hosts/${encodeURIComponent(page.arg)}/resume`).then(() => status("host-status", `${page.arg} takes VMs again`), (e) => status("host-status", e.message));

// POST /validate for this host (and the paths touching it)
document.getElementById("host-validate").onclick = async () => {
  const name = page.arg;
  status("host-status", `validating ${name}…`);
  try {
    const r = await (await api("POST", "/api/v1/validate", { hosts: [name], throughput_ms: 0 })).json();
    const tb = document.querySelector("#host-checks tbody");
    tb.innerHTML = "";
    for (const c of sortedChecks(r.checks).filter((c) => c.host === name))
      row(tb, [checkStatus(c), c.check, c.nic || "", c.peer || "", c.observed, c.fix || ""]);
    status("host-status", `${name}: ${r.passed} passed, ${r.warned} warned, ${r.failed} failed, ${r.not_available} not available here`);
  } catch (e) {
    status("host-status", `validation not run: ${e.message}`);
  }
};

document.getElementById("host-settings").onsubmit = async (ev) => {
  ev.preventDefault();
  const name = page.arg;
  const settings = {};
  const max = field("host-max");
  if (max) settings.max_migrations = max === "auto" ? "auto" : { fixed: Number(max) };
  if (field("host-option")) settings.migration_option = field("host-option");
  try {
    await api("PUT", `/api/v1/hosts/${encodeURIComponent(name)}/settings`, settings);
    status("host-status", `${name}: settings saved`);
  } catch (e) {
    status("host-status", `${name}: settings not saved: ${e.message}`);
  }
};

// ---- a VM's page ---------------------------------------------------------------------

// Its facts, a move from here, its moves (the event log's, each linked to
// its operation while the control service keeps it) and its console's end.
async function showVm(name, full) {
  const v = ferry.vms.find((x) => x.name === name);
  document.getElementById("vm-title").textContent = `VM ${name}`;
  if (!v) {
    drawFacts("vm-facts", [["state", ferry.vms.length ? "no such VM (removed?)" : "…"]]);
  } else {
    const spec = el("details");
    spec.append(el("summary", "spec"), el("pre", JSON.stringify(v.spec, null, 2)));
    drawFacts("vm-facts", [["host", v.host], ["state", vmState(v)], ["memory", mib(v.spec.memory)], ["vCPUs", String(v.spec.vcpus || 1)],
      ["disks", (v.spec.disks || []).map((d) => d.disk).join(", ") || "none"], ["spec", spec]]);
    const sel = document.getElementById("vm-move-to");
    const want = upHosts().filter((h) => h !== v.host);
    if ([...sel.options].map((o) => o.value).join() !== want.join()) {
      sel.innerHTML = "";
      for (const h of want) sel.appendChild(new Option(h, h));
    }
  }
  if (!full) return;
  try {
    const [ops, events] = await Promise.all([get("/api/v1/operations"), get("/api/v1/events?limit=2000")]);
    const tb = document.querySelector("#vm-history tbody");
    tb.innerHTML = "";
    const mine = ops.filter((o) => o.kind === "migration" && o.subject === name);
    // the operation an event logged the end of, while it is kept
    const opOf = (kind, subject, at) => ops.find((o) => o.kind === kind && o.subject === subject && o.ended_ms && Math.abs(o.ended_ms - at) < 10000);
    // running ones first (not logged yet), then each logged end: its own
    // moves and its moves in drains
    for (const o of mine.filter((o) => o.state === "running")) row(tb, [when(o.started_ms), `${o.source} → ${o.target}`, opLink(o, "running"), "—", o.by]);
    for (const e of [...events].reverse()) {
      const d = e.detail || {};
      const at = new Date(e.at_ms).toLocaleString();
      if (e.kind === "migration" && e.subject === name) {
        const o = opOf("migration", name, e.at_ms);
        const result = d.event === "completed" ? `moved in ${((d.total_ms || 0) / 1000).toFixed(1)} s over ${d.option}` : `failed: ${(d.error || {}).message || ""}`;
        row(tb, [at, `${d.source} → ${d.target}`, o ? opLink(o, result) : result,
          d.event === "completed" ? `${d.guest_downtime_ms ?? d.downtime_ms} ms` : "—", o ? o.by : "—"]);
      }
      if (e.kind === "drain") {
        const o = opOf("drain", e.subject, e.at_ms);
        for (const m of (d.moved || []).filter((m) => m.vm === name)) {
          const result = `moved in ${(m.total_ms / 1000).toFixed(1)} s, draining ${e.subject}`;
          row(tb, [at, `${e.subject} → ${m.to}`, o ? opLink(o, result) : result, `${m.downtime_ms} ms`, o ? o.by : "—"]);
        }
        for (const m of (d.failed || []).filter((m) => m.vm === name))
          row(tb, [at, `${e.subject} → —`, `not moved, draining ${e.subject}: ${m.reason}`, "—", o ? o.by : "—"]);
      }
    }
    if (!tb.children.length) row(tb, ["never moved", "", "", "", ""]);
  } catch (e) {
    showError(e);
  }
  readConsole(name);
}

async function readConsole(name) {
  const pre = document.getElementById("vm-console");
  if (!canOperate()) {
    pre.textContent = "A console is an operator's to read (it may print what a read-only user should not see).";
    return;
  }
  try {
    const c = await get(`/api/v1/vms/${encodeURIComponent(name)}/console?bytes=8192`);
    pre.textContent = c.text || "(nothing written yet)";
    pre.dataset.size = c.size;
    pre.scrollTop = pre.scrollHeight;
  } catch (e) {
    pre.textContent = `not read: ${e.message}`;
  }
}

document.getElementById("vm-console-refresh").onclick = () => readConsole(page.arg);
document.getElementById("vm-move").onclick = () => moveVm(page.arg, document.getElementById("vm-move-to").value);

// ---- storage: nodes, disks, QoS policies and flows ---------------------------------------

function status(id, text) {
  document.getElementById(id).textContent = text;
}

// Nodes, disks and policies (not pushed: they change when someone changes
// them; this page reads them on opening, after each change and every 10 s).
async function refreshStorage() {
  try {
    const [policies, nodes, disks] = await Promise.all([get("/api/v1/qos/policies"), get("/api/v1/storage/nodes"), get("/api/v1/disks")]);
    updatePolicies(policies);
    updateStorage(nodes, disks, policies);
  } catch (e) {
    // no storage node registered: the section stays empty
    status("disk-status", e.message);
  }
}

// The policy being edited, if any: the form saves it (PUT) instead of making one.
let editing = null;

function updatePolicies(policies) {
  const pb = document.querySelector("#policies tbody");
  pb.innerHTML = "";
  for (const p of policies) {
    const edit = operatorButton("Edit", `Edit policy ${p.name}`);
    edit.id = "policy-edit-" + p.name;
    edit.onclick = () => editPolicy(p);
    const del = operatorButton("Delete", `Delete policy ${p.name}`);
    del.id = "policy-delete-" + p.name;
    del.onclick = () =>
      api("DELETE", `/api/v1/qos/policies/${encodeURIComponent(p.name)}`).then(refreshStorage, (e) => status("policy-status", e.message));
    const actions = el("span");
    actions.append(edit, del);
    row(pb, [p.name, p.kind, p.min_iops || "-", p.max_iops || "-", p.max_bandwidth ? (p.max_bandwidth / 1e6).toFixed(0) + " MB/s" : "-", actions]);
  }
}

// The form holds the policy's limits; its name and type stay (a policy's
// type is fixed once made).
function editPolicy(p) {
  editing = p.name;
  document.getElementById("policy-name").value = p.name;
  document.getElementById("policy-name").readOnly = true;
  document.getElementById("policy-kind").value = p.kind;
  document.getElementById("policy-kind").disabled = true;
  document.getElementById("policy-min").value = p.min_iops;
  document.getElementById("policy-max").value = p.max_iops;
  document.getElementById("policy-mbps").value = Math.round(p.max_bandwidth / 1e6);
  document.getElementById("policy-create").textContent = `Save ${p.name}`;
  document.getElementById("policy-cancel").hidden = false;
  document.getElementById("policy-min").focus();
}

function stopEditing() {
  editing = null;
  document.getElementById("policy-name").readOnly = false;
  document.getElementById("policy-kind").disabled = false;
  document.getElementById("policy-create").textContent = "Create policy";
  document.getElementById("policy-cancel").hidden = true;
}
document.getElementById("policy-cancel").onclick = stopEditing;

document.getElementById("policy-form").onsubmit = async (ev) => {
  ev.preventDefault();
  const num = (id) => Math.max(0, Math.round(Number(document.getElementById(id).value) || 0));
  const limits = { min_iops: num("policy-min"), max_iops: num("policy-max"), max_bandwidth: num("policy-mbps") * 1e6 };
  try {
    if (editing) {
      await api("PUT", `/api/v1/qos/policies/${encodeURIComponent(editing)}`, limits);
      status("policy-status", `policy ${editing} saved`);
      stopEditing();
    } else {
      const policy = { name: field("policy-name"), kind: document.getElementById("policy-kind").value, ...limits };
      await api("POST", "/api/v1/qos/policies", policy);
      status("policy-status", `policy ${policy.name} created`);
    }
    refreshStorage();
  } catch (e) {
    // the server names what was wrong
    status("policy-status", e.message);
  }
};

// flow -> IOPS samples, with their times, for the flows' graph
const flowSeries = (ferry.flowSeries = { t: [], iops: {}, mbps: {}, latency: {}, plot: null, names: "" });

function updateFlows(flows) {
  ferry.flows = flows;
  const fb = document.querySelector("#flows tbody");
  fb.innerHTML = "";
  for (const f of flows) {
    const st = el("span", f.status, f.status === "Ok" ? "ok" : "down");
    row(fb, [f.id, f.host, f.policy || "-", f.iops.toFixed(0), (f.bandwidth / 1e6).toFixed(1), f.latency_us.toFixed(0), f.min_iops, f.max_iops, st]);
  }
  updateFlowPlot(flows);
}

// What the flows' graph can draw: each flow's value and its axis.
const FLOW_METRICS = {
  iops: { of: (f) => f.iops, unit: "IOPS", axis: "IOPS (8 KiB)" },
  mbps: { of: (f) => f.bandwidth / 1e6, unit: "MB/s", axis: "MB/s" },
  latency: { of: (f) => f.latency_us, unit: "µs", axis: "latency µs" },
};

// Each flow's IOPS, MB/s and latency over the last two minutes; the graph
// draws the one picked, a line per flow.
function updateFlowPlot(flows) {
  const now = Date.now() / 1000;
  const s = flowSeries;
  s.t.push(now);
  for (const [m, { of }] of Object.entries(FLOW_METRICS)) {
    const per = (s[m] = s[m] || {});
    for (const f of flows) {
      if (!per[f.id]) per[f.id] = s.t.slice(0, -1).map(() => null);
      per[f.id].push(of(f));
    }
    for (const k of Object.keys(per)) if (per[k].length < s.t.length) per[k].push(null);
  }
  while (s.t.length && s.t[0] < now - WINDOW_S) {
    s.t.shift();
    for (const m of Object.keys(FLOW_METRICS)) for (const k in s[m]) s[m][k].shift();
  }
  drawFlowPlot();
}

function drawFlowPlot() {
  const s = flowSeries;
  const metric = document.getElementById("flow-metric").value;
  const per = s[metric] || {};
  const names = Object.keys(per).sort();
  if (!names.length) return;
  const key = metric + ":" + names.join(",");
  if (s.plot && s.names !== key) {
    s.plot.destroy();
    s.plot = null;
  }
  const data = [s.t, ...names.map((k) => per[k])];
  if (!s.plot) {
    s.names = key;
    const m = FLOW_METRICS[metric];
    s.plot = new uPlot(lastMinutes(names, m.unit, 560, 180, m.axis), data, document.getElementById("flows-plot"));
  } else {
    s.plot.setData(data);
  }
}
document.getElementById("flow-metric").onchange = drawFlowPlot;

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
      () => status("disk-status", `${d.name}: policy ${sel.value || "none"}`),
      (e) => status("disk-status", `${d.name}: ${e.message}`),
    );
  return sel;
}

// A disk's attach control: a VM to plug it into (hot-plugged; the VM's
// host is let open it), as `ferry disk attach`.
function diskAttach(d) {
  const span = el("span");
  const sel = el("select");
  sel.id = "disk-attach-to-" + d.name;
  sel.setAttribute("aria-label", `VM to attach ${d.name} to`);
  for (const v of ferry.vms) if (!(v.spec.disks || []).some((p) => p.disk === d.name)) sel.appendChild(new Option(v.name, v.name));
  const btn = operatorButton("Attach", `Attach ${d.name}`);
  btn.id = "disk-attach-" + d.name;
  btn.disabled ||= !sel.options.length;
  btn.onclick = () => {
    status("disk-status", `attaching ${d.name} to ${sel.value}…`);
    api("POST", `/api/v1/disks/${encodeURIComponent(d.name)}/attach`, { vm: sel.value }).then(
      () => { status("disk-status", `${d.name} attached to ${sel.value}`); refreshStorage(); refreshVms(); },
      (e) => status("disk-status", `${d.name} not attached: ${e.message}`),
    );
  };
  span.append(sel, btn);
  return span;
}

// A disk's backup to a file on its node, followed until it ends.
async function backUp(d) {
  const path = prompt(`Back up ${d.name} to which new file on ${d.node}? (an absolute path in a directory that exists there)`, "");
  if (!path) return;
  try {
    await api("POST", `/api/v1/disks/${encodeURIComponent(d.name)}/backups`, { path });
    for (;;) {
      const j = await get(`/api/v1/disks/${encodeURIComponent(d.name)}/job`);
      status("disk-status", `backup of ${d.name} to ${j.target}: ${j.state}, ${mib(j.bytes_done)} of ${mib(j.bytes_total)}${j.error ? ": " + j.error : ""}`);
      if (j.state !== "running") break;
      await new Promise((r) => setTimeout(r, 1000));
    }
  } catch (e) {
    status("disk-status", `${d.name} not backed up: ${e.message}`);
  }
}

// A disk moved to another node while its guests run (`ferry disk move`).
async function moveDisk(d, to) {
  status("disk-status", `moving ${d.name} to ${to}…`);
  try {
    const r = await api("POST", `/api/v1/disks/${encodeURIComponent(d.name)}/move`, { to });
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      const lines = buf.split("\n");
      buf = lines.pop();
      for (const line of lines.filter((l) => l.trim())) {
        const m = JSON.parse(line);
        status("disk-status", `${d.name} → ${to}: ${m.phase}${m.error ? ": " + m.error : ""}`);
      }
    }
    refreshStorage();
  } catch (e) {
    status("disk-status", `${d.name} not moved: ${e.message}`);
  }
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
  // a list open under the user's hand is not redrawn
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
        () => { status("disk-status", `${d.name} grown to ${mib(d.size + 1073741824)}`); refreshStorage(); },
        (e) => status("disk-status", `${d.name}: ${e.message}`),
      );
    // a backup writes a file on the node: an administrator's
    const backup = mayAdminister(operatorButton("Back up", `Back up ${d.name}`));
    backup.id = "disk-backup-" + d.name;
    backup.onclick = () => backUp(d);
    const actions = el("span");
    actions.append(grow, backup);
    // another node to move it to, when there is one
    for (const n of nodes.filter((n) => n.name !== d.node && n.reachable)) {
      const mv = operatorButton(`Move to ${n.name}`, `Move ${d.name} to ${n.name}`);
      mv.onclick = () => moveDisk(d, n.name);
      actions.append(mv);
    }
    const del = operatorButton("Delete", `Delete disk ${d.name}`);
    del.id = "disk-delete-" + d.name;
    del.onclick = () => {
      if (!confirm(`Delete disk ${d.name} and every byte on it?`)) return;
      api("DELETE", `/api/v1/disks/${encodeURIComponent(d.name)}`).then(
        () => { status("disk-status", `${d.name} deleted`); refreshStorage(); },
        (e) => status("disk-status", `${d.name}: ${e.message}`),
      );
    };
    actions.append(del);
    row(db, [d.name, d.node, mib(d.size), d.write_through ? "yes" : "no", diskPolicy(d, policies), d.connections, role, diskAttach(d), actions]);
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
    status("disk-status", `${req.name} created`);
    refreshStorage();
  } catch (e) {
    status("disk-status", `${req.name} not created: ${e.message}`);
  }
};

// ---- validation ----------------------------------------------------------------

// Checks in the order an administrator reads them: failures first.
function sortedChecks(checks) {
  const order = { fail: 0, warn: 1, not_available: 2, pass: 3 };
  return [...checks].sort((a, b) => order[a.status] - order[b.status]);
}

function checkStatus(c) {
  const cls = { fail: "down", warn: "warn", not_available: "na", pass: "ok" };
  return el("span", c.status.replace("_", " "), cls[c.status]);
}

// POST /api/v1/validate: every check with its host, NIC and peer, what was
// seen and the fix; failures first.
document.getElementById("validate").onclick = async () => {
  const status = document.getElementById("validate-status");
  const throughput = document.getElementById("validate-throughput").checked;
  status.textContent = "validating…";
  try {
    const r = await (await api("POST", "/api/v1/validate", { throughput_ms: throughput ? 1000 : 0 })).json();
    const tb = document.querySelector("#checks tbody");
    tb.innerHTML = "";
    for (const c of sortedChecks(r.checks)) row(tb, [checkStatus(c), c.check, c.host, c.nic || "", c.peer || "", c.observed, c.fix || ""]);
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
    refreshVms();
  } catch (e) {
    status.textContent = `${spec.name} not created: ${e.message}`;
  }
};

// ---- the cluster: bandwidth classes, settings, rolling drain ------------------------------

const rate = (bits) => (bits / 1e6).toFixed(0) + " Mbit/s";

async function refreshCluster() {
  try {
    const [bw, settings, rolling] = await Promise.all([get("/api/v1/bandwidth"), get("/api/v1/cluster"), get("/api/v1/cluster/rolling")]);
    const cb = document.querySelector("#bw-classes tbody");
    cb.innerHTML = "";
    for (const c of bw.policy.classes) {
      const max = !c.max ? "none" : c.max.percent != null ? `${c.max.percent}% of each NIC` : `${rate(c.max.bits_per_sec)} per host`;
      row(cb, [c.class, max, c.min_pct ? `${c.min_pct}% of each NIC` : "none"]);
    }
    if (!bw.policy.classes.length) row(cb, ["no limits set", "", ""]);
    const nb = document.querySelector("#bw-nics tbody");
    nb.innerHTML = "";
    for (const h of bw.hosts)
      for (const n of h.nics)
        for (const c of n.classes) row(nb, [h.host, n.nic, n.up ? rate(n.link_rate) : "down", c.class, rate(c.rate), rate(c.ceil), rate(c.tx_rate * 8)]);
    if (!document.getElementById("cluster-form").contains(document.activeElement))
      document.getElementById("cluster-encrypt").checked = settings.encryption;
    updateRolling(rolling);
    updateRules(await get("/api/v1/placement"));
  } catch (e) {
    showError(e);
  }
}

// The placement rules, each removable by an operator, and the strict
// rules VMs break where they run now.
function updateRules(p) {
  const tb = document.querySelector("#rules tbody");
  tb.innerHTML = "";
  for (const r of p.rules) {
    const del = operatorButton("Remove", `Remove rule ${r.name}`);
    del.id = "rule-remove-" + r.name;
    del.onclick = () =>
      api("DELETE", `/api/v1/placement/rules/${encodeURIComponent(r.name)}`).then(refreshCluster, (e) => status("rule-status", e.message));
    row(tb, [r.name, r.kind, r.kind === "exclude" ? "-" : r.strict ? "strict" : "soft", r.group || "-", r.vms.join(", "), del]);
  }
  if (!p.rules.length) row(tb, ["no rules", "", "", "", "", ""]);
  document.getElementById("rules-broken").textContent = p.broken.length ? "Broken now: " + p.broken.join("; ") : "";
  const labels = p.labels || {};
  const kv = (m) => Object.entries(m || {}).map(([k, v]) => `${k}=${v}`).join(", ") || "-";
  const gb = document.querySelector("#groups tbody");
  gb.innerHTML = "";
  for (const g of p.groups || []) {
    // members now: named hosts, and hosts carrying every label of the group
    const byLabel = Object.entries(labels)
      .filter(([, l]) => Object.keys(g.labels || {}).length && Object.entries(g.labels).every(([k, v]) => l[k] === v))
      .map(([h]) => h);
    const members = [...new Set([...(g.hosts || []), ...byLabel])].sort();
    const del = operatorButton("Remove", `Remove host group ${g.name}`);
    del.id = "group-remove-" + g.name;
    del.onclick = () =>
      api("DELETE", `/api/v1/placement/groups/${encodeURIComponent(g.name)}`).then(refreshCluster, (e) => status("group-status", e.message));
    row(gb, [g.name, (g.hosts || []).join(", ") || "-", kv(g.labels), members.join(", ") || "none", del]);
  }
  if (!(p.groups || []).length) row(gb, ["no groups", "", "", "", ""]);
  const lb = document.querySelector("#host-labels tbody");
  lb.innerHTML = "";
  for (const [h, l] of Object.entries(labels)) row(lb, [h, kv(l)]);
  if (!Object.keys(labels).length) row(lb, ["no labels", ""]);
}

// `k=v,k2=v2` as a map; an entry without `=` is named
function pairs(text, what) {
  const out = {};
  for (const p of text.split(",").map((x) => x.trim()).filter(Boolean)) {
    const i = p.indexOf("=");
    if (i < 1) throw new Error(`${what}: '${p}' is not key=value`);
    out[p.slice(0, i).trim()] = p.slice(i + 1).trim();
  }
  return out;
}

document.getElementById("group-form").onsubmit = async (ev) => {
  ev.preventDefault();
  try {
    const g = { name: field("group-name"), hosts: field("group-hosts").split(",").map((h) => h.trim()).filter(Boolean),
                labels: pairs(field("group-labels"), "labels") };
    await api("POST", "/api/v1/placement/groups", g);
    status("group-status", `group ${g.name} saved`);
    refreshCluster();
  } catch (e) {
    status("group-status", `not saved: ${e.message}`);
  }
};

document.getElementById("label-form").onsubmit = async (ev) => {
  ev.preventDefault();
  try {
    const host = field("label-host");
    const u = { set: pairs(field("label-set"), "set"), unset: field("label-unset").split(",").map((k) => k.trim()).filter(Boolean) };
    await api("PUT", `/api/v1/hosts/${encodeURIComponent(host)}/labels`, u);
    status("label-status", `${host} labelled`);
    refreshCluster();
  } catch (e) {
    status("label-status", `not labelled: ${e.message}`);
  }
};

function showPlan(p) {
  const tb = document.querySelector("#balance-moves tbody");
  tb.innerHTML = "";
  for (const m of p.moves)
    row(tb, [m.vm, m.from, m.to, mib(m.bytes), m.seconds.toFixed(0) + " s", m.mends ? "mends " + m.mends : m.benefit.toFixed(3)]);
  document.getElementById("balance-state").textContent =
    `Spread of host load ${p.spread_before.toFixed(3)} → ${p.spread_after.toFixed(3)} (threshold ${p.threshold.toFixed(2)}), ` +
    `${p.moves.length} move(s): ${p.why}` + (p.started ? ". Started, one at a time (see Events)." : "");
}

document.getElementById("rule-form").onsubmit = async (ev) => {
  ev.preventDefault();
  const kind = field("rule-kind");
  const rule = { name: field("rule-name"), kind, vms: field("rule-vms").split(",").map((v) => v.trim()).filter(Boolean),
                 strict: !document.getElementById("rule-soft").checked };
  if (kind === "host-affinity" || kind === "host-anti-affinity") rule.group = field("rule-group");
  try {
    await api("POST", "/api/v1/placement/rules", rule);
    status("rule-status", `rule ${rule.name} made`);
    refreshCluster();
  } catch (e) {
    status("rule-status", `not made: ${e.message}`);
  }
};

document.getElementById("balance-plan").onclick = () =>
  api("POST", "/api/v1/cluster/balance", { dry_run: true })
    .then((r) => r.json())
    .then(showPlan, (e) => status("balance-status", e.message));

document.getElementById("balance-form").onsubmit = async (ev) => {
  ev.preventDefault();
  if (!confirm("Move VMs to even out the hosts' load?")) return;
  try {
    showPlan(await (await api("POST", "/api/v1/cluster/balance", {})).json());
  } catch (e) {
    status("balance-status", e.message);
  }
};

function updateRolling(r) {
  const state = document.getElementById("rolling-state");
  const tb = document.querySelector("#rolling-hosts tbody");
  tb.innerHTML = "";
  if (!r || !r.hosts) {
    state.textContent = "No rolling drain has run.";
    return;
  }
  state.textContent = `Rolling drain ${r.state}, started ${when(r.started_ms)}${r.ended_ms ? `, ended ${when(r.ended_ms)}` : ""}` +
    `; at most ${r.request.max_hosts_down} host(s) down at once${r.message ? ": " + r.message : ""}`;
  for (const h of r.hosts) {
    const p = h.progress;
    row(tb, [h.host, h.phase, p ? `${p.moved} of ${p.planned}` : String((h.moved || []).length), String((h.left || []).length), h.reason || ""]);
  }
}

document.getElementById("bw-form").onsubmit = async (ev) => {
  ev.preventDefault();
  const cls = field("bw-class");
  const max = Number(field("bw-max")) || 0;
  // the class's limits become what the form says (clear, then set)
  const req = { class: cls, clear: true, min_pct: Number(field("bw-min")) || 0 };
  if (max) req.max = { percent: max };
  try {
    await api("PUT", "/api/v1/bandwidth", req);
    status("bw-status", `${cls}: set`);
    refreshCluster();
  } catch (e) {
    status("bw-status", `${cls} not set: ${e.message}`);
  }
};

document.getElementById("cluster-form").onsubmit = async (ev) => {
  ev.preventDefault();
  const encryption = document.getElementById("cluster-encrypt").checked;
  try {
    await api("PUT", "/api/v1/cluster", { encryption });
    status("cluster-status", `saved: encryption ${encryption ? "on" : "OFF: memory crosses the migration network in clear"}`);
    refreshCluster();
  } catch (e) {
    status("cluster-status", `not saved: ${e.message}`);
  }
};

document.getElementById("rolling-form").onsubmit = async (ev) => {
  ev.preventDefault();
  const hosts = field("rolling-list").split(",").map((h) => h.trim()).filter(Boolean);
  if (!confirm(`Drain ${hosts.length ? hosts.join(", ") : "every host"} in turn, ${field("rolling-down") || 1} at a time?`)) return;
  try {
    const r = await (await api("POST", "/api/v1/cluster/rolling", { hosts, max_hosts_down: Number(field("rolling-down")) || 1 })).json();
    status("rolling-status", "started");
    updateRolling(r);
  } catch (e) {
    status("rolling-status", `not started: ${e.message}`);
  }
};

document.getElementById("rolling-stop").onclick = async () => {
  try {
    updateRolling(await (await api("DELETE", "/api/v1/cluster/rolling")).json());
    status("rolling-status", "stopped: hosts already drained stay so until resumed");
  } catch (e) {
    status("rolling-status", `not stopped: ${e.message}`);
  }
};

// ---- events ---------------------------------------------------------------------------

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
function updateEvents(events) {
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
  for (const e of shown.slice(-30).reverse()) {
    // a sentence; the whole detail folded under it
    const fold = el("details");
    fold.append(el("summary", sentence(e)), el("pre", JSON.stringify(e.detail, null, 2)));
    row(tb, [new Date(e.at_ms).toLocaleTimeString(), e.kind, e.subject, fold]);
  }
}
document.getElementById("event-kind").onchange = () => updateEvents(ferry.events);
document.getElementById("event-subject").oninput = () => updateEvents(ferry.events);

function showError(e) {
  document.getElementById("error").textContent = e.message;
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
