"""``decent-train-plot DIR [--out OUT]``: charts of one run or a sweep of runs, drawn from the files they leave.

It reads only ``metrics.jsonl``, ``result.json`` and ``resolved_config.yaml``, so runs can be plotted after the fact,
on another machine, without torch workers; one line (or bar) per run, labelled by what sets the run apart.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from omegaconf import OmegaConf

from decent_train.config import METRICS_FILE, RESOLVED_CONFIG, RESULT_FILE

THROUGHPUT = "throughput/samples_per_s"
THROUGHPUT_MIN = "throughput/samples_per_s_min_worker"
LINE_CHARTS = [("loss", "train/loss"), ("accuracy", "eval/accuracy"), ("consensus", "consensus/distance")]
X_AXES = [("step", "step", "step"), ("time", "time/elapsed_s", "time (s)")]


@dataclass
class Run:
    """What one run directory holds, read once."""

    path: Path
    records: list[dict[str, Any]]
    result: dict[str, Any]
    overrides: list[str]
    label: str = field(default="")


def find_runs(root: Path) -> list[Path]:
    """Run directories under ``root`` (itself included): any depth, so Hydra's ``multirun/DATE/TIME/k`` works too.

    Sorted by job number where the names are integers (``10`` after ``9``), else by name.
    """
    def key(run: Path) -> tuple[tuple[int, int, str], ...]:
        return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in run.relative_to(root).parts)

    return sorted({p.parent for p in root.rglob(METRICS_FILE) if p.is_file()}, key=key)


def _number(value: Any) -> float | None:
    """A finite number, else None: NaN is written as null, and a failed step may leave inf."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def load_run(path: Path) -> Run:
    """Reads a run; a line cut short by a crash, or a missing result.json (failed run), costs only that part."""
    records = []
    for line in (path / METRICS_FILE).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    try:
        result = json.loads((path / RESULT_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        result = {}
    overrides: list[str] = []
    if (path / RESOLVED_CONFIG).is_file():
        overrides = [str(o) for o in OmegaConf.select(OmegaConf.load(path / RESOLVED_CONFIG), "run.overrides") or []]
    return Run(path, records, result if isinstance(result, dict) else {}, overrides)


def run_labels(overrides: Sequence[Sequence[str]], names: Sequence[str]) -> list[str]:
    """Each run's overrides less those every run shares (they tell runs apart in a legend); its name if none is left."""
    common = set(overrides[0]).intersection(*overrides[1:]) if len(overrides) > 1 else set()
    return [" ".join(o for o in run if o not in common) or name for run, name in zip(overrides, names)]


def _series(run: Run, x_key: str, y_key: str) -> tuple[list[float], list[float]]:
    points = [(_number(r.get(x_key)), _number(r.get(y_key))) for r in run.records]
    kept = [(x, y) for x, y in points if x is not None and y is not None]
    return [x for x, _ in kept], [y for _, y in kept]


def phase_changes(run: Run, x_key: str) -> list[float]:
    """Where a run with ``phases`` changed algorithm: the x of each phase's last record."""
    changes: list[float] = []
    last_x, last_phase = None, None
    for record in run.records:
        x, phase = _number(record.get(x_key)), record.get("phase")
        if phase is not None and last_phase is not None and phase != last_phase and last_x is not None:
            changes.append(last_x)
        last_x, last_phase = x, phase if phase is not None else last_phase
    return changes


def _save(fig: Figure, path: Path) -> None:
    """Renders with Agg (no display needed) and lets the figure go, so a long sweep does not pile up figures."""
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    fig.clear()
    print(path)


def seed_groups(runs: list[Run]) -> list[tuple[str, list[Run]]]:
    """Runs that differ only in ``seed=``, together (in first-seen order), labelled without it: a sweep over seeds is
    drawn as one line per setting with the seeds' spread around it."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        label = " ".join(t for t in run.label.split() if not re.fullmatch(r"seed=\S+", t)) or run.label
        groups.setdefault(label, []).append(run)
    return list(groups.items())


def band(runs: list[Run], x_key: str, y_key: str) -> tuple[list[float], list[float], list[float], list[float]]:
    """At each step that every run logged ``y_key`` (and ``x_key``) at: (the runs' mean x, and their mean, min and max
    of y). Steps pair the runs' records, so an x of their own (time) is averaged like y."""
    points = []
    for run in runs:
        pairs = ((r.get("step"), _number(r.get(x_key)), _number(r.get(y_key))) for r in run.records)
        points.append({step: (x, y) for step, x, y in pairs if x is not None and y is not None})
    steps = sorted(set(points[0]).intersection(*points[1:]))
    xs = [sum(p[step][0] for p in points) / len(points) for step in steps]
    ys = [[p[step][1] for p in points] for step in steps]
    return xs, [sum(c) / len(c) for c in ys], [min(c) for c in ys], [max(c) for c in ys]


def plot_lines(runs: list[Run], y_key: str, x_key: str, x_label: str, path: Path) -> bool:
    """One line per run, or per setting of a sweep over seeds (its mean, the seeds' min to max shaded); False
    (nothing written) when no run has a point of ``y_key`` against ``x_key``."""
    groups = [(label, [(run, *_series(run, x_key, y_key)) for run in group]) for label, group in seed_groups(runs)]
    groups = [(label, [s for s in group if s[1]]) for label, group in groups]
    groups = [(label, group) for label, group in groups if group]
    if not groups:
        return False
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for label, group in groups:
        if len(group) == 1:
            run, xs, ys = group[0]
            (line,) = ax.plot(xs, ys, label=run.label, marker="." if len(xs) < 30 else None)
        else:
            xs, mean, low, high = band([run for run, _, _ in group], x_key, y_key)
            (line,) = ax.plot(xs, mean, label=f"{label} ({len(group)} seeds)", marker="." if len(xs) < 30 else None)
            ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        for x in phase_changes(group[0][0], x_key):  # dotted: the end of a phase
            ax.axvline(x, color=line.get_color(), linestyle=":", alpha=0.7)
    if y_key.startswith("consensus/") and all(y > 0 for _, group in groups for _, _, ys in group for y in ys):
        ax.set_yscale("log")  # the distance shrinks by orders of magnitude as the workers agree
    ax.set(xlabel=x_label, ylabel=y_key)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    _save(fig, path)
    return True


def throughput(run: Run, key: str) -> float | None:
    """The final number from result.json, else the mean of the logged ones (a failed run has no result.json)."""
    final = _number(run.result.get(key))
    if final is not None:
        return final
    logged = [v for v in (_number(r.get(key)) for r in run.records) if v is not None]
    return sum(logged) / len(logged) if logged else None


def plot_throughput(runs: list[Run], path: Path) -> bool:
    """Bars of samples/s per run, the slowest worker's beside them when logged; False when no run has any."""
    keys = [k for k in (THROUGHPUT, THROUGHPUT_MIN) if any(throughput(run, k) is not None for run in runs)]
    if not keys:
        return False
    fig = Figure(figsize=(max(5.0, 1.2 * len(runs) + 2), 4.5))
    ax = fig.add_subplot()
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        values = [throughput(run, key) for run in runs]
        xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(runs))]
        ax.bar(xs, [math.nan if v is None else v for v in values], width, label=key)
    crowded = len(runs) > 3
    ax.set_xticks(range(len(runs)), [run.label for run in runs], fontsize="small",
                  rotation=20 if crowded else 0, ha="right" if crowded else "center")
    ax.set_ylabel("samples/s")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    _save(fig, path)
    return True


def load_runs(root: Path) -> list[Run]:
    """Every run under ``root``, labelled; a run without overrides is named by its path under ``root``."""
    runs = [load_run(path) for path in find_runs(root)]
    names = [str(run.path.relative_to(root)) if run.path != root else root.resolve().name for run in runs]
    for run, label in zip(runs, run_labels([run.overrides for run in runs], names)):
        run.label = label
    return runs


def plot_dir(root: Path, out: Path) -> list[Path]:
    """Writes every chart that some run has data for into ``out``; returns the paths written."""
    runs = load_runs(root)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, y_key in LINE_CHARTS:
        missing = []
        for x_name, x_key, x_label in X_AXES:
            path = out / f"{name}_vs_{x_name}.png"
            if plot_lines(runs, y_key, x_key, x_label, path):
                written.append(path)
            else:
                missing.append((path.name, x_key))
        if len(missing) == len(X_AXES):
            print(f"skipped {', '.join(n for n, _ in missing)}: no run logs {y_key}")
        elif missing:
            print(f"skipped {', '.join(n for n, _ in missing)}: no run logs {y_key} with {missing[0][1]}")
    if plot_throughput(runs, out / "throughput.png"):
        written.append(out / "throughput.png")
    else:
        print(f"skipped throughput.png: no run has {THROUGHPUT}")
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="decent-train-plot", description="Plot a decent-train run or sweep.")
    parser.add_argument("dir", type=Path, help="a run directory, or a sweep directory holding run directories")
    parser.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: DIR/plots)")
    args = parser.parse_args(argv)
    root: Path = args.dir
    if not root.is_dir():
        _fail(f"{root}: no such directory (expected a run directory or a sweep directory of runs)")
    if not find_runs(root):
        _fail(f"{root}: no run found (expected {METRICS_FILE} in it or in a directory under it)")
    plot_dir(root, args.out if args.out is not None else root / "plots")


def _fail(message: str) -> NoReturn:
    """The user's mistake: one line, argparse's status, no traceback."""
    print(f"decent-train-plot: error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
