"""A joiner's heal state comes over the network from a peer (training/heal_state.py ``receive_state``): it must load as
tensors and plain values only, never run code (``weights_only``), and a state that does not load must be refused in
one line naming what was refused. And the real heal states still arrive bit for bit.

Two forked gloo processes (tests/distributed.py): rank 0 sends as the donor does (``send_state``), rank 1 receives.
The hostile state holds an object whose ``__reduce__`` creates a marker file when unpickled: under the old
``weights_only=False`` the receiver ran it (the marker appeared); now it must be refused and the marker absent.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from decent_train.algorithms import algorithm_class
from decent_train.training.heal_state import HealStateRefused, receive_state, send_state

from .distributed import run_workers
from .jobs import make_cfg, train_on_cpu


def make_marker(path: str) -> None:
    """What the hostile state runs if it is unpickled with code execution allowed."""
    Path(path).write_text("code from a peer ran here\n")


class Hostile:
    """Pickles as a call of :func:`make_marker`: loading it with ``weights_only=False`` runs that call."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return make_marker, (self.path,)


def _exchange(rank: int, world: int, sent: Any, raw: bytes | None = None) -> dict[str, Any]:
    """Rank 0 sends ``sent`` as the donor does (or ``raw`` bytes, framed the same way); rank 1 receives it: what
    arrived, or the refusal's type and message."""
    if rank == 0:
        if raw is None:
            send_state(sent, 1)
        else:
            payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            dist.send(torch.tensor([payload.numel()], dtype=torch.int64), 1)
            dist.send(payload, 1)
        return {}
    try:
        state, nbytes = receive_state(0)
    except Exception as error:  # noqa: BLE001 - the test asserts on whatever was raised
        return {"error": type(error), "message": str(error)}
    return {"state": state, "bytes": nbytes}


def _assert_one_line(received: dict[str, Any]) -> str:
    assert received.get("error") is HealStateRefused, received
    message = received["message"]
    assert "\n" not in message and "Traceback" not in message and len(message) < 400, message
    # join() takes a RuntimeError for a dead donor and waits for a newer plan: a refusal must end the joiner instead
    assert not issubclass(received["error"], RuntimeError)
    return message


def test_a_hostile_heal_state_is_refused_without_running_its_code() -> None:
    with tempfile.TemporaryDirectory() as workdir:
        marker = Path(workdir) / "marker"
        hostile = {"step": 3, "model": {"w": torch.ones(2)}, "algorithm": {"front": Hostile(str(marker))}}
        received = run_workers(_exchange, 2, hostile, timeout=60)[1]
        assert not marker.exists(), f"the peer's state ran code on the receiver: {marker.read_text()!r}"
        message = _assert_one_line(received)
    assert "rank 0" in message and f"{__name__}.make_marker" in message, message
    assert "weights_only" in message, message


def _truncated() -> bytes:
    buffer = io.BytesIO()
    torch.save({"step": 3, "model": {"w": torch.ones(64)}}, buffer)
    return buffer.getvalue()[: buffer.getbuffer().nbytes // 2]


@pytest.mark.parametrize("corrupt", ["garbage", "truncated"])
def test_a_corrupt_heal_state_is_refused_in_one_line(corrupt: str) -> None:
    raw = b"not a torch.save archive" if corrupt == "garbage" else _truncated()
    received = run_workers(_exchange, 2, None, raw, timeout=60)[1]
    _assert_one_line(received)


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """``a`` and ``b`` equal bit for bit: tensors by dtype and ``torch.equal``, containers item by item."""
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for k, (u, v) in enumerate(zip(a, b)):
            assert_same(u, v, f"{where}[{k}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


HEAL_CASES = {  # what fault_tolerance=live runs (config.py _check_live): the engine, and the local-steps fronts
    "decentralized": {},
    "decentralized-int8": {"compression": {"name": "int8"}},
    "streaming-diloco": {"algorithm": {"name": "diloco", "sync_every": 2, "fragments": 2}},
    "localsgd": {"algorithm": {"name": "localsgd", "sync_every": 2}},
    "diloco-int8": {"algorithm": {"name": "diloco", "sync_every": 2}, "compression": {"name": "int8"}},
}


@pytest.mark.parametrize("case", list(HEAL_CASES))
def test_a_real_heal_state_arrives_bit_for_bit(case: str, tmp_path: Path) -> None:
    """What ``live_changes._donate`` sends, from a trained run's rank 0 (its model, ``averageable_state`` of its
    algorithm's state: optimizer moments, schedule, scaler, anchors, outer momentum), loads under weights_only and
    equals what was sent."""
    steps = 4
    cfg = make_cfg(tmp_path, **HEAL_CASES[case], steps=steps, eval_every=0, launch={"nproc_per_node": 2},
                   checkpoint={"every": steps, "keep": 1})
    run_workers(train_on_cpu, 2, cfg, timeout=240)
    saved = torch.load(sorted(tmp_path.rglob("rank0.pt"))[-1], map_location="cpu", weights_only=True)
    heal = {"step": steps, "model": saved["model"], "data_taken": steps * cfg.accum_steps, "world_size": 2,
            "algorithm": algorithm_class(cfg.algorithm.name).averageable_state(saved["algorithm"])}
    received = run_workers(_exchange, 2, heal, timeout=60)[1]
    assert "state" in received, received
    assert_same(received["state"], heal)
