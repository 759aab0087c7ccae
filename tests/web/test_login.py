"""The dashboard with tokens, in a real browser (web/tests/login.mjs, Chromium via playwright-core): it
asks for a token, refuses an unknown one, then shows only the runs the token reads, live through the
login cookie, with no token in any URL or in reach of the page's scripts; "Log out" asks again. Against a
real collector on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stepwatch_server.auth import load_tokens
from stepwatch_server.web.pages import INDEX
from tests.service.conftest import Collector, steps_batch
from tests.web.browser import CHROMIUM, WEB, require_browser

BROWSER_TIMEOUT_S = 120.0
ENV = {"FEEDER": "feeder-writes-every-run-0123", "VIEWER": "team-a-viewer-reads-0123"}
TOKENS = """\
tokens:
  - {name: feeder, token_env: FEEDER, scope: write}
  - {name: team-a-viewer, token_env: VIEWER, scope: read, runs: ["team-a/*"]}
"""


@pytest.fixture
def report(start_collector: Callable[..., Collector], tmp_path: Path) -> dict[str, Any]:
    require_browser(INDEX)
    (tmp_path / "tokens.yaml").write_text(TOKENS)
    collector = start_collector(tokens=load_tokens(tmp_path / "tokens.yaml", env=ENV))
    for run in ("team-a/llm", "team-b/vit"):
        batch = steps_batch(run, uuid.uuid4().hex, 0, [0, 1, 2], loss=[2.0, 1.9, 1.8])
        response = collector.post(batch, headers={"Authorization": f"Bearer {ENV['FEEDER']}"})
        assert response.status_code == 200, response.text
    env = {
        **os.environ,
        "STEPWATCH_URL": collector.server.url,
        "STEPWATCH_READ_TOKEN": ENV["VIEWER"],
        "CHROMIUM": CHROMIUM,
    }
    done = subprocess.run(
        ["node", str(WEB / "tests" / "login.mjs")],
        cwd=WEB,
        env=env,
        capture_output=True,
        text=True,
        timeout=BROWSER_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"login.mjs failed ({done.returncode}): {done.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_dashboard_asks_for_a_token_and_then_shows_only_the_runs_it_reads(report: dict[str, Any]) -> None:
    assert report["asked"] == {"title": "Sign in · stepwatch", "runsTable": 0, "focused": "token"}
    assert "not known" in report["refused"]["error"] and report["refused"]["stillAsking"] == 1
    signed_in = report["signedIn"]
    assert signed_in["runs"] == ["team-a/llm"]  # team-b/vit is another team's
    assert signed_in["live"] == "live"  # the event stream, through the cookie
    assert signed_in["cookieVisibleToScript"] == "" and signed_in["logoutShown"]
    assert report["reloaded"] == {"asked": 0}
    assert report["loggedOut"] == {"asked": 1, "runs": 0}
    assert report["requestsWithToken"] == [] and report["pageErrors"] == []
