"""Who may write and read which runs: scoped tokens (README "Security and limits"), against a real
collector on SQLite and PostgreSQL.

The tokens file names each token's secret by an environment variable; the tests pass that environment
to `load_tokens` directly, as the collector's start does with os.environ.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from stepwatch_server.auth import load_tokens
from stepwatch_server.cli import main
from tests.service.conftest import STREAM_WAIT_S, Collector, listen_events, steps_batch

ENV = {
    "TOKEN_A_WRITE": "team-a-writes-0123456789",
    "TOKEN_B_WRITE": "team-b-writes-0123456789",
    "TOKEN_A_READ": "team-a-reads-0123456789",
    "TOKEN_ALL_READ": "everyone-reads-0123456789",
}
TOKENS_YAML = """\
tokens:
  - name: team-a-training
    token_env: TOKEN_A_WRITE
    scope: write
    runs: ["team-a/*"]
  - name: team-b-training
    token_env: TOKEN_B_WRITE
    scope: write
    runs: ["team-b/*", "shared-eval"]
  - name: team-a-viewer
    token_env: TOKEN_A_READ
    scope: read
    runs: ["team-a/*"]
  - name: grafana
    token_env: TOKEN_ALL_READ
    scope: read
"""


def bearer(env_name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {ENV[env_name]}"}


def _tokens(tmp_path: Path, text: str = TOKENS_YAML) -> Any:
    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    return load_tokens(path, env=ENV)


@pytest.fixture
def scoped(start_collector: Callable[..., Collector], tmp_path: Path) -> Collector:
    return start_collector(tokens=_tokens(tmp_path))


def _write(collector: Collector, run: str, loss: list[float], token: str) -> httpx.Response:
    batch = steps_batch(run, uuid.uuid4().hex, 0, list(range(len(loss))), loss=loss)
    return collector.post(batch, headers=bearer(token))


def _loss(collector: Collector, run: str, token: str = "TOKEN_ALL_READ") -> list[Any]:
    r = collector.http.get(f"/api/v1/runs/{run}/series", params={"metric": "loss"}, headers=bearer(token))
    assert r.status_code == 200, r.text
    return [v for s in r.json()["series"] for v in s["values"]]


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == {401: "unauthorized", 403: "forbidden"}[status]
    return str(error["message"])


def test_another_teams_write_token_cannot_start_a_new_incarnation_of_its_run(scoped: Collector) -> None:
    assert _write(scoped, "team-a/llm", [2.0, 1.9, 1.8], "TOKEN_A_WRITE").status_code == 200
    before = scoped.counts()
    # team b resumes "team-a/llm" from step 0 with a new session: a new incarnation that would replace the loss
    message = _error(_write(scoped, "team-a/llm", [99.0, 99.0, 99.0], "TOKEN_B_WRITE"), 403)
    assert "team-b/*" in message and "'team-a/llm'" in message and "write token" in message
    assert "team-b-training" in message  # which token, by its name
    assert ENV["TOKEN_B_WRITE"] not in message
    assert scoped.counts() == before
    assert _loss(scoped, "team-a/llm") == [2.0, 1.9, 1.8]
    # nor a read token, even one that reads the run
    message = _error(_write(scoped, "team-a/llm", [99.0], "TOKEN_A_READ"), 403)
    assert "only reads" in message and "'team-a/llm'" in message
    assert scoped.counts() == before


def test_a_write_without_a_known_token_is_401_before_the_body_is_read(scoped: Collector) -> None:
    batch = steps_batch("team-a/llm", uuid.uuid4().hex, 0, [0], loss=[1.0])
    assert "write token" in _error(scoped.post(batch), 401)
    assert "write token" in _error(scoped.post(batch, headers={"Authorization": "Bearer nope"}), 401)
    # a session cookie is for the dashboard's reads only: it never writes
    assert _error(scoped.post(batch, headers={"Cookie": f"stepwatch_token={ENV['TOKEN_A_WRITE']}"}), 401)
    assert scoped.counts()["points"] == 0


READ_ROUTES = [
    "/api/v1/runs",
    "/api/v1/runs/team-a/llm",
    "/api/v1/runs/team-a/llm/series?metric=loss",
    "/api/v1/runs/team-a/llm/anomalies",
    "/api/v1/runs/team-a/llm/heatmap?metric=loss",
    "/api/v1/dashboard/runs",
    "/api/v1/anomalies",
    "/api/v1/alerts",
    "/api/v1/detection",
    "/api/v1/stream",
    "/metrics",
]


def test_reads_need_a_read_token_when_tokens_are_configured(scoped: Collector) -> None:
    assert _write(scoped, "team-a/llm", [2.0], "TOKEN_A_WRITE").status_code == 200
    for path in READ_ROUTES:
        message = _error(scoped.http.get(path), 401)
        assert "read token" in message, path
        assert _error(scoped.http.get(path, headers={"Authorization": "Bearer nope"}), 401)
    assert scoped.http.get("/healthz").status_code == 200
    assert scoped.http.get("/api/v1/runs", headers=bearer("TOKEN_ALL_READ")).status_code == 200


def test_a_prefix_limited_read_token_sees_only_its_runs(scoped: Collector) -> None:
    assert _write(scoped, "team-a/llm", [2.0], "TOKEN_A_WRITE").status_code == 200
    assert _write(scoped, "team-b/vit", [3.0], "TOKEN_B_WRITE").status_code == 200
    assert _write(scoped, "shared-eval", [4.0], "TOKEN_B_WRITE").status_code == 200

    def names(path: str, token: str) -> set[str]:
        r = scoped.http.get(path, headers=bearer(token))
        assert r.status_code == 200, r.text
        return {run["name"] for run in r.json()["runs"]}

    for path in ("/api/v1/runs", "/api/v1/dashboard/runs"):
        assert names(path, "TOKEN_A_READ") == {"team-a/llm"}
        assert names(path, "TOKEN_B_WRITE") == {"team-b/vit", "shared-eval"}  # a write token reads its runs
        assert names(path, "TOKEN_ALL_READ") == {"team-a/llm", "team-b/vit", "shared-eval"}
    assert _loss(scoped, "team-a/llm", "TOKEN_A_READ") == [2.0]
    # another team's run: 403 whether it exists or not, so the answer tells nothing about it
    for run in ("team-b/vit", "team-b/no-such-run"):
        message = _error(
            scoped.http.get(f"/api/v1/runs/{run}/series?metric=loss", headers=bearer("TOKEN_A_READ")), 403
        )
        assert f"run '{run}' needs a read token for it" in message and "team-a/*" in message
    stream = scoped.http.get("/api/v1/stream?run=team-b/vit", headers=bearer("TOKEN_A_READ"))
    assert "team-a/*" in _error(stream, 403)
    # what spans every run (the Prometheus exposition, the alert log, the detection worker) needs a
    # token for every run
    for path in ("/metrics", "/api/v1/alerts", "/api/v1/detection"):
        assert "every run" in _error(scoped.http.get(path, headers=bearer("TOKEN_A_READ")), 403)
        assert scoped.http.get(path, headers=bearer("TOKEN_ALL_READ")).status_code == 200
    anomalies = scoped.http.get("/api/v1/anomalies", headers=bearer("TOKEN_A_READ"))
    assert anomalies.status_code == 200
    assert {a["run"] for a in anomalies.json()["anomalies"]} <= {"team-a/llm"}


def test_public_read_opens_reads_but_not_writes(
    start_collector: Callable[..., Collector], tmp_path: Path
) -> None:
    collector = start_collector(tokens=_tokens(tmp_path), public_read=True)
    assert _write(collector, "team-a/llm", [2.0], "TOKEN_A_WRITE").status_code == 200
    for path in READ_ROUTES:
        if path != "/api/v1/stream":
            assert collector.http.get(path).status_code in (200, 404), path
    assert {r["name"] for r in collector.get("/api/v1/runs")["runs"]} == {"team-a/llm"}
    before = collector.counts()
    batch = steps_batch("team-a/llm", uuid.uuid4().hex, 0, [0], loss=[99.0])
    assert _error(collector.post(batch), 401)
    assert _error(collector.post(batch, headers=bearer("TOKEN_ALL_READ")), 403)
    assert collector.counts() == before


def test_the_single_token_writes_and_reads_every_run_as_before(
    start_collector: Callable[..., Collector], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="stepwatch_server"):
        collector = start_collector(token="s3cret")
    assert "STEPWATCH_TOKEN: under 16 characters, guessable" in caplog.text
    ok = {"Authorization": "Bearer s3cret"}
    batch = steps_batch("any/run", uuid.uuid4().hex, 0, [0, 1], loss=[1.0, 2.0])
    assert _error(collector.post(batch), 401)
    assert _error(collector.post(batch, headers={"Authorization": "Bearer nope"}), 401)
    assert collector.post(batch, headers=ok).status_code == 200
    assert (
        collector.post(steps_batch("other", uuid.uuid4().hex, 0, [0], x=[1.0]), headers=ok).status_code == 200
    )
    assert _error(collector.http.get("/api/v1/runs"), 401)  # reads need it now (or --public-read)
    runs = collector.http.get("/api/v1/runs", headers=ok)
    assert {r["name"] for r in runs.json()["runs"]} == {"any/run", "other"}
    for path in ("/metrics", "/api/v1/alerts", "/api/v1/runs/any/run/series?metric=loss"):
        assert collector.http.get(path, headers=ok).status_code == 200, path


def test_without_tokens_everything_stays_open(collector: Collector) -> None:
    batch = steps_batch("open/run", uuid.uuid4().hex, 0, [0], loss=[1.0])
    assert collector.post(batch).status_code == 200
    assert collector.http.get("/api/v1/runs").status_code == 200
    assert collector.http.get("/metrics").status_code == 200


def _stream_names(collector: Collector, headers: dict[str, str], want: str) -> set[str]:
    """The run names the event stream sends with `headers` until it has sent `want`."""
    events: list[dict[str, Any]] = []
    done = threading.Event()
    url = f"{collector.server.url}/api/v1/stream"
    threading.Thread(target=listen_events, args=(url, events, done, headers), daemon=True).start()
    deadline = time.monotonic() + STREAM_WAIT_S
    while time.monotonic() < deadline:
        names = {r["name"] for e in list(events) for r in e["runs"]}
        if want in names:
            return names
        time.sleep(0.05)
    raise AssertionError(f"the stream did not send {want!r}: {events}")


def test_the_event_stream_with_a_token_sends_only_the_runs_it_may_read(scoped: Collector) -> None:
    assert _write(scoped, "team-b/vit", [3.0], "TOKEN_B_WRITE").status_code == 200
    assert _write(scoped, "team-a/llm", [2.0], "TOKEN_A_WRITE").status_code == 200
    assert _stream_names(scoped, bearer("TOKEN_A_READ"), "team-a/llm") == {"team-a/llm"}
    # the dashboard's way: the login sets a cookie, which EventSource sends by itself
    login = httpx.post(f"{scoped.server.url}/api/v1/login", json={"token": ENV["TOKEN_ALL_READ"]})
    assert login.status_code == 204
    cookie = login.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    value = login.cookies["stepwatch_token"]
    names = _stream_names(scoped, {"Cookie": f"stepwatch_token={value}"}, "team-b/vit")
    assert names == {"team-a/llm", "team-b/vit"}


def test_login_refuses_an_unknown_token_and_logout_clears_the_cookie(scoped: Collector) -> None:
    assert "not known" in _error(scoped.http.post("/api/v1/login", json={"token": "nope"}), 401)
    assert scoped.http.post("/api/v1/login", json={"token": ENV["TOKEN_A_READ"]}).status_code == 204
    assert scoped.http.get("/api/v1/runs").status_code == 200  # the client keeps the cookie
    assert scoped.http.post("/api/v1/logout").status_code == 204
    assert _error(scoped.http.get("/api/v1/runs"), 401)
    # anyone may send a login, so its body is read bounded and checked like any other
    huge = scoped.http.post("/api/v1/login", content=b'{"token": "' + b"x" * 100_000 + b'"}')
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "too_large"
    assert scoped.http.post("/api/v1/login", content=b"token=x").status_code == 400
    assert scoped.http.post("/api/v1/login", json={"token": 7}).json()["error"]["field"] == "token"


BAD_CONFIGS = [
    ("tokens: []\n", "tokens", "at least one"),
    ("tokens:\n  - name: a\n    scope: read\n", "tokens[0].token_env", "token_env"),
    ("tokens:\n  - name: a\n    token_env: UNSET_VAR\n    scope: read\n", "UNSET_VAR", "not set"),
    ("tokens:\n  - name: a\n    token_env: SHORT\n    scope: read\n", "tokens[0].token_env", "16"),
    (
        "tokens:\n  - name: a\n    token_env: TOKEN_A_READ\n    scope: admin\n",
        "tokens[0].scope",
        "read or write",
    ),
    (
        "tokens:\n  - name: a\n    token_env: TOKEN_A_READ\n    scope: read\n    runs: ['team-*/x']\n",
        "tokens[0].runs[0]",
        "only at the end",
    ),
    (
        "tokens:\n  - name: a\n    token_env: TOKEN_A_READ\n    scope: read\n    runs: []\n",
        "tokens[0].runs",
        "at least one",
    ),
    (
        "tokens:\n  - name: a\n    token_env: TOKEN_A_READ\n    scope: read\n    team: x\n",
        "team",
        "name, token_env",
    ),
    (
        "tokens:\n  - {name: a, token_env: TOKEN_A_READ, scope: read}\n"
        "  - {name: b, token_env: SAME_AS_A, scope: write}\n",
        "tokens[1].token_env",
        "same token as 'a'",
    ),
    (
        "tokens:\n  - {name: a, token_env: TOKEN_A_READ, scope: read}\n"
        "  - {name: a, token_env: TOKEN_B_WRITE, scope: write}\n",
        "tokens[1].name",
        "used twice",
    ),
    ("tokens: [\n", "tokens.yaml", "not valid YAML"),
]


@pytest.mark.parametrize(("text", "names", "fix"), BAD_CONFIGS)
def test_a_bad_tokens_file_stops_the_collector_at_start_with_the_field_and_the_fix(
    text: str,
    names: str,
    fix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    for key, value in {**ENV, "SHORT": "short", "SAME_AS_A": ENV["TOKEN_A_READ"]}.items():
        monkeypatch.setenv(key, value)
    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    db = f"sqlite:///{tmp_path / 'x.db'}"
    with caplog.at_level(logging.DEBUG):
        code = main(["serve", "--database-url", db, "--tokens-file", str(path), "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{path}:" in err and names in err and fix in err, err
    logged = err + caplog.text
    assert not any(secret in logged for secret in ENV.values())


def test_the_tokens_file_comes_from_the_environment_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stepwatch_server.settings import Settings

    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    path = tmp_path / "tokens.yaml"
    path.write_text(TOKENS_YAML)
    monkeypatch.setenv("STEPWATCH_TOKENS_FILE", str(path))
    monkeypatch.setenv("STEPWATCH_PUBLIC_READ", "1")
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'x.db'}")
    assert [t.name for t in settings.tokens] == [
        "team-a-training",
        "team-b-training",
        "team-a-viewer",
        "grafana",
    ]
    assert settings.public_read
    assert ENV["TOKEN_A_WRITE"] not in repr(settings)


def test_the_readme_tokens_file_example_is_one_the_collector_accepts(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("### Security and limits") :]
    example = section[section.index("```yaml\n") + 8 : section.index("```\n", section.index("```yaml"))]
    path = tmp_path / "tokens.yaml"
    path.write_text(example)
    env = {"STEPWATCH_TOKEN_TEAM_A": "a" * 16, "STEPWATCH_TOKEN_READ": "r" * 16}
    team_a, reader = load_tokens(path, env=env)
    assert team_a.writes("team-a/llm") and not team_a.writes("team-b/llm") and team_a.reads("team-a/x")
    assert reader.reads("anything") and not reader.writes("anything")


def test_the_log_names_the_tokens_and_never_shows_one(
    start_collector: Callable[..., Collector], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="stepwatch_server"):
        collector = start_collector(tokens=_tokens(tmp_path), token="legacy-token-0123456789")
        assert collector.http.post("/api/v1/login", json={"token": ENV["TOKEN_A_READ"]}).status_code == 204
        assert _write(collector, "team-b/x", [1.0], "TOKEN_A_WRITE").status_code == 403
    assert "access: 5 token(s): STEPWATCH_TOKEN (write *); team-a-training (write team-a/*)" in caplog.text
    assert "login with the token 'team-a-viewer'" in caplog.text
    assert not any(secret in caplog.text for secret in [*ENV.values(), "legacy-token-0123456789"])


def test_commands_are_asked_and_answered_only_with_a_write_token_for_the_run(scoped: Collector) -> None:
    """Asking a run's ranks for evidence, and answering as an agent, write: a read token, another team's
    write token and no token are refused; the run's own write token asks, and the command records who."""
    assert _write(scoped, "team-a/cmd", [1.0, 0.9], "TOKEN_A_WRITE").status_code == 200
    ask = {"kind": "stacks"}
    path = "/api/v1/runs/team-a/cmd/commands"
    assert "team-a-viewer" in _error(scoped.http.post(path, json=ask, headers=bearer("TOKEN_A_READ")), 403)
    _error(scoped.http.post(path, json=ask, headers=bearer("TOKEN_B_WRITE")), 403)
    _error(scoped.http.post(path, json=ask), 401)
    asked = scoped.http.post(path, json=ask, headers=bearer("TOKEN_A_WRITE"))
    assert asked.status_code == 202 and asked.json()["requested_by"] == "token team-a-training"
    answer = {
        "run": "team-a/cmd",
        "rank": 0,
        "session": "s",
        "kind": "stacks",
        "status": "refused",
        "message": "no",
    }
    results = f"/api/v1/commands/{asked.json()['id']}/results"
    _error(scoped.http.post(results, json=answer, headers=bearer("TOKEN_B_WRITE")), 403)
    _error(scoped.http.post(results, json=answer, headers=bearer("TOKEN_A_READ")), 403)
    took = scoped.http.post(results, json=answer, headers=bearer("TOKEN_A_WRITE"))
    assert took.status_code == 200 and took.json() == {"accepted": True, "first": True}
    view = scoped.http.get(f"{path}/{asked.json()['id']}", headers=bearer("TOKEN_A_READ")).json()
    assert view["ranks"] == [
        {"rank": 0, "status": "refused", "message": "no", "received_at": view["ranks"][0]["received_at"]}
    ]
    _error(scoped.http.get(f"{path}/{asked.json()['id']}"), 401)
