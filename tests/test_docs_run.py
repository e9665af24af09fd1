"""The documentation's runnable blocks run: every fenced block marked ``bash runnable`` or ``python runnable`` in the
README and docs/ exits with status 0.

Docs drift from the tool they describe; a command that no longer parses, or an API example that no longer imports,
is caught here. A page's blocks run in order in one fresh directory (a later block may use what an earlier one
wrote, as a reader following the page would), bash blocks under ``bash -e``. ``decent-train`` in a bash block is
the real command with the overrides in ``DECENT_TRAIN_DOCS_SHRINK`` appended (a few steps on 2 workers, no wandb;
set it yourself to change them), so a block shows what a user types and still runs in seconds. docs/contributing.md
describes the marker. Cost: the collector tests run in well under a second; the pages themselves take about 45 s on
2 idle cores (two short trainings, two dry runs, a plot and two Python processes), hence ``slow``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_docs_links import ROOT, fenced_blocks

SHRINK_ENV = "DECENT_TRAIN_DOCS_SHRINK"
DEFAULT_SHRINK = "steps=30 launch.nproc_per_node=2 logger=jsonl"
LANGUAGES = {"bash", "python"}
TIMEOUT_S = 300


def doc_pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def runnable_blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line, language, body) of the page's runnable blocks; a block marked runnable in a language this test cannot
    run is an error, not a block silently skipped."""
    blocks = []
    for line, info, body in fenced_blocks(path.read_text(encoding="utf-8")):
        words = info.split()
        if "runnable" not in words[1:]:
            continue
        if words[0] not in LANGUAGES:
            raise ValueError(f"{path}:{line}: '{info}' is marked runnable; runnable languages: {sorted(LANGUAGES)}")
        blocks.append((line, words[0], body))
    return blocks


def bash_script(body: str) -> str:
    """The block, with ``decent-train`` shrunk: the overrides in $DECENT_TRAIN_DOCS_SHRINK go after the block's own
    (Hydra takes the last value of a key)."""
    return f'decent-train() {{ command decent-train "$@" ${SHRINK_ENV}; }}\n{body}\n'


def run_page(path: Path, workdir: Path, env: dict[str, str]) -> list[str]:
    """Runs the page's blocks in order in ``workdir``; one message per block that failed, and none after it (what
    follows may need what it should have made)."""
    for line, language, body in runnable_blocks(path):
        command = ["bash", "-e", "-c", bash_script(body)] if language == "bash" else [sys.executable, "-c", body]
        try:
            done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return [f"{path.name}:{line}: {language} block ran over {TIMEOUT_S} s"]
        if done.returncode != 0:
            output = "\n".join((done.stdout + done.stderr).strip().split("\n")[-30:])
            return [f"{path.name}:{line}: {language} block exited with {done.returncode}:\n{body}\n--- output ---\n{output}"]
    return []


def docs_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault(SHRINK_ENV, DEFAULT_SHRINK)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_blocks_run_in_order_and_failures_name_their_line(tmp_path: Path) -> None:
    """The collector against a page written here: the unmarked block is skipped, the marked ones run in order in one
    directory, and the first failing block is reported by its line."""
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n```bash\nexit 9\n```\n\n"  # not runnable: never run
        "```bash runnable\necho hello > note.txt\n```\n\n"
        "```python runnable\nassert open('note.txt').read() == 'hello\\n'\n```\n\n"
        "```bash runnable\ntest -f missing.txt\necho never\n```\n"
    )
    assert [(line, language) for line, language, _ in runnable_blocks(page)] == [(7, "bash"), (11, "python"),
                                                                                 (15, "bash")]
    workdir = tmp_path / "run"
    workdir.mkdir()
    failures = run_page(page, workdir, docs_env())
    assert len(failures) == 1 and failures[0].startswith("page.md:15: bash block exited with 1")
    assert (workdir / "note.txt").read_text() == "hello\n"


def test_decent_train_gets_the_shrink_overrides(tmp_path: Path) -> None:
    """A stand-in ``decent-train`` on PATH records its arguments: the block's own come first, the shrink after."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "decent-train"
    stand_in.write_text('#!/bin/sh\necho "$@" > args.txt\n')
    stand_in.chmod(0o755)
    page = tmp_path / "page.md"
    page.write_text("```bash runnable\ndecent-train -m topology=ring,complete\n```\n")
    env = {**docs_env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SHRINK_ENV: "steps=3 logger=jsonl"}
    assert run_page(page, tmp_path, env) == []
    assert (tmp_path / "args.txt").read_text().split() == ["-m", "topology=ring,complete", "steps=3", "logger=jsonl"]


def test_a_runnable_block_in_another_language_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```sh runnable\nls\n```\n")
    with pytest.raises(ValueError, match="'sh runnable' is marked runnable"):
        runnable_blocks(page)


PAGES = [page for page in doc_pages() if runnable_blocks(page)]


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_page_runs(page: Path, tmp_path: Path) -> None:
    failures = run_page(page, tmp_path, docs_env())
    assert not failures, "\n\n".join(failures)


def test_the_readme_and_the_cli_page_have_runnable_blocks() -> None:
    """The entry page's first run and the sweep with ``++`` (a claim the docs once had wrong) stay checked."""
    assert {ROOT / "README.md", ROOT / "docs" / "cli.md"} <= set(PAGES)
