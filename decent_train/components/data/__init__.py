"""Datasets the launcher can build by name, each sharded over the workers (``DATASETS``, the one registry).

In memory (``TensorData``, ``arrays.py``): ``digits``, ``synthetic``, ``npz``, and ``cifar10``/``cifar100``
(torchvision's python format, ``images.py``). Streamed: ``imagefolder`` (ImageNet-style ``train/`` and ``val/`` class
folders, ``images.py``) and ``tokens`` (flat uint16 token files, ``tokens.py``). What every kind gives the worker is
``base.Datasets``; how the training set is dealt out to the workers is ``partition.py``.

Adding a dataset: its module, and one ``DatasetKind`` entry in ``DATASETS`` (plus ``conf/dataset/<name>.yaml``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from torch import Tensor

from decent_train.components.checks import refuse_unread
from decent_train.components.data import arrays, images, tokens
from decent_train.components.data.arrays import DIGITS_CLASSES, TensorData
from decent_train.components.data.base import (
    Batch,
    BatchTransform,
    Datasets,
    batch_generator,
    batch_to_device,
    host_to_device,
)
from decent_train.components.data.partition import (
    PARTITIONS,
    Sharding,
    ShardTooSmall,
    check_classes_per_worker,
    fitting_partition,
)


@dataclass(frozen=True)
class DatasetKind:
    """Everything the launcher and the worker need to know about one dataset name."""

    build: Callable[[DatasetConfig], Datasets]  # in the worker; the files are checked first
    reads: tuple[str, ...] = ()  # the dataset.* keys it reads, beside name and the partition's (others are refused)
    check_files: Optional[Callable[[DatasetConfig], None]] = None  # cheap, before any worker; None: nothing on disk
    layout: str = ""  # what dataset.root must hold, for error messages
    classes: Optional[Callable[[DatasetConfig], int]] = None  # without loading the data; None: labels not in memory
    images: bool = False  # samples are images (npz: usually; its shape is checked when loaded)
    download: Optional[Callable[[DatasetConfig], None]] = None  # dataset.download=true: in the launcher, once
    # One sample's shape from the files, without loading them (the preflight builds the model for it); None: the
    # config fixes it or the model checks it when built in the worker.
    sample_shape: Optional[Callable[[DatasetConfig], tuple[int, ...]]] = None
    # The training set's size, and its labels (for a fixed partition), as the worker will hold them but without loading
    # the samples: the preflight checks the shards against the micro-batch with them. None: left to the worker.
    train_size: Optional[Callable[[DatasetConfig], int]] = None
    train_labels: Optional[Callable[[DatasetConfig], Tensor]] = None
    # What each worker's shard must hold at a world size, for data not dealt out in samples (tokens: one window).
    check_shards: Optional[Callable[[DatasetConfig, int], None]] = None

    @property
    def in_memory(self) -> bool:
        """The labels are in memory, so the training set can be dealt out in fixed shards (``dataset.partition``)."""
        return self.classes is not None


def _check_dir(cfg: DatasetConfig) -> Path:
    root = cfg.root_path()
    if not root.is_dir():
        raise ValueError(f"dataset.root={cfg.root} is not a directory; expected {layout(cfg.name)}")
    return root


def _check_npz(cfg: DatasetConfig) -> None:
    missing = arrays.missing_npz(_check_dir(cfg))
    if missing:
        raise ValueError(f"dataset.root={cfg.root} has no {' or '.join(missing)}; expected {arrays.NPZ_LAYOUT}")
    arrays.check_npz(cfg.root_path())


def _check_cifar(cfg: DatasetConfig) -> None:
    root = cfg.root_path()
    if not (cfg.download and not images.cifar_present(root, cfg.name)):  # missing and downloaded: prepare() fetches it
        images.check_cifar(root, cfg.name)


def _check_token_shards(cfg: DatasetConfig, world: int) -> None:
    train = cfg.root_path() / "train.bin"
    tokens.check_token_shards(train, train.stat().st_size // 2, world, cfg.context_length)  # uint16: 2 bytes a token


def _cifar(name: str) -> DatasetKind:
    return DatasetKind(
        build=lambda cfg: images.cifar(cfg.root_path(), cfg.name, cfg.augment),
        reads=("root", "download", "augment"),
        check_files=_check_cifar,
        layout=images.CIFAR_LAYOUT[name],
        classes=lambda cfg: images.CIFAR_CLASSES[name],
        images=True,
        download=lambda cfg: images.download_cifar(cfg.root_path(), cfg.name),
    )


DATASETS: dict[str, DatasetKind] = {
    "digits": DatasetKind(
        build=lambda cfg: arrays.digits(cfg.test_fraction, cfg.split_seed),
        reads=("test_fraction", "split_seed"),
        classes=lambda cfg: DIGITS_CLASSES,
        images=True,
        train_size=lambda cfg: arrays.digits_train_size(cfg.test_fraction),
        train_labels=lambda cfg: arrays.digits_train_labels(cfg.test_fraction, cfg.split_seed),
    ),
    "synthetic": DatasetKind(
        build=lambda cfg: arrays.synthetic(
            cfg.num_samples, tuple(cfg.input_shape), cfg.num_classes, cfg.noise, cfg.split_seed
        ),
        reads=("num_samples", "input_shape", "num_classes", "noise", "split_seed"),
        classes=lambda cfg: cfg.num_classes,
        train_size=lambda cfg: cfg.num_samples,
        train_labels=lambda cfg: arrays.synthetic_train_labels(
            cfg.num_samples, tuple(cfg.input_shape), cfg.num_classes, cfg.split_seed
        ),
    ),
    "npz": DatasetKind(
        build=lambda cfg: arrays.npz(cfg.root_path()),
        reads=("root",),
        check_files=_check_npz,
        layout=arrays.NPZ_LAYOUT,
        classes=lambda cfg: arrays.npz_classes(cfg.root_path()),
        images=True,
        sample_shape=lambda cfg: arrays.check_npz(cfg.root_path()),
        train_size=lambda cfg: arrays.npz_train_size(cfg.root_path()),
        train_labels=lambda cfg: arrays.npz_train_labels(cfg.root_path()),
    ),
    "cifar10": _cifar("cifar10"),
    "cifar100": _cifar("cifar100"),
    "imagefolder": DatasetKind(
        build=lambda cfg: images.ImageFolderData(cfg.root_path(), cfg.image_size, cfg.augment, cfg.loader_workers),
        reads=("root", "augment", "image_size", "loader_workers"),
        check_files=lambda cfg: images.check_image_folder(_check_dir(cfg)),
        layout=images.IMAGE_FOLDER_LAYOUT,
        images=True,
    ),
    "tokens": DatasetKind(
        build=lambda cfg: tokens.TokenData(cfg.root_path(), cfg.context_length, cfg.vocab_size),
        reads=("root", "context_length", "vocab_size"),
        check_files=lambda cfg: tokens.check_token_files(_check_dir(cfg), cfg.context_length, cfg.vocab_size),
        layout=tokens.TOKENS_LAYOUT,
        check_shards=_check_token_shards,
    ),
}
DATASET_NAMES = tuple(DATASETS)
# dataset.<key> -> the datasets that read it (a fixed partition also reads split_seed, whatever the dataset)
READERS = {key: tuple(name for name, kind in DATASETS.items() if key in kind.reads)
           for key in dict.fromkeys(key for kind in DATASETS.values() for key in kind.reads)}
PARTITION_READERS = {"alpha": ("dirichlet",), "classes_per_worker": ("classes",)}  # dataset.partition's keys
IMAGE_DATASETS = tuple(name for name, kind in DATASETS.items() if kind.images)


@dataclass
class DatasetConfig:
    """``conf/dataset/*.yaml``. Construction checks values only; ``check_files`` looks at the disk."""

    name: str = "digits"
    root: Optional[str] = None  # npz, cifar10, cifar100, imagefolder, tokens: the data directory
    download: bool = False  # cifar10, cifar100: fetch into root (once, in the launcher) when it is missing
    test_fraction: float = 0.2  # digits: the share held out for evaluation
    # digits, synthetic or partition!=iid: seeds the train/test split, synthetic data, fixed partitions (not `seed`)
    split_seed: int = 0
    num_samples: int = 8192  # synthetic: training samples (plus a quarter as many test samples)
    input_shape: list[int] = field(default_factory=lambda: [1, 16, 16])  # synthetic: one sample's shape
    num_classes: int = 10  # synthetic: classes
    noise: float = 2.0  # synthetic: standard deviation around the class centres
    # cifar10, cifar100, imagefolder: random crops (cifar's padded by 4, imagefolder's resized) and flips
    augment: bool = True
    image_size: int = 224  # imagefolder: training crop; evaluation resizes to image_size / 0.875 and centre-crops
    loader_workers: int = 8  # imagefolder: decoding processes per worker
    context_length: int = 1024  # tokens: tokens per sample (the model's context)
    vocab_size: int = 50304  # tokens: every token id must be below it
    # digits, synthetic, npz, cifar10, cifar100: how the training set is dealt out: iid | shards | dirichlet | classes
    partition: str = "iid"
    alpha: float = 0.5  # partition=dirichlet: the concentration (small: few labels per worker, unequal shard sizes)
    classes_per_worker: int = 2  # partition=classes: the labels each worker holds

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"dataset.name={self.name!r} is not a dataset; valid: {', '.join(DATASET_NAMES)}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"dataset.test_fraction={self.test_fraction} must be in (0, 1)")
        for key, least in (("num_samples", 1), ("num_classes", 2), ("noise", 0)):
            if getattr(self, key) < least:
                raise ValueError(f"dataset.{key}={getattr(self, key)} must be >= {least}")
        if not self.input_shape or min(self.input_shape) < 1:
            raise ValueError(f"dataset.input_shape={list(self.input_shape)}: sizes must be >= 1, e.g. [64]")
        for key in ("image_size", "context_length", "vocab_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"dataset.{key}={getattr(self, key)} must be >= 1")
        if self.loader_workers < 0:
            raise ValueError(f"dataset.loader_workers={self.loader_workers} must be >= 0")
        self._check_download_and_partition()
        refuse_unread("dataset", self, READERS if self.partition == "iid" else
                      {k: v for k, v in READERS.items() if k != "split_seed"})
        refuse_unread("dataset", self, PARTITION_READERS, "dataset.partition", self.partition)
        if self.kind.check_files is not None:
            self.root_path()  # a data directory is named (whether it holds the data is check_files' question)

    def _check_download_and_partition(self) -> None:
        if self.download and self.kind.download is None:
            fetchable = " and ".join(name for name, kind in DATASETS.items() if kind.download is not None)
            raise ValueError(f"dataset.download=true works for {fetchable}, not dataset={self.name}")
        if self.partition not in PARTITIONS:
            raise ValueError(f"dataset.partition={self.partition!r} is not a partition; valid: {', '.join(PARTITIONS)}")
        if self.partition != "iid" and not self.kind.in_memory:
            in_memory = ", ".join(name for name, kind in DATASETS.items() if kind.in_memory)
            raise ValueError(
                f"dataset.partition={self.partition} needs the labels in memory; dataset={self.name} supports only iid "
                f"(in-memory datasets: {in_memory})"
            )
        if self.alpha <= 0:
            raise ValueError(f"dataset.alpha={self.alpha} must be > 0 (the Dirichlet concentration)")
        if self.classes_per_worker < 1:
            raise ValueError(f"dataset.classes_per_worker={self.classes_per_worker} must be >= 1")

    @property
    def kind(self) -> DatasetKind:
        return DATASETS[self.name]

    @property
    def is_tokens(self) -> bool:
        return self.name == "tokens"

    def root_path(self) -> Path:
        """``dataset.root``, with ``~`` expanded; an error naming the layout when it is not set."""
        if not self.root:
            raise ValueError(f"dataset={self.name} needs dataset.root: {layout(self.name)}")
        return Path(self.root).expanduser()

    def check_files(self) -> None:
        """The data directory exists and has the expected layout (cheap: names, headers and npz's labels). The
        launcher's preflight runs it before any worker starts; ``build_datasets`` runs it again in each worker."""
        if self.kind.check_files is not None:
            self.kind.check_files(self)

    def sharding(self) -> Sharding:
        return Sharding(self.partition, self.split_seed, self.alpha, self.classes_per_worker)

    def check_partition(self, world_sizes: list[int]) -> None:
        """``classes`` can serve each of ``world_sizes``: every class held by some worker (the labels are counted
        from the config, or read from npz's y: no worker needed). Call it after ``check_files`` (the preflight does):
        npz counts its labels from train.npz."""
        count = self.kind.classes
        if self.partition != "classes" or count is None:  # None: __post_init__ allows only iid
            return
        classes = count(self)
        for world in world_sizes:
            check_classes_per_worker(self.classes_per_worker, world, classes)

    def check_batches(self, batches: list[tuple[int, int]]) -> None:
        """Every worker's training shard holds one micro-batch, for each ``(world size, micro-batch)`` of
        ``batches``: ``fitting_partition``, the worker's own computation (``ShardTooSmall`` or dirichlet's error if
        not), run on the count and, for a fixed partition, the labels, neither loading the samples (digits: the
        labels cost scikit-learn's import, about a second; synthetic: drawing the class centres). Call it after
        ``check_files`` (npz reads train.npz). Left to the worker, which checks the same at its first batch: cifar10
        and cifar100 (count and labels are in the pickled batches, read whole) and imagefolder (listing every
        image). Tokens: a batch is windows drawn with replacement from the shard, so only one window must fit
        (``check_shards``)."""
        if self.kind.check_shards is not None:
            for world, _ in batches:
                self.kind.check_shards(self, world)
        size, read_labels = self.kind.train_size, self.kind.train_labels
        if size is None or read_labels is None:
            return
        train_size = size(self)
        labels = functools.cache(functools.partial(read_labels, self))  # read once, only for a fixed partition
        for world, batch_size in batches:
            fitting_partition(self.sharding(), labels, train_size, world, batch_size)


def layout(name: str) -> str:
    """What the directory of dataset ``name`` must hold (for error messages; empty for data not on disk)."""
    kind = DATASETS.get(name)
    return kind.layout if kind is not None else ""


def build_datasets(cfg: DatasetConfig) -> Datasets:
    """The dataset ``cfg`` names, its files checked first: a worker started without the launcher's preflight gets
    the same one-line error."""
    cfg.check_files()
    data = cfg.kind.build(cfg)
    if isinstance(data, TensorData):
        data.sharding = cfg.sharding()
    return data


def prepare(cfg: DatasetConfig) -> None:
    """Once, in the launcher before any worker starts: download what ``dataset.download=true`` asks for."""
    if cfg.download and cfg.kind.download is not None:
        cfg.kind.download(cfg)


__all__ = [
    "DATASETS",
    "DATASET_NAMES",
    "DIGITS_CLASSES",
    "IMAGE_DATASETS",
    "Batch",
    "BatchTransform",
    "DatasetConfig",
    "DatasetKind",
    "Datasets",
    "ShardTooSmall",
    "TensorData",
    "batch_generator",
    "batch_to_device",
    "build_datasets",
    "host_to_device",
    "layout",
    "prepare",
]
