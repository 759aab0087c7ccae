"""Hugging Face Trainer: `Trainer(..., callbacks=[StepwatchCallback()])` (README "In a trainer").

The callback attaches the agent to the Trainer's model and optimizer when training begins (the optimizer
exists only then), takes the run name from `run=`, else `TrainingArguments.run_name`, else the agent's own
rules (STEPWATCH_RUN, the SLURM default), marks evaluation and checkpoint saving as known pauses, and
replaces the agent's loss with the one the Trainer computes for the step, without a host-device sync.
Everything else (grad norm, lr, timings, NaN naming, one record per optimizer step under gradient
accumulation) is the agent's, as with `stepwatch.attach()`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .._step import find_loss
from .._watch import Watch
from ._support import Attacher, Pauses, framework_run, require

if TYPE_CHECKING:
    import torch

_transformers = require("transformers", "transformers", (4, 46), "5.25.0")
logger = logging.getLogger("stepwatch")

__all__ = ["StepwatchCallback"]


class StepwatchCallback(_transformers.TrainerCallback):  # type: ignore[name-defined]
    """Watches a `transformers.Trainer`'s training: `Trainer(..., callbacks=[StepwatchCallback()])`.

    Takes `attach()`'s arguments (`run`, `url`, `token` and the options); a bad one raises ValueError here,
    naming it. `watch` is the agent once training has begun (for `watch.log(...)`), else None.
    """

    def __init__(
        self, run: str | None = None, url: str | None = None, token: str | None = None, **options: Any
    ):
        self._attacher = Attacher(run, url, token, options)
        self.watch: Watch | None = None
        self._pauses = Pauses()
        self._hook: Any = None
        self._loss_sum: torch.Tensor | None = None
        self._loss_n = 0
        self._scaled = False
        self._failed = False

    # -- the Trainer's events --------------------------------------------------------------------------
    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kw: Any
    ) -> None:
        if self.watch is not None or model is None or optimizer is None:
            return
        # A bad run name raises here, before the first step, as attach() does in a plain loop.
        run = framework_run(getattr(args, "run_name", None))
        self.watch = self._attacher.attach(model, optimizer, run, int(state.global_step))
        if self.watch.session:  # not a NullWatch (STEPWATCH_DISABLED=1)
            self._hook = model.register_forward_hook(self._on_forward, with_kwargs=True)
        if getattr(args, "eval_on_start", False):
            self._pauses.begin(self.watch, "evaluate")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._pauses.end()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.watch is None or self._failed:
            return
        try:
            if self._loss_sum is not None:
                self.watch.log(loss=self._step_loss(args))
            self._loss_sum, self._loss_n, self._scaled = None, 0, False
        except Exception as exc:
            self._fail(exc)
        # Evaluation and checkpointing run after this event, before the next step begins.
        if control.should_evaluate:
            self._pauses.begin(self.watch, "evaluate")
        elif control.should_save:
            self._pauses.begin(self.watch, "checkpoint")

    def on_evaluate(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._pauses.end()
        # A checkpoint is saved right after the evaluation (with save_strategy="best": maybe).
        best = getattr(args.save_strategy, "value", args.save_strategy) == "best"
        if self.watch is not None and (control.should_save or best):
            self._pauses.begin(self.watch, "checkpoint")

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._pauses.end()

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._pauses.end()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        watch, self.watch = self.watch, None
        if watch is not None:
            watch.close()

    # -- the step's loss --------------------------------------------------------------------------------
    def _on_forward(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        """Each training forward's loss, added on the device (no sync). A model given `num_items_in_batch`
        (the Trainer's count of the step's items, over its micro-batches) has divided by it already."""
        if self._failed or not module.training:
            return
        try:
            import torch

            if not torch.is_grad_enabled():
                return
            loss = find_loss(output)
            if loss is None:
                return
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._loss_n += 1
            self._scaled = kwargs.get("num_items_in_batch") is not None
        except Exception as exc:
            self._fail(exc)

    def _step_loss(self, args: Any) -> torch.Tensor:
        """The loss the Trainer adds up for this rank's step (`training_step`'s results): the micro-batches'
        mean, or their sum when the model divided by the step's item count, times the number of processes
        when those items were counted across them (`average_tokens_across_devices`). The mean over ranks is
        the loss the Trainer logs."""
        assert self._loss_sum is not None
        if not self._scaled:
            return self._loss_sum / self._loss_n
        if getattr(args, "average_tokens_across_devices", False):
            return self._loss_sum * int(args.world_size)
        return self._loss_sum

    # -- failures ----------------------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        """Never raise into the Trainer: the callback's loss stops, said once; the agent goes on."""
        if not self._failed:
            self._failed = True
            logger.warning(
                "stepwatch: the Trainer callback stopped replacing the loss (the agent's own goes on): %r",
                exc,
            )
