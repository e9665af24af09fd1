"""ImageFolderData's training decode processes live for the whole stream, not one epoch (audit S10), while its batches
keep DistributedSampler's order and its augmentation stays a function of the seed.

Observed from outside the loader: the processes through /proc (this process's children), the samples through the
colours the test painted into the files, the order through a DistributedSampler the test builds itself."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DistributedSampler

from decent_train.components.data import DatasetConfig, Datasets, build_datasets, images

PER_CLASS = 7  # 14 images: over 2 workers, 7 each; batches of 2 give 3 per epoch and drop one image
WORLD, RANK, BATCH, SEED = 2, 1, 2, 5
PER_EPOCH = (2 * PER_CLASS // WORLD) // BATCH


def _write_folder(root: Path, textured: bool) -> None:
    """ROOT/{train,val}/{a,b}/NN.png. ImageFolder numbers samples by sorted class, then sorted file name, so image
    ``i`` (class a: 0..6, class b: 7..13) is sample ``i``; untextured, it is painted red = 10 + 12 i all over."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c, cls in enumerate("ab"):
            (root / split / cls).mkdir(parents=True)
            for k in range(PER_CLASS):
                i = c * PER_CLASS + k
                if textured:
                    pixels = rng.integers(0, 256, size=(12, 12, 3), dtype=np.uint8)
                else:
                    pixels = np.zeros((12, 12, 3), dtype=np.uint8)
                    pixels[..., 0] = 10 + 12 * i
                Image.fromarray(pixels).save(root / split / cls / f"{k:02d}.png")


def _data(root: Path, loader_workers: int, augment: bool = False) -> Datasets:
    return build_datasets(DatasetConfig(name="imagefolder", root=str(root), image_size=8, augment=augment,
                                        loader_workers=loader_workers))


def _image_ids(x: torch.Tensor) -> list[int]:
    """Which painted image each of a batch is: its red plane un-normalized back to 0..255."""
    mean, std = images.IMAGENET_MEAN_STD
    red = (x[:, 0].mean(dim=(1, 2)) * std[0] + mean[0]) * 255
    return [round((float(v) - 10) / 12) for v in red]


def _oracle(epoch: int) -> list[list[int]]:
    """This worker's batches of ``epoch``: torch's DistributedSampler over the sample numbers, in whole batches."""
    sampler = DistributedSampler(range(2 * PER_CLASS), WORLD, RANK, shuffle=True, seed=SEED, drop_last=True)
    sampler.set_epoch(epoch)
    order = list(sampler)
    return [order[i : i + BATCH] for i in range(0, len(order) - BATCH + 1, BATCH)]


def _children() -> set[tuple[int, str]]:
    """This process's live children as (pid, start time), so that a reused pid would count as a new process."""
    found = set()
    for listing in Path("/proc/self/task").glob("*/children"):
        for pid in listing.read_text().split():
            try:
                after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except FileNotFoundError:  # exited since the listing
                continue
            if after_name[0] != "Z":  # state; field 22, the start time, is the 20th after the name
                found.add((int(pid), after_name[19]))
    return found


def test_decode_processes_live_across_epochs_and_batches_keep_the_sampler_order(tmp_path: Path) -> None:
    _write_folder(tmp_path, textured=False)
    data = _data(tmp_path, loader_workers=2)
    assert data.micro_batches_per_epoch(BATCH, WORLD) == PER_EPOCH == 3
    before = _children()
    stream = data.train_batches(BATCH, RANK, WORLD, SEED)
    processes = []
    for epoch in range(3):
        ids = [_image_ids(x) for x, _ in (next(stream) for _ in range(PER_EPOCH))]
        assert ids == _oracle(epoch), epoch
        processes.append(_children() - before)
    assert len(processes[0]) == 2, processes  # loader_workers decode processes...
    assert processes[1] == processes[0] and processes[2] == processes[0], processes  # ...the same ones all along
    stream.close()
    assert not _children() - before  # closing the stream ends them

    resumed = data.train_batches(BATCH, RANK, WORLD, SEED, start=PER_EPOCH + 1)  # in the middle of epoch 1
    ids = [_image_ids(x) for x, _ in (next(resumed) for _ in range(2 * PER_EPOCH - 1))]
    assert ids == _oracle(1)[1:] + _oracle(2)
    resumed.close()


def test_augmentation_is_a_function_of_the_seed_and_position(tmp_path: Path) -> None:
    """The random crops of an uninterrupted stream come back for the same seed, with another number of decode
    processes (none included), and for a stream resumed in the middle of an epoch; another seed changes them.
    Reading batches in this process leaves its global random stream (the model's dropout, say) where it was."""
    _write_folder(tmp_path, textured=True)

    def batches(loader_workers: int, seed: int = SEED, start: int = 0) -> list[torch.Tensor]:
        stream = _data(tmp_path, loader_workers, augment=True).train_batches(BATCH, RANK, WORLD, seed, start)
        out = [next(stream)[0] for _ in range(3 * PER_EPOCH - start)]
        stream.close()
        return out

    uninterrupted = batches(loader_workers=2)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, batches(loader_workers=2), strict=True))
    state = torch.get_rng_state()
    inline = batches(loader_workers=0)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, inline, strict=True))
    resumed = batches(loader_workers=1, start=PER_EPOCH + 1)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted[PER_EPOCH + 1 :], resumed, strict=True))
    other = batches(loader_workers=0, seed=SEED + 1)
    assert not any(torch.equal(a, b) for a, b in zip(uninterrupted, other))


@pytest.mark.parametrize("seed", [0, 12345, 2**31 - 1])
def test_large_seeds_give_batches(tmp_path: Path, seed: int) -> None:
    """Seeds as users pick them (a 32-bit int): the per-epoch generator must not overflow 64 bits."""
    _write_folder(tmp_path, textured=True)
    x, y = next(_data(tmp_path, loader_workers=0, augment=True).train_batches(BATCH, RANK, WORLD, seed, start=4))
    assert x.shape == (BATCH, 3, 8, 8) and y.shape == (BATCH,)


def test_evaluation_keeps_its_decode_processes_until_the_membership_changes(tmp_path: Path) -> None:
    """The same processes serve every evaluation of one (batch size, rank, world); another world ends them and
    starts its own. Each pass covers the worker's slice of the evaluation set, as when decoded in this process, also
    when two passes are read side by side (a persistent loader has one iterator: the second gets one of its own)."""
    _write_folder(tmp_path, textured=False)
    data, inline = _data(tmp_path, loader_workers=2), _data(tmp_path, loader_workers=0)
    expected = [list(range(2 * PER_CLASS))[r::WORLD] for r in range(WORLD)]  # rank r: samples r, r + WORLD, ...

    def ids(batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
        return [i for x, _ in batches for i in _image_ids(x)]

    before = _children()
    processes = []
    for _ in range(3):
        assert ids(data.eval_batches(4, RANK, WORLD)) == expected[RANK]
        processes.append(_children() - before)
    assert len(processes[0]) == 2 and processes[1] == processes[0] and processes[2] == processes[0], processes
    assert ids(inline.eval_batches(4, RANK, WORLD)) == expected[RANK]

    a, b = data.eval_batches(4, RANK, WORLD), data.eval_batches(4, RANK, WORLD)
    side_by_side = list(zip(a, b, strict=True))
    assert ids(x for x, _ in side_by_side) == ids(y for _, y in side_by_side) == expected[RANK]

    assert ids(data.eval_batches(4, 0, 1)) == list(range(2 * PER_CLASS))  # a membership change: world 2 -> 1
    after = _children() - before
    assert len(after) == 2 and not after & processes[0], (after, processes[0])
    del data
    assert not _children() - before  # dropping the datasets ends its kept processes, without waiting for gc
