"""The default process group as a membership that can change at run time: torch's reconfigurable gloo groups.

torch 2.14 added them (experimental, private names: ``init_process_group(enable_reconfigure=True)``,
``_get_reconfigure_handle``, ``_reconfigure``); this module is the only place that calls them. A member joins with a
stable id of its own (never reused: two fresh processes with one id have equal handles), and every change of the
members is one epoch: each member publishes its handle in the store under the epoch, reads the others' in the
order agreed for the epoch, and reconfigures with the epoch's uuid (fresh on every change: a store refuses a reused
one). Its rank is then its position in that order. What was tried and measured: ``../shared/notes/reconfigure-probe.md``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

__all__ = ["MAX_MEMBER_IDS", "join", "reconfigure", "supported"]

MAX_MEMBER_IDS = 1 << 16  # the initial world size: ids (ranks before the first epoch) stay below it


def supported() -> bool:
    """Whether this torch has reconfigurable process groups."""
    return hasattr(dist, "_reconfigure") and hasattr(dist, "_get_reconfigure_handle")


def join(store: dist.Store, member_id: int, timeout: timedelta) -> None:
    """Start the default (gloo) group for a member that reconfigures: no peer is contacted until an epoch."""
    if not supported():
        raise RuntimeError("live membership needs torch >= 2.14 (reconfigurable process groups)")
    dist.init_process_group(
        "gloo", store=store, rank=member_id, world_size=MAX_MEMBER_IDS, timeout=timeout, enable_reconfigure=True
    )


def reconfigure(
    store: dist.Store, epoch: int, uuid: int, members: list[int], member_id: int, timeout: timedelta,
    abandon: Callable[[], bool] | None = None,
) -> bool:
    """Make the default group ``members`` (by stable id, in rank order) for ``epoch``; True once reconfigured, False
    if a member's handle did not come within ``timeout`` or ``abandon()`` turned true meanwhile (the epoch was
    superseded). A failed ``_reconfigure`` raises and leaves the group as it was."""
    store.set(f"handle/{epoch}/{member_id}", dist._get_reconfigure_handle())
    keys = [f"handle/{epoch}/{m}" for m in members]
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(keys):
        if (abandon is not None and abandon()) or time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    handles = [store.get(key).decode() for key in keys]
    dist._reconfigure(uuid, handles, timeout=timeout).wait()
    return True
