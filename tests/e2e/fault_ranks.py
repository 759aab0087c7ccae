"""One rank of a 4-rank gloo DDP run with a real fault injected on one rank (run as a subprocess).

`python -m tests.e2e.fault_ranks --rank R --world-size 4 --master-port P --url URL --run NAME
--fault KIND --fault-rank F --fault-step S --steps N --deadline-s D` trains a tiny MLP on the CPU with
`stepwatch.attach(...)` and, on rank F from step S on, injects KIND for real inside the process:

- `slow_forward`: the `slow` module, which on every rank waits `DEVICE_FORWARD_S` (a device's compute
  time), sleeps `SLOW_FORWARD_S` longer (the rank computes slower; the others wait for it in the gradient
  all-reduce inside backward);
- `slow_op`: like `slow_forward`, but the extra time is a real operator: the faulty rank's `slow` module
  computes `torch.cdist` of two (HEAVY_ROWS x 64) matrices (~20 ms on one CPU thread) in its forward, so that a
  profiler trace names it (tests/e2e/test_commands.py);
- `stop`: the rank stops stepping (sleeps before its next forward until the deadline); the others block in
  their all-reduce;
- `nan`: the `poison` module returns NaN; like a mixed-precision loop, every rank skips the optimizer step
  when the all-reduced gradients are non-finite;
- `leak`: the loop keeps a list of the tensors it makes each step (1 MB a step), so the rank's memory grows;
- `slow_data`: the rank's data loader takes `--fault-data-ms` per step instead of `--data-ms` (a starved
  loader); the others wait for it in the gradient all-reduce;
- `eval`: an evaluation nobody marked with `watch.phase`: at step S every rank (whatever F) runs forwards of
  the DDP model under `torch.no_grad()` for `--pause-s` seconds, all-reduces its eval loss, and trains on;
- `none`: no fault (a healthy run);
- `slow_fetch`: rank F's data loader blocks inside `slow_fetch()` from step S on (until the deadline), while
  the others wait for it in their all-reduce (tests/e2e/test_commands.py reads every rank's stacks);
- `checkpoint`: a checkpoint nobody marked: at step S rank F spends `--pause-s` seconds inside `torch.save`
  (to a file object whose first `write` waits that long), while the others wait for it in `dist.barrier()`.

With `--buffers` the model holds a registered buffer, as a GPT with its causal mask does: DDP broadcasts
it at the start of every forward, so the ranks ahead wait for a slow one there (inside forward), not in
backward's all-reduce.

Every process is bounded: it exits by itself at `--deadline-s` seconds after start (the collective timeout
is shorter than that), and the test kills what is left.
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import time
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import stepwatch

WIDTH = 64
BATCH = 32
LEAK_FLOATS_PER_STEP = 1 << 18  # 1 MB of float32 kept per step
SLOW_FORWARD_S = 0.02
HEAVY_ROWS = 700
# Every rank's forward also waits this long, standing for a device's steady compute time: a bare CPU forward
# of this tiny MLP takes ~0.7 ms, and on a loaded 2-core machine its scheduler jitter (p90 2.2 ms) made the
# healthy ranks' forward ratios as noisy as a straggler's clipped signal (the straggler test failed 1 run in
# 3 beside a CPU-burning process). Real forwards take milliseconds or more.
DEVICE_FORWARD_S = 0.008
DATA_MS = 5.0  # a data loader's pace: also keeps 4 processes from saturating a 2-core machine
EVAL_BATCH_PAUSE_S = 0.02  # between eval batches (a loader's pace; also spares a 2-core machine's CPUs)
SLEEP_SLICE_S = 0.2  # a long wait sleeps in slices, each checking the process deadline


class Fault(torch.nn.Module):
    """Identity, except on the faulty rank from the fault step on (the training loop sets `active`)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.active = False
        self.heavy: torch.Tensor | None = None  # slow_op: the operands of the extra operator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "slow_forward":
            time.sleep(DEVICE_FORWARD_S + (SLOW_FORWARD_S if self.active and self.heavy is None else 0.0))
            if self.active and self.heavy is not None:
                # a real operator, slow, whose time is its own (no matmul inside): what the trace must name
                torch.cdist(self.heavy, self.heavy, compute_mode="donot_use_mm_for_euclid_dist")
            return x
        if not self.active:
            return x
        return x * float("nan")


class SlowFile(io.BytesIO):
    """A file object on slow storage: its first write takes `wait_s` (bounded by `deadline`)."""

    def __init__(self, wait_s: float, deadline: float) -> None:
        super().__init__()
        self.wait_until = min(time.monotonic() + wait_s, deadline)

    def write(self, data: Any) -> int:
        while time.monotonic() < self.wait_until:
            time.sleep(SLEEP_SLICE_S)
        return super().write(data)


def unmarked_eval(ddp: torch.nn.Module, pause_s: float, deadline: float, gen: torch.Generator) -> None:
    """Forwards under no_grad for `pause_s` (no watch.phase), then the eval loss all-reduced."""
    until = min(time.monotonic() + pause_s, deadline)
    total, n = torch.zeros(()), 0
    with torch.no_grad():
        while time.monotonic() < until:
            x = torch.randn(BATCH, 16, generator=gen)
            total += torch.nn.functional.mse_loss(ddp(x), x[:, :1])
            n += 1
            time.sleep(EVAL_BATCH_PAUSE_S)
    dist.all_reduce(total)


def slow_fetch(deadline: float) -> None:
    """A data loader's fetch that never returns (until the process's deadline)."""
    while time.monotonic() < deadline:
        time.sleep(SLEEP_SLICE_S)


def build_model() -> torch.nn.Sequential:
    torch.manual_seed(0)  # identical initial weights on every replica
    return torch.nn.Sequential(
        OrderedDict(
            fc1=torch.nn.Linear(16, WIDTH),
            act=torch.nn.GELU(),
            slow=Fault("slow_forward"),
            poison=Fault("nan"),
            fc2=torch.nn.Linear(WIDTH, 1),
        )
    )


def init_gloo(rank: int, world_size: int, master_port: int, deadline_s: float) -> float:
    """Join the loopback gloo group, one CPU thread; the process's deadline (monotonic), which the
    collective timeout stays under."""
    deadline = time.monotonic() + deadline_s
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=max(5.0, deadline_s - 5.0))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    return deadline


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    for name in ("--rank", "--world-size", "--master-port", "--fault-rank", "--fault-step", "--steps"):
        p.add_argument(name, type=int, required=True)
    for name in ("--url", "--run", "--fault"):
        p.add_argument(name, required=True)
    p.add_argument("--deadline-s", type=float, required=True)
    p.add_argument("--data-ms", type=float, default=DATA_MS, help="every rank's data loader time per step")
    p.add_argument("--fault-data-ms", type=float, default=DATA_MS, help="slow_data: the faulty rank's")
    p.add_argument("--spool-dir", required=True)
    p.add_argument("--pause-s", type=float, default=0.0, help="length of an unmarked eval or checkpoint")
    p.add_argument(
        "--buffers",
        action="store_true",
        help="a registered buffer (a GPT's causal mask): DDP broadcasts it in forward",
    )
    a = p.parse_args(argv)
    deadline = init_gloo(a.rank, a.world_size, a.master_port, a.deadline_s)
    model = build_model()
    if a.buffers:  # DDP then starts every forward with a broadcast: the ranks ahead wait for the last there
        model.register_buffer("mask", torch.ones(WIDTH))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    watch = stepwatch.attach(
        ddp,
        optimizer,
        run=a.run,
        url=a.url,
        track=["module.poison"],
        spool_dir=a.spool_dir,
        flush_interval_s=0.2,
        heartbeat_interval_s=0.5,
    )
    faulty = a.rank == a.fault_rank
    gen = torch.Generator().manual_seed(1000 + a.rank)  # each rank sees its own shard of the data
    kept: list[torch.Tensor] = []
    for step in range(1, a.steps + 1):
        if time.monotonic() > deadline:
            break
        if step == a.fault_step and a.fault == "eval":
            unmarked_eval(ddp, a.pause_s, deadline, gen)
        if step == a.fault_step and a.fault == "checkpoint":
            if faulty:
                torch.save(model.state_dict(), SlowFile(a.pause_s, deadline))
            dist.barrier()
        if faulty and step >= a.fault_step:
            if a.fault == "stop":
                while time.monotonic() < deadline:  # stuck before its forward: never steps again
                    time.sleep(0.2)
                break
            if a.fault == "slow_fetch":
                slow_fetch(deadline)
                break
            if a.fault == "leak":
                kept.append(torch.ones(LEAK_FLOATS_PER_STEP))
            model.slow.active = a.fault in ("slow_forward", "slow_op")
            if a.fault == "slow_op" and model.slow.heavy is None:
                model.slow.heavy = torch.randn(HEAVY_ROWS, 64, generator=torch.Generator().manual_seed(0))
            model.poison.active = a.fault == "nan"
        slow_data = faulty and a.fault == "slow_data" and step >= a.fault_step
        time.sleep((a.fault_data_ms if slow_data else a.data_ms) / 1000)
        x = torch.randn(BATCH, 16, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), x[:, :1])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        watch.log(loss=loss)
        grad_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1e9)
        if torch.isfinite(grad_norm):  # a host sync, as AMP's GradScaler does: skip non-finite updates
            optimizer.step()
        else:
            optimizer.zero_grad(set_to_none=True)
            optimizer.step()  # no gradients: a skipped update, still one record for this rank
    watch.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
