"""Grouping every rank's stacks (stepwatch_server/commands/stacks.py): identical training-thread frames are one
group, smallest first, the blamed rank's group before all, each with a one-line summary."""

from __future__ import annotations

from typing import Any

from stepwatch_server.commands.stacks import MAX_SHOWN_RANKS, describe, group


def _frame(function: str, file: str, line: int, own: bool) -> dict[str, Any]:
    return {"module": "m", "function": function, "file": file, "line": line, "own": own}


LIB = "/usr/lib/python3/site-packages/torch/_tensor.py"
WAITING = [_frame("_engine_run_backward", LIB, 10, False), _frame("main", "/work/train.py", 88, True)]
FETCHING = [_frame("sleep_until", "/work/data.py", 5, True), _frame("slow_fetch", "/work/data.py", 41, True)]


def _result(frames: list[dict[str, Any]]) -> dict[str, Any]:
    other = {"name": "loader", "training": False, "frames": [_frame("run", LIB, 1, False)]}
    return {"threads": [{"name": "MainThread", "training": True, "frames": frames}, other]}


def test_the_odd_rank_out_comes_first_and_the_waiting_ranks_are_one_group() -> None:
    answers = [(r, _result(FETCHING if r == 5 else WAITING)) for r in range(8)]
    groups = group(answers)
    assert [(g["ranks"], g["count"]) for g in groups] == [([5], 1), ([0, 1, 2, 3, 4, 6, 7], 7)]
    assert groups[0]["summary"] == "1 rank: sleep_until at data.py:5"
    assert groups[1]["summary"] == "7 ranks: _engine_run_backward in main at train.py:88"
    assert groups[1]["frames"] == WAITING


def test_the_blamed_rank_leads_even_in_a_bigger_group_and_long_groups_list_some_ranks() -> None:
    answers = [(r, _result(WAITING if r < 100 else FETCHING)) for r in range(102)]
    groups = group(answers, blamed=3)
    assert groups[0]["count"] == 100 and len(groups[0]["ranks"]) == MAX_SHOWN_RANKS
    assert groups[1]["ranks"] == [100, 101]


def test_results_without_a_training_thread_are_a_group_of_their_own() -> None:
    groups = group([(0, _result(WAITING)), (1, {"threads": []}), (2, None), (3, _result(WAITING))])
    assert [g["ranks"] for g in groups] == [[0, 3], [1, 2]]  # as big: the lower rank first
    assert groups[1]["summary"] == "2 ranks: no training-thread stack"
    assert describe([_frame("f", LIB, 3, False)]) == "f at _tensor.py:3"
