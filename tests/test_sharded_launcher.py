"""``decent-train parallel.shard=2``, end to end (issue 30, acceptance 2): the default job with FSDP2 inside replicas
of two workers and ring gossip between the two replicas trains to >= 0.95, logs the replicas' consensus distance and
the memory per rank, and a worker killed after a checkpoint (SIGKILL) restarts every worker from the DCP
checkpoint, which then finishes. Bad input is one line before any worker starts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from decent_train.components.checkpoint import complete_checkpoints
from decent_train.config import RESULT_FILE

from .jobs import COMMAND, decent_train, records, worker_pids


@pytest.mark.slow
def test_the_default_job_sharded_trains_to_095_and_resumes_from_its_dcp_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = ["parallel.shard=2", "launch.nproc_per_node=4", "topology=ring", "checkpoint.every=100",
           "launch.max_restarts=1", "logger.progress_bar=false", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen([str(COMMAND), *job], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline, victim = time.monotonic() + 240, None
    while time.monotonic() < deadline and proc.poll() is None:
        if complete_checkpoints(run_dir):
            victim = worker_pids(run_dir).get(3)
            if victim:
                os.kill(victim, signal.SIGKILL)
                break
        time.sleep(0.01)
    stdout, stderr = proc.communicate(timeout=400)
    assert victim is not None, f"the run ended before a worker could be killed\n{stderr}"
    assert proc.returncode == 0, stderr
    assert f"4 workers (2 replicas x 2 shards) on cpu, topology=ring; outputs in {run_dir}" in stderr  # the start line
    assert "over 4 workers (2 replicas x 2 shards), topology=ring; " in stdout  # the summary

    result = json.loads((run_dir / RESULT_FILE).read_text())
    assert result["eval/accuracy"] >= 0.95, result
    assert result["resumed_from_step"] >= 100 and result["resumed_from_step"] % 100 == 0
    checkpoint = complete_checkpoints(run_dir)[0]
    assert checkpoint.shard == 2 and (checkpoint.path / "replica1" / ".metadata").exists()
    logged = records(run_dir)
    consensus = [r["consensus/distance"] for r in logged if "consensus/distance" in r]
    assert consensus and all(d >= 0 for d in consensus) and consensus[-1] > 0  # two replicas that differ
    start_line = (run_dir / "logs" / "rank0.log").read_text()
    assert "parallel/shard 2 | parallel/replicas 2" in start_line and "memory/params_mib" in start_line
    assert {"memory/params_mib", "memory/optimizer_mib", "memory/peak_gib"} <= logged[-1].keys()


@pytest.mark.slow
@pytest.mark.parametrize(("args", "message"), [
    (["parallel.shard=3"], "parallel.shard=3 with launch.nproc_per_node=4: a replica's workers share a node, so "
                           "parallel.shard must divide the workers per node; valid: 1, 2, 4"),
    (["parallel.shard=2", "algorithm=allreduce"], "parallel.shard=2 with algorithm=allreduce: all-reducing shards"),
    (["parallel.shard=2", "launch.nproc_per_node=6", "topology=one-peer-exp"],
     "topology=one-peer-exp with 6 workers: over 3 replicas (parallel.shard=2):"),
])
def test_bad_sharding_is_one_line_before_any_worker(tmp_path: Path, args: list[str], message: str) -> None:
    proc = decent_train(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "run" / "logs").exists()  # no worker started


@pytest.mark.slow
def test_an_fsdp2_script_with_its_own_optimizer_adopts_gossip_with_two_lines() -> None:
    """tests/user_scripts/own_fsdp2.py (FSDP2 over a (replicate, shard) mesh, AdamW, a cosine schedule and gradient
    clipping of its own) under torchrun on 4 workers, 2 replicas of 2 shards: every rank exits 0 and the loss falls."""
    script = Path(__file__).parent / "user_scripts" / "own_fsdp2.py"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(script), "--shard", "2"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, final = (float(v) for v in re.search(r"first loss ([\d.]+) final loss ([\d.]+)", proc.stdout).groups())
    assert final < 0.7 * first
