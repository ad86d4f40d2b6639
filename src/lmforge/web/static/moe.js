// The MoE visualizer: the gating of four inputs' tokens by a real trained router (from /api/moe), the
// sparsity and the FLOPs per token against a dense model of equal total parameters.
"use strict";
(() => {
  const form = document.getElementById("controls");
  const int = (v) => Math.round(v).toLocaleString("en-US");

  function gatingMap(id, input, layer, experts) {
    const rows = layer.tokens.map((t, p) => `${p}: ${JSON.stringify(t)}`);
    const z = layer.experts.map((chosen, p) => {
      const row = Array(experts).fill(null);
      chosen.forEach((e, j) => { row[e] = layer.weights[p][j]; });
      return row;
    });
    lmf.plot(id, [{
      type: "heatmap", z, x: [...Array(experts).keys()].map((e) => `expert ${e}`), y: rows,
      colorscale: "Blues", reversescale: true, zmin: 0, zmax: Math.max(...layer.weights.flat()),
      colorbar: { title: { text: "gate weight" } },
      hovertemplate: "token %{y} -> %{x}: weight %{z:.3f}<extra></extra>",
    }], { title: { text: `"${input.text}"`, font: { size: 13 } }, yaxis: { autorange: "reversed" },
          height: Math.max(260, 16 * rows.length + 90), margin: { l: 90, r: 20, t: 40, b: 40 } });
  }

  function routeTable(table, i, layer) {
    const rows = layer.tokens.map((t, p) => {
      const pairs = layer.experts[p].map((e, j) => [e, layer.weights[p][j]]);
      const text = pairs.map(([e, w]) => `${e} (${w.toFixed(3)})`).join(", ");
      return [lmf.text("td", String(p)), lmf.text("td", JSON.stringify(t)),
              lmf.cell(`route.${i}.${layer.layer}.${p}`, JSON.stringify(pairs), text)];
    });
    lmf.table(table, ["position", "token", "experts (gate weight), best first"], rows);
  }

  function drawInputs(data, layerIndex) {
    const box = document.getElementById("moe-inputs");
    box.replaceChildren();
    data.inputs.forEach((input, i) => {
      const layer = input.layers.find((l) => l.layer === layerIndex) || input.layers[0];
      const row = document.createElement("div");
      row.className = "row moe-input";
      const chart = document.createElement("div");
      chart.className = "chart";
      chart.id = `chart-moe-gate-${i}`;
      const table = document.createElement("table");
      table.className = "figures moe-route";
      table.id = `moe-route-${i}`;
      row.append(chart, table);
      box.append(row);
      gatingMap(chart.id, input, layer, data.experts);
      routeTable(table, i, layer);
    });
  }

  function drawCompute(data) {
    const c = data.compute;
    const rows = [
      ["experts E", "experts", data.experts, String(data.experts)],
      ["experts per token k", "top_k", data.top_k, String(data.top_k)],
      ["sparsity k / E (routed weights a token uses)", "sparsity", c.sparsity, `${(100 * c.sparsity).toFixed(1)}%`],
      ["parameters, non-embedding (all experts)", "total_params", c.total_params, int(c.total_params)],
      ["of which routed experts", "routed_params", c.routed_params, int(c.routed_params)],
      ["active per token", "active_params", c.active_params, int(c.active_params)],
      ["training FLOPs per token, MoE", "moe_flops", c.moe_flops, int(c.moe_flops)],
      ["training FLOPs per token, dense of equal total", "dense_flops", c.dense_flops, int(c.dense_flops)],
      ["compute saved", "saved", c.saved, `${(100 * c.saved).toFixed(1)}%`],
    ];
    lmf.table(document.getElementById("moe-compute"), ["figure", "value"],
      rows.map(([label, key, v, text]) => [lmf.text("td", label), lmf.cell(`compute.${key}`, v, text)]));
    lmf.plot("chart-moe-flops", [{
      type: "bar", x: ["MoE (active)", "dense, equal total"], y: [c.moe_flops, c.dense_flops],
      marker: { color: ["#2ca02c", "#7f7f7f"] }, text: [int(c.moe_flops), int(c.dense_flops)],
    }], { title: { text: `FLOPs per token: ${(100 * c.saved).toFixed(1)}% saved`, font: { size: 14 } },
          yaxis: { title: { text: "training FLOPs per token" }, rangemode: "tozero" } });
  }

  async function render(params) {
    const data = await lmf.get("/api/moe", params);
    const m = data.model;
    const note = document.getElementById("moe-model");
    note.textContent = `Model: ${data.experts} experts, ${data.top_k} per token, trained ${m.steps} steps ` +
      `(${lmf.num(m.tokens, 0)} tokens) in ${m.seconds.toFixed(1)} s when first asked for; training loss ` +
      `${m.losses[0].toFixed(3)} -> ${m.losses[1].toFixed(3)} nats per byte.`;
    note.dataset.experts = String(data.experts);
    drawInputs(data, Number(params.layer || 0));
    drawCompute(data);
  }
  lmf.bind(form, render);
})();
