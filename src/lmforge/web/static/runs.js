// The training dashboard: the runs table (polled), the selected runs' curves (read incrementally from
// /api/runs/metrics by byte offset; new points extend the traces), marks on the loss curve, config diff.
"use strict";
(() => {
  const form = document.getElementById("controls");
  const charts = JSON.parse(document.getElementById("charts-def").textContent);
  const pollMs = Number(document.body.dataset.pollMs) || 1000;
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                   "#bcbd22", "#17becf"];
  const DASHES = ["solid", "dot", "dash", "longdash", "dashdot", "longdashdot"];
  const MARK_DASH = { event: "solid", phase: "dash", warmup: "dot" };
  // a series with fewer points gets a marker at each (one point draws no line): lmforge plot's FEW_POINTS
  const FEW_POINTS = Number(document.getElementById("charts-def").dataset.fewPoints);
  const MAX_LABELS = 24;  // text labels on the loss chart; every mark keeps its line and its table row
  const state = {};   // run -> {offset, file, phase, lines: {chart: {key: {label, x, y}}}, marks: []}
  const rows = {};    // run -> its <tr> in the runs table
  const drawn = {};   // chart -> ["run\tkey", ...]: the trace order of its last full draw
  const listed = [];  // runs in the order they were first listed (fixes each run's colour)
  let listedOnce = false;

  // one request chain: a poll and a change of the selection never read the same offset twice
  let chain = Promise.resolve();
  const serial = (fn) => { const p = chain.then(fn, fn); chain = p.catch(() => {}); return p; };

  const selected = () => [...form.querySelectorAll("input[name=sel]:checked")].map((e) => e.value);
  const colour = (run) => PALETTE[listed.indexOf(run) % PALETTE.length];
  const fmt = (v, d) => (v === null || v === undefined ? "–" : lmf.num(v, d));
  const val = (v) => (v === null || v === undefined ? "" : v);

  function setCells(tr, r) {
    const cells = [
      lmf.cell(`status:${r.run}`, r.status, r.status),
      lmf.cell(`steps:${r.run}`, val(r.steps), fmt(r.steps, 0)),
      lmf.cell(`last_loss:${r.run}`, val(r.last_loss), fmt(r.last_loss, 4)),
      lmf.cell(`best_val_loss:${r.run}`, val(r.best_val_loss), fmt(r.best_val_loss, 4)),
      lmf.cell(`best_val_step:${r.run}`, val(r.best_val_step), fmt(r.best_val_step, 0)),
    ];
    cells[0].className = `runs-status runs-${r.status}`;
    while (tr.cells.length > 2) tr.deleteCell(2);
    cells.forEach((c) => tr.appendChild(c));
  }

  async function refreshList() {
    const body = await lmf.get("/api/runs");
    const tbody = document.querySelector("#runs-table tbody");
    for (const r of body.runs) {
      let tr = rows[r.run];
      if (!tr) {
        listed.push(r.run);
        tr = rows[r.run] = document.createElement("tr");
        tr.dataset.run = r.run;
        const box = document.createElement("input");
        Object.assign(box, { type: "checkbox", name: "sel", value: r.run });
        box.setAttribute("aria-label", `show ${r.run}`);
        const tick = document.createElement("td");
        tick.appendChild(box);
        const name = document.createElement("td");
        const swatch = document.createElement("span");
        swatch.className = "runs-swatch";
        swatch.style.background = colour(r.run);
        name.append(swatch, r.run);
        tr.append(tick, name);
        tbody.appendChild(tr);
        if (listedOnce && r.status === "running") {  // a run started while the page is open: follow it
          box.checked = true;
          box.dispatchEvent(new Event("change", { bubbles: true }));
        }
      }
      setCells(tr, r);
    }
    listedOnce = true;
    return body.runs;
  }

  function defaultSelection(runs) {
    const running = runs.filter((r) => r.status === "running");
    const pick = running.length ? running : runs.slice().sort((a, b) => b.written_at - a.written_at).slice(0, 1);
    for (const r of pick) rows[r.run].querySelector("input").checked = true;
  }

  // Read what is new of one run; returns what changed: {full: traces appeared / restarted, marks, added}
  async function fetchRun(run) {
    const change = { full: false, marks: false, added: {} };
    for (;;) {
      const s = state[run];
      const a = await lmf.get("/api/runs/metrics", {
        run, offset: s ? s.offset : 0, file: s ? s.file : "", phase: s ? s.phase : -1 });
      let t = s;
      if (a.start || !t) {
        t = state[run] = { offset: 0, file: "", phase: -1, lines: {}, marks: [] };
        change.full = true;
      }
      Object.assign(t, { offset: a.offset, file: a.file, phase: a.phase });
      for (const [chart, lines] of Object.entries(a.series)) {
        t.lines[chart] = t.lines[chart] || {};
        for (const ln of lines) {
          let line = t.lines[chart][ln.key];
          if (!line) { line = t.lines[chart][ln.key] = { label: ln.label, x: [], y: [] }; change.full = true; }
          line.x.push(...ln.x);
          line.y.push(...ln.y);
          const add = ((change.added[chart] = change.added[chart] || {})[ln.key] =
            change.added[chart][ln.key] || { x: [], y: [] });
          add.x.push(...ln.x);
          add.y.push(...ln.y);
        }
      }
      if (a.marks.length) { t.marks.push(...a.marks); change.marks = true; }
      if (!a.more) return change;
    }
  }

  function traces(chart, runs) {
    const out = [];
    const order = [];
    const several = runs.length > 1;
    for (const run of runs) {
      const lines = (state[run] && state[run].lines[chart]) || {};
      Object.entries(lines).forEach(([key, line], i) => {
        const isEval = key.startsWith("eval:");
        out.push({
          x: line.x.slice(), y: line.y.slice(), type: "scatter",
          mode: isEval || line.x.length < FEW_POINTS ? "lines+markers" : "lines",
          name: several ? `${run}: ${line.label}` : line.label,
          line: { color: several || Object.keys(lines).length === 1 ? colour(run) : PALETTE[i % PALETTE.length],
                  dash: several ? DASHES[i % DASHES.length] : "solid", width: 1.5 },
          marker: { size: 5 },
        });
        order.push(`${run}\t${key}`);
      });
    }
    return [out, order];
  }

  function markLayout(runs) {
    const shapes = [];
    const annotations = [];
    const points = [];
    for (const run of runs) {
      const seen = new Set();
      for (const m of (state[run] && state[run].marks) || []) {
        shapes.push({ type: "line", xref: "x", yref: "paper", x0: m.step, x1: m.step, y0: 0, y1: 1,
                      line: { color: colour(run), width: 1, dash: MARK_DASH[m.kind] || "solid" }, opacity: 0.5 });
        const id = `${m.step}\t${m.label}`;
        if (!seen.has(id) && annotations.length < MAX_LABELS) {
          seen.add(id);
          annotations.push({ x: m.step, xref: "x", y: 1, yref: "paper", yanchor: "top", text: m.label,
                             showarrow: false, textangle: -90, xanchor: "right",
                             font: { size: 10, color: colour(run) } });
        }
        if (m.loss !== null && m.loss !== undefined) points.push({ run, m });
      }
    }
    const marker = points.length ? [{
      x: points.map((p) => p.m.step), y: points.map((p) => p.m.loss), type: "scatter", mode: "markers",
      name: "guard events", text: points.map((p) => `${p.run}: ${p.m.label}`),
      marker: { symbol: "x-open", size: 9, color: points.map((p) => colour(p.run)) },
    }] : [];
    return { shapes, annotations, marker };
  }

  function drawChart(c, runs) {
    const [data, order] = traces(c.name, runs);
    const layout = { title: { text: c.title, font: { size: 14 } }, xaxis: { title: { text: "step" } },
                     yaxis: { title: { text: c.ylabel }, type: c.log ? "log" : "linear" } };
    if (c.name === "loss") {
      const m = markLayout(runs);
      Object.assign(layout, { shapes: m.shapes, annotations: m.annotations });
      data.push(...m.marker);
      order.push(...m.marker.map(() => "\tmarks"));
    }
    drawn[c.name] = order;
    lmf.plot(`chart-${c.name}`, data, layout);
  }

  function drawMarks(runs) {
    const tbody = document.querySelector("#marks tbody");
    tbody.replaceChildren();
    for (const run of runs) {
      for (const m of (state[run] && state[run].marks) || []) {
        const tr = document.createElement("tr");
        Object.assign(tr.dataset, { run, step: m.step, kind: m.kind, label: m.label });
        for (const text of [run, String(m.step), m.kind, m.label, m.text || ""]) {
          const td = document.createElement("td");
          td.textContent = text;
          tr.appendChild(td);
        }
        tbody.appendChild(tr);
      }
    }
  }

  async function drawDiff(runs) {
    const thead = document.querySelector("#diff thead");
    const tbody = document.querySelector("#diff tbody");
    const note = document.getElementById("diff-note");
    thead.replaceChildren();
    tbody.replaceChildren();
    if (runs.length < 2) { note.textContent = "Tick two or more runs."; return; }
    const body = await lmf.get("/api/runs/diff", runs.map((r) => ["run", r]));
    const keys = Object.keys(body.differences);
    note.textContent = keys.length ? `${keys.length} config keys differ (lmforge compare's differences).`
      : "The selected runs' configs are the same.";
    const head = document.createElement("tr");
    for (const text of ["key", ...runs]) { const th = document.createElement("th"); th.textContent = text; head.appendChild(th); }
    thead.appendChild(head);
    for (const key of keys) {
      const tr = document.createElement("tr");
      tr.dataset.key = key;
      const td = document.createElement("td");
      td.textContent = key;
      tr.appendChild(td);
      body.differences[key].forEach((v, i) => {
        const text = JSON.stringify(v);
        tr.appendChild(lmf.cell(`diff:${key}:${runs[i]}`, text, text));
      });
      tbody.appendChild(tr);
    }
  }

  // a change of the selection: read the newly ticked runs, redraw everything
  async function render() {
    await serial(async () => {
      const runs = selected();
      for (const run of runs) if (!state[run]) await fetchRun(run);
      charts.forEach((c) => drawChart(c, runs));
      drawMarks(runs);
      await drawDiff(runs);
    });
  }

  // a poll: the runs table, then what is new of each ticked run; extend traces where only points came
  async function tick() {
    await serial(async () => {
      await refreshList();
      const runs = selected();
      const changes = [];
      for (const run of runs) changes.push(await fetchRun(run));
      const marks = changes.some((c) => c.marks);
      for (const c of charts) {
        const order = drawn[c.name] || [];
        const idx = [];
        const xs = [];
        const ys = [];
        const plain = [];  // traces that reach FEW_POINTS with these points: their markers go
        let full = changes.some((ch) => ch.full) || (c.name === "loss" && marks);
        runs.forEach((run, r) => {
          for (const [key, add] of Object.entries(changes[r].added[c.name] || {})) {
            if (!add.x.length) continue;
            const i = order.indexOf(`${run}\t${key}`);
            if (i < 0) { full = true; continue; }
            const n = state[run].lines[c.name][key].x.length;  // points now, the new ones counted
            if (!key.startsWith("eval:") && n >= FEW_POINTS && n - add.x.length < FEW_POINTS) plain.push(i);
            idx.push(i); xs.push(add.x); ys.push(add.y);
          }
        });
        if (full) drawChart(c, runs);
        else if (idx.length) {
          Plotly.extendTraces(`chart-${c.name}`, { x: xs, y: ys }, idx);
          if (plain.length) Plotly.restyle(`chart-${c.name}`, { mode: "lines" }, plain);
          document.body.dataset.extended = String(Number(document.body.dataset.extended || 0) + 1);
        }
      }
      if (marks) drawMarks(runs);
    });
    document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
  }

  async function poll() {
    try { await tick(); } catch (e) { console.warn(e.message); }
    setTimeout(poll, pollMs);
  }

  (async () => {
    try { defaultSelection(await refreshList()); } catch (e) { console.warn(e.message); }
    lmf.bind(form, render);
    setTimeout(poll, pollMs);
  })();
})();
