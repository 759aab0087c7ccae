"""The bus's commands refuse what cannot work, at start, saying how to fix it."""

from __future__ import annotations

import os
import subprocess
import sys

CLI = [sys.executable, "-m", "stepwatch_server.cli"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, env=env, check=False)


def test_detect_without_a_bus_says_it_needs_one() -> None:
    done = _run("detect", "--database-url", "sqlite:///unused.db")
    assert done.returncode == 2
    assert "--bus (or STEPWATCH_BUS) is required" in done.stderr


def test_a_bus_that_is_not_a_redis_url_is_refused_by_serve_and_detect() -> None:
    for args in (("serve", "--bus", "http://redis:6379"), ("detect", "--bus", "http://redis:6379")):
        done = _run(*args)
        assert done.returncode == 2, done.stderr
        assert (
            "expected a redis:// URL (e.g. redis://127.0.0.1:6379/0), got 'http://redis:6379'" in done.stderr
        )
