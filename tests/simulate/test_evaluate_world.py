"""`detect.evaluate`'s world mode: the report's table and lists, what a false alarm was near, and the
command line. (Scoring a whole split takes minutes; these use hand-made detections.)"""

from __future__ import annotations

import pytest

from stepwatch_server.detect.evaluate import error_list, main, near, score_results, world_table
from stepwatch_server.simulate import Detection, Scenario
from stepwatch_server.simulate.benign import DataStall, MemoryDrift
from stepwatch_server.simulate.scenario import Straggler

RUN = Scenario(
    "w", world_size=8, steps=1000, eval_every=300, marked_pauses=(),
    benign=(MemoryDrift(100, 1.0, 200.0, ranks=(2,)), DataStall(5, 700, 3, 4.0)),
    faults=(Straggler(3, 400, factor=1.5),),
)  # fmt: skip
CLEAN = Scenario("c", world_size=4, steps=500)


def test_report_lists_false_alarms_with_what_was_near_them_and_misses() -> None:
    results = [
        (RUN.labels, [Detection("memory_leak", 120, 440, rank=2, summary="rank 2 growing 0.6 MB/step")], 1.0),
        (CLEAN.labels, [], 0.5),
    ]
    total, rows = score_results([RUN, CLEAN], results, progress=None)
    assert [r["scenario"] for r in rows] == ["w", "c"] and rows[0]["completed_steps"] == 1000
    fa = total.false_alarm_rows[0]
    assert any("memory drift on ranks [2]" in x for x in fa["near"])
    assert not any("data stall" in x for x in fa["near"])  # steps 700-702 are far from it
    table = world_table(total)
    assert "| `memory_leak` | 0 | - | 0% |" in table and "| **all kinds** | 1 | 0% | 0% |" in table
    assert (
        f"Clean steps (completed steps outside every label's window): {total.steps_outside_labels:,}" in table
    )
    text = error_list(total)
    assert "False alarms (1):" in text and "rank 2 growing 0.6 MB/step" in text
    assert "Misses (1):" in text and "- w `straggler` rank=3" in text


def test_near_names_unmarked_pauses() -> None:
    fa = {"first_step": 301, "detected_step": 305, "last_step": None}
    assert any("marked: none" in x for x in near(RUN, fa))


def test_world_mode_takes_no_scenario_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--world", "dev", "clean_8"])
    assert "--world scores a whole split" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--world", "test"])
