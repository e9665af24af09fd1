"""``decent-train-plot``'s labels, groups and titles compare what runs ran with, not how their overrides are written.

The run directories are written by the launcher itself (``decent-train -m dry_run=true``: resolved_config.yaml and
.hydra/ as a training job leaves them, less the dry run's own override) and by the trainer's MetricLogger
(metrics.jsonl), so the plot reads exactly the files a user's sweep holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from matplotlib.figure import Figure
from omegaconf import OmegaConf

from decent_train.components.metrics import LoggerConfig, MetricLogger, WandbConfig
from decent_train.config import METRICS_FILE, RESOLVED_CONFIG, RESULT_FILE
from decent_train.launcher.plot import Run, charts, header, load_runs, main, seed_groups, varying

from .jobs import decent_train

SET = ["algorithm=localsgd", "topology=ring"]  # localsgd's sync_every is 10 unless set
LINE_PNGS = [f"{name}_vs_{x}.png" for name in ("loss", "accuracy", "consensus") for x in ("step", "time")]


def as_trained(run_dir: Path, scale: float) -> None:
    """A dry run's directory made what a training job leaves: its records (written by the trainer's logger) and
    result.json, and ``dry_run=true`` gone from the overrides (a training job was not given it)."""
    config = OmegaConf.load(run_dir / RESOLVED_CONFIG)
    config.run.overrides = [o for o in config.run.overrides if not o.startswith("dry_run=")]
    OmegaConf.save(config, run_dir / RESOLVED_CONFIG)
    hydra_overrides = run_dir / ".hydra" / "overrides.yaml"
    OmegaConf.save(OmegaConf.create([o for o in OmegaConf.load(hydra_overrides) if not o.startswith("dry_run=")]),
                   hydra_overrides)
    metrics = MetricLogger(run_dir / METRICS_FILE, LoggerConfig(wandb=WandbConfig(mode="disabled")), {})
    for step in range(10, 110, 10):
        metrics.log({"step": step, "train/loss": scale / step, "eval/accuracy": 1 - scale / step,
                     "consensus/distance": scale / step, "time/elapsed_s": 0.01 * scale * step,
                     "throughput/samples_per_s": 1000.0 / scale, "world/members": 4})
    (run_dir / RESULT_FILE).write_text(json.dumps({"eval/accuracy": 1 - scale / 100, "world_size": 4,
                                                   "throughput/samples_per_s": 1000.0 / scale}, indent=2) + "\n")


def launch(sweep: Path, *overrides: str) -> list[Path]:
    """The jobs of ``decent-train -m dry_run=true OVERRIDES``, trained as above (scale: 1, 2, ... in job order)."""
    done = decent_train("-m", "dry_run=true", *overrides, f"hydra.sweep.dir={sweep}", cwd=sweep.parent)
    assert done.returncode == 0, done.stderr
    jobs = sorted((p for p in sweep.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    for scale, job in enumerate(jobs, 1):
        as_trained(job, float(scale))
    return jobs


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``seeds``: a sweep over seed= alone. ``sync``: algorithm.sync_every=10,20 x seed=0,1, written explicitly."""
    root = tmp_path_factory.mktemp("plot_labels")
    seeds = launch(root / "seeds", *SET, "seed=0,1")
    sync = launch(root / "sync", *SET, "algorithm.sync_every=10,20", "seed=0,1")
    found = {"seeds": root / "seeds"}
    for job in seeds + sync:
        cfg = OmegaConf.load(job / RESOLVED_CONFIG)
        found[f"{job.parent.name}{cfg.algorithm.sync_every if job.parent.name == 'sync' else ''}/{cfg.seed}"] = job
    return found


def links(root: Path, runs: list[Path]) -> Path:
    """A directory of links to chosen runs: a sweep of its own to decent-train-plot."""
    root.mkdir()
    for job, run in enumerate(runs):
        (root / str(job)).symlink_to(run, target_is_directory=True)
    return root


def legend(fig: Figure) -> list[str]:
    return [text.get_text() for found in fig.legends for text in found.get_texts()]


def title(fig: Figure) -> str:
    return " ".join(fig.get_suptitle().split())


@pytest.mark.slow
def test_a_sweep_over_seeds_alone_is_one_line_with_the_seeds_spread(sweeps: dict[str, Path], tmp_path: Path) -> None:
    """``decent-train -m algorithm=localsgd topology=ring seed=0,1``: one group, labelled by what every run sets."""
    runs = load_runs(sweeps["seeds"])
    assert [run.label for run in runs] == ["seed=0", "seed=1"]
    assert [(label, [run.path.name for run in group]) for label, group in seed_groups(runs)] == [
        ("algorithm=localsgd topology=ring", ["0", "1"])]
    figures = charts(runs, sweeps["seeds"])[0]
    fig = figures["loss_vs_step.png"]
    assert legend(fig) == ["algorithm=localsgd topology=ring (2 seeds: mean, min to max shaded)"]
    fig.canvas.draw()  # the legend, named by every override, stays inside the PNG (a long one is wrapped)
    assert fig.bbox.x0 - 1 <= fig.legends[0].get_window_extent().x0 <= fig.legends[0].get_window_extent().x1 <= \
        fig.bbox.x1 + 1
    assert len(fig.axes[0].lines) == 1 and len(fig.axes[0].collections) == 1  # the mean, and the band around it
    assert "varying seed (0, 1)" in title(fig) and "every run: algorithm=localsgd topology=ring" in title(fig)
    main([str(sweeps["seeds"]), "--out", str(tmp_path / "plots")])
    assert all((tmp_path / "plots" / name).stat().st_size > 0 for name in [*LINE_PNGS, "throughput.png"])


@pytest.mark.slow
def test_an_override_equal_to_the_default_is_no_difference(sweeps: dict[str, Path], tmp_path: Path) -> None:
    """algorithm.sync_every=10 written out, and localsgd's default 10: the same setting, so nothing varies."""
    root = links(tmp_path / "explicit_vs_default", [sweeps["sync10/0"], sweeps["seeds/0"]])
    runs = load_runs(root)
    assert runs[0].overrides == [*SET, "algorithm.sync_every=10", "seed=0"] and runs[1].overrides == [*SET, "seed=0"]
    assert varying(runs) == {}
    assert [run.label for run in runs] == ["defaults #1", "defaults #2"]  # alike runs, numbered
    head = header(runs, root)
    assert "varying nothing" in head and "sync_every (10, default)" not in head, head
    assert "every run: algorithm=localsgd topology=ring algorithm.sync_every=10 seed=0" in head, head
    fig = charts(runs, root)[0]["loss_vs_step.png"]
    assert legend(fig) == ["defaults #1", "defaults #2"]
    main([str(root), "--out", str(tmp_path / "plots")])
    assert (tmp_path / "plots" / "loss_vs_step.png").stat().st_size > 0


@pytest.mark.slow
def test_runs_alike_but_for_the_seed_form_one_group_however_their_overrides_are_written(
        sweeps: dict[str, Path], tmp_path: Path) -> None:
    """sync_every=10 written out (seed 0) and by default (seed 1), beside sync_every=20 at seeds 0 and 1: two
    groups of two seeds, each labelled by its setting; the title lists the values run, not how they were written."""
    chosen = [sweeps["sync10/0"], sweeps["seeds/1"], sweeps["sync20/0"], sweeps["sync20/1"]]
    root = links(tmp_path / "mixed", chosen)
    runs = load_runs(root)
    assert [run.label for run in runs] == ["algorithm.sync_every=10 seed=0", "algorithm.sync_every=10 seed=1",
                                           "algorithm.sync_every=20 seed=0", "algorithm.sync_every=20 seed=1"]
    assert [(label, len(group)) for label, group in seed_groups(runs)] == [
        ("algorithm.sync_every=10", 2), ("algorithm.sync_every=20", 2)]
    assert varying(runs) == {"algorithm.sync_every": ["10", "20"], "seed": ["0", "1"]}
    fig = charts(runs, root)[0]["accuracy_vs_step.png"]
    assert legend(fig) == [f"algorithm.sync_every={n} (2 seeds: mean, min to max shaded)" for n in (10, 20)]
    assert "varying algorithm.sync_every (10, 20), seed (0, 1)" in title(fig), title(fig)
    main([str(root), "--out", str(tmp_path / "plots")])
    assert (tmp_path / "plots" / "accuracy_vs_step.png").stat().st_size > 0


def test_resolved_values_decide_what_varies() -> None:
    """In memory: a value written two ways (3e-3, 0.003) is one value; a key a config lacks (a run written before
    configs were kept whole) falls back to the override's text."""
    def run(overrides: list[str], lr: float, seed: int) -> Run:
        config = OmegaConf.create({"seed": seed, "optim": {"lr": lr}, "run": {"overrides": overrides, "choices": {}}})
        return Run(Path("r"), [], {}, overrides, 4, 1, config=config)

    runs = [run(["optim.lr=3e-3", "seed=0"], 0.003, 0), run(["seed=1"], 0.003, 1), run(["extra=1"], 0.003, 0)]
    assert varying(runs) == {"seed": ["0", "1"], "extra": ["default", "1"]}
