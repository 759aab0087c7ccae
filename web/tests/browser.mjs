// What the browser tests share: the system's Chromium through playwright-core, and the rule that only
// loopback (and data:/blob:/about:) may be reached, as on an offline training cluster.
import { chromium } from "playwright-core";

/** Chromium, headless, from $CHROMIUM (default /usr/bin/chromium). */
export function launch() {
  return chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    headless: true,
    args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"],
  });
}

/** Whether a request to `url` stays on this machine. */
export function loopback(url) {
  const u = new URL(url);
  if (u.protocol === "data:" || u.protocol === "blob:" || u.protocol === "about:") return true;
  return ["127.0.0.1", "localhost", "[::1]"].includes(u.hostname);
}
