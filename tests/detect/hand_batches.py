"""Hand-built batches of a small run, fed through the real validation into a detection engine.

For detectors that look at what the agent's heartbeats say (phase, forward counts, stack) in situations
the simulator does not write: every rank's batch of steps, and heartbeats with chosen fields, at chosen
event times. The wall clock passed to the engine is the event time, so "nothing arrived" never fires.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from stepwatch_server.detect import Anomaly, DetectionEngine, EngineSettings
from stepwatch_server.ingest.validate import parse_batch

START_TS = 1_764_427_200.0
TRAIN_STACK = ("torch.autograd.graph:_engine_run_backward", "torch._tensor:Tensor.backward", "train:main")
EVAL_STACK = ("torch.nn.modules.module:Module._call_impl", "train:evaluate", "train:main")
SAVE_STACK = ("train:SlowFile.write", "torch.serialization:_save", "torch.serialization:save", "train:main")
BARRIER_STACK = (
    "torch.distributed.distributed_c10d:barrier",
    "torch.distributed.c10d_logger:_exception_logger.<locals>.wrapper",
    "train:main",
)


@dataclass
class Rank:
    session: str = field(default_factory=lambda: uuid.uuid4().hex)
    seq: int = 0
    forwards: int = 0
    nograd: int = 0
    last_step: int | None = None


class HandRun:
    """A `world_size`-rank run; `anomalies` holds every anomaly as last seen, in the order first raised."""

    def __init__(self, world_size: int = 4, step_s: float = 1.0, **hang_settings: Any) -> None:
        self.run = f"hand-{uuid.uuid4().hex[:8]}"
        self.world_size, self.step_s = world_size, step_s
        self.engine = DetectionEngine(EngineSettings(kinds=("hang",), overrides={"hang": hang_settings}))
        self.ranks = [Rank() for _ in range(world_size)]
        self.seen: dict[int, Anomaly] = {}
        self.now = START_TS

    @property
    def anomalies(self) -> list[Anomaly]:
        return list(self.seen.values())

    def hangs(self) -> list[Anomaly]:
        return [a for a in self.anomalies if a.kind == "hang" and a.key == "run"]

    def feed(self, rank: int, steps: list[int], timestamps: list[float], heartbeat: dict[str, Any]) -> None:
        r = self.ranks[rank]
        doc: dict[str, Any] = {
            "schema": 1,
            "run": self.run,
            "session": r.session,
            "seq": r.seq,
            "rank": rank,
            "world_size": self.world_size,
            "node": f"node-{rank // 2}",
            "steps": steps,
            "timestamps": timestamps,
            "metrics": {"time.step_ms": [self.step_s * 1000.0] * len(steps)},
            "heartbeat": heartbeat,
        }
        r.seq += 1
        wall = max([*timestamps, heartbeat["ts"]])
        for anomaly in self.engine.feed(parse_batch(doc), wall_now=wall):
            self.seen.setdefault(anomaly.local_id, anomaly)

    def train(self, first: int, n: int, stack: tuple[str, ...] = TRAIN_STACK) -> None:
        """Every rank completes steps first .. first + n - 1, one per `step_s`, sent in batches of 4."""
        for start in range(first, first + n, 4):
            steps = list(range(start, min(start + 4, first + n)))
            ends = [self.now + (i + 1) * self.step_s for i in range(len(steps))]
            for rank, r in enumerate(self.ranks):
                r.forwards += len(steps)
                r.last_step = steps[-1]
                self.feed(rank, steps, ends, self._heartbeat(r, ends[-1], "data", stack))
            self.now = ends[-1]

    def wait(
        self,
        seconds: float,
        phase: str | dict[int, str] = "data",
        stack: tuple[str, ...] | dict[int, tuple[str, ...]] = TRAIN_STACK,
        nograd_per_beat: int | dict[int, int] = 0,
        activity: bool = True,
        every_s: float = 5.0,
        silent: tuple[int, ...] = (),
        steps_per_beat: int = 0,
    ) -> None:
        """No step for `seconds`: each rank (but `silent` ones) sends a heartbeat every `every_s`, with its
        phase and stack, its no-grad forwards advanced by `nograd_per_beat`; `activity=False` leaves the
        forward counts and the stack out (an older agent); `steps_per_beat` > 0: the ranks train again, each
        heartbeat saying that many more steps completed (their records come later, with `train`)."""
        end = self.now + seconds
        while self.now + every_s <= end + 1e-9:
            self.now += every_s
            for rank, r in enumerate(self.ranks):
                if rank in silent:
                    continue
                add = nograd_per_beat if isinstance(nograd_per_beat, int) else nograd_per_beat.get(rank, 0)
                r.forwards += add + steps_per_beat
                r.nograd += add
                if steps_per_beat:
                    r.last_step = (r.last_step or 0) + steps_per_beat
                p = phase if isinstance(phase, str) else phase.get(rank, "data")
                s = stack if isinstance(stack, tuple) else stack.get(rank, TRAIN_STACK)
                hb = self._heartbeat(r, self.now, p, s)
                if not activity:
                    for name in ("forwards", "nograd_forwards", "stack"):
                        hb.pop(name)
                self.feed(rank, [], [], hb)
        self.now = end

    def restart(self) -> None:
        """Every rank starts a new agent session (its counters start again at 0)."""
        self.ranks = [Rank() for _ in range(self.world_size)]

    @staticmethod
    def _heartbeat(r: Rank, ts: float, phase: str, stack: tuple[str, ...]) -> dict[str, Any]:
        return {
            "ts": ts,
            "phase": phase,
            "last_step": r.last_step,
            "forwards": r.forwards,
            "nograd_forwards": r.nograd,
            "stack": list(stack),
        }
