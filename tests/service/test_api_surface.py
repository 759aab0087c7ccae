"""The public surface: __all__, the ingest example in the docs, OpenAPI."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from pathlib import Path

import httpx
import pytest

import stepwatch_server
from stepwatch_server.ingest.example import EXAMPLE_BATCH
from stepwatch_server.ingest.validate import parse_batch
from tests.service.conftest import Collector, make_batch

DOC = Path(__file__).resolve().parents[2] / "docs" / "ingest.md"


def test_all_is_honest() -> None:
    assert sorted(stepwatch_server.__all__) == ["Settings", "create_app"]
    for name in stepwatch_server.__all__:
        assert getattr(stepwatch_server, name) is not None


def test_example_in_docs_is_the_one_served_and_it_validates() -> None:
    block = re.search(r"```json\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None
    assert json.loads(block.group(1)) == EXAMPLE_BATCH
    batch = parse_batch(EXAMPLE_BATCH)
    assert batch.value_rows() == 24 and batch.replica_group == 3


def test_openapi_documents_ingest_with_the_example(collector: Collector) -> None:
    spec = httpx.get(f"{collector.server.url}/openapi.json").json()
    ingest = spec["paths"]["/api/v1/ingest"]["post"]
    assert ingest["tags"] == ["ingest"]
    assert ingest["requestBody"]["content"]["application/json"]["example"] == EXAMPLE_BATCH
    assert set(ingest["responses"]) >= {"200", "400", "401", "413", "415", "422"}
    assert spec["paths"]["/api/v1/runs/{run}/series"]["get"]["tags"] == ["runs"]


def test_documented_limits_are_the_enforced_ones() -> None:
    from stepwatch_server.ingest.schema import MAX_VALUES_PER_BATCH
    from stepwatch_server.settings import MAX_BATCH_BYTES

    text = DOC.read_text()
    assert MAX_BATCH_BYTES == 16 * 1024 * 1024 and "**16 MiB**" in text
    assert f"{MAX_VALUES_PER_BATCH:,}" in text


def test_an_unexpected_error_answers_500_in_the_documented_shape_without_details(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug behind any route (here one that raises, added to the real app) answers the error shape,
    with nothing of the exception in the answer and all of it in the log."""
    from stepwatch_server.app import create_app
    from stepwatch_server.settings import Settings

    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'x.db'}"))

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("secret detail /path?api_key=K")

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.get("/boom")

    with caplog.at_level(logging.ERROR, logger="stepwatch_server"):
        response = asyncio.run(get())
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "internal_error" and error["field"] is None and "log" in error["message"]
    assert "secret" not in response.text
    assert any("secret detail" in r.getMessage() or r.exc_info for r in caplog.records)


def test_a_bad_query_parameter_is_an_invalid_parameter_not_an_invalid_batch(collector: Collector) -> None:
    response = collector.http.get("/api/v1/alerts", params={"status": "nope"})
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_parameter"
    assert response.json()["error"]["field"] == "status"


def test_a_nul_or_an_out_of_range_number_in_a_parameter_is_a_422_naming_it_on_both_databases(
    populated: Collector,
) -> None:
    """PostgreSQL cannot take a NUL in a string, nor a step past 64 bits: each was a 500 (found by
    tests/service/test_openapi_conformance.py)."""
    run = EXAMPLE_BATCH["run"]
    for path, params, field in (
        (f"/api/v1/runs/{run}/tensors", {"name": "fc\x001"}, "name"),
        ("/api/v1/alerts", {"channel": "\x00"}, "channel"),
        ("/api/v1/runs/a%00b", {}, "run"),
        (f"/api/v1/runs/{run}/fingerprints", {"from_step": str(2**70)}, "from_step"),
        (f"/api/v1/runs/{run}/events", {"rank": str(2**33)}, "rank"),
        (f"/api/v1/runs/{run}/series", {"metric": "loss", "rank": "1" * 12}, "rank"),
    ):
        response = populated.http.get(path, params=params)
        assert response.status_code == 422, (path, params, response.text)
        error = response.json()["error"]
        assert error["code"] == "invalid_parameter" and error["field"] == field, (path, error)


def test_the_readme_limits_table_states_the_enforced_limits() -> None:
    """The README's limits table says what the code enforces (a change to a limit must change both)."""
    from stepwatch_server.ingest import schema
    from stepwatch_server.settings import MAX_BATCH_BYTES

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme[readme.index("| limit | value | beyond it |") :].split("\n\n", 1)[0]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in table.splitlines()[2:]}
    assert rows["batch size, on the wire and after gunzip"] == f"{MAX_BATCH_BYTES // 2**20} MiB"
    values = rows["values in one batch (scalars, tensor statistics, fingerprints, events)"]
    assert values == f"{schema.MAX_VALUES_PER_BATCH:,}"
    assert rows["world size (ranks in a run)"] == f"{schema.MAX_WORLD_SIZE:,}"
    names = rows["series names per run (metric names, and each tensor statistic of a module)"]
    assert names == f"{schema.MAX_SERIES_PER_RUN:,}"
    assert rows["step"] == "0 to 2^62" and schema.MAX_STEP == 2**62
    assert rows["one event's `data`"].startswith(
        f"{schema.MAX_EVENT_DATA_BYTES // 1024} KiB as JSON, nested at most {schema.MAX_EVENT_DATA_DEPTH} deep"
    )
    assert (
        rows["heartbeat stack"]
        == f"{schema.MAX_STACK_FRAMES} frames of 1-{schema.MAX_FRAME_CHARS} characters"
    )
    assert (
        schema.MAX_TS == 253_402_300_799.0
        and "end of 9999" in rows[next(k for k in rows if "timestamps" in k)]
    )
    from stepwatch_server.detect.engine import MAX_RUNS
    from stepwatch_server.ingest.store import MAX_CACHED_RUNS

    held = rows[next(k for k in rows if k.startswith("runs whose detection state"))]
    assert held == f"the {MAX_RUNS:,} most recently active"
    assert rows[next(k for k in rows if k.startswith("runs whose series ids"))] == (
        f"the {MAX_CACHED_RUNS:,} most recently written"
    )


def test_a_database_that_is_down_is_a_503_with_retry_after_and_healthz_says_so() -> None:
    """With its PostgreSQL unreachable (a closed port) the collector answered a plain-text 500: now
    ingest is a 503 in the error shape with Retry-After (the agent backs off and spools), and /healthz
    is 503 as well."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    collector = Collector(
        f"postgresql+psycopg://stepwatch@127.0.0.1:{port}/test", run_migrations=False, detection=False
    )
    try:
        response = collector.post(make_batch())
        assert response.status_code == 503, response.text
        assert response.headers["Retry-After"] == "5"
        error = response.json()["error"]
        assert error["code"] == "unavailable" and "retry later" in error["message"]
        assert collector.http.get("/healthz").status_code == 503
    finally:
        collector.close()


def test_ingest_taken_straight_to_its_handler_answers_as_the_routed_stack_does(tmp_path: Path) -> None:
    """`POST /api/v1/ingest` skips FastAPI's layers (asgi.CollectorApp) but not what they do for it: the
    app-wide parameter check, each error in the one shape with its headers, a bug's 500 without its
    details; other methods on the path are FastAPI's (405)."""
    from stepwatch_server.ingest.routes import INGEST_PATH

    collector = Collector(f"sqlite:///{tmp_path / 'x.db'}", token="s3cret-token")
    try:
        auth = {"Authorization": "Bearer s3cret-token"}
        ok = collector.http.post(INGEST_PATH, json=make_batch(), headers=auth)
        assert ok.status_code == 200 and ok.json()["accepted"] is True
        no_token = collector.http.post(INGEST_PATH, json=make_batch())
        assert no_token.status_code == 401 and no_token.headers["WWW-Authenticate"] == "Bearer"
        assert no_token.json()["error"]["field"] == "Authorization"
        nul = collector.http.post(INGEST_PATH, params={"note": "a\x00b"}, json=make_batch(), headers=auth)
        assert nul.status_code == 422
        assert nul.json()["error"] == {
            "code": "invalid_parameter",
            "field": "note",
            "message": "note: holds a NUL character (U+0000), which no name or value may",
        }
        bad = collector.http.post(INGEST_PATH, content=b"{", headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
        get = collector.http.get(INGEST_PATH, headers=auth)
        assert get.status_code == 405 and get.json()["error"]["code"] == "method_not_allowed"
    finally:
        collector.close()

    from stepwatch_server.app import create_app
    from stepwatch_server.settings import Settings

    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'y.db'}"))  # lifespan not run: no pipeline

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.post(INGEST_PATH, json=make_batch())

    response = asyncio.run(post())  # ingest finds no writing pipeline: a bug's AttributeError
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error" and "NoneType" not in response.text
