"""Checks that the component configs and the job's config share: an engine rule named by its config key, and the
refusal of a key that the chosen option never reads.

A key set away from its default where the option in force ignores it would change nothing: such a command is refused
in one line naming the key, the option and what reads it, before any worker starts (the standard: docs/cli.md#errors).
A key left at its default is never refused, so a recipe or a sweep that does not set it keeps working. A run already
written is read back (``load_model``) under :func:`as_written`, where these refusals do not apply: a run that started
before they existed still loads.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

_AS_WRITTEN = contextvars.ContextVar("as_written", default=False)


@contextlib.contextmanager
def as_written() -> Iterator[None]:
    """Check the config of a run already written: options it ignored pass (:func:`refusing_ignored` is false), every
    other check applies."""
    token = _AS_WRITTEN.set(True)
    try:
        yield
    finally:
        _AS_WRITTEN.reset(token)


def refusing_ignored() -> bool:
    """Whether an option the run would ignore is refused: always, but for a run already written (:func:`as_written`)."""
    return not _AS_WRITTEN.get()


def engine_check(key: str, value: Any, check: Callable[[], object]) -> None:
    """Run one of the engine's own argument checks on the config's ``key``: the same rule in both places, with an
    error that names the config key."""
    try:
        check()
    except ValueError as error:
        raise ValueError(f"{key}={value}: {error}") from None


def refuse_unread(group: str, config: Any, readers: dict[str, tuple[str, ...]]) -> None:
    """Refuse a key of ``config`` (the dataclass of ``conf/<group>/``, its option in ``config.name``) that differs
    from its schema's default while the option is not among those that read it (``readers``: key -> options)."""
    if not refusing_ignored():
        return
    for key, options in readers.items():
        value, default = getattr(config, key), type(config).__dataclass_fields__[key].default
        if config.name not in options and value != default:
            raise ValueError(
                f"{group}.{key}={value} with {group}={config.name}: {group}={config.name} does not read it; use "
                f"{group}={'|'.join(options)}, or leave {group}.{key}={default}"
            )
