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

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from loguru import logger
from torch import Tensor, nn

from decent_train.algorithms.offload import HostStore
from decent_train.components.metrics import gossip_bytes_per_step
from decent_train.engine.comm import CommWaits, PairPoster, first_line, peers_must_answer
from decent_train.engine.compress import CompressedGossip, Compressor
from decent_train.engine.exchange import MESSAGE_TAGS, ExchangeBuffers, Exchanger, PeerMessages
from decent_train.engine.membership import Membership, local_part
from decent_train.engine.topology import Edge, ShardedTopology, Topology

__all__ = ["OuterGroup", "ParameterRun", "Fragment", "InFlight", "OuterExchange", "split_parameters", "payload_kind",
           "one_uniform_group", "replicas"]

PAYLOAD_COPIES = {"x": 1, "x+anchor": 2, "delta": 1}


def payload_kind(anchored: bool, topology: Topology, compressed: bool) -> str:
    """What an outer step sends (see the module): ``x``, ``x+anchor`` or ``delta``."""
    if not anchored:
        return "x"
    return "delta" if one_uniform_group(topology) and not compressed else "x+anchor"


def replicas(topology: Topology) -> int:
    """How many copies of the model a round mixes: the replicas of a sharded topology (each edge joins one shard
    position's ranks), else the workers."""
    return topology.base.world_size if isinstance(topology, ShardedTopology) else topology.world_size


def one_uniform_group(topology: Topology) -> bool:
    """Whether every round is one stage: all workers (all replicas), weighted alike (an all-reduce's mean)."""
    return all(
        len(stages) == 1 and stages[0].size == replicas(topology) and stages[0].is_uniform
        for stages in (topology.edges(r) for r in range(topology.period))
    )


_LINGERING: dict[int, list[Tensor]] = {}  # OuterExchange.linger


class OuterGroup:
    """A fragment's parameters of one dtype and device: their anchors and the exchange buffer of the payload.
    ``params`` are what this rank holds of ``owners``, the model's parameters: the parameters themselves, or their
    local shards (FSDP2's DTensors).

    With a ``store`` (offload, offload.py) the anchors and public copies live in host memory and the device buffers
    exist only between :meth:`acquire` (the exchange starts) and :meth:`release` (after the outer step): then this
    worker's public copies of the round's groups are device copies of the host ones, and the others' copies follow
    when their messages are mixed in; the anchors stay at home (:meth:`fill` and the outer step copy them straight
    to where they are used). ``reduce_in_place``: every round is one all-reduce of all
    workers (not a pair's swap), or a worker alone, so the payload is reduced in place, without a ``comm`` buffer.
    No third buffer holds a round's result: :meth:`OuterExchange._into` writes it into ``flat`` or ``comm``."""

    def __init__(self, index: int, owners: list[nn.Parameter], payload: str, names: list[str] | None = None,
                 store: HostStore | None = None, reduce_in_place: bool = False):
        self.owners, self.payload, self.store = owners, payload, store
        self.names = names if names is not None else [f"parameter {i}" for i in range(len(owners))]
        self.params = params = [local_part(o) for o in owners]
        self._layout = [(p.shape, p.dtype, p.device) for p in params]
        self._storage = [p.data_ptr() for p in params]
        self.numel = sum(p.numel() for p in params)
        self.reduce_in_place = reduce_in_place
        first = params[0]
        self.acquired = False
        if store is None:
            self.flat = torch.zeros(PAYLOAD_COPIES[payload] * self.numel, dtype=first.dtype, device=first.device)
            comm = self.flat if reduce_in_place else torch.zeros_like(self.flat)
            self.buffers = ExchangeBuffers(index=index, flat=self.flat, comm=comm)
            self.anchors = [p.detach().clone() for p in params] if payload != "x" else []  # LocalSGD's x: none
        else:
            self.flat = first.new_empty(0)
            self.buffers = ExchangeBuffers(index=index, flat=self.flat, comm=self.flat)
            self.anchors = store.to_host([p.detach() for p in params]) if payload != "x" else []
        self.home_copies: dict[Any, Any] = {}  # offload: the public copies in host memory, by group
        self.pinned: list[Tensor] = []  # views of what the exchange in flight posted (OuterExchange._post)
        # Gossip (``keep_sent``): its outer step adds W x^s − x^s, so x^s, what the exchange sent, is read back then:
        # from ``flat`` where no stage writes it (:meth:`fill`), else from ``sent``, a copy made as it starts.
        self.keep_sent = False
        self.sent: Tensor | None = None
        self._sent_in_flat = False

    def follow_params(self) -> None:
        """Capture the parameters' local shards again if their storage moved (audit R9): FSDP2 keeps a DTensor's
        local tensor in place through its own resets and in-place loads, but a module moved or cast in place
        (``model.cpu()`` and back: ``Module._apply``) gives it new storage, and the front would then read and write
        tensors the model no longer uses. Called as an exchange starts and at the outer step; checking costs one
        pointer per parameter. A parameter whose shape, dtype or device changed (``model.double()``, ``model.cuda()``
        after the front was built) is refused: the front's buffers and anchors are laid out for what it was."""
        if all(local_part(o).data_ptr() == at for o, at in zip(self.owners, self._storage)):
            return
        now = [local_part(o) for o in self.owners]
        for name, p, (shape, dtype, device) in zip(self.names, now, self._layout):
            if (p.shape, p.dtype, p.device) != (shape, dtype, device):
                raise ValueError(
                    f"parameter '{name}' is now {p.dtype} {tuple(p.shape)} on {p.device}, was {dtype} {tuple(shape)} "
                    f"on {device} when the front was built: build it after the model's last .to() or cast")
        self.params = now
        self._storage = [p.data_ptr() for p in now]

    def compress(self, compressor: Compressor, groups: list[Edge]) -> None:
        """Send compressed differences to public copies, which start at this payload (equal on every worker)."""
        self._create_copies(compressor, groups)
        self.reset_copies()

    def _create_copies(self, compressor: Compressor, groups: list[Edge]) -> None:
        """Public copies for ``groups`` (their values unset: :meth:`reset_copies` sets them)."""
        self.buffers.comm = self.flat.new_zeros(0)
        if self.store is None:
            self.buffers.compressed = CompressedGossip.create(compressor, self.flat, groups, None)
        else:  # the copies in host memory; the scratch and the messages exist while an exchange is in flight
            shape = torch.empty(PAYLOAD_COPIES[self.payload] * self.numel, dtype=self.flat.dtype, device="meta")
            compressed = CompressedGossip.create(compressor, shape, groups, None)
            self.home_copies = {key: replace(c, own=self.store.host_like(c.own), others=self.store.host_like(c.others))
                                for key, c in compressed.copies.items()}
            compressed.copies = dict(self.home_copies)
            self.buffers.compressed = compressed
            self._message_numel, self._slots = compressed.outgoing.numel(), len(compressed.incoming)
            self._drop_device_buffers()

    def reset_copies(self, at_anchors: bool = False) -> None:
        """The public copies to the payload now; every worker must hold the same (at the start, or after an averaged
        resume). ``at_anchors``: to ``(anchor, anchor)`` instead (LocalSGD's ``x``, which keeps no anchors: zero)."""
        compressed = self.buffers.compressed
        if compressed is None:
            return
        self.acquire(list(self.home_copies), others=True)  # offload: the copies and ``flat`` on the device
        if not at_anchors:
            self.fill()
            compressed.reset(self.flat)
        elif self.payload == "x":
            compressed.reset(None)
        else:
            first, second = self.views(self.flat)  # flat is scratch until the next exchange's fill
            self.anchors_into(first)
            if second:
                self.anchors_into(second)
            compressed.reset(self.flat)
        self.release()  # offload: the copies back to host memory

    def restart_copies(self, groups: list[Edge]) -> None:
        """Live membership, at a change (after the anchors' mean): copies for ``groups``, this worker's groups of the
        new topology, with every public value at ``(anchor, anchor)`` (``x``, LocalSGD's payload, which keeps no
        anchors: zero, as the engine's copies restart). The old copies cannot go on: a group's ``others`` is one
        weighted sum, from which a lost member's copy cannot be taken out, and a peer's copy may differ between its
        holders where its last message reached some of them. The anchors are equal on every member after their mean,
        so the copies are equal wherever they are held, the joiner's too (it brought none); and the first message
        after the change carries ``x − anchor``, as small as a steady one, not the whole payload. Offload: the new
        copies live in host memory, as the old ones did."""
        compressed = self.buffers.compressed
        if compressed is None:
            return
        self._create_copies(compressed.compressor, groups)
        self.reset_copies(at_anchors=True)

    def acquire(self, keys: list[Any], others: bool = False) -> None:
        """Offload: the device buffers of an exchange, and device copies of this worker's public copies (``own``)
        of the groups ``keys`` (``CompressedGossip.key``s of this round's stages), which the encode reads as the
        exchange starts; the ``others`` come in only where their messages are mixed (:meth:`bring_in_others`), or
        here with ``others``. Nothing without offload, or if held."""
        store = self.store
        if store is None or self.acquired:
            return
        self.acquired = True
        self.flat = torch.empty(PAYLOAD_COPIES[self.payload] * self.numel, dtype=self.flat.dtype,
                                device=self.flat.device)
        self.buffers.flat = self.flat
        compressed = self.buffers.compressed
        if compressed is None:
            self.buffers.comm = self.flat if self.reduce_in_place else torch.empty_like(self.flat)
            return
        keys = [k for k in keys if k in self.home_copies]
        names = ("own", "others") if others else ("own",)
        copies = iter(store.to_device([getattr(self.home_copies[k], name) for k in keys for name in names]))
        for key in keys:
            compressed.copies[key] = replace(self.home_copies[key], **{name: next(copies) for name in names})
        compressed.scratch = None  # made at its first use (none for int8's compiled kernels over a pair)
        compressed.outgoing = self.flat.new_zeros(self._message_numel, dtype=torch.uint8)
        compressed.incoming = [self.flat.new_zeros(self._message_numel, dtype=torch.uint8)
                               for _ in range(self._slots)]

    def bring_in_others(self, edge: Edge) -> None:
        """Offload: a device copy of the ``others`` of ``edge``'s group, as its messages are about to be mixed in
        (nothing reads it before: while an exchange is in flight the device holds this worker's copy alone)."""
        compressed = self.buffers.compressed
        if self.store is None or compressed is None or not self.acquired or edge.size == 1:
            return
        key = CompressedGossip.key(edge)
        current, home = compressed.copies.get(key), self.home_copies.get(key)
        if current is None or home is None or current.others is not home.others:
            return
        (others,) = self.store.to_device([home.others])
        compressed.copies[key] = replace(current, others=others)

    def release(self) -> None:
        """Offload: copy the round's public copies back to host memory and drop the device buffers (the copies out
        finish before their memory is reused: offload.py). The outer step has copied the anchors home already."""
        store = self.store
        if store is None or not self.acquired:
            return
        homes: list[Tensor] = []
        working: list[Tensor] = []
        compressed = self.buffers.compressed
        if compressed is not None:
            for key, home in self.home_copies.items():
                current = compressed.copies[key]
                for at_home, on_device in ((home.own, current.own), (home.others, current.others)):
                    if on_device is not at_home:
                        homes.append(at_home)
                        working.append(on_device)
                compressed.copies[key] = home
        store.copy_out(homes, working)
        self._drop_device_buffers()

    def discard(self) -> None:
        """Offload: drop the device buffers without copying anything back (a resume overwrites the host state)."""
        if self.store is not None and self.acquired:
            if self.buffers.compressed is not None:
                self.buffers.compressed.copies = dict(self.home_copies)
            self._drop_device_buffers()

    def _drop_device_buffers(self) -> None:
        self.flat = self.flat.new_empty(0)
        self.sent = None  # (an exchange's ``InFlight.sent`` holds its own views until its outer step)
        self.buffers.flat = self.buffers.comm = self.flat
        self.buffers.staged = self.buffers.group_received = None
        compressed = self.buffers.compressed
        if compressed is not None:
            compressed.scratch, compressed.outgoing = None, self.flat.new_empty(0)
            compressed.incoming = []
        self.acquired = False

    def held(self) -> list[tuple[Tensor, bool]]:
        """(tensor, at home) for every tensor this group holds now: anchors, exchange buffers, public copies, the
        scratch and messages of compression."""
        at_home = self.store is not None
        buffers, compressed = self.buffers, self.buffers.compressed
        held = [(a, at_home) for a in self.anchors]
        held += [(t, False) for t in (buffers.flat, buffers.comm, buffers.staged, buffers.group_received, self.sent)
                 if t is not None]
        if compressed is not None:
            held += [(t, False) for t in (compressed.scratch, compressed.outgoing, *compressed.incoming)
                     if t is not None]
            for key, copies in compressed.copies.items():
                home = self.home_copies.get(key)
                homes = (home.own, home.others) if home is not None else ()
                working = (copies.own, copies.others)
                held += [(t, any(t is h for h in homes)) for t in working]
                held += [(h, True) for h in homes if not any(h is t for t in working)]
        return held

    def copies_state(self) -> dict[str, Any] | None:
        """The public copies for a checkpoint (``CompressedGossip.state``'s form; offloaded and at rest, the messages
        are zeros: an outer exchange writes them before it reads them)."""
        compressed = self.buffers.compressed
        if compressed is None:
            return None
        if self.store is None or self.acquired:
            return compressed.state()
        return {"copies": {key: (c.own.clone(), c.others.clone()) for key, c in compressed.copies.items()},
                "incoming": [torch.zeros(self._message_numel, dtype=torch.uint8) for _ in range(self._slots)]}

    def load_copies(self, state: dict[str, Any]) -> None:
        """The public copies from :meth:`copies_state` (offloaded: into the host copies, which are the front's copies
        while nothing is in flight, and no messages are held at rest)."""
        compressed = self.buffers.compressed
        if self.store is not None:
            assert not self.acquired, "the public copies are loaded with no exchange in flight"
            state = {"copies": state["copies"], "incoming": []}
        compressed.load(state)

    @torch.no_grad()
    def fill(self, flat_kept: bool = False) -> None:
        """The payload from the parameters (and anchors) now. ``keep_sent`` (Gossip's payload ``x``): what was sent
        stays readable (:meth:`sent_views`) until the outer step: in ``flat`` itself where ``flat_kept`` (nothing
        writes it before then: :meth:`OuterExchange.start`), else in a copy, a payload more only on the topologies
        and compressions that overwrite ``flat``."""
        first, second = self.views(self.flat)
        params = [p.detach() for p in self.params]
        if self.payload == "delta":
            self.anchors_into(first)
            torch._foreach_sub_(first, params)
            return
        torch._foreach_copy_(first, params)
        if second:
            self.anchors_into(second)
        if self.keep_sent:
            self._sent_in_flat = flat_kept
            if not flat_kept:
                if self.sent is None:
                    self.sent = torch.empty(self.numel, dtype=self.flat.dtype, device=self.flat.device)
                torch._foreach_copy_(self.sent_views(), params)

    def sent_views(self) -> list[Tensor]:
        """What the last :meth:`fill` sent of the parameters (``keep_sent``), shaped like them."""
        if self._sent_in_flat:
            return self.views(self.flat)[0]
        assert self.sent is not None, "keep_sent: nothing was sent yet"
        return self.views(self.sent)[0]

    def anchors_into(self, targets: list[Tensor], which: slice = slice(None)) -> None:
        """``targets`` (device tensors) <- the anchors ``which`` (offload: straight from host memory)."""
        anchors = self.anchors[which]
        if self.store is not None:
            self.store.copy_in(targets, anchors)
        else:
            torch._foreach_copy_(targets, anchors)

    def anchors_from(self, sources: list[Tensor], which: slice = slice(None)) -> None:
        """The anchors ``which`` <- ``sources`` (the parameters after an outer step; offload: copied out to host
        memory from a snapshot, so the next inner steps may write the parameters at once)."""
        anchors = self.anchors[which]
        if self.store is not None:
            self.store.copy_out(anchors, sources, snapshot=True)
        else:
            torch._foreach_copy_(anchors, sources)

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
        numel = PAYLOAD_COPIES[self.payload] * self.numel
        compressed = self.buffers.compressed
        if compressed is not None:
            return compressed.compressor.message_bytes(numel)
        return numel * self.flat.element_size()


@dataclass
class ParameterRun:
    """Consecutive parameters ``which`` of a group that an outer step updates together, with their views of the
    mixed payload (``first``; ``second``: the mixed anchors of ``x+anchor``, else empty)."""

    group: OuterGroup
    which: slice
    first: list[Tensor]
    second: list[Tensor]
    sent: list[Tensor] = field(default_factory=list)  # Gossip: what the exchange sent of these parameters (x^s)

    @property
    def params(self) -> list[Tensor]:
        return [p.detach() for p in self.group.params[self.which]]

    @property
    def owners(self) -> list[nn.Parameter]:
        return self.group.owners[self.which]


@dataclass
class Fragment:
    """Parameters synced together (one group per dtype and device), every ``sync_every`` inner steps; ``syncs``
    counts its outer steps (the round index of its next one)."""

    groups: list[OuterGroup]
    syncs: int = 0


@dataclass
class InFlight:
    """A fragment's exchange that started: the value of each group after the stages run so far and the works of the
    stage in flight; or, ``mixed``, the finished result (from a checkpoint, or waited for). ``sent``: per group, what
    it sent of the parameters (x^s), where the outer step reads it back (Gossip's ``keep_sent``; else None)."""

    fragment: Fragment
    round: int
    values: list[Tensor]
    works: list[list[Any]]
    mixed: list[Tensor] | None = None
    sent: list[list[Tensor]] | None = None


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

    def __init__(self, members: Membership, topology: Topology, consensus_step: float, message_bytes: int = 0,
                 fault_tolerant: bool = False):
        self.members, self.topology = members, topology
        self.exchanger = Exchanger(members.rank, members.exchange_group, message_bytes, consensus_step,
                                   point_to_point=fault_tolerant)
        self.waits = CommWaits(members.timeout)
        self.missed: list[tuple[int, int]] = []  # fault_tolerant: (round, peer rank) of each message that never came

    def changed(self, topology: Topology) -> None:
        """Live membership: the members were renumbered; exchange over ``topology`` (built over them) from now on.
        A thread still waiting on a dead peer is left behind, as the engine's is."""
        self.topology = topology
        self.exchanger.rank = self.members.rank
        self.exchanger.pairs = PairPoster()

    def check_messages(self, groups: list[OuterGroup], message_size_in_mb: float) -> None:
        """A pair sends a group's payload in messages of ``message_bytes`` (a rate-limited link keeps up with small
        ones), each with its own tag: at most ``MESSAGE_TAGS`` per group."""
        size = self.exchanger.message_bytes
        if not size:
            return
        most = max(-(-PAYLOAD_COPIES[g.payload] * g.numel // max(1, size // g.params[0].element_size()))
                   for g in groups)
        if most > MESSAGE_TAGS:
            raise ValueError(f"message_size_in_mb={message_size_in_mb} splits an outer step's payload into {most} "
                             f"messages, more than {MESSAGE_TAGS}; use larger messages")

    def start(self, fragment: Fragment) -> InFlight:
        round_ = fragment.syncs
        stages, overlapped = self.topology.edges(round_), self.topology.async_stage(round_)
        values, works = [], []
        for group in fragment.groups:
            group.follow_params()
            group.acquire([CompressedGossip.key(edge) for edge in stages if edge.size > 1])  # offload: on the device
            # ``flat`` keeps what was sent where the round is one stage whose result goes to ``comm`` (``_into``) or
            # is ``flat`` untouched (a worker alone); not where an earlier stage's result, a reduction in place or a
            # compressed mix is written into it
            alone = len(stages) == 1 and stages[0].size == 1
            one = len(stages) == 1 and not group.reduce_in_place and group.buffers.compressed is None
            group.fill(flat_kept=alone or one)
            group.pinned = []  # the previous exchange's works were waited on (and let go of) long ago
            value = group.flat
            for edge in stages[:overlapped]:
                value = self._stage(group, edge, value, round_, last=False)
            works.append(self._post(group, stages[overlapped], value))
            values.append(value)
        sent = [g.sent_views() for g in fragment.groups] if all(g.keep_sent for g in fragment.groups) else None
        return InFlight(fragment, round_, values, works, sent=sent)

    def finish(self, exchange: InFlight) -> list[Tensor]:
        """Each group's mixed payload (views of the exchange buffers: read them before the fragment's next start)."""
        if exchange.mixed is not None:
            return exchange.mixed
        round_ = exchange.round
        stages, overlapped = self.topology.edges(round_), self.topology.async_stage(round_)
        mixed = []
        last = len(stages) - 1
        for group, value, works in zip(exchange.fragment.groups, exchange.values, exchange.works):
            self._wait(group, works, value, round_, stages[overlapped])
            group.bring_in_others(stages[overlapped])
            value = self.exchanger.finish(group.buffers, stages[overlapped], value,
                                          self._into(group, value, overlapped == last))
            for k in range(overlapped + 1, len(stages)):
                value = self._stage(group, stages[k], value, round_, k == last)
            mixed.append(value)
        exchange.mixed = mixed
        return mixed

    def _post(self, group: OuterGroup, edge: Edge, value: Tensor) -> list[Any]:
        """Start a stage's exchange, holding a view of every tensor it posts until the next exchange starts.

        gloo's worker thread keeps each work, and so its tensors, until it moves on, and may drop them after the wait
        returned. These buffers, unlike the engine's (whose ``flat`` the parameters are views of), have no other
        reference but their Python object; releasing such a tensor's last one on gloo's thread takes the GIL, and
        during interpreter teardown that aborts a finished process ("terminate called without an active exception";
        engine/comm.py, run_collective). A view keeps a second reference, dropped here on the main thread."""
        buffers = group.buffers
        posted = [value, buffers.flat, buffers.comm, buffers.group_received]
        if buffers.compressed is not None:
            posted += [buffers.compressed.outgoing, *buffers.compressed.incoming]
        group.pinned += [t.view_as(t) for t in posted if t is not None and t.device.type == "cpu"]  # gloo's
        return self.exchanger.start(buffers, edge, value)

    @staticmethod
    def linger(fragments: list[Fragment]) -> None:
        """Keep the views :meth:`_post` holds until the interpreter ends, past this exchange's front (a script's
        ``with LocalSGD(...):`` drops the front as its block ends, while gloo's thread may still hold the last
        exchange's works): one list per group, replaced each time its front's block ends."""
        for fragment in fragments:
            for group in fragment.groups:
                _LINGERING[id(group)] = list(group.pinned)

    def _stage(self, group: OuterGroup, edge: Edge, value: Tensor, round_: int, last: bool) -> Tensor:
        works = self._post(group, edge, value)
        self._wait(group, works, value, round_, edge)
        group.bring_in_others(edge)
        return self.exchanger.finish(group.buffers, edge, value, self._into(group, value, last))

    @staticmethod
    def _into(group: OuterGroup, value: Tensor, last: bool) -> Tensor:
        """Where a stage's result goes: into one of the two buffers it is computed from, never a third (``staged``,
        the engine's, would be a third payload-sized buffer: audit D7). Both are this group's own (each fragment has
        its own), and the stage's messages were waited for, so nothing still reads what was sent.

        - The round's last stage, uncompressed: ``comm``. Nothing receives into it again before this fragment's next
          exchange starts, and the result is read before that: by the outer step, which finishes the exchange
          (Streaming's delayed one too) and consumes the result at once; a checkpoint taken before copies it.
        - An earlier stage: ``value`` (``flat``), in place, as the next stage receives into ``comm`` while it sends
          this result.
        - Compressed (no ``comm``): ``value``, in place, as the engine mixes; the message was encoded apart, so
          ``flat`` is not posted. ``fill`` rewrites ``flat`` at the next start."""
        return group.buffers.comm if last and group.buffers.compressed is None else value

    def _wait(self, group: OuterGroup, works: list[Any], value: Tensor, round_: int, edge: Edge) -> None:
        if works and self.exchanger.point_to_point:
            self._wait_each(group, works, value, round_, edge)
        elif works:
            with peers_must_answer(lambda: f"outer step round {round_}'s exchange with ranks {edge.ranks}",
                                   self.members.timeout):
                self.waits.wait(works, value.device)

    def _wait_each(self, group: OuterGroup, works: list[PeerMessages], value: Tensor, round_: int, edge: Edge) -> None:
        """Live membership: each peer's message waited on alone; one that fails (the peer died) is replaced by this
        worker's own payload (``Exchanger.settle``: its weight stays here, for x and anchor alike) until the members
        change."""
        failed = []
        for messages in works:
            try:
                self.waits.wait([messages], value.device)
            except RuntimeError as error:
                failed.append(messages)
                if not any(peer == messages.peer for _, peer in self.missed):
                    logger.warning(f"rank {self.members.rank}: no message from rank {messages.peer} in outer step "
                                   f"round {round_}: {first_line(error)}; its weight stays here until the members "
                                   "change")
                self.missed.append((round_, messages.peer))
        self.exchanger.settle(group.buffers, edge, value, failed)

    def bytes_per_sync(self, fragments: list[Fragment]) -> float:
        """Bytes this worker sends when every fragment has synced once, averaged over the topology's period."""
        messages = [g.message_bytes() for f in fragments for g in f.groups]
        compressed = any(g.buffers.compressed is not None for f in fragments for g in f.groups)
        return gossip_bytes_per_step(self.topology, self.members.rank, messages, all_gather=compressed)
