"""Continuing a run: find its checkpoint (this run's own after a restart, or ``cfg.resume``'s), restore a worker from
it, and, at another world size, start from the average of the saved workers with the data re-sharded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger
from torch import nn

from decent_train.algorithms.base import Algorithm
from decent_train.components.checkpoint import FRESH_FLAG, Checkpoint, describe_unreadable, load_latest_checkpoint
from decent_train.components.data import Datasets
from decent_train.config import TrainConfig


def load_checkpoint(
    cfg: TrainConfig, run_dir: Path, algorithm: type[Algorithm]
) -> tuple[Checkpoint | None, dict[str, Any] | None]:
    """The newest checkpoint every rank completed in ``run_dir``, else ``cfg.resume``'s, and this worker's state
    from it (the average of the saved workers' when the world size differs); (None, None) when there is none.

    Starting from step 0 when checkpoints exist but none can be read (or ``resume=`` holds none) would throw away what
    the user asked to continue, so that is a ``ValueError`` naming each one tried, unless
    ``checkpoint.fresh_if_unreadable`` says to start afresh. The launcher's preflight says the same before any worker
    starts; this is for files damaged since, for workers that torchrun restarts, and for the Python API."""
    tried: list[tuple[Path, str]] = []
    settings = resume_settings(cfg)
    checkpoint, state = load_latest_checkpoint(
        [run_dir] + ([Path(cfg.resume)] if cfg.resume else []), cfg.schedule(dist.get_world_size()),
        cfg.model.architecture(), prepare_average=lambda saved: _averageable(saved, algorithm),
        shard=cfg.parallel.shard, tried=tried, settings=settings,
    )
    if checkpoint is None and (tried or cfg.resume):
        line = describe_unreadable(f"resume={cfg.resume}" if cfg.resume else str(run_dir), tried)
        if not cfg.checkpoint.fresh_if_unreadable:
            raise ValueError(line)
        if dist.get_rank() == 0:
            logger.warning(f"{line.rpartition('; to train from step 0')[0]}; training from step 0 "
                           f"({FRESH_FLAG})")
    return checkpoint, state


def resume_settings(cfg: TrainConfig) -> dict[str, Any]:
    """What a resume must match besides the topology and the model, as overrides (key -> value): what the saved
    state's layout depends on. Another algorithm, optimizer or schedule fails while loading (or, adamw for
    accum_adamw, trains on silently from the other's moments); a local-steps algorithm keeps its anchors and counters
    per fragment; the engine saves compressed gossip's public copies and the messages received, sized by the
    compressor (int8: by its block). Hyperparameters (lr, weight_decay, steps, consensus_step) are not here: they
    change on purpose."""
    settings: dict[str, Any] = {"algorithm": cfg.algorithm.name, "optim": cfg.optim.name,
                                "scheduler": cfg.scheduler.name, "compression": cfg.compression.name}
    fragments = getattr(cfg.algorithm, "fragments", None)  # local steps (diloco, localsgd) only
    if fragments is not None:
        settings["algorithm.fragments"] = fragments
    if cfg.compression.name == "int8":
        settings["compression.int8_block"] = cfg.compression.int8_block
    return settings


def restore(
    algo: Algorithm, checkpoint: Checkpoint, state: dict[str, Any], cfg: TrainConfig, data: Datasets,
    batch_size: int, device: torch.device,
) -> int:
    """Continue from ``state`` (read from ``checkpoint``); the micro-batches of this worker's stream to skip, at
    ``batch_size`` per micro-batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    start_step = checkpoint.step
    same = checkpoint.same_layout(world, cfg.parallel.shard)
    if state["model"] is None:  # a sharded model: its model and optimizer are the replicas' DCP checkpoints
        saved_replicas = checkpoint.world_size // checkpoint.shard
        algo.load_sharded_state(checkpoint.path, [rank // checkpoint.shard] if same else list(range(saved_replicas)))
    else:
        _check_fits(algo.net, state["model"], checkpoint.path)
    _restore(algo, state, device)
    data_start = state.get("data_position", start_step * cfg.accum_steps)
    if checkpoint.world_size == world:
        averaged = "" if same else f", from the average of its replicas (parallel.shard was {checkpoint.shard})"
        logger.info(f"resumed from {checkpoint.path} (step {checkpoint.step}){averaged}")
        return data_start
    saved_batch_size = state.get("batch_size") or cfg.batch_size_per_worker(checkpoint.world_size)
    old, new = (checkpoint.world_size, saved_batch_size), (world, batch_size)
    data_start = resharded_start(data, data_start, old, new)
    torch.manual_seed(cfg.seed + rank + 1_000_003 * start_step)  # fresh per worker: the files' were N others'
    logger.info(
        f"resumed step {start_step} from {checkpoint.world_size} workers' checkpoint on {world} workers: "
        f"models and optimizer states averaged ({checkpoint.path})"
    )
    return data_start


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


def _restore(algo: Algorithm, state: dict[str, Any], device: torch.device) -> None:
    """Continue from a checkpoint's state: the model, the algorithm's state and the random number generators (not
    from an average of other workers' states: each worker's generators were its own)."""
    if state["model"] is not None:
        algo.net.load_state_dict(state["model"])
    averaged_from = state.get("averaged_from")
    algorithm_state = state["algorithm"]
    algo.load_state_dict({**algorithm_state, "averaged_from": averaged_from} if averaged_from else algorithm_state)
    if not averaged_from:
        torch.set_rng_state(state["rng"])
        if device.type == "cuda" and state["cuda_rng"] is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], device)


def _averageable(state: dict[str, Any], algorithm: type[Algorithm]) -> dict[str, Any]:
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
