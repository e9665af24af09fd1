"""Evaluation of the workers' average model: when, and how."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from decent_train.components.data import Batch, Datasets
from decent_train.config import TrainConfig
from decent_train.engine import reconfigure
from decent_train.engine.comm import peers_must_answer, run_collective
from decent_train.training.forward import Precision, cross_entropy
from decent_train.training.job import Job


@torch.no_grad()
def evaluate(
    net: nn.Module, cfg: TrainConfig, data: Datasets, device: torch.device, precision: Precision,
    before_reduce: Callable[[], None] = lambda: None, lockstep: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Loss and accuracy (next-token accuracy for tokens) on the whole evaluation set; each worker evaluates a
    disjoint slice and the sums are reduced. ``lockstep``: ranks whose forward passes pair up (a sharded model's
    replica, which gathers its parameters in each): they run as many as the one with the most batches, agreed on by
    one all-reduce before the loop where the dataset counts its batches (``eval_batch_count``), else by one per batch
    (``_in_lockstep``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    was_training = net.training
    net.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, count
    batches = data.device_eval_batches(cfg.eval_batch_size, rank, world, device=device, channels_last=cfg.channels_last)
    count = data.eval_batch_count(cfg.eval_batch_size, rank, world)
    for x, y, counts in _in_lockstep(batches, count, lockstep, device):
        with precision.autocast():
            logits = net(x)
        if counts:
            sums[0] += cross_entropy(logits.float(), y, reduction="sum").double()
            sums[1] += (logits.argmax(dim=-1) == y).sum()
            sums[2] += y.numel()
    before_reduce()  # live membership's fence: a member that died while evaluating stops nobody
    sums = sums.to(reconfigure.control_device(sums.device))  # over the default group: gloo beside a data group
    with peers_must_answer("the evaluation's all-reduce"):
        run_collective(dist.all_reduce, sums)
    net.train(was_training)
    loss, correct, count = sums.tolist()
    return {"eval/loss": loss / count, "eval/accuracy": correct / count}


def _in_lockstep(
    batches: Iterator[Batch], count: int | None, group: dist.ProcessGroup | None, device: torch.device
) -> Iterator[tuple[Tensor, Tensor, bool]]:
    """``(x, y, counts)`` per batch; with ``group``, as many as the rank of it with the most batches, a rank done early
    repeating its last batch with ``counts`` false. Given ``count`` (this rank's batches: ``eval_batch_count``), one
    MAX all-reduce of the counts before the loop and one host sync; None, one of each per batch
    (``_flagged_in_lockstep``). A count that ``batches`` do not match is an error."""
    if group is None:
        yield from ((x, y, True) for x, y in batches)
        return
    if count is None:
        yield from _flagged_in_lockstep(batches, group, device)
        return
    most = torch.tensor([count], dtype=torch.int64, device=device)
    run_collective(dist.all_reduce, most, op=dist.ReduceOp.MAX, group=group)
    last, seen = None, 0
    for _ in range(int(most.item())):  # the one host sync
        batch = next(batches, None)
        seen += batch is not None
        last, counts = _or_last(batch, last)
        yield (*last, counts)
    if seen != count or next(batches, None) is not None:  # unchecked, batches would go unevaluated or uncounted
        yields = f"only {seen}" if seen < count else "more"
        raise RuntimeError(f"rank {dist.get_rank()}'s dataset counts {count} evaluation batches (eval_batch_count) "
                           f"but yields {yields}")


def _flagged_in_lockstep(
    batches: Iterator[Batch], group: dist.ProcessGroup, device: torch.device
) -> Iterator[tuple[Tensor, Tensor, bool]]:
    """``_in_lockstep`` for batches of unknown number: until every rank is done, with one flag all-reduced (and read
    on the host) per batch."""
    last = None
    while True:
        batch = next(batches, None)
        more = torch.tensor([batch is not None], dtype=torch.int32, device=device)
        run_collective(dist.all_reduce, more, op=dist.ReduceOp.MAX, group=group)
        if not more.item():
            return
        last, counts = _or_last(batch, last)
        yield (*last, counts)


def _or_last(batch: Batch | None, last: Batch | None) -> tuple[Batch, bool]:
    """``batch``, counted; None (this rank has run out while its replica's others have not): its last batch again,
    not counted."""
    if batch is not None:
        return batch, True
    if last is None:
        raise RuntimeError(f"rank {dist.get_rank()} has no evaluation batch while its replica's others do: use at "
                           "least one evaluation sample per worker")
    return last, False


class Evaluator:
    """Evaluates the global average of the workers' models every ``eval_every`` steps and after the last."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def should_evaluate(self, step: int) -> bool:
        every = self.job.cfg.eval_every
        return step == self.job.total_steps or (every > 0 and step % every == 0)

    def evaluate(self) -> dict[str, float]:
        """Every rank calls it at the same step: the average is formed, evaluated, and the local models restored."""
        job = self.job
        with job.algo.averaged():
            return evaluate(job.algo.net, job.cfg, job.data, job.device, job.precision, before_reduce=job.fence,
                            lockstep=job.algo.lockstep_group)
