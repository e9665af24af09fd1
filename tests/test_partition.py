"""``dataset.partition``: fixed non-iid shards (shards, dirichlet, classes) and the iid stream.

Oracles: computations by hand on the digits labels (set algebra for disjointness and cover, bincounts for the label
histograms, the Dirichlet cut sizes floor(cumulative share x class count) from ``Partition.proportions``, a replay of
the module's numpy draws for the redraw rule), an explicit DistributedSampler + BatchSampler for ``iid``, an
uninterrupted stream / run for resumes, and the documented one-line errors for bad input.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from itertools import accumulate, islice
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from loguru import logger
from torch import Tensor
from torch.utils.data import BatchSampler, DistributedSampler, TensorDataset

from decent_train.components.data import DatasetConfig, TensorData, build_datasets
from decent_train.components.data.partition import MAX_DRAWS, Partition, Sharding, label_histograms, split
from decent_train.config import TrainConfig, check_config
from decent_train.launcher.preflight import preflight
from decent_train.training import train

from .datafiles import write_image_folder, write_token_files
from .distributed import run_workers
from .test_checkpoint import CHECKPOINTED, _crash_after, _measured, _same_params
from .jobs import WORLD, decent_train, make_cfg, records

CLASSES = 10  # digits


@pytest.fixture(scope="module")
def digits() -> TensorData:
    data = build_datasets(DatasetConfig(name="digits"))
    assert isinstance(data, TensorData)
    return data


@pytest.fixture(scope="module")
def labels(digits: TensorData) -> Tensor:
    return digits.train.tensors[1]


def _hand_histograms(labels: Tensor, shards: list[Tensor]) -> list[list[int]]:
    """Per worker, per class: counted with a Counter, not with torch.bincount."""
    out = []
    for shard in shards:
        counts = Counter(labels[shard].tolist())
        out.append([counts.get(c, 0) for c in range(CLASSES)])
    return out


def _check_disjoint_cover(shards: list[Tensor], n: int, world: int) -> None:
    assert len(shards) == world
    indices = [i for s in shards for i in s.tolist()]
    assert len(indices) == len(set(indices)) == n  # disjoint, and together every sample
    assert set(indices) == set(range(n))


def _same_split(a: Partition, b: Partition) -> bool:
    return len(a.shards) == len(b.shards) and all(torch.equal(x, y) for x, y in zip(a.shards, b.shards))


# -- the split, by hand ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3, 7])
def test_shards_are_an_even_disjoint_cover(labels: Tensor, world: int) -> None:
    """Oracle: set algebra, and sizes floor/ceil of n / world (np.array_split's rule)."""
    part = split(labels, world, "shards", seed=3)
    _check_disjoint_cover(part.shards, len(labels), world)
    sizes = [len(s) for s in part.shards]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(labels)
    assert part.proportions is None


@pytest.mark.parametrize(("world", "alpha", "seed"), [(2, 0.5, 0), (4, 0.5, 1), (4, 0.1, 2), (8, 1.0, 0), (3, 100.0, 5)])
def test_dirichlet_histograms_follow_the_drawn_proportions(labels: Tensor, world: int, alpha: float, seed: int) -> None:
    """Oracle: class c's piece for worker r has floor(P[c, :r+1].sum() * n_c) - floor(P[c, :r].sum() * n_c) samples
    (the last worker takes the rest), P = ``Partition.proportions``; histograms counted here."""
    part = split(labels, world, "dirichlet", seed=seed, alpha=alpha)
    _check_disjoint_cover(part.shards, len(labels), world)
    p = part.proportions
    assert p is not None and p.shape == (CLASSES, world) and part.draws == 1
    assert np.all(p >= 0) and np.allclose(p.sum(axis=1), 1.0)
    histograms = _hand_histograms(labels, part.shards)
    class_counts = Counter(labels.tolist())
    for c in range(CLASSES):
        n_c = class_counts[c]
        cuts = [0] + [math.floor(share * n_c) for share in list(accumulate(p[c].tolist()))[:-1]] + [n_c]
        expected = [cuts[r + 1] - cuts[r] for r in range(world)]
        assert [histograms[r][c] for r in range(world)] == expected, f"class {c}"
    assert label_histograms(labels, part.shards, CLASSES) == histograms


@pytest.mark.parametrize(("world", "per_worker"), [(2, 5), (4, 3), (3, 4), (5, 2), (4, 10), (10, 1)])
def test_classes_each_worker_holds_its_labels_split_evenly(labels: Tensor, world: int, per_worker: int) -> None:
    """Oracle: each worker holds exactly ``per_worker`` labels; every class is held by floor or ceil of
    world x per_worker / classes workers (round-robin), which get sizes differing by at most 1; the held labels are
    consecutive windows of the class order replayed here with numpy (10 permutations first, then the order)."""
    seed = 4
    part = split(labels, world, "classes", seed=seed, classes_per_worker=per_worker)
    _check_disjoint_cover(part.shards, len(labels), world)
    histograms = _hand_histograms(labels, part.shards)
    held = [{c for c in range(CLASSES) if h[c] > 0} for h in histograms]
    assert all(len(h) == per_worker for h in held)
    assert set().union(*held) == set(range(CLASSES))
    class_counts = Counter(labels.tolist())
    holders = {c: [h[c] for h in histograms if h[c] > 0] for c in range(CLASSES)}
    slots = world * per_worker
    assert Counter(len(v) for v in holders.values()) == Counter(
        [slots // CLASSES + 1] * (slots % CLASSES) + [slots // CLASSES] * (CLASSES - slots % CLASSES)
    )
    for c, sizes in holders.items():
        assert sum(sizes) == class_counts[c] and max(sizes) - min(sizes) <= 1, f"class {c}: {sizes}"
    rng = np.random.default_rng(seed)
    y = labels.numpy()
    for c in range(CLASSES):
        rng.permutation(np.flatnonzero(y == c))
    order = rng.permutation(CLASSES).tolist()
    assert held == [{order[(r * per_worker + j) % CLASSES] for j in range(per_worker)} for r in range(world)]


@pytest.mark.parametrize(("world", "per_worker", "valid"), [(4, 1, "3..10"), (4, 11, "3..10"), (3, 0, "4..10"), (1, 9, "10..10")])
def test_classes_split_refuses_a_class_no_worker_holds(labels: Tensor, world: int, per_worker: int, valid: str) -> None:
    """Oracle: valid is ceil(classes / world)..classes (what the config check says too), on one line."""
    with pytest.raises(ValueError) as error:
        split(labels, world, "classes", seed=0, classes_per_worker=per_worker)
    message = str(error.value)
    assert f"dataset.classes_per_worker={per_worker} with {world} workers and 10 classes: valid is {valid}" in message
    assert "\n" not in message


@pytest.mark.parametrize(("partition", "kwargs"), [("shards", {}), ("dirichlet", {"alpha": 0.5}), ("classes", {"classes_per_worker": 3})])
def test_split_is_a_function_of_the_seed(labels: Tensor, partition: str, kwargs: dict) -> None:
    """Oracle: two calls with one seed are equal element for element; split_seed 1 gives other shards than 0."""
    first = split(labels, 4, partition, seed=0, **kwargs)
    assert _same_split(first, split(labels, 4, partition, seed=0, **kwargs))
    assert not _same_split(first, split(labels, 4, partition, seed=1, **kwargs))
    # and through the datasets' own path: two fresh builds
    cfg = DatasetConfig(name="digits", partition=partition, **kwargs)
    a, b = build_datasets(cfg), build_datasets(cfg)
    assert isinstance(a, TensorData) and isinstance(b, TensorData)
    pa, pb = a.partition(4, 16), b.partition(4, 16)
    assert pa is not None and pb is not None and _same_split(pa, pb) and _same_split(pa, first)


def _own_stream(rank: int, world: int, cfg: DatasetConfig, batches: int) -> list[tuple[Tensor, Tensor]]:
    return list(islice(build_datasets(cfg).train_batches(16, rank, world, seed=11), batches))


def test_worker_processes_agree_on_the_split() -> None:
    """Oracle: each forked worker's own stream (built in that process) equals that rank's stream built here."""
    cfg = DatasetConfig(name="digits", partition="dirichlet", alpha=0.3, split_seed=5)
    there = run_workers(_own_stream, 3, cfg, 40)
    here = build_datasets(cfg)
    for rank, stream in enumerate(there):
        expected = list(islice(here.train_batches(16, rank, 3, seed=11), 40))
        assert len(stream) == 40
        for (x, y), (ex, ey) in zip(stream, expected):
            assert torch.equal(x, ex) and torch.equal(y, ey)


def _replayed_dirichlet_draws(labels: Tensor, world: int, seed: int, alpha: float) -> list[tuple[np.ndarray, list[np.ndarray]]]:
    """All ``MAX_DRAWS`` (proportions, shards) the module's generator yields, replayed with numpy in its call order:
    one permutation of each class's indices, then one Dirichlet draw per attempt."""
    rng = np.random.default_rng(seed)
    y = labels.numpy()
    by_class = [rng.permutation(np.flatnonzero(y == c)) for c in range(CLASSES)]
    draws = []
    for _ in range(MAX_DRAWS):
        p = rng.dirichlet([alpha] * world, size=CLASSES)
        shards: list[list[int]] = [[] for _ in range(world)]
        for c, indices in enumerate(by_class):
            bounds = [0] + [math.floor(s * len(indices)) for s in list(accumulate(p[c].tolist()))[:-1]] + [len(indices)]
            for r in range(world):
                shards[r].extend(indices[bounds[r] : bounds[r + 1]].tolist())
        draws.append((p, [np.sort(np.array(s, dtype=np.int64)) for s in shards]))
    return draws


def test_dirichlet_redraws_until_every_worker_has_min_size(labels: Tensor) -> None:
    """Oracle: the replayed draws; min_size = the first draw's smallest shard + 1, so the answer is the first later
    draw whose smallest shard reaches it (here the third: the setting is chosen so two draws are rejected)."""
    world, seed, alpha = 8, 0, 0.1
    draws = _replayed_dirichlet_draws(labels, world, seed, alpha)
    smallest = [min(len(s) for s in shards) for _, shards in draws]
    min_size = smallest[0] + 1
    expected = next(k for k, m in enumerate(smallest) if m >= min_size)
    assert expected >= 2  # the setting really exercises two redraws
    part = split(labels, world, "dirichlet", seed=seed, alpha=alpha, min_size=min_size)
    p, shards = draws[expected]
    assert part.draws == expected + 1
    assert part.proportions is not None and np.array_equal(part.proportions, p)
    assert [s.tolist() for s in part.shards] == [s.tolist() for s in shards]
    assert min(len(s) for s in part.shards) >= min_size
    _check_disjoint_cover(part.shards, len(labels), world)
    # TensorData.partition asks for one micro-batch per worker: the same rule with min_size = batch_size
    data = TensorData(TensorDataset(labels.float(), labels), TensorDataset(labels.float(), labels), CLASSES)
    data.sharding = Sharding("dirichlet", seed, alpha)
    via_data = data.partition(world, min_size)
    assert via_data is not None and via_data.draws == expected + 1 and _same_split(via_data, part)


def test_dirichlet_impossible_min_size_is_one_line_naming_the_worker(labels: Tensor) -> None:
    """Oracle: the replay's last draw names the worker with the fewest samples and their number."""
    world, seed, alpha = 4, 2, 0.5
    min_size = len(labels) // world + 1  # no split of 1438 samples gives all 4 workers 360
    _, shards = _replayed_dirichlet_draws(labels, world, seed, alpha)[-1]
    sizes = [len(s) for s in shards]
    worker = sizes.index(min(sizes))
    with pytest.raises(ValueError) as error:
        split(labels, world, "dirichlet", seed=seed, alpha=alpha, min_size=min_size)
    message = str(error.value)
    assert "\n" not in message
    assert f"worker {worker} with {sizes[worker]}" in message and f"{MAX_DRAWS} draws" in message
    assert f"micro-batch of {min_size}" in message and "dataset.alpha=0.5" in message


# -- the stream ------------------------------------------------------------------------------------------------------
def _indexed(labels: Tensor, sharding: Sharding) -> TensorData:
    """The digits labels with x = each sample's own index (float), so a batch names the samples it holds."""
    x = torch.arange(len(labels), dtype=torch.float64).unsqueeze(1)
    data = TensorData(TensorDataset(x, labels), TensorDataset(x[:10], labels[:10]), CLASSES)
    data.sharding = sharding
    return data


def _ids(batch: tuple[Tensor, Tensor]) -> list[int]:
    return batch[0].squeeze(1).long().tolist()


STREAM_SHARDINGS = {
    "shards": Sharding("shards", seed=1),
    "dirichlet": Sharding("dirichlet", seed=1, alpha=0.5),
    "classes": Sharding("classes", seed=1, classes_per_worker=3),
}


@pytest.mark.parametrize("name", STREAM_SHARDINGS)
def test_shard_stream_covers_its_shard_each_epoch(labels: Tensor, name: str) -> None:
    """Oracle: the split computed here; each of the shard's epochs (len // batch micro-batches) holds distinct
    samples of this worker's shard only, all of it but the remainder; labels are those of the samples; the next epoch
    is another order."""
    world, batch = 4, 16
    data = _indexed(labels, STREAM_SHARDINGS[name])
    shards = STREAM_SHARDINGS[name].split(labels, world, min_size=batch).shards
    for rank in range(world):
        shard = set(shards[rank].tolist())
        per_epoch = len(shard) // batch
        stream = data.train_batches(batch, rank, world, seed=3)
        epochs = [[next(stream) for _ in range(per_epoch)] for _ in range(3)]
        orders = []
        for epoch in epochs:
            seen = [i for b in epoch for i in _ids(b)]
            for b in epoch:
                assert len(b[1]) == batch and torch.equal(b[1], labels[torch.tensor(_ids(b))])
            assert len(seen) == len(set(seen)) == per_epoch * batch and set(seen) <= shard
            assert len(shard - set(seen)) == len(shard) % batch  # only the dropped remainder is missing
            orders.append(seen)
        assert orders[0] != orders[1] != orders[2]


@pytest.mark.parametrize("name", ["dirichlet", "classes"])
def test_stream_resumes_at_any_micro_batch(labels: Tensor, name: str) -> None:
    """Oracle: the uninterrupted stream; ``start=k`` gives its batches k, k+1, ... (in, at and across the shard's
    epoch boundaries)."""
    world, batch, rank = 4, 32, 2
    data = _indexed(labels, STREAM_SHARDINGS[name])
    per_epoch = len(STREAM_SHARDINGS[name].split(labels, world, min_size=batch).shards[rank]) // batch
    whole = [_ids(b) for b in islice(data.train_batches(batch, rank, world, seed=5), 3 * per_epoch + 5)]
    for start in [0, 1, per_epoch - 2, per_epoch - 1, per_epoch, per_epoch + 1, 2 * per_epoch + 3]:
        resumed = [_ids(b) for b in islice(data.train_batches(batch, rank, world, seed=5, start=start), per_epoch + 2)]
        assert resumed == whole[start : start + per_epoch + 2], f"start={start}"


@pytest.mark.parametrize(("name", "kwargs"), [("iid", {}), ("shards", {}), ("classes", {"classes_per_worker": 3})])
def test_batch_larger_than_a_shard_is_one_line(name: str, kwargs: dict) -> None:
    """Oracle: iid's behaviour (a ValueError naming the batch size and the worker's shard size); a fixed shard
    smaller than one micro-batch must be refused the same way, naming the smallest shard's size (dirichlet redraws
    instead; shards and classes cannot)."""
    batch, world = 400, 4  # digits: 1438 training samples, shards of about 360 (classes: 284..448)
    data = build_datasets(DatasetConfig(name="digits", partition=name, **kwargs))
    assert isinstance(data, TensorData)
    labels = data.train.tensors[1]
    if name == "iid":
        sizes = [len(labels) // world] * world
    else:
        sizes = [len(s) for s in split(labels, world, name, 0, **kwargs).shards]
    rank = sizes.index(min(sizes))
    assert min(sizes) < batch
    with pytest.raises(ValueError) as error:
        next(data.train_batches(batch, rank, world, seed=0))
    message = str(error.value)
    assert "400" in message and str(min(sizes)) in message and "\n" not in message


def test_iid_is_distributed_sampler_bit_for_bit(digits: TensorData) -> None:
    """Oracle: torch's DistributedSampler(shuffle, seed, drop_last) + BatchSampler(drop_last), set_epoch each epoch,
    indexing the real digits tensors; also with ``start`` across an epoch boundary."""
    assert digits.sharding.partition == "iid" and digits.partition(3, 32) is None
    world, batch, seed = 3, 32, 9
    for rank in range(world):
        sampler = DistributedSampler(digits.train, world, rank, shuffle=True, seed=seed, drop_last=True)
        batches = BatchSampler(sampler, batch, drop_last=True)
        expected = []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            expected += [digits.train[indices] for indices in batches]
        got = list(islice(digits.train_batches(batch, rank, world, seed), len(expected)))
        assert len(got) == len(expected) == 3 * len(batches)
        for (x, y), (ex, ey) in zip(got, expected):
            assert torch.equal(x, ex) and torch.equal(y, ey)
        start = len(batches) - 1
        resumed = list(islice(digits.train_batches(batch, rank, world, seed, start=start), 3))
        for (x, y), (ex, ey) in zip(resumed, expected[start : start + 3]):
            assert torch.equal(x, ex) and torch.equal(y, ey)


# -- a training run on a non-iid partition ---------------------------------------------------------------------------
NON_IID = {
    **CHECKPOINTED,
    "batch_size": 64,  # shards of 567 and 871 samples: 8 and 13 micro-batches an epoch, 18 taken in 9 steps
    "dataset": {"name": "digits", "partition": "dirichlet", "alpha": 0.5},
}


def _train_logging_info(rank: int, world: int, cfg: TrainConfig) -> dict[str, Any]:
    """``train``, and the start-up line the worker logs (its info, as ``key value | key value ...``)."""
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(message.record["message"]), level="INFO")
    try:
        result = train(cfg, Path(cfg.run.output_dir), torch.device("cpu"))
    finally:
        logger.remove(sink)
    return {**result, "info": [line for line in lines if line.startswith("world_size ")]}


def _info(line: str) -> dict[str, str]:
    return dict(part.split(" ", 1) for part in line.split(" | "))


@pytest.fixture(scope="module")
def non_iid_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    run_dir = tmp_path_factory.mktemp("dirichlet")
    return run_dir, run_workers(_train_logging_info, WORLD, make_cfg(run_dir, **NON_IID))


def test_non_iid_run_resumes_exactly(non_iid_run: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    """Oracle: the uninterrupted run; crashed after step 6 (rank 0 is then in its shard's second epoch, rank 1 crosses
    its boundary after the restart), the resumed run ends with its parameters bit for bit and its records."""
    whole, _ = non_iid_run
    cfg = make_cfg(tmp_path, **NON_IID)
    data = build_datasets(cfg.dataset)
    assert isinstance(data, TensorData)
    part = data.partition(WORLD, cfg.batch_size)
    assert part is not None
    per_epoch = [len(s) // cfg.batch_size for s in part.shards]
    taken_at_crash, taken = 6 * cfg.accum_steps, cfg.steps * cfg.accum_steps
    assert per_epoch[0] <= taken_at_crash < per_epoch[1] < taken  # the setting exercises both resume cases
    _crash_after(tmp_path, whole, 6)
    results = run_workers(_train_logging_info, WORLD, cfg)
    assert results[0]["resumed_from_step"] == 6
    _same_params(tmp_path, whole)
    assert _measured(tmp_path) == _measured(whole)


def test_records_carry_the_workers_loss_spread(non_iid_run: tuple[Path, list[dict[str, Any]]]) -> None:
    """Oracle: train/loss is the mean over workers of equally many micro-batches, so it lies between the smallest and
    largest worker's mean; on Dirichlet shards the workers' losses differ."""
    run_dir, _ = non_iid_run
    logged = [r for r in records(run_dir) if "train/loss" in r]
    assert [r["step"] for r in logged] == [3, 6, 9]
    for r in logged:
        assert r["train/loss_min_worker"] <= r["train/loss"] <= r["train/loss_max_worker"], r
        assert r["train/loss_min_worker"] < r["train/loss_max_worker"], r


def test_start_up_info_has_the_shards(non_iid_run: tuple[Path, list[dict[str, Any]]], labels: Tensor) -> None:
    """Oracle: the split computed here (dataset.split_seed 0, alpha 0.5, min_size the batch) and its histograms
    counted here; the sizes add up to the training set."""
    _, results = non_iid_run
    expected = split(labels, WORLD, "dirichlet", seed=0, alpha=0.5, min_size=NON_IID["batch_size"])
    for result in results:
        (line,) = result["info"]
        info = _info(line)
        assert info["data/partition"] == "dirichlet"
        sizes = json.loads(info["data/shard_sizes"])
        assert sizes == [len(s) for s in expected.shards] and sum(sizes) == int(info["data/train_samples"]) == len(labels)
        assert json.loads(info["data/shard_labels"]) == _hand_histograms(labels, expected.shards)


# -- bad input -------------------------------------------------------------------------------------------------------
def _file_datasets(tmp_path: Path) -> dict[str, dict[str, Any]]:
    """Valid token and image-folder datasets (checked as valid with partition iid), so only the partition is wrong."""
    write_token_files(tmp_path / "tokens", n_train=400, n_val=100, vocab=48)
    write_image_folder(tmp_path / "images")
    datasets = {
        "tokens": {"name": "tokens", "root": str(tmp_path / "tokens"), "context_length": 12, "vocab_size": 48},
        "imagefolder": {"name": "imagefolder", "root": str(tmp_path / "images"), "image_size": 32},
    }
    for dataset in datasets.values():
        DatasetConfig(**dataset).check_files()  # valid as iid
    return datasets


BAD = {
    "unknown partition": ({"dataset": {"partition": "foo"}}, "dataset.partition='foo' is not a partition; valid: iid, shards, dirichlet, classes"),
    "alpha 0": ({"dataset": {"partition": "dirichlet", "alpha": 0.0}}, "dataset.alpha=0.0 must be > 0"),
    "alpha negative": ({"dataset": {"partition": "dirichlet", "alpha": -1.0}}, "dataset.alpha=-1.0 must be > 0"),
    "classes_per_worker 0": ({"dataset": {"partition": "classes", "classes_per_worker": 0}}, "dataset.classes_per_worker=0 must be >= 1"),
    "classes_per_worker too large": (
        {"dataset": {"partition": "classes", "classes_per_worker": 11}, "launch": {"nproc_per_node": 4}},
        "dataset.classes_per_worker=11 with 4 workers and 10 classes: valid is 3..10",
    ),
    "classes_per_worker too small": (
        {"dataset": {"partition": "classes", "classes_per_worker": 1}, "launch": {"nproc_per_node": 4}},
        "dataset.classes_per_worker=1 with 4 workers and 10 classes: valid is 3..10",
    ),
    "synthetic classes": (
        {"dataset": {"name": "synthetic", "num_classes": 7, "partition": "classes", "classes_per_worker": 1},
         "launch": {"nproc_per_node": 4}, "model": {"name": "mlp"}},
        "dataset.classes_per_worker=1 with 4 workers and 7 classes: valid is 2..7",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_partition_is_one_line_naming_the_value(case: str) -> None:
    """Oracle: the documented message, on one line."""
    override, fragment = BAD[case]
    with pytest.raises(ValueError) as error:
        preflight(check_config(override))
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_classes_at_the_edges_of_its_range_are_accepted() -> None:
    """Oracle: 4 workers x 3 classes and 1 worker x 10 cover 10 classes; the check must not refuse them."""
    preflight(check_config({"dataset": {"partition": "classes", "classes_per_worker": 3}, "launch": {"nproc_per_node": 4}}))
    preflight(check_config({"dataset": {"partition": "classes", "classes_per_worker": 10}, "launch": {"nproc_per_node": 1}}))


@pytest.mark.parametrize("name", ["tokens", "imagefolder"])
def test_streamed_datasets_refuse_a_fixed_partition(tmp_path: Path, name: str) -> None:
    """Oracle: the documented message, though the data directory itself is valid."""
    dataset = _file_datasets(tmp_path)[name]
    with pytest.raises(ValueError) as error:
        check_config({"dataset": {**dataset, "partition": "dirichlet"}})
    message = str(error.value)
    assert f"dataset.partition=dirichlet needs the labels in memory; dataset={name} supports only iid" in message
    assert "\n" not in message


@pytest.mark.slow
def test_cli_unknown_partition_is_one_line_before_any_worker(tmp_path: Path) -> None:
    """Oracle: the CLI's contract for bad input (exit 2, one ``decent-train: error:`` line, nothing launched)."""
    run_dir = tmp_path / "run"
    proc = decent_train("dataset.partition=foo", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("decent-train: error: "), proc.stderr
    assert "dataset.partition='foo'" in lines[0] and "iid, shards, dirichlet, classes" in lines[0]
    assert not (run_dir / "resolved_config.yaml").exists() and not (run_dir / "logs").exists()
