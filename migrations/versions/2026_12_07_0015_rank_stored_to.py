"""Each rank's highest stored step: `ranks.stored_to`, the highest step of any batch stored for the rank,
every incarnation's (stepwatch_server/ingest/store.py moves it forward with each batch), so that a read above
the rollup watermark asks the raw values only where a rank holds any there (runs/rollups.py `stored_above`).
The ranks of the runs stored before get theirs here from their raw values above their run's watermark, a
seek a series and rank (below it the rollups hold everything, so the watermark stands for those); a rank
without values keeps NULL. A downgrade drops the column.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07 22:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0015'
down_revision: str | None = '0014'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ABOVE = sa.text(
    'SELECT rank, max(step) FROM points WHERE series_id IN :ids AND rank IN :ranks AND step > :mark GROUP BY rank'
).bindparams(sa.bindparam('ids', expanding=True), sa.bindparam('ranks', expanding=True))


def upgrade() -> None:
    with op.batch_alter_table('ranks') as batch:
        batch.add_column(sa.Column('stored_to', sa.BigInteger(), nullable=True))
    conn = op.get_bind()
    runs = conn.execute(
        sa.text(
            'SELECT runs.id, coalesce(rollup_marks.rolled_to, -1) FROM runs '
            'LEFT JOIN rollup_marks ON rollup_marks.run_id = runs.id'
        )
    ).all()
    for run_id, mark in runs:
        ranks = list(conn.execute(sa.text('SELECT rank FROM ranks WHERE run_id = :r'), {'r': run_id}).scalars())
        ids = list(conn.execute(sa.text('SELECT id FROM series WHERE run_id = :r'), {'r': run_id}).scalars())
        top = {rank: int(mark) for rank in ranks} if mark >= 0 else {}
        for i in range(0, len(ids), 500):
            params = {'ids': ids[i : i + 500], 'ranks': ranks, 'mark': int(mark)}
            for rank, step in conn.execute(_ABOVE, params) if ranks else ():
                top[int(rank)] = max(top.get(int(rank), -1), int(step))
        if top:
            conn.execute(
                sa.text('UPDATE ranks SET stored_to = :top WHERE run_id = :run AND rank = :rank'),
                [{'top': step, 'run': run_id, 'rank': rank} for rank, step in top.items()],
            )


def downgrade() -> None:
    with op.batch_alter_table('ranks') as batch:
        batch.drop_column('stored_to')
