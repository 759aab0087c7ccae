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


numbers = st.integers(min_value=-(2**70), max_value=2**70) | st.floats()
odd_items = st.sampled_from([None, "NaN", "Infinity", "x", True, [1.0]])


@st.composite
def value_columns(draw: Any) -> tuple[dict[str, Any], int]:
    """Columns of `expected` numbers mostly (the 2-D path), some with an odd item or a wrong length."""
    expected = draw(st.integers(min_value=0, max_value=4))
    names = draw(
        st.lists(st.sampled_from(["loss", "grad_norm", "lr", "bad name", "time.step_ms"]), max_size=4)
    )
    columns = {}
    for name in names:
        items = draw(st.lists(numbers, min_size=expected, max_size=expected))
        if draw(st.integers(0, 5)) == 0:
            items = draw(st.lists(numbers | odd_items, max_size=5))
        columns[name] = items
    return columns, expected


@hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
@hypothesis.given(case=value_columns())
def test_value_columns_parsed_together_equal_each_parsed_alone(case: tuple[dict[str, Any], int]) -> None:
    """The metrics (and each stat's tensors) are parsed as one 2-D array when every column is numbers of
    the right length: the same values, bit for bit, as parsing each column alone, and a refusal where
    that refuses."""
    import numpy as np

    from stepwatch_server.errors import InvalidBatch
    from stepwatch_server.ingest.validate import _columns, _name, _value_column

    columns, expected = case

    def alone() -> dict[str, Any]:
        return {
            _name(n, f"metrics.{n}"): _value_column(c, f"metrics.{n}", expected, "steps")
            for n, c in columns.items()
        }

    outcomes = []
    for parse in (lambda: _columns(columns, "metrics", expected, "steps"), alone):
        try:
            outcomes.append(parse())
        except InvalidBatch as exc:
            outcomes.append(str(exc))
    together, each = outcomes
    if isinstance(each, str) or isinstance(together, str):
        # Both refuse (which field is named first may differ when one column's name and another's
        # values are bad: names are now checked first).
        assert isinstance(each, str) and isinstance(together, str)
        return
    assert together.keys() == each.keys()
    for name in each:
        assert together[name].values.tobytes() == each[name].values.tobytes()
        assert (together[name].present is None) == (each[name].present is None)
        if each[name].present is not None:
            assert np.array_equal(together[name].present, each[name].present)
