"""Datasets, sharding and models, checked against direct computations on the arrays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from decent_train.components.data import DatasetConfig, build_datasets
from decent_train.components.models import ModelConfig, build_model


def test_digits_split_is_disjoint_complete_and_fixed() -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    a, b = build_datasets(DatasetConfig(name="digits")), build_datasets(DatasetConfig(name="digits"))
    assert torch.equal(a.train.tensors[0], b.train.tensors[0])  # independent of anything but split_seed
    assert len(a.train) + len(a.test) == len(digits.target) and len(a.test) == round(0.2 * len(digits.target))
    assert a.input_shape == (1, 8, 8) and a.num_classes == 10
    images = torch.cat([a.train.tensors[0], a.test.tensors[0]]).flatten(1) * 16
    rows = {tuple(r) for r in images.round().long().tolist()}
    assert rows == {tuple(r) for r in digits.data.astype(int).tolist()}  # the same images, none lost or repeated


@pytest.mark.parametrize("world", [1, 3, 4])
def test_train_shards_are_disjoint_and_reshuffle_each_epoch(world: int) -> None:
    data = build_datasets(DatasetConfig(name="synthetic", num_samples=120, input_shape=[3]))
    x_all = data.train.tensors[0]
    batch = 5
    per_epoch = (120 // world) // batch
    seen = []
    for rank in range(world):
        stream = data.train_batches(batch, rank, world, seed=1)
        epochs = [[next(stream)[0] for _ in range(per_epoch)] for _ in range(2)]
        seen.append([torch.cat(e) for e in epochs])
    index = {tuple(row.tolist()): i for i, row in enumerate(x_all)}
    first = [{index[tuple(r.tolist())] for r in s[0]} for s in seen]
    assert sum(len(f) for f in first) == len(set().union(*first)) == world * per_epoch * batch  # disjoint
    assert not torch.equal(seen[0][0], seen[0][1])  # a new order in the next epoch


def test_eval_batches_cover_the_test_set_once() -> None:
    data = build_datasets(DatasetConfig(name="synthetic", num_samples=100, input_shape=[2]))
    got = torch.cat([x for r in range(3) for x, _ in data.eval_batches(4, r, 3)])
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, data.test.tensors[0].tolist()))


def test_npz_directory(tmp_path: Path) -> None:
    x = np.random.default_rng(0).integers(0, 256, size=(10, 2, 3, 3), dtype=np.uint8)
    y = np.arange(10) % 4
    np.savez(tmp_path / "train.npz", x=x, y=y)
    np.savez(tmp_path / "test.npz", x=x[:3], y=y[:3])
    data = build_datasets(DatasetConfig(name="npz", root=str(tmp_path)))
    torch.testing.assert_close(data.train.tensors[0], torch.from_numpy(x).float() / 255)
    assert data.input_shape == (2, 3, 3) and data.num_classes == 4 and len(data.test) == 3


def test_malformed_npz_names_file_and_layout(tmp_path: Path) -> None:
    np.savez(tmp_path / "train.npz", x=np.zeros((3, 2)), y=np.zeros(2, dtype=int))
    np.savez(tmp_path / "test.npz", x=np.zeros((3, 2)), y=np.zeros(3, dtype=int))
    with pytest.raises(ValueError, match="train.npz: x has 3 samples"):
        build_datasets(DatasetConfig(name="npz", root=str(tmp_path)))


@pytest.mark.parametrize("name,shape", [("mlp", (64,)), ("mlp", (1, 8, 8)), ("cnn", (1, 8, 8)), ("cnn", (3, 32, 32))])
def test_models_map_inputs_to_class_scores(name: str, shape: tuple[int, ...]) -> None:
    size = {"hidden_sizes": [16]} if name == "mlp" else {"channels": [4, 8]}
    model = build_model(ModelConfig(name=name, **size), shape, 7)
    assert model(torch.randn(5, *shape)).shape == (5, 7)


def test_cnn_needs_images() -> None:
    with pytest.raises(ValueError, match="needs image inputs"):
        build_model(ModelConfig(name="cnn"), (64,), 10)
