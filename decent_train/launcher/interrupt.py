"""A stop signal to ``decent-train`` before its workers start (Ctrl-C's SIGINT, SIGTERM, SIGUSR1): one line, exit status
128 + the signal's number. While the workers run, ``launch.StopForwarding`` handles them instead (the workers stop
with a checkpoint; ``job._exit_stopped`` says how to go on).

Standard library only: ``cli.main`` installs these handlers before it imports the rest of the command (torch, Hydra:
seconds), which a Ctrl-C most likely cuts short. During that import a handler ends the process itself instead of
raising: torch's C++ runs Python code while it initializes (imports, from ``torch._C._autograd_init``), and an
exception raised there crossed its C++ and crashed the command (SIGSEGV, or SIGABRT with "terminate called").
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import NoReturn

RECEIVED: list[signal.Signals] = []  # every stop signal these handlers took, in order


class Stopped(BaseException):
    """Raised by the handler of SIGTERM and SIGUSR1 (SIGINT's raises KeyboardInterrupt), wherever the command is then;
    ``sigval`` as torch's SignalException names it. Not an Exception, as KeyboardInterrupt is not: no ``except
    Exception`` takes it for an error (Hydra's, around a sweep's job, would record it as the job's failure and start
    the next job)."""

    def __init__(self, sig: signal.Signals) -> None:
        super().__init__(f"got {sig.name}")
        self.sigval = sig


def exception(sig: signal.Signals) -> BaseException:
    """What the handler of ``sig`` raises."""
    return KeyboardInterrupt() if sig == signal.SIGINT else Stopped(sig)


def install(at_once: bool = False) -> None:
    """The handlers, unless SIGINT is ignored (a shell's background job): that stays so. ``at_once``: the handler
    ends the process where it is (while the command imports torch: nothing to clean up yet), else it raises."""
    handler = _exit_at_once if at_once else _raise
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        if sig != signal.SIGINT or signal.getsignal(sig) in (signal.default_int_handler, _exit_at_once, _raise):
            signal.signal(sig, handler)


def _raise(signum: int, frame: FrameType | None) -> None:
    sig = signal.Signals(signum)
    RECEIVED.append(sig)
    raise exception(sig)


def _exit_at_once(signum: int, frame: FrameType | None) -> NoReturn:
    sys.stderr.write(_stopped_line(signal.Signals(signum)))
    sys.stderr.flush()
    os._exit(128 + signum)


def raise_if_received() -> None:
    """Raise the stop these handlers took, if any, where the command is about to start something that takes long
    (a sweep's next job, the workers). The exception a handler raises can be swallowed where it lands: a user's module
    may (tests/test_startup_interrupt.py), and so does any finalizer or weakref callback that the garbage collector
    runs (Python prints "Exception ignored" and goes on); a job ran to the end after its Ctrl-C (a sweep's, in CI)."""
    if RECEIVED:
        raise exception(RECEIVED[0])


def stop_signal(error: BaseException | None) -> signal.Signals | None:
    """The stop signal that ended the command with ``error`` (None: it went on). Its own, or, for any other error, the
    first that came: a library may swallow the exception and go on (a user's module may), or fail in its
    clean-up of the state it left (OmegaConf's ``flag_override``, in Hydra's composition): both measured."""
    sig = getattr(error, "sigval", None)  # Stopped, or torch's SignalException (a node agent's second Ctrl-C)
    if isinstance(sig, signal.Signals):
        return sig
    if isinstance(error, KeyboardInterrupt):
        return signal.SIGINT
    return RECEIVED[0] if RECEIVED else None


def exit_stopped(sig: signal.Signals) -> NoReturn:
    sys.stderr.write(_stopped_line(sig))
    sys.stderr.flush()
    raise SystemExit(128 + int(sig)) from None


def exit_output_closed() -> NoReturn:
    """The reader of the output left (``decent-train --help | head``): end quietly, with the status of a writer
    SIGPIPE would have ended (the interpreter ignores SIGPIPE, so a write raised BrokenPipeError instead). Not in the
    middle of training: the launcher prints there through loguru, which keeps going."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # for the interpreter's own flush at exit
    raise SystemExit(128 + int(signal.SIGPIPE)) from None


def _stopped_line(sig: signal.Signals) -> str:
    return f"decent-train: stopped by {sig.name}; no checkpoint was written at this stop\n"
