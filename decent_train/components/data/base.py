"""What every dataset gives the worker, and the helpers its batches go through.

A ``Datasets`` has endless shuffled training micro-batches of this worker's shard (deterministic by seed, disjoint
across workers), evaluation batches that cover the whole evaluation set exactly once over all workers, and the input
shape and number of classes (the vocabulary size for tokens) that size the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch import Tensor

Batch = tuple[Tensor, Tensor]
BatchTransform = Callable[[Tensor, Optional[torch.Generator]], Tensor]  # (x, generator or None at evaluation) -> x


class Datasets(ABC):
    """A training and an evaluation split, sharded over ``world`` workers."""

    input_shape: tuple[int, ...]  # one sample, without the batch dimension
    num_classes: int  # classes; the vocabulary size for tokens
    train_size: int  # training samples (context windows for tokens) in one epoch

    @abstractmethod
    def train_batches(self, batch_size: int, rank: int, world: int, seed: int, start: int = 0) -> Iterator[Batch]:
        """Endless micro-batches of this worker's shard, reshuffled each epoch; disjoint from other workers'.

        ``start``: begin with micro-batch number ``start`` of that stream (a resumed run), without producing the
        ones before it.
        """

    @abstractmethod
    def eval_batches(self, batch_size: int, rank: int, world: int) -> Iterator[Batch]:
        """This worker's slice of the evaluation set; over all workers, every sample exactly once."""

    def eval_batch_count(self, batch_size: int, rank: int, world: int) -> int | None:
        """How many batches ``eval_batches`` (and ``device_eval_batches``) yield, or None where the dataset cannot say
        without reading them. A sharded evaluation agrees on the most with one all-reduce given the counts, with one
        per batch without (and refuses a wrong count). A subclass that changes the evaluation batches overrides it."""
        return None

    def micro_batches_per_epoch(self, batch_size: int, world: int) -> int:
        return (self.train_size // world) // batch_size

    def shard_summary(self, world: int, batch_size: int) -> dict[str, Any]:
        """Each worker's part of the training set, for the start-up log and the run's config: here (iid) the size of
        its share of each epoch; fixed shards add their label histograms."""
        return {"data/partition": "iid", "data/shard_sizes": [self.train_size // world] * world}

    # The worker takes its batches from these two: the same batches, on the device. In-memory data overrides them to
    # copy what it stores and transform it there.
    def device_train_batches(
        self, batch_size: int, rank: int, world: int, seed: int, start: int = 0, *, device: torch.device | str,
        channels_last: bool = False,
    ) -> Iterator[Batch]:
        """``train_batches`` on ``device`` (what the worker trains on): each copied as ``batch_to_device`` says."""
        for batch in self.train_batches(batch_size, rank, world, seed, start):
            yield batch_to_device(batch, device, channels_last)

    def device_eval_batches(
        self, batch_size: int, rank: int, world: int, *, device: torch.device | str, channels_last: bool = False
    ) -> Iterator[Batch]:
        """``eval_batches`` on ``device``."""
        for batch in self.eval_batches(batch_size, rank, world):
            yield batch_to_device(batch, device, channels_last)


def batch_generator(seed: int, rank: int, epoch: int, index: int) -> torch.Generator:
    """The random numbers of one training batch: by seed, different per worker, epoch and batch. Modulo 2**64, the
    seeds a generator takes: seeds of a few hundred and more overflowed it; smaller ones keep their numbers."""
    return torch.Generator().manual_seed((((seed * 100_003 + rank) * 1_000_003 + epoch) * 1_000_003 + index) % 2**64)


def host_to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """``t`` copied to ``device`` without blocking the host. For CUDA it is first pinned (unless a loader pinned it):
    from pageable memory the copy is synchronous whatever ``non_blocking`` says. The caching host allocator keeps a
    pinned block until the copies from it are done, so reusing it for the next batch is safe."""
    device = torch.device(device)
    if device.type == "cuda" and not t.is_pinned():
        t = t.contiguous().pin_memory()  # contiguous: pinning a strided view would pin the span it strides over
    return t.to(device, non_blocking=True)


def batch_to_device(
    batch: Batch, device: torch.device | str, channels_last: bool = False, transform: BatchTransform | None = None,
    generator: Optional[torch.Generator] = None,
) -> Batch:
    """The one way batches reach the model: copied as stored (uint8 images: a quarter of float32's bytes), then
    ``transform(x, generator)`` where they landed, so normalization and augmentation run on the GPU, not the main
    thread; the generator's numbers are still drawn on the CPU, so the batch does not depend on the device."""
    x, y = (host_to_device(t, device) for t in batch)
    if transform is not None:
        x = transform(x, generator)
    if channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y
