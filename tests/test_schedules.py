"""Algorithm schedules: the engine's gradient all-reduce mode, switching modes and topologies at step boundaries,
hierarchical (staged) gossip and periodic global averaging.

Oracles: torch DDP for the all-reduce mode; the single-process replay (tests/replay.py) for everything else; a mixing
matrix built by hand for the hierarchical topology.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from torch import nn

from decent_train import (
    DecentralizedDataParallel,
    build_topology,
    lr_scheduler_fn_cosine_with_warmup,
    optim_fn_adam,
    optim_fn_sgd,
)
from tests.distributed import run_workers
from tests.replay import SEED, loss_fn, make_model, max_deviation, replay, snapshot, topology_for, train_engine

TOL = 1e-12
STEPS = 12
ADAM = partial(optim_fn_adam, lr=0.01, weight_decay=0.01)
SCHEDULE = partial(lr_scheduler_fn_cosine_with_warmup, t_max=STEPS, t_warmup=3)


# -- all-reduce mode against torch DDP ------------------------------------------------------------------------------
def _allreduce_against_ddp(rank: int, world: int, optim: str, clip: float) -> dict[str, Any]:
    optim_fn = ADAM if optim == "adam" else partial(optim_fn_sgd, lr=0.05, momentum=0.9, weight_decay=1e-3)
    ours = DecentralizedDataParallel(make_model(SEED + rank), optim_fn, SCHEDULE, topology="allreduce",
                                     bucket_size_in_mb=0.0005, grad_clip_norm=clip)
    reference_model = make_model(SEED + rank)
    reference = nn.parallel.DistributedDataParallel(reference_model, bucket_cap_mb=0.0005)
    optimizer = optim_fn(list(reference_model.named_parameters()))
    scheduler = SCHEDULE(optimizer)
    for s in range(STEPS):  # every worker its own batches: the mean gradient differs from each worker's
        loss_fn(ours, rank, s).backward()
        optimizer.zero_grad()
        loss_fn(reference, rank, s).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(reference_model.parameters(), clip)
        optimizer.step()
        scheduler.step()
    start = make_model(SEED)
    return {
        "buckets": len(ours.bucket_names),
        "deviation": max((a - b).abs().max().item() for a, b in zip(ours.parameters(), reference_model.parameters())),
        "moved": max((a - b).abs().max().item() for a, b in zip(ours.parameters(), start.parameters())),
    }


@pytest.mark.parametrize(("optim", "world", "clip"), [("adam", 2, 0.0), ("adam", 3, 0.0), ("sgd", 4, 0.05)])
def test_allreduce_mode_matches_torch_ddp(optim: str, world: int, clip: float) -> None:
    for rank, result in enumerate(run_workers(_allreduce_against_ddp, world, optim, clip)):
        assert result["buckets"] >= 3, "the test model must span several buckets"
        assert result["moved"] > 1e-3
        assert result["deviation"] <= TOL, f"rank {rank}"


def test_allreduce_mode_keeps_workers_equal_and_differs_from_gossip() -> None:
    """The oracle can tell the modes apart: the same steps with ring gossip end elsewhere."""
    world = 4
    reduced = run_workers(train_engine, world, topology="allreduce", steps=STEPS, optim_fn=ADAM)
    expected = replay(topology_for("ring", world), STEPS, optim_fn=ADAM, phases={0: None})
    assert max_deviation(reduced, expected) <= TOL
    for other in reduced[1:]:
        assert all(torch.equal(other["params"][k], reduced[0]["params"][k]) for k in other["params"])
    gossip = replay(topology_for("ring", world), STEPS, optim_fn=ADAM)
    assert max_deviation(reduced, gossip) > 1e-6


# -- switching ------------------------------------------------------------------------------------------------------
SWITCHES = {
    "allreduce-ring-allreduce": ("allreduce", {4: "ring", 9: "allreduce"}),
    "ring-onepeer-ring": ("ring", {3: "one-peer-exp", 6: "ring"}),  # gossip to gossip: an exchange is in flight
    "complete-allreduce-ring": ("complete", {5: "allreduce", 8: "ring"}),
}


@pytest.mark.parametrize("switches", list(SWITCHES))
def test_switching_matches_the_replay_of_the_phases(switches: str) -> None:
    world = 4
    first, phases = SWITCHES[switches]
    common = dict(optim_fn=ADAM, lr_scheduler_fn=SCHEDULE)  # Adam's moments and the schedule must carry over
    engine = run_workers(train_engine, world, topology=first, steps=STEPS, phases=phases, **common)
    as_topology = {s: None if name == "allreduce" else topology_for(name, world) for s, name in phases.items()}
    if first == "allreduce":
        as_topology[0] = None
    start = topology_for("ring" if first == "allreduce" else first, world)
    expected = replay(start, STEPS, phases=as_topology, **common)
    assert all(r["step"] == STEPS for r in engine)
    assert max_deviation(engine, expected) <= TOL
    # The phases matter: without them (or with fresh optimizers) the parameters end elsewhere.
    assert max_deviation(engine, replay(start, STEPS, **common)) > 1e-6


def _switch_mid_backward(rank: int, world: int) -> str:
    ddp = DecentralizedDataParallel(make_model(SEED), ADAM, topology="ring", bucket_size_in_mb=0.0005)
    loss = loss_fn(ddp, rank, 0)
    try:
        ddp.switch_to("allreduce")
    except RuntimeError as error:
        loss.backward()
        return str(error)
    return "no error"


def test_switch_between_forward_and_backward_is_refused() -> None:
    assert all("between steps" in message for message in run_workers(_switch_mid_backward, 2))


# -- hierarchical gossip --------------------------------------------------------------------------------------------
def _hand_hierarchical(nodes: int, local: int, round_: int) -> torch.Tensor:
    """Round k by hand: local rank j of node a averages with local rank j of node a XOR 2^((k + j) mod log2 N), then
    each node averages its workers."""
    n, dims = nodes * local, nodes.bit_length() - 1
    between = torch.zeros(n, n, dtype=torch.float64)
    for a in range(nodes):
        for j in range(local):
            partner = a ^ (1 << ((round_ + j) % dims))
            between[a * local + j, a * local + j] = between[a * local + j, partner * local + j] = 0.5
    within = torch.block_diag(*[torch.full((local, local), 1.0 / local, dtype=torch.float64)] * nodes)
    return within @ between


@pytest.mark.parametrize(("nodes", "local"), [(2, 2), (4, 2), (4, 3), (8, 1)])
def test_hierarchical_round_is_the_stage_product_built_by_hand(nodes: int, local: int) -> None:
    topology = build_topology("hierarchical", nodes * local, local)
    assert topology.period == nodes.bit_length() - 1
    for r in range(topology.period):
        torch.testing.assert_close(topology.mixing_matrix(r), _hand_hierarchical(nodes, local, r), rtol=0, atol=1e-15)
        assert topology.async_stage(r) == 0  # the exchange between nodes is the one overlapped


def test_hierarchical_needs_a_power_of_two_number_of_nodes() -> None:
    with pytest.raises(ValueError, match="power-of-two number of nodes .* got 3 nodes"):
        build_topology("hierarchical", 6, 2)


@pytest.mark.parametrize(("world", "local", "kwargs"), [(4, 2, {}), (8, 2, {}), (4, 2, {"param_as_bucket_view": False})])
def test_hierarchical_engine_matches_the_replay(world: int, local: int, kwargs: dict) -> None:
    common = dict(optim_fn=ADAM, adaptive_factor=0.7)
    engine = run_workers(train_engine, world, topology="hierarchical", steps=STEPS, local_world_size=local,
                         **common, **kwargs)
    topology = topology_for("hierarchical", world, local)
    assert max_deviation(engine, replay(topology, STEPS, **common)) <= TOL
    # Applying only the first stage (the exchange between nodes) ends elsewhere.
    first_stage_only = topology_for("hierarchical", world, local)
    first_stage_only.stages = [stages[:1] for stages in first_stage_only.stages]
    assert max_deviation(engine, replay(first_stage_only, STEPS, **common)) > 1e-6


def test_a_custom_topology_with_the_slow_stage_in_the_middle_matches_the_replay() -> None:
    """Within the node, between nodes, within again: the middle stage is the one in flight."""
    from decent_train import Edge, Topology

    class WithinBetweenWithin(Topology):
        def _get_topo_stages(self):
            within = [Edge([0, 1]), Edge([2, 3])]
            return [[within, [Edge([0, 2]), Edge([1, 3])], within], [within, [Edge([0, 3]), Edge([1, 2])], within]]

    topology = WithinBetweenWithin(local_world_size=2, world_size=4)
    assert [topology.async_stage(r) for r in range(2)] == [1, 1]
    engine = run_workers(train_engine, 4, topology=WithinBetweenWithin, steps=STEPS, local_world_size=2,
                         optim_fn=ADAM)
    assert max_deviation(engine, replay(topology, STEPS, optim_fn=ADAM)) <= TOL


# -- periodic global averaging --------------------------------------------------------------------------------------
@pytest.mark.parametrize("topology", ["ring", "hierarchical"])
def test_global_avg_every_matches_the_replay(topology: str) -> None:
    engine = run_workers(train_engine, 4, topology=topology, steps=STEPS, global_avg_every=4, local_world_size=2,
                         optim_fn=ADAM)
    expected = replay(topology_for(topology, 4, 2), STEPS, optim_fn=ADAM, global_avg_every=4)
    assert max_deviation(engine, expected) <= TOL
    assert max_deviation(engine, replay(topology_for(topology, 4, 2), STEPS, optim_fn=ADAM)) > 1e-6


def _state_across_a_hierarchical_step(rank: int, world: int) -> dict[str, Any]:
    def engine(seed: int) -> DecentralizedDataParallel:
        return DecentralizedDataParallel(make_model(seed), ADAM, topology="hierarchical", local_world_size=2,
                                         bucket_size_in_mb=0.0005)

    old = engine(SEED + rank)
    for s in range(5):
        loss_fn(old, rank, s).backward()
    model_state = {k: v.clone() for k, v in old.state_dict().items()}
    engine_state = old.engine_state_dict()
    new = engine(7 + rank)
    new.load_state_dict(model_state)
    new.load_engine_state_dict(engine_state)
    for s in range(5, STEPS):
        loss_fn(new, rank, s).backward()
    return {"params": snapshot(new)}


def test_hierarchical_engine_state_continues_exactly() -> None:
    """The exchange in flight holds the stages' partial result as well as what was received."""
    results = run_workers(_state_across_a_hierarchical_step, 8)
    assert max_deviation(results, replay(topology_for("hierarchical", 8, 2), STEPS, optim_fn=ADAM)) <= TOL
