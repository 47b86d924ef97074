// mlxproxy live page: polls /streams and draws tables and SVG charts. No dependencies.
// Every value from the proxy is written with textContent or as an SVG attribute, never as HTML.
"use strict";
(function () {
  const POLL_MS = 500;
  const HIDDEN_POLL_MS = 5000;
  const LANE_WINDOW_S = 300;
  const CHART_WINDOW_S = 3600;
  const MAX_RECORDS = 2000;
  const MAX_ROWS = 300;
  const KEY_STORE = "mlxproxy.key";
  const SVGNS = "http://www.w3.org/2000/svg";
  const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"];
  const OK = new Set(["ok", "ok_no_done"]);

  const state = {
    seq: 0, records: new Map(), inflight: [], now: Date.now() / 1000, clockOffset: 0,
    stallRule: { factor: 10, min_s: 1 }, sort: { col: "started_at", dir: -1 }, selected: null,
    colors: new Map(), dirty: true, polls: 0,
  };

  // -- the proxy key ------------------------------------------------------------------------
  if (location.hash.startsWith("#key=")) {  // a fragment never reaches a server or its logs
    sessionStorage.setItem(KEY_STORE, decodeURIComponent(location.hash.slice(5)));
    history.replaceState(null, "", location.pathname + location.search);
  }
  const $ = (sel, root) => (root || document).querySelector(sel);
  const keybox = $("#keybox");
  keybox.addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY_STORE, $("#keyinput").value.trim());
    $("#keyinput").value = "";
    keybox.hidden = true;
    $("#main").hidden = false;
    schedule(0);
  });

  class NeedKey extends Error {}

  async function getJSON(path) {
    const headers = {};
    const key = sessionStorage.getItem(KEY_STORE);
    if (key) headers.authorization = "Bearer " + key;
    const r = await fetch(path, { headers, cache: "no-store" });
    if (r.status === 401) throw new NeedKey();
    if (!r.ok) throw new Error(path.split("?")[0] + " answered HTTP " + r.status);
    return r.json();
  }

  // -- polling ------------------------------------------------------------------------------
  let timer = null;
  function schedule(ms) {
    clearTimeout(timer);
    timer = setTimeout(poll, ms);
  }

  async function poll() {
    try {
      const d = await getJSON("/streams?since=" + state.seq);
      ingest(d);
      state.polls += 1;
      const kept = state.records.size;
      setStatus(`live · ${kept} request${kept === 1 ? "" : "s"} kept · updated ${clock(state.now)}`, "ok");
      render();
      schedule(document.hidden ? HIDDEN_POLL_MS : POLL_MS);  // a tab in the background asks rarely
    } catch (err) {
      if (err instanceof NeedKey) {
        const hadKey = !!sessionStorage.getItem(KEY_STORE);
        sessionStorage.removeItem(KEY_STORE);
        keybox.hidden = false;
        $("#main").hidden = true;
        $("#keyerror").textContent = hadKey ? "That key was refused." : "";
        setStatus("needs the proxy key", "bad");
        return;  // resumes when a key is entered
      }
      setStatus("no data: " + (err && err.message ? err.message : String(err)) + " (retrying)", "bad");
      schedule(1000);
    }
  }

  function ingest(d) {
    if (d.seq < state.seq) {  // the proxy restarted: start over
      state.records.clear();
    }
    state.clockOffset = d.now - Date.now() / 1000;
    state.now = d.now;
    state.inflight = d.in_flight || [];
    if (d.stall_rule) state.stallRule = d.stall_rule;
    const fresh = (d.recent || []).slice().reverse();  // oldest first
    for (const r of fresh) state.records.set(r.id, r);
    if (fresh.length) state.dirty = true;
    while (state.records.size > MAX_RECORDS) state.records.delete(state.records.keys().next().value);
    state.seq = d.seq;
  }

  // -- helpers --------------------------------------------------------------------------------
  function setStatus(text, cls) {
    const s = $("#status");
    s.textContent = text;
    s.className = "status " + (cls || "");
  }
  function fmt(v, digits) {
    return v === null || v === undefined || Number.isNaN(v) ? "–" : Number(v).toFixed(digits);
  }
  function clock(epoch) {
    const d = new Date(epoch * 1000);
    return d.toTimeString().slice(0, 8);
  }
  function colorOf(name) {
    const key = name || "(none)";
    if (!state.colors.has(key)) state.colors.set(key, PALETTE[state.colors.size % PALETTE.length]);
    return state.colors.get(key);
  }
  function nOut(r) {  // the output count the proxy's speeds use
    if (r.tokens_source) return r.completion_tokens;
    return r.completion_tokens_reported !== null && r.completion_tokens_reported !== undefined
      ? r.completion_tokens_reported : r.completion_tokens_counted;
  }
  function td(tr, text, cls) {
    const c = document.createElement("td");
    c.textContent = text;
    if (cls) c.className = cls;
    tr.appendChild(c);
    return c;
  }
  function svg(tag, attrs, parent, text) {
    const e = document.createElementNS(SVGNS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function niceTicks(lo, hi, n) {
    if (!(hi > lo)) return [lo];
    const raw = (hi - lo) / n;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => (hi - lo) / s <= n) || 10 * mag;
    const out = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + 1e-9; t += step) out.push(t);
    return out;
  }
  function timeTicks(lo, hi, n) {
    const steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600];
    const step = steps.find((s) => (hi - lo) / s <= n) || 3600;
    const out = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi; t += step) out.push(t);
    return out;
  }
  // An x tick label's anchor: centred, or ending at its tick near the right edge so it is not cut.
  function tickAnchor(x, right, half) {
    return x > right - half ? "end" : "middle";
  }
  function shortNum(v) {
    if (Math.abs(v) >= 1000) return (v / 1000).toFixed(v % 1000 === 0 ? 0 : 1) + "k";
    return Math.abs(v) >= 10 || v === 0 ? String(Math.round(v)) : v.toPrecision(2);
  }

  // A chart frame: returns {svg, sx, sy} for x in [x0, x1], y in [0, y1]; xfmt labels the x ticks.
  function frame(parent, w, h, x0, x1, y1, xfmt, ylabel) {
    parent.textContent = "";
    const root = svg("svg", { viewBox: `0 0 ${w} ${h}`, width: "100%", class: "frame", role: "img" }, parent);
    const L = 46, R = w - 8, T = 8, B = h - 22;
    const sx = (x) => L + (x - x0) / ((x1 - x0) || 1) * (R - L);
    const sy = (y) => B - y / (y1 || 1) * (B - T);
    for (const t of niceTicks(0, y1, 4)) {
      svg("line", { x1: L, x2: R, y1: sy(t), y2: sy(t), class: "grid" }, root);
      svg("text", { x: L - 4, y: sy(t) + 3, class: "tick", "text-anchor": "end" }, root, shortNum(t));
    }
    for (const t of (xfmt === clock ? timeTicks(x0, x1, 4) : niceTicks(x0, x1, 8))) {
      svg("line", { x1: sx(t), x2: sx(t), y1: B, y2: B + 3, class: "axis" }, root);
      svg("text", { x: sx(t), y: B + 14, class: "tick", "text-anchor": tickAnchor(sx(t), w, 24) }, root, xfmt(t));
    }
    svg("rect", { x: L, y: T, width: R - L, height: B - T, class: "box" }, root);
    if (ylabel) svg("text", { x: 10, y: (T + B) / 2, class: "tick", transform: `rotate(-90 10 ${(T + B) / 2})`, "text-anchor": "middle" }, root, ylabel);
    return { root, sx, sy, L, R, T, B };
  }

  // -- in flight ----------------------------------------------------------------------------
  function renderInflight() {
    const body = $("#inflight tbody");
    body.textContent = "";
    const rows = state.inflight.slice().sort((a, b) => b.age_s - a.age_s);
    for (const s of rows) {
      const tr = document.createElement("tr");
      tr.dataset.id = s.id;
      td(tr, s.id.slice(0, 8), "mono");
      td(tr, s.model || "–");
      td(tr, s.upstream);
      td(tr, fmt(s.age_s, 1), "num");
      const pre = td(tr, "");
      const ahead = firstTokenText(s);
      if (ahead) {
        pre.textContent = ahead;
      } else {
        const [done, total] = s.prefill_progress;
        const pct = total > 0 ? Math.min(100, 100 * done / total) : 0;
        const bar = document.createElement("span");
        bar.className = "bar";
        const fill = document.createElement("span");
        fill.style.width = pct.toFixed(1) + "%";
        bar.appendChild(fill);
        pre.appendChild(bar);
        pre.appendChild(document.createTextNode(` ${done}/${total}`));
      }
      td(tr, String(s.tokens_so_far), "num tokens");
      td(tr, fmt(s.tokens_per_s, 1), "num");
      td(tr, fmt(s.idle_s, 1), "num" + (s.idle_s >= state.stallRule.min_s ? " warn" : ""));
      body.appendChild(tr);
    }
    $("#inflight-count").textContent = String(rows.length);
    $("#inflight .empty").hidden = rows.length > 0;
  }

  // The "first token" cell of a stream in flight, or null to draw its prefill progress bar. The
  // time to the first token includes any wait behind other requests (a serial server queues
  // them), so it is never called prefill; a progress of one step ("1/1") says nothing, and
  // once the first token came the prefill is over.
  function firstTokenText(s) {
    if (s.ttft_s !== null && s.ttft_s !== undefined) {
      const before = (s.concurrency || 1) - 1;
      return "after " + fmt(s.ttft_s, 2) + " s" + (before > 0 ? `, ${before} in flight before it` : "");
    }
    if (s.prefill_progress && s.prefill_progress[1] > 1) return null;
    const ahead = state.inflight.filter((o) => o.upstream === s.upstream && o.age_s > s.age_s).length;
    return ahead > 0 ? `waiting, ${ahead} ahead of it` : "waiting";
  }

  // -- swim lanes ---------------------------------------------------------------------------
  function renderLanes() {
    const holder = $("#lanes .plot");
    const now = state.now;
    const spans = [];
    for (const r of state.records.values()) {
      const end = r.started_at + (r.duration_s || 0);
      if (end >= now - LANE_WINDOW_S) spans.push({ id: r.id, up: r.upstream, start: r.started_at, end, ttft: r.ttft_s, live: false, bad: !OK.has(r.outcome), anom: (r.anomalies || []).length > 0, label: `${r.model || "–"} · ${r.outcome} · ${fmt(r.e2e_s || r.duration_s, 2)} s` });
    }
    for (const s of state.inflight) {
      spans.push({ id: s.id, up: s.upstream, start: now - s.age_s, end: now, ttft: s.ttft_s, live: true, bad: false, anom: false, label: `${s.model || "–"} · in flight · ${s.tokens_so_far} tokens` });
    }
    if (!spans.length) {
      holder.textContent = "No requests in the last 5 minutes.";
      return;
    }
    const t0 = Math.max(now - LANE_WINDOW_S, Math.min(...spans.map((s) => s.start)) - 1);
    const ups = [...new Set(spans.map((s) => s.up))].sort();
    const lanesOf = new Map();
    // A lane is one stream decoding at a time: spans share a lane unless their decoding (dark)
    // parts overlap, so a serial server is one lane however many requests wait in its queue.
    // Later decodes are drawn first, so each lane's dark parts lie over the waits (pale) under them.
    const decodeStart = (s) => (s.ttft !== null && s.ttft !== undefined ? Math.min(s.start + s.ttft, s.end) : s.end);
    for (const up of ups) {
      const mine = spans.filter((s) => s.up === up).sort((a, b) => decodeStart(a) - decodeStart(b));
      const ends = [];
      for (const s of mine) {
        let i = ends.findIndex((e) => e <= decodeStart(s));
        if (i < 0) { i = ends.length; ends.push(0); }
        ends[i] = s.end;
        s.lane = i;
      }
      lanesOf.set(up, { spans: mine.reverse(), lanes: Math.max(1, ends.length) });
    }
    const laneH = 9, gap = 14, w = 1200, L = 190;
    let h = 24;
    for (const v of lanesOf.values()) h += v.lanes * laneH + gap;
    holder.textContent = "";
    const root = svg("svg", { viewBox: `0 0 ${w} ${h}`, width: "100%", class: "frame lanes" }, holder);
    const sx = (t) => L + (t - t0) / ((now - t0) || 1) * (w - L - 8);
    let y = 6;
    for (const up of ups) {
      const v = lanesOf.get(up);
      const bandH = v.lanes * laneH;
      svg("rect", { x: L, y: y - 2, width: w - L - 8, height: bandH + 4, class: "band" }, root);
      svg("text", { x: L - 6, y: y + Math.min(bandH, 12) - 2, class: "lane-label", "text-anchor": "end" }, root,
        `${up.length > 22 ? up.slice(0, 21) + "…" : up} (${v.lanes} lane${v.lanes > 1 ? "s" : ""})`);
      for (const s of v.spans) {
        const x1 = sx(Math.max(s.start, t0)), x2 = Math.max(sx(s.end), x1 + 1.5);
        const yy = y + s.lane * laneH;
        const cls = s.bad ? "span bad" : s.anom ? "span anom" : s.live ? "span live" : "span";
        const g = svg("g", { class: cls, "data-id": s.id }, root);
        svg("title", {}, g, s.label);
        svg("rect", { x: x1, y: yy, width: x2 - x1, height: laneH - 2, class: "wait" }, g);
        if (s.ttft !== null && s.ttft !== undefined) {
          const xt = sx(Math.max(s.start + s.ttft, t0));
          if (x2 > xt) svg("rect", { x: xt, y: yy, width: x2 - xt, height: laneH - 2, class: "decode" }, g);
        }
        if (!s.live) g.addEventListener("click", () => select(s.id));
      }
      y += bandH + gap;
    }
    for (const t of timeTicks(t0, now, 10)) {
      svg("line", { x1: sx(t), x2: sx(t), y1: 2, y2: h - 16, class: "grid" }, root);
      svg("text", { x: sx(t), y: h - 4, class: "tick", "text-anchor": tickAnchor(sx(t), w, 28) }, root, clock(t));
    }
  }

  // -- charts over time -----------------------------------------------------------------------
  function legend(holder, models) {
    const lg = document.createElement("div");
    lg.className = "legend";
    for (const m of models) {
      const item = document.createElement("span");
      const sw = document.createElement("i");
      sw.style.background = colorOf(m);
      item.appendChild(sw);
      item.appendChild(document.createTextNode(m || "(none)"));
      lg.appendChild(item);
    }
    holder.appendChild(lg);
  }

  function scatter(id, value) {
    const holder = $(`#${id} .plot`);
    const now = state.now;
    const pts = [];
    for (const r of state.records.values()) {
      const v = value(r);
      const t = r.started_at + (r.duration_s || 0);
      if (v !== null && v !== undefined && t >= now - CHART_WINDOW_S) pts.push({ t, v, m: r.model, id: r.id });
    }
    if (!pts.length) { holder.textContent = "No data yet."; return; }
    const t0 = Math.min(...pts.map((p) => p.t)) - 1;
    const f = frame(holder, 360, 170, t0, now, Math.max(...pts.map((p) => p.v)) * 1.1, clock, "");
    for (const p of pts) {
      const c = svg("circle", { cx: f.sx(p.t), cy: f.sy(p.v), r: 2.6, fill: colorOf(p.m), class: "pt" }, f.root);
      svg("title", {}, c, `${p.m || "–"}: ${fmt(p.v, 3)} at ${clock(p.t)}`);
      c.addEventListener("click", () => select(p.id));
    }
    legend(holder, [...new Set(pts.map((p) => p.m))]);
  }

  function aggregate() {
    // each record's tokens spread evenly over its decode span (first token to end), summed per model in 10 s
    // buckets; the current bucket is the rate over its elapsed part, drawn at that part's middle (a full
    // 10 s divisor made the line drop at the end while traffic ran, and its midpoint lay past now)
    const id = "chart-aggregate", B = 10;
    const holder = $(`#${id} .plot`);
    const now = state.now;
    const per = new Map();
    let tmin = Infinity;
    for (const r of state.records.values()) {
      const n = nOut(r);
      if (!OK.has(r.outcome) || !n || r.ttft_s === null || r.duration_s === null) continue;
      const a = r.started_at + r.ttft_s, b = r.started_at + r.duration_s;
      if (b < now - CHART_WINDOW_S) continue;
      tmin = Math.min(tmin, a);
      const rate = n / Math.max(b - a, 1e-3);
      if (!per.has(r.model)) per.set(r.model, new Map());
      const buckets = per.get(r.model);
      for (let k = Math.floor(a / B); k * B < b; k++) {
        const overlap = Math.min(b, (k + 1) * B) - Math.max(a, k * B);
        if (overlap > 0) buckets.set(k, (buckets.get(k) || 0) + rate * overlap);
      }
    }
    if (!per.size) { holder.textContent = "No data yet."; return; }
    // per model, [time, rate] of each bucket: the rate over the part that has happened, at its middle
    const series = new Map();
    for (const [m, b] of per) {
      const ks = [...b.keys()].sort((x, y) => x - y), pts = [];
      for (let k = ks[0]; k <= ks[ks.length - 1]; k++) {
        const w = Math.min(B, now - k * B);
        if (w >= 1) pts.push([k * B + w / 2, (b.get(k) || 0) / w]);  // (a bucket's first second: too little to say a rate)
      }
      series.set(m, pts);
    }
    const t0 = Math.max(now - CHART_WINDOW_S, Math.floor(tmin / B) * B);
    const ymax = Math.max(0, ...[...series.values()].flatMap((pts) => pts.map(([, v]) => v)));
    const f = frame(holder, 360, 170, t0, now, ymax * 1.1, clock, "");
    for (const [m, pts] of series) {
      const xy = pts.map(([t, v]) => [f.sx(t).toFixed(1), f.sy(v).toFixed(1)]);
      svg("polyline", { points: xy.map((p) => p.join(",")).join(" "), fill: "none", stroke: colorOf(m), "stroke-width": 1.8, class: "series" }, f.root);
      if (xy.length === 1) {  // one bucket so far: a line of one point draws nothing
        svg("circle", { cx: xy[0][0], cy: xy[0][1], r: 2.6, fill: colorOf(m), class: "series-dot" }, f.root);
      }
    }
    legend(holder, [...per.keys()]);
  }

  // -- anomalies ----------------------------------------------------------------------------
  function renderAnomalies() {
    const list = $("#anomalies ul");
    list.textContent = "";
    let n = 0;
    const recs = [...state.records.values()].filter((r) => (r.anomalies || []).length).reverse();
    for (const r of recs) {
      for (const kind of r.anomalies) {
        n += 1;
        if (n > 60) continue;
        const li = document.createElement("li");
        li.dataset.id = r.id;
        const head = document.createElement("b");
        head.textContent = kind;
        li.appendChild(head);
        li.appendChild(document.createTextNode(` ${clock(r.started_at)} ${r.model || "–"} @ ${r.upstream}: `));
        const ev = document.createElement("span");
        ev.className = "evidence";
        ev.textContent = (r.anomaly_evidence || {})[kind] || "";
        li.appendChild(ev);
        li.addEventListener("click", () => select(r.id));
        list.appendChild(li);
      }
    }
    $("#anomaly-count").textContent = String(n);
    $("#anomalies .empty").hidden = n > 0;
  }

  // -- conversations (the records grouped as /sessions groups them) --------------------------
  const MAX_CONVERSATIONS = 8;
  const CACHE_ANOMALIES = new Set(["prefix_cache_miss", "prompt_prefix_changed", "cached_tokens_unreported",
    "cached_tokens_claimed_cold"]);
  function renderConversations() {
    const groups = new Map();
    for (const r of state.records.values()) {
      if (!r.conversation_id) continue;
      if (!groups.has(r.conversation_id)) groups.set(r.conversation_id, []);
      groups.get(r.conversation_id).push(r);
    }
    const latest = (turns) => Math.max(...turns.map((r) => r.started_at));
    const convs = [...groups.entries()].sort((a, b) => latest(b[1]) - latest(a[1]));
    const body = $("#conversations tbody");
    body.textContent = "";
    for (const [cid, turns] of convs.slice(0, MAX_CONVERSATIONS)) {
      turns.sort((a, b) => (a.turn || 0) - (b.turn || 0) || a.started_at - b.started_at);
      const last = turns[turns.length - 1];
      const lost = Math.max(...turns.map((r) => r.conversation_lost_s || 0));
      const causes = [...new Set(turns.map((r) => r.reprefill_cause).filter(Boolean))];
      const client = [...turns].reverse().map((r) => r.client).find(Boolean);
      const head = document.createElement("tr");
      head.className = "conv";
      td(head, `${cid} · ${last.turn} turn${last.turn === 1 ? "" : "s"}`, "mono");
      td(head, `${client ? client + " · " : ""}${last.model || "–"} @ ${last.upstream}`);
      td(head, last.prompt_tokens ?? "–", "num");
      td(head, "", "num"); td(head, "", "num"); td(head, "", "num");
      td(head, fmt(lost, 2), lost > 0 ? "num warn" : "num");
      td(head, causes.join(", "), causes.length ? "warn" : "");
      td(head, ""); td(head, "");
      body.appendChild(head);
      const fix = conversationFix(turns);
      if (fix) {  // the seconds lost and the fix users apply, in one line (the records' reprefill_fix)
        const tr = document.createElement("tr");
        tr.className = "fix";
        const c = td(tr, "", "fix");
        c.colSpan = 10;
        const b = document.createElement("b");
        b.textContent = `${fmt(lost, 2)} s lost to ${fix.cause}. Fix: `;
        c.appendChild(b);
        c.appendChild(document.createTextNode(fix.line));
        body.appendChild(tr);
      }
      for (const r of turns) {
        const tr = document.createElement("tr");
        tr.dataset.id = r.id;
        tr.className = "turn";
        td(tr, `turn ${r.turn ?? "–"} · ${clock(r.started_at)}`, "mono");
        td(tr, OK.has(r.outcome) ? "" : r.outcome, OK.has(r.outcome) ? "" : "bad");
        td(tr, r.prompt_tokens ?? "–", "num");
        td(tr, r.prefix_reusable_tokens ?? "–", "num");
        td(tr, r.cached_tokens ?? "–", "num");
        td(tr, fmt(r.ttft_s, 3), "num");
        td(tr, r.reprefill_lost_s ? fmt(r.reprefill_lost_s, 3) : "", "num");
        td(tr, r.reprefill_cause || "", r.reprefill_cause ? "warn" : "");
        td(tr, r.reprefill_at || "", "mono where").title = r.reprefill_at || "";
        const anomalies = (r.anomalies || []).filter((a) => CACHE_ANOMALIES.has(a));
        td(tr, anomalies.join(", "), anomalies.length ? "warn" : "");
        tr.addEventListener("click", () => select(r.id));
        body.appendChild(tr);
      }
    }
    $("#conversation-count").textContent = String(groups.size);
    $("#conversations .empty").hidden = groups.size > 0;
  }

  // the cause that lost the conversation the most seconds and its fix (as /sessions' `fix`)
  function conversationFix(turns) {
    const lost = new Map(), line = new Map();
    for (const r of turns) {
      if (!r.reprefill_cause) continue;
      lost.set(r.reprefill_cause, (lost.get(r.reprefill_cause) || 0) + (r.reprefill_lost_s || 0));
      if (r.reprefill_fix && !line.has(r.reprefill_cause)) line.set(r.reprefill_cause, r.reprefill_fix);
    }
    let best = null;
    for (const [cause, s] of lost) if (best === null || s > lost.get(best)) best = cause;
    return best && line.has(best) ? { cause: best, line: line.get(best) } : null;
  }

  // -- side requests (titles, token counts, probes, quota checks: in no conversation) --------
  const MAX_SIDE = 20;
  function renderSide() {
    const side = [...state.records.values()].filter((r) => r.side_request).sort((a, b) => b.started_at - a.started_at);
    const body = $("#side tbody");
    body.textContent = "";
    for (const r of side.slice(0, MAX_SIDE)) {
      const tr = document.createElement("tr");
      tr.dataset.id = r.id;
      td(tr, clock(r.started_at), "mono");
      td(tr, r.client || "–");
      td(tr, r.side_request, "side");
      td(tr, `${r.method} ${r.path}`, "mono");
      td(tr, `${r.model || "–"} @ ${r.upstream}`);
      td(tr, OK.has(r.outcome) ? "ok" : r.outcome, OK.has(r.outcome) ? "" : "bad");
      td(tr, fmt(r.ttft_s, 3), "num");
      tr.addEventListener("click", () => select(r.id));
      body.appendChild(tr);
    }
    $("#side-count").textContent = String(side.length);
    $("#side .empty").hidden = side.length > 0;
  }

  // -- recent requests ----------------------------------------------------------------------
  function sortValue(r, col) {
    if (col === "n_out") return nOut(r);
    if (col === "anomalies") return (r.anomalies || []).join(",");
    return r[col];
  }

  function renderRecent() {
    const body = $("#recent tbody");
    body.textContent = "";
    const { col, dir } = state.sort;
    const recs = [...state.records.values()].sort((a, b) => {
      const x = sortValue(a, col), y = sortValue(b, col);
      if (x === y) return 0;
      if (x === null || x === undefined) return 1;  // missing values last, either way
      if (y === null || y === undefined) return -1;
      return (x < y ? -1 : 1) * dir;
    });
    for (const r of recs.slice(0, MAX_ROWS)) {
      const tr = document.createElement("tr");
      tr.dataset.id = r.id;
      if (r.id === state.selected) tr.className = "selected";
      td(tr, clock(r.started_at), "mono");
      td(tr, r.model || "–");
      td(tr, r.upstream);
      td(tr, r.outcome, OK.has(r.outcome) ? "" : "bad");
      td(tr, fmt(r.ttft_s, 3), "num");
      td(tr, fmt(r.decode_tps, 1), "num");
      td(tr, fmt(r.wall_tps, 1), "num");
      td(tr, `${r.completion_tokens_reported ?? "–"}/${r.completion_tokens_counted ?? "–"}`, "num");
      td(tr, r.prompt_tokens ?? "–", "num");
      td(tr, fmt(r.e2e_s, 2), "num");
      td(tr, (r.anomalies || []).join(", "), (r.anomalies || []).length ? "warn anoms" : "anoms");
      tr.addEventListener("click", () => select(r.id));
      body.appendChild(tr);
    }
    for (const th of document.querySelectorAll("#recent th[data-col]")) {
      th.classList.toggle("asc", th.dataset.col === col && dir > 0);
      th.classList.toggle("desc", th.dataset.col === col && dir < 0);
    }
    $("#recent-count").textContent = String(recs.length);
    $("#recent .empty").hidden = recs.length > 0;
  }

  for (const th of document.querySelectorAll("#recent th[data-col]")) {
    th.addEventListener("click", () => {
      const col = th.dataset.col;
      state.sort = { col, dir: state.sort.col === col ? -state.sort.dir : (col === "started_at" ? -1 : 1) };
      renderRecent();
    });
  }

  // -- one request's timeline ---------------------------------------------------------------
  async function select(id) {
    state.selected = id;
    const known = state.records.get(id);
    if (known && !known.event_offsets_ms) {  // the token timeline is fetched when a request is opened
      try {
        const d = await getJSON("/streams?timeline=1&id=" + encodeURIComponent(id));
        const full = (d.recent || [])[0];
        if (full && state.records.has(id)) state.records.set(id, full);
        else known.event_offsets_ms = null;  // no longer kept by the proxy
      } catch (err) {
        setStatus("could not load the timeline: " + (err && err.message ? err.message : String(err)), "bad");
      }
    }
    if (state.selected !== id) return;  // another request was opened meanwhile
    renderDetail();
    renderRecent();
    $("#detail").scrollIntoView({ block: "nearest" });
  }
  $("#detail-close").addEventListener("click", () => { state.selected = null; renderDetail(); renderRecent(); });

  function stallsOf(offs) {
    const gaps = [];
    for (let i = 1; i < offs.length; i++) gaps.push(offs[i] - offs[i - 1]);
    if (gaps.length < 1) return [];
    const sorted = gaps.slice().sort((a, b) => a - b);
    const median = sorted[Math.floor(sorted.length / 2)];
    const limit = Math.max(state.stallRule.min_s * 1000, state.stallRule.factor * median);
    const out = [];
    for (let i = 0; i < gaps.length; i++) if (gaps[i] >= limit) out.push([offs[i], offs[i + 1]]);
    return out;
  }

  function renderDetail() {
    const sec = $("#detail");
    const r = state.selected && state.records.get(state.selected);
    if (!r) { sec.hidden = true; return; }
    sec.hidden = false;
    $("#detail-id").textContent = `${r.id} · ${r.model || "–"} @ ${r.upstream} · ${r.outcome}`;
    const dl = $("#detail-figures");
    dl.textContent = "";
    const rows = [
      ["started", new Date(r.started_at * 1000).toLocaleString()],
      ["endpoint", `${r.method} ${r.path || r.endpoint} ${r.stream ? "(stream)" : ""}`],
      ["status", r.status ?? "–"], ["finish reason", r.finish_reason ?? "–"],
      ["TTFT", fmt(r.ttft_s, 3) + " s"], ["e2e", fmt(r.e2e_s, 3) + " s"],
      ["decode", fmt(r.decode_tps, 1) + " tok/s"], ["wall", fmt(r.wall_tps, 1) + " tok/s"],
      ...(r.tail_after_done_s ? [["open after [DONE]", fmt(r.tail_after_done_s, 3) + " s"]] : []),
      ["prefill", fmt(r.prefill_tps, 0) + " tok/s"],
      ["prompt tokens", r.prompt_tokens ?? "–"], ["cached tokens", r.cached_tokens ?? "–"],
      ["tokens reported", r.completion_tokens_reported ?? "–"], ["tokens counted", r.completion_tokens_counted ?? "–"],
      ["tokens (tokenizer)", r.completion_tokens_tokenizer ?? "–"],
      ...(r.tokens_source ? [["tokens used for speeds", `${r.completion_tokens ?? "–"} (from ${r.tokens_source})`]] : []),
      ["stalls", `${r.stall_count} (${fmt(r.stall_total_s, 2)} s)`], ["concurrency", r.concurrency],
    ];
    if (r.error) rows.push(["error", r.error]);
    for (const [k, v] of rows) {
      const dt = document.createElement("dt");
      dt.textContent = k;
      const dd = document.createElement("dd");
      dd.textContent = String(v);
      dl.appendChild(dt);
      dl.appendChild(dd);
    }
    const ul = $("#detail-anomalies");
    ul.textContent = "";
    for (const kind of r.anomalies || []) {
      const li = document.createElement("li");
      const b = document.createElement("b");
      b.textContent = kind;
      li.appendChild(b);
      const ev = document.createElement("span");
      ev.className = "evidence";
      ev.textContent = " " + ((r.anomaly_evidence || {})[kind] || "");
      li.appendChild(ev);
      ul.appendChild(li);
    }
    const holder = $("#detail-plot");
    const offs = r.event_offsets_ms || [];
    const endMs = (r.duration_s || 0) * 1000;
    if (!offs.length) {
      holder.textContent = r.event_offsets_ms === null ? "The proxy no longer keeps this request's timeline."
        : "No token events (a response that was not streamed, or none came).";
      return;
    }
    const x1 = Math.max(endMs, offs[offs.length - 1]) / 1000 * 1.02;
    const reported = r.completion_tokens_reported;
    const ymax = Math.max(offs.length, reported || 0) * 1.08;
    const f = frame(holder, 900, 260, 0, x1, ymax, (t) => shortNum(t) + " s", "tokens");
    for (const [a, b] of stallsOf(offs)) {
      svg("rect", { x: f.sx(a / 1000), y: f.T, width: f.sx(b / 1000) - f.sx(a / 1000), height: f.B - f.T, class: "stall" }, f.root);
    }
    const pts = ["" + f.sx(0) + "," + f.sy(0)];
    offs.forEach((o, i) => {
      const x = f.sx(o / 1000);
      pts.push(`${x.toFixed(1)},${f.sy(i).toFixed(1)}`, `${x.toFixed(1)},${f.sy(i + 1).toFixed(1)}`);
    });
    svg("polyline", { points: pts.join(" "), class: "cumulative" }, f.root);
    const ticks = svg("g", { class: "tok" }, f.root);
    const step = Math.max(1, Math.ceil(offs.length / 1500));  // at most ~1500 marks
    for (let i = 0; i < offs.length; i += step) {
      const x = f.sx(offs[i] / 1000).toFixed(1);
      svg("line", { x1: x, x2: x, y1: f.B - 6, y2: f.B }, ticks);
    }
    if (r.ttft_s !== null && r.ttft_s !== undefined) {
      svg("line", { x1: f.sx(r.ttft_s), x2: f.sx(r.ttft_s), y1: f.T, y2: f.B, class: "ttft" }, f.root);
      svg("text", { x: f.sx(r.ttft_s) + 3, y: f.B - 10, class: "tick" }, f.root, `first token ${fmt(r.ttft_s, 3)} s`);
    }
    if (reported !== null && reported !== undefined) {
      const y = f.sy(reported);
      svg("line", { x1: f.L, x2: f.R, y1: y, y2: y, class: "reported" }, f.root);
      svg("text", { x: f.R - 4, y: y - 3, class: "tick", "text-anchor": "end" }, f.root, `usage reported ${reported} tokens; ${offs.length} token events streamed`);
    }
  }

  // -- all ----------------------------------------------------------------------------------
  function render() {
    renderInflight();
    renderLanes();
    if (state.dirty) {
      state.dirty = false;
      scatter("chart-ttft", (r) => (OK.has(r.outcome) ? r.ttft_s : null));
      scatter("chart-decode", (r) => (OK.has(r.outcome) ? r.decode_tps : null));
      aggregate();
      renderAnomalies();
      renderConversations();
      renderSide();
      renderRecent();
      renderDetail();
    }
  }

  // -- upstream reachability (/healthz, every 5 s; open without the proxy key) --------------------
  const HEALTH_MS = 5000;
  async function pollHealth() {
    try {
      const r = await fetch("/healthz", { cache: "no-store" });
      renderHealth(r.ok ? (await r.json()).upstreams || [] : []);
    } catch (err) {
      renderHealth([]);  // the proxy itself is down: the status line says so
    }
    setTimeout(pollHealth, HEALTH_MS);
  }
  function renderHealth(upstreams) {
    const box = $("#upstream-health");
    const down = upstreams.filter((u) => u.reachable === false);
    box.replaceChildren();
    for (const u of down) {
      const p = document.createElement("p");
      p.textContent = `upstream ${u.name} at ${u.url} is unreachable` + (u.last_error ? `: ${u.last_error}` : "") +
        (u.last_error_at ? ` (${clock(u.last_error_at)})` : "") + "; requests to it get HTTP 502";
      box.appendChild(p);
    }
    box.hidden = down.length === 0;
  }
  pollHealth();

  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && keybox.hidden) schedule(0);
  });
  schedule(0);
})();
