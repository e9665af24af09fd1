"""What every test module shares: the process setup below, and (as the suite is deduplicated) the helpers that more
than one module uses, as fixtures. Helpers that run inside forked workers stay plain functions in tests/distributed.py
and tests/replay.py (a fixture cannot be sent to a worker).

Markers (pyproject.toml): ``slow`` (launches in new processes, or over 15 s; ``pytest -m "not slow"`` is the inner
loop), ``gpu``, ``slurm``.
"""

import torch

# Workers are forked from the test process: keep its intra-op pool single-threaded so no OpenMP state is inherited.
torch.set_num_threads(1)

# The tests train in this process and in workers forked from it, as decent_train.worker does: with the package's log
# messages on, as the worker's entry point turns them on (decent_train/__init__.py keeps them off for a library user;
# tests/test_quiet_library.py checks that in a process of its own).
import decent_train  # noqa: E402  (first: importing it turns the messages off)
from loguru import logger  # noqa: E402

logger.enable("decent_train")
