"""The Grafana datasources and dashboard folder stepwatch needs: one definition, used both for the
provisioning files (generate.py writes dashboards/provisioning/) and by `grafana push` (push.py).

Datasource uids are stable (`stepwatch-prometheus`, `stepwatch-postgres`); the dashboards reach them
through their datasource variables, so other datasources work too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import make_url

from stepwatch_server.grafana.panels import POSTGRES_TYPE, PROMETHEUS_TYPE
from stepwatch_server.storage.engine import normalise_url

FOLDER_TITLE = "stepwatch"
FOLDER_UID = "stepwatch"
PROMETHEUS_UID = "stepwatch-prometheus"
POSTGRES_UID = "stepwatch-postgres"
DASHBOARDS_PATH = "/var/lib/grafana/dashboards/stepwatch"  # where docker-compose.yml mounts dashboards/


@dataclass(frozen=True)
class Postgres:
    """Where Grafana reaches the collector's PostgreSQL database (host:port, database, user, password)."""

    host: str = "postgres:5432"
    database: str = "stepwatch"
    user: str = "stepwatch"
    password: str = "$STEPWATCH_POSTGRES_PASSWORD"  # Grafana expands $VAR in provisioning files

    @classmethod
    def from_url(cls, url: str) -> Postgres:
        """From an SQLAlchemy/libpq URL such as the collector's STEPWATCH_DATABASE_URL."""
        parsed = make_url(normalise_url(url))
        if parsed.get_backend_name() != "postgresql":
            raise ValueError(f"--postgres-url must be a PostgreSQL URL, got {parsed.get_backend_name()!r}")
        return cls(
            host=f"{parsed.host or 'localhost'}:{parsed.port or 5432}",
            database=parsed.database or "",
            user=parsed.username or "",
            password=parsed.password or "",
        )


def datasources(
    prometheus_url: str = "http://prometheus:9090", postgres: Postgres | None = None
) -> list[dict[str, Any]]:
    """The two datasources, in Grafana's API / provisioning shape."""
    pg = postgres or Postgres()
    return [
        {
            "name": "stepwatch Prometheus",
            "uid": PROMETHEUS_UID,
            "type": PROMETHEUS_TYPE,
            "access": "proxy",
            "url": prometheus_url,
            "isDefault": True,
            "jsonData": {"timeInterval": "15s", "httpMethod": "POST"},
        },
        {
            "name": "stepwatch PostgreSQL",
            "uid": POSTGRES_UID,
            "type": POSTGRES_TYPE,
            "access": "proxy",
            "url": pg.host,
            "user": pg.user,
            "jsonData": {"database": pg.database, "sslmode": "disable", "postgresVersion": 1600},
            "secureJsonData": {"password": pg.password},
        },
    ]


def datasources_file() -> dict[str, Any]:
    return {"apiVersion": 1, "datasources": datasources()}


def dashboards_file() -> dict[str, Any]:
    return {
        "apiVersion": 1,
        "providers": [
            {
                "name": "stepwatch",
                "folder": FOLDER_TITLE,
                "folderUid": FOLDER_UID,
                "type": "file",
                "disableDeletion": False,
                "allowUiUpdates": False,
                "updateIntervalSeconds": 60,
                "options": {"path": DASHBOARDS_PATH, "foldersFromFilesStructure": False},
            }
        ],
    }
