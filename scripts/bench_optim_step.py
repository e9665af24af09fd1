"""AccumAdam(W)'s step before and after a change, side by side in one run: the peak of the temporaries a step holds
and its time, on the CPU.

The fronts (DiLoCo, LocalSGD) run AccumAdamW over the whole model, where what a step allocates besides its state adds
to peak memory; this measures it as the CPU allocator reports it to the profiler (not by reading the code). "before"
is ``decent_train/engine/optimizers.py`` at a git revision, loaded beside the working tree's, so both run on the same
parameters and gradients in the same process, alternating step by step.

    python scripts/bench_optim_step.py --before f9af21d
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

from revisions import load_revision  # scripts/ (this script's folder)

OPTIMIZERS = "decent_train/engine/optimizers.py"


def peak_new_bytes(fn: Callable[[], object]) -> int:
    """The most bytes ``fn`` held at once of what it allocated, from the allocator's events in the profiler."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def make_model(width: int, layers: int, seed: int) -> tuple[list[tuple[str, Tensor]], list[Tensor]]:
    """Named parameters of ``layers`` Linear(width, width) in float32, and one gradient for each."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    named = list(model.named_parameters())
    return named, [torch.randn_like(p) for _, p in named]


class Case:
    """One implementation's optimizer on its own copy of the parameters, stepped with the shared gradients."""

    def __init__(self, module: ModuleType, factory: str, named: list[tuple[str, Tensor]], grads: list[Tensor]) -> None:
        self.params = [nn.Parameter(p.detach().clone()) for _, p in named]
        for p, g in zip(self.params, grads):
            p.grad = g
        named_copy = [(name, p) for (name, _), p in zip(named, self.params)]
        self.opt: torch.optim.Optimizer = getattr(module, factory)(named_copy)  # the recipes' defaults
        self.opt.step()  # creates the state, which is not a temporary

    def step_s(self) -> tuple[float, float]:
        """Seconds of one step: wall clock, and this process's CPU time (user and system: page faults count), which
        other jobs on a shared machine disturb less."""
        wall, cpu = time.perf_counter(), time.process_time()
        self.opt.step()
        return time.perf_counter() - wall, time.process_time() - cpu


def host_cost_us(n_tensors: int, repeats: int = 300) -> dict[str, float]:
    """Host microseconds per parameter tensor of what a step does in Python besides the kernels: ``_batches`` (group
    by step count, device and dtype; what a cache would save) and the step counts' increment, for a group of small
    tensors, where the kernels cost little."""
    from decent_train.engine.optimizers import AccumAdamW

    params = [nn.Parameter(torch.randn(8)) for _ in range(n_tensors)]
    for p in params:
        p.grad = torch.randn(8)
    opt = AccumAdamW(params)
    opt.step()
    group, steps = opt.param_groups[0], [opt.state[p]["step"] for p in params]
    parts: dict[str, Callable[[], object]] = {
        "batches": lambda: opt._batches(group),  # type: ignore[attr-defined]
        "int_step": lambda: [int(s) for s in steps],
        "step_increment": lambda: torch._foreach_add_(steps, 1),
        "whole_step": opt.step,
    }
    result = {}
    for name, fn in parts.items():
        fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        result[name] = 1e6 * (time.perf_counter() - start) / repeats / n_tensors
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure both implementations for each optimizer; returns the results as a dict."""
    import decent_train.engine.optimizers as after

    before = load_revision(args.before, OPTIMIZERS)
    named, grads = make_model(args.width, args.layers, seed=0)
    n_params = sum(p.numel() for _, p in named)
    param_bytes = sum(p.numel() * p.element_size() for _, p in named)
    results: dict[str, Any] = {"before": args.before, "params": n_params, "param_bytes": param_bytes,
                               "threads": torch.get_num_threads(), "torch": torch.__version__, "optimizers": {}}
    print(f"{n_params / 1e6:.1f}M parameters, {param_bytes / 2**20:.1f} MiB; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; before = {args.before}")
    for factory in ("optim_fn_accum_adamw", "optim_fn_accum_adam"):
        cases = {"before": Case(before, factory, named, grads), "after": Case(after, factory, named, grads)}
        # accum_iter steps: one of them refreshes the moments.
        accum_iter = cases["after"].opt.param_groups[0]["accum_iter"]
        peaks = {tag: peak_new_bytes(lambda c=case: [c.opt.step() for _ in range(accum_iter)])
                 for tag, case in cases.items()}
        times: dict[str, list[tuple[float, float]]] = {tag: [] for tag in cases}
        for _ in range(args.steps):  # alternating step by step: a busy machine slows both alike
            for tag, case in cases.items():
                times[tag].append(case.step_s())
        pairs = zip(cases["before"].params, cases["after"].params)
        drift = max(float((a.detach() - b.detach()).abs().max()) for a, b in pairs)
        entry = {tag: {"peak_bytes": peaks[tag], "peak_x_params": peaks[tag] / param_bytes,
                       "step_ms_median": 1e3 * statistics.median(w for w, _ in times[tag]),
                       "step_cpu_ms_median": 1e3 * statistics.median(c for _, c in times[tag]),
                       "step_ms": [1e3 * w for w, _ in times[tag]], "step_cpu_ms": [1e3 * c for _, c in times[tag]]}
                 for tag in cases}
        entry["max_abs_param_difference"] = drift
        results["optimizers"][factory] = entry
        for tag in cases:
            e = entry[tag]
            print(f"{factory:22s} {tag:6s}: peak {e['peak_bytes'] / 2**20:7.1f} MiB "
                  f"({e['peak_x_params']:.2f}x params), step {e['step_ms_median']:.1f} ms wall, "
                  f"{e['step_cpu_ms_median']:.1f} ms CPU (medians of {len(times[tag])})")
        print(f"{factory:22s} max |after - before| over the parameters after the same steps: {drift:.2e}")
        del cases
    results["host_us_per_tensor"] = host = host_cost_us(args.host_tensors)
    print(f"host, per tensor of a group of {args.host_tensors} small ones (us): "
          + ", ".join(f"{k} {v:.2f}" for k, v in host.items()))
    return results


def main() -> None:
    """Parse the arguments, run, print and optionally write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="f9af21d", help="git revision of the 'before' optimizers.py")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=15, help="timed steps of each implementation, alternating")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument("--host-tensors", type=int, default=200, help="tensors of the host-cost group")
    parser.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = run(args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
