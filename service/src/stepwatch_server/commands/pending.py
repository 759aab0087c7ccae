"""Which ranks still owe an answer to a command, held in memory so that ingest's answers cost a dict lookup.

Every `REFRESH_S` the worker reads the unexpired commands and who answered them (two queries, whatever the
number of runs), so that with several ingest replicas each one puts a command asked through any of them on
its answers within a second. A command asked or answered through this process is seen at once. Ranks may
be handed a command again until their answer is read back here: the agent carries out an id once.
"""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy import Engine

from stepwatch_server.background import BackgroundWorker
from stepwatch_server.commands import store

REFRESH_S = 1.0


class PendingCommands(BackgroundWorker):
    label = "commands"
    error_pause_s = 1.0

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self._engine = engine
        self._by_run: dict[str, list[tuple[store.Asked, set[int]]]] = {}
        self._mutex = threading.Lock()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._guard("refresh", self.refresh)
            self._stop.wait(REFRESH_S)

    def refresh(self) -> None:
        with self._engine.connect() as conn:
            rows = store.unexpired(conn)
        by_run: dict[str, list[tuple[store.Asked, set[int]]]] = {}
        for asked, answered in rows:
            by_run.setdefault(asked.run, []).append((asked, answered))
        with self._mutex:
            self._by_run = by_run

    def asked(self, asked: store.Asked) -> None:
        with self._mutex:
            self._by_run.setdefault(asked.run, []).append((asked, set()))

    def answered(self, run: str, command_id: int, rank: int) -> None:
        with self._mutex:
            for asked, ranks in self._by_run.get(run, ()):
                if asked.id == command_id:
                    ranks.add(rank)

    def for_rank(self, run: str, rank: int) -> list[dict[str, Any]]:
        """The commands `rank` of `run` has not answered, as the ingest answer carries them (no lock: the
        dict is replaced whole, and a set read while another thread adds to it is at worst a repeat)."""
        waiting = self._by_run.get(run)
        if not waiting:
            return []
        now = store.now()
        return [
            {"id": asked.id, "kind": asked.kind, "args": asked.args}
            for asked, answered in waiting
            if asked.wanted(rank) and rank not in answered and asked.expires_at > now
        ]
