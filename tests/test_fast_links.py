"""The engine's per-step work on a fast link: where pair sends run, how many passes the mix makes, what it allocates.

Oracles: the single-process replay (tests/replay.py) for the values; the thread that calls gloo's send, and the
operators torch.profiler records inside the engine's scopes, for the cost.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from decent_train import DecentralizedDataParallel
from decent_train.engine.comm import PairPoster, _PostedBatch
from tests.distributed import run_workers
from tests.replay import SEED, SGD, loss_fn, make_model, max_deviation, replay, snapshot, topology_for

STEPS = 6


def _train_recording_posting_threads(rank: int, world_size: int, topology: str) -> dict[str, Any]:
    """Train through the engine while noting, for every ``batch_isend_irecv``, whether the training thread called it."""
    on_main_thread: list[bool] = []
    original = dist.batch_isend_irecv

    def recording(ops: list[dist.P2POp]) -> list[Any]:
        on_main_thread.append(threading.current_thread() is threading.main_thread())
        return original(ops)

    dist.batch_isend_irecv = recording
    try:
        ddp = DecentralizedDataParallel(make_model(SEED + rank), SGD, topology=topology, bucket_size_in_mb=0.0005)
        for step in range(STEPS):
            loss_fn(ddp, rank, step).backward()
        return {"params": snapshot(ddp), "on_main_thread": on_main_thread, "buckets": len(ddp.bucket_names)}
    finally:
        dist.batch_isend_irecv = original


@pytest.mark.parametrize("topology, world_size", [("ring", 4), ("one-peer-exp", 4), ("ring", 2)])
def test_pair_sends_are_posted_off_the_training_thread_and_values_match_the_replay(
    topology: str, world_size: int
) -> None:
    """gloo writes a send on the calling thread until the socket is full: the engine posts pairs from its own thread."""
    results = run_workers(_train_recording_posting_threads, world_size, topology=topology)
    for result in results:
        posted = result["on_main_thread"]
        assert len(posted) >= STEPS * result["buckets"] // 2, "every pair exchange goes through batch_isend_irecv"
        assert not any(posted), "a pair exchange was posted from the training thread"
    assert max_deviation(results, replay(topology_for(topology, world_size), STEPS)) <= 1e-12


def test_a_posted_batch_reports_posting_failures_and_time_limits_as_runtime_errors() -> None:
    """What ``peers_must_answer`` turns into one ExchangeError line: the poster's own failure, or no answer in time."""
    failed: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
    failed.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        _PostedBatch(failed).wait()
    never: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
    with pytest.raises(RuntimeError, match="not posted within 0.05 s"):
        _PostedBatch(never).wait(timedelta(seconds=0.05))

    class Work:
        def __init__(self) -> None:
            self.timeouts: list[timedelta | None] = []

        def wait(self, timeout: timedelta | None = None) -> bool:
            self.timeouts.append(timeout)
            return True

    works = [Work(), Work()]
    done: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
    done.set_result(works)
    assert _PostedBatch(done).wait(timedelta(seconds=3))
    assert [w.timeouts for w in works] == [[timedelta(seconds=3)], [timedelta(seconds=3)]]


def test_cuda_tensors_are_posted_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL posts asynchronously: no thread, the works themselves come back."""
    calls: list[bool] = []

    def fake_batch(ops: list[Any]) -> list[str]:
        calls.append(threading.current_thread() is threading.main_thread())
        return ["work"]

    class CudaOp:
        tensor = torch.empty(0, device="meta")

    monkeypatch.setattr(dist, "batch_isend_irecv", fake_batch)
    poster = PairPoster()
    assert poster.post([CudaOp()]) == ["work"]  # a meta tensor stands in for CUDA: anything not on the CPU
    assert calls == [True] and poster._thread is None


def _post_once(poster: PairPoster) -> None:
    class CpuOp:
        tensor = torch.zeros(1)

    poster.post([CpuOp()])[0].wait(timedelta(seconds=5))


def test_a_forked_child_posts_from_a_thread_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """fork copies the poster but not its thread: the child starts one instead of queueing work nobody runs."""
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [])
    poster = PairPoster()
    _post_once(poster)  # the parent's thread exists now
    child = multiprocessing.get_context("fork").Process(target=_post_once, args=(poster,))
    child.start()
    child.join(30)
    assert child.exitcode == 0


def _profile_engine_scopes(rank: int, world_size: int, topology: str) -> dict[str, Any]:
    """The operators and allocations inside the engine's mix and launch scopes over a few steps, per bucket."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = DecentralizedDataParallel(model, SGD, topology=topology, bucket_size_in_mb=0.01)
    x = torch.randn(8, 64)
    for _ in range(2):
        ddp(x).square().mean().backward()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(3):
            ddp(x).square().mean().backward()
    inside: dict[str, list[str]] = {"decent_train.mix": [], "decent_train.launch": []}
    allocated: dict[str, int] = dict.fromkeys(inside, 0)

    def collect(event: Any, scope: str) -> None:
        """The operators the engine calls in ``scope`` (not what they call in turn), outside its waits."""
        for child in event.cpu_children:
            if child.name == "decent_train.wait":
                continue
            if child.name.startswith("aten::"):
                inside[scope].append(child.name)
                allocated[scope] += max(child.cpu_memory_usage, 0)
            else:
                collect(child, scope)

    scopes = [e for e in prof.events() if e.name in inside]
    for event in scopes:
        collect(event, event.name)
    return {"ops": inside, "allocated": allocated, "buckets": len(ddp.bucket_names),
            "scopes": sum(e.name == "decent_train.mix" for e in scopes)}


@pytest.mark.parametrize("topology", ["ring", "complete"])
def test_the_mix_is_one_pass_and_the_engine_allocates_nothing_per_step(topology: str) -> None:
    """A pair's mix is one lerp_ (reads x and comm, writes x); a group's is its one unavoidable combine. Neither the
    mix nor the launch allocates a tensor."""
    for result in run_workers(_profile_engine_scopes, 4, topology=topology):
        mixes = result["scopes"]
        assert mixes == 3 * result["buckets"] >= 6
        ops = result["ops"]
        if topology == "ring":
            assert ops["decent_train.mix"] == ["aten::lerp_"] * mixes
            assert [op for op in ops["decent_train.launch"] if op != "aten::view"] == []
        else:  # a group receives the sum over the group: one multiply of it into x; its launch copies x into comm
            assert ops["decent_train.mix"] == ["aten::mul"] * mixes
            assert ops["decent_train.launch"] == ["aten::copy_"] * mixes
        assert result["allocated"] == {"decent_train.mix": 0, "decent_train.launch": 0}
