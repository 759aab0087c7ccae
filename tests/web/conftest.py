"""The collector fixtures of tests/service (fresh SQLite and PostgreSQL databases, a real server)."""

from tests.service.conftest import backend, collector, database_url, start_collector  # noqa: F401
