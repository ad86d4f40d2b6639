// Tensor parallelism: what /api/tensor-parallel computed. Two panels, column-parallel (top) and
// row-parallel (bottom), animated through shard -> compute -> communicate -> result (later stages faint).
"use strict";
(() => {
  const form = document.getElementById("controls");
  lmfPar.buttons("pause", "step", "tp-anim");
  const PHASES = ["shard", "compute", "communicate", "result"];
  const SHOWN = 4; // GPUs drawn per panel (more: "…")

  // A matrix rows x cols drawn at (x, y), split into `parts` coloured stripes along `axis`
  // ("cols", "rows" or null: one grey block), its label under it; returns the width it takes (the matrix
  // or its label, the wider, as the browser measures the text) and its height.
  function matrix(s, x, y, rows, cols, sc, parts, axis, stage, now, label, color) {
    const w = Math.max(6, cols * sc), h = Math.max(6, rows * sc);
    const g = lmfPar.el(s, "g", { class: stage > now ? "faint" : "" });
    if (!axis) {
      lmfPar.el(g, "rect", { x, y, width: w, height: h, fill: color || "#c9d4e3", stroke: "#333" });
    } else {
      for (let p = 0; p < parts; p++) {
        const a = axis === "cols" ? { x: x + p * w / parts, y, width: w / parts, height: h }
          : { x, y: y + p * h / parts, width: w, height: h / parts };
        lmfPar.el(g, "rect", Object.assign(a, { fill: lmfPar.color(p), stroke: "#fff", opacity: 0.85 }));
      }
      lmfPar.el(g, "rect", { x, y, width: w, height: h, fill: "none", stroke: "#333" });
    }
    const text = label ? lmfPar.el(g, "text", { x, y: y + h + 14 }, label) : null;
    return [Math.max(w, text ? text.getComputedTextLength() : 0), h];
  }

  function panel(s, d, oy, kind, now) {
    const t = d.gpus, sc = 80 / Math.max(d.m, d.k, d.n);
    const col = kind === "column", sh = d[kind];
    lmfPar.el(s, "text", { x: 20, y: oy, class: "big" }, col
      ? `column-parallel: W split by columns, Y_i = X W_i, then all-gather (${lmfPar.bytes(sh.forward_bytes)} sent per GPU)`
      : `row-parallel: W split by rows, partial X_i W_i, then all-reduce (${lmfPar.bytes(sh.forward_bytes)} sent per GPU)`);
    const y = oy + 20;
    const slot = (w) => Math.max(w, 60) + 18;  // room for the widest of matrix and label, then a gap
    let x = 20;
    let [w, h] = matrix(s, x, y, d.m, d.k, sc, t, col ? null : "cols", 0, now, col ? `X ${d.m}×${d.k}` : `X_i ${sh.x_shape.join("×")}`);
    lmfPar.el(s, "text", { x: x + w + 5, y: y + h / 2 + 4 }, "×");
    x += slot(w);
    [w] = matrix(s, x, y, d.k, d.n, sc, t, col ? "cols" : "rows", 0, now, `W_i ${sh.w_shard.join("×")}`);
    x += slot(w) + 10;
    // per-GPU products
    const shown = Math.min(t, SHOWN);
    for (let g = 0; g < shown; g++) {
      const [ww] = matrix(s, x, y, sh.y_shard[0], sh.y_shard[1], sc, 1, null, 1, now,
        `GPU ${g}: ${col ? "" : "partial "}${sh.y_shard.join("×")}`, lmfPar.color(g));
      x += slot(ww);
    }
    if (t > shown) x += lmfPar.el(s, "text", { x, y: y + 40 }, `… ${t - shown} more`).getComputedTextLength() + 18;
    x = Math.max(x, 560) + 12;
    const ga = lmfPar.el(s, "g", { class: now < 2 ? "faint" : "" });
    lmfPar.arrow(ga, x, y + 40, x + 120, y + 40, { "stroke-width": 3, "marker-end": "url(#tp-anim-arrow)" });
    lmfPar.el(ga, "text", { x, y: y + 30 }, col ? "all-gather" : "all-reduce (sum)");
    lmfPar.el(ga, "text", { x, y: y + 58 }, lmfPar.bytes(sh.forward_bytes));
    const [wy] = matrix(s, x + 140, y, d.m, d.n, sc, t, col ? "cols" : null, 3, now, `Y ${d.m}×${d.n} on every GPU`);
    return x + 140 + wy;  // the right end of what the panel drew
  }

  function draw(d, i) {
    const s = lmfPar.svg("tp-anim", 1250, 300);
    const right = Math.max(panel(s, d, 20, "column", i), panel(s, d, 165, "row", i));
    s.setAttribute("viewBox", `0 0 ${Math.max(1250, Math.ceil(right) + 20)} 300`);  // nothing cut off
    document.getElementById("phase-text").textContent = `phase: ${PHASES[i]}`;
  }

  async function render(params) {
    const d = await lmf.get("/api/tensor-parallel", params);
    lmfPar.animate(document.getElementById("tp-anim"), PHASES, (i) => draw(d, i), 1200);
    const b = lmfPar.bytes;
    lmfPar.rows("tp-figures", [
      ["FLOPs, unsplit", "flops_total", d.flops_total, lmf.num(d.flops_total), "2 M K N"],
      ["FLOPs per GPU", "flops_per_gpu", d.flops_per_gpu, lmf.num(d.flops_per_gpu), "2 M K N / t (both splits)"],
      ["column: W shard", "column_w_shard", d.column.w_shard.join("x"), d.column.w_shard.join(" × "), "K × N/t"],
      ["column: output shard", "column_y_shard", d.column.y_shard.join("x"), d.column.y_shard.join(" × "), "M × N/t"],
      ["column: forward all-gather", "column_forward_bytes", d.column.forward_bytes, b(d.column.forward_bytes), "comm.all_gather(M N c, t)"],
      ["column: backward all-reduce of dX", "column_backward_bytes", d.column.backward_bytes, b(d.column.backward_bytes), "comm.all_reduce(M K c, t)"],
      ["row: W shard", "row_w_shard", d.row.w_shard.join("x"), d.row.w_shard.join(" × "), "K/t × N"],
      ["row: input shard", "row_x_shard", d.row.x_shape.join("x"), d.row.x_shape.join(" × "), "M × K/t"],
      ["row: forward all-reduce", "row_forward_bytes", d.row.forward_bytes, b(d.row.forward_bytes), "comm.all_reduce(M N c, t)"],
      ["row: backward", "row_backward_bytes", d.row.backward_bytes, b(d.row.backward_bytes), "dX_i = dY W_iᵀ is local"],
    ]);
    lmfPar.rows("tp-mlp", [
      ["all-reduces in forward", "mlp_forward_all_reduces", d.mlp.forward_all_reduces, String(d.mlp.forward_all_reduces), "after the row layer"],
      ["all-reduces in backward", "mlp_backward_all_reduces", d.mlp.backward_all_reduces, String(d.mlp.backward_all_reduces), "dX, before the column layer"],
      ["forward bytes per GPU", "mlp_forward_bytes", d.mlp.forward_bytes, b(d.mlp.forward_bytes), "comm.all_reduce(M K c, t)"],
      ["backward bytes per GPU", "mlp_backward_bytes", d.mlp.backward_bytes, b(d.mlp.backward_bytes), "comm.all_reduce(M K c, t)"],
      ["one block (attention + MLP)", "block_tp_volume", d.mlp.block_tp_volume, b(d.mlp.block_tp_volume), "comm.tp_volume(t, 1, M, K, V, c, head=False)"],
    ]);
    const c = d.check, dims = c.dims.join("×");
    lmfPar.rows("tp-check", [
      ["column-parallel, cat_i(X W_i)", "check_column", c.column_max_diff, c.column_max_diff.toExponential(2), `X W, ${dims}`],
      ["row-parallel, Σ_i X_i W_i", "check_row", c.row_max_diff, c.row_max_diff.toExponential(2), `X W, ${dims}`],
      ["MLP pair, Σ_i gelu(X W_i) W2_i", "check_mlp", c.mlp_max_diff, c.mlp_max_diff.toExponential(2), "gelu(X W) W2"],
      ["largest |Y| (scale)", "check_scale", c.scale, lmf.num(c.scale, 3), "of X W"],
    ]);
  }

  lmf.bind(form, render);
})();
