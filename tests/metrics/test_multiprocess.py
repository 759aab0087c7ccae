"""Several collector processes: with PROMETHEUS_MULTIPROC_DIR set, /metrics of any one of them sums the
collector's own metrics over every process (prometheus-client's multiprocess mode)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

WORKER = """
from stepwatch_server.metrics import ingest_accepted, ingest_rejected
for _ in range({n}):
    ingest_accepted(100, 10, False, 0.01)
ingest_rejected("invalid_json")
"""
SERVER = """
import sys, urllib.request
from stepwatch_server.serving import BackgroundServer
from stepwatch_server.settings import Settings
server = BackgroundServer(Settings(database_url=sys.argv[1], detection=False)).start()
try:
    sys.stdout.write(urllib.request.urlopen(server.url + "/metrics", timeout=30).read().decode())
finally:
    server.stop()
"""


def test_metrics_are_summed_over_worker_processes(tmp_path: Path) -> None:
    directory = tmp_path / "multiproc"
    directory.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    workers = [  # two worker processes that ingested 3 and 4 batches and refused one each
        subprocess.Popen([sys.executable, "-c", WORKER.format(n=n)], env=env) for n in (3, 4)
    ]
    assert [w.wait(timeout=120) for w in workers] == [0, 0]
    served = subprocess.run(
        [sys.executable, "-c", SERVER, f"sqlite:///{tmp_path / 'm.db'}"],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    ).stdout.decode()
    assert 'stepwatch_ingest_batches_total{result="stored"} 7.0' in served
    assert "stepwatch_ingest_values_total 70.0" in served
    assert "stepwatch_ingest_received_bytes_total 700.0" in served
    assert 'stepwatch_ingest_rejected_batches_total{reason="invalid_json"} 2.0' in served
    assert "stepwatch_ingest_duration_seconds_count 7.0" in served
    assert 'stepwatch_alert_deliveries_total{channel_type="webhook",outcome="failed"} 0.0' in served
