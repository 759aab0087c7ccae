"""The hand-over between the threads: steps packed into one tensor, decoded into rows, encoded as JSON."""

from __future__ import annotations

import gzip
import json
import math

import torch

from stepwatch import _batch
from stepwatch._device import transfer
from stepwatch._step import Step


def _step_with(
    acts: list[tuple[float, float] | float | None], loss: float, logs: dict[str, torch.Tensor]
) -> Step:
    """A finished step; `acts` are (min, max) pairs for a sampled step, float32 sums for another."""
    sampled = any(isinstance(a, tuple) for a in acts)
    step = Step(len(acts), sampled)
    step.acts = [
        None
        if a is None
        else (torch.tensor(a[0]), torch.tensor(a[1]))
        if isinstance(a, tuple)
        else torch.tensor(a)
        for a in acts
    ]
    step.hook_names.append("grad_norm")
    step.scalars.append(torch.tensor(3.0))
    step.loss_sum, step.loss_n = torch.tensor(loss * 2), 2  # two micro-batches
    step.logs.update(logs)
    step.host["lr"] = 0.1
    return step


def test_records_round_trip_through_one_tensor() -> None:
    missing = (torch.tensor(1.0), torch.tensor(-1.0), torch.tensor(0.0))
    order = ("a", "b")
    first = _step_with([(-2.0, 1.5), None], 4.0, {"tokens": torch.tensor(7.0, dtype=torch.float64)})
    first.grads = (torch.tensor([1.0, 2.0]), ("w", "b"))
    rec1 = first.record(10, 1.0, order, missing)
    rec1.vectors.append(torch.tensor([1.0, 0.0, 0.0, 0.0]))  # fingerprint words
    rec1.fingerprint = True
    second = _step_with([math.inf, 3.0], math.nan, {"x": torch.tensor(0.5, dtype=torch.bfloat16)})
    rec2 = second.record(11, 2.0, order, missing)
    third = _step_with([None, None], 1.0, {})  # no tracked module ran
    rec3 = third.record(12, 3.0, order, missing)
    fourth = _step_with([None, 2.5], 1.0, {})  # a not sampled step on which only b ran
    rec4 = fourth.record(13, 4.0, order, missing)

    chunk = transfer([rec1, rec2, rec3, rec4], cuda=False)
    assert chunk.values is not None and chunk.values.dim() == 1
    assert all(not r.scalars and not r.vectors for r in chunk.records)  # the tensors were released
    rows, events = _batch.Decoder().decode(chunk)

    one, two, three, four = (r.metrics for r in rows)
    assert one["loss"] == 4.0 and one["grad_norm"] == 3.0 and one["grad_sumsq"] == 9.0
    assert one["tokens"] == 7.0 and one["lr"] == 0.1
    assert rows[0].amax == {"a": 2.0, "b": None}  # b did not run: no value, not a zero
    assert rows[0].grads == {"w": 1.0, "b": 2.0}
    assert rows[0].fingerprint == f"{_batch.mix64(1):016x}"
    assert one["nonfinite.activations"] == one["nonfinite.loss"] == one["nonfinite.grads"] == 0
    assert two["x"] == 0.5 and math.isnan(two["loss"])
    assert two["nonfinite.activations"] == 1 and two["nonfinite.loss"] == 1
    assert rows[1].amax is None  # not a sampled step: the sums only say which module was non-finite
    assert three["nonfinite.activations"] is None and rows[2].amax is None
    assert four["nonfinite.activations"] == 0 and rows[3].amax is None
    assert "mem.rss_mb" in four  # host RSS once per chunk, on its last step
    assert events == [
        {
            "step": 11,
            "ts": 2.0,
            "kind": "nonfinite",
            "data": {"module": "a", "where": ["activations", "loss"]},
        }
    ]


def test_encode_writes_non_finite_values_as_strings() -> None:
    rows = [_batch.Row(1, 1.0, {"loss": 1.5, "g": None}), _batch.Row(2, 2.0, {"loss": math.nan})]
    rows[1].amax = {"fc": -math.inf}
    batch = _batch.build({"schema": 1}, rows, [], {"ts": 0.0, "phase": "data", "last_step": 2})
    decoded = json.loads(gzip.decompress(_batch.encode(batch)))
    assert decoded["metrics"] == {"loss": [1.5, "NaN"], "g": [None, None]}
    assert decoded["tensors"] == {"steps": [2], "stats": {"amax": {"fc": ["-Infinity"]}}}

    finite = _batch.build({"schema": 1, "run": "NaN-run"}, rows[:1], [], {"ts": 0.0, "phase": "x"})
    assert json.loads(gzip.decompress(_batch.encode(finite)))["metrics"] == {"loss": [1.5], "g": [None]}
