"""End-to-end: the installed ``decent-train`` command, run from a directory outside the checkout.

Kept few, since each launch starts real torchrun workers (10-20 s on a 2-core machine).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from omegaconf import OmegaConf

from decent_train.components.data import build_datasets
from decent_train.components.models import build_model
from decent_train.config import load_config

from .jobs import COMMAND, check_succeeded, decent_train, records, start

QUIET = ["logger.progress_bar=false"]
SMALL = ["launch.nproc_per_node=2", "model=mlp", "steps=10", *QUIET]


@pytest.mark.slow
def test_default_job_shortened(tmp_path: Path) -> None:
    """The default job (digits, 4 workers, ring, AccumAdamW, CNN), shortened to 40 steps."""
    run_dir = tmp_path / "run"
    proc = decent_train("steps=40", "eval_every=20", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    check_succeeded(proc)
    assert f"outputs: {run_dir}" in proc.stdout and "eval/accuracy" in proc.stdout

    cfg = load_config(run_dir / "resolved_config.yaml")
    assert (cfg.algorithm.name, cfg.topology.name, cfg.optim.name, cfg.dataset.name) == ("decentralized", "ring", "accum_adamw", "digits")
    assert cfg.launch.world_size == 4 and cfg.run.output_dir == str(run_dir)

    logged = records(run_dir)
    assert [r["step"] for r in logged] == [10, 20, 30, 40]
    assert all(np.isfinite(r["train/loss"]) for r in logged)
    assert [r["step"] for r in logged if "eval/accuracy" in r] == [20, 40]
    assert logged[-1]["train/loss"] < logged[0]["train/loss"]
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [f"rank{r}.log" for r in range(4)]

    result = json.loads((run_dir / "result.json").read_text())
    assert result["eval/accuracy"] == logged[-1]["eval/accuracy"] and result["wall_time_s"] > 0
    # The saved averaged model is a plain state_dict of the bare model; evaluated here, it gives the reported accuracy.
    data = build_datasets(cfg.dataset)
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    model.load_state_dict(torch.load(run_dir / "model.pt"))
    model.eval()
    x, y = data.test.tensors
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).double().mean().item()
    assert acc == pytest.approx(result["eval/accuracy"], abs=1e-12)
    assert acc > 0.5  # 10 classes: chance is 0.1


@pytest.mark.slow
def test_multirun_of_three_topologies(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = decent_train("-m", "topology=complete,ring,one-peer-exp", *SMALL, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    check_succeeded(proc)
    for num, topology in enumerate(["complete", "ring", "one-peer-exp"]):
        run_dir = sweep / str(num)
        cfg = load_config(run_dir / "resolved_config.yaml")
        assert cfg.topology.name == topology and cfg.run.choices["topology"] == topology
        assert cfg.run.job_num == num and cfg.run.sweep_dir == str(sweep)
        result = json.loads((run_dir / "result.json").read_text())
        assert result["topology"] == topology and result["steps"] == 10
        assert records(run_dir)[-1]["eval/accuracy"] == result["eval/accuracy"]
        assert any("consensus/distance" in r for r in records(run_dir))

    plot = subprocess.run([str(COMMAND) + "-plot", str(sweep)], capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr
    charts = sorted(p.name for p in (sweep / "plots").glob("*.png"))
    assert charts == sorted(
        f"{what}_vs_{axis}.png" for what in ("loss", "accuracy", "consensus") for axis in ("step", "time")
    ) + ["throughput.png"]
    for chart in charts:
        with Image.open(sweep / "plots" / chart) as image:
            image.verify()
            assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


@pytest.mark.slow
def test_allreduce(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    check_succeeded(decent_train("algorithm=allreduce", *SMALL, f"hydra.run.dir={run_dir}", cwd=tmp_path))
    result = json.loads((run_dir / "result.json").read_text())
    assert result["algorithm"] == "allreduce" and result["topology"] is None and result["world_size"] == 2


@pytest.mark.slow
def test_crashing_worker_fails_the_command_with_its_error(tmp_path: Path) -> None:
    # The preflight reads the arrays' headers and the labels, not the samples: a flipped byte in x's data (its
    # CRC no longer matches) passes it, and fails the worker that reads x whole.
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    marker = np.float64(1234.5678)
    for split in ("train", "test"):
        path = data_dir / f"{split}.npz"
        np.savez(path, x=np.full((4, 4096), marker), y=np.arange(4) % 2)  # x past the header's first read
        raw = bytearray(path.read_bytes())
        at = raw.rfind(marker.tobytes())  # x's last sample
        raw[at] ^= 0xFF
        path.write_bytes(bytes(raw))
    run_dir = tmp_path / "run"
    proc = decent_train("dataset=npz", f"dataset.root={data_dir}", *SMALL, "batch_size=2", f"hydra.run.dir={run_dir}",
                        cwd=tmp_path)  # 2 samples a worker: the preflight lets it through to the worker
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("decent-train: error: worker rank") and "CRC" in last
    assert "Traceback" in proc.stderr and "_load_npz" in proc.stderr  # the worker's traceback, shown once
    assert proc.stderr.count("Traceback") == 1
    assert "CRC" in (run_dir / "logs" / "rank0.log").read_text()


BAD_INPUTS = {
    "unknown option": (["topology=rng"], ["topology=rng", "complete, hierarchical, one-peer-exp, ring"]),
    "unknown key": (["optim.lrr=0.1"], ["optim.lrr", "lr, weight_decay"]),
    "wrong type": (["seed=abc"], ["seed", "abc"]),
    "topology vs workers": (["topology=one-peer-exp", "launch.nproc_per_node=3"], ["one-peer-exp", "3 workers"]),
    "no workers": (["launch.nproc_per_node=0"], ["launch.nproc_per_node=0"]),
    "missing dataset dir": (["dataset=npz", "dataset.root=/no/such/dir"], ["/no/such/dir", "train.npz"]),
    "unknown algorithm": (["algorithm=gossip"], ["algorithm=gossip", "allreduce, decentralized, diloco, localsgd"]),
    "fragments not dividing sync_every": (["algorithm=diloco", "algorithm.fragments=3"],
                                          ["sync_every=10 is not a multiple of fragments=3"]),
    "more fragments than tensors": (["algorithm=localsgd", "algorithm.sync_every=20", "algorithm.fragments=10"],
                                    ["algorithm.fragments=10", "8 trainable parameter tensors"]),
    "option of another algorithm": (["algorithm.sync_every=5"], [
        "algorithm.sync_every is not a key", "option of algorithm=diloco|localsgd", "++algorithm.sync_every=",
    ]),
    "allreduce with compression": (["algorithm=allreduce", "compression=int8"], ["compression=int8 compresses gossip"]),
    "phases with diloco": (["algorithm=diloco", "phases=[{algorithm:allreduce,steps:5},{}]"],
                           ["leave algorithm=decentralized (not 'diloco')"]),
    **({"cuda without a GPU": (["launch=gpu"], ["launch.device=cuda", "launch.device=cpu"]),
        "a live coordinator without a GPU": (["launch=gpu", "fault_tolerance=live", "fault_tolerance.role=coordinator",
                                              "launch.rdzv_endpoint=127.0.0.1:29397"],
                                             ["fault_tolerance.role=coordinator with launch.device=cuda",
                                              "set launch.nproc_per_node"]),
        # a login node checks a job for GPU nodes: it would check (and print the command of) one worker
        "a GPU job dry run without a GPU": (["launch=gpu", "dry_run=true"],
                                              ["dry_run=true with launch.device=cuda", "set launch.nproc_per_node"])}
       if not torch.cuda.is_available() else {}),
    "engine environment": ([], ["DECENT_TRAIN_COMPILED_INT8='yes'", "auto, always, never"]),
    "unresolvable rendezvous host": (  # .invalid never resolves (RFC 2606); torch's client would retry it for 60 s
        ["launch.nnodes=2", "launch.rdzv_endpoint=no-such-host.invalid:29500", "launch.rdzv_id=t"],
        ["launch.rdzv_endpoint=no-such-host.invalid:29500", "cannot resolve the host 'no-such-host.invalid'"]),
    "an empty resume": (["resume="], ["resume= is empty", "give resume=RUN_DIR"]),  # it checked the working dir
    "a launcher fact": (["run.job_num=3"], ["run.job_num=3: run.* are the launcher's facts"]),  # was overwritten
    "rendezvous port": (["launch.nnodes=2", "launch.rdzv_endpoint=node1:99999", "launch.rdzv_id=t"],
                        ["launch.rdzv_endpoint=node1:99999", "is not an endpoint", "a port in 1..65535"]),
}
BAD_ENVIRONMENT = {"engine environment": {"DECENT_TRAIN_COMPILED_INT8": "yes"}}


@pytest.mark.slow
def test_several_nodes_must_name_one_run_directory(tmp_path: Path) -> None:
    """Each node runs its own ``decent-train``; with ``hydra.run.dir`` from the clock (the default) each would write
    into a directory of its own: the checkpoints split between them (a two-node run on localhost showed it, and the
    second node's launcher ended in a traceback, finding no result). Refused in one line, before any worker, and no
    run directory is left; the same command naming a directory passes (a dry run)."""
    several = ["launch.nnodes=2", "launch.rdzv_endpoint=localhost:29400", "launch.rdzv_id=job7", "dry_run=true"]
    refused = decent_train(*several, cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("decent-train: error: launch.nnodes=2 with hydra.run.dir=outputs/"
                                                   "${now:%Y-%m-%d}/${now:%H-%M-%S}"), refused.stderr
    assert "set hydra.run.dir=/shared/PATH, the same on every node" in lines[0]
    assert not [p for p in (tmp_path / "outputs").rglob("*") if p.is_file()]
    check_succeeded(decent_train(*several, f"hydra.run.dir={tmp_path / 'shared'}", cwd=tmp_path))
    one_node = decent_train("launch.nnodes=1", "dry_run=true", cwd=tmp_path)  # the clock's directory is fine on one
    check_succeeded(one_node)


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.Popen[str], str, str, Path]]:
    """Every bad command at once (each costs an interpreter start, not a launch)."""
    root = tmp_path_factory.mktemp("bad")
    runs = {}
    for name, (args, _) in BAD_INPUTS.items():
        run_dir = root / name.replace(" ", "_")
        runs[name] = (start(*args, f"hydra.run.dir={run_dir}", cwd=root, env=BAD_ENVIRONMENT.get(name)), run_dir)
    return {name: (*proc.communicate(timeout=120), proc.returncode, run_dir) for name, (proc, run_dir) in runs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line_before_any_worker(case: str, bad_input_runs: dict) -> None:
    stdout, stderr, returncode, run_dir = bad_input_runs[case]
    assert returncode == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("decent-train: error: "), stderr
    for expected in BAD_INPUTS[case][1]:
        assert expected in lines[0]
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())  # not even Hydra's .hydra/ copy


@pytest.mark.slow
def test_dry_run_prints_topology_and_command(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = decent_train("dry_run=true", "topology=one-peer-exp", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    check_succeeded(proc)
    config_path = run_dir / "resolved_config.yaml"
    assert "one-peer-exp: 4 workers" in proc.stdout and "round 1: (0,2) (1,3)" in proc.stdout
    assert f"torchrun --standalone --nproc-per-node=4 --max-restarts=0 --monitor-interval=0.1 -m decent_train.worker {config_path}" in proc.stdout
    assert OmegaConf.load(config_path).topology.name == "one-peer-exp"
    assert not (run_dir / "logs").exists() and not (run_dir / "metrics.jsonl").exists()


@pytest.mark.parametrize(("sweep", "refused"), [
    (["steps=20,-1", "launch.nproc_per_node=2"], "job 1 of the sweep (steps=-1 launch.nproc_per_node=2 model=mlp"),
    (["launch.nproc_per_node=2,3", "topology=one-peer-exp"], "job 1 of the sweep (launch.nproc_per_node=3 "),
])
def test_a_sweep_job_that_would_be_refused_stops_the_sweep_before_any_trains(tmp_path: Path, sweep: list[str],
                                                                             refused: str) -> None:
    """Hydra's launcher runs a sweep's jobs one after another; before, a value job k refuses was found only once
    jobs 0..k-1 had trained (hours, in a real sweep). Job 0 checks every job first (launcher/sweep_check.py)."""
    sweep_dir = tmp_path / "sweep"
    proc = decent_train("-m", *sweep, "model=mlp", "logger=jsonl", f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1].startswith(f"decent-train: error: {refused}"), proc.stderr
    assert lines[-1].endswith("; no job has trained") and "Traceback" not in proc.stderr
    assert not sweep_dir.exists()  # nothing of it is left: not even Hydra's multirun.yaml


def test_refused_commands_leave_no_folders_named_from_the_clock(tmp_path: Path) -> None:
    """Hydra makes outputs/DATE/TIME (a sweep: multirun/DATE/TIME with its multirun.yaml) before the job's checks;
    a refused command removed only TIME, leaving a dated folder per mistake. Folders the user named are kept."""
    (tmp_path / "mine").mkdir()
    for args in (["steps=-1"], ["-m", "steps=5,-1", "dry_run=true"], ["steps=-1", "hydra.run.dir=mine/run"]):
        assert decent_train(*args, cwd=tmp_path).returncode == 2
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == ["mine", "multirun", "outputs"], left


def test_a_sweep_with_a_run_directory_is_one_line(tmp_path: Path) -> None:
    """``-m ... hydra.run.dir=X``: Hydra ignores it and writes the jobs under multirun/DATE/TIME, where the user does
    not look. Refused, naming the key to give; nothing is written."""
    proc = decent_train("-m", "steps=5,6", "dry_run=true", f"hydra.run.dir={tmp_path / 'x'}", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"decent-train: error: hydra.run.dir={tmp_path / 'x'} with -m: a sweep's jobs go into hydra.sweep.dir/<job "
        f"number>; give hydra.sweep.dir={tmp_path / 'x'}"), proc.stderr
    assert [p.name for p in tmp_path.rglob("*")] == ["multirun"]  # (empty: Hydra makes it before the job)


@pytest.mark.slow
def test_a_sweep_over_algorithms_sets_their_options_with_plus_plus(tmp_path: Path) -> None:
    """``-m algorithm=diloco,localsgd ++algorithm.sync_every=5``: both jobs get the option (the plain override fails,
    with the hint, in the case above: Hydra composes the sweep's base config with the default algorithm)."""
    sweep_dir = tmp_path / "sweep"
    proc = decent_train("-m", "algorithm=diloco,localsgd", "++algorithm.sync_every=5", "dry_run=true",
                        f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
    check_succeeded(proc)
    configs = [load_config(sweep_dir / str(k) / "resolved_config.yaml") for k in range(2)]
    assert [(c.algorithm.name, c.algorithm.sync_every) for c in configs] == [("diloco", 5), ("localsgd", 5)]
