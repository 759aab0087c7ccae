"""Checks on every request's query and path parameters, before any route reads them.

PostgreSQL cannot store or compare a string holding NUL (U+0000): a parameter with one would reach the
database as an error (500). Ingest refuses NUL in a batch (ingest/validate.py); this refuses it in the
parameters of every route, in one place (an app-wide dependency).
"""

from __future__ import annotations

from fastapi import Request

from stepwatch_server.errors import InvalidParameter


def no_nul_in_parameters(request: Request) -> None:
    for name, value in (*request.query_params.multi_items(), *request.path_params.items()):
        if "\x00" in str(value):
            raise InvalidParameter(
                f"{name}: holds a NUL character (U+0000), which no name or value may", field=name
            )
