"""Lightning with stepwatch: `callbacks=[StepwatchCallback(run=...)]` is the one addition.

A small regression fitted on the CPU or a GPU; alone, or on several processes (`--devices 2`, Lightning starts
them). The collector is STEPWATCH_URL.

    python examples/lightning_fit.py --steps 50
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch

from stepwatch.integrations.lightning import StepwatchCallback


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--run", default="lightning-example")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--root-dir", default="/tmp/stepwatch-lightning-example")
    a = p.parse_args()
    x = torch.randn(4096, 16, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    train = torch.utils.data.DataLoader(data, batch_size=32)
    val = torch.utils.data.DataLoader(torch.utils.data.Subset(data, range(256)), batch_size=32)
    trainer = pl.Trainer(
        max_steps=a.steps,
        devices=a.devices,
        val_check_interval=max(1, a.steps // 2),
        check_val_every_n_epoch=None,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=a.root_dir,
        callbacks=[StepwatchCallback(run=a.run)],  # <- the one addition
    )
    trainer.fit(Regression(), train, val)


if __name__ == "__main__":
    main()
