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
    assert "pip install -q . " in cmds[0]  # a wheel install, not editable
    assert "quantlab run +sweep=smoke" in cmds[0]
    assert "python -m pytest" in cmds[1]


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    assert _commands()[1] in ci


def _readme_commands() -> list[str]:
    """Every ``quantlab ...`` line of the README's shell blocks after the set-up commands."""
    body = (REPO / "README.md").read_text().split("\n---\n", 1)[1]
    lines = [ln.split("#")[0].strip() for block in re.findall(r"```bash\n(.*?)\n```", body, flags=re.S)
             for ln in block.splitlines()]
    return [ln for ln in lines if ln.startswith("quantlab ")]


def test_every_cli_the_readme_names_answers_help():
    """The quick tour's commands exist and parse: ``python -m quantlab SUB --help`` of
    each (cheap); the sweeps themselves run in their own tests."""
    import subprocess
    import sys

    from quantlab.console import COMMANDS

    subs = sorted({ln.split()[1] for ln in _readme_commands()})
    assert subs == sorted(COMMANDS), subs
    for sub in subs:
        proc = subprocess.run([sys.executable, "-m", "quantlab", sub, "--help"], cwd=REPO,
                              capture_output=True, text=True, timeout=300,
                              env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
        assert proc.returncode == 0 and proc.stdout.strip(), (sub, proc.stderr[-500:])


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
                 "reference/schemes.md", "reference/metrics.md", "reference/targets.md", "architecture.md", "api.md",
                 "testing.md", "results/"):
        assert f"docs/{name}" in text, name


def test_docs_state_findings_not_work_history():
    """README and docs/ are a user's guide and measured findings: no issue
    numbers, no notes on how the work was done (sessions, reviews,
    corrections kept under a banner)."""
    history = re.compile(r"#\d+\b|\bissues?\b|(?<!`)\bsessions?\b(?![(`])|\breview(?:'s|s)?\b|\bcorrection\b", re.I)
    docs = [REPO / "README.md", REPO / "evaluation" / "README.md", *(REPO / "docs").rglob("*.md")]
    hits = [f"{d.relative_to(REPO)}:{i}: {line.strip()[:100]}" for d in docs
            for i, line in enumerate(d.read_text().splitlines(), 1) if history.search(line)]
    assert hits == []
