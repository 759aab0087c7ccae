"""Collector configuration: one frozen dataclass, filled from arguments or the environment."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from stepwatch_server.auth.tokens import Grant, check_distinct, legacy_grant, load_tokens
from stepwatch_server.storage.engine import normalise_url

if TYPE_CHECKING:
    from stepwatch_server.alerts.config import AlertsConfig

DEFAULT_DATABASE_URL = "sqlite:///./stepwatch.db"
DEFAULT_COMPACT_AFTER_STEPS = 3600  # an hour of a run at one step a second stays one row per value
MIN_COMPACT_AFTER_STEPS = (
    128  # the live views read up to 64 steps back (runs/queries.RECENT_STEPS): twice that
)
MAX_BATCH_BYTES = 16 * 1024 * 1024  # docs/ingest.md: 16 MiB on the wire and after decompression


def _env_database_url() -> str:
    return os.environ.get("STEPWATCH_DATABASE_URL") or DEFAULT_DATABASE_URL


def _env_token() -> str | None:
    return os.environ.get("STEPWATCH_TOKEN") or None


def _env_tokens() -> tuple[Grant, ...]:
    """The tokens file named by STEPWATCH_TOKENS_FILE, checked; () when unset."""
    path = os.environ.get("STEPWATCH_TOKENS_FILE", "").strip()
    return load_tokens(path) if path else ()


def _env_public_read() -> bool:
    return os.environ.get("STEPWATCH_PUBLIC_READ", "").strip().lower() in {"1", "true", "yes", "on"}


def _env_alerts() -> AlertsConfig | None:
    """The alerts configuration named by STEPWATCH_ALERTS (docs/alerts.md), checked; None when unset."""
    path = os.environ.get("STEPWATCH_ALERTS", "").strip()
    if not path:
        return None
    from stepwatch_server.alerts.config import load_config

    return load_config(path)


def _env_days(name: str) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}: expected a number of days (e.g. 30 or 0.5), got {raw!r}") from None


def _env_raw_retention() -> float | None:
    return _env_days("STEPWATCH_RAW_RETENTION_DAYS")


def _env_run_retention() -> float | None:
    return _env_days("STEPWATCH_RUN_RETENTION_DAYS")


def _env_compact_after_steps() -> int:
    raw = os.environ.get("STEPWATCH_COMPACT_AFTER_STEPS", "").strip()
    if not raw:
        return DEFAULT_COMPACT_AFTER_STEPS
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"STEPWATCH_COMPACT_AFTER_STEPS: expected a whole number of steps (e.g. 3600, or 0 to never compact), "
            f"got {raw!r}"
        ) from None


def _env_bus() -> str | None:
    return os.environ.get("STEPWATCH_BUS", "").strip() or None


def _env_detection() -> bool:
    return os.environ.get("STEPWATCH_DETECTION", "").strip().lower() not in {"off", "false", "0"}


def _env_detection_overrides() -> dict[str, dict[str, Any]]:
    raw = os.environ.get("STEPWATCH_DETECTION", "").strip()
    if not raw or raw.lower() in {"on", "true", "1", "off", "false", "0"}:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"STEPWATCH_DETECTION is not JSON ({exc.msg} at character {exc.pos}): expected an object such "
            'as {"straggler": {"window_steps": 40}}, or "off"'
        ) from None
    if not isinstance(value, dict):
        raise ValueError(
            f"STEPWATCH_DETECTION must be a JSON object of {{kind: {{setting: value}}}}, got {raw!r}"
        )
    return value


def check_detection_overrides(overrides: dict[str, Any]) -> None:
    """ValueError naming the detector or setting when `overrides` does not fit the detectors."""
    from stepwatch_server.detect.anomalies import KINDS
    from stepwatch_server.detect.registry import DETECTORS

    registered = {cls.kind: cls for cls in DETECTORS}
    for kind, settings in overrides.items():
        if kind not in KINDS:
            raise ValueError(
                f"detection overrides: unknown detector {kind!r}; the detectors are {', '.join(KINDS)}"
            )
        if not isinstance(settings, dict):
            raise ValueError(
                f"detection overrides for {kind!r}: expected an object of settings, got {settings!r}"
            )
        cls = registered.get(kind)
        if cls is None:
            continue  # a known kind whose detector is not in this build: nothing to apply
        fields = {f.name: f for f in dataclasses.fields(cls.Settings)}
        defaults = cls.Settings()
        for name, value in settings.items():
            if name not in fields:
                known = ", ".join(fields) or "none"
                raise ValueError(
                    f"detection overrides: {kind!r} has no setting {name!r} (its settings: {known})"
                )
            default = getattr(defaults, name)
            if not _same_kind(value, default):
                raise ValueError(
                    f"detection overrides: {kind}.{name} must be like its default {default!r}, got {value!r}"
                )


def _same_kind(value: Any, default: Any) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, int | float)
    if isinstance(default, int):
        return isinstance(value, int)
    if isinstance(default, tuple | list):
        return isinstance(value, list | tuple)
    return default is None or isinstance(value, type(default))


@dataclass(frozen=True)
class Settings:
    """What the collector needs to know to start.

    `database_url` is an SQLAlchemy URL: `sqlite:///path.db` (the embedded default, WAL mode) or
    `postgresql+psycopg://user@host/db` (plain `postgresql://` is accepted and means psycopg 3).
    When `token` is set, `POST /api/v1/ingest` requires `Authorization: Bearer <token>`, and so do
    reads unless `public_read`: the one token writes and reads every run. `tokens` are scoped tokens
    (auth/tokens.py: read or write, limited to run names or prefixes), default from the file named by
    STEPWATCH_TOKENS_FILE; `public_read` (STEPWATCH_PUBLIC_READ=1) lets anyone read while tokens are
    configured. Defaults come from STEPWATCH_DATABASE_URL and STEPWATCH_TOKEN. `repr` shows no token.

    `detection` runs the detectors on every stored batch (docs/detection.md); `detection_overrides`
    changes their settings by name, `{kind: {setting: value}}`. Both default from
    STEPWATCH_DETECTION: `off` turns detection off; a JSON object, e.g.
    `{"straggler": {"window_steps": 40}}`, is the overrides. An unknown detector or setting, or a
    value unlike the setting's default, is a ValueError naming it, at start.

    `alerts` is the checked alerts configuration (docs/alerts.md), default from the file named by
    STEPWATCH_ALERTS; a broken file is a ValueError naming the line, at start. None: no alerts.

    `bus` (STEPWATCH_BUS), a redis:// URL: the collector detects nothing itself and adds each stored
    batch to the bus for `stepwatch-server detect` workers (bus/; README, "Running at scale").

    `raw_retention_days` (STEPWATCH_RAW_RETENTION_DAYS): per-rank values, step times and fingerprints of
    steps finished longer ago are deleted once rolled up; `run_retention_days` (STEPWATCH_RUN_RETENTION_DAYS):
    a run not heard from for longer is deleted (runs/expiry.py). None: kept forever.

    `compact_after_steps` (STEPWATCH_COMPACT_AFTER_STEPS): a run's values this many steps behind its newest
    step move into compressed blocks (runs/compaction.py), all of them once the run is silent for a day;
    0: never.
    """

    database_url: str = field(default_factory=_env_database_url)
    token: str | None = field(default_factory=_env_token, repr=False)
    tokens: tuple[Grant, ...] = field(default_factory=_env_tokens)
    public_read: bool = field(default_factory=_env_public_read)
    max_batch_bytes: int = MAX_BATCH_BYTES
    run_migrations: bool = True
    detection: bool = field(default_factory=_env_detection)
    detection_overrides: dict[str, dict[str, Any]] = field(default_factory=_env_detection_overrides)
    alerts: AlertsConfig | None = field(default_factory=_env_alerts)
    bus: str | None = field(default_factory=_env_bus)
    raw_retention_days: float | None = field(default_factory=_env_raw_retention)
    run_retention_days: float | None = field(default_factory=_env_run_retention)
    compact_after_steps: int = field(default_factory=_env_compact_after_steps)

    @classmethod
    def from_env(
        cls, *, database_url: str | None = None, token: str | None = None, **kwargs: object
    ) -> Settings:
        """Settings from arguments, falling back to STEPWATCH_DATABASE_URL / STEPWATCH_TOKEN when None."""
        return cls(
            database_url=database_url or _env_database_url(),
            token=token if token is not None else _env_token(),
            **kwargs,  # type: ignore[arg-type]
        )

    @property
    def redacted_database_url(self) -> str:
        """The database URL with any password hidden, for logs."""
        try:
            return make_url(normalise_url(self.database_url)).render_as_string(hide_password=True)
        except ArgumentError:
            return "<invalid database URL>"

    def __post_init__(self) -> None:
        if self.max_batch_bytes < 1024:
            raise ValueError(f"max_batch_bytes must be at least 1024, got {self.max_batch_bytes}")
        try:
            make_url(normalise_url(self.database_url))
        except ArgumentError:
            raise ValueError(
                f"invalid database URL {self.database_url!r}: use sqlite:///path.db or "
                "postgresql+psycopg://user@host/db"
            ) from None
        check_detection_overrides(self.detection_overrides)
        for name, value in (("raw", self.raw_retention_days), ("run", self.run_retention_days)):
            if value is not None and not (0 < value < 1e6):
                raise ValueError(
                    f"{name}_retention_days (--{name}-retention-days, STEPWATCH_{name.upper()}_RETENTION_DAYS) "
                    f"must be a number of days above 0, got {value!r}; leave it unset to keep everything"
                )
        if self.compact_after_steps != 0 and not MIN_COMPACT_AFTER_STEPS <= self.compact_after_steps < 2**62:
            raise ValueError(
                "compact_after_steps (--compact-after-steps, STEPWATCH_COMPACT_AFTER_STEPS) must be 0 (never "
                f"compact) or at least {MIN_COMPACT_AFTER_STEPS} steps (the live views read the newest steps as "
                f"rows), got {self.compact_after_steps!r}"
            )
        if self.bus is not None and not self.bus.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"bus: expected a redis:// URL (e.g. redis://127.0.0.1:6379/0), got {self.bus!r}"
            )
        if self.token == "":
            object.__setattr__(self, "token", None)
        check_distinct(((legacy_grant(self.token),) if self.token else ()) + tuple(self.tokens))
