"""What the command line says to a user who asks or errs (issue 40, point 4): ``decent-train --help`` and a word that
is not ``key=value``."""

from __future__ import annotations

import dataclasses
import subprocess
import typing
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import decent_train
import decent_train.algorithms  # noqa: F401  (registers diloco and localsgd)
from decent_train.config import ALGORITHM_TRAITS, TrainConfig
from decent_train.launcher import help as help_module
from decent_train.components.data import DATASET_NAMES, PARTITIONS, READERS, DatasetConfig
from decent_train.components.launch import LaunchConfig
from decent_train.launcher.job import _workers, shipped_dir

from .jobs import COMMAND
from .test_cli_fuzz import check_like_the_cli

EXPECTED = "expected key=value, e.g. {} (see decent-train --help)"


@pytest.mark.parametrize(("words", "line"), [
    (["topology"], "'topology' is not key=value; " + EXPECTED.format("topology=ring")),
    (["steps", "100"], "'steps' is not key=value; " + EXPECTED.format("steps=VALUE")),
    (["+extra"], "'+extra' is not key=value; " + EXPECTED.format("+extra=VALUE")),
    (["topology=ring]"], "'topology=ring]' cannot be read as key=value (extraneous input ']' expecting <EOF>); "
                         + EXPECTED.format("topology=ring")),
    (["a b"], "'a b' is not key=value; " + EXPECTED.format("topology=ring")),
    (["model=[1"], "'model=[1' cannot be read as key=value (no viable alternative at input '[1'); "
                   + EXPECTED.format("model=cnn")),
])
def test_a_word_that_is_not_key_value_is_one_line(words: list[str], line: str) -> None:
    assert check_like_the_cli(words) == line


@pytest.mark.slow
def test_a_bare_group_and_option_is_one_line_and_exit_2() -> None:
    proc = subprocess.run([str(COMMAND), "topology", "ring"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "decent-train: error: 'topology' is not key=value; " + EXPECTED.format("topology=ring") + "\n"


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--help"], ["dry_run=true"]])
def test_output_whose_reader_left_ends_quietly(args: list[str], tmp_path: Path) -> None:
    """``decent-train --help | head -1``: the reader closes the pipe, and the next write raises BrokenPipeError (the
    interpreter ignores SIGPIPE). Here the pipe is closed before the first write. Ends as a writer SIGPIPE kills: no
    traceback, nothing from Hydra, status 128 + 13."""
    proc = subprocess.Popen([str(COMMAND), *args, f"hydra.run.dir={tmp_path / 'run'}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == "", err


# -- decent-train --help --------------------------------------------------------------------------------------------
def _help(*overrides: str, show_all: bool = False) -> list[str]:
    """The help ``decent-train OVERRIDES --help`` prints, composed in this process as Hydra composes it there."""
    help_module.SHOW_ALL = show_all
    try:
        with initialize_config_dir(config_dir=shipped_dir("conf"), version_base="1.3"):
            cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
        return str(cfg.hydra.help.template).replace("$$", "$").splitlines()
    finally:
        help_module.SHOW_ALL = False


def _listed(lines: list[str]) -> dict[str, str]:
    """key -> description of every key line (``  key=value   description``)."""
    keys = {}
    for line in lines:
        if line.startswith("  ") and not line.startswith("  -") and "=" in line.split(" ")[2]:
            key, _, rest = line.strip().partition("=")
            keys[key] = rest.partition(" ")[2].strip()
    return keys


SOURCE = "\n".join(p.read_text() for p in Path(decent_train.__file__).parent.rglob("*.py"))


@pytest.mark.slow
def test_the_default_help_fits_a_screen_and_describes_every_key() -> None:
    proc = subprocess.run([str(COMMAND), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.rstrip("\n").splitlines()
    assert len(lines) <= 60 and all(len(line) <= 120 for line in lines), proc.stdout
    assert "Hydra" not in lines[0] and "algorithm_schema" not in proc.stdout  # internal groups, recipes' folders
    assert not any(line.startswith(("local_steps", "study")) for line in lines)
    groups = sorted(p.name for p in Path(shipped_dir("conf")).iterdir() if p.is_dir() and p.name != "hydra")
    assert sorted(line.partition("=")[0] for line in lines if not line.startswith(" ") and "=" in line.split(" ")[0]) \
        == groups
    listed = _listed(lines)
    assert len(listed) > 30 and "model.channels" in listed and "seed" in listed
    for key, description in listed.items():  # each one is its field's comment, as written in the source
        assert description and description.rstrip(".") in SOURCE, (key, description)


@pytest.mark.parametrize(("overrides", "present", "absent"), [
    ([], ["model.channels", "global_avg_every", "epochs", "topology.local_world_size"],
     ["model.layers", "model.hidden_sizes", "model.small_stem", "compression.int8_block", "fault_tolerance.detect_s",
      "dataset.alpha", "parallel.mixed_precision", "launch.slurm.partition", "algorithm.sync_every", "run.choices"]),
    (["model=gpt2", "dataset=tokens"], ["model.layers", "model.heads", "dataset.context_length", "dataset.root"],
     ["model.channels", "channels_last", "dataset.test_fraction", "dataset.partition"]),
    (["algorithm=allreduce"], ["optim.lr"], ["global_avg_every", "phases", "topology.local_world_size"]),
    (["algorithm=diloco"], ["algorithm.sync_every", "algorithm.outer_lr"], ["global_avg_every", "phases"]),
    (["algorithm=localsgd"], ["algorithm.sync_every"], ["algorithm.outer_lr"]),
    (["steps=100", "optim=sgd", "scheduler=constant"], ["optim.momentum"],
     ["epochs", "optim.beta1", "optim.accum_iter", "scheduler.min_lr"]),
    (["dataset.partition=dirichlet", "compression=int8", "parallel.shard=2", "fault_tolerance=live"],
     ["dataset.alpha", "compression.int8_block", "parallel.mixed_precision", "fault_tolerance.detect_s"],
     ["dataset.classes_per_worker"]),
])
def test_the_help_lists_the_keys_that_apply_to_the_choices(overrides: list[str], present: list[str],
                                                           absent: list[str]) -> None:
    listed = _listed(_help(*overrides))
    assert [k for k in present if k not in listed] == [] and [k for k in absent if k in listed] == []


def test_the_help_shows_the_chosen_options() -> None:
    lines = _help("topology=complete", "model=mlp")
    assert "topology=complete  (or alternating-exp-ring, hierarchical, one-peer-exp, ring)" in lines
    assert "model=mlp  (or cnn, gpt2, resnet18, resnet50)" in lines
    assert f"{'  model.hidden_sizes=[128,128]':<33} width of each hidden layer" in lines


@pytest.mark.parametrize("algorithm", sorted(ALGORITHM_TRAITS))
def test_topology_and_compression_show_where_the_algorithm_gossips(algorithm: str) -> None:
    groups = {line.partition("=")[0] for line in _help(f"algorithm={algorithm}") if not line.startswith(" ")}
    assert ({"topology", "compression"} <= groups) == ALGORITHM_TRAITS[algorithm].gossips
    assert ({"topology", "compression"} & groups == set()) == (not ALGORITHM_TRAITS[algorithm].gossips)


def test_help_all_lists_the_advanced_keys_too() -> None:
    short, full = _listed(_help()), _listed(_help(show_all=True))
    assert set(short) < set(full) and {"pg_timeout_s", "logger.wandb.mode", "launch.threads_per_worker"} <= set(full)
    more = next(line for line in _help() if line.startswith("--help-all"))
    assert more.startswith(f"--help-all: {len(full) - len(short)} more keys;")
    keys = [key for _, schema in _schemas() for key, _, _ in _fields(schema, "algorithm." if schema is not TrainConfig
                                                                       else "")]
    assert [p for p in help_module.ADVANCED if not any(k.startswith(p) for k in keys)] == []  # no stale names


def _schemas() -> list[tuple[str, type]]:
    return [("", TrainConfig)] + [(f"algorithm={name}: algorithm.", traits.schema)
                                  for name, traits in ALGORITHM_TRAITS.items()]


def _fields(schema: type, prefix: str = "") -> list[tuple[str, type, str]]:
    """(dotted key, its dataclass, field name) of every field under ``schema``."""
    out = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        out.append((prefix + f.name, schema, f.name))
        if dataclasses.is_dataclass(hints[f.name]):
            out += _fields(hints[f.name], prefix + f.name + ".")
    return out


def test_every_key_a_user_sets_has_a_description() -> None:
    """A new field needs its comment: the help shows it. The launcher's own facts (run.*) and the groups' names (the
    group's line) are not listed."""
    missing = []
    for where, schema in _schemas():
        for key, owner, name in _fields(schema):
            hint = typing.get_type_hints(owner)[name]
            if key.startswith("run") or dataclasses.is_dataclass(hint) or name == "name" or key == "algorithm":
                continue
            if not help_module.field_docs(owner).get(name):
                missing.append(where + key)
    assert missing == []


def test_every_condition_names_a_key_or_group_that_exists() -> None:
    """A misspelt ``algoritm=decentralized:`` would hide its key everywhere: each condition's key is a group, a key of
    the same dataclass or of the config, and each value one it can take."""
    cfg = OmegaConf.structured(TrainConfig)
    groups = help_module.group_options(Path(shipped_dir("conf")))
    problems = []
    for _, schema in _schemas():
        for key, owner, name in _fields(schema):
            options = set(groups.get(key.partition(".")[0], [])) if "." in key else set()
            alternatives, _ = help_module.split_conditions(help_module.field_docs(owner).get(name, ""), options)
            for condition_key, _, values in (c for conditions in alternatives for c in conditions):
                parent = key.rpartition(".")[0]
                if condition_key in groups:
                    wrong = values - set(groups[condition_key])
                elif condition_key == "hydra/launcher":
                    wrong = values - {"basic", "slurm"}
                elif not condition_key:
                    wrong = set()
                elif OmegaConf.select(cfg, f"{parent}.{condition_key}" if parent else condition_key,
                                      default="missing") != "missing" or OmegaConf.select(cfg, condition_key,
                                                                                          default="missing") != "missing":
                    wrong = set()
                else:
                    wrong = {f"{condition_key}?"}
                if wrong:
                    problems.append(f"{key}: {condition_key} {sorted(wrong)}")
    assert problems == []


# -- how many workers the launcher's lines name -----------------------------------------------------------------------
@pytest.mark.parametrize(("nnodes", "shard", "world_size", "said"), [
    (1, 1, None, "4 workers"),
    (1, 2, None, "4 workers (2 replicas x 2 shards)"),
    (1, 4, None, "4 workers (1 replicas x 4 shards)"),
    ("1:2", 2, None, "4 to 8 workers (2 to 4 replicas x 2 shards)"),
    ("1:2", 2, 4, "4 workers (2 replicas x 2 shards)"),  # the summary: the world the run ended with
])
def test_the_start_line_and_summary_name_replicas_and_shards(nnodes: int | str, shard: int, world_size: int | None,
                                                             said: str) -> None:
    launch = LaunchConfig(nproc_per_node=4, nnodes=nnodes, rdzv_endpoint="host:29400", rdzv_id="job")
    assert _workers(launch, shard, world_size) == said



def _dataset_keys(dataset: str, partition: str, **keys: object) -> dict[str, object]:
    """A dataset's keys with a data directory where it reads one."""
    root = {"root": "/data"} if dataset in READERS["root"] else {}
    return {"name": dataset, "partition": partition, **root, **keys}


def _taken(**keys: object) -> bool:
    try:
        DatasetConfig(**keys)  # type: ignore[arg-type]
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(("dataset", "partition"), [(d, p) for d in DATASET_NAMES for p in PARTITIONS
                                                    if _taken(**_dataset_keys(d, p))])
def test_help_shows_split_seed_exactly_where_a_set_one_is_accepted(dataset: str, partition: str) -> None:
    """``dataset.split_seed`` is read by two datasets and by every fixed partition (an or the help's grammar states as
    ``digits, synthetic or partition!=iid``); the refusal of an unread key decides it in code of its own. For each
    pair the config takes, the help lists the key where the key set to another value is accepted, and only there."""
    accepted = _taken(**_dataset_keys(dataset, partition, split_seed=3))
    overrides = [f"dataset.{k}={v}" if k != "name" else f"dataset={v}"
                 for k, v in _dataset_keys(dataset, partition).items()]
    assert ("dataset.split_seed" in _listed(_help(*overrides, show_all=True))) == accepted


def test_a_long_description_ends_at_a_sentence_before_a_phrase() -> None:
    """Cut at the last clause that fits, ``fault_tolerance.role`` read "what this launch runs. both: the
    coordinator" (a phrase's end, after a sentence's) and ``fragment_update_alpha`` "...parameters; 0"."""
    key = "  k=v".ljust(help_module.KEY_COLUMN)
    words = "what this launch runs. both: the coordinator (the store and the plans) and this node's agent " * 2
    assert help_module._cut(f"{key} {words}") == f"{key} what this launch runs"
    phrases = "a b c, " * 30  # no sentence: the last phrase that fits
    cut = help_module._cut(f"{key} {phrases}")
    assert cut.endswith("a b c") and len(cut) <= help_module.WIDTH < len(cut) + len(", a b c")
