"""``parallel.shard`` = K in the worker (``algorithms/sharded.py``, ``ShardedGossip``): its checkpoints (one DCP
checkpoint per replica), exact and averaged resume, a truncated DCP shard, and the consensus distance from shards.

Oracles, none of them the package's own code path:

* an uninterrupted run of the same config (4 workers, K = 2: 2 replicas, ring): a run that dies after its step-4
  checkpoint, continued by a new run in a fresh directory (``resume=``), must end with exactly its model, losses and
  records; so must a resume that falls back past a truncated DCP shard to that checkpoint;
* the replicas' full models and optimizer states read back from the DCP folders in this process
  (``dcp_to_torch_save``: one process, no process group), averaged here in float64: what 6 workers (3 replicas)
  resumed from the 4 workers' final checkpoint must hold, and the distance the run recorded at a checkpoint's step;
* full models gathered by ``full_tensor()`` on every rank, for ``ConsensusProbe`` on the local shards.

The averaged-resume test fails against a wrong oracle: compared with replica 0's saved model instead of the mean,
every replica's loaded model is 6e-4 (mlp) and 4e-4 (cnn) away from it where the tolerance is 0 (checked in a
scratch edit, not kept). Each rank's BatchNorm statistics (its own: FSDP2 leaves buffers whole) are in its own file, so the cnn's resume is
exact too.

The workers are forked from this process: the modules they would import each on their own (scikit-learn for the
digits, torch._dynamo for the device mesh, DCP) are imported here once, which takes a run from ~8 s to ~1 s on 2
cores.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sklearn.datasets  # noqa: F401 - imported before the workers fork (see the module's docstring)
import torch
import torch._dynamo  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
from torch import Tensor, nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from decent_train.components.checkpoint import complete_checkpoints
from decent_train.components.metrics import ConsensusProbe
from decent_train.components.models import ModelConfig, build_model
from decent_train.config import MODEL_FILE, RESULT_FILE
from decent_train.launcher.preflight import preflight
from decent_train.training import train

from .distributed import run_workers
from .jobs import make_cfg, records, train_on_cpu

STEPS, EVERY = 8, 4  # checkpoints at 4 and 8; records at every second step
MODELS = {"mlp": {"name": "mlp", "hidden_sizes": [32]}, "cnn": {"name": "cnn", "channels": [8, 16]}}
# Runs named by model; "diloco" is the mlp under Streaming DiLoCo over the replicas (a fragment every 3 steps, each
# exchange started 2 steps before its outer step): at the checkpoint of step 4 fragment 1's exchange is in flight
# (started after step 4, its outer step after 6) and it has no outer momentum yet; DCP holds the anchors and fragment
# 0's momentum.
DILOCO = {"algorithm": {"name": "diloco", "sync_every": 6, "fragments": 2, "fragment_sync_delay": 2}}
MODELS["diloco"] = MODELS["mlp"]
SHARDED = {
    "parallel": {"shard": 2}, "steps": STEPS, "eval_every": 0, "checkpoint": {"every": EVERY, "keep": 5},
    "logger": {"log_every": 2, "consensus_every": 2, "wandb": {"mode": "disabled"}},
}
TIMING = ("time/", "throughput/", "memory/")
EVAL = ("eval/",)

def _cfg(run_dir: Path, model: str, workers: int = 4, **overrides: Any) -> Any:
    """K = 2 over ``workers`` fork-started workers on one node (no LOCAL_WORLD_SIZE there: the layout is set here)."""
    layout = {"launch": {"nproc_per_node": workers}, "topology": {"local_world_size": workers}}
    algorithm = DILOCO if model == "diloco" else {}
    return make_cfg(run_dir, **{**SHARDED, **layout, "model": MODELS[model], **algorithm, **overrides})


def _result(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / RESULT_FILE).read_text())


def _measured(run_dir: Path, skip: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING + skip)} for r in records(run_dir)]


def _checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def _parameter_names(model: str) -> list[str]:
    """The model's parameters (not its buffers), as the state dicts name them."""
    return [name for name, _ in build_model(ModelConfig(**MODELS[model]), (1, 8, 8), 10).named_parameters()]


def _mean64(tensors: list[Tensor]) -> Tensor:
    """The mean, summed in float64, in the tensors' dtype; integers (step counts) must all be equal: that value."""
    if not tensors[0].is_floating_point():
        assert all(torch.equal(t, tensors[0]) for t in tensors[1:])
        return tensors[0]
    return (sum(t.double() for t in tensors) / len(tensors)).to(tensors[0].dtype)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("scratch")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Run A of a model (once per module): 4 workers, K = 2, ring over the 2 replicas, 8 steps straight."""
    runs: dict[str, Path] = {}

    def run(model: str) -> Path:
        if model not in runs:
            run_dir = tmp_path_factory.mktemp(f"uninterrupted_{model}")
            run_workers(train_on_cpu, 4, _cfg(run_dir, model))
            runs[model] = run_dir
        return runs[model]

    return run


@pytest.fixture(scope="module")
def saved_replicas(scratch: Path) -> Callable[[Path, int], list[dict[str, Any]]]:
    """Each replica's DCP checkpoint of ``run_dir``'s step ``step`` as one plain state dict ({"model": ...,
    "optim": ...}), read in this process by torch's own converter (cached per folder)."""
    cache: dict[Path, list[dict[str, Any]]] = {}

    def read(run_dir: Path, step: int) -> list[dict[str, Any]]:
        directory = _checkpoint(run_dir, step)
        if directory not in cache:
            folders = sorted(directory.glob("replica*"))
            assert [f.name for f in folders] == [f"replica{r}" for r in range(len(folders))]
            states = []
            for folder in folders:
                out = scratch / f"{run_dir.name}_{directory.name}_{folder.name}.pt"
                dcp_to_torch_save(folder, out)
                states.append(torch.load(out, weights_only=False))
            cache[directory] = states
        return cache[directory]

    return read


# -- 1. exact resume at the same layout -----------------------------------------------------------------------------
class _Died(Exception):
    """Raised at a record: the worker stops there as a killed one would (its later checkpoints never written)."""


def _train_until(rank: int, world: int, cfg: Any, last_step: int) -> str:
    """Train ``cfg`` and die at the first record after ``last_step`` (every rank records at the same steps)."""
    def on_record(record: dict[str, Any], net: nn.Module) -> None:
        if record["step"] > last_step:
            raise _Died(f"step {record['step']}")

    try:
        train(cfg, Path(cfg.run.output_dir), torch.device("cpu"), on_record=on_record)
    except _Died as died:
        return str(died)
    return "finished"


def _died_and_resumed(tmp_path: Path, model: str) -> Path:
    """Run B: trains to step 6 and dies, its checkpoint of step 4 complete; then a new run in a fresh directory
    continues it (``resume=``) to step 8. The new run's directory."""
    died, resumed = tmp_path / "died", tmp_path / "resumed"
    assert run_workers(_train_until, 4, _cfg(died, model), EVERY) == ["step 6"] * 4
    assert [c.step for c in complete_checkpoints(died)] == [EVERY]
    manifest = complete_checkpoints(died)[0].manifest
    assert manifest["shard"] == 2 and manifest["world_size"] == 4
    assert [Path(e["file"]).parent.name for entry in manifest["ranks"] for e in entry["sharded"]] == (
        ["replica0"] * 3 + ["replica1"] * 3)  # each rank its shard's file; a replica's first rank also .metadata
    run_workers(train_on_cpu, 4, _cfg(resumed, model, resume=str(died)))
    result = _result(resumed)
    assert result["resumed_from_step"] == EVERY and "resumed_from_world_size" not in result
    return resumed


def _assert_same(got: dict[str, Tensor], want: dict[str, Tensor], names: list[str]) -> None:
    assert got.keys() == want.keys()
    for name in names:
        assert torch.equal(got[name], want[name]), f"{name}: {(got[name] - want[name]).abs().max().item():.3g} away"


@pytest.mark.parametrize("model", ["mlp", "cnn", "diloco"])
def test_resumed_run_ends_with_the_uninterrupted_run(
    uninterrupted: Callable[[str], Path], tmp_path: Path, model: str
) -> None:
    """Model, final losses and every record after the checkpoint (the replicas' consensus distance included): bit
    for bit those of run A."""
    whole = uninterrupted(model)
    resumed = _died_and_resumed(tmp_path, model)
    got, want = torch.load(resumed / MODEL_FILE), torch.load(whole / MODEL_FILE)
    _assert_same(got, want, list(want))
    mine, theirs = _result(resumed), _result(whole)
    assert (mine["train/loss"], mine["eval/loss"]) == (theirs["train/loss"], theirs["eval/loss"])
    assert _measured(resumed) == [r for r in _measured(whole) if r["step"] > EVERY]


def _buffers_at(rank: int, world: int, cfg: Any, step: int) -> dict[str, Tensor]:
    """This rank's buffers at the record of ``step`` (a checkpoint step: nothing trains between the two)."""
    buffers: dict[str, Tensor] = {}

    def on_record(record: dict[str, Any], net: nn.Module) -> None:
        if record["step"] == step:
            buffers.update({name: b.detach().clone() for name, b in net.named_buffers()})

    train(cfg, Path(cfg.run.output_dir), torch.device("cpu"), on_record=on_record)
    return buffers


def test_every_ranks_batchnorm_statistics_are_in_the_checkpoint(tmp_path: Path) -> None:
    """At the checkpoint the two ranks of a replica hold different running statistics (each normalized its own
    micro-batches; FSDP2 leaves buffers whole), and each rank's file keeps its own (DCP would keep one per replica)."""
    held = run_workers(_buffers_at, 4, _cfg(tmp_path, "cnn"), EVERY)
    assert not torch.equal(held[0]["1.running_mean"], held[1]["1.running_mean"])  # the ranks of a replica differ
    directory = _checkpoint(tmp_path, EVERY)
    for rank, buffers in enumerate(held):
        saved = torch.load(directory / f"rank{rank}.pt", weights_only=True)["algorithm"]["buffers"]
        _assert_same(saved, buffers, list(buffers))


# -- 2. averaged resume at another number of replicas ---------------------------------------------------------------
def _held_before_the_final_average(rank: int, world: int, cfg: Any) -> dict[str, Any]:
    """Train ``cfg``; what this rank's replica holds (model and optimizer state, gathered whole) when training has
    ended, before the final average of the replicas, and the folders of ``cfg.resume``'s replicas it opened a file in
    (Python's audit events; its own checkpoint's are not counted). (Patched in this forked worker only.)"""
    import sys

    from decent_train.algorithms.sharded import ShardedGossip

    held: dict[str, Any] = {"opened": set()}

    def record(event: str, args: tuple[Any, ...]) -> None:
        path = Path(args[0]) if event == "open" and isinstance(args[0], (str, Path)) else None
        if path is not None and cfg.resume and path.is_relative_to(cfg.resume):
            if path.parent.name.startswith("replica"):
                held["opened"].add(path.parent.name)

    sys.addaudithook(record)  # this forked worker's own: it ends with the process
    average = ShardedGossip.average

    def capture_then_average(self: ShardedGossip) -> None:
        model, optim = get_state_dict(self.net, self.inner, options=StateDictOptions(full_state_dict=True))
        held.update(copy.deepcopy({"model": model, "optim": optim}))
        average(self)

    ShardedGossip.average = capture_then_average  # type: ignore[method-assign]
    train_on_cpu(rank, world, cfg)
    return held


def _flat(state: Any, prefix: str = "") -> dict[str, Any]:
    """A nested state dict's leaves by path."""
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in _flat(value, f"{prefix}/{key}").items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, value in enumerate(state) for k, v in _flat(value, f"{prefix}[{i}]").items()}
    return {prefix: state}


@pytest.mark.parametrize(("model", "workers", "shard"), [("mlp", 6, 2), ("cnn", 6, 2), ("mlp", 4, 4)])
def test_other_replicas_continue_from_the_mean_of_two(
    uninterrupted: Callable[[str], Path], saved_replicas: Callable[[Path, int], list[dict[str, Any]]],
    tmp_path: Path, model: str, workers: int, shard: int,
) -> None:
    """6 workers (3 replicas of 2), or 4 workers in one replica of 4 shards (DCP reshards each saved replica), resume
    4 workers' (2 replicas of 2) final checkpoint with nothing left to train: every replica starts from the float64
    mean of the 2 saved replicas (model and optimizer state: Adam's moments, the accumulated gradient), and model.pt
    is that mean (the final average of equal replicas: within float32's rounding of (x + x + x) / 3)."""
    source = uninterrupted(model)
    saved = saved_replicas(source, STEPS)
    run_dir = tmp_path / "other"
    cfg = _cfg(run_dir, model, workers, resume=str(source), parallel={"shard": shard})
    held = run_workers(_held_before_the_final_average, workers, cfg)
    result = _result(run_dir)
    assert (result["resumed_from_step"], result.get("resumed_from_world_size", 4), result["world_size"]) == (
        STEPS, 4, workers)
    assert result["train_time_s"] is None and result["train/loss"] is None  # nothing was trained (a new directory)

    mean = {name: _mean64([s["model"][name] for s in saved]) for name in saved[0]["model"]}
    # Buffers are each rank's own (in its file, FSDP2 leaves them whole): the mean over all 4 saved ranks.
    files = [torch.load(_checkpoint(source, STEPS) / f"rank{k}.pt", weights_only=True) for k in range(4)]
    for name, value in files[0]["algorithm"]["buffers"].items():
        mean[name] = _mean64([f["algorithm"]["buffers"][name] for f in files]) if value.is_floating_point() else value
    # The oracle tells the mean from either replica: they differ far beyond the tolerance below.
    params = _parameter_names(model)
    assert max((saved[0]["model"][n] - saved[1]["model"][n]).abs().max().item() for n in params) > 1e-4
    for rank, state in enumerate(held):
        _assert_same(state["model"], mean, list(mean))  # each replica loaded exactly the mean
    replicas = workers // shard
    if replicas > 1:  # saved replica k is read (hashed, loaded) by new replica k alone, and replica 2 (no share)
        # loads replica 0 for its step counts: 3 reads, not 6
        readers = {f"replica{k}": {r // shard for r, state in enumerate(held) if f"replica{k}" in state["opened"]}
                   for k in range(2)}
        assert readers == {"replica0": {0, 2}, "replica1": {1}}
    final = torch.load(run_dir / MODEL_FILE)
    assert final.keys() == mean.keys()
    for name in mean:
        torch.testing.assert_close(final[name], mean[name], rtol=2.5e-7, atol=0, msg=name)

    saved_optim = [_flat(s["optim"]["state"]) for s in saved]
    want = {path: _mean64([o[path] for o in saved_optim]) for path in saved_optim[0]}
    assert {path.rsplit("/", 1)[1] for path in want} == {"exp_avg", "exp_avg_sq", "accum_grad", "step"}
    for rank, state in enumerate(held):
        got = _flat(state["optim"]["state"])
        assert got.keys() == want.keys()
        for path in want:
            assert torch.equal(got[path], want[path]), f"rank {rank} {path}"
        lrs = [g["lr"] for g in state["optim"]["param_groups"]]
        assert lrs == [g["lr"] for g in saved[0]["optim"]["param_groups"]]  # the schedule at step 8


@pytest.mark.parametrize("step", [EVERY, STEPS])
def test_recorded_consensus_is_the_distance_between_the_saved_replicas(
    uninterrupted: Callable[[str], Path], saved_replicas: Callable[[Path, int], list[dict[str, Any]]], step: int
) -> None:
    """The run's consensus/distance at a checkpoint step (measured from shards, exactly: consensus_samples covers
    the model) against sqrt((1/R) Σ_r |x_r − mean|²) over the saved replicas' full parameters, in float64 here."""
    run_dir = uninterrupted("cnn")
    saved = saved_replicas(run_dir, step)
    names = _parameter_names("cnn")
    x = torch.stack([torch.cat([s["model"][n].double().flatten() for n in names]) for s in saved])
    mean = x.mean(0)
    distance = (x - mean).square().sum(1).mean().sqrt().item()
    (record,) = [r for r in records(run_dir) if r["step"] == step]
    assert record["consensus/distance"] == pytest.approx(distance, rel=1e-5)
    assert record["consensus/relative"] == pytest.approx(distance / mean.norm().item(), rel=1e-5)


# -- 3. a truncated DCP shard -------------------------------------------------------------------------------------
def _train_logging_warnings(rank: int, world: int, cfg: Any, folder: Path) -> dict[str, Any]:
    """``train_on_cpu``, this rank's warnings also into ``folder/rank<k>.log`` (message only)."""
    from loguru import logger

    folder.mkdir(exist_ok=True)
    logger.add(folder / f"rank{rank}.log", level="WARNING", format="{message}")
    return train_on_cpu(rank, world, cfg)


@pytest.mark.parametrize("workers", [4, 6])
def test_truncated_dcp_shard_falls_back_to_the_checkpoint_before(
    uninterrupted: Callable[[str], Path], tmp_path: Path, workers: int
) -> None:
    """Half of one DCP shard file of the newest checkpoint (rank 3's: replica 1, shard 1) is cut off: every rank
    resumes from step 4 instead (4 workers: each checks its own files; 6: rank k < 4 reads saved rank k's)."""
    whole = uninterrupted("mlp")
    source = tmp_path / "source"
    shutil.copytree(whole / "checkpoints", source / "checkpoints")
    damaged = _checkpoint(source, STEPS) / "replica1" / "__1_0.distcp"
    data = damaged.read_bytes()
    damaged.write_bytes(data[: len(data) // 2])

    run_dir, warnings = tmp_path / "resumed", tmp_path / "warnings"
    run_workers(_train_logging_warnings, workers, _cfg(run_dir, "mlp", workers, resume=str(source)), warnings)
    result = _result(run_dir)
    assert result["resumed_from_step"] == EVERY  # every rank fell back, not only rank 3
    (warning,) = (warnings / "rank0.log").read_text().splitlines()  # rank 0 says why, once
    assert all((warnings / f"rank{k}.log").read_text() == "" for k in range(1, workers))
    assert warning.startswith(f"checkpoint step_{STEPS:08d} skipped: {damaged} is truncated or corrupt (")
    assert warning.endswith("; trying the one before")
    if workers == 4:  # the same layout: it then trains exactly as run A did
        got, want = torch.load(run_dir / MODEL_FILE), torch.load(whole / MODEL_FILE)
        _assert_same(got, want, list(want))
    else:
        assert result["resumed_from_world_size"] == 4


# -- 4. the consensus distance from shards ------------------------------------------------------------------------
class _Net(nn.Module):
    """Linear 5 -> 7, LayerNorm, Linear 7 -> 1: 7 rows shard 4 + 3 over 2 ranks, 1 row 1 + 0 (an empty shard)."""

    def __init__(self, seed: int, dtype: torch.dtype):
        super().__init__()
        torch.manual_seed(seed)
        self.first, self.norm, self.second = nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 1)
        with torch.no_grad():  # LayerNorm starts at ones and zeros whatever the seed
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)
        self.to(dtype)


SAMPLES, SEEDS = 8, 400  # sampled probes: 8 coordinates of each rank's shard (40 and 24 elements), 400 draws


def _probe(rank: int, world: int, replicas: int, dtype: torch.dtype, same: bool) -> dict[str, Any]:
    """FSDP2 over a (replicas, 2) mesh, replica r's model from seed r (``same``: all from seed 0); ConsensusProbe on
    this rank's local shards, exact and sampled, and the full model gathered on every rank."""
    mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    model = _Net(0 if same else mesh.get_coordinate()[0], dtype)
    for unit in (model.first, model.norm, model.second):
        fully_shard(unit, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    shards = [p.to_local().detach() for p in model.parameters()]
    group = mesh.get_group("replicate")
    exact = ConsensusProbe(shards, samples=0, group=group, replicas=replicas).measure()
    sampled = [ConsensusProbe(shards, SAMPLES, seed=s, group=group, replicas=replicas).measure() for s in range(SEEDS)]
    full = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}  # collective
    return {"exact": exact, "sampled": sampled, "full": full, "numel": [t.numel() for t in shards]}


@pytest.mark.parametrize(("replicas", "dtype", "tolerance"), [
    (2, torch.float64, 1e-12), (2, torch.float32, 1e-5), (3, torch.float64, 1e-12),
])
def test_consensus_from_shards_is_the_distance_of_the_full_models(
    replicas: int, dtype: torch.dtype, tolerance: float
) -> None:
    results = run_workers(_probe, 2 * replicas, replicas, dtype, False)
    assert [r["numel"] for r in results[:2]] == [[20, 4, 4, 4, 7, 1], [15, 3, 3, 3, 0, 0]]  # one rank: empty shards
    full = [results[2 * r]["full"] for r in range(replicas)]
    for rank, r in enumerate(results):  # a replica's ranks gathered the same model
        _assert_same(r["full"], full[rank // 2], list(full[0]))
    x = torch.stack([torch.cat([m[n].double().flatten() for n in m]) for m in full])
    mean = x.mean(0)
    distance = (x - mean).square().sum(1).mean().sqrt().item()
    assert distance > 0.1
    for r in results:  # every rank gets the same numbers
        assert r["exact"] == results[0]["exact"]
        assert r["sampled"] == results[0]["sampled"]
    got, relative = results[0]["exact"]
    assert got == pytest.approx(distance, rel=tolerance, abs=0)
    assert relative == pytest.approx(distance / mean.norm().item(), rel=tolerance, abs=0)
    # Sampled: (numel / samples) x the sampled sum estimates each shard's sum of squares without bias, so the mean
    # of distance² over many draws comes back to the exact one (these seeds: deterministic).
    estimates = torch.tensor([d for d, _ in results[0]["sampled"]], dtype=torch.float64)
    assert bool(torch.isfinite(estimates).all()) and bool((estimates > 0).all())
    assert estimates.square().mean().sqrt().item() == pytest.approx(distance, rel=0.05)  # measured: 0.996


def test_consensus_of_equal_replicas_is_zero() -> None:
    results = run_workers(_probe, 4, 2, torch.float32, True)
    assert all(r["exact"] == (0.0, 0.0) for r in results)
    assert all(d == 0.0 for r in results for d, _ in r["sampled"])


def test_a_replica_evaluates_in_lockstep_when_its_ranks_have_unequal_batches(
    uninterrupted: Callable[[str], Path], tmp_path: Path
) -> None:
    """At eval_batch_size=89 the digits' 359 evaluation samples give ranks 0-2 two batches (89 + 1) and rank 3 one:
    rank 3 repeats its batch, uncounted, while rank 2 (its replica's other rank) gathers parameters for its second.
    Without that the replica's FSDP2 all-gathers would pair up wrongly or hang. The result is the evaluation of the
    uninterrupted run (batches of 512) up to the order of the sums."""
    run_dir = tmp_path / "small_eval_batches"
    run_workers(train_on_cpu, 4, _cfg(run_dir, "mlp", eval_batch_size=89))
    mine, theirs = _result(run_dir), _result(uninterrupted("mlp"))
    assert mine["eval/accuracy"] == theirs["eval/accuracy"]
    assert mine["eval/loss"] == pytest.approx(theirs["eval/loss"], rel=1e-6)
    assert mine["train/loss"] == theirs["train/loss"]


def test_a_sharded_checkpoint_and_a_whole_model_run_do_not_continue_each_other(
    uninterrupted: Callable[[str], Path], tmp_path: Path
) -> None:
    """Whole models cannot load DCP shards (nor FSDP2 a rank file's whole model): one line before any worker."""
    cfg = make_cfg(tmp_path, model=MODELS["mlp"], resume=str(uninterrupted("mlp")), launch={"nproc_per_node": 4})
    with pytest.raises(ValueError, match=r"parallel\.shard=2; this run has parallel\.shard=1: resume a sharded run"):
        preflight(cfg)
