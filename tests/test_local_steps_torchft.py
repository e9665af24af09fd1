"""DiLoCo with ``topology="complete"`` is DiLoCo as torchft defines it (issue 28, acceptance 2), plain and streamed.

The oracle is torchft's update rule replayed by hand (float64, every replica in one process), written from torchft's
``local_sgd.py`` (0.2.0; docs/design/torchft-local-sgd.md), not from the front's formula: with one shared counter,
fragment f = (syncs so far) % F is prepared after inner step P − τ of each period of P = sync_every / F steps and
performed after step P::

    prepare:  Δ̄ = (1/N) Σ_r (anchor_r − x_r)           (all-reduce SUM, then / N)
    perform:  local = x;  x <- anchor;  x.grad = Δ̄;  outer_f.step();  anchor <- x;  x <- lerp(x, local, α)

with one outer optimizer per fragment (torchft's list form: each steps its fragment alone, as the front's one outer
optimizer does). Where torchft installs, the front is also checked against ``torchft.local_sgd.DiLoCo`` itself, one
replica per process with its real Manager, a gloo process group and a lighthouse (skipped where it is absent).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from decent_train import DiLoCo
from tests.distributed import run_workers
from tests.replay import loss_fn, make_model

WORLD = 4
STEPS = 20
TOLERANCE = 1e-9  # float64: sums in another order only
WRONG = 1e-3  # a wrong variant of the rule deviates by more (measured below in each test's assertions)
HAS_TORCHFT = importlib.util.find_spec("torchft") is not None  # not imported here: only in the forked workers


def _inner(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)


def _outer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _whole(model: nn.Module) -> list[nn.Module]:
    """Plain DiLoCo: torchft's ``model_fragments=[model]``."""
    return [model]


def _layers(model: nn.Module) -> list[nn.Module]:
    """Streaming: make_model's three Linear layers (144, 272 and 68 elements), torchft's list of fragments."""
    return [model[0], model[2], model[4]]


FRAGMENTS: dict[str, Callable[[nn.Module], list[nn.Module]]] = {"whole": _whole, "layers": _layers}

# (fragments, sync_every, fragment_sync_delay τ, fragment_update_alpha α); 20 inner steps each
CASES = [
    ("whole", 5, 0, 0.0),  # DiLoCo: 4 outer steps
    ("whole", 5, 2, 0.5),  # one fragment, its exchange overlapping 2 inner steps, α-mixed
    ("layers", 6, 0, 0.0),  # 3 fragments, one synced every 2 steps: each 3 or 4 times
    ("layers", 6, 1, 0.5),
    ("layers", 9, 2, 0.25),  # P = 3, τ = 2: the last exchange (after step 19) is still in flight at the end
]


def _replay(fragments: str, sync_every: int, delay: int, alpha: float, steps: int = STEPS,
            variant: str = "exact") -> list[list[torch.Tensor]]:
    """torchft's DiLoCo by hand (see the module) for WORLD replicas from the same initial parameters (rank 0's).
    ``variant``: ``exact``; ``anchor_after_merge`` (the new anchor taken after the α-mix instead of before it);
    ``delta_at_perform`` (Δ from the parameters after step P, not P − τ)."""
    models = [make_model(seed=0) for _ in range(WORLD)]
    inners = [_inner(m.parameters()) for m in models]
    parts = [[list(module.parameters()) for module in FRAGMENTS[fragments](m)] for m in models]  # [replica][f]
    outers = [[_outer(params) for params in replica] for replica in parts]
    anchors = [[[p.detach().clone() for p in params] for params in replica] for replica in parts]
    count = len(parts[0])
    period = sync_every // count
    local_step, manager_step, pending = 0, 0, None
    for step in range(steps):
        for rank, (m, opt) in enumerate(zip(models, inners)):
            loss_fn(m, rank, step).backward()
            opt.step()
            opt.zero_grad()
        local_step += 1  # the post hook, identical on every replica
        f = manager_step % count
        prepare_at = period if variant == "delta_at_perform" else period - delay
        if local_step == prepare_at:
            with torch.no_grad():
                deltas = [[a - p for a, p in zip(anchors[r][f], parts[r][f])] for r in range(WORLD)]
                pending = [torch.stack([d[k] for d in deltas]).sum(0) / WORLD for k in range(len(deltas[0]))]
        if local_step < period:
            continue
        for r in range(WORLD):
            with torch.no_grad():
                local = [p.detach().clone() for p in parts[r][f]]
                for p, a, g in zip(parts[r][f], anchors[r][f], pending):
                    p.copy_(a)
                    p.grad = g.clone()
            outers[r][f].step()
            with torch.no_grad():
                if variant != "anchor_after_merge":
                    anchors[r][f] = [p.detach().clone() for p in parts[r][f]]
                for p, kept in zip(parts[r][f], local):
                    p.lerp_(kept, alpha)
                if variant == "anchor_after_merge":
                    anchors[r][f] = [p.detach().clone() for p in parts[r][f]]
            outers[r][f].zero_grad()
        manager_step, local_step, pending = manager_step + 1, 0, None
    return [[p.detach().clone() for p in m.parameters()] for m in models]


def _front(rank: int, fragments: str, sync_every: int, delay: int, alpha: float) -> list[torch.Tensor]:
    """This worker's run through decent-train's front, topology="complete" (rank 0's initial parameters win)."""
    model = make_model(seed=rank)
    inner = _inner(model.parameters())
    split: int | list[nn.Module] = 1 if fragments == "whole" else FRAGMENTS[fragments](model)
    with DiLoCo(model, inner, _outer(model.parameters()), sync_every=sync_every, topology="complete",
                fragments=split, fragment_sync_delay=delay, fragment_update_alpha=alpha):
        for step in range(STEPS):
            loss_fn(model, rank, step).backward()
            inner.step()
            inner.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _front_worker(rank: int, world_size: int, *case: Any) -> list[torch.Tensor]:
    return _front(rank, *case)


def _deviation(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> float:
    return max((a - b).abs().max().item() for g, w in zip(got, want) for a, b in zip(g, w))


@pytest.mark.parametrize("fragments, sync_every, delay, alpha", CASES)
def test_complete_is_torchfts_diloco(fragments: str, sync_every: int, delay: int, alpha: float) -> None:
    """Acceptance 2: every worker of the front within 1e-9 of torchft's rule replayed by hand (and, for plain DiLoCo
    ending on an outer step, all equal: an all-reduce). The replay tells torchft's choices apart: with the Δ taken at perform time instead of P − τ, or the
    anchor taken after the α-mix, it is > 1e-3 away where τ > 0 or α > 0 (it would not pass a front that did so)."""
    workers = run_workers(_front_worker, WORLD, fragments, sync_every, delay, alpha)
    deviation = _deviation(workers, _replay(fragments, sync_every, delay, alpha))
    assert deviation <= TOLERANCE, f"the front is {deviation:.3g} from torchft's rule"
    if fragments == "whole" and not alpha and STEPS % sync_every == 0:  # the run ends on an all-reduced outer step
        assert _deviation(workers, [workers[0]] * WORLD) <= TOLERANCE
    if delay:
        assert _deviation(workers, _replay(fragments, sync_every, delay, alpha, variant="delta_at_perform")) > WRONG
    if alpha:
        assert _deviation(workers, _replay(fragments, sync_every, delay, alpha, variant="anchor_after_merge")) > WRONG


# -- against torchft itself ---------------------------------------------------------------------------------------

def _torchft_and_front(rank: int, world_size: int, fragments: str, sync_every: int, delay: int,
                       alpha: float) -> dict[str, list[torch.Tensor]]:
    """Replica ``rank`` of torchft's DiLoCo (its own Manager: a replica group of one process, a gloo process group,
    rank 0 hosting the lighthouse; every replica from the same initial parameters, so no healing: init_sync=False),
    then the same run through the front. Both parameter lists."""
    from torchft._torchft import LighthouseServer
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=world_size) if rank == 0 else None
    address = [lighthouse.address() if lighthouse is not None else None]
    dist.broadcast_object_list(address, src=0)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # this replica group's
    wait = timedelta(seconds=60)
    manager = Manager(pg=ProcessGroupGloo(timeout=wait), load_state_dict=None, state_dict=None,
                      min_replica_size=world_size, use_async_quorum=False, replica_id=f"replica{rank}",
                      store_addr="localhost", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=address[0], hostname="localhost", init_sync=False, timeout=wait,
                      quorum_timeout=wait, connect_timeout=wait)
    model = make_model(seed=0)
    inner = _inner(model.parameters())
    modules = FRAGMENTS[fragments](model)
    outers = [_outer(module.parameters()) for module in modules]
    try:
        with TorchftDiLoCo(manager, modules, inner, outers, sync_every=sync_every, fragment_sync_delay=delay,
                           fragment_update_alpha=alpha):
            for step in range(STEPS):
                loss_fn(model, rank, step).backward()
                inner.step()
                inner.zero_grad()
        committed = manager.current_step()
    finally:
        manager.shutdown(wait=False)
    dist.barrier()
    if lighthouse is not None:
        lighthouse.shutdown()
    assert committed == (STEPS // (sync_every // len(modules))), f"torchft committed {committed} syncs"
    return {"torchft": [p.detach().clone() for p in model.parameters()],
            "front": _front(rank, fragments, sync_every, delay, alpha)}


@pytest.mark.skipif(not HAS_TORCHFT, reason="torchft is not installed (pip install torchft==0.2.0): the by-hand "
                    "replay of its rule (test_complete_is_torchfts_diloco) stands in for it")
@pytest.mark.parametrize("fragments, sync_every, delay, alpha", [CASES[0], CASES[3]])
def test_complete_equals_torchft_itself(fragments: str, sync_every: int, delay: int, alpha: float) -> None:
    """torchft's own ``DiLoCo`` with 4 replicas (one per process) and the front on the same data: every replica's
    parameters within 1e-9 of the front's, and of the by-hand replay (which this checks against torchft itself)."""
    results = run_workers(_torchft_and_front, WORLD, fragments, sync_every, delay, alpha, timeout=180)
    torchft = [result["torchft"] for result in results]
    assert _deviation([result["front"] for result in results], torchft) <= TOLERANCE
    assert _deviation(_replay(fragments, sync_every, delay, alpha), torchft) <= TOLERANCE
