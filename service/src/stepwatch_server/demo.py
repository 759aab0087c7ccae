"""`stepwatch-server demo`: the collector plus a real multi-rank training run feeding it.

The run is genuine synchronous data-parallel training: `--ranks` processes, torch.distributed with the
gloo backend, a small MLP wrapped in DistributedDataParallel on the CPU, each rank attached with the
one-line `stepwatch.attach`. It needs torch and the `stepwatch` agent (installed by scripts/setup.sh).
"""

from __future__ import annotations

import math
import os
import socket
import sys
import time
from typing import Any

from stepwatch_server.serving import BackgroundServer
from stepwatch_server.settings import Settings

EVAL_EVERY_STEPS = 500
EVAL_PAUSE_S = 1.0
WARMUP_STEPS = 100
PEAK_LR = 3e-3
BATCH = 64
WIDTH = 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lr_at(step: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total - WARMUP_STEPS)
    return PEAK_LR * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_rank(rank: int, world_size: int, master_port: int, url: str, run: str, steps: int) -> None:
    """One rank of the demo run (the target of torch.multiprocessing.spawn)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import stepwatch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)  # identical initial weights on every replica
    model = torch.nn.Sequential(
        torch.nn.Linear(32, WIDTH),
        torch.nn.GELU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.GELU(),
        torch.nn.Linear(WIDTH, 1),
    )
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=PEAK_LR, weight_decay=0.01)
    watch = stepwatch.attach(ddp, optimizer, run=run, url=url)

    data_rng = torch.Generator().manual_seed(1000 + rank)  # each rank sees its own shard of the data
    teacher = torch.nn.Linear(32, 1)
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, steps)
        x = torch.randn(BATCH, 32, generator=data_rng)
        y = teacher(x).detach() + 0.1 * torch.randn(BATCH, 1, generator=data_rng)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        watch.log(loss=loss)  # a device tensor: no sync; it belongs to the step that optimizer.step() ends
        optimizer.step()
        if (step + 1) % EVAL_EVERY_STEPS == 0:
            with watch.phase("eval"):
                time.sleep(EVAL_PAUSE_S)
    watch.close()
    dist.destroy_process_group()


def run_demo(
    settings: Settings, *, host: str, port: int, ranks: int, steps: int, run: str, keep_serving: bool
) -> int:
    try:
        import torch.multiprocessing as mp

        import stepwatch  # noqa: F401  (fail early with a clear message, not inside four processes)
    except ImportError as exc:
        print(
            f"stepwatch-server demo needs torch and the stepwatch agent ({exc}); run scripts/setup.sh",
            file=sys.stderr,
        )
        return 2

    server = BackgroundServer(settings, host=host, port=port).start()
    base = server.url
    print(f"stepwatch demo: collector on {base} (database {settings.redacted_database_url})", flush=True)
    print(f"stepwatch demo: training run {run!r}: {ranks} ranks x {steps} steps (gloo, DDP, CPU)", flush=True)
    print("stepwatch demo: look at", flush=True)
    for path in (
        "/api/v1/runs",
        f"/api/v1/runs/{run}/ranks",
        f"/api/v1/runs/{run}/series?metric=loss&rank=all",
        f"/api/v1/runs/{run}/tensors?stat=amax",
        "/docs",
    ):
        print(f"    {base}{path}", flush=True)
    started = time.monotonic()
    args: tuple[Any, ...] = (ranks, _free_port(), base, run, steps)
    try:
        mp.spawn(train_rank, args=args, nprocs=ranks, join=True)
    except Exception as exc:  # a failed rank: say so, keep the collector's data
        print(f"stepwatch demo: training failed: {exc}", file=sys.stderr, flush=True)
        server.stop()
        return 1
    print(f"stepwatch demo: training done in {time.monotonic() - started:.1f} s", flush=True)
    if keep_serving:
        print("stepwatch demo: the collector keeps serving; Ctrl-C to stop", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    server.stop()
    return 0
