"""The aligner: every step of every rank ends up in exactly one frame, in step order."""

from __future__ import annotations

import numpy as np
import pytest

from stepwatch_server.detect.frames import FIRST_RING_STEPS, RING_STEPS, Aligner, StepFrame
from stepwatch_server.ingest.validate import parse_batch
from stepwatch_server.simulate import Hang, Simulation
from tests.detect.helpers import scenario
from tests.service.conftest import steps_batch


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


def _frame_key(frame: StepFrame) -> tuple[object, ...]:
    metrics = {name: values.tobytes() for name, values in frame.metrics.items()}
    tensors = {(s, n): v.tobytes() for s, cols in frame.tensors.items() for n, v in cols.items()}
    events = [(row, e.kind, e.step) for row, e in frame.events]
    return frame.step, frame.ts, frame.present.tobytes(), metrics, tensors, frame.fingerprints, events


def _ahead_docs(ranks: int, steps: int, ahead: dict[int, int], seed: int) -> list[dict[str, object]]:
    """Batches of 1-7 steps per rank, interleaved at random; rank r runs `ahead[r]` steps ahead of the
    others (its batches sent earlier), so the oldest pending step waits while it reports far later ones."""
    rng = np.random.default_rng(seed)
    queues = []
    for rank in range(ranks):
        batches, step = [], 1
        while step <= steps:
            n = int(rng.integers(1, 8))
            batch_steps = list(range(step, min(steps, step + n - 1) + 1))
            step += len(batch_steps)
            batches.append(
                steps_batch(
                    "ahead", f"session-{rank}", len(batches), batch_steps, rank=rank, world_size=ranks,
                    loss=[float(rng.random()) for _ in batch_steps],
                    grad_norm=[float(rng.random()) for _ in batch_steps],
                )
            )  # fmt: skip
        queues.append(batches)
    docs: list[dict[str, object]] = []
    sent = [0] * ranks
    while any(sent[r] < len(queues[r]) for r in range(ranks)):
        # the rank whose next batch starts earliest (less its lead) goes next, ties at random
        def start(r: int) -> float:
            steps_r = queues[r][sent[r]]["steps"]
            return float(steps_r[0]) - ahead.get(r, 0) + float(rng.random())  # type: ignore[index]

        r = min((r for r in range(ranks) if sent[r] < len(queues[r])), key=start)
        docs.append(queues[r][sent[r]])
        sent[r] += 1
    return docs


@pytest.mark.parametrize(
    "stream",
    ["clean_8", "hang_dead", "one_rank_120_ahead", "one_rank_700_ahead", "two_ranks_300_ahead"],
)
def test_a_ring_that_starts_small_emits_the_same_frames_as_one_allocated_whole(stream: str) -> None:
    """The ring grows as ranks run ahead (issue 14: a fixed 512-step ring held 1.3 MiB for every short
    run); what comes out must be exactly what a ring allocated whole gives: the same frames, the same
    values, the same incomplete steps forced out once a rank runs more than RING_STEPS ahead."""
    if stream == "clean_8":
        docs = list(Simulation(scenario("clean_8", steps=600)))
    elif stream == "hang_dead":
        sc = scenario("hang_dead_256", world_size=16, steps=500, faults=(Hang(11, 300, mode="dead"),))
        docs = list(Simulation(sc))
    else:
        ahead = {
            "one_rank_120_ahead": {2: 120},
            "one_rank_700_ahead": {0: 700},
            "two_ranks_300_ahead": {1: 300, 3: 300},
        }[stream]
        docs = _ahead_docs(4, 1500, ahead, seed=len(stream))
    world = int(docs[0]["world_size"])  # type: ignore[call-overload]
    whole = Aligner("x", world, grace_s=30.0, first_capacity=RING_STEPS)
    small = Aligner("x", world, grace_s=30.0, first_capacity=2)
    got_whole, got_small = [], []
    for doc in docs:
        batch = parse_batch(doc)
        got_whole += [_frame_key(f) for f in whole.add(batch)]
        got_small += [_frame_key(f) for f in small.add(batch)]
    assert len(got_whole) >= 299  # the hang's run stops at step 300
    assert got_small == got_whole
    if stream == "one_rank_700_ahead":
        assert small.capacity == RING_STEPS  # grown to its most, then forced steps out as the whole one did
        assert any(not np.frombuffer(k[2], dtype=bool).all() for k in got_whole)


def test_a_short_run_in_step_holds_a_small_ring() -> None:
    """Two ranks sending 2 steps a batch in step with each other: the ring stays at its first size and
    has a column per rank heard from, so a short run costs kilobytes, not the 512-step x 8-column ring
    per metric it held before (issue 14, item 12)."""
    aligner = Aligner("short", 2, grace_s=30.0)
    frames = []
    for seq in range(100):
        for rank in range(2):
            steps = [2 * seq + 1, 2 * seq + 2]
            doc = steps_batch("short", f"session-{rank}", seq, steps, rank=rank, world_size=2,
                              **{f"m{i}": [1.0, 2.0] for i in range(30)})  # fmt: skip
            frames += aligner.add(parse_batch(doc))
    assert [f.step for f in frames] == list(range(1, 201))
    assert aligner.capacity == FIRST_RING_STEPS < RING_STEPS
    assert aligner._mring.shape == (30, FIRST_RING_STEPS, 2)


def test_each_metric_lands_in_its_own_row_whatever_names_order_and_nulls_each_rank_sends() -> None:
    """Ranks may send different sets of names, in any order, with nulls (not measured: NaN in the frame);
    names beyond MAX_METRICS are left out and the others keep their values."""
    from stepwatch_server.detect.frames import MAX_METRICS

    aligner = Aligner("names", 2, grace_s=30.0, capacity=16)
    many = {f"m{i}": [float(i), float(i) + 0.5] for i in range(MAX_METRICS + 6)}
    docs = [
        steps_batch("names", "session-a0", 0, [1, 2], rank=0, world_size=2, loss=[1.0, None], lr=[0.1, 0.2]),
        steps_batch(
            "names", "session-b1", 0, [1, 2], rank=1, world_size=2, lr=[0.3, 0.4], x=[5, 6], loss=[2.0, 3.0]
        ),
        steps_batch("names", "session-a0", 1, [3, 4], rank=0, world_size=2, **many),
        steps_batch("names", "session-b1", 1, [3, 4], rank=1, world_size=2, lr=[0.7, None], loss=[4.0, 5.0]),
    ]
    docs += [  # a new name once the rows are all taken, before a known one: left out, loss still loss
        steps_batch("names", "session-a0", 2, [5], rank=0, world_size=2, late=[9.0], loss=[6.0]),
        steps_batch("names", "session-b1", 2, [5], rank=1, world_size=2, loss=[7.0]),
    ]
    frames: list[StepFrame] = []
    for doc in docs:
        frames += aligner.add(parse_batch(doc))
    by_step = {f.step: f.metrics for f in frames}
    assert sorted(by_step) == [1, 2, 3, 4, 5]
    np.testing.assert_array_equal(by_step[5]["loss"], [6.0, 7.0])
    assert "late" not in by_step[5]
    np.testing.assert_array_equal(by_step[1]["loss"], [1.0, 2.0])
    np.testing.assert_array_equal(by_step[2]["loss"], [np.nan, 3.0])
    np.testing.assert_array_equal(by_step[2]["lr"], [0.2, 0.4])
    np.testing.assert_array_equal(by_step[2]["x"], [np.nan, 6.0])
    np.testing.assert_array_equal(by_step[4]["lr"], [np.nan, np.nan])
    np.testing.assert_array_equal(by_step[4]["loss"], [np.nan, 5.0])
    kept = [name for name in many if name in by_step[4]]
    assert len(kept) == MAX_METRICS - 3  # loss, lr and x took three of the rows
    for name in kept:
        np.testing.assert_array_equal(by_step[3][name], [many[name][0], np.nan])
        np.testing.assert_array_equal(by_step[4][name], [many[name][1], np.nan])
