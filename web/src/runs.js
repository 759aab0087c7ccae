// The runs page: every run with its verdict, size, progress, pace, open anomalies and disk use, kept live by the
// event stream (each `runs` event carries the rows that changed).
import { getJson } from "./api.js";
import { subscribe } from "./live.js";
import { badge, el, fmtAgo, fmtBytes, fmtInt, fmtPace } from "./format.js";

const COLUMNS = ["Run", "Health", "World size", "Last step", "Step rate or duration", "Open anomalies", "Stored", "Last seen"];
const NUMBER_COLUMNS = new Set(["World size", "Last step", "Step rate or duration", "Open anomalies", "Stored"]); // right-aligned

export function renderRuns(main) {
  document.title = "Runs · stepwatch";
  const rows = new Map();
  const tbody = el("tbody");
  const empty = el("p", { class: "empty", hidden: true }, "No runs yet. Attach the agent to a training loop, or run ",
    el("code", {}, "stepwatch-server demo"), ".");
  main.append(
    el("h1", {}, "Runs"),
    el("p", { class: "lede" }, "Every run the collector has heard from, most recently seen first. Updates live."),
    el("table", { class: "runs", "aria-label": "Runs" },
      el("thead", {}, el("tr", {}, COLUMNS.map((c) => el("th", { scope: "col", class: NUMBER_COLUMNS.has(c) ? "num" : "" }, c)))), tbody),
    empty,
  );

  const render = () => {
    const sorted = [...rows.values()].sort((a, b) => (b.last_seen_at ?? "").localeCompare(a.last_seen_at ?? ""));
    tbody.replaceChildren(...sorted.map(row));
    empty.hidden = sorted.length > 0;
  };
  const update = (list) => {
    for (const r of list) rows.set(r.name, r);
    render();
  };
  getJson("/api/v1/dashboard/runs").then((data) => update(data.runs)).catch((e) => {
    if (e.status !== 401) throw e; // 401: main.js asks for a token
  });
  const unsubscribe = subscribe(null, update);
  const clock = setInterval(render, 5000); // "last seen" ages
  return () => {
    unsubscribe();
    clearInterval(clock);
  };
}

function row(r) {
  const href = `/run/${encodeURIComponent(r.name).replaceAll("%2F", "/")}`;
  return el("tr", { dataset: { run: r.name } },
    el("th", { scope: "row" }, el("a", { href, "data-nav": true }, r.name),
      r.live ? el("span", { class: "pill live" }, "live") : null),
    el("td", {}, badge(r.verdict)),
    el("td", { class: "num" }, fmtInt(r.world_size)),
    el("td", { class: "num", dataset: { field: "last-step" } }, fmtInt(r.last_step)),
    el("td", { class: "num", dataset: { field: "pace" } }, fmtPace(r)),
    el("td", { class: "num" }, r.open_anomalies ? el("a", { href: `${href}#anomalies`, "data-nav": true }, String(r.open_anomalies)) : "0"),
    el("td", { class: "num", dataset: { field: "stored" },
      title: `${fmtInt(r.stored_values)} values; the database's size shared out by stored values` }, fmtBytes(r.stored_bytes)),
    el("td", {}, el("time", { datetime: r.last_seen_at ?? "" }, fmtAgo(r.last_seen_at))),
  );
}
