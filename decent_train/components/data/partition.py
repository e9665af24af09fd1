"""How the training set is dealt out to the workers (``dataset.partition``).

``iid``: every epoch one shuffle of the whole set, dealt out in turn (torch's DistributedSampler): every worker sees
every label in proportion. The others give each worker a fixed shard for the whole run, which it reshuffles within
itself every epoch: the heterogeneous setting in which the topology shows in accuracy.

- ``shards``: a seeded shuffle cut into equal parts (label mix as in the whole set, up to chance).
- ``dirichlet``: for each class, the shares of the workers drawn from Dirichlet(``alpha``) (Hsu et al. 2019); small
  alpha gives each worker few labels and shards of very different sizes. A split that leaves a worker fewer samples
  than one micro-batch is redrawn from the same generator (deterministically: the n-th draw that fits), at most
  ``MAX_DRAWS`` times; after that it is an error naming the worker and its size.
- ``classes``: each worker holds ``classes_per_worker`` labels, dealt round-robin over a seeded order of the classes;
  a class's samples are split evenly among the workers that hold it.

Every split depends on ``split_seed``, the number of workers and the labels only: the same on every worker and in
every run. Every training sample goes to exactly one worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import Tensor

PARTITIONS = ("iid", "shards", "dirichlet", "classes")
MAX_DRAWS = 100


@dataclass
class Partition:
    """The training samples of each worker (indices into the training set) and, for ``dirichlet``, the drawn shares:
    ``proportions[c, r]`` is worker r's share of class c."""

    shards: list[Tensor]
    proportions: Optional[np.ndarray] = None
    draws: int = 1  # dirichlet: how many splits were drawn to find one that fits


@dataclass(frozen=True)
class Sharding:
    """``dataset.partition`` and its settings, as the datasets apply them."""

    partition: str = "iid"
    seed: int = 0  # dataset.split_seed
    alpha: float = 0.5
    classes_per_worker: int = 2

    def split(self, labels: Tensor, world: int, min_size: int = 1) -> Partition:
        return split(labels, world, self.partition, self.seed, self.alpha, self.classes_per_worker, min_size)


def split(
    labels: Tensor, world: int, partition: str, seed: int, alpha: float = 1.0, classes_per_worker: int = 1,
    min_size: int = 1,
) -> Partition:
    """Each of ``world`` workers' fixed shard of the samples with ``labels`` (not for ``iid``, which has none)."""
    rng = np.random.default_rng(seed)
    y = labels.numpy()
    if partition == "shards":
        return Partition([torch.from_numpy(np.sort(part)) for part in np.array_split(rng.permutation(len(y)), world)])
    classes = int(y.max()) + 1
    by_class = [rng.permutation(np.flatnonzero(y == c)) for c in range(classes)]
    if partition == "classes":
        check_classes_per_worker(classes_per_worker, world, classes)
        order = rng.permutation(classes)
        held = [[int(order[(r * classes_per_worker + j) % classes]) for j in range(classes_per_worker)]
                for r in range(world)]
        parts: list[list[np.ndarray]] = [[] for _ in range(world)]
        for c in range(classes):
            holders = [r for r in range(world) if c in held[r]]
            for r, piece in zip(holders, np.array_split(by_class[c], len(holders))):
                parts[r].append(piece)
        return Partition([torch.from_numpy(np.sort(np.concatenate(p))) for p in parts])
    if partition != "dirichlet":
        raise ValueError(f"dataset.partition={partition!r} has no fixed shards; valid: {', '.join(PARTITIONS[1:])}")
    for draw in range(1, MAX_DRAWS + 1):
        proportions = rng.dirichlet([alpha] * world, size=classes)  # (classes, world)
        parts = [[] for _ in range(world)]
        for c, indices in enumerate(by_class):
            cuts = (np.cumsum(proportions[c])[:-1] * len(indices)).astype(int)
            for r, piece in enumerate(np.split(indices, cuts)):
                parts[r].append(piece)
        shards = [np.sort(np.concatenate(p)) for p in parts]
        smallest = min(range(world), key=lambda r: len(shards[r]))
        if len(shards[smallest]) >= min_size:
            return Partition([torch.from_numpy(s) for s in shards], proportions, draw)
    raise ValueError(
        f"dataset.partition=dirichlet with dataset.alpha={alpha} over {world} workers: in {MAX_DRAWS} draws a worker "
        f"always had fewer samples than one micro-batch of {min_size} (last: worker {smallest} with "
        f"{len(shards[smallest])}); use a larger alpha, fewer workers or smaller batches"
    )


class ShardTooSmall(ValueError):
    """A worker's training shard holds fewer samples than one micro-batch. One message for the worker (at its first
    batch) and the launcher's preflight (before any worker starts); the fields let the preflight name
    ``global_batch_size`` where that set the micro-batch."""

    def __init__(self, batch_size: int, shard: int, train_size: int, world: int, partition: str,
                 rank: Optional[int] = None) -> None:
        self.batch_size, self.shard, self.train_size, self.world = batch_size, shard, train_size, world
        self.partition, self.rank = partition, rank
        whose = "a worker's shard" if rank is None else f"worker {rank}'s shard"
        how = "" if partition == "iid" else f", dataset.partition={partition}"
        self.where = f"{whose} ({shard} samples of {train_size}{how} over {world} workers)"
        super().__init__(f"batch_size={batch_size} is larger than {self.where}; valid: batch_size <= {shard} (or "
                         "fewer workers)")

    def __reduce__(self) -> tuple[type, tuple[int, int, int, int, str, Optional[int]]]:
        """Picklable (a worker's error may be sent to its parent process)."""
        return ShardTooSmall, (self.batch_size, self.shard, self.train_size, self.world, self.partition, self.rank)


def check_iid_shard(train_size: int, world: int, batch_size: int) -> None:
    """Each worker's part of an iid epoch holds one micro-batch: DistributedSampler(drop_last=True) deals
    ``train_size // world`` samples to every worker and leaves the rest out."""
    shard = train_size // world
    if shard < batch_size:
        raise ShardTooSmall(batch_size, shard, train_size, world, "iid")


def fitting_partition(
    sharding: Sharding, labels: Callable[[], Tensor], train_size: int, world: int, batch_size: int
) -> Optional[Partition]:
    """The workers' fixed shards (None for iid), each holding one micro-batch of ``batch_size`` at least, else
    ``ShardTooSmall`` naming the smallest (dirichlet redraws first, and fails with its own error). The one computation
    the worker trains on and the launcher's preflight checks. ``labels()``: the training set's, read only for fixed
    shards (iid needs ``train_size`` alone)."""
    if sharding.partition == "iid":
        check_iid_shard(train_size, world, batch_size)
        return None
    partition = sharding.split(labels(), world, min_size=batch_size)
    small = min(range(world), key=lambda r: len(partition.shards[r]))
    if len(partition.shards[small]) < batch_size:
        raise ShardTooSmall(batch_size, len(partition.shards[small]), train_size, world, sharding.partition, small)
    return partition


def check_classes_per_worker(classes_per_worker: int, world: int, classes: int) -> None:
    """Every class must be held by some worker, and no worker can hold more classes than there are."""
    if not 1 <= classes_per_worker <= classes or classes_per_worker * world < classes:
        raise ValueError(
            f"dataset.classes_per_worker={classes_per_worker} with {world} workers and {classes} classes: valid is "
            f"{-(-classes // world)}..{classes} (every class held by some worker)"
        )


def label_histograms(labels: Tensor, shards: list[Tensor], classes: int) -> list[list[int]]:
    """How many samples of each class each worker holds."""
    return [torch.bincount(labels[shard], minlength=classes).tolist() for shard in shards]
