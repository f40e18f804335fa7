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


def _readme_commands() -> list[str]:
    """Every ``python -m quantlab...`` line of the README's shell blocks after the set-up commands."""
    body = (REPO / "README.md").read_text().split("\n---\n", 1)[1]
    lines = [ln.split("#")[0].strip() for block in re.findall(r"```bash\n(.*?)\n```", body, flags=re.S)
             for ln in block.splitlines()]
    return [ln for ln in lines if ln.startswith("python -m quantlab")]


def test_every_cli_the_readme_names_answers_help():
    """The quick tour's entry points exist and parse: ``--help`` of each
    (cheap); the sweeps themselves run in their own tests."""
    import subprocess
    import sys

    mods = sorted({ln.split()[2] for ln in _readme_commands()})
    assert {"quantlab", "quantlab.report", "quantlab.export", "quantlab.sensitivity",
            "quantlab.capabilities"} <= set(mods), mods
    for mod in mods:
        proc = subprocess.run([sys.executable, "-m", mod, "--help"], cwd=REPO, capture_output=True, text=True,
                              timeout=300, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
        assert proc.returncode == 0 and proc.stdout.strip(), (mod, proc.stderr[-500:])


def test_readme_is_a_short_guide_whose_links_resolve():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) < 250
    docs = [REPO / "README.md", *(REPO / "docs").rglob("*.md")]
    broken = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(REPO)} -> {target}")
    assert broken == []
    for name in ("guides/sweeps.md", "guides/serving.md", "guides/export.md", "guides/mixed-precision.md",
                 "reference/schemes.md", "reference/metrics.md", "reference/targets.md", "architecture.md",
                 "testing.md", "results/"):
        assert f"docs/{name}" in text, name
