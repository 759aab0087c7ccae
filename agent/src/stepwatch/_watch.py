"""`attach()` and the `Watch` it returns."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ._config import FLUSH_TIMEOUT_S, Config, build_config, env_disabled
from ._guard import Counters, Guard
from ._identity import Identity, detect, with_layout
from ._layout import Layout, from_params
from ._records import Live
from ._sender import Sender
from ._spool import Spool, spool_path
from ._version import __version__

if TYPE_CHECKING:
    import torch

    from ._hooks import Hooks

logger = logging.getLogger("stepwatch")
_LIVE: weakref.WeakSet[Watch] = weakref.WeakSet()
_REGISTERED = False
_REGISTER_LOCK = threading.Lock()


def _close_all_at_exit() -> None:
    for watch in list(_LIVE):
        watch.close()


def _disable_in_child() -> None:
    # After fork (DataLoader workers) only the forking thread exists in the child: the sender thread
    # and its locks are the parent's. The child's copy of each watch goes quiet and never touches them.
    for watch in list(_LIVE):
        watch._forked = True
        watch._guard.disable_all()  # the hooks too: a child that trains must not queue steps for it


def _register_process_hooks() -> None:
    global _REGISTERED
    with _REGISTER_LOCK:
        if not _REGISTERED:
            _REGISTERED = True
            atexit.register(_close_all_at_exit)
            if hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=_disable_in_child)


class Watch:
    """Watches one model and optimizer; returned by `stepwatch.attach()`.

    Every `optimizer.step()` yields one record for this rank; a background thread ships them.
    Methods never raise into the training loop.
    """

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: Config, identity: Identity
    ) -> None:
        from ._hooks import Hooks  # imports torch: only ever reached through attach()

        layout = _layout_of(model, identity)
        identity = with_layout(identity, layout, config)
        config = config.for_world(identity.world_size)  # the default cadence grows with the run
        self.config, self.identity, self.layout = config, identity, layout
        self._counters = Counters()
        self._guard = Guard(self._counters)
        self._live = Live()
        self._pid = os.getpid()
        self._forked = False
        self._closed = False
        max_bytes = int(config.max_spool_mb * 2**20)
        self._spool = Spool(
            spool_path(config.spool_dir, config.run, identity.rank), max_bytes, self._counters, self._guard
        )
        # attach() runs in the training loop's thread: its stack is what heartbeats report.
        training_thread = threading.get_ident()
        self._sender = Sender(
            config,
            identity,
            self._counters,
            self._guard,
            self._live,
            self._spool,
            __version__,
            training_thread,
        )
        self._hooks: Hooks | None = Hooks(
            model, optimizer, config, self._guard, self._live, self._sender.submit, layout
        )
        self._sender.set_capacity_mb(self._hooks.capacity_mb)
        self._tracked = list(self._hooks.tracked)
        self._sender.start()
        _LIVE.add(self)
        _register_process_hooks()

    @property
    def session(self) -> str:
        """This agent session's id (the `session` field of every batch)."""
        return self._sender.session

    @property
    def step(self) -> int | None:
        """The last completed optimizer step (counted by the agent from 1), or None before the first."""
        return self._live.last_step

    def _usable(self) -> bool:
        return not self._closed and not self._forked and self._hooks is not None

    def log(self, **values: Any) -> None:
        """Record extra scalars (tensors or numbers) for the current step, without a device sync.

        Called between `optimizer.step()` and the next forward, the values belong to the step that
        just ended (the usual `opt.step(); watch.log(loss=loss)`). `loss=` replaces the loss found
        in the model's output; `grad_norm=` replaces the hook's (which sees the grads after clipping).
        Do not modify a logged tensor in place afterwards: it is read when the step is handed over.
        """
        hooks = self._hooks
        if hooks is None or self._closed or self._forked or "log" in self._guard.off:
            return
        try:
            hooks.log(values)
        except Exception as exc:
            self._guard.fail("log", exc)

    def identify(self, **values: Any) -> None:
        """Name the data of the current step (`sample_ids=batch["idx"]`, `shard="s3://.../017"`): numbers,
        strings, lists of up to 64 of them, or a CPU tensor of up to 64 elements. Kept on this rank with
        the step and sent only with the first non-finite step (the `nonfinite` anomaly's evidence), so that
        a NaN the data caused can be traced to its batch. Call it when the batch is fetched: the values
        belong to the step its forward starts (unlike `log()`, whose values after `optimizer.step()` belong
        to the step that just ended)."""
        hooks = self._hooks
        if hooks is None or self._closed or self._forked or "log" in self._guard.off:
            return
        try:
            hooks.identify(values)
        except Exception as exc:
            self._guard.fail("log", exc)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a known pause (eval, checkpoint): heartbeats show it, the collector does not call it a hang."""
        usable = self._usable() and self._guard.on("phase")
        previous = self._live.phase
        if usable:
            try:
                self._hooks.pause(True)  # type: ignore[union-attr]
                self._live.phase = str(name)
                self._sender.add_event("phase_start", {"phase": str(name)})
            except Exception as exc:
                self._guard.fail("phase", exc)
        try:
            yield
        finally:
            if usable and self._guard.on("phase"):
                try:
                    self._sender.add_event("phase_end", {"phase": str(name)})
                    self._live.phase = previous
                    self._hooks.pause(False)  # type: ignore[union-attr]
                except Exception as exc:
                    self._guard.fail("phase", exc)

    def _step_function(self, owner: Any, name: str) -> None:
        """For an integration: time `owner.<name>` (a LightningModule's `training_step`) as the forward."""
        if self._usable():
            try:
                self._hooks.step_function(owner, name)  # type: ignore[union-attr]
            except Exception as exc:
                self._guard.fail("steps", exc)

    def stats(self) -> dict[str, int]:
        """The agent's counters (also shipped in every batch as `agent.counters`)."""
        return self._counters.snapshot()

    def tracked(self) -> list[str]:
        """The modules whose output is checked for NaN/Inf and sampled for amax, by the names they are sent
        under: every `nn.Linear` a forward calls, each `nn.MultiheadAttention` (in place of its `out_proj`,
        which it applies functionally) and the `track` option's."""
        return list(self._tracked)

    def close(self, timeout_s: float | None = None) -> None:
        """Remove the hooks, send what is pending within `timeout_s` (default 2 s), spool the rest.

        Idempotent; also runs at interpreter exit. In a forked child it does nothing.
        """
        if self._closed or self._forked or os.getpid() != self._pid:
            return
        self._closed = True
        timeout = FLUSH_TIMEOUT_S if timeout_s is None else max(0.0, float(timeout_s))
        try:
            hooks, self._hooks = self._hooks, None
            if hooks is not None:
                hooks.remove()
                hooks.drain()
        except Exception as exc:
            self._guard.fail("close", exc, disable=False)
        try:
            # The collector learns this rank finished on purpose: a finished run is not a hung one.
            self._sender.add_event("session_end", {"reason": "close"})
            self._sender.close(timeout)
            left, spooled = self._sender.left_steps, len(self._spool)
            if left or spooled:
                logger.warning(
                    "stepwatch: closed run %r; %d step(s) were not delivered and %d batch(es) wait "
                    "in the spool %s for the next session",
                    self.config.run,
                    left,
                    spooled,
                    self._spool.directory,
                )
        except Exception as exc:
            self._guard.fail("close", exc, disable=False)
        _LIVE.discard(self)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullWatch(Watch):
    """What `attach()` returns when stepwatch is disabled: the same methods, doing nothing."""

    def __init__(self) -> None:  # no hooks, no thread, no files
        self._counters = Counters()
        self._live = Live()
        self._closed = True
        self._tracked: list[str] = []

    @property
    def session(self) -> str:
        return ""

    def log(self, **values: Any) -> None:
        pass

    def identify(self, **values: Any) -> None:
        pass

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield

    def close(self, timeout_s: float | None = None) -> None:
        pass


def attach(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    run: str | None = None,
    url: str | None = None,
    token: str | None = None,
    **options: Any,
) -> Watch:
    """Watch `model` and `optimizer`; one record per `optimizer.step()` goes to the collector at `url`.

    `optimizer` may be a framework's wrapper around the torch optimizer (accelerate's, Lightning's): the
    torch optimizer inside it is watched.

    Arguments win over the environment (STEPWATCH_RUN, STEPWATCH_URL, STEPWATCH_TOKEN, STEPWATCH_NODE),
    which wins over the defaults. STEPWATCH_DISABLED=1 or enabled=False returns a `NullWatch`.
    Bad options raise ValueError naming the option; nothing raises after this call.
    """
    enabled = options.pop("enabled", True)
    if not isinstance(enabled, bool):
        raise ValueError(f"stepwatch: option enabled={enabled!r} must be True or False")
    if not enabled or env_disabled():
        return NullWatch()
    config = build_config(run, url, token, options)
    import torch  # the user's own; imported only here so that `import stepwatch` needs nothing

    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"stepwatch: attach(model=...) needs a torch.nn.Module, got {type(model).__name__}")
    optimizer = inner_optimizer(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"stepwatch: attach(optimizer=...) needs a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    modules = dict(model.named_modules())
    missing = [name for name in config.track if name not in modules]
    if missing:
        known = ", ".join(list(modules)[1:8])
        raise ValueError(
            f"stepwatch: option track names no module {missing[0]!r}; names come from "
            f"model.named_modules(), e.g. {known}"
        )
    return Watch(model, optimizer, config, detect(config))


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (accelerate's `AcceleratedOptimizer`, Lightning's
    `LightningOptimizer`, which hold it as `.optimizer`): the one whose `step()` runs the optimizer's hooks.
    A wrapper's own `step()` runs none (it never called `Optimizer.__init__`), or only at real updates
    (accelerate skips the inner step between accumulated micro-batches)."""
    import torch

    for _ in range(8):  # wrappers of wrappers, bounded
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer


def _layout_of(model: torch.nn.Module, identity: Identity) -> Layout | None:
    """The parameters' device-mesh layout (FSDP2, HSDP, TP), said once on rank 0; None without DTensors
    or when it cannot be read (then the options' or the defaults' layout stands)."""
    try:
        layout = from_params(list(model.parameters()), identity.rank, identity.world_size)
    except Exception as exc:  # an unfamiliar mesh: never break attach() over it
        logger.warning(
            "stepwatch: could not read the parameters' device mesh (%s); set shard/num_shards", exc
        )
        return None
    if layout is not None and identity.rank == 0:
        if layout.replicas == 1:
            logger.warning(
                "stepwatch: the model is split into %s: no two ranks hold the same parameters, so replica "
                "fingerprints are not compared (replica_divergence needs data-parallel copies, e.g. HSDP)",
                layout.description,
            )
        else:
            logger.info("stepwatch: parameter layout %s", layout.description)
    return layout
