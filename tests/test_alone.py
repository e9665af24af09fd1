"""Under ``-n 2`` (the README's test command) a test marked ``alone`` runs with no other test beside it, and the others
do run two at a time (tests/conftest.py ``_Share``). The oracle is the tests' own start and end times, compared by
hand: a run of pytest-xdist on a small generated suite whose tests write them down.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SUITE = '''
import time, pytest
from pathlib import Path

def _record(name):
    start = time.monotonic()
    time.sleep(0.6)
    with open(Path(__file__).parent / "times.txt", "a") as out:
        out.write(f"{name} {start} {time.monotonic()}\\n")
'''


@pytest.mark.slow
def test_alone_tests_run_by_themselves_and_the_others_two_at_a_time(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_configure, pytest_runtest_protocol, pytest_unconfigure  # noqa: F401\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: by itself\n")
    for module in "abcd":  # --dist loadfile: a file's tests go to one worker, so two files can meet
        tests = [f"def test_{module}{i}():\n    _record('{module}{i}')\n" for i in range(3)]
        tests.append(f"@pytest.mark.alone\ndef test_{module}_alone():\n    _record('{module}_alone')\n")
        (tmp_path / f"test_{module}.py").write_text(SUITE + "\n" + "\n".join(tests))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}  # this run may be a worker
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    spans = {name: (float(a), float(b)) for name, a, b in
             (line.split() for line in (tmp_path / "times.txt").read_text().splitlines())}
    assert len(spans) == 16, spans

    def overlap(x: str, y: str) -> bool:
        return spans[x][0] < spans[y][1] and spans[y][0] < spans[x][1]

    alone = [n for n in spans if n.endswith("alone")]
    assert not [(a, n) for a in alone for n in spans if n != a and overlap(a, n)]
    assert [(m, n) for m in spans for n in spans if m < n and overlap(m, n)], "no two tests ran at once"
