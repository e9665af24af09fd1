"""Live fault tolerance over nodes (issue 39): the coordinator outside the nodes, one agent per node, the node as the
unit of failure.

- The coordinator's planning, against a hand computation: a real store (the coordinator's own ``TCPStore``) and fake
  node agents written as store clients (no processes): a silent node's members leave in one plan; a spare node joins
  as one group, healing from established members spread over them; a hot spare waits for a node to leave.
- The agent's rule, caused for real: the process hosting the store is stopped (SIGSTOP: the agent's store calls block,
  as to a host cut off) or killed; the agent kills its workers and exits with one line within detect_s.
- End to end on localhost (slow): a coordinator and 3 agents as separate processes, each agent in its own process
  group; one agent's whole group SIGKILLed mid-run (6 -> 4 in one change), then a spare node started (4 -> 6).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from decent_train.components.timeouts import MIN_DETECT_S
from decent_train.config import TrainConfig, check_config
from decent_train.engine import reconfigure
from decent_train.launcher.coordinator import Coordinator, NodeKeys
from decent_train.training.live import HEARTBEAT_S, PAUSE_ENV, Keys, Plan

from .jobs import COMMAND, free_port, records
from .test_elastic import alive, stopped

pytestmark = pytest.mark.alone  # it times its faults or starves the machine: no test shares it (tests/conftest.py)

DETECT_S = MIN_DETECT_S  # the shortest that the config takes (components/timeouts.py)


def _cfg(nnodes: int | str, nproc: int = 2, detect_s: float = DETECT_S, **extra: Any) -> TrainConfig:
    return check_config({
        "fault_tolerance": {"name": "live", "detect_s": detect_s},
        "launch": {"nnodes": nnodes, "nproc_per_node": nproc, "rdzv_endpoint": "127.0.0.1:1", "rdzv_id": "t"},
        **extra,
    })


class FakeAgent:
    """A node agent as the coordinator sees it: the keys it writes, written by hand (no worker process)."""

    def __init__(self, port: int, workers: int, take_ids: bool = True) -> None:
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False)
        self.node = self.store.add(NodeKeys.NODE_IDS, 1) - 1
        for key in (NodeKeys.beat(self.node), NodeKeys.events(self.node), NodeKeys.orders(self.node)):
            self.store.add(key, 0)
        self.events, self.workers = 0, workers
        if take_ids:  # otherwise later: another agent may take its ids in between, as a real one may
            self.take_ids()

    def take_ids(self) -> None:
        """The founders' ids as one block (what node_agent.py's register does), their starts, the node's info."""
        workers = self.workers
        first = self.store.add(NodeKeys.MEMBER_IDS, workers) - workers
        self.members = list(range(first, first + workers))
        for member in self.members:
            self.report("started", member=member, pid=10_000 + member)
        self.store.set(NodeKeys.info(self.node), json.dumps({"host": f"fake{self.node}", "pid": 0,
                                                             "workers": workers}))

    def report(self, kind: str, **fields: Any) -> None:
        self.store.set(NodeKeys.event(self.node, self.events), json.dumps({"kind": kind, **fields}))
        self.events += 1
        self.store.add(NodeKeys.events(self.node), 1)

    def hello(self, *members: int) -> None:
        for member in members or self.members:
            self.report("hello", member=member)

    def beat(self) -> None:
        self.store.add(NodeKeys.beat(self.node), 1)

    def orders(self) -> list[dict[str, Any]]:
        count = self.store.add(NodeKeys.orders(self.node), 0)
        return [json.loads(self.store.get(NodeKeys.order(self.node, k))) for k in range(count)]


def _coordinator(tmp_path: Path, cfg: TrainConfig) -> Coordinator:
    return Coordinator(cfg, tmp_path, "{}", port=0)


def _epochs(coordinator: Coordinator) -> int:
    return coordinator.store.add(Keys.EPOCH, 0)


def _commit(coordinator: Coordinator) -> None:
    """Every member of the newest plan is done with the change (what the workers do)."""
    plan = coordinator.plan
    coordinator.store.add(Keys.commit(plan.epoch), len(plan.members))


def _steps_until(coordinator: Coordinator, beating: list[FakeAgent], done: Callable[[], bool],
                 limit_s: float = DETECT_S + 5.0) -> None:
    """Run the coordinator's looks while ``beating`` agents beat, until ``done()``."""
    deadline = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < deadline, "the coordinator did not plan in time"
        for agent in beating:
            agent.beat()
        coordinator._step()
        time.sleep(0.02)


def _founded(tmp_path: Path, cfg: TrainConfig, nodes: int) -> tuple[Coordinator, list[FakeAgent]]:
    coordinator = _coordinator(tmp_path, cfg)
    agents = [FakeAgent(coordinator.port, cfg.launch.nproc_per_node) for _ in range(nodes)]
    for agent in agents:
        agent.hello()
        agent.beat()
    coordinator._wait_for_founders()
    return coordinator, agents


def test_a_silent_node_leaves_in_one_plan_with_all_its_members(tmp_path: Path) -> None:
    coordinator, (a, b, c) = _founded(tmp_path, _cfg(3), 3)
    assert (a.members, b.members, c.members) == ([0, 1], [2, 3], [4, 5])
    first = coordinator.plan
    assert (first.members, first.nodes) == ([0, 1, 2, 3, 4, 5], [0, 0, 1, 1, 2, 2])
    _steps_until(coordinator, [a, c], lambda: _epochs(coordinator) > 1)  # node 1 falls silent
    for _ in range(int(2 * DETECT_S / 0.02)):  # no further plan follows (one change, not one per member)
        a.beat(), c.beat()
        coordinator._step()
        time.sleep(0.02)
    assert _epochs(coordinator) == 2
    plan = Plan.loads(coordinator.store.get(Keys.plan(1)))
    assert plan.members == [0, 1, 4, 5] and plan.nodes == [0, 0, 2, 2] and plan.members_per_node() == [2, 2]
    assert sorted(plan.lost) == [2, 3] and all("silent" in why for why in plan.lost.values())
    assert plan.joined == [] and not plan.stop
    assert [o["kind"] for o in b.orders()] == ["fence"]  # a lost node is told to stop, never asked to replace
    assert a.orders() == [] and c.orders() == []


def test_member_k_starts_as_rank_k_whatever_order_the_agents_register_in(tmp_path: Path) -> None:
    """Node 0 registers first but takes its ids after node 1 (agents race): ranks follow the member ids, not the node
    ids, so member 0 is rank 0 (the tests that spare rank 0's node pick it by member id)."""
    coordinator = _coordinator(tmp_path, _cfg(2))
    late = FakeAgent(coordinator.port, 2, take_ids=False)
    early = FakeAgent(coordinator.port, 2)
    late.take_ids()
    assert (late.node, late.members, early.node, early.members) == (0, [2, 3], 1, [0, 1])
    for agent in (late, early):
        agent.hello()
        agent.beat()
    coordinator._wait_for_founders()
    assert (coordinator.plan.members, coordinator.plan.nodes) == ([0, 1, 2, 3], [1, 1, 0, 0])


def test_a_worker_lost_on_a_live_node_is_replaced_there(tmp_path: Path) -> None:
    coordinator, (a, b) = _founded(tmp_path, _cfg(2), 2)
    coordinator.restarts_left = 1  # launch.max_restarts=1
    b.report("lost", member=3, why="killed by SIGKILL")
    _steps_until(coordinator, [a, b], lambda: _epochs(coordinator) > 1)
    plan = coordinator.plan
    assert plan.members == [0, 1, 2] and plan.lost == {3: "killed by SIGKILL"}
    assert [o["kind"] for o in b.orders()] == ["start"] and a.orders() == []


def test_a_spare_node_joins_as_one_group_healing_from_established_members(tmp_path: Path) -> None:
    coordinator, (a, b) = _founded(tmp_path, _cfg("2:3"), 2)
    _commit(coordinator)
    spare = FakeAgent(coordinator.port, 2)
    assert spare.members == [4, 5]
    spare.hello(4)  # one of its workers is ready, the other still builds: the node waits for it
    for _ in range(10):
        for agent in (a, b, spare):
            agent.beat()
        coordinator._step()
        time.sleep(0.02)
    assert _epochs(coordinator) == 1
    spare.hello(5)
    _steps_until(coordinator, [a, b, spare], lambda: _epochs(coordinator) > 1)
    plan = coordinator.plan
    assert plan.members == [0, 1, 2, 3, 4, 5] and plan.nodes == [0, 0, 1, 1, 2, 2]
    assert plan.joined == [4, 5]
    # donors: established members only, spread from the last rank back (hand computation: 4 <- 3, 5 <- 2)
    assert plan.donors == {4: 3, 5: 2}


def test_a_hot_spare_waits_for_a_node_to_leave(tmp_path: Path) -> None:
    coordinator, (a, b) = _founded(tmp_path, _cfg(2), 2)  # at most 2 nodes in the run
    _commit(coordinator)
    spare = FakeAgent(coordinator.port, 2)
    spare.hello()
    for _ in range(10):
        for agent in (a, b, spare):
            agent.beat()
        coordinator._step()
        time.sleep(0.02)
    assert _epochs(coordinator) == 1  # no room: it waits
    _steps_until(coordinator, [a, spare], lambda: _epochs(coordinator) > 1)  # node 1 falls silent
    assert coordinator.plan.members == [0, 1] and sorted(coordinator.plan.lost) == [2, 3]
    _commit(coordinator)
    _steps_until(coordinator, [a, spare], lambda: _epochs(coordinator) > 2)
    plan = coordinator.plan
    assert plan.members == [0, 1, 4, 5] and plan.joined == [4, 5] and plan.donors == {4: 1, 5: 0}


@pytest.mark.parametrize(("overrides", "message"), [
    ({"fault_tolerance": {"name": "live", "role": "worker"}},
     "fault_tolerance.role='worker'; valid: both, coordinator, agent"),
    ({"fault_tolerance": {"role": "agent"}},
     "fault_tolerance.role=agent with fault_tolerance=none: fault_tolerance=none does not read it; use "
     "fault_tolerance=live, or leave fault_tolerance.role=both"),
    ({"fault_tolerance": {"name": "live", "role": "agent"}},
     "fault_tolerance=live with fault_tolerance.role=agent: the agents reach the coordinator at launch.rdzv_endpoint"),
    ({"fault_tolerance": {"name": "live", "role": "coordinator"}, "launch": {"rdzv_endpoint": "host:0"}},
     "launch.rdzv_endpoint=host:0: the coordinator's store; valid: HOST:PORT with a port in 1..65535"),
    ({"fault_tolerance": {"name": "live", "min_workers": 7},
      "launch": {"nnodes": 3, "nproc_per_node": 2, "rdzv_endpoint": "h:1", "rdzv_id": "j"}},
     "fault_tolerance.min_workers=7 is more than the 6 workers launched; valid: 1..6"),
])
def test_node_settings_are_refused_in_one_line(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as error:
        check_config(overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_several_nodes_are_accepted_under_live() -> None:
    cfg = _cfg(3)
    assert cfg.launch.world_size == 6 and cfg.fault_tolerance.role == "both"


def test_the_topology_is_laid_out_over_the_plans_nodes() -> None:
    cfg = _cfg(3, topology={"name": "one-peer-exp"})
    assert Plan(1, [0, 1, 4, 5], 1, nodes=[0, 0, 2, 2]).members_per_node() == [2, 2]
    assert cfg.live_topology(4, [2, 2]) == ("one-peer-exp", 2)  # a whole node left: two nodes of two
    assert cfg.live_topology(4) == ("one-peer-exp", 2)  # no plan yet: nodes as launched (launch.nproc_per_node)
    assert cfg.live_topology(4, [4]) == ("one-peer-exp", 4)
    assert cfg.live_topology(6, [2, 2, 2]) == ("ring", 6)  # one-peer-exp needs a power of two: ring
    assert cfg.live_topology(3, [2, 1]) == ("ring", 3)
    assert _cfg(3).live_topology(5, [2, 2, 1]) == ("ring", 5)  # nodes of different sizes: laid out as one node


# --- the agent's rule: no coordinator, no workers ---------------------------------------------------------------------

AGENT = """
import sys
from pathlib import Path
from decent_train.config import check_config
from decent_train.launcher.launch import StopForwarding
from decent_train.launcher.node_agent import NodeAgent
cfg = check_config({"fault_tolerance": {"name": "live", "detect_s": float(sys.argv[2])}, "pg_timeout_s": 600,
                    "launch": {"nproc_per_node": 2}})
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
NodeAgent(cfg, Path("unused"), sys.argv[1], StopForwarding(), command=sleeper).run()
"""
STORE = """
import sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL], ids=["coordinator-stopped", "coordinator-killed"])
def test_an_agent_that_loses_the_coordinator_kills_its_workers_and_exits(tmp_path: Path,
                                                                          fault: signal.Signals) -> None:
    detect_s = 2.0
    server = subprocess.Popen([sys.executable, "-c", STORE], stdout=subprocess.PIPE, text=True)
    agent = None
    try:
        port = int(server.stdout.readline())
        agent = subprocess.Popen([sys.executable, "-c", AGENT, f"127.0.0.1:{port}", str(detect_s)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        store = dist.TCPStore("127.0.0.1", port, is_master=False)
        store.wait([NodeKeys.info(0)])
        pids = [json.loads(store.get(NodeKeys.event(0, k)))["pid"] for k in range(2)]
        assert all(alive(pid) for pid in pids)
        time.sleep(1.0)  # the agent is beating: nothing happens
        assert agent.poll() is None and all(alive(pid) for pid in pids)
        cut = time.monotonic()
        os.kill(server.pid, fault)
        agent.wait(timeout=detect_s + 10)
        took = time.monotonic() - cut
        print(f"agent exited {took:.2f} s after the coordinator was {fault.name}ed (detect_s={detect_s:g})")
        assert agent.returncode == 1, agent.stderr.read()
        assert not any(alive(pid) for pid in pids), f"workers {pids} outlived their agent"
        lines = [line for line in agent.stderr.read().splitlines() if line.startswith("decent-train")]
        assert len(lines) == 1 and "no answer from the coordinator" in lines[0], lines
        # silence counts from the agent's last answer, up to one look (HEARTBEAT_S) before the fault
        assert detect_s - HEARTBEAT_S <= took < detect_s + 3
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGKILL)
        server.wait()
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait()


SLOTS_AGENT = """
import sys
from pathlib import Path
from decent_train.config import check_config
from decent_train.launcher.launch import StopForwarding
from decent_train.launcher.node_agent import NodeAgent
cfg = check_config({"fault_tolerance": {"name": "live"}, "launch": {"nproc_per_node": 4}})
# a stand-in worker: writes its LOCAL_RANK into a file named by its member id, then waits
worker = [sys.executable, "-c", "import os, sys, time; from pathlib import Path; "
          "Path(sys.argv[1], os.environ['DECENT_TRAIN_MEMBER_ID']).write_text(os.environ.get('LOCAL_RANK', 'unset')); "
          "time.sleep(600)", sys.argv[2]]
NodeAgent(cfg, Path("unused"), sys.argv[1], StopForwarding(), command=worker).run()
"""


def test_each_worker_of_a_node_has_its_own_local_rank_and_a_replacement_takes_the_freed_one(tmp_path: Path) -> None:
    """Under live the agent, not torchrun, starts the workers, and a worker on CUDA trains on GPU LOCAL_RANK
    (training/live.py ``LiveMembership.start``): a real agent with 4 stand-in workers gives them LOCAL_RANK 0..3;
    members 1 and 2 SIGKILLed and replaced (the coordinator's start orders, written by hand) take slots 2 and 1,
    those their lost workers freed, in the order of the orders, not the lowest free first."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    agent = subprocess.Popen([sys.executable, "-c", SLOTS_AGENT, f"127.0.0.1:{store.port}", str(tmp_path)],
                             start_new_session=True)

    def slots(count: int) -> dict[int, str]:
        deadline = time.monotonic() + 60
        while len(written := {int(f.name): f.read_text() for f in tmp_path.iterdir() if f.read_text()}) < count:
            assert time.monotonic() < deadline and agent.poll() is None, f"written: {written}"
            time.sleep(0.05)
        return written

    try:
        assert slots(4) == {0: "0", 1: "1", 2: "2", 3: "3"}
        pids = {e["member"]: e["pid"] for e in (json.loads(store.get(NodeKeys.event(0, k))) for k in range(4))}
        for member in (1, 2):
            os.kill(pids[member], signal.SIGKILL)
        store.wait([NodeKeys.event(0, 5)])  # the agent reported both lost
        for index, replaced in enumerate((2, 1)):
            store.set(NodeKeys.order(0, index), json.dumps({"kind": "start", "replaces": replaced}))
        store.add(NodeKeys.orders(0), 2)
        assert slots(6) == {0: "0", 1: "1", 2: "2", 3: "3", 4: "2", 5: "1"}
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()


# --- end to end: nodes as process groups on localhost -----------------------------------------------------------------

# the spare node's pair joined at steps 560-760 (17 s into training, 11 s after its agent registered) with 2 cores
# loaded by others (load average 5-6): 1200 steps leave it 440 steps beyond the latest seen
STEPS = 1200
SPARE_AT = 10  # the spare node is started once training runs: it joins when ready, waiting if the run is full
KILL_AT = 150
TIMEOUT_S = 420


def _records_written(run_dir: Path) -> dict[int, float]:
    """step -> the wall time rank 0 logged its record (logs/member<k>.log, whichever member was rank 0 then)."""
    written: dict[int, float] = {}
    for log in (run_dir / "logs").glob("member*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if "metrics:log" in line and " - step=" in line:
                stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f").timestamp()
                written[int(line.split(" - step=")[1].split()[0])] = stamp
    return written


class Cluster:
    """A coordinator and node agents, each its own process group, with their consoles in files."""

    def __init__(self, tmp_path: Path, *job: str) -> None:
        self.tmp_path, self.run_dir = tmp_path, tmp_path / "run"
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.agents: list[subprocess.Popen[bytes]] = []
        self.coordinator = self._start("coordinator", "fault_tolerance.role=coordinator", *job,
                                       f"hydra.run.dir={self.run_dir}")

    def _start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        with (self.tmp_path / f"{name}.txt").open("w") as out:
            return subprocess.Popen([str(COMMAND), "fault_tolerance=live", f"launch.rdzv_endpoint={self.endpoint}",
                                     "launch.rdzv_id=nodes", *args], cwd=self.tmp_path, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def start_agent(self) -> subprocess.Popen[bytes]:
        k = len(self.agents)
        agent = self._start(f"agent{k}", "fault_tolerance.role=agent", f"hydra.run.dir={self.tmp_path / f'agent{k}'}")
        self.agents.append(agent)
        return agent

    def members_of(self, k: int) -> list[int]:
        """The members agent ``k`` started (its log's first line names them)."""
        log = (self.tmp_path / f"agent{k}" / "launcher.log")
        for line in log.read_text().splitlines() if log.exists() else []:
            if "workers (members" in line:
                return [int(m) for m in line.split("(members ")[1].split(")")[0].split(", ")]
        return []

    def last_step(self) -> int:
        with contextlib.suppress(FileNotFoundError):
            steps = []
            for line in (self.run_dir / "metrics.jsonl").read_text().splitlines():
                with contextlib.suppress(ValueError):
                    steps.append(json.loads(line)["step"])
            return max(steps, default=-1)
        return -1

    def consoles(self) -> str:
        out = ""
        for path in sorted(self.tmp_path.glob("*.txt")):
            out += f"\n--- {path.name} ---\n" + path.read_text(errors="replace")[-4000:]
        for log in sorted((self.run_dir / "logs").glob("member*.log")) if (self.run_dir / "logs").exists() else []:
            lines = [x for x in log.read_text(errors="replace").splitlines() if "metrics:log" not in x]
            out += f"\n--- {log.name} (tail) ---\n" + "\n".join(lines[-8:])
        return out

    def close(self) -> None:
        for proc in [self.coordinator, *self.agents]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def kill_a_node(cluster: Cluster, holds_rank_0: bool, spare: bool) -> tuple[int | None, int | None, list[int]]:
    """Start 3 agents, SIGKILL one node's agent and workers (its process group) once KILL_AT is recorded, the one
    holding rank 0 or one that does not; with ``spare``, a fourth agent once training runs (it waits while the run is
    full). The coordinator's exit code, the last step recorded before the kill, the killed node's members."""
    try:
        for _ in range(3):
            cluster.start_agent()
        start, killed_at, victims = time.monotonic(), None, []
        while cluster.coordinator.poll() is None:
            assert time.monotonic() - start < TIMEOUT_S, f"no exit within {TIMEOUT_S} s{cluster.consoles()}"
            if spare and len(cluster.agents) == 3 and cluster.last_step() >= SPARE_AT:
                cluster.start_agent()
            if killed_at is None and cluster.last_step() >= KILL_AT:
                victim = next(k for k in range(3) if (0 in cluster.members_of(k)) == holds_rank_0)
                victims, killed_at = cluster.members_of(victim), cluster.last_step()
                os.killpg(cluster.agents[victim].pid, signal.SIGKILL)
            time.sleep(0.01)
        return cluster.coordinator.returncode, killed_at, victims
    finally:
        cluster.close()


@pytest.mark.slow
@pytest.mark.skipif(not reconfigure.supported(), reason="live membership needs torch >= 2.14")
def test_a_node_killed_leaves_in_one_change_and_a_spare_node_joins_as_a_group(tmp_path: Path) -> None:
    """Rank 0's node SIGKILLed (its agent's process group) after step 150: 6 -> 4 in one change, a survivor takes
    over rank 0's records and result; a spare node started once training runs waits (the run is full at
    launch.nnodes=3) and joins as one group when the node has left: 4 -> 6, healed from established members."""
    cluster = Cluster(tmp_path, "launch.nnodes=3", "launch.nproc_per_node=2", f"steps={STEPS}",
                      "logger.log_every=10", "logger.progress_bar=false", "fault_tolerance.detect_s=2",
                      # the new rank 0 would start a wandb run of its own (offline: ~2 s here) inside the change
                      "logger.wandb.mode=disabled")
    # rank 0's node (member 0's): the records, the evaluation and the result move to a survivor
    code, killed_at, victims = kill_a_node(cluster, holds_rank_0=True, spare=True)
    context = cluster.consoles()
    assert code == 0 and killed_at is not None, f"exit {code}{context}"
    rows = records(cluster.run_dir)
    steps = [r["step"] for r in rows]
    assert all(x < y for x, y in zip(steps, steps[1:])) and steps[-1] == STEPS, f"{steps}{context}"
    counts = [r["world/members"] for r in rows]
    members = [n for i, n in enumerate(counts) if i == 0 or counts[i - 1] != n]
    assert members == [6, 4, 6], f"{members}{context}"
    result = json.loads((cluster.run_dir / "result.json").read_text())
    assert result["eval/accuracy"] >= 0.95, f"{result}{context}"
    loss, join = result["membership_changes"]
    assert sorted(x["member"] for x in loss["lost"]) == sorted(victims) and len(victims) == 2, f"{loss}{context}"
    assert loss["members"] == 4 and loss["joined"] == [] and loss["step"] > killed_at, f"{loss}{context}"
    spare = cluster.members_of(3)
    assert sorted(j["member"] for j in join["joined"]) == sorted(spare) and join["members"] == 6, f"{join}{context}"
    established = set(range(6)) - set(victims)
    assert all(j["donor"] in established for j in join["joined"]), f"{join}{context}"  # never another joiner
    assert join["heal_mb"] > 0, f"{join}{context}"
    assert result["world_size"] == 6 and (cluster.run_dir / "model.pt").exists(), f"{result}{context}"
    assert "is rank 0 now" in context or any("is rank 0 now" in log.read_text()
                                             for log in (cluster.run_dir / "logs").glob("member*.log")), context
    written = _records_written(cluster.run_dir)  # wall clock: rank 0 changes with the node (time/elapsed_s is its own)
    gaps = [(written[b] - written[a], a) for a, b in zip(steps, steps[1:])]
    around = max(g for g in gaps if killed_at <= g[1] <= loss["step"])
    print(f"longest gap between the survivors' records around the node's loss: {around[0]:.2f} s (after step "
          f"{around[1]}); longest in the run: {max(gaps)[0]:.2f} s")
    assert around[0] < 5.0, f"{around}{context}"


# --- acceptance 1's gap, wherever in the step the node dies ----------------------------------------------------------

FAULT_STEP = 200  # a record step (log_every=10) that also measures consensus (every 10) and evaluates (every 100)
MOST_GAP_S = 5.0  # acceptance 1: the longest gap between the survivors' records, wherever in the step the node died
STOPPED_S = 0.3  # the paused member stopped this long before its node is killed: its peers are inside the collective


def _member_pid(agent_pid: int, member: int) -> int | None:
    """The pid of ``member``, a worker the agent ``agent_pid`` forked from its forkserver (it names itself)."""
    for server in _children(agent_pid):
        for child in _children(server):
            with contextlib.suppress(OSError):
                if f"(member {member})".encode() in Path(f"/proc/{child}/cmdline").read_bytes():
                    return child
    return None


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


@pytest.mark.slow
@pytest.mark.skipif(not reconfigure.supported(), reason="live membership needs torch >= 2.14")
@pytest.mark.parametrize("inside", [None, "gather", "evaluation"],
                         ids=["between-record-steps", "inside-the-record-steps-first-gather",
                              "inside-the-evaluations-all-reduce"])
def test_a_node_killed_anywhere_in_the_step_costs_the_survivors_under_5_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inside: str | None
) -> None:
    """Acceptance 1's gap, the node SIGKILLed at 3 moments of the step: between record steps (once step 150 is
    recorded), and inside record step FAULT_STEP's collectives: the first (the gather of the workers' statistics)
    and the evaluation's all-reduce. For those, member 2 stops itself past the step's barrier just before that
    collective (the test hook ``PAUSE_ENV``: every other member is inside it, waiting), and its node (agent and
    workers) is SIGKILLed STOPPED_S later. The survivors' longest gap between records around the loss, as rank 0
    logged them (wall clock), is at most 5 s with no allowance for a record step's bound; 6 -> 4 in one change."""
    if inside is not None:
        monkeypatch.setenv(PAUSE_ENV, f"2:{FAULT_STEP}:{inside}")
    steps = 300
    cluster = Cluster(tmp_path, "launch.nnodes=3", "launch.nproc_per_node=2", f"steps={steps}",
                      "logger.log_every=10", "logger.progress_bar=false", "fault_tolerance.detect_s=2",
                      "checkpoint.every=0", "logger.wandb.mode=disabled")
    killed_wall, victims, stopped_since = None, [], None
    try:
        for _ in range(3):
            cluster.start_agent()
        start = time.monotonic()
        while cluster.coordinator.poll() is None:
            assert time.monotonic() - start < TIMEOUT_S, f"no exit within {TIMEOUT_S} s{cluster.consoles()}"
            victim = next((k for k in range(3) if 2 in cluster.members_of(k)), None)
            if killed_wall is None and victim is not None:
                if inside is None:
                    due = cluster.last_step() >= KILL_AT
                else:
                    pid = _member_pid(cluster.agents[victim].pid, 2)
                    if stopped_since is None and pid is not None and stopped(pid):
                        stopped_since = time.monotonic()
                    due = stopped_since is not None and time.monotonic() - stopped_since >= STOPPED_S
                if due:
                    victims, killed_wall = cluster.members_of(victim), time.time()
                    os.killpg(cluster.agents[victim].pid, signal.SIGKILL)
            time.sleep(0.01)
        code = cluster.coordinator.returncode
    finally:
        cluster.close()
    context = cluster.consoles()
    assert code == 0 and killed_wall is not None, f"exit {code}{context}"
    assert 0 not in victims and len(victims) == 2, f"{victims}: rank 0 must survive to write the records{context}"
    rows = records(cluster.run_dir)
    steps_seen = [r["step"] for r in rows]
    assert all(x < y for x, y in zip(steps_seen, steps_seen[1:])) and steps_seen[-1] == steps, f"{steps_seen}{context}"
    counts = [r["world/members"] for r in rows]
    assert [n for i, n in enumerate(counts) if i == 0 or counts[i - 1] != n] == [6, 4], f"{counts}{context}"
    (change,) = json.loads((cluster.run_dir / "result.json").read_text())["membership_changes"]
    assert sorted(x["member"] for x in change["lost"]) == sorted(victims), f"{change}{context}"
    logs = "".join(log.read_text(errors="replace") for log in (cluster.run_dir / "logs").glob("member*.log"))
    if inside is not None:  # the fault did land inside that collective: a survivor's failed there
        described = {"gather": "the gather of the workers' statistics", "evaluation": "the evaluation's all-reduce"}
        assert f"{described[inside]} failed" in logs, context
    written = _records_written(cluster.run_dir)
    last = max(s for s in steps_seen if written[s] <= killed_wall)
    after = next(s for s in steps_seen if s > max(last, change["step"]))  # the first record after the change
    around = [s for s in steps_seen if last <= s <= after]
    gap, at = max((written[b] - written[a], a) for a, b in zip(around, around[1:]))
    print(f"node killed {'between record steps' if inside is None else f'inside step {FAULT_STEP}: {inside}'}: "
          f"longest gap between the survivors' records {gap:.2f} s (after step {at}; kill "
          f"{killed_wall - written[last]:.2f} s after step {last}'s record, change at step {change['step']})")
    assert gap <= MOST_GAP_S, f"gap {gap:.2f} s after step {at}{context}"


# --- store traffic: a record step's barrier costs requests linear in the members --------------------------------------


class CountingStore:
    """A store client that counts the requests a member makes (the main thread's; the heartbeat has its own)."""

    def __init__(self, store: dist.TCPStore) -> None:
        self.store, self.requests = store, 0

    @property
    def timeout(self) -> Any:
        return self.store.timeout

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.requests += 1
            return method(*args, **kwargs)

        return counted


@pytest.mark.parametrize("n", [2, 4, 8])
def test_a_record_steps_barrier_costs_requests_linear_in_the_members(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Two record steps' barriers, every member at once (threads, one store client each): by reading
    ``LiveMembership._verdict``, each member makes 4 requests per barrier (its arrival, the counter, one blocking
    wait, the verdict), the last to arrive 2 more (the newest epoch, the verdict) and, from the second barrier on,
    deletes the n + 2 keys of the one before: 9n + 6 in all, with no polling (the old backoff polled every 2-50 ms)."""
    import threading
    from datetime import timedelta

    from decent_train.training.live import STORE_ENV, LiveMembership

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv(STORE_ENV, f"127.0.0.1:{server.port}")
    plan = Plan(0, list(range(n)), 1)
    server.set(Keys.plan(0), plan.dumps())
    server.add(Keys.EPOCH, 1)
    members = [LiveMembership(CountingStore(dist.TCPStore("127.0.0.1", server.port, is_master=False)), m,
                              timedelta(seconds=30)) for m in range(n)]
    for member in members:
        member.plan = plan
    verdicts: list[bool] = []

    def two_record_steps(member: LiveMembership) -> None:
        verdicts.extend(member.change_at(step, needs_all=True) for step in (10, 20))

    threads = [threading.Thread(target=two_record_steps, args=(m,)) for m in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for member in members:
        member.close(finished=False)
    assert verdicts == [False] * 2 * n
    requests = sum(m.store.requests for m in members)
    print(f"{n} members: {requests} store requests for two record steps' barriers")
    assert requests == 9 * n + 6


@pytest.mark.parametrize("extra, named", [  # (one node's range, 3..2, is empty)
    # 10 classes, 3 per worker: 3 workers hold 9 < 10 (refused), 4 hold 12; only the nodes' count reaches 3
    ({"fault_tolerance": {"name": "live", "min_workers": 3},
      "dataset": {"partition": "classes", "classes_per_worker": 3}}, "with 3 workers"),
])
def test_the_preflight_checks_every_number_of_members_over_all_nodes(extra: dict[str, Any], named: str) -> None:
    """The preflight's live checks span min_workers to every node's workers (3 nodes x 2 here), not one node's."""
    from decent_train.launcher.preflight import check_live

    cfg = _cfg(3, **{k: v for k, v in extra.items() if k != "fault_tolerance"})
    if "fault_tolerance" in extra:
        cfg.fault_tolerance.min_workers = extra["fault_tolerance"]["min_workers"]
    with pytest.raises(ValueError, match=named):
        check_live(cfg)


@pytest.mark.slow
@pytest.mark.skipif(not reconfigure.supported(), reason="live membership needs torch >= 2.14")
def test_diloco_across_nodes_goes_on_without_a_node_killed(tmp_path: Path) -> None:
    """Acceptance 4 across nodes: ``algorithm=diloco algorithm.sync_every=10`` on 3 nodes x 2 workers, a node that
    does not hold rank 0 SIGKILLed after step KILL_AT: its 2 members leave in one change, the survivors' outer steps
    go on over 4 (the rule's replay: tests/test_live_local_steps.py), exit 0, accuracy >= 0.95."""
    steps = 600
    cluster = Cluster(tmp_path, "launch.nnodes=3", "launch.nproc_per_node=2", f"steps={steps}", "algorithm=diloco",
                      "algorithm.sync_every=10", "logger.log_every=10", "logger.progress_bar=false",
                      "fault_tolerance.detect_s=2", "logger.wandb.mode=disabled")
    code, killed_at, victims = kill_a_node(cluster, holds_rank_0=False, spare=False)
    context = cluster.consoles()
    assert code == 0 and killed_at is not None, f"exit {code}{context}"
    rows = records(cluster.run_dir)
    steps_seen = [r["step"] for r in rows]
    assert all(x < y for x, y in zip(steps_seen, steps_seen[1:])) and steps_seen[-1] == steps, f"{steps_seen}{context}"
    counts = [r["world/members"] for r in rows]
    assert [n for i, n in enumerate(counts) if i == 0 or counts[i - 1] != n] == [6, 4], f"{counts}{context}"
    result = json.loads((cluster.run_dir / "result.json").read_text())
    (change,) = result["membership_changes"]
    assert sorted(x["member"] for x in change["lost"]) == sorted(victims) and len(victims) == 2, f"{change}{context}"
    assert result["eval/accuracy"] >= 0.95, f"{result}{context}"


def test_the_run_ends_when_joiners_were_planned_as_training_finished(tmp_path: Path) -> None:
    """A spare node's workers planned in the same moment training ended never join (no record step is left to change
    at): the run is over once every member that trained is done, not when the joiners are (seen once: a coordinator
    waiting for them until killed)."""
    coordinator, (a, b) = _founded(tmp_path, _cfg("2:3"), 2)
    _commit(coordinator)
    spare = FakeAgent(coordinator.port, 2)
    spare.hello()
    _steps_until(coordinator, [a, b, spare], lambda: _epochs(coordinator) > 1)
    assert coordinator.plan.joined == [4, 5]  # planned, not committed: the change never comes
    for agent in (a, b):
        for member in agent.members:
            agent.report("done", member=member)
    over = False
    for _ in range(20):
        for agent in (a, b, spare):
            agent.beat()
        over = coordinator._step()
        if over:
            break
        time.sleep(0.02)
    assert over
