"""Detector throughput: values per second through the `DetectionEngine` with every detector, one core.

A 512-rank simulator scenario (a 2x forward straggler from early on, so its anomaly keeps updating, and
a NaN in one layer on one rank later; fingerprints, sampled activation amax and per-parameter grad
norms as the agent sends them) is generated and validated first (`parse_batch`, as ingest does),
outside the timing. Then the batches go, in the simulator's arrival order, through one
`DetectionEngine` with all ten detectors registered, pinned to one CPU core; the script reports the
values fed per second (what ingest counts as stored: every metric, tensor, fingerprint and event
value), the batches and rank-steps per second, and, with `--profile`, where the time goes.
The first `--warmup-steps` steps are fed before the clock starts (detectors judge nothing in the
first steps of a run: timing them would flatter the figure).

    .venv/bin/python bench/detector_throughput.py                      # 512 ranks x 300 steps
    .venv/bin/python bench/detector_throughput.py --ranks 64 --steps 2000 --profile
"""

from __future__ import annotations

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")  # one core: no BLAS threads behind numpy's back

import argparse  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402
import time  # noqa: E402

from stepwatch_server.detect import DetectionEngine  # noqa: E402
from stepwatch_server.detect.registry import DETECTORS  # noqa: E402
from stepwatch_server.ingest.schema import Batch  # noqa: E402
from stepwatch_server.ingest.validate import parse_batch  # noqa: E402
from stepwatch_server.simulate import NonFinite, Scenario, Simulation, Straggler  # noqa: E402

TARGET_VALUES_PER_S = 1_000_000


def scenario(world_size: int, steps: int) -> Scenario:
    return Scenario(
        "bench_detector_throughput",
        world_size,
        steps,
        seed=512,
        warmup_steps=20,
        faults=(
            Straggler(world_size // 2, 20, factor=2.0),
            NonFinite(max(60, int(steps * 0.7)), ranks=(world_size // 3,), module="layers.3.attn.qkv"),
        ),
    )


def batches(sc: Scenario) -> list[Batch]:
    return [parse_batch(doc) for doc in Simulation(sc)]


def n_values(batch: Batch) -> int:
    return batch.value_rows()


def feed(engine: DetectionEngine, todo: list[Batch]) -> int:
    changed = 0
    for batch in todo:
        changed += len(engine.feed(batch, wall_now=0.0))
    return changed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=512)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup-steps", type=int, default=40, help="fed before the clock starts")
    p.add_argument("--cpu", type=int, default=None, help="core to pin to (default: the first allowed)")
    p.add_argument("--profile", action="store_true", help="print the 25 costliest functions")
    a = p.parse_args()
    if hasattr(os, "sched_setaffinity"):
        allowed = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {a.cpu if a.cpu is not None else allowed[0]})
    sc = scenario(a.ranks, a.steps)
    t0 = time.perf_counter()
    all_batches = batches(sc)
    print(
        f"detector_throughput: {a.ranks} ranks x {a.steps} steps: {len(all_batches)} batches "
        f"generated and validated in {time.perf_counter() - t0:.1f} s; detectors: "
        + ", ".join(cls.kind for cls in DETECTORS),
        flush=True,
    )
    warm = [b for b in all_batches if b.steps.size and int(b.steps[-1]) <= a.warmup_steps]
    timed = [b for b in all_batches if not (b.steps.size and int(b.steps[-1]) <= a.warmup_steps)]
    engine = DetectionEngine()
    feed(engine, warm)
    values = sum(n_values(b) for b in timed)
    rank_steps = sum(int(b.steps.size) for b in timed)
    profiler = cProfile.Profile() if a.profile else None
    cpu0, t0 = time.process_time(), time.perf_counter()
    if profiler is not None:
        profiler.enable()
    changed = feed(engine, timed)
    if profiler is not None:
        profiler.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    rate = values / cpu
    kinds = sorted({a.kind for a in engine.open_anomalies()} | {a.kind for rd in engine.runs.values()
                                                                for a in rd.ctx.book.resolved})  # fmt: skip
    print(
        f"detector_throughput: {len(timed)} batches, {rank_steps:,} rank-steps, {values:,} values in "
        f"{cpu:.2f} s CPU ({wall:.2f} s wall): {rate:,.0f} values/s, {rank_steps / cpu:,.0f} rank-steps/s, "
        f"{len(timed) / cpu:,.0f} batches/s on one core; {changed} anomaly changes; kinds found: {kinds}",
        flush=True,
    )
    verdict = "meets" if rate >= TARGET_VALUES_PER_S else "MISSES"
    print(f"detector_throughput: {verdict} the target of {TARGET_VALUES_PER_S:,} values/s", flush=True)
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
