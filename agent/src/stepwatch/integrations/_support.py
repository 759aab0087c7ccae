"""What every integration shares: importing its framework with a clear error, and the run name a framework's
own setting gives."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from .._config import run_chars


def require(module: str, package: str, minimum: tuple[int, ...], tested: str) -> ModuleType:
    """Import `module`, or raise ImportError saying what to install; older than `minimum`: ImportError too."""
    try:
        framework = importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"stepwatch: this integration needs {package} {'.'.join(map(str, minimum))} or newer (tested with "
            f"{tested}), which could not be imported ({exc}); pip install '{package}>={'.'.join(map(str, minimum))}'"
        ) from exc
    version = str(getattr(framework, "__version__", "0"))
    parts = tuple(int(p) if p.isdigit() else 0 for p in version.split(".")[: len(minimum)])
    if parts < minimum:
        raise ImportError(
            f"stepwatch: this integration needs {package} {'.'.join(map(str, minimum))} or newer (tested with "
            f"{tested}); {version} is installed: pip install -U '{package}>={'.'.join(map(str, minimum))}'"
        )
    return framework


def framework_run(name: object) -> str | None:
    """A run name from a framework's setting (`TrainingArguments.run_name`, ...): its characters a run name
    cannot hold become '-'; None when it is unset or nothing is left."""
    if not isinstance(name, str):
        return None
    return run_chars(name)[:200] or None


def torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (accelerate's `AcceleratedOptimizer`, Lightning's
    `LightningOptimizer`, which hold it as `.optimizer`): the one whose `step()` runs the optimizer's hooks."""
    import torch

    for _ in range(8):  # wrappers of wrappers, bounded
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer
