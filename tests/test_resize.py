"""Resuming at another world size: M workers continue N workers' checkpoint from the average of their states.

Oracles: the average of the N saved files computed here from the files themselves (parameters and Adam's moments, in
float64), the data order of an epoch (what N workers saw is a prefix of it), and the default job's accuracy.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from decent_train import DecentralizedDataParallel, optim_fn_adam
from decent_train.components.checkpoint import complete_checkpoints, load_latest_checkpoint, save_checkpoint
from decent_train.components.data import DatasetConfig, build_datasets
from decent_train.config import RESULT_FILE
from decent_train.training.resume import resharded_start

from .distributed import run_workers
from .replay import loss_fn, make_model
from .jobs import check_succeeded, decent_train, records

ADAM = partial(optim_fn_adam, lr=0.01)
MODEL = {"name": "test"}


def _engine(topology: str) -> DecentralizedDataParallel:
    return DecentralizedDataParallel(make_model(0), ADAM, topology=topology, bucket_size_in_mb=0.0005,
                                     compression="int8")


def _train_and_save(rank: int, world: int, run_dir: Path, steps: int) -> None:
    from loguru import logger

    logger.remove()
    engine = _engine("ring")
    for s in range(steps):
        loss_fn(engine, rank, s).backward()  # every worker its own data: the models and moments differ
    state = {"model": engine.state_dict(), "algorithm": engine.engine_state_dict()}
    save_checkpoint(run_dir, steps, state, "ring", MODEL, keep=1)


def _load_averaged(rank: int, world: int, run_dir: Path) -> dict[str, Any]:
    from loguru import logger

    logger.remove()
    engine = _engine("ring")

    def averageable(state: dict[str, Any]) -> dict[str, Any]:
        return {**state, "algorithm": DecentralizedDataParallel.averageable_state(state["algorithm"])}

    checkpoint, state = load_latest_checkpoint([run_dir], "ring", MODEL, prepare_average=averageable)
    assert checkpoint is not None and state is not None
    engine.load_state_dict(state["model"])
    engine.load_engine_state_dict({**state["algorithm"], "averaged_from": state["averaged_from"]})
    moments = {
        (b, key): [opt.state[p][key].clone() for p in opt.param_groups[0]["params"]]
        for b, opt in enumerate(engine.optimizers) for key in ("exp_avg", "exp_avg_sq", "step")
    }
    copies = [c.own.clone() for bucket in engine._buckets for c in bucket.compressed.copies.values()]
    flats = [bucket.flat.clone() for bucket in engine._buckets for _ in bucket.compressed.copies]
    pending = [bucket.pending for bucket in engine._buckets]
    return {"params": {k: v.detach().clone() for k, v in engine.named_parameters()}, "moments": moments,
            "copies_equal_flat": all(torch.equal(c, f) for c, f in zip(copies, flats)),
            "pending": pending, "step": engine.step_count, "averaged_from": state["averaged_from"]}


@pytest.mark.parametrize("new_world", [2, 8])
def test_workers_start_from_the_average_of_another_world_size(tmp_path: Path, new_world: int) -> None:
    """4 workers train 5 steps with Adam and int8 compression and checkpoint; M workers load it: every one holds the
    average of the 4 saved models and of their optimizer moments, nothing in flight, its copies at the average."""
    run_workers(_train_and_save, 4, tmp_path, steps=5)
    (checkpoint,) = complete_checkpoints(tmp_path)
    saved = [torch.load(checkpoint.path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    expected = {name: torch.stack([s["model"][name] for s in saved]).mean(0) for name in saved[0]["model"]}
    assert max((expected[n] - saved[0]["model"][n]).abs().max().item() for n in expected) > 1e-3, "models differ"

    loaded = run_workers(_load_averaged, new_world, tmp_path)
    for result in loaded:
        assert result["averaged_from"] == 4 and result["step"] == 5
        for name, value in result["params"].items():
            assert value.dtype == torch.float64
            assert (value - expected[name]).abs().max().item() <= 1e-12, name
        for (b, key), values in result["moments"].items():
            states = [s["algorithm"]["buckets"][b]["optimizer"]["state"] for s in saved]
            for index, value in enumerate(values):
                mean = torch.stack([state[index][key] for state in states]).mean(0)
                assert (value - mean).abs().max().item() <= 1e-12, (b, key, index)
        assert result["moments"][0, "step"][0].item() == 5.0  # step counts kept
        assert result["copies_equal_flat"] and result["pending"] == [None] * len(result["pending"])


def _save_own_state(rank: int, world: int, run_dir: Path, odd_file: int) -> None:
    """A state that differs per rank in every value: floats of two dtypes, an integer tensor, a Python number;
    ``odd_file``'s rank saves one tensor of another shape."""
    generator = torch.Generator().manual_seed(rank)
    shape = (4,) if rank == odd_file else (3,)
    state = {"model": {"w": torch.randn(shape, generator=generator, dtype=torch.float64),
                       "b": torch.randn(2, 2, generator=generator)},
             "algorithm": {"counts": torch.tensor([rank, 7]), "step": rank}}
    save_checkpoint(run_dir, 5, state, "ring", MODEL, keep=1)


def _load_recording_reads(rank: int, world: int, run_dir: Path, chunk: int = 0) -> dict[str, Any]:
    """The averaged state this worker loads, and the checkpoint files it opened (Python's audit events); ``chunk``:
    the elements per all-reduce, if set (in this forked worker only)."""
    import sys

    from loguru import logger

    from decent_train.components import state_average

    logger.remove()
    if chunk:
        state_average.ALL_REDUCE_ELEMENTS = chunk
    opened: set[str] = set()

    def record(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and isinstance(args[0], (str, Path)) and Path(args[0]).name.startswith("rank"):
            opened.add(Path(args[0]).name)

    sys.addaudithook(record)  # this forked worker's own: it ends with the process
    try:
        _, state = load_latest_checkpoint([run_dir], "ring", MODEL)
    except ValueError as error:
        return {"error": str(error)}
    assert state is not None
    return {"state": state, "opened": opened}


@pytest.mark.parametrize(("new_world", "chunk"), [(3, 3), (8, 0)])
def test_each_saved_file_is_read_by_one_worker(tmp_path: Path, new_world: int, chunk: int) -> None:
    """M workers continuing 4 workers' checkpoint read each file once in all (file k by worker k mod M), not each
    worker all 4; every one starts from the average of the 4 files (floats, summed in float64 and in their dtype) and
    file 0's other values, computed here from the files. With 3 elements per all-reduce the sums go in 2 chunks (w,
    and b, larger than a chunk, alone)."""
    run_workers(_save_own_state, 4, tmp_path, odd_file=-1)
    (checkpoint,) = complete_checkpoints(tmp_path)
    saved = [torch.load(checkpoint.path / f"rank{r}.pt", weights_only=True) for r in range(4)]
    loaded = run_workers(_load_recording_reads, new_world, tmp_path, chunk=chunk)

    readers = {f"rank{r}.pt": [w for w, result in enumerate(loaded) if f"rank{r}.pt" in result["opened"]]
               for r in range(4)}
    assert readers == {f"rank{r}.pt": [r % new_world] for r in range(4)}
    for result in loaded:
        state = result["state"]
        for name in ("w", "b"):
            mean = torch.stack([s["model"][name].double() for s in saved]).mean(0)
            assert state["model"][name].dtype == saved[0]["model"][name].dtype
            assert (state["model"][name].double() - mean).abs().max().item() <= (1e-12 if name == "w" else 1e-6)
        assert state["averaged_from"] == 4
        assert torch.equal(state["algorithm"]["counts"], torch.tensor([0, 7])) and state["algorithm"]["step"] == 0


def test_a_file_of_another_layout_is_refused_on_every_worker(tmp_path: Path) -> None:
    """File 1 holds a tensor of another shape and is read by worker 1 of 3 alone (its only file): every worker stops
    with the same line naming it, none left waiting in the all-reduce."""
    run_workers(_save_own_state, 4, tmp_path, odd_file=1)
    loaded = run_workers(_load_recording_reads, 3, tmp_path, timeout=60.0)
    assert [result.get("error") for result in loaded] == \
        ["checkpoint file 1 holds a state of another layout than file 0's"] * 3


def test_resharded_data_continues_the_epoch_where_the_old_workers_stopped() -> None:
    """What N workers took of an epoch is a prefix of its shuffled order; M workers go on from the end of that prefix
    (skipping fewer than one of their global micro-batches), in the same epoch."""
    data = build_datasets(DatasetConfig(name="digits"))
    seed, batch = 0, 8

    per_epoch_4 = data.micro_batches_per_epoch(batch, 4)
    taken = per_epoch_4 + 5  # into the second epoch
    start = resharded_start(data, taken, (4, batch), (2, batch))
    per_epoch_2 = data.micro_batches_per_epoch(batch, 2)
    assert start == per_epoch_2 + 10  # 5 micro-batches x 4 workers = 10 x 2 workers: the same 160 samples done
    assert resharded_start(data, taken, (4, batch), (8, batch)) == data.micro_batches_per_epoch(batch, 8) + 3  # 160/64
    assert resharded_start(data, taken, (4, batch), (4, batch)) == taken  # the same world: the same stream

    # The samples: 4 workers' first 5 micro-batches of epoch 1 and 2 workers' next ones are disjoint, and together
    # the prefix of the epoch's order.
    def samples(world: int, first: int, count: int) -> Counter[tuple[float, ...]]:
        seen: Counter[tuple[float, ...]] = Counter()
        for rank in range(world):
            stream = data.train_batches(batch, rank, world, seed, start=first)
            for _ in range(count):
                x, _ = next(stream)
                seen.update(tuple(row.flatten().tolist()) for row in x)
        return seen

    old, new = samples(4, per_epoch_4, 5), samples(2, start, 10)
    both = samples(2, per_epoch_2, 20)  # 2 workers taking the whole prefix of 320 samples themselves
    assert old.total() == new.total() == 160 and old + new == both


@pytest.mark.slow
def test_cli_continues_a_4_worker_checkpoint_on_2_and_8_workers(tmp_path: Path) -> None:
    """The default job, checkpointed by 4 workers at step 200 of 400, continued with resume= on 2 and on 8."""
    source = tmp_path / "source"
    check_succeeded(decent_train("steps=400", "checkpoint.every=200", "eval_every=0", "logger.progress_bar=false",
                                 f"hydra.run.dir={source}", cwd=tmp_path))
    shutil.rmtree(source / "checkpoints" / "step_00000400")  # as if it had stopped after step 200
    for workers in (2, 8):
        run_dir = tmp_path / f"on{workers}"
        proc = decent_train("steps=400", "checkpoint.every=200", "eval_every=0", "logger.progress_bar=false",
                            f"resume={source}", f"launch.nproc_per_node={workers}", f"hydra.run.dir={run_dir}",
                            cwd=tmp_path)
        check_succeeded(proc)
        said = f"resumed step 200 from 4 workers' checkpoint on {workers} workers: models and optimizer states averaged"
        assert said in proc.stdout + proc.stderr
        result = json.loads((run_dir / RESULT_FILE).read_text())
        assert (result["world_size"], result["resumed_from_world_size"]) == (workers, 4)
        assert (result["resumed_from_step"], result["steps"]) == (200, 400)
        assert result["eval/accuracy"] >= 0.95
        logged = [r["step"] for r in records(run_dir)]
        assert logged[0] == 200 + (logged[1] - logged[0]) and logged[-1] == 400
        assert [c.manifest["world_size"] for c in complete_checkpoints(run_dir)] == [workers]  # step 400
        assert all(c.run_world_size == 4 for c in complete_checkpoints(run_dir))
