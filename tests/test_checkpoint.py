"""Checkpoints, exact resume and worker failures.

Oracles: an uninterrupted run of the same config (resume must end with exactly its parameters), the replay of the
engine's recurrence, and the data stream itself (which step first meets a poisoned sample).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from decent_train import DecentralizedDataParallel, lr_scheduler_fn_cosine_with_warmup
from decent_train.components.checkpoint import complete_checkpoints
from decent_train.components.data import build_datasets
from decent_train.config import DIVERGED_FILE, MODEL_FILE, RESULT_FILE
from decent_train.launcher.preflight import preflight
from decent_train.engine.ddp import ExchangeError
from decent_train.engine.optimizers import optim_fn_accum_adamw
from decent_train.engine.comm import peers_must_answer

from .distributed import WorkerError, run_workers
from .replay import loss_fn, make_model, replay, snapshot, topology_for
from .jobs import COMMAND, WORLD, check_succeeded, decent_train, make_cfg, records, train_on_cpu, worker_pids

ADAMW = partial(optim_fn_accum_adamw, lr=0.01, accum_iter=2, weight_decay=0.1)
SCHEDULE = partial(lr_scheduler_fn_cosine_with_warmup, t_max=12, t_warmup=3)


# -- the engine ------------------------------------------------------------------------------------------------------
def _interrupted_engine_run(rank: int, world: int, topology: str, first: int, then: int, **kwargs: Any) -> dict:
    """``first`` steps, then the state moves into a new engine around a new model (as a restarted worker builds it)."""
    def engine(seed: int) -> DecentralizedDataParallel:
        return DecentralizedDataParallel(
            make_model(seed), ADAMW, SCHEDULE, topology=topology, bucket_size_in_mb=0.0005, **kwargs
        )

    old = engine(1000 + rank)
    for s in range(first):
        loss_fn(old, rank, s).backward()
    model_state, engine_state = old.state_dict(), old.engine_state_dict()
    model_state = {k: v.clone() for k, v in model_state.items()}  # what torch.save would keep
    new = engine(5000 + rank)  # another init: everything must come from the checkpoint
    new.load_state_dict(model_state)
    new.load_engine_state_dict(engine_state)
    for s in range(first, first + then):
        loss_fn(new, rank, s).backward()
    return {"params": snapshot(new), "step": new.step_count}


@pytest.mark.parametrize(
    ("topology", "world", "kwargs"),
    [("ring", 4, {}), ("complete", 3, {"param_as_bucket_view": False}), ("one-peer-exp", 4, {})],
)
def test_engine_state_continues_exactly(topology: str, world: int, kwargs: dict) -> None:
    """After k steps an exchange is in flight (pairs: a send/receive; 3: an all-reduce); its data must be carried."""
    results = run_workers(_interrupted_engine_run, world, topology, 5, 7, **kwargs)
    expected = replay(topology_for(topology, world), 12, optim_fn=ADAMW, lr_scheduler_fn=SCHEDULE)
    for rank, (result, want) in enumerate(zip(results, expected)):
        assert result["step"] == 12
        for name in want:
            torch.testing.assert_close(result["params"][name], want[name], rtol=0, atol=1e-12, msg=f"rank {rank} {name}")


def _load_into_other_buckets(rank: int, world: int) -> str:
    a = DecentralizedDataParallel(make_model(1), ADAMW, topology="ring", bucket_size_in_mb=0.0005)
    b = DecentralizedDataParallel(make_model(1), ADAMW, topology="ring", bucket_size_in_mb=25)
    with pytest.raises(ValueError, match="buckets hold other parameters") as error:
        b.load_engine_state_dict(a.engine_state_dict())
    c = DecentralizedDataParallel(make_model(1), ADAMW, topology="complete", bucket_size_in_mb=0.0005)
    with pytest.raises(ValueError, match="from 2 workers with 'ring: 2 workers"):
        c.load_engine_state_dict(a.engine_state_dict())
    return str(error.value)


def test_engine_state_of_another_layout_is_refused() -> None:
    run_workers(_load_into_other_buckets, 2)


# -- a hanging peer --------------------------------------------------------------------------------------------------
def _hang_worker(rank: int, workdir: str, result: str) -> None:
    dist.init_process_group(
        "gloo", store=dist.FileStore(os.path.join(workdir, "store"), 2), rank=rank, world_size=2,
        timeout=timedelta(seconds=30),
    )
    engine = DecentralizedDataParallel(make_model(0), ADAMW, topology="ring", timeout=1.0)
    loss_fn(engine, rank, 0).backward()  # launches the exchange of step 1
    if rank == 1:
        time.sleep(20)  # hangs: never sends again
        os._exit(0)
    loss_fn(engine, rank, 1).backward()  # mixes step 0's exchange, launches step 1's
    start = time.monotonic()
    try:
        loss_fn(engine, rank, 2).backward()  # waits for rank 1's step-1 values, which never come
        message = "no error"
    except ExchangeError as error:
        message = str(error)
    Path(result).write_text(json.dumps({"message": message, "seconds": time.monotonic() - start}))
    os._exit(0)


def _rank0_outcome_with_rank1_hanging(worker: Callable[..., None], *args: Any) -> dict[str, Any]:
    """Run ``worker(rank, workdir, result_file, *args)`` on 2 forked ranks; rank 1 hangs and is killed once rank 0 has
    written what happened to it."""
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as workdir:
        result = os.path.join(workdir, "result.json")
        procs = [ctx.Process(target=worker, args=(r, workdir, result, *args)) for r in range(2)]
        for p in procs:
            p.start()
        procs[0].join(timeout=60)
        procs[1].kill()
        procs[1].join()
        return json.loads(Path(result).read_text())


def test_a_hanging_peer_is_an_error_after_the_timeout() -> None:
    outcome = _rank0_outcome_with_rank1_hanging(_hang_worker)
    assert outcome["message"].startswith(
        "rank 0: the exchange of bucket 0 with rank(s) [1] at step 2 failed (a peer hangs or died, limit 1 s): "
    )
    assert "Timed out" in outcome["message"]  # gloo's words: the wait ended by the limit, not by a lost connection
    assert 0.9 < outcome["seconds"] < 10


def _collective_hang_worker(rank: int, workdir: str, result: str, collective: str) -> None:
    dist.init_process_group(
        "gloo", store=dist.FileStore(os.path.join(workdir, "store"), 2), rank=rank, world_size=2,
        timeout=timedelta(seconds=1),
    )
    if rank == 1:
        time.sleep(20)  # hangs: never joins the collective
        os._exit(0)
    try:
        with peers_must_answer(f"the {collective}"):
            if collective == "barrier":
                dist.barrier()
            else:
                dist.all_gather_object([None, None], {"file": "rank0.pt"})
        message = "no error"
    except ExchangeError as error:
        message = str(error)
    Path(result).write_text(json.dumps({"message": message}))
    os._exit(0)


@pytest.mark.parametrize("collective", ["barrier", "all_gather_object"])
def test_a_collective_with_a_hanging_peer_fails_with_one_line_naming_it(collective: str) -> None:
    """The worker's own collectives (checkpoint, statistics, evaluation) say what hung, as the engine's exchange does."""
    outcome = _rank0_outcome_with_rank1_hanging(_collective_hang_worker, collective)
    assert outcome["message"].startswith(f"rank 0: the {collective} failed (a peer hangs or died): ")
    assert "Timed out" in outcome["message"] and "\n" not in outcome["message"]


# -- the worker: exact resume, corrupt files, mismatch, NaN ----------------------------------------------------------
CHECKPOINTED = {
    "steps": 9, "eval_every": 0, "checkpoint": {"every": 3, "keep": 5}, "logger": {"log_every": 3, "consensus_every": 0}
}  # records on checkpoint steps: a resumed run logs the same windows
TIMING = ("time/", "throughput/", "memory/")


def _run(cfg: Any) -> dict[str, Any]:
    return run_workers(train_on_cpu, WORLD, cfg)[0]


def _same_params(a: Path, b: Path) -> None:
    left, right = torch.load(a / MODEL_FILE), torch.load(b / MODEL_FILE)
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), name


def _measured(run_dir: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records(run_dir)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    _run(make_cfg(run_dir, **CHECKPOINTED))
    return run_dir


def _crash_after(run_dir: Path, source: Path, step: int) -> None:
    """``run_dir`` as a run that died after writing the checkpoint of ``step`` (and a later, partial one)."""
    shutil.copytree(source / "checkpoints", run_dir / "checkpoints")
    for checkpoint in complete_checkpoints(run_dir):
        if checkpoint.step > step:
            shutil.rmtree(checkpoint.path)
    partial_dir = run_dir / "checkpoints" / f"step_{step + 3:08d}"
    partial_dir.mkdir()
    (partial_dir / "rank0.pt").write_bytes(b"cut short")  # no manifest: never used
    kept = [line for line in (source / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= step + 2]
    (run_dir / "metrics.jsonl").write_text("\n".join(kept) + '\n{"step": 1')  # and a record cut short


def test_restarted_run_ends_with_the_uninterrupted_parameters(uninterrupted: Path, tmp_path: Path) -> None:
    assert [c.step for c in complete_checkpoints(uninterrupted)] == [9, 6, 3]
    _crash_after(tmp_path, uninterrupted, 3)
    result = _run(make_cfg(tmp_path, **CHECKPOINTED))
    assert result["resumed_from_step"] == 3
    _same_params(tmp_path, uninterrupted)
    assert _measured(tmp_path) == _measured(uninterrupted)  # the same losses, step by step, no duplicate records


@pytest.mark.parametrize("algorithm", ["decentralized", "allreduce"])
def test_fp16_run_resumes_exactly(tmp_path: Path, algorithm: str) -> None:
    # The GradScaler's scale and growth tracker are part of the state; decentralized: with whole-model clipping.
    config = {**CHECKPOINTED, "algorithm": algorithm, "precision": "fp16", "grad_clip_norm": 0.5}
    _run(make_cfg(tmp_path / "whole", **config))
    _crash_after(tmp_path / "resumed", tmp_path / "whole", 6)
    assert _run(make_cfg(tmp_path / "resumed", **config))["resumed_from_step"] == 6
    _same_params(tmp_path / "resumed", tmp_path / "whole")
    assert _measured(tmp_path / "resumed") == _measured(tmp_path / "whole")


def test_resume_from_another_run_dir(uninterrupted: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    _crash_after(source, uninterrupted, 6)
    result = _run(make_cfg(tmp_path / "new", **CHECKPOINTED, resume=str(source)))
    assert result["resumed_from_step"] == 6
    _same_params(tmp_path / "new", uninterrupted)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_checkpoint_falls_back_to_the_one_before(uninterrupted: Path, tmp_path: Path, damage: str) -> None:
    _crash_after(tmp_path, uninterrupted, 6)
    rank1 = tmp_path / "checkpoints" / "step_00000006" / "rank1.pt"
    data = bytearray(rank1.read_bytes())
    if damage == "truncate":
        del data[len(data) // 2 :]
    else:
        data[len(data) // 2] ^= 0xFF
    rank1.write_bytes(bytes(data))
    result = _run(make_cfg(tmp_path, **CHECKPOINTED))
    assert result["resumed_from_step"] == 3  # every rank fell back, not only rank 1
    _same_params(tmp_path, uninterrupted)


def test_checkpoint_of_another_topology_is_refused(uninterrupted: Path, tmp_path: Path) -> None:
    """Another world size is welcome (the workers start from the average), another topology is not."""
    preflight(make_cfg(Path("/unused"), resume=str(uninterrupted), launch={"nproc_per_node": 4}))
    with pytest.raises(ValueError, match=r"was written by 2 workers with topology 'ring: 2 workers \(1 nodes x 2\)'; "
                                         r"this run has 4 workers with 'complete: 4 workers \(1 nodes x 4\)': resume "
                                         r"with the same topology$"):
        preflight(make_cfg(Path("/unused"), resume=str(uninterrupted), launch={"nproc_per_node": 4},
                           topology={"name": "complete"}))
    with pytest.raises(ValueError, match=r"this run has 2 workers with 'ring: 2 workers \(2 nodes x 1\)': resume with "
                                         r"the same topology, launch.nnodes and launch.nproc_per_node \(or "
                                         r"another number of workers, which starts from the saved workers' "
                                         r"average\)$"):
        preflight(make_cfg(Path("/unused"), resume=str(uninterrupted), topology={"local_world_size": 1}))
    with pytest.raises(ValueError, match=r"this run has 2 workers with 'allreduce'"):
        preflight(make_cfg(Path("/unused"), resume=str(uninterrupted), algorithm="allreduce"))
    with pytest.raises(ValueError, match=r"^resume=/no/such/run: no such directory; "):
        preflight(make_cfg(Path("/unused"), resume="/no/such/run"))
    with pytest.raises(ValueError, match=rf"^resume={tmp_path} holds no complete checkpoint"):  # there, but empty
        preflight(make_cfg(Path("/unused"), resume=str(tmp_path)))


def test_checkpoint_of_another_model_is_refused_by_name(uninterrupted: Path, tmp_path: Path) -> None:
    """Another model's settings: the launcher says which before any worker starts. Another dataset under the same
    settings (the input size differs): the worker names the first tensor that does not fit."""
    with pytest.raises(ValueError, match=r"holds another model \(model.hidden_sizes=\[32\] there, \[64\] here\): "):
        preflight(make_cfg(Path("/unused"), resume=str(uninterrupted), model={"hidden_sizes": [64]}))
    preflight(make_cfg(Path("/unused"), resume=str(uninterrupted), model={"dropout": 0.1}))  # dropout shapes nothing
    other_data = make_cfg(tmp_path, **CHECKPOINTED, resume=str(uninterrupted),
                          dataset={"name": "synthetic", "input_shape": [1, 4, 4], "num_samples": 256})
    first = next(iter(torch.load(uninterrupted / MODEL_FILE)))  # the model's first tensor: the input layer's weight
    with pytest.raises(WorkerError, match=rf"ValueError: .*step_00000009 holds another model: {re.escape(first)} is "
                                          r"of shape \[32, 64\] there and of shape \[32, 16\] here; "):
        run_workers(train_on_cpu, WORLD, other_data)


@pytest.mark.slow
def test_launcher_refuses_a_mismatched_resume_before_any_worker(uninterrupted: Path, tmp_path: Path) -> None:
    proc = decent_train(f"resume={uninterrupted}", "launch.nproc_per_node=4", "topology=complete",
                        f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"decent-train: error: resume={uninterrupted}: ") and "this run has 4 workers" in line
    assert not (tmp_path / "run" / "logs").exists()


POISONED = {"steps": 12, "eval_every": 0, "checkpoint": {"every": 2, "keep": 10}, "batch_size": 4, "accum_steps": 1}


def _poisoned_data(root: Path) -> dict[str, Any]:
    """An npz dataset with one NaN in sample 37 (met mid-run with ``POISONED``); its dataset config."""
    root.mkdir()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(96, 6)).astype(np.float32), rng.integers(0, 3, 96)
    x[37, 0] = np.nan
    np.savez(root / "train.npz", x=x, y=y)
    np.savez(root / "test.npz", x=x[:10], y=y[:10])
    return {"name": "npz", "root": str(root)}


def test_nan_loss_stops_naming_the_step_and_keeps_the_good_checkpoints(tmp_path: Path) -> None:
    dataset = _poisoned_data(tmp_path / "data")
    cfg = make_cfg(tmp_path / "run", **POISONED, model={"name": "mlp"}, dataset=dataset)
    # The oracle: the first step whose micro-batch (on any worker) holds the poisoned sample.
    data = build_datasets(cfg.dataset)
    first = min(
        m + 1
        for rank in range(WORLD)
        for m, (xb, _) in zip(range(cfg.steps), data.train_batches(cfg.batch_size, rank, WORLD, cfg.seed))
        if torch.isnan(xb).any()
    )
    assert 2 < first <= cfg.steps, "the poisoned sample must be met mid-run for this test"
    with pytest.raises(WorkerError, match=rf"NonFiniteLoss: train/loss is NaN or infinite from step {first} on"):
        run_workers(train_on_cpu, WORLD, cfg)
    steps = [c.step for c in complete_checkpoints(tmp_path / "run")]
    assert steps == [s for s in range(cfg.steps, 0, -1) if s % 2 == 0 and s < first]
    assert not (tmp_path / "run" / RESULT_FILE).exists()
    why = (tmp_path / "run" / DIVERGED_FILE).read_text()
    assert why.startswith(f"train/loss is NaN or infinite from step {first} on")


@pytest.mark.slow
def test_restarted_workers_do_not_train_into_the_same_nan_again(tmp_path: Path) -> None:
    """With launch.max_restarts the agent restarts the workers after a NaN: they stop at once, naming it."""
    dataset = _poisoned_data(tmp_path / "data")
    flat = [f"{k}={v}" for k, v in POISONED.items() if k != "checkpoint"] + ["checkpoint.every=2", "checkpoint.keep=10"]
    proc = decent_train(*flat, "model=mlp", "dataset=npz", f"dataset.root={dataset['root']}", "launch.max_restarts=2",
                        "launch.nproc_per_node=2", "seed=7", "logger=jsonl", "logger.progress_bar=false",
                        f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode != 0
    assert "train/loss is NaN or infinite from step" in proc.stderr
    assert "(in an earlier attempt; restarts do not train again)" in proc.stderr
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()  # appended to by every attempt
    assert log.count("model/parameters") == 1  # only the first attempt built its job and trained
    assert "resumed from" not in log


# -- a worker killed or hanging mid-run, end to end -----------------------------------------------------------------------------
def _hang(run_dir: Path, pid: int) -> None:
    """Freeze a worker until a neighbour's exchange times out (the error is in its log), then let it go on: the agent
    has asked it to terminate by then."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if "a peer hangs or died" in (run_dir / "logs" / "rank0.log").read_text():
            break
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):  # the agent may have killed it already: it never answers a SIGTERM
        os.kill(pid, signal.SIGCONT)


FAULTS = {"killed": lambda run_dir, pid: os.kill(pid, signal.SIGKILL), "hanging": _hang}


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(FAULTS))
def test_failed_worker_restarts_and_ends_like_an_uninterrupted_run(tmp_path: Path, fault: str) -> None:
    """Rank 1 is killed, or hangs until rank 0's exchange times out: the agent restarts both from the checkpoint."""
    job = ["steps=600", "eval_every=0", "logger=jsonl", "logger.progress_bar=false", "logger.consensus_every=0",
           "checkpoint.every=40", "launch.max_restarts=1", "launch.nproc_per_node=2", "model=mlp", "comm_timeout_s=4",
           "pg_timeout_s=6"]  # rank 0 may be caught in a checkpoint's barrier (the process group's limit) too
    failed_dir = tmp_path / fault
    proc = subprocess.Popen([str(COMMAND), *job, f"hydra.run.dir={failed_dir}"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, victim = time.monotonic() + 120, None
    while time.monotonic() < deadline and proc.poll() is None:
        if complete_checkpoints(failed_dir):
            victim = worker_pids(failed_dir).get(1)
            if victim:
                FAULTS[fault](failed_dir, victim)
                break
        time.sleep(0.01)
    stdout, stderr = proc.communicate(timeout=300)
    assert victim is not None, f"the run ended before a worker could fail\n{stderr}"
    assert proc.returncode == 0, stderr
    result = json.loads((failed_dir / RESULT_FILE).read_text())
    assert 40 <= result["resumed_from_step"] < 600
    if fault == "hanging":  # a time limit ended the first attempt: of an exchange or of a collective (a checkpoint's
        log = (failed_dir / "logs" / "rank0.log").read_text()  # barrier), whichever rank 0 was waiting in
        assert "failed (a peer hangs or died" in log and "Timed out" in log

    clean = decent_train(*job, f"hydra.run.dir={tmp_path / 'clean'}", cwd=tmp_path)
    check_succeeded(clean)
    _same_params(failed_dir, tmp_path / "clean")
    assert _measured(failed_dir) == _measured(tmp_path / "clean")


# -- phases ----------------------------------------------------------------------------------------------------------
PHASED = {
    **CHECKPOINTED,
    "checkpoint": {"every": 2, "keep": 5},
    "phases": [{"algorithm": "allreduce", "steps": 4}, {"topology": "ring", "steps": 3}, {"algorithm": "allreduce"}],
}  # checkpoints at 2, 4 (the last all-reduce step), 6 (inside ring: an exchange in flight), 8 and 9


@pytest.mark.parametrize("crash_after", [4, 6])
def test_phased_run_resumes_exactly_at_and_inside_a_phase(tmp_path: Path, crash_after: int) -> None:
    """The engine is rebuilt in the phase the checkpoint was taken in, and enters the next phase at the same step."""
    whole = tmp_path / "whole"
    _run(make_cfg(whole, **PHASED))
    resumed = tmp_path / "resumed"
    _crash_after(resumed, whole, crash_after)
    assert _run(make_cfg(resumed, **PHASED))["resumed_from_step"] == crash_after
    _same_params(resumed, whole)
    assert _measured(resumed) == _measured(whole)
    assert {r["step"]: r["phase"] for r in records(whole)} == {3: 0, 4: 0, 6: 1, 7: 1, 9: 2}


def test_a_checkpoint_from_another_phase_plan_is_refused(uninterrupted: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="phases: allreduce from step 0"):
        preflight(make_cfg(tmp_path, **PHASED, resume=str(uninterrupted)))
