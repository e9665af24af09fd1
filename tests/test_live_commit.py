"""A change that a newer plan supersedes (training/live.py ``LiveMembership.commit``, launcher/coordinator.py
``Coordinator._publish``).

The coordinator marks the change superseded before it writes the newer plan (``Coordinator._publish``), so a member
woken by that outcome must wait for the plan: otherwise it starts the change over with the superseded plan and
reconfigures with that plan's uuid a second time, and gloo's rendezvous then held the survivors for 5 x
``comm_timeout_s`` (seen in tests/test_live_launcher.py's replacement killed while it joins).

A real TCPStore and a real member (its heartbeat thread too); the coordinator's writes are made here by hand, in
``_publish``'s order, with a pause between them that is far longer than the member needs to wake.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from decent_train.launcher.coordinator import Coordinator
from decent_train.training.live import STORE_ENV, Keys, LiveMembership, Plan, PlanSuperseded

from .test_live_nodes import FakeAgent, _cfg

PAUSE_S = 0.5  # between the coordinator's writes: the outcome, then the plan (the member wakes in milliseconds)


def test_a_superseded_commit_returns_once_the_plan_that_superseded_it_is_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Member 0 commits epoch 2 ([0, 1, 3, 4]); member 4 dies before it commits, so the coordinator supersedes epoch 2
    and plans epoch 3 ([0, 1, 3]). Oracle, by hand: when commit raises PlanSuperseded, epoch 3 is the newest plan
    the member knows, and the plan it would change to next."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv(STORE_ENV, f"127.0.0.1:{server.port}")
    superseded, newer = Plan(2, [0, 1, 3, 4], 1002), Plan(3, [0, 1, 3], 1003)
    server.set(Keys.plan(superseded.epoch), superseded.dumps())
    server.add(Keys.EPOCH, superseded.epoch + 1)  # the counter is the newest epoch + 1
    member = LiveMembership(dist.TCPStore("127.0.0.1", server.port, is_master=False), 0, timedelta(seconds=30))
    member.plan = superseded

    def coordinator() -> None:  # Coordinator._publish, with member 4 dead before it committed
        time.sleep(PAUSE_S)
        server.compare_set(Keys.committed(superseded.epoch), "", "superseded")
        time.sleep(PAUSE_S)
        server.set(Keys.plan(newer.epoch), newer.dumps())
        server.add(Keys.EPOCH, 1)

    thread = threading.Thread(target=coordinator)
    thread.start()
    try:
        with pytest.raises(PlanSuperseded):
            member.commit()
        assert member.newer_plan()
        assert member._latest_plan() == newer
    finally:
        thread.join(timeout=30)
        member.close(finished=False)


class LastMembersCommitAfterTheCoordinatorCounts:
    """The coordinator's store, through which the members still missing from ``epoch``'s commit commit (as
    ``LiveMembership.commit`` does, from a client of their own) right after the coordinator has counted them: the
    moment between its count and its outcome, which the timing of a real run only sometimes hits."""

    def __init__(self, store: dist.TCPStore, plan: Plan) -> None:
        self.store, self.plan, self.fired = store, plan, False
        self.members = dist.TCPStore("127.0.0.1", store.port, is_master=False)

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)

    def add(self, key: str, value: int) -> int:
        count = self.store.add(key, value)
        if key == Keys.commit(self.plan.epoch) and not self.fired:
            self.fired = True
            for _ in range(len(self.plan.members) - count):
                if self.members.add(key, 1) >= len(self.plan.members):
                    self.members.compare_set(Keys.committed(self.plan.epoch), "", "all")
        return count


def test_a_change_committed_while_the_coordinator_publishes_is_committed_for_both(tmp_path: Path) -> None:
    """The last member commits epoch 1 between the coordinator's count of the commits and its "superseded": the
    members then go on in epoch 1 (the outcome they read is "all"), so the coordinator must count it committed too,
    and take its members as the established ones (who heal a joiner). Oracle: the outcome key the members act on."""
    cfg = _cfg(1)
    coordinator = Coordinator(cfg, tmp_path, "{}", port=0)
    agent = FakeAgent(coordinator.port, cfg.launch.nproc_per_node)
    agent.hello()
    agent.beat()
    coordinator._wait_for_founders()  # epoch 0, committed from the start
    change = coordinator._publish(coordinator.plan.members)
    coordinator.store.add(Keys.commit(change.epoch), len(change.members) - 1)  # all but the last have committed
    coordinator.store = LastMembersCommitAfterTheCoordinatorCounts(coordinator.store, change)
    coordinator._publish(change.members)
    outcome = coordinator.store.get(Keys.committed(change.epoch))
    assert coordinator.store.fired and coordinator.changes[1].committed == (outcome == b"all"), \
        f"outcome for the members: {outcome!r}"
