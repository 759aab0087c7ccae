// One run: its curves on one shared, synchronised step axis with anomaly markers; ranks x steps
// heatmaps (forward/data time relative to the cross-rank median, memory); amax per module against the
// FP8 limit; the anomaly list with evidence, each entry zooming everything to its step. Live: new steps
// and anomalies arrive through the event stream.
import { AMAX_TOP, AmaxPanel } from "./amax.js";
import { anomalyItem } from "./anomalies.js";
import { finiteOrNull, getJson, runPath } from "./api.js";
import { ChartGroup, mergeDetail } from "./charts.js";
import { badge, el, fmtAgo, fmtDuration, fmtInt, fmtRate } from "./format.js";
import { Heatmap } from "./heatmap.js";
import { subscribe } from "./live.js";

const CURVES = [
  { metric: "loss", title: "Loss (mean over ranks)", stroke: "#6ea8fe" },
  // The model's norm: the shards' sums of squares combined per step (FSDP, TP), not a shard's own norm.
  { metric: "grad_norm", rank: "global", title: "Gradient norm (the model's, shards combined)", stroke: "#c084fc" },
  { metric: "lr", title: "Learning rate", stroke: "#5eead4" },
  { metric: "time.step_ms", title: "Step time, ms (mean over ranks, log scale)", stroke: "#fbbf24", log: true },
];
// The agent's own metrics (docs/ingest.md); anything else a run reports is the user's (`watch.log(eval_loss=...)`),
// charted after the built-in curves, the first MAX_USER_CURVES of them (the rest named).
const BUILT_IN = /^(loss|grad_norm|grad_sumsq|optimizer\.skipped|lr(\.\d+)?|(time|mem|nonfinite)\..+)$/;
const MAX_USER_CURVES = 12;
const USER_COLOURS = ["#f472b6", "#a3e635", "#fb923c", "#38bdf8", "#e879f9", "#facc15"];

function userCurves(metrics) {
  return metrics.filter((m) => !BUILT_IN.test(m)).map((m, i) => ({
    metric: m, title: `${m} (yours, from watch.log; mean over ranks)`, stroke: USER_COLOURS[i % USER_COLOURS.length],
  }));
}

// The heatmap's views. The first, derived by the collector from the step's timeline (README, "Who holds
// the run up"), lights the rank the others wait for; phase times light the ranks that wait.
const PHASES = [
  { metric: "time.late_ms", label: "who holds the run up", needs: ["time.data_ms", "time.step_ms"],
    note: "how late each rank reaches its step's sync points, as a share of the step: the slow rank is a line, the ranks waiting for it are not" },
  { metric: "time.forward_ms", label: "forward time", note: "relative to the median of all ranks at the same steps (a rank waiting for a slow peer in forward looks slow here)" },
  { metric: "time.data_ms", label: "data wait", note: "relative to the median of all ranks at the same steps" },
];
const MEMORY = [ // the first one the run reports: device memory, else (CPU training) the host's
  { metric: "mem.allocated_mb", label: "allocated device memory, MB" },
  { metric: "mem.rss_mb", label: "host memory (RSS), MB: no device memory reported" },
];
const MAX_POINTS = 1600;
const TAIL_STEPS = 32; // live updates re-read this many steps back: ranks report a step at different times
const SLOW_REFRESH_MS = 5000; // heatmaps and amax follow live data at most this often
const HEATMAP_BUCKETS = 240;

export function renderRun(main, run) {
  document.title = `${run} · stepwatch`;
  const state = { run, row: null, curves: [], lastStep: null, anomaliesVersion: undefined, anomalies: [],
    phase: PHASES[0].metric, highlight: null, alive: true, slowTimer: null, lastSlow: 0 };
  const group = new ChartGroup();
  const path = runPath(run);

  const head = el("div", { class: "run-head" });
  const chartsBox = el("div", { class: "chart-stack" });
  const zoomNote = el("span", { class: "muted", dataset: { testid: "zoom" } }, "all steps");
  const resetButton = el("button", { type: "button", onclick: () => group.setRange(null) }, "Show all steps");
  const charts = el("section", { class: "panel charts", "aria-labelledby": "curves-h" },
    el("div", { class: "panel-head" }, el("h2", { id: "curves-h" }, "Training curves"),
      el("span", { class: "muted" }, "Drag across a chart to zoom, double-click to reset; every chart follows."),
      zoomNote, resetButton),
    chartsBox);
  const phaseSelect = el("select", { "aria-label": "Heatmap metric" },
    PHASES.map((p) => el("option", { value: p.metric }, p.label)));
  const heatBox = el("div", { class: "heat-box" });
  const highlightNote = el("span", { class: "muted" });
  const phaseNote = el("span", { class: "muted" }, PHASES[0].note);
  const heatPanel = el("section", { class: "panel", "aria-labelledby": "heat-h" },
    el("div", { class: "panel-head" }, el("h2", { id: "heat-h" }, "Ranks × steps: "), phaseSelect,
      phaseNote, highlightNote),
    heatBox);
  const memBox = el("div", { class: "heat-box" });
  const memNote = el("span", { class: "muted" }, "each cell the peak of its steps");
  const memPanel = el("section", { class: "panel", "aria-labelledby": "mem-h" },
    el("div", { class: "panel-head" }, el("h2", { id: "mem-h" }, "Memory per rank"),
      memNote),
    memBox);
  const amaxBox = el("div", {});
  const amaxNote = el("p", { class: "muted amax-note", hidden: true });
  const amaxTable = el("table", { class: "amax", "aria-label": "Amax headroom per module" });
  const amaxPanel = el("section", { class: "panel", "aria-labelledby": "amax-h" },
    el("div", { class: "panel-head" }, el("h2", { id: "amax-h" }, "Activation amax per module"),
      el("span", { class: "muted" }, "max over ranks, log scale; the dashed line is FP8 E4M3's largest value, 448")),
    amaxNote, amaxBox, amaxTable);
  const anomalyList = el("ol", { class: "anomaly-list", "aria-label": "Anomalies" });
  const anomalyCount = el("span", { class: "muted" });
  const aside = el("aside", { class: "panel anomalies", id: "anomalies", "aria-labelledby": "anom-h" },
    el("div", { class: "panel-head" }, el("h2", { id: "anom-h" }, "Anomalies"), anomalyCount), anomalyList);
  const error = el("p", { class: "error", role: "alert", hidden: true });
  main.append(
    el("p", { class: "crumbs" }, el("a", { href: "/", "data-nav": true }, "Runs"), " / ", run),
    head, error,
    el("div", { class: "run-grid" }, el("div", { class: "run-main" }, charts, heatPanel, memPanel, amaxPanel), aside),
  );

  const heat = new Heatmap(heatBox, { label: "Ranks by steps heatmap, relative to the rank's peers", mode: "late" });
  const mem = new Heatmap(memBox, { label: "Memory per rank heatmap", mode: "absolute", unit: "MB" });
  const amax = new AmaxPanel(amaxBox, amaxTable, amaxNote, group);

  const fail = (e) => {
    if (!state.alive) return;
    error.hidden = false;
    error.textContent = `Could not load: ${e.message}`;
  };

  function renderHead() {
    const r = state.row;
    if (!r) return;
    head.replaceChildren(
      el("h1", {}, run, " ", badge(r.verdict)),
      el("dl", { class: "stats" },
        stat("World size", fmtInt(r.world_size)),
        stat("Last step", fmtInt(r.last_step), "last-step"),
        r.finished ? stat("Finished", `after ${fmtDuration(r.duration_s)}`, "pace") : stat("Step rate", fmtRate(r.step_rate), "pace"),
        stat("Open anomalies", fmtInt(r.open_anomalies)),
        stat("Last seen", `${fmtAgo(r.last_seen_at)}${r.live ? " (live)" : ""}`)),
    );
  }

  // -- curves ---------------------------------------------------------------------------------------
  async function loadCurves(metrics) {
    const own = userCurves(metrics);
    const present = [...CURVES.filter((c) => metrics.includes(c.metric)), ...own.slice(0, MAX_USER_CURVES)];
    if (own.length > MAX_USER_CURVES) {
      chartsBox.after(el("p", { class: "muted" }, `Also logged, not charted: ${own.slice(MAX_USER_CURVES).map((c) => c.metric).join(", ")}`));
    }
    for (const c of present) {
      const box = el("div", { class: "chart", dataset: { metric: c.metric } });
      chartsBox.append(box);
      const chart = group.add(box, { title: c.title, log: c.log, series: [{ label: c.metric, stroke: c.stroke }] });
      state.curves.push({ ...c, chart, steps: [], values: [] });
    }
    await Promise.all(state.curves.map(async (c) => {
      const d = await getJson(`${path}/series`, { metric: c.metric, rank: c.rank ?? "mean", max_points: MAX_POINTS });
      const s = d.series[0] ?? { steps: [], values: [] };
      c.steps = s.steps;
      c.values = finiteOrNull(s.values);
      group.setData(c.chart, [c.steps, c.values]);
    }));
    state.lastStep = Math.max(-1, ...state.curves.map((c) => c.steps.at(-1) ?? -1));
    charts.dataset.lastStep = String(state.lastStep);
  }

  async function loadTail() {
    const from = Math.max(0, (state.lastStep ?? 0) - TAIL_STEPS);
    await Promise.all(state.curves.map(async (c) => {
      const d = await getJson(`${path}/series`, { metric: c.metric, rank: c.rank ?? "mean", from_step: from, max_points: MAX_POINTS });
      const s = d.series[0];
      if (!s) return;
      const keep = c.steps.findIndex((x) => x >= from);
      const cut = keep < 0 ? c.steps.length : keep;
      c.steps = c.steps.slice(0, cut).concat(s.steps);
      c.values = c.values.slice(0, cut).concat(finiteOrNull(s.values));
      group.setData(c.chart, [c.steps, c.values]);
    }));
    state.lastStep = Math.max(state.lastStep ?? -1, ...state.curves.map((c) => c.steps.at(-1) ?? -1));
    charts.dataset.lastStep = String(state.lastStep);
  }

  async function loadDetail(range) {
    if (!range) return;
    const [lo, hi] = [Math.floor(range[0]), Math.ceil(range[1])];
    await Promise.all(state.curves.map(async (c) => {
      const d = await getJson(`${path}/series`, { metric: c.metric, rank: c.rank ?? "mean", from_step: Math.max(0, lo), to_step: hi, max_points: MAX_POINTS });
      const s = d.series[0];
      if (!s) return;
      [c.steps, c.values] = mergeDetail(c.steps, c.values, s.steps, finiteOrNull(s.values), lo, hi);
      group.setData(c.chart, [c.steps, c.values]);
    }));
  }

  // -- heatmaps and amax ------------------------------------------------------------------------------
  const rangeParams = () => (group.range ? { from_step: Math.max(0, Math.floor(group.range[0])), to_step: Math.ceil(group.range[1]) } : {});
  // Answers come back in any order: one asked for a range the page no longer shows (a slow full-range
  // heatmap after a zoom) is dropped, and so is any answer older than the last request for the same
  // view (a generation per target: a slow forward-time answer after the view was switched, or an older
  // refresh), so the newest request always wins. A caller whose answer was dropped for a newer request
  // waits for that one, so a page that says it is ready has drawn what it asked for (a second full-range
  // load started while the first was in flight let the page say ready with an empty heatmap).
  const rangeKey = () => JSON.stringify(rangeParams());
  const generations = {};
  const newest = {};
  const forRange = (target, promise, apply) => {
    const asked = rangeKey();
    const generation = (generations[target] = (generations[target] ?? 0) + 1);
    const done = promise.then((d) => {
      if (!state.alive || rangeKey() !== asked) return undefined;
      if (generations[target] === generation) return apply(d);
      return newest[target];
    });
    newest[target] = done;
    return done;
  };

  async function loadHeatmaps(metrics) {
    const jobs = [];
    const view = PHASES.find((p) => p.metric === state.phase);
    phaseNote.textContent = view.note;
    heat.setMode(view.metric === "time.late_ms" ? "late" : "median");
    if ((view.needs ?? [view.metric]).every((m) => metrics.includes(m))) {
      jobs.push(forRange("heat", getJson(`${path}/heatmap`, { metric: state.phase, mode: "median", buckets: HEATMAP_BUCKETS, ...rangeParams() }), (d) => heat.setData(d)));
    } else heat.setData(null);
    const memory = MEMORY.find((m) => metrics.includes(m.metric));
    if (memory) {
      memNote.textContent = `${memory.label}; each cell the peak of its steps`;
      jobs.push(forRange("memory", getJson(`${path}/heatmap`, { metric: memory.metric, mode: "absolute", buckets: HEATMAP_BUCKETS, ...rangeParams() }), (d) => mem.setData(d)));
    } else mem.setData(null);
    await Promise.all(jobs);
  }

  async function loadAmax() {
    await forRange("amax", getJson(`${path}/amax`, { max_points: MAX_POINTS, top: AMAX_TOP, ...rangeParams() }), (d) => amax.show(d));
  }

  function refreshSlow() {
    const now = Date.now();
    if (state.slowTimer) return;
    const wait = Math.max(0, state.lastSlow + SLOW_REFRESH_MS - now);
    state.slowTimer = setTimeout(() => {
      state.slowTimer = null;
      state.lastSlow = Date.now();
      if (!state.alive) return;
      getJson(path).then((detail) => { // metrics sampled less often (amax, memory) may have appeared
        state.metrics = detail.metrics;
        return Promise.all([loadHeatmaps(detail.metrics), loadAmax(), loadPhases()]);
      }).catch(fail);
    }, wait);
  }

  // -- known pauses ------------------------------------------------------------------------------------
  /** The pauses the user marked (`watch.phase`: eval, checkpoint), once per step whichever ranks said so. */
  async function loadPhases() {
    const d = await getJson(`${path}/events`, { kind: "phase_start", limit: 10000 });
    const seen = new Map(d.events.map((e) => [`${e.step} ${e.data?.phase}`, { step: e.step, phase: String(e.data?.phase ?? "pause") }]));
    const phases = [...seen.values()].sort((a, b) => a.step - b.step);
    charts.dataset.phases = String(phases.length);
    group.setPhases(phases);
  }

  // -- anomalies ---------------------------------------------------------------------------------------
  async function loadAnomalies() {
    const d = await getJson(`${path}/anomalies`);
    state.anomalies = d.anomalies.sort((a, b) => a.first_step - b.first_step || a.id - b.id);
    group.setAnomalies(state.anomalies);
    const open = state.anomalies.filter((a) => a.status === "open").length;
    anomalyCount.textContent = `${open} open, ${state.anomalies.length - open} resolved`;
    anomalyList.replaceChildren(...state.anomalies.map((a) => anomalyItem(a, zoomTo)));
    if (!state.anomalies.length) anomalyList.append(el("li", { class: "muted" }, "None: the detectors found nothing wrong."));
  }

  function zoomTo(a) {
    const all = state.curves[0]?.steps ?? [];
    const span = all.length ? all.at(-1) - all[0] : 1000;
    const half = Math.max(30, Math.round(span * 0.03));
    const lo = Math.max(all[0] ?? 0, a.first_step - half);
    group.select(a.id);
    state.highlight = a.rank;
    heat.setHighlight(a.rank);
    mem.setHighlight(a.rank);
    highlightNote.textContent = a.rank !== null ? `highlighting rank ${a.rank} (${a.kind.replaceAll("_", " ")})` : "";
    for (const li of anomalyList.children) li.classList.toggle("selected", li.dataset.id === String(a.id));
    group.setRange([lo, a.first_step + half]);
    charts.scrollIntoView({ block: "start", behavior: "instant" });
    history.replaceState(null, "", `#anomaly=${a.id}`); // a link to this view
  }

  /** `#anomaly=<id>` in the address: open the run zoomed to that anomaly, as its button does. */
  function zoomFromAddress() {
    const id = Number(new URLSearchParams(location.hash.slice(1)).get("anomaly"));
    const a = state.anomalies.find((x) => x.id === id);
    if (a) zoomTo(a);
  }

  let shownRange = rangeKey(); // a scale change that leaves the range as it was reloads nothing
  group.onRange((range) => {
    const key = rangeKey();
    if (key === shownRange) return;
    shownRange = key;
    charts.dataset.xMin = range ? String(Math.round(range[0])) : "";
    charts.dataset.xMax = range ? String(Math.round(range[1])) : "";
    zoomNote.textContent = range ? `steps ${fmtInt(Math.round(range[0]))}–${fmtInt(Math.round(range[1]))}` : "all steps";
    clearTimeout(state.zoomTimer);
    state.zoomTimer = setTimeout(() => {
      if (!state.alive) return;
      loadDetail(range).catch(fail);
      loadHeatmaps(state.metrics).catch(fail);
      loadAmax().catch(fail);
    }, 200);
  });

  // One tail read at a time; steps that arrive meanwhile are read right after it.
  let tailRunning = false;
  let tailAgain = false;
  async function followTail() {
    if (tailRunning) {
      tailAgain = true;
      return;
    }
    tailRunning = true;
    try {
      do {
        tailAgain = false;
        await loadTail();
      } while (tailAgain && state.alive);
      refreshSlow();
    } catch (e) {
      fail(e);
    } finally {
      tailRunning = false;
    }
  }

  // -- start and stay live ---------------------------------------------------------------------------------
  const onResize = () => {
    const width = chartsBox.clientWidth;
    group.resize(width);
    heat.draw();
    mem.draw();
  };
  window.addEventListener("resize", onResize);

  // Open the run (again, when it had not reported yet: the stream says when it has).
  let loading = false;
  async function start() {
    loading = true;
    try {
      const [detail, overview] = await Promise.all([getJson(path), getJson("/api/v1/dashboard/runs")]);
      if (!detail.metrics.length) throw Object.assign(new Error("no metrics yet"), { status: 404 });
      state.metrics = detail.metrics;
      state.row = overview.runs.find((r) => r.name === run) ?? null;
      state.anomaliesVersion = state.row?.anomalies_updated_at;
      error.hidden = true;
      renderHead();
      await Promise.all([loadCurves(detail.metrics), loadAnomalies(), loadHeatmaps(detail.metrics), loadAmax(), loadPhases()]);
      state.lastSlow = Date.now();
      state.loaded = true;
      main.dataset.ready = "true";
      zoomFromAddress();
    } catch (e) {
      if (e.status !== 404) throw e;
      error.hidden = false;
      error.textContent = `Run ${run} has not reported yet; this page opens it as soon as it does.`;
    } finally {
      loading = false;
    }
  }
  const unsubscribe = subscribe(run, (rows) => {
    const row = rows.find((r) => r.name === run);
    if (!row || !state.alive) return;
    if (!state.loaded) {
      if (!loading) start().catch(fail);
      return;
    }
    state.row = row;
    renderHead();
    if (row.anomalies_updated_at !== state.anomaliesVersion) {
      state.anomaliesVersion = row.anomalies_updated_at;
      loadAnomalies().catch(fail);
    }
    if (row.last_step !== null && row.last_step > (state.lastStep ?? -1)) followTail();
  });
  start().catch(fail);
  phaseSelect.addEventListener("change", () => {
    state.phase = phaseSelect.value;
    loadHeatmaps(state.metrics).catch(fail);
  });

  return () => {
    state.alive = false;
    unsubscribe();
    clearTimeout(state.slowTimer);
    clearTimeout(state.zoomTimer);
    window.removeEventListener("resize", onResize);
    group.destroy();
  };
}

function stat(label, value, testid) {
  return el("div", {}, el("dt", {}, label), el("dd", { dataset: testid ? { testid } : {} }, value));
}
