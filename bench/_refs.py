"""Older checkouts for side-by-side benchmarks: a detached `git worktree` of a ref under /tmp."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worktree(ref: str) -> Path:
    """A detached worktree of `ref` under /tmp (made once, reused while it stays at that commit)."""
    sha = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", f"{ref}^{{commit}}"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    path = Path("/tmp") / f"stepwatch-ref-{sha[:12]}"
    if not (path / "service" / "src" / "stepwatch_server").is_dir():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), sha], check=True)
    head = subprocess.run(
        ["git", "-C", str(path), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    )
    if head.stdout.strip() != sha:
        raise SystemExit(
            f"{path} is at {head.stdout.strip()[:12]}, not {sha[:12]}: remove it (git worktree remove)"
        )
    return path
