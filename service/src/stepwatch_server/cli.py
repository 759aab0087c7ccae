"""`stepwatch-server`: run the collector (`serve`), a detection worker of the bus (`detect`), a live
demonstration (`demo`), send a test alert (`alerts test --channel NAME`), `grafana push`, or list and
delete runs (`runs list`, `runs delete RUN`)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from stepwatch_server.detect.anomalies import KINDS
from stepwatch_server.grafana.command import add_grafana_command, run_grafana_command
from stepwatch_server.runs.command import add_runs_command, run_runs_command

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_DEMO_STEPS = 3000


def _add_server_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (default %(default)s)")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="port (default %(default)s; 0 = any free)"
    )
    parser.add_argument(
        "--database-url",
        default=None,
        help="SQLAlchemy URL; default $STEPWATCH_DATABASE_URL or sqlite:///./stepwatch.db "
        "(PostgreSQL: postgresql+psycopg://user@host/db)",
    )
    parser.add_argument(
        "--token",
        default=None,
        help="one token that writes and reads every run: 'Authorization: Bearer TOKEN' "
        "(default $STEPWATCH_TOKEN)",
    )
    parser.add_argument(
        "--tokens-file",
        default=None,
        metavar="FILE",
        help="scoped tokens (YAML: read or write, limited to run-name prefixes; README 'Security and "
        "limits'); default $STEPWATCH_TOKENS_FILE",
    )
    parser.add_argument(
        "--public-read",
        action="store_true",
        default=None,
        help="with tokens configured, let anyone read (API, events, dashboard, /metrics); writes still "
        "need a token (default $STEPWATCH_PUBLIC_READ)",
    )
    _add_alerts_option(parser)
    for name, what in (
        ("raw", "each run's per-rank values of the steps finished longer ago (rollups stay)"),
        ("run", "a run not heard from for longer"),
    ):
        parser.add_argument(
            f"--{name}-retention-days",
            type=float,
            default=None,
            metavar="DAYS",
            help=f"delete {what}; default ${'STEPWATCH_' + name.upper() + '_RETENTION_DAYS'}, else keep forever",
        )
    parser.add_argument(
        "--compact-after-steps",
        type=int,
        default=None,
        metavar="STEPS",
        help="move each run's values this many steps behind its newest into compressed blocks (all of them "
        "once the run is silent for a day); 0: never (default $STEPWATCH_COMPACT_AFTER_STEPS, else 3600)",
    )


def _add_alerts_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--alerts",
        default=None,
        metavar="FILE",
        help="alerts configuration (YAML; docs/alerts.md); default $STEPWATCH_ALERTS, else no alerts",
    )


def _kinds(value: str) -> list[str]:
    """`--inject`: one anomaly kind or several, comma-separated (`straggler,loss_spike`)."""
    kinds = [k.strip() for k in value.split(",") if k.strip()]
    for kind in kinds:
        if kind not in KINDS:
            raise argparse.ArgumentTypeError(f"invalid choice: {kind!r} (choose from {', '.join(KINDS)})")
    if not kinds or len(set(kinds)) != len(kinds):
        raise argparse.ArgumentTypeError(f"expected distinct kinds separated by commas, got {value!r}")
    return kinds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepwatch-server", description="The stepwatch collector.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the collector")
    _add_server_options(serve)
    serve.add_argument(
        "--bus",
        default=None,
        metavar="URL",
        help="Redis (redis://host:6379/0): add each stored batch to the bus for `detect` workers instead of "
        "detecting in this process (README 'Running at scale'); default $STEPWATCH_BUS, else no bus",
    )

    detect = sub.add_parser(
        "detect",
        help="a detection worker for collectors started with --bus: takes its share of the bus's streams",
    )
    detect.add_argument(
        "--bus", default=None, metavar="URL", help="Redis URL (default $STEPWATCH_BUS); required"
    )
    detect.add_argument(
        "--database-url",
        default=None,
        help="the collectors' database (default $STEPWATCH_DATABASE_URL); PostgreSQL with several processes",
    )
    detect.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve this worker's Prometheus metrics on this port (/metrics); default: none",
    )
    detect.add_argument(
        "--metrics-host", default=DEFAULT_HOST, help="address for --metrics-port (default %(default)s)"
    )
    _add_alerts_option(detect)

    demo = sub.add_parser(
        "demo",
        help="run the collector and a real multi-rank CPU training run (torch.distributed, gloo) feeding it; "
        "or, with --inject KIND[,KIND...], a simulated run with those faults",
    )
    _add_server_options(demo)
    demo.add_argument("--ranks", type=int, default=4, help="training processes (default %(default)s)")
    demo.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"optimizer steps per rank (default {DEFAULT_DEMO_STEPS}; with --inject: the scenario's, "
        "or fewer when given)",
    )
    demo.add_argument(
        "--run", default=None, help="run name (default 'demo'; with --inject: inject-KIND-TIME)"
    )
    demo.add_argument(
        "--inject",
        type=_kinds,
        default=None,
        metavar="KIND[,KIND...]",
        help="instead of training, feed the simulator's scenario with this fault (several, comma-separated: "
        "one run with all of them) over HTTP and print the anomalies found; KIND is one of: "
        f"{', '.join(KINDS)}",
    )
    demo.add_argument(
        "--exit-when-done",
        action="store_true",
        help="stop the collector when training ends (default: keep serving)",
    )
    add_grafana_command(sub)
    add_runs_command(sub)
    alerts = sub.add_parser("alerts", help="alert channels (docs/alerts.md)")
    alerts_sub = alerts.add_subparsers(dest="alerts_command", required=True)
    test = alerts_sub.add_parser("test", help="send a test message to one channel now and report the answer")
    test.add_argument("--channel", required=True, help="a channel name of the configuration")
    _add_alerts_option(test)
    return parser


def _alerts_test(args: argparse.Namespace) -> int:
    import os

    from stepwatch_server.alerts.config import AlertsConfigError, load_config
    from stepwatch_server.alerts.probe import send_test

    path = args.alerts or os.environ.get("STEPWATCH_ALERTS")
    if not path:
        print(
            "stepwatch-server alerts test: give the configuration with --alerts FILE or STEPWATCH_ALERTS",
            file=sys.stderr,
        )
        return 2
    try:
        config = load_config(path, only_channel=args.channel)  # the other channels' secrets are not needed
    except AlertsConfigError as exc:
        print(f"stepwatch-server: {exc}", file=sys.stderr)
        return 2
    if args.channel not in config.channels:
        known = ", ".join(config.channels)
        print(
            f"stepwatch-server alerts test: no channel {args.channel!r} in {path}; the channels are {known}",
            file=sys.stderr,
        )
        return 2
    result = send_test(config, args.channel)
    if result.ok:
        print(f"test message delivered to {args.channel} (HTTP {result.status})")
        return 0
    print(f"test message to {args.channel} failed: {result.error}", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet = args.command == "runs"  # a listing or a delete's progress, not the migrations' log lines
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "grafana":
        return run_grafana_command(args)
    if args.command == "runs":
        return run_runs_command(args)
    if args.command == "alerts":
        return _alerts_test(args)
    if args.command == "detect":
        from stepwatch_server.bus.command import run_detect

        return run_detect(args)
    from stepwatch_server.settings import Settings

    try:
        extra: dict[str, object] = {}
        if args.alerts:
            from stepwatch_server.alerts.config import load_config

            extra["alerts"] = load_config(args.alerts)
        if args.tokens_file:
            from stepwatch_server.auth import load_tokens

            extra["tokens"] = load_tokens(args.tokens_file)
        if args.public_read:
            extra["public_read"] = True
        if getattr(args, "bus", None):
            extra["bus"] = args.bus
        for name in ("raw_retention_days", "run_retention_days", "compact_after_steps"):
            if getattr(args, name, None) is not None:
                extra[name] = getattr(args, name)
        settings = Settings.from_env(database_url=args.database_url, token=args.token, **extra)
    except ValueError as exc:
        print(f"stepwatch-server: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        from stepwatch_server.serving import serve_forever

        serve_forever(settings, host=args.host, port=args.port)
        return 0
    from stepwatch_server.demo import run_demo, run_inject_demo

    if args.ranks < 1 or (args.steps is not None and args.steps < 1):
        print("stepwatch-server demo: --ranks and --steps must be at least 1", file=sys.stderr)
        return 2
    if args.inject is not None:
        return run_inject_demo(
            settings,
            host=args.host,
            port=args.port,
            kinds=args.inject,
            run=args.run,
            steps=args.steps,
            keep_serving=not args.exit_when_done,
        )
    return run_demo(
        settings,
        host=args.host,
        port=args.port,
        ranks=args.ranks,
        steps=args.steps or DEFAULT_DEMO_STEPS,
        run=args.run or "demo",
        keep_serving=not args.exit_when_done,
    )


if __name__ == "__main__":
    raise SystemExit(main())
