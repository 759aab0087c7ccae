"""Hooks on the model and the optimizer. Hot path: cheap device work, no host-device sync, no I/O.

Per step the values stay on the device as 0-dim tensors in a list (`_step.Step`); every few steps one
`torch.stack` and one non-blocking copy to pinned host memory (with a CUDA event) hand them to the
sender thread, which decodes them. Timings: host `perf_counter` on CPU; CUDA events on GPU, read by
the sender once they completed. Every hook first tests plain attributes (paused, the guard's set of
switched-off features) so that a disabled or paused agent costs a few attribute reads.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import Any

import torch
from torch import nn

from . import _profile
from ._capacity import device_capacity_mb
from ._config import Config
from ._device import (
    SMALL_ELEMENTS,
    Fingerprinter,
    SquareSums,
    amax_each,
    check_one,
    local,
    read_cuda_memory_mb,
    timing_event,
    transfer,
)
from ._guard import Guard
from ._layout import Layout
from ._records import Chunk, Live, StepRecord
from ._step import (
    Step,
    find_loss,
    first_tensor,
    identity,
    log_one,
    resumed_step,
    valid_name,
    wire_names,
)

logger = logging.getLogger("stepwatch")

STEPS_PER_TRANSFER = 8  # device values of this many steps share one copy to the host
# Rows of the ring: a row is written again this many steps after it was handed out, and a step's values
# are copied out by the transfer at most STEPS_PER_TRANSFER + 2 steps after (pending, done, current).
RING_ROWS = 2 * STEPS_PER_TRANSFER + 2
# Tracked modules' outputs wait for one fused reduction (`Hooks.flush`) until this many calls or
# elements are queued (16 MiB of float32), or the root forward ends: what the agent keeps alive.
FLUSH_CALLS = 128
FLUSH_ELEMENTS = 1 << 22
# On a CPU an output of more elements is checked on its own, at once (`_device.SMALL_ELEMENTS`: a copy
# into a stack would cost more than the dispatch it saves). On CUDA outputs wait (the foreach kernel
# reads each in place) unless one alone fills the queue (FLUSH_ELEMENTS): it would be reduced on its own
# anyway, and the direct check skips the queue's Python (flush, amax_each, no_grad) on the launch thread.
DIRECT_ELEMENTS = SMALL_ELEMENTS
_grad_enabled = torch.is_grad_enabled
_compiling: Callable[[], bool] = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (
    lambda: False
)
_sum = torch.sum
_grad_of = attrgetter("grad")
_DENSE_TYPES = {torch.Tensor}  # the type of every gradient on the fast path (no None, no DTensor)
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


def tracked_modules(model: nn.Module, extra: Sequence[str]) -> dict[str, nn.Module]:
    """The modules whose outputs are checked, by name: every `nn.Linear`, and the modules named in `extra`.
    `nn.MultiheadAttention` applies its `out_proj` through the weight (F.multi_head_attention_forward),
    so that Linear never runs as a module: the attention module is tracked in its place (its output is
    out_proj's)."""
    named = dict(model.named_modules())
    functional = {
        f"{n}.out_proj" if n else "out_proj" for n, m in named.items() if isinstance(m, nn.MultiheadAttention)
    }
    tracked: dict[str, nn.Module] = {
        n: m
        for n, m in named.items()
        if isinstance(m, nn.MultiheadAttention) or (isinstance(m, nn.Linear) and n not in functional)
    }
    tracked.update({n: named[n] for n in extra})
    return tracked


class Ring:
    """Preallocated float32 rows the per-step device values are written into (`out=`), so that the hooks
    allocate as few tensors per step as they can.

    Small tensors made on every step and kept until the transfer sit between the model's large
    activation buffers in the allocator's heap. On a CPU (mlp-wide-batch in bench/agent_overhead.py)
    one small tensor per tracked module and step cost the training thread about 100 extra minor page
    faults per step, which went away with a ring. A row holds one step: item 0 its grad norm. Rows are
    reused after RING_ROWS steps.
    """

    WIDTH = 1

    def __init__(self, device: torch.device) -> None:
        buffer = torch.zeros((RING_ROWS, self.WIDTH), dtype=_f32, device=device)
        self.rows = [tuple(buffer[i].unbind()) for i in range(RING_ROWS)]
        self.next = 0

    def row(self) -> tuple[torch.Tensor, ...]:
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
        self.direct_elements = FLUSH_ELEMENTS - 1 if self.cuda else DIRECT_ELEMENTS
        self._timing_event = timing_event(self.device) if self.cuda else None
        self.capacity_mb = self._capacity_mb()  # read once: the sender adds it to the memory values
        named_params = list(model.named_parameters())
        self._pnames = dict(
            zip((id(p) for _, p in named_params), wire_names([n for n, _ in named_params]), strict=True)
        )
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
        self._square_sums = SquareSums()
        self._step = config.start_step if config.start_step is not None else resumed_step(optimizer)
        self._ring = Ring(self.device)
        self._cur = self._new_step()
        self._done: tuple[Step, int, float, Any, Any] | None = None  # finished step, not yet finalized
        self._pending: list[StepRecord] = []
        self._prev_end_host = _perf()
        self._prev_end = self._mark()
        self._last_transfer = self._prev_end_host
        self._paused = 0
        self._profiling: _profile.Profiling | None = None  # a profile command under way
        self._handles: list[Any] = []
        self._step_fns: list[tuple[Any, str, StepFunction, bool]] = []
        self._bad_names: set[str] = set()
        self._good_names: set[str] = set()
        self._params: list[torch.Tensor] = []
        self._all_key: tuple[int, ...] = ()  # ids of self._params
        self._dense: bool | None = None  # their gradients are not sparse (None: not seen yet)
        self._grad_names: tuple[tuple[int, ...], tuple[str, ...]] = ((), ())
        tracked = tracked_modules(model, config.track)
        self._order = wire_names(list(tracked))  # tracked modules' names as sent; a tap's slot indexes them
        self._taps = [self._tap(slot, module) for slot, module in enumerate(tracked.values())]
        # The root's forward hooks, by name: an integration's step function takes their place (step_function).
        self._root_handles = [
            model.register_forward_pre_hook(_EagerHook(self._on_forward_pre)),
            model.register_forward_hook(_EagerHook(self._on_forward)),
        ]
        self._handles += [
            *self._root_handles,
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

    @property
    def tracked(self) -> tuple[str, ...]:
        return self._order

    def _capacity_mb(self) -> float | None:
        try:
            return device_capacity_mb(self.device)
        except Exception as exc:
            self.guard.fail("memory", exc)
            return None

    def _new_step(self) -> Step:
        return Step(self._sampled(self._step + 1), self._ring.row())

    def _tap(self, slot: int, module: nn.Module) -> tuple[nn.Module, Tap]:
        own = "forward" in module.__dict__  # an instance forward already (another library's wrapper)
        tap = Tap(self, slot, module.forward, own)
        module.forward = tap
        return module, tap

    def _sampled(self, step: int) -> bool:
        """Steps that ship amax and per-parameter grad norms (every `amax_every`-th)."""
        return step % self.config.amax_every == 0

    # -- hooks (training thread) --------------------------------------------------------------------
    def _mark(self) -> Any:
        if self._timing_event is not None:
            event = self._timing_event()
            event.record()
            return event
        return _perf()

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
            if cur.pending:
                self.flush()
            if "loss" not in self._off:
                loss = find_loss(output)
                if loss is not None:
                    if loss.device != self.device:
                        loss = loss.to(self.device, non_blocking=True)
                    cur.loss_sum = loss if cur.loss_sum is None else cur.loss_sum + loss
                    cur.loss_n += 1
        except Exception as exc:
            self.guard.fail("loss", exc)

    def _on_step_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        if "steps" in self._off:
            return None
        # args are step()'s own, the optimizer first: step(closure) gives (optimizer, closure)
        named = "closure" in kwargs
        closure = kwargs["closure"] if named else (args[1] if len(args) > 1 else None)
        if callable(closure):
            # `optimizer.step(closure)` (Lightning, LBFGS): the forward and backward run inside the step,
            # so the step proper begins when the closure returns (its first call).
            wrapped = _AfterClosure(closure, self._step_begins, optimizer)
            if named:
                return args, {**kwargs, "closure": wrapped}
            return (args[0], wrapped, *args[2:]), kwargs
        self._step_begins(optimizer)
        return None

    def _step_begins(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's update begins: its clock starts, the gradients and learning rates are read."""
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
                self._all_key, self._dense = tuple(map(id, params)), None
            grads = list(map(_grad_of, params))  # C loops here and below: ~1000 parameters a step
            owners, key = params, self._all_key
            plain = set(map(type, grads)) == _DENSE_TYPES
            if plain and self._dense is None:
                self._dense = not any(map(attrgetter("is_sparse"), grads))
            if not (plain and self._dense):
                # Some parameter has no gradient this step, a sparse one, or a DTensor (this rank's
                # shard is reduced).
                pairs = [
                    (p, g) for p, g in zip(params, grads, strict=True) if g is not None and not g.is_sparse
                ]
                owners = [p for p, _ in pairs]
                grads = [g if type(g) is torch.Tensor else local(g) for _, g in pairs]
                key = tuple(map(id, owners))
            if not grads:
                return
            # One fused reduction over all gradients (_device.py); float32 so that fp16 squares do not
            # overflow. Per-parameter sums only where they are shipped or weighted.
            cur.hook_names.append("grad_norm")
            if not (cur.sampled or self._copies):
                into = cur.row[0] if cur.row and grads[0].device == self.device else None
                norm = self._square_sums.norm(grads, key, into)
                cur.scalars.append(norm if norm.dtype == _f32 else norm.float())
                return
            squares = self._square_sums(grads, key)
            if cur.row and squares.device == self.device:
                cur.scalars.append(_sum(squares, None, out=cur.row[0]).sqrt_())
            else:
                cur.scalars.append(_sum(squares).sqrt_())
            if self._copies:
                cur.hook_names.append("grad_sumsq")
                cur.scalars.append(torch.dot(squares, self._weights_of(owners, key, squares.device)))
            if cur.sampled:
                cur.grads = (squares.sqrt().to(self.device, non_blocking=True), self._names_of(key))
        except Exception as exc:
            self.guard.fail("grads", exc)

    def _weights_of(
        self, owners: list[torch.Tensor], key: tuple[int, ...], device: torch.device
    ) -> torch.Tensor:
        """1/copies per parameter with a dense gradient this step (made again when that set changes).

        A gradient still `Partial` (each rank holds a part of a sum: a sequence-parallel LayerNorm's
        before its reduction) has no share of the norm that squares can add up: weight 0, said once.
        """
        cached_key, weights = self._weights
        if key != cached_key or weights is None:
            partial = [_is_partial(p.grad) for p in owners]
            values = [
                0.0 if part else 1.0 / self._copies.get(i, 1.0) for i, part in zip(key, partial, strict=True)
            ]
            weights = torch.tensor(values, dtype=torch.float32).to(device)
            self._weights = (key, weights)
            if any(partial) and not self._partial_said:
                self._partial_said = True
                names = [
                    self._pnames.get(id(p), "?") for p, part in zip(owners, partial, strict=True) if part
                ]
                logger.warning(
                    "stepwatch: %d parameters have Partial gradients (%s): left out of grad_sumsq, so the "
                    "global grad norm is the norm without them",
                    len(names), ", ".join(names[:4]) + (", ..." if len(names) > 4 else ""),
                )  # fmt: skip
        return weights

    def _names_of(self, key: tuple[int, ...]) -> tuple[str, ...]:
        """Names of the parameters that have a dense gradient this step (sampled steps only)."""
        if key != self._grad_names[0]:
            names = tuple(self._pnames.get(i, f"param.{k}") for k, i in enumerate(key))
            self._grad_names = (key, names)
        return self._grad_names[1]

    def _on_step_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if "steps" in self._off:
            return
        try:
            if self._cur.pending:
                self.flush()  # outputs queued since the last forward (recomputed in backward)
            cur = self._cur
            end, ts = self._mark(), time.time()
            self._step += 1
            prev_end = self._prev_end
            if self.cuda:
                end_host = _perf()  # the allocator's memory: read once per transfer (transfer())
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
            live = self.live
            live.last_step = self._step
            live.phase = "data"
            if self._profiling is not None or live.profile_request is not None:
                self._profile_step()
        except Exception as exc:
            self.guard.fail("steps", exc)

    def _profile_step(self) -> None:
        """A `profile` command (_profile.py): start tracing at this step's end, or count a traced step. A
        failure here ends the profile (reported as failed), never the step recording it rides on."""
        live = self.live
        profiling, cid, steps = self._profiling, 0, 0
        try:
            if profiling is None:
                assert live.profile_request is not None
                (cid, steps), live.profile_request = live.profile_request, None
                started = _profile.start(cid, steps, self.cuda)
                if isinstance(started, _profile.Finished):
                    live.profile_done = started
                else:
                    self._profiling = started
                return
            finished = _profile.step_ended(profiling)
            if finished is not None:
                self._profiling = None
                live.profile_done = finished
        except Exception as exc:
            self.stop_profiling()
            if profiling is not None:
                cid, steps = profiling.command_id, profiling.steps
            live.profile_done = _profile.Finished(cid, steps, error=f"{type(exc).__name__}: {exc}"[:500])

    def stop_profiling(self) -> None:
        """Stop a profile under way (an error, or the watch closing): the profiler never outlives the agent."""
        profiling, self._profiling = self._profiling, None
        if profiling is not None:
            with contextlib.suppress(Exception):
                profiling.profiler.stop()

    def flush(self) -> None:
        """The queued outputs of tracked modules -> one max |x| per call, in one fused reduction."""
        cur = self._cur
        pending, slots, total = cur.pending, cur.pending_slots, cur.pending_elements
        cur.pending, cur.pending_slots, cur.pending_elements = [], [], 0
        if not pending or "amax" in self._off:
            return
        try:
            cur.amax.append(amax_each(pending, total, cur.sampled))
            cur.calls += slots
        except Exception as exc:
            self.guard.fail("amax", exc)

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
        rec = cur.record(step, ts, self._order)
        every = self._fingerprints
        if every and step % every == 0 and "fingerprint" not in self._off:
            try:
                rec.vectors.append(self._fingerprint.words())
                rec.fingerprint = True
            except Exception as exc:
                self.guard.fail("fingerprint", exc)
        if self.cuda:
            rec.marks = (prev_end, cur.forwards, cur.opt_start, end)
            rec.amax_exact = True  # the CUDA reductions take the max |x| on every step
        self._pending.append(rec)

    def transfer(self) -> None:
        """Hand the finished steps to the sender: one stack + one non-blocking copy to the host."""
        self._last_transfer = _perf()
        self.live.transfer_requested = False
        records, self._pending = self._pending, []
        if records:
            if self.cuda and "memory" not in self._off:
                try:  # on the last step of the chunk: the memory as that step left it
                    records[-1].host.update(read_cuda_memory_mb(self.device))
                except Exception as exc:
                    self.guard.fail("memory", exc)
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

    def identify(self, values: Mapping[str, Any]) -> None:
        """watch.identify(): host values naming the data of the step in progress, or of the next one when
        called between optimizer.step() and its forward (_step.identity)."""
        target = self._cur
        for name, value in values.items():
            kept, problem = identity(name, value)
            if problem is None:
                if target.ids is None:
                    target.ids = {}
                target.ids[name] = kept
                continue
            self.guard.counters.add("rejected_log_values")
            if name not in self._bad_names and len(self._bad_names) < 100:
                self._bad_names.add(name)
                logger.warning("stepwatch: watch.identify(%s=...) ignored: %s (logged once)", name, problem)

    def pause(self, paused: bool) -> None:
        """Entering or leaving a known pause (watch.phase): hand over what is finished."""
        self._paused += 1 if paused else -1
        if paused:
            self._finalize()
            self.transfer()
        elif not self._paused:  # the next step's clock (its data wait, its step time) starts now
            self._prev_end, self._prev_end_host = self._mark(), _perf()

    def drain(self) -> None:
        """At close: hand over every finished step (a profile under way is stopped, unreported)."""
        self.stop_profiling()
        if self._cur.discarded:
            self._end_skipped()
        self._finalize()
        self.transfer()
        cur = self._cur
        if not cur.n_fwd and cur.opt_start is None and (cur.logs or cur.host):
            # Only watch.log() fills a step that never began: values logged after a marked pause had
            # handed the last step over, with no step after them to join.
            names = sorted({*cur.logs, *cur.host})
            logger.warning(
                "stepwatch: %d value(s) logged after step %d were not stored (%s): no step followed them; a "
                "marked pause (watch.phase) hands the step before it over, so log them before the pause",
                len(names), self._step, ", ".join(names[:8]) + (", ..." if len(names) > 8 else ""),
            )  # fmt: skip

    def step_function(self, owner: Any, name: str) -> None:
        """Take `owner.<name>` (a LightningModule's `training_step`, which may call the model's forward or
        not) as the step's forward: its start and end time the forward, its result gives the loss, and the
        root forward hooks give way to it."""
        for handle in self._root_handles:
            handle.remove()
            self._handles.remove(handle)
        self._root_handles = []
        wrapper = StepFunction(self, owner, getattr(owner, name))
        own = name in owner.__dict__  # an instance attribute already: given back at remove()
        setattr(owner, name, wrapper)
        self._step_fns.append((owner, name, wrapper, own))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for owner, name, wrapper, own in self._step_fns:
            wrapper.hooks = None  # inert, wherever it still is
            if owner.__dict__.get(name) is wrapper:
                if own:
                    setattr(owner, name, wrapper.inner)
                else:
                    delattr(owner, name)
        self._step_fns = []
        for module, tap in self._taps:
            tap.hooks = None  # inert, wherever it still is
            if module.__dict__.get("forward") is tap:
                if tap.own:
                    module.forward = tap.inner
                else:
                    del module.forward
        self._taps = []
        if self.optimizer.__dict__.get("zero_grad") == self._on_zero_grad:
            del self.optimizer.zero_grad


class _AfterClosure:
    """An optimizer's closure that calls `begins(optimizer)` after its first evaluation returns."""

    __slots__ = ("begins", "closure", "optimizer")

    def __init__(self, closure: Callable[[], Any], begins: Callable[[Any], None], optimizer: Any) -> None:
        self.closure, self.optimizer = closure, optimizer
        self.begins: Callable[[Any], None] | None = begins

    def __call__(self) -> Any:
        result = self.closure()
        begins, self.begins = self.begins, None
        if begins is not None:
            begins(self.optimizer)
        return result


class StepFunction:
    """What a framework's step function (a LightningModule's `training_step`) becomes under
    `Hooks.step_function`: timed and read for the loss as the model's forward. Copied or pickled as the
    function it wraps, like `Tap`."""

    __slots__ = ("hooks", "inner", "owner")

    def __init__(self, hooks: Hooks | None, owner: Any, inner: Callable[..., Any]) -> None:
        self.hooks, self.owner, self.inner = hooks, owner, inner

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.inner.__reduce_ex__(protocol)

    @property
    def __wrapped__(self) -> Callable[..., Any]:  # what `inspect` and Lightning's is_overridden look through
        return self.inner

    @_eager
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hooks = self.hooks
        if hooks is None:
            return self.inner(*args, **kwargs)
        hooks._on_forward_pre(self.owner, args)
        out = self.inner(*args, **kwargs)
        hooks._on_forward(self.owner, args, out)
        return out


class Tap:
    """What a tracked module's `forward` becomes: the module's own forward, then its output queued on
    the step for one fused max |x| over many modules (`Hooks.flush`).

    An instance attribute, not a forward hook: `nn.Module.__call__` takes its slow path (hook lists,
    global hooks, ~3x the cost of a plain call; bench/README.md, host_cost) for any module with a hook,
    and a model of 500 Linear modules pays that 500 times per step. Here a call costs one Python call
    and two appends. Queued outputs are bounded (`FLUSH_CALLS` calls, `FLUSH_ELEMENTS` elements) and
    released at the end of each root forward, so that no activation outlives the forward by more.
    Inside a torch.compile graph the max is taken per call instead (traced into the graph: no host
    cost, no graph break). A copy of the model (deepcopy, torch.save) gets the module's own forward
    back; `Hooks.remove()` restores it, or leaves the tap inert where someone wrapped it since.
    """

    __slots__ = ("hooks", "inner", "own", "slot")

    def __init__(self, hooks: Hooks | None, slot: int, inner: Callable[..., Any], own: bool) -> None:
        self.hooks, self.slot, self.inner, self.own = hooks, slot, inner, own

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickled as the forward it wraps (a bound method: `getattr(module, "forward")`, the copy's own).
        return self.inner.__reduce_ex__(protocol)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        hooks = self.hooks
        if hooks is None or hooks._paused or not _grad_enabled():
            return out
        off = hooks._off
        if off and ("steps" in off or "amax" in off):
            return out
        try:
            t = out if type(out) is torch.Tensor else first_tensor(out)
            if t is None or not t.is_floating_point():
                return out
            if type(t) is not torch.Tensor:
                t = local(t.detach())  # a DTensor output (tensor parallel): this rank's part
            n = t.numel()
            if not n:
                return out
            cur = hooks._cur
            if _compiling():  # traced into the graph: no host cost there, and no Python state to flush
                cur.calls.append(self.slot)
                cur.amax.append(check_one(t))
                return out
            if n > hooks.direct_elements:
                if cur.pending:
                    hooks.flush()  # the waiting calls first: values stay in call order
                cur.calls.append(self.slot)
                cur.amax.append(check_one(t, cur.sampled))  # a step that ships no amax: a sum will do
                return out
            # Not detached (one op less): the reduction runs under no_grad and only reads it.
            cur.pending.append(t)
            cur.pending_slots.append(self.slot)
            cur.pending_elements += n
            if len(cur.pending) >= FLUSH_CALLS or cur.pending_elements >= FLUSH_ELEMENTS:
                hooks.flush()
        except Exception as exc:
            hooks.guard.fail("amax", exc)
        return out
