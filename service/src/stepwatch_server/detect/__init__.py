"""Streaming anomaly detection over ingested batches (docs/detection.md)."""

from stepwatch_server.detect.anomalies import KINDS, Anomaly, AnomalyBook
from stepwatch_server.detect.engine import DetectionEngine, EngineSettings
from stepwatch_server.detect.frames import Aligner, StepFrame

__all__ = ["KINDS", "Aligner", "Anomaly", "AnomalyBook", "DetectionEngine", "EngineSettings", "StepFrame"]
