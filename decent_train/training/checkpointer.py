"""Saving every worker's state: when, and what."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from loguru import logger

from decent_train.components.checkpoint import NonFiniteState, save_checkpoint
from decent_train.config import DIVERGED_FILE
from decent_train.training.job import Job
from decent_train.training.resume import resume_settings


class Checkpointer:
    """Saves every ``checkpoint.every`` steps and after the last (``checkpoint.every=0``: only after the last)."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def should_save(self, step: int) -> bool:
        every = self.job.cfg.checkpoint.every
        return step == self.job.total_steps or (every > 0 and step % every == 0)

    def save(self, step: int) -> Path:
        """This worker's state at ``step`` (the caller has checked the loss is finite; ``save_checkpoint`` checks the
        state: if it holds NaN or inf it is not saved, and the run stops as after a NaN loss, restarts included)."""
        job, cfg = self.job, self.job.cfg
        sharded = job.algo.sharded_state()  # a sharded model and its optimizer: DCP's, per replica
        state = {
            "step": step,
            "data_position": job.data_start + (step - job.data_step) * cfg.accum_steps,  # micro-batches taken
            "batch_size": job.batch_size,
            "model": job.algo.net.state_dict() if sharded is None else None,
            "algorithm": job.algo.state_dict(),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(job.device) if job.device.type == "cuda" else None,
        }
        try:
            path = save_checkpoint(job.run_dir, step, state, cfg.schedule(dist.get_world_size()),
                                   cfg.model.architecture(), cfg.checkpoint.keep, job.run_world,
                                   before_gather=job.fence, sharded=sharded, settings=resume_settings(cfg))
        except NonFiniteState as error:  # workers torchrun restarts must not train into it again
            if dist.get_rank() == 0:
                (job.run_dir / DIVERGED_FILE).write_text(f"{error}\n")
            raise
        logger.debug(f"checkpoint {path}")
        return path
