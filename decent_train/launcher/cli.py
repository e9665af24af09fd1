"""``decent-train [overrides]``, the console entry point: the command itself is ``job.py`` (compose the config with
Hydra, check it, start the workers), imported by :func:`main` and not here.

Its import (torch, Hydra: about 2.5 s on 2 cores) is part of the command's start, so a Ctrl-C during it must end as
one later before the workers start does: one line, exit status 130 (interrupt.py). This module and the package's
``__init__`` import nothing heavy, so that :func:`main` runs, with its handlers, a few tens of milliseconds after the
interpreter starts (tests/test_startup_interrupt.py).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Iterator

from decent_train.launcher import forking, interrupt


def main() -> None:
    """Console entry point. Errors in the user's input end in one line on stderr and exit status 2 (job.py); a stop
    signal before the workers start (they have their own handling: launch.py) in one line and 128 + its number."""
    interrupt.install(at_once=True)  # first: before the slow import
    if forking.launches_workers(sys.argv[1:]):
        forking.spawn_forkserver()  # its imports on another core, while this process does its own
    with _quiet_cpp_log():
        from decent_train.launcher.job import run
    interrupt.install()
    try:
        run()
    except BrokenPipeError:
        interrupt.exit_output_closed()
    except (KeyboardInterrupt, interrupt.Stopped, Exception) as error:
        sig = interrupt.stop_signal(error)
        if sig is None:
            raise
        interrupt.exit_stopped(sig)
    finally:
        # The interpreter's exit collects every object left, torch's and Hydra's: about 0.8 s of a short launch here,
        # after its last line. Frozen, they are not visited (the files this command wrote are closed).
        gc.freeze()


@contextlib.contextmanager
def _quiet_cpp_log() -> Iterator[None]:
    """torch's C++ messages off in this process, unless ``TORCH_CPP_LOG_LEVEL`` says otherwise: the rendezvous
    store's client prints a warning with a C++ stack for each retry at an endpoint that does not answer, before the
    command's own line says so (launch.py). torch reads the level once, as it is imported; the variable is gone again
    before any worker starts, so the workers log as the user's environment says."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        yield
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


if __name__ == "__main__":
    main()
