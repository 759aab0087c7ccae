"""The alerts configuration file (docs/alerts.md, docs/alerts.example.yaml): loaded and checked at start.

Secrets never appear in the file: a Slack incoming-webhook URL (the URL is the credential) and a
webhook's signing secret are read from environment variables the file names (`url_env`,
`secret_env`). Every problem is an `AlertsConfigError` (a ValueError) that names the file, the line,
the setting and the fix, so the collector refuses to start with a broken configuration.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from stepwatch_server.alerts._yaml import load_file, located
from stepwatch_server.alerts.routing import Match, Route, channels_for
from stepwatch_server.detect.anomalies import KINDS, SEVERITIES

CONFIG_VERSION = 1
DEFAULT_GROUP_WINDOW_S = 10.0
DEFAULT_COOLDOWN_S = 900.0
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_DEADLINE_S = 3600.0
DEFAULT_MAX_BACKOFF_S = 300.0
DEFAULT_MAX_PER_MINUTE = 20
CHANNEL_TYPES = ("slack", "webhook")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class AlertsConfigError(ValueError):
    """A configuration problem, with the file, line, setting and fix in the message."""


@dataclass(frozen=True)
class Channel:
    name: str
    type: Literal["slack", "webhook"]
    url: str = field(repr=False)  # may hold a credential (Slack): never logged, never stored
    secret: bytes | None = field(default=None, repr=False)  # webhook signing key
    max_per_minute: int = DEFAULT_MAX_PER_MINUTE
    line: int = 0


@dataclass(frozen=True)
class AlertsConfig:
    """A checked configuration. `route()` gives the channels for an anomaly."""

    source: str
    channels: Mapping[str, Channel]
    routes: tuple[Route, ...]
    dashboard_url: str | None = None
    group_window_s: float = DEFAULT_GROUP_WINDOW_S
    cooldown_s: float = DEFAULT_COOLDOWN_S
    timeout_s: float = DEFAULT_TIMEOUT_S
    deadline_s: float = DEFAULT_DEADLINE_S
    max_backoff_s: float = DEFAULT_MAX_BACKOFF_S

    def route(self, kind: str, severity: str, run: str) -> tuple[str, ...]:
        return channels_for(self.routes, kind, severity, run)


def load_config(
    path: str | os.PathLike[str], env: Mapping[str, str] | None = None, *, only_channel: str | None = None
) -> AlertsConfig:
    """Read and check the file at `path`; secrets come from `env` (default: os.environ). With `only_channel`
    (`alerts test --channel`), the other channels are checked but their secrets are not needed yet: such a
    configuration can test that channel and nothing else (its other channels have no endpoint)."""
    fix = "pass an existing file to --alerts or STEPWATCH_ALERTS (example: docs/alerts.example.yaml)"
    doc, lines = load_file(path, "alerts configuration", fix, AlertsConfigError)
    return _Checker(str(path), lines, os.environ if env is None else env, only_channel).config(doc)


class _Checker:
    def __init__(
        self,
        source: str,
        lines: dict[tuple[str | int, ...], int],
        env: Mapping[str, str],
        only_channel: str | None = None,
    ) -> None:
        self.source, self.lines, self.env, self.only_channel = source, lines, env, only_channel

    def fail(self, path: tuple[str | int, ...], problem: str) -> AlertsConfigError:
        return AlertsConfigError(located(self.source, self.lines, path, problem))

    def mapping(self, value: Any, path: tuple[str | int, ...], allowed: tuple[str, ...]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, f"expected a mapping of {', '.join(allowed)}, got {_show(value)}")
        for key in value:
            if key not in allowed:
                raise self.fail(
                    (*path, key), f"unknown setting {key!r}; the settings here are {', '.join(allowed)}"
                )
        return value

    def number(self, doc: dict[str, Any], path: tuple[str | int, ...], default: float, low: float) -> float:
        value = doc.get(str(path[-1]), default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < low:
            raise self.fail(path, f"expected a number >= {low:g} (seconds), got {_show(value)}")
        return float(value)

    def names(
        self, value: Any, path: tuple[str | int, ...], allowed: tuple[str, ...] | None
    ) -> tuple[str, ...]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items or not all(isinstance(v, str) for v in items):
            raise self.fail(path, f"expected a name or a list of names, got {_show(value)}")
        for i, item in enumerate(items):
            if allowed is not None and item not in allowed:
                at = path if isinstance(value, str) else (*path, i)
                raise self.fail(at, f"unknown value {item!r}; expected one of {', '.join(allowed)}")
        return tuple(items)

    def config(self, doc: Any) -> AlertsConfig:
        top = ("version", "dashboard_url", "grouping", "delivery", "channels", "routes")
        doc = self.mapping(doc, (), top)
        if doc.get("version", CONFIG_VERSION) != CONFIG_VERSION:
            raise self.fail(
                ("version",), f"this collector reads version {CONFIG_VERSION}, got {_show(doc['version'])}"
            )
        dashboard = doc.get("dashboard_url")
        if dashboard is not None:
            dashboard = self.url(dashboard, ("dashboard_url",), "the web dashboard's base URL").rstrip("/")
        grouping = self.mapping(doc.get("grouping", {}), ("grouping",), ("window_s", "cooldown_s"))
        delivery = self.mapping(
            doc.get("delivery", {}), ("delivery",), ("timeout_s", "deadline_s", "max_backoff_s")
        )
        channels = self.channels(doc.get("channels"))
        routes = self.routes(doc.get("routes"), channels)
        return AlertsConfig(
            source=self.source,
            channels=channels,
            routes=routes,
            dashboard_url=dashboard,
            group_window_s=self.number(grouping, ("grouping", "window_s"), DEFAULT_GROUP_WINDOW_S, 0.0),
            cooldown_s=self.number(grouping, ("grouping", "cooldown_s"), DEFAULT_COOLDOWN_S, 0.0),
            timeout_s=self.number(delivery, ("delivery", "timeout_s"), DEFAULT_TIMEOUT_S, 0.1),
            deadline_s=self.number(delivery, ("delivery", "deadline_s"), DEFAULT_DEADLINE_S, 1.0),
            max_backoff_s=self.number(delivery, ("delivery", "max_backoff_s"), DEFAULT_MAX_BACKOFF_S, 0.1),
        )

    def channels(self, value: Any) -> dict[str, Channel]:
        if not isinstance(value, dict) or not value:
            raise self.fail(("channels",), "expected a mapping of channel names to channels (at least one)")
        out: dict[str, Channel] = {}
        for name, spec in value.items():
            path = ("channels", name)
            if not _NAME.match(name):
                raise self.fail(path, "a channel name is 1-100 characters of A-Z a-z 0-9 _ . -")
            spec = self.mapping(spec, path, ("type", "url", "url_env", "secret_env", "max_per_minute"))
            kind = spec.get("type")
            if kind not in CHANNEL_TYPES:
                raise self.fail((*path, "type"), f"expected type: slack or type: webhook, got {_show(kind)}")
            limit = spec.get("max_per_minute", DEFAULT_MAX_PER_MINUTE)
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise self.fail(
                    (*path, "max_per_minute"), f"expected a whole number >= 1, got {_show(limit)}"
                )
            if self.only_channel in (None, name):
                url, secret = self.endpoint(spec, path, kind)
            else:
                url, secret = "", None  # not the channel under test: its secrets are not read
            out[name] = Channel(name, kind, url, secret, limit, self.lines.get(path, 0))
        return out

    def endpoint(
        self, spec: dict[str, Any], path: tuple[str | int, ...], kind: str
    ) -> tuple[str, bytes | None]:
        if kind == "slack":
            if "url" in spec:
                raise self.fail(
                    (*path, "url"),
                    "a Slack incoming-webhook URL is a secret: put it in an environment variable and name "
                    "the variable with url_env: (e.g. url_env: STEPWATCH_SLACK_URL)",
                )
            if "secret_env" in spec:
                raise self.fail((*path, "secret_env"), "Slack messages are not signed: remove secret_env")
        if ("url" in spec) == ("url_env" in spec):
            raise self.fail(path, "give the endpoint as url: https://... or url_env: VARIABLE (one of them)")
        if "url" in spec:
            url = self.url(spec["url"], (*path, "url"), "the receiver's URL")
        else:
            url = self.url(self.secret(spec, (*path, "url_env"), "URL"), (*path, "url_env"), "its value")
        if kind == "slack":
            return url, None
        if "secret_env" not in spec:
            raise self.fail(
                path,
                "a webhook channel signs its messages: add secret_env: VARIABLE naming an environment variable "
                "that holds the shared secret",
            )
        return url, self.secret(spec, (*path, "secret_env"), "signing secret").encode()

    def secret(self, spec: dict[str, Any], path: tuple[str | int, ...], what: str) -> str:
        name = spec[str(path[-1])]
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise self.fail(path, f"expected the name of an environment variable, got {_show(name)}")
        value = self.env.get(name, "")
        if not value:
            raise self.fail(
                path,
                f"environment variable {name} (the {what}) is not set or empty; export it before starting",
            )
        return value

    def url(self, value: Any, path: tuple[str | int, ...], what: str) -> str:
        parts = urllib.parse.urlsplit(value) if isinstance(value, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            shown = "a value that is not an http(s) URL" if path[-1] == "url_env" else _show(value)
            raise self.fail(path, f"{what} must be an http:// or https:// URL with a host, got {shown}")
        return str(value)

    def routes(self, value: Any, channels: dict[str, Channel]) -> tuple[Route, ...]:
        if not isinstance(value, list) or not value:
            raise self.fail(("routes",), "expected a list of routes (- match: {...}, channels: [...])")
        out = []
        for i, spec in enumerate(value):
            path: tuple[str | int, ...] = ("routes", i)
            spec = self.mapping(spec, path, ("match", "channels"))
            if "channels" not in spec:
                raise self.fail(
                    path, f"a route needs channels: [...]; the channels are {', '.join(channels)}"
                )
            names = self.names(spec["channels"], (*path, "channels"), None)
            for j, name in enumerate(names):
                if name not in channels:
                    at = (*path, "channels") if isinstance(spec["channels"], str) else (*path, "channels", j)
                    raise self.fail(
                        at,
                        f"unknown channel {name!r}; define it under channels: or use one of {', '.join(channels)}",
                    )
            out.append(
                Route(self.match(spec.get("match", {}), (*path, "match")), names, self.lines.get(path, 0))
            )
        return tuple(out)

    def match(self, value: Any, path: tuple[str | int, ...]) -> Match:
        spec = self.mapping(value or {}, path, ("kind", "severity", "min_severity", "run"))
        kinds = self.names(spec["kind"], (*path, "kind"), KINDS) if "kind" in spec else None
        sevs = self.names(spec["severity"], (*path, "severity"), SEVERITIES) if "severity" in spec else None
        low = spec.get("min_severity")
        if low is not None and low not in SEVERITIES:
            raise self.fail(
                (*path, "min_severity"), f"expected one of {', '.join(SEVERITIES)}, got {_show(low)}"
            )
        runs = self.names(spec["run"], (*path, "run"), None) if "run" in spec else None
        return Match(
            kinds=frozenset(kinds) if kinds else None,
            severities=frozenset(sevs) if sevs else None,
            min_severity=low,
            runs=runs,
        )


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return "nothing" if value is None else repr(value)
