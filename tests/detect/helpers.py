"""Running simulator scenarios through the real validation and the detection engine (no HTTP)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from stepwatch_server.detect import Anomaly, DetectionEngine, EngineSettings
from stepwatch_server.ingest.validate import parse_batch
from stepwatch_server.simulate import SCENARIOS, Scenario, Simulation


def scenario(name: str, **changes: Any) -> Scenario:
    return dataclasses.replace(SCENARIOS[name], **changes) if changes else SCENARIOS[name]


def run_scenario(
    sc: Scenario, kinds: tuple[str, ...] | None = None, **overrides: dict[str, Any]
) -> tuple[Simulation, list[Anomaly]]:
    """Feed every batch of `sc` (validated exactly as ingest does) to a fresh engine; return every
    anomaly as last seen, in the order first raised."""
    sim = Simulation(sc)
    return sim, detect_docs(sim, kinds, **overrides)[1]


def detect_docs(
    sim: Iterable[dict[str, Any]], kinds: tuple[str, ...] | None = None, **overrides: dict[str, Any]
) -> tuple[DetectionEngine, list[Anomaly]]:
    """Feed batch documents to a fresh engine as `run_scenario` does; return it and the anomalies."""
    engine = DetectionEngine(EngineSettings(kinds=kinds, overrides=dict(overrides)))
    seen: dict[int, Anomaly] = {}
    last_ts = 0.0
    for doc in sim:
        batch = parse_batch(doc)
        last_ts = max(last_ts, float(batch.timestamps[-1]) if batch.steps.size else last_ts)
        for anomaly in engine.feed(batch, wall_now=last_ts):
            seen.setdefault(anomaly.local_id, anomaly)
    return engine, list(seen.values())
