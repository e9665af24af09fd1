"""Compressed gossip: compressors and the public copies of CHOCO-style difference compression.

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
one scratch buffer (none where int8's compiled kernels encode and a pair's mix: int8_kernels.py) and the
messages; no float buffer to receive into (the engine allocates none when compressing).
``copy_dtype=torch.bfloat16`` halves the pairs' copies: both ends round x̂ + D(q) to bfloat16 with the same operation
on the same values, so the copies stay bit-identical and the mean exact; but a copy then follows x only to bfloat16's
precision (2^-9 relative), which bounds how close the workers get (the consensus distance stalls near 2^-9 |x|
instead of vanishing). A group's weighted sum is not one member's copy, so it stays in the parameters' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from decent_train.engine.int8_kernels import Int8Kernels, compiled_int8_kernels
from decent_train.engine.topology import Edge

__all__ = [
    "BFloat16Compressor", "COMPRESSORS", "Compressor", "CompressedGossip", "Int8Compressor", "check_consensus_step",
    "make_compressor",
]


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

    def split(self, message: Tensor, padded: int) -> tuple[Tensor, Tensor]:
        blocks = padded // self.block
        return message[:padded].view(torch.int8).view(blocks, self.block), message[padded:].view(torch.float32)

    def encode_(self, scratch: Tensor, message: Tensor) -> None:
        levels, scales = self.split(message, scratch.numel())
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
        levels, scales = self.split(message, scratch.numel())
        rows = scratch.view(-1, self.block)
        rows.copy_(levels)
        rows.mul_(scales.to(scratch.dtype).unsqueeze(1))


COMPRESSORS = ("bf16", "int8")


def check_consensus_step(consensus_step: float) -> None:
    """CHOCO's gamma: the step toward the neighbours' public copies."""
    if not 0.0 < consensus_step <= 1.0:
        raise ValueError(f"consensus_step must be in (0, 1], got {consensus_step}")


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
    scratch: Tensor | None  # made at its first use (:meth:`_scratch`): int8's compiled kernels need none for a pair
    outgoing: Tensor
    incoming: list[Tensor]  # a pair's: one; a group of m: m (an all-gather's outputs, this worker's included)
    copies: dict[tuple[tuple[int, ...], float], _GroupCopies] = field(default_factory=dict)  # by CompressedGossip.key
    kernels: Int8Kernels | None = None  # int8's compiled loops (int8_kernels.py), where they pay

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
            scratch=None,
            outgoing=torch.zeros(message, dtype=torch.uint8, device=flat.device),
            incoming=[torch.zeros(message, dtype=torch.uint8, device=flat.device) for _ in range(slots)],
            copies={cls.key(edge): _GroupCopies.for_edge(flat, edge, copy_dtype) for edge in groups},
            kernels=(compiled_int8_kernels(numel, compressor.block, compressor.LEVELS)
                     if isinstance(compressor, Int8Compressor) else None),
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
        if self.kernels is not None:
            self.kernels.encode_(x, copies.own, *self._int8_message(self.outgoing))
            return self.outgoing
        scratch = self._scratch(x)
        difference = scratch[: self.numel]
        if copies.own.dtype == x.dtype:
            torch.sub(x, copies.own, out=difference)
        else:  # the same values: a CPU subtracts a bfloat16 copy 10x slower than it widens it first
            torch.sub(x, difference.copy_(copies.own), out=difference)
        self.compressor.encode_(scratch, self.outgoing)
        copies.own.add_(difference)
        return self.outgoing

    def mix(self, x: Tensor, out: Tensor, edge: Edge, received: list[Tensor], step: float) -> None:
        """others += track * D(q_j) for each received message, then out = x + step (pull * others − (1 − w_ii) x̂)
        (``out`` may be ``x``)."""
        copies = self.copies[self.key(edge)]
        if self.kernels is not None and copies.track == 1.0 and len(received) == 1:  # a pair's
            self.kernels.mix_pair_(x, out, copies.own, copies.others, *self._int8_message(received[0]),
                                   step * copies.pull, step * (1.0 - copies.own_weight))
            return
        scratch = self._scratch(x)
        difference = scratch[: self.numel]
        for message in received:
            self.compressor.decode(message, scratch)
            if copies.track == 1.0:  # a pair's: no scaling (2x faster into a bfloat16 copy on a CPU)
                copies.others.add_(difference)
            else:
                copies.others.add_(difference, alpha=copies.track)
        torch.add(x, copies.others, alpha=step * copies.pull, out=out)
        out.add_(copies.own, alpha=-step * (1.0 - copies.own_weight))

    def _scratch(self, x: Tensor) -> Tensor:
        """The padded buffer the eager paths encode and decode in, like ``x`` (its tail beyond ``numel`` stays
        zero); made when first needed, so a bucket that int8's compiled kernels encode and mix (a pair's) has none."""
        if self.scratch is None:
            self.scratch = x.new_zeros(self.compressor.padded_numel(self.numel))
        return self.scratch

    def _int8_message(self, message: Tensor) -> tuple[Tensor, Tensor]:
        """An int8 message's levels (rows of a block) and float32 scales."""
        assert isinstance(self.compressor, Int8Compressor)
        return self.compressor.split(message, self.compressor.padded_numel(self.numel))

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
        if self.incoming:  # none held at rest (an offloaded outer exchange's)
            torch._foreach_copy_(self.incoming, state["incoming"])
