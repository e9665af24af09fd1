"""``fault_tolerance=live``: the coordinator, the one writer of plans, and the store every worker reconfigures through.

It runs where no worker does (no worker's death takes the store down, rank 0's included): in the ``decent-train``
process of a one-node run, or alone on a host that does not train (``fault_tolerance.role=coordinator``). It knows
*nodes*: one node agent per node (``node_agent.py``) registers, starts and watches that node's workers, and reports
to it through the store; the coordinator reads O(nodes) keys per look (each agent's heartbeat counter and event
counter, in one request) plus one counter of ``stuck/<member>`` reports, and decides:

- a node whose agent is silent for ``fault_tolerance.detect_s`` is lost: all its members leave in one plan (its
  agent, if alive but cut off, stops them itself: ``node_agent.py``);
- a worker that exits with an error or hangs (its agent saw it and killed it) is lost; a replacement is asked of its
  agent while ``launch.max_restarts`` allows;
- a node that registers later (a spare, or one that came back) joins as one group once every one of its workers
  said hello, each healing from an established member (the donors spread over them);
- fewer than ``fault_tolerance.min_workers`` members: a last plan stops the run (the workers save a checkpoint).

Members are planned in node order, then by id, so a node's ranks are consecutive (the topology keeps its structure).
The worker's side of the protocol: ``training/live.py``; the design: ``docs/fault-tolerance.md``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from loguru import logger

from decent_train.config import TrainConfig
from decent_train.launcher.launch import Interrupted, StopForwarding, WorkerFailure
from decent_train.training.live import Keys, Plan

POLL_S = 0.02  # between two looks at the nodes
WORKERS_FILE = "workers.json"  # member id -> pid of every worker process started (for chaos tests)


class NodeKeys:
    """The store's keys between the coordinator and the node agents (the workers' own: ``live.Keys``)."""

    NODE_IDS = "nodes/ids"  # a counter: node ids handed out (``add(NODE_IDS, 1) - 1`` is a new node's)
    MEMBER_IDS = "nodes/member_ids"  # a counter: member ids handed out, so that ids never collide across nodes
    CONFIG = "nodes/config"  # the job's resolved config (YAML): every node's workers run the coordinator's
    RUN_ID = "nodes/run_id"  # launch.rdzv_id: an agent of another job is refused

    @staticmethod
    def info(node: int) -> str:
        return f"node/{node}/info"  # JSON {host, pid, workers}: set last at registration, so it is complete

    @staticmethod
    def beat(node: int) -> str:
        return f"node/{node}/beat"  # a counter: the agent's heartbeat

    @staticmethod
    def events(node: int) -> str:
        return f"node/{node}/events"  # a counter of the agent's reports ...

    @staticmethod
    def event(node: int, index: int) -> str:
        return f"node/{node}/event/{index}"  # ... each a JSON {kind: started|hello|done|lost|ended, member, ...}

    @staticmethod
    def orders(node: int) -> str:
        return f"node/{node}/orders"  # a counter of the coordinator's orders to the agent ...

    @staticmethod
    def order(node: int, index: int) -> str:
        return f"node/{node}/order/{index}"  # ... each a JSON {kind: start|kill|stop|fence|end, ...}


@dataclass
class _Node:
    id: int
    host: str
    workers: int  # started at registration
    beats: int = 0
    last_beat: float = field(default_factory=time.monotonic)
    events: int = 0  # events read
    orders: int = 0  # orders written
    lost: str | None = None
    ended: bool = False
    in_process: bool = False  # its agent runs in this process (one command): it cannot be cut off from the store


@dataclass
class _Member:
    id: int
    node: int
    pid: int
    hello: bool = False
    lost: str | None = None
    before_hello: bool = False  # lost before it said hello


@dataclass
class _Change:
    plan: Plan
    committed: bool = False  # every member of the plan is done with the change


class Coordinator:
    """Hosts the store on ``port`` (0: a free one) and decides who is in the run; :meth:`run` returns the membership
    changes (``result.json``'s ``membership_changes``)."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, config_text: str, port: int = 0,
                 stopping: StopForwarding | None = None) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.ft, self.launch = cfg.fault_tolerance, cfg.launch
        self.store = dist.TCPStore("0.0.0.0" if port else "127.0.0.1", port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=cfg.pg_timeout_s))
        self.store.set(NodeKeys.CONFIG, config_text)
        self.store.set(NodeKeys.RUN_ID, self.launch.rdzv_id)
        self.stopping = stopping or StopForwarding()
        self.restarts_left = self.launch.max_restarts
        self.nodes: dict[int, _Node] = {}
        self.members: dict[int, _Member] = {}
        self.changes: list[_Change] = []
        self.finished: set[int] = set()
        self.lost_at_end: set[int] = set()  # members lost once another had finished training
        self._stuck_reports = 0
        self._stop_sent = False

    @property
    def port(self) -> int:
        return int(self.store.port)

    def address(self) -> str:
        return f"{socket.getfqdn()}:{self.port}"

    # -- what the agents report --------------------------------------------------------------------------------------
    def _order(self, node: _Node, **order: Any) -> None:
        self.store.set(NodeKeys.order(node.id, node.orders), json.dumps(order))
        node.orders += 1
        self.store.add(NodeKeys.orders(node.id), 1)

    def _discover(self) -> None:
        """Nodes that registered since the last look (their info is set last)."""
        for node_id in range(self.store.add(NodeKeys.NODE_IDS, 0)):
            if node_id in self.nodes or not self.store.check([NodeKeys.info(node_id)]):
                continue
            info = json.loads(self.store.get(NodeKeys.info(node_id)))
            in_process = info["pid"] == os.getpid() and info["host"] == socket.gethostname()
            self.nodes[node_id] = _Node(node_id, info["host"], info["workers"], in_process=in_process)
            logger.info(f"node {node_id} ({info['host']}) registered with {info['workers']} workers")

    def _look(self) -> dict[int, str]:
        """One look at the nodes: the members lost since the last (id -> why). A silent node loses all of its."""
        self._discover()
        watched = [n for n in self.nodes.values() if n.lost is None and not n.ended]
        lost: dict[int, str] = {}
        values = self.store.multi_get([k for n in watched for k in (NodeKeys.beat(n.id), NodeKeys.events(n.id))])
        now = time.monotonic()
        for node, beats, events in zip(watched, values[::2], values[1::2]):
            self._read_events(node, int(events), lost)
            if int(beats) != node.beats:
                node.beats, node.last_beat = int(beats), now
            elif now - node.last_beat > self.ft.detect_s and not node.in_process:
                node.lost = f"node {node.id} ({node.host}) silent for {self.ft.detect_s:g} s"
                logger.warning(f"{node.lost}: its members leave together")
                self._order(node, kind="fence", why=node.lost)  # if it is alive and hears this: stop its workers
                for member in self.members.values():
                    if member.node == node.id and member.lost is None and member.id not in self.finished:
                        member.lost = lost[member.id] = node.lost
        stuck = self.store.add(Keys.STUCK, 0)
        if stuck != self._stuck_reports:  # a member waited past a bound for another: its agent kills it
            self._stuck_reports = stuck
            for member in self.members.values():
                if member.lost is None and self.store.check([Keys.stuck(member.id)]):
                    why = f"stuck: {self.store.get(Keys.stuck(member.id)).decode()}"
                    self.store.delete_key(Keys.stuck(member.id))
                    self._order(self.nodes[member.node], kind="kill", member=member.id, why=why)
        return lost

    def _read_events(self, node: _Node, count: int, lost: dict[int, str]) -> None:
        for index in range(node.events, count):
            event = json.loads(self.store.get(NodeKeys.event(node.id, index)))
            kind, member_id = event["kind"], event.get("member")
            if kind == "started":
                self.members[member_id] = _Member(member_id, node.id, event["pid"])
                self._write_workers()
            elif kind == "ended":
                node.ended = True
            elif member_id in self.members:
                member = self.members[member_id]
                if kind == "hello":
                    member.hello = True
                elif kind == "done":
                    self.finished.add(member_id)
                elif kind == "lost" and member.lost is None and member_id not in self.finished:
                    member.lost = lost[member_id] = event["why"]
                    member.before_hello = not member.hello
        node.events = count

    def _write_workers(self) -> None:
        """``RUN_DIR/workers.json``: who to kill, for chaos tests (never read half-written)."""
        partial = self.run_dir / f"{WORKERS_FILE}.partial"
        partial.write_text(json.dumps({m.id: m.pid for m in self.members.values()}) + "\n")
        os.replace(partial, self.run_dir / WORKERS_FILE)

    # -- plans -------------------------------------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        return self.changes[-1].plan

    def _publish(self, members: list[int], **kwargs: Any) -> Plan:
        """Write the next plan. A change not committed yet is superseded (its members wait on that outcome). The
        outcome's first writer wins: the last member to commit may set "all" after the count here, and then the
        change is committed for the coordinator too."""
        for change in self.changes:
            if not change.committed:
                outcome = Keys.committed(change.plan.epoch)
                change.committed = (self.store.add(Keys.commit(change.plan.epoch), 0) >= len(change.plan.members)
                                    or self.store.compare_set(outcome, "", "superseded") == b"all")
        epoch = len(self.changes)
        nodes = [self.members[m].node for m in members]
        plan = Plan(epoch, members, uuid.uuid4().int >> 65, detected_at=time.time(), nodes=nodes, **kwargs)
        self.store.set(Keys.plan(epoch), plan.dumps())
        self.store.add(Keys.EPOCH, 1)  # now epoch + 1: the workers read epoch = value - 1
        self.changes.append(_Change(plan))
        return plan

    def _ordered(self, members: list[int], established: list[int]) -> list[int]:
        """``members`` in rank order: by node, then established members before joiners, then by id. Nodes with an
        established member come first, so rank 0 is always one that holds the run's state; nodes in the order of
        their first member id (an agent takes its founders' ids as one block), so that member k starts as rank k."""
        def key(m: int) -> tuple[bool, int, bool, int]:
            node = self.members[m].node
            node_has_established = any(self.members[e].node == node for e in established)
            first = min(x.id for x in self.members.values() if x.node == node)
            return (not node_has_established, first, m not in established, m)

        return sorted(members, key=key)

    def _established(self) -> list[int]:
        """The members of the newest committed plan (the ones that can heal a joiner)."""
        return next((c.plan.members for c in reversed(self.changes) if c.committed), self.changes[0].plan.members)

    def _plan(self, members: list[int], joiners: list[int], lost: dict[int, str] | None = None) -> None:
        """A plan with ``members`` and ``joiners`` (new, or of a plan not committed yet); the joiners' donors are
        established members, spread over them from the last rank back (one joiner: the last, as a one-node run
        always did)."""
        committed = self._established()
        established = [m for m in members if m in committed]
        joiners = list(dict.fromkeys(j for j in members + joiners if j not in established))
        ordered = self._ordered(established + joiners, established)
        donors_in_order = [m for m in ordered if m in established][::-1]
        joining = [m for m in ordered if m in joiners]
        donors = {j: donors_in_order[i % len(donors_in_order)] for i, j in enumerate(joining)}
        self._publish(ordered, lost=lost or {}, joined=joining, donors=donors)
        if joining:
            logger.info(f"epoch {len(self.changes) - 1}: {len(joining)} worker(s) joining, healing from member(s) "
                        f"{', '.join(str(d) for d in sorted(set(donors.values())))}")

    def _plan_without(self, plan: Plan, lost: dict[int, str]) -> None:
        for member, why in lost.items():
            logger.warning(f"member {member} lost ({why})")
        members = [m for m in plan.members if m not in lost and m not in self.finished]
        established = [m for m in members if m in self._established()]
        if not established:
            raise WorkerFailure("every worker was lost: " + "; ".join(f"member {m}: {w}" for m, w in lost.items()))
        if len(established) < self.ft.min_workers:  # a last plan: the workers save a checkpoint and end
            self._publish(self._ordered(established, established), lost=lost, stop=True)
            return
        # Joiners of a plan not committed yet are left out (they wait, and join by a later plan): a plan that drops a
        # member may be carried out at a fence, inside a step's evaluation, where a joiner cannot start.
        self._publish(self._ordered(established, established), lost=lost)
        for member in lost:
            node = self.nodes[self.members[member].node]
            if node.lost is None and self.restarts_left > 0 and self.stopping.received is None:
                self.restarts_left -= 1  # the agent starts it and reports its id
                self._order(node, kind="start", replaces=member)
                logger.info(f"member {member} to be replaced on node {node.id} (restarts left: {self.restarts_left})")

    def _joiners(self, plan: Plan) -> list[int]:
        """Workers ready to join: every live worker of their node that is not a member said hello (a node joins as
        one group), and the plan has room for their node (at most ``launch.nnodes``' MAX nodes)."""
        planned_nodes = {self.members[m].node for m in plan.members}
        ready: list[int] = []
        for node in self.nodes.values():
            if node.lost is not None or node.ended:
                continue
            waiting = [m for m in self.members.values() if m.node == node.id and m.lost is None
                       and m.id not in plan.members and m.id not in self.finished]
            started = sum(1 for m in self.members.values() if m.node == node.id)
            if not waiting or started < node.workers or not all(m.hello for m in waiting):
                continue
            if node.id not in planned_nodes and len(planned_nodes) >= self.launch.max_nodes:
                continue  # a hot spare: it joins when a node has left
            planned_nodes.add(node.id)
            ready += [m.id for m in waiting]
        return ready

    # -- the run -----------------------------------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        """Plan the run to its end; the membership changes. Raises :class:`WorkerFailure` if it cannot go on."""
        try:
            self._wait_for_founders()
            while not self._step():
                time.sleep(POLL_S)
            self._end(kill=False)
        except BaseException:
            self._end(kill=True)
            raise
        return self._summary()

    def _wait_for_founders(self) -> None:
        """The first plan: ``launch.nnodes`` (MIN) nodes registered, each with every worker's hello. A worker lost
        before it (its agent reports why: an exit, or no hello within its bound) stops the launch with one line: no
        plan exists yet to go on without it. Nodes must register within ``pg_timeout_s``; a stop signal ends the wait."""
        start, needed = time.monotonic(), self.launch.min_nodes
        while True:
            if self.stopping.received is not None:  # no worker trains yet: nothing to stop at a step
                raise Interrupted(self.stopping.received)
            lost = self._look()
            for member_id, why in lost.items():
                if why.startswith("no hello"):
                    raise WorkerFailure(f"worker {member_id} hung before training started: {why}; stopped")
                raise WorkerFailure(f"worker {member_id} failed before training started ({why})")
            ready = [n for n in self.nodes.values() if n.lost is None and self._node_ready(n)]
            if len(ready) >= needed:
                break
            if time.monotonic() - start > self.cfg.pg_timeout_s:
                raise WorkerFailure(
                    f"{len(self.nodes)} of launch.nnodes={needed} node agents registered within pg_timeout_s="
                    f"{self.cfg.pg_timeout_s:g} s (start one per node: fault_tolerance.role=agent "
                    f"launch.rdzv_endpoint={self.address()})")
            time.sleep(POLL_S)
        founders = [m.id for n in ready[:self.launch.max_nodes] for m in self.members.values() if m.node == n.id]
        self._publish(self._ordered(founders, founders))
        self.changes[0].committed = True  # nobody heals at the first plan
        logger.info(f"live membership: {len(founders)} workers on {len(ready[:self.launch.max_nodes])} node(s), "
                    f"store {self.address()}")

    def _node_ready(self, node: _Node) -> bool:
        workers = [m for m in self.members.values() if m.node == node.id]
        return len(workers) == node.workers and all(m.hello for m in workers)

    def _step(self) -> bool:
        """One look; True when the run is over."""
        plan = self.plan
        if plan.stop and self.store.add(Keys.commit(plan.epoch), 0) >= len(plan.members):
            raise WorkerFailure(
                f"fault_tolerance.min_workers={self.ft.min_workers}: {len(plan.members)} worker(s) left; the run "
                "stopped with a checkpoint (resume=RUN_DIR continues it)"
            )
        self._pass_on_a_stop()
        lost = {m: why for m, why in self._look().items() if m in plan.members}  # a joiner not in yet: dropped
        if lost and self.finished:  # training is over (a member finished): nothing to plan for
            if set(lost) - self.lost_at_end:
                logger.warning(f"lost after the end of training: {lost}")
            self.lost_at_end |= set(lost)
        if self.finished:  # over once every member that trained is done; joiners of a plan not committed never
            trained = set(self._established())  # will (their agents stop them at the end)
            return all(m in self.finished or m in self.lost_at_end for m in plan.members if m in trained)
        if lost:
            self._plan_without(plan, lost)
            return False
        change = self.changes[-1]
        if not change.committed and self.store.add(Keys.commit(plan.epoch), 0) >= len(plan.members):
            change.committed = True
        joiners = self._joiners(plan)
        if joiners and change.committed and self.stopping.received is None:
            self._plan(plan.members, joiners)
        return False

    def _pass_on_a_stop(self) -> None:
        """A stop signal this process received goes to every node's agent, which passes it to its workers (on one
        node the launcher's handler has already: the agent does not send it twice)."""
        if self.stopping.received is not None and not self._stop_sent:
            self._stop_sent = True
            for node in self.nodes.values():
                if node.lost is None:
                    self._order(node, kind="stop", signal=self.stopping.received.name)

    def _end(self, kill: bool) -> None:
        """Tell every agent the run is over (``kill``: stop its workers now; else they exit on their own, within a
        bound), and wait a little for them to say they ended (an agent that does not is cut off anyway)."""
        nodes = [n for n in self.nodes.values() if n.lost is None and not n.ended]
        try:
            for node in nodes:
                self._order(node, kind="end", kill=kill)
            deadline = time.monotonic() + (5.0 if kill else self.cfg.comm_timeout_s + 2 * self.ft.detect_s)
            while any(not n.ended and n.lost is None for n in nodes) and time.monotonic() < deadline:
                self._look()
                time.sleep(POLL_S)
        except (RuntimeError, dist.DistError) as error:  # the store itself failed: nothing more to tell
            logger.warning(f"could not tell the node agents the run ended: {error}")

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
                "joined": [{"member": m, "node": self.members[m].node, "donor": plan.donors[m],
                            "donor_rank": previous.index(plan.donors[m])} for m in plan.joined],
                "members": len(plan.members),
                "nodes": len(set(plan.nodes)),
            }
            if self.store.check([Keys.record(plan.epoch)]):
                record |= json.loads(self.store.get(Keys.record(plan.epoch)))
            summary.append(record)
            previous, lost = plan.members, {}
        return summary


def exit_reason(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
