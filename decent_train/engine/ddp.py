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
differences to public copies instead. What each sends and receives is engine/exchange.py's; this module keeps the
hooks, the order of a step, the modes and the state dict. With gradient
clipping or a GradScaler every gradient must be known before any bucket steps (global norm, overflow on any worker),
so steps move to the end of backward; the exchange still overlaps the next forward.

A round of several stages (hierarchical topologies) keeps its intermediate result in a staging buffer, so the
parameters change only at the mix and the gradient is still taken at x^s.

Modes. ``topology="allreduce"`` (or ``switch_to("allreduce")``) averages each bucket's gradients instead, launched
asynchronously as the bucket completes; at the end of backward each bucket steps as soon as its sum arrives: torch DDP's
algorithm with the same optimizer-in-bucket structure, so ``switch_to`` between modes and topologies keeps every
optimizer and scheduler state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger
from torch import Tensor, nn
from torch.autograd import Variable
from torch.autograd.profiler import record_function
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils._pytree import tree_flatten

from decent_train.engine.exchange import (
    MESSAGE_TAGS,
    CompressedGossip,
    Compressor,
    ExchangeBuffers,
    Exchanger,
    make_compressor,
)
from decent_train.engine.optim import LRSchedulerFn, OptimFn
from decent_train.engine.topology import Edge, Topology, get_topology_class
from decent_train.engine.utils import CommWaits, ExchangeError, peers_must_answer, run_collective

__all__ = ["ALLREDUCE", "DecentralizedDataParallel", "ExchangeError", "OPTIM_FN_TYPE", "LR_SCHEDULER_FN_TYPE"]

OPTIM_FN_TYPE = OptimFn
LR_SCHEDULER_FN_TYPE = LRSchedulerFn

_SECOND_BACKWARD = (
    "DecentralizedDataParallel: backward ran again without a training forward since the last optimizer step (two "
    "backward passes per forward would step twice). Sum the losses and call backward once, or use "
    "set_accumulate_grad(True) for all but the last micro-batch."
)
_ALIGN = 32  # elements: every parameter starts 64-256 bytes aligned inside its bucket


ALLREDUCE = "allreduce"
"""The engine's other mode (``topology="allreduce"``, ``switch_to("allreduce")``): each bucket's gradients are averaged
over all workers, then the bucket steps, so the workers stay equal (torch DDP's algorithm)."""


@dataclass
class _Phase:
    """What the engine does from step ``start`` on: gossip over ``topology`` with rounds counted from ``start``, or
    (``topology`` None) all-reduce the gradients."""

    topology: Topology | None
    start: int
    my_stages: list[list[Edge]]  # gossip: this worker's group in each stage of each round
    async_stages: list[int]  # gossip: the stage of each round that is overlapped with computation

    @property
    def allreduce(self) -> bool:
        return self.topology is None

    @property
    def label(self) -> str:
        return ALLREDUCE if self.topology is None else self.topology.describe()

    def round_of(self, step: int) -> int:
        return (step - self.start) % len(self.my_stages)


@dataclass
class _Exchange:
    """A gossip exchange in flight: the stages of its round, the one in flight (``async_stage``), the tensor that
    stage sends (the parameters, or the result of the stages before it) and the handles to wait on."""

    stages: list[Edge]
    async_stage: int
    value: Tensor
    works: list[Any]


@dataclass(kw_only=True)
class _Bucket(ExchangeBuffers):
    """Parameters of one dtype and device that mix, step and exchange together (the exchange's buffers: the base
    class). ``flat`` holds the parameter values: the parameters are views of it with ``param_as_bucket_view``;
    otherwise it is a staging copy. ``grads`` (all-reduce mode) holds the gradients being averaged, allocated when
    first needed.
    """

    names: list[str]
    params: list[nn.Parameter]
    views: list[Tensor]  # each parameter's slice of ``flat``
    optimizer: Optimizer
    scheduler: LRScheduler | None
    pending: _Exchange | None = None
    ready: int = 0  # parameters whose gradient arrived in this backward
    grads: Tensor | None = None
    grad_views: list[Tensor] = field(default_factory=list)  # each parameter's slice of ``grads`` (an anchor, too)
    gradient_works: list[Any] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.ready == len(self.params)

    def has_grads(self) -> bool:
        return any(p.grad is not None for p in self.params)

    def gradient_views(self) -> list[Tensor]:
        """Each parameter's slice of ``grads``, laid out like the parameter (allocated at the first call)."""
        if self.grads is None:
            self.grads = torch.zeros_like(self.flat)
            self.grad_views = [_slice_like(self.grads, view.storage_offset(), view) for view in self.views]
        return self.grad_views


@dataclass
class _GlobalAverage:
    """Local values saved by ``global_avg(will_revert=True)`` so ``revert_global_avg`` can restore them."""

    params: list[Tensor]
    buffers: list[Tensor] = field(default_factory=list)


def _aligned(numel: int) -> int:
    return -(-numel // _ALIGN) * _ALIGN


def _layout_is_supported(p: Tensor) -> bool:
    """Dense, non-overlapping layouts that a slice of a flat buffer can reproduce with ``as_strided``."""
    return (
        p.is_contiguous()
        or (p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last))
        or (p.dim() == 5 and p.is_contiguous(memory_format=torch.channels_last_3d))
    )


def _slice_like(flat: Tensor, offset: int, like: Tensor) -> Tensor:
    """A view of ``flat`` at ``offset`` with the shape and strides (memory format) of ``like``."""
    return flat.as_strided(like.shape, like.stride(), offset)


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
        message_size_in_mb: a pair sends its bucket in messages of at most this size (0: one message). Over a
            rate-limited TCP link one 26 MB gloo message ran at half the link's rate where 1 MB messages kept up
            (scripts/BENCHMARKS.md); on loopback the split cost 7-13%.
        compression: gossip sends compressed differences to public copies instead of the parameters (CHOCO-SGD,
            engine/exchange.py): ``"bf16"`` (half the bytes), ``"int8"`` (blockwise, 0.254x) or a compressor object;
            the workers' mean is preserved exactly. None sends float parameters. All-reduce mode is never compressed.
        consensus_step: with compression, the step toward the neighbours' public copies (CHOCO's gamma, in (0, 1]).
        public_copy_dtype: with compression, the dtype of a pair's public copies (None: the parameters'):
            ``torch.bfloat16`` halves their memory (two per distinct peer of the topology's period); the
            mean stays exact, but the workers then agree only to bfloat16's precision (engine/exchange.py).
    """

    FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

    def __init__(
        self,
        model: nn.Module,
        optim_fn: OptimFn,
        lr_scheduler_fn: LRSchedulerFn | None = None,
        topology: str | Topology | type[Topology] = "complete",
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
    ):
        super().__init__()
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
        if not 0.0 < consensus_step <= 1.0:
            raise ValueError(f"consensus_step must be in (0, 1], got {consensus_step}")
        if public_copy_dtype is not None and (compression is None or not public_copy_dtype.is_floating_point):
            raise ValueError(
                f"public_copy_dtype={public_copy_dtype} needs compression and a floating-point dtype (e.g. "
                "torch.bfloat16)"
            )
        self._compressor = make_compressor(compression)
        self._public_copy_dtype = public_copy_dtype
        self._consensus_step = float(consensus_step)
        self._message_bytes = max(1, int(message_size_in_mb * 2**20)) if message_size_in_mb else 0
        self._global_avg_every = int(global_avg_every)
        self._timeout = timedelta(seconds=timeout) if timeout is not None else None
        distributed = dist.is_available() and dist.is_initialized()
        self._rank = dist.get_rank() if distributed else 0
        self._world_size = dist.get_world_size() if distributed else 1
        if local_world_size is None:
            local_world_size = _local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if distributed and dist.get_backend() == "nccl" and next(model.parameters()).device.type == "cpu":
            model = model.to(torch.device("cuda", torch.cuda.current_device()))
        self.module = model
        self._local_world_size = local_world_size
        self._topologies: dict[Any, Topology] = {}  # by name, class or id: process groups are created once each
        self._scaler = scaler
        self._grad_clip_norm = float(grad_clip_norm)
        self._param_as_bucket_view = param_as_bucket_view
        self._sync_buffer_in_global_avg = sync_buffer_in_global_avg
        self._adaptive_factor = 1.0
        # Steps wait for the end of backward when they need every gradient first.
        self._defer_steps = self._grad_clip_norm > 0 or (scaler is not None and scaler.is_enabled())

        self._step = 0  # optimizer steps taken: the round of the next mix
        self._accumulating = False
        self._armed = False  # a training forward ran since the last step
        self._backward_started = False
        self._next_bucket = 0  # buckets are processed strictly in index order (same on all ranks)
        self._ready_params: set[int] = set()
        self._global_average: _GlobalAverage | None = None
        self._overflow = False  # fp16: an inf/nan gradient on some worker at this step (read once per step)
        self._waits = CommWaits(self._timeout)

        self._check_same_model_everywhere()
        self._broadcast_from_rank0()
        self._buckets = self._build_buckets(optim_fn, lr_scheduler_fn, bucket_size_in_mb * 2**20)
        self._exchange_group = self._make_exchange_group()
        self._exchanger = Exchanger(self._rank, self._exchange_group, self._message_bytes, self._consensus_step)
        messages = max((len(self._exchanger.pieces(b.flat)) for b in self._buckets), default=0)
        if messages > MESSAGE_TAGS:
            raise ValueError(
                f"message_size_in_mb={message_size_in_mb} splits a bucket into {messages} messages, more than "
                f"{MESSAGE_TAGS}; use larger messages"
            )
        for bucket in self._buckets:
            for param in bucket.params:
                param.register_post_accumulate_grad_hook(lambda p, b=bucket: self._on_grad_ready(b, p))
        self._phase = self._make_phase(topology, start=0)
        self._start_compression(identical=True)
        if self._rank == 0:
            sizes = ", ".join(f"{nbytes / 2**20:.2f}" for nbytes in self.bucket_bytes)
            logger.debug(f"DecentralizedDataParallel: {self._phase.label}; {len(self._buckets)} buckets, MB: {sizes}")

    # -- construction -------------------------------------------------------------------------------------------
    def _make_phase(self, topology: str | Topology | type[Topology], start: int) -> _Phase:
        """Gossip over ``topology`` (built and its process groups created, a collective) or all-reduce."""
        if isinstance(topology, str) and topology == ALLREDUCE:
            return _Phase(None, start, [], [])
        key = topology if isinstance(topology, (str, type)) else id(topology)
        if key in self._topologies:  # built, and its process groups created, by an earlier phase
            topology = self._topologies[key]
        else:
            if isinstance(topology, Topology):
                if topology.world_size != self._world_size:
                    raise ValueError(
                        f"topology built for {topology.world_size} workers, but the world has {self._world_size}"
                    )
            else:
                cls = topology if isinstance(topology, type) else get_topology_class(topology)
                topology = cls(local_world_size=self._local_world_size, world_size=self._world_size, rank=self._rank)
            if self._world_size > 1:
                timeout = self._group_timeout  # passed only when set: a subclass may override create_groups()
                kwargs = {"timeout": timeout, "world_group": self._exchange_group} if timeout is not None else {}
                topology.create_groups(**kwargs)
            self._topologies[key] = topology
        if topology.is_staged and any(hasattr(b.optimizer, "pre_average_hook") for b in self._buckets):
            raise ValueError(
                f"topology '{topology.name}' has rounds of several stages; an optimizer with decent-dp's "
                "pre_average_hook supports only one-stage rounds"
            )
        rounds = range(topology.period)
        return _Phase(
            topology, start, [topology.edges(r, self._rank) for r in rounds], [topology.async_stage(r) for r in rounds]
        )

    @property
    def _group_timeout(self) -> timedelta | None:
        """The timeout of the engine's own process groups: the exchange limit on a GPU, where the host does not wait
        (gloo's groups keep the default: there the wait itself has the limit)."""
        on_gpu = any(b.flat.device.type == "cuda" for b in self._buckets)
        return self._timeout if on_gpu else None

    def _make_exchange_group(self) -> dist.ProcessGroup | None:
        """The group pairs exchange and gradients are averaged in: the default group, or on a GPU with a time limit
        a world-wide group that carries it. One all-reduce over it initializes its communicator with every rank
        (NCCL's first point-to-point batch on a lazily created group must include all ranks)."""
        timeout = self._group_timeout
        if self._world_size == 1 or timeout is None:
            return None
        group = dist.new_group(timeout=timeout)
        dist.all_reduce(torch.zeros(1, device=self._buckets[0].flat.device), group=group)
        return group

    def _start_compression(self, identical: bool) -> None:
        """With compression, each bucket's copies for the current phase's rounds: the parameters where they are equal
        on every worker (at construction), zero otherwise; either way equal wherever they are held."""
        if self._compressor is None or self._phase.allreduce:
            for bucket in self._buckets:
                bucket.compressed = None
            if self._compressor is not None and self._rank == 0:
                logger.info("DecentralizedDataParallel: all-reduce mode averages full-precision gradients "
                            f"({self._compressor.name} compression applies to gossip)")
            return
        groups = [edge for stages in self._phase.my_stages for edge in stages if edge.size > 1]  # each: its copies
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
        return self._waits.seconds

    def _check_same_model_everywhere(self) -> None:
        if self._world_size == 1:
            return
        mine = [(n, tuple(t.shape), str(t.dtype)) for n, t in self._state_tensors()]
        theirs = [mine]
        dist.broadcast_object_list(theirs, src=0)
        for here, there in itertools.zip_longest(mine, theirs[0]):
            if here != there:
                raise RuntimeError(
                    f"rank {self._rank}'s model differs from rank 0's: {here} here, {there} on rank 0"
                )

    def _state_tensors(self) -> list[tuple[str, Tensor]]:
        return list(self.module.named_parameters()) + list(self.module.named_buffers())

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        """All workers start from rank 0's parameters, frozen parameters and buffers."""
        if self._world_size > 1:
            for _, tensor in self._state_tensors():
                run_collective(dist.broadcast, tensor.data, src=0)

    @torch.no_grad()
    def _build_buckets(
        self, optim_fn: OptimFn, lr_scheduler_fn: LRSchedulerFn | None, capacity: float
    ) -> list[_Bucket]:
        """Group trainable parameters into buckets of one dtype and device each.

        Reverse registration order approximates the order in which backward produces gradients (torch DDP's first
        guess too); any other order is still correct, since readiness is counted per parameter.
        """
        trainable = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        for name, p in trainable:
            if not _layout_is_supported(p):
                raise ValueError(
                    f"parameter '{name}' has strides {p.stride()}: only contiguous or channels_last layouts are supported"
                )
        groups: list[list[tuple[str, nn.Parameter]]] = []
        open_group: dict[tuple[torch.dtype, torch.device], list[tuple[str, nn.Parameter]]] = {}
        open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
        for name, p in reversed(trainable):
            key = (p.dtype, p.device)
            if key not in open_group:
                open_group[key], open_bytes[key] = [], 0
                groups.append(open_group[key])
            open_group[key].append((name, p))
            open_bytes[key] += _aligned(p.numel()) * p.element_size()
            if open_bytes[key] >= capacity:
                del open_group[key]
        order = {id(p): i for i, (_, p) in enumerate(reversed(trainable))}
        groups.sort(key=lambda g: order[id(g[-1][1])])
        return [self._make_bucket(i, g, optim_fn, lr_scheduler_fn) for i, g in enumerate(groups)]

    def _make_bucket(
        self,
        index: int,
        named: list[tuple[str, nn.Parameter]],
        optim_fn: OptimFn,
        lr_scheduler_fn: LRSchedulerFn | None,
    ) -> _Bucket:
        names, params = [n for n, _ in named], [p for _, p in named]
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += _aligned(p.numel())
        flat = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        # Compressed gossip receives into its own (smaller) messages: no float copy of the bucket to receive into.
        comm = torch.zeros_like(flat) if self._compressor is None else flat.new_zeros(0)
        views = [_slice_like(flat, o, p) for o, p in zip(offsets, params)]
        torch._foreach_copy_(views, [p.data for p in params])
        if self._param_as_bucket_view:
            for p, view in zip(params, views):
                p.data = view
        optimizer = optim_fn(list(zip(names, params)))
        if self._compressor is not None and hasattr(optimizer, "pre_average_hook"):
            raise ValueError("compression: an optimizer with decent-dp's pre_average_hook reads uncompressed values")
        if hasattr(optimizer, "pre_average_hook"):  # decent-dp's extension point reads the received values here
            for p, offset in zip(params, offsets):
                p.comm_buffer = _slice_like(comm, offset, p)  # type: ignore[attr-defined]
        scheduler = lr_scheduler_fn(optimizer) if lr_scheduler_fn is not None else None
        return _Bucket(
            index=index, flat=flat, comm=comm, comm_anchor=comm.view_as(comm), names=names, params=params, views=views,
            optimizer=optimizer, scheduler=scheduler,
        )

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
            self._armed = True
        output = self.module(*args, **kwargs)
        if training_step:
            step = self._step
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, Tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda grad, step=step: self._check_not_stepped(step))
        return output

    def _check_not_stepped(self, forward_step: int) -> None:
        """Backward reaches a forward's outputs first: refuse a second backward after that forward's step."""
        if self._step != forward_step and not self._accumulating:
            raise RuntimeError(_SECOND_BACKWARD)

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

    def _on_grad_ready(self, bucket: _Bucket, param: nn.Parameter) -> None:
        if self._accumulating:
            return
        if not self._armed:
            raise RuntimeError(_SECOND_BACKWARD)
        if id(param) in self._ready_params:
            raise RuntimeError(
                f"DecentralizedDataParallel: parameter '{bucket.names[bucket.params.index(param)]}' received its "
                "gradient twice in one backward (reentrant activation checkpointing?); use use_reentrant=False"
            )
        self._ready_params.add(id(param))
        bucket.ready += 1
        if not self._backward_started:
            self._backward_started = True
            Variable._execution_engine.queue_callback(self._finish_backward)
        while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].complete:
            self._on_bucket_ready(self._buckets[self._next_bucket])
            self._next_bucket += 1

    def _on_bucket_ready(self, bucket: _Bucket) -> None:
        """A bucket's gradients are all there (buckets come strictly in index order, the same on every rank)."""
        if self._phase.allreduce:
            self._launch_gradient_average(bucket)
        elif not self._defer_steps:
            self._process(bucket)

    @torch.no_grad()
    def _finish_backward(self) -> None:
        """End of backward: the buckets left (unused parameters); in all-reduce mode each bucket's step once its
        gradient sum arrives; the steps deferred until every gradient is there (clipping, fp16); then the next step."""
        for bucket in self._buckets[self._next_bucket :]:
            self._on_bucket_ready(bucket)
        if self._phase.allreduce:
            for bucket in self._buckets:  # in launch order: each steps while the later buckets' sums are in flight
                self._finish_gradient_average(bucket)
                if not self._defer_steps:
                    self._step_bucket(bucket)
        if self._defer_steps:
            self._prepare_deferred_steps()
            for bucket in self._buckets:
                self._step_bucket(bucket) if self._phase.allreduce else self._process(bucket)
        if self._scaler is not None:
            self._scaler.update()
        for bucket in self._buckets:
            bucket.ready = 0
        self._ready_params.clear()
        self._next_bucket = 0
        self._armed = self._backward_started = False
        self._step += 1
        if self._global_avg_every and not self._phase.allreduce and self._step % self._global_avg_every == 0:
            self.global_avg(will_revert=False)

    def _prepare_deferred_steps(self) -> None:
        """Unscale, agree on overflow across all workers, and clip by the whole model's gradient norm.

        The overflow flag is read on the host once per step (GradScaler.step would read it once per bucket), and
        the buckets then step directly or all skip.
        """
        self._overflow = False
        if self._scaler is not None and self._scaler.is_enabled():
            with_grads = [b for b in self._buckets if b.has_grads()]
            for bucket in with_grads:
                self._scaler.unscale_(bucket.optimizer)
            found = [t for b in with_grads for t in self._scaler._found_inf_per_device(b.optimizer).values()]
            if found:
                overflow = torch.stack([t.float() for t in found]).amax().reshape(1)
                if self._world_size > 1:
                    with peers_must_answer(f"the overflow check at step {self._step}", self._timeout):
                        run_collective(dist.all_reduce, overflow, op=dist.ReduceOp.MAX)
                for t in found:
                    t.copy_(overflow.reshape(()))  # what GradScaler.update() reads
                self._overflow = bool(overflow.item())
        if self._grad_clip_norm > 0:
            grads = [p for b in self._buckets for p in b.params if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(grads, self._grad_clip_norm)

    @torch.no_grad()
    def _process(self, bucket: _Bucket) -> None:
        """Gossip: mix with the neighbours' x^s, take the local step, launch the exchange of x^{s+1}."""
        with record_function("decent_train.mix"):
            self._mix(bucket)
        self._step_bucket(bucket)
        with record_function("decent_train.launch"):
            self._launch(bucket, self._phase.round_of(self._step + 1))

    def _step_bucket(self, bucket: _Bucket) -> None:
        """The bucket's optimizer and scheduler step; with fp16 loss scaling, unless a gradient overflowed on some
        worker (the bucket's gradients are unscaled already: what ``GradScaler.step`` does, without its host sync)."""
        scaled = self._scaler is not None and self._scaler.is_enabled()
        if not scaled or (not self._overflow and bucket.has_grads()):
            bucket.optimizer.step()
        bucket.optimizer.zero_grad(set_to_none=True)
        if bucket.scheduler is not None:
            bucket.scheduler.step()

    # -- all-reduce mode ----------------------------------------------------------------------------------------
    def _launch_gradient_average(self, bucket: _Bucket) -> None:
        """Copy the bucket's gradients into one buffer (zeros for a parameter without one) and start its sum."""
        if self._world_size == 1:
            return
        views = bucket.gradient_views()
        with torch.no_grad():
            for param, view in zip(bucket.params, views):
                view.copy_(param.grad) if param.grad is not None else view.zero_()
            bucket.grads.div_(self._world_size)
        bucket.gradient_works = [dist.all_reduce(bucket.grads, group=self._exchange_group, async_op=True)]

    def _finish_gradient_average(self, bucket: _Bucket) -> None:
        """Wait for the bucket's gradient sum; its slices become the parameters' gradients."""
        if self._world_size == 1:
            return
        works, bucket.gradient_works = bucket.gradient_works, []
        self._wait_works(works, bucket, list(range(self._world_size)), "gradient all-reduce")
        for param, view in zip(bucket.params, bucket.gradient_views()):
            param.grad = view

    # -- the exchange -------------------------------------------------------------------------------------------
    def _launch(self, bucket: _Bucket, round_: int) -> None:
        """Start the exchange of x^{s+1} in the current phase's round ``round_``: the stages before its overlapped
        stage now, that one in the background."""
        stages, async_stage = self._phase.my_stages[round_], self._phase.async_stages[round_]
        if all(edge.size == 1 for edge in stages):
            return
        if not self._param_as_bucket_view:
            torch._foreach_copy_(bucket.views, [p.data for p in bucket.params])
        value = bucket.flat
        for k, edge in enumerate(stages[:async_stage]):
            works = self._exchanger.start(bucket, edge, value)
            self._wait_works(works, bucket, edge.ranks, "exchange")
            value = self._exchanger.finish(bucket, edge, value)
        works = self._exchanger.start(bucket, stages[async_stage], value)
        bucket.pending = _Exchange(stages, async_stage, value, works)

    def _wait(self, bucket: _Bucket) -> _Exchange | None:
        exchange, bucket.pending = bucket.pending, None
        if exchange is not None:
            edge = exchange.stages[exchange.async_stage]
            self._wait_works(exchange.works, bucket, edge.ranks, "exchange")
        return exchange

    def _wait_works(self, works: list[Any], bucket: _Bucket, ranks: list[int], what: str) -> None:
        def described() -> str:  # formatted only if the wait fails
            peers = [r for r in ranks if r != self._rank]
            return f"the {what} of bucket {bucket.index} with rank(s) {peers} at step {self._step}"

        with peers_must_answer(described, self._timeout), record_function("decent_train.wait"):
            self._waits.wait(works, bucket.flat.device)

    def _mix(self, bucket: _Bucket) -> None:
        """x <- (1 - a) x + a (W x), a being the adaptive factor: finish the exchange in flight, run the stages after
        it, and combine. One-stage rounds combine straight from ``comm`` (no extra pass over memory)."""
        exchange = self._wait(bucket)
        if exchange is None:
            return
        stages, k, value = exchange.stages, exchange.async_stage, exchange.value
        alpha, edge = self._adaptive_factor, stages[k]
        for edge in stages[k + 1 :]:  # the stages after the one in flight: first finish that, then run each
            value = self._exchanger.finish(bucket, stages[k], value)
            works = self._exchanger.start(bucket, edge, value)
            self._wait_works(works, bucket, edge.ranks, "exchange")
            k += 1
        if bucket.compressed is not None:  # the last stage is a compressed gossip step
            if len(stages) == 1:  # on the parameters, in place: the adaptive factor scales the step
                received = self._exchanger.received(bucket, edge)
                bucket.compressed.mix(value, value, edge, received, self._consensus_step * alpha)
            else:  # into ``staged``, then the parameters move toward the round's result
                value = self._exchanger.finish(bucket, edge, value)
                if value is not bucket.flat:
                    bucket.flat.lerp_(value, alpha)
            self._write_params(bucket)
            return
        own, other = Exchanger.coefficients(edge)  # x_new = (1-alpha) x + alpha (own value + other comm)
        if hasattr(bucket.optimizer, "pre_average_hook"):  # one-stage rounds only (checked when the phase starts)
            # decent-dp's contract: comm_buffer holds neighbor * (sum over the group) when the hook runs. A pair's
            # comm holds the peer's value, so its sum gains our own and our coefficient loses the neighbour's share.
            if edge.size == 2:
                bucket.comm.add_(bucket.flat)
                own -= other
            bucket.comm.mul_(other)
            bucket.optimizer.pre_average_hook(edge, edge.weight)
            self._write_mix(bucket, bucket.flat, 1.0 - alpha + alpha * own, alpha)
        elif value is bucket.flat:
            self._write_mix(bucket, bucket.flat, 1.0 - alpha + alpha * own, alpha * other)
        else:
            self._write_mix(bucket, value, alpha * own, alpha * other, keep=1.0 - alpha)

    def _write_mix(self, bucket: _Bucket, value: Tensor, own: float, other: float, keep: float | None = None) -> None:
        """The round's result into ``flat`` (``Exchanger.combine``), then into the parameters."""
        self._exchanger.combine(bucket, value, own, other, keep)
        self._write_params(bucket)

    def _write_params(self, bucket: _Bucket) -> None:
        """``flat`` into the parameters, when they are not views of it."""
        if not self._param_as_bucket_view:
            torch._foreach_copy_([p.data for p in bucket.params], bucket.views)

    def _drop_pending_exchanges(self) -> None:
        """Forget in-flight exchanges after waiting for them (the workers are at consensus: no mix is needed)."""
        for bucket in self._buckets:
            self._wait(bucket)
        self._global_average = None
        self._reset_compression(identical=True)  # equal parameters everywhere (switch_to then starts new copies)

    # -- schedules ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def switch_to(self, topology: str | Topology | type[Topology]) -> None:
        """From the next step on, gossip over ``topology`` (rounds counted from that step) or, with ``"allreduce"``,
        average the gradients. Call it between steps, on every worker in the same order (it may create process
        groups). Optimizers and schedulers carry over.

        Exchanges in flight are drained and dropped. Entering all-reduce replaces every worker's parameters and
        floating-point optimizer state (momentum, Adam's moments) by their averages, so the workers stay equal from
        then on. Entering gossip starts the new topology's first exchange: the next step mixes with its round 0.
        """
        if self._armed or self._backward_started:
            raise RuntimeError("switch_to() between steps only: after backward, before the next training forward")
        if self._global_average is not None:
            raise RuntimeError("switch_to() inside global_avg(will_revert=True): call revert_global_avg() first")
        phase = self._make_phase(topology, start=self._step)
        if phase.allreduce:
            self.global_avg(will_revert=False)
            self._average_optimizer_states()
            self._phase = phase
            self._start_compression(identical=False)  # none in all-reduce mode
        else:
            self._drop_pending_exchanges()
            self._phase = phase
            self._start_compression(identical=False)
            for bucket in self._buckets:
                self._launch(bucket, 0)

    def _average_optimizer_states(self) -> None:
        """Average every optimizer's floating-point state on the parameters' device (momentum, Adam's moments).

        Step counters are equal everywhere and stay out; torch's Adam keeps ``step`` as a CPU tensor, which a
        CUDA-only (NCCL) group cannot reduce.
        """
        self._average_tensors(
            [
                value
                for bucket in self._buckets
                for param in bucket.params
                for key, value in sorted(bucket.optimizer.state.get(param, {}).items())
                if key != "step" and isinstance(value, Tensor) and value.is_floating_point()
                and value.device == param.device
            ]
        )

    def _average_tensors(self, tensors: list[Tensor]) -> None:
        """Average ``tensors`` over all workers in place, with one all-reduce per dtype and device."""
        groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for tensor in tensors:
            groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        for same in groups.values():
            flat = torch._utils._flatten_dense_tensors(same)
            self._average_in_place(flat)
            torch._foreach_copy_(same, torch._utils._unflatten_dense_tensors(flat, same))

    # -- evaluation ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def global_avg(self, will_revert: bool = True, return_d2c: bool = False) -> float | None:
        """Replace every worker's parameters by the exact global average (for evaluation).

        ``will_revert=True`` keeps the local values (and pending exchanges) for ``revert_global_avg()``; with False
        the average persists and training continues from it. ``return_d2c`` returns this worker's L2 distance to the
        average. Costs one blocking all-reduce of the parameters.
        """
        for bucket in self._buckets:  # in-flight sends read the parameters: let them finish first
            if bucket.pending is not None:
                self._wait_keep(bucket)
        params = [p for b in self._buckets for p in b.params]
        buffers = self._float_buffers() if self._sync_buffer_in_global_avg else []
        if self._global_average is None and (will_revert or return_d2c):
            self._global_average = _GlobalAverage(
                params=[p.detach().clone() for p in params], buffers=[t.clone() for t in buffers]
            )
        for tensor in [b.flat for b in self._buckets] if self._param_as_bucket_view else [p.data for p in params]:
            self._average_in_place(tensor)
        self._average_tensors(buffers)  # one all-reduce, not one per BatchNorm statistic
        d2c = None
        if return_d2c:
            distances = torch._foreach_norm(torch._foreach_sub(params, self._global_average.params))
            d2c = float(torch.linalg.vector_norm(torch.stack(distances).double()))
        if not will_revert:
            self._drop_pending_exchanges()
        return d2c

    def _wait_keep(self, bucket: _Bucket) -> None:
        """Complete an exchange but keep it pending, so its data is still mixed in at the next step."""
        exchange = self._wait(bucket)
        bucket.pending = dataclasses.replace(exchange, works=[]) if exchange is not None else None

    def _average_in_place(self, tensor: Tensor) -> None:
        if self._world_size > 1:
            with peers_must_answer(f"the global average at step {self._step}", self._timeout):
                run_collective(dist.all_reduce, tensor)
            tensor.div_(self._world_size)

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

    # -- checkpoints --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def engine_state_dict(self) -> dict[str, Any]:
        """Everything besides the model that training needs to continue exactly: the step, each bucket's optimizer
        and LR scheduler, the scaler, the adaptive factor, and the exchange in flight. That exchange is completed
        here and what it delivered is saved, to be mixed in at the next step as it would have been. Call it between
        steps (not inside ``global_avg(will_revert=True)``); save the model's ``state_dict()`` with it.
        """
        if self._global_average is not None:
            raise RuntimeError("engine_state_dict() inside global_avg(will_revert=True): revert_global_avg() first")
        buckets = []
        for bucket in self._buckets:
            self._wait_keep(bucket)
            buckets.append(
                {
                    "names": list(bucket.names),
                    "optimizer": bucket.optimizer.state_dict(),
                    "scheduler": bucket.scheduler.state_dict() if bucket.scheduler is not None else None,
                    "received": bucket.comm.clone() if bucket.pending is not None else None,
                    "staged": (
                        bucket.pending.value.clone()
                        if bucket.pending is not None and bucket.pending.value is not bucket.flat
                        else None
                    ),
                    "compressed": bucket.compressed.state() if bucket.compressed is not None else None,
                }
            )
        return {
            "step": self._step,
            "world_size": self._world_size,
            "topology": self._phase.label,
            "phase_start": self._phase.start,
            "adaptive_factor": self._adaptive_factor,
            "scaler": self._scaler.state_dict() if self._scaler is not None else None,
            "buckets": buckets,
        }

    @staticmethod
    def averageable_state(state: dict[str, Any]) -> dict[str, Any]:
        """``engine_state_dict()`` without what is one worker's own: the exchange in flight and the compressed
        gossip's public copies. What the workers' states average to continues training on another number of workers
        (``load_engine_state_dict``): the mixing matrices are doubly stochastic, so the average of the saved models
        is also their average after the exchange in flight, and the copies restart from the averaged model."""
        buckets = [{**b, "received": None, "staged": None, "compressed": None} for b in state["buckets"]]
        return {**state, "buckets": buckets}

    @torch.no_grad()
    def load_engine_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``engine_state_dict()`` (after loading the model's ``state_dict()`` saved with it), or from
        the average of several workers' ``averageable_state``s, marked ``averaged_from`` (their number): then the
        world size and topology may differ, and every worker must load the same average."""
        averaged = bool(state.get("averaged_from"))
        if not averaged and (state["world_size"] != self._world_size or state["topology"] != self._phase.label):
            raise ValueError(
                f"the engine state is from {state['world_size']} workers with {state['topology']!r}; this engine has "
                f"{self._world_size} workers with {self._phase.label!r}"
            )
        saved_names = [b["names"] for b in state["buckets"]]
        if saved_names != self.bucket_names:
            raise ValueError(
                "the engine state's buckets hold other parameters than this engine's (another model or "
                "bucket_size_in_mb?)"
            )
        self._step = state["step"]
        self._phase.start = state.get("phase_start", 0)
        self._adaptive_factor = state["adaptive_factor"]
        if self._scaler is not None and state["scaler"] is not None:
            self._scaler.load_state_dict(state["scaler"])
        for bucket, saved in zip(self._buckets, state["buckets"]):
            self._wait(bucket)  # nothing may still write into ``comm``
            bucket.optimizer.load_state_dict(saved["optimizer"])
            if bucket.scheduler is not None and saved["scheduler"] is not None:
                bucket.scheduler.load_state_dict(saved["scheduler"])
            if not self._param_as_bucket_view:
                torch._foreach_copy_(bucket.views, [p.data for p in bucket.params])
            compressed = saved.get("compressed")
            if averaged:
                if bucket.compressed is not None:
                    bucket.compressed.reset(bucket.flat)  # the same model on every worker
                continue
            if (compressed is None) != (bucket.compressed is None):
                raise ValueError("the engine state was saved with other compression settings than this engine's")
            if compressed is not None:
                bucket.compressed.load(compressed)
            if saved["received"] is not None:  # the exchange the last step launched, for this step's round
                round_ = self._phase.round_of(self._step)
                bucket.comm.copy_(saved["received"])
                value = bucket.flat if saved.get("staged") is None else bucket.staging().copy_(saved["staged"])
                bucket.pending = _Exchange(
                    self._phase.my_stages[round_], self._phase.async_stages[round_], value, []
                )

    # -- accessors ----------------------------------------------------------------------------------------------
    def get_lr(self) -> float:
        """Learning rate of the first bucket's first parameter group."""
        return float(self._buckets[0].optimizer.param_groups[0]["lr"]) if self._buckets else 0.0

    def set_adaptive_factor(self, factor: float) -> None:
        """Damp mixing: x <- (1 - factor) x + factor (W x). 1 is plain gossip, 0 disables mixing."""
        if not 0.0 <= factor <= 1.0:
            raise ValueError(f"adaptive factor must be in [0, 1], got {factor}")
        self._adaptive_factor = float(factor)

    @property
    def topology(self) -> Topology | None:
        """The topology gossiped over now; None in all-reduce mode."""
        return self._phase.topology

    @property
    def mode(self) -> str:
        """``"gossip"`` or ``"allreduce"``."""
        return ALLREDUCE if self._phase.allreduce else "gossip"

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far."""
        return self._step

    @property
    def optimizers(self) -> list[Optimizer]:
        return [b.optimizer for b in self._buckets]

    @property
    def lr_schedulers(self) -> list[LRScheduler | None]:
        return [b.scheduler for b in self._buckets]

    _optims = optimizers  # decent-dp's private names, used by its users' checkpoint code
    _lr_schedulers = lr_schedulers

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
            self._wait(bucket)
        with torch.no_grad():
            return self.module.load_state_dict(state_dict, strict=strict)
