"""What the training thread is doing, for the heartbeat: its Python stack, read from the sender thread.

A stall in which every rank keeps sending heartbeats is a hang only when a rank stopped while its peers
wait for it. An unmarked checkpoint blocks in a save call, a rank waiting for a peer sits in a collective;
the innermost frames of the training thread say which (the collector classifies them,
`stepwatch_server.detect.activity`). Reading them costs the training thread nothing: the sender thread
takes `sys._current_frames()` (a snapshot of every thread's innermost frame, made under the GIL) and walks
the training thread's frames outward. Only module and function names are shipped, never arguments or
values; `attach(report_stack=False)` ships none.
"""

from __future__ import annotations

import sys
from types import FrameType

MAX_STACK_FRAMES = 16  # frames shipped per heartbeat (docs/ingest.md, `heartbeat.stack`)
MAX_FRAME_CHARS = 200  # characters per frame, "module:function"
MAX_WALKED_FRAMES = 256  # frames looked at per heartbeat: stepwatch's own skipped ones included
OWN_PACKAGE = "stepwatch"


def _own(module: str) -> bool:
    return module == OWN_PACKAGE or module.startswith(OWN_PACKAGE + ".")


def frame_names(frame: FrameType | None) -> list[str]:
    """Up to MAX_STACK_FRAMES "module:qualname" entries from `frame` outward, stepwatch's own left out."""
    names: list[str] = []
    walked = 0
    while frame is not None and len(names) < MAX_STACK_FRAMES and walked < MAX_WALKED_FRAMES:
        walked += 1
        module = frame.f_globals.get("__name__")
        module = module if isinstance(module, str) and module else "?"
        if not _own(module):
            code = frame.f_code
            names.append(f"{module}:{code.co_qualname}"[:MAX_FRAME_CHARS])
        frame = frame.f_back
    return names


def thread_stack(ident: int) -> list[str]:
    """The stack of thread `ident` (innermost first), or [] when the thread has ended."""
    return frame_names(sys._current_frames().get(ident))
