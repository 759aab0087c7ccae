"""The scorer's arithmetic on hand-made labels and detections."""

from __future__ import annotations

import pytest

from stepwatch_server.simulate import Detection, Label, Score, score, score_scenario
from stepwatch_server.simulate.score import EARLY_SLACK_STEPS, LATE_SLACK_STEPS, matches, steps_outside

SPIKE = Label("loss_spike", None, None, 1000, 1030, first_ts=5000.0)
STRAGGLER = Label("straggler", 17, "gpu-002", 500, None, tolerated=("throughput_drop",), first_ts=2000.0)
SLOW_NODE = Label("slow_node", None, "gpu-003", 800, 1200, ranks=(24, 25, 26), tolerated=("straggler",))
NAN = Label("nonfinite", 5, "gpu-000", 1234, 1234, ranks=(5, 9))


def det(kind: str, first: int, at: int | None = None, **kw: object) -> dict[str, object]:
    return {"kind": kind, "first_step": first, "detected_at_step": first if at is None else at, **kw}


def test_recall_precision_and_time_to_detect() -> None:
    s = score(
        [
            (
                "a",
                [SPIKE, STRAGGLER],
                [
                    det("loss_spike", 1000, 1002, detected_at_ts=5001.5),
                    det("loss_spike", 1001, 1005),  # a second report of the same spike: duplicate, not false
                    det("straggler", 530, 540, rank=17, detected_at_ts=2016.0),
                    det("straggler", 530, 540, rank=18),  # wrong rank: false
                    det("memory_leak", 100, 400, rank=3),  # nothing there: false
                    det("throughput_drop", 600, 610),  # implied by the straggler: ignored
                ],
                2000,
            )
        ]
    )
    spike, strag, leak, tput = (
        s.kinds[k] for k in ("loss_spike", "straggler", "memory_leak", "throughput_drop")
    )
    assert (spike.labels, spike.recalled, spike.tp, spike.fp, spike.duplicates) == (1, 1, 2, 0, 1)
    assert spike.ttd_steps == [2] and spike.ttd_s == [1.5]
    assert (strag.recall, strag.tp, strag.fp, strag.precision) == (1.0, 1, 1, 0.5)
    assert strag.ttd_steps == [40] and strag.ttd_s == [16.0]
    assert (leak.fp, leak.precision, leak.recall) == (1, 0.0, None)
    assert (tput.tp, tput.fp, tput.tolerated) == (0, 0, 1)
    assert s.clean_steps == 0 and s.false_alarms_per_10k_steps is None
    assert len(s.false_alarms) == 2


def test_misses_and_clean_run_false_alarm_rate() -> None:
    s = Score()
    score_scenario(
        s, "spiky", [SPIKE], [det("loss_spike", 1200, 1200)], steps=3000
    )  # too late: outside window
    score_scenario(
        s, "clean-a", [], [det("straggler", 10, 60, rank=1), det("hang", 99, 99, rank=0)], steps=20_000
    )
    score_scenario(s, "clean-b", [], [], steps=5_000)
    assert s.kinds["loss_spike"].recall == 0.0 and s.kinds["loss_spike"].missed == [
        "spiky: loss_spike rank=None node=None step=1000"
    ]
    assert s.kinds["loss_spike"].fp == 1
    assert s.clean_steps == 25_000 and s.clean_false_alarms == 2
    assert s.false_alarms_per_10k_steps == pytest.approx(0.8)
    assert "false alarms per 10k steps on clean runs: 0.80" in s.table()
    assert s.as_dict()["kinds"]["loss_spike"]["recall"] == 0.0


def test_window_slack_edges() -> None:
    lo, hi = SPIKE.first_step - EARLY_SLACK_STEPS, SPIKE.last_step + LATE_SLACK_STEPS  # type: ignore[operator]
    assert matches(Detection("loss_spike", lo, lo), SPIKE)
    assert not matches(Detection("loss_spike", lo - 1, lo - 1), SPIKE)
    assert matches(Detection("loss_spike", hi, hi), SPIKE)
    assert not matches(Detection("loss_spike", hi + 1, hi + 1), SPIKE)
    # a detection that opened long before but was only raised at the spike does not count as early
    assert not matches(Detection("loss_spike", 900, 990, last_step=1010), SPIKE)
    assert matches(Detection("loss_spike", 990, 1001, last_step=1010), SPIKE)
    # open-ended labels accept any later detection
    assert matches(Detection("straggler", 9000, 9000, rank=17), STRAGGLER)


def test_entity_rules() -> None:
    assert matches(Detection("slow_node", 900, 905, node="gpu-003"), SLOW_NODE)
    assert matches(Detection("slow_node", 900, 905, rank=25), SLOW_NODE)  # no node given, a rank of it
    assert not matches(Detection("slow_node", 900, 905, node="gpu-004"), SLOW_NODE)
    assert not matches(Detection("slow_node", 900, 905, rank=40), SLOW_NODE)
    assert matches(Detection("nonfinite", 1234, 1234, rank=9), NAN)  # any culprit rank
    assert not matches(Detection("nonfinite", 1234, 1234, rank=6), NAN)
    assert not matches(Detection("nonfinite", 1234, 1234), NAN)  # must blame a rank
    fp8 = Label("fp8_overflow_risk", None, None, 100, None, {"module": "layers.3.attn.logits"})
    assert matches(Detection("fp8_overflow_risk", 300, 300, module="layers.3.attn.logits"), fp8)
    assert not matches(Detection("fp8_overflow_risk", 300, 300, module="lm_head"), fp8)
    assert matches(Detection("fp8_overflow_risk", 300, 300), fp8)
    # straggler detections on the slow node's ranks are implied, elsewhere they are false
    s = score(
        [("n", [SLOW_NODE], [det("straggler", 900, 950, rank=26), det("straggler", 900, 950, rank=3)], 2000)]
    )
    assert (s.kinds["straggler"].tolerated, s.kinds["straggler"].fp) == (1, 1)


def test_detection_from_dict_accepts_collector_shaped_anomalies() -> None:
    d = Detection.from_dict(
        {
            "kind": "fp8_overflow_risk",
            "step": 120,
            "rank": None,
            "evidence": {"module": "lm_head"},
            "severity": "warning",
        }
    )
    assert (d.first_step, d.detected_at_step, d.module) == (120, 120, "lm_head")
    with pytest.raises(ValueError, match="first_step"):
        Detection.from_dict({"kind": "hang"})


def test_clean_steps_are_the_steps_outside_every_labels_window() -> None:
    leak = Label("memory_leak", 3, "gpu-000", 1000, None)  # open-ended: to the end of the run
    spike = Label("loss_spike", None, None, 200, 230)
    # spike window 195..280, leak window 995..end; a resume ran 401..500 twice
    assert steps_outside([spike, leak], [(1, 500), (401, 2000)]) == (500 - 86) + (994 - 400)
    assert steps_outside([], [(1, 100)]) == 100
    assert steps_outside([Label("hang", 1, "gpu-000", 50, None)], [(1, 49)]) == 44


def test_world_false_alarms_count_every_run_against_clean_steps() -> None:
    s = Score()
    score_scenario(
        s, "faulty", [SPIKE], [det("loss_spike", 1000, 1001), det("hang", 1500, 1500, summary="stalled 40 s")],
        steps=3000,
    )  # fmt: skip
    score_scenario(s, "clean", [], [det("straggler", 10, 60, rank=1, summary="rank 1 slow")], steps=2000)
    assert s.steps_outside_labels == 3000 - (1030 + 50 - 995 + 1) + 2000
    assert s.false_alarms_per_10k_clean_steps() == pytest.approx(2 * 10_000 / s.steps_outside_labels)
    assert s.false_alarms_per_10k_clean_steps("hang") == pytest.approx(10_000 / s.steps_outside_labels)
    assert s.false_alarms_per_10k_steps == pytest.approx(5.0)  # the suite's figure: clean runs only
    assert [(r["scenario"], r["kind"], r["summary"], r["clean_run"]) for r in s.false_alarm_rows] == [
        ("faulty", "hang", "stalled 40 s", False),
        ("clean", "straggler", "rank 1 slow", True),
    ]
    overall = s.overall()
    assert (overall.labels, overall.recalled, overall.tp, overall.fp) == (1, 1, 1, 2)
    score_scenario(s, "missed", [STRAGGLER], [], steps=1000)
    assert s.miss_rows[-1]["scenario"] == "missed" and s.miss_rows[-1]["rank"] == 17
    assert s.as_dict()["false_alarms_per_10k_clean_steps"] == s.false_alarms_per_10k_clean_steps()
