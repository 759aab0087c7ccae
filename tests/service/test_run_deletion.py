"""Deleting a run and seeing what each run stores (README "Disk use, retention and deleting a run"), against a real
collector on both backends: `DELETE /api/v1/runs/{run}`, `stepwatch-server runs delete`/`runs list`,
`stored_values`/`stored_bytes` in the run answers, `stepwatch_database_bytes` in /metrics.
"""

from __future__ import annotations

import gzip
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, func, select

from stepwatch_server.alerts.config import load_config
from stepwatch_server.cli import main
from stepwatch_server.runs import deletion
from stepwatch_server.storage.models import ALL_TABLES, AgentSession, Run, Series
from tests.alerts.conftest import receiver  # noqa: F401  (a fixture: a loopback HTTP receiver)
from tests.alerts.helpers import config_text, nan_batch
from tests.alerts.receiver import Receiver
from tests.service.conftest import Collector, make_batch, steps_batch
from tests.service.test_auth import _tokens, bearer

WAIT_S = 60.0
STEPS = 400  # more than one 64-step rollup bucket, and one 256-step block once 128 steps behind


@pytest.fixture
def db(database_url: str) -> Iterator[Engine]:
    engine = create_engine(database_url)
    yield engine
    engine.dispose()


def _rows_of_run(engine: Engine, name: str, run_id: int) -> dict[str, int]:
    """Rows of every table that belong to run `run_id` (named `name`), found by the column that ties each
    table to a run: its id, its series, its sessions, or (the outbox) its name. A table tied by none of
    them fails the test, so a table added later cannot be forgotten by the delete unseen."""
    with engine.connect() as conn:
        series = select(Series.id).where(Series.run_id == run_id).scalar_subquery()
        sessions = select(AgentSession.id).where(AgentSession.run_id == run_id).scalar_subquery()
        counts = {}
        for table in ALL_TABLES:
            c = table.c
            if table.name == "runs":
                where = c.id == run_id
            elif "run_id" in c:
                where = c.run_id == run_id
            elif "series_id" in c:
                where = c.series_id.in_(series)
            elif "session_id" in c:
                where = c.session_id.in_(sessions)
            elif "run" in c:
                where = c.run == name
            else:
                raise AssertionError(f"table {table.name} is tied to a run by no column this test knows")
            counts[table.name] = int(
                conn.execute(select(func.count()).select_from(table).where(where)).scalar()
            )
        return counts


def _run_id(engine: Engine, name: str) -> int | None:
    with engine.connect() as conn:
        return conn.execute(select(Run.id).where(Run.name == name)).scalar()


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _feed(collector: Collector, run: str) -> int:
    """Two ranks of every kind of row (values, tensor statistics, fingerprints, events, a rank state), a
    non-finite loss (an anomaly and its alert events) and steps enough to be rolled up; returns the rows
    the ingest answers counted."""
    rows = 0
    for rank in range(2):
        doc = make_batch(run=run, rank=rank, world_size=2)
        answer = collector.post(doc)
        assert answer.status_code == 200, answer.text
        rows += answer.json()["rows"]
        loss = [2.0 + 0.001 * s for s in range(STEPS)]
        answer = collector.post(
            steps_batch(run, f"{run}-{rank}-long", 0, list(range(10, 10 + STEPS)), rank, 2, loss=loss)
        )
        assert answer.status_code == 200, answer.text
        rows += answer.json()["rows"]
    nan = nan_batch(run)
    nan["world_size"] = 2
    answer = collector.post(nan)
    assert answer.status_code == 200, answer.text
    rows += answer.json()["rows"]
    # evidence asked of its ranks and answered as an agent does: a command, a result and a trace
    asked = collector.http.post(f"/api/v1/runs/{run}/commands", json={"kind": "profile", "ranks": [0, 1]})
    assert asked.status_code == 202, asked.text
    cid = asked.json()["id"]
    trace = gzip.compress(b'{"traceEvents": []}')
    sent = collector.http.post(
        f"/api/v1/commands/{cid}/artifacts", params={"run": run, "rank": 0}, content=trace
    )
    assert sent.status_code == 200, sent.text
    result = {
        "run": run,
        "rank": 0,
        "session": "s",
        "kind": "profile",
        "status": "done",
        "result": {"steps": 5},
    }
    sent = collector.http.post(f"/api/v1/commands/{cid}/results", json=result)
    assert sent.status_code == 200, sent.text
    return rows


def _settled(engine: Engine, run: str) -> dict[str, int]:
    """The run's rows once detection stored its anomaly, its alerts went out and its rollups were written
    (every table holds some, and nothing changed for a second)."""
    run_id = _run_id(engine, run)
    assert run_id is not None
    seen: list[dict[str, int]] = []

    def done() -> bool:
        seen.append(_rows_of_run(engine, run, run_id))
        time.sleep(0.5)
        return len(seen) > 2 and seen[-1] == seen[-2] == seen[-3] and all(seen[-1].values())

    _wait(done, f"run {run}'s anomaly, alerts and rollups")
    return seen[-1]


def test_deleting_a_run_removes_every_row_of_it_and_nothing_of_the_others(
    start_collector: Callable[..., Collector],
    db: Engine,
    receiver: Receiver,  # noqa: F811  (the fixture imported above)
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SW_TEST_SLACK_URL", receiver.url("/slack"))
    monkeypatch.setenv("SW_TEST_HOOK_SECRET", "test-secret-0123456789")
    (tmp_path / "alerts.yaml").write_text(config_text(receiver))
    collector = start_collector(
        alerts=load_config(tmp_path / "alerts.yaml"), compact_after_steps=128
    )  # blocks too
    _feed(collector, "doomed")
    _feed(collector, "kept")
    doomed_id = _run_id(db, "doomed")
    assert doomed_id is not None
    doomed = _settled(db, "doomed")  # every table holds something of the run to delete
    kept = _settled(db, "kept")

    refused = collector.http.delete("/api/v1/runs/doomed")
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "run_live" and "force=true" in error["message"]

    answer = collector.http.delete("/api/v1/runs/doomed", params={"force": "true"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["run"] == "doomed"
    assert body["deleted"]["points"] == doomed["points"]
    assert sum(body["deleted"].values()) == sum(doomed.values())

    assert _rows_of_run(db, "doomed", doomed_id) == dict.fromkeys(doomed, 0)
    assert _rows_of_run(db, "kept", _run_id(db, "kept") or -1) == kept
    assert collector.http.get("/api/v1/runs/doomed").status_code == 404
    assert [r["name"] for r in collector.get("/api/v1/runs")["runs"]] == ["kept"]
    assert collector.http.delete("/api/v1/runs/doomed").status_code == 404


@pytest.mark.parametrize("by", ["api", "another-process"])
def test_a_deleted_run_that_sends_again_is_stored_afresh_with_its_detection(
    start_collector: Callable[..., Collector], db: Engine, database_url: str, by: str
) -> None:
    """The agent of a deleted run goes on with its session and sequence numbers: the collector that holds
    the run's ids in its caches (deleted through its API, or by `runs delete` in another process, which
    it learns from the write that misses the rows) stores it as a new run, nothing refused or lost, and
    detection starts again from nothing: the deleted run's open anomaly (a NaN at its last step, 59) is
    not carried into the new run."""
    collector = start_collector()
    session = "the-same-session"
    for seq in range(3):
        steps = list(range(seq * 20, seq * 20 + 20))
        loss: list[Any] = [1.0] * 20
        if seq == 2:
            loss[19] = "NaN"
        answer = collector.post(steps_batch("again", session, seq, steps, loss=loss))
        assert answer.status_code == 200, answer.text
    _wait(lambda: bool(collector.get("/api/v1/runs/again/anomalies")["anomalies"]), "the old run's anomaly")
    old = _run_id(db, "again")
    if by == "api":
        assert collector.http.delete("/api/v1/runs/again", params={"force": "true"}).status_code == 200
    else:
        assert main(["runs", "delete", "again", "--database-url", database_url, "--yes", "--force"]) == 0

    for seq in range(3, 6):
        steps = list(range(seq * 20, seq * 20 + 20))
        loss = [1.0] * 20
        if seq == 5:
            loss[3] = "NaN"
        answer = collector.post(steps_batch("again", session, seq, steps, loss=loss))
        assert answer.status_code == 200, answer.text
        assert answer.json()["rows"] == 20  # stored, not taken for a duplicate of the deleted run's
    new = _run_id(db, "again")
    assert new is not None
    series = collector.get("/api/v1/runs/again/series", metric="loss")["series"]
    assert series[0]["steps"][0] == 60 and len(series[0]["steps"]) == 60
    run = collector.get("/api/v1/runs/again")
    assert run["stored_values"] == 60
    assert run["restarts"] == []  # incarnation 1 again: the old run's sessions went with it

    def nonfinite() -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = collector.get("/api/v1/runs/again/anomalies")["anomalies"]
        return found

    _wait(lambda: any(a["kind"] == "nonfinite" for a in nonfinite()), "the new run's nonfinite anomaly")
    time.sleep(1.5)  # a tick of the detection worker: what the old state would have written, it has
    assert [a["first_step"] for a in nonfinite()] == [103]
    assert old is not None


def test_each_run_says_how_much_it_stores_and_metrics_has_the_database_size(
    start_collector: Callable[..., Collector],
) -> None:
    collector = start_collector()
    big = sum(
        collector.post(
            steps_batch(
                "big", f"big-session-{r:04d}", 0, list(range(500)), r, 4, loss=[1.0] * 500, lr=[0.1] * 500
            )
        ).json()["rows"]
        for r in range(4)
    )
    small = collector.post(
        steps_batch("small", "small-session-0001", 0, list(range(10)), loss=[1.0] * 10)
    ).json()["rows"]
    assert (big, small) == (4_000, 10)

    runs = {r["name"]: r for r in collector.get("/api/v1/runs")["runs"]}
    assert runs["big"]["stored_values"] == big and runs["small"]["stored_values"] == small
    one = collector.get("/api/v1/runs/big")
    assert one["stored_values"] == big
    # The same estimate from both endpoints; the database itself may grow between the two reads (the rollup
    # worker writes in the background), and its size is what the estimate shares out.
    assert one["stored_bytes"] > 0
    assert runs["big"]["stored_bytes"] == pytest.approx(one["stored_bytes"], rel=0.05)
    assert runs["big"]["stored_bytes"] / runs["small"]["stored_bytes"] == pytest.approx(big / small, rel=0.01)

    metrics = collector.http.get("/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("stepwatch_database_bytes "))
    size = float(line.split()[1])
    assert size >= runs["big"]["stored_bytes"] + runs["small"]["stored_bytes"] - 1
    duplicate = collector.post(
        steps_batch("small", "small-session-0001", 0, list(range(10)), loss=[1.0] * 10)
    )
    assert duplicate.json()["duplicates"] == small and duplicate.json()["rows"] == 0
    assert collector.get("/api/v1/runs/small")["stored_values"] == small  # a resend counts once


def test_deleting_needs_a_write_token_for_the_run(
    start_collector: Callable[..., Collector], tmp_path: Path
) -> None:
    collector = start_collector(tokens=_tokens(tmp_path))
    doc = steps_batch("team-a/x", "team-a-session-1", 0, [0, 1], loss=[1.0, 1.0])
    assert collector.post(doc, headers=bearer("TOKEN_A_WRITE")).status_code == 200
    url, force = "/api/v1/runs/team-a/x", {"force": "true"}
    assert collector.http.delete(url, params=force).status_code == 401
    for token in ("TOKEN_A_READ", "TOKEN_B_WRITE", "TOKEN_ALL_READ"):
        answer = collector.http.delete(url, params=force, headers=bearer(token))
        assert answer.status_code == 403, (token, answer.text)
    assert collector.http.get(url, headers=bearer("TOKEN_A_READ")).status_code == 200
    assert collector.http.delete(url, params=force, headers=bearer("TOKEN_A_WRITE")).status_code == 200
    assert collector.http.get(url, headers=bearer("TOKEN_A_READ")).status_code == 404


def test_runs_delete_command_asks_shows_progress_and_finishes_what_it_starts(
    start_collector: Callable[..., Collector],
    database_url: str,
    db: Engine,
    capsys: pytest.CaptureFixture[str],
) -> None:
    collector = start_collector()
    _feed(collector, "cli-run")
    _feed(collector, "other")
    collector.close()  # the command works on the database alone
    run_id = _run_id(db, "cli-run")
    assert run_id is not None
    before = _rows_of_run(db, "cli-run", run_id)

    assert main(["runs", "list", "--database-url", database_url]) == 0
    listed = capsys.readouterr().out
    assert "cli-run" in listed and "other" in listed and "values" in listed

    assert main(["runs", "delete", "cli-run", "--database-url", database_url, "--yes"]) == 2  # live
    assert "--force" in capsys.readouterr().err
    assert main(["runs", "delete", "cli-run", "--database-url", database_url, "--force"]) == 2  # no terminal
    assert "--yes" in capsys.readouterr().err
    assert _rows_of_run(db, "cli-run", run_id) == before

    code = main(["runs", "delete", "cli-run", "--database-url", database_url, "--yes", "--force"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"{before['points']:,} points" in out and "deleted run 'cli-run'" in out
    assert _rows_of_run(db, "cli-run", run_id) == dict.fromkeys(before, 0)
    assert _run_id(db, "other") is not None
    assert main(["runs", "delete", "cli-run", "--database-url", database_url, "--yes"]) == 1
    assert "not found" in capsys.readouterr().err


def test_a_delete_interrupted_midway_leaves_the_run_listed_and_is_finished_by_running_it_again(
    start_collector: Callable[..., Collector], db: Engine
) -> None:
    collector = start_collector()
    _feed(collector, "halfway")
    _feed(collector, "other")
    collector.close()
    with db.connect() as conn:
        found = deletion.find(conn, "halfway")
    assert found is not None
    before = _rows_of_run(db, "halfway", found.id)
    assert before["points"] > 100

    class Killed(Exception):
        pass

    def killed_in_the_points(table: str, rows: int, done: bool) -> None:
        if table == "points":
            raise Killed

    with pytest.raises(
        Killed
    ):  # chunks of 50 rows: the first chunk of points commits, then the process "dies"
        deletion.delete_run(db, found, chunk_rows=50, progress=killed_in_the_points)
    halfway = _rows_of_run(db, "halfway", found.id)
    assert halfway["runs"] == 1 and 0 < halfway["points"] < before["points"]

    deleted = deletion.delete_run(db, found, chunk_rows=50)
    assert _rows_of_run(db, "halfway", found.id) == dict.fromkeys(before, 0)
    assert deleted["points"] == halfway["points"] and deleted["runs"] == 1
    assert _run_id(db, "other") is not None


def test_a_run_whose_every_rank_closed_its_session_is_deleted_without_force(
    start_collector: Callable[..., Collector], db: Engine
) -> None:
    """Finished is not live, however recent its last batch: the dashboard shows no "live" pill for it."""
    collector = start_collector()
    for rank in range(2):
        doc = steps_batch("finished", f"finished-rank-{rank}", 0, [0, 1, 2], rank, 2, loss=[1.0, 0.9, 0.8])
        doc["events"] = [{"step": 2, "ts": doc["timestamps"][-1], "kind": "session_end", "data": {}}]
        assert collector.post(doc).status_code == 200
    _wait(lambda: collector.get("/api/v1/dashboard/runs")["runs"][0]["finished"], "the run to be finished")
    answer = collector.http.delete("/api/v1/runs/finished")
    assert answer.status_code == 200, answer.text
    assert _run_id(db, "finished") is None
