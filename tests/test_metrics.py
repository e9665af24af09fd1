"""What the worker measures and where it goes: consensus distance against the workers' own parameters, the
communication estimate by hand, wandb's offline files, and training that survives a failing wandb."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from decent_train import build_topology
from decent_train.components.metrics import allreduce_bytes_per_step, gossip_bytes_per_step
from decent_train.training import train

from .distributed import run_workers
from .jobs import make_cfg, records


def _train_and_dump(rank: int, world: int, cfg: Any, dump_dir: Path) -> None:
    """Train; at every record with a consensus distance, save this worker's parameters as they were measured."""

    def dump(record: dict[str, Any], model: nn.Module) -> None:
        if "consensus/distance" in record:
            params = [p.detach().clone() for p in model.parameters()]
            torch.save(params, dump_dir / f"step{record['step']}_rank{rank}.pt")

    train(cfg, Path(cfg.run.output_dir), torch.device("cpu"), on_record=dump)


def run(tmp_path: Path, world: int, dump: bool = False, **overrides: Any) -> list[dict[str, Any]]:
    run_dir, dump_dir = tmp_path / "run", tmp_path / "dumps"
    run_dir.mkdir(parents=True), dump_dir.mkdir(parents=True)
    overrides.setdefault("logger", {})
    overrides["logger"] = {"consensus_every": 2, "log_every": 2, "wandb": {"mode": "disabled"}, **overrides["logger"]}
    cfg = make_cfg(run_dir, launch={"nproc_per_node": world}, eval_every=0, **overrides)
    run_workers(_train_and_dump, world, cfg, dump_dir)
    return records(run_dir)


def test_consensus_distance_matches_the_workers_parameters(tmp_path: Path) -> None:
    world = 4
    logged = run(tmp_path, world, topology={"name": "ring"})
    measured = [r for r in logged if "consensus/distance" in r]
    assert [r["step"] for r in measured] == [2, 4, 6]
    for record in measured:
        per_rank = [torch.load(tmp_path / "dumps" / f"step{record['step']}_rank{r}.pt") for r in range(world)]
        flat = torch.stack([torch.cat([p.double().flatten() for p in params]) for params in per_rank])
        mean = flat.mean(0)
        want = math.sqrt(((flat - mean) ** 2).sum(1).mean().item())
        assert want > 0
        assert record["consensus/distance"] == pytest.approx(want, rel=1e-4)
        assert record["consensus/relative"] == pytest.approx(want / mean.norm().item(), rel=1e-4)


def test_complete_stays_closer_than_ring_and_one_worker_is_at_zero(tmp_path: Path) -> None:
    distances = {}
    for topology in ("complete", "ring"):
        logged = run(tmp_path / topology, 4, topology={"name": topology}, steps=8)
        distances[topology] = [r["consensus/distance"] for r in logged if "consensus/distance" in r]
    assert len(distances["ring"]) == 4
    # Step 2 is nearly a tie (both start from one model, and the first mix averages equal models); after it, exact
    # averaging keeps the workers closer than a ring's pairs.
    assert all(c < r for c, r in zip(distances["complete"][1:], distances["ring"][1:])), distances
    assert sum(distances["complete"]) < sum(distances["ring"])
    alone = run(tmp_path / "alone", 1, topology={"name": "ring"})
    assert [r["consensus/distance"] for r in alone if "consensus/distance" in r] == [0.0, 0.0, 0.0]


def test_record_keys_and_communication_volume(tmp_path: Path) -> None:
    logged = run(tmp_path / "gossip", 2, topology={"name": "ring"})
    model_bytes = sum(4 * math.ceil(n / 32) * 32 for n in (64 * 32, 32, 32 * 10, 10))  # fp32, 32-element aligned
    for record in logged:
        assert record["comm/bytes_per_step"] == model_bytes  # a pair sends its whole bucket once per step
        assert record["time/comm_wait_ms"] >= 0 and record["time/data_ms"] >= 0 and record["memory/peak_gib"] > 0
        assert record["throughput/samples_per_s"] > 0 and record["throughput/samples_per_s_min_worker"] > 0
    ddp = run(tmp_path / "ddp", 2, algorithm="allreduce")
    assert all("time/comm_wait_ms" not in r for r in ddp)
    assert all(r["comm/bytes_per_step"] == 4 * (64 * 32 + 32 + 32 * 10 + 10) for r in ddp)


def test_compressed_volume_is_what_the_engine_sends(tmp_path: Path) -> None:
    """With int8 compression a pair sends the message: one int8 level per element (the bucket padded to 256-element
    blocks) and one float32 scale per block."""
    logged = run(tmp_path / "int8", 2, topology={"name": "ring"}, compression={"name": "int8"})
    numel = sum(math.ceil(n / 32) * 32 for n in (64 * 32, 32, 32 * 10, 10))  # one bucket, 32-element aligned
    blocks = math.ceil(numel / 256)
    assert all(r["comm/bytes_per_step"] == blocks * 256 + 4 * blocks for r in logged)
    assert len(logged) >= 2


def test_bytes_per_step_by_hand() -> None:
    total = [1000, 600]  # two buckets
    assert gossip_bytes_per_step(build_topology("ring", 4, 4), 0, total) == 1600  # pairs in both rounds
    assert gossip_bytes_per_step(build_topology("complete", 4, 4), 2, total) == 2 * 3 / 4 * 1600
    # ring of 5: rank 4 is in the group of three in both rounds; rank 0 in a pair, then in the group of three
    assert gossip_bytes_per_step(build_topology("ring", 5, 5), 4, total) == 2 * 2 / 3 * 1600
    assert gossip_bytes_per_step(build_topology("ring", 5, 5), 0, total) == (1600 + 2 * 2 / 3 * 1600) / 2
    assert gossip_bytes_per_step(build_topology("ring", 1, 1), 0, total) == 0
    assert allreduce_bytes_per_step(8, 1600) == 2 * 7 / 8 * 1600 and allreduce_bytes_per_step(1, 1600) == 0
    # hierarchical, 2 nodes of 3: a pair between nodes, then a group of 3 within the node, in every round
    assert gossip_bytes_per_step(build_topology("hierarchical", 6, 3), 4, total) == 1600 + 2 * 2 / 3 * 1600
    # compressed groups all-gather: a ring all-gather sends m - 1 messages
    assert gossip_bytes_per_step(build_topology("complete", 4, 4), 2, total, all_gather=True) == 3 * 1600
    assert gossip_bytes_per_step(build_topology("ring", 4, 4), 0, total, all_gather=True) == 1600


def test_wandb_offline_files_hold_the_metrics(tmp_path: Path) -> None:
    logged = run(tmp_path, 2, logger={"wandb": {"mode": "offline"}})
    (log_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    content = log_file.read_bytes()
    keys = {k for r in logged for k in r if k != "step"}
    assert {"train/loss", "consensus/distance", "eval/accuracy", "throughput/samples_per_s"} <= keys
    for key in keys:
        assert key.encode() in content, key
    assert b"accum_adamw" in content  # the resolved config went with the run


@pytest.mark.parametrize("where", ["init", "log"])
def test_training_survives_a_failing_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    import wandb
    from wandb.sdk.wandb_run import Run

    def fail(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("wandb is down")

    monkeypatch.setattr(*((wandb, "init") if where == "init" else (Run, "log")), fail)  # inherited by forked workers
    logged = run(tmp_path, 2, logger={"wandb": {"mode": "offline"}})
    assert [r["step"] for r in logged] == [2, 4, 6]  # every record
    assert "eval/accuracy" in logged[-1]
