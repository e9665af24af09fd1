"""The run's config: one typed schema that composes every component's config.

Defaults live here and in the components' ``*Config`` dataclasses, nowhere else: ``TrainConfig()`` is the default
job. ``conf/train.yaml`` only picks one option per group; an option file (``conf/<group>/<option>.yaml``) sets its
``name`` and the values in which that option differs from the dataclass (``optim=sgd``'s ``lr``), never a default;
recipes override. ``tests/test_config.py`` holds the YAML to this.

Hydra validates overrides against the schema while composing (a typo or a wrong type fails at once);
``__post_init__`` checks values and their combinations (``check_config``), in the launcher and again in each worker
when it loads ``resolved_config.yaml``. Checks that read files, import user modules or build topologies are the
launcher's preflight (``decent_train.launcher.preflight``), run once before any worker starts.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from decent_train.components.checkpoint import CheckpointConfig
from decent_train.components.checks import (
    as_override,
    as_sweep_job,
    engine_check,
    refuse_added_keys,
    refusing_ignored,
    refusing_unread,
    schema_default,
)
from decent_train.components.compression import COPY_DTYPES, CompressionConfig  # noqa: F401  (re-exported)
from decent_train.components.data import IMAGE_DATASETS, DatasetConfig
from decent_train.components.launch import (  # noqa: F401  (the launch schema's names, re-exported)
    DEVICES, FAULT_TOLERANCE, LIVE_ROLES, TORCH_KEEP_ALIVE_S, TORCH_LAST_CALL_S, FaultToleranceConfig, LaunchConfig,
    SlurmConfig, host_port, node_range,
)
from decent_train.components.metrics import LoggerConfig
from decent_train.components.models import ModelConfig
from decent_train.components.optim import OptimConfig, SchedulerConfig
from decent_train.components.timeouts import check_timeouts
from decent_train.engine import ALLREDUCE, reconfigure
from decent_train.engine.ddp import check_engine_arguments
from decent_train.engine.node_layout import layout_over_nodes
from decent_train.engine.topology import ShardedTopology, Topology, build_topology

PHASE_ALGORITHMS = ("decentralized", ALLREDUCE)  # a phase's engine mode: gossip over a topology, or all-reduce
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # autocast dtypes
IMAGE_MODELS = ("cnn", "resnet18", "resnet50")
# parallel.mixed_precision -> FSDP2's (param_dtype, reduce_dtype): what the replica's all-gathers and reduce-scatters
# carry (None: the parameters' own dtype). The shards the optimizer steps, and so the gossip, keep their own dtype.
MIXED_PRECISIONS: dict[str, tuple[Optional[torch.dtype], Optional[torch.dtype]]] = {
    "none": (None, None),
    "bf16": (torch.bfloat16, torch.float32),
    "bf16-reduce": (torch.bfloat16, torch.bfloat16),
}

# What a run directory holds (the launcher, the worker and the plot command agree on these names).
RESOLVED_CONFIG = "resolved_config.yaml"
METRICS_FILE = "metrics.jsonl"
RESULT_FILE = "result.json"
MODEL_FILE = "model.pt"
DIVERGED_FILE = "diverged.txt"  # why training stopped on a NaN/inf loss: restarted workers do not train again


@dataclass
class AlgorithmConfig:
    """``conf/algorithm/*.yaml``: how the workers train together. An algorithm with options of its own subclasses
    this (``sync_every: int = 10``) and names the subclass in its traits (``@register(name, traits=...)``);
    ``check_config`` then merges the job into that subclass, so its options are typed and checked like every other
    group's."""

    name: str = "decentralized"  # decentralized (the engine: gossip) | allreduce (torch DDP)

    def check_run(self, steps: int) -> None:
        """Refuse options that a run of ``steps`` optimizer steps in all (a resumed run's too) leaves nothing to do
        (``LocalSGDConfig``'s: no outer step). Not called for a run of ``epochs``: the worker counts its steps."""


@dataclass(frozen=True)
class AlgorithmTraits:
    """What the config's checks ask of an algorithm. The config sits below ``decent_train.algorithms`` and cannot
    import it, so each algorithm states these here: the built-in ones in :data:`ALGORITHM_TRAITS`, others in their
    own module (``@register(name, traits=...)`` of ``decent_train.algorithms.base``)."""

    schema: type[AlgorithmConfig] = AlgorithmConfig  # its options
    gossips: bool = False  # exchanges with its topology's neighbours: builds the topology; compression applies
    takes_phases: bool = False  # runs in the engine, which switches between gossip and all-reduce (``phases``)
    # Each worker steps its own optimizer between outer steps (diloco, localsgd): fp16's per-worker skipped steps would
    # put the workers' outer steps at different steps (a hang), and the engine's global_avg_every does not apply.
    local_steps: bool = False
    shards: bool = False  # runs over FSDP2-sharded replicas (``parallel.shard`` > 1): algorithms/sharded.py has it
    live: bool = False  # goes on across a live membership change (``fault_tolerance=live``): docs/fault-tolerance.md


ALGORITHM_TRAITS: dict[str, AlgorithmTraits] = {
    "decentralized": AlgorithmTraits(gossips=True, takes_phases=True, shards=True, live=True),
    ALLREDUCE: AlgorithmTraits(),
}


def register_algorithm(name: str, traits: AlgorithmTraits) -> None:
    """Make ``algorithm=name`` valid (its module calls this when imported; ``conf/algorithm/<name>.yaml`` picks it)."""
    if not issubclass(traits.schema, AlgorithmConfig):
        raise TypeError(f"algorithm {name!r}: its schema {traits.schema.__name__} must subclass AlgorithmConfig")
    ALGORITHM_TRAITS[name] = traits


def algorithm_traits(name: str) -> AlgorithmTraits:
    """The traits of ``algorithm=name``; a ``ValueError`` naming the valid ones if there is no such algorithm."""
    if name not in ALGORITHM_TRAITS:
        raise ValueError(f"algorithm={name!r} is not an algorithm; valid: {', '.join(ALGORITHM_TRAITS)}")
    return ALGORITHM_TRAITS[name]


def _having(trait: str) -> str:
    """The algorithms with ``trait`` (an :class:`AlgorithmTraits` flag), for a refusal's list of valid ones."""
    return ", ".join(name for name, traits in ALGORITHM_TRAITS.items() if getattr(traits, trait))


@dataclass
class TopologyConfig:
    """``conf/topology/*.yaml``: the gossip schedule (used by algorithms that gossip)."""

    name: str = "ring"
    local_world_size: Optional[int] = None  # workers per node as the topology sees them; null: launch.nproc_per_node
    module: Optional[str] = None  # a module to import first: it registers custom topologies (@TopologyReg.register)

    def import_module(self) -> None:
        """Import ``module`` (once; later calls are free), so that its topologies are registered."""
        if self.module:
            try:
                importlib.import_module(self.module)
            except ImportError as error:
                raise ValueError(f"topology.module={self.module!r} cannot be imported: {error}") from None


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
        return ALLREDUCE if self.algorithm == ALLREDUCE else self.topology or default_topology


@dataclass
class RunInfo:
    """Facts about this job that only Hydra knows, written by the launcher for the workers (which never run Hydra)."""

    output_dir: str = ""
    choices: dict[str, str] = field(default_factory=dict)  # the option picked in each config group
    overrides: list[str] = field(default_factory=list)  # the command-line overrides of this job
    job_num: Optional[int] = None  # position in a multirun
    sweep_dir: Optional[str] = None


@dataclass
class ParallelConfig:
    """``parallel.*``: how the model is laid out over the workers. ``shard`` = K > 1: every K consecutive workers
    (of one node) hold one replica of the model, sharded by FSDP2 (``fully_shard`` per block), and the topology runs
    over the replicas: a rank exchanges its shard with the same shard of the replicas its replica mixes with
    (``algorithms/sharded.py``). 1: every worker holds the whole model (the engine)."""

    shard: int = 1  # workers that hold one replica of the model, sharded by FSDP2; 1: each holds all of it
    # shard!=1: FSDP2's mixed precision: none | bf16 | bf16-reduce | auto (bf16 with precision=bf16, else none). bf16:
    # bf16 all-gathers of the parameters, fp32 reduce-scatters of the gradients (half the all-gather bytes);
    # bf16-reduce: bf16 reduce-scatters too. Autocast alone would all-gather fp32 parameters and cast them after.
    mixed_precision: str = "auto"

    def __post_init__(self) -> None:
        if self.shard < 1:
            raise ValueError(f"parallel.shard={self.shard} must be >= 1 (workers per model replica)")
        if self.mixed_precision != "auto" and self.mixed_precision not in MIXED_PRECISIONS:
            raise ValueError(f"parallel.mixed_precision={self.mixed_precision!r} is not a mixed precision; valid: "
                             f"auto, {', '.join(MIXED_PRECISIONS)}")
        if self.shard == 1 and self.mixed_precision != "auto":
            raise ValueError(f"parallel.mixed_precision={self.mixed_precision} sets FSDP2's policy, and "
                             "parallel.shard=1 runs no FSDP2: set parallel.shard > 1, or leave it auto")

    def fsdp_dtypes(self, precision: str) -> tuple[Optional[torch.dtype], Optional[torch.dtype]]:
        """FSDP2's (param_dtype, reduce_dtype) for this run's ``precision`` (``auto`` resolved)."""
        name = self.mixed_precision
        if name == "auto":
            name = "bf16" if precision == "bf16" and self.shard > 1 else "none"
        return MIXED_PRECISIONS[name]


# TrainConfig's keys that are arguments of the engine too (its name for them): one check, the engine's.
_ENGINE_ARGUMENTS = {
    "grad_clip_norm": "grad_clip_norm",
    "message_size_mb": "message_size_in_mb",
    "comm_timeout_s": "timeout",
    "global_avg_every": "global_avg_every",
}


@dataclass
class TrainConfig:
    """The whole job; its defaults are the default job (``decent-train`` with no overrides)."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    seed: int = 0  # the initial model, the batch order and dropout (the data's split: dataset.split_seed)
    steps: int = 0  # optimizer steps; 0: run `epochs` epochs
    epochs: float = 40.0  # steps=0: epochs to train (a fraction of one too)
    batch_size: int = 32  # per worker and micro-batch
    global_batch_size: Optional[int] = None  # samples per optimizer step over all workers; sets batch_size to it
    # divided by (workers x accum_steps), so a recipe keeps its batch on any number of workers
    accum_steps: int = 1  # micro-batches per optimizer step
    grad_clip_norm: float = 0.0  # the gradients' norm is clipped to this; 0: no clipping
    label_smoothing: float = 0.0  # the cross-entropy's label smoothing, in [0, 1)
    precision: str = "fp32"  # fp32 | bf16 | fp16: autocast; fp16 also scales the loss (a GradScaler)
    # model=cnn|resnet18|resnet50: NHWC parameters and inputs (faster convolutions on tensor cores)
    channels_last: bool = False
    compile: bool = False  # torch.compile the model (in place)
    eval_every: int = 100  # optimizer steps between evaluations of the averaged model; 0: only at the end
    eval_batch_size: int = 512  # samples per evaluation batch
    # algorithm=decentralized|allreduce, parallel.shard=1: the engine's (and DDP's) bucket size
    bucket_size_mb: float = 25.0
    # algorithm=decentralized|diloco|localsgd: gossip pairs send a bucket in messages of this size; 0: one message
    message_size_mb: float = 0.0
    # a gossip exchange (or the engine's gradient all-reduce) that takes longer fails; at most pg_timeout_s on gloo
    # unless fault_tolerance=live (gloo ends an all-reduce at the group's timeout: docs/fault-tolerance.md)
    comm_timeout_s: float = 300.0
    # the process group's timeout: any other collective (checkpoints, evaluation, statistics; first-step compilation
    # skew) may take this long
    pg_timeout_s: float = 1800.0
    # algorithm=decentralized: a schedule of algorithms; empty: `algorithm` throughout
    phases: list[PhaseConfig] = field(default_factory=list)
    # algorithm=decentralized: replace every worker's model by the global average every k steps; 0: never
    global_avg_every: int = 0
    final_average: bool = True  # the final model (saved) is the workers' average; false: each keeps its own
    resume: Optional[str] = None  # a run directory to continue from (its newest complete checkpoint)
    dry_run: bool = False  # validate, print the topology and the worker command, train nothing
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)  # algorithm=decentralized|diloco|localsgd: gossip
    # algorithm=decentralized|diloco|localsgd: what gossip sends
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunInfo = field(default_factory=RunInfo)

    def __post_init__(self) -> None:
        """Values and their combinations only: nothing here reads a file, imports a module or builds a topology."""
        traits = algorithm_traits(self.algorithm.name)
        self._check_sizes()
        for key, argument in _ENGINE_ARGUMENTS.items():
            value = getattr(self, key)
            engine_check(key, value, lambda: check_engine_arguments(**{argument: value}))
        for key, bad, valid in (("eval_every", self.eval_every < 0, ">= 0 (0: never)"),
                                ("bucket_size_mb", self.bucket_size_mb <= 0, "> 0"),
                                ("pg_timeout_s", self.pg_timeout_s <= 0, "> 0")):
            if bad:
                raise ValueError(f"{key}={getattr(self, key)} must be {valid}")
        check_timeouts(self.comm_timeout_s, self.pg_timeout_s, traits.gossips and self.launch.device != "cuda",
                       self.fault_tolerance.live, self.fault_tolerance.detect_s)
        if self.compression.name != "none" and not traits.gossips:
            raise ValueError(
                f"compression={self.compression.name} compresses gossip; algorithm={self.algorithm.name} does not "
                "gossip: use algorithm=decentralized, diloco or localsgd, or compression=none"
            )
        if refusing_ignored():  # options the run would ignore (not for a run already written: load_model)
            self._check_ignored(traits)
        if traits.local_steps:
            self._check_local_steps()
        self._check_engine_keys(traits)
        self._check_model_fits_data()
        self._check_phases()
        if self.fault_tolerance.live:
            self._check_live()
        if self.parallel.shard > 1:
            self._check_sharded()

    def _check_sizes(self) -> None:
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

    def _check_ignored(self, traits: AlgorithmTraits) -> None:
        """Options the run would silently ignore (the component configs refuse their own keys that the chosen option
        never reads): a ``topology.*`` key set where the algorithm does not gossip, and what a run of ``steps`` would
        never reach: the warmup's end, the first outer step (unchecked for a run of epochs: the worker counts its
        steps)."""
        if not traits.gossips and refusing_unread():
            self._check_no_topology()
        if self.global_batch_size is not None and self.batch_size != schema_default(TrainConfig, "batch_size") \
                and refusing_unread():  # (in a sweep, another job's)
            raise ValueError(f"batch_size={self.batch_size} with global_batch_size={self.global_batch_size}: the "
                             "global batch sets each worker's; give one of them (global_batch_size=null: batch_size)")
        if self.steps:
            self.algorithm.check_run(self.steps)
        self.scheduler.check_run(self.steps, self.epochs)

    def _check_no_topology(self) -> None:
        """An algorithm that does not gossip reads no ``topology.*`` key: one set away from its default is refused."""
        for name in ("name", "local_world_size", "module"):
            value, default = getattr(self.topology, name), schema_default(TopologyConfig, name)
            key = "topology" if name == "name" else f"topology.{name}"
            if value != default:
                raise ValueError(
                    f"{key}={value} with algorithm={self.algorithm.name}: algorithm={self.algorithm.name} does not "
                    f"gossip and reads no topology; use one that does ({_having('gossips')}), or leave {key}="
                    f"{as_override(default)}"
                )

    def _check_local_steps(self) -> None:
        """What cannot apply when each worker steps alone between outer steps (``AlgorithmTraits.local_steps``)."""
        name = self.algorithm.name
        if self.precision == "fp16":
            raise ValueError(
                f"precision=fp16 with algorithm={name}: a worker whose gradients overflow skips its step alone, and "
                "the workers' outer steps would fall at different steps; use precision=bf16 or fp32"
            )
        if self.global_avg_every:
            raise ValueError(
                f"global_avg_every={self.global_avg_every} is the engine's (algorithm=decentralized); "
                f"algorithm={name} averages at its outer steps (algorithm.sync_every): leave global_avg_every=0"
            )
        if self.compression.copy_dtype != "param":
            raise ValueError(
                f"compression.copy_dtype={self.compression.copy_dtype} sets per-step gossip's public copies; "
                f"algorithm={name}'s outer exchange keeps its own (compressed) in the parameters' dtype: leave "
                "compression.copy_dtype=param"
            )

    def _check_engine_keys(self, traits: AlgorithmTraits) -> None:
        """Keys of the engine that another algorithm would ignore are refused: ``global_avg_every`` (the engine's
        global average) and ``bucket_size_mb`` (its buckets, and DDP's: the fronts of local steps and sharded replicas
        exchange a fragment's payload whole). ``message_size_mb`` splits the fronts' pair messages too."""
        if self.global_avg_every and not (traits.takes_phases or traits.local_steps):  # local steps refuse it first
            raise ValueError(
                f"global_avg_every={self.global_avg_every} averages the engine's gossiping workers; algorithm="
                f"{self.algorithm.name} does not gossip (its workers' models stay equal): leave global_avg_every=0"
            )
        front = ("parallel.shard", self.parallel.shard) if self.parallel.shard > 1 else (
            ("algorithm", self.algorithm.name) if traits.local_steps else None)
        if front is None:
            return
        if self.bucket_size_mb != schema_default(TrainConfig, "bucket_size_mb"):
            raise ValueError(
                f"bucket_size_mb={self.bucket_size_mb} with {front[0]}={front[1]}: bucket_size_mb sizes the engine's "
                f"buckets, which {front[0]}={front[1]} does not run; leave bucket_size_mb="
                f"{schema_default(TrainConfig, 'bucket_size_mb')}"
            )

    def _check_live(self) -> None:
        """What ``fault_tolerance=live`` runs with in this version (each refusal names the reason)."""
        ft, launch, name = self.fault_tolerance, self.launch, self.algorithm.name
        traits = algorithm_traits(name)
        local_steps = traits.local_steps
        refusals = [
            (not traits.live, f"algorithm={name}: live fault tolerance runs the gossip engine or local steps' outer "
             f"steps; use algorithm={_having('live')}"),
            (local_steps and getattr(self.algorithm, "fragment_sync_delay", 0) > 0, f"algorithm={name} with "
             "algorithm.fragment_sync_delay > 0: an exchange in flight across a change is next; leave it 0"),
            (bool(self.phases), "phases: an all-reduce phase needs every worker; leave phases empty"),
            (self.global_avg_every > 0, f"global_avg_every={self.global_avg_every}: a global average needs every "
             "worker; leave it 0"),
            (launch.device not in ("cpu", "cuda"), f"launch.device={launch.device}: live membership runs on the "
             "device named; use launch.device=cpu or cuda"),
            (launch.device == "cuda" and ft.role != "coordinator" and reconfigure.why_unsupported("cuda") is not None,
             f"launch.device=cuda: {reconfigure.why_unsupported('cuda')}; use launch.device=cpu"),  # where workers run
            (ft.role != "both" and not launch.rdzv_endpoint, f"fault_tolerance.role={ft.role}: the agents reach "
             "the coordinator at launch.rdzv_endpoint; set launch.rdzv_endpoint=HOST:PORT (the coordinator's host, "
             "the same on every node)"),
            (bool(launch.rdzv_endpoint) and not host_port(launch.rdzv_endpoint), f"launch.rdzv_endpoint="
             f"{launch.rdzv_endpoint}: the coordinator's store; valid: HOST:PORT with a port in 1..65535"),
            (self.precision == "fp16", "precision=fp16: the workers' overflow agreement is a collective of every "
             "worker, which a dead member fails on all the others; use precision=bf16 or fp32"),
            (launch.monitor_interval != schema_default(LaunchConfig, "monitor_interval"),
             f"launch.monitor_interval={launch.monitor_interval}: the elastic agent's, which a live run does not "
             "start (its node agents watch heartbeats; fault_tolerance.detect_s sets how soon a silent worker is "
             f"dead); leave launch.monitor_interval={schema_default(LaunchConfig, 'monitor_interval')}"),
        ]
        for refused, why in refusals:
            if refused:
                raise ValueError(f"fault_tolerance=live with {why}")
        launched = None if launch.nproc_per_node is None else launch.nproc_per_node * launch.min_nodes
        if launched is not None and ft.min_workers > launched:
            raise ValueError(
                f"fault_tolerance.min_workers={ft.min_workers} is more than the {launched} workers "
                f"launched; valid: 1..{launched}"
            )

    def _check_sharded(self) -> None:
        """What ``parallel.shard`` > 1 runs with in this version (each refusal names the reason)."""
        shard, launch, name = self.parallel.shard, self.launch, self.algorithm.name
        local = self.topology.local_world_size or launch.nproc_per_node
        refusals = [
            (name == ALLREDUCE, f"algorithm={name}: all-reducing shards across replicas is FSDP2's HSDP "
             "(fully_shard over a 2-D mesh); use algorithm=decentralized to gossip them"),
            (name != ALLREDUCE and not algorithm_traits(name).shards, f"algorithm={name}: valid with "
             f"parallel.shard: {_having('shards')}"),
            (launch.nproc_per_node is not None and launch.nproc_per_node % shard != 0,
             f"launch.nproc_per_node={launch.nproc_per_node}: a replica's workers share a node, so parallel.shard "
             f"must divide the workers per node; valid: " + ", ".join(
                 str(k) for k in range(1, (launch.nproc_per_node or 1) + 1) if (launch.nproc_per_node or 1) % k == 0)),
            (local is not None and local % shard != 0, f"topology.local_world_size={local}: it must be a multiple "
             "of parallel.shard"),
            (bool(self.phases), "phases: the engine's all-reduce phases hold whole models; leave phases empty"),
            (self.global_avg_every > 0, f"global_avg_every={self.global_avg_every}: leave it 0"),
            (self.fault_tolerance.live, "fault_tolerance=live: live membership runs the engine; use "
             "fault_tolerance=none"),
            (self.precision == "fp16", "precision=fp16: FSDP2 needs its own sharded gradient scaler; use "
             "precision=bf16 or fp32"),
            (self.compile, "compile=true: not built for sharded models yet; use compile=false"),
            (self.parallel.mixed_precision in ("bf16", "bf16-reduce") and self.precision == "fp32",
             f"parallel.mixed_precision={self.parallel.mixed_precision} and precision=fp32: bf16 parameters without "
             "autocast would run softmax, norms and the loss in bf16; set precision=bf16, or mixed_precision=none"),
            (self.compression.copy_dtype != "param", f"compression.copy_dtype={self.compression.copy_dtype}: "
             "sharded gossip keeps its public copies in the parameters' dtype; leave compression.copy_dtype=param"),
        ]
        for refused, why in refusals:
            if refused:
                raise ValueError(f"parallel.shard={shard} with {why}")

    def _check_phases(self) -> None:
        if not self.phases:
            return
        if not algorithm_traits(self.algorithm.name).takes_phases:
            raise ValueError(
                "phases run in the engine, which switches between gossip and its own gradient all-reduce; leave "
                f"algorithm=decentralized (not {self.algorithm.name!r}) and give a phase algorithm: allreduce"
            )
        for i, phase in enumerate(self.phases):
            where = f"phases[{i}]"
            if phase.algorithm not in PHASE_ALGORITHMS:
                raise ValueError(f"{where}.algorithm={phase.algorithm!r}; valid: {', '.join(PHASE_ALGORITHMS)}")
            if phase.algorithm == ALLREDUCE and phase.topology is not None:
                raise ValueError(f"{where}: algorithm allreduce takes no topology (got topology={phase.topology!r})")
            last = i == len(self.phases) - 1
            if phase.steps is None and not last:
                raise ValueError(f"{where}.steps is null, but only the last phase may run until the end")
            if phase.steps is not None and phase.steps < 1:
                raise ValueError(f"{where}.steps={phase.steps} must be >= 1 (or null in the last phase: until the end)")
        if self.steps:
            self.check_phases_fit(self.steps, f"steps={self.steps}")

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

    @property
    def gossips(self) -> bool:
        """The algorithm exchanges with the topology's neighbours (so the topology and compression apply)."""
        return algorithm_traits(self.algorithm.name).gossips

    def gossip_topologies(self) -> set[str]:
        """Every topology the run gossips over (its own and its phases'); empty when the algorithm does not gossip."""
        if not self.gossips:
            return set()
        return ({self.topology.name} | {p.mode(self.topology.name) for p in self.phases}) - {ALLREDUCE}

    def check_phases_fit(self, total_steps: int, run: str) -> None:
        """The last phase must start before the run ends, and runs to its end (with ``epochs`` the step count is known
        only in the worker, which calls this again); ``run`` says how the run's length was given."""
        before_last = self.phase_starts()[-1][0]
        if self.phases and before_last >= total_steps:
            raise ValueError(
                f"phases before the last take {before_last} steps, but the run has {run}: the last phase would "
                "never run"
            )
        if self.phases and self.phases[-1].steps not in (None, total_steps - before_last):
            raise ValueError(f"phases[{len(self.phases) - 1}].steps={self.phases[-1].steps}: the last phase runs until "
                             f"the end, {total_steps - before_last} steps with {run}; give it steps: null")

    def phase_starts(self) -> list[tuple[int, str]]:
        """(steps taken before it, engine mode) of each phase: [(0, topology or "allreduce"), ...]."""
        if not self.phases:
            return [(0, self.topology.name if self.gossips else ALLREDUCE)]
        starts, taken = [], 0
        for phase in self.phases:
            starts.append((taken, phase.mode(self.topology.name)))
            taken += phase.steps or 0
        return starts

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
        if not self.gossips:
            return ALLREDUCE
        if not self.phases:
            return self.build_topology(None, world_size).label
        labels = [
            (ALLREDUCE if mode == ALLREDUCE else self.build_topology(mode, world_size).label, start)
            for start, mode in self.phase_starts()
        ]
        return "phases: " + ", ".join(f"{label} from step {start}" for label, start in labels)

    def build_topology(self, name: str | None = None, world_size: int | None = None) -> Topology:
        """The gossip schedule for ``world_size`` workers (default: the launch's; no process group needed); default
        topology: ``topology.name``. ``topology.module`` is imported first, so its topologies can be named. With
        ``fault_tolerance=live``, :meth:`live_topology`'s."""
        self.topology.import_module()
        world_size = world_size or self.launch.world_size
        if self.fault_tolerance.live and name is None:
            name, local = self.live_topology(world_size)
            return build_topology(name, world_size, local)
        local = self.topology.local_world_size or self.launch.nproc_per_node
        shard = self.parallel.shard
        if shard == 1:
            return build_topology(name or self.topology.name, world_size, local)
        replicas = world_size // shard
        try:
            base = build_topology(name or self.topology.name, replicas, (local or shard) // shard)
        except ValueError as error:
            raise ValueError(f"over {replicas} replicas (parallel.shard={shard}): {error}") from None
        return ShardedTopology(base, shard, rank=0)

    def live_topology(self, world_size: int, members_per_node: list[int] | None = None) -> tuple[str, int]:
        """``fault_tolerance=live``: (topology, workers per node) gossiped over by ``world_size`` members, whose
        nodes hold ``members_per_node`` (the plan's, in rank order; None: as launched, ``launch.nproc_per_node``
        each); :meth:`live_layout`'s rule."""
        name, local, _ = self.live_layout(world_size, members_per_node)
        return name, local

    def live_layout(self, world_size: int, members_per_node: list[int] | None = None) -> tuple[str, int, str]:
        """:meth:`live_topology`, and why it is not ``topology.name`` over the members' nodes ('' when it is: the
        reason a change logs, once); the rule: ``engine/node_layout.py``."""
        per_node = self.launch.nproc_per_node
        launched = [per_node] * (world_size // per_node) if per_node and world_size % per_node == 0 else None
        return layout_over_nodes(self.topology.name, world_size, members_per_node or launched or [world_size],
                                 self.topology.local_world_size)


def check_config(cfg: DictConfig | dict[str, Any]) -> TrainConfig:
    """Merge into the schema and check; raises ``ValueError`` (or an OmegaConf error) naming the bad value.

    ``algorithm`` may be a bare name (``"allreduce"``, as configs written before it was a group have it); the job is
    merged into the named algorithm's own options schema."""
    algorithm = cfg.get("algorithm")
    if isinstance(algorithm, str):
        algorithm = {"name": algorithm}
        if isinstance(cfg, DictConfig):
            cfg = cfg.copy()
            with open_dict(cfg):
                cfg.algorithm = algorithm
        else:
            cfg = {**cfg, "algorithm": algorithm}
    name = (algorithm or {}).get("name", AlgorithmConfig.name)
    schema = OmegaConf.structured(TrainConfig)
    schema.algorithm = OmegaConf.structured(algorithm_traits(name).schema)  # its own options, typed
    merged = OmegaConf.merge(schema, cfg)
    with as_sweep_job() if merged.run.job_num is not None else contextlib.nullcontext():
        refuse_added_keys(merged, {"algorithm": [traits.schema for traits in ALGORITHM_TRAITS.values()]})
        return OmegaConf.to_object(merged)  # type: ignore[return-value]


def load_config(path: str | Path) -> TrainConfig:
    """A worker's view of the job: the resolved YAML the launcher wrote, checked again, with ``topology.module``
    imported when the algorithm gossips (the engine finds topologies by name in the registry it fills)."""
    cfg = check_config(OmegaConf.load(path))
    if cfg.gossips:
        cfg.topology.import_module()
    return cfg
