// Ferry's web page: everything through the control service's REST API
// (/api/v1, an API token as bearer), the same API the CLI uses.
"use strict";

const WINDOW_S = 120;
// shared with tests: latest and peak per-NIC rates, last move's events
const ferry = (window.ferry = { nicRates: {}, peakRates: {}, moves: {}, polls: 0 });

function token() {
  const m = location.hash.match(/token=([0-9A-Za-z_]+)/);
  if (m) localStorage.setItem("ferry-token", m[1]);
  return localStorage.getItem("ferry-token") || "";
}

async function api(method, path, body) {
  const r = await fetch(path, {
    method,
    headers: { Authorization: "Bearer " + token(), "Content-Type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (r.status === 401) {
    document.getElementById("login").style.display = "block";
    throw new Error("the API token is missing, unknown or revoked");
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

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

function row(tbody, cells) {
  const tr = el("tr");
  for (const c of cells) {
    const td = el("td");
    if (c instanceof Node) td.appendChild(c);
    else td.textContent = c;
    tr.appendChild(td);
  }
  tbody.appendChild(tr);
  return tr;
}

const mib = (b) => (b / 1048576).toFixed(0) + " MiB";

// ---- hosts and NIC graphs -----------------------------------------------------

const prev = {}; // host/nic -> {t, bytes}
const series = {}; // host -> {t: [], nics: {nic: []}, plot, card}

function nicCard(h) {
  const card = el("div", undefined, "host");
  card.id = "host-" + h.name;
  const title = el("div");
  card.appendChild(title);
  const buttons = el("div");
  const drain = el("button", "Drain");
  drain.onclick = () => drainHost(h.name);
  const resume = el("button", "Resume");
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
    if (!s.plot) {
      const colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];
      s.plot = new uPlot(
        {
          width: 420,
          height: 160,
          scales: { y: { range: (u, min, max) => [0, Math.max(10, max * 1.1)] } },
          series: [{}, ...names.map((k, i) => ({ label: k + " Mbit/s", stroke: colors[i % colors.length], width: 2 }))],
          axes: [{}, { size: 50 }],
        },
        data,
        s.plotDiv
      );
    } else {
      s.plot.setData(data);
    }
  }
}

// ---- VMs, moves and drains ----------------------------------------------------

function updateVms(vms, hosts) {
  const tbody = document.querySelector("#vms tbody");
  tbody.innerHTML = "";
  for (const v of vms) {
    const sel = el("select");
    sel.id = "to-" + v.name;
    for (const h of hosts) if (h.name !== v.host && !h.down) sel.appendChild(new Option(h.name, h.name));
    const btn = el("button", "Move");
    btn.id = "move-" + v.name;
    btn.onclick = () => moveVm(v.name, sel.value);
    row(tbody, [v.name, v.host, vmState(v), mib(v.spec.memory), sel, btn]);
  }
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

async function moveVm(vm, to) {
  const status = document.getElementById("move-status");
  const m = (ferry.moves[vm] = { to, events: [], done: false });
  status.textContent = `moving ${vm} to ${to}…`;
  try {
    await stream(`/api/v1/vms/${vm}/move`, { to }, (ev) => {
      m.events.push(ev);
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

async function drainHost(host) {
  const status = document.getElementById("drain-status");
  status.textContent = `draining ${host}…`;
  try {
    await stream(`/api/v1/hosts/${host}/drain`, {}, (ev) => {
      if (ev.event === "moved") status.textContent = `${host}: ${ev.vm} moved to ${ev.to}`;
      if (ev.event === "done") status.textContent = `${host} drained: ${ev.moved.length} moved, ${ev.failed.length} failed`;
    });
  } catch (e) {
    status.textContent = `drain of ${host}: ${e.message}`;
  }
  refresh();
}

// ---- storage and events ---------------------------------------------------------

function updateQos(policies, flows) {
  const pb = document.querySelector("#policies tbody");
  pb.innerHTML = "";
  for (const p of policies)
    row(pb, [p.name, p.kind, p.min_iops || "-", p.max_iops || "-", p.max_bandwidth ? mib(p.max_bandwidth) + "/s" : "-"]);
  const fb = document.querySelector("#flows tbody");
  fb.innerHTML = "";
  for (const f of flows) {
    const st = el("span", f.status, f.status === "Ok" ? "ok" : "down");
    row(fb, [f.id, f.host, f.policy || "-", f.iops.toFixed(0), (f.bandwidth / 1e6).toFixed(1), f.latency_us.toFixed(0), f.min_iops, f.max_iops, st]);
  }
}

function updateEvents(events) {
  const tb = document.querySelector("#events tbody");
  tb.innerHTML = "";
  for (const e of events.slice(-15).reverse()) {
    const d = JSON.stringify(e.detail);
    row(tb, [new Date(e.at_ms).toLocaleTimeString(), e.kind, e.subject, d.length > 100 ? d.slice(0, 99) + "…" : d]);
  }
}

function showError(e) {
  document.getElementById("error").textContent = e.message;
}

async function refresh() {
  try {
    const [hosts, vms] = await Promise.all([get("/api/v1/hosts"), get("/api/v1/vms")]);
    updateVms(vms, hosts);
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
  } catch (e) {
    // no storage node registered: the section stays empty
  }
}

document.getElementById("save-token").onclick = () => {
  localStorage.setItem("ferry-token", document.getElementById("token").value.trim());
  document.getElementById("login").style.display = "none";
  refresh();
};

refresh();
setInterval(() => {
  // hosts every second (for the graphs); the rest rides along
  get("/api/v1/hosts")
    .then((hosts) => {
      updateHosts(hosts);
      ferry.polls++;
    })
    .catch(showError);
}, 1000);
setInterval(refresh, 3000);
