"""The mean of several saved states (nested dicts, lists and tuples of tensors, the same layout in each), summed in
float64: what an averaged resume starts every worker from.

The sum is split between the workers: each sums its share of the states and one all-reduce adds the shares, so that
N checkpoint files are read (and hashed) once in all, not once by each of M workers.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from decent_train.engine.comm import peers_must_answer

ALL_REDUCE_ELEMENTS = 1 << 24  # float64 elements per all-reduce (128 MiB): the device holds one such chunk at a time
Layout = list[tuple[tuple[int, ...], torch.dtype]]


def named_floats(obj: Any, name: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each floating-point tensor of a nested state, in a fixed order (:func:`floating_tensors`':
    dict keys as they are, list items in order; the name is the keys to it, joined by dots)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield name, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from named_floats(value, f"{name}.{key}" if name else str(key))
    elif isinstance(obj, (list, tuple)):
        for index, item in enumerate(obj):
            yield from named_floats(item, f"{name}.{index}" if name else str(index))


def floating_tensors(obj: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a nested state, in a fixed order."""
    return [t for _, t in named_floats(obj)]


def with_floats(obj: Any, values: Iterator[torch.Tensor]) -> Any:
    """``obj`` with its floating-point tensors replaced, in :func:`floating_tensors`' order, by ``values``."""
    if isinstance(obj, torch.Tensor):
        return next(values) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {key: with_floats(value, values) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(with_floats(item, values) for item in obj)
    return obj


def layout_of(state: Any) -> Layout:
    """The shape and dtype of each floating-point tensor of ``state``: what states averaged together share."""
    return [(tuple(t.shape), t.dtype) for t in floating_tensors(state)]


@dataclass
class StateSum:
    """The float64 sums of the floating-point tensors of the states added so far, and the first state as a skeleton:
    its floats on the meta device (their shapes and dtypes: the layout the others must have), its other values what
    the average keeps (step counts, schedules, the scaler)."""

    skeleton: Any = None
    sums: list[torch.Tensor] = field(default_factory=list)
    count: int = 0

    @property
    def layout(self) -> Layout:
        return layout_of(self.skeleton)

    def add(self, state: Any) -> bool:
        """Add ``state``; False (nothing added) if its layout differs from the first state's."""
        floats = floating_tensors(state)
        if self.count == 0:
            self.skeleton = with_floats(state, iter([t.to("meta") for t in floats]))
            self.sums = [t.to(torch.float64, copy=True) for t in floats]
        elif layout_of(state) != self.layout:
            return False
        else:
            for total, value in zip(self.sums, floats):
                total.add_(value)
        self.count += 1
        return True

    def mean(self) -> Any:
        """The average: the first state with each floating-point tensor the mean, in its own dtype (the sums are
        divided in place: no second float64 copy)."""
        means = [total.div_(self.count).to(dtype) for total, (_, dtype) in zip(self.sums, self.layout)]
        return with_floats(self.skeleton, iter(means))


def sum_across_workers(mine: StateSum, skeleton: Any, count: int) -> StateSum:
    """Every worker's ``mine`` added up, the ``count`` states of all workers: each worker holds the same total after
    it. ``skeleton`` is the first state's (every worker's copy); a worker without a share adds zeros. Collective;
    every share's layout must be the skeleton's."""
    sums = mine.sums or [torch.zeros(shape, dtype=torch.float64) for shape, _ in layout_of(skeleton)]
    all_reduce_in_chunks(sums, "averaging a checkpoint's states (the all-reduce of their sums)")
    return StateSum(skeleton, sums, count)


def all_reduce_in_chunks(
    tensors: list[torch.Tensor], what: str, group: dist.ProcessGroup | None = None, timeout: timedelta | None = None
) -> None:
    """Sum ``tensors`` over ``group``'s ranks in place, ``ALL_REDUCE_ELEMENTS`` at a time, device by device (a
    sharded optimizer's state mixes GPU shards with CPU step counts): one chunk's flat copy exists at a time, on the
    device the backend needs (NCCL: this rank's GPU). ``what`` names it if a peer fails."""
    nccl = "nccl" in dist.get_backend(group)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(tensor)
    for chunk in (chunk for same in by_device.values() for chunk in _chunks(same, ALL_REDUCE_ELEMENTS)):
        on_host = chunk[0].device.type == "cpu"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl and on_host else chunk[0].device
        flat = torch.cat([t.reshape(-1) for t in chunk]).to(device)
        with peers_must_answer(what, timeout):
            dist.all_reduce(flat, group=group)
        for total, value in zip(chunk, flat.to(chunk[0].device).split([t.numel() for t in chunk])):
            total.copy_(value.view_as(total))


def _chunks(tensors: list[torch.Tensor], elements: int) -> Iterator[list[torch.Tensor]]:
    """``tensors`` in consecutive groups of at most ``elements`` elements (a larger tensor alone)."""
    group: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        if group and size + tensor.numel() > elements:
            yield group
            group, size = [], 0
        group.append(tensor)
        size += tensor.numel()
    if group:
        yield group
