"""What the agent sends with the first non-finite step (issue 18, item 4): the first module's output max |x|
and its input's (the tracked call before it), and the values `watch.identify()` named the step's data with,
so that a NaN the data caused is traced to its batch. A real tiny model on CPU, a real HTTP receiver."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import stepwatch
from stepwatch._batch import MAX_IDS_CHARS, _bounded

from .conftest import Receiver, make_model

NAN_STEP = 7  # Poison returns NaN from its 7th call on: the 7th step's forward


def _events(receiver: Receiver) -> list[dict[str, Any]]:
    return [e for b in receiver.accepted() for e in b.get("events", []) if e["kind"] == "nonfinite"]


def _train(watch: stepwatch.Watch, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        watch.identify(sample_ids=[10 * step + i for i in range(4)], shard=f"shard-{step % 3}")
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)
        model(x, y)["loss"].backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("amax_every", [1, 10])
def test_the_first_nonfinite_step_carries_its_data_ids_and_the_first_modules_amax(
    receiver: Receiver, fast: dict[str, Any], amax_every: int
) -> None:
    model, opt = make_model(nan_from_call=NAN_STEP)
    watch = stepwatch.attach(
        model, opt, run="nan-context", url=receiver.url, track=["poison"], amax_every=amax_every, **fast
    )
    _train(watch, model, opt, 10)
    watch.close()
    (event,) = _events(receiver)  # once: the steps after it stay non-finite
    data = event["data"]
    assert event["step"] == NAN_STEP and data["module"] == "poison"
    assert data["ids"] == {"sample_ids": [70, 71, 72, 73], "shard": "shard-1"}  # that step's, not another's
    if amax_every == 1:  # the step's values are max |x|: the poison's output and fc1's before it
        assert data["output_amax"] == "NaN"
        assert isinstance(data["input_amax"], float) and math.isfinite(data["input_amax"])
    else:  # a CPU step that ships no amax reduces by sums: no max |x| to tell
        assert "output_amax" not in data and "input_amax" not in data


def test_identify_refuses_what_it_cannot_keep_cheaply_and_says_why_once(
    receiver: Receiver, fast: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="ids-refused", url=receiver.url, **fast)
    for _ in range(2):
        watch.identify(
            on_device=torch.zeros(2, device="meta"), many=list(range(65)), nan=float("nan"), mixed=[1, "a"],
            ok=torch.tensor([1, 2]),
        )  # fmt: skip
    watch.close()
    said = [r.getMessage() for r in caplog.records if "watch.identify" in r.getMessage()]
    assert len(said) == 4 and all("(logged once)" in m for m in said)
    assert any("meta tensor: reading it would wait for the device" in m for m in said)
    assert any("65 items; at most 64" in m for m in said)
    assert watch.stats()["rejected_log_values"] == 8


def test_ids_beyond_the_event_limit_are_named_not_cut() -> None:
    ids = {f"k{i}": "x" * 190 for i in range(30)}
    kept = _bounded(ids)
    assert sum(len(k) + len(str(v)) for k, v in kept.items() if k != "_dropped") <= MAX_IDS_CHARS
    assert kept["_dropped"] == [k for k in ids if k not in kept]
    assert all(kept[k] == ids[k] for k in kept if k != "_dropped")
