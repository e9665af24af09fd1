"""Host memory for the outer state of DiLoCo, LocalSGD and Streaming DiLoCo (``offload``): what lives where, and how
it moves.

Why: kept on the device for the whole run, the anchors, the exchange buffers, CHOCO's public copies and the outer
optimizer's momentum cost 3x to about 13x the model (audit R6; scripts/BENCHMARKS.md): an OOM for exactly the large
models DiLoCo is for. torchft keeps the anchors in pinned host memory. With ``offload`` the front's state lives in
host memory (pinned where CUDA is present), and the device holds only what the fragment whose exchange is in flight
sends and receives: its payload (and a receive buffer where a pair or compression needs one, and this worker's
public copies for the round; the peers' copies come in when their messages are mixed, at the outer step). The
anchors go from host memory straight into the payload and, at the outer step, into the parameters; the outer
optimizer's state comes in a part of a fragment at a time (local_steps.py, ``OUTER_STEP_PARTS``), is stepped and
goes back. Streaming DiLoCo has one fragment in flight at a time, so while the inner steps run the device holds one
fragment's payload, and at an outer step that plus a part of a fragment.

How the copies stay off the critical path on a GPU: copies in run on one side stream and copies out on another,
``non_blocking``. A copy in waits for the work already queued on the compute stream (the memory it fills may be what
that work reads or just freed) and for the copy out that last wrote its host tensor, and the compute stream waits for
it (an event, not a host sync) before it reads the values. A copy out waits for the values' last writer and is
recorded on the device tensors it reads (``record_stream``), so the caching allocator reuses them only once it
finished, while the next inner steps run. Nothing waits on the host per fragment; the host waits for the copies in
flight only where it reads or writes host memory itself (a checkpoint, the anchors' consensus). On the CPU the
copies are plain copies.
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
    """Copies between the device and (pinned) host memory: on CUDA the copies in and the copies out each run on a side
    stream of their own. One stream for both made every copy in (which the compute stream waits for) queue behind
    the copies out of the outer step before it, though PCIe moves both directions at once; a copy in of a host
    tensor still waits for the copy out that last wrote it (``_written``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pin = torch.cuda.is_available()  # pinned memory needs a CUDA driver; a CPU-only run copies host to host
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None  # copies in
        self.out_stream = torch.cuda.Stream(device) if cuda else None  # copies out
        self.copied_in: Any = None  # the last copy in's event (CUDA)
        self.copied_out: Any = None  # the last copy out's event (CUDA)
        self._written: dict[int, Any] = {}  # a host storage's address: the event of the copy out that last wrote it

    def host_like(self, tensor: Tensor) -> Tensor:
        """An empty host tensor shaped like ``tensor`` (pinned where CUDA is present)."""
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.pin)

    def to_host(self, working: list[Tensor]) -> list[Tensor]:
        """New host tensors holding ``working`` (copied out: read them on the host after :meth:`wait`)."""
        homes = [self.host_like(t) for t in working]
        self.copy_out(homes, working)
        return homes

    def to_device(self, homes: list[Tensor]) -> list[Tensor]:
        """Device copies of ``homes``, usable on the compute stream at once (it waits for their arrival)."""
        working = [torch.empty(h.shape, dtype=h.dtype, device=self.device) for h in homes]
        self.copy_in(working, homes)
        return working

    def copy_in(self, working: list[Tensor], homes: list[Tensor]) -> None:
        """``working`` (device tensors: fresh ones, the parameters, views of a payload) <- ``homes``, after the work
        queued on the compute stream and the copies out that wrote ``homes``; the compute stream waits for the copies
        before what it queues next (no host sync)."""
        if self.stream is None:
            for w, h in zip(working, homes):
                w.copy_(h)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # fresh blocks may be memory that queued work still uses; the parameters too
        writers = {id(e): e for e in (self._written.get(h.untyped_storage().data_ptr()) for h in homes)
                   if e is not None}
        for event in writers.values():
            self.stream.wait_event(event)
        with torch.cuda.stream(self.stream):
            for w, h in zip(working, homes):
                w.copy_(h, non_blocking=True)
            self.copied_in = torch.cuda.Event()
            self.copied_in.record(self.stream)
        compute.wait_event(self.copied_in)

    def copy_out(self, homes: list[Tensor], working: list[Tensor], snapshot: bool = False) -> None:
        """``homes`` <- ``working`` once the compute stream's queued work wrote them; the device tensors are not
        reused before the copy finished (``record_stream``), so the caller may drop them at once. ``snapshot``: the
        compute stream writes ``working`` next (the parameters), so the copy reads a clone of them, freed as it ends.
        A copy in that read ``homes`` is done: the compute stream, which this copy waits for, waited for it."""
        if self.out_stream is None:
            for h, w in zip(homes, working):
                h.copy_(w)
            return
        if snapshot:
            working = [w.clone() for w in working]
        compute = torch.cuda.current_stream(self.device)
        self.out_stream.wait_stream(compute)
        with torch.cuda.stream(self.out_stream):
            for h, w in zip(homes, working):
                h.copy_(w, non_blocking=True)
            self.copied_out = torch.cuda.Event()
            self.copied_out.record(self.out_stream)
        for h in homes:
            self._written[h.untyped_storage().data_ptr()] = self.copied_out
        for w in working:
            w.record_stream(self.out_stream)

    def wait(self) -> None:
        """The host waits for every copy so far: before it reads or writes host memory itself."""
        for event in (self.copied_in, self.copied_out):
            if event is not None:
                event.synchronize()


@dataclass
class OuterStateHome:
    """The outer optimizer's per-parameter state in host memory between the outer steps of its parameters' fragment:
    ``home[p]``, the host copies of ``optimizer.state[p]``'s tensors on the parameters' device (a DTensor's local
    shard; a state tensor the optimizer keeps on the CPU anyway, Adam's step count, stays as it is). It comes to the
    device for its parameters' step only (:meth:`bring_in`, :meth:`send_home`), not while their exchange runs."""

    store: HostStore
    optimizer: Optimizer
    home: dict[Tensor, dict[str, Tensor]] = field(default_factory=dict)

    def bring_in(self, params: list[Tensor]) -> None:
        """``params``' state on the device in the optimizer, for its step."""
        keys = [(p, k) for p in params for k in self.home.get(p, {})]
        working = self.store.to_device([local_part(self.home[p][k]) for p, k in keys])
        for (p, k), local in zip(keys, working):
            self.optimizer.state[p][k] = _like(self.home[p][k], local)

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
        """(tensor, at home) for the host copies."""
        return [(local_part(t), True) for state in self.home.values() for t in state.values()]


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
