"""Who holds the run up (`stepwatch_server.timeline`): the culprit is late, the ranks that wait are not.

Each case builds the phase times a synchronous step really produces: every rank starts together, a
collective somewhere in the step makes the early ranks wait there (their phase holding the collective
grows by the wait), and every rank leaves it together.
"""

from __future__ import annotations

import numpy as np
import pytest

from stepwatch_server.timeline import holding_up, late_ms, peer_median


def synchronous_step(
    own: dict[str, np.ndarray], sync_in: str, optimizer_ms: float = 2.0
) -> dict[str, np.ndarray]:
    """Phase times per rank (ranks,) for one step with one collective at the START of phase `sync_in`
    (forward: DDP's buffer broadcast; backward: the all-reduce's last bucket, at its end, is the same
    for this purpose once the last rank's own backward is done, see below)."""
    data, fwd, bwd = own["data"], own["forward"], own["backward"]
    if sync_in == "forward":  # everyone leaves the broadcast when the last rank arrives
        arrive = data
        wait = arrive.max() - arrive
        fwd = fwd + wait
    else:  # all-reduce at the end of backward: arrival = data + forward + own backward
        arrive = data + fwd + bwd
        wait = arrive.max() - arrive
        bwd = bwd + wait
    step = data + fwd + bwd + optimizer_ms
    return {
        "data": data,
        "forward": fwd,
        "backward": bwd,
        "optimizer": np.full(data.shape, optimizer_ms),
        "step": step,
    }


def late_of(t: dict[str, np.ndarray]) -> np.ndarray:
    return late_ms(*(t[k][:, None] for k in ("data", "backward", "optimizer", "step")))[:, 0]


@pytest.mark.parametrize("sync_in", ["forward", "backward"])
@pytest.mark.parametrize("ranks", [2, 4, 64])
def test_a_rank_slow_in_data_is_late_by_its_excess_and_its_victims_are_on_time(
    sync_in: str, ranks: int
) -> None:
    data = np.full(ranks, 5.0)
    data[1] = 45.0  # its loader 9x slower
    t = synchronous_step(
        {"data": data, "forward": np.full(ranks, 10.0), "backward": np.full(ranks, 20.0)}, sync_in
    )
    if sync_in == "forward":  # what fooled the forward heatmap: the victims' forward is the long one
        assert t["forward"][0] > t["forward"][1]
    late = late_of(t)
    assert late[1] == pytest.approx(40.0)
    assert np.abs(np.delete(late, 1)).max() < 1e-9
    assert int(np.argmax(late)) == 1


@pytest.mark.parametrize("ranks", [2, 8])
def test_a_rank_slow_in_compute_is_late_at_the_end_of_its_forward(ranks: int) -> None:
    fwd = np.full(ranks, 10.0)
    bwd = np.full(ranks, 20.0)
    fwd[ranks - 1], bwd[ranks - 1] = 13.0, 26.0  # a GPU 30% slower; DDP: the all-reduce ends backward
    t = synchronous_step({"data": np.full(ranks, 5.0), "forward": fwd, "backward": bwd}, "backward")
    assert t["backward"][0] > t["backward"][ranks - 1]  # the victims wait in backward
    late = late_of(t)
    assert late[ranks - 1] == pytest.approx(3.0)  # its forward's excess: the last point before the sync
    assert np.abs(late[: ranks - 1]).max() < 1e-9


def test_a_healthy_run_is_on_time_within_its_noise() -> None:
    rng = np.random.default_rng(3)
    ranks, steps = 16, 400
    own = {
        k: rng.normal(m, m * 0.03, size=(ranks, steps))
        for k, m in (("data", 5.0), ("forward", 30.0), ("backward", 60.0))
    }
    cols = [synchronous_step({k: v[:, s] for k, v in own.items()}, "backward") for s in range(steps)]
    t = {k: np.stack([c[k] for c in cols], axis=1) for k in cols[0]}
    ratio, median_step = holding_up(t["data"], t["backward"], t["optimizer"], t["step"])
    assert ratio.shape == (ranks, steps) and median_step.shape == (steps,)
    assert np.nanmax(np.abs(ratio - 1)) < 0.1  # per step; a bucket's mean is tighter
    assert np.median(median_step) == pytest.approx(97.0, rel=0.05)


def test_holding_up_is_one_plus_late_over_the_median_step() -> None:
    t = synchronous_step(
        {"data": np.array([5.0, 5.0, 55.0]), "forward": np.full(3, 10.0), "backward": np.full(3, 20.0)},
        "forward",
    )
    ratio, median_step = holding_up(*(t[k][:, None] for k in ("data", "backward", "optimizer", "step")))
    assert median_step[0] == pytest.approx(87.0)  # 55 + 10 + 20 + 2 on every rank
    assert ratio[:, 0] == pytest.approx([1.0, 1.0, 1 + 50 / 87])


def test_missing_values_leave_only_what_is_known() -> None:
    nan = np.nan
    data = np.array([[5.0, nan], [25.0, nan], [5.0, 5.0]])
    other = np.full((3, 2), nan)  # no backward/optimizer/step reported (a sender other than the agent)
    late = late_ms(data, other, other, other)
    assert late[:, 0] == pytest.approx([-10.0, 20.0, -10.0])  # data vs the median of the other two
    assert np.isnan(late[:, 1]).all()  # one rank alone has no peers


def test_peer_median_leaves_the_rank_itself_out() -> None:
    x = np.array([[1.0, 4.0], [2.0, np.nan], [10.0, 6.0]])
    assert peer_median(x)[:, 0] == pytest.approx([6.0, 5.5, 1.5])
    assert peer_median(x)[[0, 2], 1] == pytest.approx([6.0, 4.0])
    assert np.isnan(peer_median(x)[1, 1])
