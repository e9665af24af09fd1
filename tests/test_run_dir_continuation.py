"""A launch into a run directory that holds checkpoints continues them only with the settings they were trained with,
or when ``resume=`` names that directory; otherwise it stops in one line, before any worker starts, and leaves the
old run as it was.

Before, ``hydra.run.dir=X`` given to a new experiment (another ``optim.lr``, another ``steps``) resumed X's newest
checkpoint silently: the "new" run reported the old model's accuracy with exit 0, or trained on from it. Re-running
the same command (a crash, a requeued SLURM job) must still continue, and so must a relaunch that changes only how
the run is run (workers, logging, checkpoint cadence). The oracles: real checkpoints trained by fork-started workers
and the preflight's answer for each change, and real ``decent-train`` launches whose outputs are compared byte for
byte with what the first run left.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from decent_train.components.checkpoint import CHECKPOINTS, complete_checkpoints
from decent_train.config import RESOLVED_CONFIG, RESULT_FILE, TrainConfig
from decent_train.launcher.preflight import preflight

from .distributed import run_workers
from .jobs import WORLD, check_succeeded, decent_train, make_cfg, train_on_cpu


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory as the launcher leaves it: the config it wrote before starting the workers, and the
    checkpoints the workers saved (steps 3 and 6)."""
    run_dir = tmp_path_factory.mktemp("run")
    cfg = make_cfg(run_dir, checkpoint={"every": 3})
    OmegaConf.save(OmegaConf.structured(cfg), run_dir / RESOLVED_CONFIG)
    run_workers(train_on_cpu, WORLD, cfg)
    assert [c.step for c in complete_checkpoints(run_dir)] == [6, 3]
    return run_dir


def refusal(cfg: TrainConfig) -> str | None:
    try:
        preflight(cfg)
    except ValueError as error:
        return str(error)
    return None


SAME_RUN = {  # a relaunch that changes none of what is trained: it continues
    "the same command": {},
    "other workers": {"launch": {"nproc_per_node": 1}},
    "another checkpoint cadence": {"checkpoint": {"every": 2, "keep": 5}},
    "another logger and evaluation cadence": {"logger": {"log_every": 1, "progress_bar": True}, "eval_every": 2},
    "live fault tolerance": {"fault_tolerance": {"min_workers": 1}},
}
OTHER_RUN = {  # a relaunch that trains something else: refused, naming the first changed keys
    "more steps": ({"steps": 12}, "steps=12 (was 6)"),
    "another learning rate": ({"optim": {"lr": 0.02}}, "optim.lr=0.02 (was 0.01)"),
    "another model": ({"model": {"hidden_sizes": [16]}}, "model.hidden_sizes=[16] (was [32])"),
    "another seed": ({"seed": 8}, "seed=8 (was 7)"),
    "four changes": ({"scheduler": {"warmup_steps": 1}, "batch_size": 8, "steps": 9, "seed": 1},
                     "seed=1 (was 7), steps=9 (was 6), batch_size=8 (was 16) and 1 more"),  # in the config's order
}


@pytest.mark.parametrize("change", SAME_RUN.values(), ids=SAME_RUN.keys())
def test_a_relaunch_of_the_same_run_continues(trained: Path, change: dict[str, Any]) -> None:
    assert refusal(make_cfg(trained, **change)) is None


@pytest.mark.parametrize(("change", "named"), OTHER_RUN.values(), ids=OTHER_RUN.keys())
def test_a_relaunch_with_other_settings_is_refused(trained: Path, change: dict[str, Any], named: str) -> None:
    line = refusal(make_cfg(trained, **change))
    assert line is not None and "\n" not in line
    assert line == (f"hydra.run.dir={trained} holds checkpoints (newest: step 6) of a run with other settings "
                    f"({named}); to continue it with these, add resume={trained}; to start a new run, give another "
                    "hydra.run.dir")


def test_resume_naming_the_run_directory_continues_with_other_settings(trained: Path) -> None:
    assert refusal(make_cfg(trained, steps=12, optim={"lr": 0.02}, resume=str(trained))) is None


def test_resume_naming_another_directory_is_refused(trained: Path, tmp_path: Path) -> None:
    """The workers look in their own run directory first (a restarted worker continues its run): ``resume=`` would
    be ignored."""
    other = tmp_path / "other"
    line = refusal(make_cfg(trained, resume=str(other)))
    assert line == (f"hydra.run.dir={trained} holds checkpoints (newest: step 6), which the workers would continue "
                    f"instead of resume={other}; give another hydra.run.dir to start from resume={other}, or "
                    f"resume={trained} to continue this run")


def test_keys_a_newer_decent_train_added_are_not_changes(trained: Path, tmp_path: Path) -> None:
    """A run saved by an older decent-train lacks keys added since: continuing it after an upgrade is the same run."""
    run_dir = _copy(trained, tmp_path / "old")
    saved = OmegaConf.load(run_dir / RESOLVED_CONFIG)
    del saved.parallel["mixed_precision"], saved["global_avg_every"]
    OmegaConf.save(saved, run_dir / RESOLVED_CONFIG)
    assert refusal(make_cfg(run_dir)) is None
    assert refusal(make_cfg(run_dir, global_avg_every=2)) is None  # not known to have changed: the old run's own


def test_checkpoints_without_their_config_are_refused(trained: Path, tmp_path: Path) -> None:
    run_dir = _copy(trained, tmp_path / "bare")
    (run_dir / RESOLVED_CONFIG).unlink()
    line = refusal(make_cfg(run_dir))
    assert line is not None and f"of a run with other settings ({RESOLVED_CONFIG} cannot be read: " in line
    assert refusal(make_cfg(run_dir, resume=str(run_dir))) is None


def test_a_run_directory_without_checkpoints_takes_any_settings(trained: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "empty"
    (run_dir / CHECKPOINTS).mkdir(parents=True)
    (run_dir / RESOLVED_CONFIG).write_bytes((trained / RESOLVED_CONFIG).read_bytes())
    assert refusal(make_cfg(run_dir, steps=12)) is None


def test_a_continued_run_whose_checkpoints_are_all_truncated_stops_before_the_workers(trained: Path,
                                                                                     tmp_path: Path) -> None:
    """Continuing the run directory is checked like ``resume=``: every checkpoint cut short is one line here, not a
    failure in every worker."""
    run_dir = _copy(trained, tmp_path / "cut")
    for rank_file in (run_dir / CHECKPOINTS).glob("step_*/rank1.pt"):
        rank_file.write_bytes(rank_file.read_bytes()[:1000])
    line = refusal(make_cfg(run_dir))
    assert line is not None and line.startswith(f"hydra.run.dir={run_dir}: ") and "step_00000006" in line
    assert "step_00000003" in line
    assert refusal(make_cfg(run_dir, checkpoint={"fresh_if_unreadable": True})) is None


def _copy(run_dir: Path, to: Path) -> Path:
    shutil.copytree(run_dir, to)
    return to


def _digests(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_refused_relaunch_keeps_the_record_of_the_command_that_made_the_run(tmp_path: Path) -> None:
    """Hydra writes ``.hydra/`` (the command's overrides and config) before the job runs; a relaunch into the run's
    directory that the checks refuse must not replace it with the refused command. A command that sets
    ``hydra.output_subdir`` gets Hydra's behaviour: its directory, or nothing."""
    run_dir = tmp_path / "run"
    check_succeeded(decent_train("dry_run=true", "optim.lr=0.01", f"hydra.run.dir={run_dir}", cwd=tmp_path))
    assert list(OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")) == ["dry_run=true", "optim.lr=0.01"]
    before = _digests(run_dir)
    assert set(before) == {RESOLVED_CONFIG, ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml"}
    refused = decent_train("dry_run=true", "optim.lr=-1", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert (refused.returncode, refused.stderr) == (2, "decent-train: error: optim.lr=-1.0 must be > 0\n")
    assert _digests(run_dir) == before

    check_succeeded(decent_train("dry_run=true", "hydra.output_subdir=null", f"hydra.run.dir={tmp_path}/none",
                                 cwd=tmp_path))
    assert [p.name for p in (tmp_path / "none").iterdir()] == [RESOLVED_CONFIG]
    check_succeeded(decent_train("dry_run=true", "hydra.output_subdir=record", f"hydra.run.dir={tmp_path}/own",
                                 cwd=tmp_path))
    assert sorted(p.name for p in (tmp_path / "own").iterdir()) == ["record", RESOLVED_CONFIG]
    assert (tmp_path / "own" / "record" / "overrides.yaml").is_file()


def _not_json(constant: str) -> None:
    raise AssertionError(f"result.json holds {constant}, which is not JSON")


@pytest.mark.slow
def test_relaunches_through_the_command(tmp_path: Path) -> None:
    """The same command again finishes with the first run's result; another ``steps=`` is refused with the run left
    byte for byte as it was; with ``resume=`` naming the directory it trains on from the newest checkpoint."""
    run_dir = tmp_path / "run"
    job = ("model=mlp", "model.hidden_sizes=[32]", "logger=jsonl", "launch.nproc_per_node=2", "batch_size=16",
           "eval_every=0", "checkpoint.every=2", f"hydra.run.dir={run_dir}")
    check_succeeded(decent_train(*job, "steps=4", cwd=tmp_path))
    first = json.loads((run_dir / RESULT_FILE).read_text())

    again = decent_train(*job, "steps=4", cwd=tmp_path)
    check_succeeded(again)
    assert "resumed at the end" in again.stdout
    second = json.loads((run_dir / RESULT_FILE).read_text(), parse_constant=_not_json)
    assert (second["resumed_from_step"], second["eval/accuracy"]) == (4, first["eval/accuracy"])
    trained = ("train/loss", "train_time_s", "throughput/samples_per_s", "wall_time_s")  # the first launch's, kept
    assert {k: second[k] for k in trained} == {k: first[k] for k in trained}

    before = _digests(run_dir)
    refused = decent_train(*job, "steps=6", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stdout == "" and "Traceback" not in refused.stderr
    assert refused.stderr.splitlines() == [
        f"decent-train: error: hydra.run.dir={run_dir} holds checkpoints (newest: step 4) of a run with other "
        f"settings (steps=6 (was 4)); to continue it with these, add resume={run_dir}; to start a new run, give "
        "another hydra.run.dir"]
    assert _digests(run_dir) == before

    check_succeeded(decent_train(*job, "steps=6", f"resume={run_dir}", cwd=tmp_path))
    third = json.loads((run_dir / RESULT_FILE).read_text())
    assert (third["resumed_from_step"], third["steps"]) == (4, 6)
    assert [c.step for c in complete_checkpoints(run_dir)] == [6, 4]
