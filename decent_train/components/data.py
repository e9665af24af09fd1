"""Datasets the launcher can build by name, and their per-worker sharding.

``digits`` (the 8x8 handwritten digits scikit-learn ships: real data, no download), ``synthetic`` (Gaussian class
clusters of any size and shape, for throughput) and ``npz`` (your own arrays: a directory with ``train.npz`` and ``test.npz``,
each holding ``x`` and ``y``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import BatchSampler, DistributedSampler, TensorDataset

DATASET_NAMES = ("digits", "synthetic", "npz")
_NPZ_LAYOUT = "a directory with train.npz and test.npz, each holding arrays x (samples first) and y (integer labels)"


@dataclass
class DatasetConfig:
    """``conf/dataset/*.yaml``."""

    name: str = "digits"
    root: Optional[str] = None  # npz: the data directory
    test_fraction: float = 0.2  # digits: share held out for evaluation
    split_seed: int = 0  # digits, synthetic: the train/test split and the synthetic data do not depend on the run seed
    num_samples: int = 8192  # synthetic: training samples (plus a quarter as many test samples)
    input_shape: list[int] = field(default_factory=lambda: [1, 16, 16])  # synthetic: one sample's shape
    num_classes: int = 10  # synthetic
    noise: float = 2.0  # synthetic: standard deviation around the class centres

    def __post_init__(self) -> None:
        if self.name not in DATASET_NAMES:
            raise ValueError(f"dataset.name={self.name!r} is not a dataset; valid: {', '.join(DATASET_NAMES)}")
        if self.name == "npz":
            if not self.root:
                raise ValueError(f"dataset=npz needs dataset.root: {_NPZ_LAYOUT}")
            root = Path(self.root).expanduser()
            if not root.is_dir():
                raise ValueError(f"dataset.root={self.root} does not exist; expected {_NPZ_LAYOUT}")
            missing = [f for f in ("train.npz", "test.npz") if not (root / f).is_file()]
            if missing:
                raise ValueError(f"dataset.root={self.root} has no {' or '.join(missing)}; expected {_NPZ_LAYOUT}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"dataset.test_fraction={self.test_fraction} must be in (0, 1)")
        if self.num_samples < 1 or self.num_classes < 2 or not self.input_shape or min(self.input_shape) < 1:
            raise ValueError(
                f"dataset.num_samples={self.num_samples} must be >= 1, dataset.num_classes={self.num_classes} >= 2, "
                f"dataset.input_shape={list(self.input_shape)} positive sizes"
            )


@dataclass
class Datasets:
    """A train and a test split of a classification dataset."""

    train: TensorDataset
    test: TensorDataset
    input_shape: tuple[int, ...]
    num_classes: int


def build_datasets(cfg: DatasetConfig) -> Datasets:
    if cfg.name == "digits":
        x, y = _digits()
        train_idx, test_idx = _split(len(y), cfg.test_fraction, cfg.split_seed)
        return _datasets(x[train_idx], y[train_idx], x[test_idx], y[test_idx])
    if cfg.name == "synthetic":
        return _synthetic(cfg)
    root = Path(cfg.root).expanduser()  # type: ignore[arg-type]
    return _datasets(*_load_npz(root / "train.npz"), *_load_npz(root / "test.npz"))


def _digits() -> tuple[Tensor, Tensor]:
    from sklearn.datasets import load_digits  # imported here: costs a second, only the digits need it

    digits = load_digits()
    x = torch.from_numpy(digits.images).float().div_(16.0).unsqueeze(1)  # (N, 1, 8, 8), values in [0, 1]
    return x, torch.from_numpy(digits.target).long()


def _split(n: int, test_fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = max(1, round(n * test_fraction))
    return perm[n_test:], perm[:n_test]


def _synthetic(cfg: DatasetConfig) -> Datasets:
    gen = torch.Generator().manual_seed(cfg.split_seed)
    shape = tuple(cfg.input_shape)
    centres = torch.randn(cfg.num_classes, *shape, generator=gen) * 2.0

    def sample(n: int) -> tuple[Tensor, Tensor]:
        y = torch.randint(cfg.num_classes, (n,), generator=gen)
        return centres[y] + cfg.noise * torch.randn(n, *shape, generator=gen), y

    return _datasets(*sample(cfg.num_samples), *sample(max(1, cfg.num_samples // 4)))


def _load_npz(path: Path) -> tuple[Tensor, Tensor]:
    try:
        with np.load(path) as arrays:
            x, y = arrays["x"], arrays["y"]
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{path}: cannot read arrays x and y ({error}); expected {_NPZ_LAYOUT}") from None
    if len(x) != len(y) or y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"{path}: x has {len(x)} samples, y has shape {y.shape} {y.dtype}; expected {_NPZ_LAYOUT}")
    xt = torch.from_numpy(x)
    xt = xt.float().div_(255.0) if xt.dtype == torch.uint8 else xt.float()
    return xt, torch.from_numpy(y).long()


def _datasets(x_train: Tensor, y_train: Tensor, x_test: Tensor, y_test: Tensor) -> Datasets:
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    return Datasets(TensorDataset(x_train, y_train), TensorDataset(x_test, y_test), tuple(x_train.shape[1:]), num_classes)


def train_batches(
    dataset: TensorDataset, batch_size: int, rank: int, world_size: int, seed: int
) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless shuffled micro-batches of this worker's shard; each epoch reshuffles (same permutation on all ranks,
    disjoint shards). One tensor index per batch, not one ``__getitem__`` per sample."""
    sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=seed, drop_last=True)
    batches = BatchSampler(sampler, batch_size, drop_last=True)
    if len(batches) == 0:
        raise ValueError(
            f"batch_size={batch_size} is larger than a worker's shard ({len(sampler)} samples of {len(dataset)} "
            f"over {world_size} workers)"
        )
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for indices in batches:
            yield dataset[indices]
        epoch += 1


def micro_batches_per_epoch(dataset: TensorDataset, batch_size: int, world_size: int) -> int:
    return (len(dataset) // world_size) // batch_size


def eval_batches(
    dataset: TensorDataset, rank: int, world_size: int, batch_size: int
) -> Iterator[tuple[Tensor, Tensor]]:
    """Batches of this worker's disjoint slice of the evaluation set (over all workers, every sample exactly once)."""
    x, y = (t[rank::world_size] for t in dataset.tensors)
    for start in range(0, len(y), batch_size):
        yield x[start : start + batch_size], y[start : start + batch_size]
