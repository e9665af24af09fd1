"""``train``: build one worker's run from its config (data, model, algorithm, resumed state), run the loop, and write
the result."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger
from torch import nn

from decent_train.algorithms import algorithm_for
from decent_train.components.checkpoint import Checkpoint
from decent_train.components.data import Datasets, build_datasets
from decent_train.components.metrics import MetricLogger, held_bytes
from decent_train.components.models import build_model
from decent_train.components.optim import make_scheduler_fn
from decent_train.config import METRICS_FILE, MODEL_FILE, RESULT_FILE, TrainConfig
from decent_train.training.forward import Precision
from decent_train.training.job import Job
from decent_train.training.live import LiveMembership
from decent_train.training.live_changes import LiveTraining, seed_joiner
from decent_train.training.loop import OnRecord, train_loop
from decent_train.training.recorder import refuse_to_diverge_again
from decent_train.training.resume import load_checkpoint, restore
from decent_train.training.saved_model import model_shape, save_model
from decent_train.training.stop import TrainingStopped


def train(
    cfg: TrainConfig, run_dir: Path, device: torch.device, on_record: OnRecord | None = None,
    live: LiveMembership | None = None,
) -> dict[str, Any]:
    """Train as ``cfg`` says; rank 0 writes the metrics, the result and the averaged model into ``run_dir``.

    ``on_record(record, model)`` runs on every rank after each record is measured (before any evaluation). ``live``:
    the members may change while it trains (``fault_tolerance=live``); a worker joining a running job heals first.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    data = build_datasets(cfg.dataset)
    net = _build_net(cfg, data, device)
    if live is not None:
        importlib.import_module("torch._dynamo")  # 1.3 s on the first optimizer built: not while the members wait
        live.join()  # only now: a joiner's members wait for nothing but its state
    rank, world = dist.get_rank(), dist.get_world_size()
    refuse_to_diverge_again(run_dir)
    launched = cfg.launch.world_size if live is not None else world  # live: the batch stays as launched
    batch_size = cfg.batch_size_per_worker(launched)
    torch.manual_seed(cfg.seed + rank)  # dropout and any other randomness differ per worker

    algorithm = algorithm_for(cfg)
    joining = live is not None and live.joining
    if joining:  # built over the members now; the donor's state replaces what it starts with
        seed_joiner(cfg.seed, live.id)
        name, local = cfg.live_topology(world)
        cfg = dataclasses.replace(cfg, topology=dataclasses.replace(cfg.topology, name=name, local_world_size=local))
    checkpoint, state = (None, None) if joining else load_checkpoint(cfg, run_dir, algorithm)
    start_step = checkpoint.step if checkpoint is not None else 0  # this run's own (a restart), or cfg.resume's
    # An epoch, and so the schedule's length, is counted as when the run started, whatever the world size now.
    run_world = checkpoint.run_world_size if checkpoint is not None else launched
    steps_per_epoch, total_steps = _schedule_length(cfg, data, run_world)
    precision = Precision(cfg.precision, device)
    schedule = make_scheduler_fn(cfg.scheduler, total_steps, steps_per_epoch)
    algo = algorithm(net, cfg, schedule, precision.scaler, start_step, **({"from_rank0": False} if joining else {}))
    data_start = start_step * cfg.accum_steps  # micro-batches each worker has taken
    if checkpoint is not None and state is not None:
        data_start = restore(algo, checkpoint, state, cfg, data, batch_size, device)
    job = Job(cfg, algo, data, batch_size, precision, device, total_steps, steps_per_epoch, run_dir, start_step,
              data_start, run_world)
    info = _info(job)
    logger.info(" | ".join(f"{k} {v}" for k, v in info.items()))
    metrics = MetricLogger(
        run_dir / METRICS_FILE if rank == 0 else None, cfg.logger, dataclasses.asdict(cfg), resumed_step=start_step
    )
    metrics.log_info(info)
    live_training = LiveTraining(live, job, metrics) if live is not None else None
    if joining:
        live_training.join()
    elif live is not None:
        live.commit()  # a founder: every member has built its engine (from rank 0's model)
    try:
        result = train_loop(job, metrics, on_record, live_training)
    except TrainingStopped:  # on a signal, with a checkpoint: the records so far are complete
        metrics.close()
        raise
    except BaseException:
        metrics.close(failed=True)
        raise
    metrics.close()
    return _finish(job, result, checkpoint)


def _build_net(cfg: TrainConfig, data: Datasets, device: torch.device) -> nn.Module:
    """The same initial model on every worker, on ``device``."""
    torch.manual_seed(cfg.seed)
    net = build_model(cfg.model, data.input_shape, data.num_classes).to(device)
    if cfg.channels_last:
        net = net.to(memory_format=torch.channels_last)
    if cfg.compile:
        net.compile()  # in place: parameter names and the saved state_dict stay those of the plain model
    return net


def _schedule_length(cfg: TrainConfig, data: Datasets, run_world: int) -> tuple[int, int]:
    """(steps per epoch, steps in all) of a run that started with ``run_world`` workers."""
    run_batch_size = cfg.batch_size_per_worker(run_world)
    steps_per_epoch = max(1, data.micro_batches_per_epoch(run_batch_size, run_world) // cfg.accum_steps)
    total_steps = cfg.steps or math.ceil(cfg.epochs * steps_per_epoch)
    cfg.check_phases_fit(total_steps, f"{total_steps} steps ({cfg.epochs:g} epochs of {steps_per_epoch} steps)")
    return steps_per_epoch, total_steps


def _info(job: Job) -> dict[str, Any]:
    """Facts about the run, logged once at its start."""
    world = dist.get_world_size()
    trainable = [p for p in job.algo.net.parameters() if p.requires_grad]
    return {
        "world_size": world,
        "model/parameters": sum(p.numel() for p in trainable),
        "memory/params_mib": round(held_bytes(list(job.algo.net.parameters())) / 2**20, 3),  # this rank's (shards)
        "data/train_samples": job.data.train_size,
        **job.data.shard_summary(world, job.batch_size),
        "batch_size": job.batch_size,
        "precision": job.cfg.precision,
        "steps": job.total_steps,
        **job.algo.info(),
    }


TRAINING_ENTRIES = ("train/loss", "train_time_s", "throughput/samples_per_s", "wall_time_s")


def _trained_before(path: Path, steps: int) -> dict[str, Any]:
    """``result.json``'s numbers of the training, from the launch that trained this run to ``steps`` in this
    directory: a launch resumed at the end only evaluates, and must not replace them with nothing (the same command
    again, or a sweep run again to finish its other jobs). Empty where there is none (``resume=`` into a new
    directory: they stay null)."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(earlier, dict) or earlier.get("steps") != steps:
        return {}
    return {key: earlier[key] for key in TRAINING_ENTRIES if earlier.get(key) is not None}


def _finish(job: Job, result: dict[str, Any], checkpoint: Checkpoint | None) -> dict[str, Any]:
    """Complete the loop's result; rank 0 writes it and the (averaged) model."""
    world, algo, run_dir = dist.get_world_size(), job.algo, job.run_dir
    result |= {"world_size": world, "algorithm": algo.name, "model_path": str(run_dir / MODEL_FILE),
               **model_shape(job.data.input_shape, job.data.num_classes)}
    if checkpoint is not None and checkpoint.world_size != world:
        result["resumed_from_world_size"] = checkpoint.world_size
    result["topology"] = algo.topology_name
    model = algo.full_state_dict()  # every rank: a sharded model is gathered
    if dist.get_rank() == 0:
        save_model(run_dir, model)
        trained = result["resumed_from_step"] < result["steps"]  # else resumed from the final checkpoint
        if not trained:
            result |= _trained_before(run_dir / RESULT_FILE, result["steps"])
        (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
        speed = f"{result['throughput/samples_per_s']:.0f} samples/s" if trained else "nothing left to train"
        logger.info(f"done: eval/accuracy {result['eval/accuracy']:.4f}, {speed}")
    return result
