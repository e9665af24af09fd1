"""The engine's checkpoint state: everything besides the model that training needs to continue exactly.

The exchange in flight is completed when the state is taken and what it delivered is saved, to be mixed in at the
next step as it would have been. ``averageable_state`` leaves out what is one worker's own, so that M workers can
continue from the average of N workers' states.
"""

from __future__ import annotations

from typing import Any

import torch

from decent_train.engine.buckets import Bucket
from decent_train.engine.modes import GossipMode, Mode, ModeContext
from decent_train.engine.schedule_resume import load_scheduler_state

__all__ = ["averageable_state", "engine_state_dict", "load_engine_state_dict"]


@torch.no_grad()
def engine_state_dict(buckets: list[Bucket], context: ModeContext, mode: Mode) -> dict[str, Any]:
    """The step, each bucket's optimizer and LR scheduler, the scaler, the adaptive factor, the exchange in flight."""
    saved = []
    for bucket in buckets:
        context.complete_pending(bucket)
        pending = bucket.pending
        saved.append(
            {
                "names": list(bucket.names),
                "optimizer": bucket.optimizer.state_dict(),
                "scheduler": bucket.scheduler.state_dict() if bucket.scheduler is not None else None,
                "received": bucket.comm.clone() if pending is not None else None,
                "staged": pending.value.clone() if pending is not None and pending.value is not bucket.flat else None,
                "compressed": bucket.compressed.state() if bucket.compressed is not None else None,
            }
        )
    scaler = context.steps.scaler
    return {
        "step": context.progress.step,
        "world_size": context.members.world_size,
        "topology": mode.label,
        "phase_start": mode.start,
        "adaptive_factor": context.progress.adaptive_factor,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "buckets": saved,
    }


def averageable_state(state: dict[str, Any]) -> dict[str, Any]:
    """``engine_state_dict()`` without what is one worker's own: the exchange in flight and the compressed gossip's
    public copies. What the workers' states average to continues training on another number of workers: the mixing
    matrices are doubly stochastic, so the average of the saved models is also their average after the exchange in
    flight, and the copies restart from the averaged model."""
    buckets = [{**b, "received": None, "staged": None, "compressed": None} for b in state["buckets"]]
    return {**state, "buckets": buckets}


@torch.no_grad()
def load_engine_state_dict(buckets: list[Bucket], context: ModeContext, mode: Mode, state: dict[str, Any]) -> None:
    """Continue from ``engine_state_dict()``, or from an average of ``averageable_state``s (``averaged_from``)."""
    averaged = bool(state.get("averaged_from"))
    world_size = context.members.world_size
    if not averaged and (state["world_size"] != world_size or state["topology"] != mode.label):
        raise ValueError(
            f"the engine state is from {state['world_size']} workers with {state['topology']!r}; this engine has "
            f"{world_size} workers with {mode.label!r}"
        )
    if [b["names"] for b in state["buckets"]] != [b.names for b in buckets]:
        raise ValueError(
            "the engine state's buckets hold other parameters than this engine's (another model or bucket_size_in_mb?)"
        )
    context.progress.step = state["step"]
    mode.start = state.get("phase_start", 0)
    context.progress.adaptive_factor = state["adaptive_factor"]
    scaler = context.steps.scaler
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    rebuilt: dict[str, dict[str, Any]] = {}  # LR schedules of another configuration, stepped once for every bucket
    for bucket, saved in zip(buckets, state["buckets"]):
        context.wait_pending(bucket)  # nothing may still write into ``comm``
        bucket.optimizer.load_state_dict(saved["optimizer"])
        if bucket.scheduler is not None and saved["scheduler"] is not None:
            load_scheduler_state(bucket.scheduler, saved["scheduler"], bucket.lr_scheduler_fn, rebuilt)
        bucket.read_params(context.param_as_bucket_view)
        compressed = saved.get("compressed")
        if averaged:
            if bucket.compressed is not None:
                bucket.compressed.reset(bucket.flat)  # the same model on every worker
            continue
        if (compressed is None) != (bucket.compressed is None):
            raise ValueError("the engine state was saved with other compression settings than this engine's")
        if compressed is not None:
            bucket.compressed.load(compressed)
        if saved["received"] is not None and isinstance(mode, GossipMode):  # the exchange of this step's round
            bucket.comm.copy_(saved["received"])
            value = bucket.flat if saved.get("staged") is None else bucket.staging().copy_(saved["staged"])
            mode.resume_pending(bucket, value)
