"""A real `stepwatch-server serve --alerts FILE` on a SQLite file, killed with SIGKILL while messages are
in flight, then started again on the same database: every message is delivered (at least once), and
a message sent again carries the idempotency key it had before."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from tests.alerts.conftest import write_config
from tests.alerts.helpers import DELIVERY_WAIT_S, config_text, nan_batch
from tests.alerts.receiver import Receiver
from tests.e2e.conftest import SERVER_START_TIMEOUT_S, free_port, get_json

JSON = {"Content-Type": "application/json"}
RUNS = [f"killed-{i}" for i in range(6)]  # 6 critical NaNs: 12 messages (Slack + webhook each)


class Serve:
    """`stepwatch-server serve --alerts FILE` as a child process."""

    def __init__(self, database_url: str, alerts: Path, log_path: Path) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "stepwatch_server.cli", "serve", "--port", str(self.port)]
        cmd += ["--database-url", database_url, "--alerts", str(alerts)]
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.log_path = log_path
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            assert self.process.poll() is None, log_path.read_text()[-3000:]
            try:
                get_json(f"{self.url}/healthz", timeout_s=1.0)
                return
            except OSError:
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, doc: dict[str, Any]) -> None:
        body = json.dumps(doc).encode()
        request = urllib.request.Request(f"{self.url}/api/v1/ingest", data=body, headers=JSON)
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200

    def deliveries(self) -> list[dict[str, Any]]:
        body: dict[str, Any] = get_json(f"{self.url}/api/v1/alerts?limit=1000")
        assert body["worker"]["errors"] == 0, body
        return list(body["deliveries"])

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(15)


def wait(condition: Any, what: str, timeout_s: float = DELIVERY_WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return result


def test_sigkill_mid_delivery_loses_nothing(
    receiver: Receiver, secrets: dict[str, str], tmp_path: Path
) -> None:
    database_url = f"sqlite:///{tmp_path / 'stepwatch.db'}"
    alerts = write_config(tmp_path, config_text(receiver, window_s=0.2))
    receiver.stop()  # down until every message is in the outbox, so that the kill hits deliveries only
    first = Serve(database_url, alerts, tmp_path / "first.log")
    try:
        for run in RUNS:
            first.post(nan_batch(run))
        wait(lambda: len(first.deliveries()) == 2 * len(RUNS), "12 messages in the outbox")
        receiver.delay_s = 2.0  # slow answers: the kill comes while requests are in flight
        receiver.start()
        receiver.wait_for(lambda: len(receiver.received) >= 1, 30.0, "the first delivery attempt")
        first.kill()
    finally:
        first.stop()
    cut_off = {r.key for r in receiver.received}  # reached the receiver, never acknowledged
    assert cut_off

    receiver.delay_s = 0.0
    second = Serve(database_url, alerts, tmp_path / "second.log")
    try:
        log = wait(
            lambda: (ds := second.deliveries()) and all(d["status"] == "delivered" for d in ds) and ds,
            "every message delivered after the restart",
        )
    finally:
        second.stop()
    assert len(log) == 2 * len(RUNS)
    keys = Counter(r.key for r in receiver.received)
    assert set(keys) == {d["idempotency_key"] for d in log}  # every message arrived, none unknown
    assert all(keys[k] >= 2 for k in cut_off)  # sent again after the restart, with the same key
    by_key = {d["idempotency_key"]: d for d in log}
    assert all(by_key[k]["attempts"] >= 2 for k in cut_off)
    assert {r.json["run"] for r in receiver.on("/hook")} == set(RUNS)
    assert {r.json["text"].split(" in run ")[1].split(":")[0] for r in receiver.on("/slack")} == set(RUNS)
