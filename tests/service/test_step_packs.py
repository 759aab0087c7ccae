"""The step rollups of compacted steps packed (runs/step_packs.py), on both backends: `pack` moves a range's
`step_rollups` rows into one row per (series, 256-step bucket, incarnation) and every figure reads back bit
for bit, a range's extent is counted as the rows counted it, `unpack` gives the rows back, and migration
0011 packs the rows of the steps a database had already compacted (and unpacks them on a downgrade)."""

from __future__ import annotations

from typing import Any

import numpy as np
from alembic import command
from sqlalchemy import Connection, Engine, insert, inspect, select, text, update

from stepwatch_server.runs import step_packs
from stepwatch_server.storage import make_engine, upgrade
from stepwatch_server.storage.migrate import alembic_config
from stepwatch_server.storage.models import Run, StepRollup, StepRollupPack
from tests.service.conftest import two_series

COLUMNS = ("series_id", "step", "incarnation", "n", "total", "lo", "hi", "nonfinite")


def _rows(sids: list[int]) -> list[dict[str, Any]]:
    """Step rollup rows of steps 0..699 (every 7th step missing), a second incarnation of steps 300..330 in
    the first series (a restart), and steps whose ranks sent no finite value (NULL extremes, non-finite
    counted)."""
    rng = np.random.default_rng(11)
    out = []
    keys = [(sid, step, 1) for sid in sids for step in range(700) if step % 7] + [
        (sids[0], step, 2) for step in range(300, 331)
    ]
    for sid, step, inc in keys:
        lo = float(np.float32(rng.normal(2.0, 0.5)))
        row = {"series_id": sid, "step": step, "incarnation": inc, "n": 8, "nonfinite": 0}
        row |= {"total": float(rng.normal(16.0, 1.0)), "lo": lo, "hi": lo + float(rng.random())}
        if step % 50 == 3:
            row |= {"n": 0, "total": 0.0, "lo": None, "hi": None, "nonfinite": 8}
        out.append(row)
    return out


def _read_rows(conn: Connection, sids: list[int], first: int, last: int) -> list[tuple[Any, ...]]:
    r = StepRollup
    return [
        tuple(row)
        for row in conn.execute(
            select(*(getattr(r, c) for c in COLUMNS))
            .where(r.series_id.in_(sids), r.step >= first, r.step <= last)
            .order_by(r.series_id, r.step, r.incarnation)
        )
    ]


def _as_rows(cols: list[np.ndarray]) -> list[tuple[Any, ...]]:
    """Packed columns as the rows' tuples: NaN extremes as NULL."""
    picked = [cols[0], cols[2], cols[3], *cols[4:]]
    return [
        tuple(None if isinstance(v, float) and v != v else v for v in row)
        for row in zip(*(c.tolist() for c in picked), strict=True)
    ]


def _extent(rows: list[tuple[Any, ...]], first: int, last: int) -> tuple[int, int, int] | None:
    inside = [r for r in rows if first <= r[1] <= last]
    if not inside:
        return None
    return min(r[1] for r in inside), max(r[1] for r in inside), sum(r[3] + r[7] for r in inside)


def test_rows_are_packed_read_counted_and_unpacked_with_every_figure_kept(engine: Engine) -> None:
    with engine.begin() as conn:
        sids = two_series(conn)
        conn.execute(insert(StepRollup), _rows(sids))
    with engine.connect() as conn:
        before = _read_rows(conn, sids, 0, 10_000)
    with engine.begin() as conn:
        written = step_packs.pack(conn, sids, 0, 511)
    with engine.connect() as conn:
        packs = conn.execute(
            select(StepRollupPack.series_id, StepRollupPack.bucket, StepRollupPack.incarnation)
        )
        assert sorted(packs) == sorted(
            [(sids[0], 0, 1), (sids[0], 1, 1), (sids[0], 1, 2), (sids[1], 0, 1), (sids[1], 1, 1)]
        )
        assert written == 5
        assert _read_rows(conn, sids, 0, 511) == []  # moved, not copied
        assert _read_rows(conn, sids, 512, 10_000) == [r for r in before if r[1] >= 512]
        assert _as_rows(step_packs.read(conn, sids, 0, 511)) == [r for r in before if r[1] <= 511]
        assert _as_rows(step_packs.read(conn, sids[1:], 100, 320)) == [
            r for r in before if r[0] == sids[1] and 100 <= r[1] <= 320
        ]
        packed = [r for r in before if r[1] <= 511]
        for first, last in ((0, 10_000), (100, 320), (256, 511), (5, 5), (7, 7), (600, 700)):
            assert step_packs.extent(conn, sids, first, last) == _extent(packed, first, last), (first, last)

    with engine.begin() as conn:  # a late value in bucket 1 of the first series: that pack back to rows
        step_packs.unpack(conn, sids[:1], 300, 300)
    with engine.connect() as conn:
        assert _read_rows(conn, sids, 0, 511) == [r for r in before if r[0] == sids[0] and 256 <= r[1] <= 511]
        left = conn.execute(select(StepRollupPack.series_id, StepRollupPack.bucket)).all()
        assert sorted(left) == sorted([(sids[0], 0), (sids[1], 0), (sids[1], 1)])
    with engine.begin() as conn:  # packed again, the other packs still there
        assert step_packs.pack(conn, sids, 0, 511) == 5  # the range's packs, merged with its rows
    with engine.connect() as conn:
        assert _as_rows(step_packs.read(conn, sids, 0, 511)) == [r for r in before if r[1] <= 511]
        assert _read_rows(conn, sids, 0, 511) == []

    # A row for a step that no pack holds (280: every 7th step was missing), packed over that step alone:
    # the bucket's pack is rewritten with it, every step it held kept.
    late = {"series_id": sids[0], "step": 280, "incarnation": 1, "n": 8, "total": 1.5, "lo": 0.1, "hi": 0.3}
    with engine.begin() as conn:
        conn.execute(insert(StepRollup), [{**late, "nonfinite": 0}])
        assert step_packs.pack(conn, sids[:1], 280, 280) == 2  # bucket 1's packs of incarnations 1 and 2
    with engine.connect() as conn:
        expected = sorted([r for r in before if r[1] <= 511] + [(sids[0], 280, 1, 8, 1.5, 0.1, 0.3, 0)])
        assert sorted(_as_rows(step_packs.read(conn, sids, 0, 511))) == expected
        assert _read_rows(conn, sids, 0, 511) == []


def test_the_migration_packs_the_compacted_steps_rollups_and_unpacks_them_on_a_downgrade(
    database_url: str,
) -> None:
    """A database of the 0010 layout whose run was compacted up to step 255: its step rollup rows of steps
    0..255 become packs, the later ones stay rows; a downgrade gives back every row."""
    engine = make_engine(database_url)
    try:
        upgrade(engine, "0010")
        with engine.begin() as conn:
            sids = two_series(conn)
            conn.execute(insert(StepRollup), _rows(sids))
            conn.execute(update(Run).values(compacted_to=255))
        with engine.connect() as conn:
            before = _read_rows(conn, sids, 0, 10_000)
        upgrade(engine)
        with engine.connect() as conn:
            assert _read_rows(conn, sids, 0, 255) == []
            assert _as_rows(step_packs.read(conn, sids, 0, 255)) == [r for r in before if r[1] <= 255]
            assert _read_rows(conn, sids, 256, 10_000) == [r for r in before if r[1] >= 256]
        with engine.connect() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0010")
            conn.commit()
            assert "step_rollup_packs" not in inspect(conn).get_table_names()
            assert _read_rows(conn, sids, 0, 10_000) == before
            assert conn.execute(text("SELECT count(*) FROM step_rollups")).scalar_one() == len(before)
    finally:
        engine.dispose()
