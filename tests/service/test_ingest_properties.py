"""A property of ingest, checked with generated batches (hypothesis) against a real collector on both
databases: whatever JSON value stands in any field of a valid batch, the answer is 200 or a 4xx in the
error shape, never a 500, and a rejected batch changes no row."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from stepwatch_server.ingest.example import EXAMPLE_BATCH
from tests.conftest import require_module
from tests.service.conftest import Collector, generated, make_batch

hypothesis = require_module("hypothesis")
st = require_module("hypothesis.strategies")

EXAMPLES_PER_BACKEND = 150  # bounded for CI; derandomized, so every run tries the same batches
Path = tuple[str | int, ...]


def _paths(value: Any, prefix: Path = ()) -> Iterator[Path]:
    """Every place in `value` a different value can stand: each key and each list element, nested."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield (*prefix, key)
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield (*prefix, index)
            yield from _paths(item, (*prefix, index))


PATHS = sorted(_paths(EXAMPLE_BATCH), key=repr)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)  # past 64 bits too
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
    | st.sampled_from(["NaN", "Infinity", "-Infinity", "\x00", "..", "a" * 300]),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=12,
)
edits = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(PATHS), json_values),
    st.tuples(st.just("delete"), st.sampled_from(PATHS), st.none()),
    st.tuples(st.just("add"), st.sampled_from([(), ("agent",), ("metrics",), ("heartbeat",)]), json_values),
)


def edited(batch: dict[str, Any], edit: tuple[str, Path, Any]) -> dict[str, Any]:
    action, path, value = edit
    parent: Any = batch
    for key in path[:-1] if action != "add" else path:
        parent = parent[key]
    if action == "add":
        parent["unexpected_field"] = value
    elif action == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return batch


def test_any_json_value_in_any_field_is_stored_or_rejected_in_the_error_shape_never_a_500(
    populated: Collector,
) -> None:
    answers: dict[int, int] = {}

    @generated(EXAMPLES_PER_BACKEND)
    @hypothesis.given(edit_list=st.lists(edits, min_size=1, max_size=3))
    def check(edit_list: list[tuple[str, Path, Any]]) -> None:
        batch = make_batch(seq=0)
        batch["session"] = uuid.uuid4().hex
        for edit in edit_list:
            try:
                batch = edited(batch, edit)
            except (KeyError, IndexError, TypeError):
                hypothesis.reject()  # an earlier edit removed or replaced what this one points into
        before = populated.counts()
        response = populated.post(json.dumps(batch).encode(), headers={"Content-Type": "application/json"})
        answers[response.status_code] = answers.get(response.status_code, 0) + 1
        assert response.status_code == 200 or 400 <= response.status_code < 500, (
            response.status_code,
            response.text[:500],
            edit_list,
        )
        body = response.json()
        if response.status_code == 200:
            assert body["accepted"] is True
            return
        error = body["error"]
        assert set(error) == {"code", "field", "message"}, body
        assert isinstance(error["code"], str) and isinstance(error["message"], str) and error["message"]
        assert error["field"] is None or isinstance(error["field"], str)
        assert populated.counts() == before, f"a rejected batch ({response.status_code}) changed rows"

    check()
    print(f"\nanswers by status: {dict(sorted(answers.items()))}")
    assert len(answers) >= 2, answers  # the generator reached both sides: stored and rejected
