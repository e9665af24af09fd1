"""Run a function in N fork-started worker processes joined in a gloo process group (CPU).

Each worker's return value comes back through a file (torch.save), its traceback through another; a worker that
fails or hangs fails the test with that worker's error instead of hanging the suite.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _worker(fn: Callable[..., Any], rank: int, world_size: int, workdir: str, args: tuple, kwargs: dict) -> None:
    code = 1
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        result = fn(rank, world_size, *args, **kwargs)
        torch.save(result, os.path.join(workdir, f"result{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
        code = 0
    except BaseException:
        with open(os.path.join(workdir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        os._exit(code)


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
    """``[fn(rank, world_size, *args, **kwargs) for rank in range(world_size)]``, each rank in its own process."""
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as workdir:
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, workdir, args, kwargs)) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):  # one failed: the others may wait on it forever
                time.sleep(0.5)
                break
            time.sleep(0.02)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        errors = []
        for r in range(world_size):
            path = os.path.join(workdir, f"error{r}.txt")
            if os.path.exists(path):
                errors.append(f"--- rank {r} ---\n{open(path).read()}")
        if errors:
            raise WorkerError("\n".join(errors))
        if any(p.exitcode != 0 for p in procs):
            raise WorkerError(f"workers timed out after {timeout}s or died: exit codes {[p.exitcode for p in procs]}")
        return [torch.load(os.path.join(workdir, f"result{r}.pt"), weights_only=False) for r in range(world_size)]


class WorkerError(AssertionError):
    """A worker raised; the message holds each failing worker's traceback."""
