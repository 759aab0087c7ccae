"""Every detector, in the order they see each frame. Add a detector here and in docs/detection.md."""

from __future__ import annotations

from stepwatch_server.detect.base import Detector

DETECTORS: list[type[Detector]] = []
