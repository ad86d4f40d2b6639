// LR schedules: the curves lmforge's Schedule gives (from /api/schedules), warmup shaded, exact values.
"use strict";
(() => {
  const form = document.getElementById("controls");
  async function render(params) {
    const data = await lmf.get("/api/schedules", params);
    const traces = data.series.map((s) => ({ x: s.x, y: s.lr, name: s.label, mode: "lines", type: "scatter" }));
    const shapes = data.warmup_steps > 0 ? [{
      type: "rect", xref: "x", yref: "paper", x0: 0, x1: data.warmup_steps, y0: 0, y1: 1,
      fillcolor: "rgba(255, 180, 0, 0.15)", line: { width: 0 }, layer: "below",
    }] : [];
    const annotations = data.warmup_steps > 0 ? [{
      x: data.warmup_steps / 2, y: 1, xref: "x", yref: "paper", showarrow: false, yanchor: "bottom",
      text: `warmup (${data.warmup_steps} steps)`,
    }] : [];
    await lmf.plot("chart-lr", traces, {
      title: { text: "learning rate per step" }, xaxis: { title: { text: "optimizer step" }, range: [0, data.total - 1] },
      yaxis: { title: { text: "lr" }, rangemode: "tozero" }, shapes, annotations, height: 460,
    });
    const table = document.getElementById("probe-table");
    table.replaceChildren();
    const head = table.insertRow();
    head.innerHTML = "<th>schedule</th>" + data.probes.map((p) => `<th>step ${p}</th>`).join("");
    for (const s of data.series) {
      const row = table.insertRow();
      const name = document.createElement("td");
      name.textContent = s.label;
      row.appendChild(name);
      for (const p of data.probes) row.appendChild(lmf.cell(`lr.${s.key}.${p}`, s.probes[p], lmf.num(s.probes[p], 4)));
    }
    table.dataset.warmup = String(data.warmup_steps);
  }
  lmf.bind(form, render);
})();
