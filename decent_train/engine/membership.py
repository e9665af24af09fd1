"""Membership: who is in the run now (rank, world size, workers per node) and the process groups the engine uses.

One place holds it, so that a later change of membership at run time (a worker lost or joined) changes it here: the
topologies and their groups are built over the current members, and collectives over all of them go through here.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from decent_train.engine import reconfigure
from decent_train.engine.comm import peers_must_answer, run_collective
from decent_train.engine.topology import ShardedTopology, Topology, get_topology_class

__all__ = ["Membership", "average_tensors_", "local_part"]

TopologySpec = str | Topology | type[Topology]


def local_part(tensor: Tensor) -> Tensor:
    """What of ``tensor`` this rank holds: a DTensor's local shard, detached (FSDP2's parameters; a view, so writing
    it writes the parameter), else the tensor itself. The shard is read from the DTensor's ``_local_tensor`` where it
    has one: ``to_local()`` is an autograd call per tensor, and the local-steps fronts check every shard at each
    exchange (outer_exchange.py, ``follow_params``)."""
    local = getattr(tensor, "_local_tensor", None)
    if local is not None:
        return local.detach()
    to_local = getattr(tensor, "to_local", None)
    return to_local().detach() if to_local is not None else tensor


class Membership:
    """The members of the default process group as the engine sees them.

    ``exchange_group`` is the group pairs exchange and gradients are averaged in: None (the default group), or on a
    GPU with a time limit a world-wide group that carries it (NCCL's watchdog enforces it; the host never waits), or
    under live membership on GPUs the data group (``reconfigure.data_group()``, nccl2), which every change of members
    reconfigures with the default group.

    ``shard`` > 1: every ``shard`` consecutive ranks form one replica of a sharded model (FSDP2), rank ``r * shard
    + s`` holding its shard ``s``. Topologies then run over the replicas (``ShardedTopology``), and the collectives
    over "all members" run over ``replicate_group``: the ranks holding this rank's shard in every replica.
    """

    def __init__(
        self, local_world_size: int | None, timeout: timedelta | None, point_to_point: bool = False, shard: int = 1,
        replicate_group: dist.ProcessGroup | None = None,
    ):
        self.local_world_size = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        self.shard = shard
        self.refresh()
        self.timeout = timeout
        self.point_to_point = point_to_point  # every group exchanges by messages: topologies need no process groups
        self.group_timeout: timedelta | None = None  # the engine's own groups' (set by ``create_exchange_group``)
        self.exchange_group: dist.ProcessGroup | None = None
        if self.world_size % shard or self.local_world_size % shard:
            raise ValueError(f"shard={shard} must divide the {self.world_size} workers and the "
                             f"{self.local_world_size} per node")
        self.replicate_group = replicate_group if shard > 1 else None
        if shard > 1 and replicate_group is None and self.replicas > 1:
            self.replicate_group = self._make_replicate_group()

    @property
    def data_group(self) -> dist.ProcessGroup | None:
        """The group of the collectives on every member's data (the global average, broadcasts from rank 0): the
        replicas' (sharded), else live membership's data group on GPUs, else the default group (None)."""
        return self.replicate_group if self.shard > 1 else reconfigure.data_group()

    @property
    def replicas(self) -> int:
        """Copies of the model being trained (workers, unsharded)."""
        return self.world_size // self.shard

    @property
    def replica(self) -> int:
        """The replica this rank holds a shard of: its rank in the topology."""
        return self.rank // self.shard

    @property
    def first_of_shard(self) -> int:
        """The rank of replica 0 holding this rank's shard: the source of broadcasts (rank 0 unsharded)."""
        return self.rank % self.shard

    def _make_replicate_group(self) -> dist.ProcessGroup:
        """This rank's same-position ranks of every replica (collective: every rank makes each group in turn)."""
        mine = None
        for position in range(self.shard):
            group = dist.new_group([r * self.shard + position for r in range(self.replicas)])
            if position == self.first_of_shard:
                mine = group
        assert mine is not None
        return mine

    def refresh(self, local_world_size: int | None = None) -> None:
        """Read the members from the default group again (after it was reconfigured: live membership), with
        ``local_world_size`` workers per node if given; topologies are built anew over them."""
        if local_world_size is not None:
            self.local_world_size = local_world_size
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        self._topologies: dict[Any, Topology] = {}  # by name, class or id: process groups are created once each

    def create_exchange_group(self, device: torch.device) -> None:
        """On a GPU with a time limit, a world-wide group that carries it. One all-reduce over it initializes its
        communicator with every rank (NCCL's first point-to-point batch on a lazily created group must include all
        ranks)."""
        self.group_timeout = self.engine_group_timeout(device)
        if reconfigure.data_group() is not None:  # live membership on GPUs: the data group. Not ``dist.new_group``,
            # whose counter of groups a joiner would not share; no all-reduce here: a joiner builds its engine alone
            self.exchange_group = reconfigure.data_group()
            return
        if self.world_size == 1 or self.group_timeout is None:
            return
        self.exchange_group = dist.new_group(timeout=self.group_timeout)
        dist.all_reduce(torch.zeros(1, device=device), group=self.exchange_group)

    def engine_group_timeout(self, device: torch.device) -> timedelta | None:
        """The timeout of the engine's own process groups: the exchange limit on a GPU, where the host does not wait
        (gloo's groups keep the default: there the wait itself has the limit)."""
        return self.timeout if device.type == "cuda" else None

    def topology(self, spec: TopologySpec) -> Topology:
        """The topology ``spec`` over the members, its process groups created (a collective) the first time."""
        key = spec if isinstance(spec, (str, type)) else id(spec)
        if key in self._topologies:
            return self._topologies[key]
        if isinstance(spec, Topology):
            if spec.world_size != self.replicas:
                raise ValueError(f"topology built for {spec.world_size} workers, but the world has {self.replicas}"
                                 + (" replicas" if self.shard > 1 else ""))
            topology = spec
        else:
            cls = spec if isinstance(spec, type) else get_topology_class(spec)
            topology = cls(local_world_size=self.local_world_size // self.shard, world_size=self.replicas,
                           rank=self.replica)
        if self.shard > 1:
            topology = ShardedTopology(topology, self.shard, self.rank)
        if self.world_size > 1 and not self.point_to_point:
            timeout = self.group_timeout  # passed only when set: a subclass may override create_groups()
            kwargs = {"timeout": timeout, "world_group": self.exchange_group} if timeout is not None else {}
            topology.create_groups(**kwargs)
        self._topologies[key] = topology
        return topology

    def check_same_model(self, tensors: list[tuple[str, Tensor]], settings: dict[str, Any] | None = None) -> None:
        """Every member holds tensors of the same names, shapes and dtypes as rank 0 (sharded: as the rank of replica 0
        holding the same shard), and, given ``settings`` (a front's: its algorithm, schedule, topology, compression),
        the same settings as every other rank: gathered from all, so every rank refuses a difference alike, in one
        line naming the setting and both values, where otherwise the ranks would exchange at different steps or with
        different payloads and time out blaming a peer (audit D5)."""
        if settings is not None and self.world_size > 1:
            everyone: list[Any] = [None] * self.world_size
            dist.all_gather_object(everyone, settings)
            for rank, theirs in enumerate(everyone):
                for key in settings:
                    if theirs.get(key) != everyone[0].get(key):
                        raise ValueError(
                            f"{key}={everyone[0].get(key)!r} on rank 0 but {key}={theirs.get(key)!r} on rank {rank}: "
                            "every worker must build the front with the same settings")
        if self.replicas == 1:
            return
        mine = [(n, tuple(t.shape), str(t.dtype)) for n, t in tensors]
        theirs = [mine]
        source = self.first_of_shard
        dist.broadcast_object_list(theirs, src=source, group=self.replicate_group)
        for here, there in itertools.zip_longest(mine, theirs[0]):
            if here != there:
                raise RuntimeError(
                    f"rank {self.rank}'s model differs from rank {source}'s: {here} here, {there} on rank {source}"
                )

    @torch.no_grad()
    def broadcast_from_rank0(self, tensors: list[Tensor]) -> None:
        """Every member takes rank 0's ``tensors`` (sharded: each takes replica 0's of its shard)."""
        if self.replicas > 1:
            for tensor in tensors:
                run_collective(dist.broadcast, tensor, src=self.first_of_shard, group=self.data_group)

    def average_(self, tensor: Tensor, what: str | Callable[[], str]) -> None:
        """``tensor`` <- its average over all members (sharded: over the replicas; blocking); ``what`` names the
        collective if a peer fails."""
        if self.replicas > 1:
            with peers_must_answer(what, self.timeout):
                run_collective(dist.all_reduce, tensor, group=self.data_group)
            tensor.div_(self.replicas)

    def average_tensors_(self, tensors: list[Tensor], what: str | Callable[[], str]) -> None:
        """Average ``tensors`` over all members in place, with one all-reduce per dtype and device."""
        if self.replicas > 1:
            average_tensors_(tensors, self.replicas, what, group=self.data_group, timeout=self.timeout)


def average_tensors_(
    tensors: list[Tensor], size: int, what: str | Callable[[], str], group: dist.ProcessGroup | None = None,
    timeout: timedelta | None = None,
) -> None:
    """``tensors`` <- their average over ``group``'s ``size`` ranks (None: the default group), in place: one
    all-reduce per dtype and device over the flattened tensors, since each collective costs a round trip whatever
    its size. ``what`` names it if a peer fails."""
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for same in groups.values():
        flat = torch._utils._flatten_dense_tensors(same)
        with peers_must_answer(what, timeout):
            run_collective(dist.all_reduce, flat, group=group)
        flat.div_(size)
        torch._foreach_copy_(same, torch._utils._unflatten_dense_tensors(flat, same))
