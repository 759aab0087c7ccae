"""The named scenario library the detectors are scored on.

Every anomaly kind appears alone at least once, several at the hard end of their range (a 10%
straggler, a 1.25x loss spike among 128 ranks, a 1 MB/step leak between allocator plateaus), some
together (a node failure: all 8 ranks of a node slow, then a hang elsewhere), and long clean runs full
of benign look-alikes (GC blips, eval/checkpoint pauses, allocator plateaus, warm-up noise, isolated
grad-norm spikes) measure false alarms. `QUICK` names the small ones that tests can afford;
`DEMO_BY_KIND` names one readable scenario per kind for `stepwatch-server demo --inject KIND`.
"""

from __future__ import annotations

import zlib
from typing import Any

from stepwatch_server.simulate.scenario import (
    Divergence,
    Fault,
    Fp8OverflowRisk,
    Hang,
    LossSpike,
    MemoryLeak,
    NonFinite,
    ReplicaDivergence,
    Scenario,
    SlowNode,
    Straggler,
    ThroughputDrop,
)

SCENARIOS: dict[str, Scenario] = {}


def _add(name: str, description: str, world_size: int, steps: int, *faults: Fault, **kw: Any) -> None:
    kw.setdefault("seed", zlib.crc32(name.encode()))  # stable across Python processes
    kw.setdefault("eval_every", 1000)
    SCENARIOS[name] = Scenario(name, world_size, steps, faults=faults, description=description, **kw)


# -- clean runs: false alarms ---------------------------------------------------------------------------
_add("clean_8", "8 ranks, 3k steps, evals every 1k: the smallest honest run", 8, 3000)
_add(
    "clean_long_64",
    "64 ranks x 20k steps with evals, checkpoints, GC blips, slow-storage blips, allocator plateaus",
    64, 20_000, eval_every=2000, eval_s=60.0, ckpt_every=5000, ckpt_s=120.0, gc_rate=1 / 400,
    plateaus_per_10k=2.0,
)  # fmt: skip
_add(
    "clean_wide_512",
    "512 ranks (64 nodes) x 5k steps: cross-rank statistics at scale",
    512,
    5000,
    ckpt_every=2500,
)
_add(
    "clean_noisy_256",
    "256 ranks x 4k short (120 ms) steps, double noise, frequent GC and storage blips, grad-norm spikes",
    256, 4000, step_ms=120.0, noise=2.0, gc_rate=1 / 150, global_blip_rate=1 / 400, grad_spike_rate=1 / 300,
)  # fmt: skip
_add(
    "clean_slow_steps_16",
    "16 ranks x 3k slow (4 s) steps: 5x the median step (20 s) is below the 30 s hang floor",
    16, 3000, step_ms=4000.0, ckpt_every=1500, ckpt_s=240.0,
)  # fmt: skip
_add(
    "clean_long_8",
    "8 ranks x 25k fast steps with long warm-up: the whole LR schedule, many plateaus and blips",
    8, 25_000, step_ms=150.0, warmup_steps=2000, eval_every=2500, plateaus_per_10k=4.0,
)  # fmt: skip

# -- one fault each -----------------------------------------------------------------------------------------
_add("loss_spike_8", "loss x1.6 at step 1500 on 8 ranks, recovers in 30 steps", 8, 2500, LossSpike(1500))
_add(
    "loss_spike_small_128", "a 1.25x loss spike among 128 ranks, recovering in 20 steps", 128, 3000,
    LossSpike(2200, magnitude=1.25, recovery_steps=20),
)  # fmt: skip
_add(
    "divergence_spike_32", "loss jumps x1.8 at 1800 and stays", 32, 2600,
    Divergence(1800, mode="spike-no-recover"),
)  # fmt: skip
_add("divergence_trend_16", "loss trends up 0.4%/step from 1500", 16, 2200, Divergence(1500, mode="trend"))
_add(
    "divergence_nan_64", "loss trends up from 2500 and goes NaN on every rank 40 steps later", 64, 3000,
    Divergence(2500, mode="nonfinite", rate_per_step=0.01),
)  # fmt: skip
_add(
    "nonfinite_act_8", "rank 5: NaN from layers.3.attn.qkv at step 1234 (skipped step)", 8, 2000,
    NonFinite(1234, ranks=(5,), module="layers.3.attn.qkv"),
)  # fmt: skip
_add(
    "nonfinite_loss_64", "rank 40: NaN loss (a bad sample) at step 777", 64, 1500,
    NonFinite(777, ranks=(40,), where="loss"),
)  # fmt: skip
_add(
    "nonfinite_multi_128", "ranks 17 and 99: NaN in lm_head at step 2001; grads overflow everywhere at 2600",
    128, 3000, NonFinite(2001, ranks=(17, 99), module="lm_head"), NonFinite(2600, where="grads"),
)  # fmt: skip
_add(
    "straggler_10pct_fwd_64", "rank 17: forward 10% slower from step 1000 on", 64, 2500,
    Straggler(17, 1000, factor=1.10),
)  # fmt: skip
_add(
    "straggler_10pct_data_16", "rank 6: data loading 10% slower from step 800 on", 16, 2000,
    Straggler(6, 800, factor=1.10, phase="data"),
)  # fmt: skip
_add(
    "straggler_2x_512", "rank 300: forward 2x slower for 600 steps from 1500, then recovers", 512, 3000,
    Straggler(300, 1500, factor=2.0, duration=600),
)  # fmt: skip
_add(
    "slow_node_64", "node gpu-003: 7 of its 8 ranks 30% slower in forward from 1200", 64, 2500,
    SlowNode(3, 1200, factor=1.3, slow_ranks=7),
)  # fmt: skip
_add(
    "hang_stuck_32", "rank 9 stuck in its data loader at step 2500; everyone else waits in backward", 32, 3000,
    Hang(9, 2500, mode="stuck", phase="data"),
)  # fmt: skip
_add(
    "hang_dead_256", "rank 200 dies during step 1800 (its heartbeats stop, unsent steps lost)", 256, 2500,
    Hang(200, 1800, mode="dead"),
)  # fmt: skip
_add(
    "hang_slow_steps_16", "4 s steps; rank 3 stuck in forward at step 400 (hang must wait >= 30 s)", 16, 600,
    Hang(3, 400, mode="stuck", phase="forward"), step_ms=4000.0, eval_every=0,
)  # fmt: skip
_add("memory_leak_8", "rank 3 leaks 4 MB/step from step 1000", 8, 3000, MemoryLeak(3, 1000, mb_per_step=4.0))
_add(
    "memory_leak_slow_128", "rank 64 leaks 1 MB/step from 1500 among frequent allocator plateaus", 128, 4000,
    MemoryLeak(64, 1500, mb_per_step=1.0), plateaus_per_10k=6.0,
)  # fmt: skip
_add(
    "replica_divergence_64", "rank 42's parameters silently diverge at step 1234", 64, 2500,
    ReplicaDivergence(42, 1234),
)  # fmt: skip
_add(
    "fp8_logits_32", "layers.3.attn.logits amax grows 0.4%/step from 1500 (crosses 448 ~600 steps later)", 32,
    2600, Fp8OverflowRisk("layers.3.attn.logits", 1500),
)  # fmt: skip
_add(
    "throughput_drop_64", "every rank 40% slower from step 1600 (power capping)", 64, 2800,
    ThroughputDrop(1600, factor=1.4),
)  # fmt: skip

# -- several at once -----------------------------------------------------------------------------------
_add(
    "node_failure_64", "node gpu-002 (8 ranks) 50% slower from 1500, then rank 50 dies at 2400", 64, 2800,
    SlowNode(2, 1500, factor=1.5), Hang(50, 2400, mode="dead"),
)  # fmt: skip
_add(
    "multi_spike_leak_fp8_128", "a loss spike, a slow leak on rank 7 and attention logits outgrowing FP8",
    128, 4000, LossSpike(1500, magnitude=1.4), MemoryLeak(7, 2000, mb_per_step=2.0),
    Fp8OverflowRisk("layers.3.attn.logits", 2500, growth_per_step=0.006),
)  # fmt: skip
_add(
    "multi_straggler_replica_256", "a 10% straggler (rank 130), a replica divergence (rank 5), a NaN (rank 255)",
    256, 3000, Straggler(130, 900, factor=1.10), ReplicaDivergence(5, 1650), NonFinite(2300, ranks=(255,)),
)  # fmt: skip
_add(
    "multi_throughput_then_divergence_32", "a temporary throughput drop, a recovered spike, then divergence",
    32, 4000, ThroughputDrop(1200, factor=1.3, duration=400), LossSpike(2000, magnitude=1.5),
    Divergence(3200, mode="spike-no-recover", magnitude=2.0),
)  # fmt: skip

QUICK: tuple[str, ...] = (
    "clean_8",
    "loss_spike_8",
    "divergence_trend_16",
    "nonfinite_act_8",
    "straggler_10pct_data_16",
    "hang_slow_steps_16",
    "memory_leak_8",
    "fp8_logits_32",
)

DEMO_BY_KIND: dict[str, str] = {
    "loss_spike": "loss_spike_8",
    "divergence": "divergence_trend_16",
    "nonfinite": "nonfinite_act_8",
    "straggler": "straggler_10pct_fwd_64",
    "slow_node": "slow_node_64",
    "hang": "hang_stuck_32",
    "memory_leak": "memory_leak_8",
    "replica_divergence": "replica_divergence_64",
    "fp8_overflow_risk": "fp8_logits_32",
    "throughput_drop": "throughput_drop_64",
}


def clean_names() -> list[str]:
    return [name for name, scn in SCENARIOS.items() if scn.clean]
