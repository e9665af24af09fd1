"""Process groups for scripts launched by torchrun: setup (decent-dp's ``initialize_dist``, without its pitfalls), a
clear error when a peer stops answering, and a clean exit."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

__all__ = ["ExchangeError", "initialize_dist", "exit_without_teardown", "peers_must_answer"]


class ExchangeError(RuntimeError):
    """An exchange or collective between workers failed or timed out: a peer hangs or died."""


@contextlib.contextmanager
def peers_must_answer(what: str | Callable[[], str], timeout: timedelta | None = None) -> Iterator[None]:
    """Wrap a collective (or the wait for one): its failure (a peer's closed connection, the time limit) becomes one
    ``ExchangeError`` line naming this rank and ``what`` it was doing, instead of gloo's or NCCL's message alone.

    ``what`` may be a function, called only on failure: the engine waits on every bucket at every step and should not
    format a message that is almost never shown. Wrap only the communication itself: any RuntimeError inside is
    reported as a peer's failure.
    """
    try:
        yield
    except ExchangeError:
        raise
    except RuntimeError as error:
        rank = dist.get_rank() if dist.is_initialized() else 0
        limit = f", limit {timeout.total_seconds():g} s" if timeout is not None else ""
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        described = what if isinstance(what, str) else what()
        raise ExchangeError(f"rank {rank}: {described} failed (a peer hangs or died{limit}): {first_line}") from error


def initialize_dist() -> tuple[int, int]:
    """Initialize torch.distributed from torchrun's environment and return ``(rank, world_size)``.

    With CUDA: NCCL, one device per local rank (``torch.cuda.set_device(LOCAL_RANK)``). Without: gloo.
    """
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
            dist.init_process_group(backend="nccl")
        else:
            dist.init_process_group(backend="gloo")
    return dist.get_rank(), dist.get_world_size()


def exit_without_teardown() -> NoReturn:
    """End a torchrun worker after ``destroy_process_group()`` with exit status 0: flush and skip the interpreter's
    teardown, where destroying gloo's threads rarely aborts a finished process with SIGABRT ("terminate called
    without an active exception"; seen in CI; pytorch PR #179291)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
