"""The first non-finite step's context reaches the `nonfinite` anomaly's evidence (issue 18, item 4): a real
agent in this process (a tiny model whose `poison` module turns NaN at a step) feeds a real `stepwatch-server
serve`; the anomaly names the module, its output and input max |x| on that step, and the sample ids the loop
passed to `watch.identify()` for that step's batch."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import torch

import stepwatch
from tests.agent.conftest import make_model
from tests.e2e.conftest import Collector
from tests.e2e.test_commands import _anomalies

NAN_STEP = 12


def test_the_nonfinite_anomaly_names_the_batch_and_the_first_modules_amax(
    collector: Collector, tmp_path: Path
) -> None:
    run = f"nan-ids-{uuid.uuid4().hex[:8]}"
    model, opt = make_model(nan_from_call=NAN_STEP)
    watch = stepwatch.attach(
        model, opt, run=run, url=collector.url, track=["poison"], amax_every=1, spool_dir=tmp_path / "spool",
        flush_interval_s=0.2, heartbeat_interval_s=0.2,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 20):
        watch.identify(sample_ids=[100 * step + i for i in range(4)], file="train-017.bin")
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)
        model(x, y)["loss"].backward()
        opt.step()
        opt.zero_grad()
    watch.close()
    found: list[dict[str, Any]] = []
    end = time.monotonic() + 30
    while not found and time.monotonic() < end:
        found = _anomalies(collector, run, "nonfinite")
        time.sleep(0.3)
    assert found, _anomalies(collector, run, None)
    evidence = found[0]["evidence"]
    assert found[0]["first_step"] == NAN_STEP and evidence["module"] == "poison"
    assert evidence["data_ids"] == {"sample_ids": [1200, 1201, 1202, 1203], "file": "train-017.bin"}
    assert evidence["first_module_output_amax"] == "NaN" and evidence["first_module_input_amax"] > 0
