"""Process start-up for a worker under torchrun: the process group, a store of its own per restart, dying with the
elastic agent that started it, and an error file the agent can always read."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def init_distributed(device_kind: str, timeout: timedelta) -> torch.device:
    """Join the process group torchrun describes: NCCL and one GPU per local rank on CUDA, gloo on CPU. A collective
    that takes longer than ``timeout`` fails (a peer hangs or died) instead of waiting forever; the engine's exchanges
    have their own, shorter limit (``comm_timeout_s``)."""
    use_cuda = device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available())
    device = torch.device("cpu")
    if use_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("launch.device=cuda but this worker sees no CUDA device")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    backend = {"backend": "nccl", "device_id": device} if use_cuda else {"backend": "gloo"}
    store = _restart_store(timeout)
    if store is None:
        dist.init_process_group(**backend, timeout=timeout)
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(**backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return device


def _restart_store(timeout: timedelta) -> dist.Store | None:
    """The elastic agent's store under a prefix of its own for each restart of the workers.

    torch 2.15 reuses the agent's store across restarts without one, so restarted workers could read the addresses
    their dead predecessors published and hang connecting to them (seen with gloo after a worker was killed). None
    outside an elastic agent's store: the default rendezvous then applies.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]), is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"decent_train/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)


def die_with_agent() -> None:
    """Have the kernel kill this worker when the elastic agent that started it dies (the launcher names it in
    ``DECENT_TRAIN_AGENT_PID``; a worker forked from the launcher's forkserver dies with the forkserver, which dies with
    the launcher: decent_train/forkserver.py). The agent starts the workers in a session of their own, so a killed
    agent (a node lost, as far as the other nodes can tell) would leave its workers running: they would hold the
    node's place in every collective, and an elastic job would never notice the loss. Linux only
    (``PR_SET_PDEATHSIG``)."""
    agent = os.environ.get("DECENT_TRAIN_AGENT_PID")
    if agent is None or sys.platform != "linux":
        return
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(agent):  # it died before the line above
        sys.exit(f"the elastic agent (pid {agent}) died before this worker started")


class WholeErrorFile(ErrorHandler):
    """torch's worker error file (``TORCHELASTIC_ERROR_FILE``, the format ``ErrorHandler`` writes), written to a file
    of its own first and renamed into place: the agent finds it whole or not at all.

    Why: the elastic agent parses the error file of every failed worker and raises on one it cannot parse, which ends
    the whole restart ("Failed to parse reply file"). torch's handler truncates the file, then encodes and writes, so
    a worker killed in between (the agent stops every worker when one fails) leaves it empty; runs of the restart
    benchmark (scripts/bench_fault_tolerance.py) ended so.
    """

    def record_exception(self, e: BaseException) -> None:
        file = self._get_error_file_path()
        if not file:
            super().record_exception(e)  # no file to write: torch logs it
            return
        data = {"message": {"message": f"{type(e).__name__}: {e}",
                            "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))}}}
        partial = f"{file}.{os.getpid()}.partial"
        with open(partial, "w") as fp:
            json.dump(data, fp)
        os.replace(partial, file)
