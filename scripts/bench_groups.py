"""Process groups each rank creates for a topology: the old way (a ``new_group`` per group, on every rank) against
``Topology.create_groups``::

    python scripts/bench_groups.py                  # counts at 64, 128, 256, 1024 ranks (8 per node)
    python scripts/bench_groups.py --sizes 64 --no-fake --gloo 64 --repeats 3   # and times 64 real gloo processes

What is measured, and what is not:

* ``splits``: world-wide communicator splits per rank when the default group is bound to a device (NCCL with
  ``device_id``, as the worker initializes it): the old way's ``new_group`` splits the world once per group, every
  rank taking part; ``create_groups`` calls ``split_group`` once per stage partition. Counted from the schedule (pure
  Python), independently of the code. Unbound (gloo, NCCL without ``device_id``) neither way has any: a group's
  creation involves its members only, and ``create_groups`` keeps the ``new_group`` per group there.
* ``held``: communicators a rank ends up with (max and mean over ranks), the same both ways but for a group spanning
  the world: the new way reuses the default group for it, unless a timeout is given (the ``timeout`` columns).
* ``fake``: the real code run for the busiest simulated rank on torch's ``fake`` backend, which makes groups without
  communicating: the old loop unbound (bound, its non-members fail in torch 2.15), ``create_groups`` bound. It checks
  the counted calls and times torch's Python bookkeeping only, nothing of NCCL's.
* ``--gloo N``: N forked gloo processes on this machine with a TCPStore (as torchrun), each timing the old loop and
  ``create_groups`` unbound (the same ``new_group`` calls but for the world's group), then ``create_groups`` bound to
  ``cpu:0`` (``split_group``); the slowest rank, median over repeats. On gloo a split saves nothing (non-members never
  communicated) and costs every rank a new store connection per call: this times gloo, not what NCCL saves.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decent_train.engine.topology import Topology, build_topology  # noqa: E402

# (topology, world size, workers per node) at each simulated size; ring at the odd size above has a group of 3.
SIZES = (64, 128, 256, 1024)
LOCAL = 8


def cases(sizes: tuple[int, ...] = SIZES, local: int = LOCAL) -> list[tuple[str, int, int]]:
    rows = []
    for n in sizes:
        rows += [
            ("complete", n, 1),
            ("ring", n + 1, 1),
            ("one-peer-exp", n, 1),
            ("alternating-exp-ring", n, local),
            ("hierarchical", n, local),
        ]
    return rows


@dataclass
class Counts:
    """World-wide creation calls per rank and communicators held by each rank, old and new (without and with a
    timeout given to create_groups)."""

    old_calls: int
    new_calls: int
    new_calls_timeout: int
    old_held: list[int]
    new_held: list[int]
    new_held_timeout: list[int]


def count(topology: Topology) -> Counts:
    """Counted from the schedule alone, independently of ``create_groups``."""
    n = topology.world_size
    world = tuple(range(n))
    partitions = [[tuple(e.ranks) for e in edges if e.size >= 3] for stages in topology.stages for edges in stages]
    groups = {g for partition in partitions for g in partition}

    def held(groups: set[tuple[int, ...]]) -> list[int]:
        per_rank = [0] * n
        for g in groups:
            for r in g:
                per_rank[r] += 1
        return per_rank

    def distinct(reuse_world: bool) -> int:
        return len({frozenset(g for g in p if not (reuse_world and g == world)) for p in partitions} - {frozenset()})

    return Counts(
        old_calls=len(groups),  # one new_group per distinct group, on every rank; complete's copies the world
        new_calls=distinct(reuse_world=True),
        new_calls_timeout=distinct(reuse_world=False),
        old_held=held(groups),
        new_held=held(groups - {world}),
        new_held_timeout=held(groups),
    )


def old_create_groups(topology: Topology) -> None:
    """The previous ``Topology.create_groups``: a process group per distinct group of >= 3, on every rank."""
    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for stages in topology.stages:
        for edge in (e for edges in stages for e in edges):
            key = tuple(edge.ranks)
            if len(key) >= 3 and key not in groups:
                groups[key] = dist.new_group(list(key))
            edge.group = groups.get(key)


@dataclass
class Measured:
    calls: int  # split_group / new_group calls this rank made (each one world-wide)
    held: int  # process groups this rank holds besides the default one
    seconds: float


def _create(topology: Topology, approach: str, timeout: timedelta | None) -> tuple[int, float]:
    """Run one approach, counting its split_group / new_group calls; returns (calls, seconds)."""
    calls = 0
    split_group, new_group = dist.split_group, dist.new_group

    def counting(fn):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            return fn(*args, **kwargs)

        return wrapper

    dist.split_group, dist.new_group = counting(split_group), counting(new_group)
    try:
        start = time.perf_counter()
        if approach == "old":
            old_create_groups(topology)
        else:
            topology.create_groups(timeout=timeout)
        return calls, time.perf_counter() - start
    finally:
        dist.split_group, dist.new_group = split_group, new_group


def _held() -> int:
    from torch.distributed import distributed_c10d as c10d

    return sum(1 for pg in c10d._world.pg_map if pg is not c10d._get_default_group())


def bind_to_cpu() -> Callable[[], None]:
    """Bind the default group to ``cpu:0``, the CPU's stand-in for NCCL bound to its GPU
    (``init_process_group(device_id=...)``, as the worker joins): ``create_groups`` then splits the world with
    ``dist.split_group``. Returns the function that undoes it (a forked worker that exits need not call it).

    torch 2.13 and 2.14 refuse a CPU ``device_id`` and split only the backend of an accelerator, so the binding is
    made here as ``init_process_group`` makes it (the group's ``bound_device_id``, its backend connected for that
    device) and, until undone, ``torch.accelerator`` names the CPU in this process. ``new_group`` stays refused while
    bound (it hands the CPU device to the same check).
    """
    device = torch.device("cpu", 0)
    world = dist.group.WORLD
    backend = world._get_backend(device)
    world.bound_device_id = device
    if backend.supports_splitting:
        backend.eager_connect_single_device(device)
    accelerator = torch.accelerator
    is_available, current_accelerator = accelerator.is_available, accelerator.current_accelerator
    accelerator.is_available = lambda: True  # type: ignore[assignment]
    accelerator.current_accelerator = lambda check_available=False: device  # type: ignore[assignment]

    def unbind() -> None:
        accelerator.is_available, accelerator.current_accelerator = is_available, current_accelerator
        world.bound_device_id = None

    return unbind


def fake_run(
    name: str, world: int, local: int, rank: int, approach: str, bound: bool, timeout: timedelta | None = None
) -> Measured:
    """One simulated rank of ``world`` on torch's fake backend (no communication), in this process; ``bound``: the
    default group bound to ``cpu:0``, as NCCL to its GPU (the old way's non-members then fail in torch 2.15)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # and registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    unbind = bind_to_cpu() if bound else None
    try:
        calls, seconds = _create(build_topology(name, world, local, rank), approach, timeout)
        return Measured(calls, _held(), seconds)
    finally:
        if unbind is not None:
            unbind()
        dist.destroy_process_group()


def _gloo_worker(
    rank: int, world: int, workdir: str, port: int, topologies: list[tuple[str, int, int]], repeats: int, bound: bool
) -> None:
    code = 1
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=600))  # as torchrun
        timeout = timedelta(seconds=600)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        if bound:
            bind_to_cpu()  # for the life of this process
        approaches = ("new",) if bound else ("old", "new")
        rows = []  # [topology][approach][repeat] seconds; the approaches alternate
        for name, n, local in topologies:
            row: list[list[float]] = [[] for _ in approaches]
            for _ in range(repeats):
                for k, approach in enumerate(approaches):
                    dist.barrier()
                    row[k].append(_create(build_topology(name, n, local, rank), approach, None)[1])
                    dist.barrier()
            rows.append(row)
        torch.save(rows, os.path.join(workdir, f"result{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
        code = 0
    except BaseException:
        with open(os.path.join(workdir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        os._exit(code)


def gloo_times(world: int, topologies: list[tuple[str, int, int]], repeats: int, bound: bool) -> list[list[float]]:
    """Seconds per topology and approach (old, new; bound: new only) in ``world`` forked gloo processes: the slowest
    rank's create time, median over ``repeats``."""
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as workdir:
        with socket.socket() as probe:  # a free port for rank 0's store
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        args = (world, workdir, port, topologies, repeats, bound)
        procs = [ctx.Process(target=_gloo_worker, args=(r, *args)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        errors = [f for f in os.listdir(workdir) if f.startswith("error")]
        if errors:
            raise SystemExit(open(os.path.join(workdir, errors[0])).read())
        results = [torch.load(os.path.join(workdir, f"result{r}.pt")) for r in range(world)]

    def slowest(i: int, k: int) -> float:
        return statistics.median(max(res[i][k][rep] for res in results) for rep in range(repeats))

    return [[slowest(i, k) for k in range(len(results[0][i]))] for i in range(len(topologies))]


def layout(n: int, local: int) -> str:
    return f"{n} ({n // local} x {local})" if local > 1 else str(n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="simulated world sizes (comma-separated)")
    parser.add_argument("--local", type=int, default=LOCAL, help="workers per node (for the node-based topologies)")
    parser.add_argument("--gloo", type=int, default=0, help="also time both ways in this many gloo processes")
    parser.add_argument("--repeats", type=int, default=5, help="gloo timings: runs of each way (median shown)")
    parser.add_argument("--no-fake", action="store_true", help="skip the fake-backend runs")
    args = parser.parse_args()
    sizes = tuple(int(s) for s in args.sizes.split(","))

    print("| topology | ranks | splits old | splits new | splits new, timeout | held old max/mean | held new max/mean "
          "| held new, timeout | fake old: calls, ms | fake new: calls, ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, n, local in cases(sizes, args.local):
        c = count(build_topology(name, n, local))
        fake = ["-", "-"]
        if not args.no_fake:
            busiest = max(range(n), key=lambda r: c.old_held[r])
            for k, (approach, bound) in enumerate((("old", False), ("new", True))):
                m = fake_run(name, n, local, busiest, approach, bound)
                fake[k] = f"{m.calls}, {m.seconds * 1e3:.1f}"

        def held(per_rank: list[int]) -> str:
            return f"{max(per_rank)} / {statistics.mean(per_rank):.2f}"

        print(f"| {name} | {layout(n, local)} | {c.old_calls} | {c.new_calls} | {c.new_calls_timeout} "
              f"| {held(c.old_held)} | {held(c.new_held)} | {held(c.new_held_timeout)} | {fake[0]} | {fake[1]} |")

    if args.gloo:
        n = args.gloo
        topologies = [(name, size, local) for name, size, local in cases((n,), args.local) if size == n]
        unbound = gloo_times(n, topologies, args.repeats, bound=False)
        bound = gloo_times(n, topologies, args.repeats, bound=True)
        print(f"\n{n} gloo processes (TCPStore) on {os.cpu_count()} CPU cores: create time of the slowest rank, s "
              f"(median of {args.repeats})\n")
        print("| topology | ranks | groups / partitions | old (new_group) | new unbound (new_group) "
              "| new bound (split_group) |")
        print("|---|---|---|---|---|---|")
        for (name, size, local), (old, new), (split,) in zip(topologies, unbound, bound):
            c = count(build_topology(name, size, local))
            print(f"| {name} | {layout(size, local)} | {c.old_calls} / {c.new_calls} | {old:.3f} | {new:.3f} "
                  f"| {split:.3f} |")


if __name__ == "__main__":
    main()
