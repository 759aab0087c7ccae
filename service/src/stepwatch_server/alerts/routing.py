"""Routes: which channels hear about an anomaly, by its kind, severity and run name.

Every route whose `match` holds contributes its channels (a channel named by two matching routes
gets one message). An empty `match` matches everything. Within a match, the conditions are and-ed;
a list means any of its values; `run` takes shell-style patterns (`llama-*`, `*/sft`).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from stepwatch_server.detect.anomalies import SEVERITIES


@dataclass(frozen=True)
class Match:
    kinds: frozenset[str] | None = None  # None: any kind
    severities: frozenset[str] | None = None
    min_severity: str | None = None
    runs: tuple[str, ...] | None = None  # fnmatch patterns

    def __call__(self, kind: str, severity: str, run: str) -> bool:
        if self.kinds is not None and kind not in self.kinds:
            return False
        if self.severities is not None and severity not in self.severities:
            return False
        if self.min_severity is not None and SEVERITIES.index(severity) < SEVERITIES.index(self.min_severity):
            return False
        return self.runs is None or any(fnmatch.fnmatchcase(run, p) for p in self.runs)


@dataclass(frozen=True)
class Route:
    match: Match
    channels: tuple[str, ...]
    line: int = 0  # where it is in the configuration file


def channels_for(routes: tuple[Route, ...], kind: str, severity: str, run: str) -> tuple[str, ...]:
    """The channels of every matching route, each once, in the order first named."""
    out: dict[str, None] = {}
    for route in routes:
        if route.match(kind, severity, run):
            out.update(dict.fromkeys(route.channels))
    return tuple(out)
