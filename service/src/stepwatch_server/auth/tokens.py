"""The tokens file (`--tokens-file`, STEPWATCH_TOKENS_FILE): who may write and read which runs.

```yaml
tokens:
  - name: team-a-training        # shown in messages and logs; the token itself never is
    token_env: STEPWATCH_TOKEN_TEAM_A   # the secret, read from this environment variable
    scope: write                 # write (implies read of the same runs) or read
    runs: ["team-a/*"]           # run names, or prefixes ending in '*'; default every run ("*")
```

Secrets stay out of the file, as in the alerts configuration: each token is read from the
environment variable the entry names, and must be at least `MIN_TOKEN_CHARS` long. Every problem is
a `TokensConfigError` (a ValueError) naming the file, the line, the entry's field and the fix, so the
collector refuses to start with a file it cannot trust.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from stepwatch_server.alerts._yaml import load_file, located

MIN_TOKEN_CHARS = 16
SCOPES = ("read", "write")
ENTRY_FIELDS = ("name", "token_env", "scope", "runs")
LEGACY_NAME = "STEPWATCH_TOKEN"  # the single `--token`: writes and reads every run
_NAME = re.compile(r"^[A-Za-z0-9_.@:/+-]{1,100}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PATTERN = re.compile(r"^[A-Za-z0-9._:/@+-]{0,200}\*?$")  # a run name's characters, then an optional '*'
Path_ = tuple[str | int, ...]


class TokensConfigError(ValueError):
    """A problem with the tokens configuration: the file, line, field and fix are in the message."""


@dataclass(frozen=True)
class RunPatterns:
    """Run names and prefixes (`team-a/*`); `*` alone is every run."""

    patterns: tuple[str, ...] = ("*",)

    @property
    def every_run(self) -> bool:
        return "*" in self.patterns

    def match(self, run: str) -> bool:
        return any(run.startswith(p[:-1]) if p.endswith("*") else run == p for p in self.patterns)

    def __str__(self) -> str:
        return ", ".join(self.patterns)


@dataclass(frozen=True)
class Grant:
    """One token and what it may do. `repr` leaves the secret out."""

    name: str
    token: str = field(repr=False)
    scope: Literal["read", "write"]
    runs: RunPatterns = RunPatterns()

    def reads(self, run: str) -> bool:
        return self.runs.match(run)  # a write token reads the runs it writes

    def writes(self, run: str) -> bool:
        return self.scope == "write" and self.runs.match(run)


def legacy_grant(token: str) -> Grant:
    """`--token` / STEPWATCH_TOKEN as before scoped tokens: it writes (and reads) every run."""
    return Grant(LEGACY_NAME, token, "write")


def load_tokens(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> tuple[Grant, ...]:
    """Read and check the tokens file at `path`; the secrets come from `env` (default: os.environ)."""
    fix = "pass an existing file to --tokens-file or STEPWATCH_TOKENS_FILE (README, 'Security and limits')"
    doc, lines = load_file(path, "tokens file", fix, TokensConfigError)
    return _Reader(str(path), lines, os.environ if env is None else env).grants(doc)


def check_distinct(grants: tuple[Grant, ...]) -> None:
    """TokensConfigError when two grants share a token (which one would apply?), naming both."""
    seen: dict[str, str] = {}
    for grant in grants:
        other = seen.setdefault(grant.token, grant.name)
        if other != grant.name:
            raise TokensConfigError(
                f"token {grant.name!r} is the same token as {other!r}: give every token its own secret"
            )


class _Reader:
    def __init__(self, source: str, lines: dict[Path_, int], env: Mapping[str, str]) -> None:
        self.source, self.lines, self.env = source, lines, env

    def fail(self, path: Path_, problem: str) -> TokensConfigError:
        return TokensConfigError(located(self.source, self.lines, path, problem))

    def grants(self, doc: Any) -> tuple[Grant, ...]:
        if not isinstance(doc, dict) or set(doc) != {"tokens"}:
            raise self.fail((), "expected one key, 'tokens', holding a list of tokens")
        entries = doc["tokens"]
        if not isinstance(entries, list) or not entries:
            raise self.fail(
                ("tokens",), "expected a list of at least one token (name, token_env, scope, runs)"
            )
        grants: list[Grant] = []
        by_token: dict[str, str] = {}
        for i, entry in enumerate(entries):
            grant = self.grant(entry, ("tokens", i))
            if any(g.name == grant.name for g in grants):
                raise self.fail(("tokens", i, "name"), f"{grant.name!r} is used twice: names must be unique")
            other = by_token.setdefault(grant.token, grant.name)
            if other != grant.name:
                raise self.fail(
                    ("tokens", i, "token_env"),
                    f"the same token as {other!r}: give every token its own secret",
                )
            grants.append(grant)
        return tuple(grants)

    def grant(self, entry: Any, path: Path_) -> Grant:
        if not isinstance(entry, dict):
            raise self.fail(path, f"expected a mapping of {', '.join(ENTRY_FIELDS)}")
        for key in entry:
            if key not in ENTRY_FIELDS:
                raise self.fail((*path, key), f"unknown field {key!r}; a token has {', '.join(ENTRY_FIELDS)}")
        name = entry.get("name")
        if not isinstance(name, str) or _NAME.fullmatch(name) is None:
            raise self.fail((*path, "name"), "expected a name of 1-100 characters of A-Za-z0-9_.@:/+-")
        scope = entry.get("scope")
        if scope not in SCOPES:
            raise self.fail((*path, "scope"), f"expected read or write, got {scope!r}")
        return Grant(
            name, self.secret(entry.get("token_env"), (*path, "token_env")), scope, self.runs(entry, path)
        )

    def secret(self, env_name: Any, path: Path_) -> str:
        if not isinstance(env_name, str) or _ENV_NAME.fullmatch(env_name) is None:
            raise self.fail(
                path, "expected token_env, the name of the environment variable that holds the token"
            )
        token = self.env.get(env_name, "").strip()
        if not token:
            raise self.fail(
                path, f"the environment variable {env_name} is not set (or empty): set it to the token"
            )
        if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
            raise self.fail(
                path,
                f"the token in {env_name} is {len(token)} characters: use at least {MIN_TOKEN_CHARS}, no "
                "spaces (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')",
            )
        return token

    def runs(self, entry: dict[str, Any], path: Path_) -> RunPatterns:
        value = entry.get("runs", ["*"])
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items:
            raise self.fail((*path, "runs"), "expected at least one run name or prefix ('team-a/*', or '*')")
        for i, item in enumerate(items):
            if not isinstance(item, str) or not item or _PATTERN.fullmatch(item) is None:
                shown = item if isinstance(item, str) else type(item).__name__
                where = (*path, "runs") if isinstance(value, str) else (*path, "runs", i)
                raise self.fail(
                    where,
                    f"{shown!r} is not a run name or prefix: use run-name characters (A-Za-z0-9._:/@+-), "
                    "with '*' only at the end ('team-a/*', or '*' for every run)",
                )
        return RunPatterns(tuple(items))
