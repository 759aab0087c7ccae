"""Trace chunks -> schema-1 batch dicts (docs/ingest.md), sent the way the agent sends them.

Each rank has one agent session. Its sender thread wakes every `flush_interval_s` (with jitter, so
ranks do not flush in lock-step) and sends the steps completed since its last send; when there are
none and `heartbeat_interval_s` has passed, it sends a heartbeat-only batch (during eval/checkpoint
pauses and hangs). The training thread also hands over a full buffer at the end of each chunk of
`chunk_steps` steps. Every batch carries a heartbeat with the rank's current phase and last completed
step. A dead rank's sender dies with it: steps it had not sent yet are lost and its heartbeats stop.

Non-finite values are written as the strings "NaN", "Infinity", "-Infinity"; amax rows are shipped
every `amax_every` steps and additionally on any step where an amax was non-finite (as the agent does).
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stepwatch_server.simulate.physics import STREAM_BATCH, Chunk, fingerprint
from stepwatch_server.simulate.scenario import Hang, Scenario

AGENT_VERSION = "0.1.0+sim"
TICK_JITTER = (0.85, 1.15)
FLUSH_DELAY_S = (0.002, 0.03)
PHASE_EVENT_DELAY_S = 0.002
# metric name -> (Chunk attribute, decimals); non-finite values survive rounding.
METRICS: tuple[tuple[str, str, int], ...] = (
    ("loss", "loss", 5),
    ("grad_norm", "grad_norm", 5),
    ("time.data_ms", "data", 3),
    ("time.forward_ms", "forward", 3),
    ("time.backward_ms", "backward", 3),
    ("time.optimizer_ms", "opt", 3),
    ("time.step_ms", "step_ms", 3),
    ("mem.allocated_mb", "alloc", 1),
    ("mem.reserved_mb", "reserved", 1),
    ("mem.peak_mb", "peak", 1),
    ("nonfinite.loss", "nf_loss", -1),
    ("nonfinite.grads", "nf_grads", -1),
    ("nonfinite.activations", "nf_act", -1),
)
_NONFINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def jsonable(arr: np.ndarray, decimals: int) -> list[list[Any]]:
    """(n, R) -> R lists of n JSON values (rounded; non-finite as the format's strings)."""
    if decimals < 0:
        ints: list[list[Any]] = arr.T.tolist()
        return ints
    out: list[list[Any]] = np.round(arr, decimals).T.tolist()
    bad = ~np.isfinite(arr)
    if bad.any():
        for i, r in zip(*np.nonzero(bad), strict=True):
            v = float(arr[i, r])
            out[r][i] = "NaN" if v != v else _NONFINITE[v]
    return out


@dataclass
class _Rank:
    rank: int
    head: dict[str, Any]
    seq: int = 0
    last_send: float = 0.0
    next_tick: float = 0.0
    prev_end: float = 0.0  # end of the last completed step (or the session start)
    last_step: int | None = None
    events: list[dict[str, Any]] = field(default_factory=list)


class Batcher:
    """Per-rank agent sessions; `emit()` turns one synchronised chunk into (send_ts, rank, batch)."""

    def __init__(self, scn: Scenario) -> None:
        self.scn = scn
        rng = np.random.default_rng([scn.seed, STREAM_BATCH])
        self.ranks: list[_Rank] = []
        for r in range(scn.world_size):
            session = hashlib.blake2b(f"{scn.seed}:{scn.name}:{r}".encode(), digest_size=16).hexdigest()
            head = {
                "schema": 1,
                "run": scn.run_name,
                "session": session,
                "seq": 0,
                "rank": r,
                "local_rank": r % scn.ranks_per_node,
                "world_size": scn.world_size,
                "node": scn.node_of(r),
                "replica_group": r,
                "shard": 0,
                "num_shards": 1,
                "agent": {
                    "version": AGENT_VERSION,
                    "counters": {"dropped_buffer_full": 0, "spooled_batches": 0},
                },
            }
            start = scn.start_ts
            first_tick = start + float(rng.uniform(0.0, scn.flush_interval_s))
            self.ranks.append(_Rank(r, head, last_send=start, next_tick=first_tick, prev_end=start))
        self.median_data_ms = 0.04 * scn.step_ms
        self.median_forward_ms = 0.30 * scn.step_ms

    def emit(self, ch: Chunk, *, final: bool) -> list[tuple[float, int, dict[str, Any]]]:
        scn = self.scn
        assert ch.end_ts is not None and ch.backward is not None
        rng = np.random.default_rng([scn.seed, STREAM_BATCH, ch.index])
        hang = scn.hang if final else None
        cols = {name: jsonable(getattr(ch, attr), dec) for name, attr, dec in METRICS}
        ts_cols = jsonable(ch.end_ts, 6)
        steps = ch.steps.tolist()
        lr = ch.lr.tolist()
        regular = (ch.steps % scn.amax_every == 0) if scn.amax_every else np.zeros(ch.n, dtype=bool)
        tmask = regular[:, None] | ~np.isfinite(ch.amax).all(axis=2)
        rows_any = np.flatnonzero(tmask.any(axis=1))
        # (rows, R, M) -> R x M lists over the rows that any rank ships
        amax_cols = [jsonable(ch.amax[rows_any, :, m], 4) for m in range(len(scn.modules))]
        amax_at = {int(row): j for j, row in enumerate(rows_any.tolist())}
        events_by_rank: dict[int, list[tuple[int, str, dict[str, Any]]]] = {}
        for row, r, kind, data in ch.events:
            events_by_rank.setdefault(r, []).append((row, kind, data))
        hang_end = float(ch.end_ts[-1].max()) + scn.hang_observe_s if hang else 0.0
        out: list[tuple[float, int, dict[str, Any]]] = []
        for st in self.ranks:
            r = st.rank
            ends: list[float] = ts_cols[r]
            self._queue_events(st, ch, ends, events_by_rank.get(r, ()))
            amax = [col[r] for col in amax_cols]
            per_rank = _RankChunk(
                scn, st, ch, cols, ends, steps, lr, np.flatnonzero(tmask[:, r]), amax, amax_at
            )
            if hang is None:
                limit = ends[-1]
            elif r == hang.rank and hang.mode == "dead":
                limit = ends[-1] + float(rng.uniform(0.05, 1.0))  # dies during the hung step
            else:
                limit = hang_end
            t = st.next_tick
            while t < limit:
                k = bisect_right(ends, t)
                if k > per_rank.sent or t - st.last_send >= scn.heartbeat_interval_s:
                    out.append((t, r, per_rank.batch(k, t, self._phase(st, ch, ends, k, t, hang))))
                t += scn.flush_interval_s * float(rng.uniform(*TICK_JITTER))
            st.next_tick = t
            if hang is None:  # the buffer is handed over at the end of the chunk
                f = ends[-1] + float(rng.uniform(*FLUSH_DELAY_S))
                pause = scn.pause_after(steps[-1])  # the agent's pause() hands the buffer over
                phase = pause if pause is not None and f > ends[-1] + PHASE_EVENT_DELAY_S else "data"
                out.append((f, r, per_rank.batch(ch.n, f, phase)))
                st.next_tick = f + scn.flush_interval_s * float(rng.uniform(*TICK_JITTER))
            st.prev_end = ends[-1]
            st.last_step = steps[-1]
        return out

    def _queue_events(self, st: _Rank, ch: Chunk, ends: list[float], nonfinite: Any) -> None:
        """Phase events of the pauses in this chunk and the fault events, stamped at the rank's clock."""
        new: list[dict[str, Any]] = []
        for i in np.flatnonzero(ch.pause_ms).tolist():
            prev_end = ends[i - 1] if i > 0 else st.prev_end
            step, phase = int(ch.steps[i]) - 1, ch.pause_kind[i]
            new.append({"step": step, "ts": round(prev_end + PHASE_EVENT_DELAY_S, 6), "kind": "phase_start",
                        "data": {"phase": phase}})  # fmt: skip
            end = prev_end + float(ch.pause_ms[i]) / 1000.0
            new.append({"step": step, "ts": round(end, 6), "kind": "phase_end", "data": {"phase": phase}})
        for row, kind, data in nonfinite:
            new.append({"step": int(ch.steps[row]), "ts": ends[row], "kind": kind, "data": data})
        new.sort(key=lambda e: e["ts"])
        st.events.extend(new)

    def _phase(self, st: _Rank, ch: Chunk, ends: list[float], k: int, t: float, hang: Hang | None) -> str:
        """What the rank's training thread is doing at `t`, with k steps of the chunk completed."""
        assert ch.backward is not None
        if k < ch.n:
            start = ends[k - 1] if k > 0 else st.prev_end
            e = (t - start) * 1000.0
            bounds = (
                (float(ch.pause_ms[k]), ch.pause_kind[k] or "data"),
                (float(ch.data[k, st.rank]), "data"),
                (float(ch.data[k, st.rank] + ch.forward[k, st.rank]), "forward"),
                (float(ch.data[k, st.rank] + ch.forward[k, st.rank] + ch.backward[k, st.rank]), "backward"),
            )
            return next((name for limit, name in bounds if e < limit), "optimizer")
        if hang is None:
            return "data"
        e = (t - ends[-1]) * 1000.0
        if st.rank == hang.rank:
            return "data" if hang.phase == "data" or e < self.median_data_ms else "forward"
        if e < self.median_data_ms:
            return "data"
        return "forward" if e < self.median_data_ms + self.median_forward_ms else "backward"


class _RankChunk:
    """Builds one rank's batches out of one chunk, remembering how many rows were sent."""

    def __init__(
        self, scn: Scenario, st: _Rank, ch: Chunk, cols: dict[str, list[list[Any]]], ends: list[float], steps: list[int],
        lr: list[float], trows: np.ndarray, amax: list[list[Any]], amax_at: dict[int, int],
    ) -> None:  # fmt: skip
        self.scn, self.st, self.ch, self.cols, self.ends, self.steps, self.lr = (
            scn,
            st,
            ch,
            cols,
            ends,
            steps,
            lr,
        )
        self.trows = trows.tolist()
        self.amax, self.amax_at = amax, amax_at
        self.fp_rows = ch.fp_rows.tolist()
        self.sent = 0

    def batch(self, k: int, t: float, phase: str) -> dict[str, Any]:
        st, ch, r, i = self.st, self.ch, self.st.rank, self.sent
        b = dict(st.head)
        b["seq"] = st.seq
        st.seq += 1
        b["steps"] = self.steps[i:k]
        b["timestamps"] = self.ends[i:k]
        if k > i:
            metrics = {name: col[r][i:k] for name, col in self.cols.items()}
            metrics["lr"] = self.lr[i:k]
            b["metrics"] = metrics
            trows = [j for j in self.trows if i <= j < k]
            if trows:
                at = [self.amax_at[j] for j in trows]
                b["tensors"] = {
                    "steps": [self.steps[j] for j in trows],
                    "stats": {
                        "amax": {
                            m: [col[a] for a in at]
                            for m, col in zip(self.scn.modules, self.amax, strict=True)
                        }
                    },
                }
            fps = [j for j in self.fp_rows if i <= j < k]
            if fps:
                salt = ch.fp_salt.get(r, "")
                div_from = int(salt.rsplit("@", 1)[1]) if salt else None
                seed = self.scn.seed
                b["fingerprints"] = {
                    "steps": [self.steps[j] for j in fps],
                    "values": [
                        fingerprint(
                            seed,
                            self.steps[j],
                            salt if div_from is not None and self.steps[j] >= div_from else "",
                        )
                        for j in fps
                    ],
                }
        if st.events:
            ready = [e for e in st.events if e["ts"] <= t]
            if ready:
                b["events"] = ready
                st.events = [e for e in st.events if e["ts"] > t]
        last_step = self.steps[k - 1] if k > 0 else st.last_step
        b["heartbeat"] = {"ts": round(t, 6), "phase": phase, "last_step": last_step}
        st.last_send = t
        self.sent = k
        return b
