"""What every integration shares: importing its framework with a clear error, and the run name a framework's
own setting gives."""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .._config import build_config, run_chars

if TYPE_CHECKING:
    from .._watch import Watch


def require(module: str, package: str, minimum: tuple[int, ...], tested: str) -> ModuleType:
    """Import `module`, or raise ImportError saying what to install; older than `minimum`: ImportError too."""
    least = ".".join(map(str, minimum))
    needs = f"stepwatch: this integration needs {package} {least} or newer (tested with {tested})"
    try:
        framework = importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{needs}, which could not be imported ({exc}); pip install '{package}>={least}'"
        ) from exc
    version = str(getattr(framework, "__version__", "0"))
    parts = tuple(int(p) if p.isdigit() else 0 for p in version.split(".")[: len(minimum)])
    if parts < minimum:
        raise ImportError(f"{needs}; {version} is installed: pip install -U '{package}>={least}'")
    return framework


def framework_run(name: object) -> str | None:
    """A run name from a framework's setting (`TrainingArguments.run_name`, ...): its characters a run name
    cannot hold become '-'; None when it is unset or nothing is left."""
    if not isinstance(name, str):
        return None
    return run_chars(name)[:200] or None


class Pauses:
    """The known pause a framework's events open and close (`watch.phase`): at most one at a time, a new
    one closing the one before. `watch.phase` never raises, so neither does this."""

    def __init__(self) -> None:
        self._open: contextlib.AbstractContextManager[None] | None = None

    def begin(self, watch: Watch | None, name: str) -> None:
        self.end()
        if watch is not None:
            pause = watch.phase(name)
            pause.__enter__()
            self._open = pause

    def end(self) -> None:
        pause, self._open = self._open, None
        if pause is not None:
            pause.__exit__(None, None, None)


class Attacher:
    """`attach()`'s arguments, given to an integration: checked where it is made (a bad option raises
    ValueError at the user's own line, naming it), used when the framework has its model and optimizer."""

    def __init__(self, run: str | None, url: str | None, token: str | None, options: dict[str, Any]) -> None:
        build_config(run or "check", url, token, options)
        self.run, self.url, self.token, self.options = run, url, token, dict(options)

    def attach(self, model: Any, optimizer: Any, run: str | None, start_step: int) -> Watch:
        """The agent on `model` and the torch optimizer in `optimizer`; `run` when `run=` was not given;
        `start_step`, the framework's count of steps taken (a resumed run), unless the options say."""
        from .._watch import attach

        options = dict(self.options)
        options.setdefault("start_step", start_step)
        run = self.run if self.run is not None else run
        return attach(model, optimizer, run=run, url=self.url, token=self.token, **options)
