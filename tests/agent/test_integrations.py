"""The trainer integrations' own edges (README "In a trainer"), one process against the test receiver: the
run name a framework's setting gives, the optimizer inside accelerate's wrapper, bad options refused at the
user's own line, a clear error without the framework. The 2-process runs against a real collector are in
tests/e2e/test_trainer_integrations.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_module

from .conftest import REPO_AGENT_SRC, Receiver, make_model

require_module("transformers")

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import stepwatch  # noqa: E402
from stepwatch import NullWatch  # noqa: E402
from stepwatch._watch import inner_optimizer  # noqa: E402
from stepwatch.integrations._support import framework_run  # noqa: E402
from stepwatch.integrations.transformers import StepwatchCallback  # noqa: E402
from tests.e2e.trainer_ranks import Tokens, tiny_llama  # noqa: E402


@pytest.mark.parametrize(
    ("integration", "blocked", "says"),
    [
        ("transformers", ["transformers"], "needs transformers 4.46 or newer (tested with 5.25.0)"),
        ("lightning", ["lightning", "pytorch_lightning"], "needs lightning 2.0 or newer (tested with 2.6.6)"),
        ("accelerate", ["accelerate"], "needs accelerate 1.0 or newer (tested with 1.16.0)"),
    ],
)
def test_an_integration_without_its_framework_says_which_to_install(
    integration: str, blocked: list[str], says: str
) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        for name in {blocked!r}:
            sys.modules[name] = None  # as if it were not installed
        try:
            import stepwatch.integrations.{integration}
        except ImportError as exc:
            print(exc)
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_AGENT_SRC))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert says in out.stdout and "pip install" in out.stdout, out.stdout


def test_a_bad_option_fails_where_the_callback_is_made() -> None:
    with pytest.raises(ValueError, match="amax_every"):
        StepwatchCallback(amax_every=0)
    with pytest.raises(ValueError, match="unknown option 'evry'"):
        StepwatchCallback(evry=3)


def test_a_framework_setting_becomes_a_valid_run_name() -> None:
    assert framework_run("llama 8b / sft #3") == "llama-8b-/-sft-3"
    assert framework_run("  ") is None and framework_run(None) is None


def _trainer(tmp_path: Path, callback: StepwatchCallback, run_name: str | None, steps: int = 4) -> Trainer:
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        run_name=run_name,
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    model = tiny_llama(vocab=32, hidden=16, layers=1, seq=8)
    return Trainer(model=model, args=args, train_dataset=Tokens(64, 8, 32, seed=0), callbacks=[callback])


def test_the_run_is_the_training_arguments_run_name_and_the_loss_the_trainers(
    receiver: Receiver, fast: dict[str, Any], tmp_path: Path
) -> None:
    callback = StepwatchCallback(url=receiver.url, **fast)
    trainer = _trainer(tmp_path, callback, run_name="sft run #1")
    trainer.train()
    assert callback.watch is None  # closed when training ended
    runs = {b["run"] for b in receiver.accepted()}
    assert runs == {"sft-run-1"}
    records = receiver.records()
    assert sorted(records) == [1, 2, 3, 4]
    logged = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    for step, record in records.items():  # one process: the loss is the Trainer's for the step
        assert record["loss"] == pytest.approx(logged[step], rel=1e-5), step


def test_run_wins_over_the_run_name_and_a_disabled_agent_trains_untouched(
    receiver: Receiver, fast: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    callback = StepwatchCallback(run="mine", url=receiver.url, **fast)
    _trainer(tmp_path, callback, run_name="theirs", steps=2).train()
    assert {b["run"] for b in receiver.accepted()} == {"mine"}

    monkeypatch.setenv("STEPWATCH_DISABLED", "1")
    disabled = StepwatchCallback(run="off", url=receiver.url, **fast)
    trainer = _trainer(tmp_path, disabled, run_name=None, steps=2)
    seen: list[Any] = []

    class Spy(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            seen.append(disabled.watch)

    trainer.add_callback(Spy())
    trainer.train()
    assert seen and all(isinstance(w, NullWatch) for w in seen)
    assert "off" not in {b["run"] for b in receiver.accepted()}


def test_the_optimizer_inside_accelerates_wrapper_is_the_one_watched() -> None:
    from accelerate.optimizer import AcceleratedOptimizer

    inner = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert inner_optimizer(AcceleratedOptimizer(inner, device_placement=False)) is inner
    assert inner_optimizer(inner) is inner


def _fit_6_steps(module: Any, callback: Any, tmp_path: Path) -> None:
    """A Lightning fit of 6 steps (batches of 4 of a regression) on one CPU device with `callback`."""
    import lightning.pytorch as pl

    torch.manual_seed(0)
    x = torch.randn(64, 8)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[callback],
    )
    trainer.fit(module, loader)


# lightning 2.6.6 with torch 2.13 (lightning's own call into torch.utils._pytree)
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning")
def test_lightning_on_one_device_times_training_step_as_the_forward_and_reads_its_loss(
    receiver: Receiver, fast: dict[str, Any], tmp_path: Path
) -> None:
    """On one device Lightning calls `training_step` directly, never the module's `__call__` (under DDP it
    redirects it through `forward`): without the step function the agent would see no forward and no loss."""
    require_module("lightning")
    import lightning.pytorch as pl

    from stepwatch.integrations.lightning import StepwatchCallback as LightningCallback

    losses: list[float] = []

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict[str, Any]:
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            losses.append(loss.item())
            return {"loss": loss}

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    callback = LightningCallback(run="lightning-one", url=receiver.url, **fast)
    module = Regression()
    _fit_6_steps(module, callback, tmp_path)
    assert callback.watch is None and "training_step" not in module.__dict__  # closed, given back
    records = receiver.records()
    assert sorted(records) == [1, 2, 3, 4, 5, 6]
    assert [records[s]["loss"] for s in range(1, 7)] == pytest.approx(losses, rel=1e-6)
    assert all(records[s]["time.forward_ms"] > 0 for s in records)


@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning")
def test_lightning_manual_optimisation_reports_each_steps_own_grad_norm_and_the_logged_loss(
    receiver: Receiver, fast: dict[str, Any], tmp_path: Path
) -> None:
    """With `automatic_optimization = False` the optimizer steps inside `training_step`; the module's own
    forward is the forward, and the loss comes from `watch.log` after the step."""
    require_module("lightning")
    import lightning.pytorch as pl

    from stepwatch.integrations.lightning import StepwatchCallback as LightningCallback

    callback = LightningCallback(run="lightning-manual", url=receiver.url, **fast)
    losses: list[float] = []
    norms: list[float] = []

    class Manual(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
            opt = self.optimizers()
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(self(batch[0]), batch[1])
            self.manual_backward(loss)
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in self.parameters()])))
            opt.step()
            losses.append(loss.item())
            assert callback.watch is not None
            callback.watch.log(loss=loss)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    _fit_6_steps(Manual(), callback, tmp_path)
    records = receiver.records()
    assert sorted(records) == [1, 2, 3, 4, 5, 6]
    assert [records[s]["grad_norm"] for s in range(1, 7)] == pytest.approx(norms, rel=1e-5)
    assert [records[s]["loss"] for s in range(1, 7)] == pytest.approx(losses, rel=1e-6)
    assert all(records[s]["time.forward_ms"] > 0 for s in records)


def test_the_accelerate_tracker_forwards_numbers_to_the_processs_watch_and_leaves_strings_out(
    receiver: Receiver, fast: dict[str, Any], stepwatch_log: Any
) -> None:
    from accelerate import Accelerator

    from stepwatch.integrations.accelerate import StepwatchTracker

    tracker = StepwatchTracker()
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    model, opt = make_model()
    model, opt = accelerator.prepare(model, opt)
    watch = stepwatch.attach(model, opt, run="tracker", url=receiver.url, **fast)
    accelerator.init_trackers("p")
    assert tracker.tracker is watch
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)
        accelerator.backward(model(x, y)["loss"])
        opt.step()
        opt.zero_grad()
        accelerator.log({"accuracy": 0.5 * step, "tokens": torch.tensor(100 * step), "tag": "x"}, step=step)
    watch.close(timeout_s=5)
    records = receiver.records()
    assert [records[s]["accuracy"] for s in (1, 2, 3)] == [0.5, 1.0, 1.5]
    assert [records[s]["tokens"] for s in (1, 2, 3)] == [100, 200, 300]
    assert all("tag" not in r for r in records.values())
    assert any("accelerator.log(tag=...) left out" in r.getMessage() for r in stepwatch_log.records)
