"""Where a job's files go: Hydra's record of the command, the run directory that several nodes share, a refused
job's directory removed again, and files written whole for readers on other nodes."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from decent_train.config import LaunchConfig, node_range


def drop_refused_run_dir(run_dir: Path) -> None:
    """A refused job trained nothing, and the directory Hydra made for it is empty (or holds only Hydra's copy of the
    command, where ``hydra.output_subdir`` was set): gone, so that mistakes leave no empty runs among the real ones
    (``decent-train-plot`` of a sweep, say). A directory that holds anything else is left alone. So is a sweep's
    directory refused in its first job (all are checked there: sweep_check.py), and the empty folders above either
    that Hydra named from the clock (``outputs/DATE/``), not a folder the user named."""
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if run_dir.is_dir() and {entry.name for entry in run_dir.iterdir()} <= {HYDRA_SUBDIR}:
        shutil.rmtree(run_dir / HYDRA_SUBDIR, ignore_errors=True)
        _remove_empty(run_dir, OmegaConf.to_container(hydra_cfg.sweep if multirun else hydra_cfg.run,
                                                      resolve=False)["subdir" if multirun else "dir"])
    if multirun and hydra_cfg.job.num == 0:
        sweep_dir = Path(hydra_cfg.sweep.dir)
        if sweep_dir.is_dir() and {entry.name for entry in sweep_dir.iterdir()} <= {"multirun.yaml"}:
            (sweep_dir / "multirun.yaml").unlink(missing_ok=True)
            _remove_empty(sweep_dir, OmegaConf.to_container(hydra_cfg.sweep, resolve=False)["dir"])


def _remove_empty(directory: Path, written: str) -> None:
    """Remove ``directory`` if empty, then its empty parents that ``written`` (the setting, unresolved) names from the
    clock (``outputs/${now:%Y-%m-%d}/...``), up to the working directory."""
    clocked = len([part for part in Path(written).parts if "${now:" in part])
    directory = directory.resolve()
    for folder in [directory, *directory.parents][:1 + max(0, clocked - 1)]:
        if folder == Path.cwd() or not folder.is_relative_to(Path.cwd()):
            return
        try:
            folder.rmdir()
        except OSError:
            return


HYDRA_SUBDIR = ".hydra"


def hydra_record(cfg: DictConfig) -> dict[str, str]:
    """What Hydra writes to ``.hydra/`` (the composed config, its own config, the overrides), for the job to write once
    its checks pass: conf/train.yaml sets ``hydra.output_subdir: null``, as Hydra would write them before the job runs,
    and a refused relaunch into a run's directory would replace the record of the command that trained it. Empty
    when the command set ``hydra.output_subdir`` itself: Hydra wrote there (or, null, nothing is wanted)."""
    hydra_cfg = HydraConfig.get()
    if any(o.split("=", 1)[0].lstrip("+~") == "hydra.output_subdir" for o in hydra_cfg.overrides.hydra):
        return {}
    own = OmegaConf.create({"hydra": OmegaConf.to_container(hydra_cfg)})
    own.hydra.output_subdir = HYDRA_SUBDIR  # where this record is
    return {"config.yaml": OmegaConf.to_yaml(cfg), "hydra.yaml": OmegaConf.to_yaml(own),
            "overrides.yaml": OmegaConf.to_yaml(hydra_cfg.overrides.task)}


def write_hydra_record(run_dir: Path, record: dict[str, str]) -> None:
    if record:
        (run_dir / HYDRA_SUBDIR).mkdir(exist_ok=True)
    for name, text in record.items():
        (run_dir / HYDRA_SUBDIR / name).write_text(text, encoding="utf-8")


def check_one_run_dir(launch: LaunchConfig, written: str) -> None:
    """Several nodes, each launched by its own ``decent-train`` (torchrun's agents), must share one run directory:
    each rank writes its checkpoint file there and rank 0 the manifest and results. ``hydra.run.dir`` as
    ``written`` (before Hydra resolved it) from the clock (the default, ``outputs/${now:...}``) names another one on
    every node: the checkpoints split between them (none can be resumed) and the other nodes' launchers find no
    result. Refused in one line."""
    nodes = node_range(launch.nnodes)[1]
    if nodes > 1 and "${now:" in written:
        raise ValueError(f"launch.nnodes={launch.nnodes} with hydra.run.dir={written}: each node's launch would name "
                         "its own run directory from its clock, and the checkpoints and results would be split "
                         "between them; set hydra.run.dir=/shared/PATH, the same on every node")


def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """``write`` a file of this process's own beside ``path``, then rename it over ``path``: several nodes' launches
    share the run directory, and one reading ``path`` never sees another's half-written."""
    partial = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.partial")
    write(partial)
    os.replace(partial, path)
