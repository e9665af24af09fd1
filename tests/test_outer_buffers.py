"""The outer fronts' exchange buffers (audit D7): per-step ``Gossip``, DiLoCo, LocalSGD and Streaming DiLoCo hold the
payload (``flat``) and the receive buffer (``comm``) per group, and no third, payload-sized buffer for the mixed
result: each stage's result is written into one of those two (``OuterExchange._into``). An all-reduce of all workers
reduces the payload in place (no ``comm``); compression keeps no ``comm`` either, and mixes in place.

Each case counts, after every inner step (a post-hook registered after the front's, so after a finish and the next
start), the bytes of the distinct storages the front's groups hold as ``flat``, ``comm``, ``staged`` and
``group_received``, and compares them with a hand count from the parameters' numel and element size: buffers x
payload copies (the payload is the parameters x, or [x, anchor], or the pseudo-gradient). Uncompressed, the front's
own ``memory_bytes()["device"]`` at the end equals that plus the anchors and the outer momentum, by hand. The
parameters after the run equal the float64 replays of tests/test_sharded_gossip.py, tests/test_local_steps.py and
tests/test_streaming.py; the two-stage hierarchical round, which those files do not cover uncompressed, against
test_local_steps's replay over the same two-stage W.

Before the change (``Exchanger.finish`` allocating ``staged`` at the first mix) every case here failed: from the first
outer step on, three payloads where two are counted here (complete of 4: three, not one; int8: two, not one); Gossip
over the ring of 2 held 3.0x the model after its first mix."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import tests.test_local_steps as local_steps
import tests.test_sharded_gossip as sharded_gossip
import tests.test_streaming as streaming
from decent_train import DiLoCo, LocalSGD
from decent_train.algorithms.step_gossip import Gossip
from tests.distributed import run_workers
from tests.replay import loss_fn, make_model, topology_for

TOLERANCE = 1e-9  # float64, as tests/test_local_steps.py


def _buffer_bytes(front: DiLoCo) -> int:
    """Bytes of the distinct storages the front's groups hold as exchange buffers now."""
    seen: set[int] = set()
    total = 0
    for group in front.groups:
        buffers = group.buffers
        for tensor in (buffers.flat, buffers.comm, buffers.staged, buffers.group_received):
            if tensor is None or tensor.nbytes == 0 or tensor.untyped_storage().data_ptr() in seen:
                continue
            seen.add(tensor.untyped_storage().data_ptr())
            total += tensor.untyped_storage().nbytes()
    return total


def _run(front: DiLoCo, model: torch.nn.Module, inner: torch.optim.Optimizer, rank: int, steps: int,
         step_fn: Any) -> dict[str, Any]:
    """``steps`` inner steps through ``front``; the buffers' bytes after each, ``memory_bytes()`` at the end."""
    seen: list[int] = []
    with front:
        inner.register_step_post_hook(lambda *_: seen.append(_buffer_bytes(front)))
        for step in range(steps):
            step_fn(model, rank, step)
            inner.step()
            inner.zero_grad()
        held = front.memory_bytes()
    params = list(model.parameters())
    return {"seen": seen, "held": held, "numel": sum(p.numel() for p in params),
            "element": params[0].element_size()}


def _gossip(rank: int, world_size: int, topology: str) -> dict[str, Any]:
    """tests/test_sharded_gossip.py's whole-model run (Net, AdamW), counted."""
    model = sharded_gossip.Net(seed=rank)
    inner = sharded_gossip._optimizer(model.parameters())

    def step(model: torch.nn.Module, rank: int, s: int) -> None:
        sharded_gossip._loss(model, *sharded_gossip._batch(rank, s)).backward()

    out = _run(Gossip(model, inner, topology), model, inner, rank, sharded_gossip.STEPS, step)
    return out | {"params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _local_steps(rank: int, world_size: int, topology: str, local_sgd: bool, options: dict[str, Any],
                 steps: int, streamed: bool) -> dict[str, Any]:
    """tests/test_local_steps.py's run (or tests/test_streaming.py's, with its three fragments), counted."""
    model = make_model(seed=rank)
    inner = local_steps._inner(model.parameters())
    options = dict(options)
    if streamed:
        options["fragments"] = streaming._modules(model)
    sync_every = options.pop("sync_every")
    front = (LocalSGD(model, inner, sync_every, topology, **options) if local_sgd else
             DiLoCo(model, inner, local_steps._outer(model.parameters()), sync_every, topology, **options))

    def step(model: torch.nn.Module, rank: int, s: int) -> None:
        loss_fn(model, rank, s).backward()

    return _run(front, model, inner, rank, steps, step) | {"params": local_steps._params(model)}


def _check_memory(result: dict[str, Any], buffers: int, payload: int, anchored: bool, held: bool = True) -> None:
    """Every step's buffers = ``buffers`` x ``payload`` copies of the parameters' bytes; with ``held``,
    ``memory_bytes()`` at the end: those, the anchors and the outer momentum (Nesterov SGD: one tensor like each
    parameter)."""
    model_bytes = result["numel"] * result["element"]
    assert result["seen"] and all(seen == buffers * payload * model_bytes for seen in result["seen"]), (
        [seen / model_bytes for seen in result["seen"]])
    if held:
        outer = 2 * model_bytes if anchored else 0  # anchors and momentum
        assert result["held"] == {"device": buffers * payload * model_bytes + outer, "host": 0}


def test_gossip_over_a_ring_of_two_holds_two_payloads() -> None:
    """Per-step Gossip over the ring of 2 (a pair each round): flat + comm, each the model's bytes; the parameters
    are test_sharded_gossip's replay."""
    results = run_workers(_gossip, 2, "ring")
    expected = sharded_gossip._replay("ring", 2, 1)
    for rank, result in enumerate(results):
        assert sharded_gossip._deviation(result["params"], expected[rank]) <= sharded_gossip.TOLERANCE
        _check_memory(result, buffers=2, payload=1, anchored=False)


SYNC = {"sync_every": local_steps.SYNC_EVERY}
CASES = [  # (front, topology, workers, options, buffers, payload copies, streamed)
    # a pair's round of 2 workers: every round one uniform group of all workers, so the pseudo-gradient alone
    pytest.param("diloco", "ring", 2, SYNC, 2, 1, False, id="diloco-ring2"),
    pytest.param("localsgd", "ring", 2, SYNC, 2, 1, False, id="localsgd-ring2"),
    pytest.param("diloco", "ring", 4, SYNC, 2, 2, False, id="diloco-ring4"),  # [x, anchor]
    pytest.param("diloco", "complete", 4, SYNC, 1, 1, False, id="diloco-complete4"),  # all-reduced in place
    pytest.param("diloco", "ring", 4, {"sync_every": 6, **streaming.STREAMED}, 2, 2, True, id="streaming-ring4"),
    pytest.param("diloco", "hierarchical", 4, {**SYNC, "local_world_size": 2}, 2, 2, False, id="diloco-hier4x2"),
    pytest.param("localsgd", "hierarchical", 4, {**SYNC, "local_world_size": 2}, 2, 1, False, id="localsgd-hier4x2"),
    pytest.param("diloco", "ring", 4, {**SYNC, "compression": "int8"}, 1, 2, False, id="diloco-int8-ring4"),
]


@pytest.mark.parametrize("front, topology, workers, options, buffers, payload, streamed", CASES)
def test_local_steps_hold_no_third_buffer(front: str, topology: str, workers: int, options: dict[str, Any],
                                           buffers: int, payload: int, streamed: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """DiLoCo and LocalSGD (Streaming: 3 fragments, τ = 1, α = 0.5) hold ``buffers`` payloads at every step (two:
    payload and receive buffer; one: reduced in place, or compressed); their parameters equal the replay (int8: only
    counted; tests/test_streaming.py checks its mean)."""
    local_sgd, steps = front == "localsgd", 2 * options["sync_every"] if streamed else local_steps.INNER_STEPS
    results = run_workers(_local_steps, workers, topology, local_sgd, options, steps, streamed)
    compressed = "compression" in options  # its public copies, scratch and messages: tests/test_local_steps_offload.py
    for result in results:
        _check_memory(result, buffers, payload, not local_sgd, held=not compressed)
    if compressed:
        return
    got = [result["params"] for result in results]
    if streamed:
        expected = streaming._replay(workers, topology, steps, options["sync_every"], options["fragment_sync_delay"],
                                     options["fragment_update_alpha"], local_sgd)
    else:  # test_local_steps's replay, its topology built over nodes of local_world_size (its own: over 1)
        nodes = functools.partial(topology_for, local_world_size=options.get("local_world_size", 1))
        monkeypatch.setattr(local_steps, "topology_for", nodes)
        expected = local_steps._replay(workers, topology, local_steps.SYNC_EVERY, local_sgd)
    assert local_steps._deviation(got, expected) <= TOLERANCE
