"""What the browser tests share: where the front end and Chromium are, and the check that they are there
(node, the system's Chromium, playwright-core from web/node_modules, the built pages)."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.conftest import REPO, require

WEB = REPO / "web"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOTS = REPO / "artifacts" / "screenshots"


def require_browser(built: Path) -> None:
    """Skip (fail under CI=true) with the fix when something a browser test needs is missing; `built`
    is the built page the test opens."""
    require(shutil.which("node") is not None, "node is not installed (Node.js 20: apt-get install nodejs)")
    require(Path(CHROMIUM).exists(), "chromium is not installed (apt-get install -y chromium)")
    require((WEB / "node_modules" / "playwright-core").is_dir(), "web/node_modules missing: cd web && npm ci")
    require(built.is_file(), "the dashboard is not built: cd web && npm ci && npm run build")
