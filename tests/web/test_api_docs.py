"""The API docs (/docs) come from the collector's own package: they render in a real browser with every
request beyond loopback refused (web/tests/docs.mjs, Chromium via playwright-core), as on an offline
training cluster. They were blank offline: Swagger UI came from a CDN."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from stepwatch_server.web.pages import DOCS
from tests.conftest import REPO, require
from tests.service.conftest import Collector

WEB = REPO / "web"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
BROWSER_TIMEOUT_S = 120.0


def test_the_api_docs_render_offline_from_the_package(collector: Collector) -> None:
    require(shutil.which("node") is not None, "node is not installed (Node.js 20: apt-get install nodejs)")
    require(Path(CHROMIUM).exists(), "chromium is not installed (apt-get install -y chromium)")
    require((WEB / "node_modules" / "playwright-core").is_dir(), "web/node_modules missing: cd web && npm ci")
    require(DOCS.is_file(), "the dashboard is not built: cd web && npm ci && npm run build")
    env = {**os.environ, "STEPWATCH_URL": collector.server.url, "CHROMIUM": CHROMIUM}
    done = subprocess.run(
        ["node", str(WEB / "tests" / "docs.mjs")],
        cwd=WEB, env=env, capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"docs.mjs failed ({done.returncode}): {done.stderr[-3000:]}"
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["status"] == 200
    assert report["blocked"] == [] and report["failed"] == [] and report["pageErrors"] == [], report
    assert {"/api/v1/ingest", "/api/v1/runs/{run}/series", "/healthz"} <= set(report["operations"])
    assert report["apiLink"]  # the header's "API" link leads there
    assert "stepwatch" in report["title"]
