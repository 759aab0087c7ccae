"""Webhook signatures: `X-Stepwatch-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, f"{t}.{body}")>`.

The timestamp is part of the signed text, so a receiver that checks the signature and refuses
timestamps older than a few minutes rejects both tampered bodies and replays; a retried delivery is
signed again with a fresh timestamp, and carries the same `Idempotency-Key` header for de-duplication.
"""

from __future__ import annotations

import hashlib
import hmac
import time

SIGNATURE_HEADER = "X-Stepwatch-Signature"
IDEMPOTENCY_HEADER = "Idempotency-Key"
DEFAULT_TOLERANCE_S = 300


def sign(secret: bytes, body: bytes, timestamp: int | None = None) -> str:
    """The signature header's value for `body`, signed at `timestamp` (default: now)."""
    t = int(time.time()) if timestamp is None else int(timestamp)
    digest = hmac.new(secret, f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={digest}"


def verify(
    secret: bytes,
    body: bytes,
    header: str,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now: float | None = None,
) -> bool:
    """True when `header` signs `body` with `secret` and its timestamp is within `tolerance_s` of now."""
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    try:
        t = int(parts["t"])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - t) > tolerance_s:
        return False
    expected = hmac.new(secret, f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, parts.get("v1", ""))
