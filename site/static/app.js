// The rgpu dashboard: polls /api/state and draws it. Read-only; text goes in with textContent only.
"use strict";

const POLL_MS = 2000;
const GIB = 1024 ** 3;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "style") Object.assign(node.style, value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

function bytes(n) {
  if (n === 0) return "0";
  if (n >= GIB) return (n / GIB).toFixed(n % GIB ? 1 : 0) + " GiB";
  return (n / 1024 ** 2).toFixed(0) + " MiB";
}

function age(seconds) {
  if (seconds < 60) return Math.floor(seconds) + " s";
  if (seconds < 3600) return Math.floor(seconds / 60) + " min";
  if (seconds < 86400) return (seconds / 3600).toFixed(1) + " h";
  return (seconds / 86400).toFixed(1) + " d";
}

function clock(unix) { return new Date(unix * 1000).toLocaleTimeString(); }

// One colour per user, stable across refreshes (red stays for trouble: down, expired). Paul Tol's
// "muted" scheme without its rose: told apart also with deuteranopia and protanopia
// (tests/test_dashboard.py checks it); each with the text colour that reads on it.
const PALETTE = [["#332288", "#ffffff"], ["#117733", "#ffffff"], ["#44aa99", "#1d2330"], ["#88ccee", "#1d2330"],
                 ["#ddcc77", "#1d2330"], ["#999933", "#1d2330"], ["#aa4499", "#ffffff"], ["#882255", "#ffffff"]];
function colour(name) {
  let h = 0;
  for (const c of name) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return PALETTE[h % PALETTE.length];
}

function state(name) { return el("span", { class: "state " + name }, name.replaceAll("_", " ")); }

function fillTable(id, rows, columns, empty) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren();
  if (!rows.length) {
    body.append(el("tr", {}, el("td", { class: "empty", colspan: String(columns) }, empty)));
    return;
  }
  for (const cells of rows) body.append(el("tr", {}, ...cells.map((c) => el("td", {}, c))));
}

function drawSummary(s) {
  const c = s.capacity;
  // One base whatever is down: every registered GPU, and what leases hold on them.
  const pct = c.all_units ? Math.round((100 * c.held_units) / c.all_units) : 0;
  const up = s.servers.filter((x) => x.state === "up").length;
  document.getElementById("summary").replaceChildren(
    el("span", { title: "GPU-percent held by leases, over 100 per registered GPU (those of down dispatchers included)" },
      el("b", {}, `${pct}%`), ` of ${c.gpus} GPUs allocated`),
    el("span", {}, el("b", {}, String(c.gpus)), " GPUs"),
    el("span", {}, el("b", {}, `${up}/${s.servers.length}`), " dispatchers up"),
    el("span", {}, el("b", {}, String(c.leases)), " leases"),
    // Trouble at a glance: shown only when there is some, in red.
    ...(c.servers_down ? [el("span", { class: "alarm", id: "alarm-down" }, `${c.servers_down} dispatcher(s) down`)] : []),
    ...(c.gpus_faulted ? [el("span", { class: "alarm", id: "alarm-faults" }, `${c.gpus_faulted} GPU(s) with faults`)] : []),
    ...(c.gpus_ecc_uncorrected ? [el("span", { class: "alarm", id: "alarm-ecc" },
      `${c.gpus_ecc_uncorrected} GPU(s) with uncorrected ECC errors`)] : []));
}

function used(slice) {
  const compute = slice.compute_used_percent >= 0 ? `, uses ${Math.round(slice.compute_used_percent)}% of the GPU's time` : "";
  return `uses ${bytes(slice.memory_used_bytes)} of ${bytes(slice.memory_bytes)}${compute}` +
    (slice.mostly_unused ? " (mostly unused)" : "");
}

function telemetry(g) {
  const t = g.telemetry;
  if (!t) return el("div", { class: "telemetry" }, "no readings yet");
  const parts = [];
  if (t.utilization_percent >= 0) parts.push(`util ${Math.round(t.utilization_percent)}%`);
  if (t.temperature_celsius >= 0) parts.push(`${Math.round(t.temperature_celsius)} °C`);
  if (t.power_watts >= 0) parts.push(`${Math.round(t.power_watts)} W`);
  return el("div", { class: "telemetry", title: `GPU memory in use (all processes): ${bytes(t.memory_used_bytes)}` },
    parts.join(" · ") || "no readings", ...(t.source === "emulated" ? [" ", el("span", { class: "tag" }, "emulated")] : []));
}

function trouble(g) {
  const badges = [];
  if (g.faults.length) {
    const last = g.faults[g.faults.length - 1];
    badges.push(el("span", { class: "badge fault", title: `last: ${last.error} at ${clock(last.unix)}` +
      (last.faulting ? ` (${last.faulting})` : "") }, `${g.faults.length} fault${g.faults.length > 1 ? "s" : ""}`));
  }
  const t = g.telemetry;
  if (t && t.ecc_uncorrected) badges.push(el("span", { class: "badge fault" }, `ECC ${t.ecc_uncorrected}`));
  if (t && t.last_xid) badges.push(el("span", { class: "badge fault", title: `${t.xid_errors} Xid event(s)` }, `Xid ${t.last_xid}`));
  return badges.length ? [el("div", { class: "trouble" }, ...badges)] : [];
}

function segment(slice, width, label, fill) {
  const [background, text] = colour(slice.user);
  const seg = el("div", { class: "seg" + (slice.mostly_unused ? " unused" : ""),
    title: `${slice.job_key} (${slice.user}) slice ${slice.slice}: ` +
    `holds ${slice.compute_percent}% compute, ${bytes(slice.memory_bytes)}; ${used(slice)}`,
    style: { width: `${width}%`, backgroundColor: background, color: text } }, label);
  // What the slice uses, drawn inside what it holds.
  if (fill !== undefined) seg.append(el("div", { class: "used", style: { width: `${Math.min(100, fill)}%` } }));
  return seg;
}

function drawGpus(gpus) {
  const box = document.getElementById("gpus");
  box.replaceChildren();
  if (!gpus.length) box.append(el("p", { class: "empty" }, "No GPUs: no dispatcher has registered."));
  for (const g of gpus) {
    const compute = el("div", { class: "bar compute" });
    const memory = el("div", { class: "bar memory" });
    for (const s of g.slices) {
      const uses = s.compute_used_percent >= 0 ? ` (uses ${Math.round(s.compute_used_percent)}%)` : "";
      compute.append(segment(s, s.compute_percent, `${s.job_key} · ${s.user} · ${s.compute_percent}%${uses}`));
      memory.append(segment(s, g.memory_bytes ? (100 * s.memory_bytes) / g.memory_bytes : 0, "",
        s.memory_bytes ? (100 * s.memory_used_bytes) / s.memory_bytes : 0));
    }
    const faulted = g.faults.length || (g.telemetry && g.telemetry.ecc_uncorrected) ? " faulted" : "";
    box.append(el("div", { class: `gpu ${g.server_state}${faulted}`, "data-gpu": g.uuid },
      el("div", { class: "label" }, el("div", { class: "name" }, `${g.name}`),
        el("div", { class: "where" }, `${g.server} · GPU ${g.index} · ${g.sharing || "mps"} `, state(g.server_state)),
        ...trouble(g)),
      el("div", { class: "bars" }, compute, memory),
      el("div", { class: "numbers" }, `${g.allocated_percent}% compute held`, el("br"),
        el("span", { title: "memory the slices' sessions use / hold / the GPU offers" },
          `${bytes(g.memory_used_bytes)} used / ${bytes(g.allocated_memory_bytes)} held / ${bytes(g.memory_bytes)}`),
        telemetry(g))));
  }
}

function meter(used, limit) {
  const pct = limit ? Math.min(100, (100 * used) / limit) : 100;
  return el("div", { class: "meter" + (used >= limit ? " full" : "") }, el("div", { style: { width: `${pct}%` } }));
}

function draw(s) {
  drawSummary(s);
  drawGpus(s.gpus);
  fillTable("leases", s.leases.map((l) => [l.job_key, l.user, l.account || "–",
    l.slices.map((x) => `${x.server}/${x.gpu_index} ${x.compute_percent}% ${bytes(x.memory_bytes)}` +
      ` (uses ${bytes(x.memory_used_bytes)})`).join(", "),
    String(l.units), age(l.age_seconds), l.expires_unix ? clock(l.expires_unix) : "never",
    l.idle ? el("span", {}, state(l.state), " ", el("span", { class: "state idle",
      title: "no call since " + clock(l.idle_since_unix) }, "idle")) : state(l.state)]),
    8, "No leases.");
  fillTable("servers", s.servers.map((x) => [x.address, x.hostname, state(x.state), age(x.heartbeat_age_seconds) + " ago",
    String(x.gpus) + (x.static_inventory ? " (static)" : ""), x.compute_enforcement || "–", x.version || "–"]),
    7, "No dispatchers.");
  fillTable("quotas", s.quotas.map((q) => [q.kind, q.name, meter(q.used_units, q.limit_units),
    `${q.used_units} / ${q.limit_units} GPU-%`]), 4, "No quotas.");
  const events = document.getElementById("events");
  events.replaceChildren(...s.events.map((e) => el("li", { class: e.level }, el("time", {}, clock(e.unix)), e.message)));
}

async function poll() {
  const dot = document.getElementById("status");
  const updated = document.getElementById("updated");
  try {
    const reply = await fetch("/api/state", { credentials: "same-origin", cache: "no-store" });
    if (reply.status === 401) { window.location.reload(); return; }
    if (!reply.ok) throw new Error(`HTTP ${reply.status}`);
    draw(await reply.json());
    dot.className = "dot ok";
    updated.textContent = "updated " + new Date().toLocaleTimeString();
  } catch (err) {
    dot.className = "dot bad";
    updated.textContent = `pool unreachable (${err.message}); retrying`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
