// The training dashboard's MoE load heatmap: for the first ticked run that has MoE layers, the tokens each
// expert of each MoE layer took at one logged step (layer x expert), read from /api/runs/moe-load; a
// slider picks the step (it follows the newest step while it sits at the right end).
"use strict";
(() => {
  const form = document.getElementById("controls");
  const section = document.getElementById("moe-load");
  const note = document.getElementById("moe-load-note");
  const slider = document.getElementById("moe-load-step");
  const shown = document.getElementById("moe-load-step-value");
  const pollMs = Math.max(Number(document.body.dataset.pollMs) || 1000, 1000);
  let data = null;  // the last answer of the run shown
  let busy = false;

  const ticked = () => [...form.querySelectorAll("input[name=sel]:checked")].map((e) => e.value);

  function draw() {
    const i = Number(slider.value);
    const step = data.steps[i];
    shown.textContent = `${step} (${i + 1} of ${data.steps.length} logged)`;
    shown.dataset.value = String(step);
    const load = data.load[i];
    const imb = data.imbalance[i];
    const experts = [...Array(data.experts).keys()].map((e) => `expert ${e}`);
    const layers = data.layers.map((l, j) =>
      `layer ${l}` + (imb[j] === null || imb[j] === undefined ? "" : ` (max/mean ${lmf.num(imb[j], 2)})`));
    lmf.plot("chart-moe-load", [{
      type: "heatmap", z: load, x: experts, y: layers, colorscale: "Viridis",
      colorbar: { title: { text: "tokens" } },
      hovertemplate: "%{y}, %{x}: %{z} tokens<extra></extra>",
    }], { title: { text: `${data.run}: tokens per expert at step ${step}`, font: { size: 14 } },
          yaxis: { autorange: "reversed" }, margin: { l: 170, r: 20, t: 40, b: 50 } });
    document.body.dataset.moeStep = String(step);
  }

  async function refresh() {
    if (busy) return;
    busy = true;
    try {
      let found = null;
      for (const run of ticked()) {
        const a = await lmf.get("/api/runs/moe-load", { run });
        if (a.steps.length) { found = a; break; }
      }
      if (!found) { section.hidden = true; data = null; return; }
      const atEnd = !data || data.run !== found.run || Number(slider.value) >= data.steps.length - 1;
      const changed = !data || data.run !== found.run || data.steps.length !== found.steps.length;
      data = found;
      section.hidden = false;
      note.textContent = `Run ${found.run} (the first ticked run with MoE layers): tokens routed to each ` +
        "expert of each MoE layer in one step (moe/layer.<i>/load of metrics.jsonl; top-k: a token counts " +
        "once per expert it chose). Drag the slider to go through the logged steps.";
      slider.max = String(found.steps.length - 1);
      if (atEnd) slider.value = slider.max;
      if (changed) draw();
    } catch (e) {
      console.warn(e.message);
    } finally {
      busy = false;
    }
  }

  slider.addEventListener("input", () => { if (data) draw(); });
  form.addEventListener("change", () => setTimeout(refresh, 0));
  const poll = async () => { await refresh(); setTimeout(poll, pollMs); };
  setTimeout(poll, 300);
})();
