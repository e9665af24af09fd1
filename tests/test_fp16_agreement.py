"""fp16's overflow agreement (issue 38, audit D6): every rank enters the MAX all-reduce of the overflow flag, the ones
without a gradient in any bucket this step with a zero flag; a rank that skipped it would leave its peers waiting in
a collective it never enters (gloo: a hang until the timeout; NCCL: a mismatch with its next collective).

The agreement is driven with real gloo collectives between forked workers; the gradients are real backward passes
through the engine's buckets (accumulated, so that the engine does not step itself), one rank's buckets left empty.
The oracle is the hand computation: the agreed flag is the maximum over the ranks that have gradients, and a rank's
unscaled gradients are its scaled ones divided by the scale.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from loguru import logger

from decent_train.engine import DecentralizedDataParallel
from decent_train.engine.steps import BucketSteps
from tests.distributed import run_workers

SCALE = 2.0**10


def _agree(rank: int, world_size: int, inf_on: int | None, empty_on: int) -> dict:
    """Rank ``empty_on`` has no gradient in any bucket; rank ``inf_on`` (if any) has an infinite one. Both then run the
    deferred steps' agreement, twice (two steps), as ``_finish_backward`` does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000)
    ddp = DecentralizedDataParallel(model, lambda ps: torch.optim.SGD([p for _, p in ps], lr=0.1), scaler=scaler,
                                    bucket_size_in_mb=0, topology="complete")
    steps = BucketSteps(scaler, 0.0)
    flags, grads, scales, said = [], [], [], []
    sink = logger.add(lambda message: said.append(message.record["message"]), level="INFO")
    for step in range(2):
        if rank != empty_on:
            x = torch.ones(3, 4) * (float("inf") if rank == inf_on and step == 0 else 1.0)
            with ddp.no_sync():  # gradients into the buckets, no step of the engine's own
                scaler.scale(ddp(x).square().mean()).backward()
        else:
            scaler.scale(torch.zeros(()))  # its loss reached no parameter; the scaler still scaled it
        scaled = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        scales.append(scaler.get_scale())
        steps.prepare(ddp._buckets, ddp._members, step)
        unscaled = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        flags.append(steps.overflow)
        grads.append((scaled, unscaled))
        for bucket in ddp._buckets:
            bucket.optimizer.zero_grad(set_to_none=True)
        steps.end_step()
    logger.remove(sink)
    return {"flags": flags, "grads": grads, "scales": [*scales, scaler.get_scale()], "said": said}


@pytest.mark.parametrize("world_size,inf_on,empty_on", [(2, 0, 1), (2, None, 1), (3, 2, 0), (3, None, 1)])
def test_a_rank_without_gradients_still_agrees_on_overflow(world_size: int, inf_on: int | None, empty_on: int) -> None:
    results = run_workers(_agree, world_size, inf_on, empty_on, timeout=30)
    expected = [inf_on is not None, False]  # step 0 overflows on every rank if any rank's gradient is infinite
    for rank, result in enumerate(results):
        assert result["flags"] == expected, f"rank {rank}: {result['flags']}"
        # the cost is said once (audit R10), not at every step
        barrier = [line for line in result["said"] if "fp16 loss scaling agrees on overflow" in line]
        assert len(barrier) == 1 and f"across all {world_size} workers" in barrier[0], result["said"]
        # GradScaler.update read the agreed flag: the scale halves after an overflow on any rank, on every rank
        halved = SCALE / 2 if inf_on is not None else SCALE
        assert result["scales"] == [SCALE, halved, halved], f"rank {rank}: {result['scales']}"
        for step, (scaled, unscaled) in enumerate(result["grads"]):
            assert (not scaled) == (rank == empty_on)
            if expected[step]:
                continue  # overflowed: the step is skipped, the unscaled values do not matter
            for name, grad in scaled.items():
                torch.testing.assert_close(unscaled[name], grad / result["scales"][step], rtol=0, atol=0)
    # the ranks with gradients saw the same (finite) scaled gradients: one model, one batch
    holders = [r for r in range(world_size) if r != empty_on]
    for name, grad in results[holders[0]]["grads"][1][0].items():
        for rank in holders[1:]:
            torch.testing.assert_close(results[rank]["grads"][1][0][name], grad, rtol=0, atol=0)


class Gate(nn.Module):
    """A layer some steps skip: its output then reaches the input alone, and no parameter gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        return x * 1.0 if skip else self.linear(x)


def _no_parameter_in_the_graph(rank: int, world_size: int, detached: bool) -> list[int]:
    """Rank 1's second step gives no parameter a gradient: the layer is skipped (its loss reaches only the input), or
    ``detached``, the loss does not reach the engine's output at all."""
    torch.manual_seed(0)
    ddp = DecentralizedDataParallel(Gate(), lambda ps: torch.optim.SGD([p for _, p in ps], lr=0.1),
                                    bucket_size_in_mb=0, topology="complete")
    counts = []
    for it in range(3):
        x = torch.ones(3, 4, requires_grad=True)
        gap = rank == 1 and it == 1
        y = ddp(x, skip=gap and not detached)
        if gap and detached:
            y = y.detach() + 0 * x.sum()
        y.square().mean().backward()
        counts.append(ddp.step_count)
    return counts


def test_a_backward_without_parameter_gradients_still_steps() -> None:
    counts = run_workers(_no_parameter_in_the_graph, 2, False, timeout=30)
    assert counts[0] == counts[1] == [1, 2, 3]


@pytest.mark.xfail(strict=True, reason="a loss that does not reach the engine's output runs no hook of the engine in "
                   "its backward, so that rank takes no step (torch DDP has the same limit: the loss must come from "
                   "the wrapped model's output)")
def test_a_loss_detached_from_the_output_is_not_seen() -> None:
    counts = run_workers(_no_parameter_in_the_graph, 2, True, timeout=30)
    assert counts[0] == counts[1] == [1, 2, 3]
