"""What one rank reports per step, end to end: real tiny models on CPU, a real HTTP receiver."""

from __future__ import annotations

import math
import time
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import stepwatch
from tests.conftest import require_module

from .conftest import MLP, Receiver, make_model, train
from .contract import validate

TIMINGS = ("time.data_ms", "time.forward_ms", "time.backward_ms", "time.optimizer_ms", "time.step_ms")


def test_200_steps_arrive_with_every_metric(receiver: Receiver, fast: dict[str, Any]) -> None:
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="mlp-200", url=receiver.url, **fast)
    losses = train(model, opt, 200)
    watch.close(timeout_s=5)

    batches = receiver.accepted()
    for batch in batches:
        validate(batch)
    assert receiver.steps() == list(range(1, 201))
    assert {b["session"] for b in batches} == {watch.session}
    assert [b["seq"] for b in batches] == sorted({b["seq"] for b in batches})
    records = receiver.records()
    for step in range(1, 201):
        rec = records[step]
        assert rec["loss"] == pytest.approx(losses[step - 1], rel=1e-6), step  # found in the output dict
        assert rec["grad_norm"] > 0 and rec["grad_sumsq"] == pytest.approx(rec["grad_norm"] ** 2, rel=1e-7)
        assert rec["grad_sumsq"] == float(np.float32(rec["grad_sumsq"]))  # float32, like the norm it squares
        assert rec["lr"] == 0.01
        assert all(isinstance(rec[t], float) and rec[t] >= 0 for t in TIMINGS), rec
        assert all(rec[t] == round(rec[t], 3) for t in TIMINGS), rec  # milliseconds to the microsecond
        assert rec["nonfinite.loss"] == rec["nonfinite.grads"] == rec["nonfinite.activations"] == 0
    assert any(rec.get("mem.rss_mb") for rec in records.values())
    assert len({rec["time.step_ms"] for rec in records.values()}) > 1  # rounded, not flattened

    tensor_steps = [s for b in batches if "tensors" in b for s in b["tensors"]["steps"]]
    assert tensor_steps == list(range(10, 201, 10))
    sampled = next(b for b in batches if "tensors" in b)
    assert set(sampled["tensors"]["stats"]["amax"]) == {"fc1", "fc2"}
    assert all(v > 0 for v in sampled["tensors"]["stats"]["amax"]["fc1"])
    assert "fc1.weight" in sampled["tensors"]["stats"]["grad_norm"]
    fingerprint_steps = [s for b in batches if "fingerprints" in b for s in b["fingerprints"]["steps"]]
    assert fingerprint_steps == [100, 200]
    assert batches[-1]["agent"]["version"] == stepwatch.__version__
    assert watch.stats()["sent_steps"] == 200 and watch.stats()["internal_errors"] == 0


def test_loss_found_as_scalar_attribute_tuple_or_dict_and_averaged_over_micro_batches(
    receiver: Receiver, fast: dict[str, Any]
) -> None:
    class Out:
        def __init__(self, loss: torch.Tensor) -> None:
            self.loss = loss

    class Net(nn.Module):
        def __init__(self, style: str) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)
            self.style = style

        def forward(self, x: torch.Tensor) -> Any:
            y = self.lin(x)
            loss = y.pow(2).mean()
            # (loss, logits): transformers' return_dict=False; {"loss": ...}: many trainers' own models
            return {"scalar": loss, "attribute": Out(loss), "tuple": (loss, y), "dict": {"loss": loss}}[
                self.style
            ]

    for style in ("scalar", "attribute", "tuple", "dict"):
        net = Net(style)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        watch = stepwatch.attach(net, opt, run=f"loss-{style}", url=receiver.url, **fast)
        expected = []
        for _ in range(5):
            micro = []
            for _ in range(2):  # two micro-batches per optimizer step
                out = net(torch.randn(3, 4))
                if style == "scalar":
                    loss = out
                elif style == "tuple":
                    loss = out[0]
                else:
                    loss = out["loss"] if style == "dict" else out.loss
                loss.backward()
                micro.append(loss.item())
            opt.step()
            opt.zero_grad()
            expected.append(sum(micro) / 2)
        watch.close(timeout_s=5)
        got = [b for b in receiver.accepted() if b["run"] == f"loss-{style}" and b["steps"]]
        losses = [v for b in got for v in b["metrics"]["loss"]]
        assert losses == pytest.approx(expected, rel=1e-6), style


def test_log_values_and_overrides(receiver: Receiver, fast: dict[str, Any], stepwatch_log: Any) -> None:
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="logged", url=receiver.url, **fast)
    gen = torch.Generator().manual_seed(2)
    for i in range(1, 6):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)
        loss = model(x, y)["loss"] * 0 + 100.0 + i
        watch.log(tokens=torch.tensor(4 * i))  # after the forward: belongs to the step in progress
        loss.backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()
        opt.zero_grad()
        watch.log(loss=loss.detach(), grad_norm=norm, frac=0.5 * i, bad_value="text")  # after step: step i
    watch.close(timeout_s=5)
    records = receiver.records()
    assert [records[i]["loss"] for i in range(1, 6)] == [101.0, 102.0, 103.0, 104.0, 105.0]
    assert [records[i]["tokens"] for i in range(1, 6)] == [4.0, 8.0, 12.0, 16.0, 20.0]
    assert [records[i]["frac"] for i in range(1, 6)] == [0.5, 1.0, 1.5, 2.0, 2.5]
    assert all("bad_value" not in r for r in records.values())
    assert watch.stats()["rejected_log_values"] == 5
    assert sum("bad_value" in r.getMessage() for r in stepwatch_log.records) == 1  # warned once


def test_values_logged_after_a_pause_join_the_next_step_and_after_the_last_one_are_said_at_close(
    receiver: Receiver, fast: dict[str, Any], stepwatch_log: Any
) -> None:
    """A marked pause hands the step before it to the sender, so a value logged in it or after it has no
    step to join but the next. After the last step there is none: the values are not stored, and close()
    says so, naming them, rather than dropping them silently. Logged after the last step with no pause
    between (an unmarked no-grad evaluation), they belong to that step."""
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="late-logs", url=receiver.url, **fast)
    train(model, opt, 3)
    with watch.phase("eval"):
        watch.log(eval_loss=3.0)  # no step open: joins step 4
    train(model, opt, 2)
    with torch.no_grad():  # an unmarked evaluation: no pause, the last step stays open
        model(torch.randn(2, 8))
    watch.log(final=5.0)  # after the last step, no pause: step 5's
    with watch.phase("eval"):
        watch.log(eval_loss=99.0, eval_acc=0.5)  # after a pause after the last step: nowhere to go
    watch.close(timeout_s=5)
    records = receiver.records()
    assert sorted(records) == [1, 2, 3, 4, 5]
    assert [s for s in records if records[s].get("eval_loss") is not None] == [4]
    assert records[4]["eval_loss"] == 3.0
    assert records[5]["final"] == 5.0 and records[5].get("eval_acc") is None
    said = [r.getMessage() for r in stepwatch_log.records if "not stored" in r.getMessage()]
    assert len(said) == 1 and "eval_acc, eval_loss" in said[0] and "after step 5" in said[0], said


@pytest.mark.parametrize("first", [50, 53], ids=["amax-sampled-step", "other-step"])
def test_nan_from_step_n_names_the_module(receiver: Receiver, fast: dict[str, Any], first: int) -> None:
    """amax is sampled every 10th step (the default); steps in between check non-finite values through
    a cheaper reduction, and must flag and name the module on the very step all the same."""
    model, opt = make_model(nan_from_call=first)
    watch = stepwatch.attach(model, opt, run="nan", url=receiver.url, track=["poison"], **fast)
    train(model, opt, 60)
    watch.close(timeout_s=5)
    for batch in receiver.accepted():
        validate(batch)
    records = receiver.records()
    for step in range(1, first):
        assert records[step]["nonfinite.activations"] == 0 and records[step]["nonfinite.loss"] == 0, step
        assert records[step]["nonfinite.grads"] == 0
    assert records[first]["nonfinite.activations"] == 1
    assert records[first]["nonfinite.loss"] == 1 and records[first]["loss"] == "NaN"
    assert records[first]["nonfinite.grads"] == 1
    events = [e for b in receiver.accepted() for e in b.get("events", []) if e["kind"] == "nonfinite"]
    assert len(events) == 1
    assert events[0]["step"] == first
    assert events[0]["data"]["module"] == "poison"
    assert set(events[0]["data"]["where"]) == {"activations", "loss", "grads"}
    sampled = -(-first // 10) * 10  # the first amax-sampled step from `first` on
    batch = next(b for b in receiver.accepted() if sampled in b.get("tensors", {}).get("steps", []))
    i = batch["tensors"]["steps"].index(sampled)
    assert batch["tensors"]["stats"]["amax"]["poison"][i] == "NaN"
    if sampled == first:  # later, the NaN gradients have reached every weight
        assert isinstance(batch["tensors"]["stats"]["amax"]["fc1"][i], float)


def test_every_step_reports_its_own_grad_norm_and_activation_checks(
    receiver: Receiver, fast: dict[str, Any]
) -> None:
    """The agent writes each step's grad norm and activation sums into a reused ring of buffers: over
    many transfers and ring turns, every record holds its own step's values, and a NaN in one module's
    output on one step only (masked before the loss) flags that step and no other."""

    class Blip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return x + float("nan") if self.calls == 23 else x

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.blip, self.fc2 = nn.Linear(8, 16), Blip(), nn.Linear(16, 1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            hidden = torch.nan_to_num(self.blip(torch.relu(self.fc1(x))), nan=0.0)  # the loss stays finite
            return nn.functional.mse_loss(self.fc2(hidden), y)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = stepwatch.attach(model, opt, run="own-values", url=receiver.url, track=["blip"], **fast)
    gen = torch.Generator().manual_seed(3)
    norms = []
    for _ in range(75):  # over four turns of the ring (_hooks.RING_ROWS)
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen) * 10
        model(x, y).backward()
        norms.append(float(nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        opt.step()
        opt.zero_grad()
    watch.close(timeout_s=5)
    records = receiver.records()
    assert [records[s]["grad_norm"] for s in range(1, 76)] == pytest.approx(norms, rel=1e-5)
    assert [s for s in range(1, 76) if records[s]["nonfinite.activations"]] == [23]
    assert all(records[s]["nonfinite.loss"] == records[s]["nonfinite.grads"] == 0 for s in range(1, 76))
    events = [e for b in receiver.accepted() for e in b.get("events", []) if e["kind"] == "nonfinite"]
    assert [(e["step"], e["data"]["module"]) for e in events] == [(23, "blip")]


def test_phase_and_heartbeat_while_the_training_thread_is_blocked(
    receiver: Receiver, fast: dict[str, Any]
) -> None:
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="paused", url=receiver.url, **fast)
    train(model, opt, 3)
    with watch.phase("eval"), torch.no_grad():
        model(torch.randn(2, 8))  # eval forward: not a training step
        assert receiver.wait_for(
            lambda: any(b["heartbeat"]["phase"] == "eval" for b in receiver.accepted()), 5
        )
    before = len(receiver.heartbeats())
    time.sleep(0.8)  # blocked (think: a collective): heartbeats keep coming from the sender thread
    assert len(receiver.heartbeats()) >= before + 2
    assert receiver.heartbeats()[-1]["heartbeat"]["last_step"] == 3
    train(model, opt, 2)
    watch.close(timeout_s=5)
    assert receiver.steps() == [1, 2, 3, 4, 5]
    kinds = [(e["kind"], e["data"]) for b in receiver.accepted() for e in b.get("events", [])]
    assert kinds == [
        ("phase_start", {"phase": "eval"}),
        ("phase_end", {"phase": "eval"}),
        ("session_end", {"reason": "close"}),
    ]


def test_a_marked_pause_is_not_counted_in_the_next_steps_data_wait_or_step_time(
    receiver: Receiver, fast: dict[str, Any]
) -> None:
    """An evaluation in `watch.phase("eval")` was counted in the next step's data wait (551 ms at step 201
    of a user's run): the clock of the next step starts when the pause ends."""
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="eval-wait", url=receiver.url, **fast)
    train(model, opt, 5)
    with watch.phase("eval"):
        time.sleep(0.4)  # the evaluation
    train(model, opt, 5)
    watch.close(timeout_s=5)
    records = receiver.records()
    assert sorted(records) == list(range(1, 11))
    for step in (6, 7):
        assert records[step]["time.data_ms"] < 200 and records[step]["time.step_ms"] < 200, records[step]


def test_fingerprints_agree_between_replicas_and_differ_after_a_bit_flip(
    receiver: Receiver, fast: dict[str, Any]
) -> None:
    def run(name: str, flip: bool) -> list[str]:
        model, opt = make_model()
        watch = stepwatch.attach(model, opt, run=name, url=receiver.url, fingerprint_every=5, **fast)

        def corrupt(step: int) -> None:
            if flip and step == 7:
                with torch.no_grad():
                    bits = model.fc1.weight.view(torch.int32)
                    bits[0, 0] ^= 1  # one bit of one weight: a silent data corruption

        train(model, opt, 10, between=corrupt)
        watch.close(timeout_s=5)
        return [
            v
            for b in receiver.accepted()
            if b["run"] == name and "fingerprints" in b
            for v in b["fingerprints"]["values"]
        ]

    a, b, c = run("replica-a", False), run("replica-b", False), run("replica-c", True)
    assert len(a) == 2 and a == b
    assert c[0] == a[0] and c[1] != a[1]


def test_tensor_learning_rate_and_param_groups(receiver: Receiver, fast: dict[str, Any]) -> None:
    model = MLP()
    opt = torch.optim.Adam(
        [
            {"params": model.fc1.parameters(), "lr": torch.tensor(0.01)},
            {"params": model.fc2.parameters(), "lr": 0.5},
        ]
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    watch = stepwatch.attach(model, opt, run="lrs", url=receiver.url, **fast)
    train(model, opt, 3, between=lambda _: sched.step())
    watch.close(timeout_s=5)
    records = receiver.records()
    assert [records[s]["lr"] for s in (1, 2, 3)] == pytest.approx([0.01, 0.005, 0.01 / 3])
    assert [records[s]["lr.1"] for s in (1, 2, 3)] == pytest.approx([0.5, 0.25, 0.5 / 3])
    assert all(math.isfinite(records[s]["grad_norm"]) for s in (1, 2, 3))


class _Overflow(torch.autograd.Function):
    """Identity forward; in backward, Inf gradients when `on` (an fp16 gradient that overflowed)."""

    on = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf") if _Overflow.on else grad


@pytest.mark.parametrize("zero_grad_at", ["start", "end"])
def test_a_step_the_grad_scaler_skips_is_its_own_record_marked_skipped(
    receiver: Receiver, fast: dict[str, Any], zero_grad_at: str
) -> None:
    """AMP's GradScaler never calls optimizer.step() when the gradients overflowed: before, the skipped
    iteration's forward was merged into the next step's (two forwards, the losses averaged). Now every
    iteration is one record; the skipped ones carry `optimizer.skipped` = 1 and their non-finite
    gradients, with a finite loss; the others carry no such metric. (zero_grad() at the start of the
    iteration or after the step; called between forward and backward, a skip is still merged.)"""
    model, opt = make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    watch = stepwatch.attach(model, opt, run="amp-skip", url=receiver.url, **fast)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for i in range(1, 13):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)
        _Overflow.on = i in (5, 9, 10)
        out = model.fc2(_Overflow.apply(model.act(model.fc1(x))))  # the hooks see fc1 and fc2, not the root
        if zero_grad_at == "start":
            opt.zero_grad()
        loss = model(x, y)["loss"] + 0.0 * out.sum()  # the root forward, so the step is found
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if zero_grad_at == "end":
            opt.zero_grad()
        losses.append(loss.item())
    _Overflow.on = False
    watch.close(timeout_s=5)
    records = receiver.records()
    assert receiver.steps() == list(range(1, 13))
    skipped = [s for s, r in records.items() if r.get("optimizer.skipped") == 1]
    assert skipped == [5, 9, 10]
    for step, rec in records.items():
        assert rec["loss"] == pytest.approx(losses[step - 1], rel=1e-6), step  # never two merged
        assert rec["nonfinite.loss"] == 0
        assert rec["nonfinite.grads"] == (1 if step in skipped else 0), (step, rec)
    assert scaler.get_scale() == 2.0**10 / 8  # the scaler really skipped three times


def test_tracked_outputs_wait_in_bounded_groups_are_released_with_the_forward_and_give_exact_amax(
    receiver: Receiver, fast: dict[str, Any]
) -> None:
    """Outputs of tracked modules wait for one fused max |x| (issue 13's host cost): at most FLUSH_CALLS
    of them at a time beyond what autograd keeps, none after the root forward returns; and the amax that
    arrives is each module's own max |output|, computed here by the test."""
    from stepwatch._hooks import FLUSH_CALLS

    class Residual(nn.Module):  # x + fc(x): autograd keeps no Linear output (the add saves nothing)
        def __init__(self, layers: int) -> None:
            super().__init__()
            self.fcs = nn.ModuleList(nn.Linear(32, 32) for _ in range(layers))
            for fc in self.fcs:  # small weights: the sum stays of order 1 over a hundred layers
                nn.init.normal_(fc.weight, std=0.02)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for fc in self.fcs:
                x = x + fc(x)
            return x.pow(2).mean()

    layers = 3 * FLUSH_CALLS + 5
    torch.manual_seed(0)
    model = Residual(layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    outputs: list[Any] = []  # weak references to every Linear output of the current step
    alive_at_call: list[int] = []
    true_amax: dict[int, dict[str, float]] = {}
    step = [0]

    def observe(name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            alive_at_call.append(sum(r() is not None for r in outputs))
            outputs.append(weakref.ref(out))
            true_amax.setdefault(step[0] + 1, {})[name] = float(out.detach().abs().max())

        return hook

    for i, fc in enumerate(model.fcs):
        fc.register_forward_hook(observe(f"fcs.{i}"))
    watch = stepwatch.attach(model, opt, run="bounded", url=receiver.url, amax_every=1, **fast)
    x = torch.randn(8, 32)
    for step[0] in range(4):
        outputs.clear()
        loss = model(x)
        assert sum(r() is not None for r in outputs) == 0  # released when the root forward returned
        loss.backward()
        opt.step()
        opt.zero_grad()
    watch.close(timeout_s=5)
    # counted at each call before its own output: up to FLUSH_CALLS - 1 wait with it, then all go
    assert FLUSH_CALLS - 2 <= max(alive_at_call) <= FLUSH_CALLS - 1
    reported = {s: {n: v[i] for n, v in b["tensors"]["stats"]["amax"].items()}
                for b in receiver.accepted() if "tensors" in b for i, s in enumerate(b["tensors"]["steps"])}  # fmt: skip
    assert sorted(reported) == [1, 2, 3, 4]
    for s, want in true_amax.items():
        assert reported[s] == pytest.approx(want, rel=1e-6), s


def test_small_and_big_outputs_keep_call_order_and_exact_amax(
    receiver: Receiver, fast: dict[str, Any]
) -> None:
    """On a CPU, small outputs wait for one stacked reduction and a big one (DIRECT_ELEMENTS and more)
    is reduced on its own: a copy of it would cost more memory traffic than the dispatch it saves. The
    values stay in call order across both: the first module to go non-finite is the one named, and
    each module's amax is its own max |output|."""
    from stepwatch._hooks import DIRECT_ELEMENTS

    width = 2 * DIRECT_ELEMENTS // 8 + 8  # a batch of 8 rows: the wide layer's output is big

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small_in = nn.Linear(4, 4)
            self.wide = nn.Linear(4, width)
            self.narrow = nn.Linear(width, 4)
            self.small_out = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.small_out(self.narrow(self.wide(self.small_in(x)))).pow(2).mean()

    torch.manual_seed(0)
    model = Mixed()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    true_amax: dict[int, dict[str, float]] = {}
    step = [0]
    for name, module in model.named_children():
        module.register_forward_hook(
            lambda m, a, out, name=name: true_amax.setdefault(step[0], {}).__setitem__(
                name, float(out.detach().abs().max())
            )
        )
    watch = stepwatch.attach(model, opt, run="mixed", url=receiver.url, amax_every=1, **fast)
    for step[0] in range(1, 7):
        x = torch.randn(8, 4)
        if step[0] == 5:
            x[0, 0] = math.inf  # enters small_in first: it, not a later (bigger) layer, is to blame
        model(x).backward()
        opt.step()
        opt.zero_grad()
        if step[0] == 5:
            break
    watch.close(timeout_s=5)
    batches = receiver.accepted()
    reported = {s: {n: v[i] for n, v in b["tensors"]["stats"]["amax"].items()}
                for b in batches if "tensors" in b for i, s in enumerate(b["tensors"]["steps"])}  # fmt: skip
    for s in range(1, 5):
        assert reported[s] == pytest.approx(true_amax[s], rel=1e-6), s
    events = [e for b in batches for e in b.get("events", []) if e["kind"] == "nonfinite"]
    assert [(e["step"], e["data"]["module"]) for e in events] == [(5, "small_in")]


class Attention(nn.Module):
    """One `nn.MultiheadAttention` block: its `out_proj` is applied through its weight inside
    F.multi_head_attention_forward, never called as a module."""

    def __init__(self, nan_from_call: int | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 1)
        self.nan_from_call, self.calls = nan_from_call, 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        h = self.inp(x)
        if self.nan_from_call is not None and self.calls >= self.nan_from_call:
            h = h.clone()
            h[0, 0, 0] = math.nan  # NaN into the attention's input: its output is the first non-finite
        a, _ = self.attn(h, h, h)
        return {"loss": (self.head(a) - y).pow(2).mean()}


def test_attention_whose_projection_runs_functionally_is_tracked_by_its_output(
    receiver: Receiver, fast: dict[str, Any]
) -> None:
    """`nn.MultiheadAttention.out_proj` never runs as a module, so its amax and NaN checks never fired: the
    attention module is tracked instead (its output is out_proj's), and `tracked()` says what is."""
    torch.manual_seed(0)
    model = Attention(nan_from_call=15)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = stepwatch.attach(model, opt, run="mha", url=receiver.url, **fast)
    assert watch.tracked() == ["inp", "attn", "head"]
    gen = torch.Generator().manual_seed(1)
    for _ in range(16):
        x, y = torch.randn(2, 3, 8, generator=gen), torch.randn(2, 3, 1, generator=gen)
        model(x, y)["loss"].backward()
        opt.step()
        opt.zero_grad()
    watch.close(timeout_s=5)
    batches = receiver.accepted()
    sampled = [b for b in batches if "tensors" in b]
    assert sampled and set(sampled[0]["tensors"]["stats"]["amax"]) == {"inp", "attn", "head"}
    assert sampled[0]["tensors"]["stats"]["amax"]["attn"][0] > 0
    events = [e for b in batches for e in b.get("events", []) if e["kind"] == "nonfinite"]
    assert [(e["step"], e["data"]["module"]) for e in events][:1] == [(15, "attn")]
    assert watch.tracked() == ["inp", "attn", "head"]  # still says, once closed
    assert stepwatch.NullWatch().tracked() == []


def test_a_bare_module_as_the_model_and_odd_module_names_send_batches_the_collector_accepts(
    receiver: Receiver, fast: dict[str, Any]
) -> None:
    """A bare `nn.Linear` is its own root: named `model`, not `''` (every batch was rejected). Names
    from a ModuleDict may hold any characters and any length: the agent sends each as a valid name,
    distinct from the others, so the collector's own validator accepts every batch."""
    validate_batch = require_module("stepwatch_server.ingest.validate").parse_batch

    def train(model: nn.Module, run: str, steps: int) -> list[dict[str, Any]]:
        """Train `model` for `steps` steps under the agent; the batches it sent, each checked against
        the contract and the collector's own validator."""
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        watch = stepwatch.attach(model, opt, run=run, url=receiver.url, **fast)
        for _ in range(steps):
            model(torch.randn(2, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        watch.close(timeout_s=5)
        batches = receiver.accepted()
        for batch in batches:
            validate(batch)
            validate_batch(batch)
        return batches

    batches = train(nn.Linear(4, 4), "bare-linear", 20)
    assert receiver.steps() == list(range(1, 21))
    sampled = [b for b in batches if "tensors" in b]
    assert sampled and all(set(b["tensors"]["stats"]["amax"]) == {"model"} for b in sampled)
    assert set(sampled[0]["tensors"]["stats"]["grad_norm"]) == {"weight", "bias"}

    receiver.requests.clear()
    long = "x" * 300
    odd = nn.ModuleDict(
        {"a b": nn.Linear(4, 4), "a_b": nn.Linear(4, 4), long: nn.Linear(4, 4), "é": nn.Linear(4, 4)}
    )

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = odd

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks.values():
                x = block(x)
            return x

    batches = train(Net(), "odd-names", 10)
    sampled = [b for b in batches if "tensors" in b]
    amax_names = list(sampled[0]["tensors"]["stats"]["amax"])
    grad_names = list(sampled[0]["tensors"]["stats"]["grad_norm"])
    assert len(set(amax_names)) == 4 and len(set(grad_names)) == 8  # still one per module, per parameter
    assert "blocks.a_b" in amax_names  # a valid name is sent as it is
    assert all(len(n) <= 200 for n in amax_names + grad_names)


def test_wire_names_keep_valid_names_and_make_the_others_valid_and_distinct() -> None:
    from stepwatch._step import NAME, wire_names

    long_a, long_b = "y" * 250 + "a", "y" * 250 + "b"  # the same first 191 characters
    names = ["", "model", "a b", "a_b", long_a, long_b, "é", "fc1"]
    wires = wire_names(names)
    assert wires[:4] == ("model[1]", "model", "a_b[1]", "a_b")  # valid names win; the root is `model`
    assert wires[-1] == "fc1" and len(set(wires)) == len(names)
    assert all(NAME.fullmatch(w) for w in wires)
    assert wires[4] != wires[5] and all(len(w) <= 200 for w in wires)


@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_a_step_whose_forward_and_backward_run_in_its_closure_reports_that_steps_values(
    receiver: Receiver, fast: dict[str, Any], how: str
) -> None:
    """`optimizer.step(closure)` (Lightning, LBFGS) runs the optimizer's pre-hooks before the closure, so
    before that step's forward and backward: the agent starts the update when the closure returns. Each
    record holds its own step's loss and grad norm (not the step before's), with a forward and an optimizer
    time, and zero_grad inside the closure (before backward, as Lightning does) is no skipped step."""
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run=f"closure-{how}", url=receiver.url, **fast)
    gen = torch.Generator().manual_seed(1)
    losses, norms = [], []
    for _ in range(30):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            loss = model(x, y)["loss"]
            opt.zero_grad()
            loss.backward()
            losses.append(loss.item())
            norms.append(float(nn.utils.get_total_norm([p.grad for p in model.parameters()])))
            return loss

        opt.step(closure=closure) if how == "keyword" else opt.step(closure)
    watch.close(timeout_s=5)
    records = receiver.records()
    assert sorted(records) == list(range(1, 31))
    assert [records[s]["loss"] for s in range(1, 31)] == pytest.approx(losses, rel=1e-6)
    assert [records[s]["grad_norm"] for s in range(1, 31)] == pytest.approx(norms, rel=1e-5)
    assert all(records[s]["time.forward_ms"] > 0 and records[s]["time.optimizer_ms"] > 0 for s in records)
    assert all(records[s].get("optimizer.skipped", 0) == 0 for s in records)
