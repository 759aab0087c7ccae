"""A nanoGPT-style training script with stepwatch: the one line is `stepwatch.attach(...)` below.

A small character-level GPT trained on this file's own text (no download), on the CPU or a GPU. Run alone:

    python examples/nanogpt.py --steps 200

on several processes with torchrun (examples/torchrun.sh) or SLURM (examples/slurm.sbatch): each process is
one data-parallel rank (DDP; gloo on the CPU, NCCL on GPUs). The collector is STEPWATCH_URL (default
http://127.0.0.1:8000, e.g. `stepwatch-server demo` or `serve`); the run is --run, else STEPWATCH_RUN, else
under SLURM `<job name>-<job id>`.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import stepwatch


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(
            logits.view(-1, logits.shape[-1]), targets.view(-1)
        )  # the loss stepwatch finds


def launcher_rank() -> tuple[int, int, int]:
    """(rank, local rank, world size) from torchrun's or SLURM's environment; (0, 0, 1) alone."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["WORLD_SIZE"])
    if "SLURM_NTASKS" in os.environ:
        env = os.environ
        return int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env["SLURM_NTASKS"])
    return 0, 0, 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--run", default=None, help="run name (default: STEPWATCH_RUN, or the SLURM job's)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    a = p.parse_args()

    rank, local_rank, world = launcher_rank()
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if world > 1:
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    torch.manual_seed(0)

    text = Path(__file__).read_bytes()
    data = torch.tensor(list(text), dtype=torch.long)
    model = GPT(vocab=256, block=a.block).to(device)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr)

    watch = stepwatch.attach(model, optimizer, run=a.run)  # <- the one line

    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    for step in range(1, a.steps + 1):
        starts = torch.randint(0, len(data) - a.block - 1, (a.batch,), generator=gen)
        x = torch.stack([data[s : s + a.block] for s in starts]).to(device)
        y = torch.stack([data[s + 1 : s + a.block + 1] for s in starts]).to(device)
        for group in optimizer.param_groups:  # cosine decay
            group["lr"] = a.lr * 0.5 * (1 + math.cos(math.pi * step / a.steps))
        loss = model(x, y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0 and (step % 50 == 0 or step == a.steps):
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    watch.close()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
