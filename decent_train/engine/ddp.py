"""DecentralizedDataParallel: gossip averaging of parameters, overlapped with backward and the next forward.

Each worker keeps its own parameters x_i. At optimizer step s (s = 0, 1, ...)::

    x_i^{s+1} = sum_j W(s)_ij x_j^s  -  U_i(grad f_i(x_i^s))

W(s) is the mixing matrix of the topology's round ``s mod period``; the gradient is taken at the un-mixed local x_i^s.

How one iteration runs. Parameters are grouped into buckets (one dtype and device each, in approximate
gradient-ready order). When every gradient of a bucket has arrived during backward, and the buckets before it are
done, the bucket

1. waits for the exchange of x^s that it launched one iteration earlier and mixes it in (``x <- W(s) x``),
2. steps its own optimizer and LR scheduler (optimizer-in-backward), and
3. launches the exchange of x^{s+1} with its group of round s+1, asynchronously.

So the exchange overlaps the rest of backward, data loading and the next forward. A pair exchanges by one
send/receive straight from the parameter memory (on the CPU posted from a thread of its own: gloo writes a send on the
calling thread) and one average; a larger group all-reduces a copy; with ``compression`` both send compressed
differences to public copies instead. With gradient clipping or a GradScaler every gradient must be known before any
bucket steps (global norm, overflow on any worker), so steps move to the end of backward (steps.py); the exchange
still overlaps the next forward.

A round of several stages (hierarchical topologies) keeps its intermediate result in a staging buffer, so the
parameters change only at the mix and the gradient is still taken at x^s.

Modes. ``topology="allreduce"`` (or ``switch_to("allreduce")``) averages each bucket's gradients instead (modes.py).

This module keeps the order of a step, ``switch_to`` and ``global_avg``. The rest, one question per file: buckets.py
(layout), readiness.py (when a bucket's gradients are all there), update_thread.py (updates off autograd's thread),
modes.py (what a bucket does), steps.py (deferred steps), exchange.py and compress.py (what is sent; int8_kernels.py
its loops), membership.py (who is in the run), state.py (checkpoints), host_memory.py, compat.py (decent-dp's names).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger
from torch import Tensor, nn
from torch.autograd import Variable
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils._pytree import tree_flatten

from decent_train.engine import state
from decent_train.engine.buckets import Bucket, build_buckets
from decent_train.engine.comm import CommWaits, ExchangeError, PairPoster
from decent_train.engine.compress import CompressedGossip, Compressor, check_consensus_step, make_compressor
from decent_train.engine.exchange import MESSAGE_TAGS, Exchanger
from decent_train.engine.host_memory import keep_freed_host_memory
from decent_train.engine.membership import Membership, TopologySpec
from decent_train.engine.modes import ALLREDUCE, AllReduceMode, GossipMode, Mode, ModeContext, Progress
from decent_train.engine.optimizers import LRSchedulerFn, OptimFn
from decent_train.engine.readiness import GradientReadiness
from decent_train.engine.steps import BucketSteps
from decent_train.engine.topology import Topology
from decent_train.engine.update_thread import UpdateThread

__all__ = ["ALLREDUCE", "DecentralizedDataParallel", "ExchangeError"]

_SECOND_BACKWARD = (
    "DecentralizedDataParallel: backward ran again without a training forward since the last optimizer step (two "
    "backward passes per forward would step twice). Sum the losses and call backward once, or use "
    "set_accumulate_grad(True) for all but the last micro-batch."
)


@dataclass
class _GlobalAverage:
    """Local values saved by ``global_avg(will_revert=True)`` so ``revert_global_avg`` can restore them."""

    params: list[Tensor]
    buffers: list[Tensor] = field(default_factory=list)


def check_engine_arguments(
    grad_clip_norm: float = 0.0,
    bucket_size_in_mb: float = 25,
    timeout: float | None = None,
    global_avg_every: int = 0,
    message_size_in_mb: float = 0,
    consensus_step: float = 1.0,
) -> None:
    """The engine's numeric arguments, checked before anything is built (the launcher's config checks call it too)."""
    if grad_clip_norm < 0:
        raise ValueError(f"grad_clip_norm must be >= 0 (0 disables clipping), got {grad_clip_norm}")
    if bucket_size_in_mb < 0:
        raise ValueError(f"bucket_size_in_mb must be >= 0, got {bucket_size_in_mb}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds (or None), got {timeout}")
    if global_avg_every < 0:
        raise ValueError(f"global_avg_every must be >= 0 (0 disables), got {global_avg_every}")
    if message_size_in_mb < 0:
        raise ValueError(f"message_size_in_mb must be >= 0 (0: one message per bucket), got {message_size_in_mb}")
    check_consensus_step(consensus_step)


class DecentralizedDataParallel(nn.Module):
    """Wraps a model for decentralized data-parallel training (a drop-in for decent-dp 0.2.3's class).

    Args:
        model: the model, already on its device. Buffers and all parameters (frozen ones too) are broadcast from
            rank 0 at construction.
        optim_fn: builds the optimizer of one bucket from its list of ``(name, parameter)``.
        lr_scheduler_fn: builds the LR scheduler of one bucket's optimizer; stepped once per optimizer step.
        topology: a registered topology name (see ``topology_names()``), a Topology subclass or an instance.
        scaler: a GradScaler for float16 mixed precision; its scale stays equal on all workers (an overflow on any
            worker skips the step on all).
        grad_clip_norm: clip each worker's gradient by the norm of the whole model (0 disables).
        param_as_bucket_view: parameters become views of their bucket's flat buffer (saves a copy per exchange).
        sync_buffer_in_global_avg: ``global_avg`` also averages floating-point buffers (e.g. BatchNorm statistics).
        bucket_size_in_mb: target bucket size; 0 gives one bucket per parameter.
        local_world_size: workers per node (topologies such as alternating-exp-ring use it); defaults to
            ``$LOCAL_WORLD_SIZE`` or 1. ``_local_world_size`` is decent-dp's spelling.
        timeout: seconds an exchange may take before it fails with an error naming the peers (a peer that hangs
            or died); None waits as long as the process group's own timeout. On CPU the host's wait enforces it; on
            a GPU the engine's own process groups carry it (NCCL's watchdog enforces it, the host never blocks), so
            the default process group can keep a long timeout for everything else (compilation, checkpoints).
        global_avg_every: replace every worker's parameters by the exact average after every k-th gossip step.
        message_size_in_mb: a pair sends its bucket in messages of at most this size (0: one message); smaller
            messages keep up with a rate-limited TCP link (scripts/BENCHMARKS.md).
        compression: gossip sends compressed differences to public copies instead of the parameters (CHOCO-SGD,
            engine/exchange.py): ``"bf16"`` (half the bytes), ``"int8"`` (blockwise, 0.254x) or a compressor object;
            the workers' mean is preserved exactly. None sends float parameters. All-reduce mode is never compressed.
        consensus_step: with compression, the step toward the neighbours' public copies (CHOCO's gamma, in (0, 1]).
        fault_tolerant: a peer's message that fails (it died) is replaced by this worker's own value instead of
            raising (its weight stays here; ``missed_messages`` lists them), and every group exchanges by messages,
            one per peer (exchange.py). For live membership: ``prepare_membership_change`` and
            ``membership_changed`` around a reconfiguration of the default group. Each stage of a round of several
            (``hierarchical``) settles its own missing messages: a stage's matrix keeps a missed weight with the
            receiver, and the stages' product is the round's.
        from_rank0: start from rank 0's parameters and buffers (a broadcast, after a check that every worker holds
            the same model). False for a worker that joins a running job and loads a peer's state instead.
        public_copy_dtype: with compression, the dtype of a pair's public copies (None: the parameters'):
            ``torch.bfloat16`` halves their memory (two per distinct peer of the topology's period); the
            mean stays exact, but the workers then agree only to bfloat16's precision (engine/exchange.py).
        update_thread: buckets update (mix, step, launch) on a thread and CUDA stream of their own, off autograd's
            thread (engine/update_thread.py). Off by default: on an H200 its GIL hand-offs made ResNet-50 slower.
    """

    FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

    def __init__(
        self,
        model: nn.Module,
        optim_fn: OptimFn,
        lr_scheduler_fn: LRSchedulerFn | None = None,
        topology: TopologySpec = "complete",
        scaler: torch.amp.GradScaler | None = None,
        grad_clip_norm: float = 0.0,
        param_as_bucket_view: bool = True,
        sync_buffer_in_global_avg: bool = False,
        bucket_size_in_mb: float = 25,
        local_world_size: int | None = None,
        _local_world_size: int | None = None,
        timeout: float | None = None,
        global_avg_every: int = 0,
        message_size_in_mb: float = 0,
        compression: str | Compressor | None = None,
        consensus_step: float = 1.0,
        public_copy_dtype: torch.dtype | None = None,
        fault_tolerant: bool = False,
        from_rank0: bool = True,
        update_thread: bool = False,
    ):
        super().__init__()
        check_engine_arguments(
            grad_clip_norm, bucket_size_in_mb, timeout, global_avg_every, message_size_in_mb, consensus_step
        )
        if public_copy_dtype is not None and (compression is None or not public_copy_dtype.is_floating_point):
            raise ValueError(f"public_copy_dtype={public_copy_dtype} needs compression and a floating-point dtype "
                             "(e.g. torch.bfloat16)")
        self._compressor = make_compressor(compression)
        self._public_copy_dtype = public_copy_dtype
        self._consensus_step = float(consensus_step)
        self._global_avg_every = int(global_avg_every)
        self._fault_tolerant = fault_tolerant
        self._members = Membership(
            local_world_size or _local_world_size, timedelta(seconds=timeout) if timeout is not None else None,
            point_to_point=fault_tolerant,
        )
        if dist.is_initialized() and dist.get_backend() == "nccl" and next(model.parameters()).device.type == "cpu":
            model = model.to(torch.device("cuda", torch.cuda.current_device()))
        self.module = model
        self._param_as_bucket_view = param_as_bucket_view
        self._sync_buffer_in_global_avg = sync_buffer_in_global_avg
        self._progress = Progress()
        self._accumulating = False
        self._global_average: _GlobalAverage | None = None

        if from_rank0:
            self._members.check_same_model(self._state_tensors())
            self._members.broadcast_from_rank0([t.data for _, t in self._state_tensors()])  # all start from rank 0's
        self._buckets = build_buckets(
            model, optim_fn, lr_scheduler_fn, bucket_size_in_mb * 2**20, param_as_bucket_view,
            compressed=self._compressor is not None,
        )
        self._members.create_exchange_group(
            next((b.flat.device for b in self._buckets if b.flat.device.type == "cuda"), torch.device("cpu"))
        )
        host_memory = next(
            (keep_freed_host_memory() for b in self._buckets if b.flat.device.type == "cpu"), "no CPU parameters"
        )
        message_bytes = max(1, int(message_size_in_mb * 2**20)) if message_size_in_mb else 0
        exchanger = Exchanger(self._members.rank, self._members.exchange_group, message_bytes, self._consensus_step,
                              point_to_point=fault_tolerant)
        messages = max((len(exchanger.pieces(b.flat)) for b in self._buckets), default=0)
        if messages > MESSAGE_TAGS:
            raise ValueError(f"message_size_in_mb={message_size_in_mb} splits a bucket into {messages} messages, "
                             f"more than {MESSAGE_TAGS}; use larger messages")
        steps = BucketSteps(scaler, grad_clip_norm, self._members)
        self._context = ModeContext(self._members, exchanger, CommWaits(self._members.timeout), steps, self._progress,
                                    param_as_bucket_view, fault_tolerant=fault_tolerant)
        self._readiness = GradientReadiness(self._buckets, self._on_grad_ready, model, self._members.rank == 0)
        device = next((b.flat.device for b in self._buckets), torch.device("cpu"))
        self._updates = UpdateThread(device, owner=self) if update_thread else None
        self._mode = self._make_mode(topology, start=0)
        self._start_compression(identical=True)
        if self._members.rank == 0:
            sizes = ", ".join(f"{nbytes / 2**20:.2f}" for nbytes in self.bucket_bytes)
            logger.debug(
                f"DecentralizedDataParallel: {self._mode.label}; {len(self._buckets)} buckets, MB: {sizes}; {host_memory}"
            )

    # -- construction -------------------------------------------------------------------------------------------
    def _make_mode(self, topology: TopologySpec, start: int) -> Mode:
        """Gossip over ``topology`` (built and its process groups created, a collective) or all-reduce."""
        if isinstance(topology, str) and topology == ALLREDUCE:
            return AllReduceMode(self._context, start)
        built = self._members.topology(topology)
        if built.is_staged and any(hasattr(b.optimizer, "pre_average_hook") for b in self._buckets):
            raise ValueError(f"topology '{built.name}' has rounds of several stages; an optimizer with decent-dp's "
                             "pre_average_hook supports only one-stage rounds")
        return GossipMode(self._context, built, start, self._consensus_step)

    def _start_compression(self, identical: bool) -> None:
        """With compression, each bucket's copies for the current mode's rounds: the parameters where they are equal
        on every worker (at construction), zero otherwise; either way equal wherever they are held. Without, a gossip
        mode that exchanges receives into ``comm``: it is allocated for the first such mode (buckets.py)."""
        if self._compressor is None or not isinstance(self._mode, GossipMode):
            for bucket in self._buckets:
                bucket.compressed = None
                if isinstance(self._mode, GossipMode) and self._mode.groups():
                    bucket.allocate_comm()
            if self._compressor is not None and self._members.rank == 0:
                logger.info("DecentralizedDataParallel: all-reduce mode averages full-precision gradients "
                            f"({self._compressor.name} compression applies to gossip)")
            return
        groups = self._mode.groups()
        for bucket in self._buckets:
            bucket.compressed = CompressedGossip.create(self._compressor, bucket.flat, groups, self._public_copy_dtype)
        self._reset_compression(identical)

    def _reset_compression(self, identical: bool) -> None:
        for bucket in self._buckets:
            if bucket.compressed is not None:
                bucket.compressed.reset(bucket.flat if identical else None)

    @property
    def comm_wait_seconds(self) -> float:
        """Seconds computation stalled waiting for exchanges so far: the host's wait on CPU, the stream's on a GPU
        (read between steps: on a GPU it waits for the timing events recorded so far)."""
        return self._context.waits.seconds

    @property
    def late_buckets(self) -> int:
        """Buckets so far whose update waited for the end of backward behind an earlier one's late gradient (R12)."""
        return self._readiness.late_buckets

    def _state_tensors(self) -> list[tuple[str, Tensor]]:
        return list(self.module.named_parameters()) + list(self.module.named_buffers())

    # -- training -----------------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        training_step = self.training and torch.is_grad_enabled() and not self._accumulating
        if training_step:
            if self._global_average is not None:
                logger.warning(
                    "training resumed after global_avg(will_revert=True) without revert_global_avg(): "
                    "continuing from the global average (as global_avg(will_revert=False))"
                )
                self._drop_pending_exchanges()
            self._progress.armed = True
            self._readiness.start_step()
        output = self.module(*args, **kwargs)
        if training_step:
            step = self._progress.step
            for tensor in (output,) if isinstance(output, Tensor) else tree_flatten(output)[0]:
                if isinstance(tensor, Tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda grad, step=step: self._check_not_stepped(step))
        return output

    def _check_not_stepped(self, forward_step: int) -> None:
        """Backward reaches a forward's outputs first: refuse a second backward after that forward's step, and end
        the step at the end of backward even if no parameter gets a gradient (its peers would wait for its exchange)."""
        if self._progress.step != forward_step and not self._accumulating:
            raise RuntimeError(_SECOND_BACKWARD)
        if self._progress.armed and not self._accumulating and not self._progress.backward_started:
            self._progress.backward_started = True
            Variable._execution_engine.queue_callback(self._finish_backward)

    def set_accumulate_grad(self, enable: bool = True) -> None:
        """While enabled, backward only accumulates gradients: no step, no exchange (for micro-batches)."""
        self._accumulating = enable

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """torch DDP's spelling of ``set_accumulate_grad``: backward inside the block only accumulates."""
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous

    def _on_grad_ready(self, bucket: Bucket, param: nn.Parameter) -> None:
        if self._accumulating:
            return
        if not self._progress.armed:
            raise RuntimeError(_SECOND_BACKWARD)
        if not self._progress.backward_started:
            self._progress.backward_started = True
            Variable._execution_engine.queue_callback(self._finish_backward)
        if not self._readiness.arrived(bucket, param):
            return
        progress, buckets = self._progress, self._buckets
        while progress.next_bucket < len(buckets) and buckets[progress.next_bucket].complete:
            self._on_bucket_ready(buckets[progress.next_bucket])
            progress.next_bucket += 1

    def _on_bucket_ready(self, bucket: Bucket, ended: bool = False) -> None:
        """A bucket's gradients are all there (buckets come strictly in index order, the same on every rank); once
        backward has ``ended`` (the update thread drained) it updates here."""
        self._mode.gradients_ready(bucket)
        if self._mode.updates_in_backward and not self._context.steps.deferred:
            if self._updates is None or ended:
                self._mode.update(bucket)
            else:
                self._updates.submit(functools.partial(self._mode.update, bucket), [p.grad for p in bucket.params])

    @torch.no_grad()
    def _finish_backward(self) -> None:
        """End of backward: the buckets left (unused parameters); the updates that wait for the end of backward (each
        as soon as its gradients are gathered, or all after the deferred steps' agreement); then the next step."""
        mode, steps = self._mode, self._context.steps
        if self._updates is not None:
            self._updates.drain()
        self._readiness.end_of_backward(mode.updates_in_backward and not steps.deferred)
        for bucket in self._buckets[self._progress.next_bucket :]:
            self._on_bucket_ready(bucket, ended=True)
        for bucket in self._buckets:  # in launch order: each updates while the later buckets' sums are in flight
            mode.gather(bucket)
            if not mode.updates_in_backward and not steps.deferred:
                mode.update(bucket)
        if steps.deferred:
            steps.prepare(self._buckets, self._members, self._progress.step)
            with steps.merged():
                for bucket in self._buckets:
                    mode.update(bucket)
        steps.end_step()
        self._readiness.finish()
        self._progress.next_bucket = 0
        self._progress.armed = self._progress.backward_started = False
        self._progress.step += 1
        if self._global_avg_every and mode.topology is not None and self._progress.step % self._global_avg_every == 0:
            self.global_avg(will_revert=False)

    def _drop_pending_exchanges(self) -> None:
        """Forget in-flight exchanges after waiting for them (the workers are at consensus: no mix is needed)."""
        for bucket in self._buckets:
            self._context.wait_pending(bucket)
        self._global_average = None
        self._reset_compression(identical=True)  # equal parameters everywhere (switch_to then starts new copies)

    # -- schedules ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def switch_to(self, topology: TopologySpec) -> None:
        """From the next step on, gossip over ``topology`` (rounds counted from that step) or, with ``"allreduce"``,
        average the gradients. Call it between steps, on every worker in the same order (it may create process
        groups). Optimizers and schedulers carry over.

        Exchanges in flight are drained and dropped. Entering all-reduce replaces every worker's parameters and
        floating-point optimizer state (momentum, Adam's moments) by their averages, so the workers stay equal from
        then on. Entering gossip starts the new topology's first exchange: the next step mixes with its round 0.
        """
        if self._progress.armed or self._progress.backward_started:
            raise RuntimeError("switch_to() between steps only: after backward, before the next training forward")
        if self._global_average is not None:
            raise RuntimeError("switch_to() inside global_avg(will_revert=True): call revert_global_avg() first")
        mode = self._make_mode(topology, start=self._progress.step)
        if isinstance(mode, AllReduceMode):
            self.global_avg(will_revert=False)
            self._average_optimizer_states()
            self._mode = mode
            self._start_compression(identical=False)  # none in all-reduce mode
        else:
            self._drop_pending_exchanges()
            self._mode = mode
            self._start_compression(identical=False)
            for bucket in self._buckets:
                mode.launch(bucket, 0)

    # -- live membership ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def prepare_membership_change(self) -> None:
        """Between steps, before the default group is reconfigured (``fault_tolerant``): complete the exchanges in
        flight (a dead peer's messages settle as missing) and drop them on every member alike, so that no member
        mixes what another does not. Every member then relaunches the same values over the new topology."""
        if self._progress.armed or self._progress.backward_started:
            raise RuntimeError("prepare_membership_change() between steps only")
        for bucket in self._buckets:
            self._context.wait_pending(bucket, dropping=True)
        self._global_average = None

    @torch.no_grad()
    def membership_changed(self, topology: TopologySpec, local_world_size: int | None = None) -> None:
        """After the default group was reconfigured: gossip over ``topology`` built over the new members, its rounds
        counted from this step; the public copies (compression) start at zero on every member; the next step mixes
        the exchange launched here."""
        self._members.refresh(local_world_size)
        self._context.exchanger.rank = self._members.rank
        self._context.exchanger.pairs = PairPoster()  # a thread still waiting on a dead peer is left behind
        self._mode = self._make_mode(topology, start=self._progress.step)
        self._start_compression(identical=False)
        for bucket in self._buckets:
            self._mode.launch(bucket, 0)

    @property
    def missed_messages(self) -> list[tuple[int, int, int]]:
        """``fault_tolerant``: each peer's message that never came, as (step, bucket, the peer's rank then)."""
        return self._context.missed

    def _average_optimizer_states(self) -> None:
        """Average every optimizer's floating-point state on the parameters' device (momentum, Adam's moments). Step
        counters are equal everywhere and stay out (torch's Adam keeps them on the CPU, which NCCL cannot reduce)."""
        self._members.average_tensors_(
            [
                value
                for bucket in self._buckets
                for param in bucket.params
                for key, value in sorted(bucket.optimizer.state.get(param, {}).items())
                if key != "step" and isinstance(value, Tensor) and value.is_floating_point()
                and value.device == param.device
            ],
            f"the optimizer states' average at step {self._progress.step}",
        )

    # -- evaluation ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def global_avg(self, will_revert: bool = True, return_d2c: bool = False) -> float | None:
        """Replace every worker's parameters by the exact global average (for evaluation).

        ``will_revert=True`` keeps the local values (and pending exchanges) for ``revert_global_avg()``; with False
        the average persists and training continues from it. ``return_d2c`` returns this worker's L2 distance to the
        average. Costs one blocking all-reduce of the parameters.
        """
        for bucket in self._buckets:  # in-flight sends read the parameters: let them finish first
            self._context.complete_pending(bucket)
        params = [p for b in self._buckets for p in b.params]
        buffers = self._float_buffers() if self._sync_buffer_in_global_avg else []
        if self._global_average is None and (will_revert or return_d2c):
            self._global_average = _GlobalAverage(
                params=[p.detach().clone() for p in params], buffers=[t.clone() for t in buffers]
            )
        what = f"the global average at step {self._progress.step}"
        for tensor in [b.flat for b in self._buckets] if self._param_as_bucket_view else [p.data for p in params]:
            self._members.average_(tensor, what)
        self._members.average_tensors_(buffers, what)  # one all-reduce, not one per BatchNorm statistic
        d2c = None
        if return_d2c:
            distances = torch._foreach_norm(torch._foreach_sub(params, self._global_average.params))
            d2c = float(torch.linalg.vector_norm(torch.stack(distances).double()))
        if not will_revert:
            self._drop_pending_exchanges()
        return d2c

    def _float_buffers(self) -> list[Tensor]:
        return [b.data for b in self.module.buffers() if b.dtype in self.FLOAT_DTYPES]

    @torch.no_grad()
    def revert_global_avg(self) -> None:
        """Restore the local parameters (and buffers) saved by ``global_avg(will_revert=True)``."""
        if self._global_average is None:
            raise RuntimeError("revert_global_avg(): no global_avg(will_revert=True) to revert")
        params = [p.data for b in self._buckets for p in b.params]
        torch._foreach_copy_(params, self._global_average.params)
        if self._global_average.buffers:
            torch._foreach_copy_(self._float_buffers(), self._global_average.buffers)
        self._global_average = None

    # -- checkpoints (state.py) ---------------------------------------------------------------------------------
    def engine_state_dict(self) -> dict[str, Any]:
        """Everything besides the model that training needs to continue exactly: the step, each bucket's optimizer
        and LR scheduler, the scaler, the adaptive factor, and the exchange in flight. That exchange is completed
        here and what it delivered is saved, to be mixed in at the next step as it would have been. Call it between
        steps (not inside ``global_avg(will_revert=True)``); save the model's ``state_dict()`` with it.
        """
        if self._global_average is not None:
            raise RuntimeError("engine_state_dict() inside global_avg(will_revert=True): revert_global_avg() first")
        return state.engine_state_dict(self._buckets, self._context, self._mode)

    averageable_state = staticmethod(state.averageable_state)

    def load_engine_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from ``engine_state_dict()`` (after loading the model's ``state_dict()`` saved with it), or from
        the average of several workers' ``averageable_state``s, marked ``averaged_from`` (their number): then the
        world size and topology may differ, and every worker must load the same average."""
        state.load_engine_state_dict(self._buckets, self._context, self._mode, saved)

    # -- accessors ----------------------------------------------------------------------------------------------
    def get_lr(self) -> float:
        """Learning rate of the first bucket's first parameter group."""
        return float(self._buckets[0].optimizer.param_groups[0]["lr"]) if self._buckets else 0.0

    def set_adaptive_factor(self, factor: float) -> None:
        """Damp mixing: x <- (1 - factor) x + factor (W x). 1 is plain gossip, 0 disables mixing."""
        if not 0.0 <= factor <= 1.0:
            raise ValueError(f"adaptive factor must be in [0, 1], got {factor}")
        self._progress.adaptive_factor = float(factor)

    @property
    def topology(self) -> Topology | None:
        """The topology gossiped over now; None in all-reduce mode."""
        return self._mode.topology

    @property
    def mode(self) -> str:
        """``"gossip"`` or ``"allreduce"``."""
        return ALLREDUCE if self._mode.topology is None else "gossip"

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far."""
        return self._progress.step

    @property
    def optimizers(self) -> list[Optimizer]:
        return [b.optimizer for b in self._buckets]

    @property
    def lr_schedulers(self) -> list[LRScheduler | None]:
        return [b.scheduler for b in self._buckets]

    _optims, _lr_schedulers = optimizers, lr_schedulers  # decent-dp's private names (its users' checkpoint code)

    @property
    def bucket_bytes(self) -> list[int]:
        """Size of each bucket in bytes, in processing order (what one exchange of that bucket moves)."""
        return [b.flat.numel() * b.flat.element_size() for b in self._buckets]

    @property
    def compressed(self) -> bool:
        """Whether gossip sends compressed differences now (``compression`` set, and not in all-reduce mode)."""
        return any(b.compressed is not None for b in self._buckets)

    @property
    def message_bytes(self) -> list[int]:
        """Bytes one exchange of each bucket sends to each peer: its ``bucket_bytes``, or the compressed message."""
        return [b.compressed.outgoing.numel() if b.compressed is not None else nbytes
                for b, nbytes in zip(self._buckets, self.bucket_bytes)]

    @property
    def bucket_names(self) -> list[list[str]]:
        """Parameter names of each bucket, in processing order."""
        return [list(b.names) for b in self._buckets]

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The bare model's state_dict: no wrapper prefix, loads straight into the unwrapped model."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Loads a bare state_dict, or one saved with decent-dp's ``_model.`` / DDP's ``module.`` prefix.

        Exchanges in flight are drained and dropped first: a send may still read the parameters, and what they
        delivered belongs to the replaced values (the next step mixes nothing; its exchange sends the loaded ones).
        """
        for prefix in ("_model.", "module."):
            if state_dict and all(k.startswith(prefix) for k in state_dict):
                state_dict = {k[len(prefix) :]: v for k, v in state_dict.items()}
        for bucket in self._buckets:
            self._context.wait_pending(bucket)
        with torch.no_grad():
            return self.module.load_state_dict(state_dict, strict=strict)
