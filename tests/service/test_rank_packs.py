"""The rank rollups' packed rows (runs/rank_packs.py): a pack gives back every rank's figures bit for bit,
a bucket's ranks are held by one pack (in parts where it is big), migration 0010 moves the rows of a
database of the earlier layout into packs, 0013 cuts big packs into parts (and both back, on a
downgrade) without changing a figure, and 0014 stores each pack's peaks beside it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
from alembic import command
from sqlalchemy import inspect, text

from stepwatch_server.runs import rank_packs
from stepwatch_server.storage import codec, make_engine, upgrade
from stepwatch_server.storage.migrate import alembic_config
from tests.service.conftest import two_series


def _bits(cols: list[np.ndarray]) -> list[list[int]]:
    """Each column as the integers of its words: NaN and -0.0 compared bit for bit."""
    return [c.astype(np.int64).tolist() if c.dtype.kind == "i" else c.view(np.uint64).tolist() for c in cols]


def _figures(rng: np.random.Generator, size: int) -> list[np.ndarray]:
    """n, total, lo, hi, nonfinite of `size` ranks: float32 extremes and float64 sums, some ranks with
    no finite value (NaN extremes, zero sum), -0.0, subnormals and the largest doubles among them."""
    n = rng.integers(0, 4096, size)
    lo = rng.normal(0, 3, size).astype(np.float32).astype(np.float64)
    hi = lo + np.abs(rng.normal(0, 1, size))  # float64: not float32-exact
    total = rng.normal(0, 1e6, size)
    total[: min(size, 3)] = [-0.0, 5e-324, 1.7976931348623157e308][: min(size, 3)]
    empty = n == 0
    lo[empty], hi[empty], total[empty] = np.nan, np.nan, 0.0
    return [n, total, lo, hi, rng.integers(0, 3, size) * (rng.random(size) < 0.1)]


def test_a_pack_gives_back_every_figure_bit_for_bit() -> None:
    rng = np.random.default_rng(7)
    for size in (1, 2, 257, 4096):
        ranks = np.sort(rng.choice(20_000, size, replace=False))
        figures = _figures(rng, size)
        got_ranks, got = rank_packs.decode(rank_packs.encode(ranks, figures))
        assert got_ranks.tolist() == ranks.tolist()
        assert _bits(got) == _bits([figures[0].astype(np.int64), *figures[1:4], figures[4].astype(np.int64)])
        for some in (("n", "total"), ("n", "hi"), ("nonfinite",)):  # a view reads the figures it shows
            ((got_ranks, got),) = rank_packs.decode_many([rank_packs.encode(ranks, figures)], some)
            assert got_ranks.tolist() == ranks.tolist()
            for name, column, sent in zip(rank_packs.FIGURES, got, figures, strict=True):
                if name in some:
                    assert _bits([column]) == _bits([sent.astype(column.dtype)])
                else:  # not read: NaN
                    assert column.dtype == np.float64 and np.isnan(column).all() and column.size == size
    with pytest.raises(codec.CorruptBlock):
        rank_packs.decode(b"not a pack")
    with pytest.raises(ValueError, match="figures: 'mean' is not one of n, total, lo, hi, nonfinite"):
        rank_packs.decode_many([rank_packs.encode(np.arange(2), _figures(rng, 2))], ("n", "mean"))
    with pytest.raises(ValueError, match="figures: none asked for; name at least one of n, total"):
        rank_packs.decode_many([rank_packs.encode(np.arange(2), _figures(rng, 2))], ())
    block = codec.Block(np.arange(3), np.arange(2), np.zeros((2, 3)), np.ones((2, 3), dtype=bool))
    with pytest.raises(codec.CorruptBlock, match="2 rows, expected 5"):
        rank_packs.decode(codec.encode(block))  # a value block, not a pack
    with pytest.raises(codec.CorruptBlock, match="2 rows, expected 5"):
        rank_packs.decode_many([codec.encode(block)], ("n",))
    present = np.ones((5, 3), dtype=bool)
    present[2, 1] = False
    holed = codec.Block(np.arange(3), np.arange(5), np.zeros((5, 3)), present)
    for some in (rank_packs.FIGURES, ("lo",)):
        with pytest.raises(codec.CorruptBlock, match="a rank without all of its figures"):
            rank_packs.decode_many(
                [rank_packs.encode(np.arange(2), _figures(rng, 2)), codec.encode(holed)], some
            )


def test_packs_are_written_per_bucket_and_read_back_per_rank(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        upgrade(engine)
        with engine.begin() as conn:
            sids = two_series(conn)
            cols = _rank_rows(sids)
            rank_packs.write(conn, 3, cols)
            rank_packs.write(conn, 4, rank_packs.combine(cols, 2))
        with engine.connect() as conn:
            stored = conn.execute(
                text(
                    "SELECT series_id, bucket, incarnation, part, ranks, length(data) FROM rank_rollup_packs "
                    "WHERE level = 3"
                )
            ).all()
            ranks_in = Counter(zip(*(cols[k].tolist() for k in (0, 2, 3)), strict=True))
            parts: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
            for sid, bucket, inc, part, ranks, size in stored:
                parts.setdefault((sid, bucket, inc), []).append((part, ranks, size))
            assert set(parts) == set(ranks_in)  # each (series, bucket, incarnation): one pack
            for key, held in parts.items():  # whole where it is small, else in parts of about PART_BYTES
                assert sorted(p for p, _, _ in held) == list(range(len(held)))
                assert sum(r for _, r, _ in held) == ranks_in[key]
                assert len(held) == 1 if ranks_in[key] == 10 else len(held) > 1
                assert all(size <= 1.25 * rank_packs.PART_BYTES for _, _, size in held)
            assert _bits(rank_packs.read(conn, sids, 3, 0, None)) == _bits(rank_packs.combine(cols))
            some = rank_packs.read(conn, sids, 3, 0, None, ("n", "hi"))  # the figures read; the others NaN
            whole = rank_packs.combine(cols)
            assert _bits([some[i] for i in (0, 1, 2, 3, 4, 7)]) == _bits(
                [whole[i] for i in (0, 1, 2, 3, 4, 7)]
            )
            assert all(np.isnan(some[i]).all() and some[i].size == whole[i].size for i in (5, 6, 8))
            coarse = rank_packs.read(conn, sids, 4, 5, 5)  # bucket 5 of level 4: level 3's 10 and 11
            assert _by_key(coarse) == _summed(cols, lambda bucket: bucket // 2 == 5)
            # The peaks stored beside each pack (or part): its ranks' highest maximum and non-finite values.
            for sid, bucket, inc, part, high, bad, data in conn.execute(
                text(
                    "SELECT series_id, bucket, incarnation, part, hi, nonfinite, data FROM rank_rollup_packs "
                    "WHERE level = 3"
                )
            ):
                _, (_, _, _, his, bads) = rank_packs.decode(bytes(data))
                assert bad == bads.sum() and high == np.fmax.reduce(his), (sid, bucket, inc, part)
            pieces = [(3, 0, 5), (4, 5, 5)]  # level 3's buckets 0-5, and 10-11 as level 4's bucket 5
            series, highest, nonfinite = rank_packs.peaks(conn, sids, pieces)
            assert sorted(set(series.tolist())) == sorted(sids) and series.size == 2 * len(
                sids
            )  # a row a piece
            expected = _peaks(cols, lambda bucket: bucket <= 5 or bucket >= 10)
            assert _per_series(series, highest, nonfinite) == expected
        with engine.begin() as conn:  # a pack of ranks that had no finite value: no highest maximum
            nothing = [c[cols[2] == 0] for c in cols]
            nothing[4][:], nothing[5][:], nothing[6][:], nothing[7][:] = 0, 0.0, np.nan, np.nan
            rank_packs.write(conn, 6, nothing)
        with engine.connect() as conn:
            assert {
                tuple(r) for r in conn.execute(text("SELECT hi FROM rank_rollup_packs WHERE level = 6"))
            } == {(None,)}
            series, highest, nonfinite = rank_packs.peaks(conn, sids, [(6, 0, 0)])
            assert np.isnan(highest).all() and dict(
                zip(series.tolist(), nonfinite.tolist(), strict=True)
            ) == {sid: int(nothing[8][nothing[0] == sid].sum()) for sid in sids}
        with engine.begin() as conn:
            rank_packs.remove(conn, sids[:1], 3, 0, 11)
        with engine.connect() as conn:
            left = rank_packs.read(conn, sids, 3, 0, None)
            assert not ((left[0] == sids[0]) & (left[2] < 11)).any()
            assert ((left[0] == sids[0]) & (left[2] == 11)).any() and (left[0] == sids[1]).sum() == (
                cols[0] == sids[1]
            ).sum()
    finally:
        engine.dispose()


def test_the_migration_moves_rank_rollup_rows_into_packs_and_back(database_url: str) -> None:
    """Rows of the earlier layout (0009), NULL extremes and a restart's second incarnation among them,
    read back the same from the packs after the upgrade, and as the same rows after a downgrade."""
    engine = make_engine(database_url)
    columns = "series_id, rank, bucket, incarnation, n, total, lo, hi, nonfinite"
    try:
        upgrade(engine, "0009")
        with engine.begin() as conn:
            sids = two_series(conn)
            cols = _rank_rows(sids)
            cols[5] = cols[5] + 0.0  # -0.0 -> 0.0: SQLite's REAL keeps no sign of zero
            rows = [
                dict(zip(columns.split(", "), row, strict=True)) | {"level": level}
                for level in (0, 2)
                for row in zip(*(c.tolist() for c in cols), strict=True)
            ]
            for row in rows:
                row["lo"] = None if np.isnan(row["lo"]) else row["lo"]
                row["hi"] = None if np.isnan(row["hi"]) else row["hi"]
            conn.execute(
                text(
                    f"INSERT INTO rank_rollups (level, {columns}) VALUES (:level, :series_id, :rank, :bucket, "
                    ":incarnation, :n, :total, :lo, :hi, :nonfinite)"
                ),
                rows,
            )
        upgrade(engine)
        expected = _bits(rank_packs.combine(cols))  # sorted by (series, rank, bucket, incarnation)
        with engine.connect() as conn:
            assert "rank_rollups" not in inspect(conn).get_table_names()
            for level in (0, 2):
                assert _bits(rank_packs.read(conn, sids, level, 0, None)) == expected
        with engine.connect() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0009")
            conn.commit()
            got = conn.execute(
                text(
                    f"SELECT {columns} FROM rank_rollups WHERE level = 2 ORDER BY series_id, rank, bucket, incarnation"
                )
            ).all()
        back = [
            np.array([r[i] for r in got], dtype=np.float64 if i in (5, 6, 7) else np.int64) for i in range(9)
        ]
        assert _bits(back) == expected
    finally:
        engine.dispose()


def test_the_migration_cuts_whole_packs_into_parts_and_joins_them_again(database_url: str) -> None:
    """Packs written whole (0012) read back the same once 0013 cut the big ones into parts, and as whole
    packs again, one row per (series, level, bucket, incarnation), after a downgrade."""
    engine = make_engine(database_url)
    columns = "series_id, level, bucket, incarnation, ranks, data"
    try:
        upgrade(engine, "0012")
        with engine.begin() as conn:
            sids = two_series(conn)
            cols = _rank_rows(sids)
            rows = [*rank_packs.rows(0, cols, parts=False), *rank_packs.rows(2, cols, parts=False)]
            conn.execute(
                text(f"INSERT INTO rank_rollup_packs ({columns}) VALUES (:{columns.replace(', ', ', :')})"),
                rows,
            )
        upgrade(engine)
        expected = _bits(rank_packs.combine(cols))
        with engine.connect() as conn:
            for level in (0, 2):
                assert _bits(rank_packs.read(conn, sids, level, 0, None)) == expected
            assert conn.execute(text("SELECT max(part) FROM rank_rollup_packs")).scalar_one() > 0
        with engine.connect() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0012")
            conn.commit()
            back = conn.execute(text(f"SELECT {columns} FROM rank_rollup_packs")).all()
            assert "part" not in {c["name"] for c in inspect(conn).get_columns("rank_rollup_packs")}
        assert sorted((r[0], r[1], r[2], r[3], r[4]) for r in back) == sorted(
            (r["series_id"], r["level"], r["bucket"], r["incarnation"], r["ranks"]) for r in rows
        )
        for level in (0, 2):
            found = [(r[0], r[2], r[3], r[5]) for r in back if r[1] == level]
            assert _bits(rank_packs.unpack(found)) == expected
    finally:
        engine.dispose()


def test_the_migration_stores_each_packs_peaks_beside_it(database_url: str) -> None:
    """Packs written without their peaks (0013) have them once 0014 ran: each part's highest maximum and
    non-finite values, as `rows` writes them now, read by `peaks`; a downgrade drops the two columns and
    leaves the packs as they were."""
    engine = make_engine(database_url)
    columns = "series_id, level, bucket, incarnation, part, ranks, data"
    try:
        upgrade(engine, "0013")
        with engine.begin() as conn:
            sids = two_series(conn)
            cols = _rank_rows(sids)
            rows = [*rank_packs.rows(0, cols), *rank_packs.rows(2, cols)]
            conn.execute(
                text(f"INSERT INTO rank_rollup_packs ({columns}) VALUES (:{columns.replace(', ', ', :')})"),
                rows,
            )
        upgrade(engine)
        key = ("series_id", "level", "bucket", "incarnation", "part")
        with engine.connect() as conn:
            got = conn.execute(text(f"SELECT {', '.join(key)}, hi, nonfinite FROM rank_rollup_packs")).all()
            assert sorted(tuple(r) for r in got) == sorted(
                (*(r[k] for k in key), r["hi"], r["nonfinite"]) for r in rows
            )
            assert any(r["part"] for r in rows) and all(r["hi"] is not None for r in rows)
            series, highest, nonfinite = rank_packs.peaks(conn, sids, [(0, 3, 11)])
            expected = _peaks(cols, lambda bucket: bucket >= 3)
            assert _per_series(series, highest, nonfinite) == expected
        with engine.connect() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0013")
            conn.commit()
            assert {c["name"] for c in inspect(conn).get_columns("rank_rollup_packs")} == set(
                columns.split(", ")
            )
            back = conn.execute(text(f"SELECT {columns} FROM rank_rollup_packs")).all()
        assert sorted((*r[:6], bytes(r[6])) for r in back) == sorted(
            tuple(r[c] for c in columns.split(", ")) for r in rows
        )
    finally:
        engine.dispose()


def _per_series(
    series: np.ndarray, highest: np.ndarray, nonfinite: np.ndarray
) -> dict[int, tuple[float, int]]:
    """`peaks`' rows (a series once a piece) folded per series: the highest maximum (NaN where none), the sum."""
    out: dict[int, tuple[float, int]] = {}
    for s, h, b in zip(series.tolist(), highest.tolist(), nonfinite.tolist(), strict=True):
        was_h, was_b = out.get(s, (float("nan"), 0))
        out[s] = (float(np.fmax(was_h, h)), was_b + b)
    return out


def _peaks(cols: list[np.ndarray], take: Callable[[int], bool]) -> dict[int, tuple[float, int]]:
    """Per series, over the rows whose bucket `take` accepts, in plain Python: the highest maximum of the
    finite ones (NaN where none) and the non-finite values."""
    out: dict[int, list[float]] = {}
    for sid, _, bucket, _, _, _, _, hi, bad in zip(*(c.tolist() for c in cols), strict=True):
        if take(bucket):
            got = out.setdefault(sid, [float("-inf"), 0])
            got[0] = max(got[0], hi) if hi == hi else got[0]
            got[1] += bad
    return {sid: (hi if hi > float("-inf") else float("nan"), int(bad)) for sid, (hi, bad) in out.items()}


def _rank_rows(sids: list[int]) -> list[np.ndarray]:
    """Figures per (series, rank, bucket, incarnation), unsorted: 12 buckets of ranks 0..299 but rank 7
    (it sent nothing), and a second incarnation of ranks 0..9 in bucket 11 (a restart)."""
    rng = np.random.default_rng(3)
    keys = [
        (sid, rank, bucket, 1) for sid in sids for bucket in range(12) for rank in range(300) if rank != 7
    ] + [(sid, rank, 11, 2) for sid in sids for rank in range(10)]
    order = rng.permutation(len(keys))
    key_cols = [np.array([keys[i][k] for i in order], dtype=np.int64) for k in range(4)]
    figures = _figures(rng, len(keys))
    return [*key_cols, figures[0].astype(np.int64), *figures[1:4], figures[4].astype(np.int64)]


def _by_key(cols: list[np.ndarray]) -> dict[tuple[int, ...], tuple[float, ...]]:
    """(series, rank, bucket, incarnation) -> the five figures, NaN as None."""
    rows = zip(*(c.tolist() for c in cols), strict=True)
    return {tuple(r[:4]): tuple(None if v != v else v for v in r[4:]) for r in rows}


def _summed(cols: list[np.ndarray], take: Callable[[int], bool]) -> dict[tuple[int, ...], tuple[float, ...]]:
    """The figures of the rows whose bucket `take` accepts, summed per (series, rank, bucket // 2, incarnation)
    in plain Python: counts and sums added, the lowest minimum and highest maximum of the finite ones."""
    out: dict[tuple[int, ...], list[float | None]] = {}
    for sid, rank, bucket, inc, n, total, lo, hi, bad in zip(*(c.tolist() for c in cols), strict=True):
        if not take(bucket):
            continue
        got = out.setdefault((sid, rank, bucket // 2, inc), [0, 0.0, None, None, 0])
        got[0] += n
        got[1] += total
        got[4] += bad
        if lo == lo:  # not NaN: the bucket had a finite value
            got[2] = lo if got[2] is None else min(got[2], lo)
            got[3] = hi if got[3] is None else max(got[3], hi)
    return {k: tuple(v) for k, v in out.items()}
