"""Per-channel rate limit: at most `max_per_minute` messages in any sliding 60 s, in memory.

A slot is taken when a delivery is claimed and given back when the attempt fails (`refund`), so
attempts that never reached the channel (it was down) do not use up its budget. Messages over the
limit are not dropped: they stay in the outbox, due when a slot frees. The window
lives in the process, so a restart starts it afresh (grouping and cooldown, which live in the
database, already keep a restart from re-sending anything).
"""

from __future__ import annotations

import collections
import datetime as dt
import threading
from collections.abc import Mapping

WINDOW = dt.timedelta(seconds=60)


class RateLimiter:
    def __init__(self, limits: Mapping[str, int]) -> None:
        self._limits = dict(limits)
        self._sent: dict[str, collections.deque[dt.datetime]] = collections.defaultdict(collections.deque)
        self._lock = threading.Lock()

    def take(self, channel: str, now: dt.datetime) -> bool:
        """Use a slot of `channel` at `now`, if one is free."""
        with self._lock:
            sent = self._expire(channel, now)
            if len(sent) >= self._limits.get(channel, 1):
                return False
            sent.append(now)
            return True

    def refund(self, channel: str, taken_at: dt.datetime) -> None:
        """Give back the slot taken at `taken_at` (the attempt did not deliver)."""
        with self._lock:
            sent = self._sent[channel]
            if taken_at in sent:
                sent.remove(taken_at)

    def free_at(self, channel: str, now: dt.datetime) -> dt.datetime:
        """When the next slot of `channel` frees."""
        with self._lock:
            sent = self._expire(channel, now)
            return sent[0] + WINDOW if sent else now

    def _expire(self, channel: str, now: dt.datetime) -> collections.deque[dt.datetime]:
        sent = self._sent[channel]
        while sent and sent[0] <= now - WINDOW:
            sent.popleft()
        return sent
