"""The command channel seen from the agent (stepwatch/_commands.py): commands come on the collector's answers,
are carried out once each on the sender thread, and their results go to `/api/v1/commands/{id}/results`.
A real tiny model on CPU, a real HTTP receiver standing for the collector."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

import stepwatch
from stepwatch._activity import StackReader
from stepwatch._commands import MAX_QUEUED, MIN_INTERVAL_S, Commands

from .conftest import Receiver, make_model, train

ACK = {"accepted": True, "rows": 1, "duplicates": 0, "incarnation": 1}


def _results(receiver: Receiver) -> list[dict[str, Any]]:
    with receiver.lock:
        return [r for r in receiver.requests if "/commands/" in r["path"]]


def _wait(condition: Any, wait_s: float = 10.0) -> None:
    end = time.monotonic() + wait_s
    while not condition() and time.monotonic() < end:
        time.sleep(0.05)


def test_a_command_repeated_on_every_answer_is_carried_out_once_while_training_is_blocked(
    receiver: Receiver, fast: dict[str, Any]
) -> None:
    commands = [
        {"id": 7, "kind": "stacks"},
        {"id": 8, "kind": "reboot"},
        {"id": "x"},
        "junk",
        {"kind": "stacks"},
    ]
    blocked = threading.Event()  # asked once the training thread is blocked, then on every answer
    receiver.respond = lambda batch, headers: (
        200,
        {},
        {**ACK, "commands": commands if blocked.is_set() else []},
    )
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="commands", url=receiver.url, **fast)
    train(model, opt, 3)

    def slow_fetch() -> None:  # the training thread blocked in its data loader, as in a hang
        blocked.set()
        _wait(lambda: len(_results(receiver)) >= 2, 10.0)
        time.sleep(0.5)  # more answers repeat the same commands meanwhile

    slow_fetch()
    train(model, opt, 2)
    watch.close()
    results = _results(receiver)
    assert sorted(r["path"] for r in results) == ["/api/v1/commands/7/results", "/api/v1/commands/8/results"]
    done = next(r["batch"] for r in results if r["path"].endswith("/7/results"))
    assert (
        done["status"] == "done"
        and done["run"] == "commands"
        and done["rank"] == 0
        and done["kind"] == "stacks"
    )
    training = done["result"]["threads"][0]
    assert training["training"] and training["name"] == "MainThread"
    functions = [f["function"] for f in training["frames"]]
    # innermost first: _wait (or what it calls, when the read came while it checked) inside slow_fetch
    assert "slow_fetch" in functions and functions[functions.index("slow_fetch") - 1] == "_wait", functions
    assert next(f for f in training["frames"] if f["function"] == "slow_fetch")["own"]
    assert not any(t["name"].startswith("stepwatch") for t in done["result"]["threads"])
    assert done["result"]["nccl_trace"]["available"] is False
    refused = next(r["batch"] for r in results if r["path"].endswith("/8/results"))
    assert (
        refused["status"] == "refused" and "reboot" in refused["message"] and "stacks" in refused["message"]
    )
    assert watch.stats()["commands"] == 2


def test_with_the_channel_off_every_command_is_refused_and_nothing_is_read() -> None:
    off = Commands(False, StackReader(), threading.get_ident())
    outcome = off.carry_out(1, "stacks")
    assert outcome == {
        "status": "refused",
        "message": "the command channel is off on this rank (attach(commands=False))",
    }


def test_the_queue_is_bounded_paced_and_remembers_what_it_ran() -> None:
    commands = Commands(True, StackReader(), threading.get_ident())
    commands.offer({"accepted": True, "commands": [{"id": i, "kind": "stacks"} for i in range(50)]})
    taken = []
    while len(taken) < 50 and (c := commands.take()) is not None:
        taken.append(c[0])
        commands._started -= MIN_INTERVAL_S  # as if a second had passed
    assert taken == list(range(MAX_QUEUED))
    commands.offer(
        {"accepted": True, "commands": [{"id": 60, "kind": "stacks"}, {"id": 61, "kind": "stacks"}]}
    )
    assert commands.take() == (60, "stacks", {}) and commands.take() is None  # one a second at most
    commands._started -= MIN_INTERVAL_S
    assert commands.take() == (61, "stacks", {})
    commands.offer(
        {"accepted": True, "commands": [{"id": 0, "kind": "stacks"}, {"id": 49, "kind": "stacks"}]}
    )
    commands._started -= MIN_INTERVAL_S
    assert commands.take() == (49, "stacks", {}) and commands.take() is None
    commands.offer(None)
    commands.offer({"accepted": True, "commands": "stacks"})
    assert commands.take() is None


def test_stacks_taken_while_training_go_on_and_their_cost_is_printed(
    receiver: Receiver, fast: dict[str, Any]
) -> None:
    """Every answer of the receiver asks for the stacks again (a new id each time) while the loop trains: the
    agent takes one a second at most, and the step-time medians with and without them are printed."""
    ids = iter(range(1, 1_000_000))
    asking = threading.Event()

    def respond(batch: dict[str, Any], headers: dict[str, str]) -> Any:
        commands = [{"id": next(ids), "kind": "stacks"}] if asking.is_set() else []
        return (200, {}, {**ACK, "commands": commands})

    receiver.respond = respond
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="stacks-cost", url=receiver.url, **fast)
    medians = {}
    for label in ("without", "with"):
        if label == "with":
            asking.set()
        times = []
        end = time.monotonic() + 3.5
        while time.monotonic() < end:
            t0 = time.perf_counter()
            train(model, opt, 1)
            times.append(time.perf_counter() - t0)
            time.sleep(0.002)  # a data loader's pace, so that the sender thread gets its turns
        medians[label] = sorted(times)[len(times) // 2] * 1e3
    watch.close()
    taken = [r for r in _results(receiver) if r["batch"]["status"] == "done"]
    assert 2 <= len(taken) <= 5, len(taken)  # asked on every answer, taken once a second at most
    assert all(r["batch"]["result"]["threads"][0]["training"] for r in taken)
    print(
        f"stacks cost: step median {medians['without']:.3f} ms without, {medians['with']:.3f} ms while "
        f"{len(taken)} stacks were taken"
    )


def _train_until(
    model: Any, opt: Any, receiver: Receiver, path_end: str, wait_s: float = 15.0
) -> list[dict[str, Any]]:
    end = time.monotonic() + wait_s
    while time.monotonic() < end and not [r for r in _results(receiver) if r["path"].endswith(path_end)]:
        train(model, opt, 1)
        time.sleep(0.01)
    return [r for r in _results(receiver) if r["path"].endswith(path_end)]


def test_a_profile_traces_whole_steps_and_uploads_the_trace_before_its_result(
    receiver: Receiver, fast: dict[str, Any]
) -> None:
    commands = [{"id": 21, "kind": "profile", "args": {"steps": 3}}]
    receiver.respond = lambda batch, headers: (200, {}, {**ACK, "commands": commands})
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="profiled", url=receiver.url, **fast)
    done = _train_until(model, opt, receiver, "/21/results")
    steps_before = watch.stats()["sent_steps"]
    train(model, opt, 3)
    watch.close()
    assert [r["batch"]["status"] for r in done] == ["done"]
    result = done[0]["batch"]["result"]
    assert result["steps"] == 3 and len(result["step_ms"]) == 3
    assert any(op["name"] == "aten::addmm" and op["count"] >= 3 for op in result["top_ops"])
    uploads = [r for r in _results(receiver) if "/21/artifacts" in r["path"]]
    assert len(uploads) == 1 and "run=profiled" in uploads[0]["path"] and "rank=0" in uploads[0]["path"]
    assert uploads[0]["t"] <= done[0]["t"]  # the trace first: the result points to a stored trace
    assert uploads[0]["batch"]["traceEvents"]  # the receiver un-gzips bodies: Chrome-trace JSON
    assert not torch.autograd.profiler._is_profiler_enabled  # stopped after its 3 steps
    assert watch.stats()["sent_steps"] > steps_before  # steps recorded all along


def test_a_profile_that_fails_is_reported_failed_and_the_steps_go_on(
    receiver: Receiver, fast: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from stepwatch import _profile

    def broken(profiling: Any) -> None:
        raise RuntimeError("kineto went away")

    monkeypatch.setattr(_profile, "step_ended", broken)
    commands = [{"id": 22, "kind": "profile", "args": {"steps": 2}}]
    receiver.respond = lambda batch, headers: (200, {}, {**ACK, "commands": commands})
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="profile-fails", url=receiver.url, **fast)
    done = _train_until(model, opt, receiver, "/22/results")
    train(model, opt, 3)
    watch.close()
    assert [(r["batch"]["status"], r["batch"]["message"]) for r in done] == [
        ("failed", "RuntimeError: kineto went away")
    ]
    assert not torch.autograd.profiler._is_profiler_enabled  # the failed profile's profiler was stopped
    assert watch.stats()["internal_errors"] == 0 and watch.stats()["sent_steps"] >= 4
