// The evidence asked at an anomaly (commands, README "Evidence at a verdict"): every rank's stacks at a hang,
// grouped; two ranks' profiler traces at a straggler, linked and compared. Each is a <details> read from the
// API when first opened, and again on each opening while ranks are still to answer.
import { getJson, postJson, runPath } from "./api.js";
import { el, fmtBytes, fmtInt, fmtNum } from "./format.js";

const TITLES = { stacks: "Stacks of every rank", profile: "Profiler traces" };
// A command asked by hand says when; the one the detection asked at the verdict goes without.
const when = (c) => (c.requested_by === "detection" || !c.created_at ? "" : ` (asked ${new Date(c.created_at).toLocaleTimeString()})`);

export function commandViews(a) {
  const views = (a.commands ?? []).map((c) => commandView(a, c));
  const box = el("div", { class: "command-views" }, views);
  if (a.status === "open") box.append(askButton(a, box));
  return [box];
}

// Every rank's stacks now, on demand: asking writes (a command), so a collector with tokens needs a write
// token for the run. It is asked for once, sent in the header of this one request and kept nowhere.
function askButton(a, box) {
  const problem = el("p", { class: "error", role: "alert", hidden: true });
  const button = el("button", { type: "button", class: "ask-stacks", onclick: async () => {
    button.disabled = true;
    problem.hidden = true;
    try {
      const c = await postCommand(a, { kind: "stacks", anomaly_id: a.id });
      const view = commandView(a, c);
      box.insertBefore(view, wrapper);
      view.open = true;
    } catch (e) {
      problem.textContent = `Could not ask the ranks: ${e.message}`;
      problem.hidden = false;
    } finally {
      button.disabled = false;
    }
  } }, "Ask every rank for its stacks now");
  const wrapper = el("div", { class: "ask" }, button, problem);
  return wrapper;
}

async function postCommand(a, body) {
  try {
    return await postJson(`${runPath(a.run)}/commands`, body);
  } catch (e) {
    if (e.status !== 401 && e.status !== 403) throw e;
    const token = window.prompt(`Asking the ranks of ${a.run} writes: paste a write token for this run (it is not kept)`);
    if (!token) throw e;
    return postJson(`${runPath(a.run)}/commands`, body, token);
  }
}

// The views open on this page, by command id: the anomaly list is drawn again when an anomaly changes, and
// what the reader opened stays open (and is read again).
const opened = new Set();

function commandView(a, c) {
  const body = el("div", { class: "command-body" }, el("p", { class: "muted" }, "Loading…"));
  const box = el("details", { class: "command", dataset: { kind: c.kind, id: c.id } },
    el("summary", {}, `${TITLES[c.kind] ?? c.kind}${when(c)}`), body);
  let settled = false;
  box.addEventListener("toggle", async () => {
    if (box.open) opened.add(c.id);
    else opened.delete(c.id);
    if (!box.open || settled) return;
    try {
      const view = await getJson(`${runPath(a.run)}/commands/${c.id}`);
      settled = view.ranks.every((r) => r.status !== "waiting");
      body.replaceChildren(...render(view));
      box.dataset.ready = "true";
    } catch (e) {
      body.replaceChildren(el("p", { class: "error" }, `Could not read the evidence: ${e.message}`));
    }
  });
  if (opened.has(c.id)) box.open = true;
  return box;
}

function render(view) {
  const counts = {};
  for (const r of view.ranks) counts[r.status] = (counts[r.status] ?? []).concat(r.rank);
  const status = Object.entries(counts).map(([s, ranks]) => `${s}: ${ranksText(ranks)}`).join(" · ");
  const parts = [el("p", { class: "command-status" }, status)];
  for (const r of view.ranks) if (r.message) parts.push(el("p", { class: "muted" }, `rank ${r.rank}: ${r.message}`));
  if (view.kind === "stacks") parts.push(...(view.groups ?? []).map(group));
  if (view.kind === "profile") parts.push(...profile(view));
  return parts;
}

function ranksText(ranks) {
  return ranks.length > 8 ? `${fmtInt(ranks.length)} ranks` : `rank${ranks.length > 1 ? "s" : ""} ${ranks.join(", ")}`;
}

function group(g) {
  const more = g.count > g.ranks.length ? ` and ${fmtInt(g.count - g.ranks.length)} more` : "";
  return el("div", { class: "stack-group", dataset: { count: g.count, ranks: g.ranks.join(",") } },
    el("p", { class: "stack-summary" }, g.summary),
    el("p", { class: "muted" }, `ranks ${g.ranks.join(", ")}${more}`),
    el("ol", { class: "frames" }, g.frames.map((f) =>
      el("li", { class: f.own ? "own" : null, title: f.file }, el("code", {}, f.function), ` ${f.file.split("/").pop()}:${f.line}`))));
}

function profile(view) {
  const links = (view.traces ?? []).map((t) =>
    el("a", { href: t.url, download: `stepwatch-${view.id}-rank${t.rank}.json.gz`, class: "trace-link", dataset: { rank: t.rank } },
      `rank ${t.rank} trace (${fmtBytes(t.bytes)})`));
  const out = [el("p", { class: "traces" }, ...links.flatMap((l, i) => (i ? [" · ", l] : [l])),
    links.length ? el("span", { class: "muted" }, " — open in Perfetto (ui.perfetto.dev)") : "no trace yet")];
  const cmp = view.comparison;
  if (cmp) {
    const ms = (us) => fmtNum(us / 1000, 3);
    out.push(el("p", {}, `Time per step by operator, rank ${cmp.slow_rank} against rank ${cmp.peer_rank} (ms):`),
      el("table", { class: "ops" },
        el("thead", {}, el("tr", {}, el("th", {}, "operator"), el("th", {}, `r${cmp.slow_rank}`), el("th", {}, `r${cmp.peer_rank}`), el("th", {}, "diff"))),
        el("tbody", {}, cmp.ops.slice(0, 8).map((o) =>
          el("tr", {}, el("td", {}, el("code", {}, o.name)), el("td", {}, ms(o.slow_us)), el("td", {}, ms(o.peer_us)), el("td", {}, ms(o.diff_us)))))));
  }
  return out;
}
