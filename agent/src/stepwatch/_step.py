"""The step in progress, the values hooks find and `watch.log()` adds, and the record it becomes.

Training thread only. Device values stay 0-dim device tensors in plain lists; nothing here reads them.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._records import StepRecord

NAME = re.compile(r"[A-Za-z0-9._:/@+\-\[\]]{1,200}")
MAX_KNOWN_NAMES = 1_000  # watch.log() names remembered as valid (skips the regex); beyond, checked each time
ROOT_NAME = "model"  # the root module's name ('' in named_modules(): a bare nn.Linear as the model)
_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9._:/@+\-\[\]]")


def wire_names(names: Sequence[str]) -> tuple[str, ...]:
    """Module or parameter names as the collector accepts them (`NAME`), one for one and distinct: a
    valid name is kept as it is; the root's '' becomes `model`, other characters `_`, a name over 200
    characters its first 191 and a short hash of the whole, and one that then meets a name already
    taken (a child module called `model`) a `[k]` suffix."""
    wires = list(names)
    taken = {n for n in names if NAME.fullmatch(n)}
    for i, name in enumerate(names):
        if name in taken:
            continue
        wire = ROOT_NAME if name == "" else _NOT_IN_NAME.sub("_", name)
        if len(wire) > 200:
            wire = f"{wire[:191]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
        base, k = wire, 1
        while wire in taken:
            suffix = f"[{k}]"
            wire, k = base[: 200 - len(suffix)] + suffix, k + 1
        taken.add(wire)
        wires[i] = wire
    return tuple(wires)


def find_loss(output: Any) -> torch.Tensor | None:
    """The loss in a model's output: a scalar tensor, an object with `.loss`, a mapping with "loss", or a
    tuple or list whose first item is a scalar (transformers' `return_dict=False` order: loss first)."""
    if isinstance(output, tuple | list) and output and not hasattr(output, "loss"):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        output = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(output, torch.Tensor) and output.numel() == 1 and output.is_floating_point():
        loss = output.detach()
        return loss.reshape(()) if loss.dim() else loss
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


class Step:
    """The step in progress (between two `optimizer.step()` ends)."""

    __slots__ = (
        "amax",
        "calls",
        "data_ms",
        "discarded",
        "forwards",
        "fwd_end",
        "fwd_ms",
        "fwd_start",
        "grad_mark",
        "grads",
        "hook_names",
        "host",
        "ids",
        "logs",
        "loss_n",
        "loss_sum",
        "n_fwd",
        "opt_start",
        "pending",
        "pending_elements",
        "pending_slots",
        "row",
        "sampled",
        "scalars",
    )

    def __init__(self, sampled: bool, row: Sequence[torch.Tensor] = ()) -> None:
        # Tracked modules' calls this step, in call order: the module's slot (`_hooks.Tap`), and in
        # `amax` 1-dim float32 device tensors that hold max |x| of each call's output, in the same
        # order (non-finite exactly when an element was; on a step that is not `sampled` a big CPU
        # output's value is its sum, read only for that). Shipped per module when `sampled`.
        self.calls: list[int] = []
        self.amax: list[torch.Tensor] = []
        self.sampled = sampled
        # Outputs waiting for their fused reduction (`_hooks.Hooks.flush`), their slots and size.
        self.pending: list[torch.Tensor] = []
        self.pending_slots: list[int] = []
        self.pending_elements = 0
        # 0-dim float32 views of one row of the collector's ring (`_hooks.Ring`): where this step's
        # grad norm (item 0) is written, allocating nothing.
        self.row = row
        self.hook_names: list[str] = []  # names of the device scalars from the hooks (grad_norm, lr)
        self.scalars: list[torch.Tensor] = []  # their 0-dim device values; becomes the record's list
        self.logs: dict[str, torch.Tensor] = {}  # 0-dim device values from watch.log()
        self.ids: dict[str, Any] | None = None  # host values from watch.identify()
        self.host: dict[str, float | None] = {}  # host values: CPU timings, numbers, memory
        self.grads: tuple[torch.Tensor, tuple[str, ...]] | None = None  # per-parameter norms (sampled)
        self.loss_sum: torch.Tensor | None = None
        self.loss_n = 0
        self.data_ms: float | None = None
        self.fwd_start: Any = None
        self.fwd_end: Any = None
        self.fwd_ms = 0.0
        self.n_fwd = 0
        self.forwards: list[tuple[Any, Any]] = []  # CUDA: (start, end) events of each forward
        self.opt_start: Any = None
        self.grad_mark: tuple[int, int] | None = None  # the probe gradient (id, version) at the last forward
        self.discarded = False  # zero_grad() threw its gradients away before any optimizer step

    def record(self, step: int, ts: float, order: tuple[str, ...]) -> StepRecord:
        """The finished step, its device values in the order `StepRecord` documents."""
        rec = StepRecord(step=step, ts=ts, host=self.host, ids=self.ids)
        names, scalars = self.hook_names, self.scalars
        if self.loss_sum is not None and "loss" not in self.logs and "loss" not in self.host:
            names.append("loss")
            scalars.append(self.loss_sum)
            rec.loss_div = self.loss_n
        rec.hook_names = tuple(names)
        if self.logs:
            rec.log_names = tuple(self.logs)
            scalars += self.logs.values()
        rec.scalars = scalars
        if self.calls:
            rec.amax_names = order
            rec.amax_calls = self.calls
            rec.ship_amax = self.sampled
            rec.amax_exact = self.sampled
            rec.vectors += self.amax
        if self.grads is not None:
            rec.vectors.append(self.grads[0])
            rec.grad_names = self.grads[1]
        return rec


def valid_name(name: str, known: set[str]) -> bool:
    if name in known:
        return True
    if not NAME.fullmatch(name):
        return False
    if len(known) < MAX_KNOWN_NAMES:
        known.add(name)
    return True


def log_one(target: Step, name: str, value: Any, device: torch.device) -> str | None:
    """Put one `watch.log()` value into `target`; the reason when it is refused."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return f"a tensor of {value.numel()} elements; log one value"
        if value.is_cpu and device.type != "cpu":
            target.host[name] = float(value)  # a CPU tensor: no device sync
            target.logs.pop(name, None)
            return None
        value = value.detach()
        if value.dim():
            value = value.reshape(())
        if not value.is_floating_point():
            value = value.to(torch.float64)  # exact for integers up to 2**53
        if value.device != device:
            value = value.to(device, non_blocking=True)
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


MAX_ID_ITEMS = 64  # items of one watch.identify() list
MAX_ID_CHARS = 200  # characters of one string


def identity(name: str, value: Any) -> tuple[Any, str | None]:
    """One watch.identify() value as kept (JSON-ready), or the reason it is refused. Host values only: a
    device tensor would need a copy to the host, a sync on the training thread."""
    if not NAME.fullmatch(name):
        return None, "names are 1-200 characters of A-Za-z0-9._:/@+-[]"
    if isinstance(value, torch.Tensor):
        if not value.is_cpu:
            return (
                None,
                f"a {value.device.type} tensor: reading it would wait for the device; pass host values",
            )
        if value.numel() > MAX_ID_ITEMS:
            return None, f"{value.numel()} elements; at most {MAX_ID_ITEMS}"
        value = value.detach().reshape(-1).tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None, "a non-finite number; identify the data with finite numbers or strings"
    if isinstance(value, bool | int | float) or value is None:
        return value, None
    if isinstance(value, str):
        return value[:MAX_ID_CHARS], None
    if isinstance(value, list | tuple):
        if len(value) > MAX_ID_ITEMS:
            return None, f"{len(value)} items; at most {MAX_ID_ITEMS}"
        if all(isinstance(v, bool | int) or (isinstance(v, float) and math.isfinite(v)) for v in value):
            return list(value), None
        if all(isinstance(v, str) for v in value):
            return [v[:MAX_ID_CHARS] for v in value], None
        return None, "a list of finite numbers or of strings is expected"
    return None, f"{type(value).__name__}: pass numbers, strings, lists of them, or a CPU tensor"
