"""Tiny datasets written in the real on-disk formats (CIFAR python pickles, ImageFolder PNG/JPEG, uint16 token files),
so loaders and recipes are tested on what users have, without downloads."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np


def write_cifar(root: Path, name: str = "cifar10", per_file: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """torchvision's layout: ROOT/cifar-10-batches-py/data_batch_1..5, test_batch (or cifar-100-python/train, test).
    Returns the arrays written, training files first: ``x`` (N, 3072) uint8 and ``y`` (N,)."""
    rng = np.random.default_rng(seed)
    folder, files, key, classes = {
        "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"], "labels", 10),
        "cifar100": ("cifar-100-python", ["train", "test"], "fine_labels", 100),
    }[name]
    (root / folder).mkdir(parents=True, exist_ok=True)
    written: dict[str, np.ndarray] = {}
    for f in files:
        x = rng.integers(0, 256, size=(per_file, 3072), dtype=np.uint8)
        y = rng.integers(0, classes, size=per_file)
        entry = {"batch_label": f, "data": x, key: y.tolist(), "filenames": [f"{f}_{i}.png" for i in range(per_file)]}
        if name == "cifar100":
            entry["coarse_labels"] = (y // 5).tolist()
        with open(root / folder / f, "wb") as stream:
            pickle.dump(entry, stream, protocol=2)
        written[f] = x
        written[f + ".labels"] = y
    return written


def write_image_folder(root: Path, classes: tuple[str, ...] = ("cat", "dog"), per_class: int = 4, size: tuple[int, int] = (40, 48)) -> None:
    """ROOT/train/<class>/*.png|jpg and ROOT/val/<class>/*.png|jpg, random RGB images of ``size`` (width, height)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("val", max(1, per_class // 2))):
        for c in classes:
            folder = root / split / c
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.{'jpg' if i % 2 else 'png'}")


def write_token_files(root: Path, train_tokens: int = 4096, val_tokens: int = 1024, vocab: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """ROOT/train.bin and ROOT/val.bin: flat little-endian uint16 token ids below ``vocab``."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    train = rng.integers(0, vocab, size=train_tokens).astype("<u2")
    val = rng.integers(0, vocab, size=val_tokens).astype("<u2")
    train.tofile(root / "train.bin")
    val.tofile(root / "val.bin")
    return train, val
