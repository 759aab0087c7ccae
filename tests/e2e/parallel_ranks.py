"""One rank of a gloo run of a tiny transformer-style block under a real parallel stack (a subprocess).

`python -m tests.e2e.parallel_ranks --rank R --world-size N --master-port P --url URL --run NAME
--stack STACK --steps S --deadline-s D --spool-dir DIR --out FILE [--perturb-rank R --perturb-step K]`

STACK is one of
- `fsdp2`: `fully_shard` on each Linear and on the root, over a 1-D mesh of all ranks (no replicas);
- `hsdp`: `fully_shard` over a 2-D mesh (replicate x shard: N/2 replicas of 2 shards);
- `tp`: `parallelize_module` with `ColwiseParallel` on fc1 and `RowwiseParallel` on fc2 over all ranks;
  the LayerNorm and the head stay plain tensors, a full copy on every rank;
- `tp_fsdp`: tensor parallel inside (tp = 2) and FSDP2 across (dp = N/2) on a 2-D mesh;
- `tp_sp`: tensor and sequence parallel over all ranks: fc1 colwise, fc2 rowwise into a
  sequence-sharded LayerNorm (`SequenceParallel`), whose weights and fc2's bias are `Replicate()`
  DTensors (held whole by every rank: counted once in the norm), then the sequence gathered for the
  plain head; inputs (batch, 4, width), sharded on the sequence.

Every step the rank computes the model's true gradient norm itself (each DTensor gradient's
`full_tensor()`, plain gradients as they are) and rank 0 writes them to `--out` as JSON
(`{"norms": {step: norm}}`). With `--perturb-rank`, that rank adds 1e-3 to its local shard of fc1's
weight after the optimizer step of `--perturb-step` (a replica that silently diverged).

Every process exits by itself at `--deadline-s` (the collective timeout is shorter).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import stepwatch
from tests.e2e.fault_ranks import init_gloo

WIDTH, HIDDEN, BATCH = 16, 32, 8
STACKS = ("fsdp2", "hsdp", "tp", "tp_fsdp", "tp_sp")
SEQ = 4  # tp_sp: the sequence length its inputs are sharded along


def build_model() -> torch.nn.Sequential:
    torch.manual_seed(0)  # identical initial weights on every rank
    return torch.nn.Sequential(
        OrderedDict(
            fc1=torch.nn.Linear(WIDTH, HIDDEN),
            act=torch.nn.GELU(),
            fc2=torch.nn.Linear(HIDDEN, WIDTH),
            norm=torch.nn.LayerNorm(WIDTH),
            head=torch.nn.Linear(WIDTH, 1),
        )
    )


def parallelize(model: torch.nn.Sequential, stack: str, world_size: int) -> int:
    """Apply the stack in place; returns the data-parallel index (ranks with one index see the same data)."""
    rank = dist.get_rank()
    if stack == "fsdp2":
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        for name in ("fc1", "fc2", "head"):
            fully_shard(getattr(model, name), mesh=mesh)
        fully_shard(model, mesh=mesh)
        return rank
    if stack == "hsdp":
        mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("replicate", "shard"))
        for name in ("fc1", "fc2", "head"):
            fully_shard(getattr(model, name), mesh=mesh)
        fully_shard(model, mesh=mesh)
        return rank
    if stack == "tp":
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        return 0  # every rank of one tensor-parallel group sees the same batch
    if stack == "tp_fsdp":
        mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        for name in ("fc1", "fc2", "head"):
            fully_shard(getattr(model, name), mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return rank // 2
    if stack == "tp_sp":
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        plan = {
            "fc1": ColwiseParallel(input_layouts=Shard(1)),
            "fc2": RowwiseParallel(output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            # the whole sequence back on every rank for the plain head (one output: nothing to split)
            "head": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
        }
        parallelize_module(model, mesh, plan)  # type: ignore[arg-type]
        return 0
    raise ValueError(f"--stack must be one of {STACKS}, got {stack!r}")


def true_grad_norm(model: torch.nn.Module) -> float:
    """The model's gradient norm, from the full gradients (a collective: every rank calls it), without
    the gradients still Partial (a sequence-parallel LayerNorm's), which the agent leaves out and says so."""
    total = 0.0
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor) and any(q.is_partial() for q in g.placements):
            continue
        full = g.full_tensor() if isinstance(g, DTensor) else g
        total += float(full.double().pow(2).sum())
    return total**0.5


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    for name in ("--rank", "--world-size", "--master-port", "--steps"):
        p.add_argument(name, type=int, required=True)
    for name in ("--url", "--run", "--stack", "--spool-dir", "--out"):
        p.add_argument(name, required=True)
    p.add_argument("--deadline-s", type=float, required=True)
    p.add_argument("--perturb-rank", type=int, default=-1)
    p.add_argument("--perturb-step", type=int, default=0)
    p.add_argument("--fingerprint-every", type=int, default=20)
    a = p.parse_args(argv)
    deadline = init_gloo(a.rank, a.world_size, a.master_port, a.deadline_s)
    model = build_model()
    data_index = parallelize(model, a.stack, a.world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = stepwatch.attach(
        model,
        optimizer,
        run=a.run,
        url=a.url,
        spool_dir=a.spool_dir,
        flush_interval_s=0.2,
        heartbeat_interval_s=0.5,
        fingerprint_every=a.fingerprint_every,
    )
    gen = torch.Generator().manual_seed(1000 + data_index)
    norms: dict[int, float] = {}
    for step in range(1, a.steps + 1):
        if time.monotonic() > deadline:
            break
        time.sleep(0.002)  # a data loader's pace: spares a 2-core machine's CPUs
        if a.stack == "tp_sp":  # each rank its part of the sequence; the target whole
            x = torch.randn(BATCH, SEQ, WIDTH, generator=gen)
            inputs = x.chunk(a.world_size, dim=1)[a.rank]
        else:
            x = inputs = torch.randn(BATCH, WIDTH, generator=gen)
        loss = torch.nn.functional.mse_loss(model(inputs), x[..., :1])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norms[step] = true_grad_norm(model)
        optimizer.step()
        if a.rank == a.perturb_rank and step == a.perturb_step:
            with torch.no_grad():
                w = model.fc1.weight
                (w.to_local() if isinstance(w, DTensor) else w).add_(1e-3)
    watch.close()
    if a.rank == 0:
        with open(a.out, "w") as f:
            json.dump({"norms": norms}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
