"""What the stepwatch agent costs per training step, next to wandb (offline), TensorBoard and MLflow.

One process, one CPU MLP whose step takes about 10 ms (torch on one thread; `--model` picks its
shape), one model instance per variant. The variants run interleaved: round-robin blocks of `--block` steps each, the starting
variant rotating every round, the first `--warmup` rounds discarded, so that drift (thermal, other
tenants of the machine) lands on every variant alike.

- bare: the training step and nothing else.
- stepwatch: `stepwatch.attach(model, optimizer, ...)` with default settings (amax, fingerprints,
  non-finite checks, heartbeat) plus `watch.log(loss=loss)`, shipping to a real `stepwatch-server`
  collector in a child process on loopback (a stdlib stub that answers 200 when the collector cannot
  be imported).
- wandb / tensorboard / mlflow: the same ~50 values a stepwatch record carries (loss, total and
  per-parameter grad norms, lr, five phase timings, amax of every Linear, non-finite flags, RSS),
  computed the way a user of those tools has to: forward hooks for amax, one fused norm call, phase
  timers, and one stacked `.tolist()` to get Python floats (the cheapest honest way; one `.item()` per
  value would cost them more), then one `log` call per step.

Step time is the wall time of the whole step, logging included, measured by the harness.
Background threads and processes (stepwatch's sender, wandb's service, TensorBoard's writer) run
whenever they run, so a little of one tool's background work can land in another's block; the
collector and the stub run in their own process.

    .venv/bin/python bench/agent_overhead.py [--model deep-narrow|mlp-wide-batch] [--steps 2000]
        [--block 50] [--variants bare,stepwatch] [--json OUT]
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import logging
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _src in (REPO / "agent" / "src", REPO / "service" / "src"):
    if _src.is_dir() and str(_src) not in sys.path:
        sys.path.append(str(_src))

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _servers  # noqa: E402

# Quiet and offline: no tool may reach the network or print per step.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_CONSOLE", "off")
os.environ.setdefault("WANDB_DISABLE_GIT", "true")
os.environ.setdefault("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # a local file store in a temporary directory
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

IN_FEATURES = 256
CLASSES = 10
DATA_BATCHES = 8  # pre-built batches cycled through: data loading is not what is measured
PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20
# --model: (hidden layers, width, batch rows); each steps in about 10 ms on the development machine.
MODELS = {
    # The stress case: many small layers and few rows, so per-layer hooks weigh the most.
    "deep-narrow": (12, 256, 96),
    # Closer to real training: few layers, many rows (an LLM pushes thousands of tokens through each
    # layer), so the per-layer and per-step costs are spread over more work.
    "mlp-wide-batch": (4, 256, 512),
}


def build_model(width: int, depth: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    features = IN_FEATURES
    for _ in range(depth):
        layers += [torch.nn.Linear(features, width), torch.nn.GELU()]
        features = width
    layers.append(torch.nn.Linear(features, CLASSES))
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


class Data:
    def __init__(self, batch: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self._batches = [
            (
                torch.randn(batch, IN_FEATURES, generator=gen),
                torch.randint(0, CLASSES, (batch,), generator=gen),
            )
            for _ in range(DATA_BATCHES)
        ]
        self._i = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._i = (self._i + 1) % DATA_BATCHES
        return self._batches[self._i]


def rss_mb() -> float:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * PAGE_MB


class UserMetrics:
    """What a wandb/TensorBoard/MLflow user computes to log what one stepwatch record holds."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        self.amax: list[torch.Tensor | None] = [None] * len(self.linears)
        for i, (_, module) in enumerate(self.linears):
            module.register_forward_hook(self._hook(i))
        self.tensor_keys = (
            ["loss", "grad_norm", "nonfinite.loss", "nonfinite.grads", "nonfinite.activations"]
            + [f"param_grad_norm/{n}" for n, _ in self.named_params]
            + [f"amax/{n}" for n, _ in self.linears]
        )

    def _hook(self, i: int) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> None:
            self.amax[i] = output.detach().abs().amax()

        return hook

    @property
    def keys(self) -> int:
        return len(self.tensor_keys) + 7  # + lr, five timings, rss

    def collect(self, loss: torch.Tensor, times_s: list[float]) -> dict[str, float]:
        grads = [p.grad for _, p in self.named_params]
        norms = torch._foreach_norm(grads)  # type: ignore[arg-type]
        total = torch.linalg.vector_norm(torch.stack(norms))
        amax = torch.stack(self.amax)  # type: ignore[arg-type]
        loss = loss.detach()
        flags = torch.stack(
            [~torch.isfinite(loss), ~torch.isfinite(total), ~torch.isfinite(amax).all()]
        ).float()
        packed = torch.cat([torch.stack([loss, total]), flags, torch.stack(norms), amax])
        values = dict(zip(self.tensor_keys, packed.tolist(), strict=True))  # the one device->host copy
        t0, t1, t2, t3, t4 = times_s
        values["lr"] = float(self.optimizer.param_groups[0]["lr"])
        values["time.data_ms"] = (t1 - t0) * 1e3
        values["time.forward_ms"] = (t2 - t1) * 1e3
        values["time.backward_ms"] = (t3 - t2) * 1e3
        values["time.optimizer_ms"] = (t4 - t3) * 1e3
        values["time.step_ms"] = (t4 - t0) * 1e3
        values["mem.rss_mb"] = rss_mb()
        return values


class Variant:
    name = "bare"

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.model, self.optimizer = build_model(args.width, args.depth, seed=0)
        self.data = Data(args.batch, seed=1)
        self.times_s: list[float] = []
        self.block_medians_s: list[float] = []
        self.note = ""

    def setup(self) -> None:
        pass

    def step(self, i: int) -> None:
        x, y = self.data.next()
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.optimizer.step()

    def close(self) -> None:
        pass


class StepwatchVariant(Variant):
    name = "stepwatch"

    def setup(self) -> None:
        import stepwatch

        ok, why = _servers.collector_available()
        if ok:
            url = f"sqlite:///{self.tmp / 'collector.db'}"
            self._receiver_cm = _servers.collector(url, log_path=self.tmp / "collector.log")
        else:
            print(f"  stepwatch-server not importable ({why}): using a stub receiver")
            self._receiver_cm = _servers.stub()
        receiver = self._receiver_cm.__enter__()
        self.note = f"receiver: {receiver.kind} at {receiver.url}"
        print(f"  stepwatch sends to {receiver.kind} at {receiver.url}")
        os.environ.pop("STEPWATCH_DISABLED", None)
        # Default settings; only the spool (used when the collector is unreachable) goes to the temp dir.
        self.watch = stepwatch.attach(
            self.model,
            self.optimizer,
            run="bench-overhead",
            url=receiver.url,
            spool_dir=str(self.tmp / "spool"),
        )

    def step(self, i: int) -> None:
        x, y = self.data.next()
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        self.watch.log(loss=loss)
        loss.backward()
        self.optimizer.step()

    def close(self) -> None:
        try:
            self.watch.close()
            stats = self.watch.stats()
            print(f"  stepwatch stats after close: {json.dumps(stats, default=str, sort_keys=True)}")
            self.stats = stats
        finally:
            self._receiver_cm.__exit__(None, None, None)


class StepwatchNoRingVariant(StepwatchVariant):
    """Diagnostic: the same agent with its ring switched off, so that every step's grad norm and
    activation sums are fresh tensors kept until the transfer (the agent before the ring)."""

    name = "stepwatch-no-ring"

    def setup(self) -> None:
        super().setup()
        hooks = self.watch._hooks  # private: a diagnostic, not an API
        hooks._ring.row = lambda modules: ()
        hooks._cur.row = ()
        self.note += "; ring off"


class ToolVariant(Variant):
    """A training step that computes the same values and hands them to one logging tool."""

    def setup(self) -> None:
        self.metrics = UserMetrics(self.model, self.optimizer)
        self.open_tool()

    def open_tool(self) -> None:
        raise NotImplementedError

    def emit(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def step(self, i: int) -> None:
        t0 = time.perf_counter()
        x, y = self.data.next()
        t1 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        self.optimizer.step()
        t4 = time.perf_counter()
        self.emit(self.metrics.collect(loss, [t0, t1, t2, t3, t4]), i)


class ValuesOnlyVariant(ToolVariant):
    """Reference, not a tool: computing the values the tools are given, and logging nothing."""

    name = "values-only"

    def open_tool(self) -> None:
        self.note = "hooks + fused norms + timers + one .tolist(); no logging call"

    def emit(self, values: dict[str, float], step: int) -> None:
        pass


class FloorVariant(Variant):
    """Reference, not a tool: the least any monitor computing the issue's per-step values must add.

    Per step, on the training thread: the total grad norm in one fused call over all gradients, and
    one float32 sum of every Linear's output (non-finite when an element is), the two reductions
    stepwatch does on every step. Nothing else: no timers, no amax, no host copy, no logging.
    """

    name = "floor"

    def setup(self) -> None:
        self.note = "one fused grad norm + one sum per Linear output; nothing kept, nothing shipped"
        self.sums: list[torch.Tensor] = []
        for module in self.model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(self._hook)

    def _hook(self, _module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        self.sums.append(output.detach().sum(dtype=torch.float32))

    def step(self, i: int) -> None:
        self.sums = []
        x, y = self.data.next()
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2)))
        self.optimizer.step()


class WandbVariant(ToolVariant):
    name = "wandb-offline"

    def open_tool(self) -> None:
        import wandb

        d = self.tmp / "wandb"
        d.mkdir()
        self.run = wandb.init(
            project="stepwatch-bench", mode="offline", dir=str(d), settings=wandb.Settings(console="off")
        )
        self.note = f"wandb {wandb.__version__}, offline, dir {d}"

    def emit(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardVariant(ToolVariant):
    name = "tensorboard"

    def open_tool(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.tmp / "tb"))
        self.note = "torch.utils.tensorboard.SummaryWriter.add_scalar per key"

    def emit(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class MlflowVariant(ToolVariant):
    name = "mlflow"

    def open_tool(self) -> None:
        import mlflow

        logging.getLogger("mlflow").setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mlflow.set_tracking_uri((self.tmp / "mlruns").as_uri())
            mlflow.set_experiment("stepwatch-bench")
            self.run = mlflow.start_run()
        self.mlflow = mlflow
        self.note = f"mlflow {mlflow.__version__}, file store {mlflow.get_tracking_uri()}"

    def emit(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


VARIANTS: dict[str, type[Variant]] = {
    "bare": Variant,
    "stepwatch": StepwatchVariant,
    "stepwatch-no-ring": StepwatchNoRingVariant,
    "values-only": ValuesOnlyVariant,
    "floor": FloorVariant,
    "wandb-offline": WandbVariant,
    "tensorboard": TensorBoardVariant,
    "mlflow": MlflowVariant,
}
TOOLS = ("wandb-offline", "tensorboard", "mlflow")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    variants: list[Variant] = []
    skipped: dict[str, str] = {}
    for name in args.variants:
        variant = VARIANTS[name](args, tmp)
        print(f"setting up {name} ...", flush=True)
        try:
            variant.setup()
        except Exception as exc:
            skipped[name] = f"{type(exc).__name__}: {exc}"
            print(f"  SKIPPED {name}: {skipped[name]}", flush=True)
            continue
        variants.append(variant)
    if not variants or variants[0].name != "bare":
        raise SystemExit("the bare loop must run first in --variants")
    if any(isinstance(v, ToolVariant) for v in variants):
        keys = UserMetrics(*build_model(args.width, args.depth, seed=0)).keys
        print(f"the tools log {keys} keys per step")

    failed: list[Variant] = []
    rounds = -(-args.steps // args.block)
    started = time.perf_counter()
    step_no = 0
    try:
        for r in range(args.warmup + rounds):
            shift = r % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                block: list[float] = []
                try:
                    for _ in range(args.block):
                        t = time.perf_counter()
                        variant.step(step_no)
                        block.append(time.perf_counter() - t)
                        step_no += 1
                except Exception as exc:
                    if variant is variants[0]:
                        raise
                    skipped[variant.name] = f"failed while running: {type(exc).__name__}: {exc}"
                    print(f"  DROPPED {variant.name}: {skipped[variant.name]}", flush=True)
                    variants.remove(variant)
                    failed.append(variant)
                    continue
                if r >= args.warmup:
                    variant.times_s.extend(block)
                    variant.block_medians_s.append(statistics.median(block))
            if r == args.warmup - 1 or (r + 1) % 10 == 0:
                print(
                    f"round {r + 1}/{args.warmup + rounds} ({time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
    finally:
        for variant in variants + failed:
            try:
                variant.close()
            except Exception as exc:
                print(f"  closing {variant.name} failed: {type(exc).__name__}: {exc}")

    bare = variants[0]
    bare_median = statistics.median(bare.times_s)
    results: dict[str, Any] = {}
    for variant in variants:
        median = statistics.median(variant.times_s)
        paired = [v - b for v, b in zip(variant.block_medians_s, bare.block_medians_s, strict=True)]
        results[variant.name] = {
            "steps": len(variant.times_s),
            "median_ms": median * 1e3,
            "p99_ms": percentile(variant.times_s, 99) * 1e3,
            "mean_ms": statistics.fmean(variant.times_s) * 1e3,
            "overhead_ms": (median - bare_median) * 1e3,
            "overhead_pct": (median - bare_median) / bare_median * 100,
            "paired_overhead_ms": statistics.median(paired) * 1e3,
            "note": variant.note,
        }
        if getattr(variant, "stats", None) is not None:
            results[variant.name]["agent_stats"] = variant.stats
    return {"results": results, "skipped": skipped, "elapsed_s": time.perf_counter() - started}


def report(out: dict[str, Any], args: argparse.Namespace) -> None:
    results = out["results"]
    bare = results["bare"]
    print()
    print(
        f"model {args.model}: {args.depth} hidden layers x {args.width}, batch {args.batch}; "
        f"bare step: median {bare['median_ms']:.3f} ms, p99 {bare['p99_ms']:.3f} ms (torch threads = 1)"
    )
    print(
        f"{'variant':<15}{'median ms':>11}{'p99 ms':>10}{'mean ms':>10}{'overhead ms':>13}{'overhead %':>12}{'paired ms':>11}"
    )
    for name, r in results.items():
        print(
            f"{name:<15}{r['median_ms']:>11.3f}{r['p99_ms']:>10.3f}{r['mean_ms']:>10.3f}"
            f"{r['overhead_ms']:>13.3f}{r['overhead_pct']:>11.2f}%{r['paired_overhead_ms']:>11.3f}"
        )
    for name, why in out["skipped"].items():
        print(f"{name:<15} skipped: {why}")
    tools = {n: results[n]["overhead_ms"] for n in TOOLS if n in results}
    out["ratio"] = None
    if "stepwatch" in results and tools:
        cheapest = min(tools, key=tools.__getitem__)
        agent = results["stepwatch"]["overhead_ms"]
        if tools[cheapest] > 0:
            out["ratio"] = agent / tools[cheapest]
            out["cheapest_tool"] = cheapest
            print(
                f"\nstepwatch overhead / cheapest other tool ({cheapest}) overhead: "
                f"{agent:.3f} / {tools[cheapest]:.3f} ms = {out['ratio']:.3f}  (target < 0.2)"
            )
        if "values-only" in results:
            # Stricter: only the tools' own logging calls, without computing the values they are given.
            base = results["values-only"]["overhead_ms"]
            calls = {n: ms - base for n, ms in tools.items()}
            cheapest_call = min(calls, key=calls.__getitem__)
            out["log_call_only_ms"] = calls
            print(
                "the tools' logging call alone (overhead - values-only): "
                + ", ".join(f"{n} {ms:.3f} ms" for n, ms in calls.items())
            )
            if calls[cheapest_call] > 0:
                out["ratio_vs_log_call_only"] = agent / calls[cheapest_call]
                print(
                    f"stepwatch overhead / cheapest logging call alone ({cheapest_call}): "
                    f"{out['ratio_vs_log_call_only']:.3f}"
                )
        pct = results["stepwatch"]["overhead_pct"]
        print(f"stepwatch overhead: {pct:.2f}% of the bare median step (target < 2%)")
    if "floor" in results:
        floor = results["floor"]
        print(
            f"floor (the per-step grad norm and activation sums alone): {floor['overhead_ms']:.3f} ms = "
            f"{floor['overhead_pct']:.2f}% of the bare median step"
        )
        if "stepwatch" in results:
            above = results["stepwatch"]["overhead_ms"] - floor["overhead_ms"]
            out["stepwatch_above_floor_ms"] = above
            print(f"stepwatch above the floor (timers, amax, copies, shipping, bookkeeping): {above:.3f} ms")
    print(f"measured in {out['elapsed_s']:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, default=2000, help="measured steps per variant (default %(default)s)"
    )
    parser.add_argument(
        "--block", type=int, default=50, help="steps per variant per round (default %(default)s)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="rounds discarded first (default %(default)s)")
    parser.add_argument(
        "--model",
        choices=list(MODELS),
        default="deep-narrow",
        help="model shape: " + ", ".join(f"{k} = {d} x {w}, batch {b}" for k, (d, w, b) in MODELS.items()),
    )
    parser.add_argument("--width", type=int, default=None, help="hidden width (default: from --model)")
    parser.add_argument("--depth", type=int, default=None, help="hidden layers (default: from --model)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: from --model)")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[v for v in VARIANTS if v != "stepwatch-no-ring"],
        help="bare first; names separated by spaces or commas (" + ", ".join(VARIANTS) + ")",
    )
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results as JSON")
    args = parser.parse_args(argv)
    args.variants = [v for item in args.variants for v in item.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    depth, width, batch = MODELS[args.model]
    args.depth = depth if args.depth is None else args.depth
    args.width = width if args.width is None else args.width
    args.batch = batch if args.batch is None else args.batch
    if args.steps < 1 or args.block < 1 or args.warmup < 0:
        parser.error("--steps and --block must be >= 1, --warmup >= 0")

    gc.collect()
    with tempfile.TemporaryDirectory(prefix="stepwatch-bench-") as tmp:
        out = run(args, Path(tmp))
    report(out, args)
    out.update(
        date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        machine={
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        },
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
