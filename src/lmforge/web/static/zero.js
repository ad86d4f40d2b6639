// ZeRO stages planner: draws what /api/zero returns; computes nothing.
"use strict";
(() => {
  const GIB = 2 ** 30;
  const NAMES = { ddp: "DDP", zero1: "ZeRO-1", zero2: "ZeRO-2", zero3: "ZeRO-3" };
  const PARTS = [["params", "parameters", "#4c78a8"], ["grads", "gradients", "#f58518"],
                 ["master", "master weights", "#e45756"], ["optim", "optimizer states", "#72b7b2"]];
  const { text, table } = lmf;

  function draw(d) {
    const kinds = d.formula.map((r) => r.kind);
    const traces = [];
    for (const [key, label, color] of PARTS) {
      traces.push({ type: "bar", name: label, legendgroup: key, marker: { color },
                    x: [kinds.map((k) => NAMES[k]), kinds.map(() => "formula")],
                    y: d.formula.map((r) => r[key] / GIB) });
      traces.push({ type: "bar", name: label, legendgroup: key, showlegend: false, marker: { color, opacity: 0.7 },
                    x: [kinds.map((k) => NAMES[k]), kinds.map(() => "planner")],
                    y: d.planner.map((r) => r[key] / GIB) });
    }
    traces.push({ type: "scatter", mode: "markers", name: "planner total (with activations, overhead)",
                  x: [kinds.map((k) => NAMES[k]), kinds.map(() => "planner")],
                  y: d.planner.map((r) => r.total / GIB), marker: { color: "#1d2430", symbol: "diamond", size: 10 } });
    lmf.plot("zero-memory", traces, { barmode: "stack", title: { text: `model states per device (GiB), N = ${d.gpus}` },
      yaxis: { title: "GiB" },
      shapes: [{ type: "line", xref: "paper", yref: "y", x0: 0, x1: 1, y0: d.planner[0].limit / GIB,
                 y1: d.planner[0].limit / GIB, line: { color: "#a11", dash: "dash" } }] });
    lmf.plot("zero-comm", [
      { type: "bar", name: "seed table (16-bit values)", x: kinds.map((k) => NAMES[k]), y: d.formula.map((r) => r.comm_bytes / GIB) },
      { type: "bar", name: "ring, (N-1)/N (zero-paper)", x: kinds.map((k) => NAMES[k]), y: d.formula.map((r) => r.comm_ring_bytes / GIB) },
      { type: "bar", name: "planner (lmforge dtypes)", x: kinds.map((k) => NAMES[k]), y: d.planner.map((r) => r.comm_dp / GIB) },
    ], { barmode: "group", title: { text: "data-parallel bytes sent per device and step (GiB)" }, yaxis: { title: "GiB" } });

    table(document.getElementById("zero-formula"),
      ["layout", "parameters", "gradients", "master", "optimizer", "total GiB", "comm (Ψ)", "comm GiB", "ring GiB"],
      d.formula.map((r) => [
        text("td", NAMES[r.kind]),
        ...PARTS.map(([key]) => lmf.cell(`formula.${r.kind}.${key}`, r[key], lmf.gib(r[key]))),
        lmf.cell(`formula.${r.kind}.total`, r.total, lmf.gib(r.total)),
        lmf.cell(`formula.${r.kind}.comm_psi`, r.comm_psi, `${r.comm_psi}Ψ`),
        lmf.cell(`formula.${r.kind}.comm_bytes`, r.comm_bytes, lmf.gib(r.comm_bytes)),
        lmf.cell(`formula.${r.kind}.comm_ring_bytes`, r.comm_ring_bytes, lmf.gib(r.comm_ring_bytes)),
      ]));
    table(document.getElementById("zero-planner"),
      ["layout", "parameters", "gradients", "master", "optimizer", "states GiB", "device total GiB", "fits",
       "comm GiB", "step s"],
      d.planner.map((r) => [
        text("td", `${NAMES[r.kind]} (${r.layout})`),
        ...PARTS.map(([key]) => lmf.cell(`planner.${r.kind}.${key}`, r[key], lmf.gib(r[key]))),
        lmf.cell(`planner.${r.kind}.states_total`, r.states_total, lmf.gib(r.states_total)),
        lmf.cell(`planner.${r.kind}.total`, r.total, lmf.gib(r.total)),
        lmf.cell(`planner.${r.kind}.fits`, r.fits ? 1 : 0, r.fits ? "yes" : "no"),
        lmf.cell(`planner.${r.kind}.comm_dp`, r.comm_dp, lmf.gib(r.comm_dp)),
        lmf.cell(`planner.${r.kind}.step_s`, r.step_s, lmf.num(r.step_s, 4)),
      ]));
    const s = document.getElementById("zero-summary");
    s.dataset.key = "psi";
    s.dataset.value = String(d.psi);
    s.textContent = `Ψ = ${d.psi.toLocaleString("en-US")} parameters, N = ${d.gpus}, K = ${d.paper_k} bytes per ` +
      `parameter beside the 16-bit parameters and gradients (${d.accounting} accounting; ${d.k} of optimizer ` +
      `states). Limit (dashed): ${lmf.gib(d.planner[0].limit)} GiB.`;
    document.getElementById("zero-command").textContent = d.planner[3].command;
    const acc = document.getElementById("zero-accuracy");
    acc.dataset.measured = d.accuracy.measured ? "1" : "0";
    acc.textContent = `Device total, the planner's measured accuracy: ${d.accuracy.peak_text}` +
      (d.accuracy.measured ? " (docs/memory-accuracy.md)." : ".");
  }

  lmf.bind(document.getElementById("controls"), async (params) => draw(await lmf.get("/api/zero", params)));
})();
