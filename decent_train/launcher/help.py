"""``decent-train --help``: the config groups with their options, and the keys that apply to the chosen options, each
with its description.

A key's description is the comment on its field in the schema's dataclasses (``config.py``, the components' and the
algorithms' ``*Config``), read from their source, so the help and the code say it in one place. A comment may start
with where its key applies, before a colon: ``cnn, mlp: ...`` (options of the key's own group), ``key=a|b: ...`` (a
value of a key of the same dataclass, else of the whole config, or a group's choice) or ``key!=a: ...``; every item
must hold, of one alternative where ``or`` separates several (``digits or partition!=iid: ...``). On a nested
dataclass's field it applies to all of its keys. Any other comment applies everywhere.

Hydra prints the help: conf/train.yaml's ``hydra.help.template`` calls :func:`help_text` through a resolver, with the
config Hydra composed from the command line, so ``decent-train topology=complete --help`` shows that choice.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from decent_train.components.checks import as_override
from decent_train.config import ALGORITHM_TRAITS, TrainConfig

WIDTH = 120  # characters a line of the help may take
KEY_COLUMN = 33  # where descriptions start
# Keys that apply but that few runs set: only ``--help-all`` lists them, so that ``--help`` fits a screen.
ADVANCED = (
    "eval_batch_size", "bucket_size_mb", "message_size_mb", "comm_timeout_s", "pg_timeout_s", "compile",
    "label_smoothing", "scheduler.warmup_start", "optim.eps", "launch.monitor_interval", "launch.rdzv_",
    "launch.threads_per_worker", "logger.consensus_samples", "logger.console_", "logger.wandb.",
    "checkpoint.fresh_if_unreadable", "dataset.split_seed", "dataset.loader_workers", "topology.module",
    "algorithm.fragment", "algorithm.offload",
)
HIDDEN = ("run",)  # the launcher's facts about the job, not settings
SHOW_ALL = False  # set by ``decent-train --help-all`` (cli.main)


@dataclasses.dataclass(frozen=True)
class Key:
    """One leaf of the config as the help lists it."""

    path: str  # dotted, as an override names it
    value: Any
    description: str
    applies: bool


def help_text(root: DictConfig, choices: dict[str, str], groups: dict[str, list[str]], recipes: list[str]) -> str:
    """The help for the config Hydra composed (``root``), given the option chosen in each group, every group's options
    and the recipes; ``$`` doubled (Hydra's template substitutes ``$NAME``)."""
    where = Where(root, choices, groups)
    applying = [k for k in _keys(root, TrainConfig, where) if k.applies]
    keys = [k for k in applying if SHOW_ALL or not k.path.startswith(ADVANCED)]
    lines = [
        "decent-train [group=option ...] [key=value ...]: train this config, changed by the overrides (values: as now)",
        "  -m: a sweep, one run per value (topology=complete,ring)    --cfg job: the composed config",
        *textwrap.wrap(f"-cn NAME: a recipe ({', '.join(recipes)})", WIDTH, initial_indent="  ",
                       subsequent_indent="    "),
        "",
        *[_line(k) for k in keys if k.path.partition(".")[0] not in groups],
        "",
    ]
    docs = field_docs(TrainConfig)
    for group in [f.name for f in dataclasses.fields(TrainConfig) if f.name in groups]:
        alternatives, _ = split_conditions(docs.get(group, ""), set())
        if not _applies(alternatives, root, where, ""):
            continue  # topology and compression where the algorithm does not gossip
        others = [o for o in groups[group] if o != choices.get(group)]
        lines.append(_cut(f"{group}={choices.get(group, '?')}" + (f"  (or {', '.join(others)})" if others else "")))
        lines += [_line(k) for k in keys if k.path.partition(".")[0] == group]
    more = f"--help-all: {len(applying) - len(keys)} more keys; " if len(keys) < len(applying) else ""
    lines.append(f"{more}--hydra-help: Hydra's flags; every key's default: decent_train.config.TrainConfig")
    return "\n".join(lines).replace("$", "$$")


@dataclasses.dataclass(frozen=True)
class Where:
    """What a key's conditions are read against: the whole config, the option chosen in each group and every group's
    options."""

    root: DictConfig
    choices: dict[str, str]
    groups: dict[str, list[str]]


def _keys(node: DictConfig, schema: type, where: Where, prefix: str = "", applies: bool = True) -> Iterator[Key]:
    """Every leaf of ``node`` that ``schema`` (a dataclass) types, with its description and whether it applies; the
    algorithm's keys are its own options schema's."""
    hints = typing.get_type_hints(schema)
    docs = field_docs(schema)
    own_options = set(where.groups.get(prefix.partition(".")[0], [])) if prefix else set()
    for f in dataclasses.fields(schema):
        path = prefix + f.name
        if path in HIDDEN or (f.name == "name" and prefix and prefix.count(".") == 1):
            continue
        alternatives, description = split_conditions(docs.get(f.name, ""), own_options)
        here = applies and _applies(alternatives, node, where, prefix)
        hint = hints[f.name]
        if f.name == "algorithm" and not prefix:
            hint = ALGORITHM_TRAITS[str(node.algorithm.name)].schema
        if dataclasses.is_dataclass(hint):
            yield from _keys(node[f.name], hint, where, path + ".", here)
        else:
            yield Key(path, node[f.name] if f.name in node else f.default, description, here)


def group_options(conf: Path) -> dict[str, list[str]]:
    """Every config group a user chooses from (the folders of ``conf``, but Hydra's own) and its options."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in sorted(conf.iterdir())
            if d.is_dir() and d.name != "hydra"}


Condition = tuple[str, str, set[str]]  # (key, "=" or "!=", values); key "": the options of the key's own group


def split_conditions(comment: str, group_options: set[str]) -> tuple[list[list[Condition]], str]:
    """(alternatives, description) of a field's comment: the key applies where every condition of one alternative
    holds. ``cnn, mlp: channels`` -> ([[("", "=", {cnn, mlp})]], "channels"); ``digits or partition!=iid: seed`` ->
    ([[("", "=", {digits})], [("partition", "!=", {iid})]], "seed"); a comment without a leading condition ->
    ([[]], comment)."""
    head, sep, rest = comment.partition(": ")
    if not sep:
        return [[]], comment
    alternatives = []
    for alternative in head.split(" or "):
        conditions, own = [], set()
        for item in (i.strip() for i in alternative.split(",")):
            op = "!=" if "!=" in item else "=" if "=" in item else ""
            if op:
                key, _, values = item.partition(op)
                if not key or " " in key or not values or " " in values:
                    return [[]], comment
                conditions.append((key, op, set(values.split("|"))))
            elif item in group_options:
                own.add(item)
            else:
                return [[]], comment
        if own:
            conditions.append(("", "=", own))
        alternatives.append(conditions)
    return alternatives, rest


def _applies(alternatives: list[list[Condition]], node: DictConfig, where: Where, prefix: str) -> bool:
    return any(all(_holds(c, node, where, prefix) for c in conditions) for conditions in alternatives)


def _holds(condition: tuple[str, str, set[str]], node: DictConfig, where: Where, prefix: str) -> bool:
    """Whether ``key=a|b`` (``key!=a``) holds: ``key`` a group (its choice), a key of ``node``, or of the config."""
    key, op, values = condition
    group = key or prefix.partition(".")[0]  # no key: the options of the key's own group
    if group in where.choices:
        value: Any = where.choices[group]
    elif OmegaConf.select(node, key, default=_MISSING) is not _MISSING:
        value = OmegaConf.select(node, key)
    else:
        value = OmegaConf.select(where.root, key)
    found = any(_equal(value, v) for v in values)
    return found if op == "=" else not found


_MISSING = object()


def _equal(value: Any, text: str) -> bool:
    if isinstance(value, bool) or value is None:
        return _format(value) == text
    if isinstance(value, (int, float)):
        try:
            return float(text) == value
        except ValueError:
            return False
    return str(value) == text


def _format(value: Any) -> str:
    """A value as an override writes it."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    return as_override(value)


def _line(key: Key) -> str:
    left = f"  {key.path}={_format(key.value)}"
    return _cut(f"{left:<{KEY_COLUMN}} {key.description}" if len(left) < KEY_COLUMN else f"{left} {key.description}")


def _cut(line: str) -> str:
    """One line of at most WIDTH characters: a long description ends at the last sentence or clause (". ", "; ")
    that fits, outside any parentheses, else at the last phrase (", ", " ("), else at a word, with "..."; a phrase
    cut after a sentence's end would leave a fragment ("both: the coordinator")."""
    if len(line) <= WIDTH:
        return line
    for marks in (("; ", ". "), (", ", " (")):
        ends = [i for i in range(KEY_COLUMN, WIDTH) if line.startswith(marks, i)
                and line.count("(", 0, i) == line.count(")", 0, i)]
        if ends:
            return line[: ends[-1]]
    return line[: line.rfind(" ", 0, WIDTH - 3)] + "..."


@functools.cache
def field_docs(schema: type) -> dict[str, str]:
    """Field name -> its comment in ``schema``'s source (and its dataclass bases'): the comment on the field's line,
    else the comment lines right above it, joined."""
    docs: dict[str, str] = {}
    for cls in reversed(schema.__mro__):
        if dataclasses.is_dataclass(cls) and cls is not object:
            docs.update(_class_comments(cls))
    return docs


def _class_comments(cls: type) -> dict[str, str]:
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    found = {}
    for statement in body.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        end = statement.end_lineno or statement.lineno
        if end in comments and not lines[end - 1].lstrip().startswith("#"):
            found[statement.target.id] = comments[end]
            continue
        above, line = [], statement.lineno - 1
        while line in comments and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        if above:
            found[statement.target.id] = " ".join(above)
    return found
