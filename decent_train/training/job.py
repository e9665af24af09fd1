"""What the training loop and its components work with, built once by ``train``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from decent_train.algorithms.base import Algorithm
from decent_train.components.data import Datasets
from decent_train.config import TrainConfig
from decent_train.training.forward import Precision


@dataclasses.dataclass
class Job:
    """One run of training on this worker."""

    cfg: TrainConfig
    algo: Algorithm
    data: Datasets
    batch_size: int  # per worker and micro-batch
    precision: Precision
    device: torch.device
    total_steps: int
    steps_per_epoch: int
    run_dir: Path
    start_step: int  # steps already taken (a resumed run)
    data_start: int  # micro-batches of this worker's stream already taken at ``data_step`` (re-sharded when the world
    # size changed)
    run_world: int  # the world size the run started with (its epochs are counted in it)
    data_step: int = -1  # the step ``data_start`` was counted at: ``start_step``, or a live membership change's
    fence: Callable[[], None] = lambda: None  # before a collective that follows local work (live membership's)

    def __post_init__(self) -> None:
        if self.data_step < 0:
            self.data_step = self.start_step
