"""Alert test fixtures: the collector fixtures of tests/service, a loopback receiver, config files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.alerts.receiver import Receiver
from tests.service.conftest import backend, database_url, start_collector  # noqa: F401


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture
def secrets(monkeypatch: pytest.MonkeyPatch, receiver: Receiver) -> dict[str, str]:
    """The environment the test configurations name: the Slack URL and the webhook secret."""
    env = {"SW_TEST_SLACK_URL": receiver.url("/slack"), "SW_TEST_HOOK_SECRET": "test-secret-0123456789"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def write_config(directory: Path, text: str) -> Path:
    path = directory / "alerts.yaml"
    path.write_text(text)
    return path
