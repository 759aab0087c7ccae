"""Multi-rank training-trace simulator: realistic synchronous data-parallel runs with injected faults
and ground-truth labels, emitted as schema-1 ingest batches; plus the scorer for detectors.

    from stepwatch_server.simulate import SCENARIOS, Simulation, generate, score
    sim = Simulation(SCENARIOS["straggler_10pct_fwd_64"])
    for batch in sim: ...           # what a collector would receive, in order
    sim.labels                      # ground truth, with onset timestamps

Benign behaviours (`benign.py`: drift, allocator steps, congestion, data hiccups, loss bumps, resumes)
make no labels; `world.split("dev")` / `world.split("heldout")` are the randomised runs the detectors
are scored on (`world.py`).
"""

from stepwatch_server.detect.anomalies import KINDS
from stepwatch_server.simulate.benign import (
    Benign,
    Congestion,
    DataStall,
    EvalMemoryStep,
    ExtraDataWork,
    LossBump,
    MemoryDrift,
    MemorySawtooth,
    NodeDataHiccup,
    Resume,
)
from stepwatch_server.simulate.scenario import (
    Divergence,
    Fault,
    Fp8OverflowRisk,
    Hang,
    Label,
    LossSpike,
    MemoryLeak,
    NonFinite,
    ReplicaDivergence,
    Scenario,
    SlowNode,
    Straggler,
    ThroughputDrop,
)
from stepwatch_server.simulate.score import Detection, KindScore, Score, matches, score, score_scenario
from stepwatch_server.simulate.simulation import Simulation, generate
from stepwatch_server.simulate.suite import DEMO_BY_KIND, QUICK, SCENARIOS

__all__ = [
    "DEMO_BY_KIND",
    "KINDS",
    "QUICK",
    "SCENARIOS",
    "Benign",
    "Congestion",
    "DataStall",
    "Detection",
    "Divergence",
    "EvalMemoryStep",
    "ExtraDataWork",
    "Fault",
    "Fp8OverflowRisk",
    "Hang",
    "KindScore",
    "Label",
    "LossBump",
    "LossSpike",
    "MemoryDrift",
    "MemoryLeak",
    "MemorySawtooth",
    "NodeDataHiccup",
    "NonFinite",
    "ReplicaDivergence",
    "Resume",
    "Scenario",
    "Score",
    "Simulation",
    "SlowNode",
    "Straggler",
    "ThroughputDrop",
    "generate",
    "matches",
    "score",
    "score_scenario",
]
