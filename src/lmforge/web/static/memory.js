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
    const acc = d.accuracy;
    // share: of the total, for the rows that make it up (null: a figure beside the total, no share)
    const add = (key, label, value, share, accuracy) => {
      const tr = document.createElement("tr");
      const th = document.createElement("td");
      th.textContent = label;
      const note = lmf.text("td", accuracy || "");
      note.dataset.key = `${key}.accuracy`;
      note.className = "accuracy";
      tr.append(th, lmf.cell(key, value, lmf.gib(value)), share === null ? lmf.cell(`${key}.share`, "", "")
        : lmf.cell(`${key}.share`, share, `${(share * 100).toFixed(1)}%`), note);
      body.append(tr);
      return tr;
    };
    const p = d.at_peak;
    for (const r of ROWS) {
      add(`row.${slug(r)}`, r, d.rows[r], d.total ? d.rows[r] / d.total : 0, acc.rows[r] && acc.rows[r].text);
      if (r === "activations" && p.activations_at_peak < p.activations) {
        // the row counts what is alive at the peak; the activations' own peak is another moment
        add("activations_own_peak", "activations at their own peak", p.activations, null,
          `${p.activations_at_peak ? lmf.gib(p.activations_at_peak) + " GiB of them alive" : "freed"} at the ` +
          `peak ("${p.phase}"); the most the step holds, once the forward saved them all`).className = "aside";
      }
    }
    add("total", "total", d.total, 1, acc.peak_text);
    add("limit", `limit (${d.margin} x memory)`, d.limit, null);
    add("memory_bytes", "device memory", d.memory_bytes, null);
    const accuracy = document.getElementById("memory-accuracy");
    accuracy.dataset.measured = acc.measured ? "1" : "0";
    accuracy.textContent = `The planner's measured accuracy: ${acc.peak_text}` +
      (acc.measured ? `; worst case: ${acc.worst}. Table: docs/memory-accuracy.md.` : ".");
    drawPeak(p);
    const acts = document.querySelector("#memory-activations tbody");
    acts.replaceChildren();
    const actRow = (key, label, v) => {
      const tr = document.createElement("tr");
      tr.append(lmf.text("td", label), lmf.cell(key, v, lmf.gib(v)));
      acts.append(tr);
      return tr;
    };
    for (const [k, v] of Object.entries(d.activation_parts)) if (v) actRow(`activation.${k}`, k.replace(/_/g, " "), v);
    actRow("activation.total", "all, at their largest", d.at_peak.activations).className = "sum";
    actRow("activation.at_peak", `alive at the peak (${d.at_peak.phase})`, d.at_peak.activations_at_peak)
      .className = "sum";
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

  // Which phase is the peak and what is alive in it; why the activations row can be 0 beside the table.
  function drawPeak(p) {
    const alive = p.alive.map(([r, v]) => {
      const parts = (p.parts[r] || []).map(([k, x]) => `${k.replace(/_/g, " ")} ${lmf.gib(x)}`).join(", ");
      return `${r} ${lmf.gib(v)} GiB${parts ? ` (${parts})` : ""}`;
    });
    const held = `The activation table below lists the ${lmf.gib(p.activations)} GiB of activations the step ` +
      "holds for the backward at their largest";
    let acts;
    if (!p.activations) acts = "This step holds no activations.";
    else if (!p.activations_at_peak) {
      acts = `${held}; the backward frees them layer by layer, so none are alive in this phase and the ` +
        "activations row is 0.";
    } else if (p.activations_at_peak < p.activations) {
      acts = `${held}; ${lmf.gib(p.activations_at_peak)} GiB of them are alive in this phase.`;
    } else if (p.activations_at_peak > p.activations) {
      // the forward's own buffers (the loss's) are activations too, as PyTorch's trackers count them
      acts = `${held}; all of them are alive in this phase, and the row adds the ` +
        `${lmf.gib(p.activations_at_peak - p.activations)} GiB of buffers the forward made (the loss's).`;
    } else acts = `${held}; all of them are alive in this phase.`;
    const el = document.getElementById("memory-peak");
    el.dataset.key = "peak_phase";
    el.dataset.value = p.phase;
    el.textContent = `The peak is the phase "${p.phase}". Alive in it: ${alive.join(", ")}. ${acts}`;
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
