"""`replica_divergence`: a rank's parameters differ from those of its data-parallel replicas.

Why it matters: after the gradient all-reduce every replica applies the same update to the same
parameters, so replicas agree bit for bit. One that does not has silently diverged: silent data
corruption on a bad GPU, a non-deterministic kernel, a missed all-reduce, a rank restored from the
wrong checkpoint. Its loss may look perfectly normal while it trains a different model, and every
checkpoint written from it is wrong. Megatron checks this with parameter hashes; so do we, live.

Signal: on the steps that carry a parameter fingerprint (a device-side checksum the agent computes
every K steps), the ranks are grouped by the shard they hold (`ctx.shard`: DDP = one group of all
ranks; HSDP = one group per shard index across the replica groups). Within a group the majority
fingerprint (strictly more than half of the group's ranks that reported one) is the truth; every
rank that differs from it is raised, critical, on that step. It resolves when the rank agrees with
its group's majority again (e.g. re-synchronised from a checkpoint). A group without a strict
majority (two replicas disagreeing, a 2/2 split) cannot say who is wrong: one run-level anomaly
names the group and the split, resolved when the group agrees again.

Evidence: `step`, `shard`, `fingerprint` (the rank's), `majority_fingerprint`, `group_size`
(ranks that reported), `agreeing` (how many hold the majority), `diverged_ranks` (up to 16).

Defaults: none to tune. A fingerprint is exact: one disagreement is proof, and waiting for a second
one only delays the alarm by K steps.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar

import numpy as np

from stepwatch_server.detect.base import Detector
from stepwatch_server.detect.frames import StepFrame

KIND = "replica_divergence"
RUN_KEY = "run"
MAX_LISTED = 16


class ReplicaDivergenceDetector(Detector):
    kind: ClassVar[str] = KIND

    def on_frame(self, frame: StepFrame) -> None:
        if not frame.fingerprints:
            return
        ctx, book = self.ctx, self.ctx.book
        ranks = np.fromiter(frame.fingerprints.keys(), dtype=np.int64, count=len(frame.fingerprints))  # rows
        values = np.array(list(frame.fingerprints.values()))
        shards = ctx.shard[ranks]
        split_groups: list[dict[str, Any]] = []
        for shard in np.unique(shards).tolist():
            in_group = shards == shard
            g_ranks, g_values = ranks[in_group], values[in_group]
            counts = Counter(g_values.tolist())
            top, n_top = counts.most_common(1)[0]
            if 2 * n_top <= g_ranks.size:
                if g_ranks.size > 1:
                    split_groups.append(
                        {"shard": int(shard), "group_size": int(g_ranks.size),
                         "split": sorted(counts.values(), reverse=True)[:MAX_LISTED]}
                    )  # fmt: skip
                continue
            bad = g_ranks[g_values != top]
            for r in ctx.ranks[g_ranks[g_values == top]].tolist():
                if book.is_open(KIND, f"rank:{r}"):
                    book.resolve(KIND, f"rank:{r}", step=frame.step, ts=frame.ts, note="agrees again")
            for r in bad.tolist():  # rows
                fp = frame.fingerprints[r]
                rank = ctx.rank_of(r)
                prior = book.get(KIND, f"rank:{rank}")
                since = f", first at step {prior.first_step}" if prior is not None else ""
                book.raise_(
                    KIND,
                    f"rank:{rank}",
                    step=frame.step,
                    ts=frame.ts,
                    severity="critical",
                    summary=(
                        f"{ctx.where(r)}: parameter fingerprint {fp} at step {frame.step} differs from "
                        f"{n_top} of {g_ranks.size} replicas of shard {shard} ({top}){since}: its parameters diverged"
                    ),
                    evidence={
                        "step": frame.step,
                        "shard": int(shard),
                        "fingerprint": fp,
                        "majority_fingerprint": top,
                        "group_size": int(g_ranks.size),
                        "agreeing": int(n_top),
                        "diverged_ranks": ctx.ranks[bad[:MAX_LISTED]].tolist(),
                    },
                    rank=rank,
                    node=ctx.node[r],
                )
        if split_groups:
            book.raise_(
                KIND,
                RUN_KEY,
                step=frame.step,
                ts=frame.ts,
                severity="critical",
                summary=(
                    f"replicas disagree with no majority at step {frame.step} in "
                    f"{len(split_groups)} shard group(s) (shard {split_groups[0]['shard']}: split "
                    f"{split_groups[0]['split']}): cannot tell which replica is wrong"
                ),
                evidence={"step": frame.step, "groups": split_groups[:MAX_LISTED]},
            )
        elif book.is_open(KIND, RUN_KEY):
            book.resolve(KIND, RUN_KEY, step=frame.step, ts=frame.ts, note="replicas agree again")
