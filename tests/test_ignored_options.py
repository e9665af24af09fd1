"""Options whose value the run would silently ignore are refused before any worker starts, in one line naming the
value and what is valid (docs/cli.md#errors): a key that the chosen option never reads, set away from its default
(``algorithm=allreduce topology=one-peer-exp``, ``compression=none compression.int8_block=64``, ``scheduler=constant
scheduler.min_lr=0.1``, a warmup key after the one that sets the warmup), a warmup as long as the run, and outer steps
that a run of ``steps`` never reaches. The same key at its default, and the options that do read it, still pass; in a
sweep's job a key its option does not read is another job's, and passes.

The table goes through what ``decent-train`` runs before any worker (``check_like_the_cli``: Hydra's compose,
``check_config``, the preflight, the CLI's one line) for every case; the slow tests run the command itself: a refusal
of each group (exit 2, one line, no run directory), and one short DiLoCo run whose only outer step is its last step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import decent_train as package
from decent_train.components.models import build_model
from decent_train.components import compression, data, models
from decent_train.components.compression import CompressionConfig
from decent_train.components.data import DatasetConfig
from decent_train.components.launch import FAULT_TOLERANCE_READERS, FaultToleranceConfig
from decent_train.components.models import ModelConfig
from decent_train.components.optim import OPTIM_READERS, SCHEDULER_READERS, OptimConfig, SchedulerConfig
from decent_train.config import RESOLVED_CONFIG, check_config
from decent_train.engine import reconfigure
from decent_train.launcher.help import field_docs, group_options, split_conditions

from .datafiles import write_cifar
from .jobs import check_succeeded, decent_train, records, start
from .test_cli_fuzz import CONF, check_like_the_cli
from .test_load_model import _write_run

CIFAR = "CIFAR_DIR"  # stands for a directory with CIFAR-10's files (``with_data``)
REFUSED = {  # overrides -> what the one line must hold
    "a batch size beside the global batch": (["global_batch_size=128", "batch_size=16"], [
        "batch_size=16 with global_batch_size=128", "give one of them"]),
    "allreduce with a topology": (["algorithm=allreduce", "topology=one-peer-exp"], [
        "topology=one-peer-exp with algorithm=allreduce", "does not gossip", "leave topology=ring"]),
    "allreduce with a topology layout": (["algorithm=allreduce", "topology.local_world_size=2"], [
        "topology.local_world_size=2 with algorithm=allreduce", "leave topology.local_world_size=null"]),
    "allreduce with a topology module": (["algorithm=allreduce", "topology.module=my_topologies"], [
        "topology.module=my_topologies with algorithm=allreduce", "leave topology.module=null"]),
    "no compression with an int8 block": (["compression=none", "compression.int8_block=64"], [
        "compression.int8_block=64 with compression=none", "use compression=int8", "leave compression.int8_block=256"]),
    "bf16 with an int8 block": (["compression=bf16", "compression.int8_block=64"], [
        "compression.int8_block=64 with compression=bf16", "use compression=int8"]),
    "no compression with a consensus step": (["compression.consensus_step=0.5"], [
        "compression.consensus_step=0.5 with compression=none", "use compression=bf16|int8",
        "leave compression.consensus_step=1.0"]),
    "no compression with bf16 copies": (["compression.copy_dtype=bf16"], [
        "compression.copy_dtype=bf16 with compression=none", "leave compression.copy_dtype=param"]),
    "constant with a minimum": (["scheduler=constant", "scheduler.min_lr=0.1"], [
        "scheduler.min_lr=0.1 with scheduler=constant", "use scheduler=cosine", "leave scheduler.min_lr=1e-06"]),
    "constant with warmup steps": (["scheduler=constant", "scheduler.warmup_steps=5"], [
        "scheduler.warmup_steps=5 with scheduler=constant", "leave scheduler.warmup_steps=0"]),
    "constant with warmup epochs": (["scheduler=constant", "scheduler.warmup_epochs=1"], [
        "scheduler.warmup_epochs=1.0 with scheduler=constant", "leave scheduler.warmup_epochs=0.0"]),
    "constant with a warmup fraction": (["scheduler=constant", "scheduler.warmup_fraction=0.1"], [
        "scheduler.warmup_fraction=0.1 with scheduler=constant", "leave scheduler.warmup_fraction=0.05"]),
    "constant with a warmup start": (["scheduler=constant", "scheduler.warmup_start=0.1"], [
        "scheduler.warmup_start=0.1 with scheduler=constant", "leave scheduler.warmup_start=0.01"]),
    "warmup longer than the run": (["steps=10", "scheduler.warmup_steps=20"], [
        "scheduler.warmup_steps=20 with steps=10", "the whole run", "valid: scheduler.warmup_steps in 0..9"]),
    "warmup as long as the run": (["steps=10", "scheduler.warmup_steps=10"], [
        "scheduler.warmup_steps=10 with steps=10", "valid: scheduler.warmup_steps in 0..9"]),
    "warmup epochs as long as the run": (["epochs=2", "scheduler.warmup_epochs=2"], [
        "scheduler.warmup_epochs=2.0 with epochs=2.0", "valid: scheduler.warmup_epochs < 2.0"]),
    "warmup epochs after warmup steps": (["scheduler.warmup_steps=5", "scheduler.warmup_epochs=1"], [
        "scheduler.warmup_epochs=1.0 with scheduler.warmup_steps=5", "read only when warmup_steps=0"]),
    "warmup fraction after warmup epochs": (["scheduler.warmup_epochs=1", "scheduler.warmup_fraction=0.1"], [
        "scheduler.warmup_fraction=0.1 with scheduler.warmup_epochs=1.0", "read only when warmup_epochs=0"]),
    "warmup start without a warmup": (["scheduler.warmup_fraction=0", "scheduler.warmup_start=0.1"], [
        "scheduler.warmup_start=0.1: there is no warmup", "leave scheduler.warmup_start=0.01"]),
    "diloco shorter than its period": (["algorithm=diloco", "steps=5"], [
        "algorithm.sync_every=10 with steps=5", "never communicate", "valid: algorithm.sync_every <= 5"]),
    "localsgd shorter than its period": (["algorithm=localsgd", "algorithm.sync_every=20", "steps=10"], [
        "algorithm.sync_every=20 with steps=10", "valid: algorithm.sync_every <= 10, or steps >= 20"]),
    "streaming diloco that never syncs a fragment": (
        ["algorithm=diloco", "algorithm.sync_every=8", "algorithm.fragments=2", "steps=6"],
        ["algorithm.sync_every=8 with steps=6", "each of its 2 fragments", "a multiple of algorithm.fragments=2"]),
    # steps counts the whole run, a resumed one too: the check comes before the resume's checkpoint is read
    "a resume shorter than the period": (["algorithm=diloco", "steps=5", "resume=/no/such/run"], [
        "algorithm.sync_every=10 with steps=5"]),
    "adam with accum_iter": (["optim=adam", "optim.accum_iter=8"], [
        "optim.accum_iter=8 with optim=adam", "use optim=accum_adamw|accum_adam", "leave optim.accum_iter=4"]),
    "sgd with a beta": (["optim=sgd", "optim.beta2=0.95"], [
        "optim.beta2=0.95 with optim=sgd", "use optim=accum_adamw|accum_adam|adamw|adam", "leave optim.beta2=0.999"]),
    "adamw with momentum": (["optim=adamw", "optim.momentum=0.5"], [
        "optim.momentum=0.5 with optim=adamw", "use optim=sgd", "leave optim.momentum=0.9"]),
    "accum_adamw with nesterov": (["optim.nesterov=true"], [
        "optim.nesterov=true with optim=accum_adamw", "use optim=sgd", "leave optim.nesterov=false"]),
    "a resnet with dropout": (["model=resnet18", "model.dropout=0.1"], [
        "model.dropout=0.1 with model=resnet18", "use model=mlp|cnn|gpt2", "leave model.dropout=0.0"]),
    "a cnn with a transformer depth": (["model=cnn", "model.layers=2"], [
        "model.layers=2 with model=cnn", "use model=gpt2", "leave model.layers=12"]),
    "an mlp with channels": (["model=mlp", "model.channels=[8]"], [
        "model.channels=[8] with model=mlp", "use model=cnn", "leave model.channels=[32,64]"]),
    "digits with a synthetic size": (["dataset.num_samples=100"], [
        "dataset.num_samples=100 with dataset=digits", "use dataset=synthetic", "leave dataset.num_samples=8192"]),
    "synthetic with a test fraction": (["dataset=synthetic", "dataset.test_fraction=0.5"], [
        "dataset.test_fraction=0.5 with dataset=synthetic", "use dataset=digits"]),
    "digits with a data directory": (["dataset.root=/data"], [
        "dataset.root=/data with dataset=digits", "use dataset=npz|cifar10|cifar100|imagefolder|tokens"]),
    "cifar with an image size": (["dataset=cifar10", f"dataset.root={CIFAR}", "dataset.image_size=64"], [
        "dataset.image_size=64 with dataset=cifar10", "use dataset=imagefolder", "leave dataset.image_size=224"]),
    "an iid split of cifar with a seed": (["dataset=cifar10", f"dataset.root={CIFAR}", "dataset.split_seed=3"], [
        "dataset.split_seed=3 with dataset=cifar10", "leave dataset.split_seed=0"]),
    "shards with a dirichlet alpha": (["dataset.partition=shards", "dataset.alpha=0.1"], [
        "dataset.alpha=0.1 with dataset.partition=shards", "use dataset.partition=dirichlet", "leave dataset.alpha=0.5"]),
    "iid with classes per worker": (["dataset.classes_per_worker=3"], [
        "dataset.classes_per_worker=3 with dataset.partition=iid", "use dataset.partition=classes"]),
    "no fault tolerance with a detection time": (["fault_tolerance.detect_s=5"], [
        "fault_tolerance.detect_s=5.0 with fault_tolerance=none", "use fault_tolerance=live",
        "leave fault_tolerance.detect_s=10.0"]),
    "no fault tolerance with a minimum": (["fault_tolerance.min_workers=2"], [
        "fault_tolerance.min_workers=2 with fault_tolerance=none", "use fault_tolerance=live"]),
    "no wandb with a project": (["logger=jsonl", "logger.wandb.project=mine"], [
        "logger.wandb.project=mine with logger.wandb.mode=disabled", "use logger.wandb.mode=offline|online",
        "leave logger.wandb.project=decent-train"]),
    "no wandb with an entity": (["logger=jsonl", "logger.wandb.entity=me"], [
        "logger.wandb.entity=me with logger.wandb.mode=disabled", "leave logger.wandb.entity=null"]),
    "no consensus with its samples": (["logger.consensus_every=0", "logger.consensus_samples=0"], [
        "logger.consensus_samples=0 with logger.consensus_every=0", "leave logger.consensus_samples=65536"]),
}

ACCEPTED = {  # the neighbours: the same key at its default, or under the option that reads it
    "allreduce": ["algorithm=allreduce"],
    "allreduce with the default topology": ["algorithm=allreduce", "topology=ring"],  # cannot be told from unset
    "gossip over a topology": ["topology=one-peer-exp", "topology.local_world_size=2"],
    "diloco's outer step over a topology": ["algorithm=diloco", "topology=complete", "steps=20"],
    "phases that gossip over the topology": ["topology=one-peer-exp", "steps=20",
                                             "phases=[{algorithm:allreduce,steps:5},{}]"],
    "phases that name their topology": ["phases=[{algorithm:allreduce,steps:5},{topology:one-peer-exp}]"],
    "int8 with its block": ["compression=int8", "compression.int8_block=64", "compression.consensus_step=0.5"],
    "bf16 with its keys": ["compression=bf16", "compression.consensus_step=0.5", "compression.copy_dtype=bf16"],
    "no compression, keys at their defaults": ["compression=none", "compression.int8_block=256",
                                               "compression.consensus_step=1.0", "compression.copy_dtype=param"],
    "constant": ["scheduler=constant"],
    "constant, keys at their defaults": ["scheduler=constant", "scheduler.min_lr=1e-6", "scheduler.warmup_steps=0"],
    "cosine with its keys": ["scheduler.min_lr=0.1", "scheduler.warmup_start=0.1", "scheduler.warmup_fraction=0.2"],
    "warmup one step short of the run": ["steps=10", "scheduler.warmup_steps=9"],
    "warmup epochs short of the run": ["epochs=2", "scheduler.warmup_epochs=1.5"],
    "warmup steps, fraction at its default": ["scheduler.warmup_steps=5", "scheduler.warmup_fraction=0.05"],
    "warmup epochs, fraction 0 (the recipes')": ["scheduler.warmup_steps=0", "scheduler.warmup_epochs=1",
                                                 "scheduler.warmup_fraction=0"],
    "no warmup, start at its default": ["scheduler.warmup_fraction=0"],
    # Left accepted: warmup and run counted in different units. An epoch's steps are known only in the worker (the
    # data's size, the world size the run started with), so the launcher cannot compare them.
    "warmup steps in a run of epochs": ["epochs=1", "scheduler.warmup_steps=100000"],
    "warmup epochs in a run of steps": ["steps=10", "scheduler.warmup_epochs=50"],
    "diloco's period equal to the run": ["algorithm=diloco", "steps=10"],
    "streaming diloco that syncs each fragment once": ["algorithm=diloco", "algorithm.sync_every=8",
                                                       "algorithm.fragments=2", "steps=8"],
    "diloco in a run of epochs": ["algorithm=diloco", "algorithm.sync_every=500"],  # left accepted, as the warmup
    "accum_adamw with its accum_iter": ["optim.accum_iter=8", "optim.beta2=0.95"],
    "adam with its keys": ["optim=adam", "optim.beta1=0.8", "optim.eps=1e-6", "optim.accum_iter=4"],
    "sgd with its keys": ["optim=sgd", "optim.momentum=0.5", "optim.nesterov=true", "optim.beta2=0.999"],
    "an mlp with its keys": ["model=mlp", "model.hidden_sizes=[8]", "model.dropout=0.1", "model.layers=12"],
    "a resnet with its stem": ["model=resnet18", "model.small_stem=true", "model.dropout=0.0"],
    "synthetic with its keys": ["dataset=synthetic", "dataset.num_samples=512", "dataset.noise=1.0",
                                "dataset.split_seed=3", "dataset.test_fraction=0.2"],
    "digits with its keys": ["dataset.test_fraction=0.5", "dataset.split_seed=3", "dataset.image_size=224"],
    "dirichlet with its alpha": ["dataset.partition=dirichlet", "dataset.alpha=1.0"],
    "a fixed partition of cifar with its seed": ["dataset=cifar10", f"dataset.root={CIFAR}", "dataset.partition=shards",
                                                 "dataset.split_seed=3"],
    "classes with classes per worker": ["dataset.partition=classes", "dataset.classes_per_worker=5"],
    "live with its keys": ["fault_tolerance=live", "fault_tolerance.detect_s=5", "fault_tolerance.min_workers=1"],
    "wandb offline with a project": ["logger.wandb.project=mine", "logger.wandb.tags=[a]"],
    "no wandb, keys at their defaults": ["logger=jsonl", "logger.wandb.project=decent-train"],
    "consensus with its samples": ["logger.consensus_samples=0"],
}


# What a run of its own length never reaches: refused in a sweep's job too. The rest are keys that the job's option
# does not read, which in a sweep are the other jobs' (``-m algorithm=decentralized,allreduce topology=one-peer-exp``).
MISSED_BY_THE_JOB = {"warmup longer than the run", "warmup as long as the run", "warmup epochs as long as the run",
                     "diloco shorter than its period", "localsgd shorter than its period",
                     "streaming diloco that never syncs a fragment", "a resume shorter than the period"}


READERS = [  # (group, schema, key -> the options that read it, the key that picks them; None: the group's choice)
    ("optim", OptimConfig, OPTIM_READERS, None), ("scheduler", SchedulerConfig, SCHEDULER_READERS, None),
    ("model", ModelConfig, models.READERS, None), ("dataset", DatasetConfig, data.READERS, None),
    ("dataset", DatasetConfig, data.PARTITION_READERS, "partition"),
    ("compression", CompressionConfig, compression.READERS, None),
    ("fault_tolerance", FaultToleranceConfig, FAULT_TOLERANCE_READERS, None),
]


@pytest.mark.parametrize("group, schema, readers, selector", READERS, ids=lambda v: v if isinstance(v, str) else "")
def test_help_shows_a_key_under_the_options_that_read_it(group: str, schema: type, readers: dict[str, tuple[str, ...]],
                                                         selector: str | None) -> None:
    """``--help`` lists a key under the options its comment names (``optim.accum_iter`` under accum_adam and
    accum_adamw only); the refusals name their readers in a table of their own. Both must agree, or the help would
    show a key that is refused, or hide one that is read."""
    options = set(group_options(CONF)[group])
    for key, reading in readers.items():
        alternatives, _ = split_conditions(field_docs(schema)[key], options)
        assert any((selector or "", "=", set(reading)) in conditions for conditions in alternatives), (
            key, field_docs(schema)[key])


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cifar")
    write_cifar(root, "cifar10")
    return root


def with_data(case: str, cifar_dir: Path) -> tuple[list[str], list[str]]:
    """``REFUSED[case]`` with its data directory (the same replacement serves ``ACCEPTED``)."""
    overrides, expected = REFUSED[case]
    return [arg.replace(CIFAR, str(cifar_dir)) for arg in overrides], expected


@pytest.mark.parametrize("case", REFUSED)
def test_in_a_sweep_a_key_other_jobs_read_is_theirs(case: str, cifar_dir: Path) -> None:
    """A sweep's options are shared by jobs whose options differ: a key only some of them read passes in the others
    (as ``++algorithm.KEY`` does), and what the job itself would miss is still refused, in the same words."""
    overrides, expected = with_data(case, cifar_dir)
    line = check_like_the_cli([*overrides, "run.job_num=1"])  # what the launcher sets in a sweep's job
    if case in MISSED_BY_THE_JOB:
        assert line is not None and all(fragment in line for fragment in expected), line
    else:
        assert line is None, line


@pytest.mark.parametrize("case", REFUSED)
def test_an_ignored_option_is_refused_in_one_line(case: str, cifar_dir: Path) -> None:
    overrides, expected = with_data(case, cifar_dir)
    line = check_like_the_cli(overrides)
    assert line is not None, f"{overrides} was accepted"
    assert "\n" not in line.strip()
    for fragment in expected:
        assert fragment in line, line


@pytest.mark.parametrize("case", ACCEPTED)
def test_its_neighbour_is_accepted(case: str, cifar_dir: Path) -> None:
    line = check_like_the_cli([arg.replace(CIFAR, str(cifar_dir)) for arg in ACCEPTED[case]])
    if case == "live with its keys" and not reconfigure.supported():
        # its keys passed the config's checks; the preflight's next one refuses live mode on this torch
        assert line is not None and line.startswith("fault_tolerance=live needs torch >= 2.14"), line
    else:
        assert line is None, line


def test_a_workers_reload_refuses_the_same() -> None:
    """``check_config`` runs again in each worker, on the resolved YAML: the same rules, not only the launcher's."""
    with pytest.raises(ValueError, match=r"^scheduler\.min_lr=0\.1 with scheduler=constant"):
        check_config({"scheduler": {"name": "constant", "min_lr": 0.1}})
    with pytest.raises(ValueError, match=r"^algorithm\.sync_every=10 with steps=5"):
        check_config({"algorithm": {"name": "localsgd"}, "steps": 5})
    assert check_config({"algorithm": {"name": "localsgd"}, "steps": 10}).algorithm.sync_every == 10


def test_a_run_written_before_the_refusals_still_loads(tmp_path: Path) -> None:
    """``load_model`` reads a run as it ran: a run of the all-reduce twin recipes as they were (the base recipe's
    topology under all-reduce), or with the other ignored options above, still loads; only a new job is refused."""
    from decent_train.components.checks import as_written  # here: the file's other tests run on any version
    written = {"algorithm": "allreduce", "topology": {"name": "alternating-exp-ring"}, "steps": 4,
               "scheduler": {"name": "constant", "min_lr": 0.1}, "compression": {"int8_block": 64},
               "model": {"name": "mlp", "hidden_sizes": [8]},
               "dataset": {"name": "synthetic", "input_shape": [5], "num_classes": 4}}
    with pytest.raises(ValueError, match="^scheduler.min_lr=0.1 with scheduler=constant"):
        check_config(written)
    with as_written():
        cfg = check_config(written)
    _write_run(tmp_path, cfg, build_model(cfg.model, (5,), 4).state_dict(), (5,), 4)
    loaded = package.load_model(tmp_path)
    assert loaded.config == cfg and (loaded.config.topology.name, loaded.config.scheduler.min_lr) == (
        "alternating-exp-ring", 0.1)
    with pytest.raises(ValueError, match="^topology=alternating-exp-ring with algorithm=allreduce"):
        check_config(written | {"scheduler": {}, "compression": {}})  # as_written ends with its block


# What the command itself runs: one case per group the refusals come from (the table above goes through every case
# in process, by the same functions; each command costs an interpreter that imports torch, about 2 s of a core).
COMMAND_CASES = ["allreduce with a topology", "no compression with an int8 block", "warmup as long as the run",
                 "diloco shorter than its period", "a resume shorter than the period", "adamw with momentum",
                 "a resnet with dropout", "cifar with an image size", "iid with classes per worker",
                 "no fault tolerance with a detection time", "no wandb with a project", "no consensus with its samples"]


@pytest.fixture(scope="module")
def refused_runs(tmp_path_factory: pytest.TempPathFactory, cifar_dir: Path) -> dict[str, tuple[str, str, int, Path]]:
    """The refused commands of COMMAND_CASES, six at a time (each costs an interpreter start, not a launch)."""
    root = tmp_path_factory.mktemp("ignored")
    runs: dict[str, tuple[str, str, int, Path]] = {}
    for first in range(0, len(COMMAND_CASES), 6):
        started = {}
        for name in COMMAND_CASES[first:first + 6]:
            run_dir = root / name.replace(" ", "_")
            started[name] = (start(*with_data(name, cifar_dir)[0], f"hydra.run.dir={run_dir}", cwd=root), run_dir)
        runs |= {name: (*proc.communicate(timeout=180), proc.returncode, run_dir)
                 for name, (proc, run_dir) in started.items()}
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("case", COMMAND_CASES)
def test_the_command_refuses_it_before_any_worker(case: str, refused_runs: dict) -> None:
    _, stderr, returncode, run_dir = refused_runs[case]
    assert returncode == 2, stderr
    (line,) = stderr.strip().splitlines()
    assert line.startswith("decent-train: error: ")
    assert all(fragment in line for fragment in REFUSED[case][1]), line
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_sweep_compares_allreduce_with_gossip_over_a_topology(tmp_path: Path) -> None:
    """The README's side-by-side comparison on a job with its own topology: both jobs pass (dry runs: the checks
    the launcher and the workers run), and one job alone with the same options is still refused."""
    sweep = tmp_path / "sweep"
    proc = decent_train("-m", "algorithm=decentralized,allreduce", "topology=one-peer-exp", "dry_run=true",
                        f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    check_succeeded(proc)
    assert proc.stdout.count("dry run: nothing trained") == 2, proc.stdout
    assert "all-reduce (torch DDP)" in proc.stdout and "one-peer-exp" in proc.stdout
    for job in ("0", "1"):
        check_config_of_a_worker = check_config(OmegaConf.load(sweep / job / RESOLVED_CONFIG))
        assert check_config_of_a_worker.topology.name == "one-peer-exp"
    alone = decent_train("algorithm=allreduce", "topology=one-peer-exp", "dry_run=true", cwd=tmp_path)
    assert alone.returncode == 2 and "topology=one-peer-exp with algorithm=allreduce" in alone.stderr


@pytest.mark.slow
def test_a_period_equal_to_the_run_takes_its_outer_step_at_the_end(tmp_path: Path) -> None:
    """The boundary the refusal leaves open communicates: ``sync_every == steps`` takes one outer step, the last."""
    run_dir = tmp_path / "run"
    check_succeeded(decent_train("algorithm=diloco", "algorithm.sync_every=4", "steps=4", "launch.nproc_per_node=2",
                                 "model=mlp", "logger=jsonl", "logger.progress_bar=false", "logger.log_every=1",
                                 "eval_every=0", f"hydra.run.dir={run_dir}", cwd=tmp_path))
    outer = {r["step"]: r["outer/step"] for r in records(run_dir) if "outer/step" in r}
    assert outer == {1: 0, 2: 0, 3: 0, 4: 1}, outer
    assert json.loads((run_dir / "result.json").read_text())["steps"] == 4


@pytest.mark.parametrize(("overrides", "line"), [
    (["+foo=bar"], "foo is not a key; valid at the top level: algorithm, seed, steps"),
    (["++optim.lrr=0.1"], "optim.lrr is not a key; valid in optim: name, lr, weight_decay"),
    (["algorithm=diloco", "++algorithm.sync_evry=5"], "algorithm.sync_evry is not a key; valid in algorithm: name"),
    (["algorithm=diloco", "++algorithm.sync_evry=5", "run.job_num=1"], "algorithm.sync_evry is not a key"),  # swept
    (["++model.hidden_sizez=[8]", "run.job_num=1"], "model.hidden_sizez is not a key"),
    (["algorithm=decentralized", "++algorithm.sync_every=5", "run.job_num=1"], None),  # another job's (diloco's)
])
def test_a_key_added_with_plus_that_no_schema_has_is_refused(overrides: list[str], line: str | None) -> None:
    """Hydra adds ``+key=``/``++key=`` to the typed config whatever the key; before, the job dropped an unknown one
    without a word (a misspelt ``++algorithm.sync_evry=5`` trained with sync_every=10). In a sweep's job an
    algorithm's option may be another job's."""
    got = check_like_the_cli(overrides)
    assert (got is None) if line is None else (got is not None and got.startswith(line)), got
