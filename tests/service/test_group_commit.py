"""Group commit (ingest/store.py): batches written at the same time share one transaction of bulk
statements, on SQLite and PostgreSQL, and each caller still gets its own truthful answer.

32 threads write at once, two per rank: every batch of the 16 ranks is written twice (an agent's
retry racing its original), in barrier-aligned rounds so that copies meet in the same group. Every
value must be stored exactly once, one copy answered as stored and the other as a duplicate, and the
ranks' state must end at their last step (how the threads meet is the scheduler's: that a group of
batches is one transaction is checked on its own, below).
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

from sqlalchemy import Engine, event, func, select

from stepwatch_server.ingest.store import BatchWriter, IngestResult, Pending
from stepwatch_server.ingest.validate import parse_batch
from stepwatch_server.storage.models import IngestedBatch, Point, Rank, StepRecord

RANKS, ROUNDS = 16, 12
NAMES = [f"m{i}" for i in range(20)]
JOIN_S = 120.0


def _doc(session: str, rank: int, seq: int) -> dict[str, Any]:
    steps = [2 * seq + 1, 2 * seq + 2]
    return {
        "schema": 1, "run": "grouped", "session": session, "seq": seq, "rank": rank, "world_size": RANKS,
        "steps": steps, "timestamps": [1.7e9 + s for s in steps],
        "metrics": {n: [float(rank * 1000 + s) for s in steps] for n in NAMES},
        "heartbeat": {"ts": 1.7e9 + steps[-1], "phase": "data", "last_step": steps[-1]},
    }  # fmt: skip


def test_concurrent_batches_and_their_retries_are_stored_once_each_answered_truthfully(
    engine: Engine,
) -> None:
    writer = BatchWriter(engine)
    sessions = [uuid.uuid4().hex for _ in range(RANKS)]
    for rank, session in enumerate(sessions):  # each rank's first batch: creates its session and rank row
        assert writer.write(parse_batch(_doc(session, rank, 0))).rows == 2 * len(NAMES)
    answers: dict[tuple[int, int], list[IngestResult]] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(2 * RANKS)

    def copy_of(rank: int) -> None:
        try:
            for seq in range(1, ROUNDS + 1):
                barrier.wait(timeout=JOIN_S)
                result = writer.write(parse_batch(_doc(sessions[rank], rank, seq)))
                with lock:
                    answers.setdefault((rank, seq), []).append(result)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=copy_of, args=(r % RANKS,)) for r in range(2 * RANKS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not errors and not any(t.is_alive() for t in threads), errors

    per_batch = 2 * len(NAMES)
    for key, (a, b) in answers.items():
        stored, dup = sorted((a, b), key=lambda r: r.duplicate)
        assert (stored.rows, stored.duplicate, stored.duplicates) == (per_batch, False, 0), key
        assert (dup.rows, dup.duplicate, dup.duplicates) == (0, True, per_batch), key
        assert stored.incarnation == dup.incarnation == 1 and stored.steps == (2 * key[1] + 1, 2 * key[1] + 2)
    with engine.connect() as conn:
        values = conn.execute(select(func.count()).select_from(Point)).scalar_one()
        steps = conn.execute(select(func.count()).select_from(StepRecord)).scalar_one()
        batches = conn.execute(select(func.count()).select_from(IngestedBatch)).scalar_one()
        last = dict(conn.execute(select(Rank.rank, Rank.last_step)).all())
    assert values == RANKS * (ROUNDS + 1) * per_batch
    assert steps == RANKS * (ROUNDS + 1) * 2 and batches == RANKS * (ROUNDS + 1)
    assert last == {rank: 2 * ROUNDS + 2 for rank in range(RANKS)}
    groups, written = writer.group_sizes
    assert written == RANKS + 2 * RANKS * ROUNDS and groups <= written, (groups, written)


def test_a_group_of_known_batches_is_one_transaction(engine: Engine) -> None:
    """The steady state's batches handed over together (as ingest's writing thread does) are committed
    in one transaction, each answered; a repeated one within the group is a duplicate."""
    writer = BatchWriter(engine)
    sessions = [uuid.uuid4().hex for _ in range(RANKS)]
    for rank, session in enumerate(sessions):
        writer.write(parse_batch(_doc(session, rank, 0)))
    commits: list[int] = []
    event.listen(engine, "commit", lambda conn: commits.append(1))
    group = [
        Pending(b, writer.prebuild(b)) for b in (parse_batch(_doc(s, r, 1)) for r, s in enumerate(sessions))
    ]
    again = Pending(group[3].batch, None)
    writer.write_group([*group, again])
    assert len(commits) == 1
    assert [p.result.rows for p in group if p.result] == [2 * len(NAMES)] * RANKS
    assert again.result is not None and again.result.duplicate and again.result.duplicates == 2 * len(NAMES)
    assert writer.group_sizes[0] >= 1


def test_bodies_that_wait_together_are_answered_each_on_its_own(collector: Any) -> None:
    """Over HTTP, small bodies go to ingest's writing thread (ingest/pipeline.py), which takes every one
    that waits: sent at once, a bad body (not JSON), a refused one (a session of another rank) and good
    ones each get their own answer, and only the good ones are stored."""
    from concurrent.futures import ThreadPoolExecutor

    sessions = [uuid.uuid4().hex for _ in range(RANKS)]
    for rank, session in enumerate(sessions):
        assert collector.post(_doc(session, rank, 0)).status_code == 200
    good = [_doc(sessions[r], r, 1) for r in range(RANKS)]
    thief = _doc(sessions[0], 1, 2)  # rank 1 with rank 0's session
    with ThreadPoolExecutor(RANKS + 2) as pool:
        answers = list(pool.map(collector.post, [*good, thief, b"{not json"]))
    assert [a.status_code for a in answers] == [200] * RANKS + [422, 400]
    assert answers[RANKS].json()["error"]["field"] == "session"
    assert all(a.json()["rows"] == 2 * len(NAMES) for a in answers[:RANKS])
    stored = collector.counts()
    assert stored["points"] == 2 * RANKS * 2 * len(NAMES)


def test_the_writing_threads_answer_every_waiting_body_before_they_stop(engine: Engine) -> None:
    """At shutdown the collector stops ingest's writing threads (two on PostgreSQL) after uvicorn has waited
    for the requests; what still waits in the pipeline then is written and answered before the threads
    end: no request is left without its answer, and every batch answered as stored is in the database."""
    import asyncio

    import orjson

    from stepwatch_server.ingest.pipeline import WRITING_THREADS, IngestPipeline

    pipeline = IngestPipeline(BatchWriter(engine)).start()
    assert (
        pipeline.threads
        == (1 if engine.dialect.name == "sqlite" else WRITING_THREADS)
        == len([t for t in threading.enumerate() if t.name.startswith("stepwatch-ingest")])
    )
    sessions = [uuid.uuid4().hex for _ in range(RANKS)]
    bodies = [orjson.dumps(_doc(sessions[r], r, seq)) for seq in range(ROUNDS) for r in range(RANKS)]

    async def send_all_then_stop() -> tuple[int, list[tuple[Any, IngestResult]]]:
        tasks = [asyncio.ensure_future(pipeline.ingest(body, None, 1 << 24, None)) for body in bodies]
        await asyncio.sleep(0)  # each task has queued its body
        waiting = sum(not task.done() for task in tasks)
        await asyncio.get_running_loop().run_in_executor(None, pipeline.stop)
        assert not pipeline.running
        return waiting, await asyncio.wait_for(asyncio.gather(*tasks), 10.0)

    waiting, answers = asyncio.run(send_all_then_stop())
    assert waiting > len(bodies) // 2  # most still waited when the stop began
    assert [result.rows for _, result in answers] == [2 * len(NAMES)] * len(bodies)
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(IngestedBatch)).scalar_one() == len(bodies)
        assert conn.execute(select(func.count()).select_from(Point)).scalar_one() == len(bodies) * 2 * len(
            NAMES
        )
