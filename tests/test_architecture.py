"""The package's shape, checked on every run: imports flow one way, and no file or function outgrows the limits.

The import contract lives in pyproject.toml ([tool.importlinter]): launcher -> worker -> runtime | training ->
algorithms -> config -> components -> engine, and no import circle inside a package. A module that imports upward
(the engine importing the launcher, config importing the launcher) fails here with import-linter's report of the chain.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "decent_train"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 90


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def lint_imports_command() -> str:
    """The lint-imports beside this interpreter (a venv's own), else the one on PATH."""
    beside = Path(sys.executable).parent / "lint-imports"
    found = str(beside) if beside.exists() else shutil.which("lint-imports")
    if found is None:
        pytest.fail("lint-imports not found: install the test extras (pip install -e '.[test]')")
    return found


def test_imports_follow_the_layers() -> None:
    """lint-imports keeps every contract in pyproject.toml (no cache: it would leave a folder in the repository)."""
    proc = subprocess.run(
        [lint_imports_command(), "--no-cache", "--no-logo"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"lint-imports failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"


def test_no_file_over_the_line_limit() -> None:
    too_long = {
        str(path.relative_to(REPO)): lines
        for path in sources()
        if (lines := len(path.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not too_long, f"files over {MAX_FILE_LINES} lines: {too_long}"


def function_lengths(path: Path) -> list[tuple[str, int]]:
    """(qualified name, lines from ``def`` to its last line, docstring included) of every function and method."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                found.append((name, (child.end_lineno or child.lineno) - child.lineno + 1))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), filename=str(path)), "")
    return found


def test_no_function_over_the_line_limit() -> None:
    too_long = {
        f"{path.relative_to(REPO)}:{name}": lines
        for path in sources()
        for name, lines in function_lengths(path)
        if lines > MAX_FUNCTION_LINES
    }
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


def test_function_lengths_count_from_def_to_last_line(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "@decorator\ndef f():\n    '''doc'''\n    def inner():\n        pass\n    return 1\n\n"
        "class C:\n    async def g(self):\n        pass\n"
    )
    assert function_lengths(source) == [("f", 5), ("f.inner", 2), ("C.g", 2)]


def test_every_package_ships() -> None:
    """Every folder of decent_train/ with an __init__.py is in pyproject's package list: the list is explicit (conf/ and
    recipes/ are mapped into the package), so a new subpackage left out would be missing from a wheel."""
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {
        ".".join(init.parent.relative_to(REPO).parts) for init in PACKAGE.rglob("__init__.py")
    }
    assert packages <= listed, f"packages missing from [tool.setuptools] packages: {sorted(packages - listed)}"
