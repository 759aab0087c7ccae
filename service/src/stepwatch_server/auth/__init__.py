"""Scoped tokens: who may write and read which runs (README, "Security and limits").

`tokens.py` reads and checks the configuration; `access.py` holds the per-request checks, used as
FastAPI dependencies by every route (app.py shows which routers read and which write).
"""

from stepwatch_server.auth.access import (
    COOKIE,
    READ_RESPONSES,
    Policy,
    ReadAccess,
    Reader,
    check_write,
    read_access,
    read_every_run,
    write_access,
)
from stepwatch_server.auth.access import router as router
from stepwatch_server.auth.tokens import Grant, RunPatterns, TokensConfigError, check_distinct, load_tokens

__all__ = [
    "COOKIE",
    "READ_RESPONSES",
    "Grant",
    "Policy",
    "ReadAccess",
    "Reader",
    "RunPatterns",
    "TokensConfigError",
    "check_distinct",
    "check_write",
    "load_tokens",
    "read_access",
    "read_every_run",
    "router",
    "write_access",
]
