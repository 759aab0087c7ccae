"""A real Prometheus server (Debian's `prometheus` package) for the tests: started on a free loopback
port with a generated configuration and a temporary data directory, stopped afterwards."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from tests.conftest import require
from tests.e2e.conftest import free_port

START_TIMEOUT_S = 30.0
JOB = "stepwatch"


def require_prometheus() -> tuple[str, str]:
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    require(
        prometheus is not None and promtool is not None,
        "Debian's prometheus package is not installed (scripts/test.sh installs it)",
    )
    return str(prometheus), str(promtool)


class Prometheus:
    def __init__(self, directory: Path, target: str | list[str], rules: Path | None = None) -> None:
        self.binary, _ = require_prometheus()
        self.port = free_port()
        self.directory = directory
        self.config = directory / "prometheus.yml"
        targets = [target] if isinstance(target, str) else target
        rule_files = f"rule_files: [{json.dumps(str(rules))}]\n" if rules else ""
        self.config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            f"{rule_files}"
            f"scrape_configs:\n  - job_name: {JOB}\n    static_configs:\n      - targets: {json.dumps(targets)}\n"
        )
        self.process: subprocess.Popen[bytes] | None = None
        self.log = directory / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Prometheus:
        cmd = [
            self.binary,
            f"--config.file={self.config}",
            f"--storage.tsdb.path={self.directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1h",
        ]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1.0) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"prometheus did not become ready: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10.0) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        return list(data["result"])

    def wait_for(self, expr: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """The result of `expr` once it is non-empty (polls; fails after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result:
                return result
            assert time.monotonic() < deadline, f"{expr} returned nothing for {timeout_s} s"
            time.sleep(0.5)
