"""Streaming DiLoCo over gossip (fragments, a delayed outer step, α-mixing) and the compressed outer exchange
(algorithms/local_steps.py, outer_exchange.py), against a float64 single-process replay with dense mixing matrices
and one outer optimizer per fragment (torchft's list form), and against what compression must preserve."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from decent_train import DiLoCo, LocalSGD
from decent_train.algorithms.outer_exchange import split_parameters
from decent_train.engine.compress import Int8Compressor
from decent_train.engine.int8_kernels import COMPILED_INT8_ENV
from tests.distributed import run_workers
from tests.replay import loss_fn, make_model, topology_for


def _inner(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)


def _outer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _modules(model: nn.Module) -> list[nn.Module]:
    """make_model's three Linear layers: the fragments."""
    return [model[0], model[2], model[4]]


def _train(rank: int, world_size: int, topology: str, steps: int, options: dict[str, Any],
           local_sgd: bool) -> list[torch.Tensor]:
    model = make_model(seed=rank)
    inner = _inner(model.parameters())
    options = {**options, "fragments": _modules(model)}
    front = (LocalSGD(model, inner, options.pop("sync_every"), topology, **options) if local_sgd
             else DiLoCo(model, inner, _outer(model.parameters()), options.pop("sync_every"), topology, **options))
    with front:
        for step in range(steps):
            loss_fn(model, rank, step).backward()
            inner.step()
            inner.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _replay(world_size: int, topology: str, steps: int, sync_every: int, delay: int, alpha: float,
            local_sgd: bool) -> list[list[torch.Tensor]]:
    """torchft's Streaming DiLoCo schedule with W of the fragment's own k-th outer step: fragment f = syncs % F starts
    after inner step P − τ of its period (x snapshotted there) and steps after step P."""
    models = [make_model(seed=0) for _ in range(world_size)]
    inners = [_inner(m.parameters()) for m in models]
    outers = [[_outer(fragment.parameters()) for fragment in _modules(m)] for m in models]
    fragments = [[list(f.parameters()) for f in _modules(m)] for m in models]  # [worker][fragment] -> params
    count, built = len(fragments[0]), topology_for(topology, world_size)
    period = sync_every // count
    anchors = [[[p.detach().clone() for p in f] for f in worker] for worker in fragments]
    syncs, fragment_syncs, snapshot = 0, [0] * count, None
    for step in range(1, steps + 1):
        for rank, (m, opt) in enumerate(zip(models, inners)):
            loss_fn(m, rank, step - 1).backward()
            opt.step()
            opt.zero_grad()
        local, f = (step - 1) % period + 1, syncs % count
        if local == period - delay:
            snapshot = [[p.detach().clone() for p in worker[f]] for worker in fragments]
        if local != period:
            continue
        w = built.mixing_matrix(fragment_syncs[f])
        kept = [[p.detach().clone() for p in worker[f]] for worker in fragments]  # local: when the step is taken
        with torch.no_grad():
            for i in range(world_size):
                for k, p in enumerate(fragments[i][f]):
                    mixed_x = sum(w[i, j] * snapshot[j][k] for j in range(world_size))
                    if local_sgd:
                        p.copy_(mixed_x)
                        continue
                    mixed_a = sum(w[i, j] * anchors[j][f][k] for j in range(world_size))
                    p.copy_(mixed_a)
                    p.grad = mixed_a - mixed_x
        if not local_sgd:
            for i in range(world_size):
                outers[i][f].step()
                outers[i][f].zero_grad(set_to_none=True)
                anchors[i][f] = [p.detach().clone() for p in fragments[i][f]]
        with torch.no_grad():
            for i in range(world_size):
                for p, local_p in zip(fragments[i][f], kept[i]):
                    p.lerp_(local_p, alpha)
        syncs, fragment_syncs[f] = syncs + 1, fragment_syncs[f] + 1
    return [[p.detach() for p in m.parameters()] for m in models]


CASES = [  # (sync_every, fragment_sync_delay, fragment_update_alpha)
    (6, 0, 0.0),
    (6, 1, 0.0),
    (9, 2, 0.5),
]


@pytest.mark.parametrize("sync_every, delay, alpha", CASES)
@pytest.mark.parametrize("topology, world_size, local_sgd", [("ring", 4, False), ("ring", 5, False),
                                                              ("one-peer-exp", 4, True)])
def test_streamed_gossip_matches_the_replay(topology: str, world_size: int, local_sgd: bool, sync_every: int,
                                            delay: int, alpha: float) -> None:
    """3 fragments (make_model's layers), 2 full periods: every fragment syncs twice, in rounds 0 and 1."""
    steps = 2 * sync_every
    options = {"sync_every": sync_every, "fragment_sync_delay": delay, "fragment_update_alpha": alpha}
    workers = run_workers(_train, world_size, topology, steps, options, local_sgd)
    expected = _replay(world_size, topology, steps, sync_every, delay, alpha, local_sgd)
    deviation = max((a - b).abs().max().item() for got, want in zip(workers, expected) for a, b in zip(got, want))
    assert deviation <= 1e-9
    # The replay tells the schedule apart: without the delay it gives other parameters.
    if delay:
        undelayed = _replay(world_size, topology, steps, sync_every, 0, alpha, local_sgd)
        assert max((a - b).abs().max().item() for got, want in zip(workers, undelayed)
                   for a, b in zip(got, want)) > 1e-6


def test_an_int_splits_the_parameters_by_elements() -> None:
    """make_model's tensors hold 128, 16, 256, 16, 64 and 4 elements (484): 2 fragments cut after 144 (nearest to
    242), 3 after 144 (nearest 161.3) and 400 (nearest 322.7): a layer's weight and bias may part."""
    named = list(make_model().named_parameters())
    sizes = [[p.numel() for p in part] for part in split_parameters(named, 2)]
    assert sizes == [[128, 16], [256, 16, 64, 4]]
    sizes = [[p.numel() for p in part] for part in split_parameters(named, 3)]
    assert sizes == [[128, 16], [256], [16, 64, 4]]
    with pytest.raises(ValueError, match=r"fragments=7: the model has only 6 trainable parameter tensors"):
        split_parameters(named, 7)
    model = make_model()
    with pytest.raises(ValueError, match=r"none holds 4\.weight"):
        split_parameters(list(model.named_parameters()), [model[0], model[2]])


def _recorded(rank: int, world_size: int, topology: str, compression: str | None) -> dict[str, list]:
    """Per outer step: x and the anchors when the exchange starts (a post-hook registered before the front's runs
    first), and what the outer optimizer is handed (the mixed anchor a and the gradient g)."""
    model = make_model(seed=rank)
    inner = _inner(model.parameters())
    handed: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    class Recording(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            handed.append(([p.detach().clone() for p in model.parameters()],
                           [p.grad.clone() for p in model.parameters()]))
            return super().step(closure)

    front = DiLoCo(model, inner, Recording(model.parameters(), lr=0.7, momentum=0.9, nesterov=True), sync_every=3,
                   topology=topology, compression=compression)
    sent: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    inner.register_step_post_hook(
        lambda *_: sent.append(([p.detach().clone() for p in model.parameters()], [a.clone() for a in front.anchors()]))
        if (front.inner_steps + 1) % 3 == 0 else None
    )
    with front:
        for step in range(12):
            loss_fn(model, rank, step).backward()
            inner.step()
            inner.zero_grad()
    return {"sent": sent, "handed": handed, "bytes": front.bytes_per_inner_step()}


@pytest.mark.parametrize("topology, world_size", [("ring", 4), ("complete", 4), ("ring", 5)])
def test_int8_outer_exchange_keeps_the_mean_exact(topology: str, world_size: int) -> None:
    """With int8, what each worker's outer optimizer is handed differs from the exact mix (the compression shows),
    but over the workers the mean of the mixed anchors is the mean of the anchors, and the mean gradient the mean
    pseudo-gradient anchor − x, to round-off (CHOCO's public copies with a symmetric W), at each of 4 outer steps."""
    workers = run_workers(_recorded, world_size, topology, "int8")
    built, compression_error = topology_for(topology, world_size), 0.0
    for k in range(4):
        xs = [w["sent"][k][0] for w in workers]
        anchors = [w["sent"][k][1] for w in workers]
        for t in range(len(xs[0])):
            mean_a = sum(w["handed"][k][0][t] for w in workers) / world_size
            mean_g = sum(w["handed"][k][1][t] for w in workers) / world_size
            assert (mean_a - sum(a[t] for a in anchors) / world_size).abs().max() <= 1e-12
            assert (mean_g - sum(a[t] - x[t] for a, x in zip(anchors, xs)) / world_size).abs().max() <= 1e-12
            w = built.mixing_matrix(k)
            exact_g = sum(w[0, j] * (anchors[j][t] - xs[j][t]) for j in range(world_size))
            compression_error = max(compression_error, (workers[0]["handed"][k][1][t] - exact_g).abs().max().item())
    assert compression_error > 1e-8  # the messages were compressed: the mix itself is not exact


def test_int8_outer_exchange_with_the_compiled_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with int8's compiled loops forced (they run for [x, anchor] buffers of 2^20 elements and more): the
    outer exchange mixes into its staged buffer, not in place as the engine does (the loop once wrote nothing
    there, and DiLoCo with int8 went to NaN after its first outer step on a 1.1M-parameter model)."""
    monkeypatch.setenv(COMPILED_INT8_ENV, "always")
    test_int8_outer_exchange_keeps_the_mean_exact("ring", 2)


def test_bytes_per_inner_step_by_hand() -> None:
    """484 float64 parameters. Ring: a pair swaps [x, anchor] (2 x 3872 bytes) once per 3 inner steps; complete:
    the pseudo-gradient alone all-reduced over 4 (2 x 3/4 x 3872); int8 on the ring: two 484-element halves
    padded to 1024 levels + 4 scales of 4 bytes."""
    numel = 484
    ring = run_workers(_recorded, 4, "ring", None)[0]["bytes"]
    assert ring == pytest.approx(2 * numel * 8 / 3)
    complete = run_workers(_recorded, 4, "complete", None)[0]["bytes"]
    assert complete == pytest.approx(2 * 3 / 4 * numel * 8 / 3)
    int8 = run_workers(_recorded, 4, "ring", "int8")[0]["bytes"]
    assert int8 == pytest.approx(Int8Compressor().message_bytes(2 * numel) / 3) == pytest.approx((1024 + 16) / 3)


STREAMED = {"fragments": 3, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}


def _resumed(rank: int, world_size: int, stop: int, options: dict[str, Any],
             local_sgd: bool) -> dict[str, list[torch.Tensor]]:
    """A run of H=6 over the ring with ``options`` straight for 14 steps, and stopped after ``stop``, checkpointed
    (model, inner optimizer, front) and resumed in fresh objects with other weights: the parameters of both."""

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, DiLoCo]:
        model = make_model(seed=seed)
        inner = _inner(model.parameters())
        if local_sgd:
            return model, inner, LocalSGD(model, inner, 6, "ring", **options)
        return model, inner, DiLoCo(model, inner, _outer(model.parameters()), 6, "ring", **options)

    def run(model: nn.Module, inner: torch.optim.Optimizer, front: DiLoCo, steps: range) -> None:
        with front:
            for step in steps:
                loss_fn(model, rank, step).backward()
                inner.step()
                inner.zero_grad()

    model, inner, front = build(rank)
    run(model, inner, front, range(14))
    straight = [p.detach().clone() for p in model.parameters()]
    model, inner, front = build(rank)
    run(model, inner, front, range(stop))
    saved = [model.state_dict(), inner.state_dict(), front.state_dict()]
    model, inner, front = build(100 + rank)
    model.load_state_dict(saved[0])
    inner.load_state_dict(saved[1])
    front.load_state_dict(saved[2])
    run(model, inner, front, range(stop, 14))
    return {"straight": straight, "resumed": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("options, local_sgd", [
    ({}, False), (STREAMED, False), ({**STREAMED, "compression": "int8"}, False), (STREAMED, True),
], ids=["diloco", "streamed", "streamed-int8", "streamed-localsgd"])
@pytest.mark.parametrize("stop", [5, 6])  # streamed: an exchange in flight (started after step 5 of 6); after a sync
def test_a_resumed_run_ends_bit_identical(stop: int, options: dict[str, Any], local_sgd: bool) -> None:
    """Fails when the anchors, the outer momentum, the public copies or the exchange in flight are not restored."""
    for result in run_workers(_resumed, 4, stop, options, local_sgd):
        assert all(torch.equal(a, b) for a, b in zip(result["straight"], result["resumed"]))


@pytest.mark.parametrize("kwargs, message", [
    ({"sync_every": 6, "fragments": 4}, r"sync_every=6 is not a multiple of fragments=4"),
    ({"sync_every": 6, "fragments": 3, "fragment_sync_delay": 2}, r"fragment_sync_delay=2: must be an integer in "
                                                                  r"\[0, 2\)"),
    ({"sync_every": 6, "fragment_update_alpha": 1.5}, r"fragment_update_alpha=1.5: must be in \[0, 1\]"),
    ({"sync_every": 6, "compression": "fp8"}, r"compression='fp8': valid are none, bf16, int8"),
])
def test_bad_streaming_arguments_are_one_line(kwargs: dict[str, Any], message: str) -> None:
    model = make_model()
    with pytest.raises(ValueError, match=message):
        DiLoCo(model, _inner(model.parameters()), _outer(model.parameters()), **kwargs)
