"""What memory the engine's buckets hold, counted from the storages reachable from them (audit R14).

A bucket's receive buffer (``comm``, the size of the bucket) exists only once a mode that receives into it runs:
none at world size 1, in all-reduce mode or with compression; decent-dp's ``pre_average_hook`` optimizers get their
``comm_buffer`` slices of it when the buckets are built. Also which backends average the all-reduce mode's gradients
in the collective. Numerical parity of the modes is tests/test_schedules.py's (all-reduce mode against torch DDP).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from decent_train import DecentralizedDataParallel
from decent_train.engine.modes import reduces_to_average
from tests.distributed import run_workers
from tests.replay import SEED, SGD, loss_fn, make_model

BUCKET_MB = 0.0005  # several buckets for the test model


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def held_bytes(ddp: DecentralizedDataParallel) -> int:
    """Bytes of the distinct storages that the buckets' tensors (and lists of tensors) live in."""
    storages = {}
    for bucket in ddp._buckets:
        for value in vars(bucket).values():
            for tensor in _tensors(value):
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def model_bytes(ddp: DecentralizedDataParallel) -> int:
    return sum(ddp.bucket_bytes)


def comm_bytes(ddp: DecentralizedDataParallel) -> int:
    return sum(b.comm.untyped_storage().nbytes() for b in ddp._buckets)


def test_world_size_one_holds_the_parameters_only() -> None:
    """Gossip over a ring of one receives nothing: the buckets hold their parameters and no receive buffer."""
    ddp = DecentralizedDataParallel(make_model(SEED), SGD, topology="ring", bucket_size_in_mb=BUCKET_MB)
    for s in range(3):
        loss_fn(ddp, 0, s).backward()
    held, model = held_bytes(ddp), model_bytes(ddp)
    assert len(ddp.bucket_bytes) >= 3
    assert held == model, f"held {held} bytes for a {model}-byte model"


def test_pre_average_hook_gets_its_comm_buffer_at_build_time() -> None:
    """decent-dp's optimizers read ``p.comm_buffer`` (a slice of ``comm``) from the start, at any world size."""

    class HookedSGD(torch.optim.SGD):
        def pre_average_hook(self, edge: Any, weight: float) -> None:
            pass

    ddp = DecentralizedDataParallel(make_model(SEED), lambda named: HookedSGD([p for _, p in named], lr=0.05),
                                    topology="ring", bucket_size_in_mb=BUCKET_MB)
    assert comm_bytes(ddp) == model_bytes(ddp)
    for bucket in ddp._buckets:
        for p in bucket.params:
            assert p.comm_buffer.untyped_storage().data_ptr() == bucket.comm.untyped_storage().data_ptr()


def _held_through_the_modes(rank: int, world: int) -> dict[str, int]:
    """All-reduce mode, then gossip over a ring (a pair), then a compressed engine: the bytes held after each."""
    ddp = DecentralizedDataParallel(make_model(SEED + rank), SGD, topology="allreduce", bucket_size_in_mb=BUCKET_MB)
    held = {"model": model_bytes(ddp)}
    for s in range(3):
        loss_fn(ddp, rank, s).backward()
    held["allreduce"], held["allreduce_comm"] = held_bytes(ddp), comm_bytes(ddp)
    grads = sum(b.grads.untyped_storage().nbytes() for b in ddp._buckets)
    ddp.switch_to("ring")
    for s in range(3, 6):
        loss_fn(ddp, rank, s).backward()
    held["gossip"], held["gossip_comm"], held["grads"] = held_bytes(ddp), comm_bytes(ddp), grads
    int8 = DecentralizedDataParallel(make_model(SEED + rank), SGD, topology="ring", bucket_size_in_mb=BUCKET_MB,
                                     compression="int8")
    for s in range(3):
        loss_fn(int8, rank, s).backward()
    held["int8_comm"] = comm_bytes(int8)
    return held


def test_receive_buffers_come_with_the_first_gossip_mode() -> None:
    """All-reduce mode averages the gradients in a buffer of their own and receives nothing into ``comm``: none is
    held. Switched to gossip, every bucket gets one (the bucket's size); compressed gossip receives into its
    messages and holds none."""
    for rank, held in enumerate(run_workers(_held_through_the_modes, 2)):
        model = held["model"]
        assert held["grads"] == model, f"rank {rank}: {held}"
        assert held["allreduce_comm"] == 0 and held["allreduce"] == 2 * model, f"rank {rank}: {held}"
        assert held["gossip_comm"] == model and held["gossip"] == 3 * model, f"rank {rank}: {held}"
        assert held["int8_comm"] == 0, f"rank {rank}: {held}"


@pytest.mark.parametrize(
    ("config", "device", "averages"),
    [
        ("cpu:gloo,cuda:nccl", "cuda", True),  # init_process_group() without a backend, on a GPU machine
        ("cuda:nccl", "cuda", True),
        ("cpu:gloo,cuda:nccl", "cpu", False),
        ("cpu:gloo,cuda:gloo", "cuda", False),  # gloo's AVG sums first: float16 could overflow
        ("cpu:gloo,cuda:gloo", "cpu", False),
        ("cuda:nccl2", "cuda", False),  # live membership's data group: untried, keeps the division
    ],
)
def test_only_nccl_averages_in_the_collective(
    monkeypatch: pytest.MonkeyPatch, config: str, device: str, averages: bool
) -> None:
    """All-reduce mode divides before a SUM (the path every CPU test runs) unless the group's backend for the
    gradients' device is NCCL, whose AVG scales each input before the sum: the same average, one kernel fewer."""
    monkeypatch.setattr(torch.distributed, "get_backend_config", lambda group=None: config)
    assert reduces_to_average(None, torch.device(device)) is averages
