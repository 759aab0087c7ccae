"""Running simulator scenarios through the real validation and the detection engine (no HTTP)."""

from __future__ import annotations

import dataclasses
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
    engine = DetectionEngine(EngineSettings(kinds=kinds, overrides=dict(overrides)))
    sim = Simulation(sc)
    seen: dict[int, Anomaly] = {}
    last_ts = 0.0
    for doc in sim:
        batch = parse_batch(doc)
        last_ts = max(last_ts, float(batch.timestamps[-1]) if batch.steps.size else last_ts)
        for anomaly in engine.feed(batch, wall_now=last_ts):
            seen.setdefault(anomaly.local_id, anomaly)
    return sim, list(seen.values())
