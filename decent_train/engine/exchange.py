"""The exchange: what a pair, a group and a stage of a round send and receive, in full precision or compressed.

``Exchanger.start`` sends a value to the stage's group and ``Exchanger.finish`` turns what arrived into the stage's
result; ``Exchanger.combine`` writes a round's result into the parameters' buffer. The engine (ddp.py) decides when:
it keeps the hooks, the order of a step (mix, optimizer step, launch), the modes and the state dict.

Full precision: a pair swaps its values by point-to-point send/receive straight from the parameters' memory (on the
CPU posted from a thread of its own, utils.PairPoster); a group of three or more all-reduces a copy.

Compressed gossip: CHOCO-style difference compression with a reference per round of the period.

Why differences: averaging compressed copies of the parameters (send Q(x_j), mix it in) moves the workers' mean by
the compression error of |x| at every step, forever. Here each worker i keeps, for each round r (and stage) of the
topology's period, a public copy ``own`` = x̂_i^r of its parameters that every member of its round-r group tracks,
and ``others``: a pair's peer's copy x̂_j^r, or a group's weighted sum Σ_{j≠i} w_ij x̂_j^r (Koloskova et al. 2019,
CHOCO-SGD, with the two-buffer form of EPFL's implementation). Round r's exchange of bucket b:

    launch (after the bucket's step):  q_i = Q(x_i − x̂_i^r);  x̂_i^r += D(q_i);  send q_i to the group
    mix (at the next step):            pair:  x̂_j^r += D(q_j);            x_i += γ w_ij (x̂_j^r − x̂_i^r)
                                       group: others += Σ_{j≠i} w_ij D(q_j);  x_i += γ (others − (1 − w_ii) x̂_i^r)

D(q) is decoded from the message itself, on the sender too, so every holder of x̂_i^r adds the same values: a pair's
copies are bit-identical at both ends, a group's weighted sum equals the members' weighted copies up to round-off.
With a symmetric W the mixing terms of a group cancel (Σ_i Σ_{j≠i} w_ij (x̂_j − x̂_i) = 0): the mean of the
parameters is preserved, to round-off, whatever Q does, and what is compressed is the difference to the public copy,
which shrinks with the update. Time-varying topologies (ring's alternating pairs, one-peer-exp) are why the copies are
per group: a worker talks to its round-r peers only in round r, so they are the only holders of its copy for that
group. A group that recurs (the same members and weights in several rounds or stages: an odd ring's triple, a
hierarchical node's stage) keeps one pair of copies, updated whenever it meets.

Memory per bucket: two copies per distinct group of the period that the worker is in (ring: 2 pairs, 4 copies;
one-peer-exp on n workers: 2 log2(n); complete and ring-3: 2; hierarchical: 2 per pair round + 2 for the node), plus
one scratch buffer and the messages; no float buffer to receive into (the engine allocates none when compressing).
``copy_dtype=torch.bfloat16`` halves the pairs' copies: both ends round x̂ + D(q) to bfloat16 with the same operation
on the same values, so the copies stay bit-identical and the mean exact; but a copy then follows x only to bfloat16's
precision (2^-9 relative), which bounds how close the workers get (the consensus distance stalls near 2^-9 |x|
instead of vanishing). A group's weighted sum is not one member's copy, so it stays in the parameters' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from decent_train.engine.topology import Edge
from decent_train.engine.utils import PairPoster

__all__ = [
    "BFloat16Compressor",
    "Compressor",
    "CompressedGossip",
    "ExchangeBuffers",
    "Exchanger",
    "Int8Compressor",
    "MESSAGE_TAGS",
    "make_compressor",
]

MESSAGE_TAGS = 1 << 16  # p2p tags per bucket: message i of bucket b is tagged b * MESSAGE_TAGS + i


class Compressor(Protocol):
    """Turns a difference into a message (``uint8`` bytes) and back; decoding must be a pure function of the message
    (both ends decode the same bytes to the same values)."""

    name: str

    def padded_numel(self, numel: int) -> int:
        """Elements the scratch buffer needs for a difference of ``numel`` elements (the tail stays zero)."""
        ...

    def message_bytes(self, numel: int) -> int:
        """Bytes of the message for ``numel`` elements."""
        ...

    def encode_(self, scratch: Tensor, message: Tensor) -> None:
        """Write the message for ``scratch`` (padded, the difference) into ``message``, and replace ``scratch`` by
        what the message decodes to."""
        ...

    def decode(self, message: Tensor, scratch: Tensor) -> None:
        """``scratch`` (padded) <- what ``message`` decodes to."""
        ...


class BFloat16Compressor:
    """The difference in bfloat16: half the bytes of float32, round to nearest even."""

    name = "bf16"

    def padded_numel(self, numel: int) -> int:
        return numel

    def message_bytes(self, numel: int) -> int:
        return 2 * numel

    def encode_(self, scratch: Tensor, message: Tensor) -> None:
        wire = message.view(torch.bfloat16)
        wire.copy_(scratch)
        scratch.copy_(wire)

    def decode(self, message: Tensor, scratch: Tensor) -> None:
        scratch.copy_(message.view(torch.bfloat16))


class Int8Compressor:
    """Blockwise absmax int8: per block of ``block`` elements one float32 scale (max |d| / 127) and int8 levels,
    rounded to nearest (deterministic). 256-element blocks cost 1.6% of the levels for their scales: 0.254x the bytes
    of float32."""

    name = "int8"
    LEVELS = 127

    def __init__(self, block: int = 256):
        if block < 1 or block % 4:
            raise ValueError(f"int8 block must be a positive multiple of 4 elements, got {block}")
        self.block = block

    def padded_numel(self, numel: int) -> int:
        return -(-numel // self.block) * self.block

    def message_bytes(self, numel: int) -> int:
        padded = self.padded_numel(numel)
        return padded + 4 * (padded // self.block)

    def _split(self, message: Tensor, padded: int) -> tuple[Tensor, Tensor]:
        blocks = padded // self.block
        return message[:padded].view(torch.int8).view(blocks, self.block), message[padded:].view(torch.float32)

    def encode_(self, scratch: Tensor, message: Tensor) -> None:
        levels, scales = self._split(message, scratch.numel())
        rows = scratch.view(-1, self.block)
        amax = torch.maximum(rows.amax(1), rows.amin(1).neg_())  # 9x faster on a CPU than vector_norm(inf)
        scales.copy_(amax / self.LEVELS)  # the wire's float32 scale: both ends decode with exactly this value
        scale = scales.to(scratch.dtype).unsqueeze(1)
        self._round_(rows.div_(torch.where(scale > 0, scale, torch.ones_like(scale))))
        levels.copy_(rows)
        rows.mul_(scale)  # the rounded levels times the scale: what a receiver decodes

    def _round_(self, rows: Tensor) -> None:
        """Values in units of their block's scale to integer levels, in place: to nearest. |d| / scale <= 127
        (1 + 2^-23) < 127.5, so the levels land in [-127, 127] without a clamp (one pass fewer)."""
        rows.round_()

    def decode(self, message: Tensor, scratch: Tensor) -> None:
        levels, scales = self._split(message, scratch.numel())
        rows = scratch.view(-1, self.block)
        rows.copy_(levels)
        rows.mul_(scales.to(scratch.dtype).unsqueeze(1))


COMPRESSORS = ("bf16", "int8")


def make_compressor(spec: str | Compressor | None, int8_block: int = 256) -> Compressor | None:
    """``None``, ``"none"``, ``"bf16"``, ``"int8"`` or a compressor object."""
    if spec is None or spec == "none":
        return None
    if spec == "bf16":
        return BFloat16Compressor()
    if spec == "int8":
        return Int8Compressor(int8_block)
    if isinstance(spec, str):
        raise ValueError(f"compression={spec!r}: valid are none, {', '.join(COMPRESSORS)} or a compressor object")
    return spec


@dataclass
class _GroupCopies:
    """A group's public copies: this worker's (``own``) and ``others``: a pair's peer's copy (``track`` = 1,
    ``pull`` = w_ij) or a group's weighted sum of its others' (``track`` = w_ij, ``pull`` = 1); ``own_weight`` = w_ii.
    The mix steps toward ``pull * others - (1 - own_weight) * own``."""

    own: Tensor
    others: Tensor
    own_weight: float
    track: float
    pull: float

    @classmethod
    def for_edge(cls, flat: Tensor, edge: Edge, copy_dtype: torch.dtype | None) -> _GroupCopies:
        if edge.size == 2:
            dtype = copy_dtype or flat.dtype
            return cls(flat.new_empty(flat.shape, dtype=dtype), flat.new_empty(flat.shape, dtype=dtype), edge.weight,
                       track=1.0, pull=1.0 - edge.weight)
        return cls(torch.empty_like(flat), torch.empty_like(flat), edge.weight, track=edge.neighbor_weight, pull=1.0)


@dataclass
class CompressedGossip:
    """One bucket's compressed exchange state: the copies of each of its groups, a scratch buffer, the messages."""

    compressor: Compressor
    numel: int
    scratch: Tensor
    outgoing: Tensor
    incoming: list[Tensor]  # a pair's: one; a group of m: m (an all-gather's outputs, this worker's included)
    copies: dict[tuple[tuple[int, ...], float], _GroupCopies] = field(default_factory=dict)  # by CompressedGossip.key

    @staticmethod
    def key(edge: Edge) -> tuple[tuple[int, ...], float]:
        """A group's copies are found by its members and weight: a group that recurs keeps the same copies."""
        return tuple(edge.ranks), float(edge.weight)

    @classmethod
    def create(
        cls, compressor: Compressor, flat: Tensor, groups: list[Edge], copy_dtype: torch.dtype | None
    ) -> CompressedGossip:
        """State for ``flat`` with a copy pair for each distinct group of ``groups`` (this worker's groups of two
        or more), a pair's in ``copy_dtype`` (None: ``flat``'s); set the copies with :meth:`reset` before the first
        exchange."""
        numel = flat.numel()
        message = compressor.message_bytes(numel)
        slots = max((1 if e.size == 2 else e.size for e in groups), default=1)
        return cls(
            compressor,
            numel,
            scratch=torch.zeros(compressor.padded_numel(numel), dtype=flat.dtype, device=flat.device),
            outgoing=torch.zeros(message, dtype=torch.uint8, device=flat.device),
            incoming=[torch.zeros(message, dtype=torch.uint8, device=flat.device) for _ in range(slots)],
            copies={cls.key(edge): _GroupCopies.for_edge(flat, edge, copy_dtype) for edge in groups},
        )

    def reset(self, value: Tensor | None) -> None:
        """Every copy to ``value`` (equal on every worker) or to zero: the copies stay consistent across workers."""
        for copies in self.copies.values():
            if value is None:
                copies.own.zero_()
                copies.others.zero_()
            else:
                copies.own.copy_(value)  # and others such that the mix's step, pull * others − (1 − w_ii) own, is 0
                torch.mul(value, (1.0 - copies.own_weight) / copies.pull, out=copies.others)

    def encode(self, x: Tensor, edge: Edge) -> Tensor:
        """q = Q(x − x̂) into the outgoing message, x̂ += D(q) (``edge``'s copy); the message to send."""
        copies = self.copies[self.key(edge)]
        difference = self.scratch[: self.numel]
        if copies.own.dtype == x.dtype:
            torch.sub(x, copies.own, out=difference)
        else:  # the same values: a CPU subtracts a bfloat16 copy 10x slower than it widens it first
            torch.sub(x, difference.copy_(copies.own), out=difference)
        self.compressor.encode_(self.scratch, self.outgoing)
        copies.own.add_(difference)
        return self.outgoing

    def mix(self, x: Tensor, out: Tensor, edge: Edge, received: list[Tensor], step: float) -> None:
        """others += track * D(q_j) for each received message, then out = x + step (pull * others − (1 − w_ii) x̂)
        (``out`` may be ``x``)."""
        copies = self.copies[self.key(edge)]
        difference = self.scratch[: self.numel]
        for message in received:
            self.compressor.decode(message, self.scratch)
            if copies.track == 1.0:  # a pair's: no scaling (2x faster into a bfloat16 copy on a CPU)
                copies.others.add_(difference)
            else:
                copies.others.add_(difference, alpha=copies.track)
        torch.add(x, copies.others, alpha=step * copies.pull, out=out)
        out.add_(copies.own, alpha=-step * (1.0 - copies.own_weight))

    def state(self) -> dict[str, Any]:
        """The copies, and the messages received (an exchange in flight is mixed in at the next step)."""
        return {
            "copies": {group: (c.own.clone(), c.others.clone()) for group, c in self.copies.items()},
            "incoming": [t.clone() for t in self.incoming],
        }

    def load(self, state: dict[str, Any]) -> None:
        if set(state["copies"]) != set(self.copies):
            raise ValueError(f"the saved public copies are for the groups {sorted(state['copies'])}, this worker's are "
                             f"{sorted(self.copies)} (another topology, or a checkpoint from before copies per group)")
        for group, (own, others) in state["copies"].items():
            self.copies[group].own.copy_(own)
            self.copies[group].others.copy_(others)
        torch._foreach_copy_(self.incoming, state["incoming"])


@dataclass(kw_only=True)
class ExchangeBuffers:
    """A bucket's memory for its exchanges. ``flat`` holds the values exchanged (the parameters'), ``comm`` receives
    the neighbours' values (a pair's) or their sum (a group's), and is empty with compression; ``staged`` (rounds of
    several stages, allocated when first needed) holds the result of the stages done so far; ``compressed``, with
    compression, the public copies.

    ``comm_anchor`` is a view that keeps a second reference to ``comm`` (``flat`` has the parameters' views): gloo's
    worker thread may drop an asynchronous collective's work last, and releasing a tensor's last reference there takes
    the GIL, which aborts the process during interpreter teardown (utils.run_collective).
    """

    index: int
    flat: Tensor
    comm: Tensor
    comm_anchor: Tensor | None = None
    staged: Tensor | None = None
    compressed: CompressedGossip | None = None

    def staging(self) -> Tensor:
        if self.staged is None:
            self.staged = torch.empty_like(self.flat)
        return self.staged


class Exchanger:
    """Sends and receives one stage of a round for a bucket: a pair by point-to-point, a group by a collective, in
    full precision or as compressed differences (the bucket's ``compressed`` state). Stateless between calls; the
    engine waits on what :meth:`start` returns before :meth:`finish`."""

    def __init__(self, rank: int, group: dist.ProcessGroup | None, message_bytes: int, consensus_step: float):
        self.rank, self.group = rank, group  # group: pairs' point-to-point (None: the default group)
        self.message_bytes = message_bytes  # a pair's messages at most this large (0: one per bucket)
        self.consensus_step = consensus_step
        self.pairs = PairPoster()

    def start(self, bucket: ExchangeBuffers, edge: Edge, value: Tensor) -> list[Any]:
        """Send ``value`` to the group; a pair receives the peer's value into ``comm``, a group the sum over it. With
        compression, the compressed difference to this worker's public copy for the group instead."""
        if edge.size == 1:
            return []
        if bucket.compressed is not None:
            return self._start_compressed(bucket, edge, bucket.compressed.encode(value, edge))
        if edge.size == 2:
            peer = self._peer(edge)
            pieces = zip(self.pieces(value), self.pieces(bucket.comm))
            return self.pairs.post(
                [
                    op
                    for i, (send, receive) in enumerate(pieces)
                    for op in (
                        dist.P2POp(dist.isend, send, peer, self.group, MESSAGE_TAGS * bucket.index + i),
                        dist.P2POp(dist.irecv, receive, peer, self.group, MESSAGE_TAGS * bucket.index + i),
                    )
                ]
            )
        bucket.comm.copy_(value)
        return [dist.all_reduce(bucket.comm, group=edge.group, async_op=True)]

    def _start_compressed(self, bucket: ExchangeBuffers, edge: Edge, message: Tensor) -> list[Any]:
        """A pair swaps messages, a group all-gathers them."""
        incoming = bucket.compressed.incoming
        if edge.size == 2:
            peer, tag = self._peer(edge), MESSAGE_TAGS * bucket.index
            return self.pairs.post(
                [
                    dist.P2POp(dist.isend, message, peer, self.group, tag),
                    dist.P2POp(dist.irecv, incoming[0], peer, self.group, tag),
                ]
            )
        return [dist.all_gather(incoming[: edge.size], message, group=edge.group, async_op=True)]

    def _peer(self, edge: Edge) -> int:
        return edge.ranks[0] if edge.ranks[1] == self.rank else edge.ranks[1]

    def received(self, bucket: ExchangeBuffers, edge: Edge) -> list[Tensor]:
        """The compressed messages of the other members of ``edge`` (an all-gather's outputs hold this worker's too)."""
        incoming = bucket.compressed.incoming
        if edge.size == 2:
            return incoming[:1]
        me = edge.ranks.index(self.rank)
        return [incoming[k] for k in range(edge.size) if k != me]

    def pieces(self, flat: Tensor) -> tuple[Tensor, ...]:
        """``flat`` as the messages a pair sends: one, or pieces of ``message_bytes``."""
        if not self.message_bytes:
            return (flat,)
        return flat.split(max(1, self.message_bytes // flat.element_size()))

    @staticmethod
    def coefficients(edge: Edge) -> tuple[float, float]:
        """(a, b) with the stage's result ``a * value + b * comm`` (see :meth:`start` for what comm holds)."""
        if edge.size == 1:
            return 1.0, 0.0
        if edge.size == 2:
            return edge.weight, 1.0 - edge.weight
        neighbor = 1.0 / edge.size if edge.is_uniform else edge.neighbor_weight
        return (0.0 if edge.is_uniform else edge.weight - neighbor), neighbor

    def finish(self, bucket: ExchangeBuffers, edge: Edge, value: Tensor) -> Tensor:
        """A stage's result, into ``staged`` (the parameters themselves change only at the mix)."""
        if edge.size == 1:
            return value
        out = bucket.staging()
        if bucket.compressed is not None:
            bucket.compressed.mix(value, out, edge, self.received(bucket, edge), self.consensus_step)
            return out
        own, other = self.coefficients(edge)
        if value is out:
            out.mul_(own).add_(bucket.comm, alpha=other)
        else:
            torch.mul(bucket.comm, other, out=out).add_(value, alpha=own)
        return out

    @staticmethod
    def combine(bucket: ExchangeBuffers, value: Tensor, own: float, other: float, keep: float | None = None) -> None:
        """flat <- own * flat + other * comm (``value`` is flat), or with a staged ``value``: keep * flat + own * value
        + other * comm. Zero terms are skipped; a convex pair of terms is one ``lerp_`` pass."""
        flat = bucket.flat
        if value is flat:
            if own == 0.0:
                torch.mul(bucket.comm, other, out=flat)
            elif other != 0.0 and abs(own + other - 1.0) < 1e-12:  # a convex combination (every pair): one pass
                flat.lerp_(bucket.comm, other)
            elif own != 1.0 or other != 0.0:
                flat.mul_(own)
                if other != 0.0:
                    flat.add_(bucket.comm, alpha=other)
        else:
            torch.mul(value, own, out=flat) if keep == 0.0 else flat.mul_(keep).add_(value, alpha=own)
            if other != 0.0:
                flat.add_(bucket.comm, alpha=other)
