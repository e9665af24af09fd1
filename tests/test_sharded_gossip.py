"""Per-step gossip over the user's optimizer (algorithms/step_gossip.py, ``Gossip``) on FSDP2-sharded and whole
models, against a float64 single-process replay written here from the front's formula (issue 30, acceptance 1).

The oracle (``_replay``): R plain, unsharded copies of the model, all with replica 0's initial parameters (the
workers start from a different one per replica: the front must broadcast), one ``torch.optim.AdamW`` each (weight
decay on). At step s = 0, 1, ..., replica r:

    g_r = ∇ of the mean loss over its K ranks' micro-batches, concatenated, at x_r^s   (summed over micro-batches
          when accumulating)
    x_r <- Σ_q W_rq x_q^s        for s >= 1, W = the ring's round s − 1 over the R replicas (no mix at step 0)
    x_r <- AdamW's step from there with g_r

so x^{s+1} = AdamW(W x^s, ∇f(x^s)). With a mesh (R, K) replica r is ranks r*K .. r*K+K-1, each holding a shard
(uneven: 7 and 3 rows over 2 or 3 ranks, and once 2 rows over 3, leaving one rank none); FSDP2 averages the
gradient over them, and every rank's gathered model must equal its replica's replay within 1e-10. Without a mesh
K = 1. The engine (``DecentralizedDataParallel``: mix, step, launch inside backward) mixes at step s with round s,
not s − 1, so it is compared on the ring of 2 only, whose two rounds are the same pair.

The replay tells wrong fronts apart (``test_wrong_replays_are_far_from_the_runs``): replays that mix after the
optimizer step (x^{s+1} = W AdamW(x^s)), never, or with round s instead of s − 1 are more than WRONG away."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from decent_train import DecentralizedDataParallel, build_topology
from decent_train.algorithms.step_gossip import Gossip
from tests.distributed import run_workers

STEPS = 6
ROWS = 3  # rows of one rank's micro-batch
D_IN, HIDDEN, D_OUT = 5, 7, 3  # 7 and 3 rows: uneven shards over 2 or 3 ranks
LR, WEIGHT_DECAY = 0.05, 0.1
TOLERANCE = 1e-10  # float64: the workers and the replay differ by round-off only
WRONG = 1e-3  # a wrong replay is farther than this from the runs
VARIANTS = ("mix_after_step", "never_mix", "round_s")  # wrong fronts the replay must tell apart


class Net(nn.Module):
    """Two Linear blocks and a LayerNorm between them (each a separate FSDP2 unit when sharded), in float64."""

    def __init__(self, seed: int, d_out: int = D_OUT):
        super().__init__()
        torch.manual_seed(seed)
        self.first = nn.Linear(D_IN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.second = nn.Linear(HIDDEN, d_out)
        with torch.no_grad():  # LayerNorm starts at ones and zeros everywhere: make its init differ by seed too
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.tanh(self.norm(self.first(x))))


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def _batch(rank: int, step: int, micro: int = 0, d_out: int = D_OUT) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s micro-batch ``micro`` of step ``step`` (deterministic)."""
    g = torch.Generator().manual_seed(7919 * rank + 101 * step + micro)
    return (torch.randn(ROWS, D_IN, generator=g, dtype=torch.float64),
            torch.randn(ROWS, d_out, generator=g, dtype=torch.float64))


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return ((model(x) - y) ** 2).mean()


def _replay(topology: str, replicas: int, shard: int, steps: int = STEPS,
            micro_batches: int = 1, d_out: int = D_OUT, variant: str = "exact") -> list[dict[str, Tensor]]:
    """Each replica's parameters after ``steps`` steps of the module's formula (one process, float64); ``variant``:
    the exact formula, or one of the wrong ``VARIANTS``."""
    models = [Net(seed=0, d_out=d_out) for _ in range(replicas)]
    optimizers = [_optimizer(m.parameters()) for m in models]
    built = build_topology(topology, replicas)

    def mix(s: int) -> None:
        w = built.mixing_matrix(s if variant == "round_s" else s - 1)
        with torch.no_grad():
            for params in zip(*(m.parameters() for m in models)):
                mixed = torch.einsum("ij,j...->i...", w, torch.stack(params))
                for p, new in zip(params, mixed):
                    p.copy_(new)

    for s in range(steps):
        for r, (m, opt) in enumerate(zip(models, optimizers)):
            opt.zero_grad(set_to_none=True)
            for micro in range(micro_batches):
                parts = [_batch(r * shard + k, s, micro, d_out) for k in range(shard)]
                _loss(m, torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])).backward()
        if s >= 1 and variant in ("exact", "round_s"):
            mix(s)
        for opt in optimizers:
            opt.step()
        if variant == "mix_after_step":
            mix(s + 1)
    return [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]


def _deviation(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max((got[n] - want[n]).abs().max().item() for n in want)


# -- sharded: FSDP2 over a (replicate, shard) mesh -------------------------------------------------------------


def _sharded(rank: int, world_size: int, replicas: int, shard: int, micro_batches: int,
             d_out: int) -> dict[str, Any]:
    """One rank of replica ``rank // shard``: FSDP2 over the mesh's shard dimension, ``Gossip`` over the ring of
    replicas; its full parameters at the end (gathered in its replica), the front's bytes and its shards' sizes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (replicas, shard), mesh_dim_names=("replicate", "shard"))
    model = Net(seed=rank // shard, d_out=d_out)  # equal within a replica, different between replicas
    for block in (model.first, model.norm, model.second):
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    optimizer = _optimizer(model.parameters())
    with Gossip(model, optimizer, "ring", mesh=mesh, local_world_size=world_size) as front:
        for s in range(STEPS):
            for micro in range(micro_batches):
                model.set_requires_gradient_sync(micro == micro_batches - 1)
                _loss(model, *_batch(rank, s, micro, d_out)).backward()
            optimizer.step()
            optimizer.zero_grad()
        sent = front.bytes_per_inner_step()
    local = [p.to_local() for p in model.parameters()]
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # every rank calls it
    return {"params": full, "bytes": sent, "shard_bytes": sum(t.numel() * t.element_size() for t in local),
            "shard_rows": [t.shape[0] for t in local]}


@functools.cache
def _sharded_run(replicas: int, shard: int, micro_batches: int, d_out: int) -> list[dict[str, Any]]:
    """The workers of one sharded run (once per session: the model and the bytes tests share it)."""
    return run_workers(_sharded, replicas * shard, replicas, shard, micro_batches, d_out)


SHARDED = [  # (replicas, shard, micro-batches per step, output rows)
    pytest.param(2, 2, 1, D_OUT, id="mesh2x2"),
    pytest.param(3, 2, 2, D_OUT, id="mesh3x2-accum2"),
    pytest.param(2, 3, 1, 2, id="mesh2x3-empty-shard"),  # 2 output rows over 3 ranks: the third holds none
]


@pytest.mark.parametrize("replicas, shard, micro_batches, d_out", SHARDED)
def test_every_rank_matches_its_replicas_replay(replicas: int, shard: int, micro_batches: int, d_out: int) -> None:
    """Acceptance 1 of issue 30: 6 AdamW steps (weight decay 0.1) over a (replicas, shard) mesh, ring over the
    replicas (2: pairs; 3: one group of three, 1/3 each), every rank on its own micro-batches (two per step with
    gradient accumulation in the second case, FSDP2 syncing the last only); every rank's gathered model within
    1e-10 of its replica's replay."""
    results = _sharded_run(replicas, shard, micro_batches, d_out)
    expected = _replay("ring", replicas, shard, micro_batches=micro_batches, d_out=d_out)
    for rank, result in enumerate(results):
        deviation = _deviation(result["params"], expected[rank // shard])
        assert deviation <= TOLERANCE, f"rank {rank} is {deviation:.3g} from replica {rank // shard}'s replay"
    assert results[0]["shard_rows"] != results[shard - 1]["shard_rows"]  # uneven shards indeed
    if d_out < shard:
        assert 0 in results[shard - 1]["shard_rows"]  # the last rank of a replica holds an empty shard
    first, second = expected[0], expected[1]  # gossip, not an all-reduce: the replicas differ
    assert max((first[n] - second[n]).abs().max().item() for n in first) > 1e-4


@pytest.mark.parametrize("replicas, shard, micro_batches, d_out", SHARDED)
def test_bytes_per_step_are_the_local_shard(replicas: int, shard: int, micro_batches: int, d_out: int) -> None:
    """Acceptance 1, bytes: a pair sends its rank's shard once per step (the ring of 2 pairs the replicas in both
    rounds), so ``bytes_per_inner_step()`` is the bytes of the local shards, counted from ``to_local()``; a group of
    three all-reduces it, counted as a ring all-reduce: 2 (3 − 1) / 3 of that."""
    factor = 1.0 if replicas == 2 else 2 * (replicas - 1) / replicas
    results = _sharded_run(replicas, shard, micro_batches, d_out)
    for rank, result in enumerate(results):
        assert result["bytes"] == pytest.approx(factor * result["shard_bytes"], rel=1e-12), rank
    sizes = [result["shard_bytes"] for result in results[:shard]]
    assert len(set(sizes)) > 1  # uneven shards: each rank counts its own


# -- unsharded: whole models, against the replay with K = 1 and the engine --------------------------------------


def _whole(rank: int, world_size: int, topology: str) -> dict[str, Tensor]:
    """One worker's run of ``Gossip`` over a whole model (every worker from its own seed: rank 0's wins)."""
    model = Net(seed=rank)
    optimizer = _optimizer(model.parameters())
    with Gossip(model, optimizer, topology):
        for s in range(STEPS):
            _loss(model, *_batch(rank, s)).backward()
            optimizer.step()
            optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _engine(rank: int, world_size: int, topology: str) -> dict[str, Tensor]:
    """The same through the engine: the optimizer steps per bucket inside backward (mix, step, launch)."""
    model = Net(seed=rank)
    ddp = DecentralizedDataParallel(model, lambda named: _optimizer([p for _, p in named]), topology=topology,
                                    bucket_size_in_mb=0.0002)  # several buckets
    for s in range(STEPS):
        _loss(ddp, *_batch(rank, s)).backward()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("topology, world_size", [("ring", 2), ("ring", 4)])
def test_whole_models_match_the_replay(topology: str, world_size: int) -> None:
    """``Gossip`` without a mesh: every worker within 1e-10 of the replay with K = 1. The ring of 4 alternates
    two different rounds, so it checks the round numbering (round s − 1 at step s) too."""
    workers = _whole_run(topology, world_size)
    expected = _replay(topology, world_size, 1)
    for rank, params in enumerate(workers):
        deviation = _deviation(params, expected[rank])
        assert deviation <= TOLERANCE, f"worker {rank} is {deviation:.3g} from the replay"


@functools.cache
def _whole_run(topology: str, world_size: int) -> list[dict[str, Tensor]]:
    return run_workers(_whole, world_size, topology)


@pytest.mark.parametrize("variant", VARIANTS)
def test_wrong_replays_are_far_from_the_runs(variant: str) -> None:
    """The oracle can fail: a replay that mixes after the optimizer step, never mixes, or numbers rounds like the
    engine (round s at step s) is farther than WRONG from the whole-model run on the ring of 4 (two different
    rounds) and from a sharded one (2 x 2), where the exact replay is within TOLERANCE."""
    for params, expected in ((_whole_run("ring", 4), _replay("ring", 4, 1, variant=variant)),
                             ([w["params"] for w in _sharded_run(2, 2, 1, D_OUT)][::2],
                              _replay("ring", 2, 2, variant=variant))):
        if variant == "round_s" and len(expected) == 2:
            continue  # the ring of 2's two rounds are the same pair: round s and s - 1 agree
        deviation = max(_deviation(p, e) for p, e in zip(params, expected))
        assert deviation > WRONG, f"{variant}: the run is only {deviation:.3g} from this wrong replay"


def test_the_engine_computes_the_same_on_a_period_one_schedule() -> None:
    """On a ring of 2 (both rounds pair the two workers) the engine's x^{s+1} = U(W x^s, ∇f(x^s)) is the front's:
    the engine's workers match the same replay within 1e-10."""
    workers = run_workers(_engine, 2, "ring")
    expected = _replay("ring", 2, 1)
    for rank, params in enumerate(workers):
        deviation = _deviation(params, expected[rank])
        assert deviation <= TOLERANCE, f"engine worker {rank} is {deviation:.3g} from the replay"
