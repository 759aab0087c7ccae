"""`stepwatch-server demo`: the collector plus a real multi-rank training run feeding it.

The run is genuine synchronous data-parallel training: `--ranks` processes, torch.distributed with the
gloo backend, a small MLP wrapped in DistributedDataParallel on the CPU, each rank attached with the
one-line `stepwatch.attach`. It needs torch and the `stepwatch` agent (installed by scripts/setup.sh).

`demo --inject KIND` replaces the training run with the simulator's scenario for that kind
(`simulate.DEMO_BY_KIND`; `--inject straggler,loss_spike`: one run holding both faults): its batches go to the collector over real HTTP (gzip JSON POSTs to
/api/v1/ingest on loopback), as fast as the collector takes them. Detection runs on event time (the
records' own timestamps), so the anomalies are the ones a live run would have produced; the demo
waits for the detection worker to finish and prints them.
"""

from __future__ import annotations

import dataclasses
import gzip
import http.client
import json
import math
import os
import socket
import sys
import time
import urllib.parse
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from stepwatch_server.serving import BackgroundServer
from stepwatch_server.settings import Settings
from stepwatch_server.simulate import DEMO_BY_KIND, SCENARIOS, Scenario, Simulation

EVAL_EVERY_STEPS = 500
EVAL_PAUSE_S = 1.0
WARMUP_STEPS = 100
PEAK_LR = 3e-3
BATCH = 64
WIDTH = 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lr_at(step: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total - WARMUP_STEPS)
    return PEAK_LR * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_rank(rank: int, world_size: int, master_port: int, url: str, run: str, steps: int) -> None:
    """One rank of the demo run (the target of torch.multiprocessing.spawn)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import stepwatch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)  # identical initial weights on every replica
    model = torch.nn.Sequential(
        torch.nn.Linear(32, WIDTH),
        torch.nn.GELU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.GELU(),
        torch.nn.Linear(WIDTH, 1),
    )
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=PEAK_LR, weight_decay=0.01)
    watch = stepwatch.attach(ddp, optimizer, run=run, url=url)

    data_rng = torch.Generator().manual_seed(1000 + rank)  # each rank sees its own shard of the data
    teacher = torch.nn.Linear(32, 1)
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, steps)
        x = torch.randn(BATCH, 32, generator=data_rng)
        y = teacher(x).detach() + 0.1 * torch.randn(BATCH, 1, generator=data_rng)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        watch.log(loss=loss)  # a device tensor: no sync; it belongs to the step that optimizer.step() ends
        optimizer.step()
        if (step + 1) % EVAL_EVERY_STEPS == 0:
            with watch.phase("eval"):
                time.sleep(EVAL_PAUSE_S)
    watch.close()
    dist.destroy_process_group()


def run_demo(
    settings: Settings, *, host: str, port: int, ranks: int, steps: int, run: str, keep_serving: bool
) -> int:
    try:
        import torch.multiprocessing as mp

        import stepwatch  # noqa: F401  (fail early with a clear message, not inside four processes)
    except ImportError as exc:
        print(
            f"stepwatch-server demo needs torch and the stepwatch agent ({exc}); run scripts/setup.sh",
            file=sys.stderr,
        )
        return 2

    server = BackgroundServer(settings, host=host, port=port).start()
    base = server.url
    print(f"stepwatch demo: collector on {base} (database {settings.redacted_database_url})", flush=True)
    print(f"stepwatch demo: training run {run!r}: {ranks} ranks x {steps} steps (gloo, DDP, CPU)", flush=True)
    print("stepwatch demo: look at", flush=True)
    for path in (
        "/",
        "/api/v1/runs",
        f"/api/v1/runs/{run}/ranks",
        f"/api/v1/runs/{run}/series?metric=loss&rank=all",
        f"/api/v1/runs/{run}/tensors?stat=amax",
        "/docs",
    ):
        print(f"    {base}{path}", flush=True)
    started = time.monotonic()
    if settings.token:  # the agents in the spawned ranks read it (README, "Security and limits")
        os.environ["STEPWATCH_TOKEN"] = settings.token
    args: tuple[Any, ...] = (ranks, _free_port(), base, run, steps)
    try:
        mp.spawn(train_rank, args=args, nprocs=ranks, join=True)
    except Exception as exc:  # a failed rank: say so, keep the collector's data
        print(f"stepwatch demo: training failed: {exc}", file=sys.stderr, flush=True)
        server.stop()
        return 1
    print(f"stepwatch demo: training done in {time.monotonic() - started:.1f} s", flush=True)
    return _finish(server, keep_serving)


def _finish(server: BackgroundServer, keep_serving: bool) -> int:
    """Keep the collector up for the user to look (until Ctrl-C), or stop it."""
    if keep_serving:
        print("stepwatch demo: the collector keeps serving; Ctrl-C to stop", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    server.stop()
    return 0


INJECT_TIMEOUT_S = 600.0  # the whole scenario, sent and detected
DETECTION_WAIT_S = 120.0  # for the detection worker to catch up after the last batch


class Client:
    """One keep-alive HTTP connection to the collector (stdlib only)."""

    def __init__(self, base: str, token: str | None = None) -> None:
        parsed = urllib.parse.urlsplit(base)
        self._conn = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port, timeout=60)
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}  # `--token`: writes and reads

    def post_batch(self, doc: dict[str, Any]) -> dict[str, Any]:
        body = gzip.compress(orjson.dumps(doc), compresslevel=1)
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        return self._request("POST", "/api/v1/ingest", body, headers)

    def get(self, path: str) -> Any:
        return self._request("GET", path, None, {})

    def _request(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> Any:
        try:
            headers = {**headers, **self._auth}
            self._conn.request(method, path, body=body, headers=headers)
            response = self._conn.getresponse()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            # The server closed the idle keep-alive connection: reconnect once. Safe for POSTs too,
            # because ingest is idempotent per (session, seq).
            self._conn.close()
            self._conn.request(method, path, body=body, headers=headers)
            response = self._conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(
                f"{method} {path}: HTTP {response.status}: {data[:500].decode(errors='replace')}"
            )
        return json.loads(data)

    def close(self) -> None:
        self._conn.close()


def inject_scenario(kinds: Sequence[str], steps: int | None = None) -> Scenario:
    """The simulator's demo scenario for one kind (`simulate.DEMO_BY_KIND`), or for several kinds one
    run holding all their faults: the largest of their shapes (ranks, steps), so every fault keeps its
    rank and step. `steps` cuts it short. ValueError when the faults cannot share a run."""
    chosen = [SCENARIOS[DEMO_BY_KIND[kind]] for kind in kinds]
    scenario = chosen[0]
    if len(chosen) > 1:
        scenario = dataclasses.replace(
            max(chosen, key=lambda s: (s.world_size, s.steps)),
            name="+".join(s.name for s in chosen),
            steps=max(s.steps for s in chosen),
            faults=tuple(f for s in chosen for f in s.faults),
            description="; ".join(s.description for s in chosen),
        )
    if steps is not None:
        scenario = dataclasses.replace(scenario, steps=min(steps, scenario.steps))
    return scenario


class Feeder:
    """Sends a simulated run's batches to a collector as run `run`, with fresh agent session ids (so
    the same scenario can be fed again); `send()` can be called repeatedly to feed a run in parts."""

    def __init__(self, client: Client, run: str) -> None:
        self.client = client  # also for reading back: `feeder.client.get(path)`
        self.run = run
        self.sent = 0
        self._sessions: dict[str, str] = {}

    def send(self, batches: Iterable[dict[str, Any]], deadline: float = math.inf) -> int:
        count = 0
        for doc in batches:
            doc["run"] = self.run
            doc["session"] = self._sessions.setdefault(doc["session"], uuid.uuid4().hex)
            self.client.post_batch(doc)
            count += 1
            if time.monotonic() > deadline:
                raise RuntimeError(f"the scenario took over {INJECT_TIMEOUT_S:.0f} s to send")
        self.sent += count
        return count

    def wait_for_detection(self) -> dict[str, Any]:
        """The detection worker's stats once it has processed (and stored the anomalies of) every batch."""
        return _wait_for_detection(self.client)


def run_inject_demo(
    settings: Settings,
    *,
    host: str,
    port: int,
    kinds: Sequence[str],
    run: str | None,
    steps: int | None,
    keep_serving: bool,
) -> int:
    """Feed the simulator's scenario for `kinds` to a real collector over HTTP; print what it found."""
    if not settings.detection:
        print("stepwatch demo: --inject needs detection on (STEPWATCH_DETECTION is 'off')", file=sys.stderr)
        return 2
    try:
        scenario = inject_scenario(kinds, steps)
    except ValueError as exc:
        print(f"stepwatch demo: --inject {','.join(kinds)}: {exc}", file=sys.stderr)
        return 2
    label = "+".join(kinds)
    run = run or f"inject-{label}-{time.strftime('%Y%m%d-%H%M%S')}"
    server = BackgroundServer(settings, host=host, port=port).start()
    base = server.url
    client = Client(base, settings.token)
    print(f"stepwatch demo: collector on {base} (database {settings.redacted_database_url})", flush=True)
    print(
        f"stepwatch demo: injecting {', '.join(kinds)}: scenario {scenario.name!r} ({scenario.world_size} "
        f"ranks x {scenario.steps} steps: {scenario.description}) as run {run!r}",
        flush=True,
    )
    print(f"stepwatch demo: watch it live on the dashboard: {base}/run/{urllib.parse.quote(run)}", flush=True)
    feeder = Feeder(client, run)
    started = time.monotonic()
    try:
        feeder.send(Simulation(scenario), deadline=started + INJECT_TIMEOUT_S)
        print(f"stepwatch demo: {feeder.sent} batches sent in {time.monotonic() - started:.1f} s", flush=True)
        stats = feeder.wait_for_detection()
        anomalies = client.get(f"/api/v1/runs/{urllib.parse.quote(run)}/anomalies")["anomalies"]
    except Exception as exc:  # the collector failed or is too slow: say so and stop
        print(f"stepwatch demo: {exc}", file=sys.stderr, flush=True)
        client.close()
        server.stop()
        return 1
    lag = stats.get("lag_ms", {})
    print(
        f"stepwatch demo: detection processed {stats['processed']} batches "
        f"(ack -> stored p50 {_ms(lag.get('p50'))}, p99 {_ms(lag.get('p99'))})",
        flush=True,
    )
    print(f"stepwatch demo: {len(anomalies)} anomalies found in run {run!r}:", flush=True)
    for a in sorted(anomalies, key=lambda a: (a["first_step"], a["kind"])):
        print(f"    {a['kind']:<18} {a['severity']:<8} {a['status']:<8} {a['summary']}", flush=True)
    for kind in kinds:
        if not any(a["kind"] == kind for a in anomalies):
            print(f"stepwatch demo: no {kind} anomaly was found", flush=True)
    quoted = urllib.parse.quote(run)
    print("stepwatch demo: look at", flush=True)
    for path in (
        f"/run/{quoted}",
        f"/api/v1/runs/{quoted}/anomalies",
        f"/api/v1/runs/{quoted}/health",
        "/api/v1/anomalies?status=open",
        f"/api/v1/runs/{quoted}/series?metric=loss&rank=mean",
        "/docs",
    ):
        print(f"    {base}{path}", flush=True)
    client.close()
    return _finish(server, keep_serving)


def _wait_for_detection(client: Client) -> dict[str, Any]:
    deadline = time.monotonic() + DETECTION_WAIT_S
    while True:
        stats: dict[str, Any] = client.get("/api/v1/detection")
        done = stats["processed"] + stats["dropped"] >= stats["submitted"] and stats["queue_depth"] == 0
        if done and stats["anomalies_unsaved"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise RuntimeError(f"detection did not catch up within {DETECTION_WAIT_S:.0f} s: {stats}")
        time.sleep(0.05)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"
