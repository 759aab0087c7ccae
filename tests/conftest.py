"""Shared test helpers.

Tests use real services. Outside CI a missing service skips the test with a reason; under CI=true it
fails, because CI must exercise everything.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
POSTGRES_URL = os.environ.get(
    "STEPWATCH_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def require(condition: bool, reason: str) -> None:
    """Skip (outside CI) or fail (under CI=true) when a needed service or file is missing."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"required under CI=true: {reason}")
    pytest.skip(reason)


def require_module(name: str) -> Any:
    """Import `name`; when it is missing, skip (outside CI) or fail (under CI=true), as `require` does."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        require(False, f"{name} cannot be imported: {exc}")
        raise  # not reached: require() raised


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def python_exe() -> str:
    return sys.executable
