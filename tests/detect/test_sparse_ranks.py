"""Detection state is sized by the ranks heard from: a run that declares the largest world size and
sends from a few scattered ranks gets the answers the same ranks numbered 0..N-1 get, with its own
rank numbers, and a rank heard from first in the middle of the run joins without upsetting the others."""

from __future__ import annotations

from typing import Any

from stepwatch_server.detect import Anomaly, DetectionEngine
from stepwatch_server.ingest.validate import MAX_WORLD_SIZE
from stepwatch_server.simulate import Hang, Scenario, Simulation, Straggler
from tests.detect.helpers import detect_docs, scenario

KINDS = ("straggler", "slow_node", "hang", "nonfinite", "memory_leak")
SLOW = 5


def sparse(rank: int) -> int:
    return rank * 16_001 + 7  # 7, 16008, ... 112014: scattered over the declared 131,072


def feed(docs: list[dict[str, Any]]) -> tuple[DetectionEngine, list[Anomaly]]:
    return detect_docs(docs, KINDS)


def docs(
    world: int | None = None, late: int | None = None, sc: Scenario | None = None
) -> list[dict[str, Any]]:
    sc = sc or scenario(
        "straggler_10pct_fwd_64", world_size=8, steps=700, faults=(Straggler(SLOW, 300, factor=1.3),)
    )
    out = []
    for doc in Simulation(sc):
        if late is not None and doc["rank"] == late and doc["steps"] and doc["steps"][0] < 200:
            continue  # this rank is heard from first at step ~200
        if world is not None:
            doc = doc | {"rank": sparse(doc["rank"]), "world_size": world}
        out.append(doc)
    return out


def test_scattered_ranks_of_a_huge_declared_world_get_the_dense_answer_with_their_numbers() -> None:
    _, dense = feed(docs())
    engine, scattered = feed(docs(world=MAX_WORLD_SIZE))
    (rd,) = engine.runs.values()
    assert rd.ctx.n_ranks == 8 and rd.ctx.ranks.tolist() == [sparse(r) for r in range(8)]
    assert rd.aligner._mring.shape[2] <= 16  # columns for the ranks heard from, not 131,072
    assert [(a.kind, a.rank) for a in dense] == [("straggler", SLOW)], [a.summary for a in dense]
    assert [(a.kind, a.rank, a.key) for a in scattered] == [
        ("straggler", sparse(SLOW), f"rank:{sparse(SLOW)}")
    ]
    (d,), (s,) = dense, scattered
    assert s.summary.startswith(f"rank {sparse(SLOW)} on node ")
    # Frames of a run with ranks missing wait out the alignment grace, so the last ones are still pending:
    # the answer is the same, updated up to a few steps earlier.
    assert (s.first_step, s.detected_step) == (d.first_step, d.detected_step)
    assert abs(s.evidence["ratio"] - d.evidence["ratio"]) < 0.02


def test_a_rank_heard_from_first_mid_run_joins_and_the_straggler_is_still_found() -> None:
    engine, anomalies = feed(docs(world=MAX_WORLD_SIZE, late=2))
    (rd,) = engine.runs.values()
    assert rd.ctx.n_ranks == 8
    assert [(a.kind, a.rank) for a in anomalies] == [("straggler", sparse(SLOW))], [
        a.summary for a in anomalies
    ]


def test_a_hang_names_the_culprit_by_its_number_and_counts_the_ranks_never_heard_from() -> None:
    sc = scenario(
        "hang_stuck_32", world_size=8, steps=400, faults=(Hang(3, 300, mode="stuck", phase="data"),)
    )
    _, anomalies = feed(docs(world=MAX_WORLD_SIZE, sc=sc))
    hangs = [a for a in anomalies if a.kind == "hang"]
    assert [(a.rank, a.evidence["culprits"]) for a in hangs] == [(sparse(3), [sparse(3)])], hangs
    evidence = hangs[0].evidence
    assert evidence["ranks_never_heard"] == MAX_WORLD_SIZE - 8
    assert evidence["never_heard_ranges"][:2] == [[0, 6], [8, sparse(1) - 1]]
    assert len(evidence["never_heard_ranges"]) == 9  # the gaps around 8 ranks, listed whole
