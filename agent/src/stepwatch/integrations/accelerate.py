"""Accelerate: `stepwatch.attach(model, optimizer)` after `accelerator.prepare(...)` on every process watches
the training (README "In a trainer"); `Accelerator(log_with=[StepwatchTracker()])` adds what you log.

accelerate starts trackers and hands them values on the main process only, so a tracker cannot be the agent
(which must run on every rank). `StepwatchTracker` forwards the numbers given to `accelerator.log(values)`
to the agent of its process (rank 0's), as `watch.log(**values)`: they belong to the optimizer step that
ended last, and show on the dashboard beside the agent's own.
"""

from __future__ import annotations

import importlib
import logging
import numbers
from typing import Any

from .._watch import _LIVE, Watch
from ._support import require

require("accelerate", "accelerate", (1, 0), "1.16.0")
_GeneralTracker = importlib.import_module("accelerate.tracking").GeneralTracker
logger = logging.getLogger("stepwatch")

__all__ = ["StepwatchTracker"]


class StepwatchTracker(_GeneralTracker):  # type: ignore[misc,valid-type]
    """`Accelerator(log_with=[StepwatchTracker()])`: `accelerator.log({...})` values go to this process's
    agent (`watch`, else the one `stepwatch.attach()` made in this process). Strings and other non-numbers
    are left out (said once)."""

    name = "stepwatch"
    requires_logging_directory = False

    def __init__(self, watch: Watch | None = None) -> None:
        super().__init__()
        self._watch = watch
        self._said: set[str] = set()

    @property
    def tracker(self) -> Watch | None:
        """The agent the values go to (None until `stepwatch.attach()` has run in this process)."""
        if self._watch is not None:
            return self._watch
        live = list(_LIVE)
        if len(live) == 1:
            return live[0]
        if "watch" not in self._said:
            self._said.add("watch")
            logger.warning(
                "stepwatch: StepwatchTracker found %d watches in this process; pass the one to log to: "
                "StepwatchTracker(watch)",
                len(live),
            )
        return None

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        watch = self.tracker
        if watch is None:
            return
        numbers_only = {}
        for key, value in values.items():
            if isinstance(value, numbers.Real) or (hasattr(value, "numel") and value.numel() == 1):
                numbers_only[str(key)] = value
            elif key not in self._said:
                self._said.add(key)
                logger.warning("stepwatch: accelerator.log(%s=...) left out: not a number (said once)", key)
        if numbers_only:
            watch.log(**numbers_only)
