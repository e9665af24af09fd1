"""Two reconfigurable groups per member (engine/reconfigure.py): the default (gloo, control) and the data group, with
gloo standing in for nccl2 (this machine has no GPU). Real processes, a real SIGKILL, real rendezvous; nothing mocked.

The parent hosts a TCPStore and plays the coordinator: it writes each epoch's plan (members by stable id in rank
order, a fresh uuid) and reads what the members report. Each member is a spawned process that ``reconfigure.join``s
with a data group and ``reconfigure.reconfigure``s into every plan that has it, then reports, for each group, its
rank and size as the group itself says, an all-reduce of its own value (member id + 1 on the default group, 100 x
that on the data group) and, on the data group, what a ring's ``P2POp`` brought from its predecessor.

The oracle is the plan itself: rank = position in ``members``, size = ``len(members)``, the sums over the members
by hand, the predecessor's value from its id. Epoch 0: [0, 1, 2]; then all three all-reduce on both groups in a loop
and member 1 is SIGKILLed in it (the survivors' collectives fail: a fault caused, not mocked); epoch 1: [0, 2]; a
fresh process with a new id (3) joins; epoch 2: [0, 2, 3].
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from decent_train.engine import reconfigure

pytestmark = pytest.mark.alone  # it times its faults or starves the machine: no test shares it (tests/conftest.py)

if not reconfigure.supported():
    pytest.skip(reconfigure.why_unsupported(), allow_module_level=True)

STORE_TIMEOUT = timedelta(seconds=30)  # the members' store client; never reached in a passing run
OP_TIMEOUT = timedelta(seconds=3)  # a collective's limit (join's): how long a survivor may wait on the victim
RECONFIGURE_TIMEOUT = timedelta(seconds=20)  # the handles' wait and each rendezvous; never reached in a passing run
RENDEZVOUS_S = 2.0  # the default group's rendezvous bound (reconfigure.RENDEZVOUS_S), shortened in the members
CHILD_LIMIT_S = 60  # each member's alarm
WAIT_S = 45.0  # the parent's bound on any one wait
DATA_SCALE = 100  # a member's value on the data group is this times its value on the default group

FOUNDERS, VICTIM, JOINER = [0, 1, 2], 1, 3
EPOCHS = [FOUNDERS, [0, 2], [0, 2, JOINER]]


def value(member: int) -> float:
    return float(member + 1)


# -- a member (spawned: module-level, picklable) ------------------------------------------------------------------
def _process(member: int, port: int, scenario: Callable[[int, dist.TCPStore], None]) -> None:
    """A member's process: join both groups (a gloo data group), say hello, play ``scenario``, then wait until the
    parent has read every report; any failure goes to ``error/<member>`` for the parent."""
    store = None
    try:
        signal.alarm(CHILD_LIMIT_S)
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT)
        reconfigure.join(store, member, OP_TIMEOUT, data_backend="gloo")
        store.set(f"hello/{member}", "")
        scenario(member, store)
        store.get("finished")  # nobody leaves before the parent has read every report
        code = 0
    except BaseException:
        code = 1
        if store is not None:
            store.set(f"error/{member}", traceback.format_exc())
    os._exit(code)


def _member(member: int, store: dist.TCPStore) -> None:
    """Every plan that has this member, from its first: reconfigure, report, and traffic where the plan asks."""
    epoch = int(store.get(f"first/{member}"))
    while True:
        plan = json.loads(store.get(f"plan/{epoch}"))
        if not reconfigure.reconfigure(store, epoch, plan["uuid"], plan["members"], member, RECONFIGURE_TIMEOUT):
            raise RuntimeError(f"member {member}: epoch {epoch}'s handles did not all come")
        store.set(f"result/{epoch}/{member}", json.dumps(_report(member)))
        if plan["last"]:
            return
        if plan["traffic"]:  # until a member's death breaks a collective
            store.set(f"traffic/{epoch}/{member}", "")
            store.set(f"broke/{epoch}/{member}", _traffic(member))
        epoch += 1


def _report(member: int) -> dict[str, Any]:
    """Each group's rank and size as it says, its all-reduce of this member's value, and the data group's ring."""
    data = reconfigure.data_group()
    assert data is not None
    sums = {}
    for name, group, scale in (("default", None, 1), ("data", data, DATA_SCALE)):
        tensor = torch.full((3,), scale * value(member), dtype=torch.float64)
        dist.all_reduce(tensor, group=group)
        sums[name] = tensor.tolist()
    rank, size = data.rank(), data.size()
    sent = torch.full((2,), DATA_SCALE * value(member), dtype=torch.float64)
    received = torch.zeros(2, dtype=torch.float64)
    if size > 1:
        ops = [dist.P2POp(dist.isend, sent, (rank + 1) % size, data),
               dist.P2POp(dist.irecv, received, (rank - 1) % size, data)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return {"default": [dist.get_rank(), dist.get_world_size()], "data": [rank, size], "sums": sums,
            "from_predecessor": received.tolist()}


def _traffic(member: int) -> str:
    """All-reduces on both groups in turn until one fails; its first line."""
    data = reconfigure.data_group()
    tensor = torch.ones(1000, dtype=torch.float64)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for group in (None, data):
            try:
                dist.all_reduce(tensor, group=group)
            except RuntimeError as error:
                return f"{'data' if group is not None else 'default'}: {str(error).strip().splitlines()[0]}"
        tensor.fill_(1.0)
        time.sleep(0.002)
    raise RuntimeError(f"member {member}: no collective failed within {WAIT_S:g} s")


def _rendezvous_member(member: int, store: dist.TCPStore) -> None:
    """Epoch 0 with the founders, where the victim dies after publishing its handles (its first look at whether to
    abandon: the others' are not in yet); what the survivors' reconfigure did; then epoch 1 without it."""
    reconfigure.RENDEZVOUS_S = RENDEZVOUS_S
    store.get("victim gone" if member != VICTIM else "plan/0")
    plan = json.loads(store.get("plan/0"))
    start = time.monotonic()
    try:
        reconfigure.reconfigure(store, 0, plan["uuid"], plan["members"], member, RECONFIGURE_TIMEOUT,
                                abandon=_die if member == VICTIM else None)
        outcome: dict[str, Any] = {"raised": None}
    except RuntimeError as error:
        outcome = {"raised": type(error).__name__, "absent": getattr(error, "absent", None)}
    outcome["seconds"] = time.monotonic() - start
    store.set(f"rendezvous/{member}", json.dumps(outcome))
    plan = json.loads(store.get("plan/1"))
    if not reconfigure.reconfigure(store, 1, plan["uuid"], plan["members"], member, RECONFIGURE_TIMEOUT):
        raise RuntimeError(f"member {member}: epoch 1's handles did not all come")
    store.set(f"result/1/{member}", json.dumps(_report(member)))


def _die() -> bool:
    os.kill(os.getpid(), signal.SIGKILL)
    return True


def _build_nccl2_group(port: int) -> None:
    """Member 5's nccl2 data group, built as ``join`` builds it, without a GPU: what its backend says about it."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT)
    try:
        dist.init_process_group("gloo", store=store, rank=5, world_size=reconfigure.MAX_MEMBER_IDS,
                                timeout=OP_TIMEOUT, enable_reconfigure=True)
        group = reconfigure._reconfigurable_group("nccl2", store, 5, OP_TIMEOUT)
        backend = group._get_backend(torch.device("cuda"))
        store.set("nccl2", json.dumps({
            "backend": type(backend).__name__, "enable_reconfigure": backend.options.enable_reconfigure,
            "timeout_s": backend.options._timeout.total_seconds(), "handle": dist._get_reconfigure_handle(group),
            "rank": dist.get_rank(group)}))
    except BaseException:
        store.set("nccl2", json.dumps({"error": traceback.format_exc()}))
    os._exit(0)


# -- the parent: store and coordinator -----------------------------------------------------------------------------
class Coordinator:
    def __init__(self) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)
        self.spawn = mp.get_context("spawn")
        self.procs: dict[int, Any] = {}
        draw = random.SystemRandom()
        self.uuids = [draw.randrange(1 << 63) for _ in EPOCHS]  # the supervisor's are 63-bit too

    def start(self, member: int, first_epoch: int,
              scenario: Callable[[int, dist.TCPStore], None] = _member) -> None:
        self.store.set(f"first/{member}", str(first_epoch))
        self.procs[member] = self.spawn.Process(target=_process, args=(member, self.store.port, scenario),
                                                daemon=True)
        self.procs[member].start()

    def plan(self, epoch: int, traffic: bool = False) -> None:
        plan = {"members": EPOCHS[epoch], "uuid": self.uuids[epoch], "traffic": traffic,
                "last": epoch == len(EPOCHS) - 1}
        self.store.set(f"plan/{epoch}", json.dumps(plan))

    def wait(self, keys: list[str]) -> None:
        deadline = time.monotonic() + WAIT_S
        while True:
            dead = [m for m, p in self.procs.items() if p.exitcode is not None and m != VICTIM]  # before the keys
            if self.store.check(keys):
                return
            errors = [self.store.get(f"error/{m}").decode() for m in self.procs if self.store.check([f"error/{m}"])]
            if errors:
                raise AssertionError("\n".join(errors))
            if dead or time.monotonic() > deadline:
                raise AssertionError(f"waiting for {keys}: members {dead} exited; "
                                     f"missing {[k for k in keys if not self.store.check([k])]}")
            time.sleep(0.01)

    def results(self, epoch: int) -> dict[int, dict[str, Any]]:
        keys = [f"result/{epoch}/{m}" for m in EPOCHS[epoch]]
        self.wait(keys)
        return {m: json.loads(self.store.get(key)) for m, key in zip(EPOCHS[epoch], keys)}

    def close(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join()


def check_epoch(epoch: int, results: dict[int, dict[str, Any]]) -> None:
    """Every member's report against the plan: rank = position, size = members, sums and the ring by hand."""
    members = EPOCHS[epoch]
    total = sum(value(m) for m in members)
    for member, got in results.items():
        rank, size = members.index(member), len(members)
        predecessor = members[(rank - 1) % size]
        expected = {"default": [rank, size], "data": [rank, size],
                    "sums": {"default": [total] * 3, "data": [DATA_SCALE * total] * 3},
                    "from_predecessor": [DATA_SCALE * value(predecessor)] * 2}
        assert got == expected, f"epoch {epoch} (members {members}), member {member}"


def test_both_groups_follow_a_kill_and_a_join() -> None:
    """Epoch 0 over the founders; member 1 SIGKILLed while all three all-reduce on both groups; epoch 1 over the
    survivors; a fresh process joins both groups at epoch 2."""
    coordinator = Coordinator()
    try:
        for member in FOUNDERS:
            coordinator.start(member, first_epoch=0)
        coordinator.plan(0, traffic=True)
        check_epoch(0, coordinator.results(0))

        coordinator.wait([f"traffic/0/{m}" for m in FOUNDERS])
        time.sleep(0.2)  # some all-reduces in
        os.kill(coordinator.procs[VICTIM].pid, signal.SIGKILL)
        coordinator.procs[VICTIM].join(WAIT_S)
        assert coordinator.procs[VICTIM].exitcode == -signal.SIGKILL
        coordinator.plan(1)
        survivors = EPOCHS[1]
        coordinator.wait([f"broke/0/{m}" for m in survivors])  # the kill broke a collective on every survivor
        check_epoch(1, coordinator.results(1))

        coordinator.start(JOINER, first_epoch=2)
        coordinator.wait([f"hello/{JOINER}"])
        coordinator.plan(2)
        check_epoch(2, coordinator.results(2))
        coordinator.store.set("finished", "")
        for member in EPOCHS[2]:
            coordinator.procs[member].join(WAIT_S)
            code = coordinator.procs[member].exitcode
            assert code == 0, f"member {member} exited {code}"
    finally:
        coordinator.close()


def test_a_member_dead_after_publishing_its_handles_costs_the_rendezvous_bound() -> None:
    """Member 1 publishes its handles for epoch 0 and is SIGKILLed before the rendezvous: the survivors' reconfigure
    fails within the default group's bound (RENDEZVOUS_S), not the reconfiguration's timeout, naming member 1 as
    absent; then both groups reconfigure into epoch 1 without it."""
    coordinator = Coordinator()
    try:
        for member in FOUNDERS:
            coordinator.start(member, first_epoch=0, scenario=_rendezvous_member)
        coordinator.wait([f"hello/{m}" for m in FOUNDERS])
        coordinator.plan(0)
        coordinator.procs[VICTIM].join(WAIT_S)
        assert coordinator.procs[VICTIM].exitcode == -signal.SIGKILL
        coordinator.store.set("victim gone", "")
        survivors = EPOCHS[1]
        coordinator.wait([f"rendezvous/{m}" for m in survivors])
        for member in survivors:
            outcome = json.loads(coordinator.store.get(f"rendezvous/{member}"))
            seconds = outcome.pop("seconds")
            assert outcome == {"raised": "RendezvousFailed", "absent": [VICTIM]}, f"member {member}"
            assert RENDEZVOUS_S <= seconds < RECONFIGURE_TIMEOUT.total_seconds() / 2, f"member {member}: {seconds}"
        coordinator.plan(1)
        check_epoch(1, coordinator.results(1))
        coordinator.store.set("finished", "")
    finally:
        coordinator.close()


@pytest.mark.skipif(not dist.is_backend_available("nccl2"), reason="this torch has no nccl2 backend")
def test_the_nccl2_data_group_is_built_reconfigurable() -> None:
    """What a CPU can check of the GPU path: the data group on nccl2 is a ProcessGroupNCCL2 created in the reconfigure
    regime with join's timeout, hands out an nccl2 handle, and maps ranks like the default group (reconfiguring it
    needs GPUs: docs/design/live-nccl2.md)."""
    coordinator = Coordinator()
    try:
        child = coordinator.spawn.Process(target=_build_nccl2_group, args=(coordinator.store.port,), daemon=True)
        coordinator.procs[5] = child
        child.start()
        coordinator.wait(["nccl2"])
        got = json.loads(coordinator.store.get("nccl2"))
        assert "error" not in got, got.get("error")
        assert got["handle"].startswith("nccl2:5:"), got["handle"]
        del got["handle"]
        assert got == {"backend": "ProcessGroupNCCL2", "enable_reconfigure": True,
                       "timeout_s": OP_TIMEOUT.total_seconds(), "rank": 5}
    finally:
        coordinator.close()
