"""``fault_tolerance=live``: the node agent, one per node. It starts and watches its node's workers and reports to the
coordinator (``coordinator.py``) through the coordinator's store; it decides nothing about the membership.

- It starts ``launch.nproc_per_node`` workers with ids it takes from a store counter (ids never collide across
  nodes), and a replacement when the coordinator asks for one. Each has a slot on the node, its ``LOCAL_RANK`` (on
  GPUs, its device, as torchrun's local rank is): the founders 0..nproc−1, a replacement the slot its lost worker
  freed.
- It sees a worker exit within ``POLL_S`` (its child), and a hung one by its heartbeat (silent for
  ``fault_tolerance.detect_s`` once it said hello; a founder that never says hello, by a bound of its own): it kills
  a hung one before reporting it (fencing: it must not come back into a run that went on without it).
- It beats for the node; the coordinator declares the whole node lost when that stops.
- **It stops its workers when it loses the coordinator**: no answer from the store for ``fault_tolerance.detect_s``
  (a watchdog thread: a store call to a host cut off blocks without a timeout) and it SIGKILLs its workers and exits
  with one line. A node cut off never goes on as a second half; its workers cannot pass a record step's barrier (a
  store key) without the store, so they write no record and no checkpoint meanwhile.
- A stop signal it receives goes on to its workers (``launch.StopForwarding``), as does one the coordinator passes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from loguru import logger
from omegaconf import OmegaConf

from decent_train.components.data import prepare as prepare_data
from decent_train.config import RESOLVED_CONFIG, TrainConfig, check_config
from decent_train.launcher.coordinator import NodeKeys, exit_reason
from decent_train.launcher.launch import ForkedWorker, StopForwarding, WorkerFailure, default_threads_per_worker, \
    kill_forkserver, pass_stop_on, start_forkserver
from decent_train.launcher.network import GLOO_INTERFACE, interface_towards
from decent_train.training.live import HEARTBEAT_S, MEMBER_ENV, STORE_ENV, Keys
from decent_train.training.stop import AGENT_PID_ENV, REQUEST_FILE

POLL_S = 0.02  # between two looks at the worker processes (an exit is seen this soon)
STALE_S = 0.5  # a heartbeat this old: look whether the worker said it is done (it stops beating as it exits)
# A founder must say hello within HELLO_K x the time the node's first founder took (they do the same work), at least
# HELLO_FLOOR_S, at most pg_timeout_s / 2 (before any founder has: pg_timeout_s / 2).
HELLO_K = 3.0
HELLO_FLOOR_S = 30.0
CONNECT_S = 1.0  # the timeout of a reconnection to the coordinator's store (the watchdog bounds the whole)


@dataclass
class _Worker:
    id: int
    process: subprocess.Popen[bytes] | ForkedWorker
    founder: bool  # started at registration: the hello bound applies
    slot: int  # its place on the node, 0..nproc−1: its LOCAL_RANK (its GPU)
    started: float = field(default_factory=time.monotonic)
    hello: bool = False
    done: bool = False  # trained to the end (its done key, or exit code 0)
    beats: int = 0
    last_beat: float = 0.0
    ended: bool = False  # its end (lost or done) is reported
    stopped_at_end: bool = False  # killed when the run ended: on purpose, not overdue


class NodeAgent:
    """One node's workers for the coordinator at ``coordinator`` (HOST:PORT). :meth:`run` returns when the
    coordinator ends the run; raises :class:`WorkerFailure` when the coordinator fenced this node off. ``command``:
    what a worker runs (tests start stand-ins); default: a worker forked from the launcher's forkserver
    (``launch.ForkedWorker``), the same as ``python -m decent_train.worker CONFIG``."""

    def __init__(self, cfg: TrainConfig, config_path: Path, coordinator: str, stopping: StopForwarding,
                 command: list[str] | None = None) -> None:
        self.cfg, self.ft = cfg, cfg.fault_tolerance
        self.coordinator = coordinator
        self.stopping = stopping
        self.config_path, self.command = config_path, command
        if command is None:
            start_forkserver()  # here, in the thread that lives as long as the agent (replacements start in another)
        self.nproc = cfg.launch.nproc_per_node or 1
        self.threads = cfg.launch.threads_per_worker or default_threads_per_worker(self.nproc)
        self.store = connect(coordinator, cfg.pg_timeout_s)  # the coordinator may come up after this agent
        self.workers: dict[int, _Worker] = {}
        self.node = -1
        self.events = self.orders = 0
        self.first_hello: float | None = None
        self.registered = time.monotonic()
        self.last_contact = time.monotonic()
        self.ended = threading.Event()
        self.fenced: str | None = None  # why the coordinator declared this node lost
        self.ending: float | None = None  # the run is over: the deadline of the workers' exits
        self.env = self._worker_env()

    # -- the coordinator's store -------------------------------------------------------------------------------------
    def _report(self, kind: str, **fields: Any) -> None:
        self.store.set(NodeKeys.event(self.node, self.events), json.dumps({"kind": kind, **fields}))
        self.events += 1
        self.store.add(NodeKeys.events(self.node), 1)

    def _watchdog(self) -> None:
        """No answer from the coordinator for detect_s: the workers are killed and this process ends (a store call
        that blocks holds the agent's loop, not this thread)."""
        while not self.ended.wait(HEARTBEAT_S):
            silent = time.monotonic() - self.last_contact
            if silent > self.ft.detect_s:
                self.kill_all()
                kill_forkserver()
                message = (f"node agent {self.node}: no answer from the coordinator at {self.coordinator} for "
                           f"{silent:.1f} s (fault_tolerance.detect_s={self.ft.detect_s:g}): stopped its "
                           f"{len(self.workers)} workers; the run goes on without this node, or ends if the "
                           "coordinator is gone (resume=RUN_DIR continues from the newest checkpoint)")
                logger.error(message)
                print(f"decent-train: error: {message}", file=sys.stderr, flush=True)
                os._exit(1)

    # -- workers -----------------------------------------------------------------------------------------------------
    def _worker_env(self) -> dict[str, str]:
        env = {
            **os.environ,
            STORE_ENV: self.coordinator,
            AGENT_PID_ENV: str(os.getpid()),
            "LOCAL_WORLD_SIZE": str(self.nproc),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(self.threads)),
        }
        if GLOO_INTERFACE not in env:  # gloo's address: the interface this node reaches the coordinator on
            interface = interface_towards(*self.coordinator.rsplit(":", 1))
            if interface is not None:
                env[GLOO_INTERFACE] = interface
        return env

    def _start_worker(self, founder: bool, slot: int, member: int | None = None) -> int:
        """Start a worker as ``member`` (default: the store counter's next id) in ``slot`` (its LOCAL_RANK)."""
        if member is None:
            member = self.store.add(NodeKeys.MEMBER_IDS, 1) - 1
        self.store.add(Keys.beat(member), 0)  # exists before the worker beats: read in one multi_get
        env = {**self.env, MEMBER_ENV: str(member), "LOCAL_RANK": str(slot)}
        process = subprocess.Popen(self.command, env=env) if self.command else ForkedWorker(self.config_path, env)
        self.workers[member] = _Worker(member, process, founder, slot)
        self._report("started", member=member, pid=process.pid)
        return member

    def _free_slot(self, replaces: int | None) -> int:
        """The slot of a replacement: that of the worker it replaces if it was on this node and has exited (its GPU
        is free), else the lowest slot no running worker holds (else the one fewest hold: never two on one while
        another is free)."""
        held = [w.slot for w in self.workers.values() if w.process.poll() is None]
        lost = self.workers.get(replaces) if replaces is not None else None
        if lost is not None and lost.slot not in held:
            return lost.slot
        return min(range(self.nproc), key=held.count)

    def kill_all(self) -> None:
        for worker in self.workers.values():
            if worker.process.poll() is None:
                worker.process.kill()
        for worker in self.workers.values():
            worker.process.wait()

    def _kill(self, worker: _Worker, why: str) -> None:
        """Kill ``worker`` (fencing) and report it lost."""
        worker.process.kill()
        worker.process.wait()
        self._lost(worker, why)

    def _lost(self, worker: _Worker, why: str) -> None:
        worker.ended = True
        logger.warning(f"node {self.node}: member {worker.id} lost ({why})")
        self._report("lost", member=worker.id, why=why)

    def _finished(self, worker: _Worker) -> None:
        worker.done = worker.ended = True
        self._report("done", member=worker.id)

    # -- the loop ----------------------------------------------------------------------------------------------------
    def register(self) -> None:
        """A node id, the counters the coordinator reads, the workers started; the node's info last."""
        self.node = self.store.add(NodeKeys.NODE_IDS, 1) - 1
        for key in (NodeKeys.beat(self.node), NodeKeys.events(self.node), NodeKeys.orders(self.node)):
            self.store.add(key, 0)
        # one block of ids: a node's founders are consecutive whatever order the agents register in, and the
        # coordinator ranks nodes by their first id, so member k starts as rank k
        first = self.store.add(NodeKeys.MEMBER_IDS, self.nproc) - self.nproc
        for member in range(first, first + self.nproc):
            self._start_worker(founder=True, slot=member - first, member=member)
        info = {"host": socket.gethostname(), "pid": os.getpid(), "workers": self.nproc}
        self.store.set(NodeKeys.info(self.node), json.dumps(info))
        self.last_contact = time.monotonic()
        logger.info(f"node {self.node}: {self.nproc} workers (members {', '.join(map(str, self.workers))}) for the "
                    f"coordinator at {self.coordinator}")

    def run(self) -> None:
        """Watch the workers until the coordinator ends the run (or fences this node: :class:`WorkerFailure`)."""
        watchdog = threading.Thread(target=self._watchdog, name="decent_train-agent-watchdog", daemon=True)
        watchdog.start()
        try:
            if self.node < 0:
                self.register()
            next_look = 0.0
            while not self.ended.is_set():
                try:
                    next_look = self._round(next_look)
                except (RuntimeError, dist.DistError) as error:  # the watchdog bounds how long this may last
                    logger.debug(f"node {self.node}: the coordinator's store failed ({error}); reconnecting")
                    with contextlib.suppress(RuntimeError, dist.DistError):
                        self.store = connect(self.coordinator, CONNECT_S)
                if not self.ended.is_set():
                    time.sleep(POLL_S)
        finally:
            self.ended.set()
            self.kill_all()
        if self.fenced is not None:
            raise WorkerFailure(self.fenced)

    def _round(self, next_look: float) -> float:
        """The processes (every POLL_S), and every HEARTBEAT_S a look with the coordinator; the next look's time."""
        for worker in self.workers.values():
            self._watch_process(worker)
        if self.ending is not None:
            self._end_when_exited()
            if self.ended.is_set():
                return next_look
        if time.monotonic() >= next_look:
            next_look = time.monotonic() + HEARTBEAT_S
            self._look()
            self.last_contact = time.monotonic()
        return next_look

    def _watch_process(self, worker: _Worker) -> None:
        if worker.ended:
            return
        code = worker.process.poll()
        if code == 0:
            self._finished(worker)
        elif code is not None:
            self._lost(worker, exit_reason(code))

    def _look(self) -> None:
        """One round with the coordinator: the node's heartbeat, its orders, the workers' hellos and heartbeats."""
        self.store.add(NodeKeys.beat(self.node), 1)
        orders = self.store.add(NodeKeys.orders(self.node), 0)
        for index in range(self.orders, orders):
            self.orders = index + 1
            self._obey(json.loads(self.store.get(NodeKeys.order(self.node, index))))
            if self.ended.is_set():
                return
        now = time.monotonic()
        for worker in self.workers.values():
            if not worker.ended and not worker.hello and self.store.check([Keys.hello(worker.id)]):
                worker.hello, worker.last_beat = True, now
                self.first_hello = self.first_hello or now - self.registered
                self._report("hello", member=worker.id)
        watched = [w for w in self.workers.values() if w.hello and not w.ended]
        for worker, beats in zip(watched, self.store.multi_get([Keys.beat(w.id) for w in watched])):
            if int(beats) != worker.beats:
                worker.beats, worker.last_beat = int(beats), now
            elif now - worker.last_beat > STALE_S and self.store.check([Keys.done(worker.id)]):
                self._finished(worker)  # it exits now: its heartbeat has stopped
            elif now - worker.last_beat > self.ft.detect_s:
                self._kill(worker, f"no answer for {self.ft.detect_s:g} s")
        bound = self._hello_bound()
        for worker in self.workers.values():
            if worker.founder and not worker.hello and not worker.ended and now - worker.started > bound:
                self._kill(worker, f"no hello within {bound:.0f} s ({HELLO_K:g} x the first founder's "
                                   f"{self.first_hello or 0:.1f} s, at least {HELLO_FLOOR_S:g} s, at most "
                                   "pg_timeout_s / 2)")

    def _hello_bound(self) -> float:
        ceiling = self.cfg.pg_timeout_s / 2
        return ceiling if self.first_hello is None else min(ceiling, max(HELLO_FLOOR_S, HELLO_K * self.first_hello))

    def _obey(self, order: dict[str, Any]) -> None:
        kind = order["kind"]
        if kind == "start":
            member = self._start_worker(founder=False, slot=self._free_slot(order.get("replaces")))
            logger.info(f"node {self.node}: member {order['replaces']} replaced by member {member}")
        elif kind == "kill":
            worker = self.workers.get(order["member"])
            if worker is not None and not worker.ended:
                self._kill(worker, order["why"])
        elif kind == "stop":
            if self.stopping.received is None:  # on one node, the launcher's own handler has passed it on
                pass_stop_on(self.stopping.request_file)
        elif kind == "fence":
            self.kill_all()
            self.fenced = f"node {self.node}: the coordinator declared this node lost ({order['why']}); its workers " \
                          "were stopped"
            self.ended.set()
        elif kind == "end":
            self._end(kill=order["kill"])

    def _end(self, kill: bool) -> None:
        """The run is over: members that finished training exit within comm_timeout_s + detect_s (the loop goes on
        beating meanwhile; then they are killed, with a warning: their result is written); any other worker, and
        every one with ``kill``, is stopped now."""
        for worker in self.workers.values():
            finished = worker.done or self.store.check([Keys.done(worker.id)])
            if worker.process.poll() is None and (kill or not finished):
                worker.ended = worker.stopped_at_end = True  # not a loss: the run is over
                worker.process.kill()
        self.ending = time.monotonic() + (0.0 if kill else self.cfg.comm_timeout_s + self.ft.detect_s)

    def _end_when_exited(self) -> None:
        """Once every worker has exited (or the end's bound passed): tell the coordinator, and stop."""
        running = [w for w in self.workers.values() if w.process.poll() is None]
        if running and time.monotonic() < self.ending:
            return
        for worker in running:
            if not worker.stopped_at_end:  # else it is killed, only not reaped yet
                logger.warning(f"member {worker.id} finished training but did not exit within comm_timeout_s + "
                               "fault_tolerance.detect_s: killed")
        self.kill_all()
        self.ended.set()
        with contextlib.suppress(RuntimeError, dist.DistError):
            self._report("ended")


def connect(address: str, timeout_s: float) -> dist.TCPStore:
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


def run_agent(cfg: TrainConfig, run_dir: Path) -> None:
    """``fault_tolerance.role=agent``: this node's agent for the coordinator at ``launch.rdzv_endpoint``. The job is
    the coordinator's (its resolved config, written into this run directory), so every node runs the same one."""
    address = cfg.launch.rdzv_endpoint
    try:
        store = connect(address, cfg.pg_timeout_s)
    except (RuntimeError, dist.DistError) as error:
        raise ValueError(f"no coordinator answered at launch.rdzv_endpoint={address} within pg_timeout_s="
                            f"{cfg.pg_timeout_s:g} s ({str(error).splitlines()[0]}); start it first "
                            "(fault_tolerance.role=coordinator), or check the address") from None
    run_id = store.get(NodeKeys.RUN_ID).decode()
    if run_id != cfg.launch.rdzv_id:
        raise ValueError(f"launch.rdzv_id={cfg.launch.rdzv_id}: the coordinator at {address} runs launch.rdzv_id="
                         f"{run_id}; give every node the coordinator's")
    config_path = run_dir / RESOLVED_CONFIG
    config_path.write_text(store.get(NodeKeys.CONFIG).decode())
    job = check_config(OmegaConf.load(config_path))
    prepare_data(job.dataset)
    with StopForwarding(config_path.parent / REQUEST_FILE) as stopping:
        agent = NodeAgent(job, config_path, address, stopping)
        agent.run()
