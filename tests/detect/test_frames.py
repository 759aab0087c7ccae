"""The aligner: every step of every rank ends up in exactly one frame, in step order."""

from __future__ import annotations

import numpy as np

from stepwatch_server.detect.frames import Aligner
from stepwatch_server.ingest.validate import parse_batch
from stepwatch_server.simulate import Hang, Simulation
from tests.detect.helpers import scenario


def test_frames_are_complete_and_in_step_order() -> None:
    sc = scenario("clean_8", steps=400)
    aligner = Aligner(sc.name, sc.world_size, grace_s=30.0, capacity=64)
    frames = []
    for doc in Simulation(sc):
        frames += aligner.add(parse_batch(doc))
    steps = [f.step for f in frames]
    assert steps == list(range(1, len(steps) + 1))
    assert len(steps) >= 399  # the last step may wait for a rank's final batch
    assert all(f.present.all() for f in frames)
    loss = np.array([f.metrics["loss"] for f in frames])
    assert np.isfinite(loss).all()
    assert any(f.tensors.get("amax") for f in frames)
    assert any(f.fingerprints for f in frames)


def test_a_dead_rank_does_not_stall_the_frames() -> None:
    # A 16-rank version of hang_dead_256: rank 11 dies in step 300, its unsent steps are lost.
    sc = scenario("hang_dead_256", world_size=16, steps=500, faults=(Hang(11, 300, mode="dead"),))
    hang = sc.hang
    assert hang is not None
    aligner = Aligner(sc.name, sc.world_size, grace_s=30.0)
    last = 0
    partial = 0
    for doc in Simulation(sc):
        for frame in aligner.add(parse_batch(doc)):
            assert frame.step == last + 1
            last = frame.step
            partial += int(not frame.present.all())
    assert last >= hang.step - 1  # every step anyone completed came out, the dead rank's too
    assert partial > 0  # and some of them without the dead rank's lost reports
