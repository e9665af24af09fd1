"""SLURM: ``scripts/slurm_train.sbatch`` and ``-m hydra/launcher=slurm`` against a real one-node cluster.

``scripts/slurm_cluster.sh`` installs Debian's SLURM and munge (root and apt-get) and starts the daemons under a
temporary directory; the tests marked ``slurm`` skip, with the reason, only where SLURM cannot be had (not root, no
apt-get, no package source: the script's exit 3). An install that apt-get tried and failed (exit 4) is an error of
every such test, with the end of apt-get's output: a broken install is not a machine without SLURM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from .jobs import check_succeeded, decent_train

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_SCRIPT = ROOT / "scripts" / "slurm_cluster.sh"
SBATCH_SCRIPT = ROOT / "scripts" / "slurm_train.sbatch"
JOB = ["model=mlp", "steps=12", "eval_every=0", "logger=jsonl", "logger.progress_bar=false"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A started cluster: the environment every SLURM client (and job) needs."""
    install = subprocess.run([str(CLUSTER_SCRIPT), "install"], capture_output=True, text=True, timeout=600)
    if install.returncode == 3:  # not root, no apt-get, or no package source
        pytest.skip(f"no SLURM here: {install.stderr.strip()}")
    if install.returncode != 0:  # 4: apt-get tried and failed
        pytest.fail(f"{CLUSTER_SCRIPT.name} install: exit {install.returncode}\n{install.stderr}")
    cluster = tmp_path_factory.mktemp("slurm")
    started = subprocess.run([str(CLUSTER_SCRIPT), "start", str(cluster)], capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, f"{started.stdout}\n{started.stderr}"
    env = dict(os.environ, SLURM_CONF=str(cluster / "slurm.conf"))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # decent-train and python in the jobs
    try:
        yield env
    finally:
        subprocess.run([str(CLUSTER_SCRIPT), "stop", str(cluster)], timeout=60)


def wait_for(job_id: str, env: dict[str, str], timeout: float = 240) -> dict[str, str]:
    """Poll until the job leaves the queue (``sbatch --wait`` backs off too slowly); its ``scontrol`` record."""
    deadline = time.monotonic() + timeout
    while subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=env, capture_output=True, text=True).stdout.strip():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], env=env)
            pytest.fail(f"SLURM job {job_id} did not finish in {timeout} s")
        time.sleep(0.25)
    shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return dict(field.split("=", 1) for field in shown.split() if "=" in field)


def sbatch(*args: str, env: dict[str, str], cwd: Path) -> str:
    submitted = subprocess.run(["sbatch", "--parsable", *args], env=env, cwd=cwd, capture_output=True, text=True)
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().split(";")[0]


def parameters(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.slow
@pytest.mark.slurm
def test_sbatch_job_trains_like_the_local_command(slurm: dict[str, str], tmp_path: Path) -> None:
    job_id = sbatch("--cpus-per-task=2", str(SBATCH_SCRIPT), *JOB, env=slurm, cwd=tmp_path)
    job = wait_for(job_id, slurm)
    output = (tmp_path / f"decent-train-{job_id}.out").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), output

    run_dir = tmp_path / "outputs" / "slurm" / job_id
    result = json.loads((run_dir / "result.json").read_text())
    assert result["world_size"] == 2 and result["steps"] == 12  # the job's 2 CPUs: 2 workers
    launch = OmegaConf.load(run_dir / "resolved_config.yaml").launch
    head = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    assert launch.rdzv_endpoint == f"{head}:{15000 + int(job_id) % 10000}" and launch.rdzv_id == job_id
    assert f"--rdzv-endpoint={launch.rdzv_endpoint}" in output and "--max-restarts=0" in output

    # The oracle: the same job run by the local command (elastic agent, standalone rendezvous) ends with the same model.
    local = decent_train(*JOB, "launch.nproc_per_node=2", f"hydra.run.dir={tmp_path / 'local'}", cwd=tmp_path)
    check_succeeded(local)
    on_slurm, here = parameters(run_dir / "model.pt"), parameters(tmp_path / "local" / "model.pt")
    assert on_slurm.keys() == here.keys()
    for name in here:
        assert torch.equal(on_slurm[name], here[name]), name


@pytest.mark.slow
@pytest.mark.slurm
def test_sbatch_job_with_a_bad_override_fails_with_the_error(slurm: dict[str, str], tmp_path: Path) -> None:
    job_id = sbatch("--cpus-per-task=1", str(SBATCH_SCRIPT), "topology=tree", env=slurm, cwd=tmp_path)
    job = wait_for(job_id, slurm)
    output = (tmp_path / f"decent-train-{job_id}.out").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("FAILED", "2:0"), output
    assert "decent-train: error: topology=tree is not an option; valid: alternating-exp-ring" in output
    assert not (tmp_path / "outputs" / "slurm" / job_id / "logs").exists()  # no worker started


@pytest.mark.slow
@pytest.mark.slurm
def test_sbatch_job_downloads_the_dataset_on_the_batch_host_before_any_worker(slurm: dict[str, str],
                                                                               tmp_path: Path) -> None:
    """``dataset.download=true``: the script fetches the dataset once, before the workers start, as a local launch
    does. This machine has no route to the dataset's host, so the fetch is seen failing: the job ends with the one
    line naming it and exit 2, and no worker started. Before, nothing downloaded: the dry run accepts a missing
    dataset that is to be downloaded, and every worker then failed on the missing files."""
    job_id = sbatch("--cpus-per-task=1", str(SBATCH_SCRIPT), "steps=12", "eval_every=0", "logger=jsonl",
                    "dataset=cifar10", f"dataset.root={tmp_path / 'cifar'}", "dataset.download=true", env=slurm,
                    cwd=tmp_path)
    job = wait_for(job_id, slurm)
    output = (tmp_path / f"decent-train-{job_id}.out").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("FAILED", "2:0"), output
    assert f"decent-train: error: dataset.download=true could not fetch cifar10 into {tmp_path / 'cifar'}" in output
    assert not (tmp_path / "outputs" / "slurm" / job_id / "logs").exists()  # no worker started


@pytest.mark.slow
@pytest.mark.slurm
def test_submitit_sweep_runs_each_job_on_slurm(slurm: dict[str, str], tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "decent-train"), "-m", "hydra/launcher=slurm", "topology=complete,ring",
         "launch.nproc_per_node=2", "launch.slurm.cpus_per_task=1", "launch.slurm.time_min=5", *JOB,
         f"hydra.sweep.dir={sweep_dir}"],
        env=slurm, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    check_succeeded(proc)
    for job, topology in enumerate(["complete", "ring"]):
        result = json.loads((sweep_dir / str(job) / "result.json").read_text())
        assert (result["topology"], result["world_size"], result["steps"]) == (topology, 2, 12)
    # Each job asked SLURM for what the launch config says.
    (submission,) = sweep_dir.glob(".submitit/*/*_submission.sh")
    script = submission.read_text()
    for line in ("#SBATCH --array=0-1", "#SBATCH --cpus-per-task=1", "#SBATCH --time=5", "#SBATCH --nodes=1",
                 "#SBATCH --ntasks-per-node=1", "#SBATCH --job-name=decent-train"):
        assert line in script, script


@pytest.mark.slow
@pytest.mark.slurm
def test_a_sweep_job_stops_at_submitits_signal_is_requeued_and_ends_as_if_never_stopped(slurm: dict[str, str],
                                                                                         tmp_path: Path) -> None:
    """SIGUSR2 to every process of a sweep's job (``scancel --signal=USR2``: what SLURM sends there 120 s before the
    time limit, ``--signal=USR2@120``, and what submitit's own preemption test sends): the workers stop at one step
    with a checkpoint, submitit requeues the job, and the job continues from it (no step twice) to the very model an
    uninterrupted local run ends with. Before, the workers and the process they are forked from died of it, and
    submitit ended the job ("timed-out too many times", a traceback): no checkpoint, the sweep failed."""
    sweep_dir = tmp_path / "sweep"
    job = ["model=mlp", "steps=3000", "eval_every=0", "logger=jsonl", "logger.progress_bar=false",
           "launch.nproc_per_node=2"]
    sweep = subprocess.Popen(
        [str(Path(sys.executable).parent / "decent-train"), "-m", "hydra/launcher=slurm",
         "launch.slurm.cpus_per_task=2", "launch.slurm.time_min=10", *job, f"hydra.sweep.dir={sweep_dir}"],
        env=slurm, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (sweep_dir / "0" / "metrics.jsonl").exists():
            assert time.monotonic() < deadline and sweep.poll() is None, "the job did not start training"
            time.sleep(0.2)
        queue = subprocess.run(["squeue", "-h", "-o", "%i"], env=slurm, capture_output=True, text=True).stdout
        job_id = queue.split()[0]
        subprocess.run(["scancel", "--signal=USR2", job_id], env=slurm, check=True)
        output, _ = sweep.communicate(timeout=420)  # SLURM holds a requeued job for a while before it runs again
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 0, output
    run_dir = sweep_dir / "0"
    shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=slurm, capture_output=True, text=True).stdout
    assert "Restarts=1" in shown, shown  # requeued once (its state may still read RUNNING as the sweep returns)
    (first_err,) = sweep_dir.glob(".submitit/*/*_0_log.err")  # the job's stderr, the requeued run's appended
    assert "with a checkpoint" in first_err.read_text() and "submitit requeued the job, which continues from it" in \
        first_err.read_text(), first_err.read_text()[-2000:]
    logs = (run_dir / "logs" / "rank0.log").read_text()
    stopped = int(logs.split(": stopping on SIGUSR2")[0].rsplit("step ", 1)[1])
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped:08d}'} (step {stopped})" in logs, logs[-2000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == len(set(steps)) and max(steps) == 3000 and 0 < stopped < 3000
    local = decent_train(*job, f"hydra.run.dir={tmp_path / 'local'}", cwd=tmp_path)  # the oracle: never stopped
    check_succeeded(local)
    on_slurm, here = parameters(run_dir / "model.pt"), parameters(tmp_path / "local" / "model.pt")
    assert on_slurm.keys() == here.keys()
    for name in here:
        assert torch.equal(on_slurm[name], here[name]), name


@pytest.mark.slow
@pytest.mark.slurm
def test_submitit_job_that_fails_ends_the_sweep_with_its_error(slurm: dict[str, str], tmp_path: Path) -> None:
    # Values are checked in the job, on its node (composition errors stop the sweep before any submission).
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "decent-train"), "-m", "hydra/launcher=slurm", "topology=one-peer-exp",
         "launch.nproc_per_node=3", "launch.slurm.cpus_per_task=1", *JOB, f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        env=slurm, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "decent-train: error: topology=one-peer-exp with 3 workers: topology 'one-peer-exp' needs a power-of-two "
        "number of workers (1, 2, 4, 8, ...); got 3"
    )


def script_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env | extra


@pytest.mark.slow
@pytest.mark.parametrize(
    ("per_node", "workers", "device"),
    [({"GPUS_PER_NODE": "8"}, 8, "cuda"), ({}, 2, "cpu")],  # CPU nodes: launch.nproc_per_node=2 overrides the CPUs
)
def test_sbatch_dry_run_checks_and_prints_the_commands_of_every_node(
    tmp_path: Path, per_node: dict[str, str], workers: int, device: str
) -> None:
    args = [] if device == "cuda" else ["launch.nproc_per_node=2"]  # a GPU node: one worker per GPU
    proc = subprocess.run(
        ["bash", str(SBATCH_SCRIPT), "topology=alternating-exp-ring", *args],
        env=script_env(DRY_RUN="1", NODES="4", RUN_DIR=str(tmp_path / "run"), **per_node), cwd=tmp_path,
        capture_output=True, text=True, timeout=120,
    )
    check_succeeded(proc)
    cfg = OmegaConf.load(tmp_path / "run" / "resolved_config.yaml")
    assert (cfg.launch.nnodes, cfg.launch.nproc_per_node, cfg.launch.device) == (4, workers, device)
    assert cfg.dry_run is False  # the file is what the workers run
    assert f"alternating-exp-ring: {4 * workers} workers (4 nodes x {workers})" in proc.stdout
    head = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    command = proc.stdout.split("would run on each node:")[1].split()
    # the node's CPUs asked for its one task (srun does not inherit sbatch's --cpus-per-task on SLURM 22.05-23.02)
    cpus = len(os.sched_getaffinity(0))  # SLURM_CPUS_ON_NODE of the dry run: this host's
    assert command[:5] == ["srun", "--nodes=4", "--ntasks-per-node=1", f"--cpus-per-task={cpus}", "--kill-on-bad-exit=1"]
    assert command[-9:] == [
        "--nnodes=4", f"--nproc-per-node={workers}", "--rdzv-backend=c10d", f"--rdzv-endpoint={head}:15000", "--rdzv-id=0",
        "--max-restarts=0", "-m", "decent_train.worker", str(tmp_path / "run" / "resolved_config.yaml"),
    ]
    assert not (tmp_path / "run" / "logs").exists()


def test_sbatch_script_outside_a_job_says_how_to_run_it(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(SBATCH_SCRIPT)], env=script_env(), cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 2 and "not inside a SLURM job" in proc.stderr
    assert not (tmp_path / "outputs").exists()


def fake_scontrol(directory: Path, body: str) -> dict[str, str]:
    directory.mkdir()
    scontrol = directory / "scontrol"
    scontrol.write_text(f"#!/bin/sh\n{body}\n")
    scontrol.chmod(0o755)
    return {"PATH": f"{directory}{os.pathsep}{os.environ['PATH']}"}


def test_slurm_rendezvous_is_the_first_node_and_a_port_from_the_job_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from decent_train.launcher.launch import slurm_rendezvous

    env = fake_scontrol(tmp_path / "bin", 'case "$1 $2 $3" in "show hostnames gpu[07-08]") printf "gpu07\\ngpu08\\n";; '
                                          '"show hostnames gpu[08-09]") printf "gpu08\\ngpu09\\n";; *) exit 1;; esac')
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-08]")
    assert slurm_rendezvous() == ("gpu07:18456", "123456")  # 15000 + 123456 % 10000
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[08-09]")  # a step on part of the job's nodes: its own first
    assert slurm_rendezvous() == ("gpu08:18456", "123456")


@pytest.mark.parametrize("body", ["exit 1", "true"])
def test_slurm_rendezvous_never_falls_back_to_localhost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    from decent_train.launcher.launch import slurm_rendezvous

    monkeypatch.setenv("PATH", fake_scontrol(tmp_path / "bin", body)["PATH"])
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    with pytest.raises(ValueError, match=r"SLURM job 7: cannot find its first node .*node\[1-2\].*launch.rdzv_endpoint"):
        slurm_rendezvous()
