"""Ctrl-C in a sweep (``decent-train -m``, Hydra's own launcher: one job after another in the launcher's process) ends
the whole sweep, so the line the launcher prints names the command that goes on with all of it, not only with the job
that was running: the sweep's own command line into its directory. Run, that command continues the stopped job from
its checkpoint, evaluates the finished ones again from their final checkpoints and runs the jobs never started.

One chain of three real launches (each 10 to 50 s here), real SIGINTs to the launcher's process group as a terminal's
Ctrl-C sends them: the sweep stopped while job 1 trains (exit 75, a checkpoint); its printed command, stopped again as
job 2 starts, before its workers (exit 130, no checkpoint); that one's printed command, run to the end.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from decent_train.training.stop import EXIT_STOPPED, STOP_FILE

from .jobs import COMMAND
from .test_signals import last_step

pytestmark = [pytest.mark.alone, pytest.mark.slow]

STEPS = 200
SWEEP = ["-m", "optim.lr=0.001,0.002,0.003", "launch.nproc_per_node=2", "model=mlp", f"steps={STEPS}",
         "logger.progress_bar=false"]
GO_ON = re.compile(r"; to go on with the sweep \(([^)]*)\): (decent-train .*)$")
TIMEOUT_S = 240


def sweep_launch(tmp_path: Path, name: str, argv: list[str], ready: Callable[[], bool] | None = None
                 ) -> tuple[int, list[str]]:
    """``argv`` (``decent-train ...``) run in ``tmp_path``, sent SIGINT to its process group once ``ready()``: its exit
    status and the console lines printed after the signal (all of them without one)."""
    console = tmp_path / f"{name}.console"
    start, sent_after = time.monotonic(), None if ready else 0
    with console.open("w") as out:
        proc = subprocess.Popen([str(COMMAND), *argv[1:]], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        while proc.poll() is None:
            assert time.monotonic() - start < TIMEOUT_S, f"no exit within {TIMEOUT_S} s\n{console.read_text()}"
            if sent_after is None and ready is not None and ready():
                sent_after = len(console.read_text().splitlines())
                os.killpg(proc.pid, signal.SIGINT)
            time.sleep(0.005)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    lines = console.read_text(errors="replace").splitlines()
    assert sent_after is not None, f"{name}: the sweep ended before the signal\n" + "\n".join(lines)
    return proc.returncode, lines[sent_after:]


def go_on(returncode: int, lines: list[str], expected: int, where: tuple[str, ...]) -> list[str]:
    """The stop's one line, the last, naming the job (one of ``where``), with no traceback: the command it prints,
    as argv."""
    text = "\n".join(lines)
    assert returncode == expected and "Traceback" not in text, f"exit {returncode}\n{text}"
    stops = [line for line in lines if line.startswith("decent-train: stopped by SIGINT")]
    assert stops == lines[-1:] and any(w in stops[0] for w in where), text
    found = GO_ON.search(stops[0])
    assert found is not None, stops[0]
    return shlex.split(found.group(2))


def result(sweep: Path, job: int) -> dict[str, float]:
    return json.loads((sweep / str(job) / "result.json").read_text())


def test_the_line_after_a_ctrl_c_in_a_sweep_goes_on_with_the_whole_sweep(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    returncode, lines = sweep_launch(tmp_path, "first", ["decent-train", *SWEEP, f"hydra.sweep.dir={sweep}"],
                                     lambda: last_step(sweep / "1") >= 20)
    again = go_on(returncode, lines, EXIT_STOPPED, (", in job 1 of a sweep;",))
    assert again == ["decent-train", *SWEEP, f"hydra.sweep.dir={sweep}"]
    assert not (sweep / "2").exists()  # the stop ended the sweep: job 2 never started
    stopped_at = json.loads((sweep / "1" / STOP_FILE).read_text())["step"]
    assert 20 < stopped_at < STEPS
    first_job = result(sweep, 0)

    # The printed command, stopped as job 2 begins (Hydra made its directory; no worker yet): in Hydra's code, or in
    # this job's checks, or as its workers start; each says how to go on with the sweep.
    returncode, lines = sweep_launch(tmp_path, "second", again, lambda: (sweep / "2" / ".hydra").is_dir())
    begun = (" in a sweep, while no job trained", ", in job 2 of a sweep;")  # in Hydra's code or ours; as workers start
    again = go_on(returncode, lines, 128 + signal.SIGINT, begun)
    assert again == ["decent-train", *SWEEP, f"hydra.sweep.dir={sweep}"]
    assert result(sweep, 1)["resumed_from_step"] == stopped_at and result(sweep, 1)["steps"] == STEPS
    second_job = result(sweep, 1)

    returncode, lines = sweep_launch(tmp_path, "third", again)
    assert returncode == 0 and "Traceback" not in "\n".join(lines), "\n".join(lines)
    # Every job trained to the end, each once: the finished ones only evaluated again, to the same accuracy.
    assert [result(sweep, job)["steps"] for job in range(3)] == [STEPS] * 3
    assert [result(sweep, job)["resumed_from_step"] for job in range(3)] == [STEPS, STEPS, 0]
    assert result(sweep, 0)["eval/accuracy"] == first_job["eval/accuracy"]
    assert result(sweep, 1)["eval/accuracy"] == second_job["eval/accuracy"]
