"""``parallel.shard`` = K > 1: FSDP2 inside each replica of K consecutive workers, and across the replicas per-step
gossip of the shards (``algorithm=decentralized``: the ``Gossip`` front of ``step_gossip.py``) or local steps with an
outer step over the topology (``algorithm=diloco``, ``localsgd``: the fronts of ``local_steps.py``).

The model is ``fully_shard``ed per block (``components.models.shard_units``) over the mesh's shard dimension, the
config's optimizer steps the DTensor parameters after backward (FSDP2 has averaged the gradients inside the replica
by then), and the front exchanges each rank's shard with the same shard of the replicas the topology pairs its
replica with. ``parallel.mixed_precision`` is FSDP2's ``MixedPrecisionPolicy`` on every ``fully_shard``: it sets what
the replica's all-gathers and reduce-scatters carry; the shards, and so the exchange, keep the parameters' dtype. Checkpoints: the model, the optimizers and DiLoCo's anchors, sharded, by torch.distributed.checkpoint
(DCP) per replica; the rest (the schedule, the front's counters and exchange in flight, the generators) in each rank's
file as for every algorithm.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, get_state_dict, set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from decent_train.algorithms.local_steps_algorithms import DiLoCoAlgorithm, FrontAlgorithm, LocalSGDAlgorithm
from decent_train.algorithms.step_gossip import Gossip
from decent_train.components.checkpoint import ShardedState
from decent_train.components.metrics import ConsensusProbe
from decent_train.components.models import shard_units
from decent_train.components.state_average import all_reduce_in_chunks, floating_tensors
from decent_train.config import TrainConfig
from decent_train.engine.membership import average_tensors_, local_part
from decent_train.engine.optimizers import LRSchedulerFn
from decent_train.engine.schedule_resume import load_scheduler_state

__all__ = ["ShardedFront", "ShardedGossip", "ShardedDiLoCo", "ShardedLocalSGD", "SHARDED", "shard_model",
           "mixed_precision_policy"]


def shard_model(net: nn.Module, shard_mesh: Any, policy: MixedPrecisionPolicy | None = None) -> None:
    """``fully_shard`` each of ``net``'s units, then ``net`` itself (its remaining parameters: embeddings, the head),
    all with ``policy``. A policy that casts parameters would hand BatchNorm bf16 weights beside its fp32 statistics,
    which its kernels refuse: each BatchNorm is then a unit of its own in its own dtype (FSDP1's default)."""
    policy = policy or MixedPrecisionPolicy()
    if policy.param_dtype is not None:
        for norm in [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]:
            fully_shard(norm, mesh=shard_mesh)  # the default policy: no casts
    for unit in shard_units(net):
        if not isinstance(unit, FSDPModule):
            fully_shard(unit, mesh=shard_mesh, mp_policy=policy)
    fully_shard(net, mesh=shard_mesh, mp_policy=policy)


def mixed_precision_policy(cfg: TrainConfig) -> MixedPrecisionPolicy:
    """``parallel.mixed_precision`` as FSDP2's policy. The shards it keeps (what the optimizer steps and the front
    gossips) stay in their own dtype; only the replica's all-gathers and reduce-scatters change."""
    param_dtype, reduce_dtype = cfg.parallel.fsdp_dtypes(cfg.precision)
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


class ShardedFront(FrontAlgorithm):
    """A front's algorithm over replicas of an FSDP2-sharded model: the mesh, the sharding, and what differs from
    whole models (evaluation's average, consensus, checkpoints, the final model). See the module."""

    def __init__(
        self, net: nn.Module, cfg: TrainConfig, schedule: LRSchedulerFn, scaler: torch.amp.GradScaler, steps_taken: int
    ) -> None:
        shard = cfg.parallel.shard
        device = next(net.parameters()).device
        self.mesh = init_device_mesh(device.type, (dist.get_world_size() // shard, shard),
                                     mesh_dim_names=("replicate", "shard"))
        self.shard_group = self.mesh.get_group(1)
        shard_model(net, self.mesh["shard"], mixed_precision_policy(cfg))
        super().__init__(net, cfg, schedule, scaler, steps_taken)

    def _front_kwargs(self, cfg: TrainConfig) -> dict[str, Any]:
        return super()._front_kwargs(cfg) | {"mesh": self.mesh}

    def consensus_over(self, tensors: list[Tensor], samples: int, seed: int) -> ConsensusProbe:
        """The replicas' distance, from each rank's shards (the mean over the ranks holding the same shard)."""
        members = self.front.members
        return ConsensusProbe(tensors, samples, seed=seed, group=members.replicate_group, replicas=members.replicas)

    @property
    def lockstep_group(self) -> dist.ProcessGroup | None:
        return self.shard_group  # a replica's ranks gather parameters together: their forwards pair up

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return _without_gradient_sync(self.net)

    def info(self) -> dict[str, Any]:
        members = self.front.members
        return {"parallel/shard": members.shard, "parallel/replicas": members.replicas, **super().info()}

    # -- evaluation and the final model ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        params, buffers = self._shards(), self._buffers()
        saved = [t.clone() for t in params + buffers]
        self._average(params, buffers, "the evaluation's average of the models")
        try:
            yield
        finally:
            torch._foreach_copy_(params + buffers, saved)

    def average(self) -> None:
        self._average(self._shards(), self._buffers(), "the final average of the models")

    def _shards(self) -> list[Tensor]:
        return [local_part(p) for p in self.net.parameters()]

    def _buffers(self) -> list[Tensor]:
        return [b for b in self.net.buffers() if b.is_floating_point()]

    def _average(self, shards: list[Tensor], buffers: list[Tensor], what: str) -> None:
        """Shards over the replicas; floating buffers (BatchNorm's statistics: FSDP2 leaves them whole, each rank
        updating its own) over every rank, one all-reduce per dtype; integer ones (``num_batches_tracked``) stay each
        rank's own."""
        self.front.members.average_tensors_(shards, what)
        average_tensors_(buffers, dist.get_world_size(), what)

    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole model (gathered from the shards) on rank 0, on the CPU; others get an empty dict. Collective."""
        return get_model_state_dict(self.net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """All but the sharded tensors (``sharded_state``, DCP's: the model, the optimizers' state, the anchors), and
        this rank's buffers: FSDP2 leaves them whole, and each rank of a replica updates its own (BatchNorm's
        statistics of its micro-batches), where DCP would keep one copy per replica."""
        state = super().state_dict()
        state["inner"] = None
        state["front"] |= {"anchors": None, "outer": None}
        state["buffers"] = {name: b.detach().clone() for name, b in self.net.named_buffers()}
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After ``load_sharded_state``: the front restarts an exchange due from the anchors loaded there. The buffers
        are this rank's own (an averaged resume: every saved rank's average)."""
        # After the optimizer's state: another schedule (steps=, warmup) sets the groups' LR to its own.
        load_scheduler_state(self.scheduler, state["scheduler"], self.schedule, {})
        self.scaler.load_state_dict(state["scaler"])
        for name, value in state["buffers"].items():
            self.net.get_buffer(name).copy_(value)
        self.front.load_state_dict(state["front"])

    def sharded_state(self) -> ShardedState:
        members = self.front.members
        return ShardedState(self._dcp_state(), members.replica, members.first_of_shard, members.shard,
                            self.shard_group)

    def _dcp_state(self) -> dict[str, Any]:
        """The sharded tensors as DTensors, keyed by parameter name: views of the live ones (DCP loads in place)."""
        model, optim = get_state_dict(self.net, self.inner)
        state: dict[str, Any] = {"model": model, "optim": optim}
        outer = self.front.outer
        if outer is not None:
            state["outer"] = get_optimizer_state_dict(self.net, outer)
            anchors = dict(zip(
                [name for name, p in self.net.named_parameters() if p.requires_grad], self.front.anchors()
            ))
            params = dict(self.net.named_parameters())
            state["anchors"] = {name: _like(params[name], anchor) for name, anchor in anchors.items()}
        return state

    def load_sharded_state(self, directory: Path, replicas: list[int]) -> None:
        """The model and optimizer state from the DCP checkpoints of ``replicas`` in ``directory`` (several: their
        average, in float64 as the other algorithms' averaged resume; a replica's may have been saved with another
        number of shards: DCP reshards). Before ``load_state_dict``: nothing may be in flight.

        Averaged by several replicas, each loads its share (saved replica k by replica k mod R) and one all-reduce
        over the ranks of its position adds the shares: a saved replica is read by one replica, not by every one. A
        replica without a share loads one for what is not averaged (integer step counts) and adds zeros."""
        members = self.front.members
        split = len(replicas) > 1 and members.replicas > 1
        mine = replicas[members.replica::members.replicas] if split else replicas
        with self.front.suspended():  # DCP's optimizer-state template steps the optimizer once (lr 0): not a step
            sums: list[Tensor] = []
            for replica in mine or [replicas[members.replica % len(replicas)]]:
                state = self._loaded_state(directory / f"replica{replica}")
                floats = floating_tensors(state)
                if not sums:  # no share: zeros of the same layout
                    sums = [local_part(t).to(torch.float64, copy=True) if mine
                            else torch.zeros_like(local_part(t), dtype=torch.float64) for t in floats]
                else:
                    for total, value in zip(sums, floats):
                        total.add_(local_part(value))
            if split:
                all_reduce_in_chunks(sums, f"averaging the saved replicas' states (from {directory})",
                                     group=members.data_group, timeout=members.timeout)
            for total, value in zip(sums, floats):
                local_part(value).copy_(total.div_(len(replicas)))
            set_state_dict(self.net, self.inner, model_state_dict=state["model"], optim_state_dict=state["optim"])
            if "outer" in state:
                set_optimizer_state_dict(self.net, self.front.outer, state["outer"])

    def _loaded_state(self, folder: Path) -> dict[str, Any]:
        """The sharded tensors (views of the live ones) with ``folder``'s DCP checkpoint loaded into them."""
        state = self._dcp_state()
        outer = {"outer": state.pop("outer")} if "outer" in state else {}
        dcp.load(state, checkpoint_id=folder, process_group=self.shard_group)
        if outer:  # partial: a fragment not synced yet had no momentum (the template's zeros act alike)
            dcp.load(outer, checkpoint_id=folder, process_group=self.shard_group,
                     planner=DefaultLoadPlanner(allow_partial_load=True))
        return state | outer


class ShardedGossip(ShardedFront):
    """``algorithm=decentralized``: per-step gossip of the shards."""

    name = "decentralized"

    def _build_front(self, cfg: TrainConfig, kwargs: dict[str, Any]) -> Gossip:
        return Gossip(self.net, self.inner, cfg.topology.name, **kwargs)

    def info(self) -> dict[str, Any]:
        members, topology = self.front.members, self.front.topology
        return {
            "parallel/shard": members.shard,
            "parallel/replicas": members.replicas,
            "topology/rounds": topology.describe(),
            "topology/period": topology.period,
            "topology/spectral_gap": topology.spectral_gap(),
        }

    def metrics(self) -> dict[str, Any]:
        return {}  # no outer steps, no anchors


class ShardedDiLoCo(ShardedFront, DiLoCoAlgorithm):
    """``algorithm=diloco`` over replicas of a sharded model: the outer optimizer steps the DTensor parameters."""


class ShardedLocalSGD(ShardedFront, LocalSGDAlgorithm):
    """``algorithm=localsgd`` over replicas of a sharded model."""


SHARDED: dict[str, type[ShardedFront]] = {
    "decentralized": ShardedGossip, "diloco": ShardedDiLoCo, "localsgd": ShardedLocalSGD,
}  # ``algorithm=`` -> its class over a sharded model (``parallel.shard`` > 1)


def _like(param: Tensor, local: Tensor) -> Tensor:
    """``local`` (this rank's part of a tensor shaped like ``param``) as a DTensor laid out like ``param``, sharing
    ``local``'s memory."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


@contextlib.contextmanager
def _without_gradient_sync(net: nn.Module) -> Iterator[None]:
    """FSDP2 keeps the micro-batch's gradients unreduced (accumulation) until the step's last backward."""
    assert isinstance(net, FSDPModule)
    net.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        net.set_requires_gradient_sync(True)
