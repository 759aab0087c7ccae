// The collector's event stream (/api/v1/stream): `runs` events with the overview rows that changed.
// EventSource reconnects by itself; the header says whether the page is live, in words.

const status = () => document.getElementById("live-status");

export function subscribe(run, onRuns) {
  const url = run ? `/api/v1/stream?run=${encodeURIComponent(run)}` : "/api/v1/stream";
  const source = new EventSource(url);
  source.addEventListener("open", () => setStatus("live", "● live"));
  source.addEventListener("error", () => setStatus("offline", "○ reconnecting…"));
  source.addEventListener("runs", (event) => onRuns(JSON.parse(event.data).runs));
  return () => source.close();
}

function setStatus(state, text) {
  const node = status();
  if (!node) return;
  node.dataset.state = state;
  node.textContent = text;
}
