"""What a rank is doing while no step completes (detect/activity.py), and what the run context keeps of
its heartbeats: forward counts, stacks, sessions and restarts."""

from __future__ import annotations

import numpy as np
import pytest

from stepwatch_server.detect import activity
from stepwatch_server.detect.activity import CHECKPOINT, COLLECTIVE, EVAL, NONE
from tests.detect.hand_batches import BARRIER_STACK, EVAL_STACK, SAVE_STACK, START_TS, HandRun


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        ("torch.serialization:save", CHECKPOINT),
        ("torch.distributed.checkpoint.state_dict_saver:save", CHECKPOINT),
        ("torch.distributed.checkpoint.filesystem:_write_files_from_queue", CHECKPOINT),
        ("safetensors.torch:save_file", CHECKPOINT),
        ("transformers.modeling_utils:PreTrainedModel.save_pretrained", CHECKPOINT),
        ("transformers.trainer:Trainer._save_checkpoint", CHECKPOINT),
        ("deepspeed.runtime.engine:DeepSpeedEngine.save_checkpoint", CHECKPOINT),
        ("accelerate.accelerator:Accelerator.save_state", CHECKPOINT),
        ("torch.distributed.distributed_c10d:barrier", COLLECTIVE),
        ("torch.distributed.distributed_c10d:all_reduce", COLLECTIVE),
        ("torch.distributed.distributed_c10d:monitored_barrier", COLLECTIVE),
        ("torch.distributed._functional_collectives:wait_tensor", COLLECTIVE),
        ("torch.distributed.distributed_c10d:get_rank", NONE),
        ("torch.distributed.checkpointing_is_not_this:save", NONE),  # a prefix of the name is not the package
        ("train:save", NONE),
        ("train:unsave_pretrained", NONE),
        ("torch.autograd.graph:_engine_run_backward", NONE),
    ],
)
def test_frames(frame: str, expected: int) -> None:
    assert activity.frame_activity(frame) == expected


def test_stacks_a_save_anywhere_wins_over_a_collective_inside_it() -> None:
    assert activity.stack_activity(SAVE_STACK) == CHECKPOINT
    assert activity.stack_activity(BARRIER_STACK) == COLLECTIVE
    dcp = (
        "torch.distributed.distributed_c10d:gather_object",
        "torch.distributed.checkpoint.utils:_DistWrapper.gather_object",
        "torch.distributed.checkpoint.state_dict_saver:save",
        "train:main",
    )
    assert activity.stack_activity(dcp) == CHECKPOINT
    assert activity.stack_activity(EVAL_STACK) == NONE
    assert activity.stack_activity(()) == NONE
    assert activity.first_frame(BARRIER_STACK, COLLECTIVE) == BARRIER_STACK[0]


def test_rank_activity_is_what_the_heartbeats_said_recently() -> None:
    nan = np.nan
    nograd = np.array([10, 10, 10, -1, 10, 0, 0])
    at_step = np.array([0, 10, 0, -1, 0, 0, 0])
    moved = np.array([95.0, 95.0, 70.0, nan, 95.0, nan, nan])
    saved = np.array([nan, nan, nan, 99.0, nan, 90.0, 70.0])
    stacks = np.array([NONE, COLLECTIVE, NONE, CHECKPOINT, COLLECTIVE, COLLECTIVE, COLLECTIVE], dtype=np.int8)
    got = activity.rank_activity(nograd, at_step, moved, saved, stacks, event_now=100.0, recent_s=15.0)
    # evaluating now / no forward since its step / evaluated, 30 s ago / saving now / evaluating while in an
    # all-reduce / saved 10 s ago, now in the barrier after it / saved 30 s ago, now in a collective
    assert got.tolist() == [EVAL, COLLECTIVE, NONE, CHECKPOINT, EVAL, CHECKPOINT, COLLECTIVE]


def test_context_keeps_counters_at_the_last_step_and_follows_sessions() -> None:
    run = HandRun(world_size=2)
    run.train(1, 8)
    ctx = run.engine.runs[run.run].ctx
    assert ctx.forwards.tolist() == [8, 8] and ctx.nograd_at_step.tolist() == [0, 0]
    run.wait(10.0, nograd_per_beat={0: 5}, stack={0: EVAL_STACK, 1: BARRIER_STACK})
    assert ctx.nograd_forwards.tolist() == [10, 0] and ctx.nograd_at_step.tolist() == [0, 0]
    assert ctx.nograd_moved_ts[0] == run.now and np.isnan(ctx.nograd_moved_ts[1])
    assert ctx.stack[1] == BARRIER_STACK and ctx.stack_activity.tolist() == [NONE, COLLECTIVE]
    run.wait(5.0, stack={0: SAVE_STACK, 1: BARRIER_STACK})
    assert ctx.checkpoint_seen_ts[0] == run.now and np.isnan(ctx.checkpoint_seen_ts[1])
    assert np.isnan(ctx.restart_ts)

    old = run.ranks[0].session
    run.now += 60.0
    run.restart()
    run.wait(5.0)
    assert ctx.restart_ts == run.now and ctx.session[0] == run.ranks[0].session != old
    assert ctx.nograd_forwards.tolist() == [0, 0] and ctx.nograd_at_step.tolist() == [0, 0]
    # A late batch of the earlier session (its spool, replayed by the new one) is not another restart.
    late = run.ranks[0]
    run.ranks[0] = type(late)(session=old, seq=1000)
    run.feed(0, [], [], {"ts": START_TS + 1.0, "phase": "data", "last_step": 8})
    run.ranks[0] = late
    assert ctx.session[0] == late.session and ctx.restart_ts == run.now


def test_a_together_warning_resolves_once_the_stall_is_recognised_as_an_eval() -> None:
    run = HandRun()
    run.train(1, 100)
    run.wait(620.0, activity=False)  # the heartbeats say nothing yet (10 min: together_idle_s)
    (hang,) = run.hangs()
    assert hang.evidence["mode"] == "together" and hang.status == "open"
    run.wait(30.0, nograd_per_beat=10, stack=EVAL_STACK)
    assert hang.status == "resolved", hang.summary
    assert hang.evidence["resolution"] == "recognised as an unmarked eval (ranks 0, 1, 2, 3)"
    run.wait(60.0, nograd_per_beat=10, stack=EVAL_STACK)
    run.train(101, 8)
    assert len(run.hangs()) == 1
