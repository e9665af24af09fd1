"""Topology.create_groups with real gloo processes: which process groups each rank makes and holds.

Each worker records its calls to ``dist.split_group`` / ``dist.new_group`` and the groups it holds afterwards; the
oracles are computed here from the schedule alone (which partitions have a group of >= 3, who is in which group),
plus an all-reduce on every group (the sum of its members' values) and the group's timeout, read from its gloo
options and seen ending a hung exchange. ``scripts/bench_groups.py``'s counts are checked against hand counts.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.torch_version import TorchVersion

from decent_train.engine.topology import Topology, build_topology
from tests.distributed import WorkerError, run_workers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_groups  # noqa: E402

WORLD_TIMEOUT = timedelta(seconds=60)  # tests/distributed.py's init_process_group timeout
CPU = torch.device("cpu")
# A default group bound to the CPU splits only from torch 2.14 on; NCCL's bound groups (the worker's) split in 2.13 too.
needs_cpu_split = pytest.mark.skipif(
    TorchVersion(torch.__version__) < (2, 14),
    reason="needs torch >= 2.14: before it, dist.split_group cannot split gloo (it deep-copies gloo's options, "
    "which do not pickle) and its fake backend does not split",
)
BOUND = [pytest.param(True, marks=needs_cpu_split, id="bound"), pytest.param(False, id="unbound")]


def group_timeout(group: dist.ProcessGroup) -> timedelta:
    return group._get_backend(CPU).options._timeout


def record_calls() -> list[tuple[str, list[Any]]]:
    """Wrap ``dist.split_group`` and ``dist.new_group`` (this worker only: it is a forked process) to log each call."""
    calls: list[tuple[str, list[Any]]] = []
    split_group, new_group = dist.split_group, dist.new_group

    def recording_split_group(*args: Any, **kwargs: Any) -> Any:
        calls.append(("split_group", [list(r) for r in kwargs.get("split_ranks", args[1] if len(args) > 1 else [])]))
        return split_group(*args, **kwargs)

    def recording_new_group(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        local = kwargs.get("use_local_synchronization", False)
        calls.append(("new_group(local)" if local else "new_group", list(ranks)))
        return new_group(ranks, *args, **kwargs)

    dist.split_group, dist.new_group = recording_split_group, recording_new_group
    return calls


def all_edges(topology: Topology) -> list[tuple[int, int, int]]:
    """(round, stage, index) of every edge, in schedule order (the same on every rank)."""
    return [
        (r, s, i)
        for r, stages in enumerate(topology.stages)
        for s, edges in enumerate(stages)
        for i in range(len(edges))
    ]


def bind_device() -> None:
    """Bind the default group to ``cpu:0``: gloo's stand-in for NCCL with ``device_id``, where torch's ``new_group``
    splits the world's communicator (and, on gloo, fails on non-members). Made by hand (``bench_groups.bind_to_cpu``):
    torch 2.13 and 2.14 refuse ``init_process_group(device_id=cpu)``."""
    dist.barrier()  # every rank done connecting: one that leaves early would break a peer's connectFullMesh
    bench_groups.bind_to_cpu()


def groups_worker(
    rank: int, world: int, name: str, local: int, timeout: timedelta | None, bound: bool
) -> dict[str, Any]:
    if bound:
        bind_device()
    calls = record_calls()
    topology = build_topology(name, world, local, rank)
    if timeout is None:
        topology.create_groups()
    else:
        topology.create_groups(timeout=timeout)
    held = [pg for pg in c10d._world.pg_map if pg is not c10d._get_default_group()]  # process groups of this rank
    edges: dict[tuple[int, int, int], Any] = {}
    sums: dict[tuple[int, ...], float] = {}
    for r, s, i in all_edges(topology):
        edge = topology.stages[r][s][i]
        group = edge.group
        if group is None:
            edges[(r, s, i)] = None
        elif isinstance(group, dist.ProcessGroup):
            edges[(r, s, i)] = (group.size(), group.rank(), group_timeout(group), id(group))
        else:  # e.g. GroupMember.NON_GROUP_MEMBER
            edges[(r, s, i)] = (repr(group), None, None, None)
        key = tuple(edge.ranks)
        # The oracle: every member all-reduces its rank + 1 on its group, in schedule order (the same order on all
        # ranks, so overlapping groups cannot wait on each other). A missing group is recorded, not waited on.
        if rank in key and edge.size >= 3 and key not in sums:
            if group is None and edge.size != world:
                sums[key] = float("nan")
                continue
            value = torch.tensor([rank + 1.0], dtype=torch.float64)
            dist.all_reduce(value, group=group)
            sums[key] = float(value)
    return {"calls": calls, "held": len(held), "edges": edges, "sums": sums}


def distinct_partitions(topology: Topology, reuse_world: bool) -> int:
    """Stage partitions (as their sets of groups of >= 3, the world left out when it is reused) that have a group."""
    world = tuple(range(topology.world_size))
    partitions = {
        frozenset(t for t in (tuple(e.ranks) for e in edges if e.size >= 3) if not (reuse_world and t == world))
        for stages in topology.stages
        for edges in stages
    }
    return len(partitions - {frozenset()})


def distinct_groups(topology: Topology) -> set[tuple[int, ...]]:
    return {tuple(e.ranks) for stages in topology.stages for edges in stages for e in edges if e.size >= 3}


def check_groups(
    name: str, world: int, local: int, timeout: timedelta | None, results: list[dict[str, Any]], bound: bool
) -> None:
    topology = build_topology(name, world, local)
    reuse_world = timeout is None
    world_ranks = tuple(range(world))
    for rank, res in enumerate(results):
        own: set[tuple[int, ...]] = set()
        for r, s, i in all_edges(topology):
            edge = topology.stages[r][s][i]
            key = tuple(edge.ranks)
            got = res["edges"][(r, s, i)]
            if rank in key and edge.size >= 3 and not (reuse_world and key == world_ranks):
                assert got is not None, f"rank {rank} has no group for its edge {key}"
                size, group_rank, group_limit, _ = got
                assert (size, group_rank) == (edge.size, key.index(rank)), (rank, key, got)
                assert group_limit == (WORLD_TIMEOUT if timeout is None else timeout), (rank, key, group_limit)
                own.add(key)
            else:  # a pair, another rank's group, or the world on the default group: no group held for it
                assert got is None, f"rank {rank} holds a group for edge {key}: {got}"
        # One process group per own group, the same object wherever the group recurs; nothing else held.
        ids = {res["edges"][e][3] for e in all_edges(topology) if res["edges"][e] is not None}
        assert res["held"] == len(own) == len(ids), (rank, res["held"], own)
        expected_sums = {k: float(sum(k) + len(k)) for k in distinct_groups(topology) if rank in k}
        assert res["sums"] == expected_sums, (rank, res["sums"])

    # Every rank makes the same calls in the same order (the contract of both). Bound to a device: one split per
    # distinct partition (each a world-wide split, as a new_group per group would be under NCCL). Unbound: a new_group
    # per group, in which only the members communicate. Never members-only calls.
    calls = results[0]["calls"]
    assert all(res["calls"] == calls for res in results), [res["calls"] for res in results]
    if bound:
        assert len(calls) == distinct_partitions(topology, reuse_world), calls
        assert {kind for kind, _ in calls} <= {"split_group"}, calls
    else:
        assert {kind for kind, _ in calls} <= {"new_group"}, calls
        groups = distinct_groups(topology) - ({world_ranks} if reuse_world else set())
        assert sorted(tuple(ranks) for _, ranks in calls) == sorted(groups), calls


# (topology, world size, workers per node, timeout): a group of 3 (ring at 5), partitions of several groups
# (alternating-exp-ring at 8 x 4, hierarchical's within-node stage), the world as a group (complete, the inter-node
# step of alternating-exp-ring at 2 nodes), and none (one-peer-exp).
CASES = [
    ("ring", 5, 1, None),
    ("alternating-exp-ring", 8, 2, None),
    ("alternating-exp-ring", 8, 4, None),
    ("hierarchical", 8, 4, None),
    ("complete", 4, 1, None),
    ("one-peer-exp", 4, 1, None),
    ("ring", 5, 1, timedelta(seconds=7)),
    ("alternating-exp-ring", 8, 4, timedelta(seconds=7)),
    ("complete", 4, 1, timedelta(seconds=7)),
]


@pytest.mark.parametrize("bound", BOUND)
@pytest.mark.parametrize("name,world,local,timeout", CASES)
def test_each_rank_holds_only_its_groups(
    name: str, world: int, local: int, timeout: timedelta | None, bound: bool
) -> None:
    results = run_workers(groups_worker, world, name, local, timeout, bound, timeout=120)
    check_groups(name, world, local, timeout, results, bound)


def hung_exchange_worker(rank: int, world: int, name: str, absent: int, bound: bool) -> tuple[str, float]:
    """All members but ``absent`` all-reduce on the group of ``absent`` (round 0); returns the error and its time."""
    if bound:
        bind_device()
    topology = build_topology(name, world, 1, rank)
    topology.create_groups(timeout=timedelta(seconds=2))
    edge = topology.edges(0, rank)[0]
    if rank == absent or absent not in edge.ranks:
        return "", 0.0
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=edge.group)
    except RuntimeError as error:
        return str(error).splitlines()[0], time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.parametrize("bound", BOUND)
@pytest.mark.parametrize("name,world", [("ring", 5), ("complete", 3)])
def test_group_timeout_ends_a_hung_exchange(name: str, world: int, bound: bool) -> None:
    """A group made with a 2 s timeout fails an all-reduce a member never joins within seconds, not after the default
    group's 60 s (torch's own default for a new group would be 30 minutes). ``complete``: the world's group too."""
    absent = world - 1
    results = run_workers(hung_exchange_worker, world, name, absent, bound, timeout=120)
    members = [r for r in range(world) if r != absent and absent in build_topology(name, world).edges(0, r)[0].ranks]
    assert len(members) == 2
    for r in members:
        error, seconds = results[r]
        assert error not in ("", "no error") and 1.5 < seconds < 20, (r, error, seconds)


def local_synchronization_worker(rank: int, world: int) -> bool:
    for ranks in ([2, 3, 4], [0, 3, 4]):  # ring at 5's groups of 3, made only by their members
        if rank in ranks:
            group = dist.new_group(ranks, use_local_synchronization=True, timeout=timedelta(seconds=3))
            dist.all_reduce(torch.ones(1), group=group)
    return True


def test_local_synchronization_hangs_on_overlapping_groups() -> None:
    """Why create_groups never makes a group by its members only (``new_group(use_local_synchronization=True)``): in
    torch 2.15 rank 0 names (0,3,4) after its group counter, which did not advance at (2,3,4), ranks 3 and 4 after
    theirs, which did; their rendezvous keys differ and the creation times out. If this starts passing, torch fixed
    it."""
    with pytest.raises(WorkerError, match="timeout|Timeout|timed out"):
        run_workers(local_synchronization_worker, 5, timeout=60)


# -- scripts/bench_groups.py -------------------------------------------------------------------------------------
def test_bench_counts_by_hand() -> None:
    """World-wide splits with a bound device. complete at 64: the old way makes one (a copy of the world), the new
    none (one with a timeout); ring at 65: groups (62,63,64) and (0,63,64), one per round: two either way, ranks 63
    and 64 hold two; alternating-exp-ring at 128 nodes x 8: 128 node groups + 7 x 64 two-node groups = 576 against
    one per step of the 2 x 7 rounds."""
    complete = bench_groups.count(build_topology("complete", 64))
    assert (complete.old_calls, complete.new_calls, complete.new_calls_timeout) == (1, 0, 1)
    assert (complete.old_held, complete.new_held, complete.new_held_timeout) == ([1] * 64, [0] * 64, [1] * 64)
    ring = bench_groups.count(build_topology("ring", 65))
    assert (ring.old_calls, ring.new_calls, ring.new_calls_timeout) == (2, 2, 2)
    held = [0] * 65
    for r in (62, 63, 64, 0, 63, 64):
        held[r] += 1
    assert ring.old_held == ring.new_held == held
    aer = bench_groups.count(build_topology("alternating-exp-ring", 1024, 8))
    assert (aer.old_calls, aer.new_calls) == (128 + 7 * 64, 14)
    # Each worker: its node's group and one two-node group per node round.
    assert aer.old_held == aer.new_held == [1 + 7] * 1024


@pytest.mark.parametrize(
    "approach,bound", [("old", False), pytest.param("new", True, marks=needs_cpu_split), ("new", False)]
)
def test_bench_fake_backend_matches_counts(approach: str, bound: bool) -> None:
    """The real create_groups and the old loop, run for one simulated rank of 256 on torch's fake backend, make the
    counted calls and hold the counted groups: bound to a device, a split per partition; unbound, a new_group per
    group (not the world's) as the old loop."""
    topology = build_topology("alternating-exp-ring", 256, 8)
    counted = bench_groups.count(topology)
    calls = counted.new_calls if bound else counted.old_calls
    measured = bench_groups.fake_run("alternating-exp-ring", 256, 8, rank=9, approach=approach, bound=bound)
    assert (measured.calls, measured.held) == (calls, counted.new_held[9]), (approach, bound)
