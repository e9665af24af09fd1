"""Where a run's numbers go, and the numbers only a distributed run has.

Sinks (rank 0): ``metrics.jsonl`` always, wandb (offline by default: files in the run directory, no account needed),
the console and the progress bar. Every rank logs everything to ``logs/rank<k>.log``. A wandb failure never stops
training: it is reported once and the JSONL goes on.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

import torch
import torch.distributed as dist
from loguru import logger
from torch import Tensor
from tqdm import tqdm

from decent_train.components.checks import refuse_unread, refusing_unread, schema_default
from decent_train.engine import reconfigure
from decent_train.engine.membership import local_part
from decent_train.engine.topology import Topology
from decent_train.engine.comm import peers_must_answer, run_collective

LEVELS = ("TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class WandbConfig:
    """``logger.wandb``: ``online`` uploads (set project/entity; the API key comes from ``wandb login`` or
    ``WANDB_API_KEY``, never from the config); ``offline`` writes ``RUN_DIR/wandb/`` for ``wandb sync`` later."""

    mode: str = "offline"  # offline (RUN_DIR/wandb/; `wandb sync` uploads it) | online | disabled
    project: str = "decent-train"  # the wandb project
    entity: Optional[str] = None  # the wandb team or user; null: your default entity
    group: Optional[str] = None  # the run's wandb group; null: the sweep directory (a sweep's runs share it)
    name: Optional[str] = None  # the run's wandb name; null: the job's command-line overrides
    tags: list[str] = field(default_factory=list)  # the run's tags

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"logger.wandb.mode={self.mode!r} is not a mode; valid: {', '.join(WANDB_MODES)}")


# logger.wandb.<key> -> the modes that read it: every key but the mode itself, which disabled wandb reads none of
WANDB_READERS = dict.fromkeys([key for key in WandbConfig.__dataclass_fields__ if key != "mode"], ("offline", "online"))


@dataclass
class LoggerConfig:
    """``conf/logger/*.yaml``."""

    log_every: int = 10  # optimizer steps between records
    consensus_every: int = 10  # steps between consensus-distance measurements; 0: never
    consensus_samples: int = 65536  # coordinates the consensus distance is estimated from; 0: all (exact, costly)
    progress_bar: bool = True  # a progress bar on the console (rank 0's)
    console_level: str = "INFO"  # the console's level (every rank's file gets DEBUG)
    console_all_ranks: bool = False  # also print the other ranks' messages
    wandb: WandbConfig = field(default_factory=WandbConfig)  # wandb.mode!=disabled: where wandb logs

    def __post_init__(self) -> None:
        for key, value, least in (("log_every", self.log_every, 1), ("consensus_every", self.consensus_every, 0),
                                  ("consensus_samples", self.consensus_samples, 0)):
            if value < least:
                raise ValueError(f"logger.{key}={value} must be >= {least}")
        if self.console_level.upper() not in LEVELS:
            raise ValueError(f"logger.console_level={self.console_level!r} is not a level; valid: {', '.join(LEVELS)}")
        refuse_unread("logger.wandb", self.wandb, WANDB_READERS, "logger.wandb.mode", self.wandb.mode)
        samples = schema_default(LoggerConfig, "consensus_samples")
        if refusing_unread() and self.consensus_every == 0 and self.consensus_samples != samples:
            raise ValueError(f"logger.consensus_samples={self.consensus_samples} with logger.consensus_every=0: nothing "
                             "measures the consensus distance; set logger.consensus_every > 0, or leave "
                             f"logger.consensus_samples={samples}")


def setup_worker_logging(run_dir: Path, rank: int, cfg: LoggerConfig, name: str | None = None) -> None:
    """Every rank logs everything to ``logs/rank<k>.log`` (or ``logs/<name>.log``); rank 0 (or every rank) also to
    the console."""
    logger.remove()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    logger.add(run_dir / "logs" / f"{name or f'rank{rank}'}.log", level="DEBUG", diagnose=False)
    if rank == 0 or cfg.console_all_ranks:
        log_to_console(cfg, rank)


def log_to_console(cfg: LoggerConfig, rank: int = 0) -> None:
    """This worker's messages to the console too (rank 0's, or every rank's with ``console_all_ranks``)."""
    logger.add(
        lambda message: tqdm.write(message, end="", file=sys.stderr),
        level=cfg.console_level.upper(),
        format="<green>{time:HH:mm:ss}</green> | " + ("" if rank == 0 else f"rank {rank} | ") + "<level>{message}</level>",
        colorize=sys.stderr.isatty(),
    )


class MetricLogger:
    """Rank 0's sinks: one JSON object per record in ``metrics.jsonl`` (namespaced keys such as ``train/loss``), and
    the same record to wandb. Other ranks get a logger that does nothing."""

    def __init__(self, path: Path | None, cfg: LoggerConfig, config: dict[str, Any], resumed_step: int = 0):
        """``path``: the JSONL file (wandb writes beside it); None on the ranks that do not log. A run resumed from
        a checkpoint at ``resumed_step`` keeps the records up to it and drops those after (they are measured again)."""
        if path is not None and resumed_step > 0 and path.exists():
            kept = [line for line in path.read_text().splitlines() if _record_step(line) <= resumed_step]
            path.write_text("".join(line + "\n" for line in kept))
        self._file: TextIO | None = path.open("a") if path is not None else None
        self._wandb: Any = None
        self._cfg, self._config = cfg, config
        if path is not None and cfg.wandb.mode != "disabled":
            self._wandb = _start_wandb(cfg.wandb, path.parent, config)

    @property
    def active(self) -> bool:
        """Whether this worker writes the records (rank 0's logger)."""
        return self._file is not None

    def take_over(self, path: Path) -> None:
        """Become the writer after rank 0 died (live membership): append to ``path`` after the last whole record
        (rank 0 may have died in the middle of one), and start a wandb run of this worker's own."""
        if path.exists():
            text = path.read_text()
            path.write_text(text[: text.rfind("\n") + 1])
        self._file = path.open("a")
        if self._cfg.wandb.mode != "disabled":
            self._wandb = _start_wandb(self._cfg.wandb, path.parent, self._config)

    def log_info(self, info: dict[str, Any]) -> None:
        """Facts about the run known at its start (topology, model and bucket sizes): wandb's config."""
        if self._wandb is not None:
            self._guard(lambda: self._wandb.config.update({"info": info}, allow_val_change=True))

    def log(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        logger.debug(" ".join(f"{k}={_fmt(v)}" for k, v in record.items()))
        if self._wandb is not None:
            values = {k: v for k, v in record.items() if k != "step" and not isinstance(v, str)}  # names: in the JSONL
            self._guard(lambda: self._wandb.log(values, step=record["step"]))

    def close(self, failed: bool = False) -> None:
        """Always called, also when training failed: the wandb run is finished with the right exit code."""
        if self._wandb is not None:
            self._guard(lambda: self._wandb.finish(exit_code=1 if failed else 0))
            self._wandb = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def _guard(self, call: Any) -> None:
        try:
            call()
        except Exception as error:  # noqa: BLE001 - wandb must never stop training
            logger.warning(f"wandb failed ({type(error).__name__}: {error}); it is off for the rest of this run, "
                           "metrics.jsonl goes on")
            self._wandb = None


def _start_wandb(cfg: WandbConfig, run_dir: Path, config: dict[str, Any]) -> Any:
    run_info = config.get("run", {})
    sweep_dir = run_info.get("sweep_dir")
    group = cfg.group or ("/".join(Path(sweep_dir).parts[-2:]) if sweep_dir else None)
    name = cfg.name or (" ".join(run_info.get("overrides", [])) or run_dir.name)
    try:
        import wandb

        return wandb.init(
            mode=cfg.mode,
            project=cfg.project,
            entity=cfg.entity,
            dir=str(run_dir),
            config=config,
            group=group,
            name=name,
            tags=list(cfg.tags) + [f"{k}={v}" for k, v in run_info.get("choices", {}).items()],
            job_type="train",
            settings=wandb.Settings(silent=True),
        )
    except Exception as error:  # noqa: BLE001 - wandb must never stop training
        logger.warning(f"wandb could not start ({type(error).__name__}: {error}); metrics go to metrics.jsonl only")
        return None


def _record_step(line: str) -> float:
    """The step of a JSONL record; infinity for a line cut short by a crash (dropped on resume)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class ConsensusProbe:
    """How far apart the workers' models are: ``sqrt((1/n) sum_i |x_i - mean|^2)``, and that over ``|mean|``.

    Estimated from ``samples`` coordinates drawn once, uniformly with replacement, the same on every worker (so
    ``(N / samples)`` times the sampled sum is unbiased): a measurement all-reduces ``samples`` numbers instead of the
    model (ResNet-50: 256 KB instead of 100 MB) and makes one host sync. Exact when ``samples`` is 0 or covers the
    model: then it costs a copy of the parameters and an all-reduce of it. Every rank must call :meth:`measure`.
    """

    def __init__(self, params: list[Tensor], samples: int = 65536, seed: int = 0,
                 group: dist.ProcessGroup | None = None, replicas: int | None = None):
        """``group`` and ``replicas`` for a sharded model (``params``: this rank's shards): the mean is taken over
        ``group``, the ranks holding the same shard in each of the ``replicas``; the distance sums every shard's."""
        self.params, self.group, self.replicas = params, group, replicas
        sizes = [p.numel() for p in params]
        total = sum(sizes)
        self.exact = samples == 0 or samples >= total
        self.scale = 1.0 if self.exact else total / samples
        self.dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        # where the mean is taken, if not where the tensors are (offloaded anchors in host memory, NCCL reducing
        # device tensors): the sampled elements move there, not the tensors
        self.device: torch.device | None = None
        self.picks: list[tuple[Tensor, Tensor]] = []  # (parameter, indices into its elements)
        if not self.exact:
            drawn = torch.randint(total, (samples,), generator=torch.Generator().manual_seed(seed)).sort().values
            ends = torch.tensor(sizes).cumsum(0)
            owner = torch.searchsorted(ends, drawn, right=True)
            for i, p in enumerate(params):
                mine = drawn[owner == i] - (ends[i] - sizes[i])
                if len(mine):
                    self.picks.append((p, mine.to(p.device)))

    @staticmethod
    def _elements(p: Tensor) -> Tensor:
        """The parameter's elements in memory order, without a copy (channels_last included)."""
        p = p.detach()
        return p.view(-1) if p.is_contiguous() else p.as_strided((p.numel(),), (1,))

    @torch.no_grad()
    def measure(self) -> tuple[float, float]:
        """``(distance, relative)`` now."""
        if self.exact:
            mine = torch.cat([self._elements(p).to(self.dtype) for p in self.params])
        else:
            mine = torch.cat([self._elements(p)[index].to(self.dtype) for p, index in self.picks])
        if self.device is not None:
            mine = mine.to(self.device)
        world = dist.get_world_size() if dist.is_initialized() else 1
        replicas = self.replicas or world
        mean = mine.clone()
        if replicas > 1:
            with peers_must_answer("the consensus distance's all-reduce"):
                group = self.group if self.group is not None else reconfigure.data_group()  # the data's group
                run_collective(dist.all_reduce, mean, group=group)
            mean.div_(replicas)
        sums = self.scale * torch.stack(
            [(mine - mean).double().square().sum(), mean.double().square().sum() / replicas]
        )
        sums = sums.to(reconfigure.control_device(sums.device))  # over the default group: gloo beside a data group
        if world > 1:  # sharded: every shard's sums (each rank's scale is its own shard's)
            with peers_must_answer("the consensus distance's all-reduce"):
                run_collective(dist.all_reduce, sums)
        deviation, norm_squared = sums.tolist()
        distance = math.sqrt(deviation / replicas)
        norm = math.sqrt(norm_squared)
        return distance, distance / norm if norm > 0 else 0.0


def gossip_bytes_per_step(topology: Topology, rank: int, message_bytes: list[int], all_gather: bool = False) -> float:
    """Bytes this worker sends per step, averaged over the topology's period (summed over a round's stages).

    A pair sends each bucket's message once; a group of m >= 3 all-reduces it, counted as a ring all-reduce (2(m-1)/m
    of the message), or with compression all-gathers the messages (a ring all-gather: m-1 messages); a worker alone
    sends nothing.
    """
    total = sum(message_bytes)

    def sent(size: int) -> float:
        return float((size - 1) * total) if all_gather and size > 2 else _exchange_bytes(size, total)

    per_round = [sum(sent(e.size) for e in topology.edges(r, rank)) for r in range(topology.period)]
    return sum(per_round) / len(per_round)


def allreduce_bytes_per_step(world_size: int, model_bytes: int) -> float:
    """Bytes a worker sends per step in a ring all-reduce of the gradients (what torch DDP does, in estimate)."""
    return _exchange_bytes(world_size, model_bytes) if world_size > 1 else 0.0


def _exchange_bytes(group_size: int, nbytes: int) -> float:
    if group_size <= 1:
        return 0.0
    return float(nbytes) if group_size == 2 else 2.0 * (group_size - 1) / group_size * nbytes


def held_bytes(tensors: list[Tensor]) -> int:
    """Bytes of ``tensors`` this rank holds: a DTensor's local shard only (FSDP2's parameters and their optimizer
    state)."""
    return sum(local_part(t).nbytes for t in tensors)


def optimizer_state_tensors(optimizers: list[Any]) -> list[Tensor]:
    """Every tensor of the optimizers' per-parameter state (momentum, Adam's moments, step counts)."""
    return [v for o in optimizers for state in o.state.values() for v in state.values() if isinstance(v, Tensor)]


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this worker: CUDA memory allocated on GPU, the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
