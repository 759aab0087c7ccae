"""Device-side helpers: the host transfer and the parameter fingerprint."""

from __future__ import annotations

import torch
from torch import nn

from ._records import Chunk, StepRecord

# Same-size integer view of a parameter's bytes, by element size.
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2, TP); any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


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
