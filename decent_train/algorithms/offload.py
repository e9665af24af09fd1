"""Host memory for the outer state of DiLoCo, LocalSGD and Streaming DiLoCo (``offload``): what lives where, and how
it moves.

Why: kept on the device for the whole run, the anchors, the exchange buffers, CHOCO's public copies and the outer
optimizer's momentum cost 4x to ~15x the model (audit R6): an OOM for exactly the large models DiLoCo is for.
torchft keeps the anchors in pinned host memory. With ``offload`` the front's state lives in host memory (pinned
where CUDA is present) between outer steps, and only the fragment whose exchange is in flight has device buffers:
its payload, what it receives, and, moved in for its exchange and outer step and back afterwards, its anchors,
public copies and outer-optimizer state. Streaming DiLoCo has one fragment in flight at a time, so the device holds
at most one fragment's worth.

How the copies stay off the critical path on a GPU: every copy runs on one side stream, ``non_blocking``. A copy in
waits for the work already queued on the compute stream (the buffers it fills may be memory that work just freed)
and the compute stream waits for it only where it uses the values (an event; the outer optimizer's state, prefetched
when the exchange starts, only at the outer step). A copy out waits for the values' last writer and is recorded on
the device tensors it reads (``record_stream``), so the caching allocator reuses them only once it finished, while the
next inner steps run. Nothing waits on the host per fragment; the host waits for the last copy out only where it
reads host memory itself (a checkpoint, the anchors' consensus). On the CPU the copies are plain copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from decent_train.engine.membership import local_part

__all__ = ["HostStore", "OuterStateHome", "check_offload", "held_bytes_by_place", "resolve_offload"]


def check_offload(offload: Any) -> None:
    """One line naming a bad ``offload`` and what is valid."""
    if offload is not None and not isinstance(offload, bool):
        raise ValueError(f"offload={offload!r}: valid are None (on when the parameters are on CUDA), True, False")


def resolve_offload(offload: bool | None, device: torch.device) -> bool:
    """``None``: on when the parameters are on CUDA; ``True``/``False`` force it (True on the CPU runs the same code
    path, host to host)."""
    check_offload(offload)
    return device.type == "cuda" if offload is None else offload


class HostStore:
    """Copies between the device and (pinned) host memory, on a side stream where the device is CUDA."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pin = torch.cuda.is_available()  # pinned memory needs a CUDA driver; a CPU-only run copies host to host
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copied_out: Any = None  # the last copy out's event (CUDA)

    def host_like(self, tensor: Tensor) -> Tensor:
        """An empty host tensor shaped like ``tensor`` (pinned where CUDA is present)."""
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.pin)

    def to_host(self, working: list[Tensor]) -> list[Tensor]:
        """New host tensors holding ``working`` (copied out: read them on the host after :meth:`wait`)."""
        homes = [self.host_like(t) for t in working]
        self.copy_out(homes, working)
        return homes

    def to_device(self, homes: list[Tensor], wait: bool = True) -> tuple[list[Tensor], Any]:
        """Device copies of ``homes`` and the event they are ready at; with ``wait`` the compute stream waits for it
        now (no host sync), else call :meth:`ready` before using them."""
        working = [torch.empty(h.shape, dtype=h.dtype, device=self.device) for h in homes]
        if self.stream is None:
            for w, h in zip(working, homes):
                w.copy_(h)
            return working, None
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the fresh blocks may be memory that queued compute work still uses
        with torch.cuda.stream(self.stream):
            for w, h in zip(working, homes):
                w.copy_(h, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self.stream)
        if wait:
            self.ready(arrived)
        return working, arrived

    def ready(self, arrived: Any) -> None:
        """The compute stream waits for a copy in (a stream dependency, not a host sync)."""
        if arrived is not None:
            torch.cuda.current_stream(self.device).wait_event(arrived)

    def copy_out(self, homes: list[Tensor], working: list[Tensor]) -> None:
        """``homes`` <- ``working`` once the compute stream's queued work wrote them; the device tensors are not
        reused before the copy finished (``record_stream``), so the caller may drop them at once."""
        if self.stream is None:
            for h, w in zip(homes, working):
                h.copy_(w)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            for h, w in zip(homes, working):
                h.copy_(w, non_blocking=True)
            self.copied_out = torch.cuda.Event()
            self.copied_out.record(self.stream)
        for w in working:
            w.record_stream(self.stream)

    def wait(self) -> None:
        """The host waits for every copy out so far: before it reads or writes host memory itself."""
        if self.copied_out is not None:
            self.copied_out.synchronize()


@dataclass
class OuterStateHome:
    """The outer optimizer's per-parameter state in host memory between the outer steps of its parameters' fragment:
    ``home[p]``, the host copies of ``optimizer.state[p]``'s tensors on the parameters' device (a DTensor's local
    shard; a state tensor the optimizer keeps on the CPU anyway, Adam's step count, stays as it is)."""

    store: HostStore
    optimizer: Optimizer
    home: dict[Tensor, dict[str, Tensor]] = field(default_factory=dict)
    prefetched: dict[Tensor, dict[str, Tensor]] = field(default_factory=dict)
    arrived: Any = None

    def prefetch(self, params: list[Tensor]) -> None:
        """Start copying ``params``' state to the device (it overlaps the inner steps until :meth:`bring_in`)."""
        keys = [(p, k) for p in params for k in self.home.get(p, {})]
        working, self.arrived = self.store.to_device([local_part(self.home[p][k]) for p, k in keys], wait=False)
        for (p, k), local in zip(keys, working):
            self.prefetched.setdefault(p, {})[k] = _like(self.home[p][k], local)

    def bring_in(self, params: list[Tensor]) -> None:
        """``params``' state on the device in the optimizer, for its step (prefetched, or copied now)."""
        if not all(p in self.prefetched for p in params if p in self.home):
            self.prefetch([p for p in params if p not in self.prefetched])
        self.store.ready(self.arrived)
        for p in params:
            self.optimizer.state[p].update(self.prefetched.pop(p, {}))
        self.arrived = None

    def send_home(self, params: list[Tensor]) -> None:
        """Copy ``params``' state on the device out to its host copies (made at the first step) and put the host
        copies back into the optimizer."""
        homes, working = [], []
        for p in params:
            state, mine = self.optimizer.state.get(p, {}), self.home.setdefault(p, {})
            for key, value in state.items():
                if not isinstance(value, Tensor) or local_part(value).device != self.store.device:
                    continue
                if any(value is h for h in mine.values()):
                    continue  # at home already
                if key not in mine:
                    mine[key] = _like(value, self.store.host_like(local_part(value)))
                homes.append(local_part(mine[key]))
                working.append(local_part(value))
                state[key] = mine[key]
        self.store.copy_out(homes, working)

    def held(self) -> list[tuple[Tensor, bool]]:
        """(tensor, at home) for the host copies and the prefetched device copies."""
        return ([(local_part(t), True) for state in self.home.values() for t in state.values()]
                + [(local_part(t), False) for state in self.prefetched.values() for t in state.values()])


def _like(template: Tensor, local: Tensor) -> Tensor:
    """``local`` as ``template`` is: a DTensor laid out like it (FSDP2's optimizer state), or itself."""
    if not hasattr(template, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, template.device_mesh, template.placements, run_check=False,
                              shape=template.shape, stride=template.stride())


def held_bytes_by_place(held: list[tuple[Tensor, bool]], params_on_cuda: bool) -> dict[str, int]:
    """``{"device": ..., "host": ...}`` over ``held`` (tensor, at home), each storage counted once. Where the
    parameters are on CUDA a tensor counts where it is (a CPU tensor: host); on a CPU-only machine, where both places
    are the CPU, by its role: a tensor the offload keeps at home is host, every other the device's."""
    seen: set[tuple[str, int]] = set()
    places = {"device": 0, "host": 0}
    for tensor, at_home in held:
        if tensor.nbytes == 0:
            continue
        storage = (str(tensor.device), tensor.untyped_storage().data_ptr())
        if storage in seen:
            continue
        seen.add(storage)
        host = tensor.device.type == "cpu" if params_on_cuda else at_home
        places["host" if host else "device"] += tensor.untyped_storage().nbytes()
    return places
