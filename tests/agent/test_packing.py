"""The hand-over between the threads: steps packed into one tensor, decoded into rows, encoded as JSON."""

from __future__ import annotations

import gzip
import json
import math

import torch

from stepwatch import _batch, _device
from stepwatch._device import transfer
from stepwatch._step import Step


def _step_with(
    calls: list[tuple[int, float]], loss: float, logs: dict[str, torch.Tensor], sampled: bool
) -> Step:
    """A finished step: `calls` are the tracked modules' calls in call order, (slot, max |x|), reduced
    in groups of two as `Hooks.flush` would."""
    step = Step(sampled)
    step.calls = [slot for slot, _ in calls]
    values = [a for _, a in calls]
    step.amax = [torch.tensor(values[i : i + 2]) for i in range(0, len(values), 2)]
    step.hook_names.append("grad_norm")
    step.scalars.append(torch.tensor(3.0))
    step.loss_sum, step.loss_n = torch.tensor(loss * 2), 2  # two micro-batches
    step.logs.update(logs)
    step.host["lr"] = 0.1
    return step


def test_records_round_trip_through_one_tensor() -> None:
    order = ("a", "b", "c")
    # a called twice (micro-batches, or a recompute in backward): its max over both calls; c never ran
    first = _step_with(
        [(0, 2.0), (1, 1.5), (0, 2.5)], 4.0, {"tokens": torch.tensor(7.0, dtype=torch.float64)}, True
    )
    first.grads = (torch.tensor([1.0, 2.0]), ("w", "b"))
    rec1 = first.record(10, 1.0, order)
    rec1.vectors.append(torch.tensor([1.0, 0.0, 0.0, 0.0]))  # fingerprint words
    rec1.fingerprint = True
    # b runs first and overflows, a is NaN after it: b is named, in call order
    second = _step_with(
        [(1, math.inf), (0, math.nan)], math.nan, {"x": torch.tensor(0.5, dtype=torch.bfloat16)}, False
    )
    rec2 = second.record(11, 2.0, order)
    third = _step_with([], 1.0, {}, True)  # no tracked module ran
    rec3 = third.record(12, 3.0, order)
    fourth = _step_with([(1, 2.5)], 1.0, {}, False)  # a not sampled step on which only b ran
    rec4 = fourth.record(13, 4.0, order)
    fifth = _step_with([(1, math.nan), (1, 1.0), (0, 1.0)], 1.0, {}, True)  # NaN stays over a later call
    rec5 = fifth.record(14, 5.0, order)

    chunk = transfer([rec1, rec2, rec3, rec4, rec5], cuda=False)
    assert chunk.values is not None and chunk.values.dim() == 1
    assert all(not r.scalars and not r.vectors for r in chunk.records)  # the tensors were released
    rows, events = _batch.Decoder().decode(chunk)

    one, two, three, four, five = (r.metrics for r in rows)
    assert one["loss"] == 4.0 and one["grad_norm"] == 3.0 and one["grad_sumsq"] == 9.0
    assert one["tokens"] == 7.0 and one["lr"] == 0.1
    assert rows[0].amax == {"a": 2.5, "b": 1.5}  # c did not run: no value, not a zero
    assert rows[0].grads == {"w": 1.0, "b": 2.0}
    assert rows[0].fingerprint == f"{_batch.mix64(1):016x}"
    assert one["nonfinite.activations"] == one["nonfinite.loss"] == one["nonfinite.grads"] == 0
    assert two["x"] == 0.5 and math.isnan(two["loss"])
    assert two["nonfinite.activations"] == 1 and two["nonfinite.loss"] == 1
    assert rows[1].amax is None  # not a sampled step: the values only say which module was non-finite
    assert three["nonfinite.activations"] is None and rows[2].amax is None
    assert four["nonfinite.activations"] == 0 and rows[3].amax is None
    assert five["nonfinite.activations"] == 1 and math.isnan(rows[4].amax["b"]) and rows[4].amax["a"] == 1.0
    assert "mem.rss_mb" in five  # host RSS once per chunk, on its last step
    assert events == [
        {
            "step": 11,
            "ts": 2.0,
            "kind": "nonfinite",
            "data": {"module": "b", "where": ["activations", "loss"]},
        },
        {  # a sampled step: its values are max |x|, the first module's are sent (the first call: no input)
            "step": 14,
            "ts": 5.0,
            "kind": "nonfinite",
            "data": {"module": "b", "where": ["activations"], "output_amax": "NaN", "input_amax": None},
        },
    ]


def test_amax_each_is_max_abs_per_tensor_with_nan_kept_on_both_paths() -> None:
    """The fused reduction (`Hooks.flush`): one max |x| per tensor, NaN and Inf kept, whether the
    tensors are stacked (small, one shape), copied into one buffer (small; dtypes promoted) or reduced
    by the foreach op (too many elements) or one norm (one tensor), never writing into the tensors."""
    small = [torch.tensor([[1.0, -3.0]]), torch.tensor([math.nan, 2.0]), torch.tensor([-math.inf])]
    big = [torch.full((_device.FLAT_MAX_ELEMENTS,), -2.0), torch.tensor([0.5, -7.0])]
    mixed = [torch.tensor([-4.0], dtype=torch.bfloat16), torch.tensor([1.0, 2.0])]
    same = [torch.tensor([[1.0, -2.0]]), torch.tensor([[math.inf, 0.0]]), torch.tensor([[-1.0, math.nan]])]
    for tensors, expected in (
        (small, [3.0, math.nan, math.inf]),
        (same, [2.0, math.inf, math.nan]),  # one shape: one stack
        (big, [2.0, 7.0]),
        (mixed, [4.0, 2.0]),
        ([torch.tensor([-5.0, 1.0])], [5.0]),
        ([torch.tensor(-2.0), torch.tensor(math.nan), torch.tensor(1.5)], [2.0, math.nan, 1.5]),  # 0-dim
        ([torch.full((2, 3, 4), -6.0), torch.full((2, 3, 4), 0.5)], [6.0, 0.5]),  # 3-dim, one stack
        ([torch.tensor([[1.0, -2.0]]), torch.tensor([[-3.0], [math.nan]])], [2.0, math.nan]),  # 1x2, 2x1
    ):
        before = [t.clone() for t in tensors]
        got = _device.amax_each(tensors)
        assert got.dtype == torch.float32 and got.shape == (len(tensors),)
        assert [str(x) for x in got.tolist()] == [str(x) for x in expected]
        for a, b in zip(tensors, before, strict=True):  # the inputs are only read
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        # A step that ships no amax: a check per tensor, non-finite exactly where a tensor has a NaN or
        # an Inf (the max |x| or, stacked on a CPU, the sum), the tensors left alone.
        check = _device.amax_each(tensors, amax=False)
        assert check.dtype == torch.float32 and check.shape == (len(tensors),)
        assert [math.isfinite(x) for x in check.tolist()] == [math.isfinite(x) for x in expected]
        for a, b in zip(tensors, before, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_square_sums_match_the_per_tensor_norm_and_leave_the_gradients_alone() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(16, 16), torch.randn(16), torch.randn(3, dtype=torch.float64)]
    layers = [t for _ in range(4) for t in (torch.randn(8, 4), torch.randn(8))]  # few: one flat copy
    many = [t for _ in range(20) for t in (torch.randn(8, 4), torch.randn(8))]  # two shapes: stacked
    square_sums = _device.SquareSums()
    cases = (
        grads[:2],  # two shapes in two tensors: one flat copy
        layers,
        layers[::2],  # one shape
        many,
        many[::2],
        [t.to(torch.bfloat16) for t in layers],  # squared in float32
        grads,  # float64 among them: promoted, squared in float64
        grads[:1],
        [torch.randn(_device.FLAT_MAX_ELEMENTS), grads[1]],  # too big to copy
        [torch.randn(64, 128), *layers, torch.randn(5000)],  # big ones by foreach, put back in order
        [torch.randn(64, 128), *many, torch.randn(5000)],
    )
    for tensors in cases:
        before = [t.clone() for t in tensors]
        key = tuple(map(id, tensors))
        got = square_sums(tensors, key)
        want = torch.stack([t.double().square().sum() for t in tensors]).float()
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-4, atol=0)  # float32 sums of 1M squares
        # The norm alone (a step that ships no per-parameter norms), from a fresh plan and a made one,
        # returned or written into a float32 0-dim tensor.
        for sums in (_device.SquareSums(), square_sums):
            norm = sums.norm(tensors, key)
            assert norm.dim() == 0 and norm.dtype in (torch.float32, torch.float64)
            torch.testing.assert_close(norm.double(), want.double().sum().sqrt(), rtol=1e-4, atol=0)
            into = torch.zeros(3)[1]
            assert sums.norm(tensors, key, into) is into
            torch.testing.assert_close(into.double(), want.double().sum().sqrt(), rtol=1e-4, atol=0)
        assert all(torch.equal(a, b) for a, b in zip(tensors, before, strict=True))


def test_encode_writes_non_finite_values_as_strings() -> None:
    rows = [_batch.Row(1, 1.0, {"loss": 1.5, "g": None}), _batch.Row(2, 2.0, {"loss": math.nan})]
    rows[1].amax = {"fc": -math.inf}
    batch = _batch.build({"schema": 1}, rows, [], {"ts": 0.0, "phase": "data", "last_step": 2})
    decoded = json.loads(gzip.decompress(_batch.encode(batch)))
    assert decoded["metrics"] == {"loss": [1.5, "NaN"], "g": [None, None]}
    assert decoded["tensors"] == {"steps": [2], "stats": {"amax": {"fc": ["-Infinity"]}}}

    finite = _batch.build({"schema": 1, "run": "NaN-run"}, rows[:1], [], {"ts": 0.0, "phase": "x"})
    assert json.loads(gzip.decompress(_batch.encode(finite)))["metrics"] == {"loss": [1.5], "g": [None]}


def test_check_one_is_the_max_abs_or_on_a_cpu_step_without_amax_a_value_as_finite_as_the_tensor() -> None:
    nan, inf = math.nan, math.inf
    for t, amax in (
        (torch.tensor([[1.0, -3.0], [2.0, 0.5]]), 3.0),
        (torch.tensor([1.0, nan, -inf]), nan),
        (torch.tensor([-inf, 2.0]), inf),
        (torch.tensor([-4.0, 2.0], dtype=torch.float64), 4.0),
        (torch.tensor([-4.0, 2.0], dtype=torch.bfloat16), 4.0),
    ):
        got = _device.check_one(t)
        assert got.dtype == torch.float32 and got.shape == (1,)
        assert str(got.item()) == str(amax)
        quick = _device.check_one(t, amax=False).item()  # the sum on a CPU: only its finiteness is read
        assert math.isfinite(quick) == math.isfinite(amax) and math.isnan(quick) == math.isnan(amax)


def test_cuda_memory_comes_from_one_read_of_the_allocators_nested_statistics() -> None:
    """On a GPU the agent reads `torch.cuda.memory_stats_as_nested_dict()` once per transfer (this
    machine has no GPU: its parse is checked on a dict of that call's documented shape)."""
    stat = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
    stats = {
        key: {pool: dict(stat) for pool in ("all", "large_pool", "small_pool")}
        for key in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes")
    }
    stats["allocated_bytes"]["all"].update(current=3 * 2**30, peak=5 * 2**30)
    stats["reserved_bytes"]["all"].update(current=6 * 2**30, peak=7 * 2**30)
    stats["num_alloc_retries"] = 0  # type: ignore[assignment]
    assert _device.cuda_memory_mb(stats) == {
        "mem.allocated_mb": 3072.0,
        "mem.reserved_mb": 6144.0,
        "mem.peak_mb": 5120.0,
    }
