"""``algorithm=diloco`` and ``algorithm=localsgd`` in the launcher (algorithms/local_steps_algorithms.py): what the
records say, exact resume, resume at another world size, and issue 28's acceptance 3 on the default job.

Oracles: bytes from the model's parameter count worked out by hand (digits: 8x8 inputs, 10 classes) and the payload
each topology sends; consensus distances recomputed in float64 from the anchors in the workers' checkpoint files;
the average of the saved files computed here; an uninterrupted run for the resumed one.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from decent_train.algorithms import algorithm_class
from decent_train.components.checkpoint import complete_checkpoints
from decent_train.components.data import build_datasets
from decent_train.components.metrics import gossip_bytes_per_step
from decent_train.components.models import build_model
from decent_train.components.optim import make_scheduler_fn
from decent_train.config import MODEL_FILE, RESULT_FILE, TrainConfig
from decent_train.engine.topology import build_topology
from decent_train.training.forward import Precision
from decent_train.training.resume import load_checkpoint, restore

from .distributed import run_workers
from .jobs import check_succeeded, decent_train, make_cfg, records, train_on_cpu

MLP_32 = 64 * 32 + 32 + 32 * 10 + 10  # make_cfg's model: Linear(64, 32), Linear(32, 10) on the digits
TIMING = ("time/", "throughput/", "memory/")


def _run(cfg: TrainConfig, world: int) -> dict[str, Any]:
    return run_workers(train_on_cpu, world, cfg)[0]


def _saved(run_dir: Path, step: int, world: int) -> list[dict[str, Any]]:
    (checkpoint,) = [c for c in complete_checkpoints(run_dir) if c.step == step]
    return [torch.load(checkpoint.path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _distance(per_worker: list[torch.Tensor]) -> tuple[float, float]:
    """ConsensusProbe's definition in float64: sqrt(1/n sum_i |x_i - mean|^2), and that over |mean|."""
    xs = torch.stack([x.double() for x in per_worker])
    mean = xs.mean(0)
    distance = ((xs - mean).square().sum() / len(per_worker)).sqrt().item()
    return distance, distance / mean.norm().item()


# -- records ---------------------------------------------------------------------------------------------------------
RECORDED = {
    "steps": 12, "eval_every": 0, "launch": {"nproc_per_node": 4},
    "logger": {"log_every": 2, "consensus_every": 6, "consensus_samples": 0},  # exact distances
    "checkpoint": {"every": 6, "keep": 5},
}
# bytes per outer step, 4 workers: ring pairs send [x, anchor] once (DiLoCo) or x (LocalSGD); complete all-reduces the
# pseudo-gradient alone (2 (n-1)/n of it); bf16 halves every element.
PAYLOADS = {
    ("diloco", "ring", "none"): 2 * 4 * MLP_32,
    ("diloco", "complete", "none"): 2 * 3 / 4 * 4 * MLP_32,
    ("diloco", "ring", "bf16"): 2 * 2 * MLP_32,
    ("localsgd", "ring", "none"): 4 * MLP_32,
}


@pytest.mark.parametrize("algorithm,topology,compression", list(PAYLOADS))
def test_records_carry_bytes_outer_steps_and_the_anchors_consensus(
    tmp_path: Path, algorithm: str, topology: str, compression: str
) -> None:
    cfg = make_cfg(tmp_path, **RECORDED, algorithm={"name": algorithm, "sync_every": 4},
                   topology={"name": topology}, compression={"name": compression})
    _run(cfg, 4)
    logged = records(tmp_path)
    assert [r["step"] for r in logged] == list(range(2, 13, 2))
    for record in logged:
        assert record["comm/bytes_per_step"] == pytest.approx(PAYLOADS[algorithm, topology, compression] / 4)
        assert record["outer/step"] == record["step"] // 4
    measured = {r["step"]: r for r in logged if "consensus/distance" in r}
    assert sorted(measured) == [6, 12]
    if algorithm == "localsgd":  # no anchors
        assert not any("consensus/anchor_distance" in r for r in logged)
        return
    for step in (6, 12):
        saved = _saved(tmp_path, step, 4)
        anchors = [torch.cat([a.flatten() for g in s["algorithm"]["front"]["anchors"] for a in g]) for s in saved]
        expected = _distance(anchors)
        got = measured[step]["consensus/anchor_distance"], measured[step]["consensus/anchor_relative"]
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-9)
    if topology == "complete":  # all-reduced outer steps keep the anchors equal
        assert measured[6]["consensus/anchor_distance"] <= 1e-9
    else:  # mid-period the parameters have moved on from the anchors; at an outer step they are the anchors
        assert measured[6]["consensus/anchor_distance"] > 1e-4
        assert measured[6]["consensus/anchor_distance"] != pytest.approx(measured[6]["consensus/distance"], rel=1e-3)
        assert measured[12]["consensus/anchor_distance"] == measured[12]["consensus/distance"]


# -- exact resume, the averaged model --------------------------------------------------------------------------------
RESUMED = {
    "steps": 9, "checkpoint": {"every": 3, "keep": 5}, "logger": {"log_every": 1, "consensus_every": 3},
    "launch": {"nproc_per_node": 4}, "model": {"name": "cnn", "channels": [4, 8]},  # BatchNorm: buffers averaged too
}
VARIANTS = {  # (algorithm, crash after): mid-period; an exchange in flight (started after step 3, due after 4)
    "diloco": ({"name": "diloco", "sync_every": 4}, 6, {}),
    "streaming-int8": ({"name": "diloco", "sync_every": 4, "fragments": 2, "fragment_sync_delay": 1}, 3,
                       {"compression": {"name": "int8"}}),
    "localsgd": ({"name": "localsgd", "sync_every": 2}, 3, {}),
}


def _crash_after(run_dir: Path, source: Path, step: int) -> None:
    """``run_dir`` as a run that died after writing the checkpoint of ``step``."""
    shutil.copytree(source / "checkpoints", run_dir / "checkpoints")
    for checkpoint in complete_checkpoints(run_dir):
        if checkpoint.step > step:
            shutil.rmtree(checkpoint.path)
    kept = [line for line in (source / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= step]
    (run_dir / "metrics.jsonl").write_text("\n".join(kept) + "\n")


def _measured(run_dir: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING + ("eval/",))} for r in records(run_dir)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_resumed_run_ends_bit_identical_and_the_saved_model_is_the_average(tmp_path: Path, variant: str) -> None:
    """The straight run evaluates the average at steps 4 and 8 too, the resumed one only at its end: evaluation puts
    the workers' own models back exactly, or the two would differ (a record every step: the same windows)."""
    algorithm, crash, extra = VARIANTS[variant]
    whole = tmp_path / "whole"
    _run(make_cfg(whole, **RESUMED, **extra, algorithm=algorithm, eval_every=4), 4)
    resumed = tmp_path / "resumed"
    _crash_after(resumed, whole, crash)
    assert _run(make_cfg(resumed, **RESUMED, **extra, algorithm=algorithm, eval_every=0), 4)["resumed_from_step"] == crash
    final, again = torch.load(whole / MODEL_FILE), torch.load(resumed / MODEL_FILE)
    assert all(torch.equal(final[name], again[name]) for name in final)
    assert _measured(resumed) == _measured(whole)

    # model.pt is the workers' average (their last checkpoint holds each one's own), evaluated as reported
    saved = _saved(whole, 9, 4)
    for name, value in final.items():
        if value.is_floating_point():
            mean = torch.stack([s["model"][name].double() for s in saved]).mean(0)
            assert (value.double() - mean).abs().max().item() <= 1e-6, name
    assert max((saved[0]["model"][n] - saved[1]["model"][n]).abs().max().item() for n in final) > 1e-4, "own models"
    cfg = make_cfg(whole, **RESUMED)
    data = build_datasets(cfg.dataset)
    net = build_model(cfg.model, data.input_shape, data.num_classes)
    net.load_state_dict(final)
    net.eval()
    x, y = data.test.tensors
    with torch.no_grad():
        accuracy = (net(x).argmax(1) == y).double().mean().item()
    assert accuracy == pytest.approx(json.loads((whole / RESULT_FILE).read_text())["eval/accuracy"], abs=1e-12)


# -- another world size ----------------------------------------------------------------------------------------------
RESIZED = {"algorithm": {"name": "diloco", "sync_every": 4, "fragments": 2, "fragment_sync_delay": 1},
           "checkpoint": {"every": 5, "keep": 5}, "eval_every": 0, "steps": 5,
           "scheduler": {"name": "constant", "warmup_steps": 0},  # 0: make_cfg's cosine warmup, which constant refuses
           "logger": {"log_every": 5, "consensus_every": 0}}  # step 5: an exchange in flight on every worker


def _load_at(rank: int, world: int, cfg: TrainConfig) -> dict[str, Any]:
    """What ``train`` does before its loop: build the algorithm and restore it from the 4 workers' checkpoint."""
    from loguru import logger

    logger.remove()
    data = build_datasets(cfg.dataset)
    torch.manual_seed(cfg.seed)
    net = build_model(cfg.model, data.input_shape, data.num_classes)
    algorithm = algorithm_class(cfg.algorithm.name)
    checkpoint, state = load_checkpoint(cfg, Path(cfg.run.output_dir), algorithm)
    assert checkpoint is not None and state is not None
    algo = algorithm(net, cfg, make_scheduler_fn(cfg.scheduler, 20), Precision("fp32", torch.device("cpu")).scaler,
                     checkpoint.step)
    restore(algo, checkpoint, state, cfg, data, cfg.batch_size, torch.device("cpu"))
    inner = [algo.inner.state[p] for group in algo.inner.param_groups for p in group["params"]]
    return {
        "front": state["algorithm"]["front"],
        "anchors": [a.clone() for a in algo.front.anchors()],
        "params": [p.detach().clone() for p in net.parameters()],
        "momentum": [algo.outer.state[p]["momentum_buffer"].clone() for p in net.parameters()],
        "exp_avg": [s["exp_avg"].clone() for s in inner],
        "steps": (algo.front.inner_steps, algo.front.outer_steps, algo.scheduler.last_epoch),
    }


def test_another_world_size_starts_from_the_averaged_anchors_momentum_and_moments(tmp_path: Path) -> None:
    source = tmp_path / "source"
    _run(make_cfg(source, **RESIZED, launch={"nproc_per_node": 4}), 4)
    saved = _saved(source, 5, 4)
    assert all(s["algorithm"]["front"]["in_flight"] is not None for s in saved)  # what must not be averaged

    def mean(pick: Any) -> list[torch.Tensor]:
        return [torch.stack([v.double() for v in values]).mean(0) for values in zip(*(pick(s) for s in saved))]

    anchors = mean(lambda s: [a for g in s["algorithm"]["front"]["anchors"] for a in g])
    momentum = mean(lambda s: [v["momentum_buffer"] for _, v in sorted(s["algorithm"]["front"]["outer"]["state"].items())])
    exp_avg = mean(lambda s: [v["exp_avg"] for _, v in sorted(s["algorithm"]["inner"]["state"].items())])
    params = mean(lambda s: list(s["model"].values()))
    spread = max((a - b).abs().max().item() for a, b in zip(saved[0]["algorithm"]["front"]["anchors"][0],
                                                              saved[2]["algorithm"]["front"]["anchors"][0]))
    assert spread > 1e-4, "the ring's anchors differ between workers"

    cfg = make_cfg(tmp_path / "on2", **RESIZED, launch={"nproc_per_node": 2}, resume=str(source))
    cfg.run.output_dir = str(source)  # load_checkpoint looks in the run directory first
    for loaded in run_workers(_load_at, 2, cfg):
        assert loaded["front"]["in_flight"] is None and loaded["front"]["copies"] is None
        assert loaded["steps"] == (5, 2, 5)  # counters and schedule as saved
        for got, want in ((loaded["anchors"], anchors), (loaded["momentum"], momentum),
                          (loaded["exp_avg"], exp_avg), (loaded["params"], params)):
            assert len(got) == len(want) > 0
            assert max((g.double() - w).abs().max().item() for g, w in zip(got, want)) <= 1e-6

    result = _run(make_cfg(tmp_path / "on2", **{**RESIZED, "steps": 9}, launch={"nproc_per_node": 2},
                           resume=str(source)), 2)
    assert (result["resumed_from_world_size"], result["resumed_from_step"], result["steps"]) == (4, 5, 9)
    assert math.isfinite(result["train/loss"])


# -- acceptance 3 ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_default_job_with_local_steps_reaches_095_at_a_fraction_of_ring_gossips_bytes(tmp_path: Path) -> None:
    """``decent-train algorithm=diloco algorithm.sync_every=10`` and ``algorithm=localsgd`` likewise: the default job
    (4 workers, ring, AccumAdamW, the CNN on the digits) to >= 0.95, sending an outer step's bytes / 10: at most a
    quarter of per-step ring gossip's."""
    sweep = tmp_path / "sweep"
    for num, algorithm in enumerate(("diloco", "localsgd")):  # one command each: a sweep cannot set sync_every
        check_succeeded(decent_train(f"algorithm={algorithm}", "algorithm.sync_every=10",
                                     "logger.progress_bar=false", f"hydra.run.dir={sweep / str(num)}", cwd=tmp_path))
    cnn = 9 * 32 + 2 * 32 + 9 * 32 * 64 + 2 * 64 + 64 * 10 + 10  # conv 3x3 1->32, BN, conv 32->64, BN, Linear(64, 10)
    model_bytes = 4 * cnn
    ring = build_topology("ring", 4, 4)
    per_step_ring = gossip_bytes_per_step(ring, 0, [model_bytes])
    assert per_step_ring == model_bytes  # a ring of 4: one pair per worker per round, the model sent once
    for num, (algorithm, outer_step_bytes) in enumerate([("diloco", 2 * model_bytes), ("localsgd", model_bytes)]):
        run_dir = sweep / str(num)
        result = json.loads((run_dir / RESULT_FILE).read_text())
        assert result["algorithm"] == algorithm and result["topology"] == "ring"
        assert result["eval/accuracy"] >= 0.95, (algorithm, result["eval/accuracy"])
        logged = records(run_dir)
        assert all(r["comm/bytes_per_step"] == pytest.approx(outer_step_bytes / 10) for r in logged)
        assert logged[-1]["comm/bytes_per_step"] <= per_step_ring / 4
        assert logged[-1]["outer/step"] == result["steps"] // 10
