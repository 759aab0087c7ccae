"""A run's (or a rank's) health verdict from its open anomalies: the worst severity among them, in the
dashboard's words. One place for it: the health endpoint (detect/routes.py) and the runs overview
(dashboard/summary.py) both say it."""

from __future__ import annotations

from collections.abc import Iterable

from stepwatch_server.detect.anomalies import SEVERITIES

VERDICTS = ("ok", "warning", "critical")  # by severity index: info -> ok, warning, critical


def verdict(severities: Iterable[str]) -> str:
    worst = max((SEVERITIES.index(s) for s in severities if s in SEVERITIES), default=0)
    return VERDICTS[worst]
