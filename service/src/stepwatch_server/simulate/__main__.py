"""`python -m stepwatch_server.simulate list | describe NAME | dump NAME --out FILE.jsonl`: look at traces."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from stepwatch_server.simulate.simulation import Simulation
from stepwatch_server.simulate.suite import QUICK, SCENARIOS


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepwatch_server.simulate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the scenario library, one line each")
    describe = sub.add_parser("describe", help="a scenario's parameters, faults and labels (JSON)")
    describe.add_argument("name")
    dump = sub.add_parser("dump", help="write a scenario's batches as JSON lines, in arrival order")
    dump.add_argument("name")
    dump.add_argument("--out", required=True, help="output file (- for stdout)")
    dump.add_argument("--limit", type=int, default=None, help="stop after this many batches")
    args = parser.parse_args(argv)

    if args.command == "list":
        for name, scn in SCENARIOS.items():
            quick = "*" if name in QUICK else " "
            kinds = ",".join(sorted({lab.kind for lab in scn.labels})) or "clean"
            print(
                f"{quick} {name:<38} {scn.world_size:>4} ranks {scn.steps:>6} steps  {kinds:<32} {scn.description}"
            )
        return 0
    if args.name not in SCENARIOS:
        print(f"unknown scenario {args.name!r}; see 'list'", file=sys.stderr)
        return 2
    scn = SCENARIOS[args.name]
    if args.command == "describe":
        print(json.dumps(scn.describe(), indent=2))
        return 0
    sim = Simulation(scn)
    out = sys.stdout if args.out == "-" else open(args.out, "w", encoding="utf-8")  # noqa: SIM115
    try:
        for i, batch in enumerate(sim):
            if args.limit is not None and i >= args.limit:
                break
            out.write(json.dumps(batch, allow_nan=False, separators=(",", ":")) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    print(
        json.dumps({"batches": sim.batches_sent, "labels": [lab.as_dict() for lab in sim.labels]}),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
