"""`replica_divergence`: a rank whose parameter fingerprint differs from its replicas' majority."""

from __future__ import annotations

import numpy as np

from stepwatch_server.detect import StepFrame
from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.detectors.replica_divergence import ReplicaDivergenceDetector
from tests.detect.helpers import run_scenario, scenario

KINDS = ("replica_divergence",)


def test_diverged_rank_is_named_on_the_first_fingerprint_after() -> None:
    _, anomalies = run_scenario(scenario("replica_divergence_64", steps=1400), kinds=KINDS)
    (a,) = anomalies
    assert a.rank == 42 and a.severity == "critical" and a.status == "open"
    assert a.detected_step == 1300  # the first fingerprint step after the divergence at 1234
    assert a.evidence["agreeing"] == 63 and a.evidence["group_size"] == 64
    assert "rank 42" in a.summary and "first at step 1300" in a.summary


def test_clean_replicas_agree() -> None:
    _, anomalies = run_scenario(scenario("clean_8", steps=1200), kinds=KINDS)
    assert anomalies == []


def _frame(step: int, fps: dict[int, str], world: int) -> StepFrame:
    return StepFrame("r", step, float(step), np.ones(world, dtype=bool), {}, fingerprints=fps)


def test_groups_by_shard_resolve_and_split_groups() -> None:
    ctx = RunContext("r", 6)
    ctx.shard[:] = [0, 1, 0, 1, 0, 1]  # HSDP: 3 replicas x 2 shards
    det = ReplicaDivergenceDetector(ctx, ReplicaDivergenceDetector.Settings())
    det.on_frame(_frame(100, {0: "a", 2: "a", 4: "a", 1: "b", 3: "b", 5: "b"}, 6))
    assert not ctx.book.open  # shards differ from each other, replicas of one shard agree
    det.on_frame(_frame(200, {0: "a", 2: "x", 4: "a", 1: "b", 3: "b", 5: "b"}, 6))
    (a,) = ctx.book.open.values()
    assert (a.key, a.rank, a.evidence["shard"]) == ("rank:2", 2, 0)
    det.on_frame(_frame(300, {0: "c", 2: "c", 4: "c", 1: "d", 3: "d", 5: "d"}, 6))
    assert not ctx.book.open and ctx.book.resolved[-1].key == "rank:2"
    # Two replicas that disagree: nobody can say which one is wrong.
    ctx2 = RunContext("r", 2)
    det2 = ReplicaDivergenceDetector(ctx2, ReplicaDivergenceDetector.Settings())
    det2.on_frame(_frame(100, {0: "a", 1: "b"}, 2))
    (run,) = ctx2.book.open.values()
    assert run.key == "run" and run.rank is None and "no majority" in run.summary
    det2.on_frame(_frame(200, {0: "c", 1: "c"}, 2))
    assert not ctx2.book.open
