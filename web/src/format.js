// Formatting shared by the pages: severities (never by colour alone), numbers, times.

export const SEVERITY = {
  ok: { icon: "✓", label: "ok" },
  info: { icon: "ℹ", label: "info" },
  warning: { icon: "▲", label: "warning" },
  critical: { icon: "✖", label: "critical" },
};

/** A badge that says the verdict/severity in words and with a glyph, besides its colour. */
export function badge(level) {
  const s = SEVERITY[level] ?? { icon: "?", label: level ?? "unknown" };
  const el = document.createElement("span");
  el.className = `badge sev-${level}`;
  el.dataset.verdict = level;
  const icon = document.createElement("span");
  icon.className = "icon";
  icon.setAttribute("aria-hidden", "true");
  icon.textContent = s.icon;
  el.append(icon, document.createTextNode(` ${s.label}`));
  return el;
}

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) node.append(c);
  return node;
}

export function fmtInt(n) {
  return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US");
}

// Bytes in decimal units ("12.3 MB"), as `stepwatch-server runs list` prints them.
export function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return i === 0 ? `${n} B` : `${n.toFixed(1)} ${units[i]}`;
}

export function fmtNum(v, digits = 3) {
  if (v === null || v === undefined) return "–";
  if (typeof v === "string") return v;
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
  return Number(v.toPrecision(digits)).toLocaleString("en-US", { maximumFractionDigits: 6 });
}

export function fmtRate(stepsPerS) {
  if (stepsPerS === null || stepsPerS === undefined) return "–";
  return stepsPerS >= 1 ? `${fmtNum(stepsPerS)} steps/s` : `${fmtNum(1 / stepsPerS)} s/step`;
}

/** A duration in words: "45 s", "12 min", "3 h 05 min", "2 d 4 h". */
export function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.round(s / 60)} min`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

/** The step rate of a running run; "finished after <duration>" for one whose every rank closed its session. */
export function fmtPace(row) {
  return row.finished ? `finished after ${fmtDuration(row.duration_s)}` : fmtRate(row.step_rate);
}

export function fmtAgo(iso) {
  if (!iso) return "–";
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}
