"""Topologies: who averages parameters with whom at each optimizer step.

A topology is a periodic schedule of *rounds*. Each round partitions the workers into groups; at step ``s`` every
worker averages its parameters inside its group of round ``s mod period``. The mixing matrix of a round is
block-diagonal: member ``i`` of a group of ``m`` keeps ``weight`` of its own model and takes ``(1 - weight) / (m - 1)``
of each other member's (``weight = 1/m`` is the uniform average all built-ins use).

A round may also be a sequence of *stages*, each a partition of its own, applied in order: the round's matrix is
``W_stage_k ... W_stage_1`` (hierarchical gossip: exchange between nodes, then average within each node). Topologies
with one stage per round implement ``_get_topo_edges`` (decent-dp's extension point); staged ones ``_get_topo_stages``.

The schedule is pure data (no process groups) so the launcher can validate a topology against a world size before any
worker starts; :meth:`Topology.create_groups` binds it to ``torch.distributed`` inside the workers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "Edge",
    "Stages",
    "Topology",
    "TopologyReg",
    "register_topology",
    "topology_names",
    "get_topology_class",
    "build_topology",
    "ShardedTopology",
]


@dataclass
class Edge:
    """One group of one round (decent-dp's name for it).

    ``weight`` is the fraction a member keeps of its own model; every other member contributes ``(1-weight)/(m-1)``.
    It defaults to the uniform average ``1/m``. ``group`` is the process group, set by :meth:`Topology.create_groups`
    for groups of three or more that this rank is in (pairs exchange point-to-point and need none; a rank holds none
    for other ranks' groups; None for the whole world is the default group).
    """

    ranks: list[int]
    weight: float | None = None
    group: ProcessGroup | None = None

    def __post_init__(self) -> None:
        self.ranks = sorted(int(r) for r in self.ranks)
        if self.weight is None:
            self.weight = 1.0 / max(len(self.ranks), 1)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def neighbor_weight(self) -> float:
        """Coefficient of each other member's model: ``(1 - weight) / (m - 1)``."""
        return (1.0 - self.weight) / (self.size - 1) if self.size > 1 else 0.0

    @property
    def is_uniform(self) -> bool:
        return self.size <= 1 or math.isclose(self.weight, 1.0 / self.size, rel_tol=0.0, abs_tol=1e-15)


Stages = list[list[Edge]]
"""One round: its stages in order, each a partition of the workers into groups."""


class Topology:
    """Base class: subclasses return the rounds from :meth:`_get_topo_edges` (decent-dp's extension point), or rounds
    of several stages from :meth:`_get_topo_stages`.

    Inside those methods the attributes ``_world_size``, ``_local_world_size``, ``_n_nodes`` and ``_rank`` are
    available. Size constraints are reported by raising ``ValueError`` with a message that says which sizes work.
    """

    name: ClassVar[str] = "custom"

    def __init__(self, local_world_size: int | None = None, world_size: int | None = None, rank: int | None = None):
        if world_size is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError("Topology needs world_size= or an initialized torch.distributed process group")
            world_size = dist.get_world_size()
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        local_world_size = 1 if local_world_size is None else int(local_world_size)
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        if local_world_size < 1 or world_size % local_world_size != 0:
            raise ValueError(
                f"local world size {local_world_size} must be >= 1 and divide the world size {world_size}"
            )
        self._world_size = int(world_size)
        self._local_world_size = local_world_size
        self._n_nodes = world_size // local_world_size
        self._rank = int(rank)
        self.stages: list[Stages] = self._get_topo_stages()
        self._validate(self.stages)

    # -- schedule ---------------------------------------------------------------------------------------------
    def _get_topo_edges(self) -> list[list[Edge]]:
        raise NotImplementedError("a Topology subclass must implement _get_topo_edges() or _get_topo_stages()")

    def _get_topo_stages(self) -> list[Stages]:
        """Rounds of stages; by default each round of ``_get_topo_edges`` is one stage."""
        return [[edges] for edges in self._get_topo_edges()]

    @property
    def rounds(self) -> list[list[Edge]]:
        """The groups of each round, for topologies with one stage per round (decent-dp's view)."""
        if self.is_staged:
            raise ValueError(f"topology '{self.name}' has rounds of several stages: read .stages")
        return [stages[0] for stages in self.stages]

    @rounds.setter
    def rounds(self, rounds: list[list[Edge]]) -> None:
        self.stages = [[edges] for edges in rounds]

    @property
    def is_staged(self) -> bool:
        return any(len(stages) > 1 for stages in self.stages)

    def _validate(self, rounds: list[Stages]) -> None:
        n = self._world_size
        label = f"topology '{self.name}' (world size {n})"
        if not rounds or any(not stages for stages in rounds):
            raise ValueError(f"{label}: needs at least one round of at least one stage")
        for r, edges in ((r, edges) for r, stages in enumerate(rounds) for edges in stages):
            seen: dict[int, int] = {}
            for edge in edges:
                if not edge.ranks:
                    raise ValueError(f"{label}: round {r} has an empty group")
                if not 0.0 <= edge.weight <= 1.0:
                    raise ValueError(f"{label}: round {r} group {edge.ranks} has weight {edge.weight}; valid: 0..1")
                if edge.size == 1 and edge.weight != 1.0:
                    raise ValueError(f"{label}: round {r} group {edge.ranks} has one member, so weight must be 1, not {edge.weight}")
                for rank in edge.ranks:
                    if not 0 <= rank < n:
                        raise ValueError(f"{label}: round {r} names rank {rank}; valid ranks are 0..{n - 1}")
                    if rank in seen:
                        raise ValueError(f"{label}: round {r} puts rank {rank} in more than one group")
                    seen[rank] = 1
            missing = sorted(set(range(n)) - set(seen))
            if missing:
                raise ValueError(f"{label}: round {r} leaves ranks {missing} out of every group")

    @property
    def period(self) -> int:
        return len(self.stages)

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_world_size(self) -> int:
        return self._local_world_size

    def edges(self, step: int, rank: int | None = None) -> list[Edge]:
        """The group ``rank`` (default: this worker) averages in at each stage of optimizer step ``step``'s round."""
        rank = self._rank if rank is None else rank
        return [next(e for e in edges if rank in e.ranks) for edges in self.stages[step % self.period]]

    def edge(self, step: int, rank: int | None = None) -> Edge:
        """The group ``rank`` (default: this worker) averages in at optimizer step ``step`` (one-stage rounds)."""
        if self.is_staged:
            raise ValueError(f"topology '{self.name}' has rounds of several stages: use edges(step, rank)")
        return self.edges(step, rank)[0]

    get_edge = edge  # decent-dp's name

    def async_stage(self, round_index: int) -> int:
        """The stage of a round the engine overlaps with computation: the first one with a group spanning nodes.

        The stages before it run when the exchange starts, the ones after it when it is mixed in; both block, which
        is cheap for the within-node stages they are meant for.
        """
        node = self._local_world_size
        for k, edges in enumerate(self.stages[round_index % self.period]):
            if any(len({r // node for r in e.ranks}) > 1 for e in edges):
                return k
        return 0

    # -- analysis -----------------------------------------------------------------------------------------------
    def stage_matrix(self, round_index: int, stage: int) -> torch.Tensor:
        """The ``n x n`` matrix of one stage of one round (float64)."""
        n = self._world_size
        w = torch.zeros(n, n, dtype=torch.float64)
        for edge in self.stages[round_index % self.period][stage]:
            for i in edge.ranks:
                for j in edge.ranks:
                    w[i, j] = edge.weight if i == j else edge.neighbor_weight
        return w

    def mixing_matrix(self, round_index: int) -> torch.Tensor:
        """The ``n x n`` doubly stochastic matrix W of one round (float64): ``x_new = W @ x``; for a round of stages
        the product ``W_stage_k ... W_stage_1``."""
        w = torch.eye(self._world_size, dtype=torch.float64)
        for stage in range(len(self.stages[round_index % self.period])):
            w = self.stage_matrix(round_index, stage) @ w
        return w

    def period_matrix(self) -> torch.Tensor:
        """Product ``W(p-1) ... W(1) W(0)`` of one period."""
        product = torch.eye(self._world_size, dtype=torch.float64)
        for r in range(self.period):
            product = self.mixing_matrix(r) @ product
        return product

    def spectral_gap(self) -> float:
        """``1 - ||P - J/n||_2`` for the period product P: how much one period shrinks the spread around the mean.

        1 means exact averaging every period (``complete``), 0 means the workers never reach consensus.
        """
        n = self._world_size
        deviation = self.period_matrix() - torch.full((n, n), 1.0 / n, dtype=torch.float64)
        return float(1.0 - torch.linalg.matrix_norm(deviation, ord=2))

    @property
    def label(self) -> str:
        """The topology as laid out over nodes, e.g. ``ring: 4 workers (1 nodes x 4)``."""
        return f"{self.name}: {self._world_size} workers ({self._n_nodes} nodes x {self._local_world_size})"

    def describe(self) -> str:
        def groups(edges: list[Edge]) -> str:
            return " ".join("(" + ",".join(map(str, e.ranks)) + ")" for e in edges)

        rounds = "; ".join(
            f"round {r}: " + " then ".join(groups(edges) for edges in stages) for r, stages in enumerate(self.stages)
        )
        return f"{self.label}, period {self.period}, spectral gap {self.spectral_gap():.4f}; {rounds}"

    # -- binding to torch.distributed ---------------------------------------------------------------------------
    def create_groups(self, timeout: timedelta | None = None, world_group: ProcessGroup | None = None) -> None:
        """Give this rank a process group for each of its groups of >= 3 ranks (collective: every rank, same
        ``timeout``).

        A default group bound to a device splits the world's communicator once per stage partition
        (``dist.split_group``); unbound, every rank makes each group in turn with ``new_group``. Without ``timeout``
        the groups take the default group's, and a group spanning the world is the default group itself;
        ``world_group`` (every rank, made with ``timeout``) serves that group instead of another copy of the world.
        ``edge.group`` stays None for pairs (point-to-point on the default group) and for other ranks' groups. Why
        each of these choices: docs/architecture.md, "Process groups".
        """
        rank = dist.get_rank()
        world_timeout = _default_group_timeout()
        timeout = world_timeout if timeout is None else timeout
        reuse_world = timeout == world_timeout or world_group is not None
        splits = self._group_splits(reuse_world)
        groups: dict[tuple[int, ...], ProcessGroup] = {}
        if _splits_world():
            for split_ranks in splits:
                group = dist.split_group(split_ranks=split_ranks, timeout=timeout)
                mine = [ranks for ranks in split_ranks if rank in ranks]
                if mine:
                    groups[tuple(mine[0])] = cast(ProcessGroup, group)
        else:
            for ranks in (ranks for split_ranks in splits for ranks in split_ranks):
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    groups[tuple(ranks)] = cast(ProcessGroup, group)
        if world_group is not None:
            groups[tuple(range(self._world_size))] = world_group
        for edge in (e for stages in self.stages for edges in stages for e in edges):
            edge.group = groups.get(tuple(edge.ranks))

    def _group_splits(self, reuse_world: bool) -> list[list[list[int]]]:
        """The groups :meth:`create_groups` makes, by stage partition in schedule order (pure data): each stage's groups
        of >= 3 not made by an earlier stage, less the whole world if ``reuse_world``; stages with none left out."""
        world = list(range(self._world_size))
        made: set[tuple[int, ...]] = set()
        splits: list[list[list[int]]] = []
        for edges in (edges for stages in self.stages for edges in stages):
            new = [list(e.ranks) for e in edges if e.size >= 3 and tuple(e.ranks) not in made]
            new = [ranks for ranks in new if not (reuse_world and ranks == world)]
            made.update(tuple(ranks) for ranks in new)
            if new:
                splits.append(new)
        return splits


def _default_backend() -> Any:
    """The backend of the default group that torch would split: the bound device's, else the accelerator's or the
    CPU's (as ``dist.split_group`` picks); None if there is none."""
    world = dist.group.WORLD
    try:
        device = getattr(world, "bound_device_id", None)
        if device is None:
            types = {d.type for d in world._device_types}
            accelerator = torch.accelerator.current_accelerator()
            device = accelerator if accelerator is not None and accelerator.type in types else torch.device("cpu")
        return world._get_backend(device)
    except (AttributeError, RuntimeError):
        return None


def _splits_world() -> bool:
    """Whether ``new_group`` would split the world's communicator per group (torch 2.15's ``_new_process_group_helper``
    does when the default group is bound to a device whose backend splits), so ``dist.split_group`` saves calls."""
    backend = _default_backend()
    return (
        hasattr(dist, "split_group")
        and getattr(dist.group.WORLD, "bound_device_id", None) is not None
        and bool(getattr(backend, "supports_splitting", False))
    )


def _default_group_timeout() -> timedelta | None:
    """init_process_group's timeout (the default group's), or None where the backend does not show it."""
    options = getattr(_default_backend(), "options", None)
    timeout = getattr(options, "_timeout", None)
    return timeout if isinstance(timeout, timedelta) else None


class TopologyReg:
    """Name -> Topology class (decent-dp compatible: ``@TopologyReg.register("name")``)."""

    registry: ClassVar[dict[str, type[Topology]]] = {}

    @classmethod
    def register(cls, name: str) -> Callable[[type[Topology]], type[Topology]]:
        def _register(topology: type[Topology]) -> type[Topology]:
            if name in cls.registry:
                raise ValueError(f"topology '{name}' is already registered")
            if not (isinstance(topology, type) and issubclass(topology, Topology)):
                raise ValueError(f"topology '{name}' must be a subclass of decent_train.Topology, got {topology!r}")
            topology.name = name
            cls.registry[name] = topology
            return topology

        return _register


def register_topology(name: str, topology: type[Topology]) -> type[Topology]:
    """Function form of ``@TopologyReg.register(name)``."""
    return TopologyReg.register(name)(topology)


def topology_names() -> list[str]:
    return sorted(TopologyReg.registry)


def get_topology_class(name: str) -> type[Topology]:
    try:
        return TopologyReg.registry[name]
    except KeyError:
        raise ValueError(f"unknown topology '{name}'; registered: {', '.join(topology_names())}") from None


def build_topology(name: str, world_size: int, local_world_size: int = 1, rank: int = 0) -> Topology:
    """Build and validate a topology without touching torch.distributed (the launcher's pre-flight check)."""
    return get_topology_class(name)(local_world_size=local_world_size, world_size=world_size, rank=rank)


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@TopologyReg.register("complete")
class CompleteTopology(Topology):
    """Every worker averages with every other at every step (exact averaging): one all-reduce of the parameters, or
    under live membership n - 1 point-to-point messages per worker (docs/fault-tolerance.md, limits)."""

    def _get_topo_edges(self) -> list[list[Edge]]:
        return [[Edge(list(range(self._world_size)))]]


@TopologyReg.register("ring")
class RingTopology(Topology):
    """Each worker averages with its right neighbour at even steps and its left neighbour at odd steps.

    Even n (decent-dp's groups): round 0 pairs (0,1),(2,3),...; round 1 pairs (0,n-1),(1,2),(3,4),...
    Odd n >= 3: the worker left over joins a neighbouring pair, giving one group of three per round:
    round 0 is (0,1),(2,3),...,(n-3,n-2,n-1); round 1 is (1,2),(3,4),...,(n-4,n-3),(n-2,n-1,0). Together the two
    rounds still cover every edge of the ring. n = 1 trains alone.
    """

    def _get_topo_edges(self) -> list[list[Edge]]:
        n = self._world_size
        if n == 1:
            return [[Edge([0])]]
        if n % 2 == 0:
            first = [Edge([i, i + 1]) for i in range(0, n, 2)]
            second = [Edge([i, (i - 1) % n]) for i in range(0, n, 2)]
            return [first, second]
        first = [Edge([i, i + 1]) for i in range(0, n - 3, 2)] + [Edge([n - 3, n - 2, n - 1])]
        second = [Edge([i, i + 1]) for i in range(1, n - 3, 2)] + [Edge([0, n - 2, n - 1])]
        return [first, second]


@TopologyReg.register("one-peer-exp")
class OnePeerExpTopology(Topology):
    """Round k pairs worker j with j + 2^k (mod n), k = 0..log2(n)-1: exact averaging after one period.

    Needs a power-of-two number of workers (1, 2, 4, 8, ...).
    """

    def _get_topo_edges(self) -> list[list[Edge]]:
        n = self._world_size
        if not _is_power_of_two(n):
            raise ValueError(
                f"topology 'one-peer-exp' needs a power-of-two number of workers (1, 2, 4, 8, ...); got {n}"
            )
        if n == 1:
            return [[Edge([0])]]
        rounds = []
        for k in range(int(math.log2(n))):
            used: set[int] = set()
            edges = []
            for j in range(n):
                if j not in used:
                    peer = (j + 2**k) % n
                    used.update((j, peer))
                    edges.append(Edge([j, peer]))
            rounds.append(edges)
        return rounds


@TopologyReg.register("alternating-exp-ring")
class AlternatingExpRingTopology(Topology):
    """The paper's AER: alternate intra-node averaging with averaging between two nodes paired exponentially.

    For node round k (k = 0..log2(N)-1) nodes j and j + 2^k are paired; each pair contributes its two intra-node
    groups to one step and its 2-node group to the other, alternating which comes first from pair to pair, so fast
    intra-node links and slow inter-node links are used in alternate steps (same groups as decent-dp 0.2.3).
    Needs a power-of-two number of nodes N = world_size / local_world_size (1, 2, 4, ...). With one node it is
    intra-node ``complete`` averaging. With one worker per node the intra-node steps are local-only.
    """

    def _get_topo_edges(self) -> list[list[Edge]]:
        nodes, local = self._n_nodes, self._local_world_size
        if not _is_power_of_two(nodes):
            raise ValueError(
                "topology 'alternating-exp-ring' needs a power-of-two number of nodes (1, 2, 4, 8, ... nodes of "
                f"{local} workers); got {nodes} nodes ({self._world_size} workers / {local} per node)"
            )

        def node(j: int) -> list[int]:
            return list(range(j * local, (j + 1) * local))

        if nodes == 1:
            return [[Edge(node(0))]]
        rounds: list[list[Edge]] = []
        pair_count = 0
        for k in range(int(math.log2(nodes))):
            first: list[Edge] = []  # the two steps of node round k
            second: list[Edge] = []
            used: set[int] = set()
            for j in range(nodes):
                if j in used:
                    continue
                t = (j + 2**k) % nodes
                used.update((j, t))
                intra = [Edge(node(j)), Edge(node(t))]
                inter = [Edge(node(j) + node(t))]
                if pair_count % 2 == 0:
                    first += intra
                    second += inter
                else:
                    first += inter
                    second += intra
                pair_count += 1
            rounds += [first, second]
        return rounds


@TopologyReg.register("hierarchical")
class HierarchicalTopology(Topology):
    """Two-stage rounds for clusters of nodes: exchange between nodes, then average within each node.

    Stage 1 (between nodes, overlapped with computation): local rank j of node a averages with local rank j of node
    a XOR 2^d, d = (k + j) mod log2(N) in round k, so the workers of one node talk to different nodes. Stage 2
    (within the node, over its fast links): the node's workers average. Each round uses every node's link once, and
    with as many workers per node as log2(N) a node mixes with all of its hypercube neighbours in every round.
    Needs a power-of-two number of nodes N = world_size / local_world_size. One node: ``complete``; one worker per
    node: ``one-peer-exp`` over the nodes. Every worker sends its whole model between nodes each round, and only to
    the same local rank elsewhere: it suits nodes with a NIC per GPU (rail-aligned); with one NIC per node,
    ``alternating-exp-ring`` moves fewer bytes between nodes.
    """

    def _get_topo_stages(self) -> list[Stages]:
        nodes, local = self._n_nodes, self._local_world_size
        if not _is_power_of_two(nodes):
            raise ValueError(
                "topology 'hierarchical' needs a power-of-two number of nodes (1, 2, 4, 8, ... nodes of "
                f"{local} workers); got {nodes} nodes ({self._world_size} workers / {local} per node)"
            )
        within = [Edge(list(range(a * local, (a + 1) * local))) for a in range(nodes)]
        if nodes == 1:
            return [[within]]
        dims = int(math.log2(nodes))
        rounds: list[Stages] = []
        for k in range(dims):
            between = [
                Edge([a * local + j, (a ^ 2 ** ((k + j) % dims)) * local + j])
                for a in range(nodes)
                for j in range(local)
                if a < a ^ 2 ** ((k + j) % dims)
            ]
            rounds.append([between, within] if local > 1 else [between])
        return rounds


class ShardedTopology(Topology):
    """``base`` gossiped over replicas of ``shard`` consecutive ranks each (FSDP2 shards a model over them): rank
    ``r * shard + s`` holds shard ``s`` of replica ``r`` and exchanges it with shard ``s`` of the replicas ``base``
    groups replica ``r`` with. So it is ``shard`` copies of ``base``, one per shard position, over the world's ranks:
    the engine's exchange and process groups work unchanged, and every message is a shard (1/``shard`` of the model).

    The analysis (``spectral_gap``, ``label``) is ``base``'s: the copies never mix with each other, so the matrix over
    all ranks has ``shard`` eigenvalues of 1 by construction.
    """

    def __init__(self, base: Topology, shard: int, rank: int | None = None):
        if shard < 1:
            raise ValueError(f"shard={shard} must be >= 1 (ranks per replica)")
        self.base, self.shard = base, shard
        self.name = base.name  # type: ignore[misc]
        super().__init__(base.local_world_size * shard, base.world_size * shard, rank)
        if self._rank // shard != base._rank:
            raise ValueError(f"rank {self._rank} is in replica {self._rank // shard}, but base was built for replica "
                             f"{base._rank}")

    def _get_topo_stages(self) -> list[Stages]:
        k = self.shard
        return [
            [[Edge([r * k + s for r in e.ranks], e.weight) for s in range(k) for e in edges] for edges in stages]
            for stages in self.base.stages
        ]

    def spectral_gap(self) -> float:
        return self.base.spectral_gap()

    @property
    def label(self) -> str:
        """``base``'s label over the replicas, and the shards of each, e.g. ``ring: 2 workers (1 nodes x 2) x 2
        shards``."""
        return f"{self.base.label} x {self.shard} shards"
