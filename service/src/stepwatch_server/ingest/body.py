"""From request bytes to a JSON document: encoding, size limits, UTF-8 and JSON syntax.

The size limit holds on the wire (enforced while the body streams in, see routes) and after
decompression: gzip is inflated with a bounded `decompressobj`, so a small body that inflates to
gigabytes (a gzip bomb) costs at most the limit in memory before it is refused.
"""

from __future__ import annotations

import zlib
from typing import Any

import orjson

from stepwatch_server.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType

_GZIP_WBITS = 16 + zlib.MAX_WBITS


def _too_large(limit: int, where: str) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the batch is larger than the limit of {limit} bytes {where}; send fewer steps per batch",
        field="body",
    )


def gunzip_bounded(data: bytes, limit: int) -> bytes:
    """Inflate a gzip body (one or more members), refusing to produce more than `limit` bytes."""
    out = bytearray()
    rest = data
    while True:
        inflater = zlib.decompressobj(_GZIP_WBITS)
        try:
            chunk = inflater.decompress(rest, limit + 1 - len(out))
        except zlib.error as exc:
            raise BadRequest(f"the body is not valid gzip ({exc})", code="invalid_gzip") from None
        out += chunk
        if len(out) > limit:
            raise _too_large(limit, "after decompression")
        if not inflater.eof:
            if inflater.unconsumed_tail:  # output budget exhausted exactly at the limit
                raise _too_large(limit, "after decompression")
            raise BadRequest("the gzip body is truncated", code="invalid_gzip")
        rest = inflater.unused_data
        if not rest:
            return bytes(out)


def decode_body(raw: bytes, content_encoding: str | None, limit: int) -> Any:
    """The JSON document in `raw`; raises ApiError (400/413/415) naming what is wrong."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("gzip", "x-gzip"):
        data = gunzip_bounded(raw, limit)
    elif encoding == "identity":
        data = raw
    else:
        raise UnsupportedMediaType(
            f"Content-Encoding {encoding!r} is not supported; send the body plain or gzip-compressed",
            field="Content-Encoding",
        )
    if len(data) > limit:
        raise _too_large(limit, "of JSON")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as uexc:
            raise BadRequest(
                f"the body is not valid UTF-8 (invalid byte at offset {uexc.start})", code="invalid_encoding"
            ) from None
        raise BadRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from None
