"""A bounded on-disk queue of batches for while the collector is unreachable."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from ._guard import Counters, Guard

SUFFIX = ".json.gz"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def spool_path(base: Path, run: str, rank: int) -> Path:
    """`<base>/<run>/rank-<rank>`, always one folder right under `base`: a run name with characters
    unsafe in paths (a `/` among them) or made only of dots (`.`, `..`: not a folder of its own) has
    them replaced and a short hash of the name added, so distinct names keep distinct folders."""
    safe = _UNSAFE.sub("_", run)
    if not safe.strip("."):
        safe = safe.replace(".", "_")
    if safe != run:
        safe = f"{safe}-{hashlib.sha1(run.encode()).hexdigest()[:8]}"
    return base.expanduser() / safe / f"rank-{rank}"


class Spool:
    """Files named `<session start ns>-<session>-<seq>.json.gz`, so that name order is send order:
    older sessions first, then by seq. Written atomically (temporary file + rename). When the bound
    is reached, the oldest files are deleted and counted (`dropped_spool_full`).
    Used by the sender thread only (and by close() after the sender thread is gone)."""

    def __init__(self, directory: Path, max_bytes: int, counters: Counters, guard: Guard) -> None:
        self.directory = directory
        self._max_bytes = max_bytes
        self._counters = counters
        self._guard = guard
        self._files: list[tuple[str, int]] = []  # (name, size), oldest first
        try:
            names = sorted(n for n in os.listdir(directory) if n.endswith(SUFFIX) and not n.startswith("."))
            self._files = [(n, (directory / n).stat().st_size) for n in names]
        except FileNotFoundError:
            pass
        except OSError as exc:
            guard.fail("spool", exc, disable=False)
        self._bytes = sum(size for _, size in self._files)

    def __len__(self) -> int:
        return len(self._files)

    def put(self, key: str, body: bytes) -> bool:
        """Queue a batch behind the others; False when it could not be written."""
        if len(body) > self._max_bytes:
            self._counters.add("dropped_spool_full")
            return False
        while self._files and self._bytes + len(body) > self._max_bytes:
            self._drop_oldest()
        name = key + SUFFIX
        tmp = self.directory / f".{name}.tmp"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(body)
            os.replace(tmp, self.directory / name)
        except OSError as exc:
            self._guard.fail("spool", exc, disable=False)
            return False
        self._files.append((name, len(body)))
        self._files.sort()
        self._bytes += len(body)
        self._counters.add("spooled_batches")
        return True

    def oldest(self) -> tuple[str, bytes] | None:
        while self._files:
            name = self._files[0][0]
            try:
                return name, (self.directory / name).read_bytes()
            except OSError as exc:
                self._guard.fail("spool", exc, disable=False)
                self.remove(name)
        return None

    def remove(self, name: str) -> None:
        for i, (n, size) in enumerate(self._files):
            if n == name:
                del self._files[i]
                self._bytes -= size
                break
        try:
            os.unlink(self.directory / name)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._guard.fail("spool", exc, disable=False)

    def _drop_oldest(self) -> None:
        self.remove(self._files[0][0])
        self._counters.add("dropped_spool_full")


QUARANTINE = "quarantine"  # under the spool directory: batches the collector will not take
QUARANTINE_FILES = 32  # kept for inspection, newest; older ones are deleted


class Quarantine:
    """Batches set aside so that the ones behind them go on: refused with a 4xx (other than 408/429),
    or answered with a server error (a 5xx other than 502-504) on `MAX_ANSWERED_FAILURES` tries. Each is kept as `<name>` (the gzip JSON body as sent) beside
    `<name>.reason.txt` (status and message), at most QUARANTINE_FILES of them, newest kept; counted
    in `quarantined_batches`. Sender thread only."""

    def __init__(self, directory: Path, counters: Counters, guard: Guard) -> None:
        self.directory = directory
        self._counters = counters
        self._guard = guard

    def put(self, name: str, body: bytes, reason: str) -> None:
        self._counters.add("quarantined_batches")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".{name}.tmp"
            tmp.write_bytes(body)
            os.replace(tmp, self.directory / name)
            (self.directory / f"{name}.reason.txt").write_text(reason[:2000] + "\n", encoding="utf-8")
            kept = sorted(
                n for n in os.listdir(self.directory) if n.endswith(SUFFIX) and not n.startswith(".")
            )
            for old in kept[: max(0, len(kept) - QUARANTINE_FILES)]:
                for path in (self.directory / old, self.directory / f"{old}.reason.txt"):
                    path.unlink(missing_ok=True)
        except OSError as exc:
            self._guard.fail("spool", exc, disable=False)
