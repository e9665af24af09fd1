"""What every test module shares: the process setup below, and (as the suite is deduplicated) the helpers that more
than one module uses, as fixtures. Helpers that run inside forked workers stay plain functions in tests/distributed.py
and tests/replay.py (a fixture cannot be sent to a worker).

Markers (pyproject.toml): ``slow`` (launches in new processes, or over 15 s; ``pytest -m "not slow"`` is the inner
loop), ``alone`` (no other test runs beside it under ``-n 2``: ``_Share`` below), ``gpu``, ``slurm``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Workers are forked from the test process: keep its intra-op pool single-threaded so no OpenMP state is inherited.
torch.set_num_threads(1)

# The tests train in this process and in workers forked from it, as decent_train.worker does: with the package's log
# messages on, as the worker's entry point turns them on (decent_train/__init__.py keeps them off for a library user;
# tests/test_quiet_library.py checks that in a process of its own).
import decent_train  # noqa: E402  (first: importing it turns the messages off)
from loguru import logger  # noqa: E402

logger.enable("decent_train")


class _Share:
    """Under pytest-xdist (the README runs the inner-loop tests with ``-n 2``), tests run two at a time: one alone
    leaves a core of CI's two mostly idle (docs/contributing.md). One marked ``alone`` (it times its faults, or starves
    the machine on purpose) runs with no other: a readers-writer lock on a file all workers share, behind a turnstile
    file so that a waiting ``alone`` test is not starved by the others. Without xdist it does nothing.
    """

    def __init__(self, run_id: str) -> None:
        base = Path(tempfile.gettempdir()) / f"decent-train-tests-{run_id}"
        self.paths = (Path(f"{base}.turnstile"), Path(f"{base}.lock"))
        self.turnstile, self.lock = (os.open(p, os.O_RDWR | os.O_CREAT, 0o600) for p in self.paths)

    @contextlib.contextmanager
    def hold(self, alone: bool) -> Iterator[None]:
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self.lock, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(self.turnstile, fcntl.LOCK_UN)

    def close(self) -> None:
        for fd, path in zip((self.turnstile, self.lock), self.paths):
            os.close(fd)
            path.unlink(missing_ok=True)  # a worker still running holds its descriptors: the same files for it


_share: _Share | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _share
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is not None and "PYTEST_XDIST_WORKER" in os.environ:  # xdist's workers run the tests; not its controller
        _share = _Share(run_id)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _share is not None:
        _share.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Setup, call and teardown under the share: a module's fixtures start and end inside its tests' turns."""
    if _share is None:
        yield
        return
    with _share.hold(alone=item.get_closest_marker("alone") is not None):
        yield
