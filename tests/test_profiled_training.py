"""Training under torch.profiler: a profiled region may end while the engine's exchanges are in flight.

The engine's exchanges complete in the next step, so a region profiled with ``with profile(): ...`` around training
steps always ends with some in flight. c10d ends an async work's record function on its own thread when the work
completes; if the profiler that recorded the start has stopped by then, the process crashes (engine/comm.py,
``unrecorded``). CI saw it once as glibc's "unaligned tcache chunk detected" in tests/test_fast_links.py.

Oracle: every worker survives many such regions, and training under them equals training without a profiler to
the bit (the same steps, taken by a second engine in the same workers).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from decent_train import DecentralizedDataParallel
from tests.distributed import run_workers
from tests.replay import SEED, SGD, loss_fn, make_model, snapshot

REGIONS = 120  # without the guard one of the 4 workers crashed in 5 of 6 runs of the two tests


def _train(rank: int, compression: str | None, profiled: bool) -> dict[str, torch.Tensor]:
    ddp = DecentralizedDataParallel(make_model(SEED), SGD, topology="complete", bucket_size_in_mb=0.0005,
                                    compression=compression)
    for step in range(REGIONS):  # one step per region: each ends with every bucket's exchange in flight
        with profile(activities=[ProfilerActivity.CPU]) if profiled else contextlib.nullcontext():
            loss_fn(ddp, rank, step).backward()
    ddp.engine_state_dict()  # completes the last exchange in both runs alike
    return snapshot(ddp.module)


def _profiled_and_plain(rank: int, world_size: int, compression: str | None) -> dict[str, Any]:
    return {"profiled": _train(rank, compression, True), "plain": _train(rank, compression, False)}


@pytest.mark.parametrize("compression", [None, "bf16"])  # a group all-reduces; compressed, it all-gathers
def test_profiled_regions_that_end_with_exchanges_in_flight(compression: str | None) -> None:
    for result in run_workers(_profiled_and_plain, 4, compression, timeout=300.0):
        for name, value in result["plain"].items():
            assert torch.equal(result["profiled"][name], value), name
