"""On-disk datasets (CIFAR pickles, ImageNet-style class folders, uint16 token files), checked against the arrays the
tests write themselves and per-sample computations by hand."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import pickle
import re
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from decent_train.components.data import DatasetConfig, Datasets, arrays, build_datasets, images, prepare, tokens

from .datafiles import CIFAR10_SIZES, TRAIN_FILES, VAL_FILES, write_cifar, write_image_folder, write_token_files

# --------------------------------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100 in torchvision's python format
# --------------------------------------------------------------------------------------------------------------------

def _unflatten_by_hand(flat: np.ndarray) -> np.ndarray:
    """(N, 3072) -> (N, 3, 32, 32), one pixel at a time: the R plane, then G, then B, each row-major."""
    out = np.zeros((len(flat), 3, 32, 32), dtype=np.uint8)
    for n in range(len(flat)):
        for i in range(3072):
            channel, within = divmod(i, 1024)
            row, col = divmod(within, 32)
            out[n, channel, row, col] = flat[n, i]
    return out


def _normalize_by_hand(x: np.ndarray, name: str) -> np.ndarray:
    mean, std = images.CIFAR_MEAN_STD[name]
    out = np.empty(x.shape, dtype=np.float64)
    for c in range(3):
        out[:, c] = (x[:, c].astype(np.float64) / 255.0 - mean[c]) / std[c]
    return out


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
@pytest.mark.parametrize("bytes_keys", [False, True])
def test_cifar_loads_the_written_images_and_labels(tmp_path: Path, name: str, bytes_keys: bool) -> None:
    written = write_cifar(tmp_path, name, bytes_keys)
    train_files, test_files = (
        (["data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5"], ["test_batch"])
        if name == "cifar10"
        else (["train"], ["test"])
    )
    data = build_datasets(DatasetConfig(name=name, root=str(tmp_path), augment=False))
    assert data.num_classes == (10 if name == "cifar10" else 100)
    assert data.input_shape == (3, 32, 32)
    for split, files in ((data.train, train_files), (data.test, test_files)):
        x, y = split.tensors
        expected_x = np.concatenate([_unflatten_by_hand(written[f][0]) for f in files])  # the files, in order
        expected_y = np.concatenate([written[f][1] for f in files])
        assert x.dtype == torch.uint8 and x.shape == (len(expected_x), 3, 32, 32)
        np.testing.assert_array_equal(x.numpy(), expected_x)
        np.testing.assert_array_equal(y.numpy(), expected_y)  # fine_labels for cifar100, not coarse_labels
        assert y.dtype == torch.int64
    assert data.train_size == sum(len(written[f][1]) for f in train_files)
    # One pixel by hand: the flat index 1024 * c + 32 * row + col is channel c, row `row`, column `col`.
    flat = written[train_files[0]][0]
    x0 = data.train.tensors[0][0]
    for c, row, col in ((0, 0, 1), (1, 2, 3), (2, 31, 0), (0, 5, 31), (2, 17, 29)):
        assert int(x0[c, row, col]) == int(flat[0, 1024 * c + 32 * row + col])


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
@pytest.mark.parametrize("world", [1, 2])
def test_cifar_eval_batches_are_the_normalized_test_images(tmp_path: Path, name: str, world: int) -> None:
    written = write_cifar(tmp_path, name, seed=1)
    test_file = "test_batch" if name == "cifar10" else "test"
    expected = _normalize_by_hand(_unflatten_by_hand(written[test_file][0]), name)
    labels = written[test_file][1]
    data = build_datasets(DatasetConfig(name=name, root=str(tmp_path)))  # augment=True: evaluation never augments
    seen = []
    for rank in range(world):
        batches = list(data.eval_batches(2, rank, world))
        assert all(len(xb) <= 2 for xb, _ in batches)
        xs = torch.cat([xb for xb, _ in batches])
        ys = torch.cat([yb for _, yb in batches])
        assert xs.dtype == torch.float32
        np.testing.assert_allclose(xs.double().numpy(), expected[rank::world], rtol=0, atol=1e-5)
        np.testing.assert_array_equal(ys.numpy(), labels[rank::world])
        seen += list(range(len(labels)))[rank::world]
    assert sorted(seen) == list(range(len(labels)))  # every test image once over all workers


def test_cifar_training_batches_without_augmentation_are_normalized_training_images(tmp_path: Path) -> None:
    written = write_cifar(tmp_path, "cifar10", seed=2)
    files = [f"data_batch_{i}" for i in range(1, 6)]
    expected = _normalize_by_hand(_unflatten_by_hand(np.concatenate([written[f][0] for f in files])), "cifar10")
    labels = np.concatenate([written[f][1] for f in files])
    data = build_datasets(DatasetConfig(name="cifar10", root=str(tmp_path), augment=False))
    stream = data.train_batches(3, 0, 1, seed=0)
    used = []
    for _ in range(data.micro_batches_per_epoch(3, 1)):
        xb, yb = next(stream)
        for x, y in zip(xb.double().numpy(), yb.tolist()):
            match = [i for i in range(len(expected)) if np.allclose(x, expected[i], rtol=0, atol=1e-5)]
            assert len(match) == 1 and labels[match[0]] == y
            used.append(match[0])
    assert len(set(used)) == len(used) == 12  # one epoch: distinct images


def test_cifar_augmented_training_images_are_crops_and_flips_of_training_images(tmp_path: Path) -> None:
    written = write_cifar(tmp_path, "cifar10", seed=3)
    raw = _unflatten_by_hand(np.concatenate([written[f"data_batch_{i}"][0] for i in range(1, 6)])).astype(np.float64)
    labels = np.concatenate([written[f"data_batch_{i}"][1] for i in range(1, 6)])
    padded = np.pad(raw, ((0, 0), (0, 0), (4, 4), (4, 4)))  # zero padding by 4, as in torchvision's CIFAR recipe
    keys, crops = [], []  # every (image, dy, dx, flip) and its crop, in raw pixel values
    for dy in range(9):
        for dx in range(9):
            crop = padded[:, :, dy : dy + 32, dx : dx + 32]
            for i in range(len(raw)):
                for flip in (False, True):
                    keys.append((i, dy, dx, flip))
                    crops.append(crop[i][:, :, ::-1] if flip else crop[i])
    crops = np.stack(crops)
    centre = crops[:, :, 14:18, 14:18].reshape(len(crops), -1)  # inside the image whatever the offset
    mean, std = (np.array(v).reshape(1, 3, 1, 1) for v in images.CIFAR_MEAN_STD["cifar10"])
    data = build_datasets(DatasetConfig(name="cifar10", root=str(tmp_path), augment=True))
    stream = data.train_batches(12, 0, 1, seed=0)
    found = []
    for _ in range(10):
        xb, yb = next(stream)
        back = (xb.double().numpy() * std + mean) * 255.0  # undo the normalization
        for x, y in zip(back, yb.tolist()):
            near = np.flatnonzero(np.abs(centre - x[:, 14:18, 14:18].reshape(-1)).max(axis=1) < 1e-3)
            full = [k for k in near if np.abs(crops[k] - x).max() < 1e-3]
            assert len(full) == 1, "an augmented image is no zero-padded crop (with or without flip) of a training image"
            assert labels[keys[full[0]][0]] == y
            found.append(keys[full[0]])
    _, dys, dxs, flips = zip(*found)
    assert set(dys) == set(dxs) == set(range(9)) and set(flips) == {False, True}  # padding 4: offsets 0..8


def test_random_crop_flip_is_a_crop_of_the_zero_padded_image() -> None:
    n, c, h, w, p = 64, 2, 5, 7, 2  # not square: rows and columns cannot be confused
    x = torch.randn(n, c, h, w) + 3.0  # no value is 0, the padding's value
    before = x.clone()
    out = images.random_crop_flip(x, p, torch.Generator().manual_seed(5))
    assert out.shape == x.shape and torch.equal(x, before)
    padded = np.pad(x.numpy(), ((0, 0), (0, 0), (p, p), (p, p)))
    choices = []
    for i in range(n):
        found = []
        for dy in range(2 * p + 1):
            for dx in range(2 * p + 1):
                crop = padded[i, :, dy : dy + h, dx : dx + w]
                for flip in (False, True):
                    if np.array_equal(out[i].numpy(), crop[:, :, ::-1] if flip else crop):
                        found.append((dy, dx, flip))
        assert len(found) == 1, f"image {i}: {found}"
        choices.append(found[0])
    dys, dxs, flips = zip(*choices)
    assert set(dys) == set(range(2 * p + 1)) and set(dxs) == set(range(2 * p + 1))  # offsets vary, both ends reached
    assert set(flips) == {False, True}
    again = images.random_crop_flip(x, p, torch.Generator().manual_seed(5))
    assert torch.equal(out, again)
    assert not torch.equal(out, images.random_crop_flip(x, p, torch.Generator().manual_seed(6)))


def _error(match_parts: list[str], call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for part in match_parts:
        assert part in message, f"{part!r} not in {message!r}"
    return message


def test_cifar_layout_errors_name_the_path_and_the_layout(tmp_path: Path) -> None:
    layout = images.CIFAR_LAYOUT["cifar10"]
    assert "cifar-10-batches-py" in layout and "data_batch_1" in layout and "test_batch" in layout
    missing = tmp_path / "nowhere"
    _error([str(missing), layout], lambda: DatasetConfig(name="cifar10", root=str(missing)).check_files())
    _error(["dataset.root"], lambda: DatasetConfig(name="cifar10"))

    empty = tmp_path / "empty"
    empty.mkdir()
    _error([str(empty / "cifar-10-batches-py"), "data_batch_1", layout],
           lambda: DatasetConfig(name="cifar10", root=str(empty)).check_files())
    _error([str(empty / "cifar-100-python"), images.CIFAR_LAYOUT["cifar100"]],
           lambda: DatasetConfig(name="cifar100", root=str(empty)).check_files())

    root = tmp_path / "no3"
    write_cifar(root, "cifar10")
    (root / "cifar-10-batches-py" / "data_batch_3").unlink()
    message = _error([str(root / "cifar-10-batches-py"), layout],
                     lambda: DatasetConfig(name="cifar10", root=str(root)).check_files())
    assert re.search(r"lacks data_batch_3;", message), message

    root = tmp_path / "text"
    write_cifar(root, "cifar10")
    (root / "cifar-10-batches-py" / "test_batch").write_text("not a pickle at all\n")
    _error([str(root / "cifar-10-batches-py" / "test_batch"), "not a pickle", layout],
           lambda: DatasetConfig(name="cifar10", root=str(root)).check_files())


@pytest.mark.parametrize("name", ["npz", "cifar10", "imagefolder", "tokens"])
def test_files_are_checked_by_check_files_and_build_not_by_construction(tmp_path: Path, name: str) -> None:
    """Constructing the config reads no disk (the launcher's preflight calls ``check_files``); a worker that builds
    the data anyway gets the same one-line error naming the path."""
    missing = tmp_path / "nowhere"
    cfg = DatasetConfig(name=name, root=str(missing))
    message = _error([str(missing)], cfg.check_files)
    assert _error([str(missing)], lambda: build_datasets(cfg)) == message


@pytest.mark.parametrize(
    "entry,words",
    [
        ({"labels": [1, 2]}, ["'data'"]),
        ({"data": np.zeros((2, 3000), dtype=np.uint8), "labels": [1, 2]}, ["3000"]),
        ({"data": np.zeros((2, 3072), dtype=np.uint8), "labels": [1, 2, 3]}, ["(2, 3072)"]),
        ({"data": np.zeros((2, 3072), dtype=np.uint8), "labels": [1, 10]}, ["labels outside 0..9"]),
        ({"data": np.zeros((2, 3072), dtype=np.uint8), "fine_labels": [1, 2]}, ["'labels'"]),
    ],
)
def test_malformed_cifar_pickle_is_rejected_on_load(tmp_path: Path, entry: dict, words: list[str]) -> None:
    write_cifar(tmp_path, "cifar10")
    bad = tmp_path / "cifar-10-batches-py" / "data_batch_4"
    with open(bad, "wb") as stream:
        pickle.dump(entry, stream, protocol=2)
    cfg = DatasetConfig(name="cifar10", root=str(tmp_path))
    cfg.check_files()  # the cheap check only reads headers: accepted
    _error([str(bad), images.CIFAR_LAYOUT["cifar10"], *words], lambda: build_datasets(cfg))


def test_download_only_for_cifar(tmp_path: Path) -> None:
    token_root = tmp_path / "tokens"
    token_root.mkdir()
    tokens.write_tokens(token_root / "train.bin", np.arange(20))
    tokens.write_tokens(token_root / "val.bin", np.arange(20))
    DatasetConfig(name="tokens", root=str(token_root), context_length=4).check_files()  # valid without download
    for name in ("tokens", "imagefolder", "npz", "digits", "synthetic"):
        _error(["download", name], lambda: DatasetConfig(name=name, root=str(token_root), context_length=4, download=True))
    # cifar with download=true: a missing directory is accepted (the launcher fetches it) ...
    DatasetConfig(name="cifar10", root=str(tmp_path / "later"), download=True).check_files()
    # ... and prepare() leaves data that is already there alone (no network needed).
    write_cifar(tmp_path / "here", "cifar10")
    before = {p: p.read_bytes() for p in (tmp_path / "here").rglob("*") if p.is_file()}
    cfg = DatasetConfig(name="cifar10", root=str(tmp_path / "here"), download=True)
    prepare(cfg)
    assert {p: p.read_bytes() for p in (tmp_path / "here").rglob("*") if p.is_file()} == before
    assert len(build_datasets(cfg).test) == CIFAR10_SIZES["test_batch"]


DOWNLOADER = """
import json, sys, time
from pathlib import Path
from torchvision.datasets import CIFAR10
from decent_train.components.data import images
url, sums, root, go, delay = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
CIFAR10.url, CIFAR10.tgz_md5 = url, sums["archive"]  # this test's server and archive; torchvision's code otherwise
CIFAR10.train_list = [[f, sums[f]] for f, _ in CIFAR10.train_list]
CIFAR10.test_list = [[f, sums[f]] for f, _ in CIFAR10.test_list]
CIFAR10.meta = {**CIFAR10.meta, "md5": None}
while not go.exists():  # every process imported: they download at once, each started a little later
    time.sleep(0.01)
time.sleep(float(delay))
images.download_cifar(root, "cifar10")
"""


def test_launches_downloading_into_one_shared_root_at_once_leave_it_whole(tmp_path: Path) -> None:
    """Several nodes' launches with ``dataset.download=true`` and one ``dataset.root`` on a shared file system fetch
    it at the same time. Four processes here, each with torchvision's own download and extraction, from a local
    server that sends the archive (the CIFAR files of tests/datafiles.py and 8 MB of padding) in slow chunks so that
    the downloads overlap (each starts 0.3 s after the one before): every process succeeds, the dataset's folder
    holds exactly the files served, and no download's own folder is left. Into one folder, as before, a later
    download truncated the archive under an earlier one: 1 or 2 of the 4 failed ("File not found or corrupted")."""
    source = tmp_path / "source"
    write_cifar(source, "cifar10")
    with open(source / images.CIFAR_DIR["cifar10"] / "batches.meta", "wb") as meta:  # torchvision's loader reads it
        pickle.dump({"label_names": [f"class{k}" for k in range(10)]}, meta, protocol=2)
    (source / images.CIFAR_DIR["cifar10"] / "padding.bin").write_bytes(np.random.default_rng(0).bytes(8 << 20))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        archive.add(source / images.CIFAR_DIR["cifar10"], arcname=images.CIFAR_DIR["cifar10"])
    body = buffer.getvalue()
    files = sorted((source / images.CIFAR_DIR["cifar10"]).iterdir())
    sums = {f.name: hashlib.md5(f.read_bytes()).hexdigest() for f in files} | {"archive": hashlib.md5(body).hexdigest()}

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for start in range(0, len(body), 1 << 20):  # about 1 s per download
                self.wfile.write(body[start:start + (1 << 20)])
                time.sleep(0.1)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    root, go = tmp_path / "shared", tmp_path / "go"
    url = f"http://127.0.0.1:{server.server_address[1]}/cifar-10-python.tar.gz"
    try:
        procs = [subprocess.Popen([sys.executable, "-c", DOWNLOADER, url, json.dumps(sums), str(root), str(go),
                                   str(0.3 * k)], stderr=subprocess.PIPE, text=True) for k in range(4)]
        time.sleep(8)  # each imports torchvision first
        go.touch()
        errors = [proc.communicate(timeout=120)[1] for proc in procs]
    finally:
        server.shutdown()
    last_lines = "\n".join(e.replace("\r", "\n").strip().rsplit("\n", 1)[-1] for e in errors)  # past the progress
    assert [proc.returncode for proc in procs] == [0] * 4, last_lines
    assert sorted(p.name for p in root.iterdir()) == [images.CIFAR_DIR["cifar10"]]  # no download's folder left
    fetched = root / images.CIFAR_DIR["cifar10"]
    assert {f.name: hashlib.md5(f.read_bytes()).hexdigest() for f in fetched.iterdir()} == \
        {k: v for k, v in sums.items() if k != "archive"}


# --------------------------------------------------------------------------------------------------------------------
# ImageNet-style class folders
# --------------------------------------------------------------------------------------------------------------------

def _by_hand(root: Path, split: str, files: dict[str, list[str]]) -> list[tuple[torch.Tensor, int, str]]:
    """Every image of the split through the evaluation pipeline, assembled here from torchvision's transforms."""
    from torchvision import transforms as T

    tf = T.Compose([T.Resize(round(32 / 0.875)), T.CenterCrop(32), T.ToTensor(),
                    T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    out = []
    for label, cls in enumerate(sorted(files)):
        for file in files[cls]:
            with Image.open(root / split / cls / file) as image:
                out.append((tf(image.convert("RGB")), label, f"{cls}/{file}"))
    return out


def _identify(x: torch.Tensor, oracle: list[tuple[torch.Tensor, int, str]]) -> int:
    match = [i for i, (o, _, _) in enumerate(oracle) if torch.allclose(x, o, atol=1e-5)]
    assert len(match) == 1, f"the batch image matches {len(match)} images"
    return match[0]


def _folder_cfg(root: Path, **kwargs) -> DatasetConfig:
    return DatasetConfig(name="imagefolder", root=str(root), **{"image_size": 32, "augment": False, "loader_workers": 0, **kwargs})


def test_image_folder_eval_covers_val_once_over_workers(tmp_path: Path) -> None:
    write_image_folder(tmp_path)
    data = build_datasets(_folder_cfg(tmp_path))
    assert data.input_shape == (3, 32, 32) and data.num_classes == 2 and data.train_size == 6
    oracle = _by_hand(tmp_path, "val", VAL_FILES)
    seen = []
    for rank in range(2):
        for xb, yb in data.eval_batches(2, rank, 2):
            assert xb.shape[1:] == (3, 32, 32) and len(xb) <= 2 and xb.dtype == torch.float32
            for x, y in zip(xb, yb.tolist()):
                i = _identify(x, oracle)
                assert y == oracle[i][1]  # cat = 0, dog = 1
                seen.append(i)
    assert sorted(seen) == list(range(len(oracle)))  # every val image exactly once
    assert sorted(oracle[i][1] for i in seen) == [0, 0, 0, 1, 1]


def test_image_folder_training_shards_are_disjoint_and_deterministic(tmp_path: Path) -> None:
    write_image_folder(tmp_path, seed=1)
    data = build_datasets(_folder_cfg(tmp_path))
    oracle = _by_hand(tmp_path, "train", TRAIN_FILES)  # augment=False: training uses the evaluation pipeline
    per_epoch = data.micro_batches_per_epoch(1, 2)
    assert per_epoch == 3

    def epochs(rank: int, seed: int, count: int = 2) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        stream = data.train_batches(1, rank, 2, seed)
        return [[next(stream) for _ in range(per_epoch)] for _ in range(count)]

    first = {rank: epochs(rank, seed=4) for rank in range(2)}
    shards = []
    for rank in range(2):
        for epoch in first[rank]:
            ids = []
            for xb, yb in epoch:
                assert xb.shape == (1, 3, 32, 32)
                i = _identify(xb[0], oracle)
                assert int(yb[0]) == oracle[i][1]
                ids.append(i)
            assert len(set(ids)) == per_epoch  # no image twice in one epoch
            shards.append(set(ids))
    assert not shards[0] & shards[2] and not shards[1] & shards[3]  # rank 0 and rank 1, epoch 0 and epoch 1
    assert shards[0] | shards[2] == set(range(6))
    again = epochs(0, seed=4)
    for a, b in zip(sum(first[0], []), sum(again, [])):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_image_folder_with_a_loader_process(tmp_path: Path) -> None:
    write_image_folder(tmp_path, seed=2)
    inline = build_datasets(_folder_cfg(tmp_path))
    forked = build_datasets(_folder_cfg(tmp_path, loader_workers=1))
    a_stream, b_stream = inline.train_batches(2, 1, 2, seed=3), forked.train_batches(2, 1, 2, seed=3)
    a, b = next(a_stream), next(b_stream)
    a_stream.close(), b_stream.close()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    ea = [t for batch in inline.eval_batches(4, 0, 1) for t in batch]
    eb = [t for batch in forked.eval_batches(4, 0, 1) for t in batch]
    assert len(ea) == len(eb) == 4 and all(torch.equal(p, q) for p, q in zip(ea, eb))


def test_image_folder_layout_errors_name_the_path(tmp_path: Path) -> None:
    layout = images.IMAGE_FOLDER_LAYOUT
    missing = tmp_path / "nowhere"
    _error([str(missing), layout], lambda: _folder_cfg(missing).check_files())

    root = tmp_path / "noval"
    write_image_folder(root)
    for path in sorted((root / "val").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    (root / "val").rmdir()
    _error([str(root), "val/", layout], lambda: _folder_cfg(root).check_files())

    root = tmp_path / "flat"
    write_image_folder(root)
    for cls in ("cat", "dog"):  # train/ holds the images directly, no class folders
        for file in (root / "train" / cls).iterdir():
            file.rename(root / "train" / f"{cls}_{file.name}")
        (root / "train" / cls).rmdir()
    _error([str(root / "train"), "class folders", layout], lambda: _folder_cfg(root).check_files())

    root = tmp_path / "classes"
    write_image_folder(root)
    (root / "val" / "dog").rename(root / "val" / "bird")
    _error([str(root), "bird", "dog", layout], lambda: _folder_cfg(root).check_files())

    root = tmp_path / "noimages"
    write_image_folder(root)
    for file in (root / "val" / "dog").iterdir():
        file.rename(root / "val" / "dog" / (file.name + ".txt"))  # a class folder without any image
    cfg = _folder_cfg(root)
    cfg.check_files()  # the cheap check lists folders only
    _error([str(root), layout], lambda: build_datasets(cfg))


# --------------------------------------------------------------------------------------------------------------------
# uint16 token files
# --------------------------------------------------------------------------------------------------------------------

CTX = 8


def _token_cfg(root: Path, **kwargs) -> DatasetConfig:
    return DatasetConfig(name="tokens", root=str(root), **{"context_length": CTX, "vocab_size": 50000, **kwargs})


def test_write_tokens_matches_numpy_little_endian(tmp_path: Path) -> None:
    train, val = write_token_files(tmp_path / "numpy")
    (tmp_path / "mine").mkdir()
    tokens.write_tokens(tmp_path / "mine" / "train.bin", torch.from_numpy(train))  # a tensor
    tokens.write_tokens(tmp_path / "mine" / "val.bin", val.tolist())  # a list
    for split, expected in (("train.bin", train), ("val.bin", val)):
        assert (tmp_path / "mine" / split).read_bytes() == (tmp_path / "numpy" / split).read_bytes()
        np.testing.assert_array_equal(np.fromfile(tmp_path / "mine" / split, dtype="<u2"), expected)
    a, b = (build_datasets(_token_cfg(tmp_path / d)) for d in ("numpy", "mine"))
    np.testing.assert_array_equal(np.asarray(a.train_tokens), train)
    np.testing.assert_array_equal(np.asarray(b.val_tokens), val)
    tokens.write_tokens(tmp_path / "one.bin", np.array([258, 65535], dtype=">u2"))  # big-endian input
    assert (tmp_path / "one.bin").read_bytes() == b"\x02\x01\xff\xff"  # written little-endian
    for bad in ([0, 65536], [-1, 3]):
        with pytest.raises(ValueError, match="uint16"):
            tokens.write_tokens(tmp_path / "bad.bin", bad)


@pytest.mark.parametrize("world", [1, 3])
def test_token_training_windows_lie_in_the_worker_shard(tmp_path: Path, world: int) -> None:
    train, _ = write_token_files(tmp_path)
    data = build_datasets(_token_cfg(tmp_path))
    assert data.input_shape == (CTX,) and data.num_classes == 50000
    n = len(train)
    windows = np.lib.stride_tricks.sliding_window_view(train, CTX + 1)  # windows[s] = train[s : s + CTX + 1]
    firsts = []
    for rank in range(world):
        low, high = rank * n // world, (rank + 1) * n // world
        stream = data.train_batches(4, rank, world, seed=7)
        batches = [next(stream) for _ in range(30)]
        starts = []
        for xb, yb in batches:
            assert xb.shape == yb.shape == (4, CTX) and xb.dtype == yb.dtype == torch.int64
            assert torch.equal(xb[:, 1:], yb[:, :-1])  # the targets are the inputs shifted by one
            for x, y in zip(xb.numpy(), yb.numpy()):
                full = np.concatenate([x, y[-1:]])
                where = np.flatnonzero((windows == full).all(axis=1))
                assert len(where) == 1, "the window is not a contiguous piece of train.bin"
                s = int(where[0])
                assert low <= s and s + CTX + 1 <= high, f"rank {rank}: window at {s} leaves the shard [{low}, {high})"
                starts.append(s)
        assert len(set(starts)) > 20  # random windows, not one repeated
        again = data.train_batches(4, rank, world, seed=7)
        for xb, yb in batches[:5]:
            xa, ya = next(again)
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
        other_seed = next(data.train_batches(4, rank, world, seed=8))
        assert not torch.equal(other_seed[0], batches[0][0])
        firsts.append(batches[0][0])
    for a in range(world):
        for b in range(a + 1, world):
            assert not torch.equal(firsts[a], firsts[b])


def test_token_training_draws_every_start_of_a_small_shard(tmp_path: Path) -> None:
    world, n = 3, 30  # 10 tokens per worker: starts low and low + 1 (a window and its target are CTX + 1 = 9 tokens)
    train, _ = write_token_files(tmp_path, n_train=n)
    data = build_datasets(_token_cfg(tmp_path))
    for rank in range(world):
        low = rank * n // world
        xb, yb = next(data.train_batches(40, rank, world, seed=0))
        starts = set()
        for x in xb.numpy():
            s = [s for s in range(n - CTX) if np.array_equal(train[s : s + CTX], x)]
            assert len(s) == 1
            starts.add(s[0])
        assert starts == {low, low + 1}
    with pytest.raises(ValueError, match="fewer than"):
        next(data.train_batches(1, 0, 4, seed=0))  # 7 or 8 tokens per worker: not one window


@pytest.mark.parametrize("n_val", [81, 85])  # (n - 1) divisible by the context length, and not
@pytest.mark.parametrize("world", [1, 3])
def test_token_eval_windows_are_consecutive_and_each_seen_once(tmp_path: Path, world: int, n_val: int) -> None:
    _, val = write_token_files(tmp_path, n_val=n_val)
    data = build_datasets(_token_cfg(tmp_path))
    count = (n_val - 1) // CTX
    expected = [val[w * CTX : w * CTX + CTX + 1] for w in range(count)]  # window w starts at w * CTX
    got = {}
    for rank in range(world):
        rows = []
        for xb, yb in data.eval_batches(2, rank, world):
            assert len(xb) <= 2 and xb.shape[1:] == yb.shape[1:] == (CTX,)
            assert torch.equal(xb[:, 1:], yb[:, :-1])
            rows += [np.concatenate([x, y[-1:]]) for x, y in zip(xb.numpy(), yb.numpy())]
        got[rank] = rows
        for w, row in zip(range(rank, count, world), rows):  # dealt round-robin
            np.testing.assert_array_equal(row, expected[w])
        assert len(rows) == len(range(rank, count, world))
    everything = sorted(tuple(r.tolist()) for rows in got.values() for r in rows)
    assert everything == sorted(tuple(e.tolist()) for e in expected) and len(everything) == count


def test_token_micro_batches_per_epoch(tmp_path: Path) -> None:
    write_token_files(tmp_path, n_train=1000)
    data = build_datasets(_token_cfg(tmp_path))
    assert data.train_size == 999 // CTX == 124
    for world, batch in ((1, 4), (3, 4), (3, 5), (4, 31), (4, 32)):
        assert data.micro_batches_per_epoch(batch, world) == (124 // world) // batch
    assert data.micro_batches_per_epoch(32, 4) == 0 and data.micro_batches_per_epoch(31, 4) == 1


def test_token_file_errors_name_the_path(tmp_path: Path) -> None:
    layout = tokens.TOKENS_LAYOUT
    root = tmp_path / "noval"
    write_token_files(root)
    (root / "val.bin").unlink()
    _error([str(root), "val.bin", layout], lambda: _token_cfg(root).check_files())

    root = tmp_path / "odd"
    write_token_files(root)
    with open(root / "train.bin", "ab") as stream:
        stream.write(b"\x01")
    _error([str(root / "train.bin"), "2001 bytes", layout], lambda: _token_cfg(root).check_files())

    root = tmp_path / "short"
    write_token_files(root, n_val=CTX)
    _error([str(root / "val.bin"), str(CTX + 1)], lambda: _token_cfg(root).check_files())
    write_token_files(root, n_val=CTX + 1)  # exactly one window: fine
    assert sum(len(x) for x, _ in build_datasets(_token_cfg(root)).eval_batches(4, 0, 1)) == 1

    missing = tmp_path / "nowhere"
    _error([str(missing)], lambda: _token_cfg(missing).check_files())


@pytest.mark.parametrize("split", ["train.bin", "val.bin"])
def test_token_ids_must_be_below_the_vocabulary(tmp_path: Path, split: str) -> None:
    write_token_files(tmp_path, vocab=100)
    path = tmp_path / split
    ids = np.fromfile(path, dtype="<u2")
    ids[len(ids) // 2] = 99
    ids.astype("<u2").tofile(path)
    build_datasets(_token_cfg(tmp_path, vocab_size=100))  # the largest id below the vocabulary is fine
    ids[len(ids) // 2] = 100
    ids.astype("<u2").tofile(path)
    cfg = _token_cfg(tmp_path, vocab_size=100)
    # rejected by the launcher's preflight, before any worker (it was left to the workers: a traceback), and on load
    _error([str(path), "token id 100", "dataset.vocab_size=100", "dataset.vocab_size=101 or more"], cfg.check_files)
    _error([str(path), "100", "vocab_size"], lambda: build_datasets(cfg))


# --------------------------------------------------------------------------------------------------------------------
# Every built-in dataset counts its evaluation batches (a sharded evaluation agrees on the most with one all-reduce)
# --------------------------------------------------------------------------------------------------------------------

EVAL_SPLITS = [(1, 1), (2, 1), (3, 2), (4, 3), (5, 2), (7, 4), (16, 3), (2, 8)]  # (batch_size, world)


def _counted_datasets(root: Path, name: str) -> Datasets:
    """Small instances of each built-in kind: 7 test samples in memory, 10 token windows, 5 val images."""
    if name == "arrays":
        g = torch.Generator().manual_seed(0)
        return arrays.tensor_data(torch.randn(9, 3, generator=g), torch.arange(9) % 2, torch.randn(7, 3, generator=g),
                                  torch.arange(7) % 2)
    if name == "tokens":
        write_token_files(root, n_val=85)  # (85 - 1) // CTX = 10 windows
        return build_datasets(_token_cfg(root))
    write_image_folder(root)
    return build_datasets(_folder_cfg(root))


@pytest.mark.parametrize("name", ["arrays", "tokens", "imagefolder"])
def test_eval_batch_count_is_the_number_of_eval_batches(tmp_path: Path, name: str) -> None:
    """Uneven slices (7, 10 or 5 samples over 2, 3, 4 or 8 workers: some with none) and batch sizes that do not
    divide them (a last, partial batch) included."""
    data = _counted_datasets(tmp_path, name)
    for batch_size, world in EVAL_SPLITS:
        for rank in range(world):
            count = data.eval_batch_count(batch_size, rank, world)
            assert count == len(list(data.eval_batches(batch_size, rank, world))), (batch_size, rank, world)
            on_device = data.device_eval_batches(batch_size, rank, world, device="cpu")  # what the evaluation reads
            assert count == len(list(on_device)), (batch_size, rank, world)
    assert [data.eval_batch_count(2, r, 3) for r in range(3)] == {"arrays": [2, 1, 1], "tokens": [2, 2, 2],
                                                                  "imagefolder": [1, 1, 1]}[name]


def test_digits_are_scikit_learns_without_importing_it() -> None:
    """The digits read from scikit-learn's file equal what its ``load_digits`` returns, and a fresh process that loads
    them has not imported scikit-learn (its import slowed every worker's start: scripts/BENCHMARKS.md)."""
    from sklearn.datasets import load_digits

    from decent_train.components.data.arrays import _load_digits

    x, y = _load_digits()
    bunch = load_digits()
    assert torch.equal(x, torch.from_numpy(bunch.images).float().div_(16.0).unsqueeze(1))
    assert torch.equal(y, torch.from_numpy(bunch.target).long())
    code = ("import sys; from decent_train.components.data.arrays import _load_digits; x, y = _load_digits(); "
            "print(len(y), 'sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1797", "False"], out
