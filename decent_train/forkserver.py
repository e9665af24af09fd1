"""The process decent-train's launcher forks its workers from (launcher/launch.py): multiprocessing's forkserver imports
this module before its first fork, so every worker starts with torch and the training code imported, instead of
importing them itself: about 6 s of CPU per worker, most of a short launch on a few cores (scripts/BENCHMARKS.md,
"Workers forked from a forkserver").

Importing it makes of the forkserver what torch's agent made of each worker it started as an interpreter: a session
of its own, so that the terminal's Ctrl-C reaches the launcher only, which passes it on (launch.py: StopForwarding);
and a process that dies with the launcher, as the workers then die with it (runtime.die_with_agent), from its first
lines: the command starts it before its own imports (launcher/forking.py). Its environment is the launcher's when it
started: each worker takes the launcher's of its own launch (worker.take_the_launch).
"""

import ctypes
import importlib
import os
import signal
import sys

os.setsid()  # first: until the forkserver ignores SIGINT, after this import, a Ctrl-C on the terminal would end it
# It started with SIGINT blocked (launcher/forking.py): drop a Ctrl-C meant for the command, then as an interpreter starts
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
signal.signal(signal.SIGINT, signal.default_int_handler)
# SLURM (scancel, preemption, a time limit; --signal) sends its signal to every process of the job step, this one
# too: dying of it would take the workers along (they die with this process) before they stop with a checkpoint. It
# dies with the launcher. Each worker sets their handling for itself (worker.take_the_launch, training/stop.py).
for _sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(_sig, signal.SIG_IGN)

from decent_train.launcher.forking import LAUNCHER_PID_ENV  # noqa: E402  (imports nothing heavy)

# Dies with the launcher from here on, not only after the seconds of imports below: a command that ends while they run
# (a mistake in the input, a Ctrl-C, a SIGKILL) leaves nothing running, and its output pipes are closed at once.
if sys.platform == "linux":
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(os.environ[LAUNCHER_PID_ENV]):  # it died before the line above
    sys.exit(0)

from decent_train import worker  # noqa: E402  (imported once here, for every worker)
from decent_train.training.stop import AGENT_PID_ENV  # noqa: E402

# torch's optimizers import torch._dynamo when the first is built: about 2 s of CPU in every worker otherwise
importlib.import_module("torch._dynamo")
os.environ[AGENT_PID_ENV] = str(os.getpid())  # the workers die with this process
worker.FORKSERVER_ENVIRON.update(os.environ)
