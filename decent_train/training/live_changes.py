"""What a change of members does to a worker's training (``fault_tolerance=live``): the loop asks at each step
whether the members change there; a change reconfigures, heals the joiners, and rebuilds the gossip, the data
shards and rank 0's logging over the new members. The protocol with the coordinator is ``live.py``'s."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from loguru import logger

from decent_train.components.metrics import MetricLogger, log_to_console
from decent_train.config import METRICS_FILE
from decent_train.training.checkpointer import Checkpointer
from decent_train.training.job import Job
from decent_train.training.heal_state import receive_state, send_state
from decent_train.training.live import Keys, LiveMembership, MembersChanged, Plan, PlanSuperseded, rank_of
from decent_train.training.resume import resharded_start


T = TypeVar("T")

# Tests only: the member named here stops itself (SIGSTOP) once its donor's state has arrived, before it commits, so
# that a test can kill a joiner that is not in yet.
STOP_BEFORE_COMMIT_ENV = "DECENT_TRAIN_TEST_STOP_BEFORE_COMMIT"
# Tests only, "member:step": that member's training thread hangs at that record step, before its barrier, while its
# heartbeat thread beats on (alive but stuck: what only the others' report to the coordinator can end).
HANG_AT_ENV = "DECENT_TRAIN_TEST_HANG_AT"


class LiveTraining:
    """The loop's side of live membership: when the members change, and the change itself."""

    def __init__(self, live: LiveMembership, job: Job, metrics: MetricLogger) -> None:
        self.live, self.job, self.metrics = live, job, metrics
        self._recovering: tuple[Plan, dict[str, Any]] | None = None  # a change whose next step is not done yet
        self.joined = False  # this worker joined the running job (``join``)
        self.changed_at = -1  # the step of the latest change
        member, _, step = os.environ.get(HANG_AT_ENV, "").partition(":")
        self._hang_at = int(step) if member == str(live.id) else -1  # tests only (HANG_AT_ENV); -1: never
        job.fence = live.fence

    def despite_changes(self, step: int, work: Callable[[], T]) -> T:
        """``work()`` (an evaluation, a checkpoint), again after a change if a member died while it ran."""
        while True:
            try:
                return work()
            except MembersChanged:
                self.change(step)

    def record_step(self) -> contextlib.AbstractContextManager[None]:
        """Around a record step's collectives: the bound derived from measured steps (``LiveMembership.bounded``)."""
        return self.live.bounded()

    def change_at(self, step: int, needs_all: bool) -> bool:
        """Whether the members change after ``step`` (see ``LiveMembership.change_at``); also closes the timing of
        the previous change, at the first step completed after it."""
        if needs_all and step == self._hang_at:
            threading.Event().wait()
        self.live.step_done()
        if self._recovering is not None:
            plan, record = self._recovering
            self._recovering = None
            record["recovery_s"] = round(time.time() - plan.detected_at, 3)
            logger.info(f"step {step}: first step after the change, {record['recovery_s']:.2f} s after it was detected")
            if dist.get_rank() == 0:
                self.live.store.set(Keys.record(plan.epoch), json.dumps(record))
        return self.live.change_at(step, needs_all)

    def change(self, step: int) -> None:
        """At the change's step: drain, reconfigure, heal, commit (again with a newer plan if one supersedes), then
        gossip over the new members."""
        job, live = self.job, self.live
        previous = live.plan
        taken, old_world = self._data_taken(step), dist.get_world_size()
        record: dict[str, Any] = {}
        while True:
            try:
                job.algo.prepare_membership_change()
                plan = live.reconfigure()
                if plan.stop:
                    self._stop(plan, step)
                for joiner, donor in plan.donors.items():
                    if donor == live.id:
                        healed = self._donate(plan, joiner, step, taken, old_world)
                        live.store.set(Keys.heal(plan.epoch), json.dumps(healed))
                live.commit()
                break
            except PlanSuperseded:  # a member was lost during the change: every member starts over at this step
                continue
        self._rebuild(plan, step, taken, old_world)
        # A worker is named by its member id (its logs/member<k>.log, the coordinator's lines), which it keeps; its rank
        # is its place in the process group, which a change renumbers.
        lost = [f"member {m} (rank {previous.members.index(m)}) lost ({why})"
                for m, why in live.lost_since(previous.epoch).items() if m in previous.members]
        world, topology = dist.get_world_size(), job.algo.topology_name
        if lost:
            logger.info(f"step {step}: {', '.join(lost)}; continuing on {world} workers, topology {topology}")
        if plan.joined:
            donor = next(iter(plan.donors.values()))
            record |= json.loads(live.store.get(Keys.heal(plan.epoch)))  # the donor's, set before it committed
            heal = f" ({record['heal_mb']:.1f} MB, {record['heal_s']:.2f} s)"
            joined = ", ".join(f"member {m} as rank {rank_of(plan, m)}" for m in plan.joined)
            logger.info(f"step {step}: {joined} joined, healed from member {donor} (rank {rank_of(plan, donor)})"
                        f"{heal}; {world} workers")
        record["step"] = step
        self._recovering, self.changed_at = (plan, record), step

    def join(self) -> int:
        """A worker started into a running job: receive its donor's state and load it; the step it is at."""
        job, live = self.job, self.live
        while True:
            plan = live.plan
            try:
                state, nbytes = receive_state(rank_of(plan, plan.donors[live.id]))
                if os.environ.get(STOP_BEFORE_COMMIT_ENV) == str(live.id):
                    os.kill(os.getpid(), signal.SIGSTOP)
                live.commit()
                break
            except (RuntimeError, PlanSuperseded):  # the donor or another member died: a newer plan heals it again
                live.wait_for_newer_plan(plan.donors[live.id])
                plan = live.enter()
        job.algo.net.load_state_dict(state["model"])
        job.algo.load_state_dict({**state["algorithm"], "averaged_from": 1})
        step = state["step"]
        job.start_step = job.data_step = step
        job.data_start = resharded_start(job.data, state["data_taken"], (state["world_size"], job.batch_size),
                                         (dist.get_world_size(), job.batch_size))
        self._regossip()
        donor = plan.donors[live.id]
        logger.info(f"step {step}: joined as member {live.id}, rank {dist.get_rank()} of {dist.get_world_size()}, "
                    f"healed from member {donor} (rank {rank_of(plan, donor)}) ({nbytes / 2**20:.1f} MB)")
        self._recovering = (plan, {})
        self.joined = True
        return step

    def _donate(self, plan: Plan, joiner: int, step: int, taken: int, old_world: int) -> dict[str, Any]:
        algo = self.job.algo
        state = {
            "step": step,
            "model": algo.net.state_dict(),
            "algorithm": algo.averageable_state(algo.state_dict()),
            "data_taken": taken,
            "world_size": old_world,
        }
        start = time.perf_counter()
        try:
            nbytes = send_state(state, rank_of(plan, joiner))
        except RuntimeError:  # the joiner died: the coordinator plans without it
            self.live.wait_for_newer_plan(joiner)
            raise PlanSuperseded from None
        return {"heal_mb": round(nbytes / 2**20, 3), "heal_s": round(time.perf_counter() - start, 3)}

    def _data_taken(self, step: int) -> int:
        job = self.job
        return job.data_start + (step - job.data_step) * job.cfg.accum_steps

    def _rebuild(self, plan: Plan, step: int, taken: int, old_world: int) -> None:
        """Gossip, data shards and rank 0's sinks over the new members."""
        job = self.job
        world = dist.get_world_size()
        job.data_start = resharded_start(job.data, taken, (old_world, job.batch_size), (world, job.batch_size))
        job.data_step = step
        self._regossip()
        if dist.get_rank() == 0 and not self.metrics.active:
            self.metrics.take_over(job.run_dir / METRICS_FILE)
            log_to_console(job.cfg.logger)
            logger.info(f"step {step}: this worker (member {self.live.id}) is rank 0 now: it logs and evaluates")

    def _regossip(self) -> None:
        cfg = self.job.cfg
        world = dist.get_world_size()
        nodes = self.live.plan.members_per_node()
        name, local, why = cfg.live_layout(world, nodes)
        if why:  # one line per change that loses the topology's node structure
            logger.warning(f"{why}; gossiping over {name} ({world} workers, per node: {', '.join(map(str, nodes))})")
        self.job.algo.membership_changed(name, local)

    def _stop(self, plan: Plan, step: int) -> None:
        """Fewer members than ``fault_tolerance.min_workers``: a checkpoint at this step, then the run ends."""
        path = Checkpointer(self.job).save(step)
        logger.debug(f"fault_tolerance.min_workers={self.job.cfg.fault_tolerance.min_workers}: "
                     f"{len(plan.members)} worker(s) left at step {step}; stopped with a checkpoint ({path})")
        self.live.commit()
        raise SystemExit(3)  # the launcher says why, once


def seed_joiner(seed: int, member: int) -> None:
    """A joiner's own random stream (dropout), distinct from every founder's (``seed + rank``)."""
    torch.manual_seed(seed + 1_000_003 * (member + 1))
