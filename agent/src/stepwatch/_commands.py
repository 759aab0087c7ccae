"""The collector's commands for this rank (docs/ingest.md, "Commands"): evidence asked for at a verdict.

No inbound port: the collector puts the commands pending for a rank on its answer to that rank's batch or
heartbeat (`"commands": [{"id": 7, "kind": "stacks"}]`), which only the configured collector, reached with
the run's write token, can send. The sender thread carries them out, one at a time and never on the
training thread, and posts each result to `/api/v1/commands/{id}/results`. A command id is carried out
once (the collector repeats a command until its result is in), and one command starts per second at most. `attach(commands=False)` refuses every
command with a status that says so.

Kinds: `stacks`, every thread's Python stack (`_activity.StackReader.threads`: read by faulthandler in C,
so it works while the training thread is blocked in a collective or a C call) and, where torch exposes it,
the NCCL flight recorder's dump; `profile` (`args.steps`), a torch.profiler trace of that many whole steps,
started and stopped by the training thread's hooks (_profile.py) and finished by the sender.
"""

from __future__ import annotations

import base64
import collections
import sys
import time
from typing import Any

from ._activity import StackReader
from ._records import Live

KINDS = ("stacks", "profile")
MAX_PROFILE_STEPS = 50
MAX_QUEUED = 8  # commands waiting on this rank; more in one answer are left for a later answer
MIN_INTERVAL_S = 1.0  # one command started per second at most, whatever the collector asks
REMEMBERED = 256  # ids carried out, so that a repeated command is not run twice
MAX_NCCL_TRACE_BYTES = 4 << 20


def nccl_trace() -> dict[str, Any]:
    """The NCCL flight recorder's dump (`torch._C._distributed_c10d._dump_nccl_trace`, pickled bytes,
    base64) or why there is none: torch not imported, no NCCL process group (gloo, CPU), or the
    recorder off (TORCH_NCCL_TRACE_BUFFER_SIZE unset gives an empty dump)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {"available": False, "why": "torch is not imported"}
    dump = getattr(getattr(torch._C, "_distributed_c10d", None), "_dump_nccl_trace", None)
    if dump is None:
        return {"available": False, "why": "this torch build has no NCCL (gloo or CPU only)"}
    try:
        data = dump()
    except Exception as exc:  # no NCCL process group, or the recorder is off
        return {"available": False, "why": f"{type(exc).__name__}: {exc}"[:300]}
    if not data:
        return {"available": False, "why": "empty: set TORCH_NCCL_TRACE_BUFFER_SIZE to record"}
    if len(data) > MAX_NCCL_TRACE_BYTES:
        return {"available": False, "why": f"{len(data):,} bytes, over the {MAX_NCCL_TRACE_BYTES:,} limit"}
    return {"available": True, "pickle_base64": base64.b64encode(data).decode("ascii")}


class Commands:
    """Commands taken from the collector's answers, carried out by the sender thread (only)."""

    def __init__(
        self, enabled: bool, stacks: StackReader, training_thread: int | None, live: Live | None = None
    ) -> None:
        self.enabled = enabled
        self._live = live
        self._stacks = stacks
        self._training = training_thread
        self._started = -MIN_INTERVAL_S  # when the last command was taken (monotonic)
        self._queue: collections.deque[tuple[int, str, dict[str, Any]]] = collections.deque()
        self._seen: collections.OrderedDict[int, None] = collections.OrderedDict()

    def offer(self, answer: dict[str, Any] | None) -> None:
        """The commands on one acknowledgement, queued unless seen already (malformed entries ignored)."""
        commands = answer.get("commands") if answer else None
        if not isinstance(commands, list):
            return
        for command in commands:
            if not isinstance(command, dict):
                continue
            cid, kind, args = command.get("id"), command.get("kind"), command.get("args") or {}
            if (
                type(cid) is not int
                or not isinstance(kind, str)
                or not isinstance(args, dict)
                or cid in self._seen
            ):
                continue
            if len(self._queue) >= MAX_QUEUED:
                return
            self._seen[cid] = None
            while len(self._seen) > REMEMBERED:
                self._seen.popitem(last=False)
            self._queue.append((cid, kind, args))

    def take(self) -> tuple[int, str, dict[str, Any]] | None:
        """The next command to carry out, unless one started within MIN_INTERVAL_S (it waits)."""
        now = time.monotonic()
        if not self._queue or now - self._started < MIN_INTERVAL_S:
            return None
        self._started = now
        return self._queue.popleft()

    def carry_out(self, cid: int, kind: str, args: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """One command's outcome: `{"status": "done", "result": ...}`, or `refused` / `failed` with a
        `message`; None for a profile the training thread has started on (its result comes later)."""
        if not self.enabled:
            return {
                "status": "refused",
                "message": "the command channel is off on this rank (attach(commands=False))",
            }
        if kind not in KINDS:
            return {
                "status": "refused",
                "message": f"unknown command {kind!r}: this agent carries out {', '.join(KINDS)}",
            }
        if kind == "profile":
            return self._profile(cid, args or {})
        try:
            threads = self._stacks.threads(self._training)
            return {"status": "done", "result": {"threads": threads, "nccl_trace": nccl_trace()}}
        except Exception as exc:
            return {"status": "failed", "message": f"{type(exc).__name__}: {exc}"[:500]}

    def _profile(self, cid: int, args: dict[str, Any]) -> dict[str, Any] | None:
        steps = args.get("steps", 5)
        if type(steps) is not int or not 1 <= steps <= MAX_PROFILE_STEPS:
            return {"status": "refused", "message": f"steps: expected 1-{MAX_PROFILE_STEPS}, got {steps!r}"}
        live = self._live
        if live is None or "torch" not in sys.modules:
            return {"status": "refused", "message": "no training loop is watched in this process"}
        if live.profile_request is not None:
            return {"status": "refused", "message": "a profile of this rank is under way already"}
        live.profile_request = (cid, steps)  # the training thread's next step end starts it
        return None
