"""Hooks on the model and the optimizer. Hot path: cheap device work, no host-device sync, no I/O.

Per step the values stay on the device as 0-dim tensors in a list (`_step.Step`); every few steps one
`torch.stack` and one non-blocking copy to pinned host memory (with a CUDA event) hand them to the
sender thread, which decodes them. Timings: host `perf_counter` on CPU; CUDA events on GPU, read by
the sender once they completed. Every hook first tests plain attributes (paused, the guard's set of
switched-off features) so that a disabled or paused agent costs a few attribute reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ._capacity import device_capacity_mb
from ._config import Config
from ._device import Fingerprinter, local, transfer
from ._guard import Guard
from ._layout import Layout
from ._records import Chunk, Live, StepRecord
from ._step import Step, find_loss, first_tensor, log_one, resumed_step, valid_name

logger = logging.getLogger("stepwatch")

STEPS_PER_TRANSFER = 8  # device values of this many steps share one copy to the host
# Rows of the ring: a row is written again this many steps after it was handed out, and a step's values
# are copied out by the transfer at most STEPS_PER_TRANSFER + 2 steps after (pending, done, current).
RING_ROWS = 2 * STEPS_PER_TRANSFER + 2
_grad_enabled = torch.is_grad_enabled
_aminmax = torch.aminmax
_sum = torch.sum
_vector_norm = torch.linalg.vector_norm
_f32 = torch.float32
_perf = time.perf_counter


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Run `hook` outside any torch.compile graph. The step hooks read clocks, hand steps to the sender
    and keep Python state: traced, they would be folded into the graph or break it. On the compiled
    model's own boundary they cost no graph break (tests/agent/test_stacks.py counts them)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(hook) if callable(disable) else hook


def _is_partial(grad: torch.Tensor | None) -> bool:
    """A DTensor gradient with a Partial placement (a pending sum over ranks)."""
    return any(callable(f := getattr(q, "is_partial", None)) and f() for q in getattr(grad, "placements", ()))


def _noop(*args: Any, **kwargs: Any) -> None:
    """What a hook becomes in a copy of the model (copy.deepcopy, torch.save of the whole module)."""


def _inert() -> Callable[..., None]:
    return _noop


class _EagerHook:
    """A step hook (root forward, optimizer step): run outside any compiled graph, and inert in a copy.

    `copy.deepcopy(model)` (an EMA model, a target network) and `torch.save(model)` copy the model's
    hooks with it; a hook that holds the agent would drag its threads and locks along and fail ("cannot
    pickle '_thread.lock'"), breaking the user's code. A copy is not the watched model: its hooks
    become no-ops."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    __call__ = _eager(_call)  # the whole call, so torch.compile never traces into it

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inert, ())


class Ring:
    """Preallocated float32 rows the per-step device values are written into (`out=`), so that the hooks
    allocate no tensor on most steps.

    Small tensors made on every step and kept until the transfer sit between the model's large
    activation buffers in the allocator's heap. On a CPU (mlp-wide-batch in bench/agent_overhead.py)
    that cost the training thread about 100 extra minor page faults per step, which went away when
    glibc's trim and mmap thresholds were raised, and go away with this ring. A row holds one step:
    item 0 the grad norm, item 1 + slot the sum of tracked module `slot`. Rows are reused after
    RING_ROWS steps. They grow (a new buffer; steps in flight keep the old one alive) when modules
    appear; a module beyond a row's width, on another device, or called twice in a step takes the
    allocating path. Sampled steps' (min, max) pairs allocate too (one step in `amax_every`).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.width = 0
        self.rows: list[tuple[torch.Tensor, ...]] = []
        self.next = 0

    def row(self, modules: int) -> tuple[torch.Tensor, ...]:
        if modules + 1 > self.width:
            self.width = max(16, 2 * (modules + 1))
            buffer = torch.zeros((RING_ROWS, self.width), dtype=_f32, device=self.device)
            self.rows = [tuple(buffer[i].unbind()) for i in range(RING_ROWS)]
        self.next = (self.next + 1) % RING_ROWS
        return self.rows[self.next]


class Hooks:
    """The agent's hooks on one model and optimizer (the *collector* is the service they report to)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: Config,
        guard: Guard,
        live: Live,
        submit: Callable[[Chunk], None],
        layout: Layout | None = None,
    ) -> None:
        self.model, self.optimizer, self.config, self.guard, self.live = model, optimizer, config, guard, live
        self._submit = submit
        self._off = guard.off  # the guard's switched-off features: one set, read without a call
        param = next(iter(model.parameters()), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.capacity_mb = self._capacity_mb()  # read once: the sender adds it to the memory values
        self._pnames = {id(p): n for n, p in model.named_parameters()}
        self._fingerprint = Fingerprinter(model)
        # Every rank its own shard (FSDP2 or TP over all ranks): no fingerprint has a replica to agree with.
        self._fingerprints = config.fingerprint_every if layout is None or layout.replicas > 1 else 0
        # Ranks of one replica holding each parameter (a replicated one counts 1/copies in the sum of
        # squares the collector adds up over shards); empty when every parameter is held once.
        self._copies: dict[int, float] = {}
        if layout is not None and any(c != 1.0 for c in layout.copies):
            self._copies = {id(p): c for p, c in zip(model.parameters(), layout.copies, strict=True)}
        self._weights: tuple[tuple[int, ...], torch.Tensor | None] = ((), None)
        self._partial_said = False
        self._slots: dict[str, int] = {}  # tracked module -> index in first-seen forward order
        self._order: tuple[str, ...] = ()
        # What a module that did not run this step reports, made once: (min, max) with min > max on a
        # sampled step, a zero sum on any other.
        self._missing = (
            torch.ones((), device=self.device),
            -torch.ones((), device=self.device),
            torch.zeros((), device=self.device),
        )
        self._step = config.start_step if config.start_step is not None else resumed_step(optimizer)
        self._ring = Ring(self.device)
        self._cur = self._new_step()
        self._done: tuple[Step, int, float, Any, Any] | None = None  # finished step, not yet finalized
        self._pending: list[StepRecord] = []
        self._prev_end_host = _perf()
        self._prev_end = self._mark()
        self._last_transfer = self._prev_end_host
        self._paused = 0
        self._handles: list[Any] = []
        self._bad_names: set[str] = set()
        self._good_names: set[str] = set()
        self._params: list[torch.Tensor] = []
        self._grad_names: tuple[tuple[int, ...], tuple[str, ...]] = ((), ())
        tracked = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        named = dict(model.named_modules())
        tracked.update({n: named[n] for n in config.track})
        for name, module in tracked.items():
            self._handles.append(module.register_forward_hook(self._amax_hook(name)))
        self._handles += [
            model.register_forward_pre_hook(_EagerHook(self._on_forward_pre)),
            model.register_forward_hook(_EagerHook(self._on_forward)),
            optimizer.register_step_pre_hook(_EagerHook(self._on_step_pre)),
            optimizer.register_step_post_hook(_EagerHook(self._on_step_post)),
        ]
        # optimizer.zero_grad, seen through an instance attribute (removed again by remove()): gradients
        # discarded after forwards with no optimizer step between are a skipped step (AMP's GradScaler
        # skips optimizer.step() when they overflowed), recorded as such, not merged into the next one.
        # Whether a backward ran since the last forward: the probe parameter's gradient changed (a new
        # tensor, or one accumulated into). zero_grad between forward and backward is no skip.
        self._probe = next((p for g in optimizer.param_groups for p in g["params"] if p.requires_grad), None)
        self._zero_grad = optimizer.zero_grad
        optimizer.zero_grad = self._on_zero_grad  # type: ignore[method-assign]

    def _capacity_mb(self) -> float | None:
        try:
            return device_capacity_mb(self.device)
        except Exception as exc:
            self.guard.fail("memory", exc)
            return None

    def _new_step(self) -> Step:
        n = len(self._order)
        return Step(n, self._sampled(self._step + 1), self._ring.row(n))

    def _sampled(self, step: int) -> bool:
        """Steps that ship amax and per-parameter grad norms (every `amax_every`-th)."""
        return step % self.config.amax_every == 0

    # -- hooks (training thread) --------------------------------------------------------------------
    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return _perf()

    def _amax_hook(self, name: str) -> AmaxHook:
        return AmaxHook(self, name)

    def _on_forward_pre(self, module: nn.Module, args: Any) -> None:
        # Counted first, paused or not: two int increments, the only work a no-grad forward costs. The
        # sender ships the counts in each heartbeat (no-grad forwards advancing without a step: an eval).
        live = self.live
        live.forwards += 1
        if not _grad_enabled():
            live.nograd_forwards += 1
            return
        if self._paused or "steps" in self._off:
            return
        try:
            if self._cur.discarded:  # a skipped step ends where the next one begins
                self._end_skipped()
            cur = self._cur
            if not cur.n_fwd and cur.fwd_start is None:
                self._finalize_and_maybe_transfer()
                cur.data_ms = (_perf() - self._prev_end_host) * 1e3
            self.live.phase = "forward"
            cur.fwd_start = self._mark()
        except Exception as exc:
            self.guard.fail("steps", exc)

    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._paused or "steps" in self._off or not _grad_enabled():
            return
        try:
            cur = self._cur
            if cur.fwd_start is not None:
                end = self._mark()
                if self.cuda:
                    cur.forwards.append((cur.fwd_start, end))
                else:
                    cur.fwd_ms += (end - cur.fwd_start) * 1e3
                cur.fwd_end = end
                cur.n_fwd += 1
                cur.fwd_start = None
            cur.grad_mark = self._grad_mark()
            self.live.phase = "backward"
            if "loss" not in self._off:
                loss = find_loss(output)
                if loss is not None:
                    if loss.device != self.device:
                        loss = loss.to(self.device, non_blocking=True)
                    cur.loss_sum = loss if cur.loss_sum is None else cur.loss_sum + loss
                    cur.loss_n += 1
        except Exception as exc:
            self.guard.fail("loss", exc)

    def _on_step_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if "steps" in self._off:
            return
        try:
            if not self._cur.n_fwd:  # no forward seen through the root model this step
                self._finalize_and_maybe_transfer()
            self.live.phase = "optimizer"
            cur = self._cur
            cur.opt_start = self._mark()
            if "grads" not in self._off and not cur.discarded:  # discarded: read before zero_grad
                self._grads(cur)
            for i, group in enumerate(optimizer.param_groups):
                lr, name = group.get("lr"), ("lr" if i == 0 else f"lr.{i}")
                if isinstance(lr, torch.Tensor):
                    if lr.is_cpu:
                        cur.host[name] = float(lr)  # a CPU tensor: no device sync
                    else:  # copied: schedulers update tensor learning rates in place
                        cur.hook_names.append(name)
                        cur.scalars.append(lr.detach().reshape(()).clone())
                elif isinstance(lr, int | float):
                    cur.host[name] = float(lr)
        except Exception as exc:
            self.guard.fail("steps", exc)

    def _on_zero_grad(self, *args: Any, **kwargs: Any) -> Any:
        if not self._paused and "steps" not in self._off:
            try:
                cur = self._cur
                # Forwards and their backward, then the gradients discarded with no optimizer step: the
                # update is skipped. Its record is made by what comes next: an optimizer.step() (a loop
                # that skips by hand and steps anyway) or the next forward (GradScaler, which never calls
                # optimizer.step() on overflow).
                if (
                    cur.n_fwd
                    and cur.opt_start is None
                    and not cur.discarded
                    and self._grad_mark() != cur.grad_mark
                ):
                    if "grads" not in self._off:
                        self._grads(cur)  # the overflowing gradients, before they are cleared
                    cur.host["optimizer.skipped"] = 1.0
                    cur.discarded = True
            except Exception as exc:
                self.guard.fail("steps", exc)
        return self._zero_grad(*args, **kwargs)

    def _end_skipped(self) -> None:
        """The discarded step ends without an optimizer step: recorded as one, skipped."""
        self._cur.opt_start = self._mark()
        self._on_step_post(self.optimizer, (), {})

    def _grad_mark(self) -> tuple[int, int] | None:
        g = self._probe.grad if self._probe is not None else None
        return None if g is None else (id(g), getattr(g, "_version", 0))

    def _grads(self, cur: Step) -> None:
        try:
            params = self._params
            if len(params) != sum(len(g["params"]) for g in self.optimizer.param_groups):
                params = self._params = [p for g in self.optimizer.param_groups for p in g["params"]]
            grads = []
            for p in params:
                g = p.grad
                if g is not None and not g.is_sparse:
                    grads.append(g if type(g) is torch.Tensor else local(g))  # DTensor: this rank's shard
            if not grads:
                return
            # One fused reduction over all gradients (one kernel on CUDA; on CPU measured cheaper than
            # per-tensor vector_norm or dot); float32 so that fp16 norms do not overflow.
            norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
            cur.hook_names.append("grad_norm")
            if cur.row and norms.device == self.device:
                cur.scalars.append(_vector_norm(norms, out=cur.row[0]))
            else:
                cur.scalars.append(_vector_norm(norms))
            if self._copies:
                cur.hook_names.append("grad_sumsq")
                cur.scalars.append(torch.dot(norms * norms, self._weights_of(params, norms.device)))
            if cur.sampled:
                cur.grads = (norms.to(self.device, non_blocking=True), self._names_of(params))
        except Exception as exc:
            self.guard.fail("grads", exc)

    def _weights_of(self, params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """1/copies per parameter with a dense gradient this step (made again when that set changes).

        A gradient still `Partial` (each rank holds a part of a sum: a sequence-parallel LayerNorm's
        before its reduction) has no share of the norm that squares can add up: weight 0, said once.
        """
        with_grad = [p for p in params if p.grad is not None and not p.grad.is_sparse]
        ids = tuple(id(p) for p in with_grad)
        cached_ids, weights = self._weights
        if ids != cached_ids or weights is None:
            partial = [_is_partial(p.grad) for p in with_grad]
            values = [
                0.0 if part else 1.0 / self._copies.get(i, 1.0) for i, part in zip(ids, partial, strict=True)
            ]
            weights = torch.tensor(values, dtype=torch.float32).to(device)
            self._weights = (ids, weights)
            if any(partial) and not self._partial_said:
                self._partial_said = True
                names = [
                    self._pnames.get(id(p), "?") for p, part in zip(with_grad, partial, strict=True) if part
                ]
                logger.warning(
                    "stepwatch: %d parameters have Partial gradients (%s): left out of grad_sumsq, so the "
                    "global grad norm is the norm without them",
                    len(names), ", ".join(names[:4]) + (", ..." if len(names) > 4 else ""),
                )  # fmt: skip
        return weights

    def _names_of(self, params: list[torch.Tensor]) -> tuple[str, ...]:
        """Names of the parameters that have a dense gradient this step (sampled steps only)."""
        ids = tuple(id(p) for p in params if p.grad is not None and not p.grad.is_sparse)
        if ids != self._grad_names[0]:
            names = tuple(self._pnames.get(i, f"param.{k}") for k, i in enumerate(ids))
            self._grad_names = (ids, names)
        return self._grad_names[1]

    def _on_step_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if "steps" in self._off:
            return
        try:
            cur = self._cur
            end, ts = self._mark(), time.time()
            self._step += 1
            prev_end = self._prev_end
            if self.cuda:
                end_host = _perf()
                cur.host["mem.allocated_mb"] = torch.cuda.memory_allocated(self.device) / 2**20
                cur.host["mem.reserved_mb"] = torch.cuda.memory_reserved(self.device) / 2**20
                cur.host["mem.peak_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
            else:
                end_host = end
                host, opt_start = cur.host, cur.opt_start
                host["time.step_ms"] = (end - prev_end) * 1e3
                host["time.forward_ms"] = cur.fwd_ms if cur.n_fwd else None
                host["time.backward_ms"] = (
                    (opt_start - cur.fwd_end) * 1e3
                    if cur.fwd_end is not None and opt_start is not None
                    else None
                )
                host["time.optimizer_ms"] = (end - opt_start) * 1e3 if opt_start is not None else None
            cur.host["time.data_ms"] = cur.data_ms
            self._prev_end, self._prev_end_host = end, end_host
            self._done = (cur, self._step, ts, prev_end, end)
            self._cur = self._new_step()
            self.live.last_step = self._step
            self.live.phase = "data"
        except Exception as exc:
            self.guard.fail("steps", exc)

    # -- finalize and transfer (training thread) ---------------------------------------------------
    def _finalize_and_maybe_transfer(self) -> None:
        self._finalize()
        pending = self._pending
        if (
            len(pending) >= STEPS_PER_TRANSFER
            or self.live.transfer_requested
            or (pending and _perf() - self._last_transfer >= self.config.flush_interval_s / 2)
        ):
            self.transfer()

    def _finalize(self) -> None:
        if self._done is None:
            return
        cur, step, ts, prev_end, end = self._done
        self._done = None
        rec = cur.record(step, ts, self._order, self._missing)
        every = self._fingerprints
        if every and step % every == 0 and "fingerprint" not in self._off:
            try:
                rec.vectors.append(self._fingerprint.words())
                rec.fingerprint = True
            except Exception as exc:
                self.guard.fail("fingerprint", exc)
        if self.cuda:
            rec.marks = (prev_end, cur.forwards, cur.opt_start, end)
        self._pending.append(rec)

    def transfer(self) -> None:
        """Hand the finished steps to the sender: one stack + one non-blocking copy to the host."""
        self._last_transfer = _perf()
        self.live.transfer_requested = False
        records, self._pending = self._pending, []
        if records:
            self._submit(transfer(records, self.cuda))

    # -- user calls (training thread) --------------------------------------------------------------
    def log(self, values: Mapping[str, Any]) -> None:
        # Between optimizer.step() and the next forward, values belong to the step that just ended.
        target = self._done[0] if self._done is not None else self._cur
        for name, value in values.items():
            if not valid_name(name, self._good_names):
                problem: str | None = "names are 1-200 characters of A-Za-z0-9._:/@+-[]"
            else:
                problem = log_one(target, name, value, self.device)
            if problem:
                self.guard.counters.add("rejected_log_values")
                if name not in self._bad_names and len(self._bad_names) < 100:
                    self._bad_names.add(name)
                    logger.warning("stepwatch: watch.log(%s=...) ignored: %s (logged once)", name, problem)

    def pause(self, paused: bool) -> None:
        """Entering or leaving a known pause (watch.phase): hand over what is finished."""
        self._paused += 1 if paused else -1
        if paused:
            self._finalize()
            self.transfer()

    def drain(self) -> None:
        """At close: hand over every finished step."""
        if self._cur.discarded:
            self._end_skipped()
        self._finalize()
        self.transfer()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.optimizer.__dict__.get("zero_grad") == self._on_zero_grad:
            del self.optimizer.zero_grad


class AmaxHook:
    """The forward hook on one tracked module: its output's (min, max) on sampled steps, a float32 sum
    (non-finite exactly when an element is) on the others. Traced by torch.compile (no Python state
    beyond appends), inert in a copy of the model (see _EagerHook)."""

    __slots__ = ("hooks", "name")

    def __init__(self, hooks: Hooks, name: str) -> None:
        self.hooks, self.name = hooks, name

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inert, ())

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        hooks = self.hooks
        off = hooks._off
        if hooks._paused or (off and ("steps" in off or "amax" in off)) or not _grad_enabled():
            return
        try:
            out = output if isinstance(output, torch.Tensor) else first_tensor(output)
            if out is None or not out.is_floating_point() or out.numel() == 0:
                return
            slots = hooks._slots
            slot = slots.get(self.name)
            if slot is None:
                slot = slots[self.name] = len(hooks._order)
                hooks._order += (self.name,)
                hooks._cur.acts.append(None)
            cur = hooks._cur
            acts, old = cur.acts, cur.acts[slot]
            if cur.sampled:
                # min and max in one pass (NaN propagates into both); the host takes
                # amax = max(-min, max). Cheaper than vector_norm(x, inf) on CPU, no abs/neg kernels.
                pair: tuple[torch.Tensor, torch.Tensor] = _aminmax(out.detach())
                if old is not None:  # called again this step (micro-batches, shared modules)
                    pair = (torch.minimum(old[0], pair[0]), torch.maximum(old[1], pair[1]))
                acts[slot] = pair
            else:
                # Other steps only need "was anything non-finite": one float32 sum, a single
                # output and about half the work of aminmax (NaN and Inf propagate into it),
                # written into this step's ring row.
                row = cur.row
                if old is None and slot + 1 < len(row) and out.device == hooks.device:
                    acts[slot] = _sum(out.detach(), None, dtype=_f32, out=row[slot + 1])
                else:
                    total = out.detach().sum(dtype=_f32)
                    acts[slot] = total if old is None else old + total  # type: ignore[operator]
        except Exception as exc:
            hooks.guard.fail("amax", exc)
