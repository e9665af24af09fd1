"""A bucket's optimizer step, and the steps deferred until every gradient is known.

With gradient clipping (by the whole model's norm) or fp16 loss scaling (an overflow on any worker skips the step on
all), no bucket may step before backward has ended: the steps move to the end of backward, after one agreement.
A worker alone defers too: it exchanges nothing, so a step inside backward overlaps nothing, and at the end its
buckets' fused Adams run as one call per set of hyperparameters (:meth:`BucketSteps.merged`), the host work of one
fused optimizer (scripts/BENCHMARKS.md, issue 37: the per-bucket steps were what a worker alone paid over a plain
loop where the host is the bottleneck).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from loguru import logger

from decent_train.engine.buckets import Bucket
from decent_train.engine.comm import peers_must_answer, run_collective
from decent_train.engine.fused_step import step_and_zero_grad, step_and_zero_grad_many
from decent_train.engine.membership import Membership

__all__ = ["BucketSteps"]


class BucketSteps:
    """How the buckets' optimizers step: at once, or ``deferred`` to the end of backward."""

    def __init__(self, scaler: torch.amp.GradScaler | None, grad_clip_norm: float, members: Membership | None = None):
        self.scaler = scaler
        self.grad_clip_norm = float(grad_clip_norm)
        self.scaled = scaler is not None and scaler.is_enabled()
        self.must_defer = self.grad_clip_norm > 0 or self.scaled
        self.members = members
        self.overflow = False  # fp16: an inf/nan gradient on some worker at this step (read once per step)
        self._said_barrier = False
        self._collected: list[Bucket] | None = None  # inside merged(): the buckets whose steps wait for its end

    @property
    def alone(self) -> bool:
        """A worker alone: nothing to exchange (live membership may change that between steps)."""
        return self.members is not None and self.members.world_size == 1

    @property
    def deferred(self) -> bool:
        """Whether the buckets step at the end of backward: clipping, loss scaling, or a worker alone."""
        return self.must_defer or self.alone

    @contextlib.contextmanager
    def merged(self) -> Iterator[None]:
        """The steps of the buckets updated inside run at its end, their fused Adams as one ``adam()`` per set of
        hyperparameters, where nothing reads the parameters between one bucket's step and the next's: a worker alone
        launches no exchange after a step. Unscaled only (a scaled step may be skipped); elsewhere each step runs as
        it comes. The update is the same to the bit (the kernel is elementwise)."""
        if self.scaled or not self.alone:
            yield
            return
        self._collected = []
        try:
            yield
            buckets = self._collected
        finally:
            self._collected = None
        for optimizer in step_and_zero_grad_many([b.optimizer for b in buckets]):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for bucket in buckets:
            if bucket.scheduler is not None:
                bucket.scheduler.step()

    def prepare(self, buckets: list[Bucket], members: Membership, step: int) -> None:
        """Unscale, agree on overflow across all workers, and clip by the whole model's gradient norm.

        The overflow flag is read on the host once per step (GradScaler.step would read it once per bucket), and
        the buckets then step directly or all skip.
        """
        self.overflow = False
        if self.scaled:
            assert self.scaler is not None
            with_grads = [b for b in buckets if b.has_grads()]
            for bucket in with_grads:
                self.scaler.unscale_(bucket.optimizer)
            found = [t for b in with_grads for t in self.scaler._found_inf_per_device(b.optimizer).values()]
            if found:
                overflow = torch.stack([t.float() for t in found]).amax().reshape(1)
            else:  # no gradient here this step: a zero flag, so that this rank still enters its peers' all-reduce,
                # recorded as one optimizer's, so that GradScaler.update() (which needs one) reads the agreed flag
                overflow = torch.zeros(1, device=buckets[0].flat.device if buckets else None)
                if buckets:
                    self.scaler.unscale_(buckets[0].optimizer)
                    found = [overflow.new_zeros(())]
                    self.scaler._found_inf_per_device(buckets[0].optimizer)[overflow.device] = found[0]
            if members.world_size > 1:
                self._say_barrier(members.world_size)
                with peers_must_answer(f"the overflow check at step {step}", members.timeout):
                    run_collective(dist.all_reduce, overflow, op=dist.ReduceOp.MAX, group=members.exchange_group)
            for t in found:
                t.copy_(overflow.reshape(()))  # what GradScaler.update() reads
            self.overflow = bool(overflow.item())
        if self.grad_clip_norm > 0:
            grads = [p for b in buckets for p in b.params if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(grads, self.grad_clip_norm)

    def _say_barrier(self, world_size: int) -> None:
        """Once: what fp16's agreement costs (audit R10), which gossip otherwise avoids."""
        if not self._said_barrier:
            self._said_barrier = True
            logger.info(f"DecentralizedDataParallel: fp16 loss scaling agrees on overflow across all {world_size} "
                        "workers every step (an all-reduce and a host sync after backward): no bucket steps during "
                        "backward and every step waits for the slowest worker; bf16 needs no loss scaling")

    def step(self, bucket: Bucket) -> None:
        """The bucket's optimizer and scheduler step; with fp16 loss scaling, unless a gradient overflowed on some
        worker (the bucket's gradients are unscaled already: what ``GradScaler.step`` does, without its host sync).
        Inside :meth:`merged` it waits for the block's end."""
        if self._collected is not None:
            self._collected.append(bucket)
            return
        if self.scaled:
            if not self.overflow and bucket.has_grads():
                bucket.optimizer.step()
            bucket.optimizer.zero_grad(set_to_none=True)
        elif not step_and_zero_grad(bucket.optimizer):
            bucket.optimizer.step()
            bucket.optimizer.zero_grad(set_to_none=True)
        if bucket.scheduler is not None:
            bucket.scheduler.step()

    def end_step(self) -> None:
        if self.scaler is not None:
            self.scaler.update()
