"""FSDP2-sharded gossip (issue 30): per-rank memory and bytes per step at K = 1, 2, 4 ranks per replica, against
HSDP, in one run on CPU with gloo::

    python scripts/bench_sharded.py --workers 8 --width 128 --layers 4 --steps 8 --out scripts/benchmarks/sharded.json
    python scripts/bench_sharded.py --workers 4 --no-timing        # memory and bytes only (~30 s)
    python scripts/bench_sharded.py --workers 4 --no-timing --mixed-precision bf16    # FSDP2's bf16 all-gathers

The model is the launcher's GPT-2 (``build_model(ModelConfig(name="gpt2", ...))``, ``--width``, ``--layers``,
``--heads``, context ``--context``, a vocabulary of ``--vocab`` tokens), float32, AdamW. For every K in ``--ks`` the
script forks ``--workers`` fresh gloo processes (one thread each) on a 2-D mesh ``(workers / K, K)`` named
(replicate, shard) and, in them, builds the model twice, on the meta device, ``fully_shard`` on every block and then
the root, and only then allocates and initializes each rank's shards (no rank holds the whole model):

* sharded gossip: over ``mesh["shard"]``, stepped by ``Gossip(model, AdamW, "ring", mesh=mesh)``: each block's shard
  swapped with the same shard of the paired replica (``decent_train/algorithms/step_gossip.py``);
* HSDP: ``fully_shard(..., mesh=mesh)`` over the 2-D mesh, torch's hybrid sharding: gradients reduce-scattered in
  the replica and all-reduced across the replicas.

What is measured, per rank:

* memory, as bytes of the LOCAL tensors after one optimizer step: parameters (``p.to_local()``), gradients, AdamW's
  two moments (``exp_avg``, ``exp_avg_sq``; its 0-d ``step`` counters are counted apart, they are not sharded) and
  the gossip front's exchange buffers, by its own accounting (``memory_bytes()["device"]``, after the warm-up steps
  and a finished exchange: the payload and the receive buffer, one shard each, and nothing else, audit D7). The ratio
  to K = 1 should be 1/K up to the padding of uneven shards (FSDP2 cuts dim 0 as ``torch.chunk``: the first ranks
  hold one row more).
  Also the resident set (Linux ``/proc/self/status``) against the one before the gossip model was built, measured
  after a throwaway tiny model has gone through the same code (torch's first step pages in ~200 MB of code and
  modules) and with glibc returning freed blocks (``mallopt``, ``malloc_trim``): ``held``, after its first steps with
  the gradients freed (parameters, moments, buffers, and a few MB of process groups and allocator state), and
  ``peak`` (``VmHWM``, reset through ``/proc/self/clear_refs``), which adds activations, the all-gathered blocks and
  the gradients. Approximate.
* bytes sent across replicas per step: the Gossip front's own ``bytes_per_inner_step()`` (ring over the workers / K
  replicas: a pair swaps its shards, so one shard per step), against the estimate for HSDP's all-reduce of the same
  shard's gradient over the R replicas, ``allreduce_bytes_per_step(R, shard bytes)`` from
  ``decent_train/components/metrics.py`` (a ring all-reduce: 2(R-1)/R x the shard), and for reference an unsharded
  all-reduce of the whole model over all workers, ``allreduce_bytes_per_step(workers, model bytes)`` (DDP). The
  traffic inside a replica (FSDP2's all-gathers and reduce-scatter) is the same in both and not counted.
* bytes sent inside a replica per step, counted at FSDP2's collectives (``dist.all_gather_single``,
  ``dist.reduce_scatter_single``, patched during one step of the gossip model): as ring collectives over its K ranks,
  an all-gather sends (K−1) x its input and a reduce-scatter (K−1)/K x its input; with their dtypes.
  ``--mixed-precision`` (as ``parallel.mixed_precision``: none, bf16, bf16-reduce) is the ``MixedPrecisionPolicy`` of
  both models' ``fully_shard`` calls; the optimizer's shards and the gossip stay fp32. No autocast: bf16 computes in
  bf16.
* time per step (``--repeats`` x ``--steps`` steps of each, interleaved, after ``--warmup``): the slowest rank's mean
  per repeat, the median over repeats. A gossip block ends with ``outer_step()`` (its last exchange waited for inside
  the block). CPU, gloo over loopback, more processes than cores: the ratio only, not what a GPU cluster does.

Writes ``--out`` (JSON) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import multiprocessing
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # noqa: F401  (slicing a DeviceMesh imports it: once here, not in every forked worker)
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decent_train.algorithms.step_gossip import Gossip  # noqa: E402  (imported before the workers fork)
from decent_train.components.metrics import allreduce_bytes_per_step  # noqa: E402
from decent_train.components.models import ModelConfig, build_model  # noqa: E402
from decent_train.config import MIXED_PRECISIONS  # noqa: E402

HERE = Path(__file__).resolve().parent


@dataclass
class Config:
    workers: int = 8
    width: int = 128
    layers: int = 4
    heads: int = 4
    context: int = 64
    vocab: int = 256
    batch: int = 4  # sequences per worker and step
    ks: list[int] = field(default_factory=lambda: [1, 2, 4])
    topology: str = "ring"
    steps: int = 8  # timed steps per repeat and variant
    repeats: int = 5
    warmup: int = 2  # untimed steps of each variant (the first of them is where memory is measured)
    timing: bool = True
    mixed_precision: str = "none"  # FSDP2's policy, as parallel.mixed_precision (MIXED_PRECISIONS)


def build_gpt(cfg: Config) -> nn.Module:
    """The GPT-2 model, the same on every rank (seeded)."""
    torch.manual_seed(0)
    model_cfg = ModelConfig(name="gpt2", layers=cfg.layers, heads=cfg.heads, width=cfg.width)
    return build_model(model_cfg, (cfg.context,), cfg.vocab)


def shard(cfg: Config, mesh: Any) -> nn.Module:
    """The GPT-2 model built on the meta device, FSDP2 over ``mesh`` (every transformer block, then the root:
    embeddings, final norm, the tied head), then this rank's shards allocated and initialized (GPT-2's
    initialization, drawn shard by shard): no rank ever holds the whole model, as FSDP2 is meant to be used."""
    with torch.device("meta"):
        model = build_gpt(cfg)
    param_dtype, reduce_dtype = MIXED_PRECISIONS[cfg.mixed_precision]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)  # the same draws on every rank: replicas start equal (HSDP)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local()
            if ".ln_" in name or name.startswith("ln_"):
                local.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith("proj.weight") else 0.02
                local.normal_(0.0, std, generator=generator)
    return model


def local_bytes(tensor: Tensor) -> int:
    """Bytes of what this rank holds of ``tensor`` (a DTensor's local shard, else the tensor)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes of the per-element states, e.g. AdamW's two moments; bytes of the 0-d ``step`` counters), local."""
    moments = counters = 0
    for state in optimizer.state.values():
        for name, value in state.items():
            if isinstance(value, Tensor):
                if name == "step":
                    counters += local_bytes(value)
                else:
                    moments += local_bytes(value)
    return moments, counters


# What FSDP2 calls (same arguments): the *_single names from torch 2.13 on, these before (which lacks the first).
FSDP_ALL_GATHER, FSDP_REDUCE_SCATTER = (
    ("all_gather_single", "reduce_scatter_single") if hasattr(dist, "all_gather_single")
    else ("all_gather_into_tensor", "reduce_scatter_tensor")
)


@contextlib.contextmanager
def replica_traffic(k: int, into: dict[str, Any]) -> Iterator[None]:
    """Adds to ``into`` what FSDP2's all-gathers and reduce-scatters inside the replica send from this rank while
    inside (ring collectives over the replica's ``k`` ranks; see the module) and the dtypes they carry."""
    originals = getattr(dist, FSDP_ALL_GATHER), getattr(dist, FSDP_REDUCE_SCATTER)

    def gather(output: Tensor, input: Tensor, *args: Any, **kwargs: Any) -> Any:
        into["all_gather_bytes"] += (k - 1) * input.numel() * input.element_size()
        into["all_gather_dtypes"].add(str(input.dtype).removeprefix("torch."))
        return originals[0](output, input, *args, **kwargs)

    def reduce_scatter(*args: Any, **kwargs: Any) -> Any:
        input = kwargs["input"]
        into["reduce_scatter_bytes"] += (k - 1) / k * input.numel() * input.element_size()
        into["reduce_scatter_dtypes"].add(str(input.dtype).removeprefix("torch."))
        return originals[1](*args, **kwargs)

    into.update(all_gather_bytes=0, reduce_scatter_bytes=0.0, all_gather_dtypes=set(), reduce_scatter_dtypes=set())
    setattr(dist, FSDP_ALL_GATHER, gather), setattr(dist, FSDP_REDUCE_SCATTER, reduce_scatter)
    try:
        yield
    finally:
        setattr(dist, FSDP_ALL_GATHER, originals[0]), setattr(dist, FSDP_REDUCE_SCATTER, originals[1])
        for key in ("all_gather_dtypes", "reduce_scatter_dtypes"):
            into[key] = sorted(into[key])


def _status(key: str) -> int | None:
    try:
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _return_freed_memory() -> None:
    """glibc: allocations from 64 KiB on mapped on their own and unmapped when freed (no dynamic threshold), and the
    heap's free top trimmed, so that the resident set follows what is allocated."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        return True
    except OSError:
        return False


def _batch(cfg: Config, rank: int, step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.context + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Config, rank: int, step: int,
                zero: bool = True) -> None:
    x, y = _batch(cfg, rank, step)
    logits = model(x)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    optimizer.step()
    if zero:
        optimizer.zero_grad()


def _warm_up(cfg: Config, mesh: Any, rank: int, world: int) -> None:
    tiny = replace(cfg, width=cfg.heads, layers=1, vocab=8, context=4, batch=1)
    model = shard(tiny, mesh["shard"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Gossip(model, optimizer, cfg.topology, mesh=mesh, local_world_size=world) as gossip:
        for step in range(2):
            _train_step(model, optimizer, tiny, rank, step)
        gossip.outer_step()  # the exchange in flight: waited for and mixed


def measure_worker(rank: int, world: int, cfg: Config, k: int) -> dict[str, Any]:
    """This rank's numbers at K = ``k`` ranks per replica (every rank of the process group calls it)."""
    replicas = world // k
    mesh = init_device_mesh("cpu", (replicas, k), mesh_dim_names=("replicate", "shard"))

    # Sharded gossip: memory first, in a process that has built nothing yet but a throwaway tiny copy (which pages in
    # torch's code and the modules a first step loads, ~200 MB that would otherwise swamp the resident-set delta).
    _warm_up(cfg, mesh, rank, world)
    gc.collect()
    _return_freed_memory()
    rss_before = _status("VmRSS")
    peak_reset = _reset_peak_rss()
    model = shard(cfg, mesh["shard"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gossip = Gossip(model, optimizer, cfg.topology, mesh=mesh, local_world_size=world)
    out: dict[str, Any] = {"rank": rank, "k": k, "replicas": replicas, "shard_position": rank % k}
    with gossip:
        traffic: dict[str, Any] = {}
        with replica_traffic(k, traffic):
            _train_step(model, optimizer, cfg, rank, 0, zero=False)
        out |= {f"replica_{key}": value for key, value in traffic.items()}
        moments, counters = optimizer_bytes(optimizer)
        out |= {
            "param_bytes": sum(local_bytes(p) for p in model.parameters()),
            "grad_bytes": sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None),
            "optimizer_bytes": moments,
            "step_counter_bytes": counters,
            "gossip_bytes_per_step": gossip.bytes_per_inner_step(),
            "topology": gossip.topology.describe().split(";")[0],
        }
        optimizer.zero_grad()
        for step in range(1, cfg.warmup):
            _train_step(model, optimizer, cfg, rank, step)
        gossip.outer_step()  # the exchange in flight: waited for and mixed
        out["gossip_buffer_bytes"] = gossip.memory_bytes()["device"]  # its own count, after exchanges finished
        rss_peak = _status("VmHWM")
        gc.collect()
        _return_freed_memory()
        rss_after = _status("VmRSS")
        out["rss_held_delta_bytes"] = (rss_after - rss_before) if rss_after and rss_before else None
        out["rss_peak_delta_bytes"] = (rss_peak - rss_before) if peak_reset and rss_peak and rss_before else None
        out["hsdp_bytes_per_step"] = allreduce_bytes_per_step(replicas, out["param_bytes"])  # its gradient's shard
        out["hsdp_bytes_per_step_by_hand"] = 2 * (replicas - 1) / replicas * out["param_bytes"]

        # HSDP on the same model, and the timings of both, interleaved.
        hsdp = shard(cfg, mesh)
        hsdp_optimizer = torch.optim.AdamW(hsdp.parameters(), lr=1e-3)
        _train_step(hsdp, hsdp_optimizer, cfg, rank, 0, zero=False)
        moments, _ = optimizer_bytes(hsdp_optimizer)
        out["hsdp_param_bytes"] = sum(local_bytes(p) for p in hsdp.parameters())
        out["hsdp_optimizer_bytes"] = moments
        hsdp_optimizer.zero_grad()
        for step in range(1, cfg.warmup):
            _train_step(hsdp, hsdp_optimizer, cfg, rank, step)
        gossip_s, hsdp_s = [], []
        if cfg.timing:
            step = cfg.warmup
            for _ in range(cfg.repeats):
                for variant, (net, opt), seconds in (("gossip", (model, optimizer), gossip_s),
                                                     ("hsdp", (hsdp, hsdp_optimizer), hsdp_s)):
                    dist.barrier()
                    start = time.perf_counter()
                    for i in range(cfg.steps):
                        _train_step(net, opt, cfg, rank, step + i)
                    if variant == "gossip":
                        gossip.outer_step()  # the exchange in flight: waited for and mixed
                    seconds.append((time.perf_counter() - start) / cfg.steps)
                step += cfg.steps
        out["gossip_step_s"], out["hsdp_step_s"] = gossip_s, hsdp_s
    return out


def _worker(rank: int, world: int, workdir: str, port: int, cfg: Config, k: int) -> None:
    code = 1
    try:
        torch.set_num_threads(1)
        _return_freed_memory()
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=300))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
        result = measure_worker(rank, world, cfg, k)
        torch.save(result, os.path.join(workdir, f"result{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
        code = 0
    except BaseException:
        with open(os.path.join(workdir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        os._exit(code)


def launch(cfg: Config, k: int, timeout: float = 600.0) -> list[dict[str, Any]]:
    """``measure_worker`` in ``cfg.workers`` fresh forked gloo processes; their results by rank."""
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as workdir:
        with socket.socket() as probe:  # a free port for rank 0's store
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        procs = [ctx.Process(target=_worker, args=(r, cfg.workers, workdir, port, cfg, k)) for r in range(cfg.workers)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(0.5)
                break
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        errors = sorted(f for f in os.listdir(workdir) if f.startswith("error"))
        if errors:
            raise RuntimeError(f"K={k}: " + open(os.path.join(workdir, errors[0])).read())
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"K={k}: workers died or timed out: exit codes {[p.exitcode for p in procs]}")
        return [torch.load(os.path.join(workdir, f"result{r}.pt"), weights_only=False) for r in range(cfg.workers)]


def _slowest(per_rank: list[list[float]]) -> list[float]:
    """Each repeat's slowest rank."""
    return [max(rank[i] for rank in per_rank) for i in range(len(per_rank[0]))] if per_rank else []


def measure(cfg: Config) -> dict[str, Any]:
    """Every K of ``cfg.ks``, one launch each; per-rank numbers and their summary."""
    for k in cfg.ks:
        if cfg.workers % k:
            raise ValueError(f"K={k} does not divide --workers={cfg.workers}")
    full = build_gpt(cfg)
    model_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    parameters = sum(p.numel() for p in full.parameters())
    del full
    rows = []
    for k in cfg.ks:
        ranks = launch(cfg, k)
        replicas = cfg.workers // k

        def stat(key: str, how: Any = max) -> Any:
            values = [r[key] for r in ranks]
            return None if any(v is None for v in values) else how(values)

        total = [r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] + r["gossip_buffer_bytes"] for r in ranks]
        gossip_ms, hsdp_ms = ([1e3 * s for s in _slowest([r[key] for r in ranks])]
                              for key in ("gossip_step_s", "hsdp_step_s"))
        rows.append({
            "k": k,
            "replicas": replicas,
            "topology": ranks[0]["topology"],
            "param_bytes_max": stat("param_bytes"),
            "param_bytes_mean": stat("param_bytes", statistics.mean),
            "grad_bytes_max": stat("grad_bytes"),
            "optimizer_bytes_max": stat("optimizer_bytes"),
            "step_counter_bytes": stat("step_counter_bytes"),
            "gossip_buffer_bytes_max": stat("gossip_buffer_bytes"),
            "total_bytes_max": max(total),
            "hsdp_param_bytes_max": stat("hsdp_param_bytes"),
            "hsdp_optimizer_bytes_max": stat("hsdp_optimizer_bytes"),
            "rss_peak_delta_bytes_max": stat("rss_peak_delta_bytes"),
            "rss_peak_delta_bytes_mean": stat("rss_peak_delta_bytes", statistics.mean),
            "rss_held_delta_bytes_max": stat("rss_held_delta_bytes"),
            "rss_held_delta_bytes_mean": stat("rss_held_delta_bytes", statistics.mean),
            "gossip_bytes_per_step_mean": stat("gossip_bytes_per_step", statistics.mean),
            "gossip_bytes_per_step_max": stat("gossip_bytes_per_step"),
            "replica_all_gather_bytes_per_step_max": stat("replica_all_gather_bytes"),
            "replica_reduce_scatter_bytes_per_step_max": stat("replica_reduce_scatter_bytes"),
            "replica_dtypes": {"all_gather": ranks[0]["replica_all_gather_dtypes"],
                               "reduce_scatter": ranks[0]["replica_reduce_scatter_dtypes"]},
            "hsdp_bytes_per_step_mean": stat("hsdp_bytes_per_step", statistics.mean),
            "hsdp_bytes_per_step_max": stat("hsdp_bytes_per_step"),
            "allreduce_unsharded_bytes_per_step": allreduce_bytes_per_step(cfg.workers, model_bytes),
            "gossip_step_ms": statistics.median(gossip_ms) if gossip_ms else None,
            "hsdp_step_ms": statistics.median(hsdp_ms) if hsdp_ms else None,
            "gossip_step_ms_repeats": gossip_ms,  # the slowest rank's, per repeat
            "hsdp_step_ms_repeats": hsdp_ms,
            "per_rank": ranks,
        })
    base = rows[0]
    for row in rows:
        row["param_ratio_vs_first"] = row["param_bytes_max"] / base["param_bytes_max"]
        row["optimizer_ratio_vs_first"] = row["optimizer_bytes_max"] / base["optimizer_bytes_max"]
        row["total_ratio_vs_first"] = row["total_bytes_max"] / base["total_bytes_max"]
        row["gossip_vs_hsdp_bytes"] = (row["gossip_bytes_per_step_mean"] / row["hsdp_bytes_per_step_mean"]
                                       if row["hsdp_bytes_per_step_mean"] else None)
        row["gossip_vs_unsharded_allreduce_bytes"] = (row["gossip_bytes_per_step_mean"]
                                                      / row["allreduce_unsharded_bytes_per_step"])
        row["gossip_vs_hsdp_time"] = (row["gossip_step_ms"] / row["hsdp_step_ms"]
                                      if row["gossip_step_ms"] and row["hsdp_step_ms"] else None)
    return {
        "what": "FSDP2-sharded gossip (Gossip front, ring over replicas) vs HSDP: per-rank local bytes of parameters, "
                "gradients, AdamW moments after one step, gossip buffers (the front's memory_bytes()) after the "
                "warm-up; bytes sent across replicas per step "
                "(gossip: bytes_per_inner_step(); HSDP: metrics.allreduce_bytes_per_step(replicas, shard bytes), a "
                "ring all-reduce estimate; unsharded: allreduce_bytes_per_step(workers, model bytes)); bytes sent "
                "inside a replica per step by FSDP2's all-gathers and reduce-scatters (counted at the collectives, "
                "ring costs), under --mixed-precision; time per step on CPU/gloo loopback (slowest rank, median over "
                "repeats)",
        "config": asdict(cfg),
        "model": {"parameters": parameters, "param_bytes": model_bytes},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "backend": "gloo, loopback, one thread per worker"},
        "rows": rows,
    }


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:.3f}"


def table(result: dict[str, Any]) -> str:
    cfg, model = result["config"], result["model"]
    lines = [
        f"GPT-2 width {cfg['width']}, {cfg['layers']} layers, vocab {cfg['vocab']}: {model['parameters']:,} "
        f"parameters, {model['param_bytes'] / 1e6:.3f} MB; {cfg['workers']} workers (gloo, CPU); per-rank bytes are "
        f"the largest rank's (MB); FSDP2 mixed precision: {cfg['mixed_precision']}",
        "",
        "| K | replicas | params | grads | AdamW moments | gossip buffers | total (vs K=1) | RSS held / peak delta "
        "| gossip B/step | HSDP all-reduce B/step (est.) | gossip/HSDP | unsharded all-reduce B/step "
        "| in-replica all-gather / reduce-scatter B/step | gossip ms | HSDP ms | gossip/HSDP time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        def ratio(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}x"

        ms = (lambda v: "-" if v is None else f"{v:.1f}")
        dtypes = (lambda row, key: f"({'/'.join(row['replica_dtypes'][key])})" if row["replica_dtypes"][key] else "")
        lines.append(
            f"| {r['k']} | {r['replicas']} | {_mb(r['param_bytes_max'])} ({r['param_ratio_vs_first']:.3f}) "
            f"| {_mb(r['grad_bytes_max'])} | {_mb(r['optimizer_bytes_max'])} ({r['optimizer_ratio_vs_first']:.3f}) "
            f"| {_mb(r['gossip_buffer_bytes_max'])} | {_mb(r['total_bytes_max'])} ({r['total_ratio_vs_first']:.3f}) "
            f"| {_mb(r['rss_held_delta_bytes_max'])} / {_mb(r['rss_peak_delta_bytes_max'])} "
            f"| {_mb(r['gossip_bytes_per_step_mean'])} "
            f"| {_mb(r['hsdp_bytes_per_step_mean'])} | {ratio(r['gossip_vs_hsdp_bytes'])} "
            f"| {_mb(r['allreduce_unsharded_bytes_per_step'])} "
            f"| {_mb(r['replica_all_gather_bytes_per_step_max'])} {dtypes(r, 'all_gather')} / "
            f"{_mb(r['replica_reduce_scatter_bytes_per_step_max'])} {dtypes(r, 'reduce_scatter')} "
            f"| {ms(r['gossip_step_ms'])} | {ms(r['hsdp_step_ms'])} "
            f"| {ratio(r['gossip_vs_hsdp_time'])} |"
        )
    lines.append("")
    lines.append("(ratio to K=1 in brackets; B/step in MB sent per rank across replicas; times: CPU, gloo loopback, "
                 f"{cfg['workers']} processes on {result['machine']['cpus']} cores, slowest rank, median of "
                 f"{cfg['repeats']} x {cfg['steps']} steps)")
    return "\n".join(lines)


def code_version() -> dict[str, Any]:
    """The commit the package is at and its files changed since (``git status``), where git can tell."""
    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "--no-optional-locks", *args], cwd=HERE.parent, capture_output=True,
                                  text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    changed = git("status", "--porcelain", "--", "decent_train")
    return {"commit": git("rev-parse", "HEAD"), "package_changes": None if changed is None else changed.splitlines()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Config()
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--width", type=int, default=defaults.width)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--context", type=int, default=defaults.context)
    parser.add_argument("--vocab", type=int, default=defaults.vocab)
    parser.add_argument("--batch", type=int, default=defaults.batch, help="sequences per worker and step")
    parser.add_argument("--ks", default=",".join(map(str, defaults.ks)), help="ranks per replica (comma-separated)")
    parser.add_argument("--topology", default=defaults.topology)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="timed steps per repeat and variant")
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--no-timing", action="store_true", help="memory and bytes only")
    parser.add_argument("--mixed-precision", default=defaults.mixed_precision, choices=list(MIXED_PRECISIONS),
                        help="FSDP2's MixedPrecisionPolicy, as parallel.mixed_precision")
    parser.add_argument("--out", type=Path, default=HERE / "benchmarks" / "sharded.json")
    args = parser.parse_args()
    cfg = Config(workers=args.workers, width=args.width, layers=args.layers, heads=args.heads, context=args.context,
                 vocab=args.vocab, batch=args.batch, ks=[int(k) for k in args.ks.split(",")], topology=args.topology,
                 steps=args.steps, repeats=args.repeats, warmup=max(1, args.warmup), timing=not args.no_timing,
                 mixed_precision=args.mixed_precision)
    code = code_version()  # before the run: the package measured, not one committed during it
    start = time.monotonic()
    result = measure(cfg)
    result["wall_s"] = round(time.monotonic() - start, 1)
    result["code"] = code
    result["command"] = "python scripts/bench_sharded.py " + " ".join(sys.argv[1:])
    print(table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {args.out} ({result['wall_s']} s)")


if __name__ == "__main__":
    main()
