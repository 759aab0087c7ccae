"""One HTTP POST of one message, and what its answer means for the outbox.

2xx: delivered. 408, 425, 429, 5xx, timeouts and connection errors: retry (with `Retry-After`, in
seconds or as an HTTP date, as a lower bound). Any other answer (400, 403, 404, a redirect): a
permanent failure, because sending the same body again cannot succeed. Redirects are not followed: a
signed body must reach the URL that was configured.
"""

from __future__ import annotations

import email.utils
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from stepwatch_server.alerts.config import Channel
from stepwatch_server.alerts.signing import IDEMPOTENCY_HEADER, SIGNATURE_HEADER, sign

RETRYABLE_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
MAX_ERROR_CHARS = 300
USER_AGENT = "stepwatch-alerts/1"


@dataclass(frozen=True)
class Result:
    ok: bool
    status: int | None = None
    error: str | None = None
    retryable: bool = False
    retry_after_s: float | None = None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # urllib then raises HTTPError with the 3xx status


_opener = urllib.request.build_opener(_NoRedirect)


def body_of(payload: dict[str, Any]) -> bytes:
    """The bytes sent: compact, keys sorted, so every attempt sends the same body on both databases
    (PostgreSQL's JSONB does not keep key order)."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False, sort_keys=True).encode()


def post(channel: Channel, payload: dict[str, Any], idempotency_key: str, timeout_s: float) -> Result:
    """POST `payload` to `channel` (signed when it is a webhook); never raises for network trouble."""
    body = body_of(payload)
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        IDEMPOTENCY_HEADER: idempotency_key,
    }
    if channel.secret is not None:
        headers[SIGNATURE_HEADER] = sign(channel.secret, body)
    request = urllib.request.Request(channel.url, data=body, headers=headers, method="POST")
    try:
        with _opener.open(request, timeout=timeout_s) as response:
            response.read()
            return Result(ok=True, status=response.status)
    except urllib.error.HTTPError as exc:
        detail = _read(exc)
        retry_after = parse_retry_after(exc.headers.get("Retry-After")) if exc.headers else None
        return Result(
            ok=False,
            status=exc.code,
            error=f"HTTP {exc.code}" + (f": {detail}" if detail else ""),
            retryable=exc.code in RETRYABLE_STATUSES,
            retry_after_s=retry_after,
        )
    except TimeoutError:
        return Result(ok=False, error=f"timed out after {timeout_s:g} s", retryable=True)
    except urllib.error.URLError as exc:
        return Result(ok=False, error=f"cannot connect: {exc.reason}"[:MAX_ERROR_CHARS], retryable=True)
    except OSError as exc:
        return Result(ok=False, error=f"connection failed: {exc}"[:MAX_ERROR_CHARS], retryable=True)


def _read(exc: urllib.error.HTTPError) -> str:
    try:
        return exc.read(MAX_ERROR_CHARS).decode("utf-8", "replace").strip()
    except OSError:
        return ""
    finally:
        exc.close()


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or an HTTP date); None when absent/bad."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))
