"""Collector configuration: one frozen dataclass, filled from arguments or the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from stepwatch_server.storage.engine import normalise_url

DEFAULT_DATABASE_URL = "sqlite:///./stepwatch.db"
MAX_BATCH_BYTES = 16 * 1024 * 1024  # docs/ingest.md: 16 MiB on the wire and after decompression


def _env_database_url() -> str:
    return os.environ.get("STEPWATCH_DATABASE_URL") or DEFAULT_DATABASE_URL


def _env_token() -> str | None:
    return os.environ.get("STEPWATCH_TOKEN") or None


@dataclass(frozen=True)
class Settings:
    """What the collector needs to know to start.

    `database_url` is an SQLAlchemy URL: `sqlite:///path.db` (the embedded default, WAL mode) or
    `postgresql+psycopg://user@host/db` (plain `postgresql://` is accepted and means psycopg 3).
    When `token` is set, `POST /api/v1/ingest` requires `Authorization: Bearer <token>`.
    Defaults come from STEPWATCH_DATABASE_URL and STEPWATCH_TOKEN.
    """

    database_url: str = field(default_factory=_env_database_url)
    token: str | None = field(default_factory=_env_token)
    max_batch_bytes: int = MAX_BATCH_BYTES
    run_migrations: bool = True

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
        if self.token == "":
            object.__setattr__(self, "token", None)
