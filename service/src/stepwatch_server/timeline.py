"""Which rank holds the others up: each rank's place on its step's timeline against its peers'.

Synchronous training makes every rank's step equally long: a rank that is ahead waits for the last one
inside a collective (DDP: the buffer broadcast at the start of forward, the gradient all-reduce in
backward; FSDP: the all-gathers), so a slow rank's peers show the *longer* forward or backward time.
Phase times blame the victims; the timeline does not. Every rank starts its step together with its peers
(the previous step's last collective released them all), and the agent's timings place three points on
it, measured from that start:

- the end of the data wait: `time.data_ms`;
- the end of the last forward: `time.step_ms - time.optimizer_ms - time.backward_ms`;
- the start of the optimizer step: `time.step_ms - time.optimizer_ms`.

A rank that reaches one of them later than the median of its peers keeps them waiting by that much at
the next collective; a rank that waited arrived early and then left with the others, so it is never
late. A rank's lateness is the largest of the three differences (ms): the culprit's is its excess, a
victim's about 0. With collectives in every layer (FSDP's all-gathers, tensor parallel) the peers catch
up at each of them, and a rank slow in compute is late only by its last layer's share.

Everything works on (ranks, columns) arrays (a column: a step, a bucket of steps or a window's mean),
NaN where a rank has no value.
"""

from __future__ import annotations

import warnings

import numpy as np


def peer_median(x: np.ndarray) -> np.ndarray:
    """For each rank (axis 0), the median of the OTHER ranks' finite values in the same column (with few
    ranks the rank itself must not pull the median); NaN where x is NaN or the column has < 2 values."""
    a = np.asarray(x, dtype=np.float64)
    flat = a.reshape(a.shape[0], -1)
    ranks = flat.shape[0]
    out = np.full(flat.shape, np.nan)
    finite = np.isfinite(flat)
    n = finite.sum(axis=0)  # values per column
    if ranks < 2 or not (n >= 2).any():
        return out.reshape(a.shape)
    key = np.where(finite, flat, np.inf)  # missing values sort last
    order = np.argsort(key, axis=0, kind="stable")
    s = np.take_along_axis(key, order, axis=0)
    pos = np.empty_like(order)
    np.put_along_axis(pos, order, np.broadcast_to(np.arange(ranks)[:, None], flat.shape).copy(), axis=0)
    m = n - 1  # each rank's peers
    k = np.maximum(m // 2, 0)

    def rest(i: np.ndarray) -> np.ndarray:  # the i-th smallest value once the rank itself is left out
        i = np.broadcast_to(i, flat.shape)
        return np.take_along_axis(s, np.where(i < pos, i, np.minimum(i + 1, ranks - 1)), axis=0)

    odd = (m % 2 == 1)[None, :]
    high = rest(k)
    low = rest(np.maximum(k - 1, 0))
    with np.errstate(invalid="ignore"):
        med = np.where(odd, high, 0.5 * (low + high))
    keep = finite & (n >= 2)[None, :]
    out[keep] = med[keep]
    return out.reshape(a.shape)


def late_ms(data: np.ndarray, backward: np.ndarray, optimizer: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Each rank's lateness (ms) per column: the most by which it reached a point of its step's timeline
    after the median of its peers (negative: ahead at every point it reported). NaN where none of the
    three points is known for the rank, or it has no peer with that point."""
    opt_start = step - optimizer
    points = (data, opt_start - backward, opt_start)
    diffs = np.stack([p - peer_median(p) for p in points])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all three unknown: NaN, as meant
        return np.nanmax(diffs, axis=0)


def holding_up(
    data: np.ndarray, backward: np.ndarray, optimizer: np.ndarray, step: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(ratio, median step ms) per column: ratio = 1 + late / the column's median step time over ranks,
    1.0 on time, 1.3 when the run waits 30% of a step for the rank."""
    late = late_ms(data, backward, optimizer, step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an empty column's median is NaN, as meant
        median_step = np.nanmedian(step, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = 1.0 + late / np.where(median_step > 0, median_step, np.nan)
    return ratio, median_step
