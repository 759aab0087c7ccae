"""Alerts: anomalies routed to Slack incoming webhooks and signed generic webhooks (docs/alerts.md).

The configuration file (`config`) names channels and routes; the detection store calls
`AlertWorker.on_stored` in the transaction that writes anomalies, which records routed events
(`events`); the worker groups them into messages (`grouping`, `render`), writes them to the durable
outbox and delivers them with retries (`outbox`, `transport`, `signing`).
"""

from stepwatch_server.alerts.config import AlertsConfig, AlertsConfigError, Channel, load_config
from stepwatch_server.alerts.signing import IDEMPOTENCY_HEADER, SIGNATURE_HEADER, sign, verify
from stepwatch_server.alerts.stats import record_delivery
from stepwatch_server.alerts.worker import AlertWorker

__all__ = [
    "IDEMPOTENCY_HEADER",
    "SIGNATURE_HEADER",
    "AlertWorker",
    "AlertsConfig",
    "AlertsConfigError",
    "Channel",
    "load_config",
    "record_delivery",
    "sign",
    "verify",
]
