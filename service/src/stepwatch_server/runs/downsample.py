"""Server-side downsampling that keeps extremes.

A chart of 100,000 steps needs a few thousand points, but averaging or striding would erase exactly
what a run monitor exists to show: a one-step loss spike, a NaN. So the steps are cut into buckets
and each bucket keeps its minimum and its maximum point, in step order (the "min-max" decimation of
plotting libraries). NaN sorts as a bucket's maximum, so a NaN always survives too.
"""

from __future__ import annotations

import numpy as np

DEFAULT_MAX_POINTS = 2000
MAX_POINTS_CAP = 20_000


def minmax_indices(values: np.ndarray, max_points: int) -> np.ndarray:
    """Indices (ascending) of at most `max_points` points: each bucket's min and max."""
    n = int(values.shape[0])
    if n <= max_points:
        return np.arange(n)
    buckets = max(1, max_points // 2)
    bucket = (np.arange(n, dtype=np.int64) * buckets) // n
    order = np.lexsort((values, bucket))  # by bucket, then value; NaN last, i.e. a bucket's max
    counts = np.bincount(bucket, minlength=buckets)
    ends = np.cumsum(counts)
    starts = ends - counts
    nonempty = counts > 0
    return np.unique(np.concatenate([order[starts[nonempty]], order[ends[nonempty] - 1]]))


def downsample(steps: np.ndarray, values: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    keep = minmax_indices(values, max_points)
    return steps[keep], values[keep]
