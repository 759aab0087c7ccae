"""Evidence asked at the moment of a verdict: when an anomaly of a kind in `EVIDENCE` opens, every rank of
its run is asked for it (a command, store.py), in the transaction that stores the anomaly, so that the
evidence is read while the problem is still there. The command carries the anomaly's id: its view puts
the blamed rank's group first, and the anomaly's answer lists it (detect/routes.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from sqlalchemy import Connection, select

from stepwatch_server.commands import store
from stepwatch_server.storage.models import Rank

if TYPE_CHECKING:
    from stepwatch_server.detect.store import Stored

# anomaly kind -> the command asked when one opens: every rank's stacks at a hang; a profile of the blamed rank
# and one healthy peer at a straggler or a slow node.
EVIDENCE = {"hang": "stacks", "straggler": "profile", "slow_node": "profile"}
PROFILE_STEPS = 5


def ask_at_verdicts(conn: Connection, stored: Sequence[Stored]) -> list[int]:
    """Ask for the evidence of each anomaly that opened (new, or open again); the commands' ids."""
    asked = []
    for s in stored:
        kind = EVIDENCE.get(s.anomaly.kind)
        if kind is None or s.anomaly.status != "open" or s.before_status == "open":
            continue
        reason = f"{s.anomaly.kind} opened: {s.anomaly.summary}"
        if kind == "stacks":
            asked.append(store.ask(conn, s.run_id, kind, None, {}, "detection", reason, s.id))
            continue
        pair = _slow_and_peer(conn, s.run_id, s.anomaly.rank, s.anomaly.node)
        if pair is not None:
            args = {"steps": PROFILE_STEPS}
            asked.append(store.ask(conn, s.run_id, kind, pair, args, "detection", reason, s.id))
    return asked


def _slow_and_peer(conn: Connection, run_id: int, rank: int | None, node: str | None) -> list[int] | None:
    """The blamed rank (a slow node's lowest rank) and a peer: the lowest rank on another node, else the
    lowest other rank; None when the run has no such pair."""
    found = conn.execute(select(Rank.rank, Rank.node).where(Rank.run_id == run_id).order_by(Rank.rank)).all()
    if rank is None:
        rank = next((r for r, n in found if node is not None and n == node), None)
    if rank is None:
        return None
    blamed_node = next((n for r, n in found if r == rank), node)
    others = [(r, n) for r, n in found if r != rank]
    peer = next((r for r, n in others if n != blamed_node), None)
    if peer is None and others:
        peer = others[0][0]
    return None if peer is None else [rank, peer]
