"""A module of this package as it was at an earlier commit, loaded beside today's: the benchmarks time the code
before and after a change in one run (``--before REV``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_revision(rev: str, path: str) -> ModuleType:
    """``path`` (relative to the repository) as it was at ``rev``, as a module named ``<its stem>_before``; its
    imports resolve to this tree's package."""
    source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout
    name = f"{Path(path).stem}_before"
    with tempfile.TemporaryDirectory() as folder:
        file = Path(folder) / f"{name}.py"
        file.write_text(source)
        spec = importlib.util.spec_from_file_location(name, file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return module
