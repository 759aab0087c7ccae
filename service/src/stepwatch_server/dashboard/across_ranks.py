"""Per step, the maximum over ranks: the amax a module reached anywhere in the run at that step.

FP8 overflows wherever the largest value is, so the dashboard shows each module's amax as the max
over ranks (the read API's `/tensors` answers per rank, which at 512 ranks is 512 lines per module).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stepwatch_server.runs.queries import RankSeries


def max_over_ranks(series: Sequence[RankSeries]) -> tuple[np.ndarray, np.ndarray]:
    """(steps, max over the ranks that have a value there); a NaN on any rank makes the step NaN."""
    if not series:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
    steps = np.concatenate([s.steps for s in series])
    values = np.concatenate([s.values for s in series])
    unique, inverse = np.unique(steps, return_inverse=True)
    out = np.full(unique.shape[0], -np.inf)
    np.maximum.at(out, inverse, values)  # NaN propagates through maximum, as it should here
    return unique, out
