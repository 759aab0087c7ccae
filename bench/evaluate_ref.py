"""Score an older checkout of the collector's detectors on this simulator's world (last release's figures).

    .venv/bin/python bench/evaluate_ref.py --ref 0cc4187 --world dev --jobs 2 [--json OUT]

Makes a `git worktree` of `--ref` under /tmp (detached, never committed; reused when it is already
there at that commit), then, for every run of the split, generates this simulator's batches here and
streams them as JSON lines over a pipe into `bench/_ref_replay.py` running with that checkout's
`service/src` first on PYTHONPATH: that version's `parse_batch` and `DetectionEngine` see exactly what
ingest would hand them. The anomalies come back as JSON and are scored with this version's scorer
(`simulate/score.py`), so old and new detectors are measured by the same rules on the same world.

Versions before the heartbeat's `forwards`, `nograd_forwards` and `stack` (docs/ingest.md) reject them
as unknown fields: they are stripped for such a version (the output says so); nothing else is changed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from stepwatch_server.detect.evaluate import costliest_first, score_results, world_report
from stepwatch_server.simulate import Detection, Label, Scenario, Simulation
from stepwatch_server.simulate.world import SPLITS
from stepwatch_server.simulate.world import split as world_split

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _refs import worktree

REPO = Path(__file__).resolve().parent.parent
REPLAY = Path(__file__).resolve().parent / "_ref_replay.py"
NEW_HEARTBEAT_FIELDS = ("forwards", "nograd_forwards", "stack")


def knows_activity(tree: Path) -> bool:
    """Whether that version's validation accepts the heartbeat's forwards / nograd_forwards / stack."""
    text = (tree / "service" / "src" / "stepwatch_server" / "ingest" / "validate.py").read_text()
    return "nograd_forwards" in text


def replay(
    tree: Path, sc: Scenario, strip: bool
) -> tuple[list[Label], list[Detection], float, dict[str, Any]]:
    """One run through the old collector (the unit of work of a worker process)."""
    started = time.monotonic()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tree / "service" / "src"), str(tree / "agent" / "src")]),
    }
    sim = Simulation(sc)
    stripped = 0
    with subprocess.Popen(
        [sys.executable, str(REPLAY)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True, env=env, cwd="/tmp",
    ) as proc:  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None
        for batch in sim:
            hb = batch.get("heartbeat")
            if strip and hb is not None and any(k in hb for k in NEW_HEARTBEAT_FIELDS):
                batch["heartbeat"] = {k: v for k, v in hb.items() if k not in NEW_HEARTBEAT_FIELDS}
                stripped += 1
            proc.stdin.write(json.dumps(batch, allow_nan=False, separators=(",", ":")) + "\n")
        proc.stdin.close()
        result = json.loads(proc.stdout.read())
    if proc.returncode != 0:
        raise RuntimeError(f"{sc.name}: the replay exited {proc.returncode}")
    dets = [
        Detection(
            kind=a["kind"], first_step=a["first_step"], detected_at_step=a["detected_step"], rank=a["rank"],
            node=a["node"], last_step=a["last_step"] if a["status"] == "resolved" else None,
            detected_at_ts=a["detected_ts"], module=a["module"], summary=a["summary"],
        )
        for a in result["anomalies"]
    ]  # fmt: skip
    info = {"collector": result["collector"], "rejected": result["rejected"], "stripped": stripped}
    return list(sim.labels), dets, time.monotonic() - started, info


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--ref", default="0cc4187", help="the commit to score (default: 0cc4187, the last release)"
    )
    parser.add_argument("--world", choices=SPLITS, required=True)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the score and per-run rows here")
    parser.add_argument("--runs", nargs="*", help="only these runs of the split (a quick look)")
    args = parser.parse_args(argv)
    tree = worktree(args.ref)
    strip = not knows_activity(tree)
    scns = [s for n, s in world_split(args.world).items() if not args.runs or n in args.runs]
    started = time.monotonic()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {i: pool.submit(replay, tree, scns[i], strip) for i in costliest_first(scns)}
        results = [futures[i].result() for i in range(len(scns))]
    infos = [r[3] for r in results]
    collectors = sorted({i["collector"] for i in infos})
    rejected = [f"{sc.name}: {m}" for sc, i in zip(scns, infos, strict=True) for m in i["rejected"]]
    note = (
        f"collector: {args.ref} ({', '.join(collectors)}); "
        + (
            f"heartbeat fields {', '.join(NEW_HEARTBEAT_FIELDS)} stripped from {sum(i['stripped'] for i in infos):,} "
            "batches (this version rejects them)"
            if strip
            else "batches sent as generated"
        )
        + (f"; REJECTED batches: {rejected[:5]}" if rejected else "; no batch rejected")
    )
    total, rows = score_results(scns, [(r[0], r[1], r[2]) for r in results], progress=sys.stderr)
    print(world_report(args.world, scns, total, time.monotonic() - started, note=note))
    if args.json:
        args.json.write_text(
            json.dumps({"ref": args.ref, "note": note, "score": total.as_dict(), "runs": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
