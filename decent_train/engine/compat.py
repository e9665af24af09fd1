"""decent-dp 0.2.3 compatibility: its module names and helpers, so its users' scripts run after the import swap.

``decent_train.ddp`` and ``decent_train.utils`` are this module, ``decent_train.optim`` the engine's optimizers and
``decent_train.topo`` its topologies (decent_train/__init__.py names them so when they are first imported).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from decent_train.engine import optimizers, topology
from decent_train.engine.ddp import DecentralizedDataParallel
from decent_train.engine.optimizers import LRSchedulerFn, OptimFn
from decent_train.engine.topology import Topology, TopologyReg  # decent_dp.ddp imports them too: a script may also

__all__ = [
    "DecentralizedDataParallel", "LR_SCHEDULER_FN_TYPE", "OPTIM_FN_TYPE", "Topology", "TopologyReg", "initialize_dist",
]

OPTIM_FN_TYPE = OptimFn
LR_SCHEDULER_FN_TYPE = LRSchedulerFn


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
