"""Live membership on a worker (``fault_tolerance=live``): the plans of the supervisor's coordinator, carried out at
step boundaries. The protocol in full, and why: ``decent_train/FAULT_TOLERANCE.md``.

Every membership is an *epoch* with a plan the coordinator writes into its store (it lives in the launcher, which no
worker failure takes down). A worker heartbeats from a thread of its own and reads the newest epoch there. The
members change only at a record step: there they meet in a barrier in the store, and one verdict says whether they
change at that step (a newer plan is out) or go on; nobody passes such a step without every member, so all change
at the same step. The same barrier (a fence) comes before each collective that follows local work in the step.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger

from decent_train.engine import reconfigure

STORE_ENV = "DECENT_TRAIN_STORE"  # host:port of the coordinator's store
MEMBER_ENV = "DECENT_TRAIN_MEMBER_ID"  # this worker's stable id (never reused in a run)
HEARTBEAT_S = 0.1  # how often a worker beats and looks for a newer plan
POLL_S = 0.002


class Keys:
    """The store's keys (the coordinator, launcher/supervisor.py, writes the plans; the workers the rest)."""

    EPOCH = "epoch"  # a counter: the newest plan's epoch (``add(EPOCH, 0)`` reads it without waiting)

    @staticmethod
    def plan(epoch: int) -> str:
        return f"plan/{epoch}"

    @staticmethod
    def commit(epoch: int) -> str:
        return f"commit/{epoch}"  # a counter of the members done with the change

    @staticmethod
    def beat(member: int) -> str:
        return f"beat/{member}"  # a counter: a heartbeat

    @staticmethod
    def hello(member: int) -> str:
        return f"hello/{member}"

    @staticmethod
    def done(member: int) -> str:
        return f"done/{member}"  # trained to the end: its heartbeat may stop while the process exits

    @staticmethod
    def barrier(epoch: int, step: int) -> str:
        return f"barrier/{epoch}/{step}"

    @staticmethod
    def fence(epoch: int, count: int) -> str:
        return f"fence/{epoch}/{count}"

    @staticmethod
    def heal(epoch: int) -> str:
        return f"heal/{epoch}"  # what healing the epoch's joiners cost (the donor's measurement)

    @staticmethod
    def record(epoch: int) -> str:
        return f"record/{epoch}"  # what the change cost, for the coordinator's summary


@dataclasses.dataclass
class Plan:
    """One epoch's membership, as the coordinator decided it."""

    epoch: int
    members: list[int]  # stable ids, in rank order
    uuid: int  # fresh for every epoch (reconfigure refuses a reused one)
    lost: dict[int, str] = dataclasses.field(default_factory=dict)  # id -> why it was declared dead
    joined: list[int] = dataclasses.field(default_factory=list)
    donors: dict[int, int] = dataclasses.field(default_factory=dict)  # joiner id -> the member it heals from
    stop: bool = False  # fewer than fault_tolerance.min_workers left: save a checkpoint at the change and end
    detected_at: float = 0.0  # wall time the coordinator learnt of the change

    def dumps(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def loads(cls, text: bytes | str) -> Plan:
        raw = json.loads(text)
        raw["lost"] = {int(k): v for k, v in raw["lost"].items()}
        raw["donors"] = {int(k): v for k, v in raw["donors"].items()}
        return cls(**raw)


class MembersChanged(Exception):
    """A fence's verdict: the members change at this step (one died during the step's evaluation or checkpoint)."""


class PlanSuperseded(Exception):
    """A newer plan came while this one was carried out: start over with it, at the same step."""


def connect(timeout: timedelta) -> tuple[dist.Store, int]:
    """The coordinator's store (``DECENT_TRAIN_STORE``) and this worker's id."""
    host, port = os.environ[STORE_ENV].rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    return store, int(os.environ[MEMBER_ENV])


class LiveMembership:
    """This worker's side of the coordinator's plans. ``timeout``: the limit of a message (gloo takes it from the
    reconfiguration) and of a collective of the default group: every collective of a live run follows a barrier of
    the members, so one that a member died in stalls the others no longer than that."""

    def __init__(self, store: dist.Store, member_id: int, timeout: timedelta):
        self.store, self.id, self.timeout = store, member_id, timeout
        self.plan: Plan | None = None  # the epoch this worker is in
        self._fences = 0  # fences met in this epoch (every member meets them in the same order)
        self._newest = -1  # the newest epoch the heartbeat thread saw
        host, port = os.environ[STORE_ENV].rsplit(":", 1)
        self._beat_store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)  # the thread's own
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="decent_train-heartbeat", daemon=True)
        self._thread.start()

    # -- the thread ---------------------------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        while not self._stopping.wait(HEARTBEAT_S):
            try:
                self._beat_store.add(Keys.beat(self.id), 1)
                self._newest = self._beat_store.add(Keys.EPOCH, 0) - 1
            except (RuntimeError, dist.DistError):  # the store went away: the launcher ended
                return

    def close(self, finished: bool) -> None:
        """Stop the heartbeat before the interpreter ends (a daemon thread inside a store call then would abort it);
        ``finished``: tell the coordinator first, so that the silence while the process exits is not a hang."""
        if finished:
            self.store.set(Keys.done(self.id), "")
        self._stopping.set()
        self._thread.join()

    def newer_plan(self) -> bool:
        return self.plan is None or self._newest > self.plan.epoch

    def _newest_epoch(self) -> int:
        self._newest = max(self._newest, self.store.add(Keys.EPOCH, 0) - 1)
        return self._newest

    def _latest_plan(self) -> Plan:
        return Plan.loads(self.store.get(Keys.plan(self._newest_epoch())))

    def lost_since(self, epoch: int) -> dict[int, str]:
        """Who the plans after ``epoch`` (up to this worker's) declared dead, and why."""
        lost: dict[int, str] = {}
        for later in range(epoch + 1, self.plan.epoch + 1):
            lost |= Plan.loads(self.store.get(Keys.plan(later))).lost
        return lost

    # -- joining ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the reconfigurable group (no peer is contacted yet)."""
        reconfigure.join(self.store, self.id, self.timeout)

    def join(self) -> Plan:
        """Announce this worker (ready: its model is built) and :meth:`enter` the first plan that has it."""
        self.store.set(Keys.hello(self.id), str(time.time()))
        return self.enter()

    def enter(self) -> Plan:
        """Wait for the newest plan to have this worker and reconfigure into it (not committed: a joiner commits
        once healed, a founder at once)."""
        while True:
            plan = self._wait_for_plan(lambda p: self.id in p.members)
            if self._reconfigure(plan):
                self.plan, self._fences = plan, 0
                logger.debug(f"member {self.id}: rank {dist.get_rank()} of {len(plan.members)} at epoch {plan.epoch}")
                return plan

    def _reconfigure(self, plan: Plan) -> bool:
        """Reconfigure into ``plan``; False if a newer plan came first, or if it failed (a member in it died after
        publishing its handle: gloo gives up after ``timeout``) and a newer plan is out."""
        try:
            return reconfigure.reconfigure(self.store, plan.epoch, plan.uuid, plan.members, self.id, self.timeout,
                                           abandon=lambda: self._newest_epoch() > plan.epoch)
        except (RuntimeError, dist.DistError):
            if self._newest_epoch() > plan.epoch:
                return False
            raise

    @property
    def joining(self) -> bool:
        """This worker joined a running job: it heals from a donor before it trains."""
        return self.plan is not None and self.id in self.plan.joined

    def _wait_for_plan(self, wanted: Callable[[Plan], bool]) -> Plan:
        while True:
            if self.store.add(Keys.EPOCH, 0) > 0:
                plan = self._latest_plan()
                if wanted(plan):
                    return plan
            time.sleep(POLL_S * 10)

    def commit(self) -> None:
        """Done with the change: wait for every member to be (raises PlanSuperseded if a newer plan comes)."""
        plan = self.plan
        self.store.add(Keys.commit(plan.epoch), 1)
        self._wait_count(Keys.commit(plan.epoch), len(plan.members))

    def _wait_count(self, key: str, count: int) -> None:
        while self.store.add(key, 0) < count:
            if self.newer_plan():
                raise PlanSuperseded
            time.sleep(POLL_S)

    # -- at step boundaries -------------------------------------------------------------------------------------
    def change_at(self, step: int, needs_all: bool) -> bool:
        """Whether the members change after ``step``. Only a step whose records, evaluation or checkpoint are
        collectives over every member (``needs_all``) may change them: there the members meet in a barrier in the
        store, and one verdict, the first proposed, says whether they change at this step. The last member to
        arrive proposes a change if a newer plan is out; a member waiting for one the newer plan declared dead
        proposes it too (the dead one never arrives, and nobody passes the step without it)."""
        if not needs_all:
            return False
        return self._verdict(Keys.barrier(self.plan.epoch, step))

    def fence(self) -> None:
        """Before a collective that follows local work of a record step (evaluating, writing a checkpoint file): the
        members meet in a barrier as at the step's start; MembersChanged if its verdict is a change (a member died
        during that work: nobody runs the collective with it)."""
        self._fences += 1
        if self._verdict(Keys.fence(self.plan.epoch, self._fences)):
            raise MembersChanged

    def _verdict(self, key: str) -> bool:
        """A barrier of the members at ``key``, and whether its verdict is a change."""
        plan = self.plan
        verdict = f"{key}/verdict"
        if self.store.add(key, 1) == len(plan.members):
            self._propose(verdict, self._latest_plan().epoch > plan.epoch)
        while not self.store.check([verdict]):
            if self.newer_plan() and set(plan.members) - set(self._latest_plan().members):
                self._propose(verdict, True)
            time.sleep(POLL_S)
        return self.store.get(verdict) == b"change"

    def _propose(self, verdict: str, change: bool) -> None:
        self.store.compare_set(verdict, "", "change" if change else "go on")

    def reconfigure(self) -> Plan:
        """At the change's step: the default group becomes the newest plan's members (PlanSuperseded if a newer
        plan comes first)."""
        plan = self._latest_plan()
        if not self._reconfigure(plan):
            raise PlanSuperseded
        self.plan, self._fences = plan, 0
        return plan

    def wait_for_newer_plan(self) -> None:
        """A peer failed during the change: wait for the coordinator's plan without it."""
        while self._newest_epoch() <= self.plan.epoch:
            time.sleep(POLL_S)


def send_state(state: dict[str, Any], rank: int) -> int:
    """``state`` to ``rank`` over the default group (its size first); the bytes sent."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64), rank)
    dist.send(payload, rank)
    return payload.numel()


def receive_state(rank: int) -> tuple[dict[str, Any], int]:
    """What :func:`send_state` sent from ``rank``, and its size in bytes."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, rank)
    payload = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(payload, rank)
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False), int(size)


def rank_of(plan: Plan, member: int) -> int:
    return plan.members.index(member)
