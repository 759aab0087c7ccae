"""Vectorised generation of a clean synchronous data-parallel trace, one chunk of steps at a time.

Each chunk is a few arrays of shape (steps, ranks); the only state carried between chunks is small
(random-walk positions, the running memory maximum, the clock), so a 20k-step x 64-rank or a
5k-step x 512-rank run streams in a few MB. Every chunk draws from its own random stream
(`default_rng([seed, stream, chunk])`), which keeps the trace reproducible and independent of faults.

The timing model is the one the detectors must respect. Per step and rank: `data` and `forward`
(intrinsic), `bwd` (backward compute), `opt` (optimizer); per step `tail` (the last all-reduce bucket).
Relative to the previous all-reduce end T(s-1), rank r reaches backward at
`arrive = opt(s-1) + data + forward`; gradients are all-reduced when the slowest rank has computed
them, so T(s) = T(s-1) + max_r(arrive + bwd) + tail. A rank's reported backward is T(s) - arrive (its
compute plus its wait for the slowest), its step ends at T(s) + opt. Step times are therefore equal
across ranks up to optimizer noise, and a slow rank shows a long data/forward and a SHORT backward.
Known pauses (eval, checkpoint) sit in the next step's data time, as the agent measures it (from the
previous step's end), and are marked with phase_start/phase_end events when the user wrapped them in
`watch.phase` (`Scenario.marked_pauses`).

A resumed run (`benign.Resume`) is drawn session by session: `restart()` starts a new process at a
later time, whose first step compiles again and whose memory ramps up again; its chunks draw from
streams of their own (`default_rng([seed, stream, chunk, incarnation])`), so repeated steps get new
values.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stepwatch_server.simulate.scenario import Scenario

# Shares of the median step taken by each phase (they sum to 1).
DATA_SHARE, FORWARD_SHARE, BACKWARD_SHARE, OPTIMIZER_SHARE, TAIL_SHARE = 0.04, 0.30, 0.52, 0.06, 0.08
DATA_SIGMA, COMPUTE_SIGMA, OPT_SIGMA, TAIL_SIGMA = 0.10, 0.02, 0.03, 0.05  # lognormal, per step
RANK_SPEED_SIGMA = 0.006  # persistent GPU-to-GPU speed spread
LOSS_START, LOSS_FLOOR, LOSS_TAU_STEPS, LOSS_ALPHA = 11.0, 1.9, 60.0, 0.55
LOSS_GLOBAL_SIGMA, LOSS_RANK_SIGMA, LOSS_DRIFT_PHI, LOSS_DRIFT_SIGMA = 0.006, 0.03, 0.995, 0.0015
HARD_BATCH_RATE, HARD_BATCH_BUMP = 1 / 1500, 0.12  # one rank's micro-batch is unusually hard
GRAD_SIGMA, GRAD_TAIL_SCALE = 0.08, 0.04
BASE_ALLOC_MB, ACT_PEAK_MB, MEM_WARMUP_STEPS = 38_000.0, 9_000.0, 40
AMAX_OU_PHI, AMAX_OU_SIGMA, AMAX_RANK_SIGMA = 0.998, 0.008, 0.04
AMAX_BASE = {"qkv": 8.0, "fc1": 14.0, "fc2": 22.0, "logits": 40.0, "lm_head": 30.0}
STREAM_STATIC, STREAM_CHUNK, STREAM_BATCH = 0, 1, 3


def shares(scn: Scenario) -> tuple[float, float, float, float, float]:
    """(data, forward, backward, optimizer, tail) shares of the median step; `Scenario.data_share`
    takes its share from the others in proportion."""
    if scn.data_share is None:
        return DATA_SHARE, FORWARD_SHARE, BACKWARD_SHARE, OPTIMIZER_SHARE, TAIL_SHARE
    k = (1.0 - scn.data_share) / (1.0 - DATA_SHARE)
    return scn.data_share, FORWARD_SHARE * k, BACKWARD_SHARE * k, OPTIMIZER_SHARE * k, TAIL_SHARE * k


def stream(seed: int, kind: int, index: int, incarnation: int) -> np.random.Generator:
    """The random stream of one chunk (the first session's keys are the ones used before resumes)."""
    key = [seed, kind, index] if incarnation == 0 else [seed, kind, index, incarnation]
    return np.random.default_rng(key)


def lr_at(steps: np.ndarray, scn: Scenario) -> np.ndarray:
    """Linear warm-up to the peak, then cosine decay to 10% of it (identical on every rank)."""
    s = steps.astype(np.float64)
    warm = scn.peak_lr * np.minimum(1.0, s / max(1, scn.warmup_steps))
    progress = np.clip((s - scn.warmup_steps) / max(1, scn.steps - scn.warmup_steps), 0.0, 1.0)
    cos = scn.peak_lr * (0.1 + 0.45 * (1.0 + np.cos(np.pi * progress)))
    return np.where(s < scn.warmup_steps, warm, cos)


def loss_curve(steps: np.ndarray) -> np.ndarray:
    """Noise-free global loss: ~11 at step 0, power-law decay towards the floor."""
    return LOSS_FLOOR + (LOSS_START - LOSS_FLOOR) * (1.0 + steps / LOSS_TAU_STEPS) ** -LOSS_ALPHA


def fingerprint(seed: int, step: int, salt: str = "") -> str:
    """16 hex digits standing for a device-side checksum of the parameters at `step`."""
    return hashlib.blake2b(f"{seed}:{step}:{salt}".encode(), digest_size=8).hexdigest()


def module_base_amax(name: str) -> float:
    for key, value in AMAX_BASE.items():
        if key in name:
            return value
    return 10.0


@dataclass
class Chunk:
    """Steps [steps[0], steps[-1]] of every rank. Arrays are (n, R) float64 unless noted."""

    index: int
    steps: np.ndarray  # (n,) int64
    data: np.ndarray
    forward: np.ndarray
    bwd: np.ndarray  # backward compute only; `backward` (with the wait) is filled by sync()
    opt: np.ndarray
    tail: np.ndarray  # (n,)
    pause_ms: np.ndarray  # (n,) known pause inside this step's data time
    pause_kind: list[str | None]  # (n,) "eval" / "checkpoint" / None
    lr: np.ndarray  # (n,)
    loss: np.ndarray
    grad_norm: np.ndarray
    alloc: np.ndarray
    peak: np.ndarray
    reserved: np.ndarray
    amax: np.ndarray  # (n, R, M): computed on every step, shipped every `amax_every` steps
    nf_loss: np.ndarray  # (n, R) int8
    nf_grads: np.ndarray
    nf_act: np.ndarray
    fp_rows: np.ndarray  # row indices carrying a fingerprint
    fp_salt: dict[int, str] = field(default_factory=dict)  # rank -> salt (diverged replicas)
    session_first: int = 1  # the first step of the agent session this chunk belongs to
    incarnation: int = 0  # 0 for the first session, 1.. after each resume
    session_start_ts: float | None = None  # set on the first chunk of a resumed session
    kill_ts: float | None = None  # set on the last chunk of a session that is killed
    stall_ms: np.ndarray | None = None  # (n,) storage blip inside every rank's data time (None: none)
    rank_stall_ms: np.ndarray | None = None  # (n, R) one rank's data stalls (benign.DataStall), or None

    def own_data(self) -> np.ndarray:
        """(n, R) data time that is the rank's loader's own: without the pause, the storage blip and the
        rank's data stalls that sit in the same measured interval (no loader makes a checkpoint or a
        filesystem stall longer, and more data work does not lengthen a stall)."""
        own: np.ndarray = self.data - self.pause_ms[:, None]
        if self.stall_ms is not None:
            own = own - self.stall_ms[:, None]
        if self.rank_stall_ms is not None:
            own = own - self.rank_stall_ms
        return own

    # (row, rank, kind, data): events stamped at that rank's step end (phase events add an offset)
    events: list[tuple[int, int, str, dict[str, Any]]] = field(default_factory=list)
    backward: np.ndarray | None = None
    step_ms: np.ndarray | None = None
    end_ts: np.ndarray | None = None  # (n, R) Unix seconds, with per-rank clock skew

    @property
    def n(self) -> int:
        return int(self.steps.shape[0])

    def rows(self, first: int, last: int | None) -> np.ndarray:
        """Boolean (n,) mask of the chunk's steps in [first, last] (last None: no end)."""
        m = self.steps >= first
        if last is not None:
            m &= self.steps <= last
        return m


@dataclass
class _Carry:
    t_ms: float = 0.0  # the previous all-reduce end, ms since start_ts
    prev_opt: np.ndarray | None = None
    loss_drift: float = 0.0
    amax_ou: np.ndarray | None = None
    reserved_max: np.ndarray | None = None


class CleanPhysics:
    """Streams clean chunks of a scenario; faults are applied by the caller between `draw` and `sync`."""

    def __init__(self, scn: Scenario) -> None:
        self.scn = scn
        R, M = scn.world_size, len(scn.modules)
        rng = np.random.default_rng([scn.seed, STREAM_STATIC])
        self.speed = np.exp(rng.normal(0.0, RANK_SPEED_SIGMA * scn.noise, R))
        self.data_speed = np.exp(rng.normal(0.0, 2 * RANK_SPEED_SIGMA * scn.noise, R))
        self.skew_s = rng.normal(0.0, 0.002, R)  # NTP-level clock offsets
        base = BASE_ALLOC_MB if scn.base_alloc_mb is None else scn.base_alloc_mb
        self.base_alloc = base + rng.normal(0.0, 120.0, R)
        act = ACT_PEAK_MB if scn.act_peak_mb is None else scn.act_peak_mb
        self.act_peak = act + rng.normal(0.0, 80.0, R)
        self.frag = rng.uniform(600.0, 2400.0, R)
        # Allocator plateaus: a step-up of a few hundred MB reached over a few steps, then flat.
        n_plateaus = rng.poisson(scn.plateaus_per_10k * scn.steps / 10_000, R)
        self.pl_rank = np.repeat(np.arange(R), n_plateaus)
        k = self.pl_rank.shape[0]
        self.pl_step = rng.integers(MEM_WARMUP_STEPS, max(MEM_WARMUP_STEPS + 1, scn.steps), k)
        self.pl_size = np.exp(rng.normal(math.log(350.0), 0.7, k))
        self.pl_ramp = rng.integers(1, 40, k).astype(np.float64)
        self.pl_onehot = np.zeros((k, R))  # plateau -> its rank, to add plateaus with one matmul
        self.pl_onehot[np.arange(k), self.pl_rank] = 1.0
        self.amax_base = np.array([module_base_amax(m) for m in scn.modules]) * np.exp(rng.normal(0, 0.2, M))
        self.shares = shares(scn)
        self.carry = _Carry(
            prev_opt=np.full(R, self.shares[3] * scn.step_ms),
            amax_ou=np.zeros(M),
            reserved_max=np.zeros(R),
        )

    def chunk_ranges(self, first: int = 1, last: int | None = None) -> list[tuple[int, int]]:
        """[first, last] steps of each chunk of steps first..last (default: the whole run), chunks
        aligned to multiples of chunk_steps."""
        c = self.scn.chunk_steps
        last = self.scn.last_step if last is None else last
        out, a = [], first
        while a <= last:
            b = min((a - 1) // c * c + c, last)
            out.append((a, b))
            a = b + 1
        return out

    def restart(self, start_ms: float) -> None:
        """A new process (a resumed session) starts at `start_ms` after start_ts: the caching allocator
        starts empty; the loss wander and the amax state go on (the same data, the same model)."""
        R = self.scn.world_size
        self.carry.t_ms = start_ms
        self.carry.prev_opt = np.full(R, self.shares[3] * self.scn.step_ms)
        self.carry.reserved_max = np.zeros(R)

    @property
    def t_ms(self) -> float:
        """The last all-reduce end, ms after start_ts."""
        return self.carry.t_ms

    def draw(self, index: int, first: int, last: int, session_first: int = 1, incarnation: int = 0) -> Chunk:
        """The clean intrinsic values of steps first..last (timings not yet synchronised), in the agent
        session whose first step is `session_first`."""
        scn, R, M = self.scn, self.scn.world_size, len(self.scn.modules)
        rng = stream(scn.seed, STREAM_CHUNK, index, incarnation)
        steps = np.arange(first, last + 1, dtype=np.int64)
        n, nz = steps.shape[0], scn.noise
        ms = scn.step_ms
        data_share, forward_share, backward_share, optimizer_share, tail_share = self.shares

        def lognormal(sigma: float, shape: tuple[int, ...]) -> np.ndarray:
            return np.exp(rng.normal(0.0, sigma * nz, shape))

        data = data_share * ms * self.data_speed * lognormal(DATA_SIGMA, (n, R))
        forward = forward_share * ms * self.speed * lognormal(COMPUTE_SIGMA, (n, R))
        bwd = backward_share * ms * self.speed * lognormal(COMPUTE_SIGMA, (n, R))
        opt = optimizer_share * ms * lognormal(OPT_SIGMA, (n, R))
        tail = tail_share * ms * lognormal(TAIL_SIGMA, (n,))
        # GC pauses in forward on one rank, and rare slow steps on every rank (a filesystem hiccup).
        gc = rng.random((n, R)) < scn.gc_rate
        forward += gc * rng.uniform(0.3, 1.5, (n, R)) * ms
        blip = rng.random(n) < scn.global_blip_rate
        stall_ms = blip * rng.uniform(1.0, 4.0, n) * ms
        data += stall_ms[:, None]
        # Warm-up: a session's first step compiles/autotunes, the next few are still slow.
        in_session = steps - (session_first - 1)
        early = in_session <= 5
        if early.any():
            slow = np.where(in_session == 1, scn.compile_s * 1000.0, 0.4 * ms / in_session.astype(np.float64))
            forward += (early * slow)[:, None] * rng.uniform(0.98, 1.02, (n, R))
        pause_ms = np.zeros(n)
        pause_kind: list[str | None] = [None] * n
        events: list[tuple[int, int, str, dict[str, Any]]] = []
        for i, s in enumerate(steps.tolist()):
            # A resumed session starts after its checkpoint's pause, which the killed session took.
            kind = scn.pause_after(s - 1) if s > session_first or session_first == 1 else None
            if kind is not None:
                length_s = scn.ckpt_s if kind == "checkpoint" else scn.eval_s
                pause_ms[i] = length_s * 1000.0 * rng.uniform(0.9, 1.1)
                pause_kind[i] = kind
        data += pause_ms[:, None]

        lr = lr_at(steps, scn)
        loss, grad_norm = self._loss_and_grads(rng, steps, lr, n, R)
        alloc, peak, reserved = self._memory(rng, steps, session_first, n, R)
        amax = self._amax(rng, steps, n, R, M)
        fp_rows = (
            np.flatnonzero(steps % scn.fingerprint_every == 0)
            if scn.fingerprint_every
            else np.zeros(0, np.int64)
        )
        zeros = np.zeros((n, R), dtype=np.int8)
        return Chunk(
            index=index, steps=steps, data=data, forward=forward, bwd=bwd, opt=opt, tail=tail,
            pause_ms=pause_ms, pause_kind=pause_kind, lr=lr, loss=loss, grad_norm=grad_norm,
            alloc=alloc, peak=peak, reserved=reserved, amax=amax, nf_loss=zeros, nf_grads=zeros.copy(),
            nf_act=zeros.copy(), fp_rows=fp_rows, events=events, session_first=session_first,
            incarnation=incarnation, stall_ms=stall_ms,
        )  # fmt: skip

    def _loss_and_grads(
        self, rng: np.random.Generator, steps: np.ndarray, lr: np.ndarray, n: int, R: int
    ) -> tuple[np.ndarray, np.ndarray]:
        scn, nz, c = self.scn, self.scn.noise, self.carry
        s = steps.astype(np.float64)
        # Slow wander (data mixture), AR(1) carried across chunks.
        drift = np.empty(n)
        eps = rng.normal(0.0, LOSS_DRIFT_SIGMA * nz, n)
        d = c.loss_drift
        for i in range(n):
            d = LOSS_DRIFT_PHI * d + eps[i]
            drift[i] = d
        c.loss_drift = d
        warm = s < scn.warmup_steps
        level = 0.4 + lr / scn.peak_lr + 1.5 * warm  # bigger updates -> noisier loss; warm-up is bumpy
        glob = loss_curve(s) * np.exp(drift + rng.normal(0.0, LOSS_GLOBAL_SIGMA * nz, n) * level)
        per_rank = rng.normal(0.0, LOSS_RANK_SIGMA * nz, (n, R))
        per_rank += (rng.random((n, R)) < HARD_BATCH_RATE) * HARD_BATCH_BUMP
        loss = glob[:, None] * np.exp(per_rank)
        # DDP all-reduces gradients before optimizer.step(): every rank reports the same norm.
        base = 0.9 + 6.0 * (1.0 + s / 40.0) ** -0.8
        g = base * np.exp(rng.normal(0.0, GRAD_SIGMA * nz, n) + GRAD_TAIL_SCALE * nz * rng.standard_t(3, n))
        spikes = rng.random(n) < scn.grad_spike_rate  # benign: clipped, the loss does not follow
        g *= np.where(spikes, rng.uniform(2.5, 6.0, n), 1.0)
        return loss, np.repeat(g[:, None], R, axis=1)

    def _memory(
        self, rng: np.random.Generator, steps: np.ndarray, session_first: int, n: int, R: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Memory by the step within the session: a new process allocates everything again, and the
        plateaus it had reached before come back once it reaches the same step (or at its start)."""
        s = (steps - (session_first - 1)).astype(np.float64)
        ramp = np.minimum(1.0, s / MEM_WARMUP_STEPS)[:, None]  # optimizer state appears on early steps
        alloc = self.base_alloc * (0.7 + 0.3 * ramp) + np.round(rng.normal(0.0, 2.0, (n, R)), 0)
        if self.pl_rank.size:
            pl_step = np.maximum(self.pl_step, session_first) - (session_first - 1)
            frac = np.clip((s[:, None] - pl_step[None, :]) / self.pl_ramp[None, :], 0.0, 1.0)
            alloc += (frac * self.pl_size[None, :]) @ self.pl_onehot
        peak = alloc + self.act_peak * np.exp(rng.normal(0.0, 0.003, (n, R)))
        reserved = np.zeros_like(alloc)  # filled by finish_memory() once faults have moved `peak`
        return alloc, peak, reserved

    def finish_memory(self, ch: Chunk) -> None:
        """The caching allocator keeps what it ever reserved: running max of peak + fragmentation (never
        more than the device has)."""
        assert self.carry.reserved_max is not None
        run = np.maximum.accumulate(np.vstack([self.carry.reserved_max[None, :], ch.peak]), axis=0)[1:]
        self.carry.reserved_max = run[-1].copy()
        ch.reserved = np.ceil((run + self.frag) / 2.0) * 2.0
        if self.scn.capacity_mb is not None:
            np.minimum(ch.reserved, np.maximum(self.scn.capacity_mb, ch.peak), out=ch.reserved)

    def _amax(self, rng: np.random.Generator, steps: np.ndarray, n: int, R: int, M: int) -> np.ndarray:
        c = self.carry
        assert c.amax_ou is not None
        eps = rng.normal(0.0, AMAX_OU_SIGMA * self.scn.noise, (n, M))
        ou = np.empty((n, M))
        x = c.amax_ou
        for i in range(n):
            x = AMAX_OU_PHI * x + eps[i]
            ou[i] = x
        c.amax_ou = x
        grow = 1.0 - 0.5 * np.exp(-steps.astype(np.float64) / 500.0)  # activations grow early in training
        shared = self.amax_base[None, :] * grow[:, None] * np.exp(ou)
        per_rank = np.exp(rng.normal(0.0, AMAX_RANK_SIGMA * self.scn.noise, (n, R, M)))
        return shared[:, None, :] * per_rank

    def sync(self, ch: Chunk) -> None:
        """Synchronise the ranks (see the module docstring): fills backward, step_ms and end_ts."""
        c = self.carry
        assert c.prev_opt is not None
        prev_opt = np.vstack([c.prev_opt[None, :], ch.opt[:-1]])
        arrive = prev_opt + ch.data + ch.forward
        d = (arrive + ch.bwd).max(axis=1) + ch.tail
        t = c.t_ms + np.cumsum(d)
        ch.backward = d[:, None] - arrive
        ch.step_ms = d[:, None] + ch.opt - prev_opt
        ch.end_ts = self.scn.start_ts + (t[:, None] + ch.opt) / 1000.0 + self.skew_s[None, :]
        c.t_ms = float(t[-1])
        c.prev_opt = ch.opt[-1].copy()
