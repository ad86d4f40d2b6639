// Pipeline planner: draws the grid /api/pipeline returns (torch's action order placed in time units).
"use strict";
(() => {
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                   "#bcbd22", "#17becf"];
  const OPACITY = { F: 1.0, B: 0.6, I: 0.75, W: 0.4 };
  const chart = document.getElementById("pipeline-chart");
  const now = document.getElementById("pipeline-now");
  let state = null;  // {data, cursor shape index, t}

  function draw(d) {
    const shapes = [];
    const xs = [], ys = [], texts = [], hovers = [];
    d.cells.forEach((row, rank) => {
      shapes.push({ type: "rect", x0: 0, x1: d.makespan, y0: rank - 0.45, y1: rank + 0.45,
                    line: { width: 0 }, fillcolor: "#f3f3f3", layer: "below" });
      for (const c of row) {
        shapes.push({ type: "rect", x0: c.start, x1: c.start + c.width, y0: rank - 0.4, y1: rank + 0.4,
                      fillcolor: PALETTE[c.mb % PALETTE.length], opacity: OPACITY[c.kind] ?? 1,
                      line: { color: "#333", width: 1 }, layer: "below" });
        xs.push(c.start + c.width / 2); ys.push(rank);
        texts.push(d.stages_per_rank > 1 ? c.label : `${c.kind}${c.mb}`);
        hovers.push(`rank ${rank}, stage ${c.stage}: ${c.kind} of micro-batch ${c.mb}` +
                    `<br>time ${c.start}..${c.start + c.width} (torch action ${c.label})`);
      }
    });
    shapes.push({ type: "line", x0: 0, x1: 0, y0: -0.6, y1: d.pp - 0.4, line: { color: "#000", width: 2 } });
    const trace = { type: "scatter", mode: "text", x: xs, y: ys, text: texts, hovertext: hovers,
                    hoverinfo: "text", textfont: { color: "#000", size: d.makespan > 80 ? 8 : 11 },
                    showlegend: false };
    lmf.plot(chart, [trace], {
      title: { text: `${d.torch_class}: p = ${d.pp}, m = ${d.microbatches}, v = ${d.stages_per_rank}` },
      shapes,
      xaxis: { title: { text: "time (units: forward 1, backward 2; W and I 1 each)" }, range: [-0.5, d.makespan + 0.5], zeroline: false },
      yaxis: { title: { text: "pipeline rank" }, autorange: "reversed", tickvals: [...Array(d.pp).keys()],
               ticktext: [...Array(d.pp).keys()].map((r) => `rank ${r}`), zeroline: false },
      height: 140 + 42 * d.pp,
    });
    chart.dataset.grid = JSON.stringify(d.ops);
    state = { d, cursor: shapes.length - 1, t: 0 };
  }

  function table(d) {
    const rows = [
      ["torch_class", d.torch_class, d.torch_class, "torch.distributed.pipelining class"],
      ["source", d.source, d.source, "where the order comes from"],
      ["n_stages", d.n_stages, d.n_stages, "stages = p x v"],
      ["makespan", d.makespan, d.makespan, "time units of one step (end of the last action)"],
      ["busy_units", d.busy_units, d.busy_units, "units any rank computes (F 1, B 2, I 1, W 1)"],
      ["idle_units", d.idle_units, d.idle_units, "p x makespan - busy: the empty cells"],
      ["bubble_measured", d.bubble_measured, lmf.num(d.bubble_measured, 4), "idle / (p x makespan), on this grid"],
      ["bubble_formula", d.bubble_formula, lmf.num(d.bubble_formula, 4),
       "(p-1)/(v m+p-1): lmforge.parallel.pipeline.bubble_fraction"],
    ];
    const body = document.querySelector("#pipeline-figures tbody");
    body.replaceChildren(...rows.map(([key, value, text, what]) => {
      const tr = document.createElement("tr");
      const name = document.createElement("td"); name.textContent = key;
      const note = document.createElement("td"); note.textContent = what;
      tr.append(name, lmf.cell(key, value, text), note);
      return tr;
    }));
  }

  function tick() {
    if (!state || !document.getElementById("pipeline-animate").checked) return;
    const { d } = state;
    state.t = (state.t + 1) % (d.makespan + 1);
    const t = state.t;
    const busy = d.cells.filter((row) => row.some((c) => c.start <= t && t < c.start + c.width)).length;
    now.textContent = `t = ${t}: ${busy} of ${d.pp} ranks busy`;
    Plotly.relayout(chart, { [`shapes[${state.cursor}].x0`]: t, [`shapes[${state.cursor}].x1`]: t });
  }

  lmf.bind(document.getElementById("controls"), async (params) => {
    const d = await lmf.get("/api/pipeline", params);
    draw(d);
    table(d);
  });
  setInterval(tick, 300);
})();
