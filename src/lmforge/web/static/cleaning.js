// Cleaning trade-off: the curves of a sweep.json, the optimum marked, one level's figures.
"use strict";
(() => {
  const form = document.getElementById("controls");
  const levelBox = document.getElementById("level");
  let shownSweep = null;
  const fmt = (v, d) => (v === null || v === undefined ? "–" : lmf.num(v, d ?? 4));
  // A new sweep brings its own levels; the level shown starts at its optimum.
  form.elements.sweep.addEventListener("change", () => { levelBox.value = ""; });
  function markers(data, ys) {
    const i = data.index, b = data.optimum.index;
    const out = [];
    if (b !== null && ys[b] !== null) out.push({ type: "scatter", mode: "markers", x: [data.levels[b]], y: [ys[b]],
      name: "optimum", marker: { symbol: "star", size: 16, color: "gold", line: { color: "black", width: 1 } } });
    if (ys[i] !== null) out.push({ type: "scatter", mode: "markers", x: [data.levels[i]], y: [ys[i]], name: "shown",
      marker: { symbol: "circle-open", size: 16, color: "black", line: { width: 2 } } });
    return out;
  }
  function vline(data) {
    const b = data.optimum.index;
    return b === null ? [] : [{ type: "line", xref: "x", yref: "paper", x0: data.levels[b], x1: data.levels[b], y0: 0, y1: 1,
      line: { color: "goldenrod", dash: "dot" } }];
  }
  // A threshold as text: "off" for a stage or rule not run, numbers to 4 significant digits.
  function knobText(v) {
    if (v === null) return "off";
    if (typeof v === "number") return String(Number(v.toPrecision(4)));
    if (typeof v === "object") return Object.entries(v).map(([k, x]) => `${k}: ${knobText(x)}`).join(", ");
    return String(v);
  }
  async function render(params) {
    const data = await lmf.get("/api/cleaning", params);
    if (shownSweep !== data.sweep) {
      levelBox.replaceChildren(...data.levels.map((l) => new Option(`level ${l}`, String(l))));
      shownSweep = data.sweep;
    }
    levelBox.value = String(data.levels[data.index]);
    const rows = data.rows, x = data.levels;
    const docs0 = Math.max(...rows.map((r) => r.documents_input)) || 1;
    const tok0 = Math.max(...rows.map((r) => r.tokens)) || 1;
    const docs = rows.map((r) => 100 * r.documents / docs0), toks = rows.map((r) => 100 * r.tokens / tok0);
    const layout = (title, y) => ({ title: { text: title }, margin: { l: 60, r: 60, t: 40, b: 60 }, legend: { orientation: "h", y: -0.3 }, xaxis: { title: { text: "strictness level" }, range: [-8, 108] }, yaxis: y, shapes: vline(data), height: 380 });
    await lmf.plot("chart-size", [
      { type: "scatter", mode: "lines+markers", x, y: docs, name: "documents (% of input)" },
      { type: "scatter", mode: "lines+markers", x, y: toks, name: "tokens (% of most kept)" },
      ...markers(data, toks),
    ], layout("size kept", { title: { text: "%" }, range: [0, 105] }));
    const ref = data.reference || {};
    const qlabel = ref.kind === "perplexity" ? "mean perplexity (lower is better)" : "mean P(good) (higher is better)";
    const q = rows.map((r) => r.quality_mean);
    await lmf.plot("chart-quality", [
      { type: "scatter", mode: "lines+markers", x, y: q, name: "mean" },
      { type: "scatter", mode: "lines+markers", x, y: rows.map((r) => r.quality_median), name: "median", line: { dash: "dot" } },
      ...markers(data, q),
    ], layout(`quality: ${qlabel}`, { title: { text: ref.kind || "quality" } }));
    const dk = rows.map((r) => r.distinct_ngrams_at_k);
    await lmf.plot("chart-diversity", [
      { type: "scatter", mode: "lines+markers", x, y: dk, name: `distinct ${data.ngram}-grams / word, first ${data.k_words} words` },
      { type: "scatter", mode: "lines+markers", x, y: rows.map((r) => r.distinct_ngrams_per_token), name: `distinct ${data.ngram}-grams / token, all kept`, line: { dash: "dash" } },
      { type: "scatter", mode: "lines+markers", x, y: rows.map((r) => r.vocab_entropy_bits), name: "word entropy (bits)", yaxis: "y2", line: { dash: "dot" } },
      ...markers(data, dk),
    ], Object.assign(layout("diversity", { title: { text: "per word / token" } }), {
      // its own round ticks (an overlaid axis otherwise takes the left axis's grid: 4.767, 4.839...), no grid
      yaxis2: { title: { text: "bits" }, overlaying: "y", side: "right", tickmode: "auto", nticks: 5, showgrid: false,
                automargin: true } }));
    const b = data.optimum.index;
    const note = document.getElementById("optimum-note");
    note.replaceChildren();
    const bold = (key, value) => {
      const span = document.createElement("b");
      span.dataset.key = key;
      span.dataset.value = String(value);
      span.textContent = String(value);
      return span;
    };
    if (b === null) note.textContent = "No level has every figure (or every weight is 0): no optimum marked.";
    else {
      note.append("Optimum marked: level ", bold("optimum.level", data.levels[b]),
        ` (score ${fmt(data.optimum.score[b], 3)} with weights size ${data.weights[0]}, quality ${data.weights[1]}, diversity ${data.weights[2]}).`);
    }
    const recorded = data.recorded_optimum;
    note.append(" ", recorded ? "The sweep itself marks level " : "The sweep marks no optimum (no level has every figure).");
    if (recorded) note.append(bold("recorded.level", recorded.level), " (weights 1, 1, 1).");
    const r = rows[data.index];
    document.getElementById("level-heading").textContent = `At level ${r.level}`;
    const lt = document.getElementById("level-table");
    lt.replaceChildren();
    const figs = [
      ["documents kept", "documents", 0], ["documents in", "documents_input", 0], ["bytes", "bytes", 0],
      ["words", "words", 0], ["tokens", "tokens", 0], ["quality mean", "quality_mean", 4],
      ["quality median", "quality_median", 4], [`d${data.ngram}/token`, "distinct_ngrams_per_token", 4],
      [`d${data.ngram}@K`, "distinct_ngrams_at_k", 4], ["word entropy (bits)", "vocab_entropy_bits", 4],
    ];
    for (const [label, key, d] of figs) {
      const row = lt.insertRow();
      row.insertCell().textContent = label;
      row.appendChild(lmf.cell(`level.${key}`, r[key], fmt(r[key], d)));
    }
    const score = lt.insertRow();
    score.insertCell().textContent = "score (this page's rule)";
    score.appendChild(lmf.cell("level.score", data.optimum.score[data.index], fmt(data.optimum.score[data.index], 4)));
    const rt = document.getElementById("removed-table");
    rt.replaceChildren();
    rt.insertRow().innerHTML = "<th>stage.reason</th><th>documents</th>";
    const removed = Object.entries(r.removed || {});
    if (!removed.length) rt.insertRow().insertCell().textContent = "nothing removed";
    for (const [reason, n] of removed) {
      const row = rt.insertRow();
      row.insertCell().textContent = reason;
      row.appendChild(lmf.cell(`removed.${reason}`, n, fmt(n, 0)));
    }
    const kt = document.getElementById("knob-table");
    kt.replaceChildren();
    kt.insertRow().innerHTML = "<th>stage</th><th>knob</th><th>value</th>";
    for (const k of data.knobs) {
      const row = kt.insertRow();
      row.insertCell().textContent = k.stage;
      row.insertCell().textContent = k.param;
      row.insertCell().textContent = knobText(k.value);
    }
    const st = document.getElementById("sweep-table");
    st.replaceChildren();
    st.insertRow().innerHTML = `<th>level</th><th>documents</th><th>tokens</th><th>quality</th><th>d${data.ngram}/tok</th><th>d${data.ngram}@K</th><th>H (bits)</th><th>score</th>`;
    rows.forEach((row, i) => {
      const tr = st.insertRow();
      if (i === b) tr.className = "cleaning-best";
      tr.appendChild(lmf.cell(`row.${i}.level`, row.level, String(row.level)));
      tr.appendChild(lmf.cell(`row.${i}.documents`, row.documents, fmt(row.documents, 0)));
      tr.appendChild(lmf.cell(`row.${i}.tokens`, row.tokens, fmt(row.tokens, 0)));
      tr.appendChild(lmf.cell(`row.${i}.quality_mean`, row.quality_mean, fmt(row.quality_mean)));
      tr.appendChild(lmf.cell(`row.${i}.distinct_ngrams_per_token`, row.distinct_ngrams_per_token, fmt(row.distinct_ngrams_per_token)));
      tr.appendChild(lmf.cell(`row.${i}.distinct_ngrams_at_k`, row.distinct_ngrams_at_k, fmt(row.distinct_ngrams_at_k)));
      tr.appendChild(lmf.cell(`row.${i}.vocab_entropy_bits`, row.vocab_entropy_bits, fmt(row.vocab_entropy_bits)));
      tr.appendChild(lmf.cell(`row.${i}.score`, data.optimum.score[i], fmt(data.optimum.score[i])));
    });
  }
  lmf.bind(form, render);
})();
