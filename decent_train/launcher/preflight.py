"""Checks that look past the config's values, run once by the launcher before any worker starts.

``check_config`` checks values and their combinations (cheap, and again in every worker); what needs the disk, the
user's code or every world size an elastic job may run at is here, so that a mistake still ends in one line with
exit status 2 instead of a failed worker: the run directory takes files, the dataset's files (npz: their arrays'
shapes and labels, and that the model takes their samples), the partition against each world size, the
micro-batch (tokens: one window) against the smallest worker's training shard at each world size
(``check_batches``), importing ``topology.module``, building every topology the run gossips over, the checkpoints
the run continues (``resume``'s, or the run directory's own with unchanged settings: ``check_continuation``; every
rank's file against its manifest's checksum), and the engine's environment variables (``DECENT_TRAIN_HOST_MALLOC``,
``DECENT_TRAIN_COMPILED_INT8``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from decent_train.components.checkpoint import (
    CHECKPOINTS, FRESH_FLAG, complete_checkpoints, describe_unreadable, verify_checkpoint,
)
from decent_train.components.data import ShardTooSmall
from decent_train.components.models import ModelConfig, build_model
from decent_train.config import RESOLVED_CONFIG, TrainConfig
from decent_train.engine import reconfigure
from decent_train.engine.host_memory import host_malloc_choice
from decent_train.engine.int8_kernels import compiled_int8_choice
from decent_train.training.resume import resume_settings


def preflight(cfg: TrainConfig) -> None:
    """Raise ``ValueError`` (one line, naming the bad value) if ``cfg`` cannot run; ``launch.nproc_per_node`` must be
    resolved (the launcher does that first) for the checks over world sizes."""
    if cfg.resume == "":  # (it would name the working directory)
        raise ValueError("resume= is empty; give resume=RUN_DIR, the run directory to continue from, or leave it out")
    check_run_dir(cfg)
    check_continuation(cfg)
    cfg.dataset.check_files()
    check_model_input(cfg)
    host_malloc_choice(), compiled_int8_choice()  # the engine's environment variables
    if cfg.launch.nproc_per_node is not None:
        cfg.dataset.check_partition(cfg.launch.world_sizes)
        if not cfg.fault_tolerance.live:  # live: check_live, over every number of members
            check_batches(cfg, cfg.launch.world_sizes)
        check_topologies(cfg)
    if cfg.resume is not None:
        check_resume(cfg, Path(cfg.resume), f"resume={cfg.resume}")
    check_fragments(cfg)
    if cfg.fault_tolerance.live:
        check_live(cfg)


def check_run_dir(cfg: TrainConfig) -> None:
    """The run directory takes files. Hydra makes it before the job runs (the launcher turns its error into one
    line); one that already existed may still refuse writes (read-only, a full disk: Hydra writes nothing there first,
    conf/train.yaml sets hydra.output_subdir=null), which would fail later, after the workers started, so a small file
    is written and removed."""
    run_dir = Path(cfg.run.output_dir) if cfg.run.output_dir else None
    if run_dir is None or not run_dir.is_dir():
        return
    probe = run_dir / f".write_check.{os.getpid()}"
    try:
        probe.write_bytes(bytes(4096))
    except OSError as error:
        raise ValueError(f"hydra.run.dir: cannot write {run_dir} ({error.strerror or error}); give "
                         "hydra.run.dir=<a directory you can write to>") from None
    finally:
        probe.unlink(missing_ok=True)  # a full disk may have let it be made, empty


# What a relaunch may change and still be the same run: how and where it runs, logs, checkpoints and evaluates, and
# the engine's bucket layout; every other key changes what is trained.
RUN_INDEPENDENT = ("launch", "logger", "checkpoint", "fault_tolerance", "run", "resume", "dry_run", "eval_every",
                   "eval_batch_size", "comm_timeout_s", "pg_timeout_s", "bucket_size_mb", "message_size_mb",
                   "dataset.loader_workers", "dataset.download")


def check_continuation(cfg: TrainConfig) -> None:
    """A launch into a run directory that holds checkpoints continues from them (a crash, a requeued SLURM job, the
    same command again): only with the settings they were trained with (its ``resolved_config.yaml``), unless
    ``resume=`` names that directory. A new experiment sent to an old directory would otherwise train on from the
    old model, or find it finished and report the old run's result as its own, with exit 0. ``resume=`` naming
    another directory is refused there too: the workers would continue this one's checkpoints instead."""
    run_dir = Path(cfg.run.output_dir) if cfg.run.output_dir else None
    if run_dir is None or not (run_dir / CHECKPOINTS).is_dir() or cfg.resume == str(run_dir):
        return  # resume= naming it: check_resume checks it
    unreadable: list[tuple[Path, str]] = []
    checkpoints = complete_checkpoints(run_dir, unreadable)
    if not checkpoints and not unreadable:
        return
    newest = f"newest: step {checkpoints[0].step}" if checkpoints else "none readable"
    here = f"hydra.run.dir={run_dir} holds checkpoints ({newest})"
    if cfg.resume is not None:
        raise ValueError(f"{here}, which the workers would continue instead of resume={cfg.resume}; give another "
                         f"hydra.run.dir to start from resume={cfg.resume}, or resume={run_dir} to continue this run")
    changed = changed_settings(run_dir / RESOLVED_CONFIG, OmegaConf.to_container(OmegaConf.structured(cfg)))
    if changed:
        raise ValueError(f"{here} of a run with other settings ({changed}); to continue it with these, add "
                         f"resume={run_dir}; to start a new run, give another hydra.run.dir")
    check_resume(cfg, run_dir, f"hydra.run.dir={run_dir}")


def changed_settings(saved_config: Path, config: Any) -> str:
    """The keys outside :data:`RUN_INDEPENDENT` whose values in ``config`` differ from ``saved_config``'s, as
    ``key=new (was old)``, at most three named; keys only one side has are a newer or older decent-train's, not the
    user's change. A missing or unreadable file says so: nothing tells what its checkpoints were trained with."""
    try:
        saved = OmegaConf.to_container(OmegaConf.load(saved_config))
    except (OSError, ValueError) as error:
        return f"{saved_config.name} cannot be read: {getattr(error, 'strerror', None) or error}"
    old, new = _flatten(saved), _flatten(config)
    changed = [f"{key}={new[key]} (was {old[key]})" for key in new
               if key in old and old[key] != new[key] and not _run_independent(key)]
    return ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")


def _run_independent(key: str) -> bool:
    return key in RUN_INDEPENDENT or key.startswith(tuple(f"{independent}." for independent in RUN_INDEPENDENT))


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def check_model_input(cfg: TrainConfig) -> None:
    """The model takes the dataset's samples, where only the files say their shape (npz): built and run on the meta
    device (no memory, no computation) instead of failing in every worker."""
    sample_shape = cfg.dataset.kind.sample_shape
    if sample_shape is None:
        return
    shape = sample_shape(cfg.dataset)
    try:
        with torch.device("meta"):
            build_model(cfg.model, shape, 2)(torch.empty(2, *shape))
    except (ValueError, RuntimeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"dataset.root={cfg.dataset.root}: samples of shape {list(shape)} do not fit "
                         f"model={cfg.model.name}: {reason}") from None


def check_live(cfg: TrainConfig) -> None:
    """``fault_tolerance=live`` needs torch's reconfigurable process groups, and the data must shard over every
    number of members the run may have (from ``fault_tolerance.min_workers`` to every node's workers). Any
    topology the launch can gossip over is taken (``check_topologies``), two-stage ``hierarchical`` too for the
    engine's uncompressed gossip: a change lays it out over the nodes that remain or falls back
    (``TrainConfig.live_layout``); the local steps' outer exchange and compressed gossip, which no replay covers with
    two stages across a loss, still take one-stage rounds."""
    if cfg.launch.nproc_per_node is not None:
        most = cfg.launch.max_nodes * cfg.launch.nproc_per_node  # every node's workers
        cfg.dataset.check_partition(list(range(cfg.fault_tolerance.min_workers, most + 1)))
        check_batches(cfg, list(range(cfg.fault_tolerance.min_workers, most + 1)), live=True)
        untested = (f"algorithm={cfg.algorithm.name}" if cfg.algorithm.name != "decentralized"
                    else f"compression={cfg.compression.name}" if cfg.compression.name != "none" else None)
        if untested and cfg.build_topology(world_size=most).is_staged:
            raise ValueError(f"fault_tolerance=live with {untested} and topology={cfg.topology.name}: two-stage "
                             "rounds are replayed across a change only for uncompressed gossip "
                             "(algorithm=decentralized compression=none); take a one-stage topology (complete, ring, "
                             "one-peer-exp, alternating-exp-ring)")
    if not reconfigure.supported():
        raise ValueError(f"fault_tolerance=live needs torch >= 2.14 (reconfigurable process groups); this is torch "
                         f"{torch.__version__}")


def check_batches(cfg: TrainConfig, world_sizes: list[int], live: bool = False) -> None:
    """One micro-batch fits the smallest worker's training shard at each of ``world_sizes``, by the worker's own
    computation on the data's count and labels, not its samples (``DatasetConfig.check_batches``, which says what it
    leaves to the worker). The micro-batch is ``batch_size_per_worker`` of that world size, or with ``live`` of the
    launch's, which the members keep through every change. ``parallel.shard`` changes nothing: every rank of a
    replica takes micro-batches of its own shard, dealt over all the ranks. Where ``global_batch_size`` set the
    micro-batch, the refusal names it and its bound."""
    launched = cfg.launch.world_size if live else None
    try:
        cfg.dataset.check_batches([(world, cfg.batch_size_per_worker(launched or world)) for world in world_sizes])
    except ShardTooSmall as error:
        if cfg.global_batch_size is None:
            raise
        per_step = (launched or error.world) * cfg.accum_steps
        raise ValueError(
            f"global_batch_size={cfg.global_batch_size} is batch_size={error.batch_size} per worker "
            f"({launched or error.world} workers x accum_steps={cfg.accum_steps}{' as launched' if live else ''}), "
            f"larger than {error.where}; valid: global_batch_size <= {error.shard * per_step}"
        ) from None


def check_topologies(cfg: TrainConfig) -> None:
    """Every topology the run gossips over (its own, its phases') can be laid out at every world size it may have."""
    names = cfg.gossip_topologies()
    if names:
        cfg.topology.import_module()  # its own error, not one per topology
    for name in sorted(names):
        for world_size in cfg.launch.world_sizes:  # an elastic job's every size
            try:
                cfg.build_topology(name, world_size)
            except ValueError as error:
                raise ValueError(f"topology={name} with {world_size} workers: {error}") from None


def check_resume(cfg: TrainConfig, directory: Path, named: str) -> None:
    """``directory`` (``resume``'s, or the run directory a launch continues; ``named`` says which in the line) holds
    a complete checkpoint that every rank's files match (its manifest's checksums) and whose
    floating-point tensors are finite (a diverged state is skipped like a corrupt file: the newest such checkpoint is
    what the workers continue from), trained with this run's world size, schedule, model, algorithm,
    optimizer, LR schedule and compression (``resume_settings``: what the saved state's layout depends on). None
    readable: one line naming each one tried and why, unless ``checkpoint.fresh_if_unreadable`` (then the workers
    start from step 0 and say so)."""
    if not directory.is_dir() and not cfg.checkpoint.fresh_if_unreadable:  # a typo, most likely
        raise ValueError(f"{named}: no such directory; give the run directory to continue (the one that "
                         f"holds checkpoints/), or add {FRESH_FLAG} to train from step 0 if it is missing")
    unreadable: list[tuple[Path, str]] = []
    checkpoints = complete_checkpoints(directory, unreadable)
    settings = resume_settings(cfg)
    for checkpoint in checkpoints:
        if cfg.launch.nproc_per_node is not None:
            mismatch = checkpoint.describe_mismatch(cfg.launch.world_size, cfg.schedule(), cfg.model.architecture(),
                                                    cfg.parallel.shard, settings)
        else:  # the world size is not known yet: what no world size changes (the workers check the rest)
            mismatch = checkpoint.describe_settings_mismatch(settings, same_layout=False)
        if mismatch:
            raise ValueError(f"{named}: {mismatch}")
        why = verify_checkpoint(checkpoint)
        if not why:
            return  # the workers warn, one line each, about the newer ones they skip
        unreadable.append((checkpoint.path, why))
    if not cfg.checkpoint.fresh_if_unreadable:
        raise ValueError(describe_unreadable(named, unreadable))


def check_fragments(cfg: TrainConfig) -> None:
    """A fragment is a set of whole parameter tensors: ``algorithm.fragments`` may not exceed the model's trainable
    ones (an empty fragment would sync nothing at its steps)."""
    fragments = getattr(cfg.algorithm, "fragments", 1)
    if fragments <= 1:
        return
    tensors = trainable_tensors(cfg.model, cfg.dataset.is_tokens)
    if fragments > tensors:
        raise ValueError(
            f"algorithm.fragments={fragments}: model={cfg.model.name} has {tensors} trainable parameter tensors, so "
            f"at most {tensors} fragments"
        )


def trainable_tensors(model: ModelConfig, tokens: bool) -> int:
    """How many trainable parameter tensors ``model`` has (tied ones once, as ``parameters()`` yields them). Their
    number does not depend on the input's size or the number of classes, so any stands in for the dataset's."""
    input_shape = (8,) if tokens or model.name == "mlp" else (3, 8, 8)
    with torch.device("meta"):
        net = build_model(model, input_shape, 2)
    return sum(1 for p in net.parameters() if p.requires_grad)
