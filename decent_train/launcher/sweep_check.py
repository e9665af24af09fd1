"""A sweep's jobs, all checked before its first one trains.

Hydra's own sweeper and launcher run the jobs one after another in this process, each checked as it starts: a value
that job k refuses (``-m steps=20,-1``, ``-m topology=ring,one-peer-exp launch.nproc_per_node=3``) would end the
sweep after k jobs had trained, hours into it. Job 0 composes every other job's config as the sweeper does (the
sweep's overrides from its ``multirun.yaml``, its ``hydra.sweeper.params``) and checks each as the job itself would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from hydra import compose
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf


class SweepJobRefused(Exception):
    """Job ``num`` of the sweep (its ``overrides``) is refused for ``cause``; no job has trained."""

    def __init__(self, num: int, overrides: Sequence[str], cause: BaseException) -> None:
        super().__init__(f"job {num} of the sweep ({' '.join(overrides)})")
        self.num, self.overrides, self.cause = num, list(overrides), cause


def check_other_jobs(check: Callable[[DictConfig, int], object]) -> int:
    """In job 0 of a sweep run by Hydra's own sweeper: ``check(config, num)`` each other job's composed config,
    raising :class:`SweepJobRefused` for the first that ``check`` refuses. Returns the number of jobs checked."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.job.num != 0:
        return 0
    sweep = OmegaConf.load(Path(hydra_cfg.sweep.dir) / "multirun.yaml")  # Hydra's sweeper wrote it before any job
    params = [f"{key}={value}" for key, value in (hydra_cfg.sweeper.get("params") or {}).items()]
    overrides = OverridesParser.create().parse_overrides([*params, *sweep.hydra.overrides.task])
    jobs = [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]
    for num, job in enumerate(jobs[1:], start=1):
        try:
            check(compose(hydra_cfg.job.config_name, overrides=list(job)), num)
        except Exception as error:  # noqa: BLE001 - the caller sorts it, as it sorts its own job's
            raise SweepJobRefused(num, job, error) from error
    return len(jobs) - 1


def refuse_run_dir(hydra_overrides: Sequence[str]) -> None:
    """In a sweep, ``hydra.run.dir`` (a single run's directory) names nothing: Hydra ignores it without a word and the
    jobs go under ``hydra.sweep.dir``, where the user would not look for them."""
    for override in hydra_overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key == "hydra.run.dir":
            raise ValueError(f"hydra.run.dir={value} with -m: a sweep's jobs go into hydra.sweep.dir/<job number>; "
                             f"give hydra.sweep.dir={value}")
