"""``algorithm=allreduce``: torch DistributedDataParallel with the same model, data, optimizer and schedule."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from decent_train.algorithms.base import Algorithm, register
from decent_train.components.metrics import allreduce_bytes_per_step
from decent_train.components.optim import make_optim_fn
from decent_train.config import TrainConfig
from decent_train.engine.optimizers import LRSchedulerFn
from decent_train.engine.schedule_resume import load_scheduler_state


@register("allreduce")
class AllReduce(Algorithm):
    """Gradients all-reduced in backward by torch DDP; the optimizer steps after it."""

    def __init__(
        self, net: nn.Module, cfg: TrainConfig, schedule: LRSchedulerFn, scaler: torch.amp.GradScaler, steps_taken: int
    ) -> None:
        self.scaler = scaler
        device = next(net.parameters()).device
        device_ids = [device] if device.type == "cuda" else None
        self.model = DistributedDataParallel(net, device_ids=device_ids, bucket_cap_mb=cfg.bucket_size_mb)
        self.net = net
        self.optimizer = make_optim_fn(cfg.optim)(list(net.named_parameters()))
        self.schedule, self.scheduler = schedule, schedule(self.optimizer)
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
        # After the optimizer's state: another schedule (steps=, warmup) sets the groups' LR to its own.
        load_scheduler_state(self.scheduler, state["scheduler"], self.schedule, {})
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

    def averaged(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # all-reduce keeps the workers' models equal

    def average(self) -> None:
        pass  # the workers' models are equal already
