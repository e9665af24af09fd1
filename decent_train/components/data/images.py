"""Image datasets in their usual on-disk formats: CIFAR-10/100 (torchvision's python pickles) and ImageNet-style
class folders. Nothing downloads unless ``dataset.download=true`` (CIFAR only).

torchvision is imported inside the functions that use it (a download, the image-folder pipeline): it adds about
1.5 s to every process's start-up, which the other datasets need not pay."""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset, TensorDataset

from decent_train.components.data.arrays import TensorData
from decent_train.components.data.base import Batch, BatchTransform, Datasets, batch_generator, host_to_device
from decent_train.components.data.partition import check_iid_shard

CIFAR_DIR = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}
CIFAR_SPLITS = {  # (training files, test files)
    "cifar10": ([f"data_batch_{i}" for i in range(1, 6)], ["test_batch"]),
    "cifar100": (["train"], ["test"]),
}
CIFAR_LABELS = {"cifar10": "labels", "cifar100": "fine_labels"}
CIFAR_CLASSES = {"cifar10": 10, "cifar100": 100}
CIFAR_LAYOUT = {
    name: f"ROOT/{CIFAR_DIR[name]}/ holding {', '.join(train + test)} (torchvision's {name} python format: pickled "
    f"dicts with 'data' (N x 3072 uint8) and '{CIFAR_LABELS[name]}'; dataset.download=true fetches it)"
    for name, (train, test) in CIFAR_SPLITS.items()
}
# Per-channel statistics of the training sets.
CIFAR_MEAN_STD = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
IMAGENET_MEAN_STD = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
IMAGE_FOLDER_LAYOUT = (
    "ROOT/train/<class>/<image> and ROOT/val/<class>/<image> (ImageNet-style class folders, the same classes in both)"
)


def cifar_present(root: Path, name: str) -> bool:
    train, test = CIFAR_SPLITS[name]
    return all((root / CIFAR_DIR[name] / f).is_file() for f in train + test)


def check_cifar(root: Path, name: str) -> None:
    """Cheap: the files exist and start like pickles. Their contents are checked when a worker loads them."""
    if not root.is_dir():
        raise ValueError(f"dataset.root={root} is not a directory; expected {CIFAR_LAYOUT[name]}")
    folder = root / CIFAR_DIR[name]
    train, test = CIFAR_SPLITS[name]
    missing = [f for f in train + test if not (folder / f).is_file()]
    if missing:
        raise ValueError(f"{folder} lacks {', '.join(missing)}; expected {CIFAR_LAYOUT[name]}")
    for f in train + test:
        with open(folder / f, "rb") as stream:
            if stream.read(1) != b"\x80":
                raise ValueError(f"{folder / f} is not a pickle; expected {CIFAR_LAYOUT[name]}")


def read_cifar_file(path: Path, name: str) -> tuple[Tensor, Tensor]:
    """One pickled CIFAR batch: images (N, 3, 32, 32) uint8 and labels (N,) int64."""
    try:
        with open(path, "rb") as stream:
            entry = pickle.load(stream, encoding="latin1")
        entry = {k.decode() if isinstance(k, bytes) else k: v for k, v in entry.items()}
        data = np.asarray(entry["data"], dtype=np.uint8)
        labels = np.asarray(entry[CIFAR_LABELS[name]], dtype=np.int64)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: not a CIFAR batch ({type(error).__name__}: {error}); expected {CIFAR_LAYOUT[name]}") from None
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or labels.shape != (len(data),):
        raise ValueError(f"{path}: data {data.shape}, labels {labels.shape}; expected {CIFAR_LAYOUT[name]}")
    if not len(labels) or labels.min() < 0 or labels.max() >= CIFAR_CLASSES[name]:
        raise ValueError(f"{path}: no images, or labels outside 0..{CIFAR_CLASSES[name] - 1}; expected {CIFAR_LAYOUT[name]}")
    return torch.from_numpy(data.reshape(-1, 3, 32, 32)), torch.from_numpy(labels)


def cifar(root: Path, name: str, augment: bool) -> TensorData:
    """CIFAR in memory as uint8 (150 MB for the training set); normalized, cropped and flipped per batch."""
    train_files, test_files = CIFAR_SPLITS[name]

    def read(files: list[str]) -> TensorDataset:
        parts = [read_cifar_file(root / CIFAR_DIR[name] / f, name) for f in files]
        return TensorDataset(torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))

    mean, std = CIFAR_MEAN_STD[name]
    return TensorData(read(train_files), read(test_files), CIFAR_CLASSES[name], cifar_transform(mean, std, augment))


def cifar_transform(mean: tuple[float, ...], std: tuple[float, ...], augment: bool) -> BatchTransform:
    """uint8 images to normalized float, cropped and flipped when a generator is given; on whichever device the
    images are (the worker's: ``TensorData.device_train_batches``)."""
    mean_t, std_t = torch.tensor(mean).view(1, -1, 1, 1), torch.tensor(std).view(1, -1, 1, 1)
    stats: dict[torch.device, tuple[Tensor, Tensor]] = {}  # per device, copied once

    def transform(x: Tensor, generator: Optional[torch.Generator]) -> Tensor:
        if augment and generator is not None:  # on the stored uint8: a quarter of the bytes; padding 0 stays 0.0
            x = crop_flip(x, 4, crop_flip_draws(len(x), 4, generator))
        if x.device not in stats:
            stats[x.device] = (host_to_device(mean_t, x.device), host_to_device(std_t, x.device))
        mean_d, std_d = stats[x.device]
        x = x.float().div_(255.0)
        return (x - mean_d) / std_d

    return transform


def random_crop_flip(x: Tensor, padding: int, generator: torch.Generator) -> Tensor:
    """Each image of the batch zero-padded by ``padding``, cropped back at a random offset, flipped with p = 1/2."""
    return crop_flip(x, padding, crop_flip_draws(len(x), padding, generator))


def crop_flip_draws(n: int, padding: int, generator: torch.Generator) -> Tensor:
    """``random_crop_flip``'s random numbers, (3, n) int64 on the CPU: row offsets, column offsets, flips (0 or 1).
    Drawn on the CPU in this order whatever device crops, so a batch (and a resumed run) does not depend on it."""
    dy = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    dx = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    flip = torch.rand(n, generator=generator) < 0.5
    return torch.stack([dy, dx, flip.long()])


def crop_flip(x: Tensor, padding: int, draws: Tensor) -> Tensor:
    """The crops and flips ``draws`` (``crop_flip_draws``) say, on ``x``'s device."""
    n, c, h, w = x.shape
    device = x.device
    dy, dx, flip = host_to_device(draws, device)
    padded = F.pad(x, (padding,) * 4)
    rows = dy[:, None] + torch.arange(h, device=device)  # (n, h)
    cols = dx[:, None] + torch.arange(w, device=device)
    cols = torch.where(flip.bool()[:, None], cols.flip(1), cols)
    return padded[
        torch.arange(n, device=device)[:, None, None, None],
        torch.arange(c, device=device)[None, :, None, None],
        rows[:, None, :, None],
        cols[:, None, None, :],
    ]


def download_cifar(root: Path, name: str) -> None:
    """torchvision's download of ``name`` into ``root``, unless it is there already: into a folder of this process's
    own under ``root`` first, then the dataset's folder renamed into place, whole. Several nodes' launches sharing
    ``root`` (a shared file system) may download at once, and torchvision writes the archive and extracts it in
    place: into one folder, they would corrupt it."""
    if cifar_present(root, name):
        return
    from torchvision import datasets

    cls = datasets.CIFAR10 if name == "cifar10" else datasets.CIFAR100
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-download-", dir=root))
        try:
            for train in (True, False):
                cls(str(staging), train=train, download=True)
            with contextlib.suppress(OSError):  # another launch's came first (whole too), or an old one's is there
                os.rename(staging / CIFAR_DIR[name], root / CIFAR_DIR[name])
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except Exception as error:  # network, disk: one line, not urllib's traceback
        raise ValueError(f"dataset.download=true could not fetch {name} into {root}: {error}") from None
    if not cifar_present(root, name):
        raise ValueError(f"dataset.download=true: {root / CIFAR_DIR[name]} holds an incomplete {name} (an earlier "
                         "download's?); remove it, or give another dataset.root")


def check_image_folder(root: Path) -> None:
    """Cheap: both splits have class folders, the same ones. Image files are listed when a worker loads them."""
    classes: dict[str, list[str]] = {}
    for split in ("train", "val"):
        folder = root / split
        if not folder.is_dir():
            raise ValueError(f"dataset.root={root} has no {split}/ folder; expected {IMAGE_FOLDER_LAYOUT}")
        classes[split] = sorted(d.name for d in folder.iterdir() if d.is_dir())
        if not classes[split]:
            raise ValueError(f"{folder} has no class folders; expected {IMAGE_FOLDER_LAYOUT}")
    if classes["train"] != classes["val"]:
        only = sorted(set(classes["train"]) ^ set(classes["val"]))
        raise ValueError(f"{root}: train/ and val/ have different classes ({', '.join(only[:5])}); expected {IMAGE_FOLDER_LAYOUT}")


def image_loader(dataset: Dataset, batch_size: int, workers: int, persistent: bool, **kwargs: object) -> DataLoader:
    """The image-folder pipeline's loader: ``workers`` decode processes, kept across passes where ``persistent``."""
    return DataLoader(
        dataset,
        batch_size,
        num_workers=workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=persistent and workers > 0,
        # Each iterator draws its decode processes' base seed (unused here: SeededSamples seeds the transforms)
        # from this generator; without one it would draw from, and move, the trainer's global random stream.
        generator=torch.Generator(),
        **kwargs,  # type: ignore[arg-type]
    )


class EpochOrder(Sampler[tuple[int, int]]):
    """The training loader's sampler: the current epoch's (image index, augmentation seed) pairs. Each ``iter`` of
    the loader reads it afresh, so one loader, and its decode processes, serve every epoch."""

    def __init__(self) -> None:
        self.items: list[tuple[int, int]] = []

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


class SeededSamples(Dataset):
    """``dataset[index]`` with torch's CPU random stream, which torchvision's random transforms draw from, seeded by
    the sample's own seed: its augmentation depends on the seed alone, not on which process decodes it or what that
    process decoded before. The stream is restored afterwards, so decoding in the trainer's process
    (``loader_workers=0``) leaves the trainer's random numbers (dropout, say) as they were."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> tuple[Tensor, int]:
        index, seed = key
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            return self.dataset[index]


class KeptLoader:
    """A persistent loader handed out one pass at a time. A persistent loader has one iterator, so a pass asked for
    while another is under way (two evaluation streams read side by side) gets a loader of its own."""

    def __init__(self, make: Callable[[bool], DataLoader]) -> None:
        self.make = make  # persistent or not -> a loader over the same samples
        self.loader = make(True)
        self.busy = False

    def batches(self) -> Iterator[Batch]:
        if self.busy:
            yield from self.make(False)
            return
        self.busy = True
        try:
            yield from self.loader
        finally:
            self.busy = False


class ImageFolderData(Datasets):
    """ImageNet-style folders, decoded by ``loader_workers`` processes per worker with the standard augmentations:
    random resized crop and flip for training; resize to ``image_size / 0.875`` and centre crop for evaluation.
    ``check_image_folder`` (``build_datasets`` runs it first) has checked the layout."""

    def __init__(self, root: Path, image_size: int, augment: bool, loader_workers: int):
        from torchvision import datasets
        from torchvision import transforms as T

        normalize = T.Normalize(*IMAGENET_MEAN_STD)
        eval_tf = T.Compose([T.Resize(round(image_size / 0.875)), T.CenterCrop(image_size), T.ToTensor(), normalize])
        train_tf = (
            T.Compose([T.RandomResizedCrop(image_size), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
            if augment
            else eval_tf
        )
        try:
            self.train = datasets.ImageFolder(str(root / "train"), train_tf)
            self.test = datasets.ImageFolder(str(root / "val"), eval_tf)
        except (FileNotFoundError, OSError) as error:
            raise ValueError(f"dataset.root={root}: {error}; expected {IMAGE_FOLDER_LAYOUT}") from None
        self.input_shape = (3, image_size, image_size)
        self.num_classes = len(self.train.classes)
        self.train_size = len(self.train)
        self.loader_workers = loader_workers
        self._eval: dict[tuple[int, int, int], KeptLoader] = {}  # by (batch_size, rank, world): at most one

    def train_batches(self, batch_size: int, rank: int, world: int, seed: int, start: int = 0) -> Iterator[Batch]:
        """One loader for the whole stream, its ``loader_workers`` decode processes kept from epoch to epoch (starting
        them anew, a fork each or an import of torch each with spawn or forkserver, stalled every epoch's start); each
        epoch only sets its sampler's order.

        The order is DistributedSampler's (by seed and epoch); a resume inside an epoch reads the rest of it in the
        same order. Each image's random crop and flip come from a seed of its own, drawn per epoch and position from
        ``seed`` (``SeededSamples``), not from the decode processes' random streams, which would run on from epoch to
        epoch: so a resumed stream, even inside an epoch, gets the same crops as an uninterrupted one, and so does
        any number of decode processes (none included)."""
        check_iid_shard(self.train_size, world, batch_size)
        sampler = DistributedSampler(self.train, world, rank, shuffle=True, seed=seed, drop_last=True)
        per_epoch = len(sampler) // batch_size
        epoch, skip = divmod(start, per_epoch)
        order = EpochOrder()
        loader = image_loader(SeededSamples(self.train), batch_size, self.loader_workers, True, sampler=order,
                              drop_last=True)
        while True:
            sampler.set_epoch(epoch)
            indices = list(sampler)
            # Drawn for the whole epoch before the skip, so a resume takes the same seeds for the same positions.
            seeds = torch.randint(0, 2**63 - 1, (len(indices),), generator=batch_generator(seed, rank, epoch, 0))
            order.items = list(zip(indices, seeds.tolist()))[skip * batch_size :]
            yield from loader  # a persistent loader's iter() starts the next pass on the same processes
            epoch, skip = epoch + 1, 0

    def eval_batches(self, batch_size: int, rank: int, world: int) -> Iterator[Batch]:
        """One loader kept from evaluation to evaluation, its decode processes with it (a new one after a membership
        change). A user paying for GPUs wants an evaluation to cost its forward passes: started per evaluation, the
        processes cost a fork each (0.1 to 0.2 s for 2 measured) or, with spawn or forkserver (Python 3.14's default
        on Linux), an import of torch each (3 to 8 s for 2), every evaluation; kept, each costs its memory while idle
        (12 MB private forked, 370 MB spawned), little on a GPU node (scripts/BENCHMARKS.md: "Image decode
        processes")."""
        key = (batch_size, rank, world)
        if key not in self._eval:
            self._eval.clear()  # the previous membership's processes end before the new ones start
            subset = Subset(self.test, range(rank, len(self.test), world))
            # Not through self: a loader that held this object would keep its processes alive past it.
            self._eval[key] = KeptLoader(functools.partial(image_loader, subset, batch_size, self.loader_workers))
        yield from self._eval[key].batches()

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_eval": {}}  # the kept loader's processes belong to this process

    def eval_batch_count(self, batch_size: int, rank: int, world: int) -> int:
        return -(-len(range(rank, len(self.test), world)) // batch_size)  # the loader keeps its last, partial batch
