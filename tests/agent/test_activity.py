"""What the heartbeat says the training thread is doing: forward counts, its stack, and the memory capacity
shipped with the memory values. Real tiny models on CPU, a real HTTP receiver."""

from __future__ import annotations

import statistics
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import stepwatch
from stepwatch import _activity, _capacity

from .conftest import Receiver, make_model, train
from .contract import validate

BLOCKED_S = 1.0  # how long the training thread sits in slow_fetch (heartbeats every 0.2 s meanwhile)


def _last_heartbeat(receiver: Receiver) -> dict[str, Any]:
    """The newest accepted batch's heartbeat ({} before the first batch arrived)."""
    accepted = receiver.accepted()
    return dict(accepted[-1]["heartbeat"]) if accepted else {}


def test_forwards_and_nograd_forwards_count_every_root_forward(
    receiver: Receiver, fast: dict[str, Any]
) -> None:
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="counts", url=receiver.url, **fast)
    train(model, opt, 5)  # 5 forwards with autograd
    model.eval()
    with torch.no_grad():
        for _ in range(7):
            model(torch.randn(2, 8))
    with torch.inference_mode():
        model(torch.randn(2, 8))
    with watch.phase("eval"), torch.no_grad():  # a marked pause's forwards are forwards too
        model(torch.randn(2, 8))
    model.fc1(torch.randn(2, 8))  # a submodule alone: not a forward of the watched model
    assert receiver.wait_for(lambda: _last_heartbeat(receiver).get("forwards") == 14, 15), _last_heartbeat(
        receiver
    )  # bounded; heartbeats every 0.2 s
    hb = _last_heartbeat(receiver)
    assert (hb["forwards"], hb["nograd_forwards"], hb["last_step"]) == (14, 9, 5)
    watch.close(timeout_s=5)
    assert receiver.steps() == [1, 2, 3, 4, 5]  # no-grad forwards are not steps
    for batch in receiver.accepted():
        validate(batch)
    counts = [(b["heartbeat"]["forwards"], b["heartbeat"]["nograd_forwards"]) for b in receiver.accepted()]
    assert counts == sorted(counts)  # counters of one session only grow


def slow_fetch(seconds: float) -> None:
    """A data loader that blocks (I/O, a lock): where the training thread is while heartbeats go out."""
    time.sleep(seconds)


def test_the_stack_names_the_function_the_training_thread_is_blocked_in(
    receiver: Receiver, fast: dict[str, Any]
) -> None:
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="stack", url=receiver.url, **fast)
    train(model, opt, 2)
    blocked_from = time.time()
    slow_fetch(BLOCKED_S)
    blocked_until = time.time()
    watch.close(timeout_s=5)
    during = [
        b["heartbeat"]["stack"]
        for b in receiver.accepted()
        if blocked_from < b["heartbeat"]["ts"] < blocked_until
    ]
    assert len(during) >= 2, during
    here = f"{__name__}:test_the_stack_names_the_function_the_training_thread_is_blocked_in"
    for stack in during:
        assert stack[0] == f"{__name__}:slow_fetch", stack  # innermost first: time.sleep is C, no frame
        assert here in stack, stack
        assert not [f for f in stack if f.startswith("stepwatch")], stack
    for batch in receiver.accepted():
        validate(batch)


def _own_module_frames(depth: int, inner: Any) -> Any:
    """Call `inner` through `depth` frames of a file inside the stepwatch package (a stand-in for the
    agent's own hooks, which must not show in the stack)."""
    source = "def call(inner, depth):\n    return inner() if depth == 0 else call(inner, depth - 1)\n"
    namespace: dict[str, Any] = {"__name__": "stepwatch._fake"}
    exec(compile(source, _activity.OWN_DIR + "_fake.py", "exec"), namespace)
    call = namespace["call"]
    assert isinstance(call, types.FunctionType)
    return call(inner, depth)


def _own_stack() -> list[str]:
    """This thread's stack as the heartbeat reads it (faulthandler's dump of every thread, parsed)."""
    reader = _activity.StackReader()
    try:
        return reader.stack(threading.get_ident())
    finally:
        reader.close()


def test_the_stack_skips_stepwatch_frames_and_stays_bounded() -> None:
    def innermost() -> list[str]:
        return _own_stack()

    names = _own_module_frames(3, innermost)
    assert names[:2] == [f"{__name__}:_own_stack", f"{__name__}:innermost"], names
    assert not [n for n in names if n.startswith("stepwatch")], names
    assert names[2] == f"{__name__}:_own_module_frames"  # the caller outside the skipped frames
    assert len(names) <= _activity.MAX_STACK_FRAMES

    def deep(n: int) -> list[str]:
        return deep(n - 1) if n else _own_stack()

    names = deep(40)
    assert names == [f"{__name__}:_own_stack"] + [f"{__name__}:deep"] * (_activity.MAX_STACK_FRAMES - 1)
    reader = _activity.StackReader()
    assert reader.stack(-1 & 0xFFFF) == []  # a thread that does not exist (any more)
    reader.close()


def test_frame_lines_are_parsed_whatever_the_path_and_long_names_are_cut() -> None:
    """faulthandler's frame lines: paths with spaces and quotes, '???' line numbers, '<module>'."""
    assert _activity.parse_frame('  File "/a b/c.py", line 12 in run') == ("/a b/c.py", "run")
    assert _activity.parse_frame('  File "/x/"q".py", line ??? in <module>') == ('/x/"q".py', "<module>")
    assert _activity.parse_frame("  ...") is None
    reader = _activity.StackReader()
    dump = f'Thread 0x{7:0{_activity.IDENT_DIGITS}x} (most recent call first):\n  File "/nowhere.py", line 1 in {"f" * 300}\n\n'
    (first,) = reader.names(dump, 7)
    assert first.startswith("?:fff") and len(first) == _activity.MAX_FRAME_CHARS


def test_reading_the_stack_of_a_busy_thread_never_crashes_the_process() -> None:
    """Walking another thread's frames from Python (sys._current_frames, f_back) segfaulted a test
    process here on CPython 3.11 under load. A thread that keeps pushing and popping frames, read 2,000
    times: every read is a list of names, and the process is alive to check it."""
    stop = threading.Event()

    def churn(n: int) -> int:
        return churn(n - 1) + 1 if n else 0

    def busy() -> None:
        while not stop.is_set():
            churn(30)

    thread = threading.Thread(target=busy)
    thread.start()
    reader = _activity.StackReader()
    try:
        stacks = [reader.stack(thread.ident or 0) for _ in range(2000)]
    finally:
        stop.set()
        thread.join(5)
        reader.close()
    assert all(isinstance(s, list) for s in stacks)
    assert any(s and s[0] == f"{__name__}:churn" for s in stacks), stacks[:3]


def test_building_the_heartbeat_fields_is_cheap(receiver: Receiver, fast: dict[str, Any]) -> None:
    """The sender builds these fields for every batch (a heartbeat every 5 s, a data batch every 2 s)."""
    model, opt = make_model()
    ready, release = threading.Event(), threading.Event()
    timings: list[float] = []

    def training() -> None:  # a training thread 30 frames deep, blocked while the fields are built
        watch = stepwatch.attach(model, opt, run="cost", url=receiver.url, **fast)

        def nest(n: int) -> None:
            if n:
                nest(n - 1)
                return
            sender = watch._sender
            ready.set()
            for _ in range(300):
                t0 = time.perf_counter()
                fields = sender._heartbeat_fields()
                timings.append(time.perf_counter() - t0)
            assert fields["stack"][0] == f"{__name__}:nest", fields
            release.wait(5)

        nest(30)
        watch.close(timeout_s=2)

    thread = threading.Thread(target=training)
    thread.start()
    assert ready.wait(10)
    release.set()
    thread.join(10)
    assert len(timings) == 300
    median_us = statistics.median(timings) * 1e6
    print(f"heartbeat fields: median {median_us:.1f} us, max {max(timings) * 1e6:.1f} us over 300")
    # faulthandler's dump of every thread (in many small writes): a median of ~0.5 ms measured on a loaded
    # 2-core machine (the frame walk it replaced took ~10-30 us, and could crash the process), once per
    # batch (every ~2 s) on the sender thread: ~0.03% of the GIL.
    assert median_us < 2000, median_us


def test_report_stack_false_ships_no_function_names(receiver: Receiver, fast: dict[str, Any]) -> None:
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="nostack", url=receiver.url, report_stack=False, **fast)
    train(model, opt, 2)
    slow_fetch(0.5)
    watch.close(timeout_s=5)
    heartbeats = [b["heartbeat"] for b in receiver.accepted()]
    assert heartbeats and all("stack" not in hb and hb["forwards"] >= 0 for hb in heartbeats)


def test_a_failing_stack_read_is_switched_off_once_and_heartbeats_go_on(
    receiver: Receiver,
    fast: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    stepwatch_log: Any,
    allow_internal_errors: None,
) -> None:
    calls = []

    def broken(self: Any, ident: int) -> list[str]:
        calls.append(ident)
        raise RuntimeError("no frames today")

    monkeypatch.setattr(_activity.StackReader, "stack", broken)
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="broken-stack", url=receiver.url, **fast)
    train(model, opt, 3)
    slow_fetch(0.6)
    train(model, opt, 2)
    watch.close(timeout_s=5)
    assert calls == [threading.get_ident()]  # tried once, for the thread that called attach
    assert receiver.steps() == [1, 2, 3, 4, 5]
    assert len(receiver.heartbeats()) >= 2
    assert all("stack" not in b["heartbeat"] for b in receiver.accepted())
    assert watch.stats()["internal_errors"] == 1
    internal = [r for r in stepwatch_log.records if getattr(r, "stepwatch_internal", False)]
    assert len(internal) == 1 and "stack" in internal[0].getMessage()


def test_memory_capacity_is_sent_with_the_host_rss(receiver: Receiver, fast: dict[str, Any]) -> None:
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="capacity", url=receiver.url, **fast)
    train(model, opt, 20)
    watch.close(timeout_s=5)
    records = receiver.records()
    with_rss = [s for s, m in records.items() if m.get("mem.rss_mb") is not None]
    with_capacity = [s for s, m in records.items() if m.get("mem.capacity_mb") is not None]
    assert with_rss and with_capacity == with_rss  # CPU: the host capacity beside the host RSS
    physical_mb = _capacity.physical_bytes() / 2**20  # type: ignore[operator]
    for step in with_capacity:
        capacity, rss = records[step]["mem.capacity_mb"], records[step]["mem.rss_mb"]
        assert rss < capacity <= physical_mb, (capacity, rss, physical_mb)
    assert records[with_capacity[0]]["mem.capacity_mb"] == pytest.approx(_capacity.host_capacity_mb())


def test_host_capacity_takes_a_cgroup_limit_when_one_is_set(tmp_path: Path) -> None:
    physical_mb = _capacity.physical_bytes() / 2**20  # type: ignore[operator]
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v2.write_text("max\n")
    v1.write_text("9223372036854771712\n")  # what cgroup v1 says when there is no limit
    assert _capacity.cgroup_limit_bytes((v2, v1)) is None
    assert _capacity.host_capacity_mb((v2, v1)) == physical_mb
    v1.write_text(f"{2**30}\n")
    assert _capacity.host_capacity_mb((v2, v1)) == 1024.0
    v2.write_text(f"{2**29}\n")  # the first file that sets a limit wins
    assert _capacity.host_capacity_mb((v2, v1)) == 512.0
    assert _capacity.host_capacity_mb((tmp_path / "absent",)) == physical_mb
    assert _capacity.device_capacity_mb(torch.device("cpu")) == _capacity.host_capacity_mb()


def test_on_cuda_the_capacity_is_the_devices_and_goes_with_every_steps_allocator_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No GPU needed: the device's properties are stubbed, and the decoder gets CUDA-like records."""
    from stepwatch._batch import Decoder
    from stepwatch._records import Chunk, StepRecord

    props = types.SimpleNamespace(total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert _capacity.device_capacity_mb(torch.device("cuda", 0)) == 80 * 1024.0
    records = [StepRecord(step, 1.0 + step, {"mem.allocated_mb": 100.0 + step}) for step in (1, 2, 3)]
    rows, _ = Decoder(capacity_mb=81_920.0).decode(Chunk(records))
    assert [r.metrics["mem.capacity_mb"] for r in rows] == [81_920.0] * 3
    assert [r.metrics.get("mem.rss_mb") is not None for r in rows] == [False, False, True]
    rows, _ = Decoder().decode(Chunk([StepRecord(4, 5.0, {"mem.allocated_mb": 1.0})]))
    assert "mem.capacity_mb" not in rows[0].metrics  # unknown capacity: not sent
