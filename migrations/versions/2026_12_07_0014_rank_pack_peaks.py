"""Each rank rollup pack's peaks beside it: `rank_rollup_packs.hi`, the highest maximum of its ranks (NULL
where none had a finite value), and `nonfinite`, their non-finite values (stepwatch_server/runs/rank_packs.py
`rows`), so that the run page's amax panel ranks hundreds of modules without decoding thousands of packs.
The packs written before get theirs here, decoded one series and level at a time (the packs are ~1/30 of the
values they sum: seconds); a downgrade drops the two columns.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07 21:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import sqlalchemy as sa
from alembic import op

from stepwatch_server.runs import rank_packs

revision: str = '0014'
down_revision: str | None = '0013'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KEY = ('series_id', 'level', 'bucket', 'incarnation', 'part')


def _peaks(conn: sa.Connection, sid: int, level: int) -> list[dict[str, object]]:
    """The key, `hi` and `nonfinite` of each pack (or part) of one series and level."""
    found = conn.execute(
        sa.text(f'SELECT {", ".join(KEY)}, data FROM rank_rollup_packs WHERE series_id = :sid AND level = :level'),
        {'sid': sid, 'level': level},
    ).all()
    if not found:
        return []
    _, sizes, columns = rank_packs.decode_columns([bytes(row[-1]) for row in found], ('hi', 'nonfinite'))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()  # every pack holds a rank at least
    return [
        {**dict(zip(KEY, row[:-1], strict=True)), 'hi': high, 'nonfinite': bad}
        for row, high, bad in zip(found, *rank_packs.stored_peaks(columns, starts), strict=True)
    ]


def upgrade() -> None:
    with op.batch_alter_table('rank_rollup_packs') as batch:
        batch.add_column(sa.Column('hi', sa.Double(), nullable=True))
        # NOT NULL with a default from the start: SQLite adds it in place (making it NOT NULL after would copy
        # the table), PostgreSQL without rewriting its rows
        batch.add_column(sa.Column('nonfinite', sa.BigInteger(), nullable=False, server_default='0'))
    conn = op.get_bind()
    levels = conn.execute(sa.text('SELECT DISTINCT series_id, level FROM rank_rollup_packs ORDER BY 1, 2')).all()
    where = ' AND '.join(f'{k} = :{k}' for k in KEY)
    for sid, level in levels:
        rows = _peaks(conn, int(sid), int(level))
        if rows:
            conn.execute(
                sa.text(f'UPDATE rank_rollup_packs SET hi = :hi, nonfinite = :nonfinite WHERE {where}'), rows
            )


def downgrade() -> None:
    with op.batch_alter_table('rank_rollup_packs') as batch:
        batch.drop_column('nonfinite')
        batch.drop_column('hi')
