"""One rank of a Hugging Face Trainer run with `StepwatchCallback` (run as a subprocess, torchrun-style env).

`python -m tests.e2e.trainer_ranks --rank R --world-size N --master-port P --url URL --run NAME --steps S
--deadline-s D --out DIR [--nan-rank F --nan-step K] [--eval-sleep-s X]` trains a tiny Llama built from a
config (no download) with `transformers.Trainer` on the CPU: DDP over gloo (accelerate, from the launcher's
environment), gradient accumulation 2, an evaluation every `EVAL_STEPS` steps (each of its batches waits
`--eval-sleep-s`, so the pause is long enough to see), `logging_steps=1`. The callback is given no run name:
it comes from `TrainingArguments.run_name`. With `--nan-rank`, that rank's `NAN_MODULE` returns NaN in the
training forwards of step `--nan-step` (the Trainer's own counting, from 1); the Trainer applies the
non-finite gradients, so every rank is non-finite from the next step on.

Rank 0 writes the Trainer's `log_history` to DIR/log_history.json. The process exits by itself at the
deadline (os._exit from a timer thread), whatever the Trainer is doing.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import torch

NAN_MODULE = "model.layers.1.mlp.down_proj"
EVAL_STEPS = 10
GRAD_ACCUMULATION = 2
SEQ = 16


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """`n` random sequences of `seq` tokens, each its own labels (the model shifts them)."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama(vocab: int, hidden: int, layers: int, seq: int) -> torch.nn.Module:
    """A Llama built from a config (no download), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = 4 if hidden % 4 == 0 else 2
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq,
    )
    return LlamaForCausalLM(config)


def poison(module: torch.nn.Module, now: dict[str, bool]) -> None:
    """While `now["on"]`, `module`'s own computation overflows in training forwards: its output is the first
    non-finite one (its input made NaN)."""

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        return (args[0] * float("nan"),) if now["on"] and torch.is_grad_enabled() else None

    module.register_forward_pre_hook(hook)


def exit_at(deadline_s: float) -> None:
    def stop() -> None:
        time.sleep(deadline_s)
        print(f"trainer_ranks: deadline of {deadline_s:.0f} s reached; exiting", flush=True)
        os._exit(3)

    threading.Thread(target=stop, daemon=True).start()


def rank_arguments() -> argparse.ArgumentParser:
    """The arguments every rank script of these tests takes (tests/e2e/lightning_ranks.py too)."""
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--deadline-s", type=float, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--spool-dir", required=True)
    p.add_argument("--nan-rank", type=int, default=-1)
    p.add_argument("--nan-step", type=int, default=-1)
    return p


def torchrun_environment(a: argparse.Namespace) -> None:
    """The launcher's environment, as torchrun sets it."""
    os.environ.update(
        RANK=str(a.rank),
        LOCAL_RANK=str(a.rank),
        WORLD_SIZE=str(a.world_size),
        LOCAL_WORLD_SIZE=str(a.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(a.master_port),
        OMP_NUM_THREADS="1",
    )


def main() -> None:
    p = rank_arguments()
    p.add_argument("--eval-sleep-s", type=float, default=0.0)
    a = p.parse_args()
    exit_at(a.deadline_s)
    torchrun_environment(a)  # accelerate (inside the Trainer) starts gloo from it
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from stepwatch.integrations.transformers import StepwatchCallback

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tiny_llama(vocab=64, hidden=32, layers=2, seq=SEQ)
    nan_now = {"on": False}
    if a.rank == a.nan_rank:
        poison(model.get_submodule(NAN_MODULE), nan_now)

    class Faults(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            nan_now["on"] = state.global_step + 1 == a.nan_step

        def on_prediction_step(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            time.sleep(a.eval_sleep_s)

    args = TrainingArguments(
        output_dir=str(a.out / f"trainer-{a.rank}"),
        run_name=a.run,
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=GRAD_ACCUMULATION,
        max_steps=a.steps,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=5,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=EVAL_STEPS,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    callback = StepwatchCallback(url=a.url, spool_dir=a.spool_dir, flush_interval_s=0.5)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(4096, SEQ, 64, seed=1),
        eval_dataset=Tokens(16, SEQ, 64, seed=2),
        callbacks=[Faults(), callback],
    )
    trainer.train()
    if a.rank == 0:
        (a.out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
    print(f"trainer_ranks: rank {a.rank} done, stats {callback.watch and callback.watch.stats()}", flush=True)


if __name__ == "__main__":
    main()
