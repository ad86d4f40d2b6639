// Optimizer comparison: trajectories on the landscape, loss per step, final points, state bytes.
"use strict";
(() => {
  const form = document.getElementById("controls");
  const perFunction = JSON.parse(document.getElementById("per-function").textContent);
  // A new function brings its own start and learning rates (before the debounced render reads them).
  document.getElementById("function").addEventListener("change", (e) => {
    const d = perFunction[e.target.value];
    form.elements.x0.value = d.start[0];
    form.elements.y0.value = d.start[1];
    for (const [key, lr] of Object.entries(d.lr)) form.elements[`lr_${key}`].value = lr;
  });
  // One colour per optimizer, the same in both charts, fixed by its place among the checkboxes (what is
  // unticked keeps no colour of another's).
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
  const keys = [...form.querySelectorAll("fieldset input[type=checkbox]")].map((e) => e.name);
  const colour = (key) => PALETTE[Math.max(keys.indexOf(key), 0) % PALETTE.length];
  const fmt = (v) => (v === null || v === undefined ? "–" : lmf.num(v, 4));
  async function render(params) {
    const data = await lmf.get("/api/optimizers", params);
    const land = data.landscape;
    const traces = [{
      type: "contour", x: land.x, y: land.y, z: land.z_log, colorscale: "Greys", reversescale: true,
      showscale: false, ncontours: 30, contours: { coloring: "heatmap" }, opacity: 0.55, name: "log10(1 + f - f*)",
      hoverinfo: "skip",
    }, {
      type: "scatter", mode: "markers", x: data.minima.map((m) => m[0]), y: data.minima.map((m) => m[1]),
      marker: { symbol: "star", size: 14, color: "gold", line: { color: "black", width: 1 } }, name: "minimum",
    }];
    for (const r of data.runs) {
      traces.push({ type: "scatter", mode: "lines+markers", x: r.x, y: r.y, name: r.label,
                    line: { color: colour(r.key) }, marker: { size: 3, color: colour(r.key) } });
    }
    await lmf.plot("chart-path", traces, {
      title: { text: `${data.function}: ${data.steps} steps from (${data.start.join(", ")})` },
      xaxis: { title: { text: "x" }, range: [land.x[0], land.x[land.x.length - 1]] },
      yaxis: { title: { text: "y" }, range: [land.y[0], land.y[land.y.length - 1]] }, height: 520,
    });
    await lmf.plot("chart-loss", data.runs.map((r) => ({
      type: "scatter", mode: "lines", x: r.loss.map((_, i) => i), y: r.loss.map((v) => v - data.f_min), name: r.label,
      line: { color: colour(r.key) },
    })), { title: { text: "f(x, y) - f* per step" }, xaxis: { title: { text: "step" } }, yaxis: { title: { text: "f - f*" }, type: "log" }, height: 520 });
    const fin = document.getElementById("final-table");
    fin.replaceChildren();
    fin.insertRow().innerHTML = "<th>optimizer</th><th>lr</th><th>final x</th><th>final y</th><th>final f</th><th>diverged at step</th>";
    for (const r of data.runs) {
      const row = fin.insertRow();
      row.insertCell().textContent = r.label;
      row.appendChild(lmf.cell(`lr.${r.key}`, r.lr, fmt(r.lr)));
      row.appendChild(lmf.cell(`final_x.${r.key}`, r.final_x, fmt(r.final_x)));
      row.appendChild(lmf.cell(`final_y.${r.key}`, r.final_y, fmt(r.final_y)));
      row.appendChild(lmf.cell(`final_loss.${r.key}`, r.final_loss, fmt(r.final_loss)));
      row.insertCell().textContent = r.diverged_at === null ? "–" : String(r.diverged_at);
    }
    const mem = document.getElementById("memory-table");
    mem.replaceChildren();
    mem.insertRow().innerHTML = "<th>optimizer</th><th>K (planner)</th><th>4096×4096 matrix</th><th>this run</th>";
    for (const r of data.runs) {
      const row = mem.insertRow();
      row.insertCell().textContent = r.label;
      row.appendChild(lmf.cell(`mem_k.${r.key}`, r.memory.k, fmt(r.memory.k)));
      row.appendChild(lmf.cell(`mem_matrix.${r.key}`, r.memory.matrix, fmt(r.memory.matrix)));
      row.appendChild(lmf.cell(`mem_run.${r.key}`, r.memory.measured, fmt(r.memory.measured)));
    }
  }
  lmf.bind(form, render);
})();
