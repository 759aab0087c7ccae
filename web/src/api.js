// The collector's read API: JSON over fetch, non-finite numbers ("NaN", "Infinity") turned into numbers.

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

let unauthorized = () => {};

/** What to do when the API answers 401 (tokens are configured and this browser has none): main.js asks. */
export function onUnauthorized(handler) {
  unauthorized = handler;
}

export async function getJson(path, params = {}) {
  const query = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null) query.set(k, String(v));
  const url = query.size ? `${path}?${query}` : path;
  const response = await fetch(url, { headers: { Accept: "application/json" } });
  if (!response.ok) {
    if (response.status === 401) unauthorized();
    throw await apiError(response);
  }
  return response.json();
}

/** POST a JSON body (a write: `token`, when given, goes in this request's Authorization header only). */
export async function postJson(path, body, token = null) {
  const headers = { "Content-Type": "application/json", Accept: "application/json" };
  if (token) headers.Authorization = `Bearer ${token}`;
  const response = await fetch(path, { method: "POST", headers, body: JSON.stringify(body) });
  if (!response.ok) throw await apiError(response);
  return response.json();
}

/** The API's error answer as an ApiError: its message, else the status line. */
async function apiError(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    message = (await response.json()).error?.message ?? message;
  } catch {
    /* not JSON: keep the status line */
  }
  return new ApiError(response.status, message);
}

const NONFINITE = { NaN: NaN, Infinity: Infinity, "-Infinity": -Infinity };

/** The API's values as numbers; non-finite ones become null (a gap), as charts want them. */
export function finiteOrNull(values) {
  return values.map((v) => (typeof v === "number" ? v : v in NONFINITE ? null : null));
}

export function toNumber(v) {
  return typeof v === "number" ? v : (NONFINITE[v] ?? null);
}

export const runPath = (run) => `/api/v1/runs/${encodeURIComponent(run).replaceAll("%2F", "/")}`;
