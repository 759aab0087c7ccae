"""The agent's host cost per step as a function of the number of tracked modules.

A model of N `Linear(16, 16)` layers, batch 4, one torch thread: its compute is next to nothing, so the
step time is host time (Python, hooks, op dispatch), the time a GPU step pays on the thread that
launches its kernels. Each measurement is one child process holding two copies of the model, one bare
and one with the agent attached (default settings, shipping to a stdlib stub receiver on loopback,
bench/_servers.py); it alternates their steps (ABBA), `--steps` each, and reports the median of each and
the median of the paired differences (the first `--warmup` left out). Pairing step by step is what makes
the figure hold on a machine whose speed drifts by 2x within a minute, as this one's did; one caveat:
the agent's sender thread runs during both models' steps, so part of its GIL time lands on the bare one.
With `--ref REF` the children of the agent of that commit (a detached worktree under /tmp,
bench/_refs.py) alternate with this tree's, `--rounds` each. Reported per N and agent: the medians over
rounds of the bare step, the paired added time and its share of the bare step.

    .venv/bin/python bench/host_cost.py [--n 12,100,500] [--rounds 5] [--steps 600] [--ref REF] [--json OUT]
        [--device cuda]   (the model on the GPU: its kernels are launched, not waited for)

Targets (issue 13): added <= 60 us at N=12, <= 300 us at N=100, <= 1.2 ms at N=500.
"""

from __future__ import annotations

import argparse
import json
import os
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
# The same targets as a share of the bare step on the machine they were set on (bench/README.md, host
# cost at 75b9b44: bare 272 / 1930 / 13755 us), for machines of another speed.
TARGET_SHARES = {12: 60.0 / 272, 100: 300.0 / 1930, 500: 1200.0 / 13755}

CHILD = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads(1)
n, steps, warmup, url, spool = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
device = sys.argv[6]

def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(n)]).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=1e-4)

bare, attached = make(), make()
import stepwatch
watch = stepwatch.attach(*attached, run=f"host-cost-{n}", url=url, spool_dir=spool)
x = torch.randn(4, 16, device=device)

def step(model, opt):
    t0 = time.perf_counter()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if model is attached[0]:
        watch.log(loss=loss)  # the loss is outside the model here: logged, as a user would
    return time.perf_counter() - t0

times = {"bare": [], "attached": []}
for i in range(steps):  # ABBA: each pair of steps one of each, alternating which goes first
    order = (("bare", bare), ("attached", attached)) if i % 2 else (("attached", attached), ("bare", bare))
    for name, (model, opt) in order:
        times[name].append(step(model, opt))
watch.close(timeout_s=5)
b, a = times["bare"][warmup:], times["attached"][warmup:]
print(json.dumps({"bare_s": statistics.median(b), "attached_s": statistics.median(a),
                  "paired_s": statistics.median([y - z for y, z in zip(a, b)])}))
"""


def child(
    n: int, steps: int, warmup: int, url: str, spool: str, agent_src: Path, device: str
) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(n), str(steps), str(warmup), url, spool, device],
        capture_output=True, text=True, timeout=900, cwd=REPO,
        # on CUDA the machine's own environment (its driver's library paths) is kept
        env={**(os.environ if device == "cuda" else {"PATH": "/usr/bin:/bin"}),
             "PYTHONPATH": str(agent_src), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}): {out.stderr[-2000:]}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", default="12,100,500", help="tracked Linear modules per model, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model runs (cuda: the step's kernels are launched, not waited for)",
    )
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
            runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in agents}
            for r in range(a.rounds):
                for name, src in agents[r % len(agents) :] + agents[: r % len(agents)]:  # rotated
                    runs[name].append(child(n, a.steps, a.warmup, receiver.url, spool, src, a.device))
                print(f"N={n} round {r + 1}/{a.rounds}: " + ", ".join(
                    f"{name} +{got[-1]['paired_s'] * 1e6:.0f} us on {got[-1]['bare_s'] * 1e6:.0f} us"
                    for name, got in runs.items()), file=sys.stderr, flush=True)  # fmt: skip
            for name, _ in agents:
                got = runs[name]
                b = statistics.median(g["bare_s"] for g in got)
                added = statistics.median(g["paired_s"] for g in got)
                share = statistics.median(g["paired_s"] / g["bare_s"] for g in got)
                results.append({
                    "n": n, "agent": name, "bare_us": round(b * 1e6, 1),
                    "attached_us": round(statistics.median(g["attached_s"] for g in got) * 1e6, 1),
                    "added_us": round(added * 1e6, 1), "added_share": round(share, 4),
                    "per_module_us": round(added * 1e6 / n, 2), "target_us": TARGETS_US.get(n),
                    "target_share": TARGET_SHARES.get(n), "rounds": a.rounds, "steps": a.steps,
                })  # fmt: skip
    print("| tracked Linear modules | agent | bare step | attached step | added per step (paired) | share of "
          "bare | per module | target | target as a share |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in results:
        target = f"<= {row['target_us']:.0f} us" if row["target_us"] else "-"
        share = f"<= {row['target_share']:.1%}" if row["target_share"] else "-"
        print(f"| {row['n']} | {row['agent']} | {row['bare_us']:.0f} us | {row['attached_us']:.0f} us | "
              f"{row['added_us']:.0f} us | {row['added_share']:.1%} | {row['per_module_us']:.2f} us | "
              f"{target} | {share} |")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
