"""``algorithm=decentralized``: the engine steps inside backward and gossips with the topology's neighbours, or runs
``phases``: gossip and the engine's own gradient all-reduce, switched at step boundaries."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from decent_train.algorithms.base import Algorithm, register
from decent_train.components.metrics import allreduce_bytes_per_step, gossip_bytes_per_step
from decent_train.components.optim import make_optim_fn
from decent_train.config import TrainConfig
from decent_train.engine.ddp import DecentralizedDataParallel
from decent_train.engine.optimizers import LRSchedulerFn


@register("decentralized")
class Decentralized(Algorithm):
    """The decentralized engine over ``cfg.topology`` (or ``cfg.phases``)."""

    def __init__(
        self, net: nn.Module, cfg: TrainConfig, schedule: LRSchedulerFn, scaler: torch.amp.GradScaler, steps_taken: int,
        from_rank0: bool = True,
    ) -> None:
        """``from_rank0=False``: a worker joining a running job (live membership), which loads a peer's state."""
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
            fault_tolerant=cfg.fault_tolerance.live,
            from_rank0=from_rank0,
            **cfg.compression.engine_kwargs(),
        )
        self.model, self.net = self.engine, net
        self._topology_name = cfg.topology.name

    def phase_at(self, steps_taken: int) -> int:
        """The phase the engine is in after ``steps_taken`` steps (it switches just before a phase's first step)."""
        return max([i for i, (start, _) in enumerate(self.phase_starts) if start < steps_taken], default=0)

    def begin_step(self, steps_taken: int) -> bool:
        following = self.phase + 1
        if following < len(self.phase_starts) and self.phase_starts[following][0] == steps_taken:
            self.phase = following
            self.engine.switch_to(self.phase_starts[following][1])
            return True
        return False

    @property
    def phase_name(self) -> str:
        return self.phase_starts[self.phase][1]

    @property
    def topology_name(self) -> str | None:
        return self._topology_name

    def state_dict(self) -> dict[str, Any]:
        return self.engine.engine_state_dict()

    @staticmethod
    def averageable_state(state: dict[str, Any]) -> dict[str, Any]:
        return DecentralizedDataParallel.averageable_state(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_engine_state_dict(state)

    def prepare_membership_change(self) -> None:
        self.engine.prepare_membership_change()

    def membership_changed(self, topology: str, local_world_size: int) -> None:
        self.engine.membership_changed(topology, local_world_size)
        self._topology_name = topology

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.engine.no_sync()

    def step(self) -> None:
        """Nothing left to do: each bucket stepped during backward."""

    def lr(self) -> float:
        return self.engine.get_lr()

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self.engine.optimizers

    def comm_wait_seconds(self) -> float | None:
        return self.engine.comm_wait_seconds

    def late_buckets(self) -> int | None:
        return self.engine.late_buckets

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
        self.engine.global_avg(will_revert=True)
        try:
            yield
        finally:
            self.engine.revert_global_avg()

    def average(self) -> None:
        self.engine.global_avg(will_revert=False)
