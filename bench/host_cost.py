"""The agent's host cost per step as a function of the number of tracked modules.

A model of N `Linear(16, 16)` layers, batch 4, one torch thread: its compute is next to nothing, so the
step time is host time (Python, hooks, op dispatch), the time a GPU step pays on the thread that
launches its kernels. Each measurement is one child process that trains `--steps` steps (the first
`--warmup` left out) and reports its median step time; bare and attached children alternate,
`--rounds` each, so that drift lands on both. The attached child ships to a stdlib stub receiver on
loopback (bench/_servers.py) with default settings.

Reported per N: the median of the bare children's medians, of the attached ones', and the added host
time per step (attached - bare), with the per-module share. With `--ref REF` a third child per round
runs the agent of that commit (a detached worktree under /tmp, bench/_refs.py) in the same rotation,
so that old and new are measured side by side against the same bare children.

    .venv/bin/python bench/host_cost.py [--n 12,100,500] [--rounds 5] [--steps 600] [--ref REF] [--json OUT]

Targets (issue 13): added <= 60 us at N=12, <= 300 us at N=100, <= 1.2 ms at N=500.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _servers  # noqa: E402

TARGETS_US = {12: 60.0, 100: 300.0, 500: 1200.0}

CHILD = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads(1)
n, steps, warmup, url, spool = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(n)])
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
watch = None
if url != "-":
    import stepwatch
    watch = stepwatch.attach(model, opt, run=f"host-cost-{n}", url=url, spool_dir=spool)
x = torch.randn(4, 16)
times = []
for i in range(steps):
    t0 = time.perf_counter()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if watch is not None:
        watch.log(loss=loss)
    times.append(time.perf_counter() - t0)
if watch is not None:
    watch.close(timeout_s=5)
print(json.dumps({"median_s": statistics.median(times[warmup:])}))
"""


def child(n: int, steps: int, warmup: int, url: str, spool: str, agent_src: Path) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(n), str(steps), str(warmup), url, spool],
        capture_output=True, text=True, timeout=600, cwd=REPO,
        env={"PYTHONPATH": str(agent_src), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}): {out.stderr[-2000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["median_s"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", default="12,100,500", help="tracked Linear modules per model, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--ref", help="also measure the agent of this commit, interleaved (e.g. HEAD~1)")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    sizes = [int(x) for x in a.n.split(",")]
    here = REPO / "agent" / "src"
    agents = [("attached", here)]
    if a.ref:
        from _refs import worktree

        agents.append((f"attached@{a.ref}", worktree(a.ref) / "agent" / "src"))
    results: list[dict[str, Any]] = []
    with _servers.stub() as receiver:
        spool = str(Path("/tmp") / f"stepwatch-host-cost-{int(time.time())}")
        for n in sizes:
            kinds = [("bare", "-", here), *((name, receiver.url, src) for name, src in agents)]
            times: dict[str, list[float]] = {name: [] for name, _, _ in kinds}
            for r in range(a.rounds):
                for name, url, src in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:  # rotated
                    times[name].append(child(n, a.steps, a.warmup, url, spool, src))
                print(f"N={n} round {r + 1}/{a.rounds}: " + ", ".join(
                    f"{name} {t[-1] * 1e6:.0f} us" for name, t in times.items()), file=sys.stderr, flush=True)  # fmt: skip
            b = statistics.median(times["bare"])
            for name, _ in agents:
                t = statistics.median(times[name])
                added_us = (t - b) * 1e6
                results.append({
                    "n": n, "agent": name, "bare_us": round(b * 1e6, 1), "attached_us": round(t * 1e6, 1),
                    "added_us": round(added_us, 1), "added_share": round((t - b) / b, 4),
                    "per_module_us": round(added_us / n, 2), "target_us": TARGETS_US.get(n),
                    "rounds": a.rounds, "steps": a.steps,
                })  # fmt: skip
    print("| tracked Linear modules | agent | bare step | attached step | added per step | share of bare "
          "| per module | target |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for row in results:
        target = f"<= {row['target_us']:.0f} us" if row["target_us"] else "-"
        print(f"| {row['n']} | {row['agent']} | {row['bare_us']:.0f} us | {row['attached_us']:.0f} us | "
              f"{row['added_us']:.0f} us | {row['added_share']:.1%} | {row['per_module_us']:.2f} us | "
              f"{target} |")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
