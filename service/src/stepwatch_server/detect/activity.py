"""What a rank's training thread is doing while no step completes: evaluating, saving a checkpoint, or
waiting in a collective. The `hang` detector asks, because users forget `watch.phase(...)`.

The agent's heartbeat says it (docs/ingest.md, `heartbeat`): how many forwards of the watched model ran,
and how many of them with autograd off (`nograd_forwards`), and the training thread's innermost frames
(`stack`, "module:qualname", innermost first). A rank is

- `eval` when its no-grad forwards advanced since its last completed step and did so recently (within
  `recent_s` of event time; a rank that evaluated once after its last step and then stopped is not
  evaluating any more);
- else `checkpoint` when a heartbeat within `recent_s` showed a save call on its stack
  (`CHECKPOINT_FRAMES`). "Recently", not "now", for both: a pause's end is seen in the heartbeats a few
  seconds before the steps that follow it arrive (the agent hands over the steps before the pause with
  the next step's), and that gap must not read as a stop;
- else `collective` when a frame of its stack is a collective of torch.distributed
  (`COLLECTIVE_FRAMES`): the rank waits for its peers there;
- else unknown (`NONE`): no heartbeat fields, or a stack that says none of these.

Frame patterns are "module:function". The module part is a module name, "prefix.*" (the package and
everything under it) or "*"; the function part is "*" or matches a frame's qualname when equal to it or
to its last dotted parts ("save_pretrained" matches "PreTrainedModel.save_pretrained"). A stack is
classified when its heartbeat arrives (plain Python over at most 16 frames, each frame's answer cached);
ranks are classified together, vectorised, only when the hang detector looks at a stall.
"""

from __future__ import annotations

import functools

import numpy as np

NONE, EVAL, CHECKPOINT, COLLECTIVE = 0, 1, 2, 3
NAMES = {NONE: None, EVAL: "eval", CHECKPOINT: "checkpoint", COLLECTIVE: "collective"}
BUSY = (EVAL, CHECKPOINT)  # activities that are a pause, not a wait

CHECKPOINT_FRAMES = (
    "torch.serialization:save",
    "torch.serialization:_save",
    "torch.distributed.checkpoint.*:*",  # dcp.save / async_save / load and everything below them
    "safetensors.torch:save_file",
    "safetensors.torch:save_model",
    "*:save_pretrained",  # transformers, peft, diffusers
    "*:save_checkpoint",  # deepspeed, lightning, megatron
    "*:_save_checkpoint",  # transformers.Trainer
    "*:save_state",  # accelerate
)
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_coalesced",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "send_object_list",
    "recv_object_list",
    "batch_isend_irecv",
)
COLLECTIVE_FRAMES = (
    *(f"torch.distributed.distributed_c10d:{name}" for name in COLLECTIVES),
    "torch.distributed._functional_collectives:wait_tensor",
    "*:Work.wait",
)
FRAME_CACHE_SIZE = 8192  # distinct frame strings whose answer is remembered (a run has few)


def _matches(frame: str, pattern: str) -> bool:
    module, _, qualname = frame.partition(":")
    want_module, _, want_function = pattern.partition(":")
    if want_module.endswith(".*"):
        package = want_module[:-2]
        if module != package and not module.startswith(package + "."):
            return False
    elif want_module not in ("*", module):
        return False
    return want_function in ("*", qualname) or qualname.endswith("." + want_function)


@functools.lru_cache(maxsize=FRAME_CACHE_SIZE)
def frame_activity(frame: str) -> int:
    """CHECKPOINT, COLLECTIVE or NONE for one "module:qualname" frame."""
    if any(_matches(frame, p) for p in CHECKPOINT_FRAMES):
        return CHECKPOINT
    if any(_matches(frame, p) for p in COLLECTIVE_FRAMES):
        return COLLECTIVE
    return NONE


def stack_activity(stack: tuple[str, ...]) -> int:
    """A stack with a save call anywhere is a checkpoint (a save may wait in a collective inside it, as
    torch.distributed.checkpoint does); else one with a collective anywhere waits in it; else NONE."""
    codes = [frame_activity(f) for f in stack]
    if CHECKPOINT in codes:
        return CHECKPOINT
    return COLLECTIVE if COLLECTIVE in codes else NONE


def first_frame(stack: tuple[str, ...], activity: int) -> str | None:
    """The innermost frame of `stack` that shows `activity` (for the summary), or None."""
    return next((f for f in stack if frame_activity(f) == activity), None)


def rank_activity(
    nograd: np.ndarray,
    nograd_at_step: np.ndarray,
    nograd_moved_ts: np.ndarray,
    checkpoint_seen_ts: np.ndarray,
    stack_codes: np.ndarray,
    event_now: float,
    recent_s: float,
) -> np.ndarray:
    """Per rank EVAL, CHECKPOINT, COLLECTIVE or NONE (int8), from the context's arrays (-1 / NaN: not
    reported)."""
    with np.errstate(invalid="ignore"):  # NaN (never): False
        evaluated = event_now - nograd_moved_ts <= recent_s
        saving = event_now - checkpoint_seen_ts <= recent_s
    evaluating = (nograd_at_step >= 0) & (nograd > nograd_at_step) & evaluated
    codes = np.where(saving, CHECKPOINT, np.where(stack_codes == CHECKPOINT, NONE, stack_codes))
    return np.where(evaluating, EVAL, codes).astype(np.int8)
