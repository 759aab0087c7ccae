"""Device-side helpers: fused reductions over many tensors, the host transfer, the parameter fingerprint."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ._records import Chunk, StepRecord

# Same-size integer view of a parameter's bytes, by element size.
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_F32 = torch.float32
MIB = 2**20
# On a CPU, tensors up to this many elements in all are copied into one buffer and reduced per tensor
# by one `segment_reduce`: `torch._foreach_norm` there is a loop of one dispatched op per tensor
# (bench/README.md, host_cost). Beyond it (or on any other device: one fused kernel on CUDA) the
# foreach op; the copy would cost memory, and big tensors' own compute outweighs a dispatch.
FLAT_MAX_ELEMENTS = 1 << 20
# A CPU tensor of more elements is reduced by itself, never copied: the copy costs more memory traffic
# than the dispatch it saves (two passes more than a reduction, about 0.5 ns an element here, against
# ~3-10 us a dispatch; measured on 96 x 256 outputs: stacked 11.4 us each, alone 7-14 us).
SMALL_ELEMENTS = 4096
# Up to this many small CPU tensors in all (a model of a dozen layers' weights and biases), one flat copy
# and one reduction: `_flatten_dense_tensors` costs ~3 us + ~0.6 us a tensor here, a stack per shape
# and a reduction per stack ~24 us + ~0.14 us a tensor (bench/README.md, host cost); they cross near 44.
FLAT_TENSORS = 32
_flatten = torch._utils._flatten_dense_tensors
_segment_reduce = torch.segment_reduce
_foreach_norm = torch._foreach_norm
_vector_norm = torch.linalg.vector_norm
_numel = torch.Tensor.numel


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2, TP); any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _small_on_cpu(tensors: list[torch.Tensor], total: int | None = None) -> bool:
    """More than one tensor, on a CPU, small enough in all to copy. Dtypes may differ (a stack or a flat
    copy promotes them); a tensor on another device makes the copy raise RuntimeError, and the callers
    fall back to the foreach op (per-tensor checks would cost ~0.3 us a tensor on every call)."""
    if len(tensors) < 2 or not tensors[0].is_cpu:
        return False
    return (total if total is not None else sum(map(_numel, tensors))) <= FLAT_MAX_ELEMENTS


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == _F32 else t.to(_F32)


def _foreach_norms(tensors: list[torch.Tensor], ord: float) -> torch.Tensor:
    """Per-tensor norms by the foreach op, computed in float32 (float64 when a tensor is: no narrowing
    cast is allowed there), returned as float32."""
    wide = any(t.dtype == torch.float64 for t in tensors)
    return _f32(torch.stack(_foreach_norm(tensors, ord, dtype=torch.float64 if wide else _F32)))


def check_one(t: torch.Tensor, amax: bool = True) -> torch.Tensor:
    """One tensor's check as a 1-element float32 vector, in one or two kernels: its max |x| when `amax`,
    else a value that is non-finite exactly when an element is (NaN kept either way). On a CPU that
    value is the float32 sum (~7 us on 24k elements, where `vector_norm(inf)` takes ~90 us there), which
    also overflows when the elements add up beyond ~3e38; the max |x| is abs + amax there."""
    t = t.detach()
    if t.is_cpu:
        if amax:
            return _f32(t.abs().amax().reshape(1))
        return _f32(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else _F32).reshape(1))
    wide = torch.float64 if t.dtype == torch.float64 else _F32
    return _f32(torch.linalg.vector_norm(t, math.inf, dtype=wide).reshape(1))


def amax_each(tensors: list[torch.Tensor], total: int | None = None, amax: bool = True) -> torch.Tensor:
    """max |x| of each tensor (non-empty, floating; `total` their elements when known), float32, shape
    (len(tensors),). NaN propagates: max over a NaN is NaN (CPU amax, segment_reduce and vector_norm;
    CUDA's fused foreach kernel takes `max_propagate_nan`). Never writes into the tensors.

    `amax=False` (a step that ships no amax, only non-finite flags): where the tensors are stacked on a
    CPU, each one's sum instead, which is non-finite exactly when an element is (as `check_one`'s), one
    op fewer; the other paths give the max |x| all the same."""
    with torch.no_grad():
        n = len(tensors)
        if n == 1:  # a flush of one big output: one kernel, as a per-module check would be
            return check_one(tensors[0], amax)
        if total is None:
            total = sum(map(_numel, tensors))
        if _small_on_cpu(tensors, total):
            try:
                first = tensors[0]
                if total == n * first.numel():  # equal sizes (consecutive layers' outputs, often)
                    try:
                        return _stacked_each(torch.stack(tensors), first.dim(), amax)
                    except RuntimeError:  # equal sizes, different shapes: the flat copy below
                        pass
                flat = _flatten(tensors).abs_()  # a fresh buffer (more than one tensor): in place is safe
                lengths = torch.tensor(list(map(_numel, tensors)))
                return _f32(_segment_reduce(flat, "max", lengths=lengths))
            except RuntimeError:  # not all on the CPU
                pass
        return _foreach_norms(tensors, math.inf)


def _stacked_each(stacked: torch.Tensor, dim: int, amax: bool) -> torch.Tensor:
    """Per-row max |x| (or sum, `amax=False`) of a stack of `dim`-dimensional tensors, a fresh copy."""
    if not dim:  # 0-dim tensors: the stack is the values
        return _f32(stacked.abs_() if amax else stacked)
    dims = tuple(range(1, dim + 1))  # all but the first dim
    if amax:
        return _f32(stacked.abs_().amax(dims))
    return _f32(stacked.sum(dims, dtype=_wide_of(stacked)))


def _wide_of(t: torch.Tensor) -> torch.dtype:
    """float64 for a float64 tensor, else float32: the dtype a check sums in (half precision would
    overflow where the values do not)."""
    return torch.float64 if t.dtype == torch.float64 else _F32


class SquareSums:
    """The squared L2 norm of each tensor of a list (gradients), float32, shape (len,), in a few fused
    ops. `key` names the list's tensors (the ids of their parameters); the plan for it is made again
    only when the key changes.

    On a CPU, up to FLAT_TENSORS tensors that are all small (SMALL_ELEMENTS or fewer) are copied into one
    flat buffer (reduced by one `segment_reduce`, or one norm); more of them, small tensors of one shape
    are stacked (one copy, ~0.3 us a tensor here, a third of `_flatten_dense_tensors`), squared and
    summed per row; with more shapes than a quarter of them, one flat copy and one `segment_reduce`;
    bigger tensors, and every tensor elsewhere, by the foreach norm (one fused kernel on CUDA). The
    parts are put back in list order."""

    def __init__(self) -> None:
        self._key: tuple[int, ...] | None = None
        self._parts: list[tuple[str, list[int]]] = []  # ("stack" | "flat" | "each", indices)
        self._lengths: torch.Tensor | None = None  # the "flat" part's segment lengths
        self._order: torch.Tensor | None = None  # parts' order -> list order (None: the same)

    def _plan(self, tensors: list[torch.Tensor], key: tuple[int, ...]) -> None:
        self._key, self._lengths = key, None
        every = list(range(len(tensors)))
        small = [i for i in every if tensors[i].numel() <= SMALL_ELEMENTS] if tensors[0].is_cpu else []
        if len(small) < 2:
            self._parts, self._order = [("each", every)], None
            return
        by_shape: dict[torch.Size, list[int]] = {}
        for i in small:
            by_shape.setdefault(tensors[i].shape, []).append(i)
        few = len(small) == len(every) <= FLAT_TENSORS
        if few or len(by_shape) > max(1, len(small) // 4):
            parts = [("flat", small)]
            self._lengths = torch.tensor([tensors[i].numel() for i in small])
        else:
            parts = [("stack", group) for group in by_shape.values()]
        taken = set(small)
        big = [i for i in every if i not in taken]
        if big:
            parts.append(("each", big))
        self._parts = parts
        placed = [i for _, indices in parts for i in indices]
        self._order = None if placed == every else torch.tensor(placed).argsort()

    def __call__(self, tensors: list[torch.Tensor], key: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            sums = self._each_part(tensors, key, self._part)
            out = sums[0] if len(sums) == 1 else torch.cat(sums)
            return _f32(out if self._order is None else out.index_select(0, self._order))

    def norm(
        self, tensors: list[torch.Tensor], key: tuple[int, ...], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The L2 norm of all the tensors together, 0-dim float32 (or float64), into `out` when given
        (a float32 0-dim tensor on their device): the same plan, without the per-tensor sums a step
        that ships no per-parameter norms does not need. One `vector_norm` per part and, for two parts
        (weights and biases), one `hypot`: three dispatches fewer than a `dot` per part (each after a
        `view`), their sum and a `sqrt`, a fixed cost of every step."""
        with torch.no_grad():
            if key != self._key:
                self._plan(tensors, key)  # so that `_each_part` below finds the plan made
            if out is not None and len(self._parts) == 1 and self._parts[0][0] == "flat":
                try:  # one flat copy, its norm written into `out`: two dispatches in all
                    joined = _flatten(tensors)
                    if joined.dtype != torch.float64:
                        return _vector_norm(joined, dtype=_F32, out=out)
                    return out.copy_(_vector_norm(joined))
                except RuntimeError:  # not all on the CPU: the plan below falls back
                    pass
            norms = self._each_part(tensors, key, self._part_norm)
            if len(norms) == 2 and norms[0].dtype == norms[1].dtype:
                return torch.hypot(norms[0], norms[1], out=out) if out is not None else torch.hypot(*norms)
            one = norms[0] if len(norms) == 1 else _vector_norm(torch.stack([_f32(n) for n in norms]))
            return out.copy_(one) if out is not None else one

    def _each_part(
        self,
        tensors: list[torch.Tensor],
        key: tuple[int, ...],
        part: Callable[[str, list[torch.Tensor]], torch.Tensor],
    ) -> list[torch.Tensor]:
        """`part` of each part of the plan for `key` (made again only when the key changes)."""
        if key != self._key:
            self._plan(tensors, key)  # a key's tensors keep their shapes, dtype and device
        try:
            return [part(kind, [tensors[i] for i in indices]) for kind, indices in self._parts]
        except RuntimeError:  # not all on the CPU: the foreach op for all of them from now on
            self._parts, self._order = [("each", list(range(len(tensors))))], None
            return [part("each", tensors)]

    def _part_norm(self, kind: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        if kind == "each":
            return _vector_norm(_foreach_norms(tensors, 2))
        joined = _flatten(tensors) if kind == "flat" else torch.stack(tensors)
        return _vector_norm(joined, dtype=None if joined.dtype in (_F32, torch.float64) else _F32)

    def _part(self, kind: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        if kind == "each":
            norms = _foreach_norms(tensors, 2)
            return norms.mul_(norms)
        if kind == "flat":  # two or more tensors: a fresh buffer, squared in place
            flat = _wide(_flatten(tensors))
            return _segment_reduce(flat.mul_(flat), "sum", lengths=self._lengths)
        rows = _wide(torch.stack(tensors).view(len(tensors), -1))  # a fresh copy
        return rows.mul_(rows).sum(1)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """float32 or float64 as it is; half precision in float32 (its squares would overflow)."""
    return t if t.dtype in (_F32, torch.float64) else t.to(_F32)


def cuda_memory_mb(stats: Mapping[str, Any]) -> dict[str, float]:
    """The caching allocator's memory in MiB from `torch.cuda.memory_stats_as_nested_dict()`: what is
    allocated now, what it reserved from the device, the peak allocated (since the last reset)."""
    allocated, reserved = stats["allocated_bytes"]["all"], stats["reserved_bytes"]["all"]
    return {
        "mem.allocated_mb": allocated["current"] / MIB,
        "mem.reserved_mb": reserved["current"] / MIB,
        "mem.peak_mb": allocated["peak"] / MIB,
    }


def timing_event(device: torch.device) -> Callable[[], Any]:
    """A maker of the timing events that mark a CUDA step's phases, each recorded on the current stream
    by `.record()`. `torch.Event` records in C++; `torch.cuda.Event.record()` builds a Python `Stream`
    for the current stream on every call (`torch.cuda.current_stream()`), four times a step on the thread
    that launches the kernels. Both give `elapsed_time` in ms."""
    event = getattr(torch, "Event", None)
    if event is not None:
        try:
            event(device=device, enable_timing=True)
            return lambda: event(device=device, enable_timing=True)
        except (TypeError, RuntimeError):  # an older signature, or this device's events unsupported
            pass
    return lambda: torch.cuda.Event(enable_timing=True)


def read_cuda_memory_mb(device: torch.device) -> dict[str, float]:
    """One read of the allocator's statistics (host memory only, no sync). Read once per transfer:
    `torch.cuda.memory_allocated()` and its siblings each build and flatten the whole statistics
    dict (hundreds of keys), three of them every step were a cost on the thread that launches the
    kernels."""
    return cuda_memory_mb(torch.cuda.memory_stats_as_nested_dict(device))


def transfer(records: list[StepRecord], cuda: bool) -> Chunk:
    """Pack the records' device values into one tensor and start one copy to host memory; no sync.

    The 0-dim scalars of all steps go through one `torch.stack` (cheaper than a `reshape(1)` per
    value and a `cat`), the few 1-dim vectors (sampled grad norms, fingerprints) follow them.
    """
    scalars: list[torch.Tensor] = []
    vectors: list[torch.Tensor] = []
    for rec in records:
        rec.offset = len(scalars)
        scalars += rec.scalars
        rec.scalars = []
    offset = len(scalars)
    for rec in records:
        rec.voffset = offset
        for v in rec.vectors:
            offset += v.numel()
            vectors.append(v)
        rec.vectors = []
    values = torch.stack(scalars) if scalars else None
    if vectors:
        values = torch.cat([values, *vectors] if values is not None else vectors)
    if not cuda:
        return Chunk(records, values)
    host = None
    if values is not None:
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()  # the sender reads `host` and the timing events once this event has completed
    return Chunk(records, host, ready)


class Fingerprinter:
    """A deterministic checksum of all parameters, bit-identical on replicas that hold the same values.

    Each parameter's bytes are read as integers of its element size and summed in int64 (integer sums
    wrap and are associative, so the result does not depend on reduction order, kernel or device);
    the per-parameter sums are combined with odd weights by position, so swapped parameters differ.
    """

    def __init__(self, model: nn.Module) -> None:
        self._params = list(model.parameters())
        self._weights: torch.Tensor | None = None
        device = self._params[0].device if self._params else torch.device("cpu")
        # Made once here: a tensor built from a Python list on a GPU is a synchronous copy.
        self._shifts = torch.tensor([0, 16, 32, 48], dtype=torch.int64).to(device)

    def words(self) -> torch.Tensor:
        """The 64-bit checksum as four 16-bit words in float32 (exact), shape (4,)."""
        sums = []
        for p in self._params:
            t = local(p.detach())
            flat = t.reshape(-1)
            if flat.is_complex():
                flat = torch.view_as_real(flat).reshape(-1)
            sums.append(flat.view(_INT_VIEW[flat.element_size()]).sum(dtype=torch.int64))
        if not sums:
            raise ValueError("the model has no parameters to fingerprint")
        stacked = torch.stack(sums)
        if self._weights is None or self._weights.numel() != stacked.numel():
            self._weights = torch.arange(1, 2 * stacked.numel(), 2, dtype=torch.int64, device=stacked.device)
        total = (stacked * self._weights).sum()
        return torch.bitwise_and(torch.bitwise_right_shift(total, self._shifts), 0xFFFF).to(torch.float32)
