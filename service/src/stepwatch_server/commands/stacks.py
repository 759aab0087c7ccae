"""Every rank's stacks, grouped: the ranks whose training threads stand at the same frames are one group.

A hung collective shows as one big group (the ranks waiting in it) and the culprit apart from it; the
groups are listed smallest first (with the blamed rank's group, when a verdict named one, before all), so
the odd one out is read first. A frame is named "function (file:line)"; `own` marks the project's code.
"""

from __future__ import annotations

from typing import Any

MAX_SHOWN_RANKS = 64  # ranks listed by number in a group (all are counted)


def _training_frames(result: dict[str, Any] | None) -> list[dict[str, Any]]:
    for thread in (result or {}).get("threads") or []:
        if isinstance(thread, dict) and thread.get("training"):
            return [f for f in thread.get("frames") or [] if isinstance(f, dict)]
    return []


def _key(frames: list[dict[str, Any]]) -> tuple[tuple[str, str, int], ...]:
    return tuple((str(f.get("file")), str(f.get("function")), int(f.get("line") or 0)) for f in frames)


def describe(frames: list[dict[str, Any]]) -> str:
    """The innermost frame and the innermost frame of the project's own code: "all_reduce in backward
    at train.py:88"."""
    if not frames:
        return "no training-thread stack"
    inner = frames[0]
    own = next((f for f in frames if f.get("own")), None)
    text = str(inner.get("function"))
    if own is not None and own is not inner:
        text += f" in {own.get('function')}"
    where = own or inner
    return f"{text} at {str(where.get('file')).rsplit('/', 1)[-1]}:{where.get('line')}"


def group(
    answers: list[tuple[int, dict[str, Any] | None]], blamed: int | None = None
) -> list[dict[str, Any]]:
    """[(rank, result)] -> groups `{"ranks", "count", "summary", "frames"}` by identical training-thread
    frames, smallest first, the blamed rank's group first of all."""
    groups: dict[tuple[tuple[str, str, int], ...], list[int]] = {}
    frames_of: dict[tuple[tuple[str, str, int], ...], list[dict[str, Any]]] = {}
    for rank, result in answers:
        frames = _training_frames(result)
        key = _key(frames)
        groups.setdefault(key, []).append(rank)
        frames_of.setdefault(key, frames)
    ordered = sorted(groups.items(), key=lambda kv: (blamed not in kv[1], len(kv[1]), kv[1][0]))
    return [
        {
            "ranks": ranks[:MAX_SHOWN_RANKS],
            "count": len(ranks),
            "summary": f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}: {describe(frames_of[key])}",
            "frames": frames_of[key],
        }
        for key, ranks in ordered
    ]
