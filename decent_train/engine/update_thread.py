"""Bucket updates (mix, optimizer step, launch) on a thread of their own, and on a GPU on a CUDA stream of their own.

Inside backward, a bucket's update runs in a hook on autograd's thread, and while its Python runs no further
backward kernel is launched: where backward is launch-bound (ResNet-50 at batch 64 on an H100) the GPU waits for the
host. Here the hook only queues the update: autograd's thread goes on launching backward kernels, which hold no GIL,
while this thread runs the updates in bucket order (the order every rank launches its exchanges in). On a GPU the
updates' kernels go to a side stream that waits for an event recorded where the gradients were made, so they also
overlap backward's kernels. At the end of backward, ``drain`` waits for the queue and makes the current stream wait
for the side stream, so the next forward reads the updated parameters.

The gradients an update reads are kept referenced until ``drain``: the optimizer drops them (``set_to_none``), and a
block freed while the side stream may still read it would be handed to the next allocation of backward's stream.

Opt-in (``update_thread=True``): measured on an H200, the GIL passed between the two threads cost more than the
launches it freed (ResNet-50 at batch 64: scripts/BENCHMARKS.md, "The engine's host path").
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["UpdateThread"]


class UpdateThread:
    """Runs submitted bucket updates one after another, in submission order, on a daemon thread that ends when
    ``owner`` (the engine) is collected or the interpreter exits."""

    def __init__(self, device: torch.device, owner: object):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], Any] | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._pending = 0
        self._held: list[list[Tensor]] = []  # gradients read by updates not yet drained
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="decent_train-updates", daemon=True)
        self._thread.start()
        weakref.finalize(owner, self.close)

    def submit(self, update: Callable[[], None], gradients: list[Tensor]) -> None:
        """Queue ``update`` (on autograd's thread: after the event marking where ``gradients`` were made)."""
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record()
        with self._done:
            self._pending += 1
            self._held.append(gradients)
        self._queue.put((update, event))

    def _run(self) -> None:
        if self.stream is not None:
            torch.cuda.set_device(self.device)
        while True:
            item = self._queue.get()
            if item is None:
                return
            update, event = item
            del item
            try:
                if self._error is None:
                    if self.stream is None:
                        update()
                    else:
                        with torch.cuda.stream(self.stream):
                            self.stream.wait_event(event)
                            update()
            except BaseException as error:  # raised on autograd's thread by drain()
                self._error = error
            finally:
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()

    def drain(self) -> None:
        """Wait for every queued update; the current stream then waits for theirs. Re-raises an update's error."""
        with self._done:
            while self._pending:
                self._done.wait()
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self._held.clear()  # their blocks are reused only by work queued after the wait above
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """End the thread and wait for it: at exit (weakref.finalize's atexit hook) a thread still waking while the
        interpreter finalizes is ended inside torch's C++ frames, which aborts the process."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)
