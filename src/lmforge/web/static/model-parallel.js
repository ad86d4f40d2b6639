// Layer-wise model parallelism: what /api/model-parallel computed. The animation moves the batch's
// activation forward GPU to GPU, then its gradient backward; only the highlighted GPU works.
"use strict";
(() => {
  const form = document.getElementById("controls");
  lmfPar.buttons("pause", "step", "mp-anim");

  function phases(n) {
    const out = [];
    for (let g = 0; g < n; g++) { out.push(`forward-gpu-${g}`); if (g < n - 1) out.push(`send-activation-${g}-${g + 1}`); }
    for (let g = n - 1; g >= 0; g--) { out.push(`backward-gpu-${g}`); if (g > 0) out.push(`send-gradient-${g}-${g - 1}`); }
    return out;
  }

  function draw(d, names, i) {
    const n = d.gpus, W = 1000, H = 260;
    const s = lmfPar.svg("mp-anim", W, H);
    const [kind, what, a, b] = names[i].split("-");  // forward-gpu-G, send-activation-G-H, send-gradient-G-H
    const gap = Math.min(40, 300 / n), bw = Math.min(190, (W - 40 - gap * (n - 1)) / n);
    const x0 = (W - (bw * n + gap * (n - 1))) / 2, by = 60, bh = 120;
    const gx = (g) => x0 + g * (bw + gap);
    const active = kind === "forward" || kind === "backward" ? Number(a) : -1;
    for (let g = 0; g < n; g++) {
      const [lo, hi] = d.stages[g];
      const busy = g === active;
      const fill = busy ? (kind === "forward" ? "#dbeafe" : "#fde7d3") : "#f4f6f8";
      lmfPar.el(s, "rect", { x: gx(g), y: by, width: bw, height: bh, rx: 6, fill, stroke: lmfPar.color(g),
        "stroke-width": busy ? 4 : 1.5, "data-busy": busy ? "1" : "0" });
      if (bw > 50) {
        lmfPar.el(s, "text", { x: gx(g) + 6, y: by + 16, class: "big" }, `GPU ${g}`);
        lmfPar.el(s, "text", { x: gx(g) + 6, y: by + 32 }, `layers ${lo}–${hi - 1}`);
        lmfPar.el(s, "text", { x: gx(g) + 6, y: by + bh - 8 }, busy ? kind : "idle");
      }
      const lw = (bw - 12) / Math.max(1, d.layers / n + 1);
      for (let l = lo; l < hi; l++) {
        lmfPar.el(s, "rect", { x: gx(g) + 6 + (l - lo) * lw, y: by + 44, width: Math.max(lw - 3, 1), height: 40,
          fill: lmfPar.color(g), opacity: busy ? 0.9 : 0.3 });
      }
    }
    // the batch's activation (or its gradient) as a moving token
    let tx;
    if (kind === "send") tx = (gx(Number(a)) + bw + gx(Number(b))) / 2;
    else tx = gx(Math.max(active, 0)) + bw / 2;
    const g0 = lmfPar.el(s, "g", { class: "mover", style: `transform: translate(${tx}px, ${by - 28}px)` });
    const carries = kind === "backward" || what === "gradient" ? "gradient" : "activation";
    lmfPar.el(g0, "circle", { r: 12, fill: carries === "gradient" ? "#ff7f0e" : "#1f77b4", "data-carries": carries });
    if (kind === "send") {
      const [src, dst] = [Number(b === undefined ? 0 : a), Number(b)];
      const y = by + bh / 2;
      const [x1, x2] = dst > src ? [gx(src) + bw + 2, gx(dst) - 2] : [gx(src) - 2, gx(dst) + bw + 2];
      lmfPar.arrow(s, x1, y, x2, y, { stroke: what === "gradient" ? "#ff7f0e" : "#1f77b4", "stroke-width": 3 });
      lmfPar.el(s, "text", { x: 40, y: H - 24, class: "big" },
        `${what} ${lmfPar.bytes(d.activation_bytes)} (batch × seq × d_model × bytes) GPU ${src} → GPU ${dst}`);
    } else {
      lmfPar.el(s, "text", { x: 40, y: H - 24, class: "big" },
        `GPU ${active} runs the ${kind} of layers ${d.stages[active][0]}–${d.stages[active][1] - 1}; ${n - 1} GPU(s) wait`);
    }
    document.getElementById("phase-text").textContent = `phase: ${names[i]}`;
  }

  async function render(params) {
    const d = await lmf.get("/api/model-parallel", params);
    const names = phases(d.gpus);
    lmfPar.animate(document.getElementById("mp-anim"), names, (i) => draw(d, names, i), 900);
    const traces = ["forward", "backward"].map((pass) => {
      const bars = d.timeline.filter((t) => t.pass === pass);
      return { type: "bar", orientation: "h", name: pass, base: bars.map((t) => t.start), x: bars.map((t) => t.duration),
        y: bars.map((t) => `GPU ${t.gpu}`), marker: { color: pass === "forward" ? "#1f77b4" : "#ff7f0e" } };
    });
    await lmf.plot("mp-timeline", traces, { title: { text: "one step: who works when" }, barmode: "overlay",
      xaxis: { title: { text: "time (one layer's forward = 1)" }, range: [0, d.step_time] }, yaxis: { autorange: "reversed" } });
    const rows = d.stages.map(([lo, hi], g) => [`GPU ${g} layers`, `stage_${g}_layers`, hi - lo, `${lo}–${hi - 1} (${hi - lo})`, "stage_layers"]);
    rows.push(
      ["activation per boundary, one way", "activation_bytes", d.activation_bytes, lmfPar.bytes(d.activation_bytes), "b × T × d × c"],
      ["per boundary, forward + backward", "boundary_bytes", d.boundary_bytes, lmfPar.bytes(d.boundary_bytes), "comm.pp_volume(n, bT, d, c) = 2 bTdc"],
      ["all boundaries", "total_bytes", d.total_bytes, lmfPar.bytes(d.total_bytes), `(n − 1) × pp_volume`],
      ["idle fraction (timeline mean)", "idle_mean", d.idle_mean, lmf.num(d.idle_mean, 4), "1 − busy / step, averaged over GPUs"],
      ["bubble, one micro-batch", "bubble", d.bubble, lmf.num(d.bubble, 4), "bubble_fraction(n, 1) = (n−1)/n"],
    );
    lmfPar.rows("mp-figures", rows);
  }

  lmf.bind(form, render);
})();
