"""Messages: one group of anomalies (same channel, run, kind and event) as a Slack Block Kit message
or as the versioned webhook JSON body (docs/alerts.md#the-webhook-body).

A group of one names the blamed rank/node, the step, the one-line summary and the key evidence
numbers; a larger group says what they share ("8 ranks on node gpu-012: straggler") and lists the
summaries. Both link to the anomaly in the web dashboard when `dashboard_url` is configured.
"""

from __future__ import annotations

import datetime as dt
import math
import urllib.parse
from dataclasses import dataclass
from typing import Any

from stepwatch_server.detect.anomalies import SEVERITIES

WEBHOOK_SCHEMA = "stepwatch.alert.v1"
MAX_LISTED = 10  # anomalies listed one per line in a grouped message
MAX_EVIDENCE_FIELDS = 6
SLACK_HEADER_MAX_CHARS = 150  # Block Kit limits
SLACK_TEXT_MAX_CHARS = 3000
SLACK_FIELD_MAX_CHARS = 2000
KEY_EVIDENCE: dict[str, tuple[str, ...]] = {
    "loss_spike": ("loss", "baseline", "ratio", "z", "grad_norm_ratio"),
    "divergence": ("loss", "baseline_median", "ratio", "elevated_steps", "trend_rise"),
    "nonfinite": ("where", "module", "n_ranks", "step"),
    "straggler": ("phase", "ratio", "phase_ms", "peers_median_ms", "step_fraction_lost", "slow_steps"),
    "slow_node": ("phase", "slow_ranks", "node_ranks", "ratio", "step_fraction_lost", "slow_steps"),
    "hang": ("stalled_s", "threshold_s", "last_step", "mode", "culprits", "culprit_phase"),
    "memory_leak": ("metric", "mb_per_step", "current_mb", "capacity_mb", "steps_to_oom", "seconds_to_oom"),
    "replica_divergence": ("shard", "group_size", "agreeing", "fingerprint", "majority_fingerprint"),
    "fp8_overflow_risk": ("module", "amax", "headroom_bits", "steps_to_e4m3", "doubling_steps"),
    "throughput_drop": ("ratio", "recent_step_ms", "baseline_step_ms", "phase"),
}
# An anomaly's fields in a message: its stored row's (detect/routes.py), less the timestamps.
ANOMALY_FIELDS = (
    "id", "kind", "key", "status", "severity", "rank", "node", "first_step", "last_step",
    "detected_step", "resolved_step", "summary", "evidence",
)  # fmt: skip


_EVENT_WORD = {"open": "", "escalate": "ESCALATED: ", "resolve": "RESOLVED: ", "test": "TEST: "}
_SEVERITY_MARK = {
    "critical": ":red_circle:",
    "warning": ":large_orange_circle:",
    "info": ":large_blue_circle:",
}


@dataclass(frozen=True)
class Message:
    """What one delivery says. `anomalies` are the stored rows as dicts (detect/routes.py shape)."""

    channel: str
    event: str  # open | escalate | resolve | test
    run: str
    kind: str
    anomalies: list[dict[str, Any]]
    idempotency_key: str
    created_at: dt.datetime
    dashboard_url: str | None = None

    @property
    def severity(self) -> str:
        return max((a["severity"] for a in self.anomalies), key=SEVERITIES.index, default="info")

    @property
    def title(self) -> str:
        return f"{_EVENT_WORD.get(self.event, '')}{self.severity.upper()} {_subject(self)} in run {self.run}"

    def command_url(self, command: dict[str, Any]) -> str | None:
        """The API's view of an evidence command, or None without dashboard_url."""
        if self.dashboard_url is None:
            return None
        return f"{self.dashboard_url}/api/v1/runs/{urllib.parse.quote(self.run, safe='/')}/commands/{command['id']}"

    def url(self, anomaly: dict[str, Any] | None = None) -> str | None:
        """The dashboard page of `anomaly` (default: the group's first), or None without dashboard_url."""
        if self.dashboard_url is None:
            return None
        a = anomaly or self.anomalies[0]
        # The run page of the built-in dashboard, opened zoomed to the anomaly (web/src/run.js).
        return f"{self.dashboard_url}/run/{urllib.parse.quote(self.run, safe='')}#anomaly={a['id']}"


def evidence_line(a: dict[str, Any]) -> str:
    """What the collector asked the ranks for at this anomaly (commands/at_verdicts.py), in words: the
    alert goes out before their answers, which the anomaly's page shows."""
    parts = []
    for c in a.get("commands") or []:
        if c["kind"] == "stacks":
            parts.append("every rank's stacks")
        elif c["kind"] == "profile" and c.get("ranks"):
            ranks = list(c["ranks"])
            if a.get("rank") in ranks:  # the blamed rank first, then its peer
                ranks.remove(a["rank"])
                ranks.insert(0, a["rank"])
            parts.append("profiler traces of " + " vs ".join(f"rank {r}" for r in ranks))
    return f"Evidence asked: {'; '.join(parts)} (on the anomaly's page)" if parts else ""


def _blamed(a: dict[str, Any]) -> str:
    if a.get("rank") is not None:
        return f"rank {a['rank']}" + (f" on node {a['node']}" if a.get("node") else "")
    if a.get("node"):
        return f"node {a['node']}"
    key = str(a.get("key", "run"))
    return key.replace(":", " ", 1) if ":" in key else "the run"


def _subject(msg: Message) -> str:
    group = msg.anomalies
    if len(group) == 1:
        blamed = _blamed(group[0])
        return msg.kind if blamed == "the run" else f"{msg.kind}: {blamed}"
    ranks = sorted({a["rank"] for a in group if a.get("rank") is not None})
    nodes = sorted({a["node"] for a in group if a.get("node")})
    if len(ranks) == len(group) and len(nodes) == 1:
        return f"{msg.kind}: {len(ranks)} ranks on node {nodes[0]}"
    if len(ranks) == len(group):
        shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
        return f"{msg.kind}: {len(ranks)} ranks ({shown})"
    return f"{msg.kind}: {len(group)} anomalies"


def _steps(a: dict[str, Any]) -> str:
    first, last = a["first_step"], a["last_step"]
    text = f"{first}" if first == last else f"{first}-{last}"
    if a.get("resolved_step") is not None:
        text += f", resolved at {a['resolved_step']}"
    return text


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, list):
        return ", ".join(_number(v) for v in value[:8]) + (", ..." if len(value) > 8 else "")
    return str(value)


def key_evidence(a: dict[str, Any]) -> dict[str, Any]:
    """The evidence worth reading at 3 a.m.: the kind's key fields that are present (else its numbers)."""
    evidence = a.get("evidence") or {}
    names = [n for n in KEY_EVIDENCE.get(str(a.get("kind")), ()) if evidence.get(n) is not None]
    if not names:
        names = [n for n, v in evidence.items() if isinstance(v, int | float) and not isinstance(v, bool)]
    return {n: evidence[n] for n in names[:MAX_EVIDENCE_FIELDS]}


def _escape(text: str) -> str:
    """Slack mrkdwn: &, < and > are control characters."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def slack_payload(msg: Message) -> dict[str, Any]:
    """A Slack incoming-webhook body: `text` (the notification fallback) and Block Kit `blocks`."""
    first = msg.anomalies[0]
    fields = [
        f"*Severity*\n{_SEVERITY_MARK.get(msg.severity, '')} {msg.severity}",
        f"*Run*\n{_escape(msg.run)}",
        f"*Blamed*\n{_escape(_blamed(first) if len(msg.anomalies) == 1 else _subject(msg).split(': ', 1)[1])}",
        f"*Step*\n{_steps(first)}"
        + (f" (detected at {first['detected_step']})" if msg.event == "open" else ""),
    ]
    if len(msg.anomalies) == 1:
        body = _escape(first["summary"])
    else:
        lines = [f"• {_escape(a['summary'])}" for a in msg.anomalies[:MAX_LISTED]]
        if len(msg.anomalies) > MAX_LISTED:
            lines.append(f"… and {len(msg.anomalies) - MAX_LISTED} more")
        body = "\n".join(lines)
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": _cut(msg.title, SLACK_HEADER_MAX_CHARS)}},
        {
            "type": "section",
            "fields": [{"type": "mrkdwn", "text": _cut(f, SLACK_FIELD_MAX_CHARS)} for f in fields],
        },
        {"type": "section", "text": {"type": "mrkdwn", "text": _cut(body, SLACK_TEXT_MAX_CHARS)}},
    ]
    evidence = key_evidence(first)
    if evidence:
        blocks.append(
            {
                "type": "section",
                "fields": [
                    {"type": "mrkdwn", "text": _cut(f"*{n}*\n{_escape(_number(v))}", SLACK_FIELD_MAX_CHARS)}
                    for n, v in evidence.items()
                ],
            }
        )
    said = evidence_line(first)
    if said:
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": _escape(said)}]})
    url = msg.url()
    if url is not None:
        button = {"type": "button", "text": {"type": "plain_text", "text": "Open in stepwatch"}, "url": url}
        blocks.append({"type": "actions", "elements": [button]})
    ids = ", ".join(f"#{a['id']}" for a in msg.anomalies[:MAX_LISTED])
    blocks.append(
        {
            "type": "context",
            "elements": [{"type": "mrkdwn", "text": f"stepwatch · {msg.kind} · anomaly {ids}"}],
        }
    )
    fallback = f"{msg.title}: {first['summary']}" if len(msg.anomalies) == 1 else msg.title
    return {"text": _cut(fallback, SLACK_TEXT_MAX_CHARS), "blocks": blocks}


def webhook_payload(msg: Message) -> dict[str, Any]:
    """The versioned webhook body (schema `stepwatch.alert.v1`, docs/alerts.md)."""
    return {
        "schema": WEBHOOK_SCHEMA,
        "event": msg.event,
        "idempotency_key": msg.idempotency_key,
        "created_at": msg.created_at.isoformat(),
        "channel": msg.channel,
        "run": msg.run,
        "kind": msg.kind,
        "severity": msg.severity,
        "title": msg.title,
        "count": len(msg.anomalies),
        "url": msg.url(),
        "anomalies": [
            {
                **{k: a.get(k) for k in ANOMALY_FIELDS},
                "key_evidence": key_evidence(a),
                "url": msg.url(a),
                "commands": [{**c, "url": msg.command_url(c)} for c in a.get("commands", [])],
            }
            for a in msg.anomalies
        ],
    }


def render(channel_type: str, msg: Message) -> dict[str, Any]:
    return slack_payload(msg) if channel_type == "slack" else webhook_payload(msg)
