"""Storage: engine creation, the schema and migrations."""

from stepwatch_server.storage.engine import is_sqlite, make_engine, write_transaction
from stepwatch_server.storage.migrate import upgrade

__all__ = ["is_sqlite", "make_engine", "upgrade", "write_transaction"]
