"""`nonfinite`: NaN or Inf in a rank's loss, gradients or tracked activations.

Why it matters: one NaN that reaches the optimizer poisons every parameter it touches, and in
data-parallel training the gradient all-reduce spreads it to every replica on the same step. A
grad scaler or a skip-non-finite guard may skip the step, but a model that produces NaN once
usually does it again (a bad sample, an overflowing layer, a broken GPU), and the person who can fix
it needs to know which rank and which layer started it, on the step it happened.

Signal (per step, all ranks at once): the agent's `nonfinite.loss`, `nonfinite.grads` and
`nonfinite.activations` flags (and the agent's `nonfinite` events), plus a loss value that is +-Inf;
a NaN loss counts only from a sender without flags that reported a finite loss before (in a frame
NaN also means "not reported"). The first module comes from the
rank's `nonfinite` event at that step (`data.module`, `data.where`); without one, from the first
tracked tensor whose amax is non-finite on that rank.

Blame (the physics of the all-reduce): after the gradient all-reduce every rank's gradients are
non-finite, so the grads flag alone does not say who. The culprits are the ranks whose loss or
activations were non-finite; only when no rank has those (an overflow in backward) is it the grads,
and when (nearly) every rank has them the anomaly is the run's, with no rank blamed.

Evidence: `ranks` (culprits, first `MAX_RANKS_LISTED`), `n_ranks`, `where` (loss / activations /
grads), `module`, `grads_ranks` (how many ranks had non-finite gradients), `steps` (non-finite steps
while open).

Defaults: raised on the step itself (time-to-detect 0: there is nothing to wait for, a NaN is never
noise). Critical when the loss or activations are non-finite, or when gradients overflow on
`grads_critical_steps` steps in a row; a single-step gradient overflow with finite loss is what
dynamic loss scaling (fp16 AMP) does routinely, so it is a warning. A step the grad scaler skipped
(`optimizer.skipped` = 1 on the ranks with non-finite gradients, finite loss and activations) is no
anomaly at all: the overflow the scaler exists for. `grads_critical_steps` skipped steps in a row are one
run-level warning, the loss scale collapsing (evidence `skipped_steps`). Resolved after `clear_steps`
clean steps (20: a NaN stretch that resumes after a few skipped steps is the same problem).
At most `max_rank_anomalies` culprit ranks get an anomaly each (their health turns critical); more
culprits than that is a run-wide failure, reported once for the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from stepwatch_server.detect.base import Detector, DetectorSettings
from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.frames import StepFrame

KIND = "nonfinite"
RUN_KEY = "run"
MAX_RANKS_LISTED = 16  # culprit ranks listed in evidence and summaries


@dataclass(frozen=True)
class NonFiniteSettings(DetectorSettings):
    clear_steps: int = 20  # clean steps (frames) before an open anomaly resolves
    grads_critical_steps: int = 3  # consecutive gradient-only overflows that are no longer AMP routine
    max_rank_anomalies: int = 8  # culprits beyond this many are one run-wide anomaly
    all_ranks_fraction: float = 0.9  # culprits covering this share of the ranks: run-wide


# Per-rank state: the fill of a rank heard from later (-1: set to the frames seen, as if it had a row then).
PER_RANK = {"_had_loss": False, "_clean": -1}


class NonFiniteDetector(Detector):
    kind: ClassVar[str] = KIND
    Settings: ClassVar[type[DetectorSettings]] = NonFiniteSettings

    def __init__(self, ctx: RunContext, settings: DetectorSettings) -> None:
        super().__init__(ctx, settings)
        self.s: NonFiniteSettings = settings  # type: ignore[assignment]
        n = ctx.n_ranks
        self._rows = ctx.ranks  # the rank numbers of the per-rank arrays' rows
        self._had_loss = np.zeros(n, dtype=bool)  # the rank has reported a finite loss before
        self._clean = np.zeros(n, dtype=np.int64)  # per rank: clean frames since the last bad one
        self._clean_run = 0  # ... for the run-wide anomaly
        self._frames = 0  # frames seen: the clean count of a rank never bad (or not heard from yet)
        self._grads_streak = 0  # gradient-only overflows in a row that the optimizer still applied
        self._skip_streak = 0  # steps in a row the grad scaler skipped
        self._modules: dict[str, str | None] = {}  # open key -> first module seen (events come once)
        self._contexts: dict[str, dict[str, Any]] = {}  # open key -> the first step's context (its event)
        self._steps: dict[str, int] = {}  # open key -> non-finite steps while open

    # -- per step ----------------------------------------------------------------------------------
    def on_frame(self, frame: StepFrame) -> None:
        self._rows = self.ctx.carry(self, PER_RANK, self._rows)
        self._clean[self._clean < 0] = self._frames
        n = frame.world_size
        loss = frame.metrics.get("loss")
        bad_loss = self._flag(frame, "nonfinite.loss")
        if loss is not None:
            bad_loss |= np.isinf(loss)
            if "nonfinite.loss" not in frame.metrics:  # no flags sent: a NaN from a rank that had a loss
                bad_loss |= np.isnan(loss) & frame.present & self._had_loss
            self._had_loss |= np.isfinite(loss)
        bad_act = self._flag(frame, "nonfinite.activations")
        bad_grads = self._flag(frame, "nonfinite.grads")
        grad_norm = frame.metrics.get("grad_norm")
        if grad_norm is not None:
            bad_grads |= np.isinf(grad_norm)
        events = {r: e.data for r, e in frame.events if e.kind == KIND and isinstance(e.data, dict)}
        for r, data in events.items():  # the agent's event is a flag too
            where = data.get("where") or []
            bad_loss[r] |= "loss" in where
            bad_act[r] |= "activations" in where
            bad_grads[r] |= "grads" in where

        culprits = np.flatnonzero(bad_loss | bad_act)
        grads_only = culprits.size == 0
        if grads_only:
            culprits = np.flatnonzero(bad_grads)
        # A step the grad scaler skipped (the agent's `optimizer.skipped`): the overflow it exists for.
        skipped = (
            grads_only and culprits.size > 0 and bool(self._flag(frame, "optimizer.skipped")[culprits].all())
        )
        self._skip_streak = self._skip_streak + 1 if skipped else 0
        self._grads_streak = self._grads_streak + 1 if grads_only and culprits.size and not skipped else 0
        if skipped and self._skip_streak < self.s.grads_critical_steps:
            culprits = culprits[:0]  # routine: the scale comes down and training goes on

        bad_keys: set[str] = set()
        if culprits.size:
            run_wide = (
                skipped
                or culprits.size > self.s.max_rank_anomalies
                or (culprits.size >= self.s.all_ranks_fraction * n and n > 1)
            )
            keys = [RUN_KEY] if run_wide else [f"rank:{r}" for r in self.ctx.ranks[culprits].tolist()]
            for key in keys:
                self._raise(frame, key, culprits, bad_loss, bad_act, bad_grads, events, grads_only)
            bad_keys.update(keys)
        self._resolve_cleared(frame, bad_keys)

    def _flag(self, frame: StepFrame, name: str) -> np.ndarray:
        col = frame.metrics.get(name)
        if col is None:
            return np.zeros(frame.world_size, dtype=bool)
        return np.nan_to_num(col, nan=0.0) != 0

    # -- anomalies ---------------------------------------------------------------------------------
    def _raise(
        self,
        frame: StepFrame,
        key: str,
        culprits: np.ndarray,
        bad_loss: np.ndarray,
        bad_act: np.ndarray,
        bad_grads: np.ndarray,
        events: dict[int, dict[str, Any]],
        grads_only: bool,
    ) -> None:
        rank = self.ctx.row_of(int(key.split(":")[1])) if key != RUN_KEY else None  # its row
        mine = culprits if rank is None else np.array([rank])
        module = self._modules.get(key) or self._first_module(frame, mine, events)
        if not self._contexts.get(key):  # the first step's, kept while the anomaly lasts (events come once)
            self._contexts[key] = self._first_step_context(mine, events)
        where = [
            w
            for w, flags in (("activations", bad_act), ("loss", bad_loss), ("grads", bad_grads))
            if flags[mine].any()
        ]
        self._modules[key] = module
        self._steps[key] = self._steps.get(key, 0) + 1
        n_grads = int(bad_grads.sum())
        collapsing = grads_only and self._skip_streak >= self.s.grads_critical_steps
        critical = not collapsing and (not grads_only or self._grads_streak >= self.s.grads_critical_steps)
        listed = self.ctx.ranks[culprits[:MAX_RANKS_LISTED]].tolist()
        evidence: dict[str, Any] = {
            "ranks": listed,
            "n_ranks": int(culprits.size),
            "where": where,
            "module": module,
            "grads_ranks": n_grads,
            "steps": self._steps[key],
            "step": frame.step,
            "skipped_steps": self._skip_streak,
            **self._contexts[key],
        }
        summary = self._summary(frame, rank, culprits, where, module, n_grads, grads_only)
        if collapsing:
            summary = (
                f"the grad scaler skipped {self._skip_streak} optimizer steps in a row (gradients overflow, loss "
                f"and activations finite): the loss scale is collapsing, training makes no progress"
            )
        self.ctx.book.raise_(
            KIND,
            key,
            step=frame.step,
            ts=frame.ts,
            severity="critical" if critical else "warning",
            summary=summary,
            evidence=evidence,
            rank=None if rank is None else self.ctx.rank_of(rank),
            node=self.ctx.node[rank] if rank is not None else None,
        )
        if rank is None:
            self._clean_run = 0
        else:
            self._clean[rank] = 0

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A snapshot of the bus (bus/worker.py) pickled before `_contexts` existed unpickles with it."""
        self.__dict__.update(state)
        self.__dict__.setdefault("_contexts", {})

    def _first_step_context(self, ranks: np.ndarray, events: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """What the first culprit's agent knew of the first non-finite step (its event, docs/ingest.md):
        the first module's input and output max |x| (`input_amax`, `output_amax`) and the values naming
        the step's data (`data_ids`, from `watch.identify()`)."""
        for r in ranks.tolist():
            data = events.get(r)
            if not data:
                continue
            context: dict[str, Any] = {}
            for name in ("input_amax", "output_amax"):
                if name in data:
                    context[f"first_module_{name}"] = data[name]
            if isinstance(data.get("ids"), dict):
                context["data_ids"] = data["ids"]
            if context:
                return context
        return {}

    def _first_module(
        self, frame: StepFrame, ranks: np.ndarray, events: dict[int, dict[str, Any]]
    ) -> str | None:
        for r in ranks.tolist():
            module = events.get(r, {}).get("module")
            if module:
                return str(module)
        amax = frame.tensors.get("amax", {})  # sampled steps, modules in model order
        for r in ranks.tolist():
            if not any(np.isfinite(v[r]) for v in amax.values()):
                continue  # NaN everywhere: this rank shipped no tensors at this step
            for name, values in amax.items():
                if not np.isfinite(values[r]):
                    return name
        return None

    def _summary(
        self,
        frame: StepFrame,
        rank: int | None,
        culprits: np.ndarray,
        where: list[str],
        module: str | None,
        n_grads: int,
        grads_only: bool,
    ) -> str:
        n = frame.world_size
        if rank is not None:
            who = self.ctx.where(rank)
            others = self.ctx.ranks[culprits[culprits != rank][:MAX_RANKS_LISTED]].tolist()
            also = (
                f" (also rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})"
                if others
                else ""
            )
        else:
            who = f"{culprits.size} of {n} ranks" if culprits.size < n else f"all {n} ranks"
            also = ""
        what = "/".join(where) or "values"
        first = f", first in {module}" if module else ""
        spread = ""
        if not grads_only and n_grads:
            spread = f"; gradients non-finite on {n_grads} of {n} ranks after the all-reduce"
        hint = " (gradient overflow: loss and activations finite)" if grads_only else ""
        anomaly = self.ctx.book.get(KIND, f"rank:{self.ctx.rank_of(rank)}" if rank is not None else RUN_KEY)
        when = f"at step {frame.step}"
        if anomaly is not None and anomaly.first_step != frame.step:
            steps = self._steps.get(anomaly.key, 0)
            when = f"since step {anomaly.first_step} ({steps} non-finite steps, latest {frame.step})"
        return f"{who}: NaN/Inf in {what}{first} {when}{also}{spread}{hint}"

    def _resolve_cleared(self, frame: StepFrame, bad_keys: set[str]) -> None:
        self._clean += 1
        self._clean_run += 1
        self._frames += 1
        for anomaly in self.ctx.book.open_of(KIND):
            if anomaly.key in bad_keys:
                continue
            row = None if anomaly.rank is None else self.ctx.row_of(anomaly.rank)
            clean = (
                self._clean_run if anomaly.rank is None else self._frames if row is None else self._clean[row]
            )
            if clean >= self.s.clear_steps:
                self.ctx.book.resolve(
                    KIND, anomaly.key, step=frame.step, ts=frame.ts,
                    note=f"finite again for {self.s.clear_steps} steps",
                )  # fmt: skip
                self._modules.pop(anomaly.key, None)
                self._contexts.pop(anomaly.key, None)
                self._steps.pop(anomaly.key, None)
