"""A joiner's state from its donor: ``torch.save`` bytes over the default group, loaded with ``weights_only`` (a
peer's bytes build tensors and plain values and never run code). The protocol around it: ``docs/fault-tolerance.md``.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["HealStateRefused", "receive_state", "send_state"]


class HealStateRefused(Exception):
    """A heal state not only of tensors and plain values: the joiner exits (``join`` waits out RuntimeErrors)."""


def send_state(state: dict[str, Any], rank: int) -> int:
    """``state`` to ``rank`` over the default group (its size first); the bytes sent."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64), rank)
    dist.send(payload, rank)
    return payload.numel()


def receive_state(rank: int) -> tuple[dict[str, Any], int]:
    """What :func:`send_state` sent from ``rank``, and its size in bytes; weights_only: a peer runs no code here."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, rank)
    payload = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(payload, rank)
    # onto the CPU: a CUDA donor's tensors name its own GPU; loading the state copies them to this worker's device
    try:
        return torch.load(io.BytesIO(payload.numpy()), map_location="cpu", weights_only=True), int(size)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as error:  # one line, not the unpickler's
        names: list[str] = []
        with contextlib.suppress(RuntimeError, ValueError):  # not a torch.save archive: torch's reason says so
            names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(payload.numpy()))
        reasons = [line.split(". ")[0] for line in str(error).splitlines()
                   if line.strip() and not line.startswith(("Weights only", "Please file", "Check the"))]
        why = f"{type(error).__name__}: {reasons[0] if reasons else 'no reason given'}"
    why = f"it names {', '.join(names)}, which weights_only loading refuses" if names else why
    raise HealStateRefused(f"the heal state from rank {rank} ({int(size)} bytes) was refused: {why[:300]}")
