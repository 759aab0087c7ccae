// Opens the collector's API docs (/docs) in a real browser with every request that is not to loopback
// refused, as on a training cluster without internet: the page must render the operations from the
// collector's own OpenAPI. Prints one JSON report on stdout; tests/web/test_api_docs.py asserts.
//
// env: STEPWATCH_URL (the collector), CHROMIUM.
import { launch, loopback } from "./browser.mjs";

const base = process.env.STEPWATCH_URL;
setTimeout(() => { console.error("docs.mjs: overall timeout"); process.exit(3); }, 90_000).unref();

const report = { blocked: [], pageErrors: [], failed: [] };
const browser = await launch();
try {
  const context = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  await context.route("**/*", (route) => {
    if (loopback(route.request().url())) return route.continue();
    report.blocked.push(route.request().url());
    return route.abort();
  });
  const page = await context.newPage();
  page.on("pageerror", (e) => report.pageErrors.push(e.message));
  page.on("requestfailed", (r) => report.failed.push(r.url()));
  const answer = await page.goto(`${base}/docs`);
  report.status = answer.status();
  await page.locator(".opblock").first().waitFor({ timeout: 30_000 });
  report.title = await page.title();
  report.operations = await page.$$eval(".opblock-summary-path", (els) => els.map((e) => e.textContent.trim()));
  report.apiLink = await page.evaluate(async () => {
    const shell = await fetch("/").then((r) => r.text());
    return /href="\/docs"/.test(shell);
  });
} finally {
  await browser.close();
}
process.stdout.write(JSON.stringify(report) + "\n");
