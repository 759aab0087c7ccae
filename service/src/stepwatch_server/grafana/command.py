"""The `stepwatch-server grafana` command line (cli.py adds it): `grafana push`, see grafana/push.py.

Imports of grafana-client and the database layer wait until the command runs, so that the CLI's
other commands start without them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def add_grafana_command(sub: Any) -> None:
    """`stepwatch-server grafana push ...` on the CLI's subcommand parsers."""
    grafana = sub.add_parser("grafana", help="Grafana: push the dashboards, datasources and folder")
    grafana_sub = grafana.add_subparsers(dest="grafana_command", required=True)
    push = grafana_sub.add_parser(
        "push", help="create or update the stepwatch folder, datasources and dashboards (idempotent)"
    )
    push.add_argument("--url", required=True, help="Grafana's URL, e.g. http://grafana:3000")
    push.add_argument("--token", default=None, help="a service account token (default $GRAFANA_TOKEN)")
    push.add_argument("--folder", default="stepwatch", help="folder title (default %(default)s)")
    push.add_argument(
        "--dashboards", default="dashboards", help="directory of the dashboards' JSON (default %(default)s)"
    )
    push.add_argument(
        "--prometheus-url",
        default="http://prometheus:9090",
        help="for the Prometheus datasource (as Grafana reaches it)",
    )
    push.add_argument(
        "--postgres-url",
        default=None,
        help="for the PostgreSQL datasource, as Grafana reaches it (default: the compose stack's database)",
    )


def run_grafana_command(args: argparse.Namespace) -> int:
    from stepwatch_server.grafana.provisioning import Postgres

    try:
        from stepwatch_server.grafana.push import push
    except ImportError as exc:
        print(
            f"stepwatch-server grafana push: {exc}; install it with: pip install 'stepwatch-server[grafana]'",
            file=sys.stderr,
        )
        return 1
    try:
        postgres = Postgres.from_url(args.postgres_url) if args.postgres_url else None
        report = push(
            args.url,
            args.token or os.environ.get("GRAFANA_TOKEN") or None,
            folder=args.folder,
            dashboards_dir=Path(args.dashboards),
            prometheus_url=args.prometheus_url,
            postgres=postgres,
        )
    except Exception as exc:  # an answer from Grafana, a bad URL, no dashboards: say which, exit 1
        print(f"stepwatch-server grafana push: {exc}", file=sys.stderr)
        return 1
    print(f"stepwatch-server grafana push: {report}")
    return 0
