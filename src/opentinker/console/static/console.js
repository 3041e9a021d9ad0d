// The OpenTinker console: plain JavaScript, no build step. Charts are uPlot (vendor/uplot).
// Two modes, from /console/api/mode: "server" (sign in with an API key; every request sends it as
// X-API-Key) and "runs" (local run folders, no key). Every text shown is set with textContent.
"use strict";

const API = "/console/api";
const PALETTE = ["#0b62c4", "#d1242f", "#2da44e", "#bf8700", "#8250df", "#1b7c83", "#cf222e", "#6e7781"];
const state = { mode: null, key: sessionStorage.getItem("opentinker-key") || "", tab: null, timers: [] };

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "onclick") e.addEventListener("click", v);
    else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function fmt(v, digits = 4) {
  if (v === null || v === undefined) return "";
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : v.toPrecision(digits);
  return String(v);
}

function when(t) { return t ? new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19) : ""; }

async function api(path) {
  const headers = state.mode === "server" ? { "X-API-Key": state.key } : {};
  const r = await fetch(API + path, { headers });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) {
    if (r.status === 401 && state.mode === "server") { signOut(); }
    throw new Error(body.detail || `HTTP ${r.status}`);
  }
  return body;
}

function stopTimers() { state.timers.forEach(clearInterval); state.timers = []; }
function every(ms, fn) { state.timers.push(setInterval(fn, ms)); }
function main() { return document.getElementById("main"); }
function show(...nodes) { main().replaceChildren(...nodes); }
function fail(e) { show(el("p", { class: "error", text: String(e.message || e) })); }

function showProblems(problems) {
  const box = document.getElementById("problems");
  if (!problems || !problems.length) { box.hidden = true; box.replaceChildren(); return; }
  box.hidden = false;
  box.replaceChildren(
    el("b", { text: "Some files could not be read fully:" }),
    el("ul", {}, problems.map((p) => el("li", { class: "problem" },
      el("code", { text: p.line ? `${p.file}:${p.line}` : p.file }), " — " + p.message))),
  );
}

function tabs(names) {
  const nav = document.getElementById("tabs");
  nav.replaceChildren(...names.map(([id, label, fn]) => el("button", {
    id: "tab-" + id, class: state.tab === id ? "active" : "",
    onclick: () => { state.tab = id; location.hash = id; tabs(names); stopTimers(); fn(); },
  }, label)));
}

function pager(cursor, go) {
  const { offset, limit } = cursor;
  const total = cursor.total_count;
  const more = total !== undefined ? offset + limit < total : cursor.more;
  return el("div", { class: "pager" },
    el("button", offset > 0 ? { onclick: () => go(Math.max(0, offset - limit)) } : { disabled: "" }, "‹ previous"),
    el("button", more ? { onclick: () => go(offset + limit) } : { disabled: "" }, "next ›"),
    total !== undefined ? `${total ? offset + 1 : 0}–${Math.min(offset + limit, total)} of ${total}` : "");
}

// ------------------------------------------------------------------------- charts
function chart(title, series, opts = {}) {
  // series: [{label, points: [[x, y], ...]}] -> one uPlot chart (x values merged across series)
  const xs = [...new Set(series.flatMap((s) => s.points.map((p) => p[0])))].sort((a, b) => a - b);
  const index = new Map(xs.map((x, i) => [x, i]));
  const data = [xs];
  for (const s of series) {
    const ys = new Array(xs.length).fill(null);
    for (const [x, y] of s.points) ys[index.get(x)] = y;
    data.push(ys);
  }
  const box = el("div", { class: "chart", "data-title": title, "data-points": String(series.reduce((n, s) => n + s.points.length, 0)) },
    el("h4", { text: title }));
  const plot = new uPlot({
    width: opts.width || 460, height: opts.height || 220,
    scales: { x: { time: false } },
    series: [{ label: opts.xLabel || "step" }, ...series.map((s, i) => ({
      label: s.label || title, stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true,
      points: { show: s.points.length < 60 },
    }))],
    axes: [{ label: opts.xLabel || "step" }, {}],
  }, data, box);
  box._plot = plot;
  return box;
}

// ------------------------------------------------------------------------- local runs
async function runsPage() {
  const view = el("div", {});
  show(view);
  let offset = 0;
  const selected = new Set();
  let keys = [];
  let chosenKeys = null;

  async function draw() {
    let page;
    try { page = await api(`/runs?offset=${offset}&limit=100`); } catch (e) { return fail(e); }
    showProblems(page.problems);
    const runs = page.runs;
    if (!selected.size) runs.slice(0, 8).forEach((r) => selected.add(r.name));
    keys = [...new Set(runs.filter((r) => selected.has(r.name)).flatMap((r) => r.keys))];
    if (!chosenKeys) chosenKeys = keys.slice(0, 4);
    const table = el("table", { id: "runs" },
      el("tr", {}, ["", "run", "steps", "last step", "series", "checkpoints", "rollouts"].map((h) => el("th", { text: h }))),
      runs.map((r) => el("tr", { class: "run", "data-run": r.name },
        el("td", {}, el("input", Object.assign({ type: "checkbox", onclick: (ev) => {
          if (ev.target.checked) selected.add(r.name); else selected.delete(r.name); draw();
        } }, selected.has(r.name) ? { checked: "" } : {}))),
        el("td", {}, el("code", { text: r.name })),
        el("td", { class: "num", text: fmt(r.steps) }),
        el("td", { class: "num", text: fmt(r.last_step) }),
        el("td", { text: r.series.join(", ") + (r.series_count > r.series.length ? ` (+${r.series_count - r.series.length} more)` : "") }),
        el("td", {}, r.checkpoints.slice(-3).map((c) => el("div", {}, el("code", { text: `step ${c.step}: ${c.path}` })))),
        el("td", {}, r.has_rollouts ? el("a", { class: "open-rollouts", onclick: () => rolloutsView(r.name) }, "episodes") : ""),
      )));
    const keyPicker = el("div", { id: "keys" }, "metrics: ", keys.slice(0, 60).map((k) => el("label", {},
      el("input", Object.assign({ type: "checkbox", onclick: (ev) => {
        if (ev.target.checked) chosenKeys.push(k); else chosenKeys = chosenKeys.filter((x) => x !== k); drawCharts();
      } }, chosenKeys.includes(k) ? { checked: "" } : {})), k + " ")));
    const charts = el("div", { class: "charts", id: "charts" });
    view.replaceChildren(el("h2", { text: "Runs" }), table, pager(page.cursor, (o) => { offset = o; draw(); }), keyPicker, charts);
    await drawCharts();
  }

  async function drawCharts() {
    const charts = document.getElementById("charts");
    if (!charts) return;
    const names = [...selected];
    const qs = chosenKeys.map((k) => "keys=" + encodeURIComponent(k)).join("&");
    if (!qs || !names.length) { charts.replaceChildren(); return; }
    const got = await Promise.all(names.map((n) => api(`/runs/curves?run=${encodeURIComponent(n)}&${qs}`).catch(() => null)));
    const nodes = chosenKeys.map((k) => {
      const series = [];
      got.forEach((c, i) => {
        if (!c) return;
        for (const [label, pts] of Object.entries(c.curves[k] || {})) {
          series.push({ label: label ? `${names[i]} · ${label}` : names[i], points: pts });
        }
      });
      return series.length ? chart(k, series) : null;
    }).filter(Boolean);
    const shownOf = (c) => Math.max(0, ...Object.values(c.curves).map((byLabel) => Object.keys(byLabel).length));
    const capped = got.map((c, i) => (c && c.series_total > shownOf(c)
      ? `${names[i]}: ${shownOf(c)} of its ${c.series_total} ${c.series_by}s` : null)).filter(Boolean);
    if (capped.length) nodes.unshift(el("p", { class: "capped", text: "Overlaid: " + capped.join("; ") }));
    charts.replaceChildren(...nodes);
  }

  await draw();
  every(3000, () => { if (document.getElementById("charts")) drawCharts(); });
}

async function rolloutsView(run) {
  stopTimers();
  const filters = { step: "", series: "", min_reward: "", max_reward: "", offset: 0 };
  const view = el("div", { id: "rollouts" });
  show(el("p", {}, el("a", { onclick: () => runsPage() }, "‹ runs")), el("h2", { text: `Episodes of ${run}` }), view);

  async function draw() {
    const q = new URLSearchParams({ run, offset: filters.offset, limit: 20 });
    for (const k of ["step", "series", "min_reward", "max_reward"]) if (filters[k] !== "") q.set(k, filters[k]);
    let page;
    try { page = await api(`/runs/rollouts?${q}`); } catch (e) { view.replaceChildren(el("p", { class: "error", text: e.message })); return; }
    showProblems(page.problems);
    const select = (name, values) => {
      const s = el("select", { name }, el("option", { value: "" }, "all"),
        values.map((v) => el("option", Object.assign({ value: String(v) }, String(v) === filters[name] ? { selected: "" } : {}), String(v))));
      s.addEventListener("change", () => { filters[name] = s.value; filters.offset = 0; draw(); });
      return s;
    };
    const number = (name) => {
      const i = el("input", { name, type: "number", step: "any", size: "6", value: filters[name] });
      i.addEventListener("change", () => { filters[name] = i.value; filters.offset = 0; draw(); });
      return i;
    };
    const bar = el("div", { class: "filters" }, "step ", select("step", page.steps.slice().reverse()),
      " adapter/agent ", select("series", page.series), " reward ≥ ", number("min_reward"), " ≤ ", number("max_reward"));
    const eps = page.episodes.map((ep) => el("div", { class: "episode" },
      el("div", { class: "meta" }, ep.note ? ep.note :
        `step ${ep.step} · ${ep.series || ""} · group ${ep.group} · reward ${fmt(ep.reward)} · advantage ${fmt(ep.advantage)} · policy v${ep.policy_version}`),
      (ep.turns || []).map((t) => t.kind === "action"
        ? el("div", { class: "turn action", title: "sampled tokens (sampler logprob on hover)" },
          t.tokens.map((tok, i) => el("span", { class: "tok", title: `logprob ${fmt(t.logprobs[i])}` }, tok)))
        : el("div", { class: "turn " + t.kind, text: t.text }))));
    view.replaceChildren(bar, pager(page.cursor, (o) => { filters.offset = o; draw(); }),
      eps.length ? el("div", {}, eps) : el("p", { text: "No episodes match." }));
  }
  await draw();
}

// ------------------------------------------------------------------------- the server
function signOut() { state.key = ""; sessionStorage.removeItem("opentinker-key"); signIn(); }

function signIn(message) {
  stopTimers();
  document.getElementById("tabs").replaceChildren();
  document.getElementById("who").textContent = "";
  const input = el("input", { id: "api-key", type: "password", placeholder: "tml-…", autocomplete: "off" });
  const form = el("form", { class: "signin" }, el("p", { text: "Sign in with an API key of this server." }),
    input, " ", el("button", { type: "submit" }, "Sign in"), message ? el("p", { class: "error", text: message }) : null);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    state.key = input.value.trim();
    try {
      await start();
      sessionStorage.setItem("opentinker-key", state.key);
    } catch (e) { state.key = ""; signIn(e.message); }
  });
  show(form);
}

async function start() {
  const me = await api("/whoami");
  document.getElementById("who").replaceChildren(`tenant ${me.tenant}${me.operator ? " (operator)" : ""} `,
    el("a", { onclick: signOut }, "sign out"));
  const pages = [["engine", "Engine", enginePage], ["sessions", "Sessions", sessionsPage],
    ["runs", "Training runs", modelsPage], ["checkpoints", "Checkpoints", checkpointsPage]];
  state.tab = pages.some((p) => p[0] === location.hash.slice(1)) ? location.hash.slice(1) : "runs";
  tabs(pages);
  await pages.find((p) => p[0] === state.tab)[2]();
}

async function enginePage() {
  const view = el("div", { id: "engine" });
  show(el("h2", { text: "Live engine" }), view);
  let prev = null;
  const history = {};
  async function poll() {
    let now;
    try { now = await api("/engine"); } catch (e) { view.replaceChildren(el("p", { class: "error", text: e.message })); return; }
    const blocks = now.engines.map((e) => {
      const p = prev && prev.engines.find((x) => x.base_model === e.base_model);
      const dt = p ? e.time - p.time : 0;
      const rate = (f) => (p && dt > 0 ? (f(e) - f(p)) / dt : null);
      const t = e.ticks, r = e.rollout || {};
      const ticksPerS = rate((x) => x.ticks.ticks);
      const dTicks = p ? t.ticks - p.ticks.ticks : 0;
      const rowsPerTick = p && dTicks > 0 ? (t.fused_rows - p.ticks.fused_rows) / dTicks : (t.ticks ? t.fused_rows / t.ticks : 0);
      const pc = e.prefix_cache, pg = e.paging || {};
      const stats = [
        ["ticks/s", ticksPerS], ["fused rows / tick", rowsPerTick],
        ["training tokens/s", rate((x) => x.ticks.trained_tokens)],
        ["sampling tokens/s", rate((x) => (x.rollout || {}).sampled_tokens || 0)],
        ["prefill tokens/s", rate((x) => (x.rollout || {}).prefill_tokens || 0)],
        ["sampling batch (rows)", r.live_rows ?? null], ["waiting samples", r.waiting ?? null],
        ["prefix-cache hit rate", pc && pc.lookups ? pc.hits / pc.lookups : null],
        ["ticks", t.ticks], ["models", e.models],
        ["resident models", pg.resident ?? null], ["paged-out models", pg.paged_out ?? null],
        ["resident state MiB", pg.resident_bytes === undefined ? null : Math.round(pg.resident_bytes / 2 ** 20)],
        ["memory budget MiB", pg.budget ? Math.round(pg.budget / 2 ** 20) : null],
        ["page-ins/s", rate((x) => (x.paging || {}).page_ins || 0)], ["page-outs/s", rate((x) => (x.paging || {}).page_outs || 0)],
        ["page-in wait (s/s)", rate((x) => (x.paging || {}).wait_s || 0)], ["ticks that waited for a page-in", t.waited_ticks ?? null],
      ];
      const h = (history[e.base_model] = history[e.base_model] || { x: [], y: [] });
      if (ticksPerS !== null) { h.x.push(e.time); h.y.push(ticksPerS); if (h.x.length > 300) { h.x.shift(); h.y.shift(); } }
      const depths = Object.entries(e.queue_depths);
      return el("section", { class: "engine", "data-base-model": e.base_model }, el("h3", {}, el("code", { text: e.base_model })),
        el("div", {}, stats.map(([k, v]) => el("span", { class: "stat", "data-stat": k }, el("b", { text: v === null ? "–" : fmt(v, 3) }), k))),
        el("h4", { text: "queue depth per model" }),
        depths.length ? el("table", {}, el("tr", {}, el("th", { text: "model" }), el("th", { text: "queued ops" })),
          depths.map(([m, d]) => el("tr", {}, el("td", {}, el("code", { text: m })), el("td", { class: "num", text: d }))))
          : el("p", { text: "nothing queued" }),
        e.served_by ? el("h4", { text: "served by (vLLM, or the native backend where vLLM cannot serve)" }) : null,
        e.served_by ? (e.served_by.length ? el("table", { class: "served-by" },
          el("tr", {}, el("th", { text: "snapshot" }), el("th", { text: "served by" }), el("th", { text: "why" })),
          e.served_by.map((s) => el("tr", { "data-snapshot": s.snapshot }, el("td", {}, el("code", { text: s.snapshot })),
            el("td", { text: s.served_by }), el("td", { text: s.reason }))))
          : el("p", { text: "no snapshot sampled yet (the base model samples on vLLM)" })) : null,
        h.x.length > 1 ? chart("ticks/s", [{ label: "ticks/s", points: h.x.map((x, i) => [x - h.x[0], h.y[i]]) }], { xLabel: "s" }) : null);
    });
    view.replaceChildren(...(blocks.length ? blocks : [el("p", { text: "No base model is loaded yet." })]));
    prev = now;
  }
  await poll();
  every(1000, poll);
}

async function sessionsPage(offset = 0) {
  let page;
  try { page = await api(`/sessions?offset=${offset}&limit=50`); } catch (e) { return fail(e); }
  show(el("h2", { text: "Sessions" }),
    el("table", { id: "sessions" },
      el("tr", {}, ["session", "tenant", "created", "last seen", "finished", "models", "samplers", "checkpoints"].map((h) => el("th", { text: h }))),
      page.sessions.map((s) => el("tr", { "data-session": s.session_id },
        el("td", {}, el("a", { onclick: () => tracePage(s.session_id) }, s.session_id)),
        el("td", { text: s.tenant }), el("td", { text: when(s.created) }), el("td", { text: when(s.last_seen) }),
        el("td", { text: s.finished || "" }),
        el("td", {}, s.models.map((m) => el("div", {}, el("a", { onclick: () => modelPage(m) }, m)))),
        el("td", {}, s.samplers.map((m) => el("div", {}, el("code", { text: m })))),
        el("td", { class: "num", text: s.checkpoints })))),
    pager(page, sessionsPage));
}

async function tracePage(sessionId, offset = null) {
  // the session's requests (the server's spans: what export_session_trace exports), newest page first
  const base = `/sessions/${encodeURIComponent(sessionId)}/trace`;
  let t;
  try {
    t = await api(`${base}?offset=${offset ?? 0}&limit=500`);
    if (offset === null && t.total_count > t.limit) t = await api(`${base}?offset=${t.total_count - t.limit}&limit=500`);
  } catch (e) { return fail(e); }
  const reqs = t.requests;
  const t0 = Math.min(...reqs.map((r) => r.received)), t1 = Math.max(...reqs.map((r) => r.received + r.duration_s));
  const span = Math.max(1e-3, t1 - t0), width = 900;
  const tracks = [...new Set(reqs.map((r) => r.track))];
  const x = (v) => ((v - t0) / span) * width;
  const line = el("div", { class: "timeline", id: "timeline", style: `width:${width}px;height:${Math.max(1, tracks.length) * 18 + 6}px` },
    reqs.map((r) => el("div", {
      class: `bar ${r.kind}${r.status.startsWith("failed") ? " err" : ""}`, "data-kind": r.kind,
      style: `left:${x(r.received)}px;width:${Math.max(2, (r.duration_s / span) * width)}px;top:${tracks.indexOf(r.track) * 18 + 3}px`,
      title: `${r.kind} on ${r.track} · waited ${fmt(r.queue_wait_s * 1000, 3)} ms · ran ${fmt(r.run_s * 1000, 3)} ms` + (r.tick === null ? "" : ` · tick ${r.tick}`),
    }, el("span", { class: "wait", style: `width:${(r.queue_wait_s / Math.max(r.duration_s, 1e-9)) * 100}%` }), r.kind)));
  const ms = (v) => fmt(v * 1000, 3);
  show(el("p", {}, el("a", { onclick: () => sessionsPage() }, "‹ sessions")), el("h2", {}, "Trace of ", el("code", { text: sessionId })),
    el("p", { text: `${t.total_count} requests; these ${reqs.length} span ${span.toFixed(3)} s from first arrival to last result; one row per model or sampler, the lighter part of a bar is its wait` }),
    line,
    pager(t, (o) => tracePage(sessionId, o)),
    el("table", { id: "trace" }, el("tr", {}, ["request", "on", "arrived", "queue wait (ms)", "run (ms)", "duration (ms)", "tick", "fused rows", "status"].map((h) => el("th", { text: h }))),
      reqs.slice().reverse().map((r) => el("tr", { class: "request", "data-kind": r.kind, "data-track": r.track },
        el("td", { text: r.kind }), el("td", {}, el("code", { text: r.track })),
        el("td", { text: when(r.received) }), el("td", { class: "num", text: ms(r.queue_wait_s) }),
        el("td", { class: "num", text: ms(r.run_s) }), el("td", { class: "num", text: ms(r.duration_s) }),
        el("td", { class: "num", text: fmt(r.tick) }), el("td", { class: "num", text: fmt(r.fused_rows) }),
        el("td", { text: r.status })))));
}

async function modelsPage(offset = 0) {
  let page;
  try { page = await api(`/models?offset=${offset}&limit=50`); } catch (e) { return fail(e); }
  show(el("h2", { text: "Training runs" }),
    el("table", { id: "models" },
      el("tr", {}, ["run", "tenant", "base model", "rank", "targets", "steps", "created from"].map((h) => el("th", { text: h }))),
      page.models.map((m) => el("tr", { class: "model", "data-model": m.model_id },
        el("td", {}, el("a", { onclick: () => modelPage(m.model_id) }, m.model_id)),
        el("td", { text: m.tenant }), el("td", { text: m.base_model }), el("td", { class: "num", text: fmt(m.rank) }),
        el("td", { text: m.targets.join(", ") }), el("td", { class: "num", text: m.steps }),
        el("td", {}, m.parent ? el("code", { text: m.parent }) : "")))),
    pager(page, modelsPage));
}

function lineageGraph(lin) {
  const arrow = () => el("span", { class: "arrow", text: "→" });
  const nodes = [];
  for (const a of lin.ancestors) {
    nodes.push(a.visible ? el("span", { class: "node ckpt" }, el("code", { text: a.tinker_path })) : el("span", { class: "node hidden", text: "a checkpoint you cannot see" }), arrow());
  }
  nodes.push(el("span", { class: "node run" }, "run ", el("code", { text: lin.model_id })));
  const graph = el("div", { class: "lineage", id: "lineage" }, nodes);
  const saved = el("table", { id: "lineage-checkpoints" },
    el("tr", {}, ["checkpoint", "parent", "data sampled from (sampler versions)"].map((h) => el("th", { text: h }))),
    lin.checkpoints.map((c) => el("tr", { "data-checkpoint": c.tinker_path },
      el("td", {}, el("span", { class: "node ckpt" }, el("code", { text: c.checkpoint_id }))),
      el("td", {}, c.parent ? el("code", { text: c.parent }) : "—"),
      el("td", {}, c.sampler_versions.length ? c.sampler_versions.map((v) => el("div", {}, el("code", { text: v }))) : "—"))));
  return el("div", {}, graph, el("h4", { text: "saved from this run" }), saved);
}

async function modelPage(modelId) {
  stopTimers();
  let m, lin;
  try {
    [m, lin] = await Promise.all([api(`/models/${encodeURIComponent(modelId)}`), api(`/models/${encodeURIComponent(modelId)}/lineage`)]);
  } catch (e) { return fail(e); }
  const charts = ["loss", "grad_norm", "learning_rate"].filter((k) => (m.curves[k] || []).length)
    .map((k) => chart(k, [{ label: k, points: m.curves[k] }], { xLabel: "optim step" }));
  show(el("p", {}, el("a", { onclick: () => modelsPage() }, "‹ training runs")),
    el("h2", {}, "Training run ", el("code", { id: "model-id", text: m.model_id })),
    el("table", {}, [["tenant", m.tenant], ["session", m.session_id], ["base model", m.base_model], ["rank", m.rank],
      ["targets", m.targets.join(", ")], ["steps", m.steps], ["created from", m.parent || "—"]].map(([k, v]) =>
      el("tr", {}, el("th", { text: k }), el("td", { text: fmt(v) })))),
    el("div", { class: "charts", id: "model-charts" }, charts.length ? charts : el("p", { text: "No training steps recorded by this server process yet." })),
    el("h3", { text: "Lineage" }), lineageGraph(lin),
    el("h3", { text: "Checkpoints" }), checkpointTable(m.checkpoints));
}

async function download(c) {
  const r = await fetch(`${API}/checkpoints/${c.model_id}/${c.kind}/${encodeURIComponent(c.name)}/peft.zip`, { headers: { "X-API-Key": state.key } });
  if (!r.ok) { alert((await r.json().catch(() => ({}))).detail || `HTTP ${r.status}`); return; }
  const a = el("a", { href: URL.createObjectURL(await r.blob()), download: `${c.name}-peft.zip` });
  document.body.append(a); a.click(); a.remove();
}

function checkpointTable(rows) {
  return el("table", { id: "checkpoints" },
    el("tr", {}, ["checkpoint", "run", "kind", "size", "TTL (expires)", "published", ""].map((h) => el("th", { text: h }))),
    rows.map((c) => el("tr", { class: "checkpoint", "data-checkpoint": c.tinker_path },
      el("td", {}, el("code", { text: c.tinker_path })),
      el("td", {}, el("a", { class: "to-lineage", onclick: async () => { await modelPage(c.model_id); document.getElementById("lineage").scrollIntoView(); } }, "lineage")),
      el("td", { text: c.checkpoint_type }), el("td", { class: "num", text: `${(c.size_bytes / 1024).toFixed(1)} KiB` }),
      el("td", { text: c.expires_at || "never" }), el("td", { text: c.public ? "yes" : "no" }),
      el("td", {}, c.kind === "external_weights" ? "" : el("a", { class: "download", onclick: () => download(c) }, "download PEFT")))));
}

async function checkpointsPage(offset = 0) {
  let page;
  try { page = await api(`/checkpoints?offset=${offset}&limit=50`); } catch (e) { return fail(e); }
  show(el("h2", { text: "Checkpoints" }), checkpointTable(page.checkpoints), pager(page, checkpointsPage));
}

// ------------------------------------------------------------------------- start
(async () => {
  try {
    state.mode = (await api("/mode")).mode;
  } catch (e) { return fail(e); }
  if (state.mode === "runs") {
    document.getElementById("who").textContent = "local runs";
    state.tab = "runs";
    return runsPage();
  }
  if (!state.key) return signIn();
  try { await start(); } catch (e) { signIn(e.message); }
})();
