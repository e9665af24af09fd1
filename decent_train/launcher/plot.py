"""``decent-train-plot DIR [--out OUT]``: charts of one run or a sweep of runs, drawn from the files they leave.

It reads only ``metrics.jsonl``, ``result.json`` and ``resolved_config.yaml``, so runs can be plotted after the fact,
on another machine, without torch workers; one line (or bar) per run, labelled by what sets the run apart: an
override's value as resolved in each run's config, so ``x=10`` beside x's default of 10 is no difference. Each
chart's title says which sweep it is, how many workers ran and what varies, so a PNG read alone is understood.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from omegaconf import DictConfig, ListConfig, OmegaConf

from decent_train.config import METRICS_FILE, RESOLVED_CONFIG, RESULT_FILE

THROUGHPUT = "throughput/samples_per_s"
THROUGHPUT_MIN = "throughput/samples_per_s_min_worker"
DEFAULTS = "defaults"  # the label of a run that sets nothing the others do not
SEED = "seed"  # runs that differ only in it are drawn as one line with the seeds' spread
_ABSENT = object()


@dataclass(frozen=True)
class LineChart:
    """One metric drawn against step and against time: ``<name>_vs_step.png``, ``<name>_vs_time.png``."""

    name: str
    key: str
    title: str
    y_label: str
    log: bool  # a log axis when every value is positive: losses and distances shrink by orders of magnitude


# ConsensusProbe.measure's definition (decent_train/components/metrics.py); with parallel.shard, i is a replica.
CONSENSUS_LABEL = (r"consensus distance $\sqrt{\mathrm{mean}_i \Vert x_i - \bar{x} \Vert^2}$" "\n"
                   r"($x_i$: worker $i$'s parameters, $\bar{x}$: their mean)")
LINE_CHARTS = [
    LineChart("loss", "train/loss", "Training loss", "training loss (mean over workers)", True),
    LineChart("accuracy", "eval/accuracy", "Test accuracy", "test accuracy of the workers' average model", False),
    LineChart("consensus", "consensus/distance", "Consensus distance", CONSENSUS_LABEL, True),
]
X_AXES = [("step", "step", "step"), ("time", "time/elapsed_s", "training time (s)")]
# Lines that coincide stay apart: each run its own dash and marker, the first drawn widest underneath.
LINE_STYLES = ["-", "--", "-.", ":"]
MARKERS = ["o", "s", "^", "D", "v", "P"]


@dataclass
class Run:
    """What one run directory holds, read once."""

    path: Path
    records: list[dict[str, Any]]
    result: dict[str, Any]
    overrides: list[str]
    workers: int | None = None  # ranks: result.json's world_size, else the last logged count, else the config's
    shard: int = 1  # parallel.shard: ranks per replica
    label: str = field(default="")
    config: DictConfig | ListConfig = field(default_factory=OmegaConf.create)  # resolved_config.yaml, or empty


def find_runs(root: Path) -> list[Path]:
    """Run directories under ``root`` (itself included): any depth, so Hydra's ``multirun/DATE/TIME/k`` works too,
    and through symbolic links (a directory of links to chosen runs is a sweep of its own); each real directory once.

    Sorted by job number where the names are integers (``10`` after ``9``), else by name.
    """
    def key(run: Path) -> tuple[tuple[int, int, str], ...]:
        return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in run.relative_to(root).parts)

    found, seen = [], set()
    for directory, subdirectories, files in os.walk(root, followlinks=True):
        subdirectories.sort()  # the first path to a run reached twice is the one kept, the same on every machine
        real = Path(directory).resolve()
        if real in seen:  # a link to a run already found, or back up the tree
            subdirectories.clear()
            continue
        seen.add(real)
        if METRICS_FILE in files and (Path(directory) / METRICS_FILE).is_file():
            found.append(Path(directory))
    return sorted(found, key=key)


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
    result = result if isinstance(result, dict) else {}
    config = OmegaConf.load(path / RESOLVED_CONFIG) if (path / RESOLVED_CONFIG).is_file() else OmegaConf.create()
    overrides = [str(o) for o in OmegaConf.select(config, "run.overrides") or []]
    logged = [n for n in (_number(r.get("world/members")) for r in records) if n is not None]
    per_node, nodes = OmegaConf.select(config, "launch.nproc_per_node"), OmegaConf.select(config, "launch.nnodes")
    launched = per_node * nodes if isinstance(per_node, int) and isinstance(nodes, int) else None
    workers = _number(result.get("world_size")) or (logged[-1] if logged else None) or launched
    shard = OmegaConf.select(config, "parallel.shard")
    return Run(path, records, result, overrides, int(workers) if workers else None,
               shard if isinstance(shard, int) and shard > 1 else 1, config=config)


def override_key(override: str) -> str:
    """``topology`` of ``topology=ring``, ``algorithm.sync_every`` of ``++algorithm.sync_every=4``."""
    return override.lstrip("+~").split("=", 1)[0]


def as_written(run: Run, key: str) -> str:
    """``key``'s value as the run's overrides write it: "deleted" for ``~key``, "default" if the run does not set
    it."""
    return next((o.split("=", 1)[1] if "=" in o else "deleted" for o in run.overrides if override_key(o) == key),
                "default")


def setting(run: Run, key: str) -> str:
    """What ``key`` was in the run, comparable between runs: its value in the resolved config (a group's option for
    a group), so that ``algorithm.sync_every=10`` and a default of 10, or ``3e-3`` and ``0.003``, are alike; where
    the config lacks the key (deleted, or a run directory without a whole config) the override's text instead."""
    choices = OmegaConf.select(run.config, "run.choices")
    try:
        if isinstance(choices, DictConfig) and key in choices:
            return json.dumps(["choice", choices[key]])
        value = OmegaConf.select(run.config, key, default=_ABSENT)
    except Exception:  # noqa: BLE001 - a key OmegaConf refuses to address, or an odd file: compare as written
        value = _ABSENT
    if value is _ABSENT:
        return json.dumps(["written", as_written(run, key)])
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    return json.dumps(["value", value], sort_keys=True, default=str)


def varying(runs: Sequence[Run]) -> dict[str, list[str]]:
    """The keys set by some run whose resolved values differ between runs (in first-seen order), each with the
    values run, once each, as an override wrote them ("default": a value no run wrote out)."""
    keys = list(dict.fromkeys(override_key(o) for run in runs for o in run.overrides))
    values: dict[str, list[str]] = {}
    for key in keys:
        shown: dict[str, str] = {}
        for run in runs:
            value, text = setting(run, key), as_written(run, key)
            if shown.get(value, "default") == "default":
                shown[value] = text
        if len(shown) > 1:
            values[key] = list(shown.values())
    return values


def label_runs(runs: Sequence[Run]) -> list[str]:
    """Each run's overrides of the keys that vary ("defaults" if none): what sets it apart in a legend. A run that
    does not set such a key but ran with a value another run wrote out is labelled with that override, so runs alike
    read alike. Runs whose labels are the same are numbered in order ("defaults #1", "defaults #2"). A run alone is
    labelled by all its overrides."""
    if len(runs) == 1:
        return [" ".join(runs[0].overrides) or DEFAULTS]
    keys = varying(runs)
    labels = []
    for run in runs:
        parts = []
        for key in keys:
            own = [o for o in run.overrides if override_key(o) == key]
            value = setting(run, key)
            parts += own or next(([o for o in other.overrides if override_key(o) == key] for other in runs
                                  if as_written(other, key) != "default" and setting(other, key) == value), [])
        labels.append(" ".join(parts) or DEFAULTS)
    counts = {label: labels.count(label) for label in labels}
    seen: dict[str, int] = {}
    for i, label in enumerate(labels):
        if counts[label] > 1:
            seen[label] = seen.get(label, 0) + 1
            labels[i] = f"{label} #{seen[label]}"
    return labels


def common_overrides(runs: Sequence[Run]) -> list[str]:
    """One override (the first written) of each key set by some run whose resolved value is the same in every
    run: what every run ran with."""
    keys = varying(runs)
    found: dict[str, str] = {}
    for run in runs:
        for o in run.overrides:
            if override_key(o) not in keys:
                found.setdefault(override_key(o), o)
    return list(found.values())


def sweep_name(root: Path) -> str:
    """The directory's name with its parent's, and more parents while the names are dates, times or job numbers
    (Hydra's ``multirun/DATE/TIME``): ``multirun/2025-01-01/12-00-00`` says more than ``12-00-00``."""
    parts = root.resolve().parts[1:]  # less the root "/"
    name = list(parts[-1:])
    while len(name) < len(parts) and len(name) < 4 and (len(name) == 1 or re.fullmatch(r"[\d_:.-]+", name[0])):
        name.insert(0, parts[-len(name) - 1])
    return "/".join(name) or "/"


def _workers(runs: Sequence[Run]) -> str:
    """``4 workers``, ``4 workers (2 replicas x 2 shards)``, ``2-8 workers``; sharding is said, since a worker is
    a rank and a replica is the model's copy."""
    counts = sorted({(run.workers, run.shard) for run in runs if run.workers})
    if not counts:
        return "workers not recorded"
    if len(counts) > 1:
        return f"{min(w for w, _ in counts)}-{max(w for w, _ in counts)} workers"
    ((workers, shard),) = counts
    text = f"{workers} worker{'s' if workers != 1 else ''}"
    return f"{text} ({workers // shard} replicas x {shard} shards)" if shard > 1 else text


def header(runs: Sequence[Run], root: Path) -> str:
    """The lines under each chart's title: the sweep (or run), its size in runs and workers, what varies, and the
    overrides every run shares."""
    if len(runs) == 1:
        (run,) = runs
        return f"run {sweep_name(root)}: {_workers(runs)}, {' '.join(run.overrides) or DEFAULTS}"
    keys = varying(runs)
    what = ", ".join(f"{key} ({', '.join(values) if len(values) <= 5 else f'{len(values)} values'})"
                     for key, values in keys.items()) or "nothing (the same settings)"
    lines = [f"sweep {sweep_name(root)}: {len(runs)} runs of {_workers(runs)}, varying {what}"]
    common = common_overrides(runs)
    if common:
        lines.append(f"every run: {' '.join(common)}")
    return "\n".join(lines)


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


def seed_groups(runs: list[Run]) -> list[tuple[str, list[Run]]]:
    """Runs that differ only in ``seed=``, together (in first-seen order), labelled without it: a sweep over seeds is
    drawn as one line per setting with the seeds' spread around it. Runs set apart by the seed alone (a sweep over
    seed= and nothing else) are labelled by what every run sets, like a single run, or "defaults"."""
    stripped = [[t for t in run.label.split() if override_key(t) != SEED] for run in runs]
    # Nothing but the seed in a label, and perhaps the number of alike runs.
    seed_only = [not parts or parts[0].startswith("#") for parts in stripped]
    base = " ".join(o for o in common_overrides(runs) if override_key(o) != SEED) if all(seed_only) else ""
    groups: dict[str, list[Run]] = {}
    for run, parts, only in zip(runs, stripped, seed_only):
        if only:
            parts = [base or DEFAULTS, *parts]
        groups.setdefault(" ".join(parts), []).append(run)
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


def _line_style(i: int, lines: int, points: int) -> dict[str, Any]:
    """Line ``i`` of ``lines``: its colour, dash and marker, about eight markers a line, staggered so that lines
    lying on one another show each one's marks."""
    every = max(1, points // 8)
    return {"color": f"C{i % 10}", "linestyle": LINE_STYLES[i % len(LINE_STYLES)],
            "marker": MARKERS[i % len(MARKERS)], "markevery": (i * every // lines, every), "markersize": 4,
            "linewidth": max(1.0, 2.6 - 0.6 * i), "alpha": 0.9}


def _new_figure(title: str, head: str, width: float, height: float = 5.2) -> Figure:
    """A figure titled by the chart and the sweep, the header wrapped to the figure's width (about 12 characters an
    inch at this size); constrained layout keeps the title and legend off the plots."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # Agg: no display needed
    wrapped = [textwrap.fill(line, int(12 * width), break_long_words=False, break_on_hyphens=False)
               for line in head.splitlines()]
    fig.suptitle("\n".join([title, *wrapped]), fontsize="medium")
    return fig


def _legend(fig: Figure, handles: list[Artist], labels: list[str]) -> None:
    """Below the plot, where it covers no line; as many columns as the labels' lengths allow. A label wider than the
    figure (a sweep over seeds alone is named by every override) is wrapped, at about 12 small characters an inch."""
    labels = [textwrap.fill(label, int(12 * fig.get_figwidth()) - 8, break_long_words=False, break_on_hyphens=False)
              for label in labels]
    longest = max(len(line) for label in labels for line in label.splitlines())
    columns = max(1, min(len(labels), 100 // (longest + 8)))
    fig.legend(handles, labels, loc="outside lower center", ncols=columns, fontsize="small", frameon=False)


def line_figure(runs: list[Run], chart: LineChart, x_key: str, x_label: str, head: str) -> Figure | None:
    """One line per run, or per setting of a sweep over seeds (its mean, the seeds' min to max shaded); None when no
    run has a point of ``chart.key`` against ``x_key``."""
    groups = [(label, [(run, *_series(run, x_key, chart.key)) for run in group]) for label, group in seed_groups(runs)]
    groups = [(label, [s for s in group if s[1]]) for label, group in groups]
    groups = [(label, group) for label, group in groups if group]
    if not groups:
        return None
    fig = _new_figure(f"{chart.title} vs {x_label.split(' (')[0]}", head, 8.0)
    ax = fig.add_subplot()
    lows: list[float] = []
    for i, (label, group) in enumerate(groups):
        if len(group) == 1:
            run, xs, ys = group[0]
            low = ys
            ax.plot(xs, ys, label=run.label, **_line_style(i, len(groups), len(xs)))
        else:
            xs, mean, low, high = band([run for run, _, _ in group], x_key, chart.key)
            ax.plot(xs, mean, label=f"{label} ({len(group)} seeds: mean, min to max shaded)",
                    **_line_style(i, len(groups), len(xs)))
            ax.fill_between(xs, low, high, color=f"C{i % 10}", alpha=0.2, linewidth=0)
        lows += low
        for x in phase_changes(group[0][0], x_key):  # dotted: the end of a phase
            ax.axvline(x, color=f"C{i % 10}", linestyle=":", alpha=0.7)
    log = chart.log and all(y > 0 for y in lows)
    if log:
        ax.set_yscale("log")
    ax.set(xlabel=x_label, ylabel=chart.y_label + (" (log scale)" if log and chart.key != "consensus/distance" else ""))
    if chart.key == "consensus/distance":
        ax.yaxis.label.set_fontsize("small")
    ax.grid(alpha=0.3)
    if log:
        ax.grid(alpha=0.1, which="minor")
    _legend(fig, *ax.get_legend_handles_labels())
    return fig


def throughput(run: Run, key: str) -> float | None:
    """The final number from result.json, else the mean of the logged ones (a failed run has no result.json)."""
    final = _number(run.result.get(key))
    if final is not None:
        return final
    logged = [v for v in (_number(r.get(key)) for r in run.records) if v is not None]
    return sum(logged) / len(logged) if logged else None


def _bars(ax: Axes, runs: list[Run], key: str, colors: list[str]) -> None:
    """One bar per run, named below (an override a line) and numbered on top; the headroom keeps the numbers
    inside the axes."""
    values = [throughput(run, key) for run in runs]
    bars = ax.bar(range(len(runs)), [math.nan if v is None else v for v in values], 0.6, color=colors)
    ax.bar_label(bars, [f"{v:,.0f}" if v is not None else "" for v in values], padding=2, fontsize="small")
    for x in (x for x, v in enumerate(values) if v is None):  # no bar: say so where it would stand
        ax.text(x, 0, "not logged", ha="center", va="bottom", fontsize="small")
    ax.set_ylim(0, 1.15 * max((v for v in values if v is not None), default=1.0))
    if len(runs) == 1:
        ax.set_xlim(-1.5, 1.5)  # a lone bar as wide as one of three
    ax.set_xticks(range(len(runs)), ["\n".join(run.label.split()) for run in runs], fontsize="small")
    ax.grid(axis="y", alpha=0.3)


def throughput_figure(runs: list[Run], head: str) -> Figure | None:
    """Samples/s of all workers together, and of the slowest worker at its own pace, in panels of their own: the
    two differ by about the worker count, and side by side on one axis the second reads as a straggler. Beside each
    other for a few runs, one above the other (runs named once, below) for more. None when no run has either."""
    panels = [(THROUGHPUT, "aggregate: all workers together", "samples/s, all workers"),
              (THROUGHPUT_MIN, "per worker: the slowest, at its own pace",
               "samples/s, slowest worker\n(its time waiting for peers left out)")]
    panels = [p for p in panels if any(throughput(run, p[0]) is not None for run in runs)]
    if not panels:
        return None
    color_of = {id(run): f"C{i % 10}" for i, (_, group) in enumerate(seed_groups(runs)) for run in group}
    stacked = len(runs) > 3
    # Each run's slot holds its longest override on one line (about 13 small characters an inch).
    slot = max(1.0, max(len(part) for run in runs for part in run.label.split()) / 13 + 0.3)
    width = len(runs) * slot + 1.2 if stacked else len(panels) * (len(runs) * slot + 1.2)
    fig = _new_figure("Throughput", head, max(8.0, width), 8.5 if stacked else 5.2)
    grid = fig.subplots(len(panels), 1, sharex=True) if stacked else fig.subplots(1, len(panels))
    for ax, (key, title, y_label) in zip(grid if len(panels) > 1 else [grid], panels):
        _bars(ax, runs, key, [color_of[id(run)] for run in runs])
        ax.set_title(title, fontsize="medium")
        ax.set_ylabel(y_label)
    return fig


def load_runs(root: Path) -> list[Run]:
    """Every run under ``root``, labelled by its overrides whose values differ from the others' (or "defaults")."""
    runs = [load_run(path) for path in find_runs(root)]
    for run, label in zip(runs, label_runs(runs)):
        run.label = label
    return runs


def charts(runs: list[Run], root: Path) -> tuple[dict[str, Figure], list[str]]:
    """Every chart that some run has data for, by file name, and a line for each chart skipped saying why."""
    head = header(runs, root)
    figures: dict[str, Figure] = {}
    skipped: list[str] = []
    for chart in LINE_CHARTS:
        missing = []
        for x_name, x_key, x_label in X_AXES:
            name = f"{chart.name}_vs_{x_name}.png"
            figure = line_figure(runs, chart, x_key, x_label, head)
            if figure is not None:
                figures[name] = figure
            else:
                missing.append((name, x_key))
        if len(missing) == len(X_AXES):
            skipped.append(f"skipped {', '.join(n for n, _ in missing)}: no run logs {chart.key}")
        elif missing:
            skipped.append(f"skipped {', '.join(n for n, _ in missing)}: no run logs {chart.key} with {missing[0][1]}")
    figure = throughput_figure(runs, head)
    if figure is not None:
        figures["throughput.png"] = figure
    else:
        skipped.append(f"skipped throughput.png: no run has {THROUGHPUT}")
    return figures, skipped


def plot_dir(root: Path, out: Path) -> list[Path]:
    """Writes every chart that some run has data for into ``out``; returns the paths written."""
    figures, skipped = charts(load_runs(root), root)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in figures.items():
        fig.savefig(out / name, dpi=120)
        fig.clear()  # a long sweep's figures are let go as they are written
        print(out / name)
        written.append(out / name)
    for line in skipped:
        print(line)
    return written


CHARTS_HELP = """charts written (one line or bar per run, labelled by the overrides that set it apart, or "defaults";
an override equal to a default sets nothing apart):
  loss_vs_step.png, loss_vs_time.png            training loss, mean over workers (log scale)
  accuracy_vs_step.png, accuracy_vs_time.png    test accuracy of the workers' average model
  consensus_vs_step.png, consensus_vs_time.png  consensus distance sqrt(mean_i |x_i - mean x|^2) (log scale)
  throughput.png                                samples/s: all workers together | the slowest worker's own pace
runs that differ only in seed= are drawn as their mean with the seeds' min to max shaded."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="decent-train-plot", description="Plot a decent-train run or sweep.",
                                     epilog=CHARTS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=Path, help="a run directory, or a sweep directory holding run directories "
                                               "(symbolic links to runs are followed)")
    parser.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: DIR/plots)")
    args = parser.parse_args(argv)
    root: Path = args.dir
    if not root.is_dir():
        _fail(f"{root}: no such directory (expected a run directory or a sweep directory of runs)")
    if not find_runs(root):
        _fail(f"{root}: no run found (expected {METRICS_FILE} in it or in a directory under it)")
    out = args.out if args.out is not None else root / "plots"
    try:  # before any chart is drawn: a run read elsewhere may be read-only (outputs.md: plotting after the fact)
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        given = f"--out {out}" if args.out is not None else f"{out} (the default --out)"
        _fail(f"{given}: cannot write the charts there ({error.strerror or error}); give --out DIR, a directory you "
              "can write")
    plot_dir(root, out)


def _fail(message: str) -> NoReturn:
    """The user's mistake: one line, argparse's status, no traceback."""
    print(f"decent-train-plot: error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
