"""A real 2-rank data-parallel training run (torch.distributed, gloo, DDP, CPU) with the one-line
attach, feeding a collector: the run the Prometheus/Grafana tests look at. Like the demo's run
(stepwatch_server.demo.train_rank), plus one non-finite loss on rank 1 at `NAN_STEP` (logged, not
trained on), so that the numerics panels and the anomaly annotations have something to show."""

from __future__ import annotations

import os
from typing import Any

NAN_STEP = 40


def train_rank(
    rank: int, world_size: int, master_port: int, url: str, run: str, steps: int, spool: str
) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import stepwatch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    watch: Any = stepwatch.attach(
        ddp,
        optimizer,
        run=run,
        url=url,
        amax_every=5,
        flush_interval_s=0.3,
        heartbeat_interval_s=0.5,
        spool_dir=os.path.join(spool, f"rank-{rank}"),
    )
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(1, steps + 1):
        x = torch.randn(16, 16, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), x[:, :1])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nan = rank == 1 and step == NAN_STEP
        watch.log(loss=torch.tensor(float("nan")) if nan else loss)
        optimizer.step()
    watch.close()
    dist.destroy_process_group()
