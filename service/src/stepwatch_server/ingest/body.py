"""From request bytes to a JSON document: encoding, size limits, UTF-8 and JSON syntax.

The size limit holds on the wire (enforced while the body streams in: `read_body_bounded`) and after
decompression: gzip is inflated with a bounded `decompressobj`, so a small body that inflates to
gigabytes (a gzip bomb) costs at most the limit in memory before it is refused.
"""

from __future__ import annotations

import json
import re
import zlib
from typing import Any

import orjson
from starlette.requests import Request

from stepwatch_server.errors import BadRequest, InvalidBatch, PayloadTooLarge, UnsupportedMediaType

_GZIP_WBITS = 16 + zlib.MAX_WBITS


async def read_body_bounded(request: Request, limit: int) -> bytes:
    """The raw body, refused with 413 as soon as it is known to exceed `limit` bytes."""
    length = request.headers.get("content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise BadRequest("Content-Length is not an integer", field="Content-Length") from None
        if declared > limit:
            raise PayloadTooLarge(
                f"the body is {declared} bytes; the limit is {limit} bytes on the wire", field="body"
            )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the body is over the limit of {limit} bytes on the wire", field="body")
        chunks.append(chunk)
    return b"".join(chunks)


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
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as uexc:
            raise BadRequest(
                f"the body is not valid UTF-8 (invalid byte at offset {uexc.start})", code="invalid_encoding"
            ) from None
        raise BadRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    # A key given twice: 422. The keys are counted as written and as kept (~24 us for an agent's 2 KB
    # batch against ~48 us for a second parse keeping every key), and the body is parsed again, to name
    # the key, only where the counts differ.
    if _keys_written(data) != _keys_kept(doc):
        _refuse_duplicate_keys(data)
    return doc


# Every JSON string, whole, and whether a colon follows it (then it is a key; a string value is followed by
# , ] or } instead). Matching each string whole from where it starts keeps the scan linear: a pattern for
# "a string followed by a colon" alone is tried again at every escaped quote inside a string value, which is
# quadratic (32 KB of \" took 3.2 s, with the GIL held).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"(\s*:)?')


def _keys_written(data: bytes) -> int:
    found = _STRING.findall(data)  # each string's colon group, b"" after a value: counted in C
    return len(found) - found.count(b"")


def _keys_kept(doc: Any) -> int:
    """Keys in the parsed document's objects: fewer than written when a key was given twice (the
    parser keeps the last). Arrays are walked only where they start with an object or an array, so a
    column of a million numbers costs nothing; an object further in is not counted, which makes the
    counts differ and sends the body to the exact check."""
    count, todo = 0, [doc]
    while todo:
        item = todo.pop()
        if type(item) is dict:
            count += len(item)
            todo.extend(v for v in item.values() if type(v) in (dict, list))
        elif type(item) is list and item and type(item[0]) in (dict, list):
            todo.extend(v for v in item if type(v) in (dict, list))
    return count


def _refuse_duplicate_keys(data: bytes) -> None:
    """Parse again, keeping every key: 422 naming the first key given twice (the collector never
    picks one of two values silently)."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in items:
            if key in seen:
                raise InvalidBatch(f"{key!r} twice in one object: give each key once", field=None)
            seen[key] = value
        return seen

    try:
        json.loads(data, object_pairs_hook=pairs)
    except RecursionError:  # orjson takes 1,024 levels, this parser ~1,000: no batch nests like that
        raise InvalidBatch("the body nests objects and arrays too deeply", field=None) from None
