// One entry of a run's anomaly list: severity in words and glyph, kind, status, summary, who is blamed
// and when, the evidence, and a button that takes every chart to its step (`onGoto`).
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
      evidence(a.evidence)),
  );
}

function evidence(ev) {
  if (!ev || !Object.keys(ev).length) return null;
  const rows = Object.entries(ev).map(([k, v]) => el("tr", {}, el("th", { scope: "row" }, k),
    el("td", {}, typeof v === "number" ? fmtNum(v, 4) : typeof v === "string" ? v : JSON.stringify(v).slice(0, 200))));
  return el("details", { class: "evidence" }, el("summary", {}, "Evidence"), el("table", {}, el("tbody", {}, rows)));
}
