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
import sysconfig
import tempfile
import threading
import time
from typing import IO, Any

MAX_STACK_FRAMES = 16  # frames shipped per heartbeat (docs/ingest.md, `heartbeat.stack`)
MAX_FRAME_CHARS = 200  # characters per frame, "module:function"
OWN_PACKAGE = "stepwatch"
OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
MODULES_REFRESH_S = 30.0
FRAME_PREFIX = '  File "'
IDENT_DIGITS = 2 * struct.calcsize("L")  # faulthandler prints a thread id as 0x%0*lx


# Every thread's stack, for the collector's `stacks` command (_commands.py): bounded in threads and frames.
MAX_THREADS = 64
MAX_THREAD_FRAMES = 64
THREAD_PREFIX = ("Thread 0x", "Current thread 0x")


def _library_dirs() -> tuple[str, ...]:
    """Where the interpreter's and the installed packages' files live: a frame elsewhere is the project's."""
    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(sorted(os.path.abspath(d) + os.sep for d in dirs if d))


LIBRARY_DIRS = _library_dirs()


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
    frame = parse_frame_line(line)
    return None if frame is None else (frame[0], frame[2])


def parse_frame_line(line: str) -> tuple[str, int, str] | None:
    """(path, line number, function) of a faulthandler frame line `  File "PATH", line N in FUNCTION`."""
    if not line.startswith(FRAME_PREFIX):
        return None
    path, sep, rest = line[len(FRAME_PREFIX) :].rpartition('", line ')
    if not sep:
        return None
    number, sep, function = rest.partition(" in ")
    return (path, int(number) if number.isdigit() else 0, function) if sep else None


def _ident(header: str) -> int | None:
    """The thread id of a dump's header line `Thread 0x... (most recent call first):`."""
    hexa = header.partition("0x")[2].partition(" ")[0]
    try:
        return int(hexa, 16)
    except ValueError:
        return None


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

    def _dump(self) -> str:
        with self._lock:
            f = self._buffer()
            f.seek(0)
            f.truncate()
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            return f.read().decode("utf-8", "replace")

    def stack(self, ident: int) -> list[str]:
        """The stack of thread `ident`, or [] when the thread has ended."""
        return self.names(self._dump(), ident)

    def threads(self, training: int | None) -> list[dict[str, Any]]:
        """Every thread's stack, innermost frame first: `{"name", "training", "frames": [{"module",
        "function", "file", "line", "own"}]}` (`own`: the project's code, not the interpreter's or an
        installed package's), the training thread first; stepwatch's own threads and frames left out.
        At most MAX_THREADS threads of MAX_THREAD_FRAMES frames each (faulthandler itself stops at 100
        threads and 100 frames)."""
        names = {t.ident: t.name for t in threading.enumerate()}
        out: list[dict[str, Any]] = []
        for block in self._dump().split("\n\n"):
            lines = block.strip("\n").split("\n")
            if not lines or not lines[0].startswith(THREAD_PREFIX):
                continue
            ident = _ident(lines[0])
            name = names.get(ident, "?") if ident is not None else "?"
            if name.startswith("stepwatch-"):
                continue
            frames = []
            for line in lines[1:]:
                frame = parse_frame_line(line)
                if frame is None:
                    continue
                path, number, function = frame
                module = self._module_of(path)
                if _own(module, path):
                    continue
                own = not path.startswith(LIBRARY_DIRS) and not path.startswith("<")
                frames.append(
                    {"module": module, "function": function[:MAX_FRAME_CHARS], "file": path[-MAX_FRAME_CHARS:],
                     "line": number, "own": own}
                )  # fmt: skip
                if len(frames) >= MAX_THREAD_FRAMES:
                    break
            out.append({"name": name[:MAX_FRAME_CHARS], "training": ident == training, "frames": frames})
        out.sort(key=lambda t: not t["training"])
        return out[:MAX_THREADS]

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
