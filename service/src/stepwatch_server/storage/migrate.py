"""Apply the Alembic migrations programmatically (at app start; no alembic.ini needed).

The scripts ship inside the wheel as `stepwatch_server/migrations`; in an editable install they are
the repository's `migrations/` directory.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, text

_PACKAGE_DIR = Path(__file__).resolve().parent.parent
_PG_MIGRATION_LOCK_KEY = 0x73746570  # "step": serialises concurrent collectors starting at once


def migrations_dir() -> Path:
    for candidate in (_PACKAGE_DIR / "migrations", _PACKAGE_DIR.parents[2] / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise RuntimeError(
        f"stepwatch migrations not found (looked in {_PACKAGE_DIR / 'migrations'} and "
        f"{_PACKAGE_DIR.parents[2] / 'migrations'}); reinstall stepwatch-server"
    )


def alembic_config(url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the database to `revision`; a no-op when it is already there."""
    cfg = alembic_config()
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _PG_MIGRATION_LOCK_KEY})
            conn.commit()
        try:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
            conn.commit()
        finally:
            if conn.dialect.name == "postgresql":
                conn.rollback()
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_MIGRATION_LOCK_KEY})
                conn.commit()
