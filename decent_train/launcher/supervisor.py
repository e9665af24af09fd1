"""``fault_tolerance=live``: the launcher runs the workers itself, one process each, and decides who is in the run.

torchrun's agent restarts every worker when one fails; here the launcher starts each worker as a process of its own,
hosts the store the workers reconfigure through (so no worker's death takes it down, rank 0's included), and is the
one coordinator of the membership (no split brain: one writer of plans):

- a worker that exits with an error, or whose heartbeat stops for ``fault_tolerance.detect_s`` (it is then killed,
  so that a hung worker cannot come back into a run that has gone on without it), is lost; the next plan has the
  others, and a replacement is started while ``launch.max_restarts`` allows;
- a replacement that has said hello joins by the next plan, healing from a live member;
- fewer than ``fault_tolerance.min_workers`` members: a last plan stops the run (the workers save a checkpoint);
- SIGINT, SIGTERM or SIGUSR1 to the launcher goes on to every worker as torchrun's path does (training/stop.py): they
  stop at a step they agree on, with a checkpoint, and no replacement is started; a second Ctrl-C kills them.

The workers' side, and the protocol in full: ``training/live.py`` and ``docs/fault-tolerance.md``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from loguru import logger
from torch.distributed.elastic.multiprocessing.api import SignalException

from decent_train.config import TrainConfig
from decent_train.launcher.launch import (
    AGENT_PID_ENV,
    WORKER_MODULE,
    Interrupted,
    StopForwarding,
    WorkerFailure,
    default_threads_per_worker,
)
from decent_train.training.live import MEMBER_ENV, STORE_ENV, Keys, Plan

POLL_S = 0.02
# A founder must say hello within HELLO_K x the time the first founder took (they do the same work), at least
# HELLO_FLOOR_S, at most pg_timeout_s / 2 (before any founder has: pg_timeout_s / 2).
HELLO_K = 3.0
HELLO_FLOOR_S = 30.0
WORKERS_FILE = "workers.json"  # member id -> pid of every worker process started


@dataclass
class _Worker:
    id: int
    process: subprocess.Popen[bytes]
    last_beat: float = 0.0
    beats: int = 0
    started: float = field(default_factory=time.monotonic)
    said_hello: bool = False


@dataclass
class _Change:
    plan: Plan
    committed: bool = False  # every member of the plan is done with the change


@dataclass
class Supervisor:
    """Runs one job's workers under live membership; :meth:`run` returns the membership changes."""

    cfg: TrainConfig
    config_path: Path
    run_dir: Path
    workers: dict[int, _Worker] = field(default_factory=dict)
    changes: list[_Change] = field(default_factory=list)
    finished: set[int] = field(default_factory=set)
    lost_at_end: set[int] = field(default_factory=set)  # members lost once another had finished training
    stopping: StopForwarding = field(default_factory=StopForwarding)  # its ``received``: the workers are stopping

    def __post_init__(self) -> None:
        self.ft, self.launch = self.cfg.fault_tolerance, self.cfg.launch
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=self.cfg.pg_timeout_s))
        self.restarts_left = self.launch.max_restarts
        self.next_id = 0
        self.threads = self.launch.threads_per_worker or default_threads_per_worker(self.launch.nproc_per_node)

    # -- processes ----------------------------------------------------------------------------------------------
    def _start_worker(self) -> int:
        member = self.next_id
        self.next_id += 1
        env = {
            **os.environ,
            STORE_ENV: f"127.0.0.1:{self.store.port}",
            MEMBER_ENV: str(member),
            AGENT_PID_ENV: str(os.getpid()),
            "LOCAL_WORLD_SIZE": str(self.launch.nproc_per_node),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(self.threads)),
        }
        process = subprocess.Popen([sys.executable, "-u", "-m", WORKER_MODULE, str(self.config_path)], env=env)
        self.workers[member] = _Worker(member, process)
        pids = {w.id: w.process.pid for w in self.workers.values()}
        partial = self.run_dir / f"{WORKERS_FILE}.partial"
        partial.write_text(json.dumps(pids) + "\n")
        os.replace(partial, self.run_dir / WORKERS_FILE)  # who to kill, for chaos tests: never read half-written
        return member

    def _stop_all(self) -> None:
        for worker in self.workers.values():
            if worker.process.poll() is None:
                worker.process.kill()
        for worker in self.workers.values():
            worker.process.wait()

    # -- the coordinator ----------------------------------------------------------------------------------------
    @property
    def plan(self) -> Plan | None:
        return self.changes[-1].plan if self.changes else None

    def _publish(self, members: list[int], **kwargs: Any) -> Plan:
        epoch = len(self.changes)
        plan = Plan(epoch, members, uuid.uuid4().int >> 65, detected_at=time.time(), **kwargs)
        self.store.set(Keys.plan(epoch), plan.dumps())
        self.store.add(Keys.EPOCH, 1)  # now epoch + 1: the workers read epoch = value - 1
        self.changes.append(_Change(plan))
        return plan

    def run(self) -> list[dict[str, Any]]:
        """Train to the end; the membership changes (``result.json``'s ``membership_changes``). Raises
        :class:`WorkerFailure` if the run cannot go on."""
        with self.stopping:  # a stop signal goes on to the workers (launch.py's StopForwarding)
            for _ in range(self.launch.nproc_per_node):
                self._start_worker()
            try:
                self._wait_for_founders()
                while not self._step():
                    time.sleep(POLL_S)
                for worker in self.workers.values():  # the members exit; a replacement that never joined is stopped
                    if worker.id in self.finished:
                        self._wait_for_exit(worker)
            except SignalException:  # a second Ctrl-C: the workers were killed
                raise Interrupted(signal.SIGINT) from None
            finally:
                self._stop_all()
        return self._summary()

    def _wait_for_exit(self, worker: _Worker) -> None:
        """A member that finished training exits (the end's barrier, tearing gloo down): within comm_timeout_s and
        detect_s, or it is killed (its result is written: the run is not failed for it)."""
        bound = self.cfg.comm_timeout_s + self.ft.detect_s
        try:
            worker.process.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait()
            logger.warning(f"member {worker.id} finished training but did not exit within {bound:g} s "
                           "(comm_timeout_s + fault_tolerance.detect_s): killed")

    def _wait_for_founders(self) -> None:
        """Every founder's hello. A founder that exits, or does not say hello within the bound (``_hello_bound``),
        stops the launch with one line: no plan exists yet to go on without it. Not detect_s: building the data and
        the model can hold the GIL for seconds, and the heartbeat thread with it."""
        founders, start, first = list(self.workers), time.monotonic(), None
        while not all(self.store.check([Keys.hello(m)]) for m in founders):
            now = time.monotonic()
            if first is None and any(self.store.check([Keys.hello(m)]) for m in founders):
                first = now - start
            bound = self._hello_bound(first)
            for worker in self.workers.values():
                code = worker.process.poll()
                if code is not None:
                    raise WorkerFailure(f"worker {worker.id} failed before training started ({_exit(code)})")
                if self.store.check([Keys.hello(worker.id)]):
                    continue
                if now - start > bound:
                    worker.process.kill()
                    raise WorkerFailure(
                        f"worker {worker.id} hung before training started: no hello within {bound:.0f} s "
                        f"({HELLO_K:g} x the first founder's {first or 0:.1f} s, at least {HELLO_FLOOR_S:g} s, at "
                        "most pg_timeout_s / 2); stopped"
                    )
            time.sleep(POLL_S)
        now = time.monotonic()
        for member in founders:
            self.workers[member].said_hello, self.workers[member].last_beat = True, now
        self._publish(founders)
        logger.info(f"live membership: {len(founders)} workers, store 127.0.0.1:{self.store.port}")

    def _hello_bound(self, first: float | None) -> float:
        ceiling = self.cfg.pg_timeout_s / 2
        return ceiling if first is None else min(ceiling, max(HELLO_FLOOR_S, HELLO_K * first))

    def _silent(self, worker: _Worker, now: float) -> str | None:
        """Why ``worker`` counts as hung (its heartbeat, once it has started, silent for detect_s), or None."""
        beats = self.store.add(Keys.beat(worker.id), 0)
        if beats != worker.beats or worker.beats == 0:
            worker.beats, worker.last_beat = beats, now
            return None
        return f"no answer for {self.ft.detect_s:g} s" if now - worker.last_beat > self.ft.detect_s else None

    def _step(self) -> bool:
        """One look at the workers; True when the run is over."""
        plan = self.plan
        if plan.stop and self.store.add(Keys.commit(plan.epoch), 0) >= len(plan.members):
            raise WorkerFailure(
                f"fault_tolerance.min_workers={self.ft.min_workers}: {len(plan.members)} worker(s) left; the run "
                "stopped with a checkpoint (resume=RUN_DIR continues it)"
            )
        lost = self._lost(plan)
        if lost and self.finished:  # training is over (a member finished): nothing to plan for
            if set(lost) - self.lost_at_end:
                logger.warning(f"lost after the end of training: {lost}")
            self.lost_at_end |= set(lost)
        if self.finished:
            return all(m in self.finished or m in self.lost_at_end for m in plan.members)
        if lost:
            self._plan_without(plan, lost)
            return False
        change = self.changes[-1]
        if not change.committed and self.store.add(Keys.commit(plan.epoch), 0) >= len(plan.members):
            change.committed = True
        joiners = [w.id for w in self.workers.values()
                   if w.id not in plan.members and w.process.poll() is None and self.store.check([Keys.hello(w.id)])]
        if joiners and change.committed and not self.finished:  # not once training is over
            self._plan(plan.members, joiners)
        return False

    def _established(self) -> list[int]:
        """The members of the newest committed plan (the ones that can heal a joiner)."""
        return next((c.plan.members for c in reversed(self.changes) if c.committed),
                    self.changes[0].plan.members)

    def _plan(self, members: list[int], joiners: list[int], lost: dict[int, str] | None = None) -> None:
        """A plan with ``members`` and ``joiners`` (new, or of a plan not committed yet); each joiner heals from the
        last of the established members among them."""
        established = [m for m in members if m in self._established()]
        joiners = [j for j in joiners if j not in established]
        for member in joiners:
            self.workers[member].said_hello, self.workers[member].last_beat = True, time.monotonic()
        donors = {j: established[-1] for j in joiners}
        self._publish(established + joiners, lost=lost or {}, joined=joiners, donors=donors)
        if joiners:
            logger.info(f"epoch {len(self.changes) - 1}: {len(joiners)} worker(s) joining, healing from member "
                        f"{established[-1]}")

    def _lost(self, plan: Plan) -> dict[int, str]:
        """Members (and joiners) that exited with an error or stopped beating: killed, with the reason."""
        lost: dict[int, str] = {}
        now = time.monotonic()
        for worker in self.workers.values():
            if worker.id in self.finished or any(worker.id in c.plan.lost for c in self.changes):
                continue
            code = worker.process.poll()
            if code == 0 or self.store.check([Keys.done(worker.id)]):
                self.finished.add(worker.id)
                continue
            if code is not None:
                lost[worker.id] = _exit(code)
                continue
            if not worker.said_hello:
                continue
            why = self._silent(worker, now)
            if why is None and self.store.check([Keys.stuck(worker.id)]):  # a member waited past a bound for it
                why = f"stuck: {self.store.get(Keys.stuck(worker.id)).decode()}"
            if why is not None:
                worker.process.kill()  # a hung worker must not come back into the run
                worker.process.wait()
                lost[worker.id] = why
        return {m: why for m, why in lost.items() if m in plan.members or self.workers[m].said_hello}

    def _plan_without(self, plan: Plan, lost: dict[int, str]) -> None:
        for member, why in lost.items():
            logger.warning(f"member {member} lost ({why})")
        members = [m for m in plan.members if m not in lost and m not in self.finished]
        established = [m for m in members if m in self._established()]
        if not established:
            raise WorkerFailure("every worker was lost: " + "; ".join(f"member {m}: {w}" for m, w in lost.items()))
        if len(established) < self.ft.min_workers:  # a last plan: the workers save a checkpoint and end
            self._publish(established, lost=lost, stop=True)
            return
        self._plan(members, [m for m in members if m not in established], lost)
        for member in lost:
            if self.restarts_left > 0 and self.stopping.received is None:  # not while the run stops on a signal
                self.restarts_left -= 1
                replacement = self._start_worker()
                logger.info(f"member {member} replaced by member {replacement} (restarts left: {self.restarts_left})")

    def _summary(self) -> list[dict[str, Any]]:
        """Each change the members went through: the plans a later one superseded before they took effect count
        in it (ranks are those in the members before the change; None for a joiner lost before it was in)."""
        summary, previous, lost = [], self.changes[0].plan.members, {}
        for change in self.changes[1:]:
            plan = change.plan
            lost |= plan.lost
            if not change.committed:
                continue
            record: dict[str, Any] = {
                "epoch": plan.epoch,
                "lost": [{"rank": previous.index(m) if m in previous else None, "member": m, "why": why}
                         for m, why in lost.items()],  # rank None: a joiner lost before it was in
                "joined": [{"member": m, "donor_rank": previous.index(plan.donors[m])} for m in plan.joined],
                "members": len(plan.members),
            }
            if self.store.check([Keys.record(plan.epoch)]):
                record |= json.loads(self.store.get(Keys.record(plan.epoch)))
            summary.append(record)
            previous, lost = plan.members, {}
        return summary


def _exit(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def run_supervised(cfg: TrainConfig, config_path: Path, run_dir: Path
                   ) -> tuple[list[dict[str, Any]], signal.Signals | None]:
    """Run the job's workers under live membership until they finish or stop; the membership changes, and the stop
    signal the launcher received (None: none). Raises :class:`Interrupted` on a second Ctrl-C."""
    supervisor = Supervisor(cfg, config_path, run_dir)
    return supervisor.run(), supervisor.stopping.received
