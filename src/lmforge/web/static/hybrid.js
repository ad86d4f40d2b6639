// Hybrid planner: draws what /api/hybrid returns (lmforge estimate --json and the device mesh).
"use strict";
(() => {
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                   "#bcbd22", "#17becf"];
  const colourBy = document.getElementById("hybrid-colour");
  let last = null;

  function row(cells) {
    const tr = document.createElement("tr");
    for (const c of cells) {
      if (c instanceof HTMLElement) tr.append(c);
      else { const td = document.createElement("td"); td.textContent = c; tr.append(td); }
    }
    return tr;
  }

  // Group i of n: the palette up to 10 groups, beyond it n evenly spaced hues, neighbours told apart by
  // lightness too: no two groups share a colour.
  const groupColour = (i, n) => (n <= PALETTE.length ? PALETTE[i]
    : `hsl(${(360 * i / n).toFixed(2)}, 70%, ${i % 2 ? 38 : 64}%)`);
  const HALF_W = 0.4, HALF_H = 0.36;  // a GPU's box around its (local, node) centre; gutters between

  // The path joining two GPUs of a group (a before b in rank order) through nothing but their own boxes:
  // neighbours in a row or a column directly edge to edge, others along the gutters below a's row and left
  // of b's column, above the line between nodes (off: this group's offset inside the gutters, so that groups sharing one stay apart).
  function link(a, b, off) {
    if (a.node === b.node && Math.abs(a.local - b.local) === 1) {
      const s = Math.sign(b.local - a.local);
      return [[a.local + s * HALF_W, a.node + off], [b.local - s * HALF_W, b.node + off]];
    }
    if (a.local === b.local && Math.abs(a.node - b.node) === 1) {
      const s = Math.sign(b.node - a.node);
      return [[a.local + off, a.node + s * HALF_H], [b.local + off, b.node - s * HALF_H]];
    }
    const gy = a.node + 0.44 + off / 2, gx = b.local - 0.5 + off / 2;
    return [[a.local + off, a.node + HALF_H], [a.local + off, gy], [gx, gy], [gx, b.node + off],
            [b.local - HALF_W, b.node + off]];
  }

  function groupLines(d, dim, byRank) {
    const members = d.groups[dim].members;
    return members.filter((g) => g.ranks.length > 1).map((g) => {
      const off = 0.06 * ((g.index % 5) - 2) / 2;
      const x = [], y = [];
      for (let k = 1; k < g.ranks.length; k++) {
        for (const [px, py] of link(byRank[g.ranks[k - 1]], byRank[g.ranks[k]], off)) { x.push(px); y.push(py); }
        x.push(null); y.push(null);
      }
      return { type: "scatter", mode: "lines", hoverinfo: "skip", showlegend: false, x, y, meta: g.ranks,
               name: `${dim.toUpperCase()} group ${g.index}`,
               line: { color: groupColour(g.index, members.length), width: 2,
                       dash: g.crosses_nodes ? "dash" : "solid" } };
    });
  }

  function grid(d) {
    const dim = colourBy.value;
    const e = d.result.estimate;
    const shapes = [], xs = [], ys = [], texts = [], hovers = [];
    const n = d.groups[dim].members.length;
    // each GPU holds its pipeline rank's stages: the planner's total for that rank
    const memory = (g) => (e.pp_rank_totals && e.pp_rank_totals.length ? e.pp_rank_totals[g.pp] : e.total);
    for (const g of d.grid) {
      shapes.push({ type: "rect", x0: g.local - HALF_W, x1: g.local + HALF_W, y0: g.node - HALF_H,
                    y1: g.node + HALF_H, name: `r${g.rank}`, fillcolor: groupColour(g.groups[dim], n),
                    opacity: 0.55, line: { color: "#333", width: 1 }, layer: "below" });
      xs.push(g.local); ys.push(g.node);
      texts.push(`r${g.rank}<br>pp${g.pp} dp${g.dp} tp${g.tp}<br>${lmf.gib(memory(g))} GiB`);
      hovers.push(`rank ${g.rank} (node ${g.node}, GPU ${g.local})<br>TP group ${g.groups.tp}, PP group ` +
                  `${g.groups.pp}, DP group ${g.groups.dp}<br>planned memory ${lmf.gib(memory(g))} GiB`);
    }
    for (let k = 1; k < d.nodes; k++) {
      shapes.push({ type: "line", x0: -0.6, x1: d.gpus_per_node - 0.5, y0: k - 0.5, y1: k - 0.5,
                    line: { color: "#000", width: 2 } });
    }
    const byRank = Object.fromEntries(d.grid.map((g) => [g.rank, g]));
    const labels = { type: "scatter", mode: "text", x: xs, y: ys, text: texts, hovertext: hovers,
                     hoverinfo: "text", showlegend: false, textfont: { size: 10 } };
    lmf.plot("hybrid-grid", [...groupLines(d, dim, byRank), labels], {
      title: { text: `${d.nodes} nodes x ${d.gpus_per_node} GPUs, coloured by ${dim.toUpperCase()} group` },
      shapes, height: 120 + 95 * d.nodes,
      xaxis: { title: { text: "GPU in node" }, tickvals: [...Array(d.gpus_per_node).keys()], zeroline: false,
               range: [-0.65, d.gpus_per_node - 0.45] },
      yaxis: { title: { text: "node" }, autorange: "reversed", tickvals: [...Array(d.nodes).keys()],
               ticktext: [...Array(d.nodes).keys()].map((k) => `node ${k}`), zeroline: false },
    });
    document.getElementById("hybrid-grid").dataset.gpus = JSON.stringify(
      d.grid.map((g) => ({ rank: g.rank, node: g.node, pp: g.pp, dp: g.dp, tp: g.tp, memory: memory(g) })));
  }

  function tables(d) {
    const e = d.result.estimate;
    document.getElementById("hybrid-command").textContent = `lmforge estimate ${d.flags.join(" ")} --json`;
    document.getElementById("hybrid-pp-rank").textContent = e.pp_rank;
    // [estimate key (the cell's data-key), what the page calls it, value, text]
    const figs = [
      ["total", "memory per device", e.total, `${lmf.gib(e.total)} GiB`],
      ["accuracy", "planner accuracy", d.accuracy.measured ? d.accuracy.max : "", d.accuracy.peak_text],
      ["fits", "fits", e.fits ? 1 : 0, e.fits ? `fits (limit ${lmf.gib(e.margin * e.memory_bytes)} GiB)` : "does not fit"],
      ["device_params", "parameters per device", e.device_params, lmf.num(e.device_params)],
      ["step_s", "step time", e.step_s, `${lmf.num(e.step_s, 3)} s`],
      ["compute_s", "compute time", e.compute_s, `${lmf.num(e.compute_s, 3)} s`],
      ["exposed_comm_s", "exposed communication", e.exposed_comm_s, `${lmf.num(e.exposed_comm_s, 3)} s`],
      ["bubble", "pipeline bubble", e.bubble, lmf.num(e.bubble, 4)],
      ["tokens_per_step", "tokens per step", e.tokens_per_step, lmf.num(e.tokens_per_step)],
      ["tokens_per_s", "tokens/s", e.tokens_per_s, lmf.num(e.tokens_per_s, 0)],
      ["effective_mfu", "effective MFU", e.effective_mfu, lmf.num(e.effective_mfu, 3)],
      ["peak_phase", "peak phase", e.peak_phase, e.peak_phase],
    ];
    document.querySelector("#hybrid-figures tbody").replaceChildren(
      ...figs.map(([k, name, v, t]) => row([name, lmf.cell(k, v, t)])));
    document.querySelector("#hybrid-comm tbody").replaceChildren(...["dp", "tp", "pp"].map((dim) => {
      const g = d.groups[dim];
      return row([dim.toUpperCase(), lmf.cell(`group_${dim}`, g.size, g.size), String(g.count),
                  lmf.cell(`crossing_${dim}`, g.crossing, `${g.crossing} of ${g.count}`),
                  lmf.cell(`comm_${dim}`, e.comm[dim], lmf.gib(e.comm[dim]))]);
    }));
    const parts = [["parameters", e.states.params], ["gradients", e.gradients_at_peak],
                   ["master weights", e.states.master], ["optimizer states", e.states.optim],
                   ["activations", e.activations_at_peak], ["temporaries", e.temporaries_at_peak],
                   ["overhead", e.overhead]];
    lmf.plot("hybrid-memory", parts.map(([name, v]) => ({ type: "bar", name, x: ["per device"], y: [v / 2 ** 30] })), {
      barmode: "stack", title: { text: "memory at the peak (GiB)" }, height: 360,
      shapes: [{ type: "line", x0: -0.5, x1: 0.5, y0: e.margin * e.memory_bytes / 2 ** 30,
                 y1: e.margin * e.memory_bytes / 2 ** 30, line: { color: "#a11", dash: "dot" } }],
    });
    const box = document.getElementById("hybrid-search-box");
    box.hidden = !d.flags.includes("--search");
    document.querySelector("#hybrid-search tbody").replaceChildren(...d.result.search.map((s, i) =>
      row([s.layout_description, lmf.cell(`search_${i}_total`, s.total, lmf.gib(s.total)),
           lmf.cell(`search_${i}_step_s`, s.step_s, lmf.num(s.step_s, 3)),
           lmf.cell(`search_${i}_tokens_per_s`, s.tokens_per_s, lmf.num(s.tokens_per_s, 0))])));
  }

  lmf.bind(document.getElementById("controls"), async (params) => {
    const d = await lmf.get("/api/hybrid", params);
    last = d;
    grid(d);
    tables(d);
  });
  colourBy.addEventListener("change", () => { if (last) grid(last); });
})();
