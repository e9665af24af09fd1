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

import torch
from omegaconf import DictConfig, OmegaConf

from decent_train.components.checkpoint import CheckpointConfig, complete_checkpoints
from decent_train.components.data import IMAGE_DATASETS, DatasetConfig
from decent_train.components.metrics import LoggerConfig
from decent_train.components.models import ModelConfig
from decent_train.components.optim import OptimConfig, SchedulerConfig
from decent_train.engine.exchange import COMPRESSORS, make_compressor
from decent_train.engine.topology import Topology, build_topology
from decent_train.launcher.launch import LaunchConfig

ALGORITHMS = ("decentralized", "allreduce")
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # autocast dtypes
IMAGE_MODELS = ("cnn", "resnet18", "resnet50")

# What a run directory holds (the launcher, the worker and the plot command agree on these names).
RESOLVED_CONFIG = "resolved_config.yaml"
METRICS_FILE = "metrics.jsonl"
RESULT_FILE = "result.json"
MODEL_FILE = "model.pt"
DIVERGED_FILE = "diverged.txt"  # why training stopped on a NaN/inf loss: restarted workers do not train again


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


COPY_DTYPES = {"param": None, "bf16": torch.bfloat16}


@dataclass
class CompressionConfig:
    """``conf/compression/*.yaml``: what gossip sends (engine/exchange.py). ``none`` sends the parameters; ``bf16``
    and ``int8`` send compressed differences to public copies (CHOCO-SGD), which keeps the workers' mean exact."""

    name: str = "none"  # none | bf16 | int8
    consensus_step: float = 1.0  # the step toward the neighbours' public copies (CHOCO's gamma), in (0, 1]
    int8_block: int = 256  # int8: elements per float32 scale
    copy_dtype: str = "param"  # a pair's public copies: param (the parameters' dtype) | bf16 (half the memory)

    def check(self) -> None:
        if self.name not in ("none", *COMPRESSORS):
            raise ValueError(f"compression={self.name!r} is not a compression; valid: none, {', '.join(COMPRESSORS)}")
        if not 0.0 < self.consensus_step <= 1.0:
            raise ValueError(f"compression.consensus_step={self.consensus_step} must be in (0, 1]")
        if self.int8_block < 4 or self.int8_block % 4:
            raise ValueError(f"compression.int8_block={self.int8_block} must be a positive multiple of 4")
        if self.copy_dtype not in COPY_DTYPES:
            raise ValueError(f"compression.copy_dtype={self.copy_dtype!r}; valid: {', '.join(COPY_DTYPES)}")

    def engine_kwargs(self) -> dict[str, Any]:
        """The engine's ``compression`` and ``consensus_step`` arguments."""
        if self.name == "none":
            return {}
        return {
            "compression": make_compressor(self.name, self.int8_block),
            "consensus_step": self.consensus_step,
            "public_copy_dtype": COPY_DTYPES[self.copy_dtype],
        }


@dataclass
class PhaseConfig:
    """One entry of ``phases``: ``steps`` optimizer steps of ``algorithm`` (decentralized: gossip over ``topology``,
    null meaning ``topology.name``; allreduce: the engine's gradient all-reduce). ``steps: null`` (last phase only):
    until the end."""

    algorithm: str = "decentralized"
    topology: Optional[str] = None
    steps: Optional[int] = None

    def mode(self, default_topology: str) -> str:
        """What the engine's ``switch_to`` takes: a topology name or "allreduce"."""
        return "allreduce" if self.algorithm == "allreduce" else self.topology or default_topology


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
    global_batch_size: Optional[int] = None  # samples per optimizer step over all workers; sets batch_size to it
    # divided by (workers x accum_steps), so a recipe keeps its batch on any number of workers
    accum_steps: int = 1  # micro-batches per optimizer step
    grad_clip_norm: float = 0.0  # 0: no clipping
    label_smoothing: float = 0.0
    precision: str = "fp32"  # fp32 | bf16 | fp16: autocast; fp16 also scales the loss (a GradScaler)
    channels_last: bool = False  # CNNs: NHWC parameters and inputs (faster convolutions on tensor cores)
    compile: bool = False  # torch.compile the model (in place)
    eval_every: int = 0  # optimizer steps between evaluations of the averaged model; 0: only at the end
    eval_batch_size: int = 512
    bucket_size_mb: float = 25.0  # the engine's (and DDP's) bucket size
    message_size_mb: float = 0.0  # gossip pairs send a bucket in messages of this size; 0: one message (see README)
    comm_timeout_s: float = 300.0  # a gossip exchange (or the engine's gradient all-reduce) that takes longer fails
    # Any other collective (checkpoints, evaluation, statistics; first-step compilation skew) may take this long:
    pg_timeout_s: float = 1800.0  # the process group's timeout
    phases: list[PhaseConfig] = field(default_factory=list)  # a schedule of algorithms; empty: `algorithm` throughout
    global_avg_every: int = 0  # gossip: replace every worker's model by the global average every k steps; 0: never
    final_average: bool = True  # the final model (saved) is the workers' average; false: each keeps its own
    resume: Optional[str] = None  # a run directory to continue from (its newest complete checkpoint)
    dry_run: bool = False  # validate, print the topology and the worker command, train nothing
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunInfo = field(default_factory=RunInfo)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={self.algorithm!r} is not an algorithm; valid: {', '.join(ALGORITHMS)}")
        for key in ("batch_size", "accum_steps", "eval_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not a precision; valid: {', '.join(PRECISIONS)}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing={self.label_smoothing} must be in [0, 1)")
        if self.global_batch_size is not None and self.launch.nproc_per_node is not None:
            for world_size in self.launch.world_sizes:
                self.batch_size_per_worker(world_size)
        if self.steps < 0 or (self.steps == 0 and self.epochs <= 0):
            raise ValueError(f"steps={self.steps}, epochs={self.epochs}: set steps >= 1, or steps=0 and epochs > 0")
        if (self.eval_every < 0 or self.grad_clip_norm < 0 or self.message_size_mb < 0 or self.bucket_size_mb <= 0
                or self.comm_timeout_s <= 0 or self.pg_timeout_s <= 0):
            raise ValueError(
                f"eval_every={self.eval_every}, grad_clip_norm={self.grad_clip_norm} and message_size_mb="
                f"{self.message_size_mb} must be >= 0, "
                f"bucket_size_mb={self.bucket_size_mb}, comm_timeout_s={self.comm_timeout_s} and pg_timeout_s="
                f"{self.pg_timeout_s} > 0"
            )
        if self.global_avg_every < 0:
            raise ValueError(f"global_avg_every={self.global_avg_every} must be >= 0 (0: never)")
        self.compression.check()
        if self.compression.name != "none" and self.algorithm != "decentralized":
            raise ValueError(
                f"compression={self.compression.name} compresses gossip; algorithm={self.algorithm} (torch DDP) sends "
                "full-precision gradients: use algorithm=decentralized or compression=none"
            )
        self._check_model_fits_data()
        if self.launch.nproc_per_node is not None:
            self.dataset.check_partition(self.launch.world_sizes)
        self._check_phases()
        if self.algorithm == "decentralized" and self.launch.nproc_per_node is not None:
            self.topology.import_module()
            for name in {self.topology.name} | {p.mode(self.topology.name) for p in self.phases} - {"allreduce"}:
                for world_size in self.launch.world_sizes:  # an elastic job's every size
                    try:
                        self.build_topology(name, world_size)
                    except ValueError as error:
                        raise ValueError(f"topology={name} with {world_size} workers: {error}") from None
        if self.resume is not None:
            self._check_resume()

    def _check_phases(self) -> None:
        if not self.phases:
            return
        if self.algorithm != "decentralized":
            raise ValueError(
                "phases run in the engine, which switches between gossip and its own gradient all-reduce; leave "
                f"algorithm=decentralized (not {self.algorithm!r}) and give a phase algorithm: allreduce"
            )
        for i, phase in enumerate(self.phases):
            where = f"phases[{i}]"
            if phase.algorithm not in ALGORITHMS:
                raise ValueError(f"{where}.algorithm={phase.algorithm!r}; valid: {', '.join(ALGORITHMS)}")
            if phase.algorithm == "allreduce" and phase.topology is not None:
                raise ValueError(f"{where}: algorithm allreduce takes no topology (got topology={phase.topology!r})")
            last = i == len(self.phases) - 1
            if phase.steps is None and not last:
                raise ValueError(f"{where}.steps is null, but only the last phase may run until the end")
            if phase.steps is not None and phase.steps < 1:
                raise ValueError(f"{where}.steps={phase.steps} must be >= 1 (or null in the last phase: until the end)")
        if self.steps:
            self.check_phases_fit(self.steps, f"steps={self.steps}")

    def check_phases_fit(self, total_steps: int, run: str) -> None:
        """The last phase must start before the run ends (with ``epochs`` the step count is known only in the
        worker, which calls this again); ``run`` says how the run's length was given."""
        before_last = self.phase_starts()[-1][0]
        if self.phases and before_last >= total_steps:
            raise ValueError(
                f"phases before the last take {before_last} steps, but the run has {run}: the last phase would "
                "never run"
            )

    def phase_starts(self) -> list[tuple[int, str]]:
        """(steps taken before it, engine mode) of each phase: [(0, topology or "allreduce"), ...]."""
        if not self.phases:
            return [(0, self.topology.name if self.algorithm == "decentralized" else "allreduce")]
        starts, taken = [], 0
        for phase in self.phases:
            starts.append((taken, phase.mode(self.topology.name)))
            taken += phase.steps or 0
        return starts

    def _check_resume(self) -> None:
        checkpoints = complete_checkpoints(Path(self.resume))
        if not checkpoints:
            raise ValueError(f"resume={self.resume} holds no complete checkpoint (checkpoints/step_*/manifest.json)")
        if self.launch.nproc_per_node is not None:
            mismatch = checkpoints[0].describe_mismatch(
                self.launch.world_size, self.schedule(), self.model.architecture()
            )
            if mismatch:
                raise ValueError(f"resume={self.resume}: {mismatch}")

    def _check_model_fits_data(self) -> None:
        model, dataset = self.model.name, self.dataset.name
        if (model == "gpt2") != self.dataset.is_tokens:
            wanted = "dataset=tokens" if model == "gpt2" else "a non-token dataset; a language model: model=gpt2"
            raise ValueError(f"model={model} cannot train on dataset={dataset}: it needs {wanted}")
        images = dataset in IMAGE_DATASETS or (dataset == "synthetic" and len(self.dataset.input_shape) == 3)
        if model in IMAGE_MODELS and not images:
            raise ValueError(
                f"model={model} needs images (channels, height, width), but dataset={dataset} has "
                f"dataset.input_shape={list(self.dataset.input_shape)}"
            )

    def batch_size_per_worker(self, world_size: int) -> int:
        """``batch_size``, or the share of ``global_batch_size`` of each of ``world_size`` workers' micro-batches."""
        if self.global_batch_size is None:
            return self.batch_size
        per_step = world_size * self.accum_steps
        if self.global_batch_size < per_step or self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not a multiple of workers x accum_steps = "
                f"{world_size} x {self.accum_steps}"
            )
        return self.global_batch_size // per_step

    def schedule(self, world_size: int | None = None) -> str:
        """What a checkpoint must have been trained with: the topology laid out over ``world_size`` workers' nodes
        (default: the launch's), or all-reduce, or the phases."""
        if self.algorithm != "decentralized":
            return "allreduce"
        if not self.phases:
            return self.build_topology(None, world_size).label
        labels = [
            ("allreduce" if mode == "allreduce" else self.build_topology(mode, world_size).label, start)
            for start, mode in self.phase_starts()
        ]
        return "phases: " + ", ".join(f"{label} from step {start}" for label, start in labels)

    def build_topology(self, name: str | None = None, world_size: int | None = None) -> Topology:
        """The gossip schedule for ``world_size`` workers (default: the launch's; no process group needed); default
        topology: ``topology.name``."""
        local = self.topology.local_world_size or self.launch.nproc_per_node
        return build_topology(name or self.topology.name, world_size or self.launch.world_size, local)


def check_config(cfg: DictConfig | dict[str, Any]) -> TrainConfig:
    """Merge into the schema and check; raises ``ValueError`` (or an OmegaConf error) naming the bad value."""
    merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def load_config(path: Path) -> TrainConfig:
    """A worker's view of the job: the resolved YAML the launcher wrote, checked again."""
    return check_config(OmegaConf.load(path))
