"""A resume whose algorithm, optimizer or compression differs from the checkpoint's stops before any worker starts.

The saved state's layout depends on them: resuming a ring / accum_adamw run with ``optim=sgd`` used to fail in every
worker with ``KeyError: 'momentum'``, ``algorithm=diloco`` with ``KeyError: 'inner'``, ``compression=int8`` with a
ValueError after the workers started, and ``optim=adamw`` trained on silently from AccumAdamW's state. The manifest
now records them (``resume_settings``) and the launcher refuses another value in one line, exit status 2, naming the
key, both values and what to do. The oracle: real runs through the ``decent-train`` command (one decentralized and one
Streaming DiLoCo checkpoint), and, for a refusal, that nothing started (no worker's log, no checkpoint, no record).
Hyperparameters stay changeable, and manifests written before the keys existed still load, unchecked for them.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from decent_train.components.checkpoint import MANIFEST, Checkpoint, complete_checkpoints
from decent_train.config import METRICS_FILE, RESULT_FILE
from decent_train.launcher.preflight import preflight

from .distributed import WorkerError, run_workers
from .jobs import WORLD, check_succeeded, decent_train, make_cfg, records, train_on_cpu

COMMON = ("model=mlp", "model.hidden_sizes=[32]", "logger=jsonl", "launch.nproc_per_node=2", "batch_size=16",
          "eval_every=0")
STEPS = 10  # the decentralized run's; checkpoints at 5 and 10
DILOCO = ("algorithm=diloco", "algorithm.sync_every=4", "algorithm.fragments=2")  # 2 fragments, one every 2 steps


def _train(tmp: Path, *args: str) -> Path:
    run_dir = tmp / "run"
    check_succeeded(decent_train(*COMMON, *args, f"hydra.run.dir={run_dir}", cwd=tmp))
    return run_dir


@pytest.fixture(scope="module")
def ring_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report's checkpoint: 2 workers on a ring, optim=accum_adamw (the default), no compression."""
    return _train(tmp_path_factory.mktemp("ring"), f"steps={STEPS}", "checkpoint.every=5")


@pytest.fixture(scope="module")
def diloco_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Streaming DiLoCo with 2 fragments: its saved anchors and counters are per fragment."""
    return _train(tmp_path_factory.mktemp("diloco"), *DILOCO, "steps=8", "checkpoint.every=4")


def _assert_refused(source: Path, tmp_path: Path, key: str, mine: Any, theirs: Any, *args: str) -> None:
    """``decent-train resume=source *args`` ends with exit status 2 and one line naming ``key``, the value asked for
    and the checkpoint's, before any worker started."""
    run_dir = tmp_path / "resumed"
    proc = decent_train(*COMMON, f"resume={source}", *args, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output and "KeyError" not in output and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    newest = complete_checkpoints(source)[0].path
    assert line == (f"decent-train: error: resume={source}: {key}={mine}: the checkpoint {newest} was trained with "
                    f"{key}={theirs}; resume with {key}={theirs}, or start a new run (without resume=)")
    assert not (run_dir / "logs").exists() and not (run_dir / "checkpoints").exists()
    assert not (run_dir / METRICS_FILE).exists()


@pytest.mark.slow  # reads a checkpoint that a launch of decent-train wrote (10-20 s)
def test_the_manifest_records_what_a_resume_must_match(ring_run: Path, diloco_run: Path) -> None:
    """Written by the runs themselves (the worker records them; the code that saves passes nothing new)."""
    ring = json.loads((complete_checkpoints(ring_run)[0].path / MANIFEST).read_text())
    assert ring["settings"] == {"algorithm": "decentralized", "optim": "accum_adamw", "scheduler": "cosine",
                                "compression": "none"}
    diloco = json.loads((complete_checkpoints(diloco_run)[0].path / MANIFEST).read_text())
    assert diloco["settings"] == {"algorithm": "diloco", "optim": "accum_adamw", "scheduler": "cosine",
                                  "compression": "none", "algorithm.fragments": 2}


@pytest.mark.slow  # reads a checkpoint that a launch of decent-train wrote (10-20 s)
@pytest.mark.parametrize("key, mine, theirs", [
    ("optim", "sgd", "accum_adamw"),  # was: KeyError: 'momentum' in every worker
    ("optim", "adamw", "accum_adamw"),  # was: trained to the end from AccumAdamW's state, without a word
    ("algorithm", "diloco", "decentralized"),  # was: KeyError: 'inner'
    ("compression", "int8", "none"),  # was: ValueError after the workers started
    ("scheduler", "constant", "cosine"),  # LambdaLR cannot load CosineAnnealingLR's state
])
def test_a_resume_with_another_setting_stops_before_any_worker(
    ring_run: Path, tmp_path: Path, key: str, mine: str, theirs: str
) -> None:
    _assert_refused(ring_run, tmp_path, key, mine, theirs, f"steps={STEPS + 5}", f"{key}={mine}")


@pytest.mark.slow  # reads a checkpoint that a launch of decent-train wrote (10-20 s)
@pytest.mark.parametrize("key, mine, theirs, args", [
    ("algorithm", "decentralized", "diloco", ()),  # was: KeyError: 'world_size'
    ("algorithm.fragments", 1, 2, DILOCO[:2]),  # the anchors and counters are per fragment
])
def test_a_local_steps_checkpoint_is_resumed_with_its_algorithm_and_fragments(
    diloco_run: Path, tmp_path: Path, key: str, mine: Any, theirs: Any, args: tuple[str, ...]
) -> None:
    _assert_refused(diloco_run, tmp_path, key, mine, theirs, *args, "steps=12", f"{key}={mine}")


@pytest.mark.slow  # reads a checkpoint that a launch of decent-train wrote (10-20 s)
def test_hyperparameters_change_on_resume(ring_run: Path, tmp_path: Path) -> None:
    """lr, weight decay and steps are changed on resume on purpose: the run starts from the checkpoint and goes on."""
    run_dir = tmp_path / "resumed"
    check_succeeded(decent_train(*COMMON, f"resume={ring_run}", f"steps={STEPS + 4}", "optim.lr=0.002",
                                 "optim.weight_decay=0.01", f"hydra.run.dir={run_dir}", cwd=tmp_path))
    assert json.loads((run_dir / RESULT_FILE).read_text())["resumed_from_step"] == STEPS
    steps = [r["step"] for r in records(run_dir)]
    assert steps and min(steps) > STEPS and max(steps) == STEPS + 4


def _without_settings(source: Path, copy: Path) -> Path:
    """``source``'s checkpoints as a run from before the manifest recorded the settings: the key stripped."""
    shutil.copytree(source / "checkpoints", copy / "checkpoints")
    for manifest in (copy / "checkpoints").glob(f"step_*/{MANIFEST}"):
        saved = json.loads(manifest.read_text())
        del saved["settings"]
        manifest.write_text(json.dumps(saved, indent=2))
    return copy


@pytest.mark.slow  # reads a checkpoint that a launch of decent-train wrote (10-20 s)
def test_an_older_manifest_loads_as_before_unchecked(
    ring_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the key nothing is checked (the launcher lets optim=sgd through, as before), and the same settings
    continue from it in the workers (forked here: torchrun's LOCAL_WORLD_SIZE set as the launch had it)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(WORLD))
    old = _without_settings(ring_run, tmp_path / "old")
    preflight(make_cfg(Path("/unused"), resume=str(old), optim={"name": "sgd"}))
    same = make_cfg(tmp_path / "new", resume=str(old), steps=STEPS + 2, scheduler={"warmup_steps": 0})  # as run
    result = run_workers(train_on_cpu, WORLD, same)[0]
    assert result["resumed_from_step"] == STEPS


@pytest.mark.slow  # reads a checkpoint that a launch of decent-train wrote (10-20 s)
def test_the_workers_refuse_in_one_line_too(ring_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the Python API (no launcher's preflight) the workers stop with the same line instead of a KeyError."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(WORLD))
    cfg = make_cfg(tmp_path / "new", resume=str(ring_run), steps=STEPS + 2, optim={"name": "sgd"})
    with pytest.raises(WorkerError, match=r"ValueError: optim=sgd: the checkpoint .*step_00000010 was trained with "
                                          r"optim=accum_adamw; resume with optim=accum_adamw") as error:
        run_workers(train_on_cpu, WORLD, cfg)
    assert "KeyError" not in str(error.value)


@pytest.mark.slow  # reads a checkpoint that a launch of decent-train wrote (10-20 s)
def test_an_averaged_resume_may_change_the_compression(ring_run: Path) -> None:
    """At another world size the compressed gossip's copies restart from the average: compression may change there,
    the optimizer may not."""
    four = {"launch": {"nproc_per_node": 4}}
    preflight(make_cfg(Path("/unused"), resume=str(ring_run), compression={"name": "int8"}, **four))
    with pytest.raises(ValueError, match=re.escape("optim=sgd: the checkpoint ")):
        preflight(make_cfg(Path("/unused"), resume=str(ring_run), optim={"name": "sgd"}, **four))


def test_several_settings_are_named_in_one_line_and_unknown_ones_pass() -> None:
    """All that differ, in one line (an algorithm's own options left out when the algorithm differs: they follow);
    a manifest without the key (written before it was recorded) checks nothing."""
    saved = {"algorithm": "diloco", "optim": "accum_adamw", "scheduler": "cosine", "compression": "int8",
             "algorithm.fragments": 2, "compression.int8_block": 256}
    checkpoint = Checkpoint(Path("RUN/checkpoints/step_00000010"), {"settings": saved})
    asked = {**saved, "algorithm": "localsgd", "optim": "sgd", "algorithm.fragments": 1, "compression.int8_block": 64}
    assert checkpoint.describe_settings_mismatch(asked) == (
        "algorithm=localsgd optim=sgd compression.int8_block=64: the checkpoint RUN/checkpoints/step_00000010 was "
        "trained with algorithm=diloco optim=accum_adamw compression.int8_block=256; resume with algorithm=diloco "
        "optim=accum_adamw compression.int8_block=256, or start a new run (without resume=)")
    assert checkpoint.describe_settings_mismatch({**saved, "compression": "none"}, same_layout=False) is None
    assert checkpoint.describe_settings_mismatch(saved) is None
    assert Checkpoint(Path("RUN"), {"step": 1}).describe_settings_mismatch(asked) is None
