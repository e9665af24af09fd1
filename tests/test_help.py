"""What the command line says to a user who asks or errs (issue 40, point 4): ``decent-train --help`` and a word that
is not ``key=value``."""

from __future__ import annotations

import subprocess

import pytest

from .jobs import COMMAND
from .test_cli_fuzz import check_like_the_cli

EXPECTED = "expected key=value, e.g. {} (see decent-train --help)"


@pytest.mark.parametrize(("words", "line"), [
    (["topology"], "'topology' is not key=value; " + EXPECTED.format("topology=ring")),
    (["steps", "100"], "'steps' is not key=value; " + EXPECTED.format("steps=VALUE")),
    (["+extra"], "'+extra' is not key=value; " + EXPECTED.format("+extra=VALUE")),
    (["topology=ring]"], "'topology=ring]' cannot be read as key=value (extraneous input ']' expecting <EOF>); "
                         + EXPECTED.format("topology=ring")),
    (["a b"], "'a b' is not key=value; " + EXPECTED.format("topology=ring")),
    (["model=[1"], "'model=[1' cannot be read as key=value (no viable alternative at input '[1'); "
                   + EXPECTED.format("model=cnn")),
])
def test_a_word_that_is_not_key_value_is_one_line(words: list[str], line: str) -> None:
    assert check_like_the_cli(words) == line


@pytest.mark.slow
def test_a_bare_group_and_option_is_one_line_and_exit_2() -> None:
    proc = subprocess.run([str(COMMAND), "topology", "ring"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "decent-train: error: 'topology' is not key=value; " + EXPECTED.format("topology=ring") + "\n"
