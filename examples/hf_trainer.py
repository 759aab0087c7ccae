"""Hugging Face Trainer with stepwatch: `callbacks=[StepwatchCallback()]` is the one addition.

A tiny Llama built from a config (no download) trained on random tokens; alone or under torchrun /
`accelerate launch` (each process a rank). The run is TrainingArguments.run_name; the collector STEPWATCH_URL.

    python examples/hf_trainer.py --steps 50
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py --steps 50
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from stepwatch.integrations.transformers import StepwatchCallback


class RandomTokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, seq: int = 32, vocab: int = 128) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--run", default="hf-trainer-example")
    p.add_argument("--output-dir", default="/tmp/stepwatch-hf-trainer-example")
    a = p.parse_args()
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )
    args = TrainingArguments(
        output_dir=a.output_dir,
        run_name=a.run,
        max_steps=a.steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        eval_strategy="steps",
        eval_steps=max(1, a.steps // 2),
        save_strategy="no",
        logging_steps=10,
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=LlamaForCausalLM(config),
        args=args,
        train_dataset=RandomTokens(2048),
        eval_dataset=RandomTokens(32),
        callbacks=[StepwatchCallback()],  # <- the one addition
    )
    trainer.train()


if __name__ == "__main__":
    main()
