// Activation amax per module (max over ranks, from /api/v1/runs/<run>/amax) on the shared step axis,
// log scale, against FP8 E4M3's largest value; and a table of each module's headroom, in words too.
import { finiteOrNull, toNumber } from "./api.js";
import { uPlot } from "./charts.js";
import { badge, el, fmtNum } from "./format.js";

const MODULE_COLOURS = ["#6ea8fe", "#f472b6", "#5eead4", "#fbbf24", "#c084fc", "#a3e635", "#fb923c", "#38bdf8"];
// Modules drawn (a colour each): the ones with the highest amax in the range, from `top` of /amax. A large model
// tracks hundreds (every Linear): that many lines say nothing, and their curves cost the page seconds to read.
export const AMAX_TOP = MODULE_COLOURS.length;
const TIGHT_HEADROOM = 4; // under 2 bits of headroom is a warning

export class AmaxPanel {
  constructor(box, table, note, group) {
    this.box = box;
    this.table = table;
    this.note = note;
    this.group = group;
    this.chart = null;
    this.names = [];
  }

  show(d) {
    if (!d.modules.length) {
      this.box.replaceChildren(el("p", { class: "muted" }, "No amax recorded (the agent samples it every 10 steps by default)."));
      return;
    }
    const limit = d.e4m3_max;
    const names = d.modules.map((m) => m.name);
    this.note.textContent = d.tracked > names.length
      ? `the ${names.length} of ${d.tracked} modules with the highest amax in this range (a NaN first)` : "";
    this.note.hidden = !this.note.textContent;
    const same = names.length === this.names.length && names.every((n) => this.names.includes(n));
    if (this.chart && !same) { // another range, or a live run, put other modules on top: a line (and a colour) each
      this.group.remove(this.chart);
      this.chart = null;
    }
    if (!this.chart) {
      this.box.replaceChildren();
      const series = d.modules.map((m, i) => ({ label: m.name, stroke: MODULE_COLOURS[i % MODULE_COLOURS.length] }));
      // Keep the limit in view however small the values are: the distance to it is the point.
      const yRange = (u, min, max) => uPlot.rangeLog(Math.max(1e-3, min ?? 1), Math.max(max ?? 1, limit * 1.5), 10, true);
      this.chart = this.group.add(this.box, { title: "", series, log: true, height: 220, yRange, extraDraw: (u) => drawLimit(u, limit) });
      this.names = names;
    }
    const tables = this.names.map((name) => {
      const m = d.modules.find((x) => x.name === name) ?? { steps: [], values: [] };
      return [m.steps, finiteOrNull(m.values)];
    });
    this.group.setData(this.chart, tables.length === 1 ? tables[0] : joinTables(tables));
    this.table.replaceChildren(
      el("thead", {}, el("tr", {}, ["Module", "Latest amax", `Headroom to ${limit}`, "Status"].map((h, i) => el("th", { scope: "col", class: i === 1 || i === 2 ? "num" : "" }, h)))),
      el("tbody", {}, d.modules.map((m) => headroomRow(m, limit))),
    );
  }
}

function headroomRow(m, limit) {
  const latest = toNumber(m.latest);
  const room = latest > 0 && Number.isFinite(latest) ? limit / latest : null;
  let level;
  let words;
  if (latest === null) [level, words] = ["ok", "no sample yet"];
  else if (Number.isNaN(latest)) [level, words] = ["critical", "NaN: a non-finite output (see the nonfinite anomaly), not an overflow"];
  else if (!Number.isFinite(latest)) [level, words] = ["critical", "infinite: overflows any format"];
  else if (room < 1) [level, words] = ["critical", "overflows FP8"];
  else if (room < TIGHT_HEADROOM) [level, words] = ["warning", "under 2 bits of headroom"];
  else [level, words] = ["ok", "fits"];
  const shown = Number.isNaN(latest) ? "NaN" : fmtNum(latest);
  return el("tr", { dataset: { module: m.name, level } }, el("th", { scope: "row" }, el("code", {}, m.name)), el("td", { class: "num" }, shown),
    el("td", { class: "num" }, room === null ? "–" : `${fmtNum(room)}× (${fmtNum(Math.log2(room), 2)} bits)`),
    el("td", {}, badge(level), ` ${words}`));
}

function drawLimit(u, limit) {
  const y = u.valToPos(limit, "y", true);
  if (y < u.bbox.top || y > u.bbox.top + u.bbox.height) return;
  const { ctx } = u;
  ctx.save();
  ctx.strokeStyle = "#ff5c5c";
  ctx.lineWidth = 1.5 * devicePixelRatio;
  ctx.setLineDash([6 * devicePixelRatio, 4 * devicePixelRatio]);
  ctx.beginPath();
  ctx.moveTo(u.bbox.left, y);
  ctx.lineTo(u.bbox.left + u.bbox.width, y);
  ctx.stroke();
  ctx.fillStyle = "#ff5c5c";
  ctx.textAlign = "left";
  ctx.textBaseline = "alphabetic";
  ctx.font = `${11 * devicePixelRatio}px system-ui, sans-serif`;
  ctx.fillText(`FP8 E4M3 max ${limit}`, u.bbox.left + 6 * devicePixelRatio, y - 4 * devicePixelRatio);
  ctx.restore();
}

/** Several (steps, values) tables on one x: the union of the steps, null where a table has none. */
function joinTables(tables) {
  const xs = [...new Set(tables.flatMap((t) => t[0]))].sort((a, b) => a - b);
  const index = new Map(xs.map((x, i) => [x, i]));
  return [xs, ...tables.map(([steps, values]) => {
    const out = new Array(xs.length).fill(null);
    steps.forEach((s, i) => (out[index.get(s)] = values[i]));
    return out;
  })];
}
