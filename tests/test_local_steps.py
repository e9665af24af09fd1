"""DiLoCo and LocalSGD over the user's optimizer (algorithms/local_steps.py) against a float64 single-process replay
of the formulas in the module's docstring, with dense mixing matrices (Topology.mixing_matrix)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from decent_train import DiLoCo, LocalSGD
from tests.distributed import run_workers
from tests.replay import loss_fn, make_model, topology_for

INNER_STEPS = 9


def _inner(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)


def _outer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _train(rank: int, world_size: int, topology: str, sync_every: int, local_sgd: bool) -> list[torch.Tensor]:
    """The user's loop with the two lines of the front; worker 0..n-1 start from different seeds (rank 0's wins)."""
    model = make_model(seed=rank)
    inner = _inner(model.parameters())
    front = (LocalSGD(model, inner, sync_every=sync_every, topology=topology) if local_sgd
             else DiLoCo(model, inner, _outer(model.parameters()), sync_every=sync_every, topology=topology))
    with front:
        for step in range(INNER_STEPS):
            loss_fn(model, rank, step).backward()
            inner.step()
            inner.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _replay(world_size: int, topology: str, sync_every: int, local_sgd: bool) -> list[list[torch.Tensor]]:
    """Every worker in one process, in float64: inner steps on each worker's batches; every sync_every-th step the
    outer step of round k with the dense W of the topology."""
    start = make_model(seed=0)
    models = [make_model(seed=0) for _ in range(world_size)]
    for m in models:
        m.load_state_dict(start.state_dict())
    inners = [_inner(m.parameters()) for m in models]
    outers = [_outer(m.parameters()) for m in models]
    anchors = [[p.detach().clone() for p in m.parameters()] for m in models]
    built, outer_step = topology_for(topology, world_size), 0
    for step in range(INNER_STEPS):
        for rank, (m, opt) in enumerate(zip(models, inners)):
            loss_fn(m, rank, step).backward()
            opt.step()
            opt.zero_grad()
        if (step + 1) % sync_every:
            continue
        w = built.mixing_matrix(outer_step)
        xs = [[p.detach().clone() for p in m.parameters()] for m in models]
        with torch.no_grad():
            for i, m in enumerate(models):
                for k, p in enumerate(m.parameters()):
                    wx = sum(w[i, j] * xs[j][k] for j in range(world_size))
                    if local_sgd:
                        p.copy_(wx)
                        continue
                    a = sum(w[i, j] * anchors[j][k] for j in range(world_size))
                    g = sum(w[i, j] * (anchors[j][k] - xs[j][k]) for j in range(world_size))
                    p.copy_(a)
                    p.grad = g
        if not local_sgd:
            for opt in outers:
                opt.step()
                opt.zero_grad(set_to_none=True)
        anchors = [[p.detach().clone() for p in m.parameters()] for m in models]
        outer_step += 1
    return [[p.detach() for p in m.parameters()] for m in models]


@pytest.mark.parametrize("local_sgd", [False, True], ids=["diloco", "localsgd"])
@pytest.mark.parametrize("topology, world_size", [("complete", 4), ("ring", 4), ("one-peer-exp", 4), ("ring", 5)])
def test_every_worker_matches_the_replay(topology: str, world_size: int, local_sgd: bool) -> None:
    """9 inner AdamW steps, an outer step after every 3rd (Nesterov SGD, lr 0.7): 3 outer steps, rounds 0, 1, 2."""
    engine = run_workers(_train, world_size, topology, 3, local_sgd)
    expected = _replay(world_size, topology, 3, local_sgd)
    deviation = max((a - b).abs().max().item() for got, want in zip(engine, expected) for a, b in zip(got, want))
    assert deviation <= 1e-9
    if topology != "complete":  # the replay tells gossip from all-reduce: the workers differ
        assert any((a - b).abs().max() > 1e-6 for other in engine[1:] for a, b in zip(engine[0], other))


def test_wrong_arguments_are_one_line() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"sync_every=0: must be a positive integer"):
        DiLoCo(model, _inner(model.parameters()), _outer(model.parameters()), sync_every=0)
    with pytest.raises(ValueError, match=r"the outer optimizer must be built over the model's parameters"):
        DiLoCo(model, _inner(model.parameters()), _outer([nn.Parameter(torch.zeros(1))]), sync_every=2)


@pytest.mark.slow
def test_a_script_with_its_own_optimizer_adopts_diloco_with_two_lines() -> None:
    """tests/user_scripts/own_optimizer.py (AdamW and a cosine schedule of its own, ``inner.step()`` as usual) under
    torchrun on 4 workers, ring gossip outer steps: every rank exits 0 and the loss falls."""
    script = Path(__file__).parent / "user_scripts" / "own_optimizer.py"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, final = (float(v) for v in re.search(r"first loss ([\d.]+) final loss ([\d.]+)", proc.stdout).groups())
    assert final < 0.5 * first


def _resumed(rank: int, world_size: int, stop: int, total: int) -> dict[str, list[torch.Tensor]]:
    """Train ``total`` steps straight, and again stopping after ``stop`` steps, checkpointing (model, inner optimizer,
    front), then resuming in fresh objects: the parameters of both."""

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, DiLoCo]:
        model = make_model(seed=seed)
        inner = _inner(model.parameters())
        return model, inner, DiLoCo(model, inner, _outer(model.parameters()), sync_every=2, topology="ring")

    def run(model: nn.Module, inner: torch.optim.Optimizer, front: DiLoCo, steps: range) -> None:
        with front:
            for step in steps:
                loss_fn(model, rank, step).backward()
                inner.step()
                inner.zero_grad()

    model, inner, front = build(rank)
    run(model, inner, front, range(total))
    straight = [p.detach().clone() for p in model.parameters()]
    model, inner, front = build(rank)
    run(model, inner, front, range(stop))
    saved = [model.state_dict(), inner.state_dict(), front.state_dict()]
    model, inner, front = build(100 + rank)  # other weights, fresh optimizers: all from the checkpoint
    model.load_state_dict(saved[0])
    inner.load_state_dict(saved[1])
    front.load_state_dict(saved[2])
    run(model, inner, front, range(stop, total))
    return {"straight": straight, "resumed": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("stop", [3, 4])  # between outer steps; right after one
def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(stop: int) -> None:
    for result in run_workers(_resumed, 4, stop, 9):
        assert all(torch.equal(a, b) for a, b in zip(result["straight"], result["resumed"]))
