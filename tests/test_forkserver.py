"""Workers forked from the launcher's forkserver (decent_train/forkserver.py, launch.start_forkserver) start as the
interpreter that the launcher would have started at that launch (``python -m decent_train.worker``): its directory,
its environment with torch's agent's variables over it, its thread count, the platform's way to start processes and
a name in ``ps``; and they die with the launcher. The forkserver outlives a launch, so each test changes the
launcher's state after it started. Oracles: the launcher's values at the launch, and a fresh interpreter's default.
The command starts its forkserver before its own imports (launcher/forking.py): one it refuses leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from decent_train import worker
from decent_train.launcher.forking import LAUNCHER_PID_ENV, launches_workers
from decent_train.launcher.launch import start_forkserver
from decent_train.runtime import die_with_agent
from decent_train.training.stop import AGENT_PID_ENV

from .jobs import COMMAND, start
from .test_elastic import alive


def _report(queue: Any, agents: dict[str, str], config: str, cwd: str, environ: dict[str, str]) -> None:
    """A forked worker up to its training: torch's agent sets its variables (``_wrap``), then the worker takes the
    launch; what it ended up with goes back."""
    os.environ.update(agents)
    worker.take_the_launch(config, cwd, environ)
    queue.put({"cwd": os.getcwd(), "environ": dict(os.environ), "threads": torch.get_num_threads(),
               "start_method": multiprocessing.get_start_method(), "ppid": os.getppid(),
               "cmdline": Path("/proc/self/cmdline").read_bytes().rstrip(b"\0")})


def test_a_forked_worker_takes_the_launch_it_belongs_to(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LAUNCHER_PID_ENV, "")  # start_forkserver names this process; restored afterwards
    monkeypatch.setenv("LAUNCH_VALUE", "first")
    monkeypatch.setenv("GONE_SINCE", "first")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    start_forkserver()
    # The next launch: another directory and environment (a sweep's job: hydra.job.env_set, hydra.job.chdir).
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LAUNCH_VALUE", "second")
    monkeypatch.delenv("GONE_SINCE")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    context = multiprocessing.get_context("forkserver")
    queue = context.SimpleQueue()
    process = context.Process(target=_report, args=(queue, {"RANK": "3", "WORLD_SIZE": "4", "LAUNCH_VALUE": "agent"},
                                                    "run/resolved_config.yaml", os.getcwd(), dict(os.environ)))
    process.start()
    got = queue.get()
    process.join(timeout=30)
    assert process.exitcode == 0

    assert got["cwd"] == str(tmp_path)
    environ = got["environ"]
    assert environ["RANK"] == "3" and environ["WORLD_SIZE"] == "4" and environ["LAUNCH_VALUE"] == "agent"
    assert "GONE_SINCE" not in environ
    assert {k: v for k, v in environ.items() if k not in ("RANK", "WORLD_SIZE", "LAUNCH_VALUE", AGENT_PID_ENV)} == {
        k: v for k, v in os.environ.items() if k != "LAUNCH_VALUE"}
    assert environ[AGENT_PID_ENV] == str(got["ppid"]) != str(os.getpid())  # it dies with the forkserver
    assert got["threads"] == 2
    fresh = subprocess.run([sys.executable, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert got["start_method"] == fresh
    assert got["cmdline"] == b"decent_train.worker run/resolved_config.yaml (rank 3 of 4)"


LAUNCHER = textwrap.dedent("""
    import multiprocessing, sys, time
    from decent_train.launcher.launch import start_forkserver
    from tests import test_forkserver

    if __name__ == "__main__":
        start_forkserver()
        process = multiprocessing.get_context("forkserver").Process(target=test_forkserver._train_forever)
        process.start()
        print(process.pid, flush=True)
        time.sleep(600)
""")


def _train_forever() -> None:
    die_with_agent()  # what worker.main does first
    time.sleep(600)


def test_a_killed_launcher_takes_its_forkserver_and_workers_with_it(tmp_path: Path) -> None:
    """SIGKILL to the launcher alone (not its process group: the forkserver has a session of its own): a node lost."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                                                  *sys.path])})
    try:
        assert launcher.stdout is not None
        pid = int(launcher.stdout.readline())
        server = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert server != launcher.pid and os.getsid(server) == server != os.getsid(launcher.pid)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while (alive(server) or alive(pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(server) and not alive(pid)
    finally:
        launcher.kill()
        launcher.wait()


def _forkserver_of(pid: int) -> int | None:
    """The forkserver among the children of process ``pid``, if it has one."""
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                with contextlib.suppress(OSError):
                    if b"multiprocessing.forkserver" in Path(f"/proc/{child}/cmdline").read_bytes():
                        return int(child)
    return None


def _started_forkserver(command: subprocess.Popen[str]) -> int:
    """The forkserver of ``command``, as soon as it appears."""
    server = None
    while command.poll() is None and server is None:
        server = _forkserver_of(command.pid)
    assert server is not None, "the command started no forkserver"
    return server


@pytest.mark.parametrize("end", ["refused", "killed"])
def test_a_command_that_ends_while_its_forkserver_imports_takes_it_along(end: str, tmp_path: Path) -> None:
    """The forkserver starts with the command, so it is still importing torch when a mistake in the input ends the
    command (after Hydra's composition), or a SIGKILL does at once: it must end with the command, not import on for
    seconds."""
    command = start("topology=nonsense" if end == "refused" else "steps=5", f"hydra.run.dir={tmp_path / 'run'}",
                    cwd=tmp_path)
    server = _started_forkserver(command)
    if end == "killed":
        command.kill()
    command.wait(timeout=120)  # not communicate(): the forkserver holds the command's output pipes while it runs
    deadline = time.monotonic() + 0.5  # a SIGKILL as the command ends; the imports would take seconds more
    while alive(server) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(server)
    _, stderr = command.communicate()
    assert command.returncode == 2 and "topology=nonsense" in stderr if end == "refused" else command.returncode == -9


@pytest.mark.parametrize("after_s", [0.02, 0.05, 0.1])
def test_a_ctrl_c_as_the_forkserver_starts_ends_the_command_in_one_line(after_s: float, tmp_path: Path) -> None:
    """The terminal's Ctrl-C goes to the command's process group, which the forkserver (and multiprocessing's resource
    tracker) are in until the forkserver's first line leaves it: one line and exit status 130 all the same, no
    KeyboardInterrupt traceback from a child's start (seen 0.02 to 0.1 s after the forkserver appeared)."""
    command = subprocess.Popen([str(COMMAND), "steps=5", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _started_forkserver(command)
    time.sleep(after_s)
    os.killpg(command.pid, signal.SIGINT)
    _, stderr = command.communicate(timeout=120)
    assert command.returncode == 130
    assert stderr == "decent-train: stopped by SIGINT; no checkpoint was written at this stop\n"


@pytest.mark.parametrize(("args", "launches"), [
    ([], True), (["topology=ring", "steps=40"], True), (["-m", "topology=ring,complete"], True),
    (["--config-dir", "my_conf", "recipe=cpu_demo"], True), (["--help"], False), (["--cfg", "job"], False),
    (["dry_run=true"], False), (["dry_run=True", "steps=3"], False), (["fault_tolerance.role=coordinator"], False),
    (["-m", "hydra/launcher=slurm", "seed=1,2"], False),
])
def test_the_command_starts_a_forkserver_only_where_it_launches(args: list[str], launches: bool) -> None:
    assert launches_workers(args) == launches
