// One entry of a run's anomaly list: severity in words and glyph, kind, status, summary, who is blamed
// and when, the evidence (and what its ranks sent when asked: commands.js), and a button that takes every
// chart to its step (`onGoto`).
import { commandViews } from "./commands.js";
import { badge, el, fmtInt, fmtNum } from "./format.js";

export function anomalyItem(a, onGoto) {
  const blamed = a.rank !== null ? `rank ${a.rank}${a.node ? ` (${a.node})` : ""}` : a.node ? `node ${a.node}` : "whole run";
  const steps = a.last_step > a.first_step ? `steps ${fmtInt(a.first_step)}–${fmtInt(a.last_step)}` : `step ${fmtInt(a.first_step)}`;
  return el("li", { class: `anomaly sev-${a.severity}`, dataset: { kind: a.kind, rank: a.rank ?? "", firstStep: a.first_step, id: a.id } },
    el("div", { class: "anomaly-head" }, badge(a.severity), el("strong", {}, a.kind.replaceAll("_", " ")),
      el("span", { class: `status ${a.status}` }, a.status)),
    el("p", { class: "summary" }, a.summary),
    el("p", { class: "meta" }, `${blamed} · ${steps}`),
    el("div", { class: "anomaly-actions" },
      el("button", { type: "button", class: "goto", onclick: () => onGoto(a) }, `Show step ${fmtInt(a.first_step)}`),
      el("a", { href: `#anomaly=${a.id}`, class: "permalink", onclick: (e) => { e.preventDefault(); onGoto(a); } }, "link"),
      evidence(a.evidence), ...commandViews(a)),
  );
}

// Units at the end of an evidence key, in words; the rest of the key's snake_case becomes a phrase.
const UNITS = [["_ms", "ms"], ["_mb", "MB"], ["_s", "s"], ["_pct", "%"], ["_per_step", "per step"]];
const WORDS = { n: "number of", pct: "%", ts: "time", id: "id", ids: "ids", fp8: "FP8", amax: "amax", mad: "MAD", sd: "SD", sds: "SDs" };

/** An evidence key as words: `ratio_to_peers` -> "Ratio to peers", `step_ms` -> "Step (ms)". */
export function label(key) {
  const unit = UNITS.find(([suffix]) => key.endsWith(suffix) && key.length > suffix.length);
  const stem = unit ? key.slice(0, -unit[0].length) : key;
  const words = stem.split("_").filter(Boolean).map((w) => WORDS[w] ?? w).join(" ");
  const phrase = words.charAt(0).toUpperCase() + words.slice(1);
  return unit ? `${phrase} (${unit[1]})` : phrase;
}

function evidence(ev) {
  if (!ev || !Object.keys(ev).length) return null;
  const rows = Object.entries(ev).map(([k, v]) => el("tr", { dataset: { key: k } }, el("th", { scope: "row", title: k }, label(k)),
    el("td", {}, typeof v === "number" ? fmtNum(v, 4) : typeof v === "string" ? v : JSON.stringify(v).slice(0, 200))));
  return el("details", { class: "evidence" }, el("summary", {}, "Evidence"), el("table", {}, el("tbody", {}, rows)));
}
