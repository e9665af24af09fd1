"""Batches on the worker's device: copied from pinned memory without blocking, in-memory images copied as stored
(uint8) and normalized, cropped and flipped where they land, equal to what the CPU path gave before the device path
existed (a resumed run depends on it).

Without a GPU, ``fake_cuda`` stands in for CUDA where the batch path meets it: ``Tensor.pin_memory`` and
``Tensor.is_pinned`` keep a record of pinned copies, ``Tensor.to(cuda)`` records each copy and returns a CPU copy. The
transform then runs on that copy: the code that runs on the GPU, on the CPU. ``test_gpu_batches`` checks the same on
a real GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import BatchSampler, DistributedSampler, TensorDataset

from decent_train.components.data import images
from decent_train.components.data import (
    Batch,
    DatasetConfig,
    Datasets,
    TensorData,
    batch_generator,
    batch_to_device,
    build_datasets,
    host_to_device,
)
from decent_train.components.models import ModelConfig, build_model

from .datafiles import write_cifar, write_image_folder, write_token_files

CUDA = torch.device("cuda")

# --------------------------------------------------------------------------------------------------------------------
# The reference: the CPU path as it was before batches were transformed on the device (kept here, verbatim)
# --------------------------------------------------------------------------------------------------------------------


def reference_random_crop_flip(x: Tensor, padding: int, generator: torch.Generator) -> Tensor:
    n, c, h, w = x.shape
    padded = F.pad(x, (padding,) * 4)
    dy = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    dx = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    flip = torch.rand(n, generator=generator) < 0.5
    rows = dy[:, None] + torch.arange(h)  # (n, h)
    cols = dx[:, None] + torch.arange(w)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    return padded[
        torch.arange(n)[:, None, None, None], torch.arange(c)[None, :, None, None], rows[:, None, :, None], cols[:, None, None, :]
    ]


def reference_cifar_transform(name: str, augment: bool):  # -> BatchTransform
    mean, std = images.CIFAR_MEAN_STD[name]
    mean_t, std_t = torch.tensor(mean).view(1, -1, 1, 1), torch.tensor(std).view(1, -1, 1, 1)

    def transform(x: Tensor, generator: Optional[torch.Generator]) -> Tensor:
        x = x.float().div_(255.0)
        if augment and generator is not None:
            x = reference_random_crop_flip(x, 4, generator)
        return (x - mean_t) / std_t

    return transform


def reference_train_batches(data: TensorData, batch_size: int, rank: int, world: int, seed: int, start: int = 0) -> Iterator[Batch]:
    transform = reference_cifar_transform("cifar10", augment=True)
    sampler = DistributedSampler(data.train, world, rank, shuffle=True, seed=seed, drop_last=True)
    batches = BatchSampler(sampler, batch_size, drop_last=True)
    epoch, skip = divmod(start, len(batches))
    while True:
        sampler.set_epoch(epoch)
        for index, indices in enumerate(batches):
            if index < skip:
                continue
            x, y = data.train[indices]
            yield transform(x, batch_generator(seed, rank, epoch, index)), y
        epoch, skip = epoch + 1, 0


def reference_eval_batches(data: TensorData, batch_size: int, rank: int, world: int) -> Iterator[Batch]:
    transform = reference_cifar_transform("cifar10", augment=True)
    x, y = (t[rank::world] for t in data.test.tensors)
    for start in range(0, len(y), batch_size):
        yield transform(x[start : start + batch_size], None), y[start : start + batch_size]


def cifar_like(n_train: int = 96, n_test: int = 21) -> TensorData:
    """CIFAR-10 as ``images.cifar`` builds it, from random uint8 images (more than the tiny files hold)."""
    gen = torch.Generator().manual_seed(0)

    def split(n: int) -> TensorDataset:
        return TensorDataset(torch.randint(0, 256, (n, 3, 32, 32), generator=gen, dtype=torch.uint8), torch.randint(0, 10, (n,), generator=gen))

    mean, std = images.CIFAR_MEAN_STD["cifar10"]
    return TensorData(split(n_train), split(n_test), 10, images.cifar_transform(mean, std, augment=True))


# --------------------------------------------------------------------------------------------------------------------
# CUDA, as far as the batch path can tell
# --------------------------------------------------------------------------------------------------------------------


class FakeCuda:
    def __init__(self) -> None:
        self.pinned: list[Tensor] = []  # every pinned copy (kept alive: identity is what marks them)
        self.copies: list[tuple[Tensor, bool, Tensor]] = []  # (source, non_blocking, the "device" tensor)

    def is_pinned(self, t: Tensor) -> bool:
        return any(t is p for p in self.pinned)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    real_to = torch.Tensor.to

    def pin_memory(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        assert self.device.type == "cpu"
        out = self.clone(memory_format=torch.contiguous_format)
        fake.pinned.append(out)
        return out

    def is_pinned(self: Tensor, *args: Any, **kwargs: Any) -> bool:
        return fake.is_pinned(self)

    def to(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cuda":
            assert not args[1:] and set(kwargs) <= {"device", "non_blocking"}, (args, kwargs)
            out = self.clone()
            fake.copies.append((self, bool(kwargs.get("non_blocking", False)), out))
            return out
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
    monkeypatch.setattr(torch.Tensor, "to", to)
    return fake


def _check_copies(fake: FakeCuda, batches: list[Batch]) -> None:
    """Each batch arrived as two copies, x then y, each from a pinned copy of the stored samples, non-blocking."""
    assert len(fake.copies) == 2 * len(batches)
    for source, non_blocking, _ in fake.copies:
        assert fake.is_pinned(source), "a batch was copied to CUDA from pageable memory"
        assert non_blocking, "a batch was copied to CUDA with non_blocking=False"
    for (x, y), (_, _, x_dev), (_, _, y_dev) in zip(batches, fake.copies[::2], fake.copies[1::2]):
        assert y is y_dev and len(x) == len(x_dev)


# --------------------------------------------------------------------------------------------------------------------
# Pinned, non-blocking copies
# --------------------------------------------------------------------------------------------------------------------


def test_host_to_device_pins_once_and_copies_without_blocking(fake_cuda: FakeCuda) -> None:
    x = torch.arange(12.0).view(3, 4)
    out = host_to_device(x, CUDA)
    assert len(fake_cuda.pinned) == 1 and torch.equal(fake_cuda.pinned[0], x)
    assert fake_cuda.copies == [(fake_cuda.pinned[0], True, out)]
    # Already pinned (a DataLoader with pin_memory=True): copied as it is, not pinned again.
    host_to_device(fake_cuda.pinned[0], "cuda:0")
    assert len(fake_cuda.pinned) == 1 and fake_cuda.copies[1][0] is fake_cuda.pinned[0]
    # A strided view (an evaluation slice of one worker among several): pinned as its own samples, contiguous.
    view = torch.arange(20.0).view(10, 2)[1::3]
    host_to_device(view, CUDA)
    assert fake_cuda.pinned[1].is_contiguous() and torch.equal(fake_cuda.pinned[1], view)
    # To the CPU: nothing pinned, nothing copied.
    assert host_to_device(x, "cpu") is x and len(fake_cuda.pinned) == 2 and len(fake_cuda.copies) == 3


@pytest.mark.parametrize("world", [1, 2])
def test_cifar_cuda_batches_copy_the_stored_uint8_from_pinned_memory(fake_cuda: FakeCuda, world: int) -> None:
    data = cifar_like()
    rank = world - 1
    train = data.device_train_batches(8, rank, world, seed=3, device=CUDA)
    batches = [next(train) for _ in range(7)]  # past an epoch's end for world=2 (48 samples: 6 batches)
    _check_copies(fake_cuda, batches)
    order = list(BatchSampler(DistributedSampler(data.train, world, rank, shuffle=True, seed=3, drop_last=True), 8, True))
    for (source, _, _), indices in zip(fake_cuda.copies[::2], order):
        # The stored images themselves: uint8, a quarter of float32's bytes; the floats are made on the device.
        assert source.dtype == torch.uint8 and source.nbytes == 8 * 3 * 32 * 32
        assert torch.equal(source, data.train.tensors[0][indices])
    fake_cuda.copies.clear()
    evals = list(data.device_eval_batches(4, rank, world, device=CUDA))
    _check_copies(fake_cuda, evals)
    assert all(source.dtype == torch.uint8 for source, _, _ in fake_cuda.copies[::2])


def test_cifar_transform_runs_on_the_copied_batch(fake_cuda: FakeCuda) -> None:
    data = cifar_like()
    assert data.transform is not None
    transform, seen = data.transform, []

    def recording(x: Tensor, generator: Optional[torch.Generator]) -> Tensor:
        seen.append((x, generator))
        return transform(x, generator)

    data.transform = recording
    stream = data.device_train_batches(8, 0, 1, seed=0, device=CUDA)
    for _ in range(3):
        next(stream)
    assert len(seen) == 3
    for (x, generator), (_, _, x_dev) in zip(seen, fake_cuda.copies[::2]):
        assert x is x_dev and x.dtype == torch.uint8 and generator is not None  # after the copy, augmenting
    seen.clear()
    next(data.device_eval_batches(5, 0, 1, device=CUDA))
    assert seen[0][0] is fake_cuda.copies[-2][2] and seen[0][1] is None  # evaluation: normalized, not augmented


def test_other_datasets_reach_cuda_pinned_through_the_same_call(fake_cuda: FakeCuda, tmp_path: Path) -> None:
    write_token_files(tmp_path / "tokens", n_train=400, n_val=90)
    write_image_folder(tmp_path / "folders")
    for cfg in (
        DatasetConfig(name="digits"),
        DatasetConfig(name="synthetic", num_samples=64),
        DatasetConfig(name="tokens", root=str(tmp_path / "tokens"), context_length=8),
        DatasetConfig(name="imagefolder", root=str(tmp_path / "folders"), image_size=16, loader_workers=0),
    ):
        data = build_datasets(cfg)
        fake_cuda.copies.clear()
        train = data.device_train_batches(2, 0, 1, seed=1, device=CUDA, channels_last=True)
        batches = [next(train) for _ in range(3)] + list(data.device_eval_batches(4, 0, 1, device=CUDA, channels_last=True))
        _check_copies(fake_cuda, batches)
        host = [next(data.train_batches(2, 0, 1, seed=1))] + list(data.eval_batches(4, 0, 1))
        for (x, y), (hx, hy) in zip(batches[:1] + batches[3:], host, strict=True):
            assert torch.equal(x, hx) and torch.equal(y, hy), cfg.name  # image folders: crops seeded per image
        for x, _ in batches:
            assert x.dim() != 4 or x.is_contiguous(memory_format=torch.channels_last), cfg.name


# --------------------------------------------------------------------------------------------------------------------
# The same batches as before
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("world", [1, 3])
def test_device_batches_equal_the_cpu_reference(fake_cuda: FakeCuda, device: str, world: int) -> None:
    """Bit for bit: the random numbers come from the batch's CPU generator, in the same order, whatever the device."""
    data = cifar_like()
    rank = world - 1
    per_epoch = data.micro_batches_per_epoch(5, world)
    count = 2 * per_epoch + 1  # into the third epoch
    got = data.device_train_batches(5, rank, world, seed=4, device=device)
    host = data.train_batches(5, rank, world, seed=4)
    ref = reference_train_batches(data, 5, rank, world, seed=4)
    for _ in range(count):
        (x, y), (hx, hy), (rx, ry) = next(got), next(host), next(ref)
        assert x.dtype == torch.float32 and torch.equal(x, rx) and torch.equal(y, ry)
        assert torch.equal(hx, rx) and torch.equal(hy, ry)
    # A resumed stream gives the same batches from there on.
    resumed = data.device_train_batches(5, rank, world, seed=4, start=per_epoch + 1, device=device)
    ref = reference_train_batches(data, 5, rank, world, seed=4, start=per_epoch + 1)
    for _ in range(per_epoch):
        (x, _), (rx, _) = next(resumed), next(ref)
        assert torch.equal(x, rx)
    evals = list(data.device_eval_batches(4, rank, world, device=device, channels_last=True))
    refs = list(reference_eval_batches(data, 4, rank, world))
    assert len(evals) == len(refs)
    for (x, y), (rx, ry) in zip(evals, refs):
        assert torch.equal(x, rx) and torch.equal(y, ry) and x.is_contiguous(memory_format=torch.channels_last)


def test_crop_flip_draws_are_the_reference_draws() -> None:
    x = torch.randn(40, 3, 6, 5)
    assert torch.equal(images.random_crop_flip(x, 2, torch.Generator().manual_seed(9)), reference_random_crop_flip(x, 2, torch.Generator().manual_seed(9)))
    draws = images.crop_flip_draws(40, 2, torch.Generator().manual_seed(9))
    assert draws.shape == (3, 40) and draws.dtype == torch.int64 and draws.device.type == "cpu"
    # uint8 crops are the float crops: the device crops the stored bytes before making floats of them.
    u = torch.randint(0, 256, (40, 3, 6, 5), dtype=torch.uint8)
    assert torch.equal(images.crop_flip(u, 2, draws).float(), images.crop_flip(u.float(), 2, draws))


@pytest.mark.parametrize("augment", [False, True])
def test_tiny_cifar_files_train_through_the_device_path(tmp_path: Path, augment: bool) -> None:
    """Real-format files, the worker's calls (on the CPU): the model learns its 12 (random) training images."""
    write_cifar(tmp_path, "cifar10", seed=5)
    data = build_datasets(DatasetConfig(name="cifar10", root=str(tmp_path), augment=augment))
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="mlp", hidden_sizes=[64]), data.input_shape, data.num_classes)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def train_loss() -> float:  # on the training images, unaugmented
        with torch.no_grad():
            x, y = data.train.tensors
            return F.cross_entropy(model(batch_to_device((x, y), "cpu", True, data.transform)[0]), y).item()

    before = train_loss()
    stream = data.device_train_batches(4, 0, 1, seed=0, device="cpu", channels_last=True)
    for _ in range(60):
        x, y = next(stream)
        assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and x.is_contiguous(memory_format=torch.channels_last)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert train_loss() < (0.9 if augment else 0.5) * before  # shifted noise is harder to learn than noise
    evals = list(data.device_eval_batches(2, 0, 1, device="cpu", channels_last=True))
    assert sum(len(y) for _, y in evals) == 3
    assert all(torch.isfinite(F.cross_entropy(model(x), y)) for x, y in evals)


# --------------------------------------------------------------------------------------------------------------------
# On a real GPU
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU, from pinned memory, equal to the CPU reference up to the rounding of normalizing there."""
    copies: list[tuple[bool, bool, torch.dtype, tuple[int, ...]]] = []  # (pinned, non_blocking, dtype, shape) to CUDA
    real_to = torch.Tensor.to

    def to(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cuda" and self.device.type == "cpu":
            copies.append((self.is_pinned(), bool(kwargs.get("non_blocking", False)), self.dtype, tuple(self.shape)))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    data = cifar_like()
    device = torch.device("cuda", torch.cuda.current_device())
    got = data.device_train_batches(8, 0, 1, seed=2, device=device, channels_last=True)
    ref = reference_train_batches(data, 8, 0, 1, seed=2)
    count = 2 * data.micro_batches_per_epoch(8, 1) + 1  # into the third epoch
    for _ in range(count):
        (x, y), (rx, ry) = next(got), next(ref)
        assert x.device == device and y.device == device and x.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(x.cpu(), rx, rtol=0, atol=1e-5)  # crops and flips: exact; only rounding differs
        assert torch.equal(y.cpu(), ry)
    evals = list(data.device_eval_batches(5, 0, 1, device=device))
    assert len(evals) == 5
    for (x, y), (rx, ry) in zip(evals, reference_eval_batches(data, 5, 0, 1)):
        assert x.device == device
        torch.testing.assert_close(x.cpu(), rx, rtol=0, atol=1e-5)
        assert torch.equal(y.cpu(), ry)
    assert copies and all(pinned and non_blocking for pinned, non_blocking, _, _ in copies), copies
    image_copies = [dtype for _, _, dtype, shape in copies if shape[1:] == (3, 32, 32)]
    assert len(image_copies) == count + len(evals) and set(image_copies) == {torch.uint8}  # the stored bytes, not floats
