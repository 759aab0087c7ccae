"""How much memory the rank can use (`mem.capacity_mb`), read once at attach.

The collector's memory-leak detector projects the time to out-of-memory from a slope and the capacity
it grows into. On a GPU that is the device's total memory; on a CPU run (memory measured as the host
RSS) it is the memory the process may use: physical RAM, or the container's cgroup limit when smaller.
Both are fixed for the process's lifetime, so they are read once, never per step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

CGROUP_LIMIT_FILES = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2: a number of bytes, or "max"
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1: a huge number when unlimited
)
NO_LIMIT_BYTES = 2**60  # v1 writes ~2**63 (rounded to a page) for "no limit"; no machine has this much
MIB = 2**20


def physical_bytes() -> int | None:
    try:
        n = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None
    return n if n > 0 else None


def cgroup_limit_bytes(files: tuple[Path, ...] = CGROUP_LIMIT_FILES) -> int | None:
    """The first cgroup memory limit that is set (neither "max" nor a huge "unlimited" value)."""
    for path in files:
        try:
            text = path.read_text().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if text.isdigit() and 0 < int(text) < NO_LIMIT_BYTES:
            return int(text)
    return None


def host_capacity_mb(files: tuple[Path, ...] = CGROUP_LIMIT_FILES) -> float | None:
    """MiB of memory available to this process: the smaller of physical RAM and a cgroup limit."""
    known = [n for n in (physical_bytes(), cgroup_limit_bytes(files)) if n is not None]
    return min(known) / MIB if known else None


def device_capacity_mb(device: Any) -> float | None:
    """MiB of memory of `device` (a torch.device): the GPU's total on CUDA, the host's otherwise."""
    if getattr(device, "type", None) == "cuda":
        import torch  # only reached from the collector, which already imported it

        return float(torch.cuda.get_device_properties(device).total_memory) / MIB
    return host_capacity_mb()
