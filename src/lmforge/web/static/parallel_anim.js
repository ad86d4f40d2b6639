// Shared by the data-, model- and tensor-parallel pages: SVG drawing, a phase animation that loops, byte
// formatting and figure rows. The animated <svg> carries data-phase (the phase shown) and data-frame (a
// counter of phases shown), which tests read to see the animation advance.
"use strict";
window.lmfPar = {
  NS: "http://www.w3.org/2000/svg",
  colors: ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf"],
  color(i) { return lmfPar.colors[i % lmfPar.colors.length]; },
  paused: false,
  // A new SVG element `tag` with attributes `attrs` (and text), appended to `parent`.
  el(parent, tag, attrs, text) {
    const e = document.createElementNS(lmfPar.NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    parent.appendChild(e);
    return e;
  },
  // Empty the <svg id=id>, size it, give it an arrow marker; returns it.
  svg(id, width, height) {
    const s = document.getElementById(id);
    while (s.firstChild) s.removeChild(s.firstChild);
    s.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const defs = lmfPar.el(s, "defs");
    const m = lmfPar.el(defs, "marker", { id: id + "-arrow", viewBox: "0 0 10 10", refX: 9, refY: 5,
      markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" });
    lmfPar.el(m, "path", { d: "M0,0 L10,5 L0,10 z", fill: "#333" });
    return s;
  },
  arrow(s, x1, y1, x2, y2, attrs) {
    return lmfPar.el(s, "line", Object.assign({ x1, y1, x2, y2, stroke: "#333", "stroke-width": 2,
      "marker-end": `url(#${s.id}-arrow)` }, attrs || {}));
  },
  // Show phases[0], phases[1], ... every `ms` (looping) by calling draw(i); restarts on each call.
  animate(s, phases, draw, ms) {
    if (s._timer) clearInterval(s._timer);
    let i = 0;
    const tick = (force) => {
      if (lmfPar.paused && s.dataset.frame && force !== true) return;
      s.dataset.phase = phases[i];
      s.dataset.frame = String(Number(s.dataset.frame || 0) + 1);
      draw(i);
      i = (i + 1) % phases.length;
    };
    tick(true);
    s._tick = tick;
    s._timer = setInterval(tick, ms);
  },
  // Play/pause and "next phase" buttons for the animated <svg id=svgId> (not form inputs: they change no
  // figure). "next phase" pauses the animation and shows the following phase.
  buttons(pauseId, stepId, svgId) {
    const b = document.getElementById(pauseId);
    const show = () => { b.textContent = lmfPar.paused ? "play" : "pause"; };
    b.addEventListener("click", () => { lmfPar.paused = !lmfPar.paused; show(); });
    document.getElementById(stepId).addEventListener("click", () => {
      lmfPar.paused = true;
      show();
      const s = document.getElementById(svgId);
      if (s._tick) s._tick(true);
    });
  },
  bytes(x) {
    if (x === null || x === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let u = 0, v = x;
    while (Math.abs(v) >= 1024 && u < units.length - 1) { v /= 1024; u++; }
    return `${v.toLocaleString("en-US", { maximumFractionDigits: 2 })} ${units[u]}`;
  },
  // Rows [label, key, value, text, note] into <tbody id=id>.
  rows(id, rows) {
    const body = document.getElementById(id);
    body.replaceChildren();
    for (const [label, key, value, text, note] of rows) {
      const tr = document.createElement("tr");
      const th = document.createElement("td");
      th.textContent = label;
      tr.appendChild(th);
      tr.appendChild(lmf.cell(key, value, text));
      const n = document.createElement("td");
      n.className = "note";
      n.textContent = note || "";
      tr.appendChild(n);
      body.appendChild(tr);
    }
  },
};
