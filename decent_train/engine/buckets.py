"""Buckets: parameters of one dtype and device that mix, step and exchange together, laid out in one flat buffer.

Reverse registration order approximates the order in which backward produces gradients (torch DDP's first guess
too); any other order is still correct, since readiness is counted per parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from decent_train.engine.exchange import ExchangeBuffers
from decent_train.engine.optimizers import LRSchedulerFn, OptimFn
from decent_train.engine.topology import Edge

__all__ = ["Bucket", "PendingExchange", "build_buckets", "slice_like"]

ALIGN = 32  # elements: every parameter starts 64-256 bytes aligned inside its bucket


@dataclass
class PendingExchange:
    """A gossip exchange in flight: the stages of its round, the one in flight (``async_stage``), the tensor that
    stage sends (the parameters, or the result of the stages before it) and the handles to wait on."""

    stages: list[Edge]
    async_stage: int
    value: Tensor
    works: list[Any]


@dataclass(kw_only=True)
class Bucket(ExchangeBuffers):
    """Parameters of one dtype and device that mix, step and exchange together (the exchange's buffers: the base
    class). ``flat`` holds the parameter values: the parameters are views of it with ``param_as_bucket_view``;
    otherwise it is a staging copy. ``grads`` (all-reduce mode) holds the gradients being averaged, and ``comm``
    (gossip) what the neighbours send, each allocated when first needed (``comm``: ``allocate_comm``).
    """

    names: list[str]
    params: list[nn.Parameter]
    views: list[Tensor]  # each parameter's slice of ``flat``
    optimizer: Optimizer
    scheduler: LRScheduler | None
    lr_scheduler_fn: LRSchedulerFn | None = None  # what built ``scheduler``: a resume may rebuild its position
    pending: PendingExchange | None = None
    ready: int = 0  # parameters whose gradient arrived in this backward
    grads: Tensor | None = None
    grad_views: list[Tensor] = field(default_factory=list)  # each parameter's slice of ``grads`` (an anchor, too)
    gradient_works: list[Any] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.ready == len(self.params)

    def allocate_comm(self) -> None:
        """The receive buffer, made once, before the first mode that receives into it (gossip without compression
        over a group of two or more). Until then ``comm`` is empty: at world size one, in all-reduce mode and with
        compression nothing arrives there, and a bucket-sized buffer would cost as much memory as the parameters."""
        if self.comm.numel() != self.flat.numel():
            self.comm = torch.zeros_like(self.flat)
            self.comm_anchor = self.comm.view_as(self.comm)

    def has_grads(self) -> bool:
        return any(p.grad is not None for p in self.params)

    def gradient_views(self) -> list[Tensor]:
        """Each parameter's slice of ``grads``, laid out like the parameter (allocated at the first call)."""
        if self.grads is None:
            self.grads = torch.zeros_like(self.flat)
            self.grad_views = [slice_like(self.grads, view.storage_offset(), view) for view in self.views]
        return self.grad_views

    def write_params(self, param_as_bucket_view: bool) -> None:
        """``flat`` into the parameters, when they are not views of it."""
        if not param_as_bucket_view:
            torch._foreach_copy_([p.data for p in self.params], self.views)

    def read_params(self, param_as_bucket_view: bool) -> None:
        """The parameters into ``flat``, when they are not views of it."""
        if not param_as_bucket_view:
            torch._foreach_copy_(self.views, [p.data for p in self.params])


def _aligned(numel: int) -> int:
    return -(-numel // ALIGN) * ALIGN


def _layout_is_supported(p: Tensor) -> bool:
    """Dense, non-overlapping layouts that a slice of a flat buffer can reproduce with ``as_strided``."""
    return (
        p.is_contiguous()
        or (p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last))
        or (p.dim() == 5 and p.is_contiguous(memory_format=torch.channels_last_3d))
    )


def slice_like(flat: Tensor, offset: int, like: Tensor) -> Tensor:
    """A view of ``flat`` at ``offset`` with the shape and strides (memory format) of ``like``."""
    return flat.as_strided(like.shape, like.stride(), offset)


@torch.no_grad()
def build_buckets(
    module: nn.Module,
    optim_fn: OptimFn,
    lr_scheduler_fn: LRSchedulerFn | None,
    capacity: float,
    param_as_bucket_view: bool,
    compressed: bool,
) -> list[Bucket]:
    """Group ``module``'s trainable parameters into buckets of one dtype and device each, of about ``capacity``
    bytes, each with its own optimizer and LR scheduler."""
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
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
    return [
        _make_bucket(i, g, optim_fn, lr_scheduler_fn, param_as_bucket_view, compressed) for i, g in enumerate(groups)
    ]


def _make_bucket(
    index: int,
    named: list[tuple[str, nn.Parameter]],
    optim_fn: OptimFn,
    lr_scheduler_fn: LRSchedulerFn | None,
    param_as_bucket_view: bool,
    compressed: bool,
) -> Bucket:
    names, params = [n for n, _ in named], [p for _, p in named]
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += _aligned(p.numel())
    flat = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
    views = [slice_like(flat, o, p) for o, p in zip(offsets, params)]
    torch._foreach_copy_(views, [p.data for p in params])
    if param_as_bucket_view:
        for p, view in zip(params, views):
            p.data = view
    optimizer = optim_fn(list(zip(names, params)))
    scheduler = lr_scheduler_fn(optimizer) if lr_scheduler_fn is not None else None
    bucket = Bucket(
        index=index, flat=flat, comm=flat.new_zeros(0), names=names, params=params, views=views, optimizer=optimizer,
        scheduler=scheduler, lr_scheduler_fn=lr_scheduler_fn,
    )
    if hasattr(optimizer, "pre_average_hook"):  # decent-dp's extension point reads the received values here
        if compressed:
            raise ValueError("compression: an optimizer with decent-dp's pre_average_hook reads uncompressed values")
        bucket.allocate_comm()  # now: its slices are handed out once, and a rebuilt ``comm`` would orphan them
        for p, offset in zip(params, offsets):
            p.comm_buffer = slice_like(bucket.comm, offset, p)  # type: ignore[attr-defined]
    return bucket
