"""`stepwatch-server grafana push` against a local HTTP receiver that speaks the part of Grafana's API
the command uses (Grafana itself cannot be installed here): the calls, their bodies, the bearer
token, and that a second push updates what the first created instead of duplicating it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from stepwatch_server.cli import main
from stepwatch_server.grafana.dashboards import DASHBOARDS
from stepwatch_server.grafana.generate import REPO

TOKEN = "glsa_test_token"
DASHBOARD_UIDS = {
    "stepwatch-run-overview",
    "stepwatch-ranks",
    "stepwatch-numerics",
    "stepwatch-collector",
    "stepwatch-scale",
}


class FakeGrafana:
    """Folders, datasources and dashboards by uid; every call recorded as (method, path, body)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.folders: dict[str, dict[str, Any]] = {}
        self.datasources: dict[str, dict[str, Any]] = {}
        self.dashboards: dict[str, dict[str, Any]] = {}
        self.unauthorized = 0

    def handle(self, method: str, path: str, body: Any, auth: str | None) -> tuple[int, Any]:
        self.calls.append((method, path, body))
        if auth != f"Bearer {TOKEN}":
            self.unauthorized += 1
            return 401, {"message": "Unauthorized"}
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "folders"]:
            if method == "GET" and len(parts) == 3:
                found = self.folders.get(parts[2])
                return (200, found) if found else (404, {"message": "folder not found"})
            if method == "POST" and len(parts) == 2:
                self.folders[body["uid"]] = {"uid": body["uid"], "title": body["title"], "version": 1}
                return 200, self.folders[body["uid"]]
            if method == "PUT" and len(parts) == 3 and parts[2] in self.folders:
                self.folders[parts[2]].update(
                    title=body["title"], version=self.folders[parts[2]]["version"] + 1
                )
                return 200, self.folders[parts[2]]
        if parts[:2] == ["api", "datasources"]:
            if method == "GET" and parts[2:3] == ["uid"]:
                found = self.datasources.get(parts[3])
                return (200, found) if found else (404, {"message": "Data source not found"})
            if method == "POST" and len(parts) == 2:
                self.datasources[body["uid"]] = body
                return 200, {"datasource": body, "message": "Datasource added"}
            if method == "PUT" and parts[2:3] == ["uid"] and parts[3] in self.datasources:
                self.datasources[parts[3]] = body
                return 200, {"datasource": body, "message": "Datasource updated"}
        if method == "POST" and parts == ["api", "dashboards", "db"]:
            if body["folderUid"] not in self.folders:
                return 400, {"message": "folder not found"}
            uid = body["dashboard"]["uid"]
            if uid in self.dashboards and not body.get("overwrite"):
                return 412, {"status": "version-mismatch"}
            self.dashboards[uid] = body
            return 200, {"status": "success", "uid": uid}
        return 404, {"message": f"not found: {method} {path}"}


@pytest.fixture
def grafana() -> Iterator[tuple[str, FakeGrafana]]:
    fake = FakeGrafana()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            status, answer = fake.handle(
                self.command, self.path, json.loads(raw) if raw else None, self.headers.get("Authorization")
            )
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = _serve

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", fake
    server.shutdown()
    server.server_close()
    thread.join(5)


def _push(url: str, *extra: str) -> int:
    return main(
        ["grafana", "push", "--url", url, "--token", TOKEN, "--dashboards", str(REPO / "dashboards"), *extra]
    )


def test_push_creates_then_updates_the_folder_datasources_and_dashboards(
    grafana: tuple[str, FakeGrafana],
) -> None:
    url, fake = grafana
    assert (
        _push(
            url, "--folder", "Training runs", "--postgres-url", "postgresql://grafana:pw@db.internal:6543/sw"
        )
        == 0
    )
    first = [(m, p) for m, p, _ in fake.calls]
    assert first == [
        ("GET", "/api/folders/stepwatch"),
        ("POST", "/api/folders"),
        ("GET", "/api/datasources/uid/stepwatch-prometheus"),
        ("POST", "/api/datasources"),
        ("GET", "/api/datasources/uid/stepwatch-postgres"),
        ("POST", "/api/datasources"),
        *[("POST", "/api/dashboards/db")] * len(DASHBOARDS),
    ]
    assert fake.folders["stepwatch"]["title"] == "Training runs"
    pg = fake.datasources["stepwatch-postgres"]
    assert (pg["url"], pg["user"], pg["jsonData"]["database"]) == ("db.internal:6543", "grafana", "sw")
    assert pg["secureJsonData"] == {"password": "pw"}
    assert fake.datasources["stepwatch-prometheus"]["url"] == "http://prometheus:9090"
    assert set(fake.dashboards) == DASHBOARD_UIDS
    for body in fake.dashboards.values():
        assert body["folderUid"] == "stepwatch" and body["overwrite"] is True
        assert "id" not in body["dashboard"]
        committed = json.loads(
            (REPO / "dashboards" / f"{body['dashboard']['uid'][len('stepwatch-') :]}.json").read_text()
        )
        assert body["dashboard"]["panels"] == committed["panels"]

    state = (json.dumps(fake.datasources, sort_keys=True), json.dumps(fake.dashboards, sort_keys=True))
    fake.calls.clear()
    assert (
        _push(
            url, "--folder", "Training runs", "--postgres-url", "postgresql://grafana:pw@db.internal:6543/sw"
        )
        == 0
    )
    second = [(m, p) for m, p, _ in fake.calls]
    assert second == [
        ("GET", "/api/folders/stepwatch"),
        ("PUT", "/api/folders/stepwatch"),
        ("GET", "/api/datasources/uid/stepwatch-prometheus"),
        ("PUT", "/api/datasources/uid/stepwatch-prometheus"),
        ("GET", "/api/datasources/uid/stepwatch-postgres"),
        ("PUT", "/api/datasources/uid/stepwatch-postgres"),
        *[("POST", "/api/dashboards/db")] * len(DASHBOARDS),
    ]
    assert len(fake.folders) == 1 and len(fake.datasources) == 2 and len(fake.dashboards) == len(DASHBOARDS)
    assert (
        json.dumps(fake.datasources, sort_keys=True),
        json.dumps(fake.dashboards, sort_keys=True),
    ) == state
    assert fake.unauthorized == 0


def test_push_with_a_wrong_token_fails_and_says_so(
    grafana: tuple[str, FakeGrafana], capsys: pytest.CaptureFixture[str]
) -> None:
    url, fake = grafana
    code = main(
        ["grafana", "push", "--url", url, "--token", "wrong", "--dashboards", str(REPO / "dashboards")]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert "Unauthorized" in err or "401" in err, err
    assert fake.unauthorized >= 1 and not fake.dashboards
