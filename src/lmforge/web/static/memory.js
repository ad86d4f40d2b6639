// GPU memory planner: draws what /api/memory returns (lmforge estimate's figures); computes nothing.
"use strict";
(() => {
  const ROWS = ["parameters", "gradients", "master weights", "optimizer states", "activations",
                "temporaries", "overhead"];
  const COLORS = ["#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#eeca3b", "#b8b0ac"];
  const GIB = 2 ** 30;
  const slug = (s) => s.replace(/ /g, "_");

  function limitShapes(d, horizontal) {
    const line = (v, color, dash) => horizontal
      ? { type: "line", xref: "x", yref: "paper", x0: v / GIB, x1: v / GIB, y0: 0, y1: 1, line: { color, dash } }
      : { type: "line", xref: "paper", yref: "y", x0: 0, x1: 1, y0: v / GIB, y1: v / GIB, line: { color, dash } };
    return [line(d.limit, "#a11", "dash"), line(d.memory_bytes, "#1d2430", "dot")];
  }

  function drawBreakdown(d) {
    const traces = ROWS.map((r, i) => ({
      type: "bar", orientation: "h", name: r, y: ["per device"], x: [d.rows[r] / GIB],
      marker: { color: COLORS[i] }, hovertemplate: `${r}: %{x:.2f} GiB<extra></extra>`,
    }));
    lmf.plot("memory-bar", traces, {
      barmode: "stack", title: { text: `per-device memory (GiB); dashed: limit ${d.margin} x memory` },
      xaxis: { title: "GiB" }, shapes: limitShapes(d, true), height: 300,
    });
    const body = document.querySelector("#memory-table tbody");
    body.replaceChildren();
    const add = (key, label, value, share) => {
      const tr = document.createElement("tr");
      const th = document.createElement("td");
      th.textContent = label;
      tr.append(th, lmf.cell(key, value, lmf.gib(value)), lmf.cell(`${key}.share`, share,
        `${(share * 100).toFixed(1)}%`));
      body.append(tr);
    };
    for (const r of ROWS) add(`row.${slug(r)}`, r, d.rows[r], d.total ? d.rows[r] / d.total : 0);
    add("total", "total", d.total, 1);
    add("limit", `limit (${d.margin} x memory)`, d.limit, d.limit / d.total);
    add("memory_bytes", "device memory", d.memory_bytes, d.memory_bytes / d.total);
    const acts = document.querySelector("#memory-activations tbody");
    acts.replaceChildren();
    for (const [k, v] of Object.entries(d.activation_parts)) {
      if (!v) continue;
      const tr = document.createElement("tr");
      const th = document.createElement("td");
      th.textContent = k.replace(/_/g, " ");
      tr.append(th, lmf.cell(`activation.${k}`, v, lmf.gib(v)));
      acts.append(tr);
    }
    const verdict = document.getElementById("memory-verdict");
    verdict.className = d.fits ? "fits" : "nofit";
    verdict.dataset.key = "fits";
    verdict.dataset.value = d.fits ? "1" : "0";
    verdict.textContent = `${lmf.num(d.n_params / 1e9, 2)}B parameters; ${d.layout}; ${d.attention} attention; ` +
      `peak: ${d.peak_phase}. ${d.fits ? "Fits" : "Does not fit"}: ${lmf.gib(d.total)} GiB of ` +
      `${lmf.gib(d.memory_bytes)} GiB (${(100 * d.total / d.memory_bytes).toFixed(0)}%; limit ` +
      `${lmf.gib(d.limit)} GiB). Step ${lmf.num(d.step_s, 3)} s, ${lmf.num(d.tokens_per_s, 0)} tokens/s.` +
      (d.warnings.length ? " " + d.warnings.join("; ") : "");
  }

  function drawScaling(id, tableId, series, axis, prefix) {
    const ok = series.filter((p) => !p.error);
    const xs = ok.map((p) => String(p.value));
    const traces = ROWS.map((r, i) => ({
      type: "bar", name: r, x: xs, y: ok.map((p) => p.rows[r] / GIB), marker: { color: COLORS[i] },
      hovertemplate: `${r}: %{y:.2f} GiB<extra></extra>`,
    }));
    traces.push({ type: "scatter", mode: "lines+markers", name: "total", x: xs, y: ok.map((p) => p.total / GIB),
                  line: { color: "#1d2430" } });
    if (ok.length) {
      traces.push({ type: "scatter", mode: "lines", name: `limit (${ok[0].margin} x memory)`, x: xs,
                    y: ok.map((p) => p.limit / GIB), line: { color: "#a11", dash: "dash" } });
    }
    lmf.plot(id, traces, { barmode: "stack", xaxis: { title: axis, type: "category" }, yaxis: { title: "GiB per device" } });
    const table = document.getElementById(tableId);
    table.replaceChildren();
    const head = document.createElement("tr");
    for (const h of [axis, ...ROWS, "total", "fits"]) {
      const th = document.createElement("th");
      th.textContent = h;
      head.append(th);
    }
    table.append(head);
    for (const p of series) {
      const tr = document.createElement("tr");
      const first = document.createElement("td");
      first.textContent = String(p.value);
      tr.append(first);
      if (p.error) {
        const td = document.createElement("td");
        td.colSpan = ROWS.length + 2;
        td.textContent = p.error;
        tr.append(td);
      } else {
        for (const r of ROWS) tr.append(lmf.cell(`${prefix}.${p.value}.${slug(r)}`, p.rows[r], lmf.gib(p.rows[r])));
        tr.append(lmf.cell(`${prefix}.${p.value}.total`, p.total, lmf.gib(p.total)));
        tr.append(lmf.cell(`${prefix}.${p.value}.fits`, p.fits ? 1 : 0, p.fits ? "yes" : "no"));
      }
      table.append(tr);
    }
  }

  lmf.bind(document.getElementById("controls"), async (params) => {
    const d = await lmf.get("/api/memory", params);
    document.getElementById("memory-command").textContent = d.command;
    drawBreakdown(d);
    drawScaling("memory-by-batch", "memory-batch-table", d.by_batch, "micro-batch", "batch");
    drawScaling("memory-by-seq", "memory-seq-table", d.by_seq, "sequence length", "seq");
  });
})();
