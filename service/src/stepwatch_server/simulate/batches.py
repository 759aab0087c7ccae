"""Trace chunks -> schema-1 batch dicts (docs/ingest.md), sent the way the agent sends them.

Each rank has one agent session. Its sender thread wakes every `flush_interval_s` (with jitter, so
ranks do not flush in lock-step) and sends the steps completed since its last send; when there are
none and `heartbeat_interval_s` has passed, it sends a heartbeat-only batch (during eval/checkpoint
pauses and hangs). The training thread also hands over a full buffer at the end of each chunk of
`chunk_steps` steps. Every batch carries a heartbeat with the rank's current phase and last completed
step. A dead rank's sender dies with it: steps it had not sent yet are lost and its heartbeats stop.

Non-finite values are written as the strings "NaN", "Infinity", "-Infinity"; amax rows are shipped
every `amax_every` steps and additionally on any step where an amax was non-finite (as the agent does).

Pauses the user did not wrap in `watch.phase` (`Scenario.marked_pauses`) send no phase events, and the
heartbeat's phase stays `data` through them. With `Scenario.agent_activity` every heartbeat also says
what the training thread is doing (docs/ingest.md): `forwards` and `nograd_forwards` (an evaluation's
forwards advance while no step completes) and `stack` (a checkpoint's save call, the barrier the
other ranks wait in, the data loader, backward). A killed session's senders stop at the kill; the
resumed one is a new session per rank (new id, `seq` from 0) that sends the repeated steps again.
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stepwatch_server.simulate.physics import STREAM_BATCH, Chunk, fingerprint, shares, stream
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
STREAM_SESSION = 5
CAPACITY_METRIC = "mem.capacity_mb"
# Read by the agent from the allocator together (and the capacity sent with them).
MEMORY_METRICS = ("mem.allocated_mb", "mem.reserved_mb", "mem.peak_mb", CAPACITY_METRIC)
# What the training thread's stack shows (innermost first) in each activity; "{u}" is the user's module.
STACKS: dict[str, tuple[str, ...]] = {
    "data": ("torch.utils.data.dataloader:_BaseDataLoaderIter.__next__", "{u}:main"),
    "forward": ("torch.nn.modules.module:Module._call_impl", "{u}:main"),
    "backward": ("torch.autograd:backward", "torch._tensor:Tensor.backward", "{u}:main"),
    "optimizer": ("torch.optim.adamw:AdamW.step", "torch.optim.optimizer:Optimizer.wrapper", "{u}:main"),
    "eval": ("torch.nn.modules.module:Module._call_impl", "{u}:evaluate", "{u}:main"),
    "eval_data": ("torch.utils.data.dataloader:_BaseDataLoaderIter.__next__", "{u}:evaluate", "{u}:main"),
    "save": ("torch.serialization:save", "{u}:save_checkpoint", "{u}:main"),
    "barrier": ("torch.distributed.distributed_c10d:barrier", "{u}:save_checkpoint", "{u}:main"),
}
STACK_TAIL = ("__main__:<module>",)
IN_STEP = {"forward": 1, "backward": -1, "optimizer": -1}  # forwards begun in the step (-1: grad_accum)


def stack(where: str, user_module: str) -> list[str]:
    return [f.format(u=user_module) for f in STACKS[where]] + list(STACK_TAIL)


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
    nograd: int = 0  # no-grad forwards of the evaluations completed in earlier chunks of the session


class Batcher:
    """Per-rank agent sessions; `emit()` turns one synchronised chunk into (send_ts, rank, batch)."""

    def __init__(self, scn: Scenario) -> None:
        self.scn = scn
        self.ranks: list[_Rank] = []
        self.incarnation = 0
        self._start_sessions(0, scn.start_ts, np.random.default_rng([scn.seed, STREAM_BATCH]))
        data_share, forward_share = shares(scn)[:2]
        self.median_data_ms = data_share * scn.step_ms
        self.median_forward_ms = forward_share * scn.step_ms
        self.savers = {0} if scn.ckpt_savers == "rank0" else set(range(scn.world_size))

    def _start_sessions(self, incarnation: int, start: float, rng: np.random.Generator) -> None:
        """Every rank's agent session (a resumed run starts new ones: new ids, seq from 0)."""
        scn = self.scn
        self.incarnation = incarnation
        self.ranks = []
        for r in range(scn.world_size):
            key = f"{scn.seed}:{scn.name}:{r}" + (f":{incarnation}" if incarnation else "")
            session = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
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
            first_tick = start + float(rng.uniform(0.0, scn.flush_interval_s))
            self.ranks.append(_Rank(r, head, last_send=start, next_tick=first_tick, prev_end=start))

    def emit(self, ch: Chunk, *, final: bool) -> list[tuple[float, int, dict[str, Any]]]:
        scn = self.scn
        assert ch.end_ts is not None and ch.backward is not None
        if ch.incarnation != self.incarnation:
            assert ch.session_start_ts is not None
            rng0 = np.random.default_rng([scn.seed, STREAM_SESSION, ch.incarnation])
            self._start_sessions(ch.incarnation, ch.session_start_ts, rng0)
        rng = stream(scn.seed, STREAM_BATCH, ch.index, ch.incarnation)
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
        # No-grad forwards of each row's evaluation (0 elsewhere), and of the rows before each row.
        eval_s = np.where([k == "eval" for k in ch.pause_kind], ch.pause_ms / 1000.0, 0.0)
        eval_fwd = np.floor(eval_s * scn.eval_forwards_per_s).astype(np.int64)
        evals_before = np.concatenate([[0], np.cumsum(eval_fwd)]).tolist()
        out: list[tuple[float, int, dict[str, Any]]] = []
        for st in self.ranks:
            r = st.rank
            ends: list[float] = ts_cols[r]
            self._queue_events(st, ch, ends, events_by_rank.get(r, ()))
            amax = [col[r] for col in amax_cols]
            per_rank = _RankChunk(
                scn, st, ch, cols, ends, steps, lr, np.flatnonzero(tmask[:, r]), amax, amax_at
            )
            if ch.kill_ts is not None:
                limit = ch.kill_ts  # every sender dies with its job
            elif hang is None:
                limit = ends[-1]
            elif r == hang.rank and hang.mode == "dead":
                limit = ends[-1] + float(rng.uniform(0.05, 1.0))  # dies during the hung step
            else:
                limit = hang_end
            t = st.next_tick
            while t < limit:
                k = bisect_right(ends, t)
                if k > per_rank.sent or t - st.last_send >= scn.heartbeat_interval_s:
                    phase, where = self._phase(st, ch, ends, k, t, hang)
                    hb = (
                        self._activity(st, ch, ends, k, t, where, evals_before)
                        if scn.agent_activity
                        else None
                    )
                    out.append((t, r, per_rank.batch(k, t, phase, hb)))
                t += scn.flush_interval_s * float(rng.uniform(*TICK_JITTER))
            st.next_tick = t
            if hang is None and ch.kill_ts is None:  # the buffer is handed over at the end of the chunk
                f = ends[-1] + float(rng.uniform(*FLUSH_DELAY_S))
                pause = scn.pause_after(steps[-1])  # the agent's pause() hands the buffer over
                marked = scn.pause_marked(pause) and f > ends[-1] + PHASE_EVENT_DELAY_S
                phase = pause if pause is not None and marked else "data"
                hb = None
                if scn.agent_activity:
                    where = ("save" if r in self.savers else "barrier") if pause == "checkpoint" else "data"
                    hb = self._activity(st, ch, ends, ch.n, f, where, evals_before)
                out.append((f, r, per_rank.batch(ch.n, f, phase, hb)))
                st.next_tick = f + scn.flush_interval_s * float(rng.uniform(*TICK_JITTER))
            st.prev_end = ends[-1]
            st.last_step = steps[-1]
            st.nograd += int(evals_before[-1])
        return out

    def _activity(
        self, st: _Rank, ch: Chunk, ends: list[float], k: int, t: float, where: str, evals_before: list[int]
    ) -> dict[str, Any]:
        """The heartbeat's `forwards`, `nograd_forwards` and `stack` at `t`, k rows of the chunk done."""
        scn = self.scn
        nograd = st.nograd + evals_before[k]
        if k < ch.n and ch.pause_kind[k] == "eval":  # inside (or just past) row k's evaluation
            start = ends[k - 1] if k > 0 else st.prev_end
            elapsed = min(max(t - start, 0.0), float(ch.pause_ms[k]) / 1000.0)
            nograd += math.floor(elapsed * scn.eval_forwards_per_s)
        last = ch.steps[k - 1] if k > 0 else st.last_step
        done = 0 if last is None else int(last) - (ch.session_first - 1)
        begun = IN_STEP.get(where, 0)
        forwards = done * scn.grad_accum + (scn.grad_accum if begun < 0 else begun) + nograd
        return {"forwards": forwards, "nograd_forwards": nograd, "stack": stack(where, scn.user_module)}

    def _queue_events(self, st: _Rank, ch: Chunk, ends: list[float], nonfinite: Any) -> None:
        """Phase events of the marked pauses in this chunk and the fault events, at the rank's clock."""
        new: list[dict[str, Any]] = []
        for i in np.flatnonzero(ch.pause_ms).tolist():
            if not self.scn.pause_marked(ch.pause_kind[i]):
                continue  # the user did not wrap it in watch.phase: the agent knows nothing of it
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

    def _phase(
        self, st: _Rank, ch: Chunk, ends: list[float], k: int, t: float, hang: Hang | None
    ) -> tuple[str, str]:
        """(the heartbeat's phase, what the training thread is doing: a key of STACKS) at `t`, with k
        steps of the chunk completed. An unmarked pause is `data` to the agent."""
        assert ch.backward is not None
        if k < ch.n:
            start = ends[k - 1] if k > 0 else st.prev_end
            e = (t - start) * 1000.0
            pause = ch.pause_kind[k]
            if e < float(ch.pause_ms[k]) and pause is not None:
                if pause == "eval":
                    where = "eval_data" if int(t * 1000.0) % 4 == 0 else "eval"
                else:
                    where = "save" if st.rank in self.savers else "barrier"
                return (pause if self.scn.pause_marked(pause) else "data"), where
            bounds = (
                (float(ch.data[k, st.rank]), "data"),
                (float(ch.data[k, st.rank] + ch.forward[k, st.rank]), "forward"),
                (float(ch.data[k, st.rank] + ch.forward[k, st.rank] + ch.backward[k, st.rank]), "backward"),
            )
            name = next((name for limit, name in bounds if e < limit), "optimizer")
            return name, name
        if hang is None:
            return "data", "data"
        e = (t - ends[-1]) * 1000.0
        if st.rank == hang.rank:
            name = "data" if hang.phase == "data" or e < self.median_data_ms else "forward"
        elif e < self.median_data_ms:
            name = "data"
        else:
            name = "forward" if e < self.median_data_ms + self.median_forward_ms else "backward"
        return name, name


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

    def batch(self, k: int, t: float, phase: str, activity: dict[str, Any] | None = None) -> dict[str, Any]:
        st, ch, r, i = self.st, self.ch, self.st.rank, self.sent
        b = dict(st.head)
        b["seq"] = st.seq
        st.seq += 1
        b["steps"] = self.steps[i:k]
        b["timestamps"] = self.ends[i:k]
        if k > i:
            metrics = {name: col[r][i:k] for name, col in self.cols.items()}
            metrics["lr"] = self.lr[i:k]
            if self.scn.capacity_mb is not None:
                metrics[CAPACITY_METRIC] = [self.scn.capacity_mb] * (k - i)
            every = self.scn.memory_every
            if every > 1:  # read once per transfer: every n-th step and the batch's last, null between
                skip = [j for j, step in enumerate(self.steps[i : k - 1]) if step % every]
                for name in MEMORY_METRICS:
                    col = metrics.get(name)
                    if col is not None:
                        col = metrics[name] = list(col)
                        for j in skip:
                            col[j] = None
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
                # A resumed session's parameters differ from the killed one's at the same step.
                inc = f"#incarnation{ch.incarnation}" if ch.incarnation else ""
                b["fingerprints"] = {
                    "steps": [self.steps[j] for j in fps],
                    "values": [
                        fingerprint(
                            seed,
                            self.steps[j],
                            (salt if div_from is not None and self.steps[j] >= div_from else "") + inc,
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
        if activity is not None:
            b["heartbeat"].update(activity)
        st.last_send = t
        self.sent = k
        return b
