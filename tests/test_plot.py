"""``decent-train-plot``: charts from run directories written here in the trainer's format (no training run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from PIL import Image

from decent_train.launcher.plot import (
    THROUGHPUT,
    THROUGHPUT_MIN,
    band,
    find_runs,
    load_runs,
    main,
    phase_changes,
    run_labels,
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
                                  "time/elapsed_s": 0.008 * scale * step}
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


def test_sweep_writes_every_chart(sweep: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main([str(sweep)])
    assert_pngs(sweep / "plots", ALL_PNGS)
    printed = capsys.readouterr().out.splitlines()
    assert sorted(printed) == sorted(str(sweep / "plots" / name) for name in ALL_PNGS)


def test_labels_are_the_overrides_that_differ() -> None:
    assert run_labels([["topology=ring", "seed=0"], ["topology=complete", "seed=0"]], ["0", "1"]) == [
        "topology=ring", "topology=complete"]
    assert run_labels([["topology=ring", "seed=0"]], ["0"]) == ["topology=ring seed=0"]
    assert run_labels([[]], ["my_run"]) == ["my_run"]
    # a run with nothing of its own is named by its directory
    assert run_labels([["seed=0"], ["seed=0", "lr=0.1"]], ["a", "b"]) == ["a", "lr=0.1"]


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
