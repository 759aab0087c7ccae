"""`python -m stepwatch_server.simulate list [--world dev|heldout] | describe NAME | dump NAME --out FILE.jsonl`:
look at traces. NAME is a scenario of the suite or a run of the world (`dev-007`, `heldout-012`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from stepwatch_server.simulate.scenario import Scenario
from stepwatch_server.simulate.simulation import Simulation
from stepwatch_server.simulate.suite import QUICK, SCENARIOS
from stepwatch_server.simulate.world import SPLITS, split


def lookup(name: str) -> Scenario | None:
    if name in SCENARIOS:
        return SCENARIOS[name]
    prefix = name.split("-", 1)[0]
    return split(prefix).get(name) if prefix in SPLITS else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepwatch_server.simulate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="the scenario library (or a split of the world), one line each")
    listing.add_argument("--world", choices=SPLITS, help="list this split of the world instead")
    describe = sub.add_parser("describe", help="a scenario's parameters, faults and labels (JSON)")
    describe.add_argument("name")
    dump = sub.add_parser("dump", help="write a scenario's batches as JSON lines, in arrival order")
    dump.add_argument("name")
    dump.add_argument("--out", required=True, help="output file (- for stdout)")
    dump.add_argument("--limit", type=int, default=None, help="stop after this many batches")
    args = parser.parse_args(argv)

    if args.command == "list":
        for name, scn in (split(args.world) if args.world else SCENARIOS).items():
            quick = "*" if name in QUICK else " "
            kinds = ",".join(sorted({lab.kind for lab in scn.labels})) or "clean"
            print(
                f"{quick} {name:<38} {scn.world_size:>4} ranks {scn.steps:>6} steps  {kinds:<32} {scn.description}"
            )
        return 0
    found = lookup(args.name)
    if found is None:
        print(f"unknown scenario {args.name!r}; see 'list'", file=sys.stderr)
        return 2
    scn = found
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
