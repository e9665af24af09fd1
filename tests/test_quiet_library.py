"""A library stays silent (issue 40, point 7): a user's script that imports decent_train and trains with the engine
prints nothing at the default level; the same script with ``logger.enable("decent_train")`` gets the engine's
messages, so the silence is the package's switch and not a script that never reaches a message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
from loguru import logger
from decent_train import DecentralizedDataParallel, optim_fn_adamw

if sys.argv[2] == "enable":
    logger.enable("decent_train")
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
model = DecentralizedDataParallel(torch.nn.Linear(4, 2), optim_fn_adamw, topology="complete")
for _ in range(3):
    model(torch.randn(8, 4)).sum().backward()
model.eval()
model(torch.randn(2, 4))
del model
dist.destroy_process_group()
"""


def _run(tmp_path: Path, logging: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    store = tmp_path / f"store_{logging}"
    return subprocess.run([sys.executable, str(script), str(store), logging], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_a_users_script_with_the_engine_prints_nothing(tmp_path: Path) -> None:
    quiet = _run(tmp_path, "default")
    assert quiet.returncode == 0, quiet.stderr
    assert (quiet.stdout, quiet.stderr) == ("", "")


@pytest.mark.slow
def test_the_same_script_logs_when_the_user_enables_it(tmp_path: Path) -> None:
    enabled = _run(tmp_path, "enable")
    assert enabled.returncode == 0, enabled.stderr
    assert "DecentralizedDataParallel: complete: 1 workers" in enabled.stderr
