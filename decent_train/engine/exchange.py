"""The exchange: what a pair, a group and a stage of a round send and receive, in full precision or compressed.

``Exchanger.start`` sends a value to the stage's group and ``Exchanger.finish`` turns what arrived into the stage's
result; ``Exchanger.combine`` writes a round's result into the parameters' buffer. The gossip mode (modes.py)
decides when: mix, optimizer step, launch.

Full precision: a pair swaps its values by point-to-point send/receive straight from the parameters' memory (on the
CPU posted from a thread of its own, comm.PairPoster); a group of three or more all-reduces a copy.

Point to point only (``point_to_point``, live fault tolerance): a group of three or more exchanges by messages too,
one with each other member, so that each peer's message arrives or fails on its own; one that fails (the peer died)
is replaced by this worker's own value (a compressed one by an empty difference): its weight stays with this worker.

Compression (what a compressed message is and how public copies keep the mean exact) is compress.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from decent_train.engine.comm import PairPoster, unrecorded
from decent_train.engine.compress import CompressedGossip
from decent_train.engine.topology import Edge

__all__ = ["ExchangeBuffers", "Exchanger", "MESSAGE_TAGS", "PeerMessages"]

MESSAGE_TAGS = 1 << 16  # p2p tags per bucket: message i of bucket b is tagged b * MESSAGE_TAGS + i


@dataclass(kw_only=True)
class ExchangeBuffers:
    """A bucket's memory for its exchanges. ``flat`` holds the values exchanged (the parameters'), ``comm`` receives
    the neighbours' values (a pair's) or their sum (a group's), and is empty with compression (in the engine, until a
    mode receives into it: buckets.py); ``staged`` (the engine's rounds of several stages, allocated when first
    needed; the outer exchange writes its results into ``flat`` or ``comm`` instead) holds the result of the stages
    done so far; ``compressed``, with compression, the public copies.

    ``comm_anchor`` is a view that keeps a second reference to ``comm`` (``flat`` has the parameters' views): gloo's
    worker thread may drop an asynchronous collective's work last, and releasing a tensor's last reference there takes
    the GIL, which aborts the process during interpreter teardown (comm.run_collective).
    """

    index: int
    flat: Tensor
    comm: Tensor
    comm_anchor: Tensor | None = None
    staged: Tensor | None = None
    compressed: CompressedGossip | None = None
    group_received: Tensor | None = None  # point to point: the other members' values, a row each (when needed)

    def staging(self) -> Tensor:
        if self.staged is None:
            self.staged = torch.empty_like(self.flat)
        return self.staged

    def receiving(self, peers: int) -> Tensor:
        if self.group_received is None or self.group_received.shape[0] < peers:
            self.group_received = self.flat.new_empty((peers, self.flat.numel()))
        return self.group_received[:peers]


@dataclass
class PeerMessages:
    """Point to point: what one peer's messages are waited on by, and ``slot``, where its message lands."""

    peer: int
    works: list[Any]
    slot: Tensor

    def wait(self, timeout: Any = None) -> bool:
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout)
        return True


class Exchanger:
    """Sends and receives one stage of a round for a bucket: a pair by point-to-point, a group by a collective, in
    full precision or as compressed differences (the bucket's ``compressed`` state). Stateless between calls; the
    engine waits on what :meth:`start` returns before :meth:`finish`."""

    def __init__(
        self, rank: int, group: dist.ProcessGroup | None, message_bytes: int, consensus_step: float,
        point_to_point: bool = False,
    ):
        self.rank, self.group = rank, group  # group: pairs' point-to-point (None: the default group)
        self.message_bytes = message_bytes  # a pair's messages at most this large (0: one per bucket)
        self.consensus_step = consensus_step
        self.point_to_point = point_to_point  # groups of three or more exchange by messages too (see the module)
        self.pairs = PairPoster()

    def start(self, bucket: ExchangeBuffers, edge: Edge, value: Tensor) -> list[Any]:
        """Send ``value`` to the group; a pair receives the peer's value into ``comm``, a group the sum over it. With
        compression, the compressed difference to this worker's public copy for the group instead."""
        if edge.size == 1:
            return []
        if bucket.compressed is not None:
            return self._start_compressed(bucket, edge, bucket.compressed.encode(value, edge))
        if self.point_to_point:
            peers = self._peers(edge)
            slots = [bucket.comm] if edge.size == 2 else list(bucket.receiving(len(peers)))
            return self._post_each(bucket, peers, value, slots)
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
        if bucket.comm is not value:  # (reduced in place: the value is the buffer)
            bucket.comm.copy_(value)
        with unrecorded():
            return [dist.all_reduce(bucket.comm, group=edge.group, async_op=True)]

    def _start_compressed(self, bucket: ExchangeBuffers, edge: Edge, message: Tensor) -> list[Any]:
        """A pair swaps messages, a group all-gathers them."""
        incoming = bucket.compressed.incoming
        if self.point_to_point:
            peers = self._peers(edge)
            slots = incoming[:1] if edge.size == 2 else [incoming[edge.ranks.index(p)] for p in peers]
            return self._post_each(bucket, peers, message, slots)
        if edge.size == 2:
            peer, tag = self._peer(edge), MESSAGE_TAGS * bucket.index
            return self.pairs.post(
                [
                    dist.P2POp(dist.isend, message, peer, self.group, tag),
                    dist.P2POp(dist.irecv, incoming[0], peer, self.group, tag),
                ]
            )
        with unrecorded():
            return [dist.all_gather(incoming[: edge.size], message, group=edge.group, async_op=True)]

    def _peer(self, edge: Edge) -> int:
        return edge.ranks[0] if edge.ranks[1] == self.rank else edge.ranks[1]

    def _peers(self, edge: Edge) -> list[int]:
        return [r for r in edge.ranks if r != self.rank]

    def _post_each(self, bucket: ExchangeBuffers, peers: list[int], value: Tensor, slots: list[Tensor]) -> list[Any]:
        """Send ``value`` to each peer and receive its message into its slot: receives posted first, then sends, each
        peer's waited on alone (:class:`PeerMessages`)."""
        tag = MESSAGE_TAGS * bucket.index
        receives = [dist.P2POp(dist.irecv, slot, peer, self.group, tag) for peer, slot in zip(peers, slots)]
        sends = [dist.P2POp(dist.isend, value, peer, self.group, tag) for peer in peers]
        works = self.pairs.post_each(receives + sends)
        n = len(peers)
        return [PeerMessages(peer, [works[i], works[n + i]], slot) for i, (peer, slot) in enumerate(zip(peers, slots))]

    def settle(self, bucket: ExchangeBuffers, edge: Edge, value: Tensor, failed: list[PeerMessages]) -> None:
        """Point to point, once every message was waited on: each failed peer's slot gets this worker's own ``value``
        (compressed: an empty difference), and a group's values are summed into ``comm`` (what an all-reduce gives)."""
        for messages in failed:
            messages.slot.zero_() if bucket.compressed is not None else messages.slot.copy_(value)
        if bucket.compressed is None and edge.size > 2:
            torch.sum(bucket.receiving(edge.size - 1), 0, out=bucket.comm)
            bucket.comm.add_(value)

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

    def finish(self, bucket: ExchangeBuffers, edge: Edge, value: Tensor, into: Tensor | None = None) -> Tensor:
        """A stage's result, into ``staged`` (the engine's: its ``flat`` is the parameters, which change only at the
        mix), or ``into``: ``value`` itself or ``comm`` (the outer exchange's buffers are copies, see
        outer_exchange.py); or reduced in place, ``value`` itself."""
        if edge.size == 1:
            return value
        own, other = self.coefficients(edge)
        if bucket.comm is value:  # a uniform group reduced in place (own = 0): the sum is the value's own memory
            return value.mul_(other)
        out = into if into is not None else bucket.staging()
        if bucket.compressed is not None:
            bucket.compressed.mix(value, out, edge, self.received(bucket, edge), self.consensus_step)
            return out
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
