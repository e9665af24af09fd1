"""Datasets the launcher can build by name, each sharded over the workers.

In memory (``TensorData``): ``digits`` (the 8x8 handwritten digits scikit-learn ships: real data, no download),
``synthetic`` (Gaussian class clusters of any size and shape, for throughput), ``npz`` (your arrays),
``cifar10``/``cifar100`` (torchvision's python format, ``images.py``). Streamed: ``imagefolder`` (ImageNet-style
``train/`` and ``val/`` class folders, ``images.py``) and ``tokens`` (flat uint16 token files, ``tokens.py``).

Every kind gives the worker the same three things: endless shuffled training micro-batches of this worker's shard
(deterministic by seed, disjoint across workers), evaluation batches that cover the whole evaluation set exactly once
over all workers, and the input shape and number of classes (the vocabulary size for tokens) that size the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import BatchSampler, DistributedSampler, TensorDataset

from decent_train.components.partition import (
    PARTITIONS,
    Partition,
    Sharding,
    check_classes_per_worker,
    label_histograms,
)

DATASET_NAMES = ("digits", "synthetic", "npz", "cifar10", "cifar100", "imagefolder", "tokens")
IMAGE_DATASETS = ("digits", "npz", "cifar10", "cifar100", "imagefolder")  # npz: usually; checked when loaded
_NPZ_LAYOUT = "a directory with train.npz and test.npz, each holding arrays x (samples first) and y (integer labels)"

Batch = tuple[Tensor, Tensor]
DIGITS_CLASSES = 10  # scikit-learn's handwritten digits


@dataclass
class DatasetConfig:
    """``conf/dataset/*.yaml``."""

    name: str = "digits"
    root: Optional[str] = None  # npz, cifar10, cifar100, imagefolder, tokens: the data directory
    download: bool = False  # cifar10, cifar100: fetch into root (once, in the launcher) when it is missing
    test_fraction: float = 0.2  # digits: share held out for evaluation
    split_seed: int = 0  # digits, synthetic: the train/test split and the synthetic data do not depend on the run seed
    num_samples: int = 8192  # synthetic: training samples (plus a quarter as many test samples)
    input_shape: list[int] = field(default_factory=lambda: [1, 16, 16])  # synthetic: one sample's shape
    num_classes: int = 10  # synthetic
    noise: float = 2.0  # synthetic: standard deviation around the class centres
    augment: bool = True  # cifar: random crop (padding 4) and flip; imagefolder: random resized crop and flip
    image_size: int = 224  # imagefolder: training crop; evaluation resizes to image_size / 0.875 and centre-crops
    loader_workers: int = 4  # imagefolder: decoding processes per worker
    context_length: int = 1024  # tokens: tokens per sample (the model's context)
    vocab_size: int = 50304  # tokens: every token id must be below it
    partition: str = "iid"  # iid | shards | dirichlet | classes: how the training set is dealt out (partition.py)
    alpha: float = 0.5  # dirichlet: the concentration (small: few labels per worker, unequal shard sizes)
    classes_per_worker: int = 2  # classes: the labels each worker holds

    def __post_init__(self) -> None:
        if self.name not in DATASET_NAMES:
            raise ValueError(f"dataset.name={self.name!r} is not a dataset; valid: {', '.join(DATASET_NAMES)}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"dataset.test_fraction={self.test_fraction} must be in (0, 1)")
        if self.num_samples < 1 or self.num_classes < 2 or not self.input_shape or min(self.input_shape) < 1:
            raise ValueError(
                f"dataset.num_samples={self.num_samples} must be >= 1, dataset.num_classes={self.num_classes} >= 2, "
                f"dataset.input_shape={list(self.input_shape)} positive sizes"
            )
        for key in ("image_size", "context_length", "vocab_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"dataset.{key}={getattr(self, key)} must be >= 1")
        if self.loader_workers < 0:
            raise ValueError(f"dataset.loader_workers={self.loader_workers} must be >= 0")
        if self.download and self.name not in ("cifar10", "cifar100"):
            raise ValueError(f"dataset.download=true works for cifar10 and cifar100, not dataset={self.name}")
        if self.partition not in PARTITIONS:
            raise ValueError(f"dataset.partition={self.partition!r} is not a partition; valid: {', '.join(PARTITIONS)}")
        if self.partition != "iid" and self.name in ("imagefolder", "tokens"):
            raise ValueError(
                f"dataset.partition={self.partition} needs the labels in memory; dataset={self.name} supports only iid "
                "(in-memory datasets: digits, synthetic, npz, cifar10, cifar100)"
            )
        if self.alpha <= 0:
            raise ValueError(f"dataset.alpha={self.alpha} must be > 0 (the Dirichlet concentration)")
        if self.classes_per_worker < 1:
            raise ValueError(f"dataset.classes_per_worker={self.classes_per_worker} must be >= 1")
        self.check_files()

    def check_files(self) -> None:
        """The data directory exists and has the expected layout (cheap: names and headers, not contents)."""
        if self.name in ("digits", "synthetic"):
            return
        from decent_train.components import images, tokens  # here: they import torchvision lazily themselves

        if not self.root:
            raise ValueError(f"dataset={self.name} needs dataset.root: {layout(self.name)}")
        root = Path(self.root).expanduser()
        if self.name in ("cifar10", "cifar100"):
            if not (self.download and not images.cifar_present(root, self.name)):
                images.check_cifar(root, self.name)
            return
        if not root.is_dir():
            raise ValueError(f"dataset.root={self.root} is not a directory; expected {layout(self.name)}")
        if self.name == "npz":
            missing = [f for f in ("train.npz", "test.npz") if not (root / f).is_file()]
            if missing:
                raise ValueError(f"dataset.root={self.root} has no {' or '.join(missing)}; expected {_NPZ_LAYOUT}")
        elif self.name == "imagefolder":
            images.check_image_folder(root)
        else:
            tokens.check_token_files(root, self.context_length)

    @property
    def is_tokens(self) -> bool:
        return self.name == "tokens"

    def sharding(self) -> Sharding:
        return Sharding(self.partition, self.split_seed, self.alpha, self.classes_per_worker)

    def check_partition(self, world_sizes: list[int]) -> None:
        """``classes`` can serve each of ``world_sizes``: every class held by some worker (the labels are counted
        from the config, or read from npz's y: no worker needed)."""
        if self.partition != "classes":
            return
        from decent_train.components.images import CIFAR_CLASSES  # here: images imports torchvision lazily itself

        if self.name == "synthetic":
            classes = self.num_classes
        elif self.name == "digits":
            classes = DIGITS_CLASSES
        elif self.name in CIFAR_CLASSES:
            classes = CIFAR_CLASSES[self.name]
        else:  # npz (tokens and imagefolder refuse every partition but iid)
            classes = _npz_classes(Path(self.root).expanduser() / "train.npz")  # type: ignore[arg-type]
        for world in world_sizes:
            check_classes_per_worker(self.classes_per_worker, world, classes)


def layout(name: str) -> str:
    """What the directory of dataset ``name`` must hold (for error messages)."""
    from decent_train.components import images, tokens

    return {
        "npz": _NPZ_LAYOUT,
        "cifar10": images.CIFAR_LAYOUT["cifar10"],
        "cifar100": images.CIFAR_LAYOUT["cifar100"],
        "imagefolder": images.IMAGE_FOLDER_LAYOUT,
        "tokens": tokens.TOKENS_LAYOUT,
    }.get(name, "")


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
    """The random numbers of one training batch: by seed, different per worker, epoch and batch."""
    return torch.Generator().manual_seed(((seed * 100_003 + rank) * 1_000_003 + epoch) * 1_000_003 + index)


BatchTransform = Callable[[Tensor, Optional[torch.Generator]], Tensor]  # (x, generator or None at evaluation) -> x


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
        """The workers' fixed shards (None for iid): the same on every worker; each holds one micro-batch at least."""
        if self.sharding.partition == "iid":
            return None
        partition = self.sharding.split(self.train.tensors[1], world, min_size=batch_size)
        small = min(range(world), key=lambda r: len(partition.shards[r]))
        if len(partition.shards[small]) < batch_size:  # dirichlet redraws instead; the others are what they are
            raise ValueError(
                f"batch_size={batch_size} is larger than worker {small}'s shard ({len(partition.shards[small])} "
                f"samples of {self.train_size}, dataset.partition={self.sharding.partition} over {world} workers)"
            )
        return partition

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
        batches = BatchSampler(sampler, batch_size, drop_last=True)
        if len(batches) == 0:
            raise ValueError(
                f"batch_size={batch_size} is larger than a worker's shard ({len(sampler)} samples of "
                f"{len(self.train)} over {world} workers)"
            )
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


def build_datasets(cfg: DatasetConfig) -> Datasets:
    data = _build(cfg)
    if isinstance(data, TensorData):
        data.sharding = cfg.sharding()
    return data


def _build(cfg: DatasetConfig) -> Datasets:
    from decent_train.components import images, tokens

    if cfg.name == "digits":
        x, y = _digits()
        train_idx, test_idx = _split(len(y), cfg.test_fraction, cfg.split_seed)
        return _tensor_data(x[train_idx], y[train_idx], x[test_idx], y[test_idx])
    if cfg.name == "synthetic":
        return _synthetic(cfg)
    root = Path(cfg.root).expanduser()  # type: ignore[arg-type]
    if cfg.name == "npz":
        return _tensor_data(*_load_npz(root / "train.npz"), *_load_npz(root / "test.npz"))
    if cfg.name in ("cifar10", "cifar100"):
        return images.cifar(root, cfg.name, cfg.augment)
    if cfg.name == "imagefolder":
        return images.ImageFolderData(root, cfg.image_size, cfg.augment, cfg.loader_workers)
    return tokens.TokenData(root, cfg.context_length, cfg.vocab_size)


def prepare(cfg: DatasetConfig) -> None:
    """Once, in the launcher before any worker starts: download what ``dataset.download=true`` asks for."""
    if cfg.download:
        from decent_train.components import images

        images.download_cifar(Path(cfg.root).expanduser(), cfg.name)  # type: ignore[arg-type]


def _digits() -> tuple[Tensor, Tensor]:
    from sklearn.datasets import load_digits  # imported here: costs a second, only the digits need it

    digits = load_digits()
    x = torch.from_numpy(digits.images).float().div_(16.0).unsqueeze(1)  # (N, 1, 8, 8), values in [0, 1]
    return x, torch.from_numpy(digits.target).long()


def _split(n: int, test_fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = max(1, round(n * test_fraction))
    return perm[n_test:], perm[:n_test]


def _synthetic(cfg: DatasetConfig) -> TensorData:
    gen = torch.Generator().manual_seed(cfg.split_seed)
    shape = tuple(cfg.input_shape)
    centres = torch.randn(cfg.num_classes, *shape, generator=gen) * 2.0

    def sample(n: int) -> tuple[Tensor, Tensor]:
        y = torch.randint(cfg.num_classes, (n,), generator=gen)
        return centres[y] + cfg.noise * torch.randn(n, *shape, generator=gen), y

    return _tensor_data(*sample(cfg.num_samples), *sample(max(1, cfg.num_samples // 4)))


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


def _npz_classes(path: Path) -> int:
    with np.load(path) as arrays:
        return int(arrays["y"].max()) + 1


def _tensor_data(
    x_train: Tensor, y_train: Tensor, x_test: Tensor, y_test: Tensor, transform: BatchTransform | None = None
) -> TensorData:
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    return TensorData(TensorDataset(x_train, y_train), TensorDataset(x_test, y_test), num_classes, transform)
