"""Bulk inserts of numpy columns with the driver: no SQLAlchemy, and no Python, per row.

On PostgreSQL a table's rows go in as one `INSERT ... SELECT FROM unnest(arrays)`, each column one
parameter: a binary PostgreSQL array encoded by numpy in one call (`PgArray`). psycopg's own list
dumper encodes element by element in Python (~2.5 us a value: a fifth of ingest's CPU at the agent's
cadence, bench/README.md "Batch rate"). On SQLite the driver's executemany of tuples, built from the
columns by `tolist` and `zip` (C loops).

`BulkInsert` names the table and its columns with their PostgreSQL types; the numpy type of each
column follows from it, so a column given as a list, or as an array of another integer type, is cast
once, and a value that does not fit raises instead of wrapping.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg
from psycopg.adapt import Dumper
from psycopg.pq import Format
from sqlalchemy import Connection

# PostgreSQL type -> (numpy type, the element's type oid, its wire type: big-endian, as arrays are sent)
_TYPES: dict[str, tuple[type[np.generic], int, str]] = {
    "integer": (np.int32, 23, ">i4"),
    "bigint": (np.int64, 20, ">i8"),
    "float8": (np.float64, 701, ">f8"),
}
MAX_ROWS = 100_000  # rows in one statement: bounds the size of its parameters


class PgArray:
    """A 1-D numpy column sent to PostgreSQL as one binary array parameter (`%b`, cast in the SQL)."""

    __slots__ = ("kind", "values")

    def __init__(self, values: np.ndarray, kind: str) -> None:
        self.values = values
        self.kind = kind

    def encode(self) -> bytes:
        """PostgreSQL's binary array format (array_recv): ndim, has-null flag, element oid, then per
        dimension its length and lower bound, then per element its length and bytes. No NULLs."""
        _, oid, wire = _TYPES[self.kind]
        n = self.values.shape[0]
        if n == 0:
            return struct.pack(">iii", 0, 0, oid)
        elements = np.empty(n, dtype=[("size", ">i4"), ("value", wire)])
        elements["size"] = np.dtype(wire).itemsize
        elements["value"] = self.values
        return struct.pack(">iiiii", 1, 0, oid, n, 1) + elements.tobytes()


class _PgArrayDumper(Dumper):
    # No oid: the statement casts each parameter (`%b::integer[]`), which gives the server its type.
    format = Format.BINARY

    def dump(self, obj: PgArray) -> bytes:
        return obj.encode()


psycopg.adapters.register_dumper(PgArray, _PgArrayDumper)


@dataclass(frozen=True)
class BulkInsert:
    """`INSERT INTO table (columns) ... ON CONFLICT DO NOTHING` of whole columns."""

    table: str
    columns: dict[str, str]  # name -> PostgreSQL type, in the table's insert order

    @property
    def postgresql(self) -> str:
        names = ", ".join(self.columns)
        arrays = ", ".join(f"%b::{kind}[]" for kind in self.columns.values())
        return f"INSERT INTO {self.table} ({names}) SELECT * FROM unnest({arrays}) ON CONFLICT DO NOTHING"

    @property
    def sqlite(self) -> str:
        marks = ", ".join("?" for _ in self.columns)
        return f"INSERT INTO {self.table} ({', '.join(self.columns)}) VALUES ({marks}) ON CONFLICT DO NOTHING"

    def typed(self, columns: Sequence[Any]) -> list[np.ndarray]:
        """The columns as numpy arrays of their types; ValueError naming a column that does not fit."""
        if len(columns) != len(self.columns):
            raise ValueError(f"{self.table}: {len(columns)} columns given, {len(self.columns)} expected")
        out = []
        for (name, kind), col in zip(self.columns.items(), columns, strict=True):
            target = _TYPES[kind][0]
            array = np.asarray(col)
            if array.dtype != target:
                if array.dtype.kind in "iu" and array.size:
                    info = np.iinfo(np.dtype(target))
                    if array.min() < info.min or array.max() > info.max:
                        raise ValueError(f"{self.table}.{name}: a value does not fit PostgreSQL {kind}")
                array = array.astype(target)
            out.append(array)
        if len({a.shape for a in out}) > 1:
            raise ValueError(f"{self.table}: columns of different lengths {[a.shape[0] for a in out]}")
        return out

    def run(self, conn: Connection, columns: Sequence[Any]) -> None:
        """Insert the rows these columns make (rows that exist already are skipped)."""
        arrays = self.typed(columns)
        rows = arrays[0].shape[0] if arrays else 0
        for start in range(0, rows, MAX_ROWS):
            part = [a[start : start + MAX_ROWS] for a in arrays]
            if conn.dialect.name == "postgresql":
                params = tuple(PgArray(a, kind) for a, kind in zip(part, self.columns.values(), strict=True))
                conn.exec_driver_sql(self.postgresql, params)
            else:
                conn.exec_driver_sql(self.sqlite, list(zip(*(a.tolist() for a in part), strict=True)))
