"""scripts/bench_sharded.py: its measuring function on a tiny GPT-2 in 4 forked gloo workers at K = 1, 2, 4 ranks per
replica, checked against numbers computed here from the whole model (its parameters' bytes and dim-0 sizes), not
against stored ones. Timings are only checked to exist (the machine is shared)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from decent_train.components.models import ModelConfig, build_model
from tests.jobs import import_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_sharded.py"


@pytest.fixture(scope="module")
def bench() -> Any:
    return import_script("bench_sharded")


def tiny(bench: Any, **more: Any) -> Any:
    """Uneven on purpose: a vocabulary of 50 and a context of 10 rows cut 13/13/13/11 and 3/3/3/1 over 4 ranks."""
    return bench.Config(workers=4, width=24, heads=2, layers=1, vocab=50, context=10, batch=2, ks=[1, 2, 4],
                        steps=1, repeats=2, warmup=1, **more)


def whole_model(cfg: Any) -> list[tuple[int, int, int]]:
    """(dim 0, elements per dim-0 row, bytes per element) of every distinct parameter of the unsharded model."""
    net = build_model(ModelConfig(name="gpt2", layers=cfg.layers, heads=cfg.heads, width=cfg.width), (cfg.context,),
                      cfg.vocab)
    return [(p.shape[0], p.numel() // p.shape[0], p.element_size()) for p in net.parameters()]


@pytest.fixture(scope="module")
def measured(bench: Any) -> tuple[Any, dict[str, Any]]:
    cfg = tiny(bench)
    return cfg, bench.measure(cfg)


def test_local_memory_is_one_kth_of_the_model_within_the_padding_of_uneven_shards(measured: Any) -> None:
    cfg, result = measured
    params = whole_model(cfg)
    full = sum(rows * row * size for rows, row, size in params)
    assert result["model"]["param_bytes"] == full
    assert [r["k"] for r in result["rows"]] == [1, 2, 4]
    for row in result["rows"]:
        k = row["k"]
        # a rank holds at most ceil(rows / K) rows of each parameter, and at least what the others leave
        most = sum(math.ceil(rows / k) * r * s for rows, r, s in params)
        least = sum(max(0, rows - (k - 1) * math.ceil(rows / k)) * r * s for rows, r, s in params)
        slack = most - full / k
        for replica in range(cfg.workers // k):
            ranks = row["per_rank"][replica * k : (replica + 1) * k]
            assert sum(r["param_bytes"] for r in ranks) == full  # the shards of a replica are the model, once
        for r in row["per_rank"]:
            assert least <= r["param_bytes"] <= most
            assert r["optimizer_bytes"] == 2 * r["param_bytes"]  # AdamW's two moments, sharded as the parameter
            assert r["grad_bytes"] == r["param_bytes"]
            # payload and receive buffer, one shard each; a replica alone reduces its payload in place
            assert r["gossip_buffer_bytes"] == (1 if cfg.workers == k else 2) * r["param_bytes"]
            assert r["hsdp_param_bytes"] == r["param_bytes"] and r["hsdp_optimizer_bytes"] == r["optimizer_bytes"]
            assert r["step_counter_bytes"] == 4 * len(params)  # a float32 0-d step per parameter, never sharded
        assert row["param_bytes_max"] == max(r["param_bytes"] for r in row["per_rank"])
        assert row["param_bytes_max"] / full == pytest.approx(1 / k, abs=slack / full + 1e-12)
        assert row["param_ratio_vs_first"] == pytest.approx(row["param_bytes_max"] / full)
        assert row["optimizer_ratio_vs_first"] == pytest.approx(row["param_bytes_max"] / full)
        # parameters, gradients, AdamW's two moments and the gossip buffers: 6 shards' worth, 5 for a replica alone
        units = {k: 5 if cfg.workers == k else 6 for k in (1, k)}
        assert row["total_ratio_vs_first"] == pytest.approx(units[k] / units[1] / k, abs=slack / full + 1e-12)
    assert result["rows"][2]["param_bytes_max"] > full / 4  # the padding is there: 13 of 50 rows, 3 of 10


def test_bytes_per_step_gossip_swaps_a_shard_hsdp_all_reduces_it(measured: Any) -> None:
    cfg, result = measured
    full = result["model"]["param_bytes"]
    n = cfg.workers
    for row in result["rows"]:
        replicas = n // row["k"]
        assert row["replicas"] == replicas
        for r in row["per_rank"]:
            shard = r["param_bytes"]
            # ring over an even number of replicas: pairs in every round, each rank sends its shard once
            assert r["gossip_bytes_per_step"] == (shard if replicas > 1 else 0)
            assert r["hsdp_bytes_per_step"] == pytest.approx(2 * (replicas - 1) / replicas * shard)
            assert r["hsdp_bytes_per_step_by_hand"] == pytest.approx(r["hsdp_bytes_per_step"])
        assert row["allreduce_unsharded_bytes_per_step"] == pytest.approx(2 * (n - 1) / n * full)
    k1, k2, k4 = result["rows"]
    assert k1["gossip_vs_hsdp_bytes"] == pytest.approx(2 / 3)  # 4 replicas: 1 shard against 2 * 3/4
    assert k2["gossip_vs_hsdp_bytes"] == pytest.approx(1.0)  # 2 replicas: a pair either way
    assert k4["gossip_vs_hsdp_bytes"] is None and k4["gossip_bytes_per_step_mean"] == 0  # one replica


def test_timings_and_table(bench: Any, measured: Any) -> None:
    cfg, result = measured
    for row in result["rows"]:
        for r in row["per_rank"]:
            assert len(r["gossip_step_s"]) == len(r["hsdp_step_s"]) == cfg.repeats
            assert all(s > 0 for s in r["gossip_step_s"] + r["hsdp_step_s"])
        slowest = [max(r["gossip_step_s"][i] for r in row["per_rank"]) for i in range(cfg.repeats)]
        assert row["gossip_step_ms_repeats"] == pytest.approx([1e3 * t for t in slowest])
        assert row["gossip_step_ms"] == pytest.approx(1e3 * sum(slowest) / len(slowest))  # median of 2: the mean
        assert row["gossip_vs_hsdp_time"] == pytest.approx(row["gossip_step_ms"] / row["hsdp_step_ms"])
    text = bench.table(result)
    assert text.count("\n| ") == 4 and "| 2 | 2 | " in text and "(0.500)" in text


@pytest.mark.slow
def test_the_command_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "sharded.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--workers", "2", "--width", "16", "--heads", "2", "--layers", "1", "--vocab",
         "32", "--context", "8", "--ks", "1,2", "--no-timing", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    result = json.loads(out.read_text())
    assert [r["k"] for r in result["rows"]] == [1, 2] and result["rows"][1]["param_ratio_vs_first"] == 0.5
    assert "| K | replicas |" in proc.stdout and result["command"].startswith("python scripts/bench_sharded.py")
