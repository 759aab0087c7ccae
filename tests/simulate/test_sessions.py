"""What the batch stream looks like around unmarked pauses (the heartbeat's activity fields) and
around a resume (new sessions, repeated steps, a silent gap), as a collector receives it."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import defaultdict
from functools import cache
from typing import Any

import numpy as np
import pytest

from stepwatch_server.simulate import Hang, LossSpike, Scenario, Simulation
from stepwatch_server.simulate.benign import Resume
from stepwatch_server.simulate.physics import fingerprint
from tests.conftest import require_module
from tests.simulate.helpers import check_batch

PAUSES = Scenario(
    "unmarked", world_size=8, steps=500, seed=31, eval_every=200, eval_s=30.0, ckpt_every=300, ckpt_s=40.0,
    marked_pauses=(), agent_activity=True, ckpt_savers="rank0", grad_accum=2, eval_forwards_per_s=20.0,
    user_module="pretrain", capacity_mb=81_559.0,
)  # fmt: skip
RESUMED = Scenario(
    "resumed", world_size=4, steps=700, seed=32, ckpt_every=200, ckpt_s=20.0, agent_activity=True,
    benign=(Resume(step=480, checkpoint_step=400, gap_s=300.0),), compile_s=20.0,
)  # fmt: skip


@cache
def stream(scn: Scenario) -> tuple[Simulation, list[dict[str, Any]]]:
    sim = Simulation(scn)
    return sim, list(sim)


def by_rank(batches: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for b in batches:
        out[b["rank"]].append(b)
    return out


@pytest.mark.parametrize("scn", [PAUSES, RESUMED], ids=["pauses", "resumed"])
def test_batches_pass_the_structural_check_and_the_collector(scn: Scenario) -> None:
    validate = require_module("stepwatch_server.ingest.validate")
    _, batches = stream(scn)
    for b in batches:
        check_batch(b)
    for b in batches[::5]:
        validate.parse_batch(json.loads(json.dumps(b)))


def test_unmarked_pauses_send_no_phase_events_and_stay_in_data() -> None:
    sim, batches = stream(PAUSES)
    assert not [e for b in batches for e in b.get("events", []) if e["kind"].startswith("phase")]
    end200, end300 = sim.ts_of_step(200), sim.ts_of_step(300)
    assert end200 is not None and end300 is not None
    for r, bs in by_rank(batches).items():
        in_eval = [b["heartbeat"] for b in bs if end200 + 1.0 < b["heartbeat"]["ts"] < end200 + 26.0]
        assert len(in_eval) >= 3 and all(hb["phase"] == "data" and hb["last_step"] == 200 for hb in in_eval)
        nograd = [hb["nograd_forwards"] for hb in in_eval]
        assert nograd == sorted(nograd) and nograd[-1] - nograd[0] >= 20 * 15  # 20/s for > 15 s
        assert all(hb["forwards"] == 200 * 2 + hb["nograd_forwards"] for hb in in_eval)  # no step, no grad
        assert all(hb["stack"][1] == "pretrain:evaluate" for hb in in_eval)
        in_ckpt = [b["heartbeat"] for b in bs if end300 + 1.0 < b["heartbeat"]["ts"] < end300 + 36.0]
        assert len(in_ckpt) >= 3 and all(hb["phase"] == "data" and hb["last_step"] == 300 for hb in in_ckpt)
        expected = "torch.serialization:save" if r == 0 else "torch.distributed.distributed_c10d:barrier"
        assert all(hb["stack"][:2] == [expected, "pretrain:save_checkpoint"] for hb in in_ckpt)
        assert len({hb["forwards"] for hb in in_ckpt}) == 1  # nothing runs forward during a save


def test_forwards_advance_with_steps_and_stacks_name_the_phase() -> None:
    _, batches = stream(PAUSES)
    hbs = [
        b["heartbeat"] for b in batches if b["rank"] == 3 and 20 <= (b["heartbeat"]["last_step"] or 0) < 199
    ]
    seen = {hb["phase"]: hb["stack"][0] for hb in hbs}
    assert seen.get("data") == "torch.utils.data.dataloader:_BaseDataLoaderIter.__next__"
    assert seen.get("backward", "torch.autograd:backward") == "torch.autograd:backward"
    for hb in hbs:
        assert hb["nograd_forwards"] == 0
        assert 2 * hb["last_step"] <= hb["forwards"] <= 2 * hb["last_step"] + 2  # grad_accum 2
        assert hb["stack"][-1] == "__main__:<module>"


def test_capacity_is_reported_with_every_step() -> None:
    _, batches = stream(PAUSES)
    with_steps = [b for b in batches if b["steps"]]
    assert all(b["metrics"]["mem.capacity_mb"] == [81_559.0] * len(b["steps"]) for b in with_steps)


def test_the_newer_agent_sends_the_allocators_memory_once_per_transfer() -> None:
    """`memory_every=8`: the agent reads the allocator once per transfer of 8 steps, so the memory
    values (and the capacity sent with them) are on every 8th step and on the last step of each batch,
    null between; the same values as a run that reads them every step, and every other metric intact."""
    sparse = dataclasses.replace(PAUSES, name="sparse-mem", memory_every=8)
    _, every = stream(PAUSES)
    _, batches = stream(sparse)
    memory = ("mem.allocated_mb", "mem.reserved_mb", "mem.peak_mb", "mem.capacity_mb")
    full = {
        (b["rank"], s): {k: b["metrics"][k][i] for k in memory}
        for b in every
        for i, s in enumerate(b["steps"])
    }
    seen = 0
    for b in (b for b in batches if b["steps"]):
        assert b["metrics"]["loss"] == [x for x in b["metrics"]["loss"] if x is not None]  # every step
        last = len(b["steps"]) - 1
        for i, step in enumerate(b["steps"]):
            sent = step % 8 == 0 or i == last
            for k in memory:
                value = b["metrics"][k][i]
                assert (value is not None) == sent, (k, step, i, last)
                if sent:
                    assert value == full[(b["rank"], step)][k]
                    seen += 1
    assert seen > 0


def test_a_hang_with_activity_shows_who_waits_in_a_collective() -> None:
    scn = Scenario(
        "hang-act",
        world_size=4,
        steps=400,
        seed=33,
        agent_activity=True,
        faults=(Hang(2, 300, mode="stuck"),),
    )
    _, batches = stream(scn)
    late = [
        b for b in batches if b["heartbeat"]["ts"] > max(t for x in batches for t in x["timestamps"]) + 20
    ]
    stacks = {b["rank"]: b["heartbeat"]["stack"][0] for b in late}
    assert stacks[2] == "torch.utils.data.dataloader:_BaseDataLoaderIter.__next__"
    assert {stacks[r] for r in (0, 1, 3)} == {"torch.autograd:backward"}


def test_resume_starts_new_sessions_and_repeats_steps() -> None:
    _sim, batches = stream(RESUMED)
    ranks = by_rank(batches)
    assert RESUMED.labels == () and RESUMED.completed_steps == 700 + 80
    for bs in ranks.values():
        sessions = list(dict.fromkeys(b["session"] for b in bs))
        assert len(sessions) == 2
        for s in sessions:
            assert [b["seq"] for b in bs if b["session"] == s] == list(
                range(sum(b["session"] == s for b in bs))
            )
        first = [st for b in bs if b["session"] == sessions[0] for st in b["steps"]]
        second = [st for b in bs if b["session"] == sessions[1] for st in b["steps"]]
        assert first == list(range(1, len(first) + 1)) and 470 <= len(first) <= 480  # unsent steps lost
        assert second == list(range(401, 701))  # from the checkpoint on, again
        first_new = next(b for b in bs if b["session"] == sessions[1])
        assert first_new["heartbeat"]["last_step"] is None or first_new["steps"]


def test_resume_is_silent_during_the_gap_then_compiles_and_ramps_up_again() -> None:
    _sim, batches = stream(RESUMED)
    sent = sorted(b["heartbeat"]["ts"] for b in batches)
    gap = max(b - a for a, b in itertools.pairwise(sent))
    assert 300.0 < gap < 300.0 + 20.0 + 10.0  # the gap, then step 401 compiles (~20 s) before a send
    again: dict[int, dict[str, Any]] = {}
    old: dict[int, dict[str, Any]] = {}
    for b in batches:
        if 401 in b["steps"]:
            i = b["steps"].index(401)
            row = {k: v[i] for k, v in b["metrics"].items()}
            (again if b["rank"] in old else old)[b["rank"]] = row
    for r in range(4):
        assert again[r]["time.forward_ms"] > 15_000 > old[r]["time.forward_ms"]  # compiled again
        assert again[r]["mem.allocated_mb"] < 0.8 * old[r]["mem.allocated_mb"]  # memory ramps up again
        assert again[r]["loss"] != old[r]["loss"]  # new values


def test_resumed_fingerprints_agree_across_ranks_and_differ_from_the_killed_session() -> None:
    _, batches = stream(RESUMED)
    order: dict[int, list[str]] = defaultdict(list)
    fps: dict[tuple[int, int], set[str]] = defaultdict(set)  # (incarnation, step) -> values over ranks
    for b in batches:
        if b["session"] not in order[b["rank"]]:
            order[b["rank"]].append(b["session"])
        inc = order[b["rank"]].index(b["session"])
        for s, v in zip(
            b.get("fingerprints", {}).get("steps", []),
            b.get("fingerprints", {}).get("values", []),
            strict=True,
        ):
            fps[(inc, s)].add(v)
    assert all(len(vs) == 1 for vs in fps.values())  # the replicas agree, in each session
    assert fps[(0, 400)] == {fingerprint(RESUMED.seed, 400)} and (1, 400) not in fps
    assert set(fps) >= {(1, 500), (1, 600), (1, 700)}
    assert fps[(1, 500)] != {fingerprint(RESUMED.seed, 500)}  # other parameters than a run never killed


def test_resume_needs_a_checkpoint_and_faults_after_it() -> None:
    with pytest.raises(ValueError, match="checkpoint"):
        Scenario("r", world_size=4, steps=700, ckpt_every=200, benign=(Resume(480, 300, 60.0),))
    with pytest.raises(ValueError, match="not after the last resume"):
        Scenario(
            "r", world_size=4, steps=700, ckpt_every=200, benign=(Resume(480, 400, 60.0),),
            faults=(LossSpike(450),),
        )  # fmt: skip
    with pytest.raises(ValueError, match="inside a pause"):
        Scenario("r", world_size=4, steps=700, eval_every=200, faults=(Hang(1, 201),))


def test_resumed_step_times_equalise_as_ever() -> None:
    sim = Simulation(RESUMED)
    step = np.concatenate([ch.step_ms for ch in sim.chunks() if ch.incarnation == 1])
    spread = (step.max(axis=1) - step.min(axis=1)) / np.median(step, axis=1)
    assert np.median(spread[10:]) < 0.03
