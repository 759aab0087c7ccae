"""The detector interface. One module per detector under `detectors/`, listed in `registry.py`.

A detector is streaming and per run: it sees the run's step frames in step order (`on_frame`), and
`on_tick(event_now, wall_now)` between frames for conditions that are about time passing (a hang).
It keeps bounded state (fixed-size windows), raises and resolves anomalies through the run's
`AnomalyBook`, and reads its thresholds from its own frozen settings dataclass (documented in
docs/detection.md), overridable by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.frames import StepFrame


@dataclass(frozen=True)
class DetectorSettings:
    """Base of each detector's settings; subclasses add documented fields with defaults."""


class Detector:
    kind: ClassVar[str]
    Settings: ClassVar[type[DetectorSettings]] = DetectorSettings

    def __init__(self, ctx: RunContext, settings: DetectorSettings) -> None:
        self.ctx = ctx
        self.settings = settings

    def on_frame(self, frame: StepFrame) -> None:
        """Called once per step, in step order."""

    def on_tick(self, event_now: float, wall_now: float) -> None:
        """Called after each batch and periodically: time-driven conditions (event time; wall
        clock only for 'nothing has arrived at all')."""
