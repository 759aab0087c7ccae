"""GPU check: the agent adds no host-device sync to a CUDA training loop, in the stacks users run, and what
it costs there.

A small decoder-style transformer (pre-norm blocks, causal SDPA, bf16, fused AdamW) trains on random data
in each of these stacks, one child process per stack:

    plain           eager, bf16 autocast
    fsdp2           FSDP2 (`fully_shard` on each block and the root) over a 1-GPU mesh (NCCL, world size
                    1), bf16 parameters through `MixedPrecisionPolicy`, fp32 reduction
    compile         each block compiled in place (`block.compile()`, inductor), bf16 autocast
    fsdp2+compile   blocks compiled, then sharded as in fsdp2 (torchtitan's order)

Each child holds two copies of the model, bare and with `stepwatch.attach(...)` at default settings
shipping to a stub receiver on loopback that saves every body.

1. Sync check and step time. After `--setup-steps` steps per copy (lazy set-up, compilation), the copies
   take turns in blocks of `--block` steps under `torch.cuda.set_sync_debug_mode("warn")`: every
   synchronising call (`.item()`, `.cpu()`, `nonzero`, a blocking copy, ...) warns, and each warning is
   recorded with the thread it came from and its Python stack. The check fails when a sync's stack passes
   through the agent's package on a thread other than the agent's own, or when the attached copy syncs
   more often per step than the bare one (the stack's own syncs, FSDP2's say, are reported, not blamed on
   the agent). Step times come from CUDA events at every step boundary, read after the loop: the overhead
   is the difference of the medians.
2. Host cost. `--host-steps` step pairs (bare, attached, attached, bare, ...) each started on an idle GPU
   (`torch.cuda.synchronize()` before it, outside the debug mode) and timed on the host until the call
   returns: the time the launch thread spends in the step, which the GPU pays whenever it waits for the
   host. Reported: each copy's median and the median of the paired differences.

3. Values. What each attached copy shipped (the saved bodies) must agree with what the benchmark saw:
   every step once, `time.step_ms` within 10% of the benchmark's own timer (median over the measured
   turns), the phases within each step, finite loss and grad norm, no non-finite flag, and the amax of
   every tracked module on every sampled step.

The agent never lets an exception reach the loop, so its own report is read too: any internal error it
counted or logged (at ERROR) fails the check; its warnings are listed. `--ref-agent DIR` runs each stack
again with the agent in DIR (e.g. `git archive REF agent/src | tar -x -C .ref`), side by side.

    python bench/gpu_check.py [--stacks plain,fsdp2,compile,fsdp2+compile] [--steps 300] [--json OUT]
    python bench/gpu_check.py --device cpu --stacks plain,fsdp2 --steps 20 --dim 64 --seq 32 ...
        (a dry run of the same code on a CPU, gloo instead of NCCL: no sync check, perf_counter times)

Exits 0 when every stack ran sync-free with the right values and no internal error in the agent, 1 when one
did not, 2 without CUDA (on `--device cuda`).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _src in (REPO / "agent" / "src", REPO / "service" / "src"):
    if _src.is_dir() and str(_src) not in sys.path:
        sys.path.append(str(_src))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _servers  # noqa: E402

STACKS = ("plain", "fsdp2", "compile", "fsdp2+compile")
# The options a child takes from its parent as they were given.
_CHILD_OPTIONS = (
    "steps",
    "block",
    "warmup",
    "setup_steps",
    "host_steps",
    "profile_steps",
    "layers",
    "dim",
    "heads",
    "seq",
    "batch",
    "vocab",
    "device",
)


class _Records(logging.Handler):
    """Keeps what the agent logged at WARNING and above: errors (its guard's, its sender's) fail the check,
    warnings (what it says once about the run's layout, say) are reported."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = f"{record.levelname} {record.name}: {record.getMessage()}"
        (self.errors if record.levelno >= logging.ERROR else self.warnings).append(line[:400])


class _Syncs:
    """Records each sync warning of `set_sync_debug_mode("warn")`: the copy stepping, the thread, whether
    its Python stack passes through the agent's package, and the innermost frames."""

    def __init__(self, agent_dir: str) -> None:
        self.agent_dir = agent_dir
        self.variant = ""
        self.found: list[dict[str, Any]] = []
        self._previous = warnings.showwarning

    def showwarning(self, message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        text = str(message)
        if "synchronizing cuda operation" not in text.lower():
            self._previous(message, category, filename, lineno, *rest)
            return
        stack = traceback.extract_stack()[:-1]
        self.found.append(
            {
                "variant": self.variant,
                "thread": threading.current_thread().name,
                "in_agent": any(f.filename.startswith(self.agent_dir) for f in stack),
                "message": text[:160],
                "where": [f"{f.filename}:{f.lineno} {f.name}" for f in stack[-6:]],
            }
        )

    @contextlib.contextmanager
    def recording(self, torch: Any) -> Iterator[None]:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = self.showwarning
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")


def build(args: argparse.Namespace, stack: str, optimizer_kind: str) -> tuple[Any, Any]:
    """A pre-norm causal transformer on continuous inputs (an input projection instead of an
    embedding table: the embedding backward of some CUDA builds syncs, and that is not the agent),
    wrapped as `stack` says."""
    import torch
    import torch.nn.functional as F

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = torch.nn.LayerNorm(args.dim)
            self.qkv = torch.nn.Linear(args.dim, 3 * args.dim, bias=False)
            self.proj = torch.nn.Linear(args.dim, args.dim, bias=False)
            self.norm2 = torch.nn.LayerNorm(args.dim)
            self.fc1 = torch.nn.Linear(args.dim, 4 * args.dim, bias=False)
            self.fc2 = torch.nn.Linear(4 * args.dim, args.dim, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, args.heads, d // args.heads).unbind(2)
            att = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))

    class TinyLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(args.dim, args.dim)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(args.layers))
            self.norm = torch.nn.LayerNorm(args.dim)
            self.head = torch.nn.Linear(args.dim, args.vocab, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for block in self.blocks:
                h = block(h)
            return self.head(self.norm(h))

    torch.manual_seed(0)
    model = TinyLM().to(args.device)
    if "compile" in stack:
        for block in model.blocks:
            block.compile()
    if "fsdp2" in stack:
        _shard(model, model.blocks, args.device)
    return model, _optimizer(torch, model, optimizer_kind)


def _shard(model: Any, blocks: Any, device: str) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def _optimizer(torch: Any, model: Any, kind: str) -> Any:
    return torch.optim.AdamW(model.parameters(), lr=3e-4, **{kind: True})


def _optimizer_kind(torch: Any, args: argparse.Namespace, stack: str) -> tuple[str, str | None]:
    """Fused AdamW where it runs on this stack's parameters, else foreach (and why)."""
    if args.device != "cuda" and not hasattr(torch, "_fused_adamw_"):
        return "foreach", "no fused AdamW in this torch"
    if "fsdp2" not in stack:
        return "fused", None
    probe = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(args.device)
    _shard(probe, list(probe), args.device)
    try:
        opt = _optimizer(torch, probe, "fused")
        probe(torch.randn(2, 8, device=args.device)).float().sum().backward()
        opt.step()
    except Exception as exc:
        return "foreach", f"fused AdamW failed on DTensor parameters: {type(exc).__name__}: {exc}"[:300]
    return "fused", None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--stacks",
        default=",".join(STACKS),
        help=f"comma-separated, of {', '.join(STACKS)} (default all)",
    )
    parser.add_argument(
        "--steps", type=int, default=300, help="measured steps per copy and stack (default %(default)s)"
    )
    parser.add_argument("--block", type=int, default=50, help="steps per copy per turn (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="turns discarded first (default %(default)s)")
    parser.add_argument(
        "--setup-steps",
        type=int,
        default=3,
        help="steps per copy before the debug mode is on (default %(default)s)",
    )
    parser.add_argument(
        "--host-steps",
        type=int,
        default=100,
        help="step pairs timed on the host, each from an idle GPU (default %(default)s)",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="then cProfile this many attached steps and print where the host time goes (default off)",
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the same code"
    )
    parser.add_argument(
        "--stack-timeout",
        type=float,
        default=600.0,
        help="seconds for one stack's child (default %(default)s)",
    )
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results as JSON")
    parser.add_argument(
        "--ref-agent",
        type=Path,
        default=None,
        metavar="DIR",
        help="also run each stack with the agent in DIR (a folder holding stepwatch/, e.g. another "
        "commit's agent/src), side by side",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--label", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--url", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    unknown = [s for s in stacks if s not in STACKS]
    if unknown or not stacks:
        parser.error(f"--stacks: unknown {unknown or 'none given'}; choose from {', '.join(STACKS)}")
    if args.dim % args.heads:
        parser.error(f"--dim {args.dim} is not a multiple of --heads {args.heads}")
    if args.ref_agent is not None and not (args.ref_agent / "stepwatch" / "__init__.py").is_file():
        parser.error(
            f"--ref-agent {args.ref_agent}: no stepwatch/__init__.py there (give an agent/src folder)"
        )
    if args.child:
        return child(args)

    try:
        import torch
    except ImportError as exc:
        print(f"gpu_check: torch is not installed ({exc}); this check needs torch with CUDA", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check: CUDA is not available (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda}); run this on a machine with an NVIDIA GPU "
            "(or --device cpu for a dry run)",
            file=sys.stderr,
        )
        return 2
    try:
        import stepwatch  # noqa: F401
    except ImportError as exc:
        print(
            f"gpu_check: the stepwatch agent is not importable ({exc}); pip install -e agent", file=sys.stderr
        )
        return 1
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (dry run)"
    print(f"device: {where}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)

    with tempfile.TemporaryDirectory(prefix="stepwatch-gpu-") as tmp:
        bodies = Path(tmp) / "bodies"
        bodies.mkdir()
        results: dict[str, dict[str, Any]] = {}
        with _servers.stub(bodies) as receiver:
            print(f"receiver: {receiver.kind} at {receiver.url}, saving the bodies", flush=True)
            for stack in stacks:
                agents: list[tuple[str, Path | None]] = [(stack, None)]
                if args.ref_agent:  # side by side, which goes first alternating between stacks
                    agents.append((f"{stack}@ref", args.ref_agent))
                    agents = agents[:: 1 if stacks.index(stack) % 2 == 0 else -1]
                for label, agent in agents:
                    results[label] = _run_child(args, stack, label, agent, receiver.url, Path(tmp))
        for label, result in results.items():
            if "stepwatch" in result:
                check_values(args, _records_of(bodies, run_name(label)), result)
    return report(args, results)


def run_name(stack: str) -> str:
    return f"bench-gpu-check-{stack.replace('+', '-')}"


def _records_of(bodies: Path, run: str) -> dict[str, Any]:
    """What the agent shipped for `run`: step -> {metric: value}, the sampled steps' amax by module, and
    the steps sent more than once."""
    steps: dict[int, dict[str, Any]] = {}
    amax: dict[int, dict[str, float]] = {}
    repeated: list[int] = []
    for path in sorted(bodies.glob("*.json")):
        body = json.loads(path.read_text())
        if body.get("run") != run:
            continue
        metrics = body.get("metrics") or {}
        for i, step in enumerate(body.get("steps") or []):
            if step in steps:
                repeated.append(step)
            steps[step] = {name: values[i] for name, values in metrics.items()}
        tensors = body.get("tensors") or {}
        for i, step in enumerate(tensors.get("steps") or []):
            by_module = (tensors.get("stats") or {}).get("amax") or {}
            amax[step] = {module: values[i] for module, values in by_module.items()}
    return {"steps": steps, "amax": amax, "repeated": repeated}


def check_values(args: argparse.Namespace, shipped: dict[str, Any], result: dict[str, Any]) -> None:
    """What the attached copy shipped agrees with what the benchmark saw: every step once; its step times
    those of the benchmark's own timer over the measured turns; phases within the step; finite grad norm,
    loss and amax of every tracked module on the sampled steps; no non-finite flag."""
    problems: list[str] = result["problems"]
    steps, amax = shipped["steps"], shipped["amax"]
    turns = math.ceil(args.steps / args.block)
    total = args.setup_steps + (args.warmup + turns) * args.block + 2 * args.host_steps + args.profile_steps
    if sorted(steps) != list(range(1, total + 1)) or shipped["repeated"]:
        missing = sorted(set(range(1, total + 1)) - set(steps))
        problems.append(
            f"values: {len(steps)} steps shipped, {total} taken (missing {missing[:5]}, "
            f"extra {sorted(set(steps) - set(range(1, total + 1)))[:5]}, repeated {shipped['repeated'][:5]})"
        )
        return
    # The attached copy's steps in the measured turns, less the first of each (it spans the bare turn).
    first = args.setup_steps + args.warmup * args.block
    measured = [first + t * args.block + i for t in range(turns) for i in range(2, args.block + 1)]
    step_ms = [steps[s]["time.step_ms"] for s in measured]
    shipped_median = statistics.median(step_ms)
    bench_median = result["stepwatch"]["median_ms"]
    summary = {"shipped_step_ms": shipped_median, "bench_step_ms": bench_median, "sampled_steps": len(amax)}
    result["values"] = summary
    if abs(shipped_median - bench_median) > 0.1 * bench_median:
        problems.append(
            f"values: time.step_ms median {shipped_median:.3f} ms, the benchmark's {bench_median:.3f}"
        )
    for s in measured:
        r = steps[s]
        phases = [r.get(f"time.{p}_ms") for p in ("forward", "backward", "optimizer")]
        if any(p is None or p < 0 for p in phases) or not (
            0.5 * r["time.step_ms"] <= sum(phases) <= 1.02 * r["time.step_ms"] + 0.05
        ):
            problems.append(f"values: step {s}: phases {phases} ms against a step of {r['time.step_ms']} ms")
            break
    for s, r in steps.items():
        bad = [
            name
            for name in ("loss", "grad_norm")
            if not isinstance(r.get(name), float) or not math.isfinite(r[name]) or r[name] <= 0
        ] + [name for name in r if name.startswith("nonfinite.") and r[name]]
        if bad:
            problems.append(f"values: step {s}: {', '.join(f'{n}={r.get(n)!r}' for n in bad)}")
            break
    sampled = [s for s in range(1, total + 1) if s % 10 == 0]
    if sorted(amax) != sampled:
        problems.append(f"values: amax shipped for {len(amax)} steps, {len(sampled)} sampled")
    for s, modules in amax.items():
        values = list(modules.values())
        if len(values) != result["tracked_modules"] or not all(
            isinstance(v, float) and math.isfinite(v) and v > 0 for v in values
        ):
            problems.append(f"values: step {s}: amax of {len(values)} modules {values[:4]}")
            break


def _run_child(
    args: argparse.Namespace, stack: str, label: str, agent: Path | None, url: str, tmp: Path
) -> dict[str, Any]:
    """One stack's child process; with `agent`, that agent's source (a folder holding `stepwatch/`)
    is imported instead of this tree's."""
    out = tmp / f"{label.replace('+', '_').replace('@', '_')}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", stack, "--label", label]
    cmd += ["--url", url, "--json", str(out)]
    for name in _CHILD_OPTIONS:
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    print(f"\n== {label} ==", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if agent is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(agent.resolve()), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, timeout=args.stack_timeout, env=env)
        rc: int | str = done.returncode
    except subprocess.TimeoutExpired:
        rc = f"timed out after {args.stack_timeout:.0f} s"
    wall = time.perf_counter() - started
    if out.exists():
        result: dict[str, Any] = json.loads(out.read_text())
    else:
        result = {"problems": [f"the child for {label} wrote no result (exit {rc})"]}
    result["wall_s"] = round(wall, 1)
    return result


def report(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> int:
    unit = "GPU" if args.device == "cuda" else "CPU"
    print(f"\n{'stack':<19}{'optimizer':>10}{'bare step':>11}{'attached':>10}{'overhead':>10}"
          f"{'host bare':>11}{'host added':>12}{'syncs/step':>12}{'graph breaks':>14}{'wall s':>8}")  # fmt: skip
    failed = False
    for stack, r in results.items():
        problems = r.get("problems", [])
        failed = failed or bool(problems)
        if "bare" not in r:
            print(f"{stack:<19} FAILED: {'; '.join(problems)[:300]}")
            continue
        b, a = r["bare"], r["stepwatch"]
        syncs = (
            f"{b['syncs_per_step']:.2f}/{a['syncs_per_step']:.2f}"
            if b["syncs_per_step"] is not None
            else "n/a"
        )
        breaks = f"{b['graph_breaks']}/{a['graph_breaks']}" if "compile" in stack else "-"
        print(
            f"{stack:<19}{r['optimizer']:>10}{b['median_ms']:>9.3f}ms{a['median_ms']:>8.3f}ms"
            f"{r['overhead_pct']:>9.2f}%{b['host_ms']:>9.3f}ms{r['host_added_us']:>9.0f} us"
            f"{syncs:>12}{breaks:>14}{r['wall_s']:>8.0f}"
        )
        if "values" in r:
            v = r["values"]
            print(f"    values shipped: every step once, time.step_ms median {v['shipped_step_ms']:.3f} ms "
                  f"(the benchmark's {v['bench_step_ms']:.3f}), amax of every module on {v['sampled_steps']} "
                  "sampled steps")  # fmt: skip
        for problem in problems:
            print(f"    FAIL: {problem}")
        for note in r.get("notes", []):
            print(f"    note: {note}")
    print(f"(step times: {unit} medians; overhead = attached - bare over bare; host: median time in the step "
          "call from an idle GPU, added = median of paired differences; syncs and graph breaks: bare/attached)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "stacks": results}, indent=2) + "\n")
    if failed:
        print("FAIL: see the problems above", file=sys.stderr)
        return 1
    if args.device == "cuda":
        print("OK: no host-device sync from the agent on the training thread, no internal error in the agent")
    else:
        print("OK (dry run): every stack ran, no internal error in the agent; syncs are not checked on a CPU")
    return 0


def child(args: argparse.Namespace) -> int:
    import torch

    import stepwatch

    stack, cuda = args.child, args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = True
    result: dict[str, Any] = {"notes": [], "problems": []}
    if "fsdp2" in stack:
        import torch.distributed as dist

        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"tcp://127.0.0.1:{_servers.free_port()}",
            rank=0,
            world_size=1,
        )
    records = _Records()
    logging.getLogger("stepwatch").addHandler(records)
    kind, why = _optimizer_kind(torch, args, stack)
    result["optimizer"] = kind
    if why:
        result["notes"].append(why)
    try:
        return _measure(args, torch, stepwatch, stack, kind, records, result)
    except Exception as exc:  # one stack's failure is reported, the other stacks still run
        result["problems"].append(f"{type(exc).__name__}: {exc}"[:500])
        traceback.print_exc()
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
        return 1


def _measure(
    args: argparse.Namespace,
    torch: Any,
    stepwatch: Any,
    stack: str,
    kind: str,
    records: _Records,
    result: dict[str, Any],
) -> int:
    cuda = args.device == "cuda"
    gen = torch.Generator(device=args.device).manual_seed(1)
    data = [
        (
            torch.randn(args.batch, args.seq, args.dim, device=args.device, generator=gen),
            torch.randint(0, args.vocab, (args.batch * args.seq,), device=args.device, generator=gen),
        )
        for _ in range(8)
    ]
    autocast = (
        contextlib.nullcontext
        if "fsdp2" in stack  # bf16 through the sharding's MixedPrecisionPolicy
        else lambda: torch.autocast(args.device, dtype=torch.bfloat16)
    )
    variants: dict[str, dict[str, Any]] = {}
    for name in ("bare", "stepwatch"):
        model, optimizer = build(args, stack, kind)
        variants[name] = {"model": model, "optimizer": optimizer, "events": [], "host": [], "watch": None}
    spool = Path(args.json).parent / f"spool-{stack.replace('+', '_')}"
    watch = stepwatch.attach(
        variants["stepwatch"]["model"],
        variants["stepwatch"]["optimizer"],
        run=run_name(args.label or stack),
        url=args.url,
        spool_dir=str(spool),
    )
    variants["stepwatch"]["watch"] = watch
    result["tracked_modules"] = len(watch.tracked())
    result["agent"] = str(Path(stepwatch.__file__).resolve().parent)

    def step(v: dict[str, Any], i: int) -> None:
        x, targets = data[i % len(data)]
        v["optimizer"].zero_grad(set_to_none=True)
        with autocast():
            logits = v["model"](x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets)
        if v["watch"] is not None:
            v["watch"].log(loss=loss)  # a tensor: no sync
        loss.backward()
        v["optimizer"].step()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    # Lazy set-up (optimizer state, the agent's buffers, compilation) outside the debug mode; the
    # graph breaks each copy's compilation counted.
    counters = torch._dynamo.utils.counters
    for v in variants.values():
        before = sum(counters["graph_break"].values())
        for i in range(args.setup_steps):
            step(v, i)
        sync()
        v["graph_breaks"] = sum(counters["graph_break"].values()) - before

    syncs = _Syncs(str(Path(stepwatch.__file__).resolve().parent))
    turns = math.ceil(args.steps / args.block)
    started = time.perf_counter()
    with syncs.recording(torch) if cuda else contextlib.nullcontext():
        for r in range(args.warmup + turns):
            for name in ("bare", "stepwatch") if r % 2 == 0 else ("stepwatch", "bare"):
                v = variants[name]
                syncs.variant = name if r >= args.warmup else f"{name} (warm-up)"
                marks: list[Any] = []
                for i in range(args.block + 1):
                    if cuda:
                        event = torch.cuda.Event(enable_timing=True)
                        event.record()
                        marks.append(event)
                    else:
                        marks.append(time.perf_counter())
                    if i < args.block:
                        step(v, r * args.block + i)
                if r >= args.warmup:
                    v["events"].append(marks)
        if cuda:  # a deliberate sync: the recorder must see it, or the check above proved nothing
            syncs.variant = "control"
            data[0][0].sum().item()
    sync()
    result["sync_check_s"] = round(time.perf_counter() - started, 1)

    # Host cost: each step from an idle GPU, the copies paired (ABBA).
    for i in range(2 * args.host_steps):
        order = ("bare", "stepwatch") if i % 2 == 0 else ("stepwatch", "bare")
        for name in order:
            sync()
            t0 = time.perf_counter()
            step(variants[name], i)
            variants[name]["host"].append(time.perf_counter() - t0)
    sync()
    if args.profile_steps:
        result["profile"] = _profile(lambda i: step(variants["stepwatch"], i), args.profile_steps)
        print(f"-- {stack}: the attached copy's host time by function, {args.profile_steps} steps --")
        print(result["profile"])
    watch.close()
    stats = watch.stats()

    measured_steps = turns * args.block
    for name, v in variants.items():
        if cuda:
            steps_ms = [a.elapsed_time(b) for marks in v["events"] for a, b in itertools.pairwise(marks)]
        else:
            steps_ms = [(b - a) * 1e3 for marks in v["events"] for a, b in itertools.pairwise(marks)]
        steps_ms.sort()
        counted = [s for s in syncs.found if s["variant"] == name and s["thread"] != "stepwatch-sender"]
        result[name] = {
            "steps": len(steps_ms),
            "median_ms": statistics.median(steps_ms),
            "p99_ms": steps_ms[min(len(steps_ms) - 1, round(0.99 * (len(steps_ms) - 1)))],
            "host_ms": statistics.median(v["host"]) * 1e3,
            "syncs_per_step": len(counted) / measured_steps if cuda else None,
            "graph_breaks": v["graph_breaks"],
        }
    bare, attached = result["bare"], result["stepwatch"]
    result["overhead_pct"] = (attached["median_ms"] - bare["median_ms"]) / bare["median_ms"] * 100
    pairs = zip(variants["bare"]["host"], variants["stepwatch"]["host"], strict=True)
    result["host_added_us"] = statistics.median(a - b for b, a in pairs) * 1e6
    result["agent_stats"] = stats
    result["syncs"] = {
        "total": len(syncs.found),
        "in_agent": [s for s in syncs.found if s["in_agent"]][:5],
        "examples": syncs.found[:5],
    }

    problems = result["problems"]
    problems += records.errors + _internal_errors(stats)
    result["notes"] += [f"the agent logged {line}" for line in records.warnings]
    for s in syncs.found:  # the measured turns (compilation may still run in the warm-up ones)
        if s["in_agent"] and s["thread"] != "stepwatch-sender" and s["variant"] in variants:
            problems.append(f"a sync inside the agent on thread {s['thread']}: {s['where'][-3:]}")
            break
    warm = sum(1 for s in syncs.found if s["variant"].endswith("(warm-up)"))
    if warm:
        result["notes"].append(f"{warm} sync(s) in the warm-up turns (not counted)")
    if cuda and attached["syncs_per_step"] > bare["syncs_per_step"]:
        problems.append(
            f"the attached copy syncs {attached['syncs_per_step']:.2f} times a step, the bare one "
            f"{bare['syncs_per_step']:.2f}"
        )
    if cuda and not any(s["variant"] == "control" for s in syncs.found):
        problems.append("the recorder did not see a deliberate .item(): the sync check did not work")
    if not cuda:
        result["notes"].append("dry run on a CPU: no sync check")
    args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 1 if problems else 0


def _profile(step: Any, steps: int) -> str:
    """cProfile of `steps` calls of `step`: the functions with the most time of their own."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(steps):
        step(i)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    out.write("the agent's own functions, by cumulative time:\n")
    stats.sort_stats("cumulative").print_stats("stepwatch/", 25)
    return out.getvalue()


def _internal_errors(stats: Any, prefix: str = "") -> list[str]:
    """Counters in `watch.stats()` that say something failed inside the agent."""
    found: list[str] = []
    if isinstance(stats, dict):
        for key, value in stats.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                found += _internal_errors(value, name + ".")
            elif any(word in str(key).lower() for word in ("error", "disabled", "failed")) and value:
                found.append(f"stats {name} = {value!r}")
    return found


if __name__ == "__main__":
    raise SystemExit(main())
