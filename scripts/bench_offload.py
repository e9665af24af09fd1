"""Streaming DiLoCo with and without ``offload`` (issue 37): the bytes the front holds on the device and in host memory,
peak device memory over the model's own, and the time of an inner step with and without an outer step in it::

    python scripts/bench_offload.py                                   # CPU, one worker (the numbers in BENCHMARKS.md)
    python scripts/bench_offload.py --workers 4 --topology ring --compression int8      # CPU, gloo
    python scripts/bench_offload.py --device cuda --width 4096 --layers 8 --out bench/offload.json      # one GPU

The model is ``--layers`` Linear(width, width) layers with ReLU between, float32, AdamW inside, Nesterov SGD outside,
cut into ``--fragments`` fragments synced in turn (``--sync-every`` H, ``--delay`` τ). Each round runs both fronts
(offload off, then on) from the same initial model in the same process(es); ``--rounds`` rounds, medians reported.
Per run, on rank 0:

* ``memory_bytes()`` after every inner step: the most on the device and in host memory (the front's own accounting,
  tests/test_local_steps_offload.py checks it against a hand count and, on CUDA, against the allocator), and the
  most on the device after any ``outer.step()`` call (a part of an outer step: its optimizer state is in);
* CUDA: peak ``torch.cuda.max_memory_allocated()`` minus what was allocated before the front was built (the model,
  its gradients and AdamW's state), so the front's and the steps' own peak;
* time per inner step (the device synchronized after each), the median of steps that take an outer step and of those
  that do not: their difference is what an outer step costs (on the CPU, offload's copies are host to host);
* then ``--steps`` more steps timed together, the device synchronized once at their end (``steady_step_ms``: the
  mean): what training sees, with offload's side-stream copies free to overlap the next inner steps.

On CUDA only one worker runs (NCCL takes one GPU per rank); on the CPU ``--workers`` gloo processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decent_train import DiLoCo  # noqa: E402


def build(args: argparse.Namespace, device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(args.layers):
        layers += [nn.Linear(args.width, args.width)] + ([nn.ReLU()] if i < args.layers - 1 else [])
    return nn.Sequential(*layers).to(device)


def run(args: argparse.Namespace, rank: int, device: torch.device, offload: bool) -> dict[str, Any]:
    """One training run of ``args.steps`` inner steps with the front; what it measured."""
    model = build(args, device)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width, device=device, generator=torch.Generator(device).manual_seed(rank))
    cuda = device.type == "cuda"

    def step() -> None:
        ((model(x) - x) ** 2).mean().backward()
        inner.step()
        inner.zero_grad(set_to_none=False)

    step()  # the gradients and AdamW's state exist before the front: the baseline holds them
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated() if cuda else 0
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    per = len(linears) // args.fragments
    fragments = [nn.ModuleList(linears[i * per:(i + 1) * per]) for i in range(args.fragments)]
    front = DiLoCo(model, inner, outer, args.sync_every, args.topology, fragments=fragments,
                   fragment_sync_delay=args.delay, compression=args.compression, offload=offload)
    held: list[dict[str, int]] = []
    in_outer: list[int] = []  # (a few microseconds, inside the timed steps that take an outer step)
    outer.register_step_post_hook(lambda *_: in_outer.append(front.memory_bytes()["device"]))
    with_outer: list[float] = []
    without: list[float] = []
    with front:
        for _ in range(args.steps):
            before, start = front.outer_steps, time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            (with_outer if front.outer_steps > before else without).append(1000 * (time.perf_counter() - start))
            held.append(front.memory_bytes())  # after the step's hooks, outside its time
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        steady = 1000 * (time.perf_counter() - start) / args.steps
    front.host_state_ready()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "offload": offload,
        "model_mib": params / 2**20,
        "front_device_mib_max": max(h["device"] for h in held) / 2**20,
        "front_host_mib_max": max(h["host"] for h in held) / 2**20,
        "front_device_mib_max_in_outer_step": max(in_outer, default=0) / 2**20,
        "peak_over_model_mib": (torch.cuda.max_memory_allocated() - baseline) / 2**20 if cuda else None,
        "inner_step_ms": statistics.median(without[1:] or without),  # the first step warms up
        "step_with_outer_ms": statistics.median(with_outer[1:] or with_outer),
        "steady_step_ms": steady,
    }


def worker(rank: int, args: argparse.Namespace, workdir: str) -> None:
    device = torch.device(args.device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.workers))
    if device.type == "cuda":
        torch.cuda.set_device(0)
    store = dist.FileStore(os.path.join(workdir, "store"), args.workers)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=args.workers, timeout=timedelta(seconds=300))
    rounds = [[run(args, rank, device, offload) for offload in (False, True)] for _ in range(args.rounds)]
    if rank == 0:
        with open(os.path.join(workdir, "result.json"), "w") as f:
            json.dump(rounds, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--delay", type=int, default=1)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--topology", default="complete")
    parser.add_argument("--compression", default=None, choices=["int8", "bf16"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.device == "cuda" and args.workers != 1:
        raise SystemExit(f"--workers={args.workers}: one worker on CUDA (NCCL takes one GPU per rank)")
    if args.layers % args.fragments:
        raise SystemExit(f"--layers={args.layers} is not a multiple of --fragments={args.fragments}")
    with tempfile.TemporaryDirectory() as workdir:
        mp.start_processes(worker, args=(args, workdir), nprocs=args.workers, start_method="fork" if
                           args.device == "cpu" else "spawn")
        rounds = json.loads(Path(workdir, "result.json").read_text())
    summary = {}
    for i, offload in enumerate((False, True)):
        runs = [r[i] for r in rounds]
        summary["offload" if offload else "on device"] = {
            key: (statistics.median(r[key] for r in runs) if runs[0][key] is not None else None)
            for key in runs[0] if key != "offload"
        }
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"{device}, torch {torch.__version__}; {args.layers} x Linear({args.width}, {args.width}) float32, "
          f"{args.fragments} fragments, H={args.sync_every}, tau={args.delay}, {args.topology} of {args.workers}, "
          f"compression={args.compression}; median of {args.rounds} rounds")
    keys = list(summary["on device"])
    print("| | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, values in summary.items():
        print(f"| {name} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in values.values()) + " |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "device": device,
                                        "summary": summary, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
