"""The worker: ``python -m decent_train.worker RUN_DIR/resolved_config.yaml``, one process per rank under torchrun.

It never runs Hydra: it reads the resolved config the launcher wrote, joins the process group, trains, evaluates the
average of the workers' models, and (rank 0) writes metrics.jsonl, result.json and the averaged model.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from loguru import logger
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from decent_train.components.checkpoint import complete_checkpoints, load_latest_checkpoint, save_checkpoint
from decent_train.components.data import Datasets, build_datasets
from decent_train.components.metrics import (
    ConsensusProbe,
    MetricLogger,
    allreduce_bytes_per_step,
    gossip_bytes_per_step,
    peak_memory_bytes,
    setup_worker_logging,
)
from decent_train.components.models import build_model
from decent_train.components.optim import make_optim_fn, make_scheduler_fn
from decent_train.config import (
    DIVERGED_FILE,
    METRICS_FILE,
    MODEL_FILE,
    PRECISIONS,
    RESULT_FILE,
    TrainConfig,
    load_config,
)
from decent_train.engine.ddp import DecentralizedDataParallel
from decent_train.engine.optim import LRSchedulerFn
from decent_train.engine.utils import peers_must_answer, run_collective


class Precision:
    """``precision=fp32|bf16|fp16``: forward and loss under autocast; fp16 also scales the loss (a GradScaler, kept
    equal on all workers by the engine)."""

    def __init__(self, name: str, device: torch.device):
        self.dtype, self.device_type = PRECISIONS[name], device.type
        self.scaler = torch.amp.GradScaler(device.type, enabled=name == "fp16")

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype != torch.float32)


class Decentralized:
    """``algorithm=decentralized``: the engine steps inside backward and gossips with the topology's neighbours, or
    runs ``phases``: gossip and the engine's own gradient all-reduce, switched at step boundaries."""

    def __init__(
        self, net: nn.Module, cfg: TrainConfig, schedule: LRSchedulerFn, scaler: torch.amp.GradScaler, steps_taken: int
    ):
        self.phase_starts = cfg.phase_starts()
        self.phase = self.phase_at(steps_taken)
        self.engine = DecentralizedDataParallel(
            net,
            optim_fn=make_optim_fn(cfg.optim),
            lr_scheduler_fn=schedule,
            topology=self.phase_starts[self.phase][1],
            scaler=scaler if scaler.is_enabled() else None,
            grad_clip_norm=cfg.grad_clip_norm,
            bucket_size_in_mb=cfg.bucket_size_mb,
            message_size_in_mb=cfg.message_size_mb,
            local_world_size=cfg.topology.local_world_size,  # None: torchrun's LOCAL_WORLD_SIZE
            sync_buffer_in_global_avg=True,  # BatchNorm statistics are averaged with the parameters for evaluation
            timeout=cfg.comm_timeout_s,
            global_avg_every=cfg.global_avg_every,
            **cfg.compression.engine_kwargs(),
        )
        self.model, self.net = self.engine, net

    def phase_at(self, steps_taken: int) -> int:
        """The phase the engine is in after ``steps_taken`` steps (it switches just before a phase's first step)."""
        return max([i for i, (start, _) in enumerate(self.phase_starts) if start < steps_taken], default=0)

    def begin_step(self, steps_taken: int) -> bool:
        """Enter the next phase if it starts with this step; whether it did."""
        following = self.phase + 1
        if following < len(self.phase_starts) and self.phase_starts[following][0] == steps_taken:
            self.phase = following
            self.engine.switch_to(self.phase_starts[following][1])
            return True
        return False

    @property
    def phase_name(self) -> str:
        return self.phase_starts[self.phase][1]

    def state_dict(self) -> dict[str, Any]:
        return self.engine.engine_state_dict()

    @staticmethod
    def averageable_state(state: dict[str, Any]) -> dict[str, Any]:
        return DecentralizedDataParallel.averageable_state(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_engine_state_dict(state)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.engine.no_sync()

    def step(self) -> None:
        """Nothing left to do: each bucket stepped during backward."""

    def lr(self) -> float:
        return self.engine.get_lr()

    def comm_wait_seconds(self) -> float | None:
        return self.engine.comm_wait_seconds

    def bytes_per_step(self) -> float:
        if self.engine.topology is None:
            return allreduce_bytes_per_step(dist.get_world_size(), sum(self.engine.bucket_bytes))
        return gossip_bytes_per_step(
            self.engine.topology, dist.get_rank(), self.engine.message_bytes, all_gather=self.engine.compressed
        )

    def info(self) -> dict[str, Any]:
        topology = self.engine.topology
        gossip = {} if topology is None else {
            "topology/rounds": topology.describe(),
            "topology/period": topology.period,
            "topology/spectral_gap": topology.spectral_gap(),
        }
        phases = {} if len(self.phase_starts) == 1 else {
            "phases": ", ".join(f"{mode} from step {start}" for start, mode in self.phase_starts)
        }
        return {
            **phases,
            **gossip,
            "engine/buckets": len(self.engine.bucket_bytes),
            "engine/bucket_mb": [round(b / 2**20, 4) for b in self.engine.bucket_bytes],
        }

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        """The global average of the workers' models, for evaluation; the local models come back afterwards."""
        self.engine.global_avg(will_revert=True)
        try:
            yield
        finally:
            self.engine.revert_global_avg()

    def average(self) -> None:
        """Replace every worker's model by the global average for good (the end of training)."""
        self.engine.global_avg(will_revert=False)


class AllReduce:
    """``algorithm=allreduce``: torch DistributedDataParallel with the same model, data, optimizer and schedule."""

    phase, phase_name = 0, "allreduce"

    def __init__(
        self, net: nn.Module, cfg: TrainConfig, schedule: LRSchedulerFn, scaler: torch.amp.GradScaler, steps_taken: int
    ):
        self.scaler = scaler
        device_ids = [net_device(net)] if net_device(net).type == "cuda" else None
        self.model = DistributedDataParallel(net, device_ids=device_ids, bucket_cap_mb=cfg.bucket_size_mb)
        self.net = net
        self.optimizer = make_optim_fn(cfg.optim)(list(net.named_parameters()))
        self.scheduler = schedule(self.optimizer)
        self.grad_clip_norm = cfg.grad_clip_norm

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    @staticmethod
    def averageable_state(state: dict[str, Any]) -> dict[str, Any]:
        return state  # the optimizer's state, the schedule and the scaler: nothing of one worker's own

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.model.no_sync()

    def step(self) -> None:
        if self.grad_clip_norm > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.grad_clip_norm)
        self.scaler.step(self.optimizer)  # skipped on inf/nan gradients (fp16); a plain step otherwise
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def comm_wait_seconds(self) -> float | None:
        return None  # DDP's all-reduce waits inside backward, where it cannot be told apart from compute

    def bytes_per_step(self) -> float:
        nbytes = sum(p.numel() * p.element_size() for p in self.net.parameters() if p.requires_grad)
        return allreduce_bytes_per_step(dist.get_world_size(), nbytes)

    def info(self) -> dict[str, Any]:
        return {"ddp/bucket_cap_mb": self.model.bucket_bytes_cap / 2**20}

    def begin_step(self, steps_taken: int) -> bool:
        return False

    def averaged(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # all-reduce keeps the workers' models equal

    def average(self) -> None:
        pass


def net_device(net: nn.Module) -> torch.device:
    return next(net.parameters()).device


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Over the last dimension: (N, classes) scores against (N,) labels, or (B, T, vocab) against (B, T) tokens."""
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), **kwargs)


@torch.no_grad()
def evaluate(net: nn.Module, cfg: TrainConfig, data: Datasets, device: torch.device, precision: Precision) -> dict[str, float]:
    """Loss and accuracy (next-token accuracy for tokens) on the whole evaluation set; each worker evaluates a
    disjoint slice and the sums are reduced."""
    rank, world = dist.get_rank(), dist.get_world_size()
    was_training = net.training
    net.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, count
    for x, y in data.device_eval_batches(cfg.eval_batch_size, rank, world, device=device, channels_last=cfg.channels_last):
        with precision.autocast():
            logits = net(x)
        sums[0] += cross_entropy(logits.float(), y, reduction="sum").double()
        sums[1] += (logits.argmax(dim=-1) == y).sum()
        sums[2] += y.numel()
    with peers_must_answer("the evaluation's all-reduce"):
        run_collective(dist.all_reduce, sums)
    net.train(was_training)
    loss, correct, count = sums.tolist()
    return {"eval/loss": loss / count, "eval/accuracy": correct / count}


OnRecord = Callable[[dict[str, Any], nn.Module], None]


def train(cfg: TrainConfig, run_dir: Path, device: torch.device, on_record: OnRecord | None = None) -> dict[str, Any]:
    """Train as ``cfg`` says; rank 0 writes the metrics, the result and the averaged model into ``run_dir``.

    ``on_record(record, model)`` runs on every rank after each record is measured (before any evaluation).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir.mkdir(parents=True, exist_ok=True)
    _refuse_to_diverge_again(run_dir)
    batch_size = cfg.batch_size_per_worker(world)
    data = build_datasets(cfg.dataset)
    torch.manual_seed(cfg.seed)  # the same initial model on every worker
    net = build_model(cfg.model, data.input_shape, data.num_classes).to(device)
    if cfg.channels_last:
        net = net.to(memory_format=torch.channels_last)
    if cfg.compile:
        net.compile()  # in place: parameter names and the saved state_dict stay those of the plain model
    torch.manual_seed(cfg.seed + rank)  # dropout and any other randomness differ per worker

    algorithm = Decentralized if cfg.algorithm == "decentralized" else AllReduce
    checkpoint, state = load_latest_checkpoint(
        [run_dir] + ([Path(cfg.resume)] if cfg.resume else []), cfg.schedule(world), cfg.model.architecture(),
        prepare_average=lambda saved: _averageable(saved, algorithm),
    )
    start_step = checkpoint.step if checkpoint is not None else 0  # this run's own (a restart), or cfg.resume's
    # An epoch, and so the schedule's length, is counted as when the run started, whatever the world size now.
    run_world = checkpoint.run_world_size if checkpoint is not None else world
    run_batch_size = cfg.batch_size_per_worker(run_world)
    steps_per_epoch = max(1, data.micro_batches_per_epoch(run_batch_size, run_world) // cfg.accum_steps)
    total_steps = cfg.steps or math.ceil(cfg.epochs * steps_per_epoch)
    cfg.check_phases_fit(total_steps, f"{total_steps} steps ({cfg.epochs:g} epochs of {steps_per_epoch} steps)")
    precision = Precision(cfg.precision, device)
    schedule = make_scheduler_fn(cfg.scheduler, total_steps, steps_per_epoch)
    algo = algorithm(net, cfg, schedule, precision.scaler, start_step)
    data_start = start_step * cfg.accum_steps  # micro-batches each worker has taken
    if checkpoint is not None and state is not None:
        _check_fits(net, state["model"], checkpoint.path)
        _restore(algo, state, device)
        data_start = state.get("data_position", data_start)
        if checkpoint.world_size != world:
            saved_batch_size = state.get("batch_size") or cfg.batch_size_per_worker(checkpoint.world_size)
            old, new = (checkpoint.world_size, saved_batch_size), (world, batch_size)
            data_start = resharded_start(data, data_start, old, new)
            torch.manual_seed(cfg.seed + rank + 1_000_003 * start_step)  # fresh per worker: the files' were N others'
            logger.info(
                f"resumed step {start_step} from {checkpoint.world_size} workers' checkpoint on {world} workers: "
                f"models and optimizer states averaged ({checkpoint.path})"
            )
        else:
            logger.info(f"resumed from {checkpoint.path} (step {checkpoint.step})")
    trainable = [p for p in net.parameters() if p.requires_grad]
    info = {
        "world_size": world,
        "model/parameters": sum(p.numel() for p in trainable),
        "data/train_samples": data.train_size,
        **data.shard_summary(world, batch_size),
        "batch_size": batch_size,
        "precision": cfg.precision,
        "steps": total_steps,
        **algo.info(),
    }
    logger.info(" | ".join(f"{k} {v}" for k, v in info.items()))
    metrics = MetricLogger(
        run_dir / METRICS_FILE if rank == 0 else None, cfg.logger, dataclasses.asdict(cfg), resumed_step=start_step
    )
    metrics.log_info(info)
    try:
        job = Job(cfg, algo, data, batch_size, precision, device, total_steps, steps_per_epoch, run_dir, start_step,
                  data_start, run_world)
        result = _train_loop(job, metrics, on_record)
    except BaseException:
        metrics.close(failed=True)
        raise
    metrics.close()

    result |= {"world_size": world, "algorithm": cfg.algorithm, "model_path": str(run_dir / MODEL_FILE)}
    if checkpoint is not None and checkpoint.world_size != world:
        result["resumed_from_world_size"] = checkpoint.world_size
    result["topology"] = cfg.topology.name if cfg.algorithm == "decentralized" else None
    if rank == 0:
        torch.save({k: v.cpu() for k, v in algo.net.state_dict().items()}, run_dir / MODEL_FILE)
        (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
        trained = result["train_time_s"] < math.inf  # else resumed from the final checkpoint: evaluated only
        speed = f"{result['throughput/samples_per_s']:.0f} samples/s" if trained else "nothing left to train"
        logger.info(f"done: eval/accuracy {result['eval/accuracy']:.4f}, {speed}")
    return result


@dataclasses.dataclass
class Job:
    """What the training loop works with, built once by ``train``."""

    cfg: TrainConfig
    algo: Decentralized | AllReduce
    data: Datasets
    batch_size: int  # per worker and micro-batch
    precision: Precision
    device: torch.device
    total_steps: int
    steps_per_epoch: int
    run_dir: Path
    start_step: int  # steps already taken (a resumed run)
    data_start: int  # micro-batches of this worker's stream already taken (re-sharded when the world size changed)
    run_world: int  # the world size the run started with (its epochs are counted in it)


def _check_fits(net: nn.Module, saved: dict[str, torch.Tensor], path: Path) -> None:
    """One line naming the first tensor that differs, instead of load_state_dict's list (another dataset can change
    the model's input or output size under the same model settings)."""
    mine = net.state_dict()
    for name in [*mine, *(k for k in saved if k not in mine)]:
        here, there = mine.get(name), saved.get(name)
        if here is None or there is None or here.shape != there.shape:
            there_is, here_is = ("missing" if t is None else f"of shape {list(t.shape)}" for t in (there, here))
            raise ValueError(
                f"{path} holds another model: {name} is {there_is} there and {here_is} here; resume with the same "
                "model and dataset settings"
            )


def _restore(algo: Decentralized | AllReduce, state: dict[str, Any], device: torch.device) -> None:
    """Continue from a checkpoint's state: the model, the algorithm's state and the random number generators (not
    from an average of other workers' states: each worker's generators were its own)."""
    algo.net.load_state_dict(state["model"])
    averaged_from = state.get("averaged_from")
    algorithm_state = state["algorithm"]
    algo.load_state_dict({**algorithm_state, "averaged_from": averaged_from} if averaged_from else algorithm_state)
    if not averaged_from:
        torch.set_rng_state(state["rng"])
        if device.type == "cuda" and state["cuda_rng"] is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], device)


def _averageable(state: dict[str, Any], algorithm: type[Decentralized] | type[AllReduce]) -> dict[str, Any]:
    """What of a worker's saved state goes into the average other workers continue from: not its random generators
    and not its exchange in flight."""
    kept = {k: v for k, v in state.items() if k not in ("rng", "cuda_rng")}
    return kept | {"algorithm": algorithm.averageable_state(state["algorithm"])}


def resharded_start(data: Datasets, taken: int, old: tuple[int, int], new: tuple[int, int]) -> int:
    """Where ``new`` = (world, batch size) workers start in their micro-batch streams to go on from ``old`` ones that
    took ``taken`` micro-batches each: in the same epoch, at the first sample of its order not trained on yet. Each
    epoch's order is one shuffle of the whole set that the workers deal out in turn, so what ``old`` workers saw of it
    is a prefix of the order; ``new`` ones skip fewer than one of their global micro-batches to start on a boundary."""
    (old_world, old_batch), (new_world, new_batch) = old, new
    epoch, done = divmod(taken, data.micro_batches_per_epoch(old_batch, old_world))
    per_epoch = data.micro_batches_per_epoch(new_batch, new_world)
    return epoch * per_epoch + min(-(-done * old_batch * old_world // (new_batch * new_world)), per_epoch)


def _checkpoint(job: Job, step: int) -> float:
    """Save every worker's state at ``step`` (the caller has checked the loss is finite); the seconds it took."""
    start = time.perf_counter()
    state = {
        "step": step,
        "data_position": job.data_start + (step - job.start_step) * job.cfg.accum_steps,  # micro-batches taken
        "batch_size": job.batch_size,
        "model": job.algo.net.state_dict(),
        "algorithm": job.algo.state_dict(),
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(job.device) if job.device.type == "cuda" else None,
    }
    cfg = job.cfg
    path = save_checkpoint(job.run_dir, step, state, cfg.schedule(dist.get_world_size()), cfg.model.architecture(),
                           cfg.checkpoint.keep, job.run_world)
    logger.debug(f"checkpoint {path}")
    return time.perf_counter() - start


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or infinite: training stops, the checkpoints before it are kept."""


def _check_finite(first_bad_step: torch.Tensor, run_dir: Path) -> None:
    """Stop on every rank if any rank's loss was NaN or infinite since the start (``first_bad_step`` > 0)."""
    steps = _gather([first_bad_step], first_bad_step.device)[:, 0]
    if steps.max() > 0:
        step = int(steps[steps > 0].min())
        rank = int((steps == step).nonzero()[0])
        good = complete_checkpoints(run_dir)
        kept = f"the last good checkpoint is {good[0].path}" if good else "no checkpoint was written before it"
        why = f"train/loss is NaN or infinite from step {step} on (rank {rank}); stopped: {kept}"
        if dist.get_rank() == 0:
            (run_dir / DIVERGED_FILE).write_text(why + "\n")
        raise NonFiniteLoss(why)


def _refuse_to_diverge_again(run_dir: Path) -> None:
    """Workers that torchrun's agent restarts after a NaN/inf loss fail at once: training on from the same
    checkpoint on the same data would diverge at the same step again (once per ``launch.max_restarts``)."""
    diverged = run_dir / DIVERGED_FILE
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        if dist.get_rank() == 0:
            diverged.unlink(missing_ok=True)  # left by an earlier launch into this directory
    elif diverged.exists():
        raise NonFiniteLoss(f"{diverged.read_text().strip()} (in an earlier attempt; restarts do not train again)")


def _train_loop(job: Job, metrics: MetricLogger, on_record: OnRecord | None) -> dict[str, Any]:
    cfg, algo, device, precision, total_steps = job.cfg, job.algo, job.device, job.precision, job.total_steps
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = job.data.device_train_batches(
        job.batch_size, rank, world, cfg.seed, start=job.data_start, device=device,
        channels_last=cfg.channels_last,
    )
    trainable = [p for p in algo.net.parameters() if p.requires_grad]
    consensus = ConsensusProbe(trainable, cfg.logger.consensus_samples, seed=cfg.seed)
    samples_per_step = job.batch_size * cfg.accum_steps  # per worker
    phase_ends = {start for start, _ in cfg.phase_starts()[1:]} | {total_steps}  # a record closes every phase
    bar = tqdm(
        total=total_steps, initial=job.start_step, unit="step", disable=rank != 0 or not cfg.logger.progress_bar,
        dynamic_ncols=True,
    )
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # summed on the device: no host sync per step
    first_bad_step = torch.zeros((), dtype=torch.int64, device=device)  # the first step with a NaN/inf loss; 0: none
    micro_batches, data_seconds, comm_start = 0, 0.0, algo.comm_wait_seconds() or 0.0
    window_start = train_start = time.perf_counter()
    train_seconds = 0.0
    record: dict[str, Any] = {}
    for step in range(job.start_step + 1, total_steps + 1):
        if algo.begin_step(step - 1):
            logger.info(f"step {step}: phase {algo.phase} ({algo.phase_name}) begins")
        for micro in range(cfg.accum_steps):
            data_start = time.perf_counter()
            x, y = next(batches)
            data_seconds += time.perf_counter() - data_start
            with contextlib.nullcontext() if micro == cfg.accum_steps - 1 else algo.no_sync():
                with precision.autocast():
                    loss = cross_entropy(algo.model(x), y, label_smoothing=cfg.label_smoothing)
                precision.scaler.scale(loss / cfg.accum_steps).backward()
            loss_sum += loss.detach()
            first_bad_step = torch.where((first_bad_step == 0) & ~torch.isfinite(loss.detach()), step, first_bad_step)
            micro_batches += 1
        algo.step()
        bar.update()

        every = cfg.checkpoint.every
        checkpoint_now = every > 0 and (step % every == 0 or step == total_steps)
        evaluate_now = step == total_steps or (cfg.eval_every > 0 and step % cfg.eval_every == 0)
        consensus_now = cfg.logger.consensus_every > 0 and step % cfg.logger.consensus_every == 0
        record_now = step % cfg.logger.log_every == 0 or evaluate_now or consensus_now or step in phase_ends
        if record_now or checkpoint_now:
            _check_finite(first_bad_step, job.run_dir)  # never log or save a diverged model as if it were fine
        if record_now:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the window's time includes its queued work
            elapsed = time.perf_counter() - window_start
            # The record's own cost (the gather below, the consensus all-reduce, the sinks) is training time: it
            # counts in the next window, so throughput shows what measuring costs. Evaluation does not count (below).
            window_start = time.perf_counter()
            train_seconds += elapsed
            comm_seconds = (algo.comm_wait_seconds() or 0.0) - comm_start
            stats = _gather(  # one row per worker
                [loss_sum, micro_batches, elapsed, data_seconds, comm_seconds, peak_memory_bytes(device),
                 algo.bytes_per_step()],
                device,
            )
            steps_in_window = micro_batches / cfg.accum_steps
            loss_total, micro_total, elapsed_w, data_w, comm_w, memory_w, bytes_w = stats.T
            record = {
                "step": step,
                "epoch": step / job.steps_per_epoch,
                "phase": algo.phase,
                "phase/name": algo.phase_name,
                "train/loss": (loss_total.sum() / micro_total.sum()).item(),
                # The spread over workers: on heterogeneous shards (dataset.partition) each fits its own labels.
                "train/loss_min_worker": (loss_total / micro_total).min().item(),
                "train/loss_max_worker": (loss_total / micro_total).max().item(),
                "train/lr": algo.lr(),
                "throughput/samples_per_s": world * steps_in_window * samples_per_step / elapsed_w.max().item(),
                # The slowest worker at its own pace (time blocked on its neighbours removed): exposes a straggler,
                # whom the others wait for.
                "throughput/samples_per_s_min_worker": (
                    steps_in_window * samples_per_step / (elapsed_w - comm_w).max().item()
                ),
                "time/step_ms": 1000 * elapsed_w.mean().item() / steps_in_window,
                "time/data_ms": 1000 * data_w.mean().item() / steps_in_window,
                "comm/bytes_per_step": bytes_w.mean().item(),
                "memory/peak_gib": memory_w.max().item() / 2**30,
                "time/elapsed_s": time.perf_counter() - train_start,
            }
            if cfg.dataset.is_tokens:
                record["throughput/tokens_per_s"] = record["throughput/samples_per_s"] * cfg.dataset.context_length
            if algo.comm_wait_seconds() is not None:
                record["time/comm_wait_ms"] = 1000 * comm_w.mean().item() / steps_in_window
            if consensus_now:
                record["consensus/distance"], record["consensus/relative"] = consensus.measure()
            if on_record is not None:
                on_record(record, algo.net)
            if evaluate_now:
                eval_start = time.perf_counter()
                with algo.averaged():
                    record.update(evaluate(algo.net, cfg, job.data, device, precision))
                window_start += time.perf_counter() - eval_start
            metrics.log(record)
            bar.set_postfix(
                {"loss": f"{record['train/loss']:.4f}", "samples/s": f"{record['throughput/samples_per_s']:.0f}"}
                | ({"acc": f"{record['eval/accuracy']:.4f}"} if "eval/accuracy" in record else {}),
                refresh=False,
            )
            loss_sum.zero_()
            micro_batches, data_seconds, comm_start = 0, 0.0, algo.comm_wait_seconds() or 0.0
        if checkpoint_now:  # after the step's record: a run resumed here logs from the next step on
            window_start += _checkpoint(job, step)  # (checkpoints are not training time)
    bar.close()
    if not record:  # resumed from the final checkpoint: only the evaluation of the average is left
        with algo.averaged():
            record = {"train/loss": math.nan, **evaluate(algo.net, cfg, job.data, device, precision)}
        train_seconds = math.inf
    if cfg.final_average:
        algo.average()  # the final model is the average of the workers' models
    trained = (total_steps - job.start_step) * samples_per_step * world  # in this run (after a resume: since it)
    return {
        "eval/accuracy": record["eval/accuracy"],
        "eval/loss": record["eval/loss"],
        "train/loss": record["train/loss"],
        "steps": total_steps,
        "resumed_from_step": job.start_step,
        "samples": total_steps * samples_per_step * world,
        "train_time_s": train_seconds,
        "throughput/samples_per_s": trained / train_seconds,
    }


def _gather(values: list[float | torch.Tensor], device: torch.device) -> torch.Tensor:
    """Every worker's values, one row per rank (a few numbers: cheap)."""
    row = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    rows = torch.zeros(dist.get_world_size(), len(values), dtype=torch.float64, device=device)
    rows[dist.get_rank()] = row
    with peers_must_answer("the gather of the workers' statistics"):
        run_collective(dist.all_reduce, rows)  # a sum of rows that are zero but one's: the gather
    return rows.cpu()


def init_distributed(device_kind: str, timeout: timedelta) -> torch.device:
    """Join the process group torchrun describes: NCCL and one GPU per local rank on CUDA, gloo on CPU. A collective
    that takes longer than ``timeout`` fails (a peer hangs or died) instead of waiting forever; the engine's exchanges
    have their own, shorter limit (``comm_timeout_s``)."""
    use_cuda = device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available())
    device = torch.device("cpu")
    if use_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("launch.device=cuda but this worker sees no CUDA device")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    backend = {"backend": "nccl", "device_id": device} if use_cuda else {"backend": "gloo"}
    store = _restart_store(timeout)
    if store is None:
        dist.init_process_group(**backend, timeout=timeout)
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(**backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return device


def _restart_store(timeout: timedelta) -> dist.Store | None:
    """The elastic agent's store under a prefix of its own for each restart of the workers.

    torch 2.15 reuses the agent's store across restarts without one, so restarted workers could read the addresses
    their dead predecessors published and hang connecting to them (seen with gloo after a worker was killed). None
    outside an elastic agent's store: the default rendezvous then applies.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]), is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"decent_train/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_agent() -> None:
    """Have the kernel kill this worker when the elastic agent that started it dies (the launcher names it in
    ``DECENT_TRAIN_AGENT_PID``). The agent starts each worker in a session of its own, so a killed agent (a node lost,
    as far as the other nodes can tell) would leave its workers running: they would hold the node's place in every
    collective, and an elastic job would never notice the loss. Linux only (``PR_SET_PDEATHSIG``)."""
    agent = os.environ.get("DECENT_TRAIN_AGENT_PID")
    if agent is None or sys.platform != "linux":
        return
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(agent):  # it died before the line above
        sys.exit(f"the elastic agent (pid {agent}) died before this worker started")


@record
def main(argv: list[str] | None = None) -> None:
    _die_with_agent()
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m decent_train.worker RUN_DIR/resolved_config.yaml   (under torchrun)")
    config_path = Path(args[0]).resolve()
    cfg = load_config(config_path)
    run_dir = Path(cfg.run.output_dir) if cfg.run.output_dir else config_path.parent
    device = init_distributed(cfg.launch.device, timedelta(seconds=cfg.pg_timeout_s))
    setup_worker_logging(run_dir, dist.get_rank(), cfg.logger)
    try:
        train(cfg, run_dir, device)
        gc.collect()  # free the engine (its hooks make reference cycles) while its process groups are alive
        with peers_must_answer("the barrier at the end of training"):
            dist.barrier()  # leave together: a peer tearing down gloo while others still talk to it aborts them
    except Exception as error:
        # The traceback goes to this rank's log and to the error file the launcher reports from; not to the console
        # of every rank.
        logger.opt(exception=error).debug(f"rank {dist.get_rank()} failed")
        ErrorHandler().record_exception(error)
        sys.exit(1)
    finally:
        dist.destroy_process_group()
    logger.complete()  # everything is written and the process group is gone; the interpreter exits as usual


if __name__ == "__main__":
    main()
