"""Evaluation's collectives (audit R16): what ``ShardedFront.averaged()`` and ``evaluate`` send, counted by wrapping
``torch.distributed.all_reduce`` in the workers, and what they compute, against an oracle written here.

Two ranks form one replica of an FSDP2-sharded model (``parallel.shard=2``): FSDP2 leaves buffers whole, so the
evaluation's average takes every floating buffer over every rank (4 float32 BatchNorm statistics and a float64
buffer here); the integer ``num_batches_tracked`` stays each rank's own. Rank 0 has 5 evaluation batches, rank 1 has
3; their forwards gather parameters together, so rank 1 must run 5 too, its last 2 uncounted.

Counts: the buffers' average is one all-reduce per dtype (2; it was one per buffer: 5). An evaluation whose dataset
counts its batches (``eval_batch_count``, as the built-in ones do) is one MAX all-reduce of the counts before the
loop plus the sums' (2; it was one flag per batch and the last "done" flag: 6, plus the sums: 7); a dataset that
cannot say (None, the default) keeps the per-batch flags. Without a lockstep group (whole models) only the sums are
reduced. A count its batches do not match is refused.

Oracle: the model rebuilt here in float64 with the float64 mean of the ranks' buffers, run on every rank's batches
(each counted once), the sums combined by hand. A rank's repeated batch counted, or a buffer left unaveraged, moves
the loss far beyond the tolerance.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401 - imported before the workers fork: the device mesh imports it (slow)
import torch.distributed as dist
import torch.distributed.fsdp  # noqa: F401
from torch import Tensor, nn

from decent_train.components.data.base import Batch, Datasets
from decent_train.training.evaluator import evaluate
from decent_train.training.forward import Precision, cross_entropy

from .distributed import WorkerError, run_workers
from .jobs import make_cfg

D_IN, HIDDEN, CLASSES, ROWS = 6, 8, 5, 4
BATCHES = (5, 3)  # evaluation batches of rank 0 and rank 1
MISCOUNT = (0, 0)  # added to what rank 0's and rank 1's eval_batch_count say (a test of a wrong count sets it)
FLOAT_BUFFERS, DTYPES = 5, 2  # 4 float32 BatchNorm statistics and the float64 offset


class Net(nn.Module):
    """Linear, BatchNorm, Linear, BatchNorm, plus a float64 buffer added to the logits: buffers of two dtypes that
    all change the evaluation's result."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(D_IN, HIDDEN)
        self.norm = nn.BatchNorm1d(HIDDEN)
        self.second = nn.Linear(HIDDEN, CLASSES)
        self.out_norm = nn.BatchNorm1d(CLASSES)
        self.register_buffer("offset", torch.zeros(CLASSES, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        logits = self.out_norm(self.second(torch.relu(self.norm(self.first(x)))))
        return logits + self.offset.to(logits.dtype)


def _rank_buffers(rank: int) -> dict[str, Tensor]:
    """Rank ``rank``'s buffers before the average (as if each had normalized its own micro-batches)."""
    g = torch.Generator().manual_seed(1000 + rank)
    buffers = {}
    for name, size in (("norm", HIDDEN), ("out_norm", CLASSES)):
        buffers[f"{name}.running_mean"] = torch.randn(size, generator=g)
        buffers[f"{name}.running_var"] = torch.rand(size, generator=g) + 0.5
        buffers[f"{name}.num_batches_tracked"] = torch.tensor(10 + rank)
    buffers["offset"] = torch.randn(CLASSES, generator=g, dtype=torch.float64)
    return buffers


def _batches(rank: int) -> list[Batch]:
    """Rank ``rank``'s evaluation batches: ``BATCHES[rank]`` of them, the last one shorter."""
    g = torch.Generator().manual_seed(2000 + rank)
    sizes = [ROWS] * (BATCHES[rank] - 1) + [ROWS - 1] if BATCHES[rank] else []
    return [(torch.randn(n, D_IN, generator=g), torch.randint(CLASSES, (n,), generator=g)) for n in sizes]


class _Uneven(Datasets):
    """``_batches(rank)`` as the evaluation set, a generator as the built-in datasets' are, that counts its batches or,
    ``counted=False``, cannot say (the default ``eval_batch_count``)."""

    input_shape, num_classes, train_size = (D_IN,), CLASSES, 0

    def __init__(self, counted: bool) -> None:
        self.counted = counted

    def train_batches(self, batch_size: int, rank: int, world: int, seed: int, start: int = 0) -> Iterator[Batch]:
        raise NotImplementedError

    def eval_batches(self, batch_size: int, rank: int, world: int) -> Iterator[Batch]:
        yield from _batches(rank)

    def eval_batch_count(self, batch_size: int, rank: int, world: int) -> int | None:
        return BATCHES[rank] + MISCOUNT[rank] if self.counted else super().eval_batch_count(batch_size, rank, world)


class _Counted:
    """``torch.distributed.all_reduce`` wrapped: the calls made while ``counting``, by dtype and op."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.dtype, Any]] = []
        self.counting = False
        self.real = dist.all_reduce

        def all_reduce(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.counting:
                self.calls.append((tensor.dtype, kwargs.get("op", dist.ReduceOp.SUM)))
            return self.real(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce  # this forked worker only

    def __enter__(self) -> _Counted:
        self.calls, self.counting = [], True
        return self

    def __exit__(self, *exc: object) -> None:
        self.counting = False


def _worker(rank: int, world: int, run_dir: Path) -> dict[str, Any]:
    """Build the sharded front over ``Net``, set this rank's buffers, and count and keep what the average and
    three evaluations (batches counted, not counted, no lockstep group) do."""
    from decent_train.algorithms import algorithm_for
    from decent_train.components.optim import make_scheduler_fn

    cfg = make_cfg(run_dir, parallel={"shard": 2}, launch={"nproc_per_node": world},
                   topology={"local_world_size": world})
    device, precision = torch.device("cpu"), Precision(cfg.precision, torch.device("cpu"))
    net = Net()
    with torch.no_grad():
        for name, value in _rank_buffers(rank).items():
            net.get_buffer(name).copy_(value)
    algo = algorithm_for(cfg)(net, cfg, make_scheduler_fn(cfg.scheduler, 10, 10), precision.scaler, 0)
    out: dict[str, Any] = {"full": {n: p.full_tensor().clone() for n, p in net.named_parameters()}}
    counter = _Counted()
    with contextlib.ExitStack() as averaged:
        with counter:
            averaged.enter_context(algo.averaged())
        out["average_calls"] = list(counter.calls)
        out["averaged"] = {n: b.clone() for n, b in net.named_buffers()}
        for counted in (True, False):
            with counter:
                out[f"eval_counted={counted}"] = evaluate(net, cfg, _Uneven(counted), device, precision,
                                                          lockstep=algo.lockstep_group)
            out[f"eval_calls_counted={counted}"] = list(counter.calls)
    out["restored"] = {n: b.clone() for n, b in net.named_buffers()}
    with counter:
        algo.average()
    out["final_average_calls"] = list(counter.calls)
    with counter:
        evaluate(Net(), cfg, _Uneven(True), device, precision, lockstep=None)
    out["plain_calls"] = list(counter.calls)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_workers(_worker, 2, tmp_path_factory.mktemp("eval_collectives"))


def _oracle(full: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, float]]:
    """The floating buffers' float64 mean over the ranks, and the evaluation of the model with them (in float64) over
    every rank's batches, each counted once. Measured: counting rank 1's 2 repeats moves the loss 2.23 -> 2.07,
    rank 0's or rank 1's buffers alone to 2.19 or 3.22 (the tolerance: 1e-6 relative)."""
    ranks = [_rank_buffers(r) for r in range(len(BATCHES))]
    mean = {n: sum(b[n].double() for b in ranks) / len(ranks) for n in ranks[0] if ranks[0][n].is_floating_point()}
    model = Net().double().eval()
    with torch.no_grad():
        for name, value in {**full, **mean}.items():
            model.get_parameter(name).copy_(value) if name in full else model.get_buffer(name).copy_(value)
        loss = correct = count = 0.0
        for rank in range(len(BATCHES)):
            for x, y in _batches(rank):
                logits = model(x.double())
                loss += cross_entropy(logits, y, reduction="sum").item()
                correct += (logits.argmax(dim=-1) == y).sum().item()
                count += y.numel()
    return mean, {"eval/loss": loss / count, "eval/accuracy": correct / count}


def test_the_buffers_average_is_one_all_reduce_per_dtype(results: list[dict[str, Any]]) -> None:
    """The evaluation's average and the final one (FLOAT_BUFFERS buffers, DTYPES dtypes; one replica: the shards'
    average over the replicas sends nothing)."""
    for r in results:
        for calls in (r["average_calls"], r["final_average_calls"]):
            assert len(calls) == DTYPES, f"{len(calls)} all-reduces for {FLOAT_BUFFERS} buffers of {DTYPES} dtypes"
            assert sorted(str(dtype) for dtype, _ in calls) == ["torch.float32", "torch.float64"]


def test_a_sharded_evaluation_over_uneven_batches_is_two_all_reduces(results: list[dict[str, Any]]) -> None:
    """One MAX of the batch counts before the loop, then the sums: not one flag per batch."""
    for r in results:
        calls = r["eval_calls_counted=True"]
        assert len(calls) == 2, f"{len(calls)} all-reduces for {BATCHES} batches"
        assert calls == [(torch.int64, dist.ReduceOp.MAX), (torch.float64, dist.ReduceOp.SUM)]
        assert len(r["eval_calls_counted=False"]) == max(BATCHES) + 2  # no count: a flag per batch, and "done"
        assert r["plain_calls"] == [(torch.float64, dist.ReduceOp.SUM)]  # whole models: no lockstep


def test_the_averaged_buffers_are_the_float64_mean_and_are_put_back(results: list[dict[str, Any]]) -> None:
    mean, _ = _oracle(results[0]["full"])
    for rank, r in enumerate(results):
        for name, value in r["averaged"].items():
            want = mean[name].to(value.dtype) if name in mean else _rank_buffers(rank)[name]  # integers: its own
            assert torch.equal(value, want), name
        restored, own = r["restored"], _rank_buffers(rank)
        assert restored.keys() == own.keys() and all(torch.equal(restored[n], own[n]) for n in own)


def test_the_evaluation_is_the_oracles_on_every_rank(results: list[dict[str, Any]]) -> None:
    _, want = _oracle(results[0]["full"])
    for r in results:
        got = r["eval_counted=True"]
        assert got == r["eval_counted=False"]  # the per-batch path's result exactly
        assert got["eval/accuracy"] == want["eval/accuracy"]
        assert got["eval/loss"] == pytest.approx(want["eval/loss"], rel=1e-6, abs=0)
    assert results[0]["eval_counted=True"] == results[1]["eval_counted=True"]


def _without_batches(rank: int, world: int, run_dir: Path) -> None:
    global BATCHES
    BATCHES = (2, 0)  # this forked worker only
    _worker(rank, world, run_dir)


def test_a_rank_without_batches_beside_one_with_some_is_refused(tmp_path: Path) -> None:
    with pytest.raises(WorkerError, match="rank 1 has no evaluation batch while its replica's others do"):
        run_workers(_without_batches, 2, tmp_path, timeout=60.0)


def _miscounted(rank: int, world: int, run_dir: Path, miscount: tuple[int, int]) -> None:
    global MISCOUNT
    MISCOUNT = miscount  # this forked worker only
    _worker(rank, world, run_dir)


@pytest.mark.parametrize(("miscount", "message"), [
    ((0, 1), "rank 1's dataset counts 4 evaluation batches .* but yields only 3"),  # it would repeat one uncounted
    ((-1, 0), "rank 0's dataset counts 4 evaluation batches .* but yields more"),  # its 5th would go unevaluated
    ((0, -1), "rank 1's dataset counts 2 evaluation batches .* but yields more"),  # rank 0's count covers its 3rd
])
def test_a_count_the_batches_do_not_match_is_refused(tmp_path: Path, miscount: tuple[int, int], message: str) -> None:
    with pytest.raises(WorkerError, match=message):
        run_workers(_miscounted, 2, tmp_path, miscount, timeout=60.0)
