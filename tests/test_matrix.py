"""The combination matrix (issue 38, point 1): every combination of the options that change how a run trains either
is refused before any worker starts, in one line naming both keys, or trains.

The matrix is generated, not written: each axis reads its values from the schema (a ``bool`` field gives both values,
a name is one of the registry the config checks it against: ``ALGORITHM_TRAITS``, ``COMPRESSORS``, ``PRECISIONS``,
``FAULT_TOLERANCE``, ``PHASE_ALGORITHMS``, ``DEVICES``), so a new algorithm, compression or precision enters it by
being registered (``test_a_registered_algorithm_enters_the_matrix``). Every cell goes through what the launcher runs
(``check_config``, then the preflight) and, when accepted, through the round trip a worker makes (the resolved YAML,
checked again) and the algorithm's class. A covering sample of the accepted CPU cells trains in forked gloo workers:
every accepted value of every axis, a few cells in the suite, every accepted pair of values in the ``slow`` sample.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

import decent_train.algorithms  # noqa: F401  (registers diloco and localsgd)
from decent_train.algorithms import ALGORITHMS, Algorithm, algorithm_class, register
from decent_train.components.launch import DEVICES, LaunchConfig
from decent_train.config import (
    ALGORITHM_TRAITS, FAULT_TOLERANCE, PHASE_ALGORITHMS, PRECISIONS, AlgorithmConfig, AlgorithmTraits,
    CompressionConfig, FaultToleranceConfig, ParallelConfig, PhaseConfig, TrainConfig, check_config,
)
from decent_train.engine.compress import COMPRESSORS
from decent_train.launcher.preflight import preflight

from .distributed import run_workers
from .jobs import make_cfg, records, train_on_cpu

Override = dict[str, Any]


def _default(schema: type, key: str) -> Any:
    """The schema's default of ``key`` (a factory's value for a list or a nested config)."""
    schema_field = schema.__dataclass_fields__[key]
    if schema_field.default_factory is dataclasses.MISSING:
        return schema_field.default
    return schema_field.default_factory()


def _set(key: str, value: Any) -> Override:
    """``{"a": {"b": value}}`` for ``key="a.b"``."""
    head, _, rest = key.partition(".")
    return {head: _set(rest, value) if rest else value}


def _typed(schema: type, key: str) -> list[Any]:
    """A field's values from its type: both values of a bool; the default and the next of an int counted from 1."""
    default = _default(schema, key)
    if isinstance(default, bool):
        return [default, not default]
    if isinstance(default, int):
        return [default, default + 1]
    raise TypeError(f"{schema.__name__}.{key}: no values from its type {type(default).__name__}")


def _named(default: Any, names: Any) -> list[Any]:
    """A name's values: every name its registry holds, the schema's default first."""
    return [default, *(n for n in names if n != default)]


def _schedules() -> list[tuple[str, Override]]:
    """``phases`` / ``global_avg_every``: none; a phase of each non-default phase algorithm, then the default;
    ``global_avg_every`` at its first value past 0."""
    default = _default(TrainConfig, "phases")
    phases = [(f"phases={a}", {"phases": [{"algorithm": a, "steps": 2}, {}]}) for a in PHASE_ALGORITHMS
              if a != _default(PhaseConfig, "algorithm")]
    every = _typed(TrainConfig, "global_avg_every")[1]
    return [("-", {"phases": default}), *phases, (f"global_avg_every={every}", {"global_avg_every": every})]


GROUPS = ("algorithm", "compression", "fault_tolerance")  # config groups: ``compression=int8`` sets its ``name``


def _algorithm(name: str) -> Override:
    """``algorithm=name``; one with outer steps (``sync_every``) takes two in the base job's steps: its default period
    would outlast them, a run that never communicates (refused)."""
    options: Override = {"name": name}
    if "sync_every" in ALGORITHM_TRAITS[name].schema.__dataclass_fields__:
        options["sync_every"] = BASE["steps"] // 2
    return options


def axes() -> list[tuple[str, list[tuple[str, Override]]]]:
    """(axis, [(label, override)]) for each axis of the matrix, read from the schema and the registries now."""
    def keyed(key: str, values: list[Any]) -> tuple[str, list[tuple[str, Override]]]:
        path = f"{key}.name" if key in GROUPS else key
        return key, [(f"{key}={v}", _set(path, v)) for v in values]

    return [
        ("algorithm", [(f"algorithm={name}", {"algorithm": _algorithm(name)})
                       for name in _named(_default(TrainConfig, "algorithm").name, ALGORITHM_TRAITS)]),
        keyed("compression", _named(_default(CompressionConfig, "name"), ("none", *COMPRESSORS))),
        keyed("parallel.shard", _typed(ParallelConfig, "shard")),
        keyed("fault_tolerance", _named(_default(FaultToleranceConfig, "name"), FAULT_TOLERANCE)),
        keyed("precision", _named(_default(TrainConfig, "precision"), PRECISIONS)),
        ("phases", _schedules()),
        keyed("compile", _typed(TrainConfig, "compile")),
        keyed("accum_steps", _typed(TrainConfig, "accum_steps")),
        keyed("launch.device", _named(_default(LaunchConfig, "device"), DEVICES)),
    ]


# Every cell starts from a small job: the model, data and launch every test here uses (tests/jobs.py).
BASE: Override = {
    "model": {"name": "mlp", "hidden_sizes": [32]},
    "launch": {"nproc_per_node": 2},
    "logger": {"log_every": 2, "progress_bar": False},
    "steps": 6,
    "batch_size": 16,
    "eval_every": 3,
    "seed": 7,
}


def _merge(a: Override, b: Override) -> Override:
    out = dict(a)
    for key, value in b.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@dataclasses.dataclass
class Cell:
    labels: tuple[str, ...]  # one per axis
    override: Override
    defaults: tuple[str, ...]  # each axis's first label: its default
    error: str | None = None  # the refusal; None: accepted

    def changed(self, axis_names: list[str]) -> list[str]:
        """The axes set away from their default."""
        return [name for name, label, first in zip(axis_names, self.labels, self.defaults) if label != first]


def build(override: Override) -> TrainConfig:
    """``check_config(override)`` without OmegaConf (60 ms a job, an hour for the matrix): the same dataclasses, so
    the same ``__post_init__`` checks; the accepted cells' sample goes through ``check_config`` too."""
    def nested(instance: Any, values: Override) -> Any:
        return dataclasses.replace(instance, **{
            k: nested(getattr(instance, k), v) if isinstance(v, dict) else v for k, v in values.items()})

    kwargs: dict[str, Any] = {}
    for key, value in override.items():
        if key == "algorithm":
            kwargs[key] = ALGORITHM_TRAITS[value["name"]].schema(**value)
        elif key == "phases":
            kwargs[key] = [PhaseConfig(**phase) for phase in value]
        elif isinstance(value, dict):
            kwargs[key] = nested(_default(TrainConfig, key), value)
        else:
            kwargs[key] = value
    return TrainConfig(**kwargs)


def cells(base: Override = BASE) -> Iterator[Cell]:
    """Every combination of the axes' values, checked as the launcher checks a job."""
    generated = axes()
    firsts = tuple(values[0][0] for _, values in generated)
    for combination in itertools.product(*(values for _, values in generated)):
        override = base
        for _, part in combination:
            override = _merge(override, part)
        cell = Cell(tuple(label for label, _ in combination), override, firsts)
        try:
            preflight(build(override))
        except ValueError as error:
            cell.error = str(error)
        yield cell


def _key_of(axis: str) -> list[str]:
    """How a refusal may name an axis's key."""
    return ["phases", "global_avg_every"] if axis == "phases" else [axis]


def _named_axes(cell: Cell, axis_names: list[str]) -> list[str]:
    message = cell.error or ""
    return [axis for axis in cell.changed(axis_names) if any(k + "=" in message or k + ":" in message
                                                              or f"{k} " in message for k in _key_of(axis))]


def _alone(cell: Cell, axis: str, axis_names: list[str]) -> Override:
    """The base job with only ``axis`` set as in ``cell``."""
    values = dict(axes())[axis]
    label = cell.labels[axis_names.index(axis)]
    return _merge(BASE, dict(values)[label])


def refusal_problems(refused: list[Cell], axis_names: list[str]) -> list[str]:
    """What is wrong with these refusals: more than one line, or naming fewer than two of the cell's changed keys
    (one, if that value is refused on its own here)."""
    problems = []
    for cell in refused:
        named = _named_axes(cell, axis_names)
        if "\n" in cell.error:  # type: ignore[operator]
            problems.append(f"{cell.labels}: not one line: {cell.error!r}")
        elif len(named) >= 2:
            continue
        elif len(named) == 1:  # a value refused on its own (here): then it must be refused alone too
            try:
                preflight(build(_alone(cell, named[0], axis_names)))
                problems.append(f"{cell.labels}: names only {named[0]}: {cell.error}")
            except ValueError:
                pass
        else:
            problems.append(f"{cell.labels}: names none of its keys: {cell.error}")
    return problems


def test_every_cell_runs_or_is_refused_in_one_line_naming_both_keys() -> None:
    axis_names = [name for name, _ in axes()]
    all_cells = list(cells())
    assert len(all_cells) == math.prod(len(values) for _, values in axes())
    refused = [c for c in all_cells if c.error is not None]
    problems = refusal_problems(refused, axis_names)
    assert not problems, f"{len(problems)} refusals:\n" + "\n".join(problems[:20])
    accepted = [c for c in all_cells if c.error is None]
    for cell in covering(accepted, 2):  # every accepted pair of values as the launcher composes it, then a worker's
        cfg = check_config(cell.override)  # round trip (the resolved YAML checked again) and its algorithm's class
        assert cfg == build(cell.override), cell.labels
        again = check_config(OmegaConf.to_container(OmegaConf.structured(cfg)))  # type: ignore[arg-type]
        assert again == cfg, cell.labels
        assert algorithm_class(cfg.algorithm.name) is ALGORITHMS[cfg.algorithm.name]
    print(f"\nmatrix: {len(all_cells)} cells, {len(accepted)} accepted, {len(refused)} refused")


# -- training a covering sample of the accepted cells ---------------------------------------------------------------
IN_PROCESS = {"fault_tolerance=live": "runs under its supervisor (tests/test_live_launcher.py trains it)",
              "launch.device=cuda": "needs GPUs (tests/test_gpu*.py)", "launch.device=auto": "cpu here: the cpu cells"}


def trainable(all_cells: list[Cell]) -> list[Cell]:
    """The accepted cells the forked gloo workers can train here: CPU, the engine's own launch."""
    return [c for c in all_cells if c.error is None and not set(c.labels) & set(IN_PROCESS)]


def covering(candidates: list[Cell], width: int, limit: int | None = None) -> list[Cell]:
    """Greedily, cells until every ``width``-tuple of values that some candidate holds is held by a chosen one
    (width 1: every value; 2: every pair), the cells with fewer slow values (compile) first on ties."""
    def tuples(cell: Cell) -> set[tuple[str, ...]]:
        return set(itertools.combinations(cell.labels, width))

    wanted = set().union(*(tuples(c) for c in candidates))
    chosen: list[Cell] = []
    while wanted and (limit is None or len(chosen) < limit):
        best = max(candidates, key=lambda c: (len(tuples(c) & wanted), "compile=False" in c.labels))
        chosen.append(best)
        wanted -= tuples(best)
    return chosen


def _train(cell: Cell, tmp_path: Path) -> None:
    run_dir = tmp_path / "-".join(label.replace("=", "_") for label in cell.labels)
    override = {k: v for k, v in cell.override.items() if k not in ("launch", "model")}
    # the forked workers share one node without LOCAL_WORLD_SIZE: the layout is set here (where a topology is read)
    gossips = ALGORITHM_TRAITS[override["algorithm"]["name"]].gossips
    cfg = make_cfg(run_dir, **_merge(override, {"topology": {"local_world_size": 2}} if gossips else {}))
    steps = cfg.steps
    results = run_workers(train_on_cpu, 2, cfg, timeout=240)
    assert len(results) == 2
    losses = [r["train/loss"] for r in records(run_dir) if "train/loss" in r]
    trained = [r["step"] for r in records(run_dir) if "step" in r]
    assert losses and all(math.isfinite(x) for x in losses), (cell.labels, losses)
    assert max(trained) == steps, (cell.labels, trained)


VALUES_SAMPLE = 6  # cells that cover every accepted value but compile=True (10-30 s each on two CPU workers)
FAST_SAMPLE = 2  # of which the default suite trains these first ones; the rest, and every pair, are slow


@pytest.mark.parametrize("index", [pytest.param(i, marks=[pytest.mark.slow] if i >= FAST_SAMPLE else [])
                                   for i in range(VALUES_SAMPLE)])
def test_every_accepted_value_trains(index: int, tmp_path: Path) -> None:
    sample = covering([c for c in trainable(list(cells())) if "compile=True" not in c.labels], 1)
    assert len(sample) <= VALUES_SAMPLE, f"{len(sample)} cells cover the values now: raise VALUES_SAMPLE"
    if index < len(sample):
        _train(sample[index], tmp_path)


@pytest.mark.slow
def test_every_accepted_pair_of_values_trains(tmp_path: Path) -> None:
    for cell in covering(trainable(list(cells())), 2):
        _train(cell, tmp_path)


@dataclasses.dataclass
class _ToyConfig(AlgorithmConfig):
    name: str = "toy"


@pytest.fixture
def toy_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A toy algorithm, registered as a user's module would (``@register(name, traits=...)``), gone afterwards."""
    for registry in (ALGORITHMS, ALGORITHM_TRAITS):
        monkeypatch.setitem(registry, "toy", None)
        monkeypatch.delitem(registry, "toy")

    @register("toy", traits=AlgorithmTraits(schema=_ToyConfig, local_steps=True))
    class Toy(Algorithm):  # never built here: the matrix checks configs
        pass


def test_a_registered_algorithm_enters_the_matrix(toy_registered: None) -> None:
    """Registering is all it takes: the algorithm axis grows by one value, and its cells meet the traits' rules (a
    local-steps algorithm refuses fp16 and the engine's global average, naming both keys)."""
    values = dict(axes())["algorithm"]
    assert [label for label, _ in values][-1] == "algorithm=toy"
    toy = [c for c in cells() if "algorithm=toy" in c.labels]
    assert len(toy) == math.prod(len(v) for name, v in axes() if name != "algorithm")
    names = [name for name, _ in axes()]
    assert not refusal_problems([c for c in toy if c.error], names)
    fp16 = [c for c in toy if c.changed(names) == ["algorithm", "precision"] and "precision=fp16" in c.labels]
    assert len(fp16) == 1 and "precision=fp16 with algorithm=toy" in (fp16[0].error or "")
    averaged = [c for c in toy if c.changed(names) == ["algorithm", "phases"] and "global_avg_every=1" in c.labels]
    assert len(averaged) == 1 and "algorithm=toy averages at its outer steps" in (averaged[0].error or "")
    assert any(c.error is None for c in toy)
