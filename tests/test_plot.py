"""``decent-train-plot``: charts from run directories written here in the trainer's format (no training run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from matplotlib.axis import Axis
from matplotlib.figure import Figure
from matplotlib.text import Text
from omegaconf import OmegaConf
from PIL import Image

from decent_train.launcher.plot import (
    THROUGHPUT,
    THROUGHPUT_MIN,
    Run,
    band,
    charts,
    find_runs,
    header,
    load_runs,
    main,
    label_runs,
    phase_changes,
    seed_groups,
    throughput,
)

COMMON = ["logger.progress_bar=false", "steps=20"]
LINE_PNGS = [f"{name}_vs_{x}.png" for name in ("loss", "accuracy", "consensus") for x in ("step", "time")]
ALL_PNGS = [*LINE_PNGS, "throughput.png"]


def write_run(run_dir: Path, overrides: list[str], scale: float, consensus: bool = True,
              result: bool = True) -> None:
    """A run directory as the trainer leaves it: metrics.jsonl, resolved_config.yaml, result.json (if it finished)."""
    run_dir.mkdir(parents=True)
    records: list[dict[str, Any]] = []
    for step in range(2, 22, 2):
        record: dict[str, Any] = {"step": step, "epoch": step / 11, "train/loss": scale * 2.0 / step,
                                  "train/lr": 0.003, THROUGHPUT: 16000.0 / scale + step, "time/step_ms": 7.9 * scale,
                                  "time/elapsed_s": 0.008 * scale * step, "world/members": 4}
        if step % 10 == 0:
            record |= {"eval/loss": scale / step, "eval/accuracy": 1 - scale / step}
        if consensus:
            record |= {"consensus/distance": scale * 0.1 / step, "consensus/relative": 0.01 / step,
                       THROUGHPUT_MIN: 3900.0 / scale}
        records.append(record)
    records[3]["train/loss"] = None  # NaN is logged as null
    records[4].pop("time/elapsed_s")  # and any key may be missing from a line
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    topology = next(o.split("=")[1] for o in overrides if o.startswith("topology="))
    config = {"steps": 20, "run": {"overrides": overrides, "choices": {"topology": topology, "optim": "accum_adamw"}}}
    OmegaConf.save(OmegaConf.create(config), run_dir / "resolved_config.yaml")
    if result:
        (run_dir / "result.json").write_text(json.dumps({
            "eval/accuracy": 1 - scale / 20, "eval/loss": scale / 20, "train/loss": scale / 10, "steps": 20,
            THROUGHPUT: 16322.0 / scale, "world_size": 4, "algorithm": "decentralized", "topology": topology,
            "wall_time_s": 12.8}))


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """Three jobs of a topology sweep; the last failed before writing result.json."""
    root = tmp_path / "sweep"
    for job, (topology, scale) in enumerate([("complete", 1.0), ("ring", 1.5), ("one-peer-exp", 2.0)]):
        write_run(root / str(job), [f"topology={topology}", *COMMON], scale, result=job != 2)
    return root


def assert_pngs(out: Path, names: list[str]) -> None:
    for name in names:
        path = out / name
        assert path.is_file(), f"{name} not written"
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            assert image.format == "PNG" and image.width > 0 and image.height > 0


def test_sweep_writes_every_chart_and_the_help_names_each(sweep: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main([str(sweep)])
    assert_pngs(sweep / "plots", ALL_PNGS)
    printed = capsys.readouterr().out.splitlines()
    assert sorted(printed) == sorted(str(sweep / "plots" / name) for name in ALL_PNGS)
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out
    assert all(path.name in shown for path in (sweep / "plots").iterdir()), shown


def run_labels(overrides: list[list[str]]) -> list[str]:
    """The labels of runs known by their overrides alone (no config: values compare as written)."""
    return label_runs([Run(Path(), [], {}, list(run)) for run in overrides])


def test_labels_are_the_overrides_that_differ() -> None:
    assert run_labels([["topology=ring", "seed=0"], ["topology=complete", "seed=0"]]) == [
        "topology=ring", "topology=complete"]
    assert run_labels([["topology=ring", "seed=0"]]) == ["topology=ring seed=0"]
    assert run_labels([[]]) == ["defaults"]
    # a run with nothing of its own ran on the defaults of what the others set
    assert run_labels([["seed=0"], ["seed=0", "lr=0.1"]]) == ["defaults", "lr=0.1"]
    # runs that are alike are numbered in order, never named by their directory
    assert run_labels([["lr=0.1"], [], ["lr=0.1"], []]) == ["lr=0.1 #1", "defaults #1", "lr=0.1 #2", "defaults #2"]


def test_sweep_runs_are_labelled_and_in_job_order(sweep: Path) -> None:
    runs = load_runs(sweep)
    assert [run.label for run in runs] == ["topology=complete", "topology=ring", "topology=one-peer-exp"]
    # the failed run's throughput is the mean of its logged values: 16000/2 + mean(2, 4, ..., 20)
    assert throughput(runs[2], THROUGHPUT) == pytest.approx(8000.0 + 11.0)
    assert throughput(runs[1], THROUGHPUT) == pytest.approx(16322.0 / 1.5)  # result.json wins when there is one


def test_nested_runs_sort_by_job_number(tmp_path: Path) -> None:
    sweep = tmp_path / "multirun" / "2025-01-01" / "12-00-00"
    for job in (10, 2, 0, 1):
        write_run(sweep / str(job), [f"topology=t{job}", *COMMON], 1.0)
    (sweep / ".hydra").mkdir()
    assert [run.name for run in find_runs(tmp_path / "multirun")] == ["0", "1", "2", "10"]
    assert [run.label for run in load_runs(tmp_path)] == ["topology=t0", "topology=t1", "topology=t2", "topology=t10"]


def test_single_run(sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = sweep / "1"
    assert [run.label for run in load_runs(run_dir)] == [" ".join(["topology=ring", *COMMON])]
    main([str(run_dir), "--out", str(tmp_path / "out")])
    assert_pngs(tmp_path / "out", ALL_PNGS)
    assert not (run_dir / "plots").exists()
    assert "skipped" not in capsys.readouterr().out


def test_chart_without_data_is_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for job, topology in enumerate(["complete", "ring"]):
        write_run(tmp_path / str(job), [f"topology={topology}", *COMMON], 1.0 + job, consensus=False)
    main([str(tmp_path)])
    written = [name for name in ALL_PNGS if "consensus" not in name]
    assert_pngs(tmp_path / "plots", written)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(written)
    skipped = [line for line in capsys.readouterr().out.splitlines() if "skipped" in line]
    assert skipped == ["skipped consensus_vs_step.png, consensus_vs_time.png: no run logs consensus/distance"]


def test_dir_without_runs_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty" / "0").mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "empty")])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("decent-train-plot: error: ")
    assert str(tmp_path / "empty") in lines[0] and "metrics.jsonl" in lines[0]
    assert not (tmp_path / "empty" / "plots").exists()


@pytest.mark.parametrize("out", ["a_file/charts", None])  # None: the default, RUN/plots, taken by a file here
def test_charts_that_cannot_be_written_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    out: str | None) -> None:
    """A run plotted where it cannot be written (read elsewhere, read-only): one line naming the place, nothing
    drawn. As root (CI) a mode does not stop a write, so a file stands where the folder must go."""
    write_run(tmp_path / "run", ["topology=ring", *COMMON], 1.0)
    (tmp_path / "a_file").write_text("")
    (tmp_path / "run" / "plots").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "run"), *(["--out", str(tmp_path / out)] if out else [])])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and len(lines) == 1 and lines[0].startswith("decent-train-plot: error: "), lines
    assert str(tmp_path / (out or "run/plots")) in lines[0] and "give --out DIR" in lines[0]


def test_missing_dir_is_an_error_without_traceback(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_sweep"
    done = subprocess.run([sys.executable, "-m", "decent_train.launcher.plot", str(missing)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("decent-train-plot: error: ") and str(missing) in lines[0]
    assert not missing.exists()


def test_phase_changes_are_the_last_record_of_each_phase(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "run", ["topology=ring", *COMMON], 1.0)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    phases = [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]  # records at steps 2..20: phase 0 ends at step 6, phase 1 at step 14
    with_phases = [json.dumps(json.loads(line) | {"phase": p}) for line, p in zip(lines, phases)]
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(with_phases) + "\n")
    (run,) = load_runs(tmp_path / "run")
    assert phase_changes(run, "step") == [6, 14]
    main([str(tmp_path / "run"), "--out", str(tmp_path / "charts")])  # the dotted marks do not break a chart
    assert_pngs(tmp_path / "charts", ["loss_vs_step.png"])
    no_phases = tmp_path / "plain"
    write_run(no_phases, ["topology=ring", *COMMON], 1.0)
    assert phase_changes(load_runs(no_phases)[0], "step") == []


def test_a_sweep_over_seeds_is_one_line_per_setting_with_the_seeds_spread(tmp_path: Path) -> None:
    """Two topologies x two seeds: grouped by topology, each drawn as the mean of its seeds (by hand from the scales
    written) with their min and max; times, which differ per run, are averaged per step like the values."""
    root = tmp_path / "seeds"
    scales = {("complete", 0): 1.0, ("complete", 1): 3.0, ("ring", 0): 2.0, ("ring", 1): 4.0}
    for job, ((topology, seed), scale) in enumerate(scales.items()):
        write_run(root / str(job), [f"topology={topology}", f"seed={seed}", *COMMON], scale)
    groups = seed_groups(load_runs(root))
    assert [(label, len(runs)) for label, runs in groups] == [("topology=complete", 2), ("topology=ring", 2)]
    xs, mean, low, high = band(groups[1][1], "step", "eval/accuracy")  # ring: accuracy 1 - scale / step
    assert xs == [10, 20]
    assert mean == pytest.approx([1 - 3.0 / 10, 1 - 3.0 / 20]) and low == pytest.approx([1 - 4 / 10, 1 - 4 / 20])
    assert high == pytest.approx([1 - 2 / 10, 1 - 2 / 20])
    times, _, _, _ = band(groups[0][1], "time/elapsed_s", "consensus/distance")
    assert times[0] == pytest.approx(0.008 * 2.0 * 2)  # step 2: the mean of 0.008 x scale x step over scales 1 and 3
    out = tmp_path / "plots"
    main([str(root), "--out", str(out)])
    assert_pngs(out, LINE_PNGS)


def figures(root: Path) -> dict[str, Figure]:
    """The charts decent-train-plot would write for ``root``, as figure objects (nothing drawn to disk)."""
    return charts(load_runs(root), root)[0]


def legend_labels(fig: Figure) -> list[str]:
    return [text.get_text() for legend in fig.legends for text in legend.get_texts()]


def test_every_chart_is_titled_with_the_sweep_its_workers_and_what_varies(sweep: Path) -> None:
    """The fixture's sweep: 3 topologies, 4 workers each (result.json's world_size; the failed run's logged
    world/members), the COMMON overrides on every run."""
    charts_by_name = figures(sweep)
    assert sorted(charts_by_name) == sorted(ALL_PNGS)
    for name, fig in charts_by_name.items():
        title = " ".join(fig.get_suptitle().split())  # long lines are wrapped
        assert f"sweep {sweep.parent.name}/{sweep.name}: 3 runs of 4 workers" in title, (name, title)
        assert "varying topology (complete, ring, one-peer-exp)" in title, (name, title)
        assert f"every run: {' '.join(COMMON)}" in title, (name, title)
        what = {"loss": "Training loss", "accuracy": "Test accuracy", "consensus": "Consensus distance",
                "throughput": "Throughput"}[name.split("_")[0].removesuffix(".png")]
        assert title.startswith(what), (name, title)


def test_headers_say_how_many_workers_and_shards() -> None:
    def run(workers: int | None, shard: int = 1, overrides: tuple[str, ...] = ()) -> Run:
        return Run(Path("r"), [], {}, list(overrides), workers, shard)

    root = Path("/sweeps/multirun/2025-01-01/12-00-00")  # Hydra's sweep directory: named with its date
    assert header([run(4, overrides=("lr=0.1",)), run(8, overrides=("lr=0.2",))], root) == \
        "sweep multirun/2025-01-01/12-00-00: 2 runs of 4-8 workers, varying lr (0.1, 0.2)"
    assert header([run(4, 2, ("lr=0.1",)), run(4, 2)], root) == \
        "sweep multirun/2025-01-01/12-00-00: 2 runs of 4 workers (2 replicas x 2 shards), varying lr (0.1, default)"
    assert header([run(1)], Path("/outputs/2025-01-01/12-00-00")) == \
        "run outputs/2025-01-01/12-00-00: 1 worker, defaults"


def test_loss_and_consensus_are_on_a_log_axis_with_lines_told_apart(sweep: Path) -> None:
    for name, fig in figures(sweep).items():
        if name == "throughput.png":
            continue
        (ax,) = fig.axes
        expected = "linear" if name.startswith("accuracy") else "log"
        assert ax.get_yscale() == expected, name
        # one line per run, each with a dash and a marker of its own: lines that coincide still show both
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == ["topology=complete", "topology=ring", "topology=one-peer-exp"]
        assert len({line.get_linestyle() for line in lines}) == len({line.get_marker() for line in lines}) == 3, name


def test_a_loss_that_reaches_zero_keeps_a_linear_axis(tmp_path: Path) -> None:
    """A log axis would drop the zero (a loss of 0.0 written by the run) without a word."""
    write_run(tmp_path / "run", ["topology=ring"], 1.0)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    lines[-1] = json.dumps(json.loads(lines[-1]) | {"train/loss": 0.0})
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    charts_by_name = figures(tmp_path / "run")
    assert charts_by_name["loss_vs_step.png"].axes[0].get_yscale() == "linear"
    assert charts_by_name["consensus_vs_step.png"].axes[0].get_yscale() == "log"


def test_throughput_puts_aggregate_and_slowest_worker_in_panels_of_their_own(sweep: Path, tmp_path: Path) -> None:
    fig = figures(sweep)["throughput.png"]
    aggregate, slowest = fig.axes
    assert "aggregate" in aggregate.get_title() and "slowest" in slowest.get_title()
    # the bars are the fixture's numbers: result.json's 16322 / scale; the failed run's logged mean, 16000/2 + 11;
    # the slowest worker's, logged only: 3900 / scale
    assert [bar.get_height() for bar in aggregate.patches] == pytest.approx([16322.0, 16322.0 / 1.5, 8011.0])
    assert [bar.get_height() for bar in slowest.patches] == pytest.approx([3900.0, 2600.0, 1950.0])
    for ax in fig.axes:  # runs are named under their bars, no legend covers them, their numbers fit above them
        assert [t.get_text() for t in ax.get_xticklabels()] == [
            "topology=complete", "topology=ring", "topology=one-peer-exp"]
        assert ax.get_legend() is None and not fig.legends
        assert ax.get_ylim()[1] >= 1.1 * max(bar.get_height() for bar in ax.patches)
    for job, topology in enumerate(["complete", "ring"]):  # runs that never log the slowest worker: one panel
        write_run(tmp_path / "plain" / str(job), [f"topology={topology}"], 1.0, consensus=False)
    assert len(figures(tmp_path / "plain")["throughput.png"].axes) == 1
    for job in range(5):  # more runs: the panels one above the other, the runs named once, under the lower
        write_run(tmp_path / "many" / str(job), [f"topology=t{job}"], 1.0 + job, consensus=job > 0)
    aggregate, slowest = figures(tmp_path / "many")["throughput.png"].axes
    assert aggregate.get_position().y0 > slowest.get_position().y1
    assert not [t for t in aggregate.get_xticklabels() if t.get_visible() and t.get_text()]
    assert [t.get_text() for t in slowest.get_xticklabels()] == [f"topology=t{job}" for job in range(5)]
    numbers = [(round(getattr(t, "xy", t.get_position())[0]), t.get_text()) for t in slowest.texts if t.get_text()]
    assert sorted(numbers) == [(0, "not logged"), (1, "1,950"), (2, "1,300"), (3, "975"), (4, "780")]  # 3900/scale


def test_a_run_without_overrides_is_labelled_defaults_not_by_its_time(tmp_path: Path) -> None:
    """``decent-train`` with no overrides writes outputs/DATE/TIME; a sweep's job may set nothing the others set."""
    run_dir = tmp_path / "outputs" / "2025-01-01" / "12-00-00"
    write_run(run_dir, ["topology=ring"], 1.0)
    config = OmegaConf.load(run_dir / "resolved_config.yaml")
    config.run.overrides = []
    OmegaConf.save(config, run_dir / "resolved_config.yaml")
    assert [run.label for run in load_runs(run_dir)] == ["defaults"]
    for name, fig in figures(run_dir).items():
        shown = legend_labels(fig) + [t.get_text() for ax in fig.axes for t in ax.get_xticklabels()]
        assert "defaults" in shown and not any("12-00-00" in text for text in shown), (name, shown)
    root = tmp_path / "sweep"
    write_run(root / "0", ["topology=ring", "steps=20"], 1.0)
    write_run(root / "1", ["topology=ring", "steps=20", "optim.lr=0.1"], 1.0)
    assert legend_labels(figures(root)["loss_vs_step.png"]) == ["defaults", "optim.lr=0.1"]


def test_the_consensus_axis_says_what_the_distance_measures(sweep: Path) -> None:
    for name in ("consensus_vs_step.png", "consensus_vs_time.png"):
        label = figures(sweep)[name].axes[0].get_ylabel()
        # ConsensusProbe.measure: sqrt((1/n) sum_i |x_i - mean|^2), x_i a worker's parameters
        assert label.startswith("consensus distance") and r"\sqrt{\mathrm{mean}_i" in label, label
        assert r"\Vert x_i - \bar{x} \Vert^2" in label and "worker $i$'s parameters" in label, label


def test_symlinked_run_directories_are_followed(sweep: Path, tmp_path: Path) -> None:
    """A directory of links to chosen runs plots like a sweep; a link back up the tree or a second link to the same
    run adds nothing."""
    chosen = tmp_path / "chosen"
    chosen.mkdir()
    (chosen / "0").symlink_to(sweep / "0", target_is_directory=True)
    (chosen / "1").symlink_to(sweep / "1", target_is_directory=True)
    (chosen / "1-again").symlink_to(sweep / "1", target_is_directory=True)
    (chosen / "loop").symlink_to(chosen, target_is_directory=True)
    assert find_runs(chosen) == [chosen / "0", chosen / "1"]
    main([str(chosen), "--out", str(tmp_path / "out")])
    assert_pngs(tmp_path / "out", ALL_PNGS)
    assert [run.label for run in load_runs(chosen)] == ["topology=complete", "topology=ring"]


def in_view(axis: Axis) -> list[Text]:
    """The tick labels drawn: matplotlib keeps labels for ticks beyond the axis's ends but does not draw them."""
    low, high = sorted(axis.get_view_interval())
    return [tick.label1 for tick in axis.get_major_ticks()
            if low <= tick.get_loc() <= high and tick.label1.get_visible() and tick.label1.get_text()]


def drawn_texts(fig: Figure) -> list[Text]:
    """Every text the PNG shows: the title, each panel's title, axis labels, ticks, numbers on bars, the legend."""
    texts = [fig._suptitle] if fig._suptitle is not None else []
    for ax in fig.axes:
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts, *in_view(ax.xaxis), *in_view(ax.yaxis)]
    texts += [text for legend in fig.legends for text in legend.get_texts()]
    return [text for text in texts if text.get_visible() and text.get_text()]


def test_no_text_leaves_the_figure_or_overlaps(tmp_path: Path) -> None:
    """Drawn, as the PNG is: the title, labels and legend lie inside the canvas, the runs' names under the bars do
    not run into each other, and the legend covers no plot. Two runs with long names and many shared overrides."""
    shared = ["logger.progress_bar=false", "steps=20", "dataset=digits", "model=cnn", "optim.weight_decay=0.05",
              "batch_size=64", "compression=int8"]
    for job, topology in enumerate(["complete", "one-peer-exp"]):
        write_run(tmp_path / str(job), [f"topology={topology}", f"algorithm.sync_every={4 + job}", *shared], 1.0)
    for name, fig in figures(tmp_path).items():
        renderer = fig.canvas.get_renderer()
        fig.canvas.draw()
        canvas = fig.bbox
        for text in drawn_texts(fig):
            box = text.get_window_extent(renderer)
            assert canvas.x0 - 1 <= box.x0 and box.x1 <= canvas.x1 + 1 and box.y1 <= canvas.y1 + 1, (
                name, text.get_text())
        for ax in fig.axes:
            ticks = [t.get_window_extent(renderer) for t in in_view(ax.xaxis)]
            assert not any(a.overlaps(b) for i, a in enumerate(ticks) for b in ticks[i + 1:]), name
            for legend in fig.legends:
                assert not legend.get_window_extent(renderer).overlaps(ax.get_tightbbox(renderer)), name
