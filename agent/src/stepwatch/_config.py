"""Options of `attach()`: defaults, environment, validation.

Precedence: keyword arguments to `attach()` win over the environment (`STEPWATCH_URL`, `STEPWATCH_RUN`,
`STEPWATCH_TOKEN`, `STEPWATCH_NODE`), which wins over the defaults. `STEPWATCH_DISABLED=1` is a kill
switch for operators and wins over everything, including `enabled=True`.
Bad values raise `ValueError` here, at attach, with the fix in the message; nothing raises later.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_AMAX_EVERY = 10
DEFAULT_FINGERPRINT_EVERY = 100
FLUSH_INTERVAL_S = 2.0
# The default flush interval grows with the run so that all its ranks together send at most this many
# batches a second (one collector process takes ~1,000-2,000 of the default shape: bench/batch_rate.py).
MAX_RUN_BATCHES_PER_S = 2_000
HEARTBEAT_INTERVAL_S = 5.0
REQUEST_TIMEOUT_S = 5.0
FLUSH_TIMEOUT_S = 2.0
MAX_SPOOL_MB = 256.0
DEFAULT_SPOOL_DIR = Path("~/.cache/stepwatch/spool")

RUN_NAME = re.compile(r"[A-Za-z0-9._:/@+\-]{1,200}")
TRUE_WORDS = {"1", "true", "yes", "on"}

OPTION_NAMES = (
    "amax_every",
    "fingerprint_every",
    "track",
    "flush_interval_s",
    "heartbeat_interval_s",
    "spool_dir",
    "max_spool_mb",
    "node",
    "replica_group",
    "shard",
    "num_shards",
    "timeout_s",
    "enabled",
    "start_step",
    "report_stack",
    "commands",
)


@dataclass(frozen=True)
class Config:
    """Validated settings of one watch."""

    run: str
    url: str
    token: str | None = None
    amax_every: int = DEFAULT_AMAX_EVERY
    fingerprint_every: int = DEFAULT_FINGERPRINT_EVERY
    track: tuple[str, ...] = ()
    flush_interval_s: float = FLUSH_INTERVAL_S
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    spool_dir: Path = field(default=DEFAULT_SPOOL_DIR)
    max_spool_mb: float = MAX_SPOOL_MB
    node: str | None = None
    replica_group: int | None = None  # None: from the parameters' device meshes, else the rank
    shard: int | None = None  # None: from the meshes, else 0
    num_shards: int | None = None  # None: from the meshes, else 1
    timeout_s: float = REQUEST_TIMEOUT_S
    start_step: int | None = None  # None: from the optimizer's own state (a resumed run), else 0
    report_stack: bool = True  # heartbeats carry the training thread's function names (module:function)
    commands: bool = True  # the collector may ask for evidence (every thread's stack) in its answers
    flush_given: bool = False  # flush_interval_s / heartbeat_interval_s were set (else: by world size)
    heartbeat_given: bool = False

    @property
    def urls(self) -> tuple[str, ...]:
        """The collector base URLs (`url` may list several, comma-separated)."""
        return tuple(u.strip() for u in self.url.split(","))

    @property
    def ingest_urls(self) -> tuple[str, ...]:
        return tuple(u.rstrip("/") + "/api/v1/ingest" for u in self.urls)

    @property
    def ingest_url(self) -> str:
        return self.ingest_urls[0]

    def for_world(self, world_size: int) -> Config:
        """The cadence for a run of `world_size` ranks, where not set by the user: a flush every
        `FLUSH_INTERVAL_S`, or `world_size / MAX_RUN_BATCHES_PER_S` seconds beyond 4,000 ranks, and
        heartbeats no more often than batches."""
        flush = (
            self.flush_interval_s
            if self.flush_given
            else max(FLUSH_INTERVAL_S, world_size / MAX_RUN_BATCHES_PER_S)
        )
        beat = self.heartbeat_interval_s if self.heartbeat_given else max(HEARTBEAT_INTERVAL_S, flush)
        return dataclasses.replace(self, flush_interval_s=flush, heartbeat_interval_s=beat)


def env_disabled(environ: Mapping[str, str] = os.environ) -> bool:
    """True when `STEPWATCH_DISABLED` is set to 1/true/yes/on."""
    return environ.get("STEPWATCH_DISABLED", "").strip().lower() in TRUE_WORDS


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"stepwatch: option {name}={value!r} must be an integer >= {minimum}")
    return value


def _positive(name: str, value: Any, unit: str = "seconds") -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise ValueError(f"stepwatch: option {name}={value!r} must be a finite number of {unit} > 0")
    return float(value)


def _urls(value: Any) -> str:
    """One collector base URL, or several separated by commas (each checked)."""
    if not isinstance(value, str) or not value.strip():
        return _url(value)
    for one in value.split(","):
        _url(one.strip())
    return ",".join(one.strip() for one in value.split(","))


def _url(value: Any) -> str:
    parts = urlsplit(value) if isinstance(value, str) else None
    if parts is None or parts.scheme not in {"http", "https"} or not parts.hostname:
        raise ValueError(
            f"stepwatch: option url={value!r} must look like http://HOST:PORT (the collector's base URL); "
            "pass url= or set STEPWATCH_URL"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"stepwatch: option url={value!r} must not have a query or fragment")
    try:
        parts.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError:
        raise ValueError(f"stepwatch: option url={value!r} has an invalid port") from None
    return value


def run_chars(text: str) -> str:
    """`text` with each run of characters a run name cannot hold as one '-', without '-' or '.' at the ends."""
    return re.sub(r"[^A-Za-z0-9._:/@+\-]+", "-", text.strip()).strip("-.")


def slurm_run(environ: Mapping[str, str]) -> str | None:
    """The run name of a SLURM job's ranks when none is given: `<job name>-<job id>` (`SLURM_JOB_NAME`,
    `SLURM_JOB_ID`; the name's characters a run name cannot hold become '-'), the same on every rank of
    the job and new with each job; None outside SLURM."""
    job = run_chars(environ.get("SLURM_JOB_ID", ""))[:40]
    if not job:
        return None
    name = run_chars(environ.get("SLURM_JOB_NAME", ""))
    return f"{name or 'slurm'}"[: 199 - len(job)] + f"-{job}"[:200]


def build_config(
    run: str | None,
    url: str | None,
    token: str | None,
    options: Mapping[str, Any],
    environ: Mapping[str, str] = os.environ,
) -> Config:
    """Merge arguments, environment and defaults; raise ValueError naming the first bad option."""
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise ValueError(
            f"stepwatch: unknown option {unknown[0]!r}; the options are url, run, token, "
            + ", ".join(OPTION_NAMES)
        )
    run = run if run is not None else (environ.get("STEPWATCH_RUN") or slurm_run(environ))
    if run is None:
        raise ValueError(
            "stepwatch: option run is missing; pass run='my-run' or set STEPWATCH_RUN (under SLURM it defaults "
            "to <job name>-<job id>)"
        )
    if not isinstance(run, str) or not RUN_NAME.fullmatch(run):
        raise ValueError(f"stepwatch: option run={run!r} must be 1-200 characters of A-Za-z0-9._:/@+-")
    if not run.strip("."):
        raise ValueError(
            f"stepwatch: option run={run!r} is only dots, which names a folder, not a run; "
            "give it a letter or digit, e.g. run='exp-1'"
        )
    url = _urls(url if url is not None else environ.get("STEPWATCH_URL", DEFAULT_URL))
    token = token if token is not None else (environ.get("STEPWATCH_TOKEN") or None)
    if token is not None and (not isinstance(token, str) or not token or any(c in token for c in "\r\n")):
        raise ValueError("stepwatch: option token must be a non-empty string without newlines (or None)")

    kw: dict[str, Any] = {}
    if "amax_every" in options:
        kw["amax_every"] = _int("amax_every", options["amax_every"], 1)
    if "fingerprint_every" in options:
        kw["fingerprint_every"] = _int("fingerprint_every", options["fingerprint_every"], 0)
    if "track" in options:
        track = options["track"]
        if (
            isinstance(track, str)
            or not isinstance(track, Sequence)
            or not all(isinstance(t, str) for t in track)
        ):
            raise ValueError(f"stepwatch: option track={track!r} must be a list of module names (strings)")
        kw["track"] = tuple(track)
    for name in ("flush_interval_s", "heartbeat_interval_s", "timeout_s"):
        if name in options:
            kw[name] = _positive(name, options[name])
    kw["flush_given"], kw["heartbeat_given"] = (
        "flush_interval_s" in options,
        "heartbeat_interval_s" in options,
    )
    if "max_spool_mb" in options:
        kw["max_spool_mb"] = _positive("max_spool_mb", options["max_spool_mb"], "MiB")
    if "spool_dir" in options:
        spool = options["spool_dir"]
        if not isinstance(spool, str | os.PathLike) or not str(spool):
            raise ValueError(f"stepwatch: option spool_dir={spool!r} must be a directory path")
        kw["spool_dir"] = Path(spool)
    node = options.get("node", environ.get("STEPWATCH_NODE"))
    if node is not None and (not isinstance(node, str) or not 1 <= len(node) <= 200):
        raise ValueError(f"stepwatch: option node={node!r} must be a string of 1-200 characters")
    kw["node"] = node
    if options.get("replica_group") is not None:
        kw["replica_group"] = _int("replica_group", options["replica_group"], 0)
    if options.get("shard") is not None:
        kw["shard"] = _int("shard", options["shard"], 0)
    if options.get("num_shards") is not None:
        kw["num_shards"] = _int("num_shards", options["num_shards"], 1)
    if kw.get("shard", 0) >= kw.get("num_shards", 1):
        raise ValueError(
            f"stepwatch: option shard={kw.get('shard', 0)} must be < num_shards={kw.get('num_shards', 1)}"
        )
    if options.get("start_step") is not None:
        kw["start_step"] = _int("start_step", options["start_step"], 0)
    for name in ("enabled", "report_stack", "commands"):
        if name in options and not isinstance(options[name], bool):
            raise ValueError(f"stepwatch: option {name}={options[name]!r} must be True or False")
    for name in ("report_stack", "commands"):
        if name in options:
            kw[name] = options[name]
    return Config(run=run, url=url, token=token, **kw)
