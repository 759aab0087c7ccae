"""`bench/evaluate_ref.py`: another checkout's detectors fed over a pipe give the anomalies this
checkout's engine gives in-process, when that checkout is this one (the protocol, not the worktree)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from stepwatch_server.detect.evaluate import detect_scenario
from stepwatch_server.simulate import NonFinite, Scenario
from tests.conftest import REPO

SCN = Scenario(
    "ref", world_size=4, steps=400, seed=41, agent_activity=True, eval_every=150, eval_s=10.0,
    faults=(NonFinite(300, ranks=(2,)),),
)  # fmt: skip


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("evaluate_ref", REPO / "bench" / "evaluate_ref.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["evaluate_ref"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_replay_over_a_pipe_matches_the_in_process_engine() -> None:
    ref = load()
    assert ref.knows_activity(REPO)
    labels, dets, _, info = ref.replay(REPO, SCN, strip=True)
    assert info["collector"].startswith(str(REPO / "service" / "src")) and info["rejected"] == []
    assert info["stripped"] > 0  # activity fields were there, and were taken out
    _, anomalies = detect_scenario(SCN)
    assert [(d.kind, d.rank, d.first_step, d.detected_at_step) for d in dets] == [
        (a.kind, a.rank, a.first_step, a.detected_step) for a in anomalies
    ]
    assert [lab.kind for lab in labels] == ["nonfinite"] and labels[0].first_ts is not None
    assert any(d.kind == "nonfinite" and d.rank == 2 for d in dets)
