"""The sender thread: decodes host copies, builds batches, sends them, spools and replays, heartbeats."""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
import uuid
from typing import Any
from urllib.parse import urlencode

from . import _batch
from ._activity import StackReader
from ._commands import Commands
from ._config import Config
from ._guard import Counters, Guard
from ._identity import Identity
from ._records import Chunk, Live
from ._spool import QUARANTINE, SUFFIX, Quarantine, Spool
from ._transport import Outcome, Result, Transport, backoff_s

logger = logging.getLogger("stepwatch")

MAX_BUFFERED_STEPS = 20_000  # steps waiting on the host to be sent; beyond, the oldest are dropped
MAX_STEPS_PER_BATCH = 1_000
WAKE_STEPS = 256  # wake the sender early once this many steps wait
MAX_PENDING_EVENTS = 1_000
BATCH_DEADLINE_FACTOR = 3  # a data batch is retried for up to this many request timeouts, then spooled
# A spooled batch the collector answers with a server error that is not "try later" (a 500, not 502-504)
# this many times is set aside (quarantined): the ones behind it go on.
MAX_ANSWERED_FAILURES = 5
JITTER = 0.2  # +-20% on every interval, so that a thousand ranks do not send in lock-step


def _jittered(interval_s: float) -> float:
    return interval_s * random.uniform(1 - JITTER, 1 + JITTER)


class Sender:
    def __init__(
        self,
        config: Config,
        identity: Identity,
        counters: Counters,
        guard: Guard,
        live: Live,
        spool: Spool,
        version: str,
        training_thread: int | None = None,
    ) -> None:
        self.config, self.counters, self.guard, self.live, self.spool = config, counters, guard, live, spool
        # The thread whose stack heartbeats report: the one that called attach() (the training loop's).
        self._training_thread = training_thread if config.report_stack else None
        self._stacks = StackReader()
        self.commands = Commands(config.commands, self._stacks, training_thread, live)
        self.session = uuid.uuid4().hex
        self._started_ns = time.time_ns()
        self._seq = 0
        self._head = {"schema": _batch.SCHEMA, **identity.fields(), "session": self.session}
        self._version = version
        self._lock = threading.Lock()
        self._chunks: collections.deque[Chunk] = collections.deque()
        self._queued_steps = 0
        self._events: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_PENDING_EVENTS)
        self._rows: list[_batch.Row] = []  # sender thread only
        self._decoder = _batch.Decoder()
        self._wake = threading.Event()
        self._stop = threading.Event()  # set by close(): ends every backoff sleep
        self._transport = Transport(
            config.ingest_urls, config.token, config.timeout_s, self._stop, counters, identity.rank
        )
        self._close_deadline = 0.0
        self._thread: threading.Thread | None = None
        now = time.monotonic()
        self._next_flush = now + _jittered(config.flush_interval_s)
        self._next_heartbeat = now  # the first heartbeat announces the rank at once
        self._next_replay = now
        self._replay_attempt = 0
        self._said: set[str] = set()  # what was logged once already
        # Answered failures of the spool's oldest batch (the only one replay tries), by its name: a count
        # for one batch, so one the spool's bound deletes leaves nothing behind.
        self._failing, self._failures = "", 0
        self.quarantine = Quarantine(spool.directory / QUARANTINE, counters, guard)
        self.left_steps = 0

    # -- training thread ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stepwatch-sender", daemon=True)
        self._thread.start()

    def submit(self, chunk: Chunk) -> None:
        with self._lock:
            self._chunks.append(chunk)
            self._queued_steps += len(chunk.records)
            while self._queued_steps > MAX_BUFFERED_STEPS and len(self._chunks) > 1:
                dropped = self._chunks.popleft()
                self._queued_steps -= len(dropped.records)
                self.counters.add("dropped_buffer_full", len(dropped.records))
            wake = self._queued_steps >= WAKE_STEPS
        if wake:
            self._wake.set()

    def set_capacity_mb(self, capacity_mb: float | None) -> None:
        """The rank's memory capacity (read once at attach), shipped as `mem.capacity_mb`; before start()."""
        self._decoder.capacity_mb = capacity_mb

    def add_event(self, kind: str, data: dict[str, Any]) -> None:
        self._events.append({"step": self.live.last_step or 0, "ts": time.time(), "kind": kind, "data": data})

    def close(self, timeout_s: float) -> None:
        """Send what is queued within `timeout_s`, spool the rest; the thread ends."""
        self._close_deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s + 0.1)
            if self._thread.is_alive():
                with self._lock:
                    self.left_steps += self._queued_steps + len(self._rows)

    # -- sender thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            wait = min(self._next_flush, self._next_heartbeat) - time.monotonic()
            if len(self.spool):
                wait = min(wait, self._next_replay - time.monotonic())
            self._wake.wait(max(0.0, wait))
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self._cycle()
            except Exception as exc:  # never let the thread die; the next cycle tries again
                self.guard.fail("sender", exc, disable=False)
        try:
            self._final_cycle()
        except Exception as exc:
            self.guard.fail("sender", exc, disable=False)
        finally:
            self._stacks.close()
            self._transport.close()

    def _take_ready(self, wait_until: float | None = None) -> None:
        """Decode the chunks whose device copy completed, in order."""
        while True:
            with self._lock:
                chunk = self._chunks[0] if self._chunks else None
            if chunk is None:
                return
            while not chunk.is_ready():
                if wait_until is None or time.monotonic() >= wait_until:
                    return
                time.sleep(0.001)  # close(): poll the event rather than block on a GPU that may hang
            with self._lock:
                self._chunks.popleft()
                self._queued_steps -= len(chunk.records)
            rows, events = self._decoder.decode(chunk)
            self._rows.extend(rows)
            self._events.extend(events)

    def _cycle(self) -> None:
        self._send_cycle()
        self._carry_out_commands()  # every cycle: those the answers just brought, and a finished profile

    def _send_cycle(self) -> None:
        now = time.monotonic()
        self._take_ready()
        if len(self.spool) and now >= self._next_replay:
            self._replay(deadline=None)
        if now >= self._next_flush or len(self._rows) >= WAKE_STEPS:
            self.live.transfer_requested = True  # the training thread copies its device values next step
            self._next_flush = now + _jittered(self.config.flush_interval_s)
            if self._rows or self._events:
                self._send_rows(deadline=None)
                return
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + _jittered(self.config.heartbeat_interval_s)
            # Also while batches wait in the spool: the rank stays visibly alive, and an answered
            # heartbeat means the collector is back, so the replay starts now instead of after its backoff.
            if self._heartbeat() and len(self.spool):
                self._replay_attempt = 0
                self._replay(deadline=None)

    def _carry_out_commands(self) -> None:
        """The collector's commands taken from its answers (_commands.py), one after the other; each
        result posted once (the collector asks again when it stays without one)."""
        while (command := self.commands.take()) is not None:
            cid, kind, args = command
            outcome = self.commands.carry_out(cid, kind, args)
            if outcome is not None:  # None: a profile, under way on the training thread
                self._post_outcome(cid, kind, outcome)
        done = self.live.profile_done
        if done is not None:
            self.live.profile_done = None
            self._post_profile(done)

    def _post_outcome(self, cid: int, kind: str, outcome: dict[str, Any]) -> None:
        body = _batch.encode(
            {
                "run": self.config.run,
                "rank": self._head["rank"],
                "session": self.session,
                "kind": kind,
                **outcome,
            }
        )
        end = time.monotonic() + BATCH_DEADLINE_FACTOR * self.config.timeout_s
        result = self._transport.post(body, end, endpoint=f"commands/{cid}/results")
        self.counters.add("commands" if result.outcome is Outcome.SENT else "command_failures")
        if result.outcome is Outcome.SENT:
            self.commands.offer(result.answer)

    def _post_profile(self, done: Any) -> None:
        """A finished profile (_profile.py): its trace uploaded first, then the result that points to it."""
        from . import _profile  # imports torch: only ever reached once a profile ran

        if done.error is not None:
            self._post_outcome(done.command_id, "profile", {"status": "failed", "message": done.error})
            return
        try:
            result, trace = _profile.summarise(done)
        except Exception as exc:
            message = f"the trace could not be exported: {type(exc).__name__}: {exc}"[:500]
            self._post_outcome(done.command_id, "profile", {"status": "failed", "message": message})
            return
        if trace is not None:
            query = urlencode({"run": self.config.run, "rank": self._head["rank"]})
            end = time.monotonic() + BATCH_DEADLINE_FACTOR * self.config.timeout_s
            sent = self._transport.post(trace, end, endpoint=f"commands/{done.command_id}/artifacts?{query}")
            if sent.outcome is not Outcome.SENT:
                result["trace_dropped"] = f"the upload failed: {sent.message}"[:300]
        self._post_outcome(done.command_id, "profile", {"status": "done", "result": result})

    def _final_cycle(self) -> None:
        deadline = self._close_deadline
        self._take_ready(wait_until=deadline)
        if len(self.spool):
            self._replay(deadline)
        self._send_rows(deadline)
        with self._lock:
            self.left_steps += self._queued_steps

    def _next_body(self) -> tuple[int, bytes, int]:
        rows, self._rows = self._rows[:MAX_STEPS_PER_BATCH], self._rows[MAX_STEPS_PER_BATCH:]
        events = [self._events.popleft() for _ in range(len(self._events))]
        head = dict(
            self._head, seq=self._seq, agent={"version": self._version, "counters": self.counters.snapshot()}
        )
        batch = _batch.build(head, rows, events, self._heartbeat_fields())
        self._seq += 1
        return self._seq - 1, _batch.encode(batch), len(rows)

    def _heartbeat_fields(self) -> dict[str, Any]:
        """What the training thread is doing now (docs/ingest.md, `heartbeat`); in every batch.

        Cost: measured by tests/agent/test_activity.py with the training thread 30 frames deep (the figure
        is printed there); on the sender thread, every few seconds.
        """
        live = self.live
        fields: dict[str, Any] = {
            "ts": time.time(),
            "phase": live.phase,
            "last_step": live.last_step,
            "forwards": live.forwards,
            "nograd_forwards": live.nograd_forwards,
        }
        if self._training_thread is not None and "stack" not in self.guard.off:
            try:
                fields["stack"] = self._stacks.stack(self._training_thread)
            except Exception as exc:
                self.guard.fail("stack", exc)
        return fields

    def _spool_key(self, seq: int) -> str:
        return f"{self._started_ns:020d}-{self.session}-{seq:010d}"

    def _send_rows(self, deadline: float | None) -> None:
        while self._rows or self._events:
            seq, body, n = self._next_body()
            if len(self.spool):  # strictly in order: new batches queue behind the spooled ones
                if not self.spool.put(self._spool_key(seq), body):
                    self.counters.add("dropped_unsent")
                continue
            end = (
                deadline
                if deadline is not None
                else time.monotonic() + BATCH_DEADLINE_FACTOR * self.config.timeout_s
            )
            result = self._transport.post(body, end, closing=deadline is not None)
            if result.outcome is Outcome.SENT:
                self.commands.offer(result.answer)
                self.counters.add("sent_batches")
                self.counters.add("sent_steps", n)
            elif result.outcome is Outcome.REJECTED:
                self._rejected(result)
                self._set_aside(self._spool_key(seq) + SUFFIX, body, result)
            else:
                self.counters.add("send_failures")
                self._note(result)
                self._defer(result)
                if not self.spool.put(self._spool_key(seq), body):
                    self.counters.add("dropped_unsent")
        self._next_heartbeat = time.monotonic() + _jittered(self.config.heartbeat_interval_s)

    def _replay(self, deadline: float | None) -> None:
        """Send spooled batches oldest first; stop at the first that cannot be delivered."""
        while len(self.spool) and (deadline is None or time.monotonic() < deadline):
            item = self.spool.oldest()
            if item is None:
                return
            name, body = item
            timeout = self.config.timeout_s if deadline is None else deadline - time.monotonic()
            result = self._transport.post_once(body, min(self.config.timeout_s, timeout))
            if result.outcome is Outcome.UNAVAILABLE:
                self._note(result)
                if name != self._failing:
                    self._failing, self._failures = name, 0
                self._failures += result.server_error
                if self._failures < MAX_ANSWERED_FAILURES:
                    self._defer(result)
                    return
            self.spool.remove(name)
            self._replay_attempt = 0
            if result.outcome is Outcome.SENT:
                self.commands.offer(result.answer)
                self.counters.add("replayed_batches")
                self.counters.add("sent_batches")
            else:
                if result.outcome is Outcome.REJECTED:
                    self._rejected(result)
                self._set_aside(name, body, result)

    def _defer(self, result: Result) -> None:
        wait = result.retry_after_s if result.retry_after_s is not None else backoff_s(self._replay_attempt)
        self._replay_attempt += 1
        self._next_replay = time.monotonic() + wait

    def _heartbeat(self) -> bool:
        head = dict(
            self._head, seq=self._seq, agent={"version": self._version, "counters": self.counters.snapshot()}
        )
        self._seq += 1
        body = _batch.encode(_batch.build(head, [], [], self._heartbeat_fields()))
        timeout = min(self.config.timeout_s, self.config.heartbeat_interval_s)
        result = self._transport.post_once(body, timeout)  # stale heartbeats are worthless: one try, no spool
        if result.outcome is Outcome.SENT:
            self.commands.offer(result.answer)
            self.counters.add("heartbeats")
            return True
        self.counters.add("heartbeat_failures")
        if result.outcome is Outcome.REJECTED:
            self._rejected(result)
        return False

    def _rejected(self, result: Result) -> None:
        self.counters.add("rejected_batches")
        self._say(
            "rejected",
            "stepwatch: the collector rejected a batch (%s); such batches are not retried: they are "
            "set aside in %s (logged once)",
            result.message, self.quarantine.directory,
        )  # fmt: skip

    def _set_aside(self, name: str, body: bytes, result: Result) -> None:
        """Quarantine a batch the collector will not take, so that the ones behind it go on."""
        self.quarantine.put(name, body, f"{result.status} {result.message}")
        if result.outcome is not Outcome.REJECTED:
            self._say(
                "quarantine",
                "stepwatch: a batch the collector answered %d times with a server error (%s) was set aside in "
                "%s; the batches behind it go on (logged once)",
                MAX_ANSWERED_FAILURES, result.message, self.quarantine.directory,
            )  # fmt: skip

    def _note(self, result: Result) -> None:
        """Say once what no retry will fix by itself: a redirect, a 2xx that is no acknowledgement, a wrong
        URL or token."""
        status = result.status
        if status in (404, 405):
            self._say(
                "url",
                "stepwatch: %s answers %s: url (or STEPWATCH_URL) must be the collector's base address, e.g. "
                "http://host:8000 (the agent adds /api/v1/ingest). Batches wait in the spool until it is "
                "fixed (logged once)",
                self._transport.url, result.message,
            )  # fmt: skip
        elif status in (401, 403):
            self._say(
                "token",
                "stepwatch: the collector refuses the token for run %r (%s): set token (or STEPWATCH_TOKEN) to "
                "one that may write this run. Batches wait in the spool until it is fixed (logged once)",
                self.config.run, result.message,
            )  # fmt: skip
        elif status is not None and 300 <= status < 400:
            self._say(
                "redirect",
                "stepwatch: the collector at %s answers %d, a redirect to %s; stepwatch does not follow "
                "redirects: batches wait in the spool. Set url (or STEPWATCH_URL) to the address it "
                "points to (logged once)",
                self._transport.url, status, result.location,
            )  # fmt: skip
        elif status is not None and 200 <= status < 300:
            self._say(
                "no-ack",
                "stepwatch: %s answered %s; only the collector's acknowledgement counts as delivered, "
                "so batches wait in the spool. Is url a stepwatch collector? (logged once)",
                self._transport.url, result.message,
            )  # fmt: skip

    def _say(self, key: str, message: str, *args: Any) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.error(message, *args)
