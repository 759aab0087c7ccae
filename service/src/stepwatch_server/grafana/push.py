"""`stepwatch-server grafana push`: the folder, datasources and dashboards into a running Grafana.

Idempotent: each object is looked up by its stable uid and updated when it exists, created when
it does not; dashboards are saved with `overwrite: true` into the folder. Run it again after
upgrading stepwatch and the dashboards are replaced by the new ones. Calls (Grafana HTTP API):

    GET  /api/folders/{uid}                       then PUT /api/folders/{uid} or POST /api/folders
    GET  /api/datasources/uid/{uid}               then PUT /api/datasources/uid/{uid} or POST /api/datasources
    POST /api/dashboards/db                       {"dashboard", "folderUid", "overwrite": true}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError

from stepwatch_server.grafana.provisioning import FOLDER_TITLE, FOLDER_UID, Postgres, datasources

MESSAGE = "stepwatch-server grafana push"
TIMEOUT_S = 30.0


@dataclass
class PushReport:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"created: {', '.join(self.created) or '-'}; updated: {', '.join(self.updated) or '-'}"


def _exists(get: Any, uid: str) -> bool:
    try:
        get(uid)
    except GrafanaClientError as exc:
        if exc.status_code == 404:
            return False
        raise
    return True


def load_dashboards(directory: Path) -> list[dict[str, Any]]:
    """The generated dashboards (`*.json` of `directory`), each with its uid."""
    found = sorted(directory.glob("*.json"))
    if not found:
        raise ValueError(
            f"no dashboards (*.json) in {directory}: give --dashboards DIR (the repository's dashboards/)"
        )
    docs = [json.loads(path.read_text()) for path in found]
    for path, doc in zip(found, docs, strict=True):
        if not doc.get("uid"):
            raise ValueError(f"{path}: the dashboard has no uid")
    return docs


def push(
    url: str,
    token: str | None,
    *,
    folder: str = FOLDER_TITLE,
    dashboards_dir: Path,
    prometheus_url: str = "http://prometheus:9090",
    postgres: Postgres | None = None,
) -> PushReport:
    dashboards = load_dashboards(dashboards_dir)
    api = GrafanaApi.from_url(url, credential=token, timeout=TIMEOUT_S)
    report = PushReport()
    if _exists(api.folder.get_folder, FOLDER_UID):
        api.folder.update_folder(FOLDER_UID, title=folder, overwrite=True)
        report.updated.append(f"folder {FOLDER_UID}")
    else:
        api.folder.create_folder(folder, uid=FOLDER_UID)
        report.created.append(f"folder {FOLDER_UID}")
    for source in datasources(prometheus_url, postgres):
        uid = source["uid"]
        if _exists(api.datasource.get_datasource_by_uid, uid):
            api.datasource.update_datasource_by_uid(uid, source)
            report.updated.append(f"datasource {uid}")
        else:
            api.datasource.create_datasource(source)
            report.created.append(f"datasource {uid}")
    for doc in dashboards:
        body = {key: value for key, value in doc.items() if key not in ("id", "version")}
        api.dashboard.update_dashboard(
            {"dashboard": body, "folderUid": FOLDER_UID, "overwrite": True, "message": MESSAGE}
        )
        report.updated.append(f"dashboard {doc['uid']}")
    return report
