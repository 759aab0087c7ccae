// Opens each named run's page in a real browser and reports what its default ranks x steps heatmap
// says: the rank the line under it names as holding the run up, that line's words, the share of cells
// outside the neutral band, and which view the page chose. Prints one JSON report on stdout;
// tests/web/test_ranks_view.py asserts on it.
//
// env: STEPWATCH_URL (the collector), RUNS (`label=run` pairs, comma-separated), CHROMIUM, SCREENSHOTS (a
// folder: one `ranks-<label>.png` of each page's heatmap).
import { launch, loopback } from "./browser.mjs";

const base = process.env.STEPWATCH_URL;
const runs = process.env.RUNS.split(",").map((pair) => pair.split("="));
const shots = process.env.SCREENSHOTS;
setTimeout(() => { console.error("ranks.mjs: overall timeout"); process.exit(3); }, 90_000).unref();

const report = { runs: {}, blocked: [], pageErrors: [] };
const browser = await launch();
try {
  const context = await browser.newContext({ viewport: { width: 1440, height: 900 }, deviceScaleFactor: 1 });
  await context.route("**/*", (route) => {
    if (loopback(route.request().url())) return route.continue();
    report.blocked.push(route.request().url());
    return route.abort();
  });
  for (const [label, run] of runs) {
    const page = await context.newPage();
    page.on("pageerror", (e) => report.pageErrors.push(`${run}: ${e.message}`));
    await page.goto(`${base}/run/${encodeURIComponent(run)}`);
    await page.locator('main[data-ready="true"]').waitFor({ timeout: 30_000 });
    const heat = page.locator("canvas.heatmap").first();
    await page.waitForFunction(() => document.querySelector("canvas.heatmap")?.dataset.firstStep, null, { timeout: 15_000 });
    report.runs[run] = {
      view: await page.locator('select[aria-label="Heatmap metric"]').inputValue(),
      rank: await page.locator(".heat-summary").first().getAttribute("data-rank"),
      summary: (await page.locator(".heat-summary").first().innerText()).trim(),
      outside: Number(await heat.getAttribute("data-outside")),
      lastStep: Number(await heat.getAttribute("data-last-step")),
    };
    await page.locator(".heat-box").first().screenshot({ path: `${shots}/ranks-${label}.png` });
    await page.close();
  }
} finally {
  await browser.close();
}
process.stdout.write(JSON.stringify(report) + "\n");
