"""Datasets held in memory as tensors (``TensorData``): ``digits`` (the 8x8 handwritten digits scikit-learn ships:
real data, no download), ``synthetic`` (Gaussian class clusters of any size and shape, for throughput) and ``npz``
(your arrays). CIFAR (``images.py``) is held the same way."""

from __future__ import annotations

import gzip
import importlib.util
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Optional

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import BatchSampler, DistributedSampler, TensorDataset

from decent_train.components.data.base import Batch, BatchTransform, Datasets, batch_generator, batch_to_device
from decent_train.components.data.partition import Partition, Sharding, fitting_partition, label_histograms

NPZ_LAYOUT = "a directory with train.npz and test.npz, each holding arrays x (samples first) and y (integer labels)"
NPZ_FILES = ("train.npz", "test.npz")
DIGITS_CLASSES = 10  # scikit-learn's handwritten digits
DIGITS_SAMPLES = 1797  # all of them, before the split: what the preflight counts without importing scikit-learn


class TensorData(Datasets):
    """Both splits in memory; batches are one tensor index each, not one ``__getitem__`` per sample.

    ``transform(x, generator)`` turns stored samples into model inputs per batch (uint8 to normalized float, and
    random augmentation when a generator is given: training only).
    """

    def __init__(self, train: TensorDataset, test: TensorDataset, num_classes: int, transform: BatchTransform | None = None):
        self.train, self.test, self.num_classes, self.transform = train, test, num_classes, transform
        self.input_shape = tuple(train.tensors[0].shape[1:])
        self.train_size = len(train)
        self.sharding = Sharding()  # dataset.partition: build_datasets sets it

    def partition(self, world: int, batch_size: int) -> Partition | None:
        """The workers' fixed shards (None for iid): the same on every worker; each holds one micro-batch at least
        (``fitting_partition``, which the launcher's preflight runs too)."""
        return fitting_partition(self.sharding, lambda: self.train.tensors[1], self.train_size, world, batch_size)

    def shard_summary(self, world: int, batch_size: int) -> dict[str, Any]:
        partition = self.partition(world, batch_size)
        if partition is None:
            return super().shard_summary(world, batch_size)
        return {
            "data/partition": self.sharding.partition,
            "data/shard_sizes": [len(s) for s in partition.shards],
            "data/shard_labels": label_histograms(self.train.tensors[1], partition.shards, self.num_classes),
        }

    def _stored_train_batches(
        self, batch_size: int, rank: int, world: int, seed: int, start: int
    ) -> Iterator[tuple[Tensor, Tensor, Optional[torch.Generator]]]:
        """Training batches as stored, each with its augmentation's generator (None without a transform)."""
        partition = self.partition(world, batch_size)
        if partition is not None:
            yield from self._shard_batches(partition.shards[rank], batch_size, rank, seed, start)
            return
        sampler = DistributedSampler(self.train, world, rank, shuffle=True, seed=seed, drop_last=True)
        batches = BatchSampler(sampler, batch_size, drop_last=True)  # partition() made it hold one at least
        epoch, skip = divmod(start, len(batches))
        while True:
            sampler.set_epoch(epoch)
            for index, indices in enumerate(batches):
                if index < skip:
                    continue
                x, y = self.train[indices]
                # Augmentation: its own generator per batch, so a resume can skip.
                yield x, y, None if self.transform is None else batch_generator(seed, rank, epoch, index)
            epoch, skip = epoch + 1, 0

    def _shard_batches(
        self, shard: Tensor, batch_size: int, rank: int, seed: int, start: int
    ) -> Iterator[tuple[Tensor, Tensor, Optional[torch.Generator]]]:
        """A fixed shard's micro-batches, reshuffled within it each time it runs out (its own epochs: shards differ in
        size); by seed and that epoch, so a resume at micro-batch ``start`` takes the same ones."""
        per_epoch = len(shard) // batch_size  # partition() made it >= 1
        epoch, skip = divmod(start, per_epoch)
        while True:
            order = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))]
            for index in range(skip, per_epoch):
                x, y = self.train[order[index * batch_size : (index + 1) * batch_size]]
                yield x, y, None if self.transform is None else batch_generator(seed, rank, epoch, index)
            epoch, skip = epoch + 1, 0

    def _stored_eval_batches(self, batch_size: int, rank: int, world: int) -> Iterator[Batch]:
        x, y = (t[rank::world] for t in self.test.tensors)
        for start in range(0, len(y), batch_size):
            yield x[start : start + batch_size], y[start : start + batch_size]

    def eval_batch_count(self, batch_size: int, rank: int, world: int) -> int:
        """Test samples ``rank``, ``rank + world``, ... in batches, the last one partial."""
        return -(-len(range(rank, len(self.test), world)) // batch_size)

    def train_batches(self, batch_size: int, rank: int, world: int, seed: int, start: int = 0) -> Iterator[Batch]:
        return self.device_train_batches(batch_size, rank, world, seed, start, device="cpu")

    def eval_batches(self, batch_size: int, rank: int, world: int) -> Iterator[Batch]:
        return self.device_eval_batches(batch_size, rank, world, device="cpu")

    def device_train_batches(
        self, batch_size: int, rank: int, world: int, seed: int, start: int = 0, *, device: torch.device | str,
        channels_last: bool = False,
    ) -> Iterator[Batch]:
        """The stored samples are copied, the transform runs on ``device``: the same batches as ``train_batches``."""
        for x, y, generator in self._stored_train_batches(batch_size, rank, world, seed, start):
            yield batch_to_device((x, y), device, channels_last, self.transform, generator)

    def device_eval_batches(
        self, batch_size: int, rank: int, world: int, *, device: torch.device | str, channels_last: bool = False
    ) -> Iterator[Batch]:
        for batch in self._stored_eval_batches(batch_size, rank, world):
            yield batch_to_device(batch, device, channels_last, self.transform)


def digits(test_fraction: float, split_seed: int) -> TensorData:
    """scikit-learn's digits, split by ``split_seed`` into ``test_fraction`` held out and the rest for training."""
    x, y = _load_digits()
    train_idx, test_idx = _split(len(y), test_fraction, split_seed)
    return tensor_data(x[train_idx], y[train_idx], x[test_idx], y[test_idx])


def _load_digits() -> tuple[Tensor, Tensor]:
    """The file scikit-learn's ``load_digits`` reads, read without importing scikit-learn: that import (scipy with it)
    was a large part of every worker's start (scripts/BENCHMARKS.md, "A launch's start"). scikit-learn's own loader
    stays the fallback (tests/test_data.py checks the two agree)."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running its __init__
    folders = list(spec.submodule_search_locations or []) if spec else []
    path = next((p for p in (Path(f) / "datasets" / "data" / "digits.csv.gz" for f in folders) if p.is_file()), None)
    if path is None:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        images, target = bunch.images, bunch.target
    else:
        with gzip.open(path, "rt") as f:
            rows = np.loadtxt(f, delimiter=",")  # 1797 rows: 64 pixel values 0..16, then the label
        images, target = rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(np.int64)
    x = torch.from_numpy(images).float().div_(16.0).unsqueeze(1)  # (N, 1, 8, 8), values in [0, 1]
    return x, torch.from_numpy(target).long()


def digits_train_size(test_fraction: float) -> int:
    """How many digits ``digits`` trains on, without loading them (the preflight's count)."""
    return DIGITS_SAMPLES - _test_count(DIGITS_SAMPLES, test_fraction)


def digits_train_labels(test_fraction: float, split_seed: int) -> Tensor:
    """``digits``' training labels (the preflight splits them as the worker does; a fixed partition needs them)."""
    _, y = _load_digits()
    return y[_split(len(y), test_fraction, split_seed)[0]]


def _test_count(n: int, test_fraction: float) -> int:
    return max(1, round(n * test_fraction))


def _split(n: int, test_fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = _test_count(n, test_fraction)
    return perm[n_test:], perm[:n_test]


def synthetic(num_samples: int, input_shape: tuple[int, ...], num_classes: int, noise: float, seed: int) -> TensorData:
    """Gaussian clusters around random class centres: ``num_samples`` to train on and a quarter as many to test."""
    gen, centres = _synthetic_centres(input_shape, num_classes, seed)

    def sample(n: int) -> tuple[Tensor, Tensor]:
        y = _synthetic_labels(n, num_classes, gen)
        return centres[y] + noise * torch.randn(n, *input_shape, generator=gen), y

    return tensor_data(*sample(num_samples), *sample(max(1, num_samples // 4)))


def synthetic_train_labels(num_samples: int, input_shape: tuple[int, ...], num_classes: int, seed: int) -> Tensor:
    """``synthetic``'s training labels without its samples: the first draw after the centres (which are drawn, so
    the generator reaches the same place; they are ``num_classes`` samples, not ``num_samples``)."""
    gen, _ = _synthetic_centres(input_shape, num_classes, seed)
    return _synthetic_labels(num_samples, num_classes, gen)


def _synthetic_centres(input_shape: tuple[int, ...], num_classes: int, seed: int) -> tuple[torch.Generator, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return gen, torch.randn(num_classes, *input_shape, generator=gen) * 2.0


def _synthetic_labels(n: int, num_classes: int, gen: torch.Generator) -> Tensor:
    return torch.randint(num_classes, (n,), generator=gen)


def npz(root: Path) -> TensorData:
    """``root/train.npz`` and ``root/test.npz`` (``NPZ_LAYOUT``); uint8 ``x`` is scaled to [0, 1]."""
    return tensor_data(*_load_npz(root / "train.npz"), *_load_npz(root / "test.npz"))


def missing_npz(root: Path) -> list[str]:
    """The files of ``NPZ_FILES`` that ``root`` lacks (cheap: names only)."""
    return [f for f in NPZ_FILES if not (root / f).is_file()]


def _read_header(file: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype]:
    """An .npy file's shape, Fortran order and dtype (its header only)."""
    version = np.lib.format.read_magic(file)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read(file)
    return tuple(shape), fortran, dtype


def _npz_header(archive: zipfile.ZipFile, key: str) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype of array ``key`` of an open npz, from its .npy header (no data read)."""
    with archive.open(f"{key}.npy") as file:
        shape, _, dtype = _read_header(file)
    return shape, dtype


def _npz_headers(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """x's and y's (shape, dtype) in ``path``; a file that is no npz holding both is a ``ValueError``."""
    try:
        with zipfile.ZipFile(path) as archive:
            missing = [k for k in ("x", "y") if f"{k}.npy" not in archive.namelist()]
            if missing:
                raise ValueError(f"{path}: no array {' or '.join(missing)}; expected {NPZ_LAYOUT}")
            return {key: _npz_header(archive, key) for key in ("x", "y")}
    except (OSError, zipfile.BadZipFile) as error:
        raise ValueError(f"{path}: cannot read arrays x and y ({error}); expected {NPZ_LAYOUT}") from None


def check_npz(root: Path) -> tuple[int, ...]:
    """``root``'s train.npz and test.npz hold what the worker needs (``NPZ_LAYOUT``), checked from the arrays'
    headers and the labels (small), not x's data: as many labels as samples, integer labels from 0, numeric samples
    of one shape in both files. The sample shape. Run by the preflight, so a malformed file is refused before any
    worker starts instead of failing in each."""
    shapes = []
    for name in NPZ_FILES:
        path = root / name
        (x_shape, x_dtype), (y_shape, y_dtype) = _npz_headers(path).values()
        if x_dtype.kind not in "uif" or len(x_shape) < 2:
            raise ValueError(f"{path}: x is {x_dtype} of shape {x_shape}; expected numbers (uint8 or float), "
                             "samples first, then at least one dimension per sample")
        if len(y_shape) != 1 or y_dtype.kind not in "iu":
            raise ValueError(f"{path}: y is {y_dtype} of shape {y_shape}; expected one integer label per sample")
        if x_shape[0] != y_shape[0] or x_shape[0] == 0:
            raise ValueError(f"{path}: x has {x_shape[0]} samples, y has {y_shape[0]} labels; expected as many labels "
                             "as samples, at least one")
        low = int(_load_labels(path).min())
        if low < 0:
            raise ValueError(f"{path}: y holds the label {low}; expected labels 0, 1, ..., classes - 1")
        shapes.append(x_shape[1:])
    if shapes[0] != shapes[1]:
        raise ValueError(f"{root}: train.npz's samples have shape {shapes[0]}, test.npz's {shapes[1]}; expected one "
                         "shape")
    return shapes[0]


def _load_labels(path: Path) -> np.ndarray:
    with np.load(path) as arrays:
        return arrays["y"]


def _load_npz(path: Path) -> tuple[Tensor, Tensor]:
    try:
        with np.load(path) as arrays:
            x, y = arrays["x"], arrays["y"]
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{path}: cannot read arrays x and y ({error}); expected {NPZ_LAYOUT}") from None
    if len(x) != len(y) or y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"{path}: x has {len(x)} samples, y has shape {y.shape} {y.dtype}; expected {NPZ_LAYOUT}")
    xt = torch.from_numpy(x)
    xt = xt.float().div_(255.0) if xt.dtype == torch.uint8 else xt.float()
    return xt, torch.from_numpy(y).long()


def npz_train_size(root: Path) -> int:
    """How many samples ``root/train.npz`` holds, from y's header (``check_npz`` has checked x has as many)."""
    return _npz_headers(root / "train.npz")["y"][0][0]


def npz_train_labels(root: Path) -> Tensor:
    """``root/train.npz``'s labels as the worker holds them, without loading ``x``."""
    return torch.from_numpy(_load_labels(root / "train.npz")).long()


def npz_classes(root: Path) -> int:
    """The number of classes in ``root/train.npz`` (its largest label + 1), without loading ``x``."""
    with np.load(root / "train.npz") as arrays:
        return int(arrays["y"].max()) + 1


def tensor_data(
    x_train: Tensor, y_train: Tensor, x_test: Tensor, y_test: Tensor, transform: BatchTransform | None = None
) -> TensorData:
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    return TensorData(TensorDataset(x_train, y_train), TensorDataset(x_test, y_test), num_classes, transform)
