"""Live membership on a worker (``fault_tolerance=live``): the plans of the coordinator (launcher/coordinator.py),
carried out at step boundaries. The protocol in full, and why: ``docs/fault-tolerance.md``.

Every membership is an *epoch* with a plan the coordinator writes into its store (it lives in the launcher, which no
worker failure takes down). A worker heartbeats from a thread of its own and reads the newest epoch there. The
members change only at a record step: there they meet in a barrier in the store, and one verdict says whether they
change at that step (a newer plan is out) or go on; nobody passes such a step without every member, so all change
at the same step. The same barrier (a fence) comes before each collective that follows local work in the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger

from decent_train.engine import comm, reconfigure
from decent_train.engine.comm import ExchangeError
from decent_train.engine.sever import sever_connections_to

STORE_ENV = "DECENT_TRAIN_STORE"  # host:port of the coordinator's store
MEMBER_ENV = "DECENT_TRAIN_MEMBER_ID"  # this worker's stable id (never reused in a run)
HEARTBEAT_S = 0.1  # how often a worker beats and looks for a newer plan
FOREVER_S = 10 * 365 * 86400.0  # a wait that only its key ends
# The record step's collectives (docs/fault-tolerance.md, "Every wait has a bound"): RECORD_K x the median step time
# measured so far, at least RECORD_FLOOR_S, at most comm_timeout_s (also before STEP_SAMPLES steps are measured).
RECORD_K = 20
RECORD_FLOOR_S = 10.0
STEP_SAMPLES = 5
STEP_WINDOW = 101  # the steps the median is taken over (the latest)
# Tests: "member:step[:collective]": past that step's barrier, that member SIGSTOPs itself before the first collective
# whose description contains ``collective`` (default: the step's first, a gather) (engine/comm.py's stop_before).
PAUSE_ENV = "DECENT_TRAIN_TEST_STOP_AFTER_BARRIER"


class WaitTimeout(RuntimeError):
    """A wait of the live protocol passed its bound (named in the message): the worker exits, the coordinator
    declares it lost."""


def wait_for_key(store: dist.Store, key: str, deadline: float) -> bool:
    """Block in the store until ``key`` is set (True) or ``deadline`` (``time.monotonic()``) passes (False). One
    request, answered the moment the key is set: no polling. Every key waited on is set by whoever ends the wait (a
    verdict, a commit's outcome, the next plan), so a wait runs to its deadline only when something is wrong."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return store.check([key])
    try:
        store.wait([key], timedelta(seconds=remaining))
    except dist.DistStoreError:  # the deadline: the caller names the bound
        return store.check([key])
    return True


class Keys:
    """The store's keys a worker uses (the coordinator, launcher/coordinator.py, writes the plans; the workers the
    rest; the node agents' own keys: ``coordinator.NodeKeys``)."""

    EPOCH = "epoch"  # a counter: the newest plan's epoch (``add(EPOCH, 0)`` reads it without waiting)
    STUCK = "stuck"  # a counter bumped with every ``stuck/<member>`` report: the coordinator reads one key per poll

    @staticmethod
    def plan(epoch: int) -> str:
        return f"plan/{epoch}"

    @staticmethod
    def commit(epoch: int) -> str:
        return f"commit/{epoch}"  # a counter of the members done with the change

    @staticmethod
    def committed(epoch: int) -> str:
        # "all": set by the last member to commit; "superseded": by the coordinator when a newer plan came first
        return f"commit/{epoch}/outcome"

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
    def address(member: int) -> str:
        return f"address/{member}"  # the host address it reaches the coordinator from (its gloo address)

    @staticmethod
    def stuck(member: int) -> str:
        return f"stuck/{member}"  # set by a member that waited past a bound for it: the coordinator kills it

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
    nodes: list[int] = dataclasses.field(default_factory=list)  # the node of each member (parallel to ``members``)

    def members_per_node(self) -> list[int]:
        """How many members each node has, in rank order (the members of a node are consecutive); one node when the
        plan names none."""
        counts: dict[int, int] = {}
        for node in self.nodes or [0] * len(self.members):
            counts[node] = counts.get(node, 0) + 1
        return list(counts.values())

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


def address_towards(host: str, port: int) -> str:
    """This host's address on its route to ``host`` (a UDP connect sends nothing: it only picks the route). The node
    agent binds gloo to that route's interface (``GLOO_SOCKET_IFNAME``), so peers see this worker at this address."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


class LiveMembership:
    """This worker's side of the coordinator's plans. ``timeout``: the limit of a message (gloo takes it from the
    reconfiguration) and of a collective of the default group: every collective of a live run follows a barrier of
    the members, so one that a member died in stalls the others no longer than that."""

    def __init__(self, store: dist.Store, member_id: int, timeout: timedelta):
        self.store, self.id, self.timeout = store, member_id, timeout
        self.plan: Plan | None = None  # the epoch this worker is in
        self._fences = 0  # fences met in this epoch (every member meets them in the same order)
        self._newest = -1  # the newest epoch the heartbeat thread saw (both threads write it: under the lock)
        self._newest_lock = threading.Lock()
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)  # the latest steps' durations (s)
        self._step_at: float | None = None
        self._limit = timeout  # the default group's current per-collective limit
        self._passed: list[str] = []  # the barrier/fence keys passed since the last clean-up (all members' too)
        self._pause = _pause_request(member_id)
        host, port = os.environ[STORE_ENV].rsplit(":", 1)
        self._beat_store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)  # the thread's own
        self._store_address = (socket.gethostbyname(host), int(port))  # never severed (``_sever_lost_hosts``)
        self._beat_store.set(Keys.address(member_id), address_towards(*self._store_address))  # peers reach it there
        self._waiting: tuple[str, Plan] | None = None  # (verdict key, plan) of the barrier the main thread waits at
        self._plans: dict[int, Plan] = {}  # the heartbeat thread's cache of plans it read
        self._hosts: dict[int, dict[int, str]] = {}  # and of the hosts of a plan's members (``_hosts_of``)
        self._severed_for = -1  # the newest epoch whose lost hosts were severed
        # The epoch whose record step the main thread is inside (None: outside one, or reconfiguring): a plan that drops
        # members of it makes the heartbeat thread end that step's collectives (``_end_a_doomed_record_step``). Both
        # threads change it under the lock, which the heartbeat holds while it severs: a reconfiguration (it clears
        # it first) never loses the connections it builds.
        self._record_epoch: int | None = None
        self._record_lock = threading.Lock()
        self._recording = False  # the main thread is inside ``bounded`` (a record step's collectives)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="decent_train-heartbeat", daemon=True)
        self._thread.start()

    # -- the thread ---------------------------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        while not self._stopping.wait(HEARTBEAT_S):
            try:
                self._beat_store.add(Keys.beat(self.id), 1)
                newest = self._see_epoch(self._beat_store.add(Keys.EPOCH, 0) - 1)
                self._end_a_hopeless_wait(newest)
                self._sever_lost_hosts(newest)
                self._end_a_doomed_record_step(newest)
            except (RuntimeError, dist.DistError):  # the store went away: the launcher ended
                return

    def _plan_of(self, epoch: int) -> Plan:
        """``epoch``'s plan, read once by the heartbeat thread (its own store connection; the newest one kept)."""
        if epoch not in self._plans:
            self._plans = {epoch: Plan.loads(self._beat_store.get(Keys.plan(epoch)))}
        return self._plans[epoch]

    def _end_a_hopeless_wait(self, newest: int) -> None:
        """The main thread waits at a barrier for a member that a newer plan declared dead (it never comes): propose
        the change, which ends the wait of every member there (the verdict is the key they wait on)."""
        waiting = self._waiting
        if waiting is None or newest <= waiting[1].epoch:
            return
        if set(waiting[1].members) - set(self._plan_of(newest).members):
            self._beat_store.compare_set(waiting[0], "", "change")

    def _sever_lost_hosts(self, newest: int) -> None:
        """A newer plan declared every member on another host lost (a node died or was cut off): end this worker's
        connections to that host, so that an exchange waiting on it fails now, not at comm_timeout_s (a cut host
        sends no reset; ``engine/sever.py``). Once per epoch seen; never this worker's own host, nor one a member
        of the plan still lives on."""
        plan = self.plan
        if plan is None or newest <= max(plan.epoch, self._severed_for):
            return
        self._severed_for = newest
        lost = set(plan.members) - set(self._plan_of(newest).members)
        if not lost:
            return
        hosts = self._hosts_of(plan)
        dead = {hosts[m] for m in lost} - {hosts[m] for m in plan.members if m not in lost}
        if dead:
            severed = sever_connections_to(dead, frozenset({self._store_address}))
            logger.info(f"member {self.id}: {', '.join(sorted(dead))} lost with all its members; "
                        f"{severed} connection(s) to it closed")

    def _hosts_of(self, plan: Plan) -> dict[int, str]:
        """Each member's host address (``address/<member>``), read once per plan by the heartbeat thread."""
        if plan.epoch not in self._hosts:
            self._hosts = {plan.epoch: dict(zip(plan.members, (a.decode() for a in self._beat_store.multi_get(
                [Keys.address(m) for m in plan.members]))))}
        return self._hosts[plan.epoch]

    def _end_a_doomed_record_step(self, newest: int) -> None:
        """The main thread is inside a record step's collectives and a newer plan drops members of its epoch: end
        them now, by shutting down this worker's connections to every member's host (the store's excepted).

        Why: the members change at the next record step whatever happens (its barrier's verdict is a change), so
        the epoch's connections are of no more use. Without this, a member that was not talking to the lost ones
        waits out the record bound (at least RECORD_FLOOR_S) in a later collective for the members whose collective
        with them failed at once and who went on (a failed gloo collective is not passed on: nobody else learns of
        it). Severed, its collective fails as a dead peer's does, it skips the rest of the step's records, and its
        exchanges until the next record step fail at once and settle as missing; the change there builds fresh
        connections for the members that stay (measured: a reconfigure after a sever all-reduces over them)."""
        epoch, plan = self._record_epoch, self.plan
        if epoch is None or plan is None or plan.epoch != epoch or newest <= epoch:
            return
        if not set(plan.members) - set(self._plan_of(newest).members):
            return  # only joiners: nobody waits for a member that will not come
        hosts = set(self._hosts_of(plan).values())  # the store's answers before the lock: the main thread never
        with self._record_lock:  # waits on the store for it
            if self._record_epoch != epoch:
                return  # it left the step, or reconfigures, meanwhile
            self._record_epoch = None  # once
            severed = sever_connections_to(hosts, frozenset({self._store_address}))
        logger.info(f"member {self.id}: epoch {newest} drops members of epoch {epoch}, inside whose record step "
                    f"this worker is: {severed} connection(s) to its members' hosts closed (the change is at the next "
                    "record step)")

    def close(self, finished: bool) -> None:
        """Stop the heartbeat before the interpreter ends (a daemon thread inside a store call then would abort it);
        ``finished``: tell the coordinator first, so that the silence while the process exits is not a hang."""
        if finished:
            self.store.set(Keys.done(self.id), "")
        self._stopping.set()
        self._thread.join()

    def newer_plan(self) -> bool:
        return self.plan is None or self._newest > self.plan.epoch

    def _see_epoch(self, epoch: int) -> int:
        with self._newest_lock:  # never backwards (audit R3: a stale write from the other thread)
            self._newest = max(self._newest, epoch)
            return self._newest

    def _newest_epoch(self) -> int:
        return self._see_epoch(self.store.add(Keys.EPOCH, 0) - 1)

    def _plan_is_out(self, epoch: int, bound: float) -> bool:
        """Wait up to ``bound`` s for plan ``epoch``; once it is out it is the newest this member knows of (the
        coordinator bumps ``Keys.EPOCH`` only after it wrote the plan)."""
        if not wait_for_key(self.store, Keys.plan(epoch), time.monotonic() + bound):
            return False
        self._see_epoch(epoch)
        return True

    # -- bounds -------------------------------------------------------------------------------------------------
    def _store_bound(self) -> float:
        """The bound of a wait for the coordinator (a plan, the commits): the store's own timeout (pg_timeout_s)."""
        return self.store.timeout.total_seconds()

    def step_done(self) -> None:
        """A step ended (the loop calls it at every step boundary): its time goes into the median."""
        now = time.monotonic()
        if self._step_at is not None:
            self._steps.append(now - self._step_at)
        self._step_at = now

    def record_bound(self) -> float:
        """The limit of a record step's collective: RECORD_K x the median step so far, within [RECORD_FLOOR_S,
        comm_timeout_s]. The members meet in a barrier (or a fence) just before, so what a member may still be doing
        when its peers enter is a step's worth of local work at most (the consensus probe's forward passes)."""
        ceiling = self.timeout.total_seconds()
        if len(self._steps) < STEP_SAMPLES:
            return ceiling
        return min(ceiling, max(RECORD_FLOOR_S, RECORD_K * statistics.median(self._steps)))

    @contextlib.contextmanager
    def bounded(self, seconds: float | None = None) -> Iterator[None]:
        """Collectives started inside get ``seconds`` (the record bound by default) as gloo's limit; the previous
        limit again after. A collective a member died in then fails on every survivor within the bound (one with no
        connection to the dead member would otherwise wait for ``comm_timeout_s``), as an ``ExchangeError``; sooner
        once the coordinator's plan drops that member (``_end_a_doomed_record_step``: detect_s, not the bound)."""
        previous, bound = self._limit, self.record_bound() if seconds is None else seconds
        self._set_limit(timedelta(seconds=bound))
        with self._record_lock:
            self._record_epoch, self._recording = self.plan.epoch, True
        try:
            yield
        except ExchangeError as error:
            raise ExchangeError(f"{error} [record step's bound {bound:.1f} s: {RECORD_K} x the median step, within "
                                f"{RECORD_FLOOR_S:g} s and comm_timeout_s; ended at once when a plan drops a member]"
                                ) from error
        finally:
            with self._record_lock:
                self._record_epoch, self._recording = None, False
            self._set_limit(previous)

    def _set_limit(self, limit: timedelta) -> None:
        if limit != self._limit:
            dist.set_timeout(limit)
            self._limit = limit

    def _report_stuck(self, members: list[int], why: str) -> None:
        """Tell the coordinator: it kills these members and plans without them (as for a silent heartbeat)."""
        for member in members:
            logger.warning(f"member {member} stuck: {why}; reported to the coordinator")
            self.store.set(Keys.stuck(member), why)
        self.store.add(Keys.STUCK, 1)

    def _latest_plan(self) -> Plan:
        return Plan.loads(self.store.get(Keys.plan(self._newest_epoch())))

    def lost_since(self, epoch: int) -> dict[int, str]:
        """Who the plans after ``epoch`` (up to this worker's) declared dead, and why."""
        lost: dict[int, str] = {}
        for later in range(epoch + 1, self.plan.epoch + 1):
            lost |= Plan.loads(self.store.get(Keys.plan(later))).lost
        return lost

    # -- joining ------------------------------------------------------------------------------------------------
    def start(self, device_kind: str) -> torch.device:
        """Start the reconfigurable groups (no peer is contacted yet) and return the device to train on. On CUDA
        (``launch.device``; one GPU per local rank) the data goes over a second group on nccl2
        (``reconfigure.data_backend_for``), bound to the device set here first; the default group stays gloo."""
        device = torch.device("cpu")
        if device_kind == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
            torch.cuda.set_device(device)
        reconfigure.join(self.store, self.id, self.timeout, data_backend=reconfigure.data_backend_for(device))
        return device

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
        """Reconfigure into ``plan``; False if a newer plan came first, or once one is out after a failed change."""
        with self._record_lock:  # from here on the heartbeat thread severs none of the connections built
            self._record_epoch = None
        try:
            done = reconfigure.reconfigure(self.store, plan.epoch, plan.uuid, plan.members, self.id, self.timeout,
                                           abandon=lambda: self._newest_epoch() > plan.epoch)
            if done:  # the new group's limit: the full one (a change may run inside a record step's bound)
                self._limit = timedelta(0)
                self._set_limit(self.timeout)
                data = reconfigure.data_group()
                data_group = "" if data is None else f" and data group ({data.name()}, {data.size()} ranks)"
                logger.debug(f"member {self.id}: epoch {plan.epoch}: default group{data_group} reconfigured over "
                             f"{plan.members}")
            return done
        except (reconfigure.PartlyReconfigured, reconfigure.RendezvousFailed) as error:  # unchanged: a newer plan
            # reconfigures both groups again (a member died, costing reconfigure.RENDEZVOUS_S, or stalled: reported)
            if self._newest_epoch() <= plan.epoch:
                if isinstance(error, reconfigure.RendezvousFailed) and error.absent:
                    self._report_stuck(error.absent, f"not at epoch {plan.epoch}'s rendezvous within the bound")
                self.wait_for_newer_plan(after=plan.epoch)
            return False
        except (RuntimeError, dist.DistError):
            if self._newest_epoch() > plan.epoch:
                return False
            raise

    @property
    def joining(self) -> bool:
        """This worker joined a running job: it heals from a donor before it trains."""
        return self.plan is not None and self.id in self.plan.joined

    def _wait_for_plan(self, wanted: Callable[[Plan], bool]) -> Plan:
        """The newest plan once it is ``wanted``: blocks in the store for the plan after the newest."""
        bound = self._store_bound()
        deadline = time.monotonic() + bound
        while True:
            newest = self._newest_epoch()
            if newest >= 0:
                plan = Plan.loads(self.store.get(Keys.plan(newest)))
                if wanted(plan):
                    return plan
            if not self._plan_is_out(newest + 1, deadline - time.monotonic()):
                raise WaitTimeout(f"member {self.id}: no plan with it within {bound:g} s (pg_timeout_s)")

    def commit(self) -> None:
        """Done with the change: wait for every member to be (raises PlanSuperseded if a newer plan comes). The last
        to commit sets the outcome "all"; the coordinator sets "superseded" when it publishes a newer plan first (the
        first one set wins): the members block on that one key."""
        plan = self.plan
        outcome = Keys.committed(plan.epoch)
        if self.store.add(Keys.commit(plan.epoch), 1) >= len(plan.members):
            self.store.compare_set(outcome, "", "all")
        bound = self._store_bound()
        if not wait_for_key(self.store, outcome, time.monotonic() + bound):
            raise WaitTimeout(f"member {self.id}: {Keys.commit(plan.epoch)} not reached by every member within "
                              f"{bound:g} s (pg_timeout_s)")
        if self.store.get(outcome) != b"all":  # the coordinator sets it before it publishes the newer plan: wait for
            # that plan, or this member would start the change over with the superseded one (same uuid: gloo stalls)
            if not self._plan_is_out(plan.epoch + 1, bound):
                raise WaitTimeout(f"member {self.id}: epoch {plan.epoch} superseded, no plan after it within "
                                  f"{bound:g} s (pg_timeout_s)")
            raise PlanSuperseded

    # -- at step boundaries -------------------------------------------------------------------------------------
    def change_at(self, step: int, needs_all: bool) -> bool:
        """Whether the members change after ``step``. Only a step whose records, evaluation or checkpoint are
        collectives over every member (``needs_all``) may change them: there the members meet in a barrier in the
        store, and one verdict, the first proposed, says whether they change at this step. The last member to
        arrive proposes a change if a newer plan is out; a member waiting for one the newer plan declared dead
        proposes it too (the dead one never arrives, and nobody passes the step without it)."""
        if not needs_all:
            return False
        change = self._verdict(Keys.barrier(self.plan.epoch, step))
        if self._pause[0] == step:  # tests only: stopped inside the record step, past its barrier
            comm.stop_before(self._pause[1])
        return change

    def fence(self) -> None:
        """Before a collective that follows local work of a record step (evaluating, writing a checkpoint file): the
        members meet in a barrier as at the step's start; MembersChanged if its verdict is a change (a member died
        during that work: nobody runs the collective with it)."""
        self._fences += 1
        if self._verdict(Keys.fence(self.plan.epoch, self._fences), at_fence=True):
            raise MembersChanged

    def _verdict(self, key: str, at_fence: bool = False) -> bool:
        """A barrier of the members at ``key``, and whether its verdict is a change. A member that has not come
        within ``comm_timeout_s`` (alive: it beats, but stuck) is reported to the coordinator, whose plan without
        it ends the wait. The last member to arrive deletes the keys of the barriers before (all have passed them).
        ``at_fence``: only a plan that drops a member changes the members there; one that only adds joiners waits
        for the next record step's barrier, where the joiners start with the others (a joiner starts a step's
        records from their beginning, never inside its evaluation; the coordinator never drops a member and adds a
        joiner in one plan)."""
        plan = self.plan
        verdict = f"{key}/verdict"
        self.store.set(f"{key}/{self.id}", "")  # who came: those waiting can name who did not
        if self.store.add(key, 1) == len(plan.members):
            newest = self._newest_epoch()
            drops = newest > plan.epoch and bool(set(plan.members) - set(self._latest_plan().members))
            self._propose(verdict, drops if at_fence else newest > plan.epoch)
            self._clean_up()
        bound = self.timeout.total_seconds()
        self._waiting = (verdict, plan)  # the heartbeat thread proposes a change if a newer plan drops a member
        try:
            if self.newer_plan() and set(plan.members) - set(self._latest_plan().members):
                self._propose(verdict, True)  # the plan came before the heartbeat thread knew of this wait
            if not wait_for_key(self.store, verdict, time.monotonic() + bound):
                missing = [m for m in plan.members if not self.store.check([f"{key}/{m}"])]
                self._report_stuck(missing, f"not at {key} within {bound:g} s (comm_timeout_s)")
                # the coordinator's plan without them ends the wait (through the heartbeat thread's proposal)
                wait_for_key(self.store, verdict, time.monotonic() + FOREVER_S)
        finally:
            self._waiting = None
        self._passed += [key, verdict, *(f"{key}/{m}" for m in plan.members)]
        return self.store.get(verdict) == b"change"

    def _clean_up(self) -> None:
        """Delete the keys of the barriers this member passed before the one every member has now reached."""
        current, self._passed = self._passed, []
        for key in current:
            self.store.delete_key(key)

    def _propose(self, verdict: str, change: bool) -> None:
        self.store.compare_set(verdict, "", "change" if change else "go on")

    def reconfigure(self) -> Plan:
        """At the change's step: the default group becomes the newest plan's members (PlanSuperseded if a newer
        plan comes first)."""
        plan = self._latest_plan()
        if not self._reconfigure(plan):
            raise PlanSuperseded
        self.plan, self._fences = plan, 0
        with self._record_lock:  # a change inside a record step (at a fence): its collectives over the new members
            if self._recording:
                self._record_epoch = plan.epoch
        return plan

    def wait_for_newer_plan(self, peer: int | None = None, after: int | None = None) -> None:
        """A peer failed during the change: wait for the coordinator's plan without it (one after epoch ``after``,
        by default this worker's). The peer (member id) may be alive (a transient error, or it stalled past the
        limit): after ``comm_timeout_s`` it is reported to the coordinator; after as long again this worker gives up
        (WaitTimeout: it exits, and is declared lost)."""
        bound = self.timeout.total_seconds()
        newer = (self.plan.epoch if after is None else after) + 1
        if self._plan_is_out(newer, bound):
            return
        if peer is not None:
            self._report_stuck([peer], f"its exchange with member {self.id} failed, no plan {bound:g} s after")
            if self._plan_is_out(newer, bound):
                return
        raise WaitTimeout(f"member {self.id}: no newer plan within {bound:g} s (comm_timeout_s) after a failed "
                          "exchange with a peer")


def rank_of(plan: Plan, member: int) -> int:
    return plan.members.index(member)


def _pause_request(member: int) -> tuple[int, str]:
    """The step at which tests want this member stopped inside a record step, and before which collective (by
    default the step's first, the gather of ``Recorder.check_finite``) (``PAUSE_ENV``); step -1: none."""
    wanted, _, rest = os.environ.get(PAUSE_ENV, "").partition(":")
    step, _, collective = rest.partition(":")
    return (int(step), collective or "gather") if wanted and int(wanted) == member else (-1, "")
