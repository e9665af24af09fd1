"""Start the workers with torch.distributed.run's elastic agent, in process, and say how to do the same by hand."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shlex
import signal
import socket
import subprocess
import uuid
from pathlib import Path
from types import FrameType
from typing import Any

from loguru import logger
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError, RendezvousConnectionError, RendezvousError, RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT as RENDEZVOUS_DEFAULT_PORT
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig as ElasticLaunchConfig
from torch.distributed.launcher.api import elastic_launch

from decent_train.components.launch import TORCH_STORE_TIMEOUT_S
from decent_train.config import TORCH_KEEP_ALIVE_S, TORCH_LAST_CALL_S, LaunchConfig
from decent_train.launcher.forking import children_running, environment, processes, spawn_forkserver
from decent_train.launcher.exit_order import ExitOrder
from decent_train.launcher.network import GLOO_INTERFACE, NodeAddress, this_node
from decent_train.training.stop import FORWARDED, REQUEST_FILE, stop_signals
from decent_train.worker import forked

WORKER_MODULE = "decent_train.worker"
SLURM_PORT_BASE = 15000  # a SLURM job's rendezvous port: this + job id mod 10000 (slurm_rendezvous)
# torch 2.15 shares the rank-0 agent's TCP store with the workers and caches its address across rendezvous rounds.
# When a node joins a running job, an agent that stays rank 0 does not publish the address for the new round, and both
# agents wait for each other until they time out (seen here); when rank 0's node is lost, the nodes left keep its dead
# address (read in dynamic_rendezvous.py). Unshared, every round publishes a fresh address; the workers' rank 0 hosts
# their store.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class WorkerFailure(RuntimeError):
    """A worker failed: the message names it and its error; ``traceback`` is the worker's, when it had one."""

    def __init__(self, message: str, traceback: str = ""):
        super().__init__(message)
        self.traceback = traceback


class RendezvousFailed(RuntimeError):
    """This node's agent could not join the job's rendezvous (launch.rdzv_endpoint): the message says why, in one
    line; no worker started on this node."""


def check_rendezvous_endpoint(cfg: LaunchConfig) -> None:
    """Raise ``ValueError`` (one line) if ``launch.rdzv_endpoint`` is not HOST[:PORT] with a host this node resolves.

    torch's store client retries a name that never resolves for its whole timeout (60 s by default) and then ends in
    a traceback; a typo in the endpoint is the common cause, and found here before anything starts."""
    if not cfg.rdzv_endpoint:
        return
    try:
        host, port = parse_rendezvous_endpoint(cfg.rdzv_endpoint, default_port=RENDEZVOUS_DEFAULT_PORT)
    except ValueError:
        host, port = "", 0
    if not host or not 1 <= port <= 65535:  # torch's parser takes port 0: a port of its own on every node
        raise ValueError(f"launch.rdzv_endpoint={cfg.rdzv_endpoint} is not an endpoint; valid: HOST:PORT of the "
                         "first node, with a port in 1..65535") from None
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:
        why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise ValueError(f"launch.rdzv_endpoint={cfg.rdzv_endpoint}: this node cannot resolve the host {host!r} "
                         f"({why}); valid: HOST:PORT of the first node, a name or address every node resolves") from None


def torchrun_command(cfg: LaunchConfig, config_path: Path) -> list[str]:
    """The torchrun command line equivalent to :func:`launch_workers` (what cluster scripts run on each node)."""
    if cfg.rdzv_endpoint:
        rendezvous = [
            f"--nnodes={cfg.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={cfg.rdzv_endpoint}",
            f"--rdzv-id={cfg.rdzv_id or 'RUN_ID'}",
        ]
        changed = {k: v for k, v in _rendezvous_settings(cfg).items() if v != TORCH_RENDEZVOUS_DEFAULTS[k]}
        if changed:
            rendezvous.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in changed.items()))
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
    """``(host:port, id)`` of a c10d rendezvous at the first node of this SLURM job step, as
    ``scripts/slurm_train.sbatch`` derives them: port 15000 + job id mod 10000, so jobs that share a node don't
    collide, below Linux's ephemeral ports (32768 up), where a node's own outgoing connections may hold one. The
    step's nodes, not the job's: a job's first node need not run a task of this step. Never localhost: on several
    nodes each would form a world of its own and wait forever."""
    job_id = os.environ["SLURM_JOB_ID"]
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
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
    return f"{hosts[0]}:{SLURM_PORT_BASE + int(job_id) % 10000}", job_id


class Interrupted(Exception):
    """The workers ended on a signal without stopping at a step: a second Ctrl-C killed them, or the first came
    before they could take it (starting up)."""

    def __init__(self, sig: signal.Signals) -> None:
        super().__init__(f"stopped by {sig.name}")
        self.sig = sig


def launch_workers(cfg: LaunchConfig, config_path: Path) -> signal.Signals | None:
    """Run the workers on this node until they finish; raise :class:`WorkerFailure` if one fails. Returns the stop
    signal this launcher received, if any.

    SIGINT, SIGTERM and SIGUSR1 go to the workers as SIGUSR1 (their SIGTERM is the agent's, to stop them at once),
    and they stop at a step they agree on with a checkpoint and exit 0 (training/stop.py); a second SIGINT kills them
    and raises :class:`Interrupted`. The launcher forwards these itself: torchrun's agent would, but after a first
    signal it waits for the workers in a ``finally`` as well, so a second Ctrl-C would wait again instead of stopping.
    """
    node = this_node(*parse_rendezvous_endpoint(cfg.rdzv_endpoint, RENDEZVOUS_DEFAULT_PORT)) if cfg.rdzv_endpoint \
        else NodeAddress()
    elastic = ElasticLaunchConfig(
        min_nodes=cfg.min_nodes,
        max_nodes=cfg.max_nodes,
        nproc_per_node=cfg.nproc_per_node,
        run_id=cfg.rdzv_id or uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint=cfg.rdzv_endpoint or "localhost:0",  # port 0: parallel jobs never collide
        rdzv_configs={**_rendezvous_settings(cfg), **({"is_host": True} if node.hosts_store else {})},
        local_addr=node.address,
        max_restarts=cfg.max_restarts,
        monitor_interval=cfg.monitor_interval,
        signals_to_handle="SIGHUP,SIGQUIT",  # the agent's way: it forwards them and waits (30 s), then kills
        start_method="forkserver",
    )
    threads = cfg.threads_per_worker or default_threads_per_worker(cfg.nproc_per_node)
    # The agent logs each failure at ERROR; WorkerFailure reports the first one instead.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # "Terminating process N via SIGTERM"
    _AfterTheWorkers.install()
    with StopForwarding(config_path.parent / REQUEST_FILE) as forward, environment(OMP_NUM_THREADS=str(threads),
                                                   **(ELASTIC_ENV if cfg.elastic else {}),
                                                   **({GLOO_INTERFACE: node.interface} if node.interface else {})):
        start_forkserver()
        try:
            with ExitOrder(cfg.nproc_per_node) as exits:
                elastic_launch(elastic, forked)(str(config_path), os.getcwd(), dict(os.environ))
            return forward.received
        except ChildFailedError as error:
            if forward.received is not None:  # killed by a second Ctrl-C, or by the signal before its handler was set
                raise Interrupted(forward.killed or forward.received) from None
            raise _failure(error, exits.first(), config_path.parent) from None
        except SignalException as error:
            raise Interrupted(forward.killed or error.sigval) from None
        except RendezvousError as error:
            raise RendezvousFailed(_rendezvous_failure(cfg, error)) from None


class _AfterTheWorkers(logging.Filter):
    """torch's agents meet at an exit barrier once their workers have ended, in the store of the agent that hosts the
    rendezvous, and that agent leaves as soon as it has arrived: an agent still waiting then logs a traceback (``Error
    waiting on exit barrier``) and a warning (``failed to shutdown the rendezvous``): seen on the other node in 1 of
    8 two-node runs in network namespaces, after both had trained. The launcher reports how the workers ended
    itself, so these go to launcher.log, not to the terminal."""

    loggers = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.rendezvous.dynamic_rendezvous")
    messages = ("Error waiting on exit barrier", "has failed to shutdown the rendezvous")

    @classmethod
    def install(cls) -> None:
        for name in cls.loggers:
            if not any(isinstance(f, cls) for f in logging.getLogger(name).filters):
                logging.getLogger(name).addFilter(cls())

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(part in message for part in self.messages):
            logger.debug(f"torch's agent, after the workers: {message}")
            return False
        return True


def start_forkserver() -> None:
    """Start, unless it runs (the command started it: forking.py), the process the workers are forked from instead of
    starting as interpreters: it imports torch and the training code once (decent_train/forkserver.py), and dies with
    this process. It outlives a launch: each worker takes the directory and the environment of its own
    (worker.take_the_launch)."""
    spawn_forkserver()
    # Returns once it has imported all that (seconds, the first time), so that no worker's start waits on it: a node
    # agent's loop, which must answer the coordinator within fault_tolerance.detect_s, then waits milliseconds.
    probe = multiprocessing.get_context("forkserver").Process(target=os.getpid)
    probe.start()
    probe.join()


class ForkedWorker:
    """A worker forked from the forkserver (:func:`start_forkserver`), watched through the part of
    ``subprocess.Popen``'s interface that launcher/node_agent.py uses."""

    def __init__(self, config_path: Path, environ: dict[str, str]) -> None:
        self.process = multiprocessing.get_context("forkserver").Process(
            target=forked, args=(str(config_path), os.getcwd(), environ), name="decent_train.worker")
        self.process.start()
        self.pid = self.process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def wait(self) -> int | None:
        self.process.join()
        return self.process.exitcode


class StopForwarding:
    """The launcher's handler of the stop signals while its workers (forked by torchrun's agent, or started by
    launcher/node_agent.py: :func:`_workers`) run: the first goes on to every worker; a SIGINT after it
    kills them (SIGKILL) and raises SignalException, which ends torchrun's agent's wait. Installed as a context."""

    def __init__(self, request_file: Path | None = None) -> None:
        self.received: signal.Signals | None = None
        self.killed: signal.Signals | None = None
        self.request_file = request_file  # for workers not started yet (training/stop.py: install)
        self._saved: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopForwarding:
        if self.request_file is not None:
            self.request_file.unlink(missing_ok=True)  # an earlier launch's, into the same directory
        self._saved = {sig: signal.signal(sig, self) for sig in stop_signals()}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        if self.request_file is not None:
            self.request_file.unlink(missing_ok=True)

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        again = self.received is not None and sig == signal.SIGINT
        self.received = self.received or sig
        if again:
            for pid in _workers():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.killed = sig
            raise SignalException(f"a second {sig.name}", sigval=sig)
        pass_stop_on(self.request_file)


def pass_stop_on(request_file: Path | None) -> None:
    """A stop to this node's workers: into ``request_file`` first, which a worker reads once its handler is set
    (training/stop.py: install), then as :data:`FORWARDED` to each worker whose handler is set: before that the
    signal's default action would kill it, and a worker started later would never get it."""
    if request_file is not None:
        with contextlib.suppress(OSError):
            request_file.write_text("stop")
    for pid in _workers():
        if _catches(pid, FORWARDED):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, FORWARDED)


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (the kernel's caught-signals mask, /proc/PID/status)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path(f"/proc/{pid}/status").read_text()
        mask = next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1]
        return bool(int(mask, 16) >> (int(sig) - 1) & 1)
    return False


def _workers() -> list[int]:
    """This process's workers: its children that run the worker module (a node agent's ``command``), and the
    children of its forkserver (:func:`start_forkserver`). Read from /proc."""
    found = processes()
    servers = children_running(found, "multiprocessing.forkserver")
    return [int(pid) for pid in children_running(found, WORKER_MODULE)] + \
        [int(pid) for pid, (parent, _) in found.items() if parent in servers]


def kill_forkserver() -> None:
    """Kill this process's forkserver and multiprocessing's resource tracker (its children that run them), and reap
    them; for a node agent that gives up and ends at once: nothing of it may go on running on its node. Once its
    workers are gone: the tracker outlives every process that holds its pipe."""
    for pid in children_running(processes(), "multiprocessing.forkserver", "multiprocessing.resource_tracker"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(int(pid), 0)


TORCH_RENDEZVOUS_DEFAULTS = {"last_call_timeout": TORCH_LAST_CALL_S, "keep_alive_interval": TORCH_KEEP_ALIVE_S,
                             "read_timeout": TORCH_STORE_TIMEOUT_S}


def _rendezvous_settings(cfg: LaunchConfig) -> dict[str, int]:
    """torch's c10d rendezvous options (``--rdzv-conf``) that a membership change waits on: a lost node is dropped
    after 3 missed heartbeats, and the rest go on once ``last_call`` has passed without more nodes; and how long a
    node waits for the store (``read_timeout``: to reach it, and for each request)."""
    return {"last_call_timeout": cfg.rdzv_last_call_s, "keep_alive_interval": cfg.rdzv_keep_alive_s,
            "read_timeout": cfg.rdzv_store_timeout_s}


def _rendezvous_failure(cfg: LaunchConfig, error: RendezvousError) -> str:
    """One line for a failed rendezvous: what failed, torch's reason (the first line of the error it wraps, without
    the C++ frames), and what to check."""
    endpoint = cfg.rdzv_endpoint or "localhost (this node alone)"
    cause = error.__cause__ or error.__context__
    reason = next((line.strip() for line in str(cause or error).splitlines() if line.strip()), type(error).__name__)
    if isinstance(error, RendezvousConnectionError):
        return (f"launch.rdzv_endpoint={endpoint}: no rendezvous store answered there within "
                f"launch.rdzv_store_timeout_s={cfg.rdzv_store_timeout_s} s ({reason}); it must be HOST:PORT of the "
                "first node, whose decent-train (or torchrun) hosts the store there, reachable from this node")
    if isinstance(error, RendezvousTimeoutError):
        return (f"launch.nnodes={cfg.nnodes}: not enough nodes joined the rendezvous {cfg.rdzv_id!r} at {endpoint} in "
                "time; start decent-train on every node with the same launch.rdzv_endpoint and launch.rdzv_id")
    if isinstance(error, RendezvousClosedError):
        return (f"launch.rdzv_id={cfg.rdzv_id}: the rendezvous at {endpoint} is closed: the job under that id has "
                "ended on the other nodes (or failed there); give a fresh launch.rdzv_id to start another")
    return f"launch.rdzv_endpoint={endpoint}: the rendezvous failed ({type(error).__name__}: {reason})"


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


def _failure(error: ChildFailedError, first: int | None = None, run_dir: Path | None = None) -> WorkerFailure:
    """The failed worker torch's agent reports: its last error line, and its traceback from the error file
    ``@record`` wrote. If another worker of this node ended before it (``first``, exit_order.py) without a Python
    error of its own (its log has no "rank K failed"), that one is named first: it was killed, and the reported one
    failed on it."""
    rank, failure = error.get_first_failure()
    if first is not None and first != rank and run_dir is not None:
        log = run_dir / "logs" / f"rank{first}.log"
        with contextlib.suppress(OSError):
            if f"rank {first} failed" not in log.read_text(errors="replace"):
                reported = _failure(error)
                return WorkerFailure(f"worker rank {first} ended first, with no error of its own (killed: a signal "
                                     f"such as SIGKILL, or the kernel's out-of-memory killer; its log: {log}); then "
                                     f"{reported}", reported.traceback)
    traceback = ""
    if isinstance(failure.message, dict):
        traceback = failure.message.get("extraInfo", {}).get("py_callstack", "")
        what = failure.message.get("message", "")
    elif failure.exitcode < 0:
        what = f"killed by signal {signal.Signals(-failure.exitcode).name}"
    else:
        what = "no Python error recorded (it failed before it started, or exited on its own)"
    return WorkerFailure(f"worker rank {rank} failed (exit code {failure.exitcode}): {what}", traceback.rstrip())


def format_command(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
