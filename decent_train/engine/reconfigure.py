"""The members as process groups that change at run time: torch's reconfigurable groups (gloo, and nccl2 on GPUs).

torch 2.14 added them (experimental, private names: ``init_process_group(enable_reconfigure=True)``,
``_get_reconfigure_handle``, ``_reconfigure``); this module is the only place that calls them. A member joins with a
stable id of its own (never reused: two fresh processes with one id have equal handles), and every change of the
members is one epoch: each member publishes its handle in the store under the epoch, reads the others' in the
order agreed for the epoch, and reconfigures with the epoch's uuid (fresh on every change: a store refuses a reused
one). Its rank is then its position in that order. What was tried and measured:
``../shared/notes/reconfigure-probe.md``.

On CPU workers the default group (gloo) carries everything. On GPUs a second group carries the data (``nccl2``,
``data_group()``: the gossip's messages and collectives on CUDA tensors), because a group holding a CPU and a CUDA
backend refuses to reconfigure ("multiple backends"). The default group stays gloo and carries the control traffic
(state bytes to a joiner, object gathers, the record step's collectives), so every ``dist.*`` call without
``group=`` keeps working on CPU tensors. One epoch reconfigures both, the default group first; design and what is
untested: ``docs/design/live-nccl2.md``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = [
    "DATA_BACKEND_ENV", "MAX_MEMBER_IDS", "RENDEZVOUS_S", "PartlyReconfigured", "RendezvousFailed", "control_device",
    "data_backend_for", "data_group", "group_uuid", "join", "reconfigure", "supported", "why_unsupported",
]

MAX_MEMBER_IDS = 1 << 16  # the initial world size: ids (ranks before the first epoch) stay below it
# The default group's rendezvous, at most (and at most comm_timeout_s). Every member published its handles just before
# and read the others' after, so it waits for connections only (a whole change takes well under a second:
# docs/fault-tolerance.md): a member that died after publishing its handles costs the others this, not comm_timeout_s.
RENDEZVOUS_S = 30.0
DATA_GROUP = "decent_train_data"  # the data group's name among c10d's groups (and its prefix in the store)

# Tests only: a CPU worker's data group on this backend ("gloo"), exactly as a CUDA worker's is on nccl2, so that CPU
# runs exercise the two-group path (docs/design/live-nccl2.md). Read in ``data_backend_for`` and nowhere else.
DATA_BACKEND_ENV = "DECENT_TRAIN_LIVE_DATA_BACKEND"

_data: dist.ProcessGroup | None = None  # this process's data group (None: the default group carries the data)


class RendezvousFailed(RuntimeError):
    """The default group's rendezvous did not complete within its bound; the group is as it was. ``absent``: the
    members (ids) that never reached it (a member that reached it and then died is not among them)."""

    def __init__(self, message: str, absent: list[int]):
        super().__init__(message)
        self.absent = absent


class PartlyReconfigured(RuntimeError):
    """The default group was reconfigured into the epoch but the data group was not: the member has not changed
    (it must not commit); a newer plan reconfigures both again from whatever state each is in."""


def why_unsupported(device: torch.device | str = "cpu") -> str | None:
    """Why this torch cannot run live membership with its data on ``device`` (one line), or None if it can."""
    if not (hasattr(dist, "_reconfigure") and hasattr(dist, "_get_reconfigure_handle")):
        return f"live membership needs torch >= 2.14 (reconfigurable process groups); this is torch {torch.__version__}"
    kind = torch.device(device).type
    if kind == "cpu":
        return None
    if kind != "cuda":
        return f"live membership runs on cpu or cuda devices, not {kind}"
    if not dist.is_backend_available("nccl2"):
        return f"live membership on GPUs needs the nccl2 backend (reconfigurable NCCL); torch {torch.__version__} " \
               "has none registered (a build without NCCL)"
    if not torch.cuda.is_available():
        return "live membership on cuda: no CUDA device is visible"
    return None


def supported(device: torch.device | str = "cpu") -> bool:
    """Whether this torch can run live membership with its data on ``device`` (``why_unsupported`` says why not)."""
    return why_unsupported(device) is None


def data_backend_for(device: torch.device | str) -> str | None:
    """The data group's backend for a worker training on ``device``: nccl2 on CUDA, none (the default group) else;
    on CPU, tests may ask for a gloo data group (``DECENT_TRAIN_LIVE_DATA_BACKEND=gloo``) to run the CUDA layout."""
    if torch.device(device).type == "cuda":
        return "nccl2"
    return os.environ.get(DATA_BACKEND_ENV) or None


def data_group() -> dist.ProcessGroup | None:
    """The group the data goes over (pass it as ``group=``); None where the default group carries it (CPU)."""
    return _data


def control_device(device: torch.device) -> torch.device:
    """Where a tensor for the default group goes: the CPU beside a data group (live membership on GPUs: the default
    group is gloo, and its control traffic stays on the host), else ``device``."""
    return torch.device("cpu") if _data is not None else device


def group_uuid(uuid: int, index: int) -> int:
    """The uuid of the epoch's ``index``-th group (0: the default, 1: the data), from the plan's (63 bits, fresh per
    epoch): distinct within an epoch, and one-to-one on plan uuids, so no group ever sees one twice. torch takes a
    signed 64-bit uuid, so it stays below 2**63."""
    return (uuid + index * (1 << 62)) % (1 << 63)


def join(store: dist.Store, member_id: int, timeout: timedelta, data_backend: str | None = None) -> None:
    """Start this member's groups, reconfigurable: the default (gloo), and with ``data_backend`` (``nccl2`` on GPUs:
    ``data_backend_for``) the data group. No peer is contacted until an epoch."""
    global _data
    reason = why_unsupported("cuda" if data_backend == "nccl2" else "cpu")
    if reason is not None:
        raise RuntimeError(reason)
    dist.init_process_group(
        "gloo", store=store, rank=member_id, world_size=MAX_MEMBER_IDS, timeout=timeout, enable_reconfigure=True
    )
    _data = None if data_backend is None else _reconfigurable_group(data_backend, store, member_id, timeout)


def _reconfigurable_group(backend: str, store: dist.Store, member_id: int, timeout: timedelta) -> dist.ProcessGroup:
    """A second reconfigurable group. ``dist.new_group`` cannot make one (it has no ``enable_reconfigure``, and it
    would connect every rank of the ``MAX_MEMBER_IDS`` world), so this calls the private helper that
    ``init_process_group`` itself uses, under a name of its own (its keys in the store are prefixed by it). Its ranks
    are the default group's (both follow the plan's order), so the default group's rank map (the identity) serves it
    too: ``P2POp`` and ``get_rank(group)`` look it up."""
    group, _ = c10d._new_process_group_helper(
        MAX_MEMBER_IDS, member_id, [], backend, store, c10d.GroupName(DATA_GROUP), timeout=timeout,
        group_desc=DATA_GROUP, enable_reconfigure=True,
    )
    assert isinstance(group, dist.ProcessGroup)
    c10d._world.pg_group_ranks[group] = c10d._world.pg_group_ranks[c10d._get_default_group()]
    return group


def _handle_key(epoch: int, group: str, member: int) -> str:
    return f"handle/{epoch}/{group}/{member}"


def _arrival_key(epoch: int, member: int) -> str:
    return f"rendezvous/{epoch}/{member}"


def reconfigure(
    store: dist.Store, epoch: int, uuid: int, members: list[int], member_id: int, timeout: timedelta,
    abandon: Callable[[], bool] | None = None,
) -> bool:
    """Make this member's groups ``members`` (by stable id, in rank order) for ``epoch``: the default group, then the
    data group if there is one, each with its own handles and uuid (``group_uuid``). True once both are; False if a
    member's handles did not come within ``timeout`` or ``abandon()`` turned true meanwhile (the epoch was superseded).

    Every handle of both groups is published and read before either group is reconfigured: once all are in, nobody
    abandons, so every member goes on to both rendezvous. A failed ``_reconfigure`` raises and leaves that group as it
    was; if the data group's fails after the default group's succeeded, ``PartlyReconfigured``: the default group is
    in the new epoch and the data group in its last one; the member has not changed (live.py commits only on True),
    and a newer plan recovers it: reconfiguring needs only fresh handles, whatever members each group had before.
    The default group goes first, bounded by ``RENDEZVOUS_S`` (``RendezvousFailed`` past it): gloo's rendezvous is
    cheap, so a member that died after publishing its handles costs that bound there, before any NCCL communicator
    is torn down or built. The data group's keeps ``timeout`` (NCCL's communicators take longer to build)."""
    groups: list[tuple[str, dist.ProcessGroup | None]] = [("default", None)]
    if _data is not None:
        groups.append(("data", _data))
    for name, group in groups:
        store.set(_handle_key(epoch, name, member_id), dist._get_reconfigure_handle(group))
    keys = [_handle_key(epoch, name, m) for name, _ in groups for m in members]
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(keys):
        if (abandon is not None and abandon()) or time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    handles = {name: [store.get(_handle_key(epoch, name, m)).decode() for m in members] for name, _ in groups}
    store.set(_arrival_key(epoch, member_id), "")
    rendezvous = min(timeout, timedelta(seconds=RENDEZVOUS_S))
    for index, (name, group) in enumerate(groups):
        try:
            dist._reconfigure(group_uuid(uuid, index), handles[name], group=group,
                              timeout=rendezvous if index == 0 else timeout).wait()
        except RuntimeError as error:
            if index == 0:
                absent = [m for m in members if not store.check([_arrival_key(epoch, m)])]
                raise RendezvousFailed(f"member {member_id}: epoch {epoch}'s rendezvous (default group) not done "
                                       f"within {rendezvous.total_seconds():g} s; not at it: {absent or 'none'}: "
                                       f"{error}", absent) from error
            raise PartlyReconfigured(f"member {member_id}: the {name} group was not reconfigured into epoch {epoch} "
                                     f"(the default group was): {error}") from error
    return True
