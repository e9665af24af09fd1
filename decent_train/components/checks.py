"""Checks that the component configs and the job's config share: an engine rule named by its config key, and the
refusal of a key that the chosen option never reads.

A key set away from its default where the option in force ignores it would change nothing: such a command is refused
in one line naming the key, the option and what reads it, before any worker starts (the standard: docs/cli.md#errors).
A key left at its default is never refused, so a recipe or a sweep that does not set it keeps working. A run already
written is read back (``load_model``) under :func:`as_written`, where these refusals do not apply: a run that started
before they existed still loads. A sweep's job is checked under :func:`as_sweep_job`: a key its option does not read
is another job's.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

_AS_WRITTEN = contextvars.ContextVar("as_written", default=False)
_SWEEP_JOB = contextvars.ContextVar("sweep_job", default=False)


@contextlib.contextmanager
def _while(flag: contextvars.ContextVar[bool]) -> Iterator[None]:
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


def as_written() -> contextlib.AbstractContextManager[None]:
    """Check the config of a run already written: options it ignored pass (:func:`refusing_ignored` is false), every
    other check applies."""
    return _while(_AS_WRITTEN)


def as_sweep_job() -> contextlib.AbstractContextManager[None]:
    """Check one job of a sweep (``-m``): its options are the sweep's, shared by jobs whose options differ, so a key
    that only some of them read (``-m algorithm=decentralized,allreduce topology=one-peer-exp``, ``-m
    compression=none,int8 compression.int8_block=64``) is theirs, and passes in the others (:func:`refusing_unread`
    is false), as ``++algorithm.KEY`` does; what the job itself would miss (a warmup as long as its run) is refused."""
    return _while(_SWEEP_JOB)


def refusing_ignored() -> bool:
    """Whether an option the run would ignore is refused: always, but for a run already written (:func:`as_written`)."""
    return not _AS_WRITTEN.get()


def refusing_unread() -> bool:
    """Whether a key the chosen option never reads is refused: not for a run already written, nor in a sweep's job."""
    return refusing_ignored() and not _SWEEP_JOB.get()


def engine_check(key: str, value: Any, check: Callable[[], object]) -> None:
    """Run one of the engine's own argument checks on the config's ``key``: the same rule in both places, with an
    error that names the config key."""
    try:
        check()
    except ValueError as error:
        raise ValueError(f"{key}={value}: {error}") from None


def refuse_unread(
    group: str, config: Any, readers: dict[str, tuple[str, ...]], selector: str | None = None,
    option: str | None = None,
) -> None:
    """Refuse a key of ``config`` (the dataclass of ``conf/<group>/``) that differs from its schema's default while
    the option in force is not among those that read it (``readers``: key -> options). The option is ``config.name``,
    picked by ``<group>=``, unless ``selector`` names the key that picks it (``dataset.partition``) and ``option`` its
    value."""
    if not refusing_unread():
        return
    selector, option = selector or group, config.name if option is None else option
    for key, options in readers.items():
        value, default = getattr(config, key), schema_default(type(config), key)
        if option not in options and value != default:
            raise ValueError(
                f"{group}.{key}={as_override(value)} with {selector}={option}: {selector}={option} does not read it; "
                f"use {selector}={'|'.join(options)}, or leave {group}.{key}={as_override(default)}"
            )


def schema_default(schema: type, key: str) -> Any:
    """The default of ``key`` in the dataclass ``schema`` (a list's from its factory): what a refusal of a key that
    does nothing accepts."""
    field = schema.__dataclass_fields__[key]
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def as_override(value: Any) -> str:
    """``value`` as a command-line override writes it: ``null``, ``true``, ``[32,64]``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(as_override(v) for v in value) + "]"
    return str(value)


def refuse_added_keys(node: DictConfig, sweep_schemas: dict[str, list[type]]) -> None:
    """Raise ``ConfigKeyError`` for a key that ``+key=`` or ``++key=`` added and no schema has: Hydra adds it to the
    typed config, and the job would drop it without a word (a misspelt ``++algorithm.sync_evry=5``). In a sweep's job
    (:func:`as_sweep_job`) a field of one of ``sweep_schemas[node]`` is another job's (``-m
    algorithm=decentralized,diloco ++algorithm.sync_every=5``: the algorithms' options)."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return  # a free-form dict
    fields = {f.name for f in dataclasses.fields(schema)}
    for key in node.keys():
        value = node._get_node(key)
        if key not in fields:
            others = sweep_schemas.get(node._get_full_key(None), [])
            if not refusing_unread() and any(key in {f.name for f in dataclasses.fields(s)} for s in others):
                continue
            error = ConfigKeyError(f"Key '{key}' not in '{schema.__name__}'")
            error.full_key, error.object_type, error.msg = value._get_full_key(None), schema, str(error)
            raise error
        if isinstance(value, DictConfig) and not value._is_missing() and not value._is_none():
            refuse_added_keys(value, sweep_schemas)
