"""The run's config: one typed schema that composes every component's config.

Hydra validates overrides against it while composing (a typo or a wrong type fails at once); ``__post_init__``
checks values and their combinations (``check_config``), in the launcher before any worker starts and again in each
worker when it loads ``resolved_config.yaml``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from decent_train.components.data import DatasetConfig
from decent_train.components.metrics import LoggerConfig
from decent_train.components.models import ModelConfig
from decent_train.components.optim import OptimConfig, SchedulerConfig
from decent_train.engine.topology import Topology, build_topology
from decent_train.launcher.launch import LaunchConfig

ALGORITHMS = ("decentralized", "allreduce")

# What a run directory holds (the launcher, the worker and the plot command agree on these names).
RESOLVED_CONFIG = "resolved_config.yaml"
METRICS_FILE = "metrics.jsonl"
RESULT_FILE = "result.json"
MODEL_FILE = "model.pt"


@dataclass
class TopologyConfig:
    """``conf/topology/*.yaml``: the gossip schedule (used by ``algorithm=decentralized``)."""

    name: str = "ring"
    local_world_size: Optional[int] = None  # workers per node as the topology sees them; null: launch.nproc_per_node
    module: Optional[str] = None  # a module to import first: it registers custom topologies (@TopologyReg.register)

    def import_module(self) -> None:
        if self.module:
            try:
                importlib.import_module(self.module)
            except ImportError as error:
                raise ValueError(f"topology.module={self.module!r} cannot be imported: {error}") from None


@dataclass
class RunInfo:
    """Facts about this job that only Hydra knows, written by the launcher for the workers (which never run Hydra)."""

    output_dir: str = ""
    choices: dict[str, str] = field(default_factory=dict)  # the option picked in each config group
    overrides: list[str] = field(default_factory=list)  # the command-line overrides of this job
    job_num: Optional[int] = None  # position in a multirun
    sweep_dir: Optional[str] = None


@dataclass
class TrainConfig:
    """``conf/train.yaml``: the whole job."""

    algorithm: str = "decentralized"  # decentralized (the engine: gossip) | allreduce (torch DDP)
    seed: int = 0
    steps: int = 0  # optimizer steps; 0: run `epochs` epochs
    epochs: float = 1.0
    batch_size: int = 32  # per worker and micro-batch
    accum_steps: int = 1  # micro-batches per optimizer step
    grad_clip_norm: float = 0.0  # 0: no clipping
    eval_every: int = 0  # optimizer steps between evaluations of the averaged model; 0: only at the end
    eval_batch_size: int = 512
    bucket_size_mb: float = 25.0  # the engine's (and DDP's) bucket size
    dry_run: bool = False  # validate, print the topology and the worker command, train nothing
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    run: RunInfo = field(default_factory=RunInfo)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={self.algorithm!r} is not an algorithm; valid: {', '.join(ALGORITHMS)}")
        for key in ("batch_size", "accum_steps", "eval_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if self.steps < 0 or (self.steps == 0 and self.epochs <= 0):
            raise ValueError(f"steps={self.steps}, epochs={self.epochs}: set steps >= 1, or steps=0 and epochs > 0")
        if self.eval_every < 0 or self.grad_clip_norm < 0 or self.bucket_size_mb <= 0:
            raise ValueError(
                f"eval_every={self.eval_every} and grad_clip_norm={self.grad_clip_norm} must be >= 0, "
                f"bucket_size_mb={self.bucket_size_mb} > 0"
            )
        if self.model.name == "cnn" and self.dataset.name == "synthetic" and len(self.dataset.input_shape) != 3:
            raise ValueError(
                f"model=cnn needs images (channels, height, width), but dataset.input_shape={list(self.dataset.input_shape)}"
            )
        if self.algorithm == "decentralized" and self.launch.nproc_per_node is not None:
            self.topology.import_module()
            try:
                self.build_topology()
            except ValueError as error:
                raise ValueError(f"topology={self.topology.name} with {self.launch.world_size} workers: {error}") from None

    def build_topology(self) -> Topology:
        """The gossip schedule for the launch's workers (no process group needed)."""
        local = self.topology.local_world_size or self.launch.nproc_per_node
        return build_topology(self.topology.name, self.launch.world_size, local)


def check_config(cfg: DictConfig | dict[str, Any]) -> TrainConfig:
    """Merge into the schema and check; raises ``ValueError`` (or an OmegaConf error) naming the bad value."""
    merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def load_config(path: Path) -> TrainConfig:
    """A worker's view of the job: the resolved YAML the launcher wrote, checked again."""
    return check_config(OmegaConf.load(path))
