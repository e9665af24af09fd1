"""Bucket updates on a thread of their own (``update_thread=True``, opt-in) change nothing: every worker
still equals the float64 replay, with compression, staged rounds, accumulation and deferred steps; an update's error
comes out of ``backward()``; a drain that does not wait for the queued updates is caught by the same oracle."""

from __future__ import annotations

import time
from functools import partial

import pytest
import torch

from decent_train import DecentralizedDataParallel, optim_fn_adam
from decent_train.engine.compress import make_compressor
from decent_train.engine.update_thread import UpdateThread
from tests.distributed import WorkerError, run_workers
from tests.replay import SGD, make_model, max_deviation, replay, replay_compressed, topology_for, train_engine

STEPS = 12
TOL = 1e-12


@pytest.mark.parametrize(
    "topology, world_size, local_world_size, common",
    [
        ("ring", 4, 1, {}),
        ("complete", 3, 1, {}),
        ("hierarchical", 4, 2, {}),  # two stages per round: one in flight, one when it is mixed
        ("ring", 4, 1, {"micro_batches": 2}),
        ("ring", 4, 1, {"grad_clip_norm": 0.05}),  # deferred to the end of backward: updates where backward ends
    ],
)
def test_threaded_updates_match_replay(topology: str, world_size: int, local_world_size: int, common: dict) -> None:
    engine = run_workers(train_engine, world_size, topology=topology, steps=STEPS, local_world_size=local_world_size,
                         update_thread=True, **common)
    assert len(engine[0]["buckets"]) >= 3
    expected = replay(topology_for(topology, world_size, local_world_size), STEPS, **common)
    assert max_deviation(engine, expected) <= TOL


def test_threaded_compressed_updates_match_replay() -> None:
    adam = partial(optim_fn_adam, lr=0.01)
    engine = run_workers(train_engine, 4, topology="ring", steps=STEPS, optim_fn=adam, compression="int8",
                         consensus_step=0.8, update_thread=True)
    expected = replay_compressed(topology_for("ring", 4), STEPS, make_compressor("int8"), engine[0]["buckets"],
                                 optim_fn=adam, consensus_step=0.8)
    assert max_deviation(engine, expected) <= TOL


def train_with_unwaited_drain(rank: int, world_size: int) -> dict:
    """The wrong variant: updates start late and the end of backward does not wait for them."""
    submit = UpdateThread.submit

    def late(self: UpdateThread, update, gradients) -> None:  # type: ignore[no-untyped-def]
        submit(self, lambda: (time.sleep(0.02), update()), gradients)

    UpdateThread.submit = late  # type: ignore[method-assign]
    UpdateThread.drain = lambda self: None  # type: ignore[method-assign]
    return train_engine(rank, world_size, "ring", STEPS, update_thread=True)


def test_a_drain_that_does_not_wait_is_caught() -> None:
    """The next forward then races the updates: the parameters leave the replay, or the race breaks the run outright
    (autograd's in-place check, or the ranks' exchanges out of order in gloo), as it did once on a loaded machine."""
    try:
        engine = run_workers(train_with_unwaited_drain, 4, timeout=90)
    except WorkerError:
        return
    assert max_deviation(engine, replay(topology_for("ring", 4), STEPS)) > 1e-6


class FailingSGD(torch.optim.SGD):
    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        raise ValueError("the optimizer failed on the update thread")


def failing_update(rank: int, world_size: int) -> None:
    engine = DecentralizedDataParallel(make_model(rank), lambda named: FailingSGD([p for _, p in named], lr=0.1),
                                       topology="ring", update_thread=True, bucket_size_in_mb=0.0005)
    x = torch.randn(4, 8, dtype=torch.float64)
    engine(x).sum().backward()


def test_an_update_error_comes_out_of_backward() -> None:
    with pytest.raises(WorkerError, match="the optimizer failed on the update thread"):
        run_workers(failing_update, 2, timeout=60)


def test_threaded_updates_are_off_by_default() -> None:
    def run(rank: int, world_size: int) -> bool:
        return DecentralizedDataParallel(make_model(0), SGD, topology="ring")._updates is None

    assert all(run_workers(run, 2))

