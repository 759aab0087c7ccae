"""GPU check: the agent adds no host-device sync to a CUDA training loop, and what it costs there.

A small decoder-style transformer (pre-norm blocks, causal SDPA, bf16 autocast, fused AdamW) trains
on random data, twice interleaved: bare, and with `stepwatch.attach(...)` at default
settings shipping to a receiver on loopback. The whole loop runs under
`torch.cuda.set_sync_debug_mode("error")`, so any synchronising call (`.item()`, `bool(t)`,
`.cpu()`, `nonzero`, a blocking host-to-device copy, ...) raises; only the first `--setup-steps`
steps (lazy set-up) run before the mode is switched on. The bare loop runs under the same mode: if it raises, the loop itself syncs and the check says so rather than blaming the agent. The
agent never lets an exception reach the loop, so its own report is read too: any internal error it
logged or counted fails the check.

Step times come from CUDA events recorded at every step boundary and read only after the loop
(nothing in the loop waits for the GPU): in steady state the interval between two boundaries is the
step's throughput time, and it grows if the host (the agent included) cannot keep the GPU fed.

    python bench/gpu_check.py [--steps 400] [--block 50]

Exits 0 when the agent ran sync-free with no internal error, 1 when it did not, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _src in (REPO / "agent" / "src", REPO / "service" / "src"):
    if _src.is_dir() and str(_src) not in sys.path:
        sys.path.append(str(_src))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _servers  # noqa: E402


class _Records(logging.Handler):
    """Keeps what the agent logged at WARNING and above."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def build(args: argparse.Namespace, seed: int) -> tuple[Any, Any]:
    """A pre-norm causal transformer on continuous inputs (an input projection instead of an
    embedding table: the embedding backward of some CUDA builds syncs, and that is not the agent)."""
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

    torch.manual_seed(seed)
    model = TinyLM().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    return model, optimizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, default=400, help="measured steps per variant (default %(default)s)"
    )
    parser.add_argument(
        "--block", type=int, default=50, help="steps per variant per round (default %(default)s)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="rounds discarded first (default %(default)s)")
    parser.add_argument(
        "--setup-steps",
        type=int,
        default=3,
        help="steps per variant before the debug mode is on (default %(default)s)",
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results as JSON")
    args = parser.parse_args(argv)

    try:
        import torch
    except ImportError as exc:
        print(f"gpu_check: torch is not installed ({exc}); this check needs torch with CUDA", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            f"gpu_check: CUDA is not available (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda}); run this on a machine with an NVIDIA GPU",
            file=sys.stderr,
        )
        return 2
    try:
        import stepwatch
    except ImportError as exc:
        print(
            f"gpu_check: the stepwatch agent is not importable ({exc}); pip install -e agent", file=sys.stderr
        )
        return 1

    records = _Records()
    logging.getLogger("stepwatch").addHandler(records)
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")

    with tempfile.TemporaryDirectory(prefix="stepwatch-gpu-") as tmp:
        ok, why = _servers.collector_available()
        receiver_cm = (
            _servers.collector(
                f"sqlite:///{Path(tmp) / 'collector.db'}", log_path=Path(tmp) / "collector.log"
            )
            if ok
            else _servers.stub()
        )
        if not ok:
            print(f"stepwatch-server not importable ({why}): the agent sends to a stub receiver")
        with receiver_cm as receiver:
            print(f"receiver: {receiver.kind} at {receiver.url}")
            return run(args, torch, stepwatch, receiver.url, Path(tmp), records)


def run(args: argparse.Namespace, torch: Any, stepwatch: Any, url: str, tmp: Path, records: _Records) -> int:
    gen = torch.Generator(device="cuda").manual_seed(1)
    data = [
        (
            torch.randn(args.batch, args.seq, args.dim, device="cuda", generator=gen),
            torch.randint(0, args.vocab, (args.batch * args.seq,), device="cuda", generator=gen),
        )
        for _ in range(8)
    ]
    variants: dict[str, dict[str, Any]] = {}
    for name, seed in (("bare", 0), ("stepwatch", 0)):
        model, optimizer = build(args, seed)
        variants[name] = {"model": model, "optimizer": optimizer, "events": [], "watch": None}
    variants["stepwatch"]["watch"] = stepwatch.attach(
        variants["stepwatch"]["model"],
        variants["stepwatch"]["optimizer"],
        run="bench-gpu-check",
        url=url,
        spool_dir=str(tmp / "spool"),
    )

    def step(v: dict[str, Any], i: int) -> None:
        x, targets = data[i % len(data)]
        v["optimizer"].zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = v["model"](x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets)
        if v["watch"] is not None:
            v["watch"].log(loss=loss)  # a tensor: no sync
        loss.backward()
        v["optimizer"].step()

    # First steps outside the debug mode: lazy set-up (optimizer state, the agent's device buffers,
    # cuBLAS handles) may copy from the host once; the check is about the steady state.
    for v in variants.values():
        for i in range(args.setup_steps):
            step(v, i)
    torch.cuda.synchronize()

    rounds = math.ceil(args.steps / args.block)
    failure: str | None = None
    started = time.perf_counter()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for r in range(args.warmup + rounds):
            for name in ("bare", "stepwatch") if r % 2 == 0 else ("stepwatch", "bare"):
                v = variants[name]
                block = []
                for i in range(args.block + 1):
                    event = torch.cuda.Event(enable_timing=True)
                    event.record()
                    block.append(event)
                    if i < args.block:
                        try:
                            step(v, r * args.block + i)
                        except RuntimeError as exc:
                            who = (
                                "the benchmark's own loop (bare)"
                                if name == "bare"
                                else "the agent's hot path"
                            )
                            failure = f"a host-device sync in {who}: {exc}"
                            raise
                if r >= args.warmup:
                    v["events"].append(block)
    except RuntimeError:
        pass
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    wall_s = time.perf_counter() - started
    watch = variants["stepwatch"]["watch"]
    watch.close()
    stats = watch.stats()

    if failure:
        print(f"FAIL: {failure}", file=sys.stderr)
        return 1
    results: dict[str, Any] = {}
    for name, v in variants.items():
        steps_ms = [a.elapsed_time(b) for block in v["events"] for a, b in itertools.pairwise(block)]
        results[name] = {
            "steps": len(steps_ms),
            "median_ms": statistics.median(steps_ms),
            "p99_ms": sorted(steps_ms)[min(len(steps_ms) - 1, round(0.99 * (len(steps_ms) - 1)))],
        }
    bare, agent = results["bare"]["median_ms"], results["stepwatch"]["median_ms"]
    overhead_pct = (agent - bare) / bare * 100
    print(f"{'variant':<12}{'median ms':>11}{'p99 ms':>10}")
    for name, r in results.items():
        print(f"{name:<12}{r['median_ms']:>11.3f}{r['p99_ms']:>10.3f}")
    print(f"stepwatch overhead: {agent - bare:.3f} ms = {overhead_pct:.2f}% of the bare median step")
    print(f"wall time {wall_s:.1f} s; agent stats: {json.dumps(stats, default=str, sort_keys=True)}")

    problems = list(records.records) + _internal_errors(stats)
    if args.json:
        out = {"results": results, "overhead_pct": overhead_pct, "agent_stats": stats, "problems": problems}
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    if problems:
        print("FAIL: the agent reported internal errors under sync debug mode 'error':", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print("OK: no host-device sync on the training thread, no internal error in the agent")
    return 0


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
