// A ranks x steps heatmap on a canvas: one row per rank, one column per bucket of steps, from
// /api/v1/runs/<run>/heatmap. Relative mode (each cell / the bucket's cross-rank median) and late mode
// (1 + how late the rank reaches its step's sync points / the median step: who holds the run up) use a
// diverging scale centred on 1.0, so a straggler is a warm horizontal line; absolute mode (memory) a
// sequential one. A line under it names, in words, the rank that stands out most over the cells shown.
// The left margin equals the charts' y axis, so columns line up with their steps.
import { Y_AXIS_PX } from "./charts.js";
import { el, fmtNum } from "./format.js";
import { fewestLateColumns } from "./noise.js";

const DIVERGING = [[49, 99, 196], [38, 42, 54], [242, 169, 59], [255, 72, 72]]; // <1, 1, >1, >>1
const SEQUENTIAL = [[30, 34, 48], [46, 110, 160], [110, 190, 140], [250, 220, 90]];
const NEUTRAL_BAND = 0.03; // within ±3% of the median of all ranks: like its peers (noise), drawn neutral
// Late mode from raw points: a cell also stays neutral within this many standard errors of its rank's
// per-step lateness there (the answer's `noise`): one step's hiccup is noise, a rank late step after step
// is not (~99% two-sided for a normal mean).
const NOISE_Z = 2.5;
const MIN_SPAN = 0.05; // an absolute scale spans at least 5% of its top: 367-370 MB is drift, not a leak
const TOP_PX = 8; // room above the first row, so its label is not cut
const LABEL_PX = 13; // the height one rank label needs

function lerp(stops, t) {
  const x = Math.min(1, Math.max(0, t)) * (stops.length - 1);
  const i = Math.min(stops.length - 2, Math.floor(x));
  const f = x - i;
  return stops[i].map((c, k) => Math.round(c + (stops[i + 1][k] - c) * f));
}

export class Heatmap {
  constructor(parent, { label, mode, unit }) {
    this.mode = mode;
    this.unit = unit ?? "";
    this.data = null;
    this.highlight = null; // a rank
    this.canvas = el("canvas", { class: "heatmap", role: "img", "aria-label": label });
    this.tip = el("div", { class: "heat-tip", role: "status", "aria-live": "polite" }, "Hover a cell for its rank, steps and value.");
    this.legend = el("div", { class: "heat-legend" });
    this.summary = el("p", { class: "heat-summary", role: "status" });
    parent.append(this.canvas, this.summary, this.legend, this.tip);
    this.canvas.addEventListener("mousemove", (e) => this._hover(e));
    this.canvas.addEventListener("mouseleave", () => (this.tip.textContent = "Hover a cell for its rank, steps and value."));
  }

  setData(data) {
    this.data = data;
    const steps = data?.steps ?? [];
    this.canvas.dataset.firstStep = steps.length ? String(steps[0]) : "";
    this.canvas.dataset.lastStep = steps.length ? String(steps.at(-1) + (data.bucket_steps ?? 1) - 1) : "";
    this.draw();
  }

  setMode(mode) {
    this.mode = mode;
  }

  get relative() {
    return this.mode === "median" || this.mode === "late";
  }

  setHighlight(rank) {
    this.highlight = rank;
    this.draw();
  }

  // The half-width of cell (r, c)'s neutral band.
  _band(r, c) {
    const noise = this.data?.noise?.[r]?.[c];
    return noise == null ? NEUTRAL_BAND : Math.max(NEUTRAL_BAND, NOISE_Z * noise);
  }

  _colour(v, scale, band = NEUTRAL_BAND) {
    if (v === null) return null;
    if (this.relative) {
      // within the band -> neutral; 0.85 -> blue; 1.1 -> amber; >= 1.3 -> red
      if (Math.abs(v - 1) <= band) return DIVERGING[1];
      if (v < 1) return lerp(DIVERGING, Math.max(0, (v - 0.85) / (0.15 - NEUTRAL_BAND)) / 3);
      return lerp(DIVERGING, 1 / 3 + Math.min(1, (v - 1 - NEUTRAL_BAND) / (0.3 - NEUTRAL_BAND)) * (2 / 3));
    }
    return lerp(SEQUENTIAL, (v - scale.lo) / (scale.hi - scale.lo || 1));
  }

  draw() {
    const d = this.data;
    const dpr = devicePixelRatio || 1;
    const width = Math.max(320, this.canvas.parentElement.clientWidth);
    const rows = d ? d.ranks.length : 0;
    const rowPx = rows > 128 ? 1 : rows > 32 ? 3 : LABEL_PX + 1; // up to 32 ranks: every one labelled
    const plotH = Math.max(64, rows * rowPx);
    const top = TOP_PX;
    const height = top + plotH + 22;
    this.canvas.style.width = `${width}px`;
    this.canvas.style.height = `${height}px`;
    this.canvas.width = Math.round(width * dpr);
    this.canvas.height = Math.round(height * dpr);
    const ctx = this.canvas.getContext("2d");
    ctx.scale(dpr, dpr);
    ctx.fillStyle = "#161a22";
    ctx.fillRect(0, 0, width, height);
    if (!d || rows === 0 || d.steps.length === 0) {
      ctx.fillStyle = "#aab2bf";
      ctx.font = "13px system-ui, sans-serif";
      ctx.fillText("no data", Y_AXIS_PX + 8, 24);
      this._summarise(null);
      return;
    }
    const left = Y_AXIS_PX;
    const plotW = width - left - 8;
    const cols = d.steps.length;
    const x0 = d.steps[0];
    const x1 = d.steps[cols - 1] + d.bucket_steps;
    const scale = this._scale(d);
    this.geometry = { left, top, plotW, plotH, rowPx: plotH / rows, x0, x1 };
    ctx.translate(0, top);
    const cellW = plotW / cols;
    const cellH = plotH / rows;
    let cells = 0;
    let outside = 0;
    for (let r = 0; r < rows; r++) {
      const values = d.values[r];
      for (let c = 0; c < cols; c++) {
        const band = this._band(r, c);
        const rgb = this._colour(values[c], scale, band);
        if (!rgb) continue;
        cells++;
        if (this.relative && Math.abs(values[c] - 1) > band) outside++;
        ctx.fillStyle = `rgb(${rgb[0]},${rgb[1]},${rgb[2]})`;
        ctx.fillRect(left + c * cellW, r * cellH, Math.ceil(cellW), Math.ceil(cellH));
      }
    }
    ctx.fillStyle = "#aab2bf";
    ctx.font = "11px system-ui, sans-serif";
    ctx.textAlign = "right";
    const every = Math.max(1, Math.ceil(LABEL_PX / cellH)); // the others: on hover, and the blamed rank
    let labelled = 0;
    for (let r = 0; r < rows; r += every, labelled++) ctx.fillText(`rank ${d.ranks[r]}`, left - 6, r * cellH + cellH / 2 + 4);
    this.canvas.dataset.labelledRanks = String(labelled);
    this.canvas.dataset.outside = String(cells ? outside / cells : 0); // cells outside the neutral band
    ctx.textAlign = "center";
    const ticks = Math.max(2, Math.floor(plotW / 110));
    for (let i = 0; i <= ticks; i++) {
      const step = x0 + ((x1 - x0) * i) / ticks;
      ctx.textAlign = i === 0 ? "left" : i === ticks ? "right" : "center"; // the ends stay inside
      ctx.fillText(Math.round(step).toLocaleString("en-US"), left + (plotW * i) / ticks, plotH + 15);
    }
    if (this.highlight !== null) {
      const r = d.ranks.indexOf(this.highlight);
      if (r >= 0) {
        ctx.strokeStyle = "#ffffff";
        ctx.lineWidth = 2;
        ctx.setLineDash([4, 3]);
        ctx.strokeRect(left + 1, r * cellH - 2, plotW - 2, cellH + 4);
        ctx.setLineDash([]);
        ctx.textAlign = "left";
        ctx.fillStyle = "#ffffff";
        ctx.font = "bold 12px system-ui, sans-serif";
        ctx.fillText(`◀ rank ${this.highlight}`, left + 6, Math.max(12, r * cellH - 6));
      }
    }
    this._drawLegend(scale);
    this._summarise(d);
  }

  // The rank that stands out most over the cells shown, in words (data-rank for tests): of the ranks
  // above their neutral band in more columns than noise gives (a line, not a few stray dots: see
  // noise.js), the one with the most excess over all of them.
  _summarise(d) {
    const s = this.summary;
    s.dataset.rank = "";
    if (!this.relative || !d || !d.ranks.length) {
      s.textContent = "";
      return;
    }
    let best = null;
    d.values.forEach((row, r) => {
      const above = row.map((v, c) => (v !== null && v - 1 > this._band(r, c) ? v - 1 : null)).filter((x) => x !== null);
      if (above.length < fewestLateColumns(row.filter((v) => v !== null).length)) return;
      const excess = above.reduce((a, b) => a + b, 0);
      if (best === null || excess > best.excess) best = { rank: d.ranks[r], excess, columns: above.length, of: row.filter((v) => v !== null).length };
    });
    if (best === null) {
      s.textContent = this.mode === "late" ? "No rank holds the others up beyond noise over these steps." : "No rank stands out beyond noise over these steps.";
      return;
    }
    s.dataset.rank = String(best.rank);
    const mean = best.excess / best.columns;
    s.textContent = this.mode === "late"
      ? `Holding the run up most: rank ${best.rank} — late in ${best.columns} of ${best.of} columns, the others waiting ${fmtNum(mean * 100)}% of a step for it there.`
      : `Slowest here: rank ${best.rank} — above its peers in ${best.columns} of ${best.of} columns, by ${fmtNum(mean * 100)}% there.`;
  }

  _scale(d) {
    if (this.relative) return { lo: 0.85, hi: 1.3 };
    // The 2nd to 98th percentile: a warm-up ramp or one outlier does not flatten everything else.
    const all = d.values.flat().filter((v) => v !== null).sort((a, b) => a - b);
    if (!all.length) return { lo: 0, hi: 1 };
    const at = (q) => all[Math.min(all.length - 1, Math.floor(q * all.length))];
    const [lo, hi] = [at(0.02), at(0.98)];
    const span = Math.max(hi - lo, Math.abs(hi) * MIN_SPAN);
    const mid = (lo + hi) / 2;
    this.canvas.dataset.scaleLo = String(mid - span / 2);
    this.canvas.dataset.scaleHi = String(mid + span / 2);
    return { lo: mid - span / 2, hi: mid + span / 2 };
  }

  _drawLegend(scale) {
    const stops = this.relative ? DIVERGING : SEQUENTIAL;
    const gradient = `linear-gradient(90deg, ${stops.map((c) => `rgb(${c.join(",")})`).join(", ")})`;
    const band = Math.round(NEUTRAL_BAND * 100);
    const words = {
      median: ["0.85× median (faster)", "≥ 1.3× median (slower)", `within ±${band}% of the median: like its peers (noise), neutral`],
      late: ["ahead of its peers", "the run waits ≥ 30% of a step for it", `within ±${band}% of a step or its own step-to-step noise: on time, neutral`],
    }[this.mode] ?? [`≤ ${fmtNum(scale.lo)} ${this.unit}`, `≥ ${fmtNum(scale.hi)} ${this.unit}`, ""];
    const [lo, hi, mid] = words;
    const parts = [
      el("span", {}, lo),
      el("span", { class: "bar", style: `background: ${gradient}`, "aria-hidden": "true" }),
      el("span", {}, hi),
    ];
    if (mid) parts.push(el("span", { class: "muted" }, mid));
    this.legend.replaceChildren(...parts);
  }

  _hover(e) {
    const g = this.geometry;
    const d = this.data;
    if (!g || !d) return;
    const rect = this.canvas.getBoundingClientRect();
    const x = e.clientX - rect.left - g.left;
    const y = e.clientY - rect.top - g.top;
    if (x < 0 || x > g.plotW || y < 0 || y > g.plotH) return;
    const c = Math.floor((x / g.plotW) * d.steps.length);
    const r = Math.floor(y / g.rowPx);
    const v = d.values[r]?.[c];
    const from = d.steps[c];
    const late = v === null || v === undefined ? "" : v >= 1 ? `the run waits ${fmtNum((v - 1) * 100)}% of a step for it` : `ahead of its peers by ${fmtNum((1 - v) * 100)}% of a step`;
    const neutral = this.relative && v != null ? ` (neutral within ±${fmtNum(this._band(r, c) * 100)}%)` : "";
    const what = { median: `${fmtNum(v)}× the median of all ranks`, late }[this.mode] ?? `${fmtNum(v)} ${this.unit}`;
    this.tip.textContent = `rank ${d.ranks[r]}, steps ${from.toLocaleString("en-US")}–${(from + d.bucket_steps - 1).toLocaleString("en-US")}: ${v === null || v === undefined ? "no data" : what}${neutral}`;
  }
}
