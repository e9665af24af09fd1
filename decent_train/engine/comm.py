"""Communication utilities: a clear error when a peer stops answering, waits on exchanges that do not block a GPU's
host thread, point-to-point sends that do not run on the training thread, and collectives that let go of their
tensors before they return (a clean interpreter exit), and launches that outlive a profiler safely."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "CommWaits",
    "first_line",
    "PairPoster",
    "ExchangeError",
    "peers_must_answer",
    "run_collective",
    "stop_before",
    "unrecorded",
]

_stop_before: str | None = None  # tests only (training/live.py's PAUSE_ENV): stop before this collective


class ExchangeError(RuntimeError):
    """An exchange or collective between workers failed or timed out: a peer hangs or died."""


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (gloo's and inductor's run over many), or its type's name."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


@contextlib.contextmanager
def peers_must_answer(what: str | Callable[[], str], timeout: timedelta | None = None) -> Iterator[None]:
    """Wrap a collective (or the wait for one): its failure (a peer's closed connection, the time limit) becomes one
    ``ExchangeError`` line naming this rank and ``what`` it was doing, instead of gloo's or NCCL's message alone.

    ``what`` may be a function, called only on failure: the engine waits on every bucket at every step and should not
    format a message that is almost never shown. Wrap only the communication itself: any RuntimeError inside is
    reported as a peer's failure.
    """
    if _stop_before is not None and isinstance(what, str) and _stop_before in what:
        stop_before(None)
        os.kill(os.getpid(), signal.SIGSTOP)  # tests only: its peers are left waiting inside this collective
    try:
        yield
    except ExchangeError:
        raise
    except RuntimeError as error:
        rank = dist.get_rank() if dist.is_initialized() else 0
        limit = f", limit {timeout.total_seconds():g} s" if timeout is not None else ""
        described = what if isinstance(what, str) else what()
        raise ExchangeError(f"rank {rank}: {described} failed (a peer hangs or died{limit}): {first_line(error)}") \
            from error


def stop_before(what: str | None) -> None:
    """Tests only: the next collective whose description contains ``what`` first stops this process (SIGSTOP), so
    that a test can kill it while its peers wait inside that collective; None disarms."""
    global _stop_before
    _stop_before = what


class CommWaits:
    """Waits for asynchronous communication and adds up how long computation stalled on it.

    On the CPU (gloo) the host thread is what waits: ``work.wait(timeout)`` enforces the exchange limit and
    ``perf_counter`` measures the stall. On a GPU, ``work.wait()`` only makes the current stream wait for the
    communication stream; a timeout would make ProcessGroupNCCL poll ``isCompleted()`` on the host, one host sync per
    bucket per step, so none is passed (the group's own timeout, enforced by NCCL's watchdog, is the limit). The
    stall is the stream's time between two CUDA events around the wait, summed from the events that have completed
    when :attr:`seconds` is read or when more than ``_PENDING_EVENTS`` are queued (``query()``: no sync either).
    """

    _PENDING_EVENTS = 256

    def __init__(self, timeout: timedelta | None = None):
        self.timeout = timeout
        self._seconds = 0.0
        self._events: deque[tuple[Any, Any]] = deque()  # (start, end) CUDA events not yet added up

    def wait(self, works: list[Any], device: torch.device) -> None:
        """Wait for ``works`` (the caller wraps this in :func:`peers_must_answer`)."""
        if not works:
            return
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for work in works:
                work.wait()
            end.record()
            self._events.append((start, end))
            if len(self._events) > self._PENDING_EVENTS:
                self._collect(block=False)
            return
        start_time = time.perf_counter()
        for work in works:
            work.wait() if self.timeout is None else work.wait(self.timeout)
        self._seconds += time.perf_counter() - start_time

    def _collect(self, block: bool) -> None:
        while self._events and (block or self._events[0][1].query()):
            start, end = self._events.popleft()
            end.synchronize()
            self._seconds += start.elapsed_time(end) / 1000.0

    @property
    def seconds(self) -> float:
        """Total stall so far (on a GPU this waits for the events recorded so far: read it between steps)."""
        self._collect(block=True)
        return self._seconds


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Launch communication that may outlive the step unseen by torch.profiler's record functions, while one records.

    Why: c10d ends an async work's record function when the work completes, on its own thread, and when the profiler
    that recorded the start has stopped by then the process crashes (SIGSEGV, or glibc's "unaligned tcache chunk";
    seen with gloo on torch 2.10 and 2.14). The engine's and the fronts' exchanges complete in the next step, so every
    profiled region of training ends with some in flight (tests/test_profiled_training.py). The launch's and the
    waits' own ranges stay in the trace; on a GPU the profiler still sees NCCL's kernels.
    """
    if not torch._C._autograd._profiler_enabled():
        yield
        return
    torch._C._autograd._enable_record_function(False)
    try:
        yield
    finally:
        torch._C._autograd._enable_record_function(True)


class PairPoster:
    """Posts a pair's sends and receives (``dist.batch_isend_irecv``); on the CPU from a thread of its own.

    Why: gloo's TCP transport writes a send on the calling thread for as long as the socket takes more
    (``Pair::write``), and on loopback or a fast link that is most of the message: 3-23 ms of the training thread per
    step for a 25 MB model in 4 MB buckets on 2 shared cores (scripts/BENCHMARKS.md, "Fast links"). Posted from
    another thread, the copy into the socket overlaps computation (c10d releases the GIL while it sends). The batches
    are posted in the order given, so each peer still sees a bucket's messages in order. CUDA tensors are posted
    inline: NCCL's posting is asynchronous already.
    """

    def __init__(self) -> None:
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._pid = 0  # the process that started the thread: a forked child has none, only its record

    def post(self, ops: list[dist.P2POp]) -> list[Any]:
        """Start ``ops``; what to wait on (each has ``wait(timeout=None)`` like a Work)."""
        if ops[0].tensor.device.type != "cpu":
            with unrecorded():
                return dist.batch_isend_irecv(ops)
        self._ensure_thread()
        return [_PostedBatch(self._thread.submit(dist.batch_isend_irecv, ops))]

    def post_each(self, ops: list[dist.P2POp]) -> list[Any]:
        """Start each of ``ops`` on its own, in order; one wait object per op, so that one peer's failure (posting
        or completing) leaves the others' ops alone. CUDA tensors are posted as one batch (one NCCL group call), each
        op's wait that of the whole: posted alone, a pair's receives (posted first on both sides) would each wait on
        its stream for a send queued behind the peer's own receive, forever; and on NCCL a dead peer shows as a stalled
        stream, not as one op's error, whichever way they are posted."""
        if ops[0].tensor.device.type != "cpu":
            with unrecorded():
                batch = _Works(dist.batch_isend_irecv(ops))
            return [batch] * len(ops)
        self._ensure_thread()
        posting = self._thread.submit(lambda: [_post_op(op) for op in ops])
        return [_PostedOp(posting, i) for i in range(len(ops))]

    def _ensure_thread(self) -> None:
        if self._thread is None or self._pid != os.getpid():  # it ends with the engine or at interpreter exit
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="decent_train-p2p")
            self._pid = os.getpid()


def _post_op(op: dist.P2POp) -> Any:
    """``op`` started: its work, or the error posting it raised (a closed connection), raised again at its wait."""
    try:
        return op.op(op.tensor, op.peer, op.group, op.tag)
    except RuntimeError as error:
        return _Failed(error)


class _Failed:
    def __init__(self, error: RuntimeError):
        self.error = error

    def wait(self, timeout: timedelta | None = None) -> bool:
        raise self.error


class _Works:
    """Works waited on as one: a batch's (NCCL coalesces it into one)."""

    def __init__(self, works: list[Any]):
        self._works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        return True


class _PostedOp:
    """One op of a :meth:`PairPoster.post_each` being posted on the poster's thread."""

    def __init__(self, posting: concurrent.futures.Future[list[Any]], index: int):
        self._posting, self._index = posting, index

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = timeout.total_seconds() if timeout is not None else None
        try:
            work = self._posting.result(seconds)[self._index]
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"the messages were not posted within {seconds:g} s") from None
        work.wait() if timeout is None else work.wait(timeout)
        return True


class _PostedBatch:
    """Point-to-point works being posted on the :class:`PairPoster`'s thread, waited on as one."""

    def __init__(self, future: concurrent.futures.Future[list[Any]]):
        self._future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = timeout.total_seconds() if timeout is not None else None
        try:
            works = self._future.result(seconds)  # posting's own failure (a closed connection) is raised here
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"the sends were not posted within {seconds:g} s") from None
        return _Works(works).wait(timeout)


def run_collective(collective: Callable[..., Any], tensor: torch.Tensor, **kwargs: Any) -> None:
    """``collective(tensor, **kwargs)`` (``dist.all_reduce``, ``dist.broadcast``, ...) to completion, like its
    blocking form; on the CPU it returns only once gloo's worker thread has let go of ``tensor``.

    Why: gloo runs a collective on a worker thread of its own, which holds the work (and so ``tensor``) until it
    moves on. ``dist.all_reduce(t)`` returns when the result is there and drops its handle, so that thread may drop
    the last C++ reference to ``t`` after the caller: releasing a tensor that has a Python object takes the GIL
    (``TensorImpl::decref_pyobject``). If the script reaches interpreter teardown meanwhile, Python ends the waiting
    thread (pthread_exit) inside the work's destructor and the finished process aborts: SIGABRT, "terminate called
    without an active exception" (tests/test_clean_exit.py). Here a view of ``tensor`` holds a second reference
    while the work exists, so whichever thread drops the work never needs the GIL, and the view goes on this thread
    once the work is gone (usually at once: one reference count read). On a GPU it is the plain blocking call (no
    host sync).
    """
    if tensor.device.type != "cpu":
        collective(tensor, **kwargs)
        return
    anchor = tensor.view_as(tensor)
    idle = tensor._use_count()  # references without the work's
    collective(tensor, async_op=True, **kwargs).wait()
    deadline = time.monotonic() + 60.0
    while tensor._use_count() > idle and time.monotonic() < deadline:  # the worker thread still holds the work
        time.sleep(1e-4)
    del anchor
