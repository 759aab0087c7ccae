"""Alembic environment for stepwatch.

Runs with a connection handed over by the collector (`config.attributes["connection"]`, see
stepwatch_server.storage.migrate) or, from the command line, with the URL of `alembic.ini`
(`sqlalchemy.url`) or of STEPWATCH_DATABASE_URL.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import Connection

from stepwatch_server.storage.engine import make_engine
from stepwatch_server.storage.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite ALTERs go through table copies
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _url() -> str:
    return (
        os.environ.get("STEPWATCH_DATABASE_URL")
        or config.get_main_option("sqlalchemy.url")
        or "sqlite:///./stepwatch.db"
    )


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    given = config.attributes.get("connection")
    if given is not None:
        _run(given)
    else:
        engine = make_engine(_url())
        try:
            with engine.connect() as conn:
                _run(conn)
                conn.commit()
        finally:
            engine.dispose()
