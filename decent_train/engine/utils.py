"""Process-group setup for scripts launched by torchrun (decent-dp's ``initialize_dist``, without its pitfalls)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["initialize_dist"]


def initialize_dist() -> tuple[int, int]:
    """Initialize torch.distributed from torchrun's environment and return ``(rank, world_size)``.

    With CUDA: NCCL, one device per local rank (``torch.cuda.set_device(LOCAL_RANK)``). Without: gloo.
    """
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
            dist.init_process_group(backend="nccl")
        else:
            dist.init_process_group(backend="gloo")
    return dist.get_rank(), dist.get_world_size()
