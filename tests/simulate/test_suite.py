"""The scenario library: coverage, labels, the CLI, and that the faults are detectable at the targets
while the clean runs' look-alikes stay below them (simple oracles on the generated arrays)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

import stepwatch_server.simulate as simulate
from stepwatch_server.simulate import KINDS, QUICK, SCENARIOS, Scenario, Simulation
from stepwatch_server.simulate.__main__ import main
from stepwatch_server.simulate.scenario import Hang, LossSpike, Straggler
from stepwatch_server.simulate.suite import DEMO_BY_KIND, clean_names
from tests.conftest import REPO, python_exe


def test_public_surface_is_honest() -> None:
    for name in simulate.__all__:
        assert hasattr(simulate, name), name
    assert len(set(simulate.__all__)) == len(simulate.__all__)


def test_suite_covers_every_kind_scale_and_mix() -> None:
    assert len(SCENARIOS) >= 24
    kinds = {lab.kind for scn in SCENARIOS.values() for lab in scn.labels}
    assert kinds == set(KINDS)
    sizes = [scn.world_size for scn in SCENARIOS.values()]
    assert min(sizes) == 8 and max(sizes) == 512
    assert sum(len({f.kind for f in scn.faults}) > 1 for scn in SCENARIOS.values()) >= 3
    clean = [SCENARIOS[n] for n in clean_names()]
    assert len(clean) >= 3
    assert any(s.steps >= 20_000 and s.world_size >= 64 and s.eval_every and s.ckpt_every for s in clean)
    tenth = [f for s in SCENARIOS.values() for f in s.faults if isinstance(f, Straggler) and f.factor <= 1.1]
    assert len(tenth) >= 2
    node_failure = SCENARIOS["node_failure_64"]
    assert {lab.kind for lab in node_failure.labels} == {"slow_node", "hang"}
    assert set(QUICK) <= set(SCENARIOS) and set(DEMO_BY_KIND) == set(KINDS)
    for kind, name in DEMO_BY_KIND.items():
        assert kind in {lab.kind for lab in SCENARIOS[name].labels}


def test_labels_name_the_blamed_entity() -> None:
    for scn in SCENARIOS.values():
        for lab in scn.labels:
            assert lab.kind in KINDS
            assert 1 <= lab.first_step <= scn.last_step + (lab.kind == "hang"), (scn.name, lab)
            if lab.rank is not None:
                assert lab.node == scn.node_of(lab.rank)
            if lab.kind in {"straggler", "hang", "memory_leak", "replica_divergence"}:
                assert lab.rank is not None
            if lab.kind == "slow_node":
                assert lab.node is not None and lab.rank is None and lab.ranks
    assert all(not SCENARIOS[n].labels for n in clean_names())


def test_labels_carry_onset_times_after_generation() -> None:
    sim = Simulation(SCENARIOS["hang_slow_steps_16"])
    assert all(lab.first_ts is None for lab in sim.labels)
    for _ in sim:
        pass
    (hang,) = sim.labels
    assert hang.first_ts is not None and hang.first_ts == pytest.approx(sim.ts_of_step(399), abs=0.05)
    assert sim.ts_of_step(400) is None


def test_scenarios_reject_impossible_faults() -> None:
    with pytest.raises(ValueError, match="outside"):
        Scenario("bad", world_size=8, steps=100, faults=(Straggler(8, 10),))
    with pytest.raises(ValueError, match="after the hang"):
        Scenario("bad", world_size=8, steps=100, faults=(Hang(1, 50), LossSpike(60)))


def _series(scn: Scenario, attr: str) -> np.ndarray:
    """One chunk attribute over the whole run, (steps, ranks), from the physics (no batching)."""
    return np.concatenate([getattr(ch, attr) for ch in Simulation(scn).chunks()])


def _rolling_median_ratio(x: np.ndarray, window: int) -> np.ndarray:
    """x[i] / median(x[i-window:i]) for i >= window (NaN before)."""
    out = np.full(x.shape[0], np.nan)
    for i in range(window, x.shape[0]):
        out[i] = x[i] / np.median(x[i - window : i])
    return out


def test_ten_percent_straggler_stands_out_within_50_steps() -> None:
    scn = SCENARIOS["straggler_10pct_fwd_64"]
    fwd = _series(scn, "forward")  # index 0 = step 1
    ratio = fwd / np.median(fwd, axis=1, keepdims=True)
    start = scn.faults[0].start  # type: ignore[union-attr]
    window = np.median(ratio[start - 1 : start + 49], axis=0)  # its first 50 steps
    assert window[17] > 1.07 and np.delete(window, 17).max() < 1.03
    # before it, no rank looks like that in any 50-step window
    clean = np.array([np.median(ratio[a : a + 50], axis=0) for a in range(20, start - 60, 25)])
    assert clean.max() < 1.03


def test_loss_spike_clears_clean_noise_after_warmup() -> None:
    scn = SCENARIOS["loss_spike_small_128"]
    glob = _series(scn, "loss").mean(axis=1)
    ratio = _rolling_median_ratio(glob, 50)
    step = scn.faults[0].step  # type: ignore[union-attr]
    assert ratio[step - 1] > 1.2
    after_warmup = np.r_[scn.warmup_steps : step - 1]
    assert np.nanmax(ratio[after_warmup]) < 1.08


def test_clean_run_look_alikes_stay_below_fault_levels() -> None:
    scn = SCENARIOS["clean_8"]
    glob = _series(scn, "loss").mean(axis=1)
    assert np.nanmax(_rolling_median_ratio(glob, 50)[scn.warmup_steps :]) < 1.1
    grads = _series(scn, "grad_norm")[:, 0]
    assert (
        np.nanmax(_rolling_median_ratio(grads, 50)[scn.warmup_steps :]) > 2.0
    )  # benign grad-norm spikes exist
    fwd = _series(scn, "forward")
    ratio = fwd / np.median(fwd, axis=1, keepdims=True)
    assert ratio.max() > 1.5  # GC blips
    windows = np.array([np.median(ratio[a : a + 50], axis=0) for a in range(20, scn.steps - 50, 25)])
    assert windows.max() < 1.03


def test_cli_list_describe_dump(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    listed = subprocess.run(
        [python_exe(), "-m", "stepwatch_server.simulate", "list"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout.splitlines()
    assert len(listed) == len(SCENARIOS) and all(
        name in line for name, line in zip(SCENARIOS, listed, strict=True)
    )
    assert main(["describe", "node_failure_64"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert [lab["kind"] for lab in described["labels"]] == ["slow_node", "hang"]
    out = tmp_path / "trace.jsonl"
    assert main(["dump", "nonfinite_act_8", "--out", str(out), "--limit", "300"]) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 300 and json.loads(lines[0])["schema"] == 1
    assert "labels" in json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert main(["describe", "nope"]) == 2
    assert "unknown scenario" in capsys.readouterr().err
