"""The engine's modes: what a bucket does once its gradients are there. One small interface, two implementations.

``GossipMode``: mix with the neighbours' x^s, step, launch the exchange of x^{s+1} (inside backward, overlapped).
``AllReduceMode``: average the bucket's gradients (launched as the bucket completes), then step at the end of
backward as each sum arrives: torch DDP's algorithm with the same optimizer-in-bucket structure, so a switch between
modes and topologies keeps every optimizer and scheduler state.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from loguru import logger
from torch import Tensor
from torch.autograd.profiler import record_function

from decent_train.engine.buckets import Bucket, PendingExchange
from decent_train.engine.comm import CommWaits, first_line, peers_must_answer
from decent_train.engine.exchange import Exchanger, PeerMessages
from decent_train.engine.membership import Membership
from decent_train.engine.steps import BucketSteps
from decent_train.engine.topology import Edge, Topology

__all__ = ["ALLREDUCE", "AllReduceMode", "GossipMode", "Mode", "ModeContext", "Progress", "reduces_to_average"]

ALLREDUCE = "allreduce"
"""The engine's other mode (``topology="allreduce"``, ``switch_to("allreduce")``): each bucket's gradients are averaged
over all workers, then the bucket steps, so the workers stay equal (torch DDP's algorithm)."""


@dataclass
class Progress:
    """Where training is: optimizer steps taken (the round of the next mix), the mixing's damping, and where the step
    in progress is. (Set each step on this plain object, not on the engine: ``nn.Module.__setattr__`` costs a
    microsecond or more per set on autograd's thread.)"""

    step: int = 0
    adaptive_factor: float = 1.0
    armed: bool = False  # a training forward ran since the last step
    backward_started: bool = False
    next_bucket: int = 0  # buckets are processed strictly in index order (same on all ranks)


def profiled(name: str) -> contextlib.AbstractContextManager:
    """A named range for torch.profiler, only while a profiler records: making one costs host time on autograd's
    thread for every bucket of every step."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()


@dataclass
class ModeContext:
    """What every mode works with, shared with the engine."""

    members: Membership
    exchanger: Exchanger
    waits: CommWaits
    steps: BucketSteps
    progress: Progress
    param_as_bucket_view: bool
    fault_tolerant: bool = False  # a message that fails is replaced (Exchanger.settle) instead of raising
    missed: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (step, bucket, peer rank)

    def wait_works(self, works: list[Any], bucket: Bucket, ranks: list[int], what: str) -> None:
        def described() -> str:  # formatted only if the wait fails
            peers = [r for r in ranks if r != self.members.rank]
            return f"the {what} of bucket {bucket.index} with rank(s) {peers} at step {self.progress.step}"

        with peers_must_answer(described, self.members.timeout), profiled("decent_train.wait"):
            self.waits.wait(works, bucket.flat.device)

    def wait_pending(self, bucket: Bucket, dropping: bool = False) -> PendingExchange | None:
        """Complete the bucket's exchange in flight, if any, and take it off the bucket (``dropping``: it will not be
        mixed, so its missing messages are not listed in ``missed``)."""
        exchange, bucket.pending = bucket.pending, None
        if exchange is not None:
            edge = exchange.stages[exchange.async_stage]
            if self.fault_tolerant:
                self._wait_each(exchange.works, bucket, edge, exchange.value, note=not dropping)
            else:
                self.wait_works(exchange.works, bucket, edge.ranks, "exchange")
        return exchange

    def _wait_each(
        self, messages: list[PeerMessages], bucket: Bucket, edge: Edge, value: Tensor, note: bool = True
    ) -> None:
        """Wait for each peer's messages; one that fails (the peer died) is settled as missing, not raised."""
        failed = []
        for peer_messages in messages:
            try:
                with profiled("decent_train.wait"):
                    self.waits.wait([peer_messages], bucket.flat.device)
            except RuntimeError as error:
                failed.append(peer_messages)
                step, peer = self.progress.step, peer_messages.peer
                if not note:
                    continue
                if not any(p == peer for _, _, p in self.missed):
                    why = first_line(error).split(". This is typically")[0]  # gloo's advice: not for a dead peer
                    logger.warning(f"rank {self.members.rank}: no message from rank {peer} at step {step} (bucket "
                                   f"{bucket.index}): {why}; its weight stays here until the members change")
                self.missed.append((step, bucket.index, peer))
        self.exchanger.settle(bucket, edge, value, failed)

    def wait_stage(self, works: list[Any], bucket: Bucket, edge: Edge, value: Tensor) -> None:
        """A stage run in the foreground (a round's stages before or after its overlapped one): under
        ``fault_tolerant`` each peer's message is waited on alone and one that fails settles as missing, as in the
        overlapped stage (``Exchanger.settle`` also sums a group's messages into ``comm``, which no all-reduce does
        there); else the stage's works, failing on a peer that does not answer."""
        if self.fault_tolerant:
            self._wait_each(works, bucket, edge, value)
        else:
            self.wait_works(works, bucket, edge.ranks, "exchange")

    def complete_pending(self, bucket: Bucket) -> None:
        """Complete an exchange but keep it pending, so its data is still mixed in at the next step."""
        exchange = self.wait_pending(bucket)
        bucket.pending = dataclasses.replace(exchange, works=[]) if exchange is not None else None


class Mode(Protocol):
    """What the engine asks of a mode. Buckets come to each call strictly in index order, the same on all ranks."""

    label: str
    topology: Topology | None
    start: int  # the step the mode began at
    updates_in_backward: bool  # ``update`` may run as soon as a bucket's gradients are there

    def gradients_ready(self, bucket: Bucket) -> None:
        """Every gradient of ``bucket`` arrived during backward."""

    def gather(self, bucket: Bucket) -> None:
        """End of backward, before any deferred step: what the bucket's gradients still wait for."""

    def update(self, bucket: Bucket) -> None:
        """The bucket's update: its step, and any exchange around it."""


class AllReduceMode:
    """Average each bucket's gradients over all workers, then step."""

    label, topology, updates_in_backward = ALLREDUCE, None, False

    def __init__(self, context: ModeContext, start: int):
        self.context, self.start = context, start
        self.averages: dict[torch.device, bool] = {}  # by device: the collective averages (ReduceOp.AVG)

    def gradients_ready(self, bucket: Bucket) -> None:
        """Copy the bucket's gradients into one buffer (zeros for a parameter without one) and start their average:
        NCCL's AVG, else a division before the sum (``reduces_to_average``)."""
        members = self.context.members
        if members.world_size == 1:
            return
        views = bucket.gradient_views()
        device = bucket.grads.device
        if device not in self.averages:
            self.averages[device] = reduces_to_average(members.exchange_group, device)
        with torch.no_grad():
            for param, view in zip(bucket.params, views):
                view.copy_(param.grad) if param.grad is not None else view.zero_()
            if not self.averages[device]:
                bucket.grads.div_(members.world_size)
        op = dist.ReduceOp.AVG if self.averages[device] else dist.ReduceOp.SUM
        bucket.gradient_works = [dist.all_reduce(bucket.grads, op=op, group=members.exchange_group, async_op=True)]

    def gather(self, bucket: Bucket) -> None:
        """Wait for the bucket's gradient average; its slices become the parameters' gradients."""
        members = self.context.members
        if members.world_size == 1:
            return
        works, bucket.gradient_works = bucket.gradient_works, []
        self.context.wait_works(works, bucket, list(range(members.world_size)), "gradient all-reduce")
        for param, view in zip(bucket.params, bucket.gradient_views()):
            param.grad = view

    def update(self, bucket: Bucket) -> None:
        self.context.steps.step(bucket)


def reduces_to_average(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether ``group`` averages ``device``'s tensors in the collective (``ReduceOp.AVG``), saving a division kernel
    per bucket: torch's NCCL backend (``nccl``) on CUDA tensors, whose AVG scales each input by the reciprocal of the
    group's size before the sum, as the division does. gloo's AVG divides after the sum (a float16 sum can overflow),
    and other backends (nccl2: live membership's) are untried: they keep the division. Read from the group's
    configuration, no device work."""
    if device.type != "cuda":
        return False
    config = dist.get_backend_config(group)  # "cpu:gloo,cuda:nccl": each device type's backend
    backends = dict(item.split(":", 1) for item in config.split(",") if ":" in item)
    return backends.get("cuda") == "nccl"


class GossipMode:
    """Gossip over ``topology`` with rounds counted from step ``start``: x <- W x - U(grad), the exchange of the next
    x overlapped with the rest of backward and the next forward."""

    updates_in_backward = True

    def __init__(self, context: ModeContext, topology: Topology, start: int, consensus_step: float):
        self.context, self.topology, self.start = context, topology, start
        self.consensus_step = consensus_step
        rank, rounds = context.members.rank, range(topology.period)
        self.my_stages: list[list[Edge]] = [topology.edges(r, rank) for r in rounds]  # this worker's group per stage
        self.async_stages: list[int] = [topology.async_stage(r) for r in rounds]  # the stage overlapped, per round
        self.alone: list[bool] = [all(edge.size == 1 for edge in stages) for stages in self.my_stages]  # per round

    @property
    def label(self) -> str:
        return self.topology.describe()

    def round_of(self, step: int) -> int:
        return (step - self.start) % len(self.my_stages)

    def groups(self) -> list[Edge]:
        """This worker's groups of two or more over the period (each keeps its compressed copies)."""
        return [edge for stages in self.my_stages for edge in stages if edge.size > 1]

    def gradients_ready(self, bucket: Bucket) -> None:
        pass

    def gather(self, bucket: Bucket) -> None:
        pass

    def update(self, bucket: Bucket) -> None:
        """Mix with the neighbours' x^s, take the local step, launch the exchange of x^{s+1}. Called once per bucket
        per step on autograd's thread, where grad mode is off already and a profiler rarely records: the context
        managers are entered only where they do something."""
        if torch.is_grad_enabled():  # (the update thread's, or a caller's outside backward)
            with torch.no_grad():
                return self.update(bucket)
        round_ = self.round_of(self.context.progress.step + 1)
        if not torch._C._autograd._profiler_enabled():
            self.mix(bucket)
            self.context.steps.step(bucket)
            self.launch(bucket, round_)
            return
        with profiled("decent_train.mix"):
            self.mix(bucket)
        self.context.steps.step(bucket)
        with profiled("decent_train.launch"):
            self.launch(bucket, round_)

    def launch(self, bucket: Bucket, round_: int) -> None:
        """Start the exchange of x^{s+1} in round ``round_``: the stages before its overlapped stage now, that one in
        the background."""
        if self.alone[round_]:
            return
        stages, async_stage = self.my_stages[round_], self.async_stages[round_]
        bucket.read_params(self.context.param_as_bucket_view)
        exchanger, value = self.context.exchanger, bucket.flat
        for edge in stages[:async_stage]:
            works = exchanger.start(bucket, edge, value)
            self.context.wait_stage(works, bucket, edge, value)
            value = exchanger.finish(bucket, edge, value)
        works = exchanger.start(bucket, stages[async_stage], value)
        bucket.pending = PendingExchange(stages, async_stage, value, works)

    def resume_pending(self, bucket: Bucket, value: Tensor) -> None:
        """An exchange of this step's round whose data has arrived (a checkpoint's): mixed in at the next step."""
        round_ = self.round_of(self.context.progress.step)
        bucket.pending = PendingExchange(self.my_stages[round_], self.async_stages[round_], value, [])

    def mix(self, bucket: Bucket) -> None:
        """x <- (1 - a) x + a (W x), a being the adaptive factor: finish the exchange in flight, run the stages after
        it, and combine. One-stage rounds combine straight from ``comm`` (no extra pass over memory)."""
        context, exchanger = self.context, self.context.exchanger
        exchange = context.wait_pending(bucket)
        if exchange is None:
            return
        stages, k, value = exchange.stages, exchange.async_stage, exchange.value
        alpha, edge = context.progress.adaptive_factor, stages[k]
        for edge in stages[k + 1 :]:  # the stages after the one in flight: first finish that, then run each
            value = exchanger.finish(bucket, stages[k], value)
            works = exchanger.start(bucket, edge, value)
            context.wait_stage(works, bucket, edge, value)
            k += 1
        if bucket.compressed is not None:  # the last stage is a compressed gossip step
            if len(stages) == 1:  # on the parameters, in place: the adaptive factor scales the step
                received = exchanger.received(bucket, edge)
                bucket.compressed.mix(value, value, edge, received, self.consensus_step * alpha)
            else:  # into ``staged``, then the parameters move toward the round's result
                value = exchanger.finish(bucket, edge, value)
                if value is not bucket.flat:
                    bucket.flat.lerp_(value, alpha)
            bucket.write_params(context.param_as_bucket_view)
            return
        own, other = Exchanger.coefficients(edge)  # x_new = (1-alpha) x + alpha (own value + other comm)
        if hasattr(bucket.optimizer, "pre_average_hook"):  # one-stage rounds only (checked when the mode starts)
            self._combine(bucket, bucket.flat, *_decent_dp_pre_average(bucket, edge, own, other, alpha))
        elif value is bucket.flat:
            self._combine(bucket, bucket.flat, 1.0 - alpha + alpha * own, alpha * other)
        else:
            self._combine(bucket, value, alpha * own, alpha * other, keep=1.0 - alpha)

    def _combine(self, bucket: Bucket, value: Tensor, own: float, other: float, keep: float | None = None) -> None:
        """The round's result into ``flat`` (``Exchanger.combine``), then into the parameters."""
        Exchanger.combine(bucket, value, own, other, keep)
        bucket.write_params(self.context.param_as_bucket_view)


def _decent_dp_pre_average(bucket: Bucket, edge: Edge, own: float, other: float, alpha: float) -> tuple[float, float]:
    """decent-dp's contract: ``comm_buffer`` holds neighbor * (sum over the group) when the optimizer's
    ``pre_average_hook`` runs. A pair's comm holds the peer's value, so its sum gains our own and our coefficient
    loses the neighbour's share. Returns the (own, other) coefficients of the combine that follows."""
    if edge.size == 2:
        bucket.comm.add_(bucket.flat)
        own -= other
    bucket.comm.mul_(other)
    bucket.optimizer.pre_average_hook(edge, edge.weight)
    return 1.0 - alpha + alpha * own, alpha

