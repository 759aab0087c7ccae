"""The public surface: import without dependencies, __all__, options, env, disabled, fork, guard."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import stepwatch
from stepwatch._config import build_config
from stepwatch._hooks import Tap

from .conftest import REPO_AGENT_SRC, Receiver, make_model, train


def test_import_needs_only_the_standard_library() -> None:
    code = textwrap.dedent(
        """
        import sys
        BLOCKED = {"torch", "numpy", "fastapi", "pydantic", "sqlalchemy", "stepwatch_server", "transformers", "lightning"}

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"blocked in this test: {name}")
                return None

        sys.meta_path.insert(0, Block())
        import stepwatch
        import stepwatch.integrations  # the package; each framework's module imports its framework
        assert callable(stepwatch.attach) and stepwatch.__version__
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
        w = stepwatch.NullWatch()
        w.log(loss=1.0)
        w.identify(sample_ids=[1, 2])
        with w.phase("eval"):
            pass
        w.close()
        print("ok")
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_AGENT_SRC))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_all_is_honest() -> None:
    # subpackages (stepwatch.integrations, once a test imported it) are imported by name, not exported
    public = {
        n for n, v in vars(stepwatch).items() if not n.startswith("_") and not isinstance(v, ModuleType)
    }
    public |= {"__version__"}
    assert set(stepwatch.__all__) == public
    for name in stepwatch.__all__:
        assert getattr(stepwatch, name) is not None
    for name in ("attach", "Watch", "NullWatch"):
        assert getattr(stepwatch, name).__doc__


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"run": "bad name!"}, "run"),
        ({"run": "x" * 201}, "run"),
        ({"run": ".."}, "run"),  # a folder, not a run: it spooled one level above spool_dir
        ({"run": "."}, "run"),
        ({"url": "ftp://host"}, "url"),
        ({"url": "http://:80"}, "url"),
        ({"url": "http://c1:8000,ftp://c2"}, "ftp://c2"),  # each of several collectors is checked
        ({"amax_every": 0}, "amax_every"),
        ({"amax_every": 2.5}, "amax_every"),
        ({"fingerprint_every": -1}, "fingerprint_every"),
        ({"flush_interval_s": 0}, "flush_interval_s"),
        ({"heartbeat_interval_s": "5"}, "heartbeat_interval_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"max_spool_mb": -1}, "max_spool_mb"),
        ({"track": "fc1"}, "track"),
        ({"track": ["nope"]}, "track"),
        ({"shard": 2, "num_shards": 2}, "shard"),
        ({"num_shards": 0}, "num_shards"),
        ({"replica_group": -1}, "replica_group"),
        ({"node": ""}, "node"),
        ({"token": ""}, "token"),
        ({"enabled": "yes"}, "enabled"),
        ({"report_stack": 1}, "report_stack"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_bad_options_raise_value_error_naming_the_option(options: dict[str, Any], named: str) -> None:
    model, opt = make_model()
    kwargs = {"run": "ok"} | options
    with pytest.raises(ValueError, match=named):
        stepwatch.attach(model, opt, **kwargs)


def test_every_spool_path_stays_inside_the_spool_dir(tmp_path: Path) -> None:
    """By construction, whatever the run name (the attach check aside): one folder per run, right
    under the spool directory, distinct for distinct names."""
    from stepwatch._spool import spool_path

    base = (tmp_path / "spool").resolve()
    names = ["..", ".", "...", "a/../..", "../x", "a b", "a_b", "run-1", "x" * 200, "/abs", "é"]
    paths = [spool_path(base, name, 3) for name in names]
    for name, path in zip(names, paths, strict=True):
        assert path.resolve().parent.parent == base, (name, path)
        assert path.name == "rank-3"
    assert len({p.parent for p in paths}) == len(names)
    assert spool_path(base, "run-1", 0) == base / "run-1" / "rank-0"  # a plain name is kept as it is


def test_run_is_required_and_bad_objects_are_refused() -> None:
    model, opt = make_model()
    with pytest.raises(ValueError, match="STEPWATCH_RUN"):
        stepwatch.attach(model, opt)
    with pytest.raises(ValueError, match="Module"):
        stepwatch.attach(object(), opt, run="r")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Optimizer"):
        stepwatch.attach(model, object(), run="r")  # type: ignore[arg-type]


def test_environment_configures_and_arguments_win(
    receiver: Receiver, fast: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STEPWATCH_RUN", "from-env")
    monkeypatch.setenv("STEPWATCH_URL", receiver.url)
    monkeypatch.setenv("STEPWATCH_TOKEN", "env-token")
    monkeypatch.setenv("STEPWATCH_NODE", "node-7")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, token="arg-token", **fast)
    train(model, opt, 2)
    watch.close(timeout_s=5)
    batch = receiver.data_batches()[0]
    assert (batch["run"], batch["rank"], batch["world_size"], batch["local_rank"]) == ("from-env", 3, 4, 1)
    assert (batch["node"], batch["replica_group"], batch["shard"], batch["num_shards"]) == ("node-7", 3, 0, 1)
    assert {r["headers"]["authorization"] for r in receiver.requests} == {"Bearer arg-token"}


@pytest.mark.parametrize(
    "launcher",
    [
        {
            "OMPI_COMM_WORLD_RANK": "6",
            "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        },  # Open MPI
        {"PMI_RANK": "6", "PMI_SIZE": "8", "MPI_LOCALRANKID": "2"},  # MPICH / Intel MPI (Hydra)
    ],
)
def test_mpi_launchers_give_the_identity(
    receiver: Receiver, fast: dict[str, Any], monkeypatch: pytest.MonkeyPatch, launcher: dict[str, str]
) -> None:
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="mpi", url=receiver.url, **fast)
    train(model, opt, 1)
    watch.close(timeout_s=5)
    batch = receiver.data_batches()[0]
    assert (batch["rank"], batch["world_size"], batch["local_rank"]) == (6, 8, 2)


def test_a_slurm_job_names_its_run_when_none_is_given(
    receiver: Receiver, fast: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank of one SLURM job lands in one run, `<job name>-<job id>`, and the next job in a new one;
    STEPWATCH_RUN and run= still win."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NAME", "pretrain 7b (v2)")
    model, opt = make_model()
    for run, env_run, expected in ((None, None, "pretrain-7b-v2-4242"), (None, "env-run", "env-run"),
                                   ("arg-run", "env-run", "arg-run")):  # fmt: skip
        if env_run is not None:
            monkeypatch.setenv("STEPWATCH_RUN", env_run)
        before = len(receiver.data_batches())
        watch = stepwatch.attach(model, opt, run=run, url=receiver.url, **fast)
        train(model, opt, 1)
        watch.close(timeout_s=5)
        sent = receiver.data_batches()[before:]
        assert sent and {b["run"] for b in sent} == {expected}
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.delenv("STEPWATCH_RUN")
    with pytest.raises(ValueError, match="under SLURM it defaults to <job name>-<job id>"):
        stepwatch.attach(model, opt, url=receiver.url, **fast)


def test_slurm_identity(receiver: Receiver, fast: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    model, opt = make_model()
    watch = stepwatch.attach(
        model, opt, run="slurm", url=receiver.url, replica_group=1, shard=1, num_shards=4, **fast
    )
    train(model, opt, 1)
    watch.close(timeout_s=5)
    batch = receiver.data_batches()[0]
    assert (batch["rank"], batch["world_size"], batch["local_rank"]) == (5, 8, 1)
    assert (batch["replica_group"], batch["shard"], batch["num_shards"]) == (1, 1, 4)


def test_disabled_is_a_no_op(receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPWATCH_DISABLED", "1")
    model, opt = make_model()
    senders_before = sum(t.name == "stepwatch-sender" for t in threading.enumerate())
    watch = stepwatch.attach(model, opt, run="bad name!", url=receiver.url)  # not even validated
    assert isinstance(watch, stepwatch.NullWatch)
    train(model, opt, 3)
    watch.log(loss=torch.tensor(1.0))
    watch.identify(sample_ids=torch.arange(4))
    with watch.phase("eval"):
        pass
    assert watch.stats()["sent_batches"] == 0 and watch.step is None
    watch.close()
    assert sum(t.name == "stepwatch-sender" for t in threading.enumerate()) <= senders_before
    assert not model._forward_hooks and not opt._optimizer_step_pre_hooks
    time.sleep(0.1)
    assert receiver.requests == []
    assert isinstance(stepwatch.attach(model, opt, run="r", enabled=False), stepwatch.NullWatch)


def test_fork_leaves_the_parent_intact(receiver: Receiver, fast: dict[str, Any]) -> None:
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="forked", url=receiver.url, **fast)
    train(model, opt, 5)
    pid = os.fork()
    if pid == 0:  # child (a DataLoader worker, say): hooks and methods are silent no-ops
        code = 0
        try:
            hooks = watch._hooks
            assert hooks is not None
            step, pending = hooks._step, len(hooks._pending)
            train(model, opt, 3)
            if (hooks._step, len(hooks._pending)) != (step, pending):
                code = 2  # the hooks ran in the child: steps counted and queued for a sender it lacks
            watch.log(loss=1.0)
            with watch.phase("eval"):
                pass
            watch.close(timeout_s=0.2)
        except BaseException:
            code = code or 1
        os._exit(code)
    deadline = time.monotonic() + 20
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child did not finish within 20 s")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    train(model, opt, 5)
    watch.close(timeout_s=5)
    assert receiver.steps() == list(range(1, 11))
    assert {b["session"] for b in receiver.accepted()} == {watch.session}


def test_internal_error_is_contained_logged_once_and_counted(
    receiver: Receiver, fast: dict[str, Any], allow_internal_errors: None, stepwatch_log: Any
) -> None:
    class Weird:
        @property
        def loss(self) -> torch.Tensor:
            raise RuntimeError("this output object breaks on .loss")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> Any:
            self.last = self.lin(x).pow(2).mean()
            return Weird()

    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    watch = stepwatch.attach(net, opt, run="weird", url=receiver.url, **fast)
    for _ in range(5):
        net(torch.randn(2, 4))
        net.last.backward()
        opt.step()
        opt.zero_grad()
    watch.close(timeout_s=5)
    assert watch.stats()["internal_errors"] == 1
    internal = [r for r in stepwatch_log.records if getattr(r, "stepwatch_internal", False)]
    assert len(internal) == 1 and "loss" in internal[0].getMessage()
    records = receiver.records()
    assert sorted(records) == [1, 2, 3, 4, 5]  # the rest keeps working
    assert all("loss" not in r and r["grad_norm"] > 0 for r in records.values())


def test_resumed_optimizer_state_continues_the_step_count(receiver: Receiver, fast: dict[str, Any]) -> None:
    """An Adam restored from a checkpoint of step 30 makes the next record step 31; start_step overrides."""
    model, _ = make_model()
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    train(model, adam, 30)  # "the checkpointed run"
    restored = torch.optim.Adam(model.parameters(), lr=1e-3)
    restored.load_state_dict(adam.state_dict())

    watch = stepwatch.attach(model, restored, run="resumed", url=receiver.url, **fast)
    train(model, restored, 5, watch)
    watch.close()
    assert receiver.steps() == [31, 32, 33, 34, 35]

    explicit = stepwatch.attach(
        model, restored, run="resumed-explicit", url=receiver.url, start_step=99, **fast
    )
    train(model, restored, 2, explicit)
    explicit.close()
    assert [s for s in receiver.steps() if s > 35] == [100, 101]


def test_close_tells_the_collector_the_session_ended(receiver: Receiver, fast: dict[str, Any]) -> None:
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="ends", url=receiver.url, **fast)
    train(model, opt, 3, watch)
    watch.close()
    events = [e for b in receiver.data_batches() for e in b.get("events", [])]
    assert [e["kind"] for e in events if e["kind"] == "session_end"] == ["session_end"]
    assert events[-1]["kind"] == "session_end" and events[-1]["step"] == 3


def test_a_watched_model_can_be_deep_copied_and_saved_whole_and_its_copy_reports_nothing(
    receiver: Receiver, fast: dict[str, Any], tmp_path: Path
) -> None:
    """`ema = copy.deepcopy(model)` (diffusion and RL training do it all the time) and `torch.save(model)`
    copy the model's hooks with it: before, they dragged the agent's threads and locks along and raised
    "cannot pickle '_thread.lock' object" in the user's code. A copy is not the watched model: its hooks
    are no-ops, and training the copy (or the reloaded model) adds nothing to the watched run."""
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="copies", url=receiver.url, **fast)
    train(model, opt, 3)
    ema = copy.deepcopy(model)
    opt_copy = copy.deepcopy(opt)
    torch.save(model, tmp_path / "whole.pt")
    reloaded = torch.load(tmp_path / "whole.pt", weights_only=False)
    x = torch.randn(4, model.fc1.in_features)
    for other in (ema, reloaded):
        # a tracked module's forward is a tap on the watched model; its copy gets the plain forward back
        assert isinstance(model.fc1.__dict__.get("forward"), Tap)
        assert not any(isinstance(m.__dict__.get("forward"), Tap) for m in other.modules())
        torch.testing.assert_close(other(x), model(x))
        other_opt = torch.optim.SGD(other.parameters(), lr=0.01)
        train(other, other_opt, 4)  # the copies' hooks are inert: no steps for the watched run
    assert "zero_grad" not in opt_copy.__dict__  # the agent's zero_grad watch stays on the original
    train(model, opt, 2)
    watch.close(timeout_s=5)
    assert not any("forward" in m.__dict__ for m in model.modules())  # close() gave the forwards back
    assert receiver.steps() == [1, 2, 3, 4, 5]
    assert watch.stats()["internal_errors"] == 0


def test_a_forward_someone_else_wrapped_is_kept_and_given_back_at_close(
    receiver: Receiver, fast: dict[str, Any]
) -> None:
    """Libraries (accelerate's hooks, users' patches) set a module's `forward` as an instance attribute
    too. One set before attach is wrapped and restored at close; one set over the agent's tap after
    attach is left in place at close, its tap inert."""
    model, opt = make_model()
    plain = model.fc2.forward

    def theirs(x: torch.Tensor) -> torch.Tensor:
        return plain(x) * 2.0

    model.fc2.forward = theirs  # type: ignore[method-assign]
    watch = stepwatch.attach(model, opt, run="wrapped", url=receiver.url, amax_every=1, **fast)
    tap = model.fc1.forward
    assert isinstance(tap, Tap)

    def over(x: torch.Tensor) -> torch.Tensor:
        return tap(x)

    model.fc1.forward = over  # type: ignore[method-assign]
    train(model, opt, 3)
    watch.close(timeout_s=5)
    assert model.fc2.__dict__["forward"] is theirs and model.fc1.__dict__["forward"] is over
    assert tap.hooks is None  # inert: the model still runs through it, reporting nothing
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), plain(model.act(model.fc1(x))) * 2.0)
    amax = [b["tensors"]["stats"]["amax"] for b in receiver.accepted() if "tensors" in b]
    assert amax and all(set(a) == {"fc1", "fc2"} for a in amax)
    assert receiver.steps() == [1, 2, 3]


@pytest.mark.parametrize(
    ("world_size", "options", "flush_s", "heartbeat_s"),
    [
        (8, {}, 2.0, 5.0),
        (4_000, {}, 2.0, 5.0),
        (16_384, {}, 16_384 / 2_000, 16_384 / 2_000),  # the whole run sends <= 2,000 batches/s
        (16_384, {"flush_interval_s": 1.0}, 1.0, 5.0),  # what the user set wins
        (16_384, {"heartbeat_interval_s": 3.0}, 16_384 / 2_000, 3.0),
    ],
)
def test_the_default_cadence_grows_with_the_run(
    world_size: int, options: dict[str, Any], flush_s: float, heartbeat_s: float
) -> None:
    config = build_config("cadence", None, None, options, environ={}).for_world(world_size)
    assert (config.flush_interval_s, config.heartbeat_interval_s) == pytest.approx((flush_s, heartbeat_s))
    assert world_size / config.flush_interval_s <= 2_000 or "flush_interval_s" in options
