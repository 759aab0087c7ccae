"""One HTTP POST of one message, and what its answer means for the outbox.

2xx: delivered. 408, 425, 429, 5xx, timeouts and connection errors: retry (with `Retry-After`, in
seconds or as an HTTP date, as a lower bound). Any other answer (400, 403, 404, a redirect): a
permanent failure, because sending the same body again cannot succeed. Redirects are not followed: a
signed body must reach the URL that was configured.

What is kept of a failure (`Result.error`, stored as the delivery's `last_error` and shown by the API
and the page) is the status and a short reason of our own: never the receiver's answer body, which can
echo the request's path and query (a Slack webhook's path is its secret, `?api_key=` another), and
never the channel's URL, which is cut out of any message that quotes it.
"""

from __future__ import annotations

import email.utils
import http
import json
import time
import urllib.error
import urllib.parse
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
    try:
        request = urllib.request.Request(channel.url, data=body, headers=headers, method="POST")
        with _opener.open(request, timeout=timeout_s) as response:
            response.read()
            return Result(ok=True, status=response.status)
    except urllib.error.HTTPError as exc:
        _discard(exc)  # the body is not kept: it may echo the URL's secret parts
        retry_after = parse_retry_after(exc.headers.get("Retry-After")) if exc.headers else None
        return Result(
            ok=False,
            status=exc.code,
            error=f"HTTP {exc.code} {_phrase(exc.code)}".rstrip(),
            retryable=exc.code in RETRYABLE_STATUSES,
            retry_after_s=retry_after,
        )
    except TimeoutError:
        return Result(ok=False, error=f"timed out after {timeout_s:g} s", retryable=True)
    except urllib.error.URLError as exc:
        return Result(ok=False, error=redact(f"cannot connect: {exc.reason}", channel.url), retryable=True)
    except OSError as exc:
        return Result(ok=False, error=redact(f"connection failed: {exc}", channel.url), retryable=True)
    except ValueError as exc:  # a URL urllib cannot use: sending again will not help
        return Result(ok=False, error=redact(f"bad channel url: {exc}", channel.url))


def redact(message: str, url: str) -> str:
    """`message` without the channel's URL, its path or its query (replaced by `<url>`, `<path>`,
    `<query>`), at most MAX_ERROR_CHARS characters."""
    parts = urllib.parse.urlsplit(url)
    for secret, mark in (
        (url, "<url>"),
        (parts.path + "?" + parts.query, "<path>"),
        (parts.query, "<query>"),
    ):
        if secret and secret not in ("?", "/"):
            message = message.replace(secret, mark)
    if parts.path not in ("", "/"):
        message = message.replace(parts.path, "<path>")
    return message[:MAX_ERROR_CHARS]


def _phrase(code: int) -> str:
    try:
        return http.HTTPStatus(code).phrase
    except ValueError:
        return ""


def _discard(exc: urllib.error.HTTPError) -> None:
    try:
        exc.read(MAX_ERROR_CHARS)
    except OSError:
        pass
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
