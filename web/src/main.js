// The dashboard: `/` the runs page, `/run/<name>` one run. Links are real links; the page is rebuilt on
// navigation without a reload.
import "uplot/dist/uPlot.min.css";
import "./style.css";
import { onUnauthorized } from "./api.js";
import { askForToken, setUpLogout } from "./login.js";
import { renderRuns } from "./runs.js";
import { renderRun } from "./run.js";

let teardown = () => {};

function route() {
  teardown();
  const main = document.getElementById("main");
  main.replaceChildren();
  const path = decodeURIComponent(location.pathname);
  if (path.startsWith("/run/") && path.length > 5) {
    teardown = renderRun(main, path.slice(5));
  } else {
    teardown = renderRuns(main);
  }
}

document.addEventListener("click", (event) => {
  const link = event.target.closest("a[data-nav]");
  if (!link || event.metaKey || event.ctrlKey || event.shiftKey || event.button !== 0) return;
  event.preventDefault();
  history.pushState(null, "", link.getAttribute("href"));
  route();
});
window.addEventListener("popstate", route);
onUnauthorized(() => {
  teardown(); // stop the view's stream and timers: they would only get 401 again
  teardown = () => {};
  askForToken(document.getElementById("main"), route);
});
setUpLogout(route);
route();
