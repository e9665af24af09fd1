"""Process-group setup for scripts launched by torchrun (decent-dp's ``initialize_dist``, without its pitfalls)."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist

__all__ = ["initialize_dist", "exit_without_teardown"]


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


def exit_without_teardown() -> NoReturn:
    """End a torchrun worker after ``destroy_process_group()`` with exit status 0: flush and skip the interpreter's
    teardown, where destroying gloo's threads rarely aborts a finished process with SIGABRT ("terminate called
    without an active exception"; seen in CI; pytorch PR #179291)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
