"""Local steps (DiLoCo, LocalSGD) against per-step gossip and DDP on one emulated slow link: bytes sent per worker and
training time to DDP's accuracy; a table, a JSON file and a plot of loss and accuracy against bytes sent.

    python scripts/bench_local_steps.py --rate 1gbit --out bench/local_steps          # root: ip netns + tc
    python scripts/bench_local_steps.py --rate 1gbit --configs ddp,diloco-h10-ring \\
        --variant diloco-h10-ring-lr1 diloco-h10-ring algorithm.outer_lr=1.0 --out bench/tuned
    python scripts/bench_local_steps.py --from bench/local_steps        # the table and plot again, from the runs

Every configuration is one real job of the ``decent-train`` command, ``decent-train -cn RECIPE +local_steps=NAME``
(the recipe, ``local_steps_study`` by default, holds what they share: model, data, inner optimizer, schedule, steps,
evaluations; ``recipes/local_steps/NAME.yaml`` what sets each apart), run one after another inside one network
namespace whose loopback, the only link the workers use, is limited to ``--rate`` (scripts/benchmark.py's
``emulated_network``: a ``tc ... tbf`` token bucket, all workers sharing the link). ``--variant LABEL BASE
OVERRIDE...`` adds a run of configuration BASE with more overrides (e.g. a tuned outer learning rate; an override
``env:NAME=VALUE`` sets the job's environment instead). A run that fails is a row of the table saying why.

From each run's ``metrics.jsonl``, at every evaluation of the averaged model:
- bytes sent per worker so far: the sum over records of ``comm/bytes_per_step`` times the steps since the record
  before (a record's bytes per step is averaged over the topology's period or the sync period, so for local steps
  it counts an outer step's bytes spread over its H steps: exact at multiples of H, ahead of the sends between);
- training seconds so far: the sum over records of ``time/step_ms`` times those steps (the workers' mean wall time
  per step, without evaluations, which ``time/elapsed_s`` includes and which cost the algorithms differently);
- ``eval/accuracy`` and ``eval/loss``.
The target is the reference's (DDP's) final accuracy unless ``--target`` gives one (``--metric loss``: its final eval
loss); a run reaches it at its first evaluation at or above it (loss: at or below). Ratios are to the reference's
bytes and seconds to the same target.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIG_DIR = ROOT / "recipes" / "local_steps"
COMMAND = Path(sys.executable).parent / "decent-train"

# The configurations, in the table's order; each is recipes/local_steps/NAME.yaml.
CONFIGS = ["ddp", "ring", "ring-int8", "diloco-h10-complete", "diloco-h50-complete", "diloco-h10-ring",
           "diloco-h50-ring", "diloco-h10-ring-int8", "localsgd-h10-complete", "localsgd-h10-ring"]
# What every run adds to the recipe: no progress bar in the captured output, no wandb.
COMMON = ["logger.progress_bar=false"]
# --setting tokens: the second, shorter setting. Byte-level language modelling (vocabulary 256) of the Python standard
# library's source (prepare_bytes), each worker on its own contiguous part of the files (so on its own modules), by a
# GPT-2-shaped decoder of 2 layers, width 256 (1.6M parameters, 6.5 MB), context 64, batch 16, 300 steps.
TOKENS = ["model=gpt2", "model.layers=2", "model.heads=4", "model.width=256", "dataset=tokens", "dataset.partition=iid",
          "dataset.context_length=64", "dataset.vocab_size=256", "batch_size=16", "steps=300", "eval_batch_size=64"]
TOKEN_CONFIGS = ["ddp", "ring", "ring-int8", "diloco-h10-complete", "diloco-h50-complete", "diloco-h10-ring",
                 "diloco-h50-ring"]


@dataclass
class Point:
    """One evaluation of the averaged model, with what the run had spent to get there."""

    step: int
    bytes_per_worker: float
    train_s: float
    elapsed_s: float
    accuracy: float
    loss: float


def curve(records: Sequence[dict[str, Any]]) -> list[Point]:
    """The evaluations of a run, from its records in order, with cumulative bytes sent per worker and training
    seconds (see the module's docstring)."""
    points, sent, seconds, last = [], 0.0, 0.0, 0
    for record in records:
        if "step" not in record or "comm/bytes_per_step" not in record:
            continue
        steps = record["step"] - last
        last = record["step"]
        sent += record["comm/bytes_per_step"] * steps
        seconds += record["time/step_ms"] * steps / 1000
        if record.get("eval/accuracy") is not None:
            points.append(Point(record["step"], sent, seconds, record["time/elapsed_s"], record["eval/accuracy"],
                                record["eval/loss"]))
    return points


def value(point: Point, metric: str) -> float:
    return point.accuracy if metric == "accuracy" else point.loss


def better(a: float, b: float, metric: str) -> bool:
    """Whether ``a`` is at least as good as ``b``: accuracy at or above, loss at or below."""
    return a >= b if metric == "accuracy" else a <= b


def first_at(points: Sequence[Point], target: float, metric: str = "accuracy") -> Point | None:
    """The first evaluation at the target or better; None if none is."""
    return next((p for p in points if better(value(p, metric), target, metric)), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(curves: dict[str, list[Point]], reference: str, target: float | None = None,
              metric: str = "accuracy") -> dict[str, Any]:
    """Per run: final accuracy and loss, and the metric against the reference's final (accuracy in points); bytes
    per worker and training seconds in all and to the target, and their ratios to the reference's (to the same
    target). The target is the reference's final value of ``metric`` (``accuracy`` or ``loss``) unless given."""
    scale = 100.0 if metric == "accuracy" else 1.0  # accuracy differences in points
    ref = curves[reference]
    ref_final = value(ref[-1], metric)
    target = ref_final if target is None else target
    ref_hit = first_at(ref, target, metric)
    rows = {}
    for name, points in curves.items():
        final, hit = points[-1], first_at(points, target, metric)
        best = max(points, key=lambda p: value(p, metric) * (1 if metric == "accuracy" else -1))
        rows[name] = {
            "final_accuracy": final.accuracy,
            "final_loss": final.loss,
            "best": value(best, metric),
            "vs_reference": scale * (value(final, metric) - ref_final),
            "steps": final.step,
            "bytes_per_worker": final.bytes_per_worker,
            "train_s": final.train_s,
            "bytes_vs_reference": _ratio(final.bytes_per_worker, ref[-1].bytes_per_worker),
            "train_s_vs_reference": _ratio(final.train_s, ref[-1].train_s),
            "reached": hit is not None,
            "step_at_target": hit.step if hit else None,
            "bytes_to_target": hit.bytes_per_worker if hit else None,
            "train_s_to_target": hit.train_s if hit else None,
            # < 1: fewer bytes, less time than the reference to the same accuracy
            "bytes_to_target_vs_reference": _ratio(hit.bytes_per_worker, ref_hit.bytes_per_worker)
            if hit and ref_hit else None,
            "train_s_to_target_vs_reference": _ratio(hit.train_s, ref_hit.train_s) if hit and ref_hit else None,
            "short_of_target": None if hit else scale * abs(target - value(best, metric)),
        }
    return {"reference": reference, "metric": metric, "reference_final": ref_final, "target": target, "rows": rows}


def _fmt_bytes(b: float) -> str:
    return f"{b / 1e6:.1f} MB" if b < 1e9 else f"{b / 1e9:.2f} GB"


def table(summary: dict[str, Any]) -> str:
    """The Markdown table of ``summarize``'s result."""
    target, ref, metric = summary["target"], summary["reference"], summary.get("metric", "accuracy")
    fmt = "{:+.1f} pt" if metric == "accuracy" else "{:+.3f}"
    lines = [
        f"| configuration | final {metric} (vs {ref}) | bytes/worker in all (vs {ref}) | training s in all | "
        f"to {metric} {target:.4f}: step | bytes/worker (vs {ref}) | training s (vs {ref}) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in summary["rows"].items():
        final = r["final_accuracy"] if metric == "accuracy" else r["final_loss"]
        head = (f"| {name} | {final:.4f} ({fmt.format(r['vs_reference'])}) | {_fmt_bytes(r['bytes_per_worker'])} "
                f"({r['bytes_vs_reference']:.3f}x) | {r['train_s']:.1f} | ")
        if r["reached"]:
            fewer = r["bytes_to_target_vs_reference"]
            fewer_s = ("-" if not fewer else f"{1 / fewer:.1f}x fewer" if fewer < 1 else f"{fewer:.1f}x more"
                       if fewer > 1 else "same")
            ratio = r["train_s_to_target_vs_reference"]
            lines.append(head + f"{r['step_at_target']} | {_fmt_bytes(r['bytes_to_target'])} ({fewer_s}) | "
                         f"{r['train_s_to_target']:.1f} ({f'{ratio:.2f}x' if ratio else '-'}) |")
        else:
            short = fmt.format(r["short_of_target"]).lstrip("+")
            lines.append(head + f"not reached: best {r['best']:.4f}, {short} short | | |")
    for name, why in summary.get("failed", {}).items():
        lines.append(f"| {name} | failed: {why} | | | | | |")
    return "\n".join(lines)


def plot(curves: dict[str, list[Point]], title: str, path: Path, metric: str = "accuracy",
         bases: dict[str, str] | None = None) -> None:
    """Eval loss and accuracy against bytes sent per worker (log scale), and the metric against training seconds;
    one line per run: DDP black, per-step gossip dashed, DiLoCo solid, LocalSGD dash-dotted; a variant (a label
    other than its configuration, ``bases``) thin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bases = bases or {}
    colors = plt.get_cmap("tab20").colors
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    for k, (name, points) in enumerate(curves.items()):
        base = bases.get(name, name)
        style = {"color": "black" if base == "ddp" else colors[(2 * k) % 20 + (k // 10) % 2],
                 "linestyle": "-." if base.startswith("localsgd") else "-" if base.startswith(("diloco", "ddp"))
                 else "--", "linewidth": 1.0 if base != name else 2.2 if base == "ddp" else 1.6,
                 "alpha": 0.75 if base != name else 1.0, "label": name}
        sent = [p for p in points if p.bytes_per_worker > 0]
        axes[0].plot([p.bytes_per_worker / 1e6 for p in sent], [p.loss for p in sent], **style)
        axes[1].plot([p.bytes_per_worker / 1e6 for p in sent], [p.accuracy for p in sent], **style)
        axes[2].plot([p.train_s for p in points], [value(p, metric) for p in points], **style)
    for ax in axes[:2]:
        ax.set_xscale("log")
        ax.set_xlabel("MB sent per worker")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("eval loss (averaged model)")
    axes[1].set_ylabel("eval accuracy (averaged model)")
    axes[2].set_xscale("log")
    axes[2].set_xlabel("training seconds (evaluations excluded)")
    axes[2].set_ylabel(f"eval {metric} (averaged model)")
    lows = [p.accuracy for points in curves.values() for p in points[len(points) // 5:]]
    for ax in axes[1:] if metric == "accuracy" else axes[1:2]:
        ax.set_ylim(max(0.0, min(lows) - 0.02), min(1.0, max(p.accuracy for c in curves.values() for p in c) + 0.01))
    if metric == "loss":
        axes[2].set_yscale("log")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="center right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.885, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def prepare_bytes(root: Path, val_every: int = 20, val_tokens: int = 1 << 16) -> Path:
    """``root/train.bin`` and ``val.bin`` (the format of ``dataset=tokens``) from the bytes of this interpreter's
    standard library modules (``*.py`` at its top level, sorted by name): every ``val_every``-th file is held out for
    validation (its first ``val_tokens`` bytes), the rest concatenated for training. Nothing is downloaded."""
    import sysconfig

    import numpy as np

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    train = b"".join(f.read_bytes() for i, f in enumerate(files) if i % val_every)
    val = b"".join(f.read_bytes() for i, f in enumerate(files) if not i % val_every)[:val_tokens]
    root.mkdir(parents=True, exist_ok=True)
    for name, data in (("train.bin", train), ("val.bin", val)):
        np.frombuffer(data, dtype=np.uint8).astype("<u2").tofile(root / name)
    print(f"tokens: {len(train)} training and {len(val)} validation bytes of {len(files)} modules in {root}")
    return root


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_config(prefix: list[str], recipe: str, label: str, base: str, overrides: list[str], out: Path,
               timeout: float) -> dict[str, Any]:
    """One ``decent-train`` job inside ``prefix`` (the emulated network) into ``out/label``; stopped (its process
    group killed) after ``timeout`` seconds."""
    run_dir = out / label
    env = [o.removeprefix("env:") for o in overrides if o.startswith("env:")]  # env:NAME=VALUE: the job's environment
    hydra = [o for o in overrides if not o.startswith("env:")]
    command = [*prefix, *(["env", *env] if env else []), str(COMMAND), "-cn", recipe, f"+local_steps={base}", *COMMON,
               *hydra, f"hydra.run.dir={run_dir}"]
    print(f"$ {' '.join(command)}", flush=True)
    load_before, start = load_average(), time.monotonic()
    log = out / f"{label}.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONWARNINGS="ignore"))
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wall = time.monotonic() - start
    run = {"base": base, "overrides": overrides, "command": command, "job_wall_s": wall, "load_before": load_before}
    if proc.returncode != 0:  # the table says so, and the other configurations still run
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        why = f"stopped after {timeout:g} s" if proc.returncode < 0 else (lines[-1] if lines else "no output")
        print(f"  {label} FAILED (exit {proc.returncode}): {why}; its output: {log}", flush=True)
        return run | {"failed": why, "load_after": load_average()}
    result = json.loads((run_dir / "result.json").read_text())
    print(f"  {label}: eval/accuracy {result['eval/accuracy']:.4f}, training {result['train_time_s']:.1f} s, "
          f"job {wall:.1f} s; load average before {load_before}, after {load_average()}", flush=True)
    return run | {"load_after": load_average(), "samples": result["samples"]}


def describe(run_dir: Path, network: str) -> str:
    """The plot's title: workers, link, model, data, optimizer and steps, from the run's resolved config."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run_dir / "resolved_config.yaml")
    model = cfg.model.name
    if model == "mlp":
        model += f" {list(cfg.model.hidden_sizes)}"
    elif model == "gpt2":
        model += f" ({cfg.model.layers} layers, width {cfg.model.width})"
    data = cfg.dataset.name + (f" ({cfg.dataset.partition})" if cfg.dataset.partition != "iid" else "")
    return f"{cfg.launch.nproc_per_node} workers, {network}: {model} on {data}, {cfg.optim.name}, {cfg.steps} steps"


def report(out: Path, runs: dict[str, dict[str, Any]], reference: str, target: float | None, network: str,
           argv: list[str], metric: str = "accuracy", write: bool = True) -> dict[str, Any]:
    """Read every run's metrics, print the table; ``write``: also ``local_steps.json`` (the summary, every run's
    command and curve) and ``local_steps.png`` into ``out``."""
    from decent_train.launcher.plot import load_run  # what decent-train-plot reads a run with (torch: not at start)

    curves = {label: curve(load_run(out / label).records) for label, run in runs.items() if "failed" not in run}
    if reference not in curves:
        sys.exit(f"bench_local_steps.py: the reference {reference!r} is not among the runs ({', '.join(curves)})")
    budgets = {label: r.get("samples") for label, r in runs.items()}
    if len(set(budgets.values())) > 1:
        print(f"warning: the runs trained on different budgets of samples: {budgets}", flush=True)
    summary = summarize(curves, reference, target, metric)
    summary["failed"] = {label: run["failed"] for label, run in runs.items() if "failed" in run}
    summary |= {"argv": argv, "network": network, "runs": runs,
                "curves": {label: [asdict(p) for p in points] for label, points in curves.items()}}
    print(table(summary))
    if write:
        (out / "local_steps.json").write_text(json.dumps(summary, indent=2))
        plot(curves, describe(out / reference, network), out / "local_steps.png", metric,
             {label: run["base"] for label, run in runs.items()})
        print(f"written: {out / 'local_steps.json'}, {out / 'local_steps.png'}")
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=("digits", "tokens"), default="digits",
                   help="digits: the recipe as it is; tokens: byte-level language modelling (see TOKENS), loss")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated names of {CONFIG_DIR.relative_to(ROOT)}/NAME.yaml, run in this order "
                   f"(digits: {','.join(CONFIGS)}; tokens: {','.join(TOKEN_CONFIGS)})")
    p.add_argument("--variant", nargs="+", action="append", default=[], metavar="LABEL BASE OVERRIDE",
                   help="also run configuration BASE with these overrides, labelled LABEL (repeatable)")
    p.add_argument("--recipe", default="local_steps_study", help="what every configuration shares (-cn)")
    p.add_argument("--set", default="", help="space-separated overrides for every run (e.g. steps=200)")
    p.add_argument("--rate", default=None, help="emulated link rate for tc, e.g. 1gbit (needs root)")
    p.add_argument("--delay", default=None, help="with --rate: added one-way delay for netem, e.g. 1ms")
    p.add_argument("--reference", default="ddp", help="the run whose final accuracy (or loss) is the target")
    p.add_argument("--metric", choices=("accuracy", "loss"), default=None,
                   help="of the averaged model's evaluation (default: accuracy on digits, loss on tokens)")
    p.add_argument("--target", type=float, default=None, help="the target instead of the reference's final value")
    p.add_argument("--out", type=Path, default=Path("bench/local_steps"))
    p.add_argument("--timeout", type=float, default=1800, help="seconds a run may take before it is stopped")
    p.add_argument("--from", dest="from_dir", type=Path, default=None,
                   help="no runs: the table again (any --target, --metric) from the runs of an earlier --out, which "
                   "keeps its local_steps.json")
    args = p.parse_args()
    if args.from_dir is not None:
        saved = json.loads((args.from_dir / "local_steps.json").read_text())
        report(args.from_dir, saved["runs"], args.reference, args.target, saved["network"], saved["argv"],
               args.metric or saved.get("metric", "accuracy"), write=False)
        return

    if args.configs is None:
        args.configs = ",".join(TOKEN_CONFIGS if args.setting == "tokens" else CONFIGS)
    planned: dict[str, tuple[str, list[str]]] = {name: (name, []) for name in args.configs.split(",") if name}
    for variant in args.variant:
        if len(variant) < 2:
            sys.exit(f"bench_local_steps.py: --variant {' '.join(variant)}: give LABEL BASE [OVERRIDE...]")
        planned[variant[0]] = (variant[1], variant[2:])
    unknown = sorted({base for base, _ in planned.values() if not (CONFIG_DIR / f"{base}.yaml").is_file()})
    if unknown:
        known = ", ".join(sorted(f.stem for f in CONFIG_DIR.glob("*.yaml")))
        sys.exit(f"bench_local_steps.py: no configuration {', '.join(unknown)}; valid: {known}")
    if args.reference not in planned:
        sys.exit(f"bench_local_steps.py: --reference {args.reference} is not among the runs")
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}", flush=True)

    import benchmark  # noqa: E402  (scripts/benchmark.py: the emulated link)

    shared = args.set.split()
    if args.setting == "tokens":
        shared = [*TOKENS, f"dataset.root={prepare_bytes(args.out.resolve() / 'bytes')}", *shared]
    runs = {}
    with benchmark.emulated_network(args.rate, args.delay) as prefix:
        for label, (base, overrides) in planned.items():
            runs[label] = run_config(prefix, args.recipe, label, base, [*shared, *overrides], args.out, args.timeout)
    delay = f", +{args.delay} delay" if args.delay else ""
    network = f"one {args.rate} link shared by all workers{delay}" if args.rate else "loopback (no emulation)"
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}", flush=True)
    report(args.out, runs, args.reference, args.target, network, sys.argv,
           args.metric or ("loss" if args.setting == "tokens" else "accuracy"))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
