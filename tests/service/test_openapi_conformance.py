"""Every route answers as its own OpenAPI says (schemathesis): no server error, only documented status codes
and content types, bodies that match their schemas. Against a real collector on each database that holds
the docs' example run and the anomaly it opens; half the generated requests name that run (and metric), so
200 answers are checked, not only 404s. The event stream is left out: it never ends (tests/web covers it)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from stepwatch_server.ingest.example import EXAMPLE_BATCH
from tests.conftest import require_module
from tests.service.conftest import Collector, generated

schemathesis = require_module("schemathesis")
positive_data_acceptance = require_module("schemathesis.specs.openapi.checks").positive_data_acceptance
hypothesis = require_module("hypothesis")
st = require_module("hypothesis.strategies")

EXAMPLES_PER_ROUTE = 25  # bounded for CI; derandomized, so every run sends the same requests
# Rules across fields are beyond JSON Schema: a request valid by the schema can be a 422 there, so these
# operations are not held to accepting every schema-valid request (every other check still applies).
RULES_ACROSS_FIELDS = {
    "POST /api/v1/ingest": "columns as long as their steps, rank < world_size, steps increasing",
    "GET /api/v1/runs/{run}/series": "rank=global takes metric=grad_norm only",
    "POST /api/v1/commands/{command_id}/artifacts": "the body is a gzip file (its first bytes say so)",
}


@pytest.fixture(scope="module")
def api(populated: Collector) -> Collector:
    deadline = (
        time.monotonic() + 20
    )  # the example's NaN opens a nonfinite anomaly: anomaly answers are checked too
    while not populated.get("/api/v1/anomalies")["anomalies"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert populated.get("/api/v1/anomalies")["anomalies"], "the example batch opened no anomaly"
    return populated


def send(api: Collector, case: Any) -> Any:
    """Send the generated request over the collector's own HTTP client (httpx, to the real server)."""
    kwargs = case.as_transport_kwargs(base_url=api.server.url)
    data = kwargs.pop("data", None)
    if isinstance(data, (bytes, str)):
        kwargs["content"] = data
    elif data is not None:
        kwargs["data"] = data
    for unused in ("allow_redirects", "verify", "timeout", "cookies"):  # no route reads a cookie
        kwargs.pop(unused, None)
    return api.http.request(**kwargs)


def check_operation(api: Collector, operation: Any, excluded: list[Any]) -> None:
    """Generated requests for one operation, each answer checked by schemathesis; raises on a failure."""

    @generated(EXAMPLES_PER_ROUTE)
    @hypothesis.given(case=operation.as_strategy(), real=st.booleans())
    def check(case: Any, real: bool) -> None:
        # Half the requests name the stored run and metric, so 200 answers are checked too; not a DELETE,
        # which would remove the run the other routes are checked on (test_run_deletion.py checks it).
        if real and case.method.upper() != "DELETE":
            if "run" in (case.path_parameters or {}):
                case.path_parameters["run"] = EXAMPLE_BATCH["run"]
            if "metric" in (case.query or {}):
                case.query["metric"] = "loss"
        case.validate_response(send(api, case), excluded_checks=excluded)

    check()


def test_every_route_answers_as_its_openapi_says(api: Collector) -> None:
    loaded = schemathesis.openapi.from_url(f"{api.server.url}/openapi.json").exclude(path="/api/v1/stream")
    loaded.config.generation.update(allow_x00=False)  # NUL is refused in every string (README, limits)
    operations = [result.ok() for result in loaded.get_all_operations()]
    assert len(operations) >= 15, [op.label for op in operations]
    failures: dict[str, str] = {}
    for operation in operations:
        excluded = [positive_data_acceptance] if operation.label in RULES_ACROSS_FIELDS else []
        try:
            check_operation(api, operation, excluded)
        except (Exception, BaseExceptionGroup) as exc:  # every route's failures are collected, then reported
            failures[operation.label] = str(exc)[:1500]
    assert not failures, "\n\n".join(f"{label}:\n{text}" for label, text in failures.items())


def test_the_example_run_is_there_for_the_run_routes(api: Collector) -> None:
    assert api.get(f"/api/v1/runs/{EXAMPLE_BATCH['run']}")["name"] == EXAMPLE_BATCH["run"]
