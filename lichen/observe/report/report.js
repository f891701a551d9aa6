// lichen report: draws the page from the JSON in #report-data. Plain DOM and SVG, no libraries, no network.
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("report-data").textContent);
  const SVG = "http://www.w3.org/2000/svg";
  const PHASES = ["generate", "train", "save", "sync", "eval"];
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f"];

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return node;
  }
  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    return node;
  }
  function fmt(v) {
    if (v === null || v === undefined) return "–";
    if (typeof v !== "number") return String(v);
    if (v === 0) return "0";
    const a = Math.abs(v);
    return a >= 1e4 || a < 1e-3 ? v.toExponential(2) : v.toPrecision(4).replace(/\.?0+$/, "");
  }

  // ---- curves ------------------------------------------------------------------------------------------------
  const metrics = DATA.metrics;
  const keys = new Set();
  metrics.forEach((m) => Object.keys(m).forEach((k) => keys.add(k)));
  const match = (re) => [...keys].filter((k) => re.test(k)).sort();
  const CHARTS = [
    ["Reward", ["rollout/reward_mean"]],
    ["Response length", ["rollout/response_length_mean", "rollout/response_length_max"]],
    ["Loss", ["train/loss"]],
    ["PPO KL", ["train/ppo_kl"]],
    ["Clip fraction", ["train/pg_clipfrac"]],
    ["Entropy", match(/^train\/.*entropy/)],
    ["Train − rollout log-prob |diff| (mean / max)",
      ["train/train_rollout_logprob_abs_diff", "train/train_rollout_logprob_abs_diff_max"]],
    ["Grad norm", ["train/grad_norm"]],
    ["Learning rate", ["train/lr"]],
    ["Eval scores", match(/^eval\/.+\/(reward_mean|pass@\d+)$/)],
    ["Peak RSS per phase, driver (GiB)", match(/^memory\/[^/]+_peak_rss_gb$/)],
    ["CUDA max allocated per phase, driver (GiB)", match(/^memory\/[^/]+_cuda_max_allocated_gb$/)],
    ...processMemoryCharts(),
  ];

  // one chart per other process that reports its memory: memory/rank{r}/... (trainer ranks), memory/engine{i}/...
  function processMemoryCharts() {
    const procs = [...new Set([...keys].map((k) => /^memory\/((?:rank|engine)\d+)\//.exec(k)).filter(Boolean)
      .map((m) => m[1]))].sort((a, b) => a.localeCompare(b, undefined, { numeric: true }));
    return procs.flatMap((p) => [
      [`Peak RSS per phase, ${p} (GiB)`, match(new RegExp(`^memory/${p}/.+_peak_rss_gb$`))],
      [`CUDA max allocated per phase, ${p} (GiB)`, match(new RegExp(`^memory/${p}/.+_cuda_max_allocated_gb$`))],
    ]);
  }

  function series(key) {
    return metrics.filter((m) => typeof m[key] === "number").map((m) => [m.step, m[key]]);
  }

  function lineChart(title, keyList) {
    const lines = keyList.map((k) => [k, series(k)]).filter(([, pts]) => pts.length);
    if (!lines.length) return null;
    const W = 360, H = 190, L = 52, R = 10, T = 10, B = 26;
    const all = lines.flatMap(([, p]) => p);
    let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
    let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
    const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
    const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    const root = svg("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, "data-title": title });
    for (const [v, y] of [[y0, H - B], [y1, T], [(y0 + y1) / 2, (H - B + T) / 2]]) {
      root.append(svg("line", { x1: L, x2: W - R, y1: y, y2: y, class: "grid" }));
      const t = svg("text", { x: L - 4, y: y + 4, class: "tick", "text-anchor": "end" });
      t.textContent = fmt(v);
      root.append(t);
    }
    for (const [v, anchor] of [[x0, "start"], [x1, "end"]]) {
      const t = svg("text", { x: sx(v), y: H - 8, class: "tick", "text-anchor": anchor });
      t.textContent = `step ${Math.round(v)}`;
      root.append(t);
    }
    lines.forEach(([key, pts], i) => {
      const color = COLORS[i % COLORS.length];
      const g = svg("g", { class: "series", "data-metric": key, "data-points": pts.length });
      g.append(svg("polyline", { points: pts.map(([x, y]) => `${sx(x)},${sy(y)}`).join(" "), stroke: color,
        fill: "none", "stroke-width": 1.6 }));
      for (const [x, y] of pts) {
        const c = svg("circle", { cx: sx(x), cy: sy(y), r: 2.6, fill: color, class: "pt" });
        const tip = svg("title", {});
        tip.textContent = `${key}\nstep ${x}: ${fmt(y)}`;
        c.append(tip);
        g.append(c);
      }
      root.append(g);
    });
    const legend = el("div", { class: "legend" });
    lines.forEach(([key], i) => legend.append(el("span", { class: "key" },
      el("i", { style: `background:${COLORS[i % COLORS.length]}` }), key)));
    return el("figure", { class: "card" }, el("figcaption", {}, title), root, legend);
  }

  function phaseChart() {
    const rows = metrics.filter((m) => typeof m["time/step"] === "number");
    if (!rows.length) return null;
    const W = 740, H = 220, L = 64, R = 10, T = 10, B = 26;
    const parts = rows.map((m) => {
      const p = PHASES.map((ph) => (typeof m[`time/${ph}`] === "number" ? m[`time/${ph}`] : 0));
      return [...p, Math.max(0, m["time/step"] - p.reduce((a, b) => a + b, 0))];
    });
    const ymax = Math.max(...rows.map((m, i) => Math.max(m["time/step"], parts[i].reduce((a, b) => a + b, 0))));
    const bw = Math.min(40, Math.max(1, (W - L - R) / rows.length - 1));
    const every = Math.ceil(rows.length / 12);  // at most a dozen step labels
    const root = svg("svg", { class: "chart phases", viewBox: `0 0 ${W} ${H}`, "data-title": "step time" });
    for (const [v, y] of [[0, H - B], [ymax, T]]) {
      root.append(svg("line", { x1: L, x2: W - R, y1: y, y2: y, class: "grid" }));
      const t = svg("text", { x: L - 4, y: y + 4, class: "tick", "text-anchor": "end" });
      t.textContent = `${fmt(v)} s`;
      root.append(t);
    }
    const names = [...PHASES, "other"];
    rows.forEach((m, i) => {
      let y = H - B;
      const x = L + i * (bw + 1);
      if (i % every === 0 || i === rows.length - 1) {
        const t = svg("text", { x: x + bw / 2, y: H - 8, class: "tick", "text-anchor": "middle" });
        t.textContent = m.step;
        root.append(t);
      }
      parts[i].forEach((v, j) => {
        const h = (v / (ymax || 1)) * (H - T - B);
        if (h <= 0) return;
        y -= h;
        const r = svg("rect", { x, y, width: bw, height: h, fill: COLORS[j], class: `bar ${names[j]}` });
        const tip = svg("title", {});
        tip.textContent = `step ${m.step}: ${names[j]} ${fmt(v)} s of ${fmt(m["time/step"])} s`;
        r.append(tip);
        root.append(r);
      });
    });
    const legend = el("div", { class: "legend" });
    names.forEach((n, j) => legend.append(el("span", { class: "key" }, el("i", { style: `background:${COLORS[j]}` }),
      n)));
    return el("figure", { class: "card wide" },
      el("figcaption", {}, "Step time by phase (the loop runs them one after another; 'other' is the rest)"),
      root, legend);
  }

  function timelineChart() {
    const tl = DATA.timeline;
    if (!tl || !tl.slices.length) return null;
    const lanesH = 22, L = 150, R = 10, T = 6, B = 24, W = 1100;
    const H = T + B + lanesH * tl.lanes.length;
    const t0 = Math.min(...tl.slices.map((s) => s.ts));
    const t1 = Math.max(...tl.slices.map((s) => s.ts + s.dur));
    const sx = (t) => L + ((t - t0) / (t1 - t0 || 1)) * (W - L - R);
    const root = svg("svg", { class: "chart timeline", viewBox: `0 0 ${W} ${H}`, "data-title": "timeline" });
    tl.lanes.forEach((name, i) => {
      const t = svg("text", { x: L - 6, y: T + i * lanesH + 15, class: "tick", "text-anchor": "end" });
      t.textContent = name.length > 24 ? name.slice(0, 23) + "…" : name;
      root.append(t);
    });
    const names = [...PHASES, "reward"];
    // outer phases first, so a phase nested in another (reward in generate) is drawn on top of it
    [...tl.slices].sort((a, b) => b.dur - a.dur).forEach((s) => {
      const j = names.indexOf(s.name);
      const nested = s.name === "reward";
      const r = svg("rect", { x: sx(s.ts), y: T + s.lane * lanesH + (nested ? 9 : 2),
        width: Math.max(0.5, sx(s.ts + s.dur) - sx(s.ts)), height: nested ? 9 : 16,
        fill: j >= 0 ? COLORS[j] : "#6b7280", class: `slice ${s.name}` });
      const tip = svg("title", {});
      tip.textContent = `${s.name} (rollout ${s.rollout_id}): ${fmt(s.dur / 1e6)} s`;
      r.append(tip);
      root.append(r);
    });
    const ax = svg("text", { x: W - R, y: H - 6, class: "tick", "text-anchor": "end" });
    ax.textContent = `${fmt((t1 - t0) / 1e6)} s`;
    root.append(ax);
    const legend = el("div", { class: "legend" });
    names.forEach((n, j) => legend.append(el("span", { class: "key" }, el("i", { style: `background:${COLORS[j]}` }),
      n)));
    return el("figure", { class: "card wide" }, el("figcaption", {}, "Timeline of the last rollouts (from trace.json; " +
      "one lane per thread: slices that overlap in time on different lanes ran at once, e.g. with --async)"),
    root, legend);
  }

  // ---- sample browser ------------------------------------------------------------------------------------
  const samples = DATA.samples;
  function meanAdv(s) {
    const a = (s.advantages || []).filter((v) => v !== null);
    return a.length ? a.reduce((x, y) => x + y, 0) / a.length : null;
  }
  function text(v) {
    return typeof v === "string" ? v : JSON.stringify(v);
  }
  // the engine server(s) of a sample: one URL, or one per engine call (turns, resumed segments); [] in process
  function engines(s) {
    return s.engine === undefined ? [] : Array.isArray(s.engine) ? s.engine : [s.engine];
  }
  const short = (url) => url.replace(/^https?:\/\//, "");

  function tokenView(s, mode) {
    const box = el("div", { class: "tokens" });
    const toks = s.tokens || [];
    const vals = toks.map((_, i) => {
      if (mode === "advantage") return s.advantages ? s.advantages[i] : null;
      const r = s.rollout_log_probs, t = s.trainer_log_probs;
      return r && t && r[i] !== null && t[i] !== null ? r[i] - t[i] : null;
    });
    const scale = Math.max(1e-12, ...vals.filter((v) => v !== null).map(Math.abs));
    toks.forEach((id, i) => {
      const v = vals[i];
      const a = v === null ? 0 : Math.min(1, Math.abs(v) / scale);
      const bg = v === null ? "#e5e7eb" : v >= 0 ? `rgba(220,38,38,${a * 0.85})` : `rgba(37,99,235,${a * 0.85})`;
      const label = s.token_texts ? s.token_texts[i] : `#${id}`;
      const tip = [`token ${id}`, `rollout log-prob ${fmt(s.rollout_log_probs && s.rollout_log_probs[i])}`,
        `trainer log-prob ${fmt(s.trainer_log_probs && s.trainer_log_probs[i])}`,
        `advantage ${fmt(s.advantages && s.advantages[i])}`].join("\n");
      box.append(el("span", { class: "tok", style: `background:${bg}`, title: tip }, label.replace(/\n/g, "⏎")));
    });
    return box;
  }

  function sampleBrowser() {
    const section = el("section", { id: "samples" }, el("h2", {}, "Samples"));
    if (!samples.length) {
      section.append(el("p", { class: "note" }, "No sample log in this run directory (lichen train --log-samples N " +
        "writes N samples per step)."));
      return section;
    }
    const steps = [...new Set(samples.map((s) => s.step))].sort((a, b) => a - b);
    const statuses = [...new Set(samples.map((s) => s.status))].sort();
    const stepSel = el("select", { id: "f-step" }, el("option", { value: "" }, "all steps"),
      ...steps.map((s) => el("option", { value: s }, `step ${s}`)));
    const statusSel = el("select", { id: "f-status" }, el("option", { value: "" }, "any status"),
      ...statuses.map((s) => el("option", { value: s }, s)));
    const urls = [...new Set(samples.flatMap(engines))].sort();
    const engineSel = el("select", { id: "f-engine" }, el("option", { value: "" }, "any engine"),
      ...urls.map((u) => el("option", { value: u }, short(u))));
    const rmin = el("input", { id: "f-rmin", type: "number", step: "any", placeholder: "reward ≥" });
    const rmax = el("input", { id: "f-rmax", type: "number", step: "any", placeholder: "reward ≤" });
    const search = el("input", { id: "f-text", type: "search", placeholder: "search prompt / response / label" });
    const mode = el("select", { id: "f-colour" }, el("option", { value: "diff" }, "colour: rollout − trainer log-prob"),
      el("option", { value: "advantage" }, "colour: advantage"));
    const count = el("span", { id: "sample-count", class: "note" });
    const tbody = el("tbody");
    const detail = el("div", { id: "sample-detail", class: "card" }, "Click a row to see its tokens.");
    let current = null;
    const show = (s) => {
      current = s;
      detail.replaceChildren(
        el("div", { class: "meta" }, `step ${s.step} · group ${s.group_index} · sample ${s.index} · ${s.status} · ` +
          `reward ${fmt(s.reward)} · weight versions ${(s.weight_versions || []).join(", ") || "–"}` +
          (engines(s).length ? ` · engine${engines(s).length > 1 ? "s per call" : ""} ${engines(s).join(", ")}` :
            " · in-process engine") + (s.reward_error ? ` · reward error: ${s.reward_error}` : "")),
        el("div", { class: "label" }, "prompt"), el("pre", {}, text(s.prompt)),
        el("div", { class: "label" }, `response (${s.response_length} tokens; red: positive, blue: negative)`),
        tokenView(s, mode.value), el("div", { class: "label" }, "label"), el("pre", {}, text(s.label)));
    };
    mode.addEventListener("change", () => current && show(current));
    const rows = samples.map((s) => {
      const tr = el("tr", { class: "sample-row", onclick: () => show(s) },
        el("td", {}, s.step), el("td", {}, s.group_index), el("td", {}, s.index), el("td", {}, s.status),
        el("td", {}, fmt(s.reward)), el("td", {}, fmt(meanAdv(s))), el("td", {}, s.response_length),
        el("td", { class: "engine" }, [...new Set(engines(s))].map(short).join(", ") || "–"),
        el("td", { class: "txt" }, text(s.prompt).slice(0, 80)), el("td", { class: "txt" }, text(s.response).slice(0, 120)));
      tbody.append(tr);
      return [s, tr];
    });
    const apply = () => {
      const q = search.value.toLowerCase();
      const lo = rmin.value === "" ? -Infinity : Number(rmin.value);
      const hi = rmax.value === "" ? Infinity : Number(rmax.value);
      let shown = 0;
      for (const [s, tr] of rows) {
        const r = s.reward === null ? NaN : s.reward;
        const ok = (stepSel.value === "" || String(s.step) === stepSel.value) &&
          (statusSel.value === "" || s.status === statusSel.value) &&
          (engineSel.value === "" || engines(s).includes(engineSel.value)) &&
          (lo === -Infinity && hi === Infinity || (r >= lo && r <= hi)) &&
          (!q || [s.prompt, s.response, s.label].some((v) => text(v).toLowerCase().includes(q)));
        tr.hidden = !ok;
        shown += ok ? 1 : 0;
      }
      count.textContent = `${shown} of ${rows.length} samples`;
    };
    for (const c of [stepSel, statusSel, engineSel, rmin, rmax, search]) c.addEventListener("input", apply);
    apply();
    section.append(el("div", { class: "filters" }, stepSel, statusSel, engineSel, rmin, rmax, search, mode, count),
      el("div", { class: "scroll" }, el("table", { class: "samples" }, el("thead", {}, el("tr", {},
        ...["step", "group", "sample", "status", "reward", "adv (mean)", "len", "engine", "prompt", "response"].map((h) =>
          el("th", {}, h)))), tbody)), detail);
    return section;
  }

  // ---- config, checkpoints, watchdog ---------------------------------------------------------------------
  function configSection() {
    const entries = Object.entries(DATA.config || {}).filter(([, v]) => v !== null && v !== false &&
      !(Array.isArray(v) && !v.length) && !(typeof v === "object" && !Array.isArray(v) && !Object.keys(v).length));
    return el("section", { id: "config" }, el("details", {}, el("summary", {}, `Config (${entries.length} flags ` +
      "set; unset ones hidden)"), el("table", { class: "kv" }, el("tbody", {}, ...entries.map(([k, v]) =>
      el("tr", {}, el("th", {}, `--${k.replace(/_/g, "-")}`), el("td", {}, text(v))))))));
  }

  function checkpointSection() {
    const cks = DATA.checkpoints || [];
    const section = el("section", { id: "checkpoints" }, el("h2", {}, "Checkpoints"));
    if (!cks.length) {
      section.append(el("p", { class: "note" }, "None (the run has no --save, or saved none yet)."));
      return section;
    }
    section.append(el("table", { class: "kv" }, el("thead", {}, el("tr", {}, ...["directory", "rollout", "weight version",
      "size", "written", ""].map((h) => el("th", {}, h)))), el("tbody", {}, ...cks.map((c) => el("tr", {},
      el("td", {}, c.path), el("td", {}, c.rollout_id), el("td", {}, c.weight_version ?? "–"),
      el("td", {}, `${(c.bytes / 1048576).toFixed(1)} MiB`), el("td", {}, c.time), el("td", {}, c.latest ? "latest" : ""))))));
    return section;
  }

  function hangSection() {
    if (!(DATA.hangs || []).length) return null;
    return el("section", { id: "hangs" }, el("h2", {}, "Watchdog dumps"), ...DATA.hangs.map((h) =>
      el("details", {}, el("summary", {}, h.name), el("pre", {}, h.text))));
  }

  // ---- page ----------------------------------------------------------------------------------------------
  const last = metrics.filter((m) => m.step > 0).slice(-1)[0] || {};
  const header = el("header", {}, el("h1", {}, "lichen run report"),
    el("div", { class: "note" }, `${DATA.run_dir} · ${metrics.filter((m) => m.step > 0).length} steps logged · ` +
      `page made ${DATA.generated} (run \`lichen report\` again to refresh)` +
      (DATA.has_trace ? " · trace.json beside metrics.jsonl opens in ui.perfetto.dev" : "")),
    el("div", { class: "summary" }, ...[["reward", "rollout/reward_mean"], ["response length",
      "rollout/response_length_mean"], ["loss", "train/loss"], ["step time (s)", "time/step"]].map(([n, k]) =>
      el("span", { class: "stat" }, el("b", {}, fmt(last[k])), n))));
  const curves = el("section", { id: "curves", class: "grid" });
  const phases = phaseChart();
  if (phases) curves.append(phases);
  const timeline = timelineChart();
  if (timeline) curves.append(timeline);
  for (const [title, ks] of CHARTS) {
    const c = lineChart(title, ks);
    if (c) curves.append(c);
  }
  document.body.append(header, el("h2", {}, "Curves"), curves, sampleBrowser(), checkpointSection(), configSection());
  const hangs = hangSection();
  if (hangs) document.body.append(hangs);
})();
