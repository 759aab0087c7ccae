"""What each trainer integration costs per step over the bare framework loop (README "In a trainer").

For each framework (the Hugging Face Trainer with `StepwatchCallback`, Lightning with its
`StepwatchCallback`, an Accelerate loop with `attach()` after `prepare`) a bare and an attached copy of the
same training run in child processes, one at a time, alternating (the first of each round rotating), so that
drift lands on both alike. Each child trains `--warmup` steps, then times `--steps` steps from the
framework's own step-end event (wall time between consecutive step ends, everything the framework does
included) and reports their median. One CPU thread each; the models are small enough for a step of a few
ms, where the agent's fixed cost shows most. The attached copy ships to a stdlib stub receiver (answers 200)
in another process.

    .venv/bin/python bench/integration_overhead.py [--frameworks hf,lightning,accelerate] [--rounds 5]
        [--steps 300] [--warmup 50] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _servers  # noqa: E402

FRAMEWORKS = ("hf", "lightning", "accelerate")
CHILD_TIMEOUT_S = 600.0


# -- children: one framework, bare or attached ------------------------------------------------------------
def _regression(width: int = 256, depth: int = 4) -> Any:
    import torch

    layers: list[Any] = [torch.nn.Linear(32, width), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def _data(n: int) -> Any:
    import torch

    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))


def child_hf(attached: bool, url: str, steps: int, ends: list[float]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    class Ends(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            ends.append(time.perf_counter())

    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.ids = torch.randint(0, 128, (4096, 64), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    callbacks: list[Any] = [Ends()]
    if attached:
        from stepwatch.integrations.transformers import StepwatchCallback

        callbacks.append(StepwatchCallback(run="bench-hf", url=url))
    args = TrainingArguments(
        output_dir=str(Path(os.environ["BENCH_TMP"]) / "hf"),
        use_cpu=True,
        max_steps=steps,
        per_device_train_batch_size=8,
        save_strategy="no",
        logging_steps=10**9,
        report_to="none",
        disable_tqdm=True,
    )
    Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=Tokens(), callbacks=callbacks).train()


def child_lightning(attached: bool, url: str, steps: int, ends: list[float]) -> None:
    import lightning.pytorch as pl
    import torch

    class Ends(pl.Callback):
        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            ends.append(time.perf_counter())

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _regression()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    callbacks: list[Any] = [Ends()]
    if attached:
        from stepwatch.integrations.lightning import StepwatchCallback

        callbacks.append(StepwatchCallback(run="bench-lightning", url=url))
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(Path(os.environ["BENCH_TMP"]) / "lightning"),
        callbacks=callbacks,
    )
    trainer.fit(Regression(), torch.utils.data.DataLoader(_data(64 * (steps + 10)), batch_size=64))


def child_accelerate(attached: bool, url: str, steps: int, ends: list[float]) -> None:
    import torch
    from accelerate import Accelerator

    class Regression(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _regression()

        def forward(self, x: Any, y: Any) -> Any:
            return torch.nn.functional.mse_loss(self.net(x), y)

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = Regression()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(_data(64 * (steps + 10)), batch_size=64)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    watch = None
    if attached:
        import stepwatch

        watch = stepwatch.attach(model, optimizer, run="bench-accelerate", url=url)
    for i, (x, y) in enumerate(loader):
        accelerator.backward(model(x, y))
        optimizer.step()
        optimizer.zero_grad()
        ends.append(time.perf_counter())
        if i + 1 == steps:
            break
    if watch is not None:
        watch.close()


def child(framework: str, variant: str, url: str, steps: int, warmup: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    ends: list[float] = []
    run = {"hf": child_hf, "lightning": child_lightning, "accelerate": child_accelerate}[framework]
    run(variant == "stepwatch", url, warmup + steps, ends)
    times = [(b - a) * 1e3 for a, b in zip(ends[warmup:], ends[warmup + 1 :], strict=False)]
    return {"median_ms": statistics.median(times), "steps": len(times)}


# -- the parent: interleaved children ----------------------------------------------------------------------
def measure(args: argparse.Namespace, url: str, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for framework in args.frameworks:
        rows: dict[str, list[float]] = {"bare": [], "stepwatch": []}
        for r in range(args.rounds):
            order = ["bare", "stepwatch"] if r % 2 == 0 else ["stepwatch", "bare"]
            for variant in order:
                cmd = [sys.executable, __file__, "--child", framework, "--variant", variant, "--url", url]
                cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
                env = dict(_servers.child_env(), BENCH_TMP=str(tmp), OMP_NUM_THREADS="1")
                env.update(STEPWATCH_DISABLED="", TRANSFORMERS_VERBOSITY="error")
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env)
                if done.returncode != 0:
                    raise SystemExit(f"{framework}/{variant} failed:\n{done.stderr[-3000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                rows[variant].append(result["median_ms"])
                print(
                    f"  {framework:<10} round {r + 1} {variant:<9} {result['median_ms']:8.3f} ms", flush=True
                )
        added = [s - b for b, s in zip(rows["bare"], rows["stepwatch"], strict=True)]
        bare = statistics.median(rows["bare"])
        out[framework] = {
            "bare_ms": bare,
            "stepwatch_ms": statistics.median(rows["stepwatch"]),
            "added_ms": statistics.median(added),
            "added_pct": 100 * statistics.median(added) / bare,
            "rounds": rows,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--json", type=Path)
    p.add_argument("--child", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=("bare", "stepwatch"), help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.variant, args.url, args.steps, args.warmup)))
        return 0
    args.frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = sorted(set(args.frameworks) - set(FRAMEWORKS))
    if unknown:
        p.error(f"--frameworks: unknown {unknown[0]!r}; choose from {', '.join(FRAMEWORKS)}")
    if args.rounds < 1 or args.steps < 10 or args.warmup < 0:
        p.error("--rounds must be >= 1, --steps >= 10 and --warmup >= 0")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, _servers.stub() as receiver:
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        print(
            f"integration overhead, {started}: {args.rounds} rounds x {args.steps} steps, receiver {receiver.kind}"
        )
        out = measure(args, receiver.url, Path(tmp))
    print(f"\n{'framework':<11} {'bare ms':>9} {'attached ms':>12} {'added ms':>9} {'added':>7}")
    for framework, row in out.items():
        print(
            f"{framework:<11} {row['bare_ms']:9.3f} {row['stepwatch_ms']:12.3f} "
            f"{row['added_ms']:9.3f} {row['added_pct']:6.1f}%"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"started": started, "args": vars(args) | {"json": str(args.json)}, **out})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
