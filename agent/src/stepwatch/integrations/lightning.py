"""Lightning: `Trainer(..., callbacks=[StepwatchCallback(run="my-run")])` (README "In a trainer").

The callback attaches the agent to the LightningModule and its (first) optimizer when training starts, and
times the module's `training_step` as the forward (a `training_step` often calls `self.net(x)`, not
`self(x)`; its result gives the loss). Lightning runs the forward and backward inside
`optimizer.step(closure)`, which the agent follows (the update starts when the closure returns), so each
record holds its own step's loss and grad norm, in automatic and manual optimisation. Validation and
checkpoint saving are marked as pauses. Everything else is the agent's, as with `stepwatch.attach()`.
"""

from __future__ import annotations

import importlib
from typing import Any

from .._watch import Watch
from ._support import Attacher, Pauses, require

try:  # the unified package (`lightning`) first, then the standalone `pytorch_lightning`
    importlib.import_module("lightning.pytorch")
    _pl = require("lightning.pytorch", "lightning", (2, 0), "2.6.6")
except ImportError:
    _pl = require("pytorch_lightning", "lightning", (2, 0), "2.6.6")

__all__ = ["StepwatchCallback"]


class StepwatchCallback(_pl.Callback):  # type: ignore[name-defined]
    """Watches a Lightning `Trainer`'s fit: `Trainer(..., callbacks=[StepwatchCallback(run="my-run")])`.

    Takes `attach()`'s arguments (`run`, `url`, `token` and the options); a bad one raises ValueError here,
    naming it. `watch` is the agent while training runs (for `watch.log(...)` in `training_step`), else None.
    """

    def __init__(
        self, run: str | None = None, url: str | None = None, token: str | None = None, **options: Any
    ):
        self._attacher = Attacher(run, url, token, options)
        self.watch: Watch | None = None
        self._pauses = Pauses()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.watch is not None or not trainer.optimizers:
            return
        optimizer = trainer.optimizers[0]
        self.watch = self._attacher.attach(pl_module, optimizer, None, int(trainer.global_step))
        if pl_module.automatic_optimization:
            # Manual optimisation steps the optimizer inside training_step: there the module's own forward
            # (`self(x)`) is the forward, and `watch.log(loss=...)` after `opt.step()` gives the loss.
            self.watch._step_function(pl_module, "training_step")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._pauses.end()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._pauses.begin(self.watch, "validate")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._pauses.end()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # Called as the checkpoint is assembled, before it is written; over at the next batch's start.
        self._pauses.begin(self.watch, "checkpoint")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._pauses.end()
        watch, self.watch = self.watch, None
        if watch is not None:
            watch.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)
