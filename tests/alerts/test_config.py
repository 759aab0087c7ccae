"""The alerts configuration: the documented example loads; a broken file is refused at start with the
line and the fix (unknown channel, missing secret, bad URL); `alerts test --channel` sends a real
test message; no secret reaches the database."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stepwatch_server.alerts import AlertsConfigError, load_config
from stepwatch_server.settings import Settings
from tests.alerts.conftest import write_config
from tests.alerts.helpers import SECRET, config_text
from tests.alerts.receiver import Receiver, verify_signature
from tests.conftest import REPO

EXAMPLE = REPO / "docs" / "alerts.example.yaml"
EXAMPLE_ENV = {
    "STEPWATCH_SLACK_ONCALL_URL": "https://hooks.slack.com/services/T0/B0/x",
    "STEPWATCH_SLACK_TRAINING_URL": "https://hooks.slack.com/services/T0/B1/y",
    "STEPWATCH_PAGER_SECRET": "0123456789abcdef",
}


def test_the_documented_example_loads_and_routes() -> None:
    config = load_config(EXAMPLE, env=EXAMPLE_ENV)
    assert set(config.channels) == {"oncall", "training", "pager"}
    assert config.route("hang", "critical", "prod-llama") == ("oncall", "pager", "training")
    assert config.route("hang", "critical", "dev-llama") == ("training",)
    assert config.route("straggler", "info", "prod-llama") == ()
    assert config.channels["oncall"].url == EXAMPLE_ENV["STEPWATCH_SLACK_ONCALL_URL"]
    assert "hooks.slack.com" not in repr(config)  # secrets stay out of logs and reprs


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (("channels: [oncall, pager]", "channels: [oncall, pagr]"), ":38: routes[0].channels[1]: unknown channel 'pagr'"),
        (("secret_env: STEPWATCH_PAGER_SECRET", "secret_env: SW_NOT_SET"), ":33: channels.pager.secret_env: environment variable SW_NOT_SET"),
        (("url: https://alerts.example.com/stepwatch", "url: alerts.example.com/x"), ":32: channels.pager.url: the receiver's URL must be an http:// or https:// URL"),
        (("severity: critical", "severity: urgent"), ":37: routes[0].match.severity: unknown value 'urgent'"),
        (("kind: [nonfinite,", "kind: [nan,"), ":37: routes[0].match.kind[0]: unknown value 'nan'"),
        (("url_env: STEPWATCH_SLACK_ONCALL_URL", "url: https://hooks.slack.com/x"), ":25: channels.oncall.url: a Slack incoming-webhook URL is a secret"),
        (("  cooldown_s: 900", "  cooldown_s: soon"), ":15: grouping.cooldown_s: expected a number"),
        (("max_per_minute: 10", "max_per_minte: 10"), ":26: channels.oncall.max_per_minte: unknown setting"),
        (("routes:\n", "routes: [\n"), ":37: not valid YAML"),
    ],
)  # fmt: skip
def test_a_broken_file_names_the_line_and_the_fix(
    tmp_path: Path, change: tuple[str, str], expected: str
) -> None:
    text = EXAMPLE.read_text()
    assert change[0] in text
    path = write_config(tmp_path, text.replace(*change, 1))
    with pytest.raises(AlertsConfigError) as failure:
        load_config(path, env=EXAMPLE_ENV)
    assert f"{path}{expected}" in str(failure.value), str(failure.value)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "stepwatch_server.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_serve_refuses_a_broken_file_at_start(
    tmp_path: Path, receiver: Receiver, secrets: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SW_TEST_HOOK_SECRET")
    path = write_config(tmp_path, config_text(receiver))
    done = run_cli(
        "serve", "--port", "0", "--database-url", f"sqlite:///{tmp_path / 'db.sqlite'}", "--alerts", str(path)
    )
    assert done.returncode == 2
    assert f"{path}:12: channels.pager.secret_env: environment variable SW_TEST_HOOK_SECRET" in done.stderr
    assert not (tmp_path / "db.sqlite").exists()  # refused before anything started
    monkeypatch.setenv("STEPWATCH_ALERTS", str(path))  # the environment variable is checked the same way
    with pytest.raises(ValueError, match="SW_TEST_HOOK_SECRET"):
        Settings()


def test_alerts_test_sends_a_real_signed_message(
    tmp_path: Path, receiver: Receiver, secrets: dict[str, str]
) -> None:
    path = write_config(tmp_path, config_text(receiver))
    done = run_cli("alerts", "test", "--channel", "pager", "--alerts", str(path))
    assert done.returncode == 0, done.stderr
    assert "delivered to pager (HTTP 200)" in done.stdout
    [hook] = receiver.on("/hook")
    assert hook.json["event"] == "test" and hook.json["schema"] == "stepwatch.alert.v1"
    assert verify_signature(SECRET, hook.body, hook.headers["x-stepwatch-signature"]) and hook.key

    done = run_cli("alerts", "test", "--channel", "team", "--alerts", str(path))
    assert done.returncode == 0, done.stderr
    [slack] = receiver.on("/slack")
    assert slack.json["blocks"][0]["text"]["text"].startswith("TEST: INFO straggler")

    assert run_cli("alerts", "test", "--channel", "nope", "--alerts", str(path)).returncode == 2
    receiver.script = [(403, {})]
    done = run_cli("alerts", "test", "--channel", "pager", "--alerts", str(path))
    assert done.returncode == 1 and "HTTP 403" in done.stderr


def test_alerts_test_needs_only_the_secret_of_the_channel_it_tests(
    tmp_path: Path, receiver: Receiver, secrets: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Setting up channels one at a time: the Slack URL is not exported yet, the webhook can be tested."""
    monkeypatch.delenv("SW_TEST_SLACK_URL")
    path = write_config(tmp_path, config_text(receiver))
    done = run_cli("alerts", "test", "--channel", "pager", "--alerts", str(path))
    assert done.returncode == 0, done.stderr
    assert len(receiver.on("/hook")) == 1
    done = run_cli("alerts", "test", "--channel", "team", "--alerts", str(path))  # this one needs its own
    assert (
        done.returncode == 2
        and "channels.team.url_env: environment variable SW_TEST_SLACK_URL" in done.stderr
    )
    with pytest.raises(AlertsConfigError, match="SW_TEST_SLACK_URL"):  # serving still needs every channel's
        load_config(path)


def test_the_public_surface_is_honest() -> None:
    import stepwatch_server.alerts as alerts

    assert len(set(alerts.__all__)) == len(alerts.__all__)
    assert all(getattr(alerts, name) is not None for name in alerts.__all__)
    assert {"AlertWorker", "load_config", "record_delivery", "verify"} <= set(alerts.__all__)
