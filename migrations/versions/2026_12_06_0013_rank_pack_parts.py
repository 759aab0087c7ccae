"""Rank rollup packs in parts: `rank_rollup_packs.part` joins the key, and a pack over
rank_packs.PART_BYTES (~1.3 KB) is stored as a few parts of consecutive ranks (stepwatch_server/runs/
rank_packs.py), three to a SQLite page where a pack of 256 ranks (~2.3 KB) took a page of its own. The
packs written before are cut into parts here, one series and level at a time (the packs are ~1/30 of the
values they sum: seconds); a downgrade joins them again.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06 22:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import sqlalchemy as sa
from alembic import op

from stepwatch_server.runs import rank_packs

revision: str = '0013'
down_revision: str | None = '0012'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KEY = ['series_id', 'level', 'bucket', 'incarnation']


def _levels(conn: sa.Connection) -> list[tuple[int, int]]:
    found = conn.execute(sa.text('SELECT DISTINCT series_id, level FROM rank_rollup_packs ORDER BY 1, 2'))
    return [(int(sid), int(level)) for sid, level in found]


def _take(conn: sa.Connection, sid: int, level: int) -> list[np.ndarray]:
    """The figures of one series and level, one row per rank (rank_packs.unpack), its packs deleted."""
    where = 'WHERE series_id = :sid AND level = :level'
    params = {'sid': sid, 'level': level}
    found = conn.execute(
        sa.text(f'SELECT series_id, bucket, incarnation, data FROM rank_rollup_packs {where}'), params
    ).all()
    conn.execute(sa.text(f'DELETE FROM rank_rollup_packs {where}'), params)
    return rank_packs.unpack(found)


def upgrade() -> None:
    with op.batch_alter_table('rank_rollup_packs', recreate='always') as batch:
        batch.add_column(sa.Column('part', sa.Integer(), autoincrement=False, nullable=False, server_default='0'))
        batch.drop_constraint('pk_rank_rollup_packs', type_='primary')
        batch.create_primary_key('pk_rank_rollup_packs', [*KEY, 'part'])
    with op.batch_alter_table('rank_rollup_packs') as batch:
        batch.alter_column('part', server_default=None)
    conn = op.get_bind()
    for sid, level in _levels(conn):
        _insert(conn, rank_packs.rows(level, _take(conn, sid, level)), ':part')


def _insert(conn: sa.Connection, rows: list[dict[str, object]], part: str) -> None:
    """Insert `rank_packs.rows` into this revision's table (`part`: its value), their later columns left out."""
    if rows:
        conn.execute(
            sa.text(
                'INSERT INTO rank_rollup_packs (series_id, level, bucket, incarnation, part, ranks, data) '
                f'VALUES (:series_id, :level, :bucket, :incarnation, {part}, :ranks, :data)'
            ).bindparams(sa.bindparam('data', type_=sa.LargeBinary())),
            rows,
        )


def downgrade() -> None:
    conn = op.get_bind()
    for sid, level in _levels(conn):
        _insert(conn, rank_packs.rows(level, _take(conn, sid, level), parts=False), '0')
    with op.batch_alter_table('rank_rollup_packs', recreate='always') as batch:
        batch.drop_constraint('pk_rank_rollup_packs', type_='primary')
        batch.create_primary_key('pk_rank_rollup_packs', KEY)
        batch.drop_column('part')
