"""The order of the job's timeouts (decent_train/components/timeouts.py; docs/fault-tolerance.md, "The timeouts'
order"): each ordering a run cannot keep is refused in one line before any worker starts, and shown to misbehave
where it is not refused.

- ``comm_timeout_s`` > ``pg_timeout_s`` on gloo, without live: the engine's gradient all-reduce (and a gossip
  group of three or more) fails at the process group's timeout, while its error names ``comm_timeout_s`` as the
  limit. A point-to-point exchange keeps ``comm_timeout_s`` (gloo takes the wait's limit), and under live the
  default group's timeout is ``comm_timeout_s``: both pass.
- ``fault_tolerance.detect_s`` below ``MIN_DETECT_S``: a healthy live run is declared dead (the node agent's own
  watchdog between two of its looks, or members ending their run).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from decent_train.components.checks import as_written
from decent_train.components.timeouts import MIN_DETECT_S
from decent_train.config import TrainConfig, check_config
from decent_train.engine.ddp import DecentralizedDataParallel

from .jobs import decent_train, free_port
from .test_gpu_readiness import mlp, train

pytestmark = pytest.mark.alone  # it times its faults or starves the machine: no test shares it (tests/conftest.py)

ALLREDUCE_PHASE = [{"algorithm": "allreduce", "steps": None}]  # the engine's gradient all-reduce, from the start


def _live(detect_s: float, **job: Any) -> dict[str, Any]:
    return {"fault_tolerance": {"name": "live", "detect_s": detect_s}, **job}


# -- the config's checks --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("job, line", [
    ({"comm_timeout_s": 2000.0}, "comm_timeout_s=2000.0 must be <= pg_timeout_s=1800.0: "),
    ({"comm_timeout_s": 10.0, "pg_timeout_s": 5.0, "phases": ALLREDUCE_PHASE},
     "comm_timeout_s=10.0 must be <= pg_timeout_s=5.0: "),
    ({"comm_timeout_s": 10.0, "pg_timeout_s": 5.0, "algorithm": {"name": "diloco"}, "steps": 100},
     "comm_timeout_s=10.0 must be <= pg_timeout_s=5.0: "),
    (_live(0.5), f"fault_tolerance.detect_s=0.5 must be >= {MIN_DETECT_S} s: "),
    (_live(0.1, comm_timeout_s=0.05), f"fault_tolerance.detect_s=0.1 must be >= {MIN_DETECT_S} s: "),
], ids=["comm-above-pg", "allreduce-phase", "diloco", "detect-below-floor", "detect-below-comm-too"])
def test_a_wrong_order_is_refused_in_one_line(job: dict[str, Any], line: str) -> None:
    with pytest.raises(ValueError) as refused:
        check_config(job)
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value), refused.value


@pytest.mark.parametrize("job", [
    {},  # every default
    {"comm_timeout_s": 1800.0},  # the boundary: equal
    {"comm_timeout_s": 5.0, "pg_timeout_s": 5.0, "phases": ALLREDUCE_PHASE},
    {"comm_timeout_s": 2000.0, "algorithm": {"name": "allreduce"}, "topology": {"name": "ring"}},  # DDP: not read
    {"comm_timeout_s": 2000.0, "launch": {"device": "cuda"}},  # the engine's groups take comm_timeout_s on CUDA
    _live(10.0, comm_timeout_s=2000.0),  # live: the default group's timeout is comm_timeout_s
    _live(MIN_DETECT_S),  # the boundary
    _live(600.0, comm_timeout_s=3.0),  # detect_s above comm_timeout_s: a stopped member is reported stuck sooner
    _live(2.0, comm_timeout_s=20.0),  # the tests' own
    {"comm_timeout_s": 4.0, "pg_timeout_s": 6.0},  # tests/test_checkpoint.py's
], ids=["defaults", "comm-equal-pg", "allreduce-phase-equal", "ddp", "cuda", "live-comm-above-pg", "live-detect-floor",
        "live-detect-above-comm", "live-tests", "checkpoint-tests"])
def test_its_neighbour_is_accepted(job: dict[str, Any]) -> None:
    assert isinstance(check_config({"steps": 10, **job}), TrainConfig)


def test_a_run_written_before_the_refusals_still_loads() -> None:
    with as_written():
        assert check_config({"comm_timeout_s": 2000.0, **_live(0.5)}).comm_timeout_s == 2000.0


# -- the misbehaviour the first refusal prevents ----------------------------------------------------------------------
def _all_reduce_with_a_hung_peer(rank: int, port: int, comm: float, pg: float, path: str) -> None:
    """A forked worker joined as ``decent_train.worker`` joins (the group's timeout: pg_timeout_s), in the engine's
    all-reduce mode with ``comm_timeout_s``; rank 1 hangs after one step, rank 0 times its next step's all-reduce."""
    from decent_train.runtime import init_distributed

    outcome = ("no error", 0.0)
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
        torch.set_num_threads(1)
        init_distributed("cpu", timedelta(seconds=pg))
        engine = DecentralizedDataParallel(mlp(), lambda n: torch.optim.SGD([p for _, p in n], lr=0.1),
                                           topology="allreduce", timeout=comm)
        train(engine, 1, rank)
        if rank == 1:
            time.sleep(comm + pg + 10)
            os._exit(0)
        start = time.monotonic()
        try:
            train(engine, 1, rank, first=1)
        except Exception as error:  # noqa: BLE001 - the outcome is what the test checks
            outcome = (f"{type(error).__name__}: {error}", time.monotonic() - start)
    except Exception as error:  # noqa: BLE001
        outcome = (f"setup failed: {error}", -1.0)
    with open(path, "w") as f:  # a file: a queue's feeder thread would not outlive os._exit
        f.write(json.dumps(outcome))
    os._exit(0)


@pytest.mark.parametrize("comm, pg", [(4.0, 1.5), (1.5, 4.0), (2.0, 2.0)], ids=["comm-above-pg", "below", "equal"])
def test_an_accepted_all_reduce_fails_at_comm_timeout_s_naming_it(tmp_path: Path, comm: float, pg: float) -> None:
    """Where the config accepts the pair, the engine's all-reduce with a hung peer fails after ``comm_timeout_s``,
    naming it; before the refusal, comm_timeout_s=4 with pg_timeout_s=1.5 failed after 1.5 s saying 'limit 4 s'."""
    try:
        check_config({"comm_timeout_s": comm, "pg_timeout_s": pg, "phases": ALLREDUCE_PHASE, "steps": 10})
    except ValueError as refused:
        assert comm > pg and str(refused).startswith(f"comm_timeout_s={comm} must be <= pg_timeout_s={pg}")
        return
    ctx = multiprocessing.get_context("fork")
    port, outcome = free_port(), tmp_path / "rank0.json"
    procs = [ctx.Process(target=_all_reduce_with_a_hung_peer, args=(r, port, comm, pg, str(tmp_path / f"rank{r}.json")))
             for r in range(2)]
    for proc in procs:
        proc.start()
    procs[0].join(60)
    for proc in procs:
        proc.kill()
        proc.join()
    error, took = json.loads(outcome.read_text())
    assert error.startswith("ExchangeError: rank 0: the gradient all-reduce") and f"limit {comm:g} s" in error, error
    assert comm - 0.2 <= took < comm + 2.0, f"failed after {took:.2f} s with comm_timeout_s={comm}: {error}"


# -- the command ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("overrides, line", [
    (["comm_timeout_s=2000"], "comm_timeout_s=2000.0 must be <= pg_timeout_s=1800.0: "),
    (["fault_tolerance=live", "fault_tolerance.detect_s=0.5"],
     f"fault_tolerance.detect_s=0.5 must be >= {MIN_DETECT_S} s: "),
], ids=["comm-above-pg", "detect-below-floor"])
def test_the_command_refuses_it_before_any_worker(tmp_path: Path, overrides: list[str], line: str) -> None:
    run = decent_train("dry_run=true", *overrides, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert run.returncode == 2, run
    assert run.stderr.strip().startswith(f"decent-train: error: {line}") and "Traceback" not in run.stderr, run
    assert not (tmp_path / "run").exists(), run


@pytest.mark.slow
@pytest.mark.parametrize("detect_s", [0.1, 2.0], ids=["below-the-floor", "the-live-tests-value"])
def test_a_healthy_live_run_is_not_declared_dead(tmp_path: Path, detect_s: float) -> None:
    """A healthy live run trains to its end with its members, or is refused: before the refusal, detect_s=0.1 ended
    it within seconds ('no answer from the coordinator for 0.1 s', its in-process coordinator healthy)."""
    run = decent_train("fault_tolerance=live", f"fault_tolerance.detect_s={detect_s}", "launch.nproc_per_node=2",
                       "model=mlp", "logger=jsonl", "logger.progress_bar=false", "steps=200",
                       f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    if detect_s < MIN_DETECT_S and run.returncode == 2:
        assert f"fault_tolerance.detect_s={detect_s} must be >= " in run.stderr, run
        return
    assert run.returncode == 0, f"detect_s={detect_s}: exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    assert " lost" not in run.stdout + run.stderr, run
