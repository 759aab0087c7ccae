"""Every detector, in the order they see each frame. Add a detector here and in docs/detection.md."""

from __future__ import annotations

from stepwatch_server.detect.base import Detector
from stepwatch_server.detect.detectors.divergence import DivergenceDetector
from stepwatch_server.detect.detectors.fp8_overflow import Fp8OverflowDetector
from stepwatch_server.detect.detectors.hang import HangDetector
from stepwatch_server.detect.detectors.loss_spike import LossSpikeDetector
from stepwatch_server.detect.detectors.memory_leak import MemoryLeakDetector
from stepwatch_server.detect.detectors.nonfinite import NonFiniteDetector
from stepwatch_server.detect.detectors.replica_divergence import ReplicaDivergenceDetector
from stepwatch_server.detect.detectors.slow_node import SlowNodeDetector
from stepwatch_server.detect.detectors.straggler import StragglerDetector
from stepwatch_server.detect.detectors.throughput_drop import ThroughputDropDetector

DETECTORS: list[type[Detector]] = [
    NonFiniteDetector,
    LossSpikeDetector,
    DivergenceDetector,
    StragglerDetector,
    SlowNodeDetector,
    ThroughputDropDetector,
    HangDetector,
    MemoryLeakDetector,
    ReplicaDivergenceDetector,
    Fp8OverflowDetector,
]
