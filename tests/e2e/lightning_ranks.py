"""One rank of a Lightning fit with `StepwatchCallback` (run as a subprocess; Lightning's own environment:
`LOCAL_RANK`, `NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT`, so that it starts no processes itself).

`python -m tests.e2e.lightning_ranks --rank R --world-size N --master-port P --url URL --run NAME --steps S
--deadline-s D --out DIR [--nan-rank F --nan-step K] [--val-sleep-s X]` fits a small MLP regression with
`strategy="ddp"` on the CPU (gloo), `accumulate_grad_batches=2`, a validation every `VAL_EVERY` optimizer
steps (each of its batches waits `--val-sleep-s`, so the pause is long enough to see) and a checkpoint at the
end. `training_step` calls `self.net(x)`, not `self(x)`, as many modules do. Each rank writes DIR/rank-R.json:
per optimizer step (Lightning's `global_step` after it, from 1) the mean of its micro-batches' losses and the
gradient norm Lightning's `on_before_optimizer_step` sees, read by the test here (the agent never syncs).
With `--nan-rank`, that rank's `NAN_MODULE` returns NaN in the training forwards of step `--nan-step`.

The process exits by itself at the deadline (os._exit from a timer thread), whatever Lightning is doing.
"""

from __future__ import annotations

import json
import os
import time

import torch

from tests.e2e.trainer_ranks import exit_at, poison, rank_arguments

NAN_MODULE = "net.2"
VAL_EVERY = 10  # optimizer steps
ACCUMULATE = 2


def main() -> None:
    p = rank_arguments()
    p.add_argument("--val-sleep-s", type=float, default=0.0)
    a = p.parse_args()
    exit_at(a.deadline_s)
    os.environ.update(
        LOCAL_RANK=str(a.rank), NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.master_port)
    )
    import lightning.pytorch as pl

    from stepwatch.integrations.lightning import StepwatchCallback

    torch.set_num_threads(1)
    seen: dict[int, dict[str, float]] = {}
    micro: list[float] = []

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            micro.append(loss.item())
            return loss

        def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
            time.sleep(a.val_sleep_s)
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            grads = [q.grad for q in self.parameters() if q.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads))
            seen[self.trainer.global_step + 1] = {"loss": sum(micro) / len(micro), "grad_norm": norm}
            micro.clear()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    model = Regression()
    nan_now = {"on": False}
    if a.rank == a.nan_rank:
        poison(model.get_submodule(NAN_MODULE), nan_now)

    class Faults(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
            nan_now["on"] = trainer.global_step + 1 == a.nan_step

    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    val = torch.utils.data.DataLoader(torch.utils.data.Subset(data, range(32)), batch_size=8)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=a.world_size,
        num_nodes=1,
        strategy="ddp",
        max_steps=a.steps,
        accumulate_grad_batches=ACCUMULATE,
        val_check_interval=VAL_EVERY * ACCUMULATE,  # in batches
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(a.out / f"lightning-{a.rank}"),
        callbacks=[
            Faults(),
            StepwatchCallback(run=a.run, url=a.url, spool_dir=a.spool_dir, flush_interval_s=0.5),
        ],
    )
    trainer.fit(model, loader, val)
    (a.out / f"rank-{a.rank}.json").write_text(json.dumps(seen))
    print(f"lightning_ranks: rank {a.rank} done", flush=True)


if __name__ == "__main__":
    main()
