"""Fixtures for the agent tests: a real HTTP receiver, tiny real models, and a guard against
internal errors the agent swallowed."""

from __future__ import annotations

import gzip
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import stepwatch  # noqa: E402
from stepwatch import _watch  # noqa: E402

REPO_AGENT_SRC = Path(__file__).resolve().parents[2] / "agent" / "src"
HANG_LIMIT_S = 10.0  # a "hanging" receiver never holds a request longer than this


class Receiver:
    """A stdlib HTTP server on 127.0.0.1 that decodes gzip JSON batches and records them.

    `respond(batch, headers) -> (status, headers, body) | "hang" | "drip" | None` decides the answer;
    None means 200 with an acknowledgement, "drip" a 200 whose body comes a byte at a time; a body
    that is bytes is sent as it is (not JSON-encoded).
    """

    def __init__(self, port: int = 0) -> None:
        self.requests: list[dict[str, Any]] = []  # every request: batch, headers, time, status
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.respond: Callable[[dict[str, Any], dict[str, str]], Any] = lambda batch, headers: None
        self.port = port
        self.server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    raw = gzip.decompress(raw)
                batch = json.loads(raw)
                headers = {k.lower(): v for k, v in self.headers.items()}
                answer = receiver.respond(batch, headers)
                status = 200 if answer is None or answer in ("hang", "drip") else answer[0]
                with receiver.lock:
                    receiver.requests.append(
                        {
                            "batch": batch,
                            "headers": headers,
                            "t": time.monotonic(),
                            "status": status,
                            "acked": answer is None,  # the collector's acknowledgement was the answer
                            "path": self.path,
                        }
                    )
                if answer == "hang":
                    receiver.release.wait(HANG_LIMIT_S)
                    return
                if answer == "drip":  # a 200 whose body comes a byte every 0.2 s (bounded)
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    for _ in range(int(HANG_LIMIT_S / 0.2)):
                        if receiver.release.wait(0.2):
                            return
                        try:
                            self.wfile.write(b" ")
                            self.wfile.flush()
                        except OSError:  # the agent gave up and closed the connection
                            return
                    return
                if answer is None:
                    answer = (200, {}, {"accepted": True, "rows": 1, "duplicates": 0, "incarnation": 1})
                code, extra, body = answer
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(code)
                for k, v in extra.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        return self

    def stop(self) -> None:
        self.release.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    # -- what arrived --------------------------------------------------------------------------
    def accepted(self) -> list[dict[str, Any]]:
        with self.lock:
            return [r["batch"] for r in self.requests if r["acked"]]

    def data_batches(self) -> list[dict[str, Any]]:
        return [b for b in self.accepted() if b["steps"] or b.get("events")]

    def heartbeats(self) -> list[dict[str, Any]]:
        return [b for b in self.accepted() if not b["steps"]]

    def steps(self) -> list[int]:
        return [s for b in self.accepted() for s in b["steps"]]

    def records(self) -> dict[int, dict[str, Any]]:
        """step -> {metric: value}, from every accepted batch."""
        out: dict[int, dict[str, Any]] = {}
        for b in self.accepted():
            for i, step in enumerate(b["steps"]):
                out[step] = {name: values[i] for name, values in b.get("metrics", {}).items()}
        return out

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.02)
        return predicate()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture
def fast(tmp_path: Path) -> dict[str, Any]:
    """Options for quick tests: short intervals and a private spool directory."""
    return {
        "flush_interval_s": 0.05,
        "heartbeat_interval_s": 0.2,
        "timeout_s": 0.5,
        "spool_dir": tmp_path / "spool",
    }


class MLP(nn.Module):
    def __init__(self, width: int = 16, nan_from_call: int | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.act = nn.ReLU()
        self.poison = Poison(nan_from_call)
        self.fc2 = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        out = self.fc2(self.poison(self.act(self.fc1(x))))
        if y is None:
            return out
        return {"loss": nn.functional.mse_loss(out, y), "out": out}


class Poison(nn.Module):
    """Passes its input through; from its n-th call on, outputs NaN."""

    def __init__(self, nan_from_call: int | None) -> None:
        super().__init__()
        self.nan_from_call = nan_from_call
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.nan_from_call is not None and self.calls >= self.nan_from_call:
            return x + float("nan")
        return x


def make_model(**kw: Any) -> tuple[MLP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MLP(**kw)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    watch: stepwatch.Watch | None = None,
    between: Callable[[int], None] | None = None,
) -> list[float]:
    """A plain loop; returns the losses (read with .item(): the test may sync, the agent may not)."""
    losses = []
    gen = torch.Generator().manual_seed(1)
    for i in range(1, steps + 1):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)
        loss = model(x, y)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if between is not None:
            between(i)
    return losses


# -- guards ----------------------------------------------------------------------------------------
class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def stepwatch_log() -> Iterator[_Errors]:
    handler = _Errors()
    logger = logging.getLogger("stepwatch")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


@pytest.fixture
def allow_internal_errors() -> None:
    """Request this fixture in a test that provokes an internal error on purpose."""


@pytest.fixture(autouse=True)
def _agent_hygiene(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, stepwatch_log: _Errors
) -> Iterator[None]:
    for var in (
        "STEPWATCH_URL",
        "STEPWATCH_RUN",
        "STEPWATCH_TOKEN",
        "STEPWATCH_DISABLED",
        "STEPWATCH_NODE",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "SLURM_JOB_ID",
        "SLURM_JOB_NAME",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "PMI_RANK",
        "PMI_SIZE",
        "MPI_LOCALRANKID",
    ):
        monkeypatch.delenv(var, raising=False)
    yield
    for watch in list(_watch._LIVE):
        watch.close(timeout_s=0.5)
    internal = [r for r in stepwatch_log.records if getattr(r, "stepwatch_internal", False)]
    if internal and "allow_internal_errors" not in request.fixturenames:
        pytest.fail("the agent swallowed an internal error:\n" + "\n".join(r.getMessage() for r in internal))
