// Shared by every page: JSON requests, form controls, Plotly drawing, number formatting.
// Tests wait on <body data-renders>, which counts the renders finished after the page's data arrived.
"use strict";
window.lmf = {
  // GET url?params as JSON; a 400 answer's {"error": ...} is shown in #error and thrown.
  async get(url, params) {
    const q = params ? "?" + new URLSearchParams(params).toString() : "";
    const res = await fetch(url + q);
    const body = await res.json();
    const box = document.getElementById("error");
    if (!res.ok) {
      box.textContent = body.error || res.statusText;
      box.hidden = false;
      throw new Error(body.error || res.statusText);
    }
    box.hidden = true;
    return body;
  },
  // The named inputs of a form as {name: value} (checkboxes: "1" / "0").
  params(form) {
    const out = {};
    for (const el of form.elements) {
      if (!el.name) continue;
      if (el.type === "checkbox") out[el.name] = el.checked ? "1" : "0";
      else if (el.type === "radio") { if (el.checked) out[el.name] = el.value; }
      else out[el.name] = el.value;
    }
    return out;
  },
  // Call render(params) now and after every change of the form (debounced).
  bind(form, render) {
    let timer = null;
    const run = async () => {
      try { await render(lmf.params(form)); } catch (e) { console.warn(e.message); }
      lmf.done();
    };
    const later = () => { clearTimeout(timer); timer = setTimeout(run, 150); };
    form.addEventListener("input", later);
    form.addEventListener("change", later);
    form.addEventListener("submit", (e) => { e.preventDefault(); later(); });
    run();
  },
  done() { document.body.dataset.renders = String(Number(document.body.dataset.renders) + 1); },
  plot(id, traces, layout) {
    const base = { margin: { l: 60, r: 20, t: 40, b: 50 }, paper_bgcolor: "#fff", plot_bgcolor: "#fff",
                   font: { size: 12 }, legend: { orientation: "h", y: -0.2 } };
    return Plotly.react(id, traces, Object.assign(base, layout || {}), { displaylogo: false, responsive: true });
  },
  gib(bytes) { return (bytes / 2 ** 30).toFixed(2); },
  // A number for reading: digits grouped by thousands ("412,345", "4,080,513,024") up to 1e15, with at most
  // `digits` decimals (3); exponent notation only for the very large and the very small (< 1e-3).
  num(x, digits) {
    if (x === null || x === undefined) return "–";
    return Math.abs(x) >= 1e15 || (Math.abs(x) < 1e-3 && x !== 0) ? x.toExponential(digits ?? 3)
      : x.toLocaleString("en-US", { maximumFractionDigits: digits ?? 3 });
  },
  // An element <tag> holding the text `s`.
  text(tag, s) { const el = document.createElement(tag); el.textContent = s; return el; },
  // Fill the table `el`: one header row, then one row per list of cells.
  table(el, headers, rows) {
    el.replaceChildren();
    const head = document.createElement("tr");
    for (const h of headers) head.append(lmf.text("th", h));
    el.append(head);
    for (const cells of rows) {
      const tr = document.createElement("tr");
      tr.append(...cells);
      el.append(tr);
    }
  },
  // A cell whose text is `text` and whose data-value is the exact figure (what tests compare).
  cell(key, value, text) {
    const td = document.createElement("td");
    td.dataset.key = key;
    td.dataset.value = String(value);
    td.textContent = text;
    return td;
  },
};
