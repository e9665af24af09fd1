"""Training throughput of decent_train against decent-dp 0.2.3, torch DDP and no communication at all.

Run on CPU with the gloo backend, one torchrun launch, all implementations side by side::

    torchrun --standalone --nproc_per_node=2 scripts/bench_engine.py [--topologies ring,complete] [--optim adamw] \
        [--bucket-mb 4] [--only ddp,decent_train/ring] [--phases 20] [--steps 30] [--warmup 5] [--repeats 3] \
        [--width 1024] [--depth 4] [--batch 64] [--local-world-size 1] [--json out.json]

``scripts/benchmark.py`` runs it for several worker counts, optionally on a rate-limited network or with each
implementation in a launch of its own, and draws the chart. Every rank builds, from the same seed, an MLP (``depth`` x
Linear(width, width)+ReLU, then Linear(width, 10)) for each of

* ``local``: plain model and optimizer step after backward, no communication (the ideal limit);
* ``decent_train/TOPOLOGY``: our DecentralizedDataParallel (optimizer steps inside backward), for each topology;
  ``allreduce`` as a topology is the engine's gradient all-reduce mode;
* ``decent_dp/TOPOLOGY``: decent-dp 0.2.3's class on the same topologies (skipped, with the reason, if it is not
  installed or the topology cannot serve this world size);
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (``bucket_cap_mb`` = ``--bucket-mb``).

``--local-world-size`` is the workers per node that node-aware topologies (alternating-exp-ring) assume: 1 (the
default) makes every worker a node, which is what an emulated network with one slow link between all workers models.

All use the optimizer of ``--optim`` (``make_optimizer``: SGD lr 0.01 with momentum 0.9, torch's AdamW lr 1e-3, or
decent_train's AccumAdamW) and the bucket size of ``--bucket-mb``, on synthetic batches generated per rank before
timing. The machine is shared and noisy, so the implementations are interleaved: each repeat runs, for each
implementation, ``warmup`` untimed steps then ``steps`` timed steps between two barriers (the window ends when the
slowest rank is done). Throughput is global: ``batch * world_size * steps / seconds``; the table shows the median over
repeats and min/max. ``--phases N`` then profiles N steps of each implementation with torch.profiler and prints the
median time per step of each phase (``phase_of``) on rank 0.

Reading the ratios: ``vs local`` is the fraction of communication-free throughput kept (1.0 = communication fully
hidden or free); ``vs ddp`` > 1 means faster than torch's all-reduce DDP; ``decent_train / decent_dp`` > 1 means our
engine is faster than the baseline on the same topology. On 2 shared CPU cores the workers also compete for compute,
so the absolute numbers say little; compare the ratios.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import resource
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.profiler import record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # decent_train from this checkout, installed or not

from decent_train.engine.compress import COMPRESSORS  # noqa: E402
from decent_train.engine.host_memory import keep_freed_host_memory  # noqa: E402

Step = Callable[[Tensor, Tensor], None]


def make_mlp(width: int, depth: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


OPTIMIZERS = ("sgd", "adamw", "accum_adamw")


@dataclass(frozen=True)
class Setup:
    """What every implementation of one launch shares: the optimizer, the bucket size, the node size."""

    optim: str = "sgd"
    bucket_mb: float = 25
    local_world_size: int = 1
    message_mb: float = 0
    compression: str = "none"  # decent_train's gossip: none, bf16 or int8 (engine/exchange.py)


def make_optimizer(params: list[Tensor], optim: str) -> torch.optim.Optimizer:
    """The same optimizer for every implementation: SGD (lr 0.01, momentum 0.9), torch's AdamW (lr 1e-3, its default
    weight decay 0.01) or decent_train's AccumAdamW (lr 1e-3, weight decay 0.01, accum_iter 4)."""
    if optim == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if optim == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if optim == "accum_adamw":
        from decent_train import AccumAdamW

        return AccumAdamW(params, lr=1e-3, weight_decay=0.01, accum_iter=4)
    raise ValueError(f"--optim {optim!r}: valid are {', '.join(OPTIMIZERS)}")


def optim_fn(optim: str) -> Callable[[list[tuple[str, Tensor]]], torch.optim.Optimizer]:
    """A bucket's optimizer for the engines (they pass (name, parameter) pairs)."""
    return lambda named: make_optimizer([p for _, p in named], optim)


def training_step(model: nn.Module, step_optimizer: Callable[[], None] | None = None) -> Step:
    """forward, backward and (for plain loops) the optimizer step, each in a profiler scope (``phase_breakdown``).
    An engine's loop is decent-dp's documented one: ``model.zero_grad()`` before backward."""

    def step(x: Tensor, y: Tensor) -> None:
        with record_function("bench.step"):
            with record_function("bench.forward"):
                loss = F.cross_entropy(model(x), y)
            with record_function("bench.backward"):
                if step_optimizer is None:
                    model.zero_grad()
                loss.backward()
            if step_optimizer is not None:
                step_optimizer()

    return step


def build_local(model: nn.Module, topology: str, setup: Setup) -> Step:
    opt = make_optimizer(list(model.parameters()), setup.optim)

    def step_optimizer() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return training_step(model, step_optimizer)


def build_ddp(model: nn.Module, topology: str, setup: Setup) -> Step:
    return build_local(nn.parallel.DistributedDataParallel(model, bucket_cap_mb=setup.bucket_mb), topology, setup)


def build_decent_train(model: nn.Module, topology: str, setup: Setup) -> Step:
    from decent_train import ALLREDUCE, DecentralizedDataParallel, build_topology

    if topology != ALLREDUCE:  # the engine's gradient all-reduce mode serves any world size
        build_topology(topology, dist.get_world_size(), setup.local_world_size)  # a ValueError when it cannot
    wrapped = DecentralizedDataParallel(
        model, optim_fn(setup.optim), topology=topology, bucket_size_in_mb=setup.bucket_mb,
        local_world_size=setup.local_world_size, message_size_in_mb=setup.message_mb,
        compression=None if setup.compression == "none" else setup.compression,
    )
    wrapped.train()
    return training_step(wrapped)


def build_decent_dp(model: nn.Module, topology: str, setup: Setup) -> Step:
    from decent_dp.ddp import DecentralizedDataParallel
    from decent_dp.topo import TopologyReg

    if topology not in TopologyReg.registry:
        raise ValueError(f"decent-dp has no topology '{topology}'")
    if topology == "ring" and dist.get_world_size() % 2:  # the check decent-dp does, without its logged error
        raise ValueError(f"decent-dp's ring needs an even world size, got {dist.get_world_size()}")
    if dist.get_world_size() == 1:
        raise ValueError("decent-dp cannot run one worker (its exchange needs a peer)")
    from decent_train import build_topology

    ours = build_topology(topology, dist.get_world_size(), setup.local_world_size)
    if any(edge.size == 1 for r in range(ours.period) for edge in ours.rounds[r]):
        raise ValueError(f"{topology} leaves a worker alone in a round here; decent-dp 0.2.3 divides by zero there")
    wrapped = DecentralizedDataParallel(
        model, optim_fn(setup.optim), topology=topology, bucket_size_in_mb=setup.bucket_mb,
        _local_world_size=setup.local_world_size,
    )
    wrapped.train()
    return training_step(wrapped)


BUILDERS: dict[str, Callable[[nn.Module, str, Setup], Step]] = {
    "local": build_local, "decent_train": build_decent_train, "decent_train_messages": build_decent_train,
    "decent_dp": build_decent_dp, "ddp": build_ddp,
}


def implementations(
    topologies: list[str], message_mb: float = 0, compressions: tuple[str, ...] = ()
) -> list[tuple[str, str, str]]:
    """(name, builder, topology) of every implementation measured, in table order; a compressed variant's name ends
    in its compression (``decent_train/ring/int8``)."""
    split = [(f"decent_train/{t}/{message_mb:g}MB-messages", "decent_train_messages", t) for t in topologies]
    return [
        ("local", "local", ""),
        *[(f"decent_train/{t}", "decent_train", t) for t in topologies],
        *[(f"decent_train/{t}/{c}", "decent_train", t)
          for t in topologies if t != "allreduce" for c in compressions if c != "none"],  # all-reduce: never compressed
        *(split if message_mb else []),
        *[(f"decent_dp/{t}", "decent_dp", t) for t in topologies],
        ("ddp", "ddp", ""),
    ]


def summarize(
    rates: dict[str, list[float]], wire: dict[str, list[float]], faults: dict[str, list[float]]
) -> dict[str, dict[str, Any]]:
    """Per implementation: its samples/s, their median, min and max, the median's ratios to the communication-free
    loop's and DDP's (None where they were not measured), and the medians of its loopback bytes and page faults per
    step."""
    med = {name: statistics.median(r) for name, r in rates.items()}
    return {name: {"samples_per_s": r, "median": med[name], "min": min(r), "max": max(r),
                   "vs_local": med[name] / med["local"] if "local" in med else None,
                   "vs_ddp": med[name] / med["ddp"] if "ddp" in med else None,
                   "wire_bytes_per_step": statistics.median(wire[name]),
                   "page_faults_per_step": statistics.median(faults[name])}
            for name, r in rates.items()}


def all_ranks_ok(ok: bool) -> bool:
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def loopback_bytes() -> int:
    """Bytes sent over this network namespace's loopback so far (/proc/net/dev): inside benchmark.py's --rate
    namespace, exactly what the workers put on the wire; on a shared machine's loopback, other traffic too."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])  # transmit bytes
    return 0


def timed_run(
    step: Step, batches: list[tuple[Tensor, Tensor]], warmup: int, steps: int
) -> tuple[float, float, float]:
    """Seconds for ``steps`` steps after ``warmup`` ones (the slowest rank's), the loopback bytes per step, and the
    page faults per step (the rank with most): memory mapped afresh every step (engine/host_memory.py)."""
    for i in range(warmup):
        step(*batches[i % len(batches)])
    dist.barrier()
    sent, faults, start = loopback_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    for i in range(steps):
        step(*batches[i % len(batches)])
    dist.barrier()  # inside the window: it ends when the slowest rank is done, the same on every rank
    measured = torch.tensor([time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults],
                            dtype=torch.float64)
    sent = loopback_bytes() - sent
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    return measured[0].item(), sent / steps, measured[1].item() / steps


def measure_link(numel: int, repeats: int, message_numel: int = 0) -> float | None:
    """Median seconds of one pair exchange of ``numel`` float32 values with no computation running (ranks 2i and
    2i+1 send to each other at once, as ring gossip does), in one message or in messages of ``message_numel``: what
    the link achieves. None for one worker."""
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    send, receive = torch.ones(numel), torch.empty(numel)
    times = []
    for _ in range(repeats + 1):  # the first one sets up the connection
        dist.barrier()
        start = time.perf_counter()
        if peer < world:
            pieces = zip(send.split(message_numel or numel), receive.split(message_numel or numel))
            ops = [op for i, (a, b) in enumerate(pieces)
                   for op in (dist.P2POp(dist.isend, a, peer, tag=i), dist.P2POp(dist.irecv, b, peer, tag=i))]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times[1:]) if world > 1 else None


PHASES = ("forward", "backward", "hooks", "mix", "optimizer", "wait", "launch", "end of backward", "other")


def phase_of(event_name: str) -> str | None:
    """The phase a profiler event starts (None: it belongs to the phase of the event it runs inside).

    ``hooks`` is time in AccumulateGrad nodes outside the engine's own scopes: accumulating the gradient plus the
    gradient hooks (the engine's Python bookkeeping; DDP's reducer copying gradients into its buckets and launching
    their all-reduce). ``end of backward`` is backward outside autograd nodes: the callbacks queued for its end (DDP
    waits there for its last all-reduce and copies the averages back; decent_train's deferred work)."""
    if event_name == "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad":
        return "hooks"
    if event_name.startswith("autograd::engine::evaluate_function:"):
        return "backward"
    if event_name.startswith("Optimizer."):  # step and zero_grad, wherever they run
        return "optimizer"
    return {
        "bench.step": "other", "bench.forward": "forward", "bench.backward": "end of backward",
        "decent_train.mix": "mix", "decent_train.wait": "wait", "decent_train.launch": "launch",
    }.get(event_name)


def phase_breakdown(step: Step, batches: list[tuple[Tensor, Tensor]], steps: int) -> dict[str, float]:
    """Milliseconds in each of ``PHASES`` of this rank's main thread per step, the median over ``steps`` steps run
    under torch.profiler (a step stalled by the shared machine does not skew it): every event's self time goes to
    the phase of its nearest enclosing scope that names one."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            step(*batches[i % len(batches)])

    def attribute(event: Any, phase: str, totals: dict[str, float]) -> None:
        phase = phase_of(event.name) or phase
        totals[phase] += event.cpu_time_total - sum(child.cpu_time_total for child in event.cpu_children)
        for child in event.cpu_children:
            attribute(child, phase, totals)

    per_step = []
    for event in prof.events():
        if event.name == "bench.step" and event.cpu_parent is None:
            per_step.append(dict.fromkeys(PHASES, 0.0))
            attribute(event, "other", per_step[-1])
    return {phase: statistics.median(t[phase] for t in per_step) / 1000 for phase in PHASES}


def print_phases(phases: dict[str, dict[str, float]]) -> None:
    print("per-phase ms/step, median over the profiled steps (rank 0, torch.profiler; see phase_of):")
    print(f"{'implementation':<34} " + " ".join(f"{p[:9]:>9}" for p in PHASES) + f" {'sum':>9}")
    for name, times in phases.items():
        print(f"{name:<34} " + " ".join(f"{times[p]:>9.2f}" for p in PHASES) + f" {sum(times.values()):>9.2f}")


def parser() -> argparse.ArgumentParser:
    """bench_engine.py's options (benchmark.py reads them too, to know which implementations a launch measures)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topologies", default="ring", help="comma-separated")
    p.add_argument("--local-world-size", type=int, default=1, help="workers per node that topologies assume")
    p.add_argument("--optim", default="sgd", choices=OPTIMIZERS, help="the optimizer of every implementation")
    p.add_argument("--bucket-mb", type=float, default=25,
                   help="bucket size of every implementation (DDP: bucket_cap_mb)")
    p.add_argument("--only", default=None,
                   help="comma-separated implementation names (e.g. ddp or decent_train/ring): measure just these")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--phases", type=int, default=0, metavar="STEPS",
                   help="after timing, profile this many steps of each implementation: time per phase")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compression", default="none",
                   help="comma-separated compressions (bf16, int8) to measure decent_train with, besides none")
    p.add_argument("--message-mb", type=float, default=0,
                   help="also measure decent_train with pair exchanges split into messages of this size")
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    return p


def main() -> None:
    args = parser().parse_args()

    compressions = tuple(args.compression.split(","))
    unknown = [c for c in compressions if c not in ("none", *COMPRESSORS)]
    if unknown:
        sys.exit(f"bench_engine.py: --compression {','.join(unknown)}: valid are none, {', '.join(COMPRESSORS)}")
    candidates = implementations(args.topologies.split(","), args.message_mb, compressions)
    if args.only:
        known = [name for name, _, _ in candidates]
        unknown = [name for name in args.only.split(",") if name not in known]
        if unknown:
            sys.exit(f"bench_engine.py: --only {','.join(unknown)}: not measured here; valid: {', '.join(known)}")
        candidates = [c for c in candidates if c[0] in args.only.split(",")]
    setup = Setup(args.optim, args.bucket_mb, args.local_world_size)

    torch.set_num_threads(1)
    # Every implementation on the allocator setting the engine makes (engine/host_memory.py): freeing the link test's
    # 26 MB buffers would do the same by accident, and the plain loop and DDP must not run on a worse one.
    keep_freed_host_memory()
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        from loguru import logger  # both engines log at DEBUG through loguru: keep the table readable

        logger.remove()
        logger.add(sys.stderr, level="WARNING")
    except ImportError:
        pass

    gen = torch.Generator().manual_seed(args.seed + 1000 * (rank + 1))
    batches = [(torch.randn(args.batch, args.width, generator=gen), torch.randint(0, 10, (args.batch,), generator=gen))
               for _ in range(8)]

    parameters = sum(p.numel() for p in make_mlp(args.width, args.depth, args.seed).parameters())
    link_seconds = measure_link(parameters, 5)
    message_numel = int(args.message_mb * 2**20) // 4
    link_split_seconds = measure_link(parameters, 5, message_numel) if message_numel else None

    steps: dict[str, Step] = {}
    skipped: dict[str, str] = {}
    for name, builder, topology in candidates:
        model = make_mlp(args.width, args.depth, args.seed)
        reason = ""
        try:
            steps[name] = BUILDERS[builder](
                model, topology, replace(
                    setup, message_mb=args.message_mb if builder == "decent_train_messages" else 0,
                    compression=name.rpartition("/")[2] if name.rpartition("/")[2] in COMPRESSORS else "none",
                )
            )
        except (ImportError, ValueError) as exc:
            if builder not in ("decent_dp", "decent_train", "decent_train_messages"):
                raise
            reason = f"{type(exc).__name__}: {exc}"
        if not all_ranks_ok(not reason):
            skipped[name] = reason or "failed on another rank"
            steps.pop(name, None)
            continue
        for i in range(2):  # decent-dp traces at step 0 and builds its buckets at step 1: keep both out of timing
            steps[name](*batches[i])

    rates: dict[str, list[float]] = {name: [] for name in steps}
    wire: dict[str, list[float]] = {name: [] for name in steps}
    faults: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            seconds, sent, faulted = timed_run(step, batches, args.warmup, args.steps)
            rates[name].append(args.batch * world * args.steps / seconds)
            wire[name].append(sent)
            faults[name].append(faulted)
    phases = {name: phase_breakdown(step, batches, args.phases) for name, step in steps.items()} if args.phases else {}

    if rank == 0:
        results = summarize(rates, wire, faults)
        med = {name: r["median"] for name, r in results.items()}
        ours_vs_dp = {
            t: med[f"decent_train/{t}"] / med[f"decent_dp/{t}"]
            for t in args.topologies.split(",")
            if f"decent_train/{t}" in med and f"decent_dp/{t}" in med
        }
        versions = f"torch {torch.__version__}"
        if ours_vs_dp:
            versions += f", decent-dp {importlib.metadata.version('decent-dp')}"
        print(f"command: torchrun --nproc_per_node={world} {shlex.join(sys.argv)}")
        print(f"world size {world}, gloo, CPU, {torch.get_num_threads()} thread/worker, {versions}")
        print(f"MLP width {args.width} depth {args.depth} ({parameters / 1e6:.2f}M parameters), batch {args.batch}/rank, "
              f"{args.optim}, {args.bucket_mb:g} MB buckets, {args.repeats} x ({args.warmup} warmup + {args.steps} "
              "timed) steps")
        if link_seconds is not None:
            print(f"link: a pair exchange of the model ({parameters * 4 / 1e6:.1f} MB each way, no compute) takes "
                  f"{1000 * link_seconds:.1f} ms: {parameters * 32 / link_seconds / 1e9:.2f} Gbit/s each way")
        if link_split_seconds is not None:
            print(f"link: the same in {args.message_mb:g} MB messages takes {1000 * link_split_seconds:.1f} ms: "
                  f"{parameters * 32 / link_split_seconds / 1e9:.2f} Gbit/s each way")
        print(f"{'implementation':<34} {'samples/s':>10} {'min':>10} {'max':>10} {'vs local':>9} {'vs ddp':>7} "
              f"{'MB/step':>8} {'faults/step':>11}")
        for name, r in results.items():
            ratios = " ".join(f"{x:>{w}.3f}" if x is not None else f"{'-':>{w}}"
                              for x, w in ((r["vs_local"], 9), (r["vs_ddp"], 7)))
            print(f"{name:<34} {r['median']:>10.1f} {r['min']:>10.1f} {r['max']:>10.1f} {ratios} "
                  f"{r['wire_bytes_per_step'] / 1e6:>8.1f} {r['page_faults_per_step']:>11.0f}")
        for name, reason in skipped.items():
            print(f"{name:<34} skipped: {reason}")
        for t, ratio in ours_vs_dp.items():
            print(f"decent_train / decent_dp on {t}: {ratio:.3f}")
        if phases:
            print_phases(phases)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"argv": sys.argv, "world_size": world, "torch": torch.__version__, "args": vars(args),
                           "setup": asdict(setup), "parameters": parameters, "link_exchange_s": link_seconds,
                           "link_exchange_split_s": link_split_seconds, "results": results, "phases": phases,
                           "skipped": skipped, "decent_train_vs_decent_dp": ours_vs_dp}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without the interpreter's teardown: a baseline's gloo work (decent-dp's) may still hold a tensor on gloo's
    # worker thread, whose release then needs the GIL and aborts a finished rank (SIGABRT, "terminate called without
    # an active exception": engine/comm.py's run_collective). It failed a CI launch once, its peer's agent then
    # waiting out the launch's time limit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
