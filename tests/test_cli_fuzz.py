"""The command line, fuzzed (issue 38, point 2): overrides drawn from the config schema either give a job that passes
the launcher's checks or end in one line (``describe_error``), never a traceback.

The strategies are read from the schema, not written per key: every leaf of ``TrainConfig`` (and of each algorithm's
options) gives values of its type (bools; ints and floats around the default, zero, negatives, nan and inf; ``null``
where Optional; names from the option files of its group, the registry it is checked against, or a few letters),
every config group its option files and a name that is none of them, and a few keys that do not exist. A job is then
composed and checked as ``decent-train`` does before starting any worker (Hydra's compose, ``check_config``, the
preflight). A case it finds is kept as a regular test (a case of tests/test_config.py or tests/test_cli.py); it
found none in 1,000 examples on 2026-11-26 (the suite's 200, and 800 more run once with five overrides a job).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import decent_train.algorithms  # noqa: F401  (registers diloco and localsgd)
from decent_train.config import ALGORITHM_TRAITS, TrainConfig, check_config
from decent_train.launcher.job import describe_error, shipped_dir
from decent_train.launcher.preflight import preflight

CONF = Path(shipped_dir("conf"))
SKIPPED = {"run", "resume", "dry_run"}  # the launcher's own facts; resume: tests/test_checkpoint.py
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")
OPTIONS = {group: sorted(p.stem for p in (CONF / group).glob("*.yaml")) for group in GROUPS}
NAMES = st.text("abcdefghijklmnopqrstuvwxyz_-0123456789", min_size=1, max_size=8)


def _format(value: Any) -> str:
    """A value as Hydra's override grammar reads it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value == math.inf else "-inf" if value == -math.inf
                                               else repr(value))
    if isinstance(value, list):
        return "[" + ",".join(_format(v) for v in value) + "]"
    return str(value)


def _values(hint: Any, default: Any) -> st.SearchStrategy[str]:
    """Override values for a field of type ``hint`` whose default is ``default``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return st.one_of(*(_values(a, default) for a in args if a is not type(None)),
                         st.just("null") if type(None) in args else st.nothing())
    if hint is bool:
        return st.booleans().map(_format)
    if hint is int:
        near = default if isinstance(default, int) else 1
        return st.one_of(st.sampled_from([0, 1, -1, near, near + 1, 2 * near]), st.integers(-3, 9)).map(_format)
    if hint is float:
        near = default if isinstance(default, float) else 1.0
        special = [0.0, -1.0, near, near * 2, math.nan, math.inf, 1e-9, 0.5, 1.5]
        return st.one_of(st.sampled_from(special), st.floats(-2, 4, allow_nan=False)).map(_format)
    if hint is str:
        return st.one_of(st.just(str(default)), NAMES)
    if origin is list:
        item = args[0] if args else int
        if dataclasses.is_dataclass(item):  # phases: entries of the phase schema's keys
            entry = st.fixed_dictionaries({}, optional={
                f.name: _values(typing.get_type_hints(item)[f.name], f.default) for f in dataclasses.fields(item)})
            return st.lists(entry, max_size=3).map(
                lambda entries: "[" + ",".join("{" + ",".join(f"{k}:{v}" for k, v in e.items()) + "}"
                                               for e in entries) + "]")
        return st.lists(_values(item, 1), max_size=3).map(lambda xs: "[" + ",".join(xs) + "]")
    return st.nothing()


def _leaves(schema: type, prefix: str = "") -> list[tuple[str, st.SearchStrategy[str]]]:
    """(key, value strategy) for every leaf of ``schema`` under ``prefix``."""
    out = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if not prefix and f.name in SKIPPED:
            continue
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            out += _leaves(hints[f.name], key + ".")
        elif typing.get_origin(hints[f.name]) is dict:
            continue
        else:
            out.append((key, _values(hints[f.name], default)))
    return out


def _overrides() -> st.SearchStrategy[str]:
    """One override: a leaf set to a value of its type, a group's option (or a name that is none), or a key that does
    not exist."""
    leaves = _leaves(TrainConfig)
    for name, traits in ALGORITHM_TRAITS.items():  # each algorithm's own options
        leaves += [(key, values) for key, values in _leaves(traits.schema, "algorithm.") if key != "algorithm.name"]
    by_leaf = st.sampled_from(leaves).flatmap(lambda kv: kv[1].map(lambda v: f"{kv[0]}={v}"))
    by_group = st.sampled_from(GROUPS).flatmap(
        lambda g: st.one_of(st.sampled_from(OPTIONS[g]), NAMES).map(lambda o: f"{g}={o}"))
    unknown = st.one_of(NAMES, st.sampled_from([k for k, _ in leaves]).map(lambda k: k + "x")).map(lambda k: f"{k}=1")
    return st.one_of(by_group, by_group, by_leaf, by_leaf, by_leaf, unknown)


def check_like_the_cli(overrides: list[str]) -> str | None:
    """What ``decent-train <overrides>`` does before any worker starts; None if the job passes, else the one line it
    prints. An error ``describe_error`` does not sort (a traceback on the console) fails the test."""
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("train", overrides=overrides)
        if cfg.launch.nproc_per_node is None:
            cfg.launch.nproc_per_node = 1  # the launcher: one per GPU (none here)
        preflight(check_config(cfg))
        return None
    except Exception as error:  # noqa: BLE001 - sorted as the CLI sorts it
        message = describe_error(error)
        if message is None:
            raise
        assert "\n" not in message.strip(), f"{overrides}: not one line: {message!r}"
        return message


EXAMPLES = 200


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_overrides(), max_size=4, unique_by=lambda o: o.split("=")[0]))
def test_every_generated_override_list_passes_or_ends_in_one_line(overrides: list[str]) -> None:
    check_like_the_cli(overrides)


EDGES: dict[Any, list[Any]] = {
    bool: [False, True], int: [-1, 0, 1, 2], float: [-1.0, 0.0, 1e-9, math.nan, math.inf], str: ["", "x"]}


def _edge_overrides() -> list[dict[str, Any]]:
    """Every leaf of the schema (each algorithm's options under that algorithm) alone at each edge of its type, and
    ``null`` where it is Optional: what the bounded fuzz reaches only by chance (a key among a hundred)."""
    jobs = []
    leaves = [(schema, "", key) for schema in [TrainConfig] for key in _leaf_keys(TrainConfig)]
    leaves += [(traits.schema, name, key) for name, traits in ALGORITHM_TRAITS.items()
               for key in _leaf_keys(traits.schema) if key != "name"]
    for schema, algorithm, key in leaves:
        hint = _hint(schema, key)
        optional = typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint)
        base = next((a for a in typing.get_args(hint) if a is not type(None)), hint) if optional else hint
        for value in EDGES.get(base, []) + ([None] if optional else []):
            job: dict[str, Any] = {}
            node = job.setdefault("algorithm", {"name": algorithm}) if algorithm else job
            *parents, leaf = key.split(".")
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = value
            jobs.append(job)
    return jobs


def _leaf_keys(schema: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(schema)
    keys = []
    for f in dataclasses.fields(schema):
        if (not prefix and f.name in SKIPPED) or f.name == "algorithm" and schema is TrainConfig:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            keys += _leaf_keys(hints[f.name], f"{prefix}{f.name}.")
        elif typing.get_origin(hints[f.name]) not in (dict, list):
            keys.append(prefix + f.name)
    return keys


def _hint(schema: type, key: str) -> Any:
    head, _, rest = key.partition(".")
    hint = typing.get_type_hints(schema)[head]
    return _hint(hint, rest) if rest else hint


def test_every_leaf_at_its_edges_passes_or_refuses_in_one_line() -> None:
    """The same checks as the launcher's (the schema's dataclasses, then the preflight), without Hydra's composing:
    fast enough for every leaf and edge."""
    from tests.test_matrix import build  # the matrix's OmegaConf-free check_config

    jobs, problems = _edge_overrides(), []
    for job in jobs:
        try:
            cfg = build(job)
            if cfg.launch.nproc_per_node is None:
                cfg.launch.nproc_per_node = 1
            preflight(cfg)
        except ValueError as error:
            if "\n" in str(error).strip():
                problems.append(f"{job}: not one line: {error!r}")
        except Exception as error:  # noqa: BLE001 - a traceback on the console
            problems.append(f"{job}: {type(error).__name__}: {error}")
    assert len(jobs) > 300 and not problems, "\n".join(problems)
