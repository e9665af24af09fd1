"""The offload's copies in CUDA stream order, checked on the CPU (offload.py's ``HostStore``).

On CUDA the copies in and the copies out run on two side streams, so that a copy in (which the compute stream waits
for) does not queue behind the copies out of the outer step before it. That is safe only if every copy that reads a
host tensor comes after the copy that last wrote it, and every write after the reads before it, in the order the
streams' waits and events give. No CPU run can race, so this test replays the copies against a model of that order:
fake streams and events that keep vector clocks (a stream's clock ticks at each copy; ``wait_stream`` and
``wait_event`` merge the other clock), the fronts' real code issuing the copies. Oracle: for each pair of copies that
touch the same host storage, one of them a write, the first happens before the second.

Wrong variant: the same two streams without the waits for the copy out that last wrote a host tensor race (the
anchors an outer step copies out are read by the next exchange's copy in). And the point of two streams: some copy
in is not ordered after an earlier copy out of other tensors (one stream would order them all).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from decent_train import DiLoCo
from decent_train.algorithms.offload import HostStore

Clock = dict[str, int]


@pytest.fixture
def group_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _merge(into: Clock, other: Clock) -> None:
    for name, tick in other.items():
        into[name] = max(into.get(name, 0), tick)


@dataclass
class FakeStream:
    name: str
    clock: Clock = field(default_factory=dict)

    def tick(self) -> int:
        self.clock[self.name] = self.clock.get(self.name, 0) + 1
        return self.clock[self.name]

    def wait_stream(self, other: FakeStream) -> None:
        _merge(self.clock, other.clock)

    def wait_event(self, event: FakeEvent) -> None:
        _merge(self.clock, event.clock)


@dataclass
class FakeEvent:
    clock: Clock = field(default_factory=dict)

    def record(self, stream: FakeStream) -> None:
        self.clock = dict(stream.clock)

    def synchronize(self) -> None:
        pass


@dataclass
class Copy:
    stream: str
    tick: int  # the stream's own tick at this copy
    clock: Clock  # what had happened before it, by stream
    writes: int  # the storage written, or 0 where it is no host tensor of the store
    reads: int


class StreamModel:
    """The fakes in place of torch.cuda's streams and events for a front's ``HostStore``, and the copies logged; the
    host storages checked are the store's (its ``host_like``) and the anchors the front made before the fakes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, store: HostStore, one_stream: bool, track_writers: bool):
        self.compute, self.current = FakeStream("compute"), None
        self.homes: set[int] = set()
        self.copies: list[Copy] = []
        copies_in = FakeStream("in")
        store.stream, store.out_stream = copies_in, copies_in if one_stream else FakeStream("out")
        if not track_writers:
            monkeypatch.setattr(store, "_written", _Forgetful())
        host_like, original_copy = store.host_like, torch.Tensor.copy_

        def registered_host_like(tensor: torch.Tensor) -> torch.Tensor:
            made = host_like(tensor)
            self.homes.add(made.untyped_storage().data_ptr())
            return made

        def logged_copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
            stream = self.current
            if stream is not None:
                tick = stream.tick()
                self.copies.append(Copy(stream.name, tick, dict(stream.clock), self._home(dst), self._home(src)))
            return original_copy(dst, src, non_blocking)

        @contextlib.contextmanager
        def on_stream(stream: FakeStream) -> Iterator[None]:
            self.current = stream
            try:
                yield
            finally:
                self.current = None

        monkeypatch.setattr(store, "host_like", registered_host_like)
        monkeypatch.setattr(torch.Tensor, "copy_", logged_copy)
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: None)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.compute)
        monkeypatch.setattr(torch.cuda, "stream", on_stream)
        monkeypatch.setattr(torch.cuda, "Event", FakeEvent)

    def _home(self, tensor: torch.Tensor) -> int:
        ptr = tensor.untyped_storage().data_ptr()
        return ptr if ptr in self.homes else 0

    def races(self) -> list[tuple[Copy, Copy]]:
        """Pairs (earlier, later) that touch one host storage, one writing it, with no order between them."""
        found = []
        for i, first in enumerate(self.copies):
            for second in self.copies[i + 1:]:
                shared = ({first.writes} & {second.reads, second.writes}) | ({first.reads} & {second.writes})
                if shared - {0} and second.clock.get(first.stream, 0) < first.tick:
                    found.append((first, second))
        return found

    def overlapped(self) -> int:
        """Copies in (reading a host tensor) not ordered after some earlier copy out (writing one)."""
        return sum(1 for i, out in enumerate(self.copies) if out.writes
                   for copy_in in self.copies[i + 1:]
                   if copy_in.reads and copy_in.clock.get(out.stream, 0) < out.tick)


class _Forgetful(dict):  # type: ignore[type-arg]
    """A ``_written`` that keeps nothing: the wrong variant."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


CASES = {  # sync_every, fragments, delay: DiLoCo's anchors written and read back one step apart; Streaming
    "diloco-every-step": (1, 1, 0),
    "diloco-H4": (4, 1, 0),
    "streaming-H8-4-fragments-delay-1": (8, 4, 1),
}


def _run(case: str, monkeypatch: pytest.MonkeyPatch, one_stream: bool = False, track_writers: bool = True
         ) -> StreamModel:
    sync_every, fragments, delay = CASES[case]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    front = DiLoCo(model, inner, outer, sync_every, "complete", fragments=list(model) if fragments > 1 else 1,
                   fragment_sync_delay=delay, offload=True)
    assert front.store is not None
    streams = StreamModel(monkeypatch, front.store, one_stream, track_writers)
    for group in front.groups:  # the anchors, made in host memory as the front was built
        streams.homes.update(a.untyped_storage().data_ptr() for a in group.anchors)
    x = torch.randn(16, 8)
    with front:
        for _ in range(12):
            ((model(x) - x) ** 2).mean().backward()
            inner.step()
            inner.zero_grad()
    monkeypatch.undo()
    return streams


@pytest.mark.parametrize("case", list(CASES))
def test_offload_copies_are_ordered_and_copies_in_pass_copies_out(case: str, group_of_one: None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    streams = _run(case, monkeypatch)
    assert any(c.stream == "in" for c in streams.copies) and any(c.stream == "out" for c in streams.copies)
    assert not streams.races(), streams.races()[:3]
    assert streams.overlapped() > 0


@pytest.mark.parametrize("case", ["diloco-every-step", "streaming-H8-4-fragments-delay-1"])
def test_the_wrong_variants_fail(case: str, group_of_one: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the waits for the last writer the copies race; on one stream nothing overlaps."""
    assert _run(case, monkeypatch, track_writers=False).races()
    assert _run(case, monkeypatch, one_stream=True).overlapped() == 0
