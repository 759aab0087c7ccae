"""Each benign behaviour shows in the trace as specified, touches nothing else, and leaves no label.

Most checks compare a scenario with and without the behaviour: behaviours draw from their own random
streams, so everything outside the behaviour's reach must be bit-for-bit the same."""

from __future__ import annotations

import dataclasses
from functools import cache

import numpy as np
import pytest

from stepwatch_server.simulate import LossSpike, MemoryLeak, Scenario, Simulation, Straggler
from stepwatch_server.simulate.benign import (
    Congestion,
    DataStall,
    EvalMemoryStep,
    ExtraDataWork,
    LossBump,
    MemoryDrift,
    MemorySawtooth,
    NodeDataHiccup,
)
from stepwatch_server.simulate.physics import shares

BASE = Scenario(
    "benign", world_size=16, steps=800, seed=21, plateaus_per_10k=0.0, gc_rate=0.0, global_blip_rate=0.0
)


@cache
def arrays(scn: Scenario) -> dict[str, np.ndarray]:
    """Chunk attributes over the whole run, (steps, ranks) (row 0 = step 1)."""
    chunks = list(Simulation(scn).chunks())
    names = (
        "data",
        "forward",
        "backward",
        "step_ms",
        "tail",
        "alloc",
        "peak",
        "reserved",
        "loss",
        "grad_norm",
    )
    out = {n: np.concatenate([getattr(ch, n) for ch in chunks]) for n in names}
    out["pause_ms"] = np.concatenate([ch.pause_ms for ch in chunks])
    out["stall_ms"] = np.concatenate([ch.stall_ms for ch in chunks])  # type: ignore[misc]
    return out


def with_benign(*benign: object, **kw: object) -> Scenario:
    return dataclasses.replace(BASE, benign=benign, **kw)  # type: ignore[arg-type]


def test_benign_behaviours_make_no_labels() -> None:
    scn = with_benign(MemoryDrift(100, 1.0, 300.0), LossBump(400, 5, 1.1), Congestion(300, 10, 2.0))
    assert scn.labels == () and scn.clean


def test_memory_drift_rises_and_levels_off_on_its_ranks_only() -> None:
    drift = MemoryDrift(start=100, mb_per_step=1.0, total_mb=300.0, ranks=(5,))
    a, b = arrays(BASE)["alloc"], arrays(with_benign(drift))["alloc"]
    rise = b[:, 5] - a[:, 5]
    early = (rise[149] - rise[99]) / 50  # steps 100-150: about the initial slope
    late = (rise[599] - rise[549]) / 50  # 450 steps on: exp(-450/300) of it
    assert 0.8 < early < 1.0 and 0.15 < late < 0.3  # the slope falls...
    assert 250 < rise[-1] < 300  # ...towards the total
    assert np.all(rise[:98] == 0) and np.all(np.diff(rise[100:]) >= 0)
    np.testing.assert_array_equal(np.delete(b, 5, axis=1), np.delete(a, 5, axis=1))


def test_every_rank_drift_differs_a_little_between_ranks() -> None:
    a, b = arrays(BASE)["alloc"], arrays(with_benign(MemoryDrift(100, 0.5, 200.0)))["alloc"]
    final = (b - a)[-1]
    assert np.all(final > 50) and final.std() > 5  # every rank rises, not identically


def test_eval_memory_steps_up_at_the_first_evals_and_stays() -> None:
    kw = {"eval_every": 200, "eval_s": 20.0, "marked_pauses": ()}
    a = arrays(with_benign(**kw))["alloc"]
    b = arrays(with_benign(EvalMemoryStep((300.0, 150.0)), **kw))["alloc"]
    d = np.median(b - a, axis=1)
    assert d[199] == 0 and 250 < d[200] < 350  # step 201, right after the eval of step 200
    assert 400 < d[400] < 500 and d[600] == pytest.approx(d[400])  # the third eval adds nothing


def test_sawtooth_grows_then_drops_back() -> None:
    saw = MemorySawtooth(ranks=(0,), mb=1000.0, period=100, start=1)
    rise = arrays(with_benign(saw))["alloc"][:, 0] - arrays(BASE)["alloc"][:, 0]
    assert rise[99] == pytest.approx(990.0) and rise[100] == 0.0  # step 101 is back at 0
    assert rise[149] == pytest.approx(490.0)
    assert (np.diff(rise) < -900).sum() == 7  # drops at steps 101, 201, ..., 701


def test_congestion_lengthens_the_collective_for_everyone() -> None:
    a, b = arrays(BASE), arrays(with_benign(Congestion(300, 20, 2.5)))
    rows = slice(299, 319)
    np.testing.assert_array_equal(b["forward"], a["forward"])
    np.testing.assert_array_equal(b["data"], a["data"])
    grew = np.median(b["step_ms"][rows] / a["step_ms"][rows])
    assert 1.0 + 1.2 * shares(BASE)[4] < grew < 1.0 + 1.8 * shares(BASE)[4]  # (2.5 - 1) x the tail's share
    assert np.all(b["backward"][rows] > a["backward"][rows])  # every rank waits longer in backward
    np.testing.assert_array_equal(b["step_ms"][:299], a["step_ms"][:299])


def test_node_hiccup_touches_exactly_its_nodes_data_time_for_its_steps() -> None:
    a, b = arrays(BASE), arrays(with_benign(NodeDataHiccup(node=1, step=400, steps=7, factor=5.0)))
    ratio = b["data"] / a["data"]
    changed = ratio != 1.0
    assert set(np.flatnonzero(changed.any(axis=1)) + 1) == set(range(400, 407))
    assert set(np.flatnonzero(changed.any(axis=0))) == set(range(8, 16))
    np.testing.assert_allclose(ratio[399:406, 8:], 5.0)
    np.testing.assert_array_equal(b["forward"], a["forward"])
    assert np.all(b["backward"][399:406, :8] > a["backward"][399:406, :8])  # the other node waits


def test_data_stall_on_one_rank() -> None:
    a, b = arrays(BASE), arrays(with_benign(DataStall(rank=3, step=500, steps=2, step_times=4.0)))
    extra = b["data"] - a["data"]
    np.testing.assert_allclose(extra[499:501, 3], 4.0 * BASE.step_ms)
    extra[499:501, 3] = 0.0
    assert not extra.any()


def test_loss_bump_moves_the_loss_not_the_grad_norm() -> None:
    a, b = arrays(BASE), arrays(with_benign(LossBump(step=450, steps=6, factor=1.12)))
    np.testing.assert_allclose(b["loss"][449:455] / a["loss"][449:455], 1.12)
    np.testing.assert_array_equal(b["loss"][:449], a["loss"][:449])
    np.testing.assert_array_equal(b["grad_norm"], a["grad_norm"])


@pytest.mark.parametrize(("who", "ranks"), [("local0", [0, 8]), ("rank0", [0])])
def test_extra_data_work_on_local_rank_zero(who: str, ranks: list[int]) -> None:
    a, b = arrays(BASE), arrays(with_benign(ExtraDataWork(1.4, who)))  # type: ignore[arg-type]
    ratio = b["data"] / a["data"]
    np.testing.assert_allclose(ratio[:, ranks], 1.4)
    assert np.all(np.delete(ratio, ranks, axis=1) == 1.0)


def test_data_share_and_memory_level_and_capacity() -> None:
    scn = with_benign(data_share=0.01, base_alloc_mb=60_000.0, act_peak_mb=15_000.0, capacity_mb=81_559.0)
    m = arrays(scn)
    assert 0.008 < np.median(m["data"][20:]) / BASE.step_ms < 0.012
    assert 59_000 < np.median(m["alloc"][100:]) < 61_000 and np.all(m["reserved"] <= 81_559.0)
    assert 0.9 < np.median(m["step_ms"][20:]) / BASE.step_ms < 1.1  # the other phases fill the step


def test_every_rank_leak_is_one_run_level_label() -> None:
    scn = with_benign(faults=(MemoryLeak(None, 300, mb_per_step=3.0),))
    (lab,) = scn.labels
    assert lab.kind == "memory_leak" and lab.rank is None and lab.node is None
    rise = arrays(scn)["alloc"][-1] - arrays(BASE)["alloc"][-1]
    assert np.all(rise > 0.9 * 3.0 * 500) and np.all(rise < 1.1 * 3.0 * 501)


def test_scenarios_reject_ambiguous_or_impossible_benign_behaviours() -> None:
    with pytest.raises(ValueError, match="outside"):
        with_benign(DataStall(rank=16, step=10, steps=1, step_times=1.0))
    with pytest.raises(ValueError, match="node"):
        with_benign(NodeDataHiccup(node=2, step=10, steps=1, factor=2.0))
    with pytest.raises(ValueError, match="loss bump"):
        with_benign(LossBump(500, 5, 1.1), faults=(LossSpike(503),))


def test_a_slow_loader_does_not_stretch_a_pause_or_a_storage_blip() -> None:
    kw = {"eval_every": 300, "eval_s": 30.0, "global_blip_rate": 1 / 50}
    a = arrays(with_benign(**kw))
    b = arrays(with_benign(faults=(Straggler(4, 200, factor=2.0, phase="data"),), **kw))
    extra = b["data"][:, 4] - a["data"][:, 4]
    own = a["data"][:, 4] - a["pause_ms"] - a["stall_ms"]
    np.testing.assert_allclose(extra[199:], own[199:])  # 2x its own wait, and only that
    assert a["pause_ms"][300] > 25_000 and a["stall_ms"][199:].max() > 0.9 * BASE.step_ms  # both happen
    assert extra[300] < 0.1 * BASE.step_ms  # step 301, after the 30 s evaluation


@pytest.mark.parametrize("order", ["stall first", "stall last"])
def test_more_data_work_or_a_node_hiccup_does_not_lengthen_a_rank_data_stall(order: str) -> None:
    """A data stall is drawn under the hang deadline; local rank 0's extra data work and its node's
    hiccup multiply the loader's own time only, so the stall stays what it was drawn as (heldout-032's
    20 s stalls on a local rank 0 doing 1.5x the data work were 30 s, a real hang)."""
    stall = DataStall(rank=8, step=500, steps=2, step_times=4.0)
    others = (ExtraDataWork(1.5, "local0"), NodeDataHiccup(node=1, step=499, steps=4, factor=3.0))
    plain = arrays(with_benign(*others))
    both = arrays(with_benign(stall, *others) if order == "stall first" else with_benign(*others, stall))
    extra = both["data"] - plain["data"]
    np.testing.assert_allclose(extra[499:501, 8], 4.0 * BASE.step_ms)
    extra[499:501, 8] = 0.0
    np.testing.assert_allclose(extra, 0.0, atol=1e-9)
