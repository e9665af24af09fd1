"""The engine's own cost on one worker: step time of DecentralizedDataParallel against a plain training loop.

With one worker there is nothing to exchange, so the difference is the engine itself: its gradient hooks, the
per-bucket optimizers stepping inside backward and the parameters living in flat buckets. Meant for one GPU::

    python scripts/bench_overhead.py --device cuda --models resnet50,gpt2 --precision bf16 --json overhead.json

(ResNet-50 on 224x224 images, batch 64, channels_last; GPT-2 small, context 1024, batch 8; AdamW, torch's fused kernel
on CUDA in both loops; ``--precision fp16`` adds a GradScaler to both loops). Each of ``repeats`` rounds warms
every loop up (``warmup`` steps), then the loops take turns of ``block`` steps until each has run ``steps``; the
table shows each loop's median step time and the median of the rounds' ``loop / plain`` (above 1: slower than the
plain loop). ``--variants`` adds engines built otherwise, to tell where time goes: ``update-thread`` (buckets
update on a thread and CUDA stream of their own, not on autograd's thread), ``per-parameter-hooks`` (a hook per
parameter), ``one-bucket``, ``foreach`` (torch's foreach AdamW instead of fused), ``deferred`` (every bucket steps
at the end of backward: what a worker alone does anyway), ``in-backward`` (each bucket steps inside backward, as with
peers: a worker alone did so before its steps were merged), ``optimizer-step`` (each bucket's AdamW through torch's
``Optimizer.step()``, not engine/fused_step.py's direct call). ``--compile`` compiles the model in every loop;
``--fused`` takes torch's fused AdamW on the CPU too (on CUDA it is the default), ``--bucket-mb`` sets the engine's
bucket size (25 MB); ``--profile DIR`` writes torch.profiler's tables of a few steps of each loop. On CPU
the same command with small sizes (``--image-size 32 --batch-resnet 4 --gpt-layers 2 ...``) checks that it runs.
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
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decent_train import DecentralizedDataParallel, optim_fn_adamw  # noqa: E402
from decent_train.components.models import ModelConfig, build_model  # noqa: E402
from decent_train.engine import fused_step  # noqa: E402
from decent_train.engine.optimizers import param_groups_with_weight_decay  # noqa: E402
from decent_train.engine.readiness import RELEARN_LIMIT  # noqa: E402

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
        model = model.to(memory_format=torch.channels_last) if channels_last else model
        if args.compile:
            model.compile()
        return model

    x = x.to(device, memory_format=torch.channels_last) if channels_last else x.to(device)
    return make, (x, y.to(device))


def loss_of(model: nn.Module, x: Tensor, y: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(x)
    return F.cross_entropy(logits.flatten(0, -2).float(), y.flatten())


def adamw(args: argparse.Namespace) -> Callable[[list[tuple[str, Tensor]]], torch.optim.Optimizer]:
    """Both loops' AdamW: ``optim_fn_adamw`` (fused on CUDA), fused on the CPU too with ``--fused``."""
    if not args.fused:
        return partial(optim_fn_adamw, lr=1e-4)
    return lambda named: torch.optim.AdamW(param_groups_with_weight_decay(named, 0.1), lr=1e-4, fused=True)


def plain_loop(model: nn.Module, batch: tuple[Tensor, Tensor], args: argparse.Namespace, device: torch.device) -> Step:
    optimizer = adamw(args)(list(model.named_parameters()))
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")

    def step() -> None:
        scaler.scale(loss_of(model, *batch, PRECISIONS[args.precision], device)).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


ENGINE_VARIANTS = ("engine", "update-thread", "per-parameter-hooks", "one-bucket", "foreach", "deferred",
                   "in-backward", "optimizer-step")


def engine_loop(model: nn.Module, batch: tuple[Tensor, Tensor], args: argparse.Namespace, device: torch.device,
                variant: str = "engine") -> Step:
    scaler = torch.amp.GradScaler(device.type) if args.precision == "fp16" else None
    optim_fn = adamw(args)
    if variant == "foreach":
        optim_fn = lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-4, weight_decay=0.1)  # noqa: E731
    engine = DecentralizedDataParallel(
        model, optim_fn, topology="ring", scaler=scaler, bucket_size_in_mb=10**6 if variant == "one-bucket" else args.bucket_mb,
        update_thread=variant == "update-thread",
    )
    if variant == "deferred":
        engine._context.steps.must_defer = True
    if variant == "in-backward":  # without its membership the steps do not know this worker is alone
        engine._context.steps.members = None
    if variant == "optimizer-step":  # a step hook: engine/fused_step.py declines, Optimizer.step() runs
        for optimizer in engine.optimizers:
            optimizer.register_step_pre_hook(lambda *args: None)
    if variant == "per-parameter-hooks":
        engine._readiness.relearned = RELEARN_LIMIT + 1
        engine._readiness._install()

    def step() -> None:
        loss = loss_of(engine, *batch, PRECISIONS[args.precision], device)
        (scaler.scale(loss) if scaler is not None else loss).backward()  # the buckets step inside backward

    step.engine = engine  # type: ignore[attr-defined]
    return step


def host_calls(step: Step) -> dict[str, float]:
    """Gradient hooks fired and optimizer calls made in one step of an engine loop (after its warmup): functional
    ``adam()`` calls (engine/fused_step.py: one per bucket and group, or one per set of hyperparameters for a worker
    alone) and ``Optimizer.step()`` calls (counted on the class, so that the fast path still takes the buckets)."""
    engine, counts = step.engine, {"adam": 0, "step": 0}  # type: ignore[attr-defined]
    functional, classes = fused_step.adam, {type(o) for o in engine.optimizers}
    originals = {cls: cls.step for cls in classes}

    def counted(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return call(*args, **kwargs)
        return run

    hooks = engine._readiness.hooks_fired
    fused_step.adam = counted("adam", functional)  # type: ignore[assignment]
    for cls, original in originals.items():
        cls.step = counted("step", original)  # type: ignore[method-assign]
    try:
        step()
    finally:
        fused_step.adam = functional  # type: ignore[assignment]
        for cls, original in originals.items():
            cls.step = original  # type: ignore[method-assign]
    return {"hooks": engine._readiness.hooks_fired - hooks, "optimizer_steps": counts["adam"] + counts["step"],
            "buckets": len(engine.optimizers)}


def seconds_of(step: Step, steps: int, device: torch.device) -> float:
    """Seconds ``steps`` steps take, the device drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def profile(loops: dict[str, Step], steps: int, folder: Path, name: str, device: torch.device) -> None:
    """torch.profiler over ``steps`` steps of each loop: the top operators by self time, CPU and device, per loop."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    folder.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for kind, step in loops.items():
        with profiler(activities=activities) as prof:
            for _ in range(steps):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        table += "\n" + prof.key_averages().table(sort_by=sort, row_limit=25)
        (folder / f"{name}_{kind}.txt").write_text(table)


def alternating_rounds(loops: dict[str, Step], args: argparse.Namespace, device: torch.device
                       ) -> dict[str, list[float]]:
    """Seconds per step of each loop in ``args.repeats`` rounds. Inside a round the loops take turns of
    ``args.block`` steps until each has run ``args.steps``, so that a host that changes speed (measured on an H200:
    the same loop 16 and 25 ms/step within one process) slows both alike and cancels in the round's ratio; the
    turns' order rotates each round, so no loop always runs first."""
    times: dict[str, list[float]] = {k: [] for k in loops}
    kinds = list(loops)
    for r in range(args.repeats):
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
        for kind in order:
            seconds_of(loops[kind], args.warmup, device)
        spent, done = dict.fromkeys(kinds, 0.0), 0
        while done < args.steps:
            turn = min(args.block, args.steps - done)
            for kind in order:
                spent[kind] += seconds_of(loops[kind], turn, device)
            done += turn
        for kind in kinds:
            times[kind].append(spent[kind] / args.steps)
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default="resnet50,gpt2")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="bf16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--block", type=int, default=5, help="steps per turn: inside a round the loops take turns")
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
    p.add_argument("--variants", default="", help=f"engine variants besides the engine: {', '.join(ENGINE_VARIANTS[1:])}")
    p.add_argument("--compile", action="store_true", help="compile the model (in place) in every loop")
    p.add_argument("--fused", action="store_true", help="torch's fused AdamW on the CPU too (CUDA: always)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="the engine's bucket size")
    p.add_argument("--profile", type=Path, default=None, help="write torch.profiler tables of 5 steps per loop here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_overhead.py: --device cuda, but no CUDA device is visible")

    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in ENGINE_VARIANTS[1:]]
    if unknown:
        raise SystemExit(f"bench_overhead.py: --variants: {unknown[0]!r} is not a variant; valid: "
                         f"{', '.join(ENGINE_VARIANTS[1:])}")
    results = {}
    for name in args.models.split(","):
        make, batch = workload(name, args, device)
        loops = {"plain": plain_loop(make(), batch, args, device)}
        for variant in ["engine", *variants]:
            loops[variant] = engine_loop(make(), batch, args, device, variant)
        times = alternating_rounds(loops, args, device)
        plain = statistics.median(times["plain"])
        results[name] = {"plain_ms": 1000 * plain, "plain_ms_all": [1000 * t for t in times["plain"]]}
        for variant in ["engine", *variants]:
            ratios = [t / p for t, p in zip(times[variant], times["plain"])]
            results[name] |= {f"{variant}_ms": 1000 * statistics.median(times[variant]),
                              f"{variant}_ms_all": [1000 * t for t in times[variant]],
                              f"{variant}_over_plain_rounds": ratios,
                              f"{variant}_over_plain": statistics.median(ratios),
                              f"{variant}_per_step": host_calls(loops[variant])}
        if args.profile:
            profile(loops, 5, args.profile, name, device)
        del loops

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{where}, torch {torch.__version__}, {args.precision}, {args.repeats} rounds x ({args.warmup} + {args.steps}) steps, "
          f"turns of {args.block}")
    print("| model | loop | ms/step (median) | loop / plain (median of rounds) | rounds' range |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | plain | {r['plain_ms']:.2f} | 1 | |")
        for variant in ["engine", *variants]:
            calls, rounds = r[f"{variant}_per_step"], r[f"{variant}_over_plain_rounds"]
            print(f"| {name} | {variant} ({calls['buckets']} buckets: {calls['hooks']} hooks, {calls['optimizer_steps']} "
                  f"optimizer calls per step) | {r[f'{variant}_ms']:.2f} | {r[f'{variant}_over_plain']:.3f}x | "
                  f"{min(rounds):.3f}-{max(rounds):.3f}x |")
    if args.json:
        arguments = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"device": where, "torch": torch.__version__, "args": arguments,
                                         "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
