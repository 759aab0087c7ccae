"""Accelerate with stepwatch: `stepwatch.attach(model, optimizer)` after `accelerator.prepare` is the one line.

A small regression trained with gradient accumulation; alone, or under `accelerate launch` / torchrun (each
process a rank). The collector is STEPWATCH_URL.

    python examples/accelerate_loop.py --steps 50
    accelerate launch --num_processes 2 examples/accelerate_loop.py --steps 50
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator

import stepwatch


class Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(x), y)  # a scalar output: the loss stepwatch records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--run", default="accelerate-example")
    a = p.parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = Regression()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8192, 16, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    watch = stepwatch.attach(model, optimizer, run=a.run)  # <- the one line

    step = 0
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = model(x, y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            if step == a.steps:
                break
    watch.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
