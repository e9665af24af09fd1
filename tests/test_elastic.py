"""Elastic launches: ``launch.nnodes=MIN:MAX`` parsed and checked, the torchrun and SLURM commands that carry it, and
end to end, a node lost mid-run: two agents joined by a c10d rendezvous on localhost, one killed with its workers,
the other's workers restarted on their own from the last checkpoint."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from decent_train.config import LaunchConfig, check_config, node_range
from decent_train.launcher.job import shipped_dir
from decent_train.launcher.launch import torchrun_command

from .jobs import COMMAND, check_succeeded, free_port
from .test_slurm import SBATCH_SCRIPT, script_env

ELASTIC = {"nnodes": "1:2", "rdzv_endpoint": "node1:29400", "rdzv_id": "job7"}


@pytest.mark.parametrize(
    ("nnodes", "expected"),
    [(1, (1, 1)), (3, (3, 3)), ("2", (2, 2)), ("1:2", (1, 2)), (" 2 : 8 ", (2, 8)), ("4:4", (4, 4))],
)
def test_node_range_reads_torchruns_syntax(nnodes: int | str, expected: tuple[int, int]) -> None:
    assert node_range(nnodes) == expected


@pytest.mark.parametrize("nnodes", [0, "0:2", "3:2", "a:b", "1:", ":2", "1:2:3", "-1:2", "1.5", ""])
def test_bad_node_counts_are_one_line_naming_the_value(nnodes: int | str) -> None:
    with pytest.raises(ValueError) as error:
        LaunchConfig(nnodes=nnodes, rdzv_endpoint="node1:29400", rdzv_id="job7")
    message = str(error.value)
    assert message.startswith(f"launch.nnodes={nnodes} is not a number of nodes; valid: N >= 1, or MIN:MAX")
    assert "\n" not in message


def test_elastic_range_properties() -> None:
    cfg = LaunchConfig(nproc_per_node=2, nnodes="1:3", rdzv_endpoint="node1:29400", rdzv_id="job7")
    assert (cfg.min_nodes, cfg.max_nodes, cfg.elastic) == (1, 3, True)
    assert cfg.world_sizes == [2, 4, 6]
    assert cfg.world_size == 6  # every node joined


@pytest.mark.parametrize("nnodes", [2, "2", "2:2"])
def test_a_fixed_count_stays_a_fixed_count(nnodes: int | str) -> None:
    cfg = LaunchConfig(nproc_per_node=4, nnodes=nnodes, rdzv_endpoint="node1:29400", rdzv_id="job7")
    assert cfg.nnodes == 2 and not cfg.elastic
    assert (cfg.world_sizes, cfg.world_size) == ([8], 8)


@pytest.mark.parametrize(
    "launch",
    [
        {"nnodes": "1:2"},
        {"nnodes": "1:2", "rdzv_endpoint": "localhost:29400"},  # two agents on one host still need one id
        {"nnodes": "2:4", "rdzv_id": "job7"},
        {"nnodes": 2, "rdzv_endpoint": "node1:29400"},
    ],
)
def test_several_nodes_need_one_endpoint_and_one_id(launch: dict) -> None:
    with pytest.raises(ValueError) as error:
        LaunchConfig(**launch)
    assert str(error.value) == (
        f"launch.nnodes={launch['nnodes']} needs launch.rdzv_endpoint=HOST:PORT (the first node) and "
        "launch.rdzv_id=ID, the same for every node"
    )


def test_one_node_elastic_range_needs_no_rendezvous_settings() -> None:
    assert not LaunchConfig(nnodes="1:1").elastic  # "1:1" is one node: standalone on a free port


@pytest.mark.parametrize("key", ["rdzv_last_call_s", "rdzv_keep_alive_s"])
def test_rendezvous_timeouts_are_whole_positive_seconds(key: str) -> None:
    with pytest.raises(ValueError, match=rf"^launch.{key}=0 must be >= 1 \(whole seconds\)$"):
        LaunchConfig(**{key: 0})


def test_elastic_range_from_the_command_line_and_yaml() -> None:
    """Hydra reads ``launch.nnodes=1:2`` as a string; the resolved config keeps it quoted, so YAML does not read it
    as the base-60 number 62 when a worker loads it."""
    overrides = ["launch.nproc_per_node=2", "launch.nnodes=1:2", "launch.rdzv_endpoint=node1:29400", "launch.rdzv_id=j"]
    with initialize_config_dir(config_dir=shipped_dir("conf"), version_base="1.3"):
        cfg = check_config(compose("train", overrides=overrides))
    assert cfg.launch.nnodes == "1:2" and cfg.launch.world_sizes == [2, 4]
    reloaded = OmegaConf.create(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    assert reloaded.launch.nnodes == "1:2"


@pytest.mark.parametrize("nnodes, allocated", [("1:3", 3), ("2", 2)])
def test_a_slurm_sweep_allocates_the_most_nodes_of_a_range(nnodes: str, allocated: int) -> None:
    with initialize_config_dir(config_dir=shipped_dir("conf"), version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm", f"launch.nnodes={nnodes}"], return_hydra_config=True)
    assert cfg.hydra.launcher.nodes == allocated


def test_elastic_torchrun_command() -> None:
    cfg = LaunchConfig(nproc_per_node=8, max_restarts=3, rdzv_last_call_s=5, rdzv_keep_alive_s=2, **ELASTIC)
    assert torchrun_command(cfg, Path("/runs/x/resolved_config.yaml")) == [
        "env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        "torchrun", "--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=node1:29400", "--rdzv-id=job7",
        "--rdzv-conf=last_call_timeout=5,keep_alive_interval=2",
        "--nproc-per-node=8", "--max-restarts=3", "--monitor-interval=0.1",
        "-m", "decent_train.worker", "/runs/x/resolved_config.yaml",
    ]  # fmt: skip
    # torch's own rendezvous timeouts are not repeated.
    assert not any(a.startswith("--rdzv-conf") for a in torchrun_command(LaunchConfig(**ELASTIC), Path("c.yaml")))


@pytest.mark.slow
def test_sbatch_dry_run_with_min_nodes_runs_an_elastic_range(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(SBATCH_SCRIPT), "launch.nproc_per_node=2", "launch.max_restarts=2"],
        env=script_env(DRY_RUN="1", NODES="4", MIN_NODES="2", RUN_DIR=str(tmp_path / "run")), cwd=tmp_path,
        capture_output=True, text=True, timeout=120,
    )
    check_succeeded(proc)
    launch = OmegaConf.load(tmp_path / "run" / "resolved_config.yaml").launch
    assert (launch.nnodes, launch.nproc_per_node, launch.max_restarts) == ("2:4", 2, 2)
    head = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    command = shlex.split(proc.stdout.split("would run on each node:")[1])  # printed with printf %q
    # A lost node must not end the job step: no --kill-on-bad-exit, and --no-kill.
    cpus = len(os.sched_getaffinity(0))  # the node's CPUs for its one task (the dry run: this host's)
    assert command[:6] == ["srun", "--nodes=4", "--ntasks-per-node=1", f"--cpus-per-task={cpus}", "--no-kill",
                           "--kill-on-bad-exit=0"]
    run = command.index("torch.distributed.run") + 1
    assert command[run - 5:run - 2] == ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "python3"]
    assert command[run:] == [
        "--rdzv-conf=last_call_timeout=30,keep_alive_interval=5",
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout=100",  # stops: a checkpoint
        "--nnodes=2:4", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={head}:15000", "--rdzv-id=0",
        "--max-restarts=2", "-m", "decent_train.worker", str(tmp_path / "run" / "resolved_config.yaml"),
    ]  # fmt: skip


# --- End to end: a node lost mid-run ----------------------------------------------------------------------------------

STEPS, EVERY = 1000, 50
JOB = [
    "model=mlp", f"steps={STEPS}", "eval_every=0", "logger=jsonl", "logger.progress_bar=false",
    f"checkpoint.every={EVERY}", "checkpoint.keep=1000",  # every checkpoint kept: which world size wrote each
    "launch.nnodes=1:2", "launch.nproc_per_node=2", "launch.threads_per_worker=1", "launch.max_restarts=1",
    "launch.rdzv_id=elastic-test",
    # After the loss: 3 missed heartbeats of 1 s drop the node, then the last call before the survivor goes on alone.
    # The last call is also the slack the two agents have to meet at the start (they arrive within 0.5 s here; one
    # that misses it joins the running one, which restarts its workers: slower, still a pass).
    "launch.rdzv_keep_alive_s=1", "launch.rdzv_last_call_s=3",
]  # fmt: skip


def listening_pid(port: int, candidates: list[int]) -> int:
    """Which of ``candidates`` listens on ``port`` (the c10d store's host): from /proc, no psutil."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    owners = [pid for pid in candidates if open_files(pid) & inodes]
    assert len(owners) == 1, f"port {port} is held by {owners} of {candidates}"
    return owners[0]


def open_files(pid: int) -> set[str]:
    """What the process's file descriptors point to (``socket:[INODE]`` for a socket)."""
    targets = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            targets.add(os.readlink(fd))
    return targets


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (the agent's workers sit in sessions of their own, out of its process group)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return []


def alive(pid: int) -> bool:
    """Running (a zombie that no one reaps counts as gone: it runs nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stopped(pid: int) -> bool:
    """Stopped (state T: SIGSTOP, or a test hook's SIGSTOP of itself)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def manifests(run_dir: Path) -> dict[Path, int]:
    """Directory -> world size of every complete checkpoint."""
    return {m.parent: json.loads(m.read_text())["world_size"] for m in run_dir.glob("checkpoints/step_*/manifest.json")}


def step(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step_"))


@pytest.mark.slow
@pytest.mark.alone  # its deadlines assume the machine to itself
def test_a_lost_node_restarts_the_others_from_the_last_checkpoint(tmp_path: Path) -> None:
    """nnodes 1:2, two agents x two workers on localhost; one agent is killed with SIGKILL on its process group after
    the first checkpoint, as a node's death would. Its workers go with it, and the other agent's two workers go on
    from the newest checkpoint the four completed, to the end.

    Wall time, 30-45 s on 2 cores, is mostly process start-ups: the two launchers (3-5 s), four workers (9-18 s), then
    two again (6-8 s). The loss itself costs about 3-6 s of rendezvous (the 3 s heartbeat expiry, then the 3 s last
    call), the training about 3 s.
    """
    run_dir, port = tmp_path / "run", free_port()
    args = [str(COMMAND), *JOB, f"launch.rdzv_endpoint=localhost:{port}", f"hydra.run.dir={run_dir}"]
    outputs = [tmp_path / f"agent{i}.out" for i in range(2)]  # files: a pipe no one reads could block an agent
    agents = [  # each in a session of its own: its process group is the node
        subprocess.Popen(args, cwd=tmp_path, stdout=out.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        for out in outputs
    ]
    try:
        deadline = time.monotonic() + 120
        while 4 not in manifests(run_dir).values():  # both nodes trained and checkpointed
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), "no checkpoint by 4 workers"
            time.sleep(0.05)
        survivor = listening_pid(port, [a.pid for a in agents])  # the rendezvous lives there: it must stay
        (victim,) = (a for a in agents if a.pid != survivor)
        below = descendants(victim.pid)
        assert len([pid for pid in below if "decent_train.worker" in " ".join(cmdline(pid))]) == 2, below  # its workers
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in below) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in below if alive(pid)], "the killed agent's workers outlived it"

        (agent,) = (a for a in agents if a.pid == survivor)
        agent.wait(timeout=240)
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    assert agent.returncode == 0, f"exit {agent.returncode}:\n{outputs[agents.index(agent)].read_text()}"

    result = json.loads((run_dir / "result.json").read_text())
    assert result["world_size"] == 2 and result["steps"] == STEPS
    assert math.isfinite(result["eval/loss"]) and result["eval/accuracy"] >= 0.95
    model = torch.load(run_dir / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in model.values())
    # Resumed from the newest checkpoint the four workers completed; every later one is the two workers'.
    written = manifests(run_dir)
    by_four = max((c for c, world in written.items() if world == 4), key=step)
    assert (result["resumed_from_step"], result["resumed_from_world_size"]) == (step(by_four), 4)
    assert 0 < step(by_four) < STEPS and max(map(step, written)) == STEPS
    assert all(world == 2 for c, world in written.items() if step(c) > step(by_four)), written
    assert str(by_four) in (run_dir / "logs" / "rank0.log").read_text()  # the resume is logged, naming it
