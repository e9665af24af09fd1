"""A worker's error file (``TORCHELASTIC_ERROR_FILE``) is whole or absent, even when the worker is killed writing it.

Oracle: torch's elastic agent's own reader, ``ProcessFailure``, which raises on a file it cannot parse (and so ends
the whole restart). The fault is caused: a worker SIGKILLed as soon as its error file, or the part it writes first,
appears in the directory.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, ProcessFailure

from decent_train.runtime import WholeErrorFile

HANDLERS = {"whole": WholeErrorFile, "torch": ErrorHandler}


def _fail(handler: str, error_file: str, message_mb: int) -> None:
    """A worker's failure: an exception with a long message, recorded as ``decent_train.worker.main`` records it."""
    os.environ["TORCHELASTIC_ERROR_FILE"] = error_file
    try:
        raise RuntimeError("x" * (message_mb * 2**20))
    except RuntimeError as error:
        HANDLERS[handler]().record_exception(error)
    os._exit(1)


def _run(tmp_path: Path, handler: str, message_mb: int, kill: bool) -> tuple[Path, int]:
    error_file = tmp_path / "error.json"
    process = multiprocessing.get_context("fork").Process(target=_fail, args=(handler, str(error_file), message_mb))
    process.start()
    if kill:
        deadline = time.monotonic() + 60
        while not any(tmp_path.iterdir()) and process.is_alive() and time.monotonic() < deadline:
            time.sleep(0.0005)
        os.kill(process.pid, signal.SIGKILL)
    process.join(60)
    return error_file, process.exitcode


def test_a_worker_killed_writing_its_error_file_leaves_none_the_agent_cannot_read(tmp_path: Path) -> None:
    error_file, exitcode = _run(tmp_path, "whole", 200, kill=True)
    assert exitcode == -signal.SIGKILL  # killed while it wrote, not after
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file=str(error_file))  # raises if cut
    assert not error_file.exists() and failure.message.startswith("Signal 9")


def test_a_worker_that_fails_leaves_the_file_torch_writes(tmp_path: Path) -> None:
    """The same file torch's own handler writes (but for the time stamp), and the agent reads its message."""
    files = {}
    for handler in HANDLERS:
        (tmp_path / handler).mkdir()
        error_file, exitcode = _run(tmp_path / handler, handler, 1, kill=False)
        assert exitcode == 1 and [p.name for p in (tmp_path / handler).iterdir()] == ["error.json"]
        files[handler] = json.loads(error_file.read_text())
        del files[handler]["message"]["extraInfo"]["timestamp"]
        failure = ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file=str(error_file))
        assert failure.message["message"] == "RuntimeError: " + "x" * 2**20
    assert files["whole"] == files["torch"]
