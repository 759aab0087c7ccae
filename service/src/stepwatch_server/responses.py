"""JSON answers written with orjson, and the non-finite convention shared with the ingest format.

JSON has no NaN or Infinity; stepwatch writes them as the strings "NaN", "Infinity" and "-Infinity"
both ways (docs/ingest.md). orjson would write them as null, so float arrays go through
`float_list()` before they are serialised.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import orjson
from starlette.responses import Response

_ORJSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS

# A number in an answer, as documented (OpenAPI): finite as a JSON number, the others as strings, a gap as null.
Num = float | Literal["NaN", "Infinity", "-Infinity"] | None


class OrjsonResponse(Response):
    """A JSON response serialised by orjson (numpy arrays, datetimes and non-str keys included)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=_ORJSON_OPTIONS)


def json_response(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return OrjsonResponse(content, status_code=status, headers=headers)


def nonfinite_name(value: float) -> str:
    if value != value:
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def float_list(values: np.ndarray) -> list[float | str]:
    """A float array as a JSON-ready list: finite values as numbers, the others as strings."""
    arr = np.asarray(values, dtype=np.float64)
    out: list[Any] = arr.tolist()
    bad = np.flatnonzero(~np.isfinite(arr))
    for i in bad.tolist():
        out[i] = nonfinite_name(out[i])
    return out
