"""Start the workers with torch.distributed.run's elastic agent, in process, and say how to do the same by hand."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig as ElasticLaunchConfig
from torch.distributed.launcher.api import elastic_launch

DEVICES = ("cpu", "cuda", "auto")
WORKER_MODULE = "decent_train.worker"
# torch's c10d rendezvous defaults (dynamic_rendezvous.py), which the launch config's defaults keep.
TORCH_LAST_CALL_S, TORCH_KEEP_ALIVE_S = 30, 5
# torch 2.15 shares the rank-0 agent's TCP store with the workers and caches its address across rendezvous rounds.
# When a node joins a running job, an agent that stays rank 0 does not publish the address for the new round, and both
# agents wait for each other until they time out (seen here); when rank 0's node is lost, the nodes left keep its dead
# address (read in dynamic_rendezvous.py). Unshared, every round publishes a fresh address; the workers' rank 0 hosts
# their store.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
AGENT_PID_ENV = "DECENT_TRAIN_AGENT_PID"
_NODE_RANGE = re.compile(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?")


@dataclass
class SlurmConfig:
    """``launch.slurm``: what each job of a SLURM sweep asks for (``-m hydra/launcher=slurm``, which reads these in
    ``conf/hydra/launcher/slurm.yaml``). ``scripts/slurm_train.sbatch`` gets its allocation from sbatch instead."""

    partition: Optional[str] = None  # null: the cluster's default partition
    account: Optional[str] = None
    time_min: int = 60  # the job's time limit, minutes
    gpus_per_node: Optional[int] = None  # null: no GPUs (launch=gpu starts one worker per GPU the job gets)
    cpus_per_task: Optional[int] = None  # CPUs per node (one task per node runs the torchrun agent); null: SLURM's
    mem_gb: Optional[int] = None  # memory per node; null: SLURM's default

    def __post_init__(self) -> None:
        for key in ("time_min", "gpus_per_node", "cpus_per_task", "mem_gb"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"launch.slurm.{key}={value} must be >= 1")


@dataclass
class LaunchConfig:
    """``conf/launch/*.yaml``: how many workers, on what, and how the elastic agent runs them."""

    nproc_per_node: Optional[int] = 4  # workers per node; null: one per visible GPU
    # N nodes, or torchrun's "MIN:MAX" (elastic: the workers restart when nodes leave or join; in a YAML file quote
    # it, "1:2": YAML reads 1:2 as the base-60 number 62)
    nnodes: Union[int, str] = 1
    device: str = "cpu"  # cpu (gloo) | cuda (nccl, one GPU per worker) | auto (cuda when available)
    max_restarts: int = 0  # the agent restarts all workers this many times after a failure
    monitor_interval: float = 0.1  # seconds between the agent's checks of the workers
    rdzv_endpoint: str = ""  # host:port of the c10d rendezvous; empty: standalone on this node
    rdzv_id: str = ""  # empty: a fresh id per launch (several nodes must share one)
    rdzv_last_call_s: int = TORCH_LAST_CALL_S  # once MIN nodes have joined, the rendezvous waits this long for more
    rdzv_keep_alive_s: int = TORCH_KEEP_ALIVE_S  # agents' heartbeat; a node silent for 3 of them has left
    threads_per_worker: Optional[int] = None  # OMP_NUM_THREADS of each worker; null: CPU cores / workers per node
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def __post_init__(self) -> None:
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise ValueError(f"launch.nproc_per_node={self.nproc_per_node}: at least one worker per node is needed")
        low, high = node_range(self.nnodes)
        if low == high:
            self.nnodes = low  # "2" or "2:2": a fixed number of nodes
        if self.device not in DEVICES:
            raise ValueError(f"launch.device={self.device!r} is not a device; valid: {', '.join(DEVICES)}")
        if self.max_restarts < 0:
            raise ValueError(f"launch.max_restarts={self.max_restarts} must be >= 0")
        if high > 1 and not (self.rdzv_endpoint and self.rdzv_id):
            # Each node's agent must find the others: the same endpoint and the same id (a fresh one per launch, or a
            # free port of its own, would leave every agent in a world of its own).
            raise ValueError(
                f"launch.nnodes={self.nnodes} needs launch.rdzv_endpoint=HOST:PORT (the first node) and "
                "launch.rdzv_id=ID, the same for every node"
            )
        for key in ("rdzv_last_call_s", "rdzv_keep_alive_s"):
            if getattr(self, key) < 1:
                raise ValueError(f"launch.{key}={getattr(self, key)} must be >= 1 (whole seconds)")
        if self.threads_per_worker is not None and self.threads_per_worker < 1:
            raise ValueError(f"launch.threads_per_worker={self.threads_per_worker} must be >= 1")

    @property
    def min_nodes(self) -> int:
        return node_range(self.nnodes)[0]

    @property
    def max_nodes(self) -> int:
        return node_range(self.nnodes)[1]

    @property
    def elastic(self) -> bool:
        """Nodes may leave (down to ``min_nodes``) or join (up to ``max_nodes``) while the job runs."""
        return self.min_nodes != self.max_nodes

    @property
    def world_sizes(self) -> list[int]:
        """Every number of workers the job may train with, smallest first: what the config must work for."""
        assert self.nproc_per_node is not None, "nproc_per_node is resolved by the launcher"
        return [k * self.nproc_per_node for k in range(self.min_nodes, self.max_nodes + 1)]

    @property
    def world_size(self) -> int:
        """The number of workers with every node joined (``max_nodes``). An elastic job trains with any of
        :attr:`world_sizes` at a time: checks go over all of them, and a worker's is ``dist.get_world_size()``."""
        return self.world_sizes[-1]


def node_range(nnodes: Union[int, str]) -> tuple[int, int]:
    """``launch.nnodes`` as ``(MIN, MAX)`` nodes: ``N`` is ``(N, N)``, ``"MIN:MAX"`` torchrun's elastic range."""
    match = _NODE_RANGE.fullmatch(str(nnodes))
    low, high = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
    if not 1 <= low <= high:
        raise ValueError(
            f"launch.nnodes={nnodes} is not a number of nodes; valid: N >= 1, or MIN:MAX with 1 <= MIN <= MAX "
            "(elastic, e.g. 1:4)"
        )
    return low, high


class WorkerFailure(RuntimeError):
    """A worker failed: the message names it and its error; ``traceback`` is the worker's, when it had one."""

    def __init__(self, message: str, traceback: str = ""):
        super().__init__(message)
        self.traceback = traceback


def torchrun_command(cfg: LaunchConfig, config_path: Path) -> list[str]:
    """The torchrun command line equivalent to :func:`launch_workers` (what cluster scripts run on each node)."""
    if cfg.rdzv_endpoint:
        rendezvous = [
            f"--nnodes={cfg.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={cfg.rdzv_endpoint}",
            f"--rdzv-id={cfg.rdzv_id or 'RUN_ID'}",
        ]
        if (cfg.rdzv_last_call_s, cfg.rdzv_keep_alive_s) != (TORCH_LAST_CALL_S, TORCH_KEEP_ALIVE_S):
            rendezvous.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in _rendezvous_settings(cfg).items()))
    else:
        rendezvous = ["--standalone"]
    return [
        *(["env", *(f"{k}={v}" for k, v in ELASTIC_ENV.items())] if cfg.elastic else []),
        "torchrun",
        *rendezvous,
        f"--nproc-per-node={cfg.nproc_per_node}",
        f"--max-restarts={cfg.max_restarts}",
        f"--monitor-interval={cfg.monitor_interval}",
        "-m",
        WORKER_MODULE,
        str(config_path),
    ]


def slurm_rendezvous() -> tuple[str, str]:
    """``(host:port, id)`` of a c10d rendezvous at the first node of this SLURM job, as ``scripts/slurm_train.sbatch``
    derives them: port 29500 + job id mod 10000, so jobs that share a node don't collide. Never localhost: on several
    nodes each would form a world of its own and wait forever."""
    job_id, nodes = os.environ["SLURM_JOB_ID"], os.environ.get("SLURM_JOB_NODELIST", "")
    try:
        hosts = subprocess.run(
            ["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError) as error:
        hosts, why = [], f"scontrol show hostnames {nodes!r} failed: {error}"
    else:
        why = f"scontrol show hostnames {nodes!r} printed none"
    if not hosts:
        raise ValueError(f"SLURM job {job_id}: cannot find its first node ({why}); set launch.rdzv_endpoint=HOST:PORT")
    return f"{hosts[0]}:{29500 + int(job_id) % 10000}", job_id


def launch_workers(cfg: LaunchConfig, config_path: Path) -> None:
    """Run the workers on this node until they finish; raise :class:`WorkerFailure` if one fails."""
    elastic = ElasticLaunchConfig(
        min_nodes=cfg.min_nodes,
        max_nodes=cfg.max_nodes,
        nproc_per_node=cfg.nproc_per_node,
        run_id=cfg.rdzv_id or uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint=cfg.rdzv_endpoint or "localhost:0",  # port 0: parallel jobs never collide
        rdzv_configs=_rendezvous_settings(cfg),
        max_restarts=cfg.max_restarts,
        monitor_interval=cfg.monitor_interval,
    )
    threads = cfg.threads_per_worker or default_threads_per_worker(cfg.nproc_per_node)
    # The agent logs each failure at ERROR; WorkerFailure reports the first one instead.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # the workers die with this agent (worker.py: _die_with_agent)
    with _environment(OMP_NUM_THREADS=str(threads), **(ELASTIC_ENV if cfg.elastic else {})):
        try:
            elastic_launch(elastic, sys.executable)("-u", "-m", WORKER_MODULE, str(config_path))
        except ChildFailedError as error:
            raise _failure(error) from None


def _rendezvous_settings(cfg: LaunchConfig) -> dict[str, int]:
    """torch's c10d rendezvous options (``--rdzv-conf``) that a membership change waits on: a lost node is dropped
    after 3 missed heartbeats, and the rest go on once ``last_call`` has passed without more nodes."""
    return {"last_call_timeout": cfg.rdzv_last_call_s, "keep_alive_interval": cfg.rdzv_keep_alive_s}


def check_devices(device: str, nproc_per_node: int, cuda_available: bool, gpus: int) -> None:
    """The node has what ``launch`` asks for: a GPU per worker (two workers on one GPU fail later in NCCL with
    "Duplicate GPU detected")."""
    if device == "cuda" and not cuda_available:
        raise ValueError("launch.device=cuda but no CUDA device is visible; valid here: launch.device=cpu")
    on_gpus = device == "cuda" or (device == "auto" and cuda_available)
    if on_gpus and nproc_per_node > gpus:
        raise ValueError(
            f"launch.nproc_per_node={nproc_per_node} but this node has {gpus} GPU(s); valid: 1..{gpus} (one worker "
            "per GPU)"
        )


def default_threads_per_worker(nproc_per_node: int) -> int:
    """The CPUs this process may run on (a SLURM or container allocation, not the host's count), shared by the
    workers of the node."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, allowed // nproc_per_node)


def _failure(error: ChildFailedError) -> WorkerFailure:
    """The first worker to fail: its last error line, and its traceback from the error file ``@record`` wrote."""
    rank, failure = error.get_first_failure()
    traceback = ""
    if isinstance(failure.message, dict):
        traceback = failure.message.get("extraInfo", {}).get("py_callstack", "")
        what = failure.message.get("message", "")
    elif failure.exitcode < 0:
        what = f"killed by signal {signal.Signals(-failure.exitcode).name}"
    else:
        what = "no Python error recorded (it failed before it started, or exited on its own)"
    return WorkerFailure(f"worker rank {rank} failed (exit code {failure.exitcode}): {what}", traceback.rstrip())


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Set environment variables for the workers, unless the user set them, and restore them afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    for key, value in values.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def format_command(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
