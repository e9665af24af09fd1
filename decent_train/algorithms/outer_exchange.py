"""What an outer step of one fragment sends and what comes back: the exchange buffers of its parameters, filled with
the payload, mixed over one round of the topology (started, possibly left in flight over the next inner steps, then
finished), with or without compression.

The payload, per (dtype, device) group of the fragment's parameters, laid out flat:

- ``x``: the parameters (LocalSGD). Mixed: W x.
- ``x+anchor``: parameters then anchors (DiLoCo over gossip, where the anchors differ between workers). Mixed:
  W x and W anchor, whose difference is the mixed pseudo-gradient.
- ``delta``: the pseudo-gradient anchor − x (DiLoCo whose every round is one uniform group of all workers, without
  compression: the anchors are equal on every worker, so half the bytes). Mixed: the mean pseudo-gradient.

Compression reuses the engine's CHOCO public copies (engine/compress.py): a worker sends the compressed difference
between its payload and its public copy, so with a symmetric W the mean over workers of the mixed payload is the
mean of the payloads exactly, whatever the compressor does. Compressed, the anchors drift apart by the compression
residual, so the payload is ``x+anchor`` on every topology.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from decent_train.components.metrics import gossip_bytes_per_step
from decent_train.engine.comm import CommWaits, peers_must_answer
from decent_train.engine.compress import CompressedGossip, Compressor
from decent_train.engine.exchange import ExchangeBuffers, Exchanger
from decent_train.engine.membership import Membership
from decent_train.engine.topology import Edge, Topology

__all__ = ["OuterGroup", "Fragment", "InFlight", "OuterExchange", "split_parameters", "payload_kind"]

PAYLOAD_COPIES = {"x": 1, "x+anchor": 2, "delta": 1}


def payload_kind(anchored: bool, topology: Topology, compressed: bool) -> str:
    """What an outer step sends (see the module): ``x``, ``x+anchor`` or ``delta``."""
    if not anchored:
        return "x"
    everyone = all(
        len(stages) == 1 and stages[0].size == topology.world_size and stages[0].is_uniform
        for stages in (topology.edges(r) for r in range(topology.period))
    )
    return "delta" if everyone and not compressed else "x+anchor"


class OuterGroup:
    """A fragment's parameters of one dtype and device: their anchors and the exchange buffer of the payload.
    ``params`` are what this rank holds of ``owners``, the model's parameters: the parameters themselves, or their
    local shards (FSDP2's DTensors)."""

    def __init__(self, index: int, params: list[Tensor], payload: str, owners: list[nn.Parameter] | None = None):
        self.params, self.payload = params, payload
        self.owners = owners if owners is not None else params
        self.numel = sum(p.numel() for p in params)
        first = params[0]
        self.flat = torch.zeros(PAYLOAD_COPIES[payload] * self.numel, dtype=first.dtype, device=first.device)
        self.buffers = ExchangeBuffers(index=index, flat=self.flat, comm=torch.zeros_like(self.flat))
        self.anchors = [p.detach().clone() for p in params] if payload != "x" else []  # LocalSGD's x: none

    def compress(self, compressor: Compressor, groups: list[Edge]) -> None:
        """Send compressed differences to public copies, which start at this payload (equal on every worker)."""
        self.buffers.comm = self.flat.new_zeros(0)
        self.buffers.compressed = CompressedGossip.create(compressor, self.flat, groups, None)
        self.reset_copies()

    def reset_copies(self) -> None:
        """The public copies to the payload now; every worker must hold the same (at the start, or after an averaged
        resume)."""
        if self.buffers.compressed is not None:
            self.fill()
            self.buffers.compressed.reset(self.flat)

    @torch.no_grad()
    def fill(self) -> None:
        """The payload from the parameters (and anchors) now."""
        first, second = self.views(self.flat)
        params = [p.detach() for p in self.params]
        if self.payload == "delta":
            torch._foreach_copy_(first, self.anchors)
            torch._foreach_sub_(first, params)
            return
        torch._foreach_copy_(first, params)
        if second:
            torch._foreach_copy_(second, self.anchors)

    def views(self, flat: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """``flat``'s first part and its anchor part (``x+anchor`` only; else empty), shaped like the parameters."""
        first, second, offset = [], [], 0
        for p in self.params:
            first.append(flat[offset : offset + p.numel()].view_as(p))
            if self.payload == "x+anchor":
                second.append(flat[self.numel + offset : self.numel + offset + p.numel()].view_as(p))
            offset += p.numel()
        return first, second

    def message_bytes(self) -> int:
        compressed = self.buffers.compressed
        if compressed is not None:
            return compressed.compressor.message_bytes(self.flat.numel())
        return self.flat.numel() * self.flat.element_size()


@dataclass
class Fragment:
    """Parameters synced together (one group per dtype and device), every ``sync_every`` inner steps; ``syncs``
    counts its outer steps (the round index of its next one)."""

    groups: list[OuterGroup]
    syncs: int = 0


@dataclass
class InFlight:
    """A fragment's exchange that started: the value of each group after the stages run so far and the works of the
    stage in flight; or, ``mixed``, the finished result (from a checkpoint, or waited for)."""

    fragment: Fragment
    round: int
    values: list[Tensor]
    works: list[list[Any]]
    mixed: list[Tensor] | None = None


def split_parameters(
    named: list[tuple[str, nn.Parameter]], fragments: int | list[nn.Module]
) -> list[list[nn.Parameter]]:
    """The fragments' parameters: ``fragments`` contiguous runs of the trainable parameters ``named`` (model order) of
    about equal elements, or the trainable parameters of each module given, which must cover ``named`` once."""
    params = [p for _, p in named]
    if isinstance(fragments, int):
        if fragments > len(params):
            raise ValueError(f"fragments={fragments}: the model has only {len(params)} trainable parameter tensors")
        cumulative = [0]
        for p in params:
            cumulative.append(cumulative[-1] + p.numel())
        cuts = [0]
        for k in range(1, fragments):  # each cut nearest to k/F of the elements, leaving a tensor for each one after
            allowed = range(cuts[-1] + 1, len(params) - (fragments - k) + 1)
            cuts.append(min(allowed, key=lambda i: abs(cumulative[i] - cumulative[-1] * k / fragments)))
        cuts.append(len(params))
        return [params[a:b] for a, b in zip(cuts, cuts[1:])]
    owner: dict[int, int] = {}
    parts: list[list[nn.Parameter]] = []
    for i, module in enumerate(fragments):
        part = [p for p in module.parameters() if p.requires_grad]
        if not part:
            raise ValueError(f"fragments[{i}] ({type(module).__name__}) has no trainable parameters")
        for p in part:
            if id(p) in owner:
                raise ValueError(f"fragments[{i}] shares a parameter with fragments[{owner[id(p)]}]")
            owner[id(p)] = i
        parts.append(part)
    missing = [name for name, p in named if id(p) not in owner]
    if missing:
        raise ValueError(f"the fragments must cover the model's trainable parameters; none holds {missing[0]}")
    return parts


class OuterExchange:
    """Starts and finishes fragments' exchanges over the topology, through the engine's :class:`Exchanger`. Stages of a
    round before its overlapped one (``Topology.async_stage``) run when it starts, the ones after it when it
    finishes; both block, as in the engine."""

    def __init__(self, members: Membership, topology: Topology, consensus_step: float):
        self.members, self.topology = members, topology
        self.exchanger = Exchanger(members.rank, members.exchange_group, 0, consensus_step)
        self.waits = CommWaits(members.timeout)

    def start(self, fragment: Fragment) -> InFlight:
        round_ = fragment.syncs
        stages, overlapped = self.topology.edges(round_), self.topology.async_stage(round_)
        values, works = [], []
        for group in fragment.groups:
            group.fill()
            value = group.flat
            for edge in stages[:overlapped]:
                value = self._stage(group, edge, value, round_)
            works.append(self.exchanger.start(group.buffers, stages[overlapped], value))
            values.append(value)
        return InFlight(fragment, round_, values, works)

    def finish(self, exchange: InFlight) -> list[Tensor]:
        """Each group's mixed payload (views of the exchange buffers: read them before the fragment's next start)."""
        if exchange.mixed is not None:
            return exchange.mixed
        round_ = exchange.round
        stages, overlapped = self.topology.edges(round_), self.topology.async_stage(round_)
        mixed = []
        for group, value, works in zip(exchange.fragment.groups, exchange.values, exchange.works):
            self._wait(works, value, round_, stages[overlapped])
            value = self.exchanger.finish(group.buffers, stages[overlapped], value)
            for edge in stages[overlapped + 1 :]:
                value = self._stage(group, edge, value, round_)
            mixed.append(value)
        exchange.mixed = mixed
        return mixed

    def _stage(self, group: OuterGroup, edge: Edge, value: Tensor, round_: int) -> Tensor:
        works = self.exchanger.start(group.buffers, edge, value)
        self._wait(works, value, round_, edge)
        return self.exchanger.finish(group.buffers, edge, value)

    def _wait(self, works: list[Any], value: Tensor, round_: int, edge: Edge) -> None:
        if works:
            with peers_must_answer(lambda: f"outer step round {round_}'s exchange with ranks {edge.ranks}",
                                   self.members.timeout):
                self.waits.wait(works, value.device)

    def bytes_per_sync(self, fragments: list[Fragment]) -> float:
        """Bytes this worker sends when every fragment has synced once, averaged over the topology's period."""
        messages = [g.message_bytes() for f in fragments for g in f.groups]
        compressed = any(g.buffers.compressed is not None for f in fragments for g in f.groups)
        return gossip_bytes_per_step(self.topology, self.members.rank, messages, all_gather=compressed)
