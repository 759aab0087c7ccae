"""The API docs (/docs) come from the collector's own package: they render in a real browser with every
request beyond loopback refused (web/tests/docs.mjs, Chromium via playwright-core), as on an offline
training cluster. They were blank offline: Swagger UI came from a CDN."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from stepwatch_server.web.pages import DOCS
from tests.service.conftest import Collector
from tests.web.browser import CHROMIUM, WEB, require_browser

BROWSER_TIMEOUT_S = 120.0


def test_the_api_docs_render_offline_from_the_package(collector: Collector) -> None:
    require_browser(DOCS)
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
