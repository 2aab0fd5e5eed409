/* vitscope report: the model bar, the per-layer charts (uPlot), the CKA grids and the attention explorer.
   Everything it reads is in the page (script elements of type application/json); it makes no request.
   window.vitscope exposes the state for tests and for readers who want the numbers. */
(function () {
  "use strict";
  const VS = (window.vitscope = { charts: [], grids: [], panels: {}, ready: false });
  const dataEl = document.getElementById("vs-data");
  if (!dataEl) return;
  const DATA = JSON.parse(dataEl.textContent);
  const MODELS = DATA.models;
  const META = Object.fromEntries(MODELS.map((m) => [m.name, m]));
  const shown = new Set(MODELS.map((m) => m.name));
  const listeners = [];
  VS.shown = shown;

  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v);
    }
    for (const k of kids) if (k != null) e.append(k);
    return e;
  }
  function fmt(v) {
    if (v == null || !isFinite(v)) return "–";
    return String(Number(v.toPrecision(4)));
  }

  /* ---- one model selection for the whole page ---- */
  function setShown(name, on) {
    if (on === shown.has(name)) return;
    if (on) shown.add(name);
    else shown.delete(name);
    for (const f of listeners) f(name, on);
  }
  VS.setShown = setShown;
  function buildBar() {
    const bar = document.getElementById("vs-models");
    if (!bar) return;
    bar.append(el("b", { text: "Models: " }));
    const boxes = {};
    for (const m of MODELS) {
      const box = el("input", { type: "checkbox", "data-model": m.name });
      box.checked = true;
      box.addEventListener("change", () => setShown(m.name, box.checked));
      boxes[m.name] = box;
      bar.append(el("label", { class: "vs-model", title: m.family },
        box, el("span", { class: "vs-swatch", style: `background:${m.color}` }), m.name));
    }
    const families = [...new Set(MODELS.map((m) => m.family).filter((f) => f))];
    if (families.length > 1) {
      bar.append(el("span", { class: "muted", text: " families: " }));
      for (const f of families) {
        const members = MODELS.filter((m) => m.family === f).map((m) => m.name);
        bar.append(el("button", { type: "button", class: "vs-family", "data-family": f, onclick: () => {
          const on = !members.every((n) => shown.has(n));
          members.forEach((n) => setShown(n, on));
        } }, f));
      }
    }
    listeners.push((name, on) => { if (boxes[name]) boxes[name].checked = on; });
  }

  /* ---- per-layer charts ---- */
  function hexAlpha(c, a) {
    return c.length === 7 ? c + Math.round(a * 255).toString(16).padStart(2, "0") : c;
  }
  function drawBands(u) {
    const ctx = u.ctx, panel = u._vsPanel, names = u._vsNames;
    ctx.save();
    ctx.beginPath();
    ctx.rect(u.bbox.left, u.bbox.top, u.bbox.width, u.bbox.height);
    ctx.clip();
    names.forEach((name, k) => {
      const s = u.series[k + 1];
      if (!s.show) return;
      const ser = panel.series[name], xs = panel.x;
      ctx.fillStyle = META[name] && META[name].untrained ? "rgba(120,120,120,0.28)" : hexAlpha(s._stroke || "#888888", 0.16);
      let seg = [];
      const flush = () => {
        if (seg.length) {
          ctx.beginPath();
          seg.forEach((i, j) => {
            const x = u.valToPos(xs[i], "x", true), y = u.valToPos(ser.hi[i], "y", true);
            j ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
          });
          for (let j = seg.length - 1; j >= 0; j--) ctx.lineTo(u.valToPos(xs[seg[j]], "x", true), u.valToPos(ser.lo[seg[j]], "y", true));
          ctx.closePath();
          ctx.fill();
        }
        seg = [];
      };
      xs.forEach((_, i) => { (ser.lo[i] == null || ser.hi[i] == null) ? flush() : seg.push(i); });
      flush();
    });
    ctx.restore();
  }
  function bandRange(panel) {
    /* the y range that shows the chance level and the untrained models' bands, padded */
    const vals = [];
    if (panel.chance != null) vals.push(panel.chance);
    for (const [name, s] of Object.entries(panel.series)) {
      if (!(META[name] && META[name].untrained)) continue;
      for (const arr of [s.lo, s.hi, s.y]) for (const v of arr) if (v != null) vals.push(v);
    }
    if (!vals.length) return null;
    let lo = Math.min(...vals), hi = Math.max(...vals);
    const pad = Math.max((hi - lo) * 0.25, Math.abs(hi) * 0.02, 1e-3);
    return [lo - pad, hi + pad];
  }
  function buildChart(host, chart) {
    const box = el("div", { class: "vs-chart", id: chart.id });
    const head = el("div", { class: "vs-chart-head" }, el("b", { text: chart.title }));
    const plot = el("div", { class: "vs-plot" });
    const note = el("div", { class: "muted vs-note" });
    const entry = { id: chart.id, chart, u: null, panel: 0 };
    let select = null;
    if (chart.panels.length > 1) {
      select = el("select", { class: "vs-panel" });
      chart.panels.forEach((p, i) => select.append(el("option", { value: String(i) }, p.label)));
      select.addEventListener("change", () => draw(Number(select.value)));
      head.append(" ", select);
    }
    const zoom = el("button", { type: "button", class: "vs-zoom" }, "zoom to the reference / untrained");
    const reset = el("button", { type: "button", class: "vs-reset" }, "reset zoom");
    head.append(" ", zoom, " ", reset);
    box.append(head, plot, note);
    host.append(box);
    function draw(i) {
      entry.panel = i;
      const panel = chart.panels[i];
      const names = Object.keys(panel.series);
      const data = [panel.x, ...names.map((n) => panel.series[n].y)];
      const series = [{ label: "block", value: (u, v) => (v == null ? "–" : String(v)) }];
      names.forEach((n) => {
        const m = META[n] || { color: "#888888", untrained: false };
        const s = panel.series[n];
        series.push({
          label: n + (m.untrained ? " (untrained)" : ""), stroke: m.untrained ? "#777777" : m.color, width: 1.6,
          dash: m.untrained ? [6, 4] : undefined, show: shown.has(n), spanGaps: false,
          points: { show: true, size: 4 },
          value: (u, v, si, idx) => {
            if (v == null || idx == null) return "–";
            const lo = s.lo[idx], hi = s.hi[idx];
            if (lo == null || hi == null) return fmt(v);
            return s.n[idx] > 1 ? `${fmt(v)} (mean; range ${fmt(lo)} to ${fmt(hi)})` : `${fmt(v)} [${fmt(lo)}, ${fmt(hi)}]`;
          },
        });
      });
      if (panel.chance != null) {
        data.push(panel.x.map(() => panel.chance));
        series.push({ label: panel.reference || "chance", stroke: "#000000", dash: [3, 3], width: 1, points: { show: false },
          value: () => fmt(panel.chance) });
      }
      const width = Math.max(320, Math.min(760, host.clientWidth - 10 || 640));
      const opts = {
        width, height: 260, series, scales: { x: { time: false } },
        axes: [{ label: "block" }, { label: panel.label, size: 60 }],
        cursor: { drag: { x: true, y: true, uni: 30 } },
        hooks: {
          drawAxes: [drawBands],
          setSeries: [(u, si, o) => { if (o && o.show != null && si > 0 && si <= names.length) setShown(names[si - 1], o.show); }],
        },
      };
      if (entry.u) entry.u.destroy();
      const u = new uPlot(opts, data, plot);
      u._vsPanel = panel;
      u._vsNames = names;
      names.forEach((n, k) => { u.series[k + 1]._stroke = (META[n] || {}).color || "#888888"; });
      entry.u = u;
      entry.names = names;
      const range = bandRange(panel);
      zoom.disabled = !range;
      zoom.title = range ? "" : "this chart has no reference level and no untrained model";
      note.textContent = panel.note + (panel.chance != null ? `; dashed black: ${panel.reference || "chance"}` : "") +
        (names.some((n) => META[n] && META[n].untrained) ? "; grey, dashed: untrained" : "") +
        ". Click a legend entry to hide a model on every chart; drag to zoom, double-click to zoom out.";
    }
    zoom.addEventListener("click", () => { const r = bandRange(chart.panels[entry.panel]); if (r) entry.u.setScale("y", { min: r[0], max: r[1] }); });
    reset.addEventListener("click", () => draw(entry.panel));
    draw(0);
    listeners.push((name, on) => {
      const k = entry.names.indexOf(name);
      if (k >= 0 && entry.u.series[k + 1].show !== on) entry.u.setSeries(k + 1, { show: on });
    });
    VS.charts.push(entry);
  }

  /* ---- colour map (viridis, 9 stops) ---- */
  const VIRIDIS = [[68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141], [39, 173, 129],
    [92, 200, 99], [170, 220, 50], [253, 231, 37]];
  function colour(t) {
    t = Math.max(0, Math.min(1, t)) * (VIRIDIS.length - 1);
    const i = Math.min(VIRIDIS.length - 2, Math.floor(t)), f = t - i, a = VIRIDIS[i], b = VIRIDIS[i + 1];
    return [0, 1, 2].map((c) => Math.round(a[c] + (b[c] - a[c]) * f));
  }

  /* ---- CKA grids ---- */
  function buildGrid(host, chart) {
    const box = el("div", { class: "vs-chart vs-grid", id: chart.id });
    const head = el("div", { class: "vs-chart-head" }, el("b", { text: chart.title }));
    const views = chart.grids;
    const names = [...new Set(views.flatMap((g) => g.pairs.flatMap((p) => [p.a, p.b])))];
    const order = MODELS.map((m) => m.name).filter((n) => names.includes(n));
    const selA = el("select", { class: "vs-pick-a" }), selB = el("select", { class: "vs-pick-b" });
    for (const n of order) { selA.append(el("option", { value: n }, n)); selB.append(el("option", { value: n }, n)); }
    if (order.length > 1) selB.value = order[1];
    const selV = el("select", { class: "vs-pick-view" });
    views.forEach((g, i) => selV.append(el("option", { value: String(i) }, g.view || "all")));
    head.append(" A ", selA, " B ", selB, views.length > 1 ? " view " : "", views.length > 1 ? selV : null);
    const canvas = el("canvas", { width: "320", height: "320", class: "vs-heat" });
    const tip = el("div", { class: "vs-tip muted", text: "hover a cell for its CKA and 95 % interval" });
    box.append(head, el("div", {}, canvas, el("div", { class: "muted vs-heat-note" })), tip);
    host.append(box);
    const entry = { id: chart.id, canvas, cells: null };
    function pair() {
      const g = views[Number(selV.value) || 0], a = selA.value, b = selB.value;
      for (const p of g.pairs) {
        if (p.a === a && p.b === b) return { la: p.layers_a, lb: p.layers_b, range: g.range, get: (k, i, j) => p[k][i][j] };
        if (p.a === b && p.b === a) return { la: p.layers_b, lb: p.layers_a, range: g.range, get: (k, i, j) => p[k][j][i] };
      }
      return null;
    }
    function draw() {
      const ctx = canvas.getContext("2d"), p = pair();
      ctx.clearRect(0, 0, canvas.width, canvas.height);
      entry.cells = p;
      if (!p) { ctx.fillText("no rows for this pair", 10, 20); return; }
      box.querySelector(".vs-heat-note").textContent = `rows: ${selA.value}'s blocks (0 at the bottom), columns: ` +
        `${selB.value}'s; colour ${fmt(p.range[0])} (dark) to ${fmt(p.range[1])} (bright)`;
      const w = canvas.width / p.lb.length, h = canvas.height / p.la.length;
      p.la.forEach((_, i) => p.lb.forEach((_, j) => {
        const v = p.get("value", i, j), span = p.range[1] - p.range[0] || 1;
        const [r, g, b] = v == null ? [220, 220, 220] : colour((v - p.range[0]) / span);
        ctx.fillStyle = `rgb(${r},${g},${b})`;
        ctx.fillRect(j * w, canvas.height - (i + 1) * h, Math.ceil(w), Math.ceil(h));
      }));
    }
    canvas.addEventListener("mousemove", (ev) => {
      const p = entry.cells;
      if (!p) return;
      const r = canvas.getBoundingClientRect();
      const j = Math.floor(((ev.clientX - r.left) / r.width) * p.lb.length);
      const i = Math.floor(((r.bottom - ev.clientY) / r.height) * p.la.length);
      if (i < 0 || j < 0 || i >= p.la.length || j >= p.lb.length) return;
      const v = p.get("value", i, j), lo = p.get("lo", i, j), hi = p.get("hi", i, j);
      tip.textContent = `${selA.value} block ${p.la[i]} × ${selB.value} block ${p.lb[j]}: ${fmt(v)}` +
        (lo != null && hi != null ? ` [${fmt(lo)}, ${fmt(hi)}]` : "");
      tip.dataset.value = v == null ? "" : String(v);
    });
    [selA, selB, selV].forEach((s) => s.addEventListener("change", draw));
    draw();
    VS.grids.push(entry);
  }

  /* ---- attention explorer ---- */
  function bytes(b64) {
    const s = atob(b64), out = new Uint8Array(s.length);
    for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
    return out;
  }
  function floats(b64) {
    const b = bytes(b64), v = new DataView(b.buffer), out = new Float32Array(b.length / 4);
    for (let i = 0; i < out.length; i++) out[i] = v.getFloat32(4 * i, true);
    return out;
  }
  const decoded = new Map();
  function quantised(key, pair) {
    /* codes and row maxima of one block (decoded once, when first shown) */
    if (!decoded.has(key)) decoded.set(key, { codes: bytes(pair[0]), scales: floats(pair[1]) });
    return decoded.get(key);
  }
  function row(q, heads, Q, T, head, query) {
    /* one query's attention over all T keys (codes laid out heads x Q queries x T keys): one head, or the mean
       of the heads */
    const out = new Float64Array(T), hs = head === "mean" ? [...Array(heads).keys()] : [head];
    for (const h of hs) {
      const s = q.scales[h * Q + query], base = (h * Q + query) * T;
      for (let k = 0; k < T; k++) out[k] += (q.codes[base + k] / 255) * s;
    }
    if (hs.length > 1) for (let k = 0; k < T; k++) out[k] /= hs.length;
    return out;
  }
  function buildExplorer() {
    const host = document.getElementById("vs-explorer");
    const EX = DATA.explorer;
    if (!host || !EX) return;
    const names = Object.keys(EX.models);
    const left = Object.entries(EX.left_out || {});
    if (left.length) {
      host.append(el("p", { class: "muted vs-ex-left", text: "Not in the page, to keep it within its size budget: " +
        left.map(([m, k]) => `${k} kept image${k > 1 ? "s" : ""} of ${m}`).join(", ") +
        " (every map is in results/attention_explorer.parquet; fewer layers or images fit more)." }));
    }
    if (!names.length) return;
    const images = [...new Set(names.flatMap((n) => Object.keys(EX.models[n].images)))].sort((a, b) => a - b);
    const maxLayers = Math.max(...names.map((n) => EX.models[n].layers.length));
    const maxHeads = Math.max(...names.flatMap((n) => Object.values(EX.models[n].images).map((im) => im.heads || 1)));
    const maxRegs = Math.max(...names.map((n) => EX.models[n].prefix - (EX.models[n].cls ? 1 : 0)));
    const anyCls = names.some((n) => EX.models[n].cls);
    const anyPool = names.some((n) => Object.values(EX.models[n].images).some((im) => im.pool));
    const st = (VS.explorer = { image: images[0], block: 0, head: "mean", query: { kind: "patch", fy: 0.5, fx: 0.5 }, pinned: false, panels: {} });

    const imgSel = el("select", { class: "vs-ex-image" });
    images.forEach((i) => imgSel.append(el("option", { value: i }, `image ${i}`)));
    const slider = el("input", { type: "range", min: "0", max: String(maxLayers - 1), value: "0", class: "vs-ex-block" });
    const sliderLabel = el("span", { class: "vs-ex-block-label", text: "block 0" });
    const headSel = el("select", { class: "vs-ex-head" }, el("option", { value: "mean" }, "mean of heads"));
    for (let h = 0; h < maxHeads; h++) headSel.append(el("option", { value: String(h) }, `head ${h}`));
    const qSel = el("select", { class: "vs-ex-query" }, el("option", { value: "patch" }, "a patch (hover, click to pin)"));
    if (anyCls) qSel.append(el("option", { value: "cls" }, "CLS token"));
    for (let k = 0; k < maxRegs; k++) qSel.append(el("option", { value: `reg${k}` }, `register ${k}`));
    if (anyPool) qSel.append(el("option", { value: "pool" }, "the pool's query (attention pool)"));
    const status = el("span", { class: "muted vs-ex-status" });
    host.append(el("div", { class: "vs-ex-controls" }, imgSel, " ", slider, " ", sliderLabel, " ", headSel, " query: ", qSel, " ", status));
    const row_ = el("div", { class: "vs-ex-panels" });
    host.append(row_);
    const SIZE = 176;
    for (const n of names) {
      const m = EX.models[n];
      const main = el("canvas", { width: String(SIZE), height: String(SIZE), class: "vs-ex-map", "data-model": n });
      const roll = el("canvas", { width: String(SIZE / 2), height: String(SIZE / 2), class: "vs-ex-rollout", "data-model": n });
      const text = el("div", { class: "vs-ex-text" });
      const panel = el("div", { class: "vs-ex-panel", "data-model": n },
        el("div", { class: "vs-ex-title" }, el("span", { class: "vs-swatch", style: `background:${(META[n] || {}).color || "#888"}` }), n),
        main, el("div", { class: "vs-ex-roll" }, roll, el("div", { class: "muted", text: "rollout (head mean) up to this block" })), text);
      row_.append(panel);
      const img = new Image();
      st.panels[n] = { panel, main, roll, text, img, model: m };
      const pick = (ev, pin) => {
        const r = main.getBoundingClientRect();
        const fy = (ev.clientY - r.top) / r.height, fx = (ev.clientX - r.left) / r.width;
        if (fy < 0 || fx < 0 || fy >= 1 || fx >= 1) return;
        if (st.pinned && !pin) return;
        st.query = { kind: "patch", fy, fx };
        qSel.value = "patch";
        if (pin) st.pinned = true;
        render();
      };
      main.addEventListener("mousemove", (ev) => pick(ev, false));
      main.addEventListener("click", (ev) => pick(ev, true));
      panel.style.display = shown.has(n) ? "" : "none";
    }
    listeners.push((name, on) => { if (st.panels[name]) st.panels[name].panel.style.display = on ? "" : "none"; });
    imgSel.addEventListener("change", () => { st.image = imgSel.value; render(); });
    slider.addEventListener("input", () => { st.block = Number(slider.value); render(); });
    headSel.addEventListener("change", () => { st.head = headSel.value === "mean" ? "mean" : Number(headSel.value); render(); });
    qSel.addEventListener("change", () => {
      const v = qSel.value;
      st.pinned = false;
      st.query = v === "patch" ? { kind: "patch", fy: 0.5, fx: 0.5 } : v === "cls" ? { kind: "cls" } : v === "pool" ? { kind: "pool" } : { kind: "reg", k: Number(v.slice(3)) };
      render();
    });

    function token(m, q) {
      /* the query's token index in this model, or a reason it has none */
      const [gr, gc] = m.grid, regs = m.prefix - (m.cls ? 1 : 0);
      if (q.kind === "patch") {
        const r = Math.min(gr - 1, Math.floor(q.fy * gr)), c = Math.min(gc - 1, Math.floor(q.fx * gc));
        return { t: m.prefix + r * gc + c, r, c };
      }
      if (q.kind === "cls") return m.cls ? { t: 0 } : { why: "no CLS token" };
      if (q.kind === "reg") return q.k < regs ? { t: (m.cls ? 1 : 0) + q.k } : { why: `no register ${q.k}` };
      return { why: "pool" };
    }
    function prefixName(m, k) {
      return m.cls && k === 0 ? "CLS" : `register ${k - (m.cls ? 1 : 0)}`;
    }
    function paint(canvas, img, grid, values, cell) {
      const ctx = canvas.getContext("2d"), W = canvas.width, H = canvas.height, [gr, gc] = grid;
      ctx.imageSmoothingEnabled = false;
      ctx.clearRect(0, 0, W, H);
      if (img.complete && img.naturalWidth) ctx.drawImage(img, 0, 0, W, H);
      if (values) {
        let max = 0;
        for (const v of values) max = Math.max(max, v);
        const cw = W / gc, ch = H / gr;
        for (let r = 0; r < gr; r++) for (let c = 0; c < gc; c++) {
          const [R, G, B] = colour(max > 0 ? values[r * gc + c] / max : 0);
          ctx.fillStyle = `rgba(${R},${G},${B},0.62)`;
          ctx.fillRect(c * cw, r * ch, Math.ceil(cw), Math.ceil(ch));
        }
        ctx.strokeStyle = "rgba(255,255,255,0.15)";
        ctx.lineWidth = 1;
        for (let c = 1; c < gc; c++) { ctx.beginPath(); ctx.moveTo(c * cw, 0); ctx.lineTo(c * cw, H); ctx.stroke(); }
        for (let r = 1; r < gr; r++) { ctx.beginPath(); ctx.moveTo(0, r * ch); ctx.lineTo(W, r * ch); ctx.stroke(); }
        if (cell) { ctx.strokeStyle = "#ff2a2a"; ctx.lineWidth = 2; ctx.strokeRect(cell.c * cw + 1, cell.r * ch + 1, cw - 2, ch - 2); }
      }
    }
    function render() {
      const q = st.query;
      sliderLabel.textContent = `block ${st.block}`;
      status.textContent = q.kind === "patch" ? (st.pinned ? "pinned: click another patch to move it" : "hover a patch, click to pin it") : "";
      for (const n of names) {
        const P = st.panels[n], m = P.model, im = m.images[st.image];
        const canvas = P.main;
        for (const k of ["values", "token", "block", "head", "prefixValues"]) delete canvas.dataset[k];
        if (!im) { P.text.textContent = "this image was not kept for this model"; paint(canvas, P.img, m.grid, null); continue; }
        if (P.img._src !== im.png) { P.img._src = im.png; P.img.onload = () => render(); P.img.src = "data:image/png;base64," + im.png; }
        const li = Math.min(st.block, m.layers.length - 1), block = m.layers[li];
        const heads = im.heads, T = im.tokens;
        const head = st.head === "mean" ? "mean" : Math.min(st.head, heads - 1);
        const notes = [];
        if (li !== st.block) notes.push(`its last block is ${block}`);
        if (head !== st.head) notes.push(`it has ${heads} heads`);
        let values = null, tok = token(m, q), prefixVals = null, text;
        if (q.kind === "pool") {
          if (!im.pool) { text = "no attention pool: its head reads " + (m.cls ? "the CLS token" : "the patch mean"); }
          else {
            const [c, s, ph, pq] = im.pool, qq = quantised(`${n}/${st.image}/pool`, [c, s]);
            const full = row(qq, ph, pq, T, head === "mean" ? "mean" : Math.min(head, ph - 1), 0);
            values = Array.from(full.slice(m.prefix));
            text = `the pool's query over the last block's tokens${pq > 1 ? " (its first query)" : ""}`;
          }
        } else if (tok.why) {
          text = tok.why;
        } else {
          const qa = quantised(`${n}/${st.image}/a${block}`, im.attention[String(block)]);
          const full = row(qa, heads, T, T, head, tok.t);
          values = Array.from(full.slice(m.prefix));
          prefixVals = Array.from(full.slice(0, m.prefix));
          const type = head === "mean" ? "" : m.types[`${block},${head}`];
          text = `block ${block}, ${head === "mean" ? "mean of heads" : "head " + head}` + (type ? ` (${type})` : "") +
            ` · max ${fmt(Math.max(...values))}` + (m.prefix ? " · to " + prefixVals.map((v, k) => `${prefixName(m, k)} ${fmt(v)}`).join(", ") : "");
        }
        if (notes.length) text += ` (${notes.join("; ")})`;
        P.text.textContent = text;
        paint(canvas, P.img, m.grid, values, tok && tok.r != null ? tok : null);
        if (values) {
          canvas.dataset.values = JSON.stringify(values);
          canvas.dataset.token = String(q.kind === "pool" ? -1 : tok.t);
          canvas.dataset.block = String(block);
          canvas.dataset.head = String(head);
          if (prefixVals) canvas.dataset.prefixValues = JSON.stringify(prefixVals);
        }
        // the rollout row of the same query up to this block (head mean by its definition)
        let rv = null;
        if (!tok.why && im.rollout[String(block)]) {
          const qr = quantised(`${n}/${st.image}/r${block}`, im.rollout[String(block)]);
          rv = Array.from(row(qr, 1, T, T, 0, tok.t).slice(m.prefix));
        }
        paint(P.roll, P.img, m.grid, rv, tok && tok.r != null ? tok : null);
      }
    }
    VS.explorerRender = render;
    render();
  }

  function start() {
    for (const e of document.querySelectorAll(".vs-js")) e.classList.remove("vs-js");  // shown: scripts run
    buildBar();
    buildExplorer();
    for (const host of document.querySelectorAll(".vs-charts")) {
      for (const chart of DATA.charts[host.dataset.analysis] || []) {
        if (chart.grids) buildGrid(host, chart);
        else buildChart(host, chart);
      }
    }
    VS.ready = true;
    VS.readyMs = performance.now();
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
