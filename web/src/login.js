// Tokens (README, "Security and limits"): when the API answers 401 the page asks for a token, once, and
// sends it to POST /api/v1/login, which sets an HttpOnly cookie; fetch and EventSource carry the cookie
// from then on (EventSource cannot send a header). The page keeps no token and puts none into a URL:
// sessionStorage only remembers that this tab logged in, to offer "Log out".
import { el } from "./format.js";

const LOGGED_IN = "stepwatch-logged-in";

/** Replace `main` with the token form (unless it is there already); `onDone` runs after a good login. */
export function askForToken(main, onDone) {
  if (main.querySelector("form.login")) return;
  document.title = "Sign in · stepwatch";
  const status = document.getElementById("live-status");
  if (status) {
    status.dataset.state = "offline";
    status.textContent = "○ not signed in";
  }
  const input = el("input", { id: "token", name: "token", type: "password", autocomplete: "current-password", required: true, spellcheck: "false" });
  const problem = el("p", { class: "login-error", role: "alert", hidden: true });
  const form = el("form", { class: "login", "aria-labelledby": "login-h" },
    el("h1", { id: "login-h" }, "Sign in"),
    el("p", { class: "lede" }, "This collector needs a token to show its runs: a read token, or your team's write token."),
    el("label", { for: "token" }, "Token"),
    input,
    el("button", { type: "submit" }, "Sign in"),
    problem,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    problem.hidden = true;
    const response = await fetch("/api/v1/login", {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "application/json" },
      body: JSON.stringify({ token: input.value }),
    });
    if (response.ok) {
      sessionStorage.setItem(LOGGED_IN, "1");
      showLogout();
      onDone();
      return;
    }
    let message = `${response.status} ${response.statusText}`;
    try {
      message = (await response.json()).error?.message ?? message;
    } catch {
      /* not JSON: keep the status line */
    }
    problem.textContent = message;
    problem.hidden = false;
    input.select();
  });
  main.replaceChildren(form);
  input.focus();
}

/** The header's "Log out": shown once this tab has logged in; clears the cookie, then `onDone`. */
export function setUpLogout(onDone) {
  const button = document.getElementById("logout");
  if (!button) return;
  button.addEventListener("click", async () => {
    await fetch("/api/v1/logout", { method: "POST" });
    sessionStorage.removeItem(LOGGED_IN);
    button.hidden = true;
    onDone();
  });
  if (sessionStorage.getItem(LOGGED_IN)) showLogout();
}

function showLogout() {
  const button = document.getElementById("logout");
  if (button) button.hidden = false;
}
