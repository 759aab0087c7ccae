// Drives the built dashboard in a real browser (playwright-core + the system's Chromium) against a
// running collector, and reports what it saw as JSON lines on stdout; tests/web/test_dashboard.py
// starts the collector, feeds it, runs this script and asserts on the report.
//
// env: STEPWATCH_URL (the collector), STEPWATCH_RUN, CHROMIUM (executable), SCREENSHOTS (a folder).
// Protocol: prints {"phase":"ready_for_live",...}, then waits for a line on stdin (the test has fed
// more steps), then prints {"phase":"done", ...the report} and exits.
import { launch, loopback } from "./browser.mjs";
import readline from "node:readline";

const base = process.env.STEPWATCH_URL;
const run = process.env.STEPWATCH_RUN;
const shots = process.env.SCREENSHOTS;
const LIVE_WAIT_MS = 10_000; // how long to wait for the live step at all (the test judges the time)
setTimeout(() => { console.error("dashboard.mjs: overall timeout"); process.exit(3); }, 120_000).unref();

const report = { consoleErrors: [], blocked: [], requests: [] };
const emit = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");

const browser = await launch();
try {
  const context = await browser.newContext({ viewport: { width: 1440, height: 900 }, deviceScaleFactor: 1 });
  await context.route("**/*", (route) => {
    const url = route.request().url();
    report.requests.push(url);
    if (loopback(url)) return route.continue();
    report.blocked.push(url);
    return route.abort();
  });
  const page = await context.newPage();
  page.on("console", (m) => { if (m.type() === "error") report.consoleErrors.push(m.text()); });
  page.on("pageerror", (e) => report.consoleErrors.push(`pageerror: ${e.message}`));
  page.on("websocket", (ws) => { if (!loopback(ws.url())) report.blocked.push(ws.url()); });

  // -- the runs page ----------------------------------------------------------------------------------
  await page.goto(`${base}/`);
  const row = page.locator(`tr[data-run="${run}"]`);
  await row.waitFor({ timeout: 15_000 });
  report.runsPage = {
    verdict: await row.locator("[data-verdict]").first().getAttribute("data-verdict"),
    text: (await row.innerText()).replace(/\s+/g, " "),
    liveStatus: await page.locator("#live-status").innerText(),
    verdicts: Object.fromEntries(await page.$$eval("tr[data-run]", (rows) =>
      rows.map((r) => [r.dataset.run, r.querySelector("[data-verdict]")?.dataset.verdict]))),
    pace: Object.fromEntries(await page.$$eval("tr[data-run]", (rows) =>
      rows.map((r) => [r.dataset.run, r.querySelector('[data-field="pace"]')?.innerText.trim()]))),
    livePills: await page.$$eval("tr[data-run]", (rows) => rows.filter((r) => r.querySelector(".pill.live")).map((r) => r.dataset.run)),
    stored: Object.fromEntries(await page.$$eval("tr[data-run]", (rows) =>
      rows.map((r) => [r.dataset.run, r.querySelector('[data-field="stored"]')?.innerText.trim()]))),
  };
  await page.waitForFunction(() => document.getElementById("live-status")?.dataset.state === "live", null, { timeout: 10_000 }).catch(() => {});
  await page.screenshot({ path: `${shots}/runs.png` });

  // -- the run page -------------------------------------------------------------------------------------
  const opened = Date.now();
  await row.locator("a").first().click();
  await page.locator('main[data-ready="true"]').waitFor({ timeout: 30_000 });
  report.runPage = { url: page.url(), openMs: Date.now() - opened };
  report.phaseMarks = Number(await page.locator("section.charts").getAttribute("data-phases"));
  report.heatmaps = await page.$$eval("canvas.heatmap", (els) => els.map((c) => ({
    label: c.getAttribute("aria-label"), labelledRanks: Number(c.dataset.labelledRanks),
    scaleLo: c.dataset.scaleLo ? Number(c.dataset.scaleLo) : null, scaleHi: c.dataset.scaleHi ? Number(c.dataset.scaleHi) : null,
    rank: c.parentElement.querySelector(".heat-summary")?.dataset.rank ?? null,
    summary: c.parentElement.querySelector(".heat-summary")?.textContent ?? "",
    view: c.closest("section")?.querySelector("select")?.value ?? null,
  })));
  await page.waitForTimeout(300); // let the last frames paint
  report.canvases = await page.evaluate(() => {
    const painted = (c) => {
      const ctx = c.getContext("2d");
      if (!c.width || !c.height) return 0;
      const data = ctx.getImageData(0, 0, c.width, c.height).data;
      const seen = new Set();
      let n = 0;
      for (let i = 0; i < data.length; i += 16) {
        if (data[i + 3] === 0) continue;
        seen.add((data[i] << 16) | (data[i + 1] << 8) | data[i + 2]);
        n++;
      }
      return seen.size > 1 ? n : 0; // a flat fill is not a drawing
    };
    const out = [];
    for (const box of document.querySelectorAll(".chart, .panel")) {
      for (const c of box.querySelectorAll("canvas")) {
        const name = box.dataset.metric ?? c.getAttribute("aria-label") ?? box.querySelector("h2")?.textContent ?? "canvas";
        out.push({ name, painted: painted(c), width: c.width, height: c.height });
      }
    }
    return out;
  });
  report.amax = await page.evaluate(() => ({
    note: document.querySelector(".amax-note")?.hidden ? "" : document.querySelector(".amax-note")?.textContent ?? "",
    rows: [...document.querySelectorAll("table.amax tbody tr")].map((tr) => tr.dataset.module),
  }));
  report.evidenceLabels = await page.$$eval(".evidence th", (ths) => ths.map((th) => [th.title, th.textContent]));
  report.anomalies = await page.$$eval("li.anomaly", (items) => items.map((li) => ({
    kind: li.dataset.kind, rank: li.dataset.rank === "" ? null : Number(li.dataset.rank),
    firstStep: Number(li.dataset.firstStep), text: li.innerText.replace(/\s+/g, " "),
    severityText: li.querySelector("[data-verdict]")?.innerText.trim(),
  })));
  await page.screenshot({ path: `${shots}/run.png`, fullPage: true });

  // -- clicking the loss spike zooms every chart to it ----------------------------------------------------------
  const spike = page.locator('li.anomaly[data-kind="loss_spike"] button.goto').first();
  const before = await page.$$eval(".uplot", (els) => els.map((e) => [Number(e.dataset.xMin), Number(e.dataset.xMax)]));
  if (await spike.count()) {
    await spike.focus();
    await page.keyboard.press("Enter"); // by keyboard: the list is usable without a mouse
    await page.waitForFunction(() => document.querySelector("section.charts")?.dataset.xMin, null, { timeout: 5_000 });
    await page.waitForTimeout(600); // the detail reload after a zoom
    const straggler = page.locator('li.anomaly[data-kind="straggler"] button.goto').first();
    report.zoom = {
      before,
      after: await page.$$eval(".uplot", (els) => els.map((e) => [Number(e.dataset.xMin), Number(e.dataset.xMax)])),
      note: await page.locator('[data-testid="zoom"]').innerText(),
      url: page.url(),
    };
    await page.screenshot({ path: `${shots}/run-zoomed.png`, fullPage: false });
    if (await straggler.count()) {
      await straggler.click();
      await page.waitForTimeout(600);
      report.highlight = await page.locator("#heat-h").locator("..").innerText();
      await page.locator("#heat-h").scrollIntoViewIfNeeded();
      await page.screenshot({ path: `${shots}/run-straggler.png`, fullPage: false });
    }
    await page.locator("button", { hasText: "Show all steps" }).click();
  }

  // -- a new step arrives live -----------------------------------------------------------------------------
  const lastStep = async () => Number((await page.locator('[data-testid="last-step"]').innerText()).replace(/[^0-9]/g, ""));
  const shownBefore = await lastStep();
  const chartBefore = Number(await page.locator("section.charts").getAttribute("data-last-step"));
  emit({ phase: "ready_for_live", lastStep: shownBefore, chartLastStep: chartBefore });
  const rl = readline.createInterface({ input: process.stdin });
  await new Promise((resolve) => rl.once("line", resolve));
  const fed = Date.now();
  const arrived = await page.waitForFunction(([s, c]) => {
    const shown = Number(document.querySelector('[data-testid="last-step"]')?.textContent.replace(/[^0-9]/g, ""));
    const drawn = Number(document.querySelector("section.charts")?.dataset.lastStep);
    return shown > s && drawn > c ? { shown, drawn } : null;
  }, [shownBefore, chartBefore], { timeout: LIVE_WAIT_MS, polling: 50 }).then((h) => h.jsonValue()).catch(() => null);
  report.live = { before: shownBefore, chartBefore, after: arrived, ms: arrived ? Date.now() - fed : null };
  rl.close();

  // -- the address of a zoomed view opens zoomed -------------------------------------------------------------
  if (report.zoom?.url.includes("#anomaly=")) {
    const again = await context.newPage();
    again.on("pageerror", (e) => report.consoleErrors.push(`pageerror: ${e.message}`));
    await again.goto(report.zoom.url);
    await again.locator('main[data-ready="true"]').waitFor({ timeout: 30_000 });
    await again.waitForFunction(() => document.querySelector("section.charts")?.dataset.xMin, null, { timeout: 5_000 }).catch(() => {});
    report.permalink = await again.$$eval(".uplot", (els) => els.map((e) => [Number(e.dataset.xMin), Number(e.dataset.xMax)]));
    // Opened again and again (a slow full-range heatmap answered after the zoomed one used to win): each
    // time the charts and both heatmaps show the anomaly's range once the page has settled.
    report.reopened = [];
    // As on a long run, the full-range heatmaps answer late (held 1.5 s here); the zoomed ones at once.
    await again.route(/\/heatmap\?/, async (route) => {
      if (!route.request().url().includes("from_step=")) await new Promise((r) => setTimeout(r, 1500));
      await route.continue();
    });
    for (let i = 0; i < 10; i++) {
      await again.goto("about:blank");
      await again.goto(report.zoom.url);
      await again.locator('main[data-ready="true"]').waitFor({ timeout: 30_000 });
      await again.waitForFunction(() => document.querySelector("section.charts")?.dataset.xMin, null, { timeout: 5_000 }).catch(() => {});
      await again.waitForLoadState("networkidle");
      report.reopened.push({
        charts: await again.$$eval(".uplot", (els) => els.map((e) => [Number(e.dataset.xMin), Number(e.dataset.xMax)])),
        heatmaps: await again.$$eval("canvas.heatmap", (els) => els.map((e) => [Number(e.dataset.firstStep), Number(e.dataset.lastStep)])),
      });
    }
  }
} finally {
  await browser.close();
}
emit({ phase: "done", ...report });
