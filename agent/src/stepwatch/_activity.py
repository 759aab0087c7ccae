"""What the training thread is doing, for the heartbeat: its Python stack, read from the sender thread.

A stall in which every rank keeps sending heartbeats is a hang only when a rank stopped while its peers
wait for it. An unmarked checkpoint blocks in a save call, a rank waiting for a peer sits in a collective;
the innermost frames of the training thread say which (the collector classifies them,
`stepwatch_server.detect.activity`). Only module and function names are shipped, never arguments or
values; `attach(report_stack=False)` ships none.

How it is read matters more than what: walking another thread's frames from Python
(`sys._current_frames()`, then `f_back`, `f_globals`) can crash the interpreter on CPython 3.11 (a
frame object that still points at an interpreter frame its thread has since popped: a segfault seen
here under load in tests/agent, and in Sentry's and Datadog's samplers), and a crash in a training
process is the one thing the agent must never cause. So the stack is read by `faulthandler`, in C, in
one call under the GIL (no thread can pop a frame meanwhile), into an in-memory file, and only its text
is parsed: "File PATH, line N in FUNCTION" per frame. The module of a frame is looked up by its file in
`sys.modules` (refreshed at most every `MODULES_REFRESH_S` when a file is new), and stepwatch's own
frames are left out. The function is the code's name (not its qualified name: faulthandler prints that).
"""

from __future__ import annotations

import faulthandler
import os
import struct
import sys
import tempfile
import threading
import time
from typing import IO

MAX_STACK_FRAMES = 16  # frames shipped per heartbeat (docs/ingest.md, `heartbeat.stack`)
MAX_FRAME_CHARS = 200  # characters per frame, "module:function"
OWN_PACKAGE = "stepwatch"
OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
MODULES_REFRESH_S = 30.0
FRAME_PREFIX = '  File "'
IDENT_DIGITS = 2 * struct.calcsize("L")  # faulthandler prints a thread id as 0x%0*lx


def _own(module: str, path: str) -> bool:
    return module == OWN_PACKAGE or module.startswith(OWN_PACKAGE + ".") or path.startswith(OWN_DIR)


def _thread_block(text: str, ident: int) -> list[str]:
    """The frame lines of thread `ident` in a faulthandler dump (innermost first), [] when absent."""
    marker = f"hread 0x{ident:0{IDENT_DIGITS}x} (most recent call first):"  # "Thread" or "Current thread"
    start = text.find(marker)
    if start < 0:
        return []
    lines = text[start:].split("\n")[1:]
    block = []
    for line in lines:
        if not line.startswith("  "):  # a blank line ends the thread's block
            break
        block.append(line)
    return block


def parse_frame(line: str) -> tuple[str, str] | None:
    """(path, function) of a faulthandler frame line `  File "PATH", line N in FUNCTION`."""
    if not line.startswith(FRAME_PREFIX):
        return None
    path, sep, rest = line[len(FRAME_PREFIX) :].rpartition('", line ')
    if not sep:
        return None
    _, sep, function = rest.partition(" in ")
    return (path, function) if sep else None


class StackReader:
    """Reads one thread's stack as ["module:function", ...], innermost first (sender thread only)."""

    def __init__(self) -> None:
        self._file: IO[bytes] | None = None
        self._modules: dict[str, str] = {}
        self._refreshed = -float("inf")
        self._lock = threading.Lock()  # one dump at a time through the shared buffer

    def _buffer(self) -> IO[bytes]:
        if self._file is None:
            memfd = getattr(os, "memfd_create", None)  # Linux: in memory, no disk
            # Kept open for the reader's life (close() closes it): one buffer for every heartbeat.
            self._file = os.fdopen(memfd("stepwatch-stack"), "w+b") if memfd else tempfile.TemporaryFile()  # noqa: SIM115
        return self._file

    def _module_of(self, path: str) -> str:
        module = self._modules.get(path)
        if module is None and time.monotonic() - self._refreshed > MODULES_REFRESH_S:
            self._refreshed = time.monotonic()
            found: dict[str, str] = {}
            # dict.copy() is one C call: the training thread importing meanwhile cannot change the dict
            # under it (iterating sys.modules from this thread raised "changed size during iteration").
            for name, mod in sys.modules.copy().items():
                file = getattr(mod, "__file__", None)
                if isinstance(file, str):
                    found[file] = name
            self._modules = found
            module = found.get(path)
        return module or "?"

    def names(self, text: str, ident: int) -> list[str]:
        names: list[str] = []
        for line in _thread_block(text, ident):
            frame = parse_frame(line)
            if frame is None:
                continue
            path, function = frame
            module = self._module_of(path)
            if _own(module, path):
                continue
            names.append(f"{module}:{function}"[:MAX_FRAME_CHARS])
            if len(names) >= MAX_STACK_FRAMES:
                break
        return names

    def stack(self, ident: int) -> list[str]:
        """The stack of thread `ident`, or [] when the thread has ended."""
        with self._lock:
            f = self._buffer()
            f.seek(0)
            f.truncate()
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            text = f.read().decode("utf-8", "replace")
        return self.names(text, ident)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
