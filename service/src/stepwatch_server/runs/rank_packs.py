"""How the rank rollups are stored: one row per (series, level, bucket, incarnation) that holds every
rank's figures (`rank_rollup_packs`), not one row per rank.

A row per rank took ~40 bytes on SQLite and ~136 on PostgreSQL (its key and tuple header included): 2.3
and 7.6 bytes per stored value of a 256-rank run, more than the compacted values themselves (issue 17,
bench/README.md "Storage"). A pack is a block of the block codec (storage/codec.py) whose "steps" are
the ranks it holds (increasing) and whose five rows are the figures, in the order of `FIGURES`: counts
as whole numbers, minima and maxima as float32 words when every one is float32-exact (the agent sends
float32 values), sums as float64 words, each row XORed or differenced and split into byte planes under
zstd; a bucket without finite values keeps NaN as its minimum and maximum. Decoding gives back every
figure bit for bit.

The rollup worker (runs/rollups.py) writes a bucket's pack whole, for all of the run's ranks at once,
and replaces it when a late value changes it; reads (runs/rank_rollups.py) decode the packs of a range
into columns, one row per rank again. A pack over PART_BYTES is stored as a few parts of consecutive ranks
instead (`part` 0, 1, ...; `write`), so that SQLite's 4 KB pages hold three of them: a ~2.3 KB pack of 256
ranks took a page of its own, ~40% of it empty (bench/README.md "Storage: the rank rollup packs in
parts").

Columns here are lists of numpy arrays in the order of `COLUMNS`, as the reads use them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from sqlalchemy import Connection, delete, func, insert, select

from stepwatch_server.storage import codec
from stepwatch_server.storage.chunks import chunk_size, chunks
from stepwatch_server.storage.models import RankRollupPack

FIGURES = ("n", "total", "lo", "hi", "nonfinite")
COLUMNS = ("series_id", "rank", "bucket", "incarnation", *FIGURES)
INTEGERS = (0, 1, 2, 3, 4, 8)  # the integer columns of COLUMNS
_COUNTS = tuple(COLUMNS[i] for i in INTEGERS if COLUMNS[i] in FIGURES)  # the figures that are whole numbers
_ROWS = np.arange(len(FIGURES), dtype=np.int64)
_INSERT_ROWS = 1_000  # rows per INSERT: a row is PART_BYTES or so
# A pack over this many bytes is stored in parts of consecutive ranks of about this size: SQLite keeps a row
# of up to ~4 KB in its table's 4 KB pages, and these fit three to a page with their keys; PostgreSQL keeps
# them in its rows (under its ~2 KB TOAST threshold), six to an 8 KB page.
PART_BYTES = 1_280


def encode(rank: np.ndarray, figures: Sequence[np.ndarray]) -> bytes:
    """The pack of one bucket: `rank` increasing, `figures` the five columns of FIGURES (one per rank)."""
    return codec.encode(_block(rank, figures))


def _block(rank: np.ndarray, figures: Sequence[np.ndarray]) -> codec.Block:
    values = np.stack([np.asarray(f, dtype=np.float64) for f in figures])
    present = np.ones(values.shape, dtype=bool)
    return codec.Block(np.asarray(rank, dtype=np.int64), _ROWS, values, present)


def decode(data: bytes) -> tuple[np.ndarray, list[np.ndarray]]:
    """(ranks, the five figure columns) of a pack; codec.CorruptBlock when `data` is not one."""
    return decode_many([data])[0]


def decode_many(
    datas: Sequence[bytes], figures: Sequence[str] = FIGURES
) -> list[tuple[np.ndarray, list[np.ndarray]]]:
    """`decode` of each of `datas`, decoded together (`decode_columns`)."""
    if not datas:
        return []
    ranks, sizes, columns = decode_columns(datas, figures)
    cuts = np.cumsum(sizes)[:-1]
    per_pack = [np.split(c, cuts) for c in columns]
    return [(r, [c[i] for c in per_pack]) for i, r in enumerate(np.split(ranks, cuts))]


def decode_columns(
    datas: Sequence[bytes], figures: Sequence[str] = FIGURES
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """The packs `datas` decoded together (codec.decode_flat) as columns: (every pack's ranks end to end,
    the ranks each pack holds, the five figure columns). Only `figures` are decoded (a heatmap's means
    need the counts and sums, not the extremes: about a third less work); the others come back as NaN.
    codec.CorruptBlock when one of `datas` is not a pack."""
    if not figures:
        raise ValueError(f"figures: none asked for; name at least one of {', '.join(FIGURES)}")
    unknown = [f for f in figures if f not in FIGURES]
    if unknown:
        raise ValueError(f"figures: {unknown[0]!r} is not one of {', '.join(FIGURES)}")
    wanted = np.array(sorted({FIGURES.index(f) for f in figures}), dtype=np.int64)
    flat = codec.decode_flat(datas, wanted)
    if (flat.rows != len(FIGURES)).any():
        rows = int(flat.rows[flat.rows != len(FIGURES)][0])
        raise codec.CorruptBlock(f"rank rollup pack: {rows} rows, expected {len(FIGURES)}")
    if (flat.sizes != wanted.size * flat.width).any():
        raise codec.CorruptBlock("rank rollup pack: a rank without all of its figures")
    first = flat.series == wanted[0]
    columns = []
    for i in range(len(FIGURES)):
        if i not in wanted:
            columns.append(np.full(int(flat.width.sum()), np.nan))
        else:
            column = flat.value[flat.series == i]
            columns.append(column.astype(np.int64) if FIGURES[i] in _COUNTS else column)
    return flat.step[first], flat.width, columns


def unpack_keyed(
    found: Sequence[Sequence[Any]], figures: Sequence[str] = FIGURES
) -> tuple[list[np.ndarray], np.ndarray, list[np.ndarray]]:
    """Rows (*keys, data) of packs, at least one -> (each key column, one entry per rank of each pack; the ranks
    (or steps, for a step rollup pack); the five figure columns, NaN where not in `figures`), pack by pack."""
    ranks, sizes, columns = decode_columns([bytes(row[-1]) for row in found], figures)
    keys = [
        np.repeat(np.array([row[i] for row in found], dtype=np.int64), sizes)
        for i in range(len(found[0]) - 1)
    ]
    return keys, ranks, columns


def group_starts(keys: Sequence[np.ndarray]) -> np.ndarray:
    """The indices where a group begins in rows sorted by the key columns `keys` (non-empty)."""
    change = np.zeros(keys[0].size, dtype=bool)
    change[0] = True
    for k in keys:
        change[1:] |= k[1:] != k[:-1]
    return np.flatnonzero(change)


def empty() -> list[np.ndarray]:
    return [np.zeros(0, dtype=np.int64 if i in INTEGERS else np.float64) for i in range(len(COLUMNS))]


def combine(cols: list[np.ndarray], factor: int = 1) -> list[np.ndarray]:
    """Columns summed per (series, rank, bucket // factor, incarnation): counts and sums added, the lowest
    minimum and the highest maximum kept (NaN where no bucket had a finite value), sorted by that key."""
    sid, rank, bucket, inc = cols[0], cols[1], cols[2] // factor, cols[3]
    if sid.size == 0:
        return empty()
    order = np.lexsort((inc, bucket, rank, sid))
    keys = [k[order] for k in (sid, rank, bucket, inc)]
    starts = group_starts(keys)
    n, total, lo, hi, bad = (c[order] for c in cols[4:])
    with np.errstate(invalid="ignore"):
        return [
            *(k[starts] for k in keys),
            np.add.reduceat(n, starts),
            np.add.reduceat(total, starts),
            np.fmin.reduceat(lo, starts),
            np.fmax.reduceat(hi, starts),
            np.add.reduceat(bad, starts),
        ]


def write(conn: Connection, level: int, cols: list[np.ndarray]) -> None:
    """Insert the packs of `cols` (one row per series, rank, bucket and incarnation, in any order) at
    `level`: one pack per (series, bucket, incarnation), in parts where it is big (`_parts`). The range's
    old packs must be deleted first."""
    found = rows(level, cols)
    for i in range(0, len(found), _INSERT_ROWS):
        conn.execute(insert(RankRollupPack), found[i : i + _INSERT_ROWS])


def rows(level: int, cols: list[np.ndarray], parts: bool = True) -> list[dict[str, Any]]:
    """The `rank_rollup_packs` rows of `write`, each with its ranks' highest maximum (`hi`, None where none
    had a finite value) and non-finite values (`nonfinite`) beside the pack; `parts=False`: each pack whole
    and no `part` (the table of migrations 0010-0012, which ignore `hi` and `nonfinite`)."""
    sid, rank, bucket, inc = cols[:4]
    if sid.size == 0:
        return []
    order = np.lexsort((rank, inc, bucket, sid))
    sid, rank, bucket, inc = sid[order], rank[order], bucket[order], inc[order]
    figures = [c[order] for c in cols[4:]]
    out = []
    starts = []  # each stored row's first rank's row: they follow one another
    for whole in encode_groups([sid, bucket, inc], rank, figures):
        first = whole[0]
        key = {"series_id": int(sid[first]), "level": level, "bucket": int(bucket[first])}
        key["incarnation"] = int(inc[first])
        if not parts:
            out.append({**key, "ranks": whole[1] - first, "data": whole[2]})
            starts.append(first)
            continue
        for part, (a, b, data) in enumerate(_parts(whole, rank, figures)):
            out.append({**key, "part": part, "ranks": b - a, "data": data})
            starts.append(a)
    for row, high, bad in zip(out, *stored_peaks(figures, starts), strict=True):
        row["hi"], row["nonfinite"] = high, bad
    return out


def stored_peaks(
    figures: Sequence[np.ndarray], starts: Sequence[int]
) -> tuple[list[float | None], list[int]]:
    """For packs whose ranks follow one another in the five columns `figures`, each beginning at its entry of
    `starts`: each pack's highest maximum (None where no rank had a finite value) and non-finite values, the
    columns stored beside it (`rows`; migration 0014)."""
    with np.errstate(invalid="ignore"):
        highest = np.fmax.reduceat(figures[FIGURES.index("hi")], starts).tolist()
    nonfinite = np.add.reduceat(figures[FIGURES.index("nonfinite")], starts).tolist()
    return [None if math.isnan(h) else h for h in highest], [int(b) for b in nonfinite]


def _parts(
    pack: tuple[int, int, bytes], rank: np.ndarray, figures: Sequence[np.ndarray]
) -> list[tuple[int, int, bytes]]:
    """A pack (its first row, the row after its last, its bytes) as it is stored: whole up to PART_BYTES,
    else cut into as many parts of consecutive ranks, each encoded alone, as its bytes need."""
    a, b, data = pack
    count = min(b - a, -(-len(data) // PART_BYTES))
    if count <= 1:
        return [pack]
    cuts = list(itertools.pairwise([a + (b - a) * i // count for i in range(count + 1)]))
    made = codec.encode_many([_block(rank[lo:hi], [f[lo:hi] for f in figures]) for lo, hi in cuts])
    return [(lo, hi, data) for (lo, hi), data in zip(cuts, made, strict=True)]


def encode_groups(
    keys: Sequence[np.ndarray], positions: np.ndarray, figures: Sequence[np.ndarray]
) -> list[tuple[int, int, bytes]]:
    """One pack per run of equal `keys` in rows sorted by `keys`, then by `positions` (the ranks, or the
    steps of a step rollup pack): (its first row, the row after its last, its bytes)."""
    starts = group_starts(keys).tolist()
    ends = [*starts[1:], int(positions.size)]
    made = codec.encode_many(
        [_block(positions[a:b], [f[a:b] for f in figures]) for a, b in zip(starts, ends, strict=True)]
    )
    return [(a, b, data) for a, b, data in zip(starts, ends, made, strict=True)]


def remove(conn: Connection, ids: Sequence[int], level: int, lo: int, hi: int) -> None:
    """Delete the packs of series `ids` at `level` for buckets lo..hi-1."""
    p = RankRollupPack
    for part in chunks(sorted(ids), chunk_size(conn, fixed=3)):
        conn.execute(delete(p).where(p.series_id.in_(part), p.level == level, p.bucket >= lo, p.bucket < hi))


def read(
    conn: Connection,
    ids: Sequence[int],
    level: int,
    first: int,
    last: int | None,
    figures: Sequence[str] = FIGURES,
) -> list[np.ndarray]:
    """The figures of series `ids` at `level` in buckets first..last (None: to the end), one row per
    (series, rank, bucket, incarnation), sorted by that key; only `figures` decoded, the others NaN."""
    p = RankRollupPack
    found: list[Any] = []
    for part in chunks(sorted(ids), chunk_size(conn, fixed=3)):
        q = select(p.series_id, p.bucket, p.incarnation, p.data).where(
            p.series_id.in_(part), p.level == level, p.bucket >= first
        )
        if last is not None:
            q = q.where(p.bucket <= last)
        found += conn.execute(q).all()
    return unpack(found, figures)


def peaks(
    conn: Connection, ids: Sequence[int], pieces: Sequence[tuple[int, int, int]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per piece of `pieces` ((level, first bucket, last bucket) each) and series of `ids` with packs there:
    (the series, the highest maximum of their ranks, NaN where none had a finite value; the non-finite values
    they count), unsorted, from the columns stored beside each pack (`rows`): nothing decoded, a row a part
    read (a ranking of hundreds of modules: dashboard/routes.py). A query a piece, so each is a seek into the
    key (one query for all of them, its levels ORed, read every pack of the series on SQLite: 0.39 s at 500
    modules x 100k steps)."""
    p = RankRollupPack
    found: list[Any] = []
    for level, a, b in pieces:
        for part in chunks(sorted(ids), chunk_size(conn, fixed=3)):
            found += conn.execute(
                select(p.series_id, func.max(p.hi), func.sum(p.nonfinite))
                .where(p.series_id.in_(part), p.level == level, p.bucket >= a, p.bucket <= b)
                .group_by(p.series_id)
            ).all()
    series = np.array([row[0] for row in found], dtype=np.int64)
    highest = np.array([np.nan if row[1] is None else row[1] for row in found], dtype=np.float64)
    return series, highest, np.array([row[2] for row in found], dtype=np.int64)


def unpack(found: Sequence[Any], figures: Sequence[str] = FIGURES) -> list[np.ndarray]:
    """Rows of (series_id, bucket, incarnation, data) -> columns, one row per rank, sorted by
    (series, rank, bucket, incarnation); only `figures` decoded, the others NaN."""
    if not found:
        return empty()
    (sid, bucket, inc), rank, columns = unpack_keyed(found, figures)
    cols = [sid, rank, bucket, inc, *columns]
    order = np.lexsort((inc, bucket, rank, sid))
    return [c[order] for c in cols]
