"""Ctrl-C, SIGTERM and SIGUSR1 on a default ``decent-train`` run, sent for real to real processes: every worker stops
at the same step with a checkpoint there, the launcher prints one line saying how to go on and exits with
``EXIT_STOPPED``; the command it prints continues to the very model an uninterrupted run ends with (the oracle). A
second Ctrl-C stops at once: exit 130, no checkpoint, no worker left.

One chain of launches covers the three signals (each resumes the one before): SIGINT to the launcher's process group
(what a terminal's Ctrl-C does; the workers run in sessions of their own, torchrun's agent forwards it) while the ring
gossip exchanges, SIGTERM to the launcher while rank 0 evaluates (the moment read from its log), SIGUSR1 to one worker
only (the others learn of it in the record step's gather). Each launch is the default job (4 workers, ring, digits)
cut to ``STEPS`` steps: 15-30 s here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from decent_train.components.checkpoint import complete_checkpoints
from decent_train.launcher.supervisor import WORKERS_FILE
from decent_train.training.stop import EXIT_STOPPED, STOP_FILE

from .jobs import COMMAND, free_port, start, worker_pids
from .test_elastic import alive, descendants

pytestmark = [pytest.mark.alone, pytest.mark.slow]

STEPS = 160
JOB = [f"steps={STEPS}", "eval_every=50", "eval_batch_size=1", "logger.progress_bar=false"]  # batch 1: a long eval
TIMEOUT_S = 180
NEXT = "; to go on: "


@dataclass
class Launch:
    run_dir: Path
    returncode: int
    console: str
    sent_at: int  # the last record's step when the signal went out
    lines_after: int  # console lines printed after it

    def __str__(self) -> str:
        log = self.run_dir / "logs" / "rank0.log"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-12:]) if log.exists() else ""
        return f"exit {self.returncode}, signal after step {self.sent_at}\n--- console ---\n{self.console}\n" \
               f"--- rank0.log (tail) ---\n{tail}"

    @property
    def stop(self) -> dict[str, object]:
        return json.loads((self.run_dir / STOP_FILE).read_text())

    def go_on_command(self) -> list[str]:
        """The command the launcher's last line says continues the run."""
        line = next(line for line in self.console.splitlines() if NEXT in line)
        return shlex.split(line.split(NEXT, 1)[1])


def last_step(run_dir: Path) -> int:
    steps = [-1]
    with contextlib.suppress(FileNotFoundError):
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line being written
                steps.append(json.loads(line)["step"])
    return max(steps)


def log_has(run_dir: Path, text: str) -> bool:
    with contextlib.suppress(FileNotFoundError):
        return text in (run_dir / "logs" / "rank0.log").read_text(errors="replace")
    return False


Send = Callable[[subprocess.Popen[bytes], Path], None]


def launch(tmp_path: Path, name: str, args: list[str], ready: Callable[[Path], bool], send: Send) -> Launch:
    """``args`` (decent-train's, or a whole command) into ``tmp_path/name``; ``send`` once ``ready(run_dir)``."""
    run_dir, console_file = tmp_path / name, tmp_path / f"{name}.console"
    argv = args if args[0] == "decent-train" else ["decent-train", *args]
    argv = [str(COMMAND), *argv[1:], f"hydra.run.dir={run_dir}"]
    sent_at, lines_before, start = -2, 0, time.monotonic()
    with console_file.open("w") as out:
        proc = subprocess.Popen(argv, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while proc.poll() is None:
            assert time.monotonic() - start < TIMEOUT_S, f"no exit within {TIMEOUT_S} s\n{console_file.read_text()}"
            if sent_at == -2 and ready(run_dir):
                sent_at, lines_before = last_step(run_dir), len(console_file.read_text().splitlines())
                send(proc, run_dir)
            time.sleep(0.005)
    finally:
        workers = worker_pids(run_dir) or live_workers(run_dir)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    console = console_file.read_text(errors="replace")
    run = Launch(run_dir, proc.returncode, console, sent_at, len(console.splitlines()) - lines_before)
    assert sent_at != -2, f"the run ended before the signal was sent\n{run}"
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in workers.values()), f"workers outlived the launcher: {workers}\n{run}"
    return run


def live_workers(run_dir: Path) -> dict[int, int]:
    """member -> pid of every worker a live run's launcher started (it writes them: launcher/supervisor.py)."""
    with contextlib.suppress(FileNotFoundError):
        return {int(m): pid for m, pid in json.loads((run_dir / WORKERS_FILE).read_text()).items()}
    return {}


def ctrl_c(proc: subprocess.Popen[bytes], run_dir: Path) -> None:
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: its foreground process group


def check_stopped(run: Launch, sig: signal.Signals, steps: set[int]) -> int:
    """Exit ``EXIT_STOPPED``, at most 3 console lines and no traceback, every rank's checkpoint at the step the
    run stopped at (one of ``steps``): the newest complete one. stopped.json names ``sig``, the launcher's."""
    assert run.returncode == EXIT_STOPPED, f"{run}"
    assert run.lines_after <= 3, f"{run.lines_after} lines after the signal\n{run}"
    assert "Traceback" not in run.console and "Error" not in run.console, f"{run}"
    stop = run.stop
    # The launcher passes every stop signal on as SIGUSR1 (the workers' SIGTERM is torchrun's agent's), and then
    # names the one it received in stopped.json, as its line does.
    assert stop["signal"] == sig.name and stop["step"] in steps and stop["step"] > run.sent_at, \
        f"{stop}\n{run}"
    newest = complete_checkpoints(run.run_dir)[0]
    assert newest.step == stop["step"] and sorted(p.name for p in newest.path.glob("rank*.pt")) == [
        f"rank{r}.pt" for r in range(4)], f"{newest}\n{run}"
    assert f"stopped by {sig.name} at step {stop['step']} of {STEPS}" in run.console, f"{run}"
    return int(stop["step"])


def test_signals_stop_with_a_checkpoint_and_resume_to_the_uninterrupted_model(tmp_path: Path) -> None:
    # SIGINT to the process group while the workers train (ring gossip: an exchange is in flight in every step).
    first = launch(tmp_path, "sigint", ["decent-train", *JOB], lambda d: last_step(d) >= 20, ctrl_c)
    check_stopped(first, signal.SIGINT, {30, 40})

    # SIGTERM to the launcher once rank 0 logs that it evaluates at step 50: the stop comes at the next record step.
    second = launch(tmp_path, "sigterm", first.go_on_command(), lambda d: log_has(d, "step 50: evaluating"),
                    lambda proc, _: os.kill(proc.pid, signal.SIGTERM))
    check_stopped(second, signal.SIGTERM, {60})

    # SIGUSR1 to rank 2 alone: the agent sees its workers exit 0; rank 0 learns of it in the gather.
    third = launch(tmp_path, "sigusr1", second.go_on_command(), lambda d: last_step(d) >= 80,
                   lambda proc, d: os.kill(worker_pids(d)[2], signal.SIGUSR1))
    check_stopped(third, signal.SIGUSR1, {90, 100})

    resumed = subprocess.run([str(COMMAND), *third.go_on_command()[1:], f"hydra.run.dir={tmp_path / 'end'}"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr
    whole = subprocess.run([str(COMMAND), *JOB, f"hydra.run.dir={tmp_path / 'whole'}"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    assert whole.returncode == 0, whole.stderr
    ended, oracle = torch.load(tmp_path / "end" / "model.pt"), torch.load(tmp_path / "whole" / "model.pt")
    assert ended.keys() == oracle.keys()
    for key in oracle:
        assert torch.equal(ended[key], oracle[key]), key


def test_a_signal_while_the_workers_start_stops_them_with_a_checkpoint(tmp_path: Path) -> None:
    """SIGTERM (SLURM's preemption) to the launcher as it starts the workers, before any of them can be signalled:
    the launcher leaves the stop beside the config (training/stop.py: REQUEST_FILE) and every worker takes it when its
    handler is set, so the run stops at its first record step with a checkpoint. Passed on only to the workers that
    existed, it was lost and the run trained to its end (exit 0)."""
    launched: list[float] = []

    def starting(run_dir: Path) -> bool:  # the launcher's line just before torchrun starts the workers
        with contextlib.suppress(FileNotFoundError):
            if " workers on cpu" in (run_dir / "launcher.log").read_text():
                launched.append(time.monotonic())
        return bool(launched) and time.monotonic() - launched[0] > 0.2  # past the data's preparation

    run = launch(tmp_path, "starting", ["decent-train", *JOB], starting,
                 lambda proc, _: os.kill(proc.pid, signal.SIGTERM))
    assert run.sent_at < 0, f"the workers had recorded a step already: not the moment this test is about\n{run}"
    check_stopped(run, signal.SIGTERM, set(range(1, STEPS)))
    assert not (run.run_dir / "stop_requested").exists(), f"{run}"  # the launcher's, gone with it

def test_sigterm_to_every_process_of_a_slurm_job_stops_with_a_checkpoint(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """SLURM's scancel, preemption and time limit (proctrack/cgroup) send SIGTERM to every process of the job step at
    once: the launcher, its forkserver, multiprocessing's resource tracker and every worker, not to the launcher
    alone. In a SLURM job (``SLURM_JOB_ID``) the workers take it as a stop, and the forkserver, whose death would
    take them along, ignores it: every worker stops at one step with a checkpoint. Before, the forkserver and the
    workers died of it (no checkpoint: the launcher reported the workers' failure). wandb's service, a process of
    the step too, dies of it, which the run reports in a warning line and goes on without wandb (``logger=jsonl``
    here, so that the lines are the launcher's alone)."""
    monkeypatch.setenv("SLURM_JOB_ID", "7")  # what the workers and the launcher are told; nothing else of SLURM runs

    def every_process(proc: subprocess.Popen[bytes], _: Path) -> None:
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    # logger=jsonl: wandb's service is a process of the step too, and dies of it (a warning line: wandb is off)
    run = launch(tmp_path, "cgroup", ["decent-train", *JOB, "logger=jsonl"], lambda d: last_step(d) >= 20,
                 every_process)
    check_stopped(run, signal.SIGTERM, {30, 40})


def test_a_second_ctrl_c_stops_at_once(tmp_path: Path) -> None:
    """Records every 50 steps: the agreed stop is seconds away when the second Ctrl-C comes."""

    def twice(proc: subprocess.Popen[bytes], run_dir: Path) -> None:
        ctrl_c(proc, run_dir)
        time.sleep(0.3)
        ctrl_c(proc, run_dir)

    run = launch(tmp_path, "twice", ["decent-train", *JOB, "logger.log_every=50", "logger.consensus_every=0"],
                 lambda d: log_has(d, "world_size 4"), twice)
    assert run.returncode == 128 + signal.SIGINT, f"{run}"
    assert "Traceback" not in run.console and run.lines_after <= 3, f"{run}"
    assert not (run.run_dir / STOP_FILE).exists() and not complete_checkpoints(run.run_dir), f"{run}"
    assert "stopped by SIGINT at once" in run.console, f"{run}"


def test_ctrl_c_stops_a_live_run_with_a_checkpoint_and_resume_goes_on(tmp_path: Path) -> None:
    """``fault_tolerance=live``: the launcher runs the workers itself (launcher/supervisor.py) and passes the signal
    on as torchrun's path does: the same stop at an agreed step with a checkpoint, and ``resume=`` finishes the run
    from there."""
    first = launch(tmp_path, "live", ["decent-train", "fault_tolerance=live", *JOB], lambda d: last_step(d) >= 20,
                   ctrl_c)
    step = check_stopped(first, signal.SIGINT, {30, 40})
    resumed = subprocess.run([str(COMMAND), *first.go_on_command()[1:], f"hydra.run.dir={tmp_path / 'end'}"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr
    result = json.loads((tmp_path / "end" / "result.json").read_text())
    assert (result["resumed_from_step"], result["steps"]) == (step, STEPS), result
    assert result["eval/accuracy"] >= 0.9, result


def test_sigterm_ends_a_coordinator_waiting_for_its_nodes(tmp_path: Path) -> None:
    """A live coordinator whose node agents never came (a typo in the agents' command, a job not yet scheduled) stops
    on SIGTERM within a second, with one line and 128 + 15; before, it ignored the signal and waited out
    ``pg_timeout_s`` (measured: still waiting 10 minutes after ``timeout 60`` sent SIGTERM)."""
    port = free_port()
    proc = start("fault_tolerance=live", "fault_tolerance.role=coordinator", f"launch.rdzv_endpoint=127.0.0.1:{port}",
                 "logger.wandb.mode=disabled", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # its store listens: it waits for the agents
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the coordinator's store never listened")
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert time.monotonic() - sent < 5
        assert err.strip().splitlines()[-1].startswith("decent-train: stopped by SIGTERM"), err
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
