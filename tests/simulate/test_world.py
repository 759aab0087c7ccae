"""The world: two disjoint, deterministic splits that hold every fault kind (with the hard cases), the
benign behaviours, and runs whose batches the collector accepts."""

from __future__ import annotations

import hashlib
import inspect
import json
from itertools import islice, pairwise

import pytest

from stepwatch_server.simulate import (
    KINDS,
    MemoryLeak,
    Scenario,
    Straggler,
    generate,
    world_benign,
    world_faults,
)
from stepwatch_server.simulate import world as world_mod
from stepwatch_server.simulate.benign import EFFECTS
from stepwatch_server.simulate.world import (
    DEV,
    FINAL,
    FINAL2,
    HELDOUT,
    RunPlan,
    build,
    composition,
    plan,
    split,
)
from tests.conftest import require_module
from tests.simulate.helpers import check_batch


@pytest.mark.parametrize("name", ["dev", "heldout", "final", "final2", "final3", "final4", "final5"])
def test_split_holds_every_kind_the_hard_cases_and_a_third_clean(name: str) -> None:
    scns = split(name)
    comp = composition(scns)
    assert comp["runs"] == 40 and 11 <= comp["clean_runs"] <= 15
    assert all(comp["labels"].get(kind, 0) >= 4 for kind in KINDS), comp["labels"]
    sizes = comp["ranks"]
    assert min(sizes) == 2 and max(sizes) == 512 and sum(s <= 4 for s in sizes) == 10
    assert comp["rank_steps"] <= 4_300_000
    assert set(comp["benign_runs"]) == {cls.kind for cls in EFFECTS}  # every behaviour, somewhere
    assert 0 < comp["agent_activity_runs"] < 40 and 0 < comp["unmarked_pause_runs"] < 40
    faults = [(scn, f) for scn in scns.values() for f in scn.faults]
    leaks = [(s, f) for s, f in faults if isinstance(f, MemoryLeak)]
    assert any(f.rank is None for _, f in leaks)  # every rank: a run-level label
    assert any(f.mb_per_step >= 20 for _, f in leaks)  # a big leak
    near = [(s, f) for s, f in leaks if f.mb_per_step <= 2 and s.capacity_mb is not None]
    # a slow leak that fills the device within a few times its own length
    assert any(
        s.capacity_mb - s.base_alloc_mb - s.act_peak_mb < 8 * f.mb_per_step * (s.last_step - f.start)  # type: ignore[operator]
        for s, f in near
    )
    assert any(
        s.benign and any(b.kind == "memory_drift" for b in s.benign) and f.rank is not None for s, f in leaks
    )
    small = [s.world_size for s, f in faults if isinstance(f, Straggler)]
    assert {2, 3} <= set(small)
    spikes = [f for _, f in faults if f.kind == "loss_spike"]
    assert any(110 <= f.step <= 300 for f in spikes)  # type: ignore[union-attr]
    hangs = [s for s, f in faults if f.kind == "hang"]
    assert all(not s.marked_pauses and (s.eval_every or s.ckpt_every) for s in hangs)
    assert {f.mode for _, f in faults if f.kind == "hang"} == {"stuck", "dead"}  # type: ignore[union-attr]


def test_splits_are_disjoint_and_deterministic() -> None:
    assert {p.seed for p in DEV}.isdisjoint(p.seed for p in HELDOUT)
    assert len({p.seed for p in DEV + HELDOUT + FINAL + FINAL2}) == 160
    assert [p.name for p in DEV] == [f"dev-{i:03d}" for i in range(40)]
    assert [p.name for p in HELDOUT] == [f"heldout-{i:03d}" for i in range(40)]
    plan.cache_clear()
    assert plan("dev") == DEV and plan("heldout") == HELDOUT
    for p in DEV[:5] + HELDOUT[:5]:
        assert build(p) == build(p) == split(p.name.split("-")[0])[p.name]
    with pytest.raises(ValueError, match="unknown split"):
        plan("test")


def test_the_same_seed_gives_the_same_trace() -> None:
    p = next(p for p in DEV if p.world_size <= 4)

    def digest() -> str:
        h = hashlib.sha256()
        for b in islice(generate(build(p)), 800):
            h.update(json.dumps(b, sort_keys=True).encode())
        return h.hexdigest()

    assert digest() == digest()


def test_the_generator_reads_no_detector_setting() -> None:
    for mod in (world_mod, world_faults, world_benign):
        assert "stepwatch_server.detect" not in inspect.getsource(mod)


def small_world_runs() -> list[Scenario]:
    """The world's own small runs (2-3 ranks), and a handful of 8-rank draws cut short: every benign
    behaviour, unmarked pauses, resumes, activity on and off."""
    own = [s for s in list(split("dev").values()) + list(split("heldout").values()) if s.world_size <= 3]
    drawn = [build(RunPlan(f"t-{i}", 1000 + i, 8, ()), max_steps=1500) for i in range(8)]
    return own + drawn


def test_small_world_runs_cover_the_stream_features() -> None:
    runs = small_world_runs()
    assert any(s.resumes for s in runs) and any(not s.marked_pauses and s.eval_every for s in runs)
    assert any(s.agent_activity for s in runs) and any(not s.agent_activity for s in runs)
    assert any(s.capacity_mb for s in runs)


@pytest.mark.parametrize("index", range(len(small_world_runs())))
def test_world_batches_pass_the_structural_check_and_the_collector(index: int) -> None:
    validate = require_module("stepwatch_server.ingest.validate")
    scn = small_world_runs()[index]
    for i, b in enumerate(generate(scn)):
        check_batch(b)
        if i % 11 == 0 or b.get("events") or not b["steps"]:
            validate.parse_batch(json.loads(json.dumps(b)))


def test_cli_lists_and_describes_world_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from stepwatch_server.simulate.__main__ import main

    assert main(["list", "--world", "heldout"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 40 and "heldout-000" in lines[0]
    assert main(["describe", "dev-003"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["name"] == "dev-003" and "benign" in described and "labels" in described


def test_benign_loss_bumps_never_stack() -> None:
    """Two bumps on the same steps multiply past the benign range (1.08 x 1.18 = 1.27x, which the
    detectors may rightly call a spike): the world keeps them apart, in both splits."""
    from stepwatch_server.simulate.benign import LossBump
    from stepwatch_server.simulate.world import split

    for name in ("dev", "heldout"):
        for scn in split(name).values():
            bumps = sorted((b for b in scn.benign if isinstance(b, LossBump)), key=lambda b: b.step)
            for a, b in pairwise(bumps):
                assert b.step > a.step + a.steps + 5, (scn.name, a, b)


def test_one_ranks_data_stalls_never_stack() -> None:
    """Two stalls of one rank on the same steps add up (2 x 20 s is past the hang deadline a stall is
    drawn under: final-014's rank 4 waited 40 s): the world keeps them apart, in every split."""
    from stepwatch_server.simulate.benign import DataStall
    from stepwatch_server.simulate.world import SPLITS, split

    for name in SPLITS:
        for scn in split(name).values():
            stalls = sorted(
                (b for b in scn.benign if isinstance(b, DataStall)), key=lambda b: (b.rank, b.step)
            )
            for a, b in pairwise(stalls):
                assert a.rank != b.rank or b.step >= a.step + a.steps, (scn.name, a, b)
