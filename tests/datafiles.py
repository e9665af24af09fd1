"""Tiny datasets written in the real on-disk formats (CIFAR python pickles, ImageFolder PNG/JPEG, uint16 token files),
so loaders and recipes are tested on what users have, without downloads."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
from PIL import Image

from decent_train.components.data import images

CIFAR10_SIZES = {"data_batch_1": 3, "data_batch_2": 2, "data_batch_3": 4, "data_batch_4": 1, "data_batch_5": 2, "test_batch": 3}
CIFAR100_SIZES = {"train": 5, "test": 3}


def _cifar_entry(n: int, rng: np.random.Generator, name: str, file: str, bytes_keys: bool) -> tuple[dict, np.ndarray, np.ndarray]:
    data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    classes = 10 if name == "cifar10" else 100
    labels = rng.integers(0, classes, size=n)
    labels[0] = classes - 1  # the top class is a valid label
    if name == "cifar10":
        entry = {"batch_label": f"training batch {file}", "labels": labels.tolist(), "data": data,
                 "filenames": [f"img_{i}.png" for i in range(n)]}
    else:
        entry = {"filenames": [f"img_{i}.png" for i in range(n)], "batch_label": file, "fine_labels": labels.tolist(),
                 "coarse_labels": (labels // 5).tolist(), "data": data}
    if bytes_keys:  # what a Python 2 pickle read without an encoding looks like
        entry = {k.encode(): v for k, v in entry.items()}
    return entry, data, labels


def write_cifar(root: Path, name: str, bytes_keys: bool = False, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Tiny CIFAR files in the real format; returns {file: (flat data N x 3072, labels)}."""
    rng = np.random.default_rng(seed)
    folder = root / images.CIFAR_DIR[name]
    folder.mkdir(parents=True)
    written = {}
    for file, n in (CIFAR10_SIZES if name == "cifar10" else CIFAR100_SIZES).items():
        entry, data, labels = _cifar_entry(n, rng, name, file, bytes_keys)
        with open(folder / file, "wb") as stream:
            pickle.dump(entry, stream, protocol=2)
        written[file] = (data, labels)
    return written


TRAIN_FILES = {"cat": ["a.png", "b.png", "c.jpg"], "dog": ["a.png", "d.png", "e.png"]}
VAL_FILES = {"cat": ["x.png", "y.jpg", "z.png"], "dog": ["v.png", "w.png"]}


def write_image_folder(root: Path, seed: int = 0) -> None:
    """ROOT/train/<class>/ and ROOT/val/<class>/ holding random 40x48 RGB images, PNG and JPEG."""
    rng = np.random.default_rng(seed)
    for split, files in (("train", TRAIN_FILES), ("val", VAL_FILES)):
        for cls, names in files.items():
            (root / split / cls).mkdir(parents=True)
            for file in names:
                pixels = rng.integers(0, 256, size=(48, 40, 3), dtype=np.uint8)  # 40 wide, 48 high
                Image.fromarray(pixels).save(root / split / cls / file)


def write_token_files(root: Path, n_train: int = 1000, n_val: int = 85, seed: int = 0, vocab: int = 50000) -> tuple[np.ndarray, np.ndarray]:
    """ROOT/train.bin and ROOT/val.bin: flat little-endian uint16 token ids below ``vocab``."""
    rng = np.random.default_rng(seed)
    train = rng.integers(0, vocab, size=n_train)
    val = rng.integers(0, vocab, size=n_val)
    root.mkdir(parents=True, exist_ok=True)
    np.array(train, dtype="<u2").tofile(root / "train.bin")
    np.array(val, dtype="<u2").tofile(root / "val.bin")
    return train, val
