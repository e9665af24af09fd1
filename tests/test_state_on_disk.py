"""State on disk (issue 38, point 5): checkpoints that cannot be read, a run directory that cannot be written, an npz
that does not hold what its layout says, and ``checkpoint.every=0``.

Each fault is caused for real: checkpoint files of a real short run truncated, bit-flipped, deleted, a manifest
overwritten; a path under a file, a read-only directory, a filled-up tmpfs; npz files written with the wrong arrays.
The oracle for a refusal is the fault itself (the line names the file and why) and that nothing ran (no worker, no
training); for ``checkpoint.every=0`` it is the checkpoint an otherwise identical run with periodic checkpoints
writes at the same final step.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from decent_train.components.checkpoint import FRESH_FLAG, complete_checkpoints
from decent_train.launcher.preflight import preflight

from .distributed import WorkerError, run_workers
from .jobs import WORLD, decent_train, make_cfg, train_on_cpu

STEPS = 6
SHORT = {"steps": STEPS, "eval_every": 0, "logger": {"log_every": 3, "consensus_every": 0}}


def _run(cfg: Any) -> dict[str, Any]:
    return run_workers(train_on_cpu, WORLD, cfg)[0]


@pytest.fixture(scope="module")
def periodic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real short run with checkpoints at steps 3 and 6."""
    run_dir = tmp_path_factory.mktemp("periodic")
    _run(make_cfg(run_dir, **SHORT, checkpoint={"every": 3, "keep": 5}))
    assert [c.step for c in complete_checkpoints(run_dir)] == [6, 3]
    return run_dir


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source / "checkpoints", target / "checkpoints")
    return target


def _truncate(path: Path) -> str:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return rf"{path.name} is truncated or corrupt \({path.stat().st_size} bytes, manifest: \d+; checksum differs\)"


def _flip(path: Path) -> str:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return rf"{path.name} is truncated or corrupt \({len(data)} bytes, manifest: {len(data)}; checksum differs\)"


def _delete(path: Path) -> str:
    path.unlink()
    return rf"{path.name} cannot be read \(No such file or directory\)"


def _garble_manifest(path: Path) -> str:
    (path.parent / "manifest.json").write_text('{"step": 3, "world_')
    return r"manifest.json cannot be read \([^]]*\)"


DAMAGE: dict[str, tuple[Callable[[Path], str], Callable[[Path], str]]] = {  # (newest checkpoint's, the one before's)
    "truncated and bit-flipped": (_truncate, _flip),
    "a rank's file missing, a manifest cut short": (_delete, _garble_manifest),
}


def _damage_all(run_dir: Path, how: str) -> str:
    """Damage both checkpoints of ``run_dir`` (rank 1's file of step 6, rank 0's of step 3); the line expected."""
    newest, older = DAMAGE[how]
    first = newest(run_dir / "checkpoints" / "step_00000006" / "rank1.pt")
    second = older(run_dir / "checkpoints" / "step_00000003" / "rank0.pt")
    if older is _garble_manifest:  # an unreadable manifest is found before the checkpoints are tried
        return rf"step_00000003 \[{second}\], step_00000006 \[{first}\]"
    return rf"step_00000006 \[{first}\], step_00000003 \[{second}\]"


@pytest.mark.parametrize("how", list(DAMAGE))
def test_every_checkpoint_unreadable_is_refused_before_any_worker(periodic: Path, tmp_path: Path, how: str) -> None:
    """Only the newest damaged: the preflight passes (the workers fall back to the one before, one warning line
    each); every one damaged: one line listing each and why, and the flag that starts afresh."""
    source = _copy(periodic, tmp_path / "source")
    cfg = make_cfg(tmp_path / "new", **SHORT, resume=str(source))
    newest, older = DAMAGE[how]
    first = newest(source / "checkpoints" / "step_00000006" / "rank1.pt")
    preflight(cfg)
    second = older(source / "checkpoints" / "step_00000003" / "rank0.pt")
    with pytest.raises(ValueError) as refused:
        preflight(cfg)
    line = str(refused.value)
    assert "\n" not in line
    # An unreadable manifest is found before the checkpoints' files are checked.
    listed = [rf"step_00000006 \[{first}\]", rf"step_00000003 \[{second}\]"][:: -1 if older is _garble_manifest else 1]
    expected = rf"resume={re.escape(str(source))}: no checkpoint can be read: {', '.join(listed)}; to train from step 0 instead, " \
               rf"add {FRESH_FLAG}"
    assert re.fullmatch(expected, line), line


def test_workers_stop_too_when_every_checkpoint_is_unreadable(periodic: Path, tmp_path: Path) -> None:
    """Files damaged after the preflight (or workers started without it): the workers stop with the same line
    instead of training from step 0; with the flag they train from step 0, as a run without ``resume=`` does."""
    source = _copy(periodic, tmp_path / "source")
    listed = _damage_all(source, "truncated and bit-flipped")
    with pytest.raises(WorkerError, match=rf"ValueError: resume={re.escape(str(source))}: no checkpoint can be read: {listed}; "):
        run_workers(train_on_cpu, WORLD, make_cfg(tmp_path / "stopped", **SHORT, resume=str(source)))
    assert not (tmp_path / "stopped" / "checkpoints").exists()  # nothing trained

    fresh = make_cfg(tmp_path / "fresh", **SHORT, resume=str(source), checkpoint={"fresh_if_unreadable": True})
    preflight(fresh)
    assert _run(fresh)["resumed_from_step"] == 0
    same = torch.load(tmp_path / "fresh" / "model.pt"), torch.load(periodic / "model.pt")  # a run from step 0
    assert all(torch.equal(same[0][k], same[1][k]) for k in same[1])


@pytest.mark.slow
def test_the_launcher_refuses_a_resume_with_nothing_readable_in_one_line(periodic: Path, tmp_path: Path) -> None:
    """The whole command: exit status 2, one line on the console, no worker started, nothing trained (it used to
    warn twice, train from step 0 and exit 0). The same preflight refuses a malformed npz the same way."""
    source = _copy(periodic, tmp_path / "source")
    _damage_all(source, "truncated and bit-flipped")
    run_dir = tmp_path / "run"
    proc = decent_train(f"resume={source}", "launch.nproc_per_node=2", "model=mlp", "model.hidden_sizes=[32]",
                        f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"decent-train: error: resume={source}: no checkpoint can be read: step_00000006 [")
    assert line.endswith(f"; to train from step 0 instead, add {FRESH_FLAG}") and proc.stdout == ""
    assert not (run_dir / "logs").exists() and not (run_dir / "checkpoints").exists()


# -- checkpoint.every=0 ----------------------------------------------------------------------------------------------
def test_every_0_writes_only_the_final_checkpoint(periodic: Path, tmp_path: Path) -> None:
    _run(make_cfg(tmp_path, **SHORT, checkpoint={"every": 0}))
    (final,) = complete_checkpoints(tmp_path)
    assert final.step == STEPS
    oracle = {c.step: c for c in complete_checkpoints(periodic)}[STEPS]  # the same run, checkpointing every 3 steps
    for rank in range(WORLD):
        got, want = (torch.load(c.path / f"rank{rank}.pt", weights_only=True) for c in (final, oracle))
        assert got["step"] == want["step"] == STEPS
        assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])


# -- an unwritable run directory -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_run_dir_under_a_file_is_refused_in_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = decent_train(f"hydra.run.dir={blocker}/run", "launch.nproc_per_node=2", "model=mlp", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == (f"decent-train: error: hydra.run.dir: cannot create or write {blocker}/run (Not a directory: "
                    f"{blocker} is a file); give hydra.run.dir=<a directory you can write to>")


def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory that refuses a new file: a read-only one (as root, which ignores permissions, /sys: read-only)."""
    if os.geteuid() != 0:
        folder = tmp_path / "read_only"
        folder.mkdir(mode=0o555)
        return folder
    try:
        (Path("/sys") / "write_check").write_bytes(b"")
    except OSError:
        return Path("/sys")
    pytest.skip("no read-only directory here: root, and /sys is writable")


def test_an_existing_run_dir_that_refuses_files_is_refused(tmp_path: Path) -> None:
    folder = _unwritable_dir(tmp_path)
    with pytest.raises(ValueError, match=rf"^hydra.run.dir: cannot write {re.escape(str(folder))} \(.+\); give hydra.run.dir=<a "
                                         r"directory you can write to>$"):
        preflight(make_cfg(folder))


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A directory on a 64 KiB tmpfs filled to the last byte (mounting needs root and the capability; else skipped)."""
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with open(mount / "filler", "wb", buffering=0) as filler, contextlib.suppress(OSError):
            while filler.write(bytes(4096)):
                pass
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_run_dir_on_a_full_disk_is_refused(full_disk: Path) -> None:
    with pytest.raises(ValueError, match=rf"^hydra.run.dir: cannot write {re.escape(str(full_disk))} \(No space left "
                                         r"on device\); give hydra.run.dir=<a directory you can write to>$"):
        preflight(make_cfg(full_disk))
    assert [p.name for p in full_disk.iterdir()] == ["filler"]  # the probe is gone


@pytest.mark.slow
@pytest.mark.parametrize("hydra_writes", [False, True], ids=["the job's check", "hydra.output_subdir set"])
def test_the_launcher_refuses_a_run_dir_on_a_full_disk_in_one_line(full_disk: Path, hydra_writes: bool) -> None:
    """The preflight's write fails first; where the command sets ``hydra.output_subdir``, Hydra's own write does,
    before the job runs, naming no file: the line names the directory."""
    subdir = ["hydra.output_subdir=.hydra"] if hydra_writes else []
    proc = decent_train(f"hydra.run.dir={full_disk}/run", "launch.nproc_per_node=2", "model=mlp", *subdir,
                        cwd=full_disk.parent)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    written = "create or write {}/run/.hydra" if hydra_writes else "write {}/run"
    assert line == (f"decent-train: error: hydra.run.dir: cannot {written.format(full_disk)} (No space left on "
                    "device); give hydra.run.dir=<a directory you can write to>")
    assert (full_disk / "run").exists() == hydra_writes  # Hydra's error comes before the job, which drops its own


# -- a malformed npz -------------------------------------------------------------------------------------------------
def _npz(root: Path, train: dict[str, np.ndarray], test: dict[str, np.ndarray] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    np.savez(root / "train.npz", **train)
    np.savez_compressed(root / "test.npz", **(test if test is not None else train))
    return root


RNG = np.random.default_rng(0)
X = RNG.random((100, 1, 8, 8), dtype=np.float32)
Y = RNG.integers(0, 10, 100)
MALFORMED: dict[str, tuple[dict[str, Any], str]] = {  # the arrays of train.npz, and what the line says after the path
    "x 100 samples, y 90": ({"x": X, "y": Y[:90]}, r"x has 100 samples, y has 90 labels; expected as many labels as "),
    "no y": ({"x": X}, r"no array y; expected a directory with train.npz and test.npz"),
    "float labels": ({"x": X, "y": Y.astype(np.float32)}, r"y is float32 of shape \(100,\); expected one integer "),
    "negative label": ({"x": X, "y": Y - 1}, r"y holds the label -1; expected labels 0, 1, \.\.\., classes - 1"),
    "strings as samples": ({"x": X.astype(str), "y": Y}, r"x is <U\d+ of shape \(100, 1, 8, 8\); expected numbers "),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_npz_is_refused_before_any_worker(tmp_path: Path, case: str) -> None:
    arrays, says = MALFORMED[case]
    root = _npz(tmp_path / "data", arrays, {"x": X, "y": Y})
    with pytest.raises(ValueError, match=rf"^{re.escape(str(root))}/train.npz: {says}") as refused:
        preflight(make_cfg(Path("/unused"), dataset={"name": "npz", "root": str(root)}))
    assert "\n" not in str(refused.value)


def test_npz_samples_the_model_cannot_take_are_refused(tmp_path: Path) -> None:
    """Flat samples for the CNN: fine for the MLP, refused for the CNN naming the shape; other shapes in test.npz."""
    root = _npz(tmp_path / "flat", {"x": X.reshape(100, 64), "y": Y})
    preflight(make_cfg(Path("/unused"), dataset={"name": "npz", "root": str(root)}))
    with pytest.raises(ValueError, match=rf"^dataset.root={re.escape(str(root))}: samples of shape \[64\] do not fit model=cnn: "
                                         r"model.name=cnn needs image inputs \(channels, height, width\)"):
        preflight(make_cfg(Path("/unused"), dataset={"name": "npz", "root": str(root)}, model={"name": "cnn"}))
    root = _npz(tmp_path / "two_shapes", {"x": X, "y": Y}, {"x": X[:, :, :4], "y": Y})
    with pytest.raises(ValueError, match=rf"^{re.escape(str(root))}: train.npz's samples have shape \(1, 8, 8\), test.npz's "
                                         r"\(1, 4, 8\); expected one shape$"):
        preflight(make_cfg(Path("/unused"), dataset={"name": "npz", "root": str(root)}))
