"""The engine's own cost on one worker: step time of DecentralizedDataParallel against a plain training loop.

With one worker there is nothing to exchange, so the difference is the engine itself: its gradient hooks, the
per-bucket optimizers stepping inside backward and the parameters living in flat buckets. Meant for one GPU::

    python scripts/bench_overhead.py --device cuda --models resnet50,gpt2 --precision bf16 --json overhead.json

(ResNet-50 on 224x224 images, batch 64, channels_last; GPT-2 small, context 1024, batch 8; AdamW; ``--precision fp16``
adds a GradScaler to both loops). The two loops alternate, ``repeats`` times ``warmup`` + ``steps`` steps each, and the
table shows the median step time and ``plain / engine`` (above 1: the engine is faster). On CPU the same command with
small sizes (``--image-size 32 --batch-resnet 4 --gpt-layers 2 ...``) checks that it runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decent_train import DecentralizedDataParallel, optim_fn_adamw  # noqa: E402
from decent_train.components.models import ModelConfig, build_model  # noqa: E402

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
Step = Callable[[], None]


def workload(name: str, args: argparse.Namespace, device: torch.device) -> tuple[Callable[[], nn.Module], tuple[Tensor, Tensor]]:
    """A model factory (same seed each call) and one synthetic batch on ``device``."""
    g = torch.Generator().manual_seed(0)
    if name == "resnet50":
        shape = (3, args.image_size, args.image_size)
        x = torch.randn(args.batch_resnet, *shape, generator=g)
        y = torch.randint(0, 1000, (args.batch_resnet,), generator=g)
        cfg, classes = ModelConfig(name="resnet50"), 1000
    elif name == "gpt2":
        x = torch.randint(0, args.vocab, (args.batch_gpt, args.context), generator=g)
        y = torch.randint(0, args.vocab, (args.batch_gpt, args.context), generator=g)
        cfg = ModelConfig(name="gpt2", layers=args.gpt_layers, heads=args.gpt_heads, width=args.gpt_width)
        shape, classes = (args.context,), args.vocab
    else:
        raise SystemExit(f"bench_overhead.py: --models: {name!r} is not a model; valid: resnet50, gpt2")
    channels_last = name == "resnet50" and device.type == "cuda"

    def make() -> nn.Module:
        torch.manual_seed(0)
        model = build_model(cfg, shape, classes).to(device)
        return model.to(memory_format=torch.channels_last) if channels_last else model

    x = x.to(device, memory_format=torch.channels_last) if channels_last else x.to(device)
    return make, (x, y.to(device))


def loss_of(model: nn.Module, x: Tensor, y: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(x)
    return F.cross_entropy(logits.flatten(0, -2).float(), y.flatten())


def plain_loop(model: nn.Module, batch: tuple[Tensor, Tensor], args: argparse.Namespace, device: torch.device) -> Step:
    optimizer = optim_fn_adamw(list(model.named_parameters()), lr=1e-4)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")

    def step() -> None:
        scaler.scale(loss_of(model, *batch, PRECISIONS[args.precision], device)).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


def engine_loop(model: nn.Module, batch: tuple[Tensor, Tensor], args: argparse.Namespace, device: torch.device) -> Step:
    scaler = torch.amp.GradScaler(device.type) if args.precision == "fp16" else None
    engine = DecentralizedDataParallel(model, partial(optim_fn_adamw, lr=1e-4), topology="ring", scaler=scaler)

    def step() -> None:
        loss = loss_of(engine, *batch, PRECISIONS[args.precision], device)
        (scaler.scale(loss) if scaler is not None else loss).backward()  # the buckets step inside backward

    return step


def seconds_per_step(step: Step, warmup: int, steps: int, device: torch.device) -> float:
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default="resnet50,gpt2")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="bf16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-resnet", type=int, default=64)
    p.add_argument("--batch-gpt", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--gpt-layers", type=int, default=12)
    p.add_argument("--gpt-heads", type=int, default=12)
    p.add_argument("--gpt-width", type=int, default=768)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_overhead.py: --device cuda, but no CUDA device is visible")

    results = {}
    for name in args.models.split(","):
        make, batch = workload(name, args, device)
        loops = {"plain": plain_loop(make(), batch, args, device), "engine": engine_loop(make(), batch, args, device)}
        times: dict[str, list[float]] = {k: [] for k in loops}
        for _ in range(args.repeats):
            for kind, step in loops.items():
                times[kind].append(seconds_per_step(step, args.warmup, args.steps, device))
        plain, engine = statistics.median(times["plain"]), statistics.median(times["engine"])
        results[name] = {"plain_ms": 1000 * plain, "engine_ms": 1000 * engine, "plain_over_engine": plain / engine,
                         "plain_ms_all": [1000 * t for t in times["plain"]],
                         "engine_ms_all": [1000 * t for t in times["engine"]]}
        del loops

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{where}, torch {torch.__version__}, {args.precision}, {args.repeats} x ({args.warmup} + {args.steps}) steps")
    print("| model | plain loop ms/step | engine ms/step | plain / engine |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['plain_ms']:.1f} | {r['engine_ms']:.1f} | {r['plain_over_engine']:.3f}x |")
    if args.json:
        args.json.write_text(json.dumps({"device": where, "torch": torch.__version__, "args": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
