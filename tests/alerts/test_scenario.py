"""A run with a straggler, a NaN on the 8 ranks of one node and a loss spike, ingested over HTTP into a
real collector with alerts: exactly the expected messages reach the routed channels, Slack's as valid
Block Kit, the webhook's signed (and a tampered body fails verification), resolves after recoveries."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from slack_sdk.models.blocks import Block

from stepwatch_server.alerts import load_config
from stepwatch_server.simulate import LossSpike, NonFinite, Scenario, Straggler
from tests.alerts.conftest import write_config
from tests.alerts.helpers import SECRET, config_text, feed, settled
from tests.alerts.receiver import Receiver, verify_signature
from tests.service.conftest import Collector

SCENARIO = Scenario(
    "alerts_mix_16",
    16,
    1300,
    seed=5,
    faults=(
        Straggler(6, 300, factor=1.3, phase="data"),
        NonFinite(700, ranks=tuple(range(8, 16))),  # every rank of node gpu-001
        LossSpike(1100),
    ),
    flush_interval_s=20.0,  # 50 steps per batch: few requests, same detections
    eval_every=0,
    run="llama-mix",
)


def check_block_kit(payload: dict[str, object]) -> None:
    """What Slack's incoming webhook takes: a fallback `text` and blocks that slack_sdk's Block Kit
    models parse back to the same JSON and validate (types, required fields, length limits)."""
    assert set(payload) == {"text", "blocks"} and isinstance(payload["text"], str) and payload["text"]
    raw = payload["blocks"]
    assert isinstance(raw, list) and 0 < len(raw) <= 50
    for block_json in raw:
        block = Block.parse(block_json)
        assert block is not None and type(block).__name__ != "Block", f"unknown block type: {block_json}"
        block.validate_json()
        assert block.to_dict() == block_json


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)  # PostgreSQL: test_delivery's outage test
def test_straggler_nan_and_spike_reach_the_routed_channels(
    start_collector: Callable[..., Collector], receiver: Receiver, secrets: dict[str, str], tmp_path: Path
) -> None:
    config = load_config(write_config(tmp_path, config_text(receiver)))
    collector = start_collector(alerts=config)
    feed(collector, SCENARIO)
    log = settled(collector)

    slack = [r.json for r in receiver.on("/slack")]
    titles = sorted(m["blocks"][0]["text"]["text"] for m in slack)
    assert titles == sorted(
        [
            "WARNING straggler: rank 6 on node gpu-000 in run llama-mix",
            "CRITICAL nonfinite: 8 ranks on node gpu-001 in run llama-mix",
            "RESOLVED: CRITICAL nonfinite: 8 ranks on node gpu-001 in run llama-mix",
            "WARNING loss_spike in run llama-mix",
            "RESOLVED: WARNING loss_spike in run llama-mix",
        ]
    ), titles
    for message in slack:
        check_block_kit(message)
    straggler = next(m for m in slack if "straggler" in m["blocks"][0]["text"]["text"])
    text = str(straggler["blocks"])
    assert "1.3" in text and "data" in text  # the evidence: its phase and ratio
    assert "http://dashboard.test:8000/run/llama-mix#anomaly=" in text
    # the profile the detection asked of the straggler and a peer, said before its answers come
    assert "Evidence asked: profiler traces of rank 6 vs rank " in text and "(on the anomaly's page)" in text

    hooks = receiver.on("/hook")
    assert sorted((h.json["event"], h.json["count"]) for h in hooks) == [("open", 8), ("resolve", 8)]
    for hook in hooks:
        assert verify_signature(SECRET, hook.body, hook.headers["x-stepwatch-signature"])
        tampered = hook.body.replace(b'"count":8', b'"count":9')
        assert tampered != hook.body
        assert not verify_signature(SECRET, tampered, hook.headers["x-stepwatch-signature"])
        body = hook.json
        assert body["schema"] == "stepwatch.alert.v1" and body["idempotency_key"] == hook.key
        assert {a["rank"] for a in body["anomalies"]} == set(range(8, 16))
        assert {a["node"] for a in body["anomalies"]} == {"gpu-001"}
        assert all(a["key_evidence"]["module"] == "layers.3.attn.qkv" for a in body["anomalies"])
        assert all(a["commands"] == [] for a in body["anomalies"])  # a NaN asks the ranks for nothing
    opened = next(h for h in hooks if h.json["event"] == "open")
    resolved = next(h for h in hooks if h.json["event"] == "resolve")
    assert opened.at < resolved.at  # the resolve follows the open
    assert all(a["status"] == "resolved" and a["resolved_step"] for a in resolved.json["anomalies"])

    deliveries = log["deliveries"]
    assert len(deliveries) == 7 and {d["status"] for d in deliveries} == {"delivered"}
    assert all(d["attempts"] == 1 and d["last_error"] is None for d in deliveries)
    assert sorted(d["channel"] for d in deliveries) == ["pager"] * 2 + ["team"] * 5
    assert len({r.key for r in receiver.received}) == 7  # one idempotency key per message
