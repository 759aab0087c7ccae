"""Min-max downsampling keeps extremes."""

from __future__ import annotations

import numpy as np

from stepwatch_server.runs.downsample import downsample, minmax_indices


def test_short_series_is_untouched() -> None:
    assert minmax_indices(np.arange(10.0), 10).tolist() == list(range(10))


def test_one_step_spike_and_dip_and_nan_survive() -> None:
    rng = np.random.default_rng(0)
    values = rng.normal(2.0, 0.01, 100_000)
    values[12_345] = 80.0
    values[54_321] = -5.0
    values[99_999] = np.nan
    steps = np.arange(100_000, dtype=np.int64) * 10
    s, v = downsample(steps, values, 1000)
    assert len(s) <= 1000 and np.all(np.diff(s) > 0)
    assert 123_450 in s and 80.0 in v and -5.0 in v and np.isnan(v).any()


def test_every_bucket_keeps_its_min_and_max() -> None:
    values = np.sin(np.linspace(0, 20, 5000))
    keep = minmax_indices(values, 100)
    assert 2 < len(keep) <= 100
    assert values[keep].max() == values.max() and values[keep].min() == values.min()
