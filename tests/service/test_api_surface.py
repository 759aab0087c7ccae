"""The public surface: __all__, the ingest example in the docs, OpenAPI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

import stepwatch_server
from stepwatch_server.ingest.example import EXAMPLE_BATCH
from stepwatch_server.ingest.validate import parse_batch
from tests.service.conftest import Collector

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
