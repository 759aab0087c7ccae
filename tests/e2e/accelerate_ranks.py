"""One rank of an Accelerate training loop with `stepwatch.attach(model, optimizer)` after
`accelerator.prepare(...)` (run as a subprocess, torchrun-style environment).

`python -m tests.e2e.accelerate_ranks --rank R --world-size N --master-port P --url URL --run NAME --steps S
--deadline-s D --out DIR [--nan-rank F --nan-step K] [--eval-sleep-s X]` trains the tiny Llama of
`trainer_ranks` on the CPU: DDP over gloo (accelerate, from the launcher's environment), gradient
accumulation 2 through `accelerator.accumulate(model)` (the prepared optimizer steps on every micro-batch;
accelerate skips the real step between them), an evaluation inside `watch.phase("evaluate")` every
`EVAL_STEPS` optimizer steps, its loss given to `accelerator.log` (the main process's `StepwatchTracker`
forwards it to its agent). Each rank writes DIR/rank-R.json: per optimizer step (from 1) the mean of its
micro-batches' losses and the gradient norm before the step, read by the test here (the agent never syncs).
"""

from __future__ import annotations

import json
import time

import torch

from tests.e2e.trainer_ranks import (
    NAN_MODULE,
    SEQ,
    Tokens,
    exit_at,
    poison,
    rank_arguments,
    tiny_llama,
    torchrun_environment,
)

EVAL_STEPS = 10
GRAD_ACCUMULATION = 2


def main() -> None:
    p = rank_arguments()
    p.add_argument("--eval-sleep-s", type=float, default=0.0)
    a = p.parse_args()
    exit_at(a.deadline_s)
    torchrun_environment(a)
    from accelerate import Accelerator

    import stepwatch
    from stepwatch.integrations.accelerate import StepwatchTracker

    torch.set_num_threads(1)
    accelerator = Accelerator(
        cpu=True, gradient_accumulation_steps=GRAD_ACCUMULATION, log_with=[StepwatchTracker()]
    )
    model = tiny_llama(vocab=64, hidden=32, layers=2, seq=SEQ)
    nan_now = {"on": False}
    if a.rank == a.nan_rank:
        poison(model.get_submodule(NAN_MODULE), nan_now)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train = torch.utils.data.DataLoader(Tokens(4096, SEQ, 64, seed=1), batch_size=4)
    evaluation = torch.utils.data.DataLoader(Tokens(16, SEQ, 64, seed=2), batch_size=4)
    model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)
    watch = stepwatch.attach(
        model, optimizer, run=a.run, url=a.url, spool_dir=a.spool_dir, flush_interval_s=0.5
    )
    accelerator.init_trackers(
        "stepwatch-test"
    )  # the main process's tracker: accelerator.log goes to its watch

    seen: dict[int, dict[str, float]] = {}
    micro: list[float] = []
    step = 0
    for batch in train:
        nan_now["on"] = step + 1 == a.nan_step
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            micro.append(loss.item())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                grads = [q.grad for q in model.parameters() if q.grad is not None]
                norm = float(torch.nn.utils.get_total_norm(grads))
                seen[step + 1] = {"loss": sum(micro) / len(micro), "grad_norm": norm}
                micro.clear()
            optimizer.step()
            optimizer.zero_grad()
        if not accelerator.sync_gradients:
            continue
        step += 1
        if step % EVAL_STEPS == 0:
            with watch.phase("evaluate"), torch.no_grad():
                losses = []
                for eval_batch in evaluation:
                    losses.append(model(**eval_batch).loss)
                    time.sleep(a.eval_sleep_s)
            accelerator.log({"eval_loss": torch.stack(losses).mean(), "note": "evaluated"})
        if step == a.steps:
            break
    watch.close()
    (a.out / f"rank-{a.rank}.json").write_text(json.dumps(seen))
    accelerator.end_training()
    print(f"accelerate_ranks: rank {a.rank} done", flush=True)


if __name__ == "__main__":
    main()
