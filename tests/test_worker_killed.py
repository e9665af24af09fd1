"""A worker killed outright (SIGKILL, as the kernel's out-of-memory killer kills) is the one the last line names.

torch's agent reports the first failed worker it finds at its next look; rank 1's peer fails on it within
milliseconds ("Connection reset by peer"), and the report named rank 0 and its ExchangeError, never rank 1 or the
kill (reproduced 3 times of 3, and by an audit twice). The launcher watches the order its workers end in
(launcher/exit_order.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .jobs import records, start, worker_pids


@pytest.mark.slow
def test_the_last_line_names_the_killed_worker(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start("model=mlp", "steps=3000", "launch.nproc_per_node=2", "logger=jsonl", "logger.progress_bar=false",
                 f"hydra.run.dir={run_dir}", cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not (records(run_dir) if (run_dir / "metrics.jsonl").exists() else []):
            assert proc.poll() is None and time.monotonic() < deadline, "no record"
            time.sleep(0.1)
        os.kill(worker_pids(run_dir)[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith(
        "decent-train: error: worker rank 1 ended first, with no error of its own (killed: a signal such as SIGKILL")\
        or last.startswith("decent-train: error: worker rank 1 failed (exit code -9): killed by signal SIGKILL"), err
