"""DiLoCo and LocalSGD over FSDP2-sharded replicas (issue 30: the outer step over the replicas): the fronts of
``algorithms/local_steps.py`` with ``mesh=`` against the same fronts over whole models, one worker per replica given
the replica's combined batch. The whole-model fronts are checked against a float64 replay of their formulas in
``tests/test_local_steps.py`` and ``tests/test_streaming.py``; here the sharded runs must equal them (float64, 1e-10):
the outer optimizer steps the DTensor parameters with the mixed pseudo-gradient's shards, the anchors are shards.
Per-step gossip with bf16-compressed differences (CHOCO's public copies per shard; bf16 rounds elementwise, so a
shard's messages are the whole model's rows) equals the whole-model front too.
A front that handed the outer optimizer half the pseudo-gradient's shards was 0.27 (DiLoCo) and 0.31 (streaming) away
(checked once by editing ``_gradient_for``, not kept). Streaming with an exchange in flight for one inner step
(``fragment_sync_delay=1``) equals the whole-model front too; a sharded front that ignored the delay was 0.242 away."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from decent_train.algorithms.local_steps import DiLoCo, LocalSGD
from decent_train.algorithms.step_gossip import Gossip
from tests.distributed import run_workers
from tests.test_sharded_gossip import D_IN, HIDDEN, Net, _batch, _loss, _optimizer

STEPS, SYNC_EVERY = 10, 4  # ends between outer steps: the replicas differ
TOLERANCE = 1e-10


def _front(model: torch.nn.Module, inner: torch.optim.Optimizer, kind: str, **kwargs: Any) -> DiLoCo:
    if kind == "gossip-bf16":  # per-step gossip of bf16-compressed differences (elementwise: shards change nothing)
        return Gossip(model, inner, "ring", compression="bf16", **kwargs)
    if kind == "localsgd":
        return LocalSGD(model, inner, SYNC_EVERY, "ring", **kwargs)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    streaming = kind.startswith("streaming")
    return DiLoCo(model, inner, outer, SYNC_EVERY, "ring", fragments=2 if streaming else 1,
                  fragment_sync_delay=1 if kind == "streaming-delayed" else 0, **kwargs)


def _sharded(rank: int, world_size: int, shard: int, kind: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size // shard, shard), mesh_dim_names=("replicate", "shard"))
    model = Net(seed=rank // shard)  # equal within a replica (each rank keeps its own init's shard)
    for block in (model.first, model.norm, model.second):
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    inner = _optimizer(model.parameters())
    with _front(model, inner, kind, mesh=mesh, local_world_size=world_size) as front:
        for s in range(STEPS):
            _loss(model, *_batch(rank, s)).backward()
            inner.step()
            inner.zero_grad()
        anchors = [a.clone() for a in front.anchors()]
        sent = front.bytes_per_inner_step()
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    numel = sum(p.to_local().numel() for p in model.parameters())
    return {"params": full, "anchors": anchors, "outer_steps": front.outer_steps, "sent": sent, "numel": numel}


def _whole(rank: int, world_size: int, shard: int, kind: str) -> dict[str, Any]:
    """Replica ``rank`` as one worker: its batch is its ``shard`` ranks' micro-batches (mean loss over them)."""
    model = Net(seed=rank)
    inner = _optimizer(model.parameters())
    with _front(model, inner, kind) as front:
        for s in range(STEPS):
            parts = [_batch(rank * shard + k, s) for k in range(shard)]
            _loss(model, torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])).backward()
            inner.step()
            inner.zero_grad()
        anchors = [a.clone() for a in front.anchors()]
        sent = front.bytes_per_inner_step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "anchors": anchors,
            "outer_steps": front.outer_steps, "sent": sent, "numel": sum(p.numel() for p in model.parameters())}


@pytest.mark.parametrize("kind", ["diloco", "streaming", "streaming-delayed", "localsgd", "gossip-bf16"])
def test_sharded_replicas_equal_whole_model_workers(kind: str) -> None:
    """2 replicas of 2 shards, ring; DiLoCo (Nesterov outer SGD), Streaming DiLoCo (2 fragments), LocalSGD: every
    rank's gathered model equals its replica's whole-model worker, its anchors (DiLoCo) are that worker's anchors'
    rows it holds (FSDP2 cuts dimension 0 as ``torch.chunk``), and as many outer steps were taken."""
    shard = 2
    sharded = run_workers(_sharded, 4, shard, kind)
    whole = run_workers(_whole, 2, shard, kind)
    for rank, result in enumerate(sharded):
        want = whole[rank // shard]
        deviation = max((result["params"][n] - want["params"][n]).abs().max().item() for n in want["params"])
        assert deviation <= TOLERANCE, f"rank {rank}: {deviation:.3g} from replica {rank // shard}'s worker"
        period = 1 if kind == "gossip-bf16" else SYNC_EVERY // (2 if kind.startswith("streaming") else 1)
        assert result["outer_steps"] == want["outer_steps"] == STEPS // period - (kind == "gossip-bf16")
        assert len(result["anchors"]) == len(want["anchors"]) == (0 if kind in ("localsgd", "gossip-bf16") else 6)
        if kind == "gossip-bf16":  # compressed indeed: the pair sends its shard once, in bf16 (2 bytes an element)
            assert result["sent"] == 2 * result["numel"]
        else:  # the whole-model worker's payload, cut to the shard: the ring of 2 replicas sends the delta alone
            assert result["sent"] == pytest.approx(want["sent"] * result["numel"] / want["numel"]), (result, want)
        for mine, theirs in zip(result["anchors"], want["anchors"]):
            rows = torch.chunk(theirs, shard, dim=0)[rank % shard]
            assert mine.shape == rows.shape and (mine - rows).abs().max().item() <= TOLERANCE
    first, second = (w["params"] for w in whole)
    assert max((first[n] - second[n]).abs().max().item() for n in first) > 1e-4  # gossip: replicas differ


def _moving(rank: int, world_size: int, move: bool) -> dict[str, Tensor]:
    """2 replicas of 1 shard, Streaming DiLoCo (2 fragments, an exchange in flight for one step before each outer
    step); with ``move``, every third step gives every local shard new storage with the same values
    (``module._apply(clone)``: what ``model.cpu(); model.cuda()`` does on a GPU), once while an exchange is in flight."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    model = Net(seed=rank)
    for block in (model.first, model.norm, model.second):
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    inner = _optimizer(model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    with DiLoCo(model, inner, outer, SYNC_EVERY, "ring", fragments=2, fragment_sync_delay=1, mesh=mesh,
                local_world_size=world_size) as front:
        for s in range(STEPS):
            _loss(model, *_batch(rank, s)).backward()
            inner.step()
            inner.zero_grad()
            if move and s % 3 == 0:  # steps 1, 4, 7, 10: after step 1 fragment 0's exchange is in flight
                model._apply(lambda t: t.clone())
        assert front.outer_steps == STEPS // (SYNC_EVERY // 2)
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def test_the_front_follows_shards_that_moved() -> None:
    """Audit R9: FSDP2 gives a local shard new storage when the module is moved or cast (``model.cpu()`` and back),
    and the front must then exchange and update the new tensors. Moved every third step, the run equals the same run
    unmoved (itself equal to whole-model workers, above). A front that kept the shards it captured at construction
    (``OuterGroup.follow_params`` returning at once) missed the outer steps' updates: 0.33 away."""
    moved, still = run_workers(_moving, 2, True), run_workers(_moving, 2, False)
    for rank, (mine, want) in enumerate(zip(moved, still)):
        deviation = max((mine[n] - want[n]).abs().max().item() for n in want)
        assert deviation <= TOLERANCE, f"rank {rank}: {deviation:.3g} from the run whose shards stayed in place"


def _cast(rank: int, world_size: int) -> str:
    model = Net(seed=0)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)  # stateless: it steps the cast parameters as they are
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    with DiLoCo(model, inner, outer, 2, "complete"):
        _loss(model, *_batch(rank, 0)).backward()
        inner.step()
        model.float()
        try:
            inner.step()  # (the gradients were cast too) the second step is an outer step
        except ValueError as error:
            return str(error)
    return "no error"


def test_a_parameter_cast_after_the_front_was_built_is_refused() -> None:
    """``model.float()`` after DiLoCo was built over a float64 model: the next outer step refuses in one line naming
    the parameter, instead of copying float32 parameters into float64 buffers and anchors."""
    (message,) = run_workers(_cast, 1)
    layout = f"({HIDDEN}, {D_IN}) on cpu"
    assert message.startswith(f"parameter 'first.weight' is now torch.float32 {layout}, was torch.float64 {layout}"), message
    assert "\n" not in message
