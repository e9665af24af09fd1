"""Checkpoints whose saved state holds NaN or inf: a resume skips them like a corrupt file, and training never writes
one.

Each fault is caused for real. One tensor of a real short run's checkpoint file is overwritten with NaN or inf and
its manifest's checksum updated to match, as a run that diverged just before it saved would have written it (the
checksum cannot see it). A non-finite state at a save step is trained into: a real checkpoint's Adam moment set to a
huge but finite value makes the next update overflow the parameters, after that step's loss was computed (finite).

Oracles: CPU resumes are bit-exact, so a resume that falls back to the finite checkpoint ends with exactly the
parameters of the uninterrupted run; the refusals name the file and the tensor that were damaged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from decent_train.components.checkpoint import FRESH_FLAG, complete_checkpoints
from decent_train.config import DIVERGED_FILE, MODEL_FILE, RESULT_FILE
from decent_train.launcher.preflight import preflight

from .distributed import WorkerError, run_workers
from .jobs import WORLD, check_succeeded, decent_train, make_cfg, train_on_cpu

SHORT = {"steps": 6, "eval_every": 0, "checkpoint": {"every": 3, "keep": 5},
         "logger": {"log_every": 3, "consensus_every": 0}}
WEIGHT = ("model", "1.weight")  # the input layer's weight (model.hidden_sizes=[32])
MOMENT = ("algorithm", "buckets", 0, "optimizer", "state", 0, "exp_avg_sq")  # Adam's second moment of a parameter
MEAN = ("algorithm", "buckets", 0, "optimizer", "state", 0, "exp_avg")  # its first moment


def _name(key: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in key)


def _poison(checkpoint: Path, rank: int, key: tuple[Any, ...], value: float, everywhere: bool = False) -> Path:
    """Write ``value`` into the tensor at ``key`` of ``rank``'s file of ``checkpoint`` (its first element, or all of
    it), and that file's new checksum and size into the manifest: what a run that saved this state writes."""
    path = checkpoint / f"rank{rank}.pt"
    state = torch.load(path, weights_only=True)
    tensor = state
    for part in key:
        tensor = tensor[part]
    if everywhere:
        tensor.fill_(value)
    else:
        tensor.view(-1)[0] = value
    torch.save(state, path)
    data = path.read_bytes()
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["ranks"][rank].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return path


def _step(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source / "checkpoints", target / "checkpoints")
    return target


def _same_params(a: Path, b: Path) -> None:
    left, right = torch.load(a / MODEL_FILE), torch.load(b / MODEL_FILE)
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), name


def _train_logging_warnings(rank: int, world: int, cfg: Any, folder: Path) -> dict[str, Any]:
    """``train_on_cpu``, this rank's warnings also into ``folder/rank<k>.log`` (message only)."""
    from loguru import logger

    folder.mkdir(exist_ok=True)
    logger.add(folder / f"rank{rank}.log", level="WARNING", format="{message}")
    return train_on_cpu(rank, world, cfg)


@pytest.fixture(scope="module")
def periodic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real short run with checkpoints at steps 3 and 6 (and its final model)."""
    run_dir = tmp_path_factory.mktemp("periodic")
    run_workers(train_on_cpu, WORLD, make_cfg(run_dir, **SHORT))
    assert [c.step for c in complete_checkpoints(run_dir)] == [6, 3]
    return run_dir


# -- the workers -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("key", "value", "shown"), [(WEIGHT, float("nan"), "NaN"), (MOMENT, float("inf"), "inf")])
def test_workers_fall_back_to_the_newest_finite_checkpoint(
    periodic: Path, tmp_path: Path, key: tuple[Any, ...], value: float, shown: str
) -> None:
    """A parameter (NaN) or an optimizer moment (inf: Adam would go on from it, silently freezing that weight) of
    rank 1's newest file: every rank resumes from step 3 instead, and trains exactly as the uninterrupted run did.
    Rank 0 says why in one line, naming the file and the tensor."""
    source = _copy(periodic, tmp_path / "source")
    damaged = _poison(_step(source, 6), 1, key, value)
    run_dir, warnings = tmp_path / "resumed", tmp_path / "warnings"
    result = run_workers(_train_logging_warnings, WORLD, make_cfg(run_dir, **SHORT, resume=str(source)), warnings)[0]
    assert result["resumed_from_step"] == 3
    _same_params(run_dir, periodic)
    (warning,) = (warnings / "rank0.log").read_text().splitlines()
    assert warning == (f"checkpoint step_00000006 skipped: {damaged} holds {shown} in {_name(key)}; trying the one "
                       "before")
    assert (warnings / "rank1.log").read_text() == ""


def test_an_averaged_resume_skips_a_file_holding_nan(periodic: Path, tmp_path: Path) -> None:
    """At another world size every worker reads every saved file: one NaN in rank 0's newest file would be averaged
    into every new worker's model; it falls back to step 3 instead."""
    source = _copy(periodic, tmp_path / "source")
    _poison(_step(source, 6), 0, WEIGHT, float("nan"))
    cfg = make_cfg(tmp_path / "resumed", **SHORT, resume=str(source), launch={"nproc_per_node": 1})
    result = run_workers(train_on_cpu, 1, cfg)[0]
    assert result["resumed_from_step"] == 3 and result["resumed_from_world_size"] == WORLD
    assert all(torch.isfinite(t).all() for t in torch.load(tmp_path / "resumed" / MODEL_FILE).values())


# -- the launcher's check --------------------------------------------------------------------------------------------
def test_the_preflight_skips_a_nonfinite_checkpoint_and_refuses_when_none_is_finite(
    periodic: Path, tmp_path: Path
) -> None:
    """Only the newest non-finite: the preflight passes (the workers fall back). Every one: one line naming each file
    and tensor, and the flag that trains from step 0 instead."""
    source = _copy(periodic, tmp_path / "source")
    cfg = make_cfg(tmp_path / "new", **SHORT, resume=str(source))
    _poison(_step(source, 6), 1, WEIGHT, float("nan"))
    preflight(cfg)
    _poison(_step(source, 3), 0, MOMENT, float("inf"))
    with pytest.raises(ValueError) as refused:
        preflight(cfg)
    line = str(refused.value)
    expected = (f"resume={source}: no checkpoint can be read: step_00000006 [rank1.pt holds NaN in {_name(WEIGHT)}], "
                f"step_00000003 [rank0.pt holds inf in {_name(MOMENT)}]; to train from step 0 instead, add "
                f"{FRESH_FLAG}")
    assert line == expected


# -- training never saves a non-finite state -----------------------------------------------------------------------
def test_a_nonfinite_state_is_not_saved_and_the_last_finite_checkpoint_is_kept(tmp_path: Path) -> None:
    """With ``checkpoint.keep=1`` a non-finite state saved at step 5 used to delete step 4, the only finite
    checkpoint, and the stop one step later named the non-finite one as 'the last good checkpoint': nothing trained
    was left. Now the run stops at step 5 without saving, naming the tensor, and step 4 is kept as it was."""
    every_step = {"eval_every": 0, "checkpoint": {"every": 1, "keep": 1}}
    run_workers(train_on_cpu, WORLD, make_cfg(tmp_path, **every_step, steps=4))
    for rank in range(WORLD):  # finite, but the next Adam update overflows the parameters it moves
        _poison(_step(tmp_path, 4), rank, MEAN, 3e38, everywhere=True)
    kept = {rank: (_step(tmp_path, 4) / f"rank{rank}.pt").read_bytes() for rank in range(WORLD)}
    pattern = (rf"NonFiniteState: the model or optimizer state is NaN or infinite at step 5 \(rank \d: model\.\S+ "
               rf"holds (inf|NaN)\); not saved, training stopped: the last good checkpoint is "
               rf"{re.escape(str(_step(tmp_path, 4)))}")
    with pytest.raises(WorkerError, match=pattern):
        run_workers(train_on_cpu, WORLD, make_cfg(tmp_path, **every_step, steps=8))  # a restart: from step 4
    assert [c.step for c in complete_checkpoints(tmp_path)] == [4]
    assert not _step(tmp_path, 5).exists()
    assert all((_step(tmp_path, 4) / f"rank{rank}.pt").read_bytes() == kept[rank] for rank in range(WORLD))
    assert re.match(pattern.removeprefix("NonFiniteState: "), (tmp_path / DIVERGED_FILE).read_text())
    assert json.loads((tmp_path / RESULT_FILE).read_text())["steps"] == 4  # the first run's: the second had none


# -- the whole command -----------------------------------------------------------------------------------------------
JOB = ["steps=9", "eval_every=0", "checkpoint.every=3", "checkpoint.keep=5", "model=mlp", "model.hidden_sizes=[32]",
       "launch.nproc_per_node=2", "seed=7", "logger=jsonl", "logger.progress_bar=false", "logger.consensus_every=0"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real short run of the command, with checkpoints at steps 3, 6 and 9."""
    run_dir = tmp_path_factory.mktemp("launched") / "run"
    check_succeeded(decent_train(*JOB, f"hydra.run.dir={run_dir}", cwd=run_dir.parent))
    assert [c.step for c in complete_checkpoints(run_dir)] == [9, 6, 3]
    return run_dir


def _died_after_6(launched: Path, target: Path) -> Path:
    """``launched``'s checkpoints as a run that stopped after step 6 left them: steps 3 and 6."""
    source = _copy(launched, target)
    shutil.rmtree(_step(source, 9))
    return source


@pytest.mark.slow
def test_the_command_resumes_from_the_finite_checkpoint_with_one_warning(launched: Path, tmp_path: Path) -> None:
    """It used to load the NaN and fail in every worker at the next step, with a traceback and 'train/loss is NaN
    ...: no checkpoint was written before it'; now it resumes from step 3, says why in one line, and ends exactly as
    the uninterrupted run."""
    source = _died_after_6(launched, tmp_path / "source")
    damaged = _poison(_step(source, 6), 1, WEIGHT, float("nan"))
    run_dir = tmp_path / "run"
    proc = decent_train(*JOB, f"resume={source}", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    check_succeeded(proc)
    assert "Traceback" not in proc.stderr + proc.stdout
    (line,) = [line for line in proc.stderr.splitlines() if "skipped" in line or "NaN" in line]
    assert line.endswith(f"checkpoint step_00000006 skipped: {damaged} holds NaN in {_name(WEIGHT)}; trying the one "
                         "before")
    assert json.loads((run_dir / RESULT_FILE).read_text())["resumed_from_step"] == 3
    _same_params(run_dir, launched)


@pytest.mark.slow
def test_the_command_refuses_in_one_line_when_no_checkpoint_is_finite(launched: Path, tmp_path: Path) -> None:
    """Exit status 2, one line naming each checkpoint's file and tensor, before any worker starts."""
    source = _died_after_6(launched, tmp_path / "source")
    _poison(_step(source, 6), 1, WEIGHT, float("nan"))
    _poison(_step(source, 3), 0, MOMENT, float("inf"))
    run_dir = tmp_path / "run"
    proc = decent_train(*JOB, f"resume={source}", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == (f"decent-train: error: resume={source}: no checkpoint can be read: step_00000006 [rank1.pt holds "
                    f"NaN in {_name(WEIGHT)}], step_00000003 [rank0.pt holds inf in {_name(MOMENT)}]; to train from "
                    f"step 0 instead, add {FRESH_FLAG}")
    assert proc.stdout == "" and not (run_dir / "logs").exists() and not (run_dir / "checkpoints").exists()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16,
                                   torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_the_scan_names_the_first_non_finite_tensor_of_every_floating_dtype(dtype: torch.dtype) -> None:
    """By hand: in a state of finite tensors, integer ones and one NaN (float8_e4m3fn has no inf) or inf, the scan
    names that tensor's keys; a finite state gives None. torch has no float8 ``aminmax`` on the CPU."""
    from decent_train.components.checkpoint import nonfinite_tensor

    bad = torch.tensor([1.0, float("nan"), 2.0]).to(dtype)
    finite = {"model": {"w": torch.ones(4, dtype=dtype), "steps": torch.arange(3)},
              "rng": torch.zeros(8, dtype=torch.uint8)}
    assert nonfinite_tensor(finite) is None
    assert nonfinite_tensor({**finite, "opt": [torch.zeros(2, dtype=dtype), {"m": bad}]}) == ("opt.1.m", "NaN")
    if dtype != torch.float8_e4m3fn:
        assert nonfinite_tensor({"x": torch.tensor([float("-inf")]).to(dtype)}) == ("x", "inf")


def test_the_launchers_check_names_the_lowest_bad_rank_when_a_later_one_is_found_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``verify_checkpoint`` checks the ranks in threads; its line is still the lowest bad rank's, as when it checked
    them one after another. Four hand-made rank files: rank 0's holds NaN (found after its hash), rank 2's does not
    match the manifest; rank 0's hash waits until rank 2's is done, so rank 2's problem is found first."""
    from decent_train.components import checkpoint as module

    ranks = []
    for rank in range(4):
        path = tmp_path / f"rank{rank}.pt"
        torch.save({"model": {"w": torch.full((4,), float("nan") if rank == 0 else 1.0)}}, path)
        sha256, size = module._checksum(path)
        ranks.append({"file": path.name, "sha256": sha256 if rank != 2 else "0" * 64, "bytes": size})
    rank2_hashed, checksum = threading.Event(), module._checksum

    def rank0_after_rank2(path: Path, *stop: Any) -> tuple[str, int]:
        if path.name == "rank0.pt":
            rank2_hashed.wait(timeout=10)  # checked one at a time, rank 2 never comes first: go on after the wait
        found = checksum(path, *stop)
        if path.name == "rank2.pt":
            rank2_hashed.set()
        return found

    monkeypatch.setattr(module, "_checksum", rank0_after_rank2)
    monkeypatch.setattr(module, "VERIFY_THREADS", 4)
    why = module.verify_checkpoint(module.Checkpoint(tmp_path, {"step": 3, "world_size": 4, "ranks": ranks}))
    assert rank2_hashed.is_set()  # rank 2's problem was there before rank 0's: the order was not a given
    assert why == f"{tmp_path / 'rank0.pt'} holds NaN in model.w"


def test_a_ctrl_c_during_the_launchers_check_ends_it_at_once(tmp_path: Path) -> None:
    """A real SIGINT while ``verify_checkpoint`` hashes two large rank files (sparse: 8 GiB each, no disk used) ends it
    within a chunk, not after the files: the hashing threads stop too, so nothing waits for them at the exit."""
    from decent_train.components import checkpoint as module

    ranks = []
    for rank in range(2):
        (tmp_path / f"rank{rank}.pt").touch()
        os.truncate(tmp_path / f"rank{rank}.pt", 8 << 30)
        ranks.append({"file": f"rank{rank}.pt", "sha256": "0" * 64, "bytes": 8 << 30})
    runners = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as a user's Python has it
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            module.verify_checkpoint(module.Checkpoint(tmp_path, {"step": 3, "world_size": 2, "ranks": ranks}))
    finally:
        signal.signal(signal.SIGINT, runners)
    stopped = time.monotonic() - start
    assert not [t for t in threading.enumerate() if t.name.startswith("verify_checkpoint")]
    assert stopped < 5.0, f"stopped {stopped:.1f} s after the start, 0.5 s after which the signal came"
