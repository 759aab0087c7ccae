"""Every script in examples/ runs for a few steps against a real collector (`stepwatch-server serve` on
loopback, SQLite) and its run is stored whole: nanoGPT alone, under torchrun (examples/torchrun.sh, 2
processes) and as a SLURM job (examples/slurm.sbatch run by bash with a stand-in `srun` that starts its 2
tasks here, as srun would, with SLURM's environment: the run is named `<job name>-<job id>`), and the Hugging
Face Trainer, Lightning and Accelerate scripts. Every process is bounded by a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import require_module
from tests.e2e.conftest import Collector, free_port
from tests.e2e.test_detection_real import anomalies, detection_idle

require_module("torch")
require_module("transformers")
require_module("lightning")

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240.0
STEPS = 12

# srun as SLURM runs a job step: each task the command, with its SLURM_PROCID / SLURM_LOCALID.
FAKE_SRUN = """#!/usr/bin/env bash
for ((i = 0; i < SLURM_NTASKS; i++)); do SLURM_PROCID=$i SLURM_LOCALID=$i "$@" & done
status=0; for job in $(jobs -p); do wait "$job" || status=1; done; exit $status
"""


def run_example(cmd: list[str], tmp_path: Path, **env: str) -> None:
    environ = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **env}
    log = tmp_path / "example.log"
    with log.open("wb") as out:
        proc = subprocess.run(
            cmd, cwd=REPO, env=environ, stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT_S
        )
    assert proc.returncode == 0, log.read_text()[-4000:]


def assert_stored_whole(collector: Collector, run: str, ranks: list[int], steps: int = STEPS) -> None:
    detection_idle(collector)
    body = collector.get(f"/api/v1/runs/{run}/series?metric=loss&rank=all&max_points=10000")
    stored = {s["rank"]: s["steps"] for s in body["series"]}
    assert stored == {rank: list(range(1, steps + 1)) for rank in ranks}, stored
    found = anomalies(collector, run)
    assert found == [], "\n".join(f"{a['kind']} rank {a['rank']}: {a['summary']}" for a in found)


def test_nanogpt_alone(collector: Collector, tmp_path: Path) -> None:
    run = f"nanogpt-{uuid.uuid4().hex[:6]}"
    cmd = [sys.executable, "examples/nanogpt.py", "--steps", str(STEPS), "--run", run]
    run_example(cmd, tmp_path, STEPWATCH_URL=collector.url)
    assert_stored_whole(collector, run, [0])


def test_nanogpt_under_torchrun(collector: Collector, tmp_path: Path) -> None:
    run = f"torchrun-{uuid.uuid4().hex[:6]}"
    env = {"STEPWATCH_URL": collector.url, "NPROC": "2", "STEPS": str(STEPS), "RUN": run}
    run_example(["bash", "examples/torchrun.sh"], tmp_path, **env)
    assert_stored_whole(collector, run, [0, 1])


def test_nanogpt_as_a_slurm_job_is_the_run_named_after_the_job(collector: Collector, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    job = str(uuid.uuid4().int % 10**7)
    env = {
        "STEPWATCH_URL": collector.url,
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "SLURM_JOB_ID": job,
        "SLURM_JOB_NAME": "nanogpt",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "localhost",
        "MASTER_PORT": str(free_port()),
        "STEPS": str(STEPS),
    }
    run_example(["bash", "examples/slurm.sbatch"], tmp_path, **env)
    assert_stored_whole(collector, f"nanogpt-{job}", [0, 1])


@pytest.mark.parametrize(
    ("script", "extra"),
    [
        ("examples/hf_trainer.py", ["--output-dir"]),
        ("examples/lightning_fit.py", ["--root-dir"]),
        ("examples/accelerate_loop.py", []),
    ],
)
def test_each_integration_example(
    collector: Collector, tmp_path: Path, script: str, extra: list[str]
) -> None:
    run = f"{Path(script).stem}-{uuid.uuid4().hex[:6]}"
    cmd = [sys.executable, script, "--steps", str(STEPS), "--run", run]
    if extra:
        cmd += [extra[0], str(tmp_path / "out")]
    run_example(cmd, tmp_path, STEPWATCH_URL=collector.url)
    assert_stored_whole(collector, run, [0])
