"""Resuming an LR schedule whose configuration changed: the position comes from the checkpoint, the shape from the
configuration.

Users resume with another ``steps=`` (or warmup) on purpose, to train longer. torch's ``load_state_dict`` restores
a scheduler's configuration with its position (``T_max``, milestones), so the LR would follow the old schedule (past
the old ``T_max`` cosine annealing's recurrence climbs back up), and a warmup that appears or disappears changes the
scheduler's class (``CosineAnnealingLR`` or ``SequentialLR``), whose states do not load into each other.
"""

from __future__ import annotations

from typing import Any

import torch
from loguru import logger
from torch.optim.lr_scheduler import LRScheduler

from decent_train.engine.optimizers import LRSchedulerFn

__all__ = ["load_scheduler_state"]

# Where a scheduler is in its schedule (and torch's bookkeeping of it), not what the schedule is.
POSITION_KEYS = frozenset({"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial",
                           "verbose"})


def load_scheduler_state(
    scheduler: LRScheduler, saved: dict[str, Any], lr_scheduler_fn: LRSchedulerFn | None,
    rebuilt: dict[str, dict[str, Any]],
) -> None:
    """Load ``saved`` into ``scheduler`` (built from the current configuration) after its optimizer's state.

    The same configuration (``saved`` without its position equals ``scheduler``'s state without its own) loads
    ``saved`` as it is: bit-identical to before. Another one takes the LR the current schedule gives at ``saved``'s
    step, exactly as if the run had been configured so from the start: ``lr_scheduler_fn`` builds it on a throwaway
    optimizer with the current base LRs, steps it there, and its state is loaded; the optimizer's groups (whose
    loaded state carries the old schedule's LR) get its LR. ``rebuilt`` (one dict per load, shared by the buckets)
    keeps the stepped states: stepping to a late step costs ~1-2 s per 100k steps, once per distinct configuration.
    Without ``lr_scheduler_fn`` (a scheduler of unknown origin) ``saved`` is loaded as it is.
    """
    current = scheduler.state_dict()
    shape = _shape(current)
    if lr_scheduler_fn is None or shape == _shape(saved):
        scheduler.load_state_dict(saved)
        return
    base_lrs = _base_lrs(current, scheduler)
    position = int(saved["last_epoch"])
    key = repr((shape, base_lrs, position))
    if key not in rebuilt:
        if not rebuilt:
            logger.info(f"the LR schedule differs from the checkpoint's (another steps= or warmup): it follows this "
                        f"run's schedule from step {position}")
        rebuilt[key] = _stepped(lr_scheduler_fn, scheduler, base_lrs, position)
    scheduler.load_state_dict(rebuilt[key])
    for group, base_lr, lr in zip(scheduler.optimizer.param_groups, base_lrs, scheduler.get_last_lr()):
        group["lr"], group["initial_lr"] = lr, base_lr


def _shape(state: Any) -> Any:
    """A scheduler state without its position, recursively (``SequentialLR``'s ``_schedulers``)."""
    if isinstance(state, dict):
        return {k: _shape(v) for k, v in state.items() if k not in POSITION_KEYS}
    if isinstance(state, list):
        return [_shape(v) for v in state]
    return state


def _base_lrs(state: dict[str, Any], scheduler: LRScheduler) -> list[Any]:
    """The LRs the current schedule scales: its own ``base_lrs``, or its first part's (``SequentialLR``); else the
    ones its optimizer started from, which the loaded optimizer state may have replaced."""
    if "base_lrs" in state:
        return list(state["base_lrs"])
    parts = state.get("_schedulers")
    if parts and isinstance(parts[0], dict) and "base_lrs" in parts[0]:
        return list(parts[0]["base_lrs"])
    return [group.get("initial_lr", group["lr"]) for group in scheduler.optimizer.param_groups]


def _stepped(lr_scheduler_fn: LRSchedulerFn, like: LRScheduler, base_lrs: list[Any], position: int) -> dict[str, Any]:
    """The state of ``lr_scheduler_fn``'s schedule after ``position`` steps, built on a throwaway optimizer with
    ``like``'s groups' hyperparameters (a schedule may read them, e.g. ``OneCycleLR`` the momentum) at ``base_lrs``."""
    groups = [
        {**{k: v for k, v in group.items() if k not in ("params", "initial_lr")}, "params": [torch.zeros(0)], "lr": lr}
        for group, lr in zip(like.optimizer.param_groups, base_lrs)
    ]
    throwaway = torch.optim.SGD(groups)
    throwaway.defaults = {**like.optimizer.defaults, **throwaway.defaults}
    throwaway._opt_called = True  # type: ignore[attr-defined]  # no warning that the schedule steps alone
    schedule = lr_scheduler_fn(throwaway)
    while schedule.last_epoch < position:
        schedule.step()
    return schedule.state_dict()
