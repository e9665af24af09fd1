"""A micro-batch larger than a worker's training shard is refused by the launcher's preflight, in one line naming the
value and what is valid, before any worker starts, at every world size the job may run at.

The oracle is the worker itself: the dataset it builds (``build_datasets``) and whether its ``train_batches`` yields a
batch or refuses, at each world size, checked against a hand computation (scikit-learn's 1797 digits less the 20%
held out: 1438 to train on; iid: ``1438 // world`` each, DistributedSampler dropping the rest).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from decent_train.components.data import DATASETS, Datasets, DatasetConfig, TensorData, build_datasets
from decent_train.config import TrainConfig, check_config
from decent_train.engine import reconfigure
from decent_train.launcher.preflight import preflight

from .datafiles import write_token_files

DIGITS_TRAIN = 1797 - round(1797 * 0.2)  # 1438: the default dataset.test_fraction holds out 359
SYNTHETIC = {"name": "synthetic", "num_samples": 100, "input_shape": [4], "num_classes": 4}
MLP = {"name": "mlp", "hidden_sizes": [8]}
RDZV = {"rdzv_endpoint": "node1:29400", "rdzv_id": "job7"}
LAUNCHES = {  # name: (launch, the world sizes it may train with)
    "1 worker": ({"nproc_per_node": 1}, [1]),
    "3 workers": ({"nproc_per_node": 3}, [3]),
    "4 workers": ({"nproc_per_node": 4}, [4]),
    "elastic 1:3 nodes of 2": ({"nproc_per_node": 2, "nnodes": "1:3", **RDZV}, [2, 4, 6]),
}
_BUILT: dict[str, Datasets] = {}


def data_for(dataset: dict[str, Any]) -> Datasets:
    """The worker's dataset (built once per config)."""
    key = repr(sorted(dataset.items()))
    if key not in _BUILT:
        _BUILT[key] = build_datasets(DatasetConfig(**dataset))
    return _BUILT[key]


def worker_error(dataset: dict[str, Any], batch: int, world: int) -> str | None:
    """Oracle: what every worker of ``world`` does with micro-batches of ``batch``: its error, or None (a batch).
    Rank 0 stands for all: iid shards are equal, fixed ones are the same split on every rank, and the check is of
    the smallest."""
    try:
        next(data_for(dataset).train_batches(batch, 0, world, seed=0))
    except ValueError as error:
        return str(error)
    return None


def cfg_with(dataset: dict[str, Any], launch: dict[str, Any], **overrides: Any) -> TrainConfig:
    model = {"model": MLP} if dataset.get("name") in ("synthetic", "npz") else {}  # vectors, not images
    return check_config({"dataset": dataset, "launch": launch, **model, **overrides})


def preflight_error(cfg: TrainConfig) -> str | None:
    try:
        preflight(cfg)
    except ValueError as error:
        return str(error)
    return None


def test_the_digits_train_on_1438_samples() -> None:
    """The hand computation's premise, from the worker's own dataset."""
    assert data_for({}).train_size == DIGITS_TRAIN == 1438


@pytest.mark.parametrize("test_fraction", [0.2, 0.1, 0.5, 0.33])
def test_the_preflight_counts_the_digits_the_worker_loads(test_fraction: float) -> None:
    """The preflight counts the digits without scikit-learn; the worker loads them: the same number."""
    dataset = DatasetConfig(test_fraction=test_fraction)
    assert DATASETS["digits"].train_size(dataset) == build_datasets(dataset).train_size


def test_npz_from_its_header_and_labels(tmp_path: Path) -> None:
    """npz: the count from train.npz's header, the labels (for classes) from its y; the worker's shards decide."""
    rng = np.random.default_rng(0)
    for name, n in (("train.npz", 50), ("test.npz", 10)):
        np.savez(tmp_path / name, x=rng.normal(size=(n, 4)).astype(np.float32), y=rng.integers(0, 3, n))
    for partition, world in (("iid", 3), ("classes", 3), ("classes", 2)):
        dataset = {"name": "npz", "root": str(tmp_path), "partition": partition, "classes_per_worker": 2}
        data = data_for(dataset)
        assert isinstance(data, TensorData) and data.train_size == 50
        smallest = min(data.shard_summary(world, 1)["data/shard_sizes"])
        assert partition != "iid" or smallest == 50 // world
        launch = {"nproc_per_node": world}
        assert preflight_error(cfg_with(dataset, launch, batch_size=smallest)) is None
        message = preflight_error(cfg_with(dataset, launch, batch_size=smallest + 1))
        assert message is not None and message == worker_error(dataset, smallest + 1, world), message


def every_worker_error(dataset: dict[str, Any], world: int) -> str | None:
    """Oracle for token data: each worker's contiguous shard of the stream is its own, so every rank's first batch
    is drawn; the first refusal, or None."""
    for rank in range(world):
        try:
            next(data_for(dataset).train_batches(1, rank, world, seed=0))
        except ValueError as error:
            return str(error)
    return None


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("tokens", [35, 36, 40, 59])
def test_tokens_hold_one_window_per_worker_at_every_world_size(tmp_path: Path, launch: str, tokens: int) -> None:
    """A token shard must hold one window and its shifted targets (context_length + 1 tokens), at every world size
    the launch may train at: the preflight refuses exactly when some worker would, in that worker's words. 35 to 59
    tokens with windows of 9 straddle the bound at 4 and 6 workers (shards of 8 or 9 tokens, uneven ones included)."""
    write_token_files(tmp_path, n_train=tokens)
    dataset = {"name": "tokens", "root": str(tmp_path), "context_length": 8}
    launch_cfg, worlds = LAUNCHES[launch]
    expected = next((e for e in (every_worker_error(dataset, world) for world in worlds) if e), None)
    cfg = check_config({"dataset": dataset, "launch": launch_cfg, "model": {"name": "gpt2", "layers": 1, "heads": 1,
                                                                           "width": 8}})
    assert preflight_error(cfg) == expected
    if expected is not None:
        assert "valid: dataset.context_length <= " in expected and "\n" not in expected


def test_the_token_oracle_by_hand(tmp_path: Path) -> None:
    """The oracle's premise: 36 tokens over 4 workers are shards of 9, one window of 8 and its target each; 35 leave
    rank 0 with 8 (ranks 1-3 still have 9)."""
    for tokens, fits in ((36, True), (35, False)):
        write_token_files(tmp_path / str(tokens), n_train=tokens)
        dataset = {"name": "tokens", "root": str(tmp_path / str(tokens)), "context_length": 8}
        error = every_worker_error(dataset, 4)
        assert (error is None) == fits and (fits or "leave 8 per worker" in error), error


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("dataset", [{}, SYNTHETIC], ids=["digits", "synthetic"])
def test_iid_batch_against_the_smallest_shard(dataset: dict[str, Any], launch: str) -> None:
    """The largest world size has the smallest shards: exactly its shard passes, one more is refused there, in the
    worker's words plus what is valid."""
    launch_cfg, worlds = LAUNCHES[launch]
    total = DIGITS_TRAIN if not dataset else SYNTHETIC["num_samples"]
    largest = worlds[-1]
    shard = total // largest
    assert worker_error(dataset, shard, largest) is None and worker_error(dataset, shard + 1, largest)  # the oracle
    assert preflight_error(cfg_with(dataset, launch_cfg, batch_size=shard)) is None
    message = preflight_error(cfg_with(dataset, launch_cfg, batch_size=shard + 1))
    assert message is not None, "the preflight passed a batch the workers refuse"
    assert message.startswith(f"batch_size={shard + 1} is larger than a worker's shard ({shard} samples of {total} "
                              f"over {largest} workers)"), message
    assert f"valid: batch_size <= {shard}" in message and "\n" not in message
    assert message == worker_error(dataset, shard + 1, largest)  # the worker says the same


@pytest.mark.parametrize(("dataset", "world"), [
    ({"partition": "shards"}, 3),
    ({"partition": "classes", "classes_per_worker": 3}, 4),
    ({**SYNTHETIC, "partition": "classes", "classes_per_worker": 1}, 4),
    ({**SYNTHETIC, "partition": "shards"}, 3),
], ids=["digits-shards", "digits-classes", "synthetic-classes", "synthetic-shards"])
def test_fixed_shards_against_the_smallest_worker(dataset: dict[str, Any], world: int) -> None:
    """Uneven shards (classes): the smallest worker's, as the worker splits them, is the bound."""
    data = data_for(dataset)
    assert isinstance(data, TensorData)
    smallest = min(data.shard_summary(world, 1)["data/shard_sizes"])
    assert worker_error(dataset, smallest, world) is None and worker_error(dataset, smallest + 1, world)
    launch = {"nproc_per_node": world}
    assert preflight_error(cfg_with(dataset, launch, batch_size=smallest)) is None
    message = preflight_error(cfg_with(dataset, launch, batch_size=smallest + 1))
    assert message == worker_error(dataset, smallest + 1, world), message
    assert f"batch_size={smallest + 1}" in message and f"valid: batch_size <= {smallest}" in message


@pytest.mark.parametrize("dataset", [{"partition": "dirichlet", "alpha": 0.3},
                                     {**SYNTHETIC, "partition": "dirichlet", "alpha": 0.3}],
                         ids=["digits", "synthetic"])
def test_dirichlet_refuses_what_the_worker_refuses(dataset: dict[str, Any]) -> None:
    """Dirichlet redraws a split until every worker holds one micro-batch: the preflight runs the same draws, so it
    refuses exactly the batches the worker refuses, with its message."""
    world = 4
    fits = []
    for batch in (1, 10, 40, 80, 150, 300, 400):
        expected = worker_error(dataset, batch, world)
        assert preflight_error(cfg_with(dataset, {"nproc_per_node": world}, batch_size=batch)) == expected, batch
        fits.append(expected is None)
    assert fits[0] and not fits[-1]  # both outcomes occur


def test_global_batch_over_an_elastic_range_names_global_batch_size() -> None:
    """global_batch_size=G over 2 or 4 workers is G/2 or G/4 per worker, against shards of 719 or 359: 1436 fits both,
    1440 is 720 per worker over 2 workers: refused there, naming the value the user gave."""
    launch = {"nproc_per_node": 2, "nnodes": "1:2", **RDZV}
    assert worker_error({}, 720, 2) and worker_error({}, 718, 2) is None and worker_error({}, 359, 4) is None
    assert preflight_error(cfg_with({}, launch, global_batch_size=1436)) is None
    message = preflight_error(cfg_with({}, launch, global_batch_size=1440))
    assert message is not None and message.startswith("global_batch_size=1440"), message
    assert "batch_size=720" in message and "(719 samples of 1438 over 2 workers)" in message
    assert "valid: global_batch_size <= 1438" in message and "\n" not in message


def test_global_batch_with_accumulation() -> None:
    """4 workers x accum_steps 2: a micro-batch is G/8, against a shard of 359: G <= 2872."""
    launch = {"nproc_per_node": 4}
    assert preflight_error(cfg_with({}, launch, global_batch_size=2872, accum_steps=2)) is None
    message = preflight_error(cfg_with({}, launch, global_batch_size=2880, accum_steps=2))
    assert message is not None and "global_batch_size=2880" in message and "batch_size=360" in message, message
    assert "valid: global_batch_size <= 2872" in message


def test_sharded_replicas_still_shard_the_data_per_worker() -> None:
    """parallel.shard=2: each rank of a replica takes its own micro-batches (FSDP2 averages their gradients), so the
    data is dealt over all 4 workers, not over the 2 replicas."""
    launch = {"nproc_per_node": 4}
    assert preflight_error(cfg_with({}, launch, batch_size=359, parallel={"shard": 2})) is None
    message = preflight_error(cfg_with({}, launch, batch_size=360, parallel={"shard": 2}))
    assert message is not None and "(359 samples of 1438 over 4 workers)" in message, message


@pytest.mark.skipif(not reconfigure.supported(), reason="live membership needs torch >= 2.14 (refused before)")
def test_live_keeps_the_launched_batch_at_every_number_of_members() -> None:
    """fault_tolerance=live: the batch stays as launched (G/4) whatever the members (1 to 4), so G=1436 passes though
    3 members could not split it; 1440 is 360 per worker, refused against 4 members' 359."""
    live = {"fault_tolerance": {"name": "live"}}
    launch = {"nproc_per_node": 4}
    assert preflight_error(cfg_with({}, launch, global_batch_size=1436, **live)) is None
    message = preflight_error(cfg_with({}, launch, global_batch_size=1440, **live))
    assert message is not None and "global_batch_size=1440" in message and "over 4 workers" in message, message


@pytest.mark.slow
@pytest.mark.alone  # it times the refusal
def test_the_command_refuses_before_any_worker(tmp_path: Path) -> None:
    """The defect's command: one line, exit status 2, no traceback, no worker started (no logs/, the refused run
    directory removed), in seconds (workers take ~15 s to start and fail)."""
    run_dir = tmp_path / "run"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "decent_train.launcher.cli", "batch_size=5000", "steps=3", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    elapsed = time.monotonic() - started
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert lines == ["decent-train: error: batch_size=5000 is larger than a worker's shard (359 samples of 1438 over 4 "
                     "workers); valid: batch_size <= 359 (or fewer workers)"], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (run_dir / "logs").exists() and not run_dir.exists()
    assert elapsed < 12, f"{elapsed:.1f} s: did workers start?"
