// rolloutd dashboard: a single-page app over the daemon's JSON API. Plain JavaScript, no
// build step, no dependency. Every text from the daemon goes into the page as text nodes
// (never as HTML). The bearer token, when the daemon needs one, is asked for once and kept
// in sessionStorage (this tab only); it travels in the Authorization header, never in a URL.
"use strict";

const TOKEN_KEY = "rolloutd.token";
const POLL_MS = 2000;
const PAGE_SIZES = [25, 50, 100, 200, 500];
const STATUSES = ["queued", "init", "run", "eval", "completed", "failed", "timed_out", "cancelled", "lost"];
const TERMINAL = ["completed", "failed", "timed_out", "cancelled", "lost"];
const API = "../v1/"; // the page is served at <daemon>/ui/

// ---- DOM helpers ----------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "text") el.textContent = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function svg(tag, attrs) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  return el;
}

const main = () => document.getElementById("main");

function show(...nodes) {
  main().replaceChildren(...nodes.flat(Infinity).filter((n) => n));
}

function fmt(x, digits = 3) {
  if (x === null || x === undefined) return "—";
  if (typeof x === "number") return Number.isInteger(x) ? String(x) : x.toFixed(digits);
  return String(x);
}

function secs(x) {
  if (x === null || x === undefined) return "—";
  return x < 1 ? `${(x * 1000).toFixed(0)} ms` : `${x.toFixed(2)} s`;
}

function statusSpan(s) {
  return h("span", { class: `st-${s}`, "data-status": s, text: s });
}

function rolloutLink(id) {
  return h("a", { href: `#/rollout/${encodeURIComponent(id)}`, class: "mono", text: id });
}

function groupLink(gid) {
  return gid ? h("a", { href: `#/group/${encodeURIComponent(gid)}`, class: "mono", text: gid }) : "—";
}

function table(headers, rows, attrs) {
  return h("table", attrs || {},
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", typeof x === "string" ? { text: x } : x)))),
    h("tbody", {}, rows.map((r) => h("tr", {}, r.map((c) => (c instanceof Node && c.tagName === "TD") ? c : h("td", {}, c))))));
}

// ---- API and the token ----------------------------------------------------------------

class Unauthorized extends Error {}

function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

async function api(path, params, method = "GET") {
  let url = API + path;
  if (params) {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(params)) if (v !== "" && v !== null && v !== undefined) q.set(k, v);
    const qs = q.toString();
    if (qs) url += "?" + qs;
  }
  const headers = { Accept: "application/json" };
  const t = token();
  if (t) headers.Authorization = "Bearer " + t;
  const resp = await fetch(url, { method, headers, cache: "no-store", credentials: "omit" });
  if (resp.status === 401) throw new Unauthorized("a valid bearer token is required");
  let body = null;
  try { body = await resp.json(); } catch (e) { body = null; }
  if (!resp.ok) {
    const msg = body && body.error ? `${body.error.type}: ${body.error.message}` : `HTTP ${resp.status}`;
    throw new Error(msg);
  }
  return body;
}

function askForToken(message) {
  stopPolling();
  document.getElementById("main").hidden = true;
  document.getElementById("login").hidden = false;
  document.getElementById("login-error").textContent = message || "";
  document.getElementById("logout").hidden = true;
  document.getElementById("token").focus();
}

function signedIn() {
  document.getElementById("login").hidden = true;
  document.getElementById("main").hidden = false;
  document.getElementById("logout").hidden = !token();
}

function failed(err) {
  if (err instanceof Unauthorized) {
    const had = token();
    sessionStorage.removeItem(TOKEN_KEY);
    askForToken(had ? "That token was refused." : "");
    return;
  }
  show(h("p", { class: "error", id: "load-error", text: String(err.message || err) }));
}

// ---- routing ----------------------------------------------------------------------------

let timer = null;
let generation = 0; // a view's async work stops drawing once the route changed

function stopPolling() {
  if (timer !== null) { clearInterval(timer); timer = null; }
}

function parseHash() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [path, qs] = raw.split("?", 2);
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  return { parts, params: new URLSearchParams(qs || "") };
}

function route() {
  stopPolling();
  generation += 1;
  const gen = generation;
  const { parts, params } = parseHash();
  const view = parts[0] || "overview";
  for (const a of document.querySelectorAll("[data-nav]")) a.classList.toggle("active", a.dataset.nav === view);
  document.body.dataset.view = view;
  let work;
  if (view === "rollouts") work = viewRollouts(params, gen);
  else if (view === "rollout" && parts[1]) work = viewTrajectory(parts[1], gen);
  else if (view === "group" && parts[1]) work = viewGroup(parts[1], gen);
  else work = viewOverview(gen);
  work.catch(failed);
}

// ---- overview -------------------------------------------------------------------------

function sparkline(points, id, opts = {}) {
  // points: [{t, v}] with v a number or null (a gap: nothing measured then).
  const w = opts.w || 320, hgt = opts.h || 60;
  const box = svg("svg", { width: w, height: hgt, viewBox: `0 0 ${w} ${hgt}`, class: "spark", id });
  const known = points.filter((p) => typeof p.v === "number");
  if (!points.length || !known.length) return box;
  const t0 = points[0].t, t1 = points[points.length - 1].t;
  const vmin = opts.vmin !== undefined ? Math.min(opts.vmin, ...known.map((p) => p.v)) : Math.min(...known.map((p) => p.v));
  const vmax = Math.max(...known.map((p) => p.v), vmin + 1e-9);
  const x = (t) => ((t - t0) / Math.max(1e-9, t1 - t0) * (w - 4) + 2).toFixed(1);
  const y = (v) => (hgt - 2 - (v - vmin) / (vmax - vmin) * (hgt - 4)).toFixed(1);
  let run = [];
  const flush = () => {
    if (run.length > 1) box.append(svg("polyline", { points: run.map((p) => `${x(p.t)},${y(p.v)}`).join(" ") }));
    else if (run.length === 1) box.append(svg("circle", { cx: x(run[0].t), cy: y(run[0].v), r: 2 }));
    run = [];
  };
  for (const p of points) {
    if (typeof p.v === "number") run.push(p);
    else flush();
  }
  flush();
  return box;
}

function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return i ? `${n.toFixed(1)} ${units[i]}` : `${n} B`;
}

function hourPanel(history) {
  // The daemon's own per-minute buckets of the last hour (GET /v1/status `history`).
  const buckets = (history && history.buckets) || [];
  const per = (history && history.bucket_s) || 60;
  const finished = buckets.reduce((n, b) => n + b.finished, 0);
  const rewarded = buckets.reduce((n, b) => n + b.rewarded, 0);
  const rewardSum = buckets.reduce((n, b) => n + (b.rewarded ? b.mean_reward * b.rewarded : 0), 0);
  const last = buckets.length ? buckets[buckets.length - 1] : null;
  const span = `${Math.round(buckets.length * per / 60)} min`;
  return h("div", { class: "row", id: "history" },
    h("div", {},
      h("p", {}, "finished rollouts per minute: ", h("strong", { id: "rate", text: last ? fmt(last.finished) : "—" }),
        h("span", { class: "muted", text: ` this minute · ${finished} in the last ${span}` })),
      finished ? sparkline(buckets.map((b) => ({ t: b.start, v: b.finished })), "throughput", { vmin: 0 })
        : h("p", { class: "muted", id: "throughput-empty", text: `no rollout finished in the last ${span}` })),
    h("div", {},
      h("p", {}, "mean reward per minute: ", h("strong", { id: "reward-last", text: last && last.rewarded ? fmt(last.mean_reward) : "—" }),
        h("span", { class: "muted", text: ` this minute · ${rewarded ? fmt(rewardSum / rewarded) : "—"} over the ${rewarded} rewarded in the last ${span}` })),
      rewarded ? sparkline(buckets.map((b) => ({ t: b.start, v: b.rewarded ? b.mean_reward : null })), "reward-series")
        : h("p", { class: "muted", id: "reward-empty", text: `no rollout rewarded in the last ${span}` })));
}

function toolsPanel(tools) {
  if (!tools || !tools.length) return h("p", { class: "muted", id: "tools-empty", text: "no tool calls yet (finished rollouts' calls count)" });
  return table(["tool", { text: "calls", class: "num" }, { text: "failed", class: "num" }, { text: "p50", class: "num" },
    { text: "p95", class: "num" }, { text: "over last", class: "num" }],
  tools.map((t) => [h("span", { class: "mono", text: t.name }), h("td", { class: "num", text: fmt(t.calls) }),
    h("td", { class: t.failed ? "num error" : "num", text: fmt(t.failed) }), h("td", { class: "num", text: secs(t.p50_s) }),
    h("td", { class: "num", text: secs(t.p95_s) }), h("td", { class: "num", text: `${t.window} calls` })]), { id: "tools" });
}

function imagesPanel(im) {
  if (!im) return h("p", { class: "muted", text: "no image store" });
  const lookups = (im.hits || 0) + (im.misses || 0);
  const read = im.images !== undefined;
  return h("div", {},
    read ? null : h("p", { class: "muted", text: "the image store's figures are not read yet" }),
    h("div", { class: "cards", id: "images" },
      card("images", im.images, "images-count"), card("layers", im.layers), card("unpacked size", bytes(im.bytes), "images-bytes"),
      card("hits", im.hits), card("misses", im.misses),
      card("hit rate", lookups ? `${(100 * (im.hits || 0) / lookups).toFixed(0)} %` : "—", "images-hit-rate"),
      card("unpack time", secs(im.unpack_s_total)), card("prefetched", im.prefetched), card("prefetching", im.prefetching),
      card("prefetch failed", im.prefetch_failed)));
}

function card(k, v, id) {
  return h("div", { class: "card", id }, h("div", { class: "v", text: fmt(v) }), h("div", { class: "k", text: k }));
}

function renderOverview(st) {
  document.getElementById("node").textContent =
    `${st.node_id || ""} · up ${fmt(st.uptime_s, 0)} s${st.draining ? " · DRAINING" : ""}${st.ready ? "" : " · not ready"}`;
  const counts = st.rollouts || {};
  const pipe = st.pipeline || {};
  const stages = pipe.stages || {};
  const out = [];

  out.push(h("h2", { text: "Rollouts" }));
  out.push(h("div", { class: "cards", id: "status-counts" },
    card("submitted", counts.submitted || 0, "count-submitted"),
    STATUSES.map((s) => card(s, counts[s] || 0, `count-${s}`))));

  out.push(h("h2", { text: "Pipeline" }));
  out.push(h("div", { class: "row" },
    h("div", {},
      h("p", {}, `intake queue: ${fmt(pipe.queued)} / ${fmt(pipe.queue_capacity)} · live jobs: ${fmt(pipe.live_jobs)} · `,
        pipe.accepting === false ? h("span", { class: "error", text: "not accepting" }) : "accepting"),
      table(["stage", { text: "workers", class: "num" }, { text: "queued", class: "num" }, { text: "in flight", class: "num" },
        { text: "free", class: "num" }, { text: "finished", class: "num" }, { text: "failed", class: "num" },
        { text: "p50", class: "num" }, { text: "p95", class: "num" }, { text: "p99", class: "num" }],
      ["init", "run", "eval"].filter((n) => stages[n]).map((name) => [name, stages[name]]).map(([name, s]) => [name,
        ...[s.workers, s.queued, s.in_flight, s.free, s.finished, s.failed].map((v) => h("td", { class: "num", text: fmt(v) })),
        ...[s.p50_s, s.p95_s, s.p99_s].map((v) => h("td", { class: "num", text: secs(v) }))]), { id: "stages" }))));

  out.push(h("h2", { text: "Last hour" }));
  out.push(hourPanel(st.history));

  out.push(h("h2", { text: "Tool latency" }));
  out.push(toolsPanel(st.tools));

  out.push(h("h2", { text: "Image cache" }));
  out.push(imagesPanel(st.images));

  const be = st.backends;
  out.push(h("h2", { text: "LLM backends" }));
  if (!be) out.push(h("p", { class: "muted", text: "no backend pool" }));
  else out.push(h("p", {}, `policy version ${fmt(be.policy_version)}`),
    table(["id", "kind", "name", "url", "health", { text: "in flight", class: "num" }, { text: "served", class: "num" },
      { text: "failures", class: "num" }, "last error"],
    (be.backends || []).map((b) => [h("span", { class: "mono", text: b.id }), b.kind || "—", b.name || "—", b.url || "—",
      h("span", { class: b.healthy ? "ok" : "error", text: (b.healthy ? "healthy" : "unhealthy") + (b.paused ? " (paused)" : "") }),
      h("td", { class: "num", text: fmt(b.in_flight) }), h("td", { class: "num", text: fmt(b.served) }),
      h("td", { class: "num", text: fmt(b.failures) }), b.last_error || ""]), { id: "backends" }));

  const sb = st.sandboxes;
  out.push(h("h2", { text: "Sandboxes" }));
  if (!sb) out.push(h("p", { class: "muted", text: "no sandbox supervisor" }));
  else out.push(h("div", { class: "cards", id: "sandboxes" },
    ["live", "pool_idle", "pool_hits", "opened", "closed", "start_failures", "swept"].map((k) => card(k, sb[k])),
    card("backend", sb.backend), card("limits", sb.limits_mechanism)));

  const fed = st.federation;
  out.push(h("h2", { text: "Federation" }));
  if (!fed) out.push(h("p", { class: "muted", text: "federation is off" }));
  else {
    const members = fed.members || [];
    const keys = [...new Set(members.flatMap((m) => Object.keys(m)))].filter((k) => typeof members[0][k] !== "object");
    out.push(table(keys, members.map((m) => keys.map((k) => fmt(m[k]))), { id: "members" }));
  }
  show(out);
}

async function viewOverview(gen) {
  show(h("p", { class: "muted", text: "loading status…" }));
  const tick = async () => {
    try {
      const st = await api("status");
      if (gen === generation) { signedIn(); renderOverview(st); }
    } catch (err) {
      if (gen === generation) failed(err);
    }
  };
  await tick();
  if (gen === generation && !document.getElementById("main").hidden) timer = setInterval(tick, POLL_MS);
}

// ---- rollout browser ------------------------------------------------------------------

const FILTERS = ["status", "group_id", "batch_id", "label", "kind", "min_reward", "max_reward", "id_prefix"];

async function viewRollouts(params, gen) {
  const limit = Number(params.get("limit")) || 50;
  const offset = Math.max(0, Number(params.get("offset")) || 0);
  const query = { limit, offset };
  for (const f of FILTERS) if (params.get(f)) query[f] = params.get(f);
  const data = await api("rollouts", query);
  if (gen !== generation) return;
  signedIn();

  const field = (name, label, attrs) => h("label", {}, label, h("input", { name, value: params.get(name) || "", ...attrs }));
  const form = h("form", { class: "filters", id: "filters", onsubmit: (ev) => {
    ev.preventDefault();
    const q = new URLSearchParams();
    for (const [k, v] of new FormData(ev.target)) if (v) q.set(k, v);
    location.hash = "#/rollouts?" + q.toString();
  } },
  h("label", {}, "status", h("select", { name: "status" }, h("option", { value: "", text: "any" }),
    STATUSES.map((s) => h("option", { value: s, text: s, selected: params.get("status") === s })))),
  field("group_id", "group"), field("batch_id", "batch"), field("label", "label"), field("kind", "task kind"),
  field("min_reward", "min reward", { type: "number", step: "any", size: 6 }),
  field("max_reward", "max reward", { type: "number", step: "any", size: 6 }),
  field("id_prefix", "id prefix"),
  h("label", {}, "per page", h("select", { name: "limit" },
    PAGE_SIZES.map((n) => h("option", { value: n, text: n, selected: n === limit })))),
  h("button", { type: "submit", text: "Filter" }),
  h("a", { href: "#/rollouts", text: "clear" }));

  const page = (off) => {
    const q = new URLSearchParams(params);
    q.set("offset", String(off));
    return "#/rollouts?" + q.toString();
  };
  const pager = h("div", { class: "pager" },
    offset > 0 ? h("a", { href: page(Math.max(0, offset - limit)), text: "← newer" }) : null,
    h("span", { id: "page-info", text: data.total ? `${offset + 1}–${offset + data.rollouts.length} of ${data.total}` : "no rollouts match" }),
    offset + limit < data.total ? h("a", { href: page(offset + limit), text: "older →" }) : null);

  const rows = data.rollouts.map((r) => [rolloutLink(r.id), groupLink(r.group_id), h("td", { class: "num", text: r.sample_index }),
    statusSpan(r.status), r.usable ? "yes" : "no", h("td", { class: "num", text: fmt(r.reward) }), r.kind || "—",
    r.labels.join(", "), h("td", { class: "num", text: r.turns }), h("td", { class: "num", text: r.sampled_tokens }),
    h("td", { class: "num", text: secs(r.total_s) }), r.error_type ? h("span", { class: "error", text: r.error_type }) : ""]);
  show(h("h2", { text: "Rollouts held by this daemon" }),
    h("p", { class: "muted", text: "Live rollouts and finished ones still in the result store, newest first." }),
    form, pager,
    table(["id", "group", { text: "#", class: "num" }, "status", "usable", { text: "reward", class: "num" }, "kind", "labels",
      { text: "turns", class: "num" }, { text: "sampled", class: "num" }, { text: "time", class: "num" }, "error"], rows, { id: "rollout-table" }),
    pager.cloneNode(true));
}

// ---- trajectory view ------------------------------------------------------------------

function logprobColour(lp) {
  if (lp === null || lp === undefined) return null;
  const p = Math.exp(Math.max(-20, Math.min(0, lp)));
  return `hsl(${Math.round(p * 120)}, 75%, 82%)`; // red (unlikely) .. green (certain)
}

function tokenSpan(traj, i) {
  const id = traj.token_ids[i];
  const mask = traj.loss_mask[i] || 0;
  const lp = traj.logprobs[i];
  const pieces = traj.pieces; // the decoded text of each token (GET /v1/rollouts/{id}/tokens), if known
  const piece = pieces ? pieces[i] : null;
  const shown = piece === null ? String(id) : piece.replace(/\n/g, "↵\n").replace(/\t/g, "⇥\t");
  const title = `id ${id} · logprob ${lp === null || lp === undefined ? "—" : lp.toFixed(4)} · mask ${mask}` +
    (piece === null ? "" : ` · text ${JSON.stringify(piece)}${piece === "" ? " (part of a character the next tokens complete)" : ""}`);
  const el = h("span", { class: `tok m${mask}${piece === null ? "" : " text"}${piece === "" ? " partial" : ""}`, title, "data-i": i, "data-id": id, text: shown });
  const colour = mask ? logprobColour(lp) : null;
  if (colour) el.style.backgroundColor = colour;
  return el;
}

function tokens(traj, start, end) {
  const out = [];
  for (let i = start; i < end && i < traj.token_ids.length; i++) out.push(tokenSpan(traj, i));
  return h("div", { class: traj.pieces ? "tokens text" : "tokens" }, out);
}

function timingBar(tm) {
  const stages = ["queue", "init", "run", "eval"];
  const total = Math.max(tm.total_s || 0, stages.reduce((n, s) => n + (tm[`${s}_s`] || 0), 0), 1e-9);
  const seg = (name, v, of) => {
    const el = h("span", { class: `seg-${name}`, title: `${name} ${secs(v)}` });
    el.style.width = `${(100 * v / of).toFixed(3)}%`; // CSSOM: the CSP allows no style attributes
    return el;
  };
  const run = Math.max(tm.run_s || 0, 1e-9);
  const other = Math.max(0, run - (tm.llm_s || 0) - (tm.tool_s || 0));
  const legend = (names) => h("div", { class: "legend" }, names.map(([n, v]) => h("span", {}, h("i", { class: `seg-${n}` }), `${n} ${secs(v)}`)));
  return h("div", { id: "timing" },
    h("div", { class: "bar", title: "stages" }, stages.map((s) => seg(s, tm[`${s}_s`] || 0, total))),
    legend([...stages.map((s) => [s, tm[`${s}_s`] || 0]), ["total", tm.total_s]]),
    h("div", { class: "bar", title: "run: LLM and tools" }, seg("llm", tm.llm_s || 0, run), seg("tool", tm.tool_s || 0, run), seg("other", other, run)),
    legend([["llm", tm.llm_s || 0], ["tool", tm.tool_s || 0], ["other", other]]));
}

function waterfall(traj) {
  // Every span at its real start (seconds since the rollout was submitted): the stages, and
  // within run each turn's LLM call and its tool calls. Records from before start times were
  // kept (no `start_s`) are laid end to end within run, as their durations allow.
  const tm = traj.timing;
  const spans = [];
  const known = (x) => typeof x === "number";
  spans.push({ kind: "queue", label: "queue", at: 0, s: tm.queue_s || 0 });
  for (const st of ["init", "run"]) if (known(tm[`${st}_start_s`])) spans.push({ kind: st, label: st, at: tm[`${st}_start_s`], s: tm[`${st}_s`] || 0 });
  let at = known(tm.run_start_s) ? tm.run_start_s : (tm.queue_s || 0) + (tm.init_s || 0);
  traj.turns.forEach((t, k) => {
    const llmAt = known(t.start_s) ? t.start_s : at;
    spans.push({ kind: "llm", label: `turn ${k} LLM`, at: llmAt, s: t.llm_s || 0 });
    at = llmAt + (t.llm_s || 0);
    for (const c of t.tool_calls) {
      const toolAt = known(c.start_s) ? c.start_s : at;
      spans.push({ kind: "tool", label: `turn ${k} ${c.name}${c.ok ? "" : " (failed)"}`, at: toolAt, s: c.latency_s || 0 });
      at = toolAt + (c.latency_s || 0);
    }
  });
  if (known(tm.eval_start_s)) spans.push({ kind: "eval", label: "eval", at: tm.eval_start_s, s: tm.eval_s || 0 });
  if (!traj.turns.length) return null;
  const total = Math.max(tm.total_s || 0, ...spans.map((x) => x.at + x.s), 1e-9);
  const rows = spans.map((x) => {
    const bar = h("span", { class: `seg-${x.kind}`, title: `${x.label} at ${secs(x.at)} for ${secs(x.s)}` });
    bar.style.marginLeft = `${(100 * x.at / total).toFixed(3)}%`;
    bar.style.width = `${Math.max(0.2, 100 * x.s / total).toFixed(3)}%`;
    return h("div", { class: "wf-row", "data-kind": x.kind, "data-start": x.at.toFixed(6) },
      h("span", { class: "wf-label", text: `${x.label} · +${secs(x.at)} · ${secs(x.s)}` }), h("div", { class: "wf-track" }, bar));
  });
  return h("div", { class: "waterfall", id: "waterfall" }, rows);
}

function replayPanel(traj) {
  // A replay's comparison with the rollout it replays (POST /v1/rollouts/{id}/replay).
  const r = traj.replay;
  if (!r) return null;
  const eq = r.tool_outputs_equal;
  const d = r.first_difference;
  return h("div", { id: "replay-info" },
    h("p", {}, "Replay of ", rolloutLink(r.of), ` · ${r.turns} turns fed back · ${r.tool_calls} tool outputs · equal: `,
      h("strong", { class: eq === false ? "error" : "", text: eq === null || eq === undefined ? "not yet compared" : (eq ? "yes" : "no") })),
    d ? h("div", { id: "replay-difference" },
      h("p", { text: `first difference: turn ${d.turn ?? "—"}, call ${d.call} (${d.tool || "—"})` }),
      h("div", { class: "diff" }, h("div", {}, h("strong", { text: "recorded" }), h("pre", { text: d.recorded ?? "(none)" })),
        h("div", {}, h("strong", { text: "replayed" }), h("pre", { text: d.replayed ?? "(none)" })))) : null);
}

function replayButton(traj) {
  // Replay: the same task in a fresh sandbox with this rollout's sampled turns fed back.
  if (!TERMINAL.includes(traj.status) || !traj.turns.length) return null;
  const out = h("span", { id: "replay-result" });
  const btn = h("button", { type: "button", id: "replay", text: "Replay", title: "re-run this rollout's model outputs against a fresh sandbox and compare the tool outputs" });
  btn.onclick = async () => {
    btn.disabled = true;
    out.textContent = " starting…";
    try {
      const r = await api(`rollouts/${encodeURIComponent(traj.id)}/replay`, null, "POST");
      out.replaceChildren(" replay ", h("a", { href: `#/rollout/${encodeURIComponent(r.id)}`, id: "replay-link", class: "mono", text: r.id }));
    } catch (e) {
      out.replaceChildren(h("span", { class: "error", text: ` ${e.message}` }));
    } finally {
      btn.disabled = false;
    }
  };
  return h("span", {}, btn, out);
}

function messageText(content) {
  if (typeof content === "string") return content;
  if (Array.isArray(content)) return content.map((c) => (c && typeof c.text === "string") ? c.text : JSON.stringify(c)).join("\n");
  return JSON.stringify(content, null, 2);
}

function messageCard(m, i, extraClass) {
  const calls = (m.tool_calls || []).map((c) => {
    const fn = c.function || c;
    return h("div", { class: "call" }, h("strong", { text: `call ${fn.name}` }), h("pre", { text: JSON.stringify(fn.arguments, null, 2) }));
  });
  return h("div", { class: `msg role-${m.role} ${extraClass || ""}`, "data-index": i },
    h("div", { class: "role", text: `${i} · ${m.role}${m.name ? " · " + m.name : ""}` }),
    h("pre", { text: messageText(m.content) }), calls);
}

// A harness-driven rollout's turn points into its segment: the last segment is the top-level
// sequence (with decoded pieces); an earlier one is shown by token id.
function segmentOf(traj, turn) {
  const segs = traj.segments || [];
  if (turn.segment === null || turn.segment === undefined || turn.segment === segs.length - 1) return traj;
  return segs[turn.segment] || traj;
}

function harnessPanel(traj) {
  const hi = traj.harness;
  if (!hi) return null;
  const segs = traj.segments || [];
  return h("div", { id: "harness" },
    h("h3", { text: "Agent harness" }),
    h("p", {}, h("span", { class: "mono", text: (hi.command || []).join(" ").slice(0, 300) }),
      ` · ended ${hi.ended || "—"} · exit ${fmt(hi.exit_code)} · calls ${hi.calls} · merged ${hi.merged_calls} · refused ${hi.refused_calls}`,
      ` · segments ${segs.length}: `, segs.map((s, i) => `#${i} ${s.token_ids.length} tokens/${s.calls} calls`).join(", ")),
    hi.output_tail ? h("details", {}, h("summary", { text: "output (tail)" }), h("pre", { id: "harness-output", text: hi.output_tail })) : null);
}

function download(traj) {
  const blob = new Blob([JSON.stringify(traj, null, 2)], { type: "application/json" });
  const a = h("a", { href: URL.createObjectURL(blob), download: `${traj.id}.json` });
  document.body.append(a);
  a.click();
  setTimeout(() => { URL.revokeObjectURL(a.href); a.remove(); }, 1000);
}

async function viewTrajectory(id, gen) {
  const traj = await api(`rollouts/${encodeURIComponent(id)}`);
  if (gen !== generation) return;
  signedIn();
  try {
    const tok = await api(`rollouts/${encodeURIComponent(id)}/tokens`);
    if (tok.pieces.length === traj.token_ids.length) traj.pieces = tok.pieces;
  } catch (e) {
    if (e instanceof Unauthorized) throw e; // else (no tokenizer): token ids are shown instead
  }
  if (gen !== generation) return;
  const sampled = traj.loss_mask.reduce((n, m) => n + m, 0);
  const err = traj.error;
  const turns = traj.turns.map((t, k) => h("div", { class: "turn", "data-turn": k },
    h("div", {}, h("strong", { text: `turn ${k}` }),
      h("span", { class: "muted", text: `${t.segment !== null && t.segment !== undefined ? ` · segment ${t.segment}${t.merged ? " (merged)" : ""}` : ""} · tokens ${t.start}–${t.end} · backend ${t.backend || "—"} · finish ${t.finish_reason || "—"} · llm ${secs(t.llm_s)} · policy v${t.policy_version_start}${t.policy_version_end !== t.policy_version_start ? "→" + t.policy_version_end : ""}${t.retries ? " · retries " + t.retries : ""}` })),
    t.error ? h("div", { class: "error", text: t.error }) : null,
    tokens(segmentOf(traj, t), t.start, t.end),
    t.tool_calls.length ? table(["tool", "arguments", "ok", "exit", { text: "start", class: "num" }, { text: "latency", class: "num" }, "error", ...(traj.replay ? ["equal"] : [])],
      t.tool_calls.map((c) => [c.name, h("pre", { text: JSON.stringify(c.arguments) }), c.ok ? "yes" : h("span", { class: "error", text: "no" }),
        fmt(c.exit_code), h("td", { class: "num", text: c.start_s === null || c.start_s === undefined ? "—" : "+" + secs(c.start_s) }),
        h("td", { class: "num", text: secs(c.latency_s) }), c.error || "",
        ...(traj.replay ? [c.output_equal === false ? h("span", { class: "error", text: "differs" }) : (c.output_equal ? "yes" : "—")] : [])])) : null));

  show(
    h("h2", {}, "Rollout ", h("span", { class: "mono", id: "traj-id", text: traj.id })),
    h("p", {}, "group ", groupLink(traj.group_id), ` · sample ${traj.sample_index} · `, statusSpan(traj.status),
      ` · usable ${traj.usable ? "yes" : "no"} · reward `, h("strong", { id: "reward", text: fmt(traj.reward) }),
      traj.batch_id ? [" · batch ", h("a", { href: `#/rollouts?batch_id=${encodeURIComponent(traj.batch_id)}`, class: "mono", id: "traj-batch", text: traj.batch_id })] : "",
      traj.task_id ? ` · task ${traj.task_id}` : "", traj.labels.length ? ` · labels ${traj.labels.join(", ")}` : "",
      " · ", h("button", { type: "button", id: "download", text: "Download JSON", onclick: () => download(traj) }),
      " ", replayButton(traj)),
    replayPanel(traj),
    err ? h("p", { class: "error", id: "traj-error" }, `error in ${err.stage}: ${err.type}: ${err.message}`) : null,
    harnessPanel(traj),
    h("h3", { text: "Timing" }), timingBar(traj.timing), waterfall(traj),
    h("h3", { text: "Reward info" }), h("pre", { id: "reward-info", text: JSON.stringify(traj.reward_info, null, 2) }),
    h("h3", { text: `Messages (${traj.messages.length})` }),
    h("div", { id: "messages" }, traj.messages.map((m, i) => messageCard(m, i))),
    h("h3", { text: `Turns (${traj.turns.length}) · ${traj.token_ids.length} tokens, ${sampled} sampled, prompt ${traj.prompt_length}` }),
    h("p", { class: "muted" }, "Sampled tokens (loss mask 1, underlined) are coloured by probability, red unlikely to green certain; ",
      "grey tokens (mask 0) are prompt and tool output. Tokens show their text decoded by the served tokenizer (↵ a newline); hover a token for its id and logprob."),
    h("div", { id: "turns" }, turns),
    h("h3", { text: "All tokens" }),
    h("div", { id: "all-tokens" }, tokens(traj, 0, traj.token_ids.length)));
}

// ---- group view -----------------------------------------------------------------------

function advantages(rewards) {
  // TRL's GRPO (scale_rewards="group"): (r - mean) / (std + 1e-4), std with Bessel's correction.
  const xs = rewards.filter((r) => typeof r === "number");
  if (!xs.length) return rewards.map(() => null);
  const mean = xs.reduce((a, b) => a + b, 0) / xs.length;
  const std = xs.length > 1 ? Math.sqrt(xs.reduce((a, b) => a + (b - mean) ** 2, 0) / (xs.length - 1)) : 0;
  return rewards.map((r) => (typeof r === "number" ? (r - mean) / (std + 1e-4) : null));
}

function firstDifference(a, b) {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) if (JSON.stringify(a[i]) !== JSON.stringify(b[i])) return i;
  return a.length === b.length ? null : n;
}

async function viewGroup(gid, gen) {
  const listing = await api("rollouts", { group_id: gid, limit: 500 });
  const trajs = await Promise.all(listing.rollouts.map((r) => api(`rollouts/${encodeURIComponent(r.id)}`)));
  if (gen !== generation) return;
  signedIn();
  trajs.sort((a, b) => a.sample_index - b.sample_index);
  const adv = advantages(trajs.map((t) => t.reward));
  const base = trajs.length ? trajs[0].messages : [];
  const diffs = trajs.map((t) => firstDifference(base, t.messages));
  const groupDiff = diffs.filter((d) => d !== null).reduce((m, d) => Math.min(m, d), Infinity);
  const rows = trajs.map((t, k) => [rolloutLink(t.id), h("td", { class: "num", text: t.sample_index }), statusSpan(t.status),
    h("td", { class: "num", text: fmt(t.reward) }), h("td", { class: "num", "data-advantage": adv[k], text: fmt(adv[k]) }),
    h("td", { class: "num", text: t.turns.length }), h("td", { class: "num", text: t.messages.length }),
    h("td", { class: "num", text: t.token_ids.length }), h("td", { class: "num", text: t.loss_mask.reduce((n, m) => n + m, 0) }),
    k === 0 ? "(reference)" : diffs[k] === null ? "same messages" : `message ${diffs[k]}`]);
  const cols = trajs.map((t, k) => h("div", { class: "group-col", "data-sample": t.sample_index },
    h("h3", {}, `sample ${t.sample_index} · reward ${fmt(t.reward)} · `, rolloutLink(t.id)),
    t.messages.map((m, i) => messageCard(m, i, i === (k === 0 ? groupDiff : diffs[k]) ? "diverges" : ""))));
  show(h("h2", {}, "Group ", h("span", { class: "mono", id: "group-id", text: gid })),
    h("p", {}, `${trajs.length} samples held · `,
      Number.isFinite(groupDiff) ? `they first differ at message ${groupDiff}` : "their messages are identical",
      h("span", { class: "muted", text: " · advantage as TRL's GRPO computes it: (r − mean) / (std + 1e-4), sample std over the rewarded samples" })),
    table(["rollout", { text: "#", class: "num" }, "status", { text: "reward", class: "num" }, { text: "advantage", class: "num" },
      { text: "turns", class: "num" }, { text: "messages", class: "num" }, { text: "tokens", class: "num" }, { text: "sampled", class: "num" },
      "first difference from sample 0"], rows, { id: "group-table" }),
    h("h3", { text: "Side by side" }),
    h("div", { class: "group-grid", id: "group-grid" }, cols));
}

// ---- start ----------------------------------------------------------------------------

function start() {
  document.getElementById("login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const input = document.getElementById("token");
    sessionStorage.setItem(TOKEN_KEY, input.value.trim());
    input.value = "";
    route();
  });
  document.getElementById("logout").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    askForToken("");
  });
  document.getElementById("open-id").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const id = document.getElementById("open-id-input").value.trim();
    if (id) location.hash = `#/rollout/${encodeURIComponent(id)}`;
  });
  window.addEventListener("hashchange", route);
  route();
}

document.addEventListener("DOMContentLoaded", start);
