"""docs/alerts.md matches the code: the webhook schema's fields are exactly those of a real body, the
example body is what the renderer writes, and the verification snippet accepts a real signature."""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any

from stepwatch_server.alerts import sign
from stepwatch_server.alerts.render import Message, webhook_payload
from stepwatch_server.alerts.transport import body_of
from tests.conftest import REPO

DOC = (REPO / "docs" / "alerts.md").read_text()


def json_blocks() -> list[str]:
    return re.findall(r"```json\n(.*?)```", DOC, flags=re.S)


def test_the_webhook_schema_lists_exactly_the_fields_sent() -> None:
    schema = json.loads(
        DOC.split("<!-- webhook-schema -->", 1)[1].split("```json\n", 1)[1].split("```", 1)[0]
    )
    example = json.loads(json_blocks()[0])
    anomaly = dict(example["anomalies"][0])
    msg = Message(
        "pager",
        "open",
        "llama-8b",
        "straggler",
        [anomaly],
        example["idempotency_key"],
        dt.datetime.now(dt.UTC),
    )
    body = webhook_payload(msg)
    assert set(schema["required"]) == set(schema["properties"]) == set(body) == set(example)
    item = schema["properties"]["anomalies"]["items"]
    assert set(item["required"]) == set(item["properties"]) == set(body["anomalies"][0]) == set(anomaly)
    assert body["schema"] == schema["properties"]["schema"]["const"] == example["schema"]
    assert body["anomalies"][0]["key_evidence"] == example["anomalies"][0]["key_evidence"]


def test_the_documented_verification_accepts_a_real_signature_and_refuses_a_tampered_body() -> None:
    snippet = re.search(r"```python\n(.*?)```", DOC, flags=re.S)
    assert snippet is not None
    namespace: dict[str, Any] = {}
    exec(snippet.group(1), namespace)
    body = body_of({"schema": "stepwatch.alert.v1", "count": 1})
    header = sign(b"k3y", body)
    assert namespace["verify"](b"k3y", body, header)
    assert not namespace["verify"](b"k3y", body.replace(b"1", b"2"), header)
    assert not namespace["verify"](b"other", body, header)
    assert not namespace["verify"](b"k3y", body, sign(b"k3y", body, timestamp=1_000_000_000))  # a replay
