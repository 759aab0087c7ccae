// Step-axis charts (uPlot) that share one x scale: zoom or pan one and every chart (and every listener,
// e.g. the heatmaps) follows. Anomalies are drawn on all of them as vertical markers, known pauses
// (`watch.phase("eval")`, checkpoints) as grey ticks at the step they followed, labelled where there is room.
import uPlot from "uplot";

const AXIS = { stroke: "#aab2bf", grid: { stroke: "rgba(255,255,255,0.07)" }, ticks: { stroke: "rgba(255,255,255,0.15)" } };
export const Y_AXIS_PX = 64; // fixed, so that heatmaps below can line their columns up with the charts
const SEVERITY_COLOUR = { info: "#6ea8fe", warning: "#f2a93b", critical: "#ff5c5c" };

export class ChartGroup {
  constructor() {
    this.charts = [];
    this.anomalies = [];
    this.phases = []; // [{step, phase}]: a known pause after that step
    this.selected = null; // the anomaly id highlighted
    this.range = null; // [min, max] steps shown, null = everything
    this.listeners = [];
    this._syncing = false;
  }

  /** A chart of `series` ([{label, stroke}]) over one x (steps) array, appended to `parent`. */
  add(parent, { title, series, log = false, height = 170, yFormat, yRange, extraDraw }) {
    const group = this;
    const width = Math.max(320, parent.clientWidth || 600);
    const opts = {
      width,
      height,
      title,
      scales: { x: { time: false }, y: { ...(log ? { distr: 3 } : {}), ...(yRange ? { range: yRange } : log ? { range: logRange } : {}) } },
      series: [{ label: "step", value: (u, v) => (v === null ? "–" : Math.round(v).toLocaleString("en-US")) },
        ...series.map((s) => ({ width: 1.5, spanGaps: false, points: { show: false }, ...s,
          value: (u, v) => (v === null ? "–" : (yFormat ?? fmt)(v)) }))],
      axes: [{ ...AXIS }, { ...AXIS, size: Y_AXIS_PX, values: (u, vals) => vals.map((v) => (yFormat ?? fmt)(v)) }],
      cursor: { sync: { key: "stepwatch-steps", setSeries: false }, drag: { x: true, y: false } },
      legend: { live: true },
      hooks: {
        setScale: [(u, key) => {
          if (key !== "x") return;
          u.root.dataset.xMin = String(Math.round(u.scales.x.min ?? 0)); // what is shown, for people and tests
          u.root.dataset.xMax = String(Math.round(u.scales.x.max ?? 0));
          group._onScale(u);
        }],
        draw: [(u) => { group._drawMarkers(u); extraDraw?.(u); }],
      },
    };
    const data = [[], ...series.map(() => [])];
    const chart = new uPlot(opts, data, parent);
    chart.over.addEventListener("dblclick", () => this.setRange(null));
    this.charts.push(chart);
    return chart;
  }

  setData(chart, data) {
    this._syncing = true; // new data is not a zoom
    try {
      chart.setData(data, false);
      const [lo, hi] = this.range ?? this.extent();
      if (Number.isFinite(lo) && hi > lo) {
        for (const c of this.charts) if (c.data[0].length) c.setScale("x", { min: lo, max: hi });
      }
    } finally {
      this._syncing = false;
    }
  }

  setAnomalies(anomalies) {
    this.anomalies = anomalies;
    for (const c of this.charts) c.redraw(false, false);
  }

  setPhases(phases) {
    this.phases = phases;
    for (const c of this.charts) c.redraw(false, false);
  }

  select(anomalyId) {
    this.selected = anomalyId;
    for (const c of this.charts) c.redraw(false, false);
  }

  /** Show steps [min, max] on every chart (null: all of them). */
  setRange(range) {
    this.range = range;
    this._syncing = true;
    try {
      for (const c of this.charts) {
        if (range === null) {
          const [lo, hi] = this.extent();
          if (Number.isFinite(lo)) c.setScale("x", { min: lo, max: hi });
        } else {
          c.setScale("x", { min: range[0], max: range[1] });
        }
      }
    } finally {
      this._syncing = false;
    }
    this._notify(range === null);
  }

  /** The first and last step over every chart's data. */
  extent() {
    let lo = Infinity;
    let hi = -Infinity;
    for (const c of this.charts) {
      const xs = c.data[0];
      if (xs.length) { lo = Math.min(lo, xs[0]); hi = Math.max(hi, xs[xs.length - 1]); }
    }
    return [lo, hi];
  }

  onRange(listener) {
    this.listeners.push(listener);
  }

  resize(width) {
    for (const c of this.charts) c.setSize({ width: Math.max(320, width), height: c.height });
  }

  /** Take `chart` (one `add` made) off the page and out of the group. */
  remove(chart) {
    this.charts = this.charts.filter((c) => c !== chart);
    chart.destroy();
  }

  destroy() {
    for (const c of this.charts) c.destroy();
    this.charts = [];
  }

  _onScale(u) {
    if (this._syncing || !u.data[0].length) return; // a chart's first, empty scale is not a zoom
    const { min, max } = u.scales.x;
    if (min === null || max === null || min === undefined) return;
    const [lo, hi] = this.extent();
    const full = min <= lo && max >= hi;
    this._syncing = true;
    try {
      for (const c of this.charts) if (c !== u) c.setScale("x", { min, max });
    } finally {
      this._syncing = false;
    }
    this.range = full ? null : [min, max];
    this._notify(full);
  }

  _notify(full) {
    for (const fn of this.listeners) fn(this.range, full);
  }

  _drawMarkers(u) {
    const { ctx } = u;
    const top = u.bbox.top;
    const bottom = top + u.bbox.height;
    ctx.save();
    ctx.strokeStyle = "rgba(170, 178, 191, 0.45)";
    ctx.fillStyle = "#aab2bf";
    ctx.lineWidth = devicePixelRatio;
    ctx.setLineDash([2 * devicePixelRatio, 3 * devicePixelRatio]);
    ctx.font = `${10 * devicePixelRatio}px system-ui, sans-serif`;
    ctx.textBaseline = "bottom";
    let labelledUpTo = -Infinity;
    for (const p of this.phases) {
      const x = u.valToPos(p.step + 0.5, "x", true);
      if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, bottom);
      ctx.stroke();
      if (x > labelledUpTo) { // a label where the last one ends, not on top of it
        ctx.fillText(p.phase, x + 2 * devicePixelRatio, bottom - 2 * devicePixelRatio);
        labelledUpTo = x + ctx.measureText(p.phase).width + 8 * devicePixelRatio;
      }
    }
    ctx.setLineDash([]);
    for (const a of this.anomalies) {
      const x = u.valToPos(a.first_step, "x", true);
      if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
      const selected = a.id === this.selected;
      ctx.strokeStyle = SEVERITY_COLOUR[a.severity] ?? "#ccc";
      ctx.lineWidth = (selected ? 3 : 1.25) * devicePixelRatio;
      ctx.setLineDash(a.severity === "critical" || selected ? [] : [5 * devicePixelRatio, 4 * devicePixelRatio]);
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, bottom);
      ctx.stroke();
      ctx.fillStyle = ctx.strokeStyle;
      const s = 5 * devicePixelRatio;
      ctx.beginPath(); // a small triangle: markers stay distinguishable from the data without colour
      ctx.moveTo(x - s, top);
      ctx.lineTo(x + s, top);
      ctx.lineTo(x, top + s * 1.6);
      ctx.fill();
    }
    ctx.restore();
  }
}

/** A log axis that ends near the data (uPlot's default rounds out to whole decades: 10-100 ms data on an
axis to 10,000). */
function logRange(u, min, max) {
  const lo = Math.max(min ?? 1, 1e-9);
  return uPlot.rangeLog(lo, Math.max(max ?? lo, lo), 10, false);
}

export function fmt(v) {
  if (v === null || v === undefined) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(1);
  return Number(v.toPrecision(3)).toString();
}

/** Merge a detailed stretch [lo, hi] into an overview series: overview outside, detail inside. */
export function mergeDetail(steps, values, dSteps, dValues, lo, hi) {
  const xs = [];
  const ys = [];
  let i = 0;
  while (i < steps.length && steps[i] < lo) { xs.push(steps[i]); ys.push(values[i]); i++; }
  for (let j = 0; j < dSteps.length; j++) { xs.push(dSteps[j]); ys.push(dValues[j]); }
  while (i < steps.length && steps[i] <= hi) i++;
  while (i < steps.length) { xs.push(steps[i]); ys.push(values[i]); i++; }
  return [xs, ys];
}

export { uPlot };
