// Gradient checkpointing planner: draws what /api/checkpointing returns; computes nothing.
"use strict";
(() => {
  const GIB = 2 ** 30;
  const MB = 1e6;
  const { text, table } = lmf;

  function drawPlanner(rows) {
    const names = rows.map((r) => r.policy);
    lmf.plot("checkpointing-memory", [
      { type: "bar", name: "saved by the forward", x: names, y: rows.map((r) => r.saved / GIB), marker: { color: "#54a24b" } },
      { type: "bar", name: "one block recomputed or autocast's weight cache (the larger)", x: names, y: rows.map((r) => r.transient / GIB), marker: { color: "#eeca3b" } },
    ], { barmode: "stack", title: { text: "activation memory per device (GiB)" }, yaxis: { title: "GiB" } });
    lmf.plot("checkpointing-compute", [
      { type: "bar", name: "compute factor", x: names, y: rows.map((r) => r.recompute), marker: { color: "#4c78a8" } },
      { type: "scatter", mode: "lines+markers", name: "step time / none", x: names, y: rows.map((r) => r.step_ratio), line: { color: "#e45756" } },
    ], { title: { text: "compute relative to no checkpointing" }, yaxis: { title: "x none", rangemode: "tozero" } });
    table(document.getElementById("checkpointing-table"),
      ["policy", "saved GiB", "recompute GiB", "autocast cache GiB", "activations GiB", "x none", "device total GiB",
       "compute factor", "step s", "step x none"],
      rows.map((r) => [
        text("td", r.policy),
        lmf.cell(`${r.policy}.saved`, r.saved, lmf.gib(r.saved)),
        lmf.cell(`${r.policy}.recompute_peak`, r.recompute_peak, lmf.gib(r.recompute_peak)),
        lmf.cell(`${r.policy}.forward_casts`, r.forward_casts, lmf.gib(r.forward_casts)),
        lmf.cell(`${r.policy}.activations`, r.activations, lmf.gib(r.activations)),
        lmf.cell(`${r.policy}.activations_ratio`, r.activations_ratio, r.activations_ratio.toFixed(3)),
        lmf.cell(`${r.policy}.total`, r.total, lmf.gib(r.total)),
        lmf.cell(`${r.policy}.recompute`, r.recompute, r.recompute.toFixed(4)),
        lmf.cell(`${r.policy}.step_s`, r.step_s, lmf.num(r.step_s, 4)),
        lmf.cell(`${r.policy}.step_ratio`, r.step_ratio, r.step_ratio.toFixed(4)),
      ]));
    document.getElementById("checkpointing-command").textContent = rows[rows.length - 2].command;
  }

  function drawMeasured(files, command) {
    const box = document.getElementById("checkpointing-measured");
    box.replaceChildren();
    if (!files.length) {
      box.append(text("p", "No activation_checkpointing*.json under the runs folder (two levels deep). " +
        "Produce one with: " + command));
      return;
    }
    files.forEach((f, i) => {
      box.append(text("h3", f.file));
      if (f.error) { box.append(text("p", f.error)); return; }
      const s = f.shape;
      box.append(text("p", `llama ${s.layers} x ${s.d_model}, ${s.heads} heads, vocab ${s.vocab}, batch ` +
        `${s.batch} x ${s.seq}, FP32 on CPU, ${f.threads} threads; time: median of ${f.rounds} rounds x ` +
        `${f.steps} steps. Formula: activation_bytes (no document mask), recompute_factor.`));
      const t = document.createElement("table");
      t.className = "figures checkpointing-measured";
      table(t, ["policy", "saved MB measured", "formula", "saved x none", "matmul FLOPs x none",
                "formula compute", "time x none", "CPU time x none"],
        f.rows.map((r) => [
          text("td", r.policy),
          lmf.cell(`measured.${i}.${r.policy}.saved_bytes`, r.saved_bytes, (r.saved_bytes / MB).toFixed(3)),
          lmf.cell(`formula.${i}.${r.policy}.saved_bytes`, r.formula_saved_bytes, (r.formula_saved_bytes / MB).toFixed(3)),
          lmf.cell(`measured.${i}.${r.policy}.saved_ratio`, r.saved_ratio, r.saved_ratio.toFixed(3)),
          lmf.cell(`measured.${i}.${r.policy}.flops_ratio`, r.flops_ratio, r.flops_ratio.toFixed(3)),
          lmf.cell(`formula.${i}.${r.policy}.compute_ratio`, r.formula_compute_ratio, r.formula_compute_ratio.toFixed(3)),
          lmf.cell(`measured.${i}.${r.policy}.time_ratio`, r.time_ratio, r.time_ratio.toFixed(3)),
          lmf.cell(`measured.${i}.${r.policy}.cpu_ratio`, r.cpu_ratio, r.cpu_ratio.toFixed(3)),
        ]));
      box.append(t);
    });
  }

  lmf.bind(document.getElementById("controls"), async (params) => {
    const d = await lmf.get("/api/checkpointing", params);
    drawPlanner(d.policies);
    const acc = document.getElementById("checkpointing-accuracy");
    acc.dataset.measured = d.accuracy.measured ? "1" : "0";
    acc.textContent = `Device total, the planner's measured accuracy: ${d.accuracy.peak_text}` +
      (d.accuracy.measured ? " (docs/memory-accuracy.md)." : ".");
    drawMeasured(d.measured, d.benchmark_command);
  });
})();
