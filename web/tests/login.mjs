// Drives the built dashboard in a real browser (playwright-core + the system's Chromium) against a
// collector that has tokens: the page asks for a token, refuses an unknown one, shows the runs the
// token reads once it is given (the event stream too, through the login cookie), and "Log out" asks
// again. Prints one JSON report on stdout; tests/web/test_login.py starts the collector and asserts.
//
// env: STEPWATCH_URL (the collector), STEPWATCH_READ_TOKEN (a token that reads some runs), CHROMIUM.
import { launch } from "./browser.mjs";

const base = process.env.STEPWATCH_URL;
const token = process.env.STEPWATCH_READ_TOKEN;
setTimeout(() => { console.error("login.mjs: overall timeout"); process.exit(3); }, 90_000).unref();

const report = { requestsWithToken: [], pageErrors: [] };
const browser = await launch();
try {
  const context = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  const page = await context.newPage();
  page.on("request", (r) => { if (r.url().includes(token)) report.requestsWithToken.push(r.url()); });
  page.on("pageerror", (e) => report.pageErrors.push(e.message));

  await page.goto(`${base}/`);
  const form = page.locator("form.login");
  await form.waitFor({ timeout: 15_000 });
  report.asked = { title: await page.title(), runsTable: await page.locator("table.runs").count(), focused: await page.evaluate(() => document.activeElement?.id) };

  await page.fill("#token", "not-a-known-token-0123");
  await page.keyboard.press("Enter");
  const problem = page.locator(".login-error");
  await problem.waitFor({ state: "visible", timeout: 10_000 });
  report.refused = { error: await problem.innerText(), stillAsking: await form.count() };

  await page.fill("#token", token);
  await page.locator("form.login button[type=submit]").click();
  await page.locator("table.runs tr[data-run]").first().waitFor({ timeout: 15_000 });
  await page.waitForFunction(() => document.getElementById("live-status")?.dataset.state === "live", null, { timeout: 10_000 }).catch(() => {});
  report.signedIn = {
    runs: await page.$$eval("tr[data-run]", (rows) => rows.map((r) => r.dataset.run)),
    live: await page.locator("#live-status").getAttribute("data-state"),
    cookieVisibleToScript: await page.evaluate(() => document.cookie),
    logoutShown: await page.locator("#logout").isVisible(),
  };
  await page.reload(); // the cookie lasts the browser session: no second prompt
  await page.locator("table.runs tr[data-run]").first().waitFor({ timeout: 15_000 });
  report.reloaded = { asked: await form.count() };

  await page.locator("#logout").click();
  await form.waitFor({ timeout: 10_000 });
  report.loggedOut = { asked: await form.count(), runs: await page.locator("tr[data-run]").count() };
} finally {
  await browser.close();
}
process.stdout.write(JSON.stringify(report) + "\n");
