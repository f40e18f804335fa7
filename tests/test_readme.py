"""README starts with exactly two set-up commands; CI runs the second verbatim."""
from __future__ import annotations

import re

from tests.conftest import REPO


def _commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    head = text.split("\n---\n", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", head, flags=re.S)


def test_two_setup_commands_first():
    cmds = _commands()
    assert len(cmds) == 2
    assert "python -m quantlab +sweep=smoke" in cmds[0]
    assert "python -m pytest" in cmds[1]


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    assert _commands()[1] in ci
