"""Hooks on the model and the optimizer. Hot path: cheap device work, no host-device sync, no I/O.

Per step the values stay on the device as a list of small tensors; every few steps one `torch.cat`
and one non-blocking copy to pinned host memory (with a CUDA event) hand them to the sender thread.
Timings: host `perf_counter` on CPU; CUDA events on GPU, read by the sender once they completed.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ._config import Config
from ._device import Fingerprinter, local, transfer
from ._guard import Guard
from ._records import Chunk, Live, StepRecord

logger = logging.getLogger("stepwatch")

STEPS_PER_TRANSFER = 8  # device values of this many steps share one copy to the host
NAME = re.compile(r"[A-Za-z0-9._:/@+\-\[\]]{1,200}")


def find_loss(output: Any) -> torch.Tensor | None:
    """The loss in a model's output: a scalar tensor, an object with `.loss`, or a mapping with "loss"."""
    if not isinstance(output, torch.Tensor):
        output = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(output, torch.Tensor) and output.numel() == 1 and output.is_floating_point():
        return output.detach().reshape(1)
    return None


def resumed_step(optimizer: torch.optim.Optimizer) -> int:
    """Steps the optimizer has already taken: non-zero when its state was restored from a checkpoint.

    Adam-like optimizers keep a per-parameter `step` count. Read once at attach, never on the hot path
    (for a capturable optimizer on the GPU this is one host-device sync, at attach only).
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and step.numel() == 1:
                return max(0, int(step.item()))
            if isinstance(step, int | float):
                return max(0, int(step))
    return 0


def first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


class _Step:
    """The step in progress (between two `optimizer.step()` ends)."""

    __slots__ = (
        "amax",
        "data_ms",
        "forwards",
        "fwd_ms",
        "fwd_start",
        "grad_norms",
        "hook",
        "host",
        "logs",
        "loss_n",
        "loss_sum",
        "opt_start",
    )

    def __init__(self, n_amax: int) -> None:
        self.amax: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_amax
        self.hook: dict[str, torch.Tensor] = {}  # device values from the hooks (loss, grad_norm, lr)
        self.logs: dict[str, torch.Tensor] = {}  # device values from watch.log()
        self.host: dict[str, float | None] = {}  # host values: CPU timings, numbers, memory
        self.grad_norms: tuple[torch.Tensor, tuple[str, ...]] | None = None
        self.loss_sum: torch.Tensor | None = None
        self.loss_n = 0
        self.data_ms: float | None = None
        self.fwd_start: Any = None
        self.fwd_ms = 0.0
        self.forwards: list[tuple[Any, Any]] = []
        self.opt_start: Any = None


class Collector:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: Config,
        guard: Guard,
        live: Live,
        submit: Callable[[Chunk], None],
    ) -> None:
        self.model, self.optimizer, self.config, self.guard, self.live = model, optimizer, config, guard, live
        self._submit = submit
        param = next(iter(model.parameters()), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self._pnames = {id(p): n for n, p in model.named_parameters()}
        self._fingerprint = Fingerprinter(model)
        self._slots: dict[str, int] = {}  # tracked module -> index in first-seen forward order
        self._order: list[str] = []
        # (min, max) of a module that did not run this step: min > max marks it missing.
        self._missing = (torch.ones(1, device=self.device), -torch.ones(1, device=self.device))
        self._step = config.start_step if config.start_step is not None else resumed_step(optimizer)
        self._cur = _Step(0)
        self._done: tuple[_Step, int, float, Any, Any] | None = None  # finished step, not yet finalized
        self._pending: list[StepRecord] = []
        self._prev_end_host = time.perf_counter()
        self._prev_end = self._mark()
        self._last_transfer = self._prev_end_host
        self._paused = 0
        self._handles: list[Any] = []
        self._bad_names: set[str] = set()
        self._params: list[torch.Tensor] = []
        tracked = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        named = dict(model.named_modules())
        tracked.update({n: named[n] for n in config.track})
        for name, module in tracked.items():
            self._handles.append(module.register_forward_hook(self._amax_hook(name)))
        self._handles += [
            model.register_forward_pre_hook(self._on_forward_pre),
            model.register_forward_hook(self._on_forward),
            optimizer.register_step_pre_hook(self._on_step_pre),
            optimizer.register_step_post_hook(self._on_step_post),
        ]

    # -- hooks (training thread) --------------------------------------------------------------------
    def _active(self) -> bool:
        return self._paused == 0 and self.guard.on("steps") and torch.is_grad_enabled()

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _amax_hook(self, name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._active() or not self.guard.on("amax"):
                return
            try:
                out = first_tensor(output)
                if out is None or not out.is_floating_point() or out.numel() == 0:
                    return
                slot = self._slots.get(name)
                if slot is None:
                    slot = self._slots[name] = len(self._order)
                    self._order.append(name)
                    self._cur.amax.append(None)
                # min and max in one pass (NaN propagates into both); the host takes amax = max(-min, max).
                # Cheaper than vector_norm(x, inf) on CPU, and no extra kernels for abs/neg.
                low, high = torch.aminmax(out.detach())
                old = self._cur.amax[slot]
                if old is not None:
                    low, high = torch.minimum(old[0], low), torch.maximum(old[1], high)
                self._cur.amax[slot] = (low.reshape(1), high.reshape(1))
            except Exception as exc:
                self.guard.fail("amax", exc)

        return hook

    def _on_forward_pre(self, module: nn.Module, args: Any) -> None:
        if not self._active():
            return
        try:
            cur = self._cur
            if not cur.forwards and cur.fwd_start is None:
                self._finalize_and_maybe_transfer()
                cur.data_ms = (time.perf_counter() - self._prev_end_host) * 1e3
            self.live.phase = "forward"
            cur.fwd_start = self._mark()
        except Exception as exc:
            self.guard.fail("steps", exc)

    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._active():
            return
        try:
            cur = self._cur
            if cur.fwd_start is not None:
                end = self._mark()
                if not self.cuda:
                    cur.fwd_ms += (end - cur.fwd_start) * 1e3
                cur.forwards.append((cur.fwd_start, end))
                cur.fwd_start = None
            self.live.phase = "backward"
            if self.guard.on("loss"):
                loss = find_loss(output)
                if loss is not None:
                    cur.loss_sum = loss if cur.loss_sum is None else cur.loss_sum + loss
                    cur.loss_n += 1
        except Exception as exc:
            self.guard.fail("loss", exc)

    def _on_step_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.guard.on("steps"):
            return
        try:
            if not self._cur.forwards:  # no forward seen through the root model this step
                self._finalize_and_maybe_transfer()
            self.live.phase = "optimizer"
            cur = self._cur
            cur.opt_start = self._mark()
            if self.guard.on("grads"):
                self._grads(cur)
            for i, group in enumerate(optimizer.param_groups):
                lr, name = group.get("lr"), ("lr" if i == 0 else f"lr.{i}")
                if isinstance(lr, torch.Tensor):
                    if lr.device.type == "cpu":
                        cur.host[name] = float(lr)  # a CPU tensor: no device sync
                    else:  # copied: schedulers update tensor learning rates in place
                        cur.hook[name] = lr.detach().reshape(1).clone()
                elif isinstance(lr, int | float):
                    cur.host[name] = float(lr)
        except Exception as exc:
            self.guard.fail("steps", exc)

    def _grads(self, cur: _Step) -> None:
        try:
            count = sum(len(g["params"]) for g in self.optimizer.param_groups)
            if len(self._params) != count:  # first step, or add_param_group() since
                self._params = [p for g in self.optimizer.param_groups for p in g["params"]]
            params, grads = [], []
            for p in self._params:
                grad = p.grad
                if grad is not None and not grad.is_sparse:
                    params.append(p)
                    grads.append(local(grad))
            if not grads:
                return
            # One fused reduction over all gradients; float32 so that fp16 norms do not overflow.
            norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
            cur.hook["grad_norm"] = torch.linalg.vector_norm(norms).reshape(1)
            if (self._step + 1) % self.config.amax_every == 0:
                names = tuple(self._pnames.get(id(p), f"param.{i}") for i, p in enumerate(params))
                cur.grad_norms = (norms.to(self.device, non_blocking=True), names)
        except Exception as exc:
            self.guard.fail("grads", exc)

    def _on_step_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.guard.on("steps"):
            return
        try:
            cur = self._cur
            end, end_host, ts = self._mark(), time.perf_counter(), time.time()
            self._step += 1
            prev_end = self._prev_end
            if not self.cuda:
                cur.host["time.step_ms"] = (end_host - self._prev_end_host) * 1e3
                cur.host["time.forward_ms"] = cur.fwd_ms if cur.forwards else None
                last_fwd = cur.forwards[-1][1] if cur.forwards else None
                cur.host["time.backward_ms"] = (
                    (cur.opt_start - last_fwd) * 1e3 if last_fwd is not None else None
                )
                cur.host["time.optimizer_ms"] = (
                    (end - cur.opt_start) * 1e3 if cur.opt_start is not None else None
                )
            else:
                cur.host["mem.allocated_mb"] = torch.cuda.memory_allocated(self.device) / 2**20
                cur.host["mem.reserved_mb"] = torch.cuda.memory_reserved(self.device) / 2**20
                cur.host["mem.peak_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
            cur.host["time.data_ms"] = cur.data_ms
            self._prev_end, self._prev_end_host = end, end_host
            self._done = (cur, self._step, ts, prev_end, end)
            self._cur = _Step(len(self._order))
            self.live.last_step = self._step
            self.live.phase = "data"
        except Exception as exc:
            self.guard.fail("steps", exc)

    # -- finalize and transfer (training thread) ---------------------------------------------------
    def _finalize_and_maybe_transfer(self) -> None:
        self._finalize()
        now = time.perf_counter()
        if (
            len(self._pending) >= STEPS_PER_TRANSFER
            or self.live.transfer_requested
            or (self._pending and now - self._last_transfer >= self.config.flush_interval_s / 2)
        ):
            self.transfer()

    def _finalize(self) -> None:
        if self._done is None:
            return
        cur, step, ts, prev_end, end = self._done
        self._done = None
        rec = StepRecord(step=step, ts=ts, host=cur.host)
        parts = rec.parts
        if cur.loss_sum is not None and "loss" not in cur.logs and "loss" not in cur.host:
            cur.hook["loss"] = cur.loss_sum
            rec.loss_div = cur.loss_n
        rec.hook_names = tuple(cur.hook)
        parts.extend(cur.hook.values())
        rec.log_names = tuple(cur.logs)
        parts.extend(cur.logs.values())
        if any(v is not None for v in cur.amax):
            rec.amax_names = tuple(self._order[: len(cur.amax)])
            for pair in cur.amax:
                parts.extend(self._missing if pair is None else pair)
            rec.ship_amax = step % self.config.amax_every == 0
        if cur.grad_norms is not None:
            parts.append(cur.grad_norms[0])
            rec.grad_names = cur.grad_norms[1]
        every = self.config.fingerprint_every
        if every and step % every == 0 and self.guard.on("fingerprint"):
            try:
                parts.append(self._fingerprint.words())
                rec.fingerprint = True
            except Exception as exc:
                self.guard.fail("fingerprint", exc)
        if self.cuda:
            rec.marks = (prev_end, cur.forwards, cur.opt_start, end)
        self._pending.append(rec)

    def transfer(self) -> None:
        """Hand the finished steps to the sender: one cat + one non-blocking copy to the host."""
        self._last_transfer = time.perf_counter()
        self.live.transfer_requested = False
        records, self._pending = self._pending, []
        if records:
            self._submit(transfer(records, self.cuda))

    # -- user calls (training thread) --------------------------------------------------------------
    def log(self, values: Mapping[str, Any]) -> None:
        # Between optimizer.step() and the next forward, values belong to the step that just ended.
        target = self._done[0] if self._done is not None else self._cur
        for name, value in values.items():
            problem = self._log_one(target, name, value)
            if problem:
                self.guard.counters.add("rejected_log_values")
                if name not in self._bad_names and len(self._bad_names) < 100:
                    self._bad_names.add(name)
                    logger.warning("stepwatch: watch.log(%s=...) ignored: %s (logged once)", name, problem)

    def _log_one(self, target: _Step, name: str, value: Any) -> str | None:
        if not NAME.fullmatch(name):
            return "names are 1-200 characters of A-Za-z0-9._:/@+-[]"
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                return f"a tensor of {value.numel()} elements; log one value"
            if value.device.type == "cpu" and self.device.type != "cpu":
                target.host[name] = float(value)  # a CPU tensor: no device sync
                target.logs.pop(name, None)
                return None
            value = value.detach().reshape(1)
            if not value.is_floating_point():
                value = value.to(torch.float64)  # exact for integers up to 2**53
            if value.device != self.device:
                value = value.to(self.device, non_blocking=True)
            target.logs[name] = value
            target.host.pop(name, None)
            return None
        if isinstance(value, str):
            return "a string; log numbers or tensors"
        try:
            target.host[name] = float(value)
        except (TypeError, ValueError, OverflowError):
            return f"{type(value).__name__} is not a number"
        target.logs.pop(name, None)
        return None

    def pause(self, paused: bool) -> None:
        """Entering or leaving a known pause (watch.phase): hand over what is finished."""
        self._paused += 1 if paused else -1
        if paused:
            self._finalize()
            self.transfer()

    def drain(self) -> None:
        """At close: hand over every finished step."""
        self._finalize()
        self.transfer()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
