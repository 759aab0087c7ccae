// Opens each named run's page in a real browser, opens the evidence of its first anomaly of the named kind
// (the command the detection asked at it: stacks at a hang, traces at a straggler) and reports what the page
// shows: the stack groups with their summaries and the project's own frames, or the trace links (each
// fetched: status and type) and the first rows of the operator table; on the stacks run it then presses
// "Ask every rank for its stacks now" and reports the new command's view. Prints one JSON report on stdout;
// tests/web/test_evidence_view.py asserts on it.
//
// env: STEPWATCH_URL (the collector), RUNS (`label=run=kind` triples, comma-separated), CHROMIUM, SCREENSHOTS
// (a folder: one `evidence-<label>.png` of each anomaly with its evidence open).
import { launch, loopback } from "./browser.mjs";

const base = process.env.STEPWATCH_URL;
const runs = process.env.RUNS.split(",").map((triple) => triple.split("="));
const shots = process.env.SCREENSHOTS;
setTimeout(() => { console.error("evidence.mjs: overall timeout"); process.exit(3); }, 90_000).unref();

const report = { runs: {}, blocked: [], pageErrors: [], consoleErrors: [] };
const browser = await launch();
try {
  const context = await browser.newContext({ viewport: { width: 1440, height: 1000 }, deviceScaleFactor: 1 });
  await context.route("**/*", (route) => {
    if (loopback(route.request().url())) return route.continue();
    report.blocked.push(route.request().url());
    return route.abort();
  });
  for (const [label, run, kind] of runs) {
    const page = await context.newPage();
    page.on("pageerror", (e) => report.pageErrors.push(`${run}: ${e.message}`));
    page.on("console", (m) => { if (m.type() === "error") report.consoleErrors.push(`${run}: ${m.text()}`); });
    await page.goto(`${base}/run/${encodeURIComponent(run)}`);
    await page.locator('main[data-ready="true"]').waitFor({ timeout: 30_000 });
    const item = page.locator(`li.anomaly[data-kind="${kind}"]`).first();
    await item.waitFor({ timeout: 15_000 });
    const box = item.locator("details.command").first();
    const title = (await box.locator("summary").innerText()).trim();
    await box.locator("summary").click();
    await item.locator('details.command[data-ready="true"]').waitFor({ timeout: 15_000 });
    const seen = { title, status: (await box.locator(".command-status").innerText()).trim() };
    seen.groups = await box.locator(".stack-group").evaluateAll((groups) => groups.map((g) => ({
      ranks: g.dataset.ranks, count: Number(g.dataset.count), summary: g.querySelector(".stack-summary").innerText,
      own: [...g.querySelectorAll("li.own code")].map((c) => c.innerText),
    })));
    seen.traces = await box.locator("a.trace-link").evaluateAll((links) => links.map((a) => ({ href: a.getAttribute("href"), text: a.innerText })));
    for (const t of seen.traces) {
      const answer = await page.request.get(base + t.href);
      t.status = answer.status();
      t.type = answer.headers()["content-type"];
    }
    seen.ops = await box.locator("table.ops tbody tr").evaluateAll((rows) => rows.slice(0, 3).map((r) => [...r.cells].map((c) => c.innerText)));
    const ask = item.locator("button.ask-stacks");
    seen.askButton = await ask.count();
    if (label === "stacks" && seen.askButton) {  // on demand: every rank's stacks now
      await ask.click();
      const asked = item.locator("details.command").nth(1);
      try {
        await item.locator('details.command[data-ready="true"]').nth(1).waitFor({ timeout: 15_000 });
      } catch (e) {
        throw new Error(`${e.message}\n${await item.innerHTML()}`);
      }
      seen.asked = {
        title: (await asked.locator("summary").innerText()).trim(),
        status: (await asked.locator(".command-status").innerText()).trim(),
      };
    }
    await item.scrollIntoViewIfNeeded();
    await item.screenshot({ path: `${shots}/evidence-${label}.png` });
    report.runs[label] = seen;
    await page.close();
  }
} finally {
  await browser.close();
}
process.stdout.write(JSON.stringify(report) + "\n");
