// Data parallelism: what /api/data-parallel computed, drawn and animated (split, forward, backward, each
// ring step of the all-reduce, update). The chunk squares under each GPU show how many GPUs' gradients
// the chunk holds (faint: its own only; solid: all of them).
"use strict";
(() => {
  const form = document.getElementById("controls");
  lmfPar.buttons("pause", "step", "dp-anim");

  function phases(d) {
    const out = ["split", "forward", "backward"];
    for (const s of d.ring_steps) out.push(`${s.phase}-${s.step + 1}`);
    out.push("update");
    return out;
  }

  // counts[g][c]: how many GPUs' gradients chunk c on GPU g holds after the first `upto` ring steps.
  function chunkCounts(d, upto) {
    const n = d.gpus;
    let counts = Array.from({ length: n }, () => Array(n).fill(1));
    for (const step of d.ring_steps.slice(0, upto)) {
      const before = counts.map((r) => r.slice());
      for (const { src, dst, chunk } of step.sends) {
        counts[dst][chunk] = step.phase === "reduce-scatter" ? before[dst][chunk] + before[src][chunk]
          : before[src][chunk];
      }
    }
    return counts;
  }

  function draw(d, names, i) {
    const n = d.gpus, W = 1000, H = 330;
    const s = lmfPar.svg("dp-anim", W, H);
    const phase = names[i];
    const ringIndex = i - 3; // index into ring_steps during the all-reduce
    const gap = Math.min(44, 300 / n), bw = Math.min(200, (W - 40 - gap * (n - 1)) / n);
    const x0 = (W - (bw * n + gap * (n - 1))) / 2;
    const gx = (g) => x0 + g * (bw + gap);
    const by = 120, bh = 120;
    // the global batch, one cell per sample (coloured by the GPU it goes to)
    const cells = Math.min(d.batch, 256), cw = (W - 80) / cells;
    lmfPar.el(s, "text", { x: 40, y: 18, class: "big" }, `global batch: ${d.batch} samples → ${d.micro_batch} per GPU`);
    for (let c = 0; c < cells; c++) {
      const g = Math.floor((c * d.batch / cells) / d.micro_batch);
      lmfPar.el(s, "rect", { x: 40 + c * cw, y: 26, width: Math.max(cw - 1, 0.5), height: 22,
        fill: lmfPar.color(g), opacity: phase === "split" ? 1 : 0.35 });
    }
    for (let g = 0; g < n; g++) {
      const x = gx(g);
      if (phase === "split") {
        lmfPar.arrow(s, 40 + (g + 0.5) * (W - 80) / n, 50, x + bw / 2, by - 4, { stroke: lmfPar.color(g) });
      }
      const fill = phase === "forward" ? "#dbeafe" : phase === "backward" ? "#fde7d3" : "#f4f6f8";
      lmfPar.el(s, "rect", { x, y: by, width: bw, height: bh, rx: 6, fill, stroke: lmfPar.color(g), "stroke-width": 2 });
      if (bw > 60) {
        lmfPar.el(s, "text", { x: x + 6, y: by + 16, class: "big" }, `GPU ${g}`);
        lmfPar.el(s, "text", { x: x + 6, y: by + 34 }, `replica ${lmf.num(d.params / 1e6, 1)}M`);
        lmfPar.el(s, "text", { x: x + 6, y: by + 50 }, `${d.micro_batch} samples`);
        const what = { forward: "forward →", backward: "← backward", update: "optimizer step" }[phase];
        if (what) lmfPar.el(s, "text", { x: x + 6, y: by + 68 }, what);
      }
      // gradient chunks
      if (i >= 2) {
        const counts = chunkCounts(d, Math.max(0, Math.min(ringIndex + 1, d.ring_steps.length)));
        const cwid = (bw - 12) / n;
        for (let c = 0; c < n; c++) {
          lmfPar.el(s, "rect", { x: x + 6 + c * cwid, y: by + bh - 30, width: Math.max(cwid - 2, 1), height: 22,
            fill: lmfPar.color(c), opacity: 0.15 + 0.85 * (counts[g][c] / n), "data-count": counts[g][c] });
        }
      }
    }
    // the ring sends of this step
    if (ringIndex >= 0 && ringIndex < d.ring_steps.length) {
      const step = d.ring_steps[ringIndex];
      for (const { src, dst, chunk } of step.sends) {
        if (dst === src + 1) {
          lmfPar.arrow(s, gx(src) + bw + 1, by + bh - 19, gx(dst) - 1, by + bh - 19,
            { stroke: lmfPar.color(chunk), "stroke-width": 3 });
          if (gap > 24) lmfPar.el(s, "text", { x: gx(src) + bw + 4, y: by + bh - 26 }, `c${chunk}`);
        } else {
          const y = by + bh + 40;
          lmfPar.el(s, "path", { d: `M${gx(src) + bw / 2},${by + bh} L${gx(src) + bw / 2},${y} L${gx(dst) + bw / 2},${y} L${gx(dst) + bw / 2},${by + bh + 4}`,
            fill: "none", stroke: lmfPar.color(chunk), "stroke-width": 3, "marker-end": "url(#dp-anim-arrow)" });
          lmfPar.el(s, "text", { x: gx(dst) + bw / 2 + 6, y: y - 4 }, `chunk ${chunk}`);
        }
      }
      lmfPar.el(s, "text", { x: 40, y: H - 20, class: "big" },
        `${step.phase} step ${step.step + 1}/${n - 1}: every GPU sends one chunk of ${lmfPar.bytes(d.chunk_bytes)} to the next`);
    } else if (phase === "update") {
      lmfPar.el(s, "text", { x: 40, y: H - 20, class: "big" },
        `all-reduce done: each GPU sent ${lmfPar.bytes(d.all_reduce_bytes)}; every replica applies the same summed gradient`);
    }
    document.getElementById("phase-text").textContent = `phase: ${phase}`;
  }

  async function render(params) {
    const d = await lmf.get("/api/data-parallel", params);
    const names = phases(d);
    lmfPar.animate(document.getElementById("dp-anim"), names, (i) => draw(d, names, i), 1100);
    lmfPar.rows("dp-figures", [
      ["samples per GPU", "micro_batch", d.micro_batch, String(d.micro_batch), "batch / gpus"],
      ["parameters", "params", d.params, lmf.num(d.params), "plan.memory.param_count"],
      ["gradient bytes X", "grad_bytes", d.grad_bytes, lmfPar.bytes(d.grad_bytes), "params × dtype bytes"],
      ["chunk (one ring step)", "chunk_bytes", d.chunk_bytes, lmfPar.bytes(d.chunk_bytes), "X / gpus"],
      ["ring steps", "ring_step_count", d.ring_steps.length, String(d.ring_steps.length), "2 (gpus − 1)"],
      ["reduce-scatter, sent per GPU", "reduce_scatter_bytes", d.reduce_scatter_bytes, lmfPar.bytes(d.reduce_scatter_bytes), "comm.reduce_scatter(X, n) = (n−1)/n X"],
      ["all-gather, sent per GPU", "all_gather_bytes", d.all_gather_bytes, lmfPar.bytes(d.all_gather_bytes), "comm.all_gather(X, n) = (n−1)/n X"],
      ["all-reduce, sent per GPU", "all_reduce_bytes", d.all_reduce_bytes, lmfPar.bytes(d.all_reduce_bytes), "comm.all_reduce(X, n) = 2 (n−1)/n X"],
      ["lmforge DDP (FP32 gradients)", "lmforge_ddp_bytes", d.lmforge_ddp_bytes, lmfPar.bytes(d.lmforge_ddp_bytes), "comm.dp_volume('ddp', P, n): lmforge estimate's comm.dp"],
    ]);
  }

  lmf.bind(form, render);
})();
