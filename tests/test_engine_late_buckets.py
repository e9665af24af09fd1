"""A gradient that arrives late holds back every later bucket to the end of backward, and the engine says so (R12).

Buckets update strictly in index order, so a weight whose gradient comes last in backward (used at the start of
forward, here an embedding tied to the output projection) but that lands in the first bucket keeps every later bucket
from stepping and launching until backward ends. Oracles by hand from the layout: ``bucket_size_in_mb=0`` gives one
bucket per parameter, in reverse registration order, and the gradients of the body's layers all come before the
embedding's (it is used first in forward). The count is ``late_buckets`` (the record's
``engine/late_buckets_per_step``); a warning names the parameter once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from loguru import logger
from torch import Tensor, nn

from decent_train import DecentralizedDataParallel
from decent_train.algorithms.decentralized import Decentralized
from decent_train.training import train
from tests.distributed import run_workers
from tests.jobs import make_cfg, records
from tests.replay import SGD

STEPS = 3
BODY_PARAMS = 6  # three Linear layers, a weight and a bias each: six buckets of one parameter


class Tied(nn.Module):
    """An embedding used at the start of forward and again as the output projection (GPT-2's tied ``wte``); its
    gradient is complete only when backward reaches the lookup, after every body layer's. ``late`` registers it
    after the body, so it is the first bucket in backward order; otherwise first, so it lands in the last bucket."""

    def __init__(self, late: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        if not late:
            self.emb = nn.Embedding(10, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        if late:
            self.emb = nn.Embedding(10, 8)
        self.double()

    def forward(self, tokens: Tensor) -> Tensor:
        return self.body(self.emb(tokens)) @ self.emb.weight.T


class Branch(nn.Module):
    """A branch registered last (the first two buckets) and used on even steps only: on odd steps its buckets never
    complete, and the body's buckets behind them wait for the end of backward (the engine does them there)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.extra = nn.Linear(8, 8)
        self.double()

    def forward(self, x: Tensor, step: int) -> Tensor:
        h = self.body(x)
        return h + self.extra(x) if step % 2 == 0 else h


def train_counting(rank: int, world_size: int, model: str, grad_clip_norm: float = 0.0) -> dict[str, Any]:
    """Train a few steps; the cumulative ``late_buckets`` after each, the warnings, and the bucket layout."""
    warnings: list[str] = []
    sink = logger.add(lambda message: warnings.append(message.record["message"]), level="WARNING")
    net = Branch() if model == "branch" else Tied(late=model == "late")
    engine = DecentralizedDataParallel(net, SGD, topology="ring", bucket_size_in_mb=0, grad_clip_norm=grad_clip_norm)
    counts = []
    for step in range(STEPS + 1 if model == "branch" else STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        if model == "branch":
            loss = engine(torch.randn(5, 8, generator=g, dtype=torch.float64), step=step).square().mean()
        else:
            loss = engine(torch.randint(0, 10, (5,), generator=g)).square().mean()
        loss.backward()
        counts.append(engine.late_buckets)
    logger.remove(sink)
    return {"counts": counts, "warnings": warnings, "names": engine.bucket_names}


def test_a_late_weight_in_the_first_bucket_holds_back_every_later_bucket() -> None:
    result = run_workers(train_counting, 2, "late")[0]
    assert result["names"][0] == ["emb.weight"] and len(result["names"]) == 1 + BODY_PARAMS
    # Every step: buckets 1..6 (the body's six parameters) have their gradients before the embedding's, which comes
    # last in backward; bucket 0 (the embedding) could not have gone earlier, so 6 buckets wait, on every step.
    assert result["counts"] == [BODY_PARAMS * (s + 1) for s in range(STEPS)]
    [warning] = result["warnings"]  # once, not once per step
    assert "'emb.weight'" in warning and "bucket 0 " in warning and f"{BODY_PARAMS} later buckets" in warning


def test_the_late_weight_in_the_last_bucket_holds_back_nothing() -> None:
    result = run_workers(train_counting, 2, "first")[0]
    assert result["names"][-1] == ["emb.weight"]
    assert result["counts"] == [0] * STEPS and result["warnings"] == []


def test_deferred_steps_wait_for_the_end_by_design_and_count_nothing() -> None:
    """Gradient clipping steps every bucket after backward (the global norm): no overlap was lost to the order."""
    result = run_workers(train_counting, 2, "late", 1.0)[0]
    assert result["counts"] == [0] * STEPS and result["warnings"] == []


def test_a_branch_unused_on_a_step_holds_back_the_buckets_behind_it() -> None:
    result = run_workers(train_counting, 2, "branch")[0]
    assert result["names"][:2] == [["extra.bias"], ["extra.weight"]]
    # Even steps use the branch (its gradients come first: nothing waits). Odd steps: buckets 0 and 1 never complete
    # (not counted: they could not have gone earlier), and the body's six (2..7) wait for the end of backward, but the
    # one that completes last (a parameter of body.0, backward's last gradient) would have updated then anyway: 5.
    late = BODY_PARAMS - 1
    assert result["counts"] == [0, late, late, 2 * late]
    [warning] = result["warnings"]
    assert "'extra.bias' of bucket 0 got no gradient" in warning and f"{late} later buckets (from 2)" in warning


def _train_with_late_buckets(rank: int, world: int, cfg: Any) -> None:
    """Train with an engine whose count grows by 3 per step (the recorder's arithmetic, not the engine's)."""
    Decentralized.late_buckets = lambda self: 3 * self.engine.step_count  # type: ignore[method-assign]
    train(cfg, Path(cfg.run.output_dir), torch.device("cpu"))


def test_the_record_holds_late_buckets_per_step(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, eval_every=0, steps=4, logger={"wandb": {"mode": "disabled"}})
    run_workers(_train_with_late_buckets, 2, cfg)
    logged = records(tmp_path)
    assert [(r["step"], r["engine/late_buckets_per_step"]) for r in logged] == [(2, 3.0), (4, 3.0)]
