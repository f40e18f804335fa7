"""quantlab installed as a wheel (not editable) works from any directory: its
presets, calibration specs and lm-eval templates travel inside the package,
and the ``quantlab`` command dispatches to every tool.

The wheel is built from this checkout and installed without dependencies into
a fresh venv that sees the suite's installed packages through a ``.pth`` line
(no network). The suite's own editable finder is not loaded there (a plain
path line in a ``.pth`` does not process that directory's ``.pth`` files), so
``import quantlab`` can only find the wheel's copy.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """bin/ of a venv holding quantlab's wheel."""
    root = tmp_path_factory.mktemp("wheel")
    # built from a copy: setuptools writes quantlab.egg-info into the tree it builds, and one left in the
    # checkout would shadow the editable install's metadata (its entry points) for every later change
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("quantlab", "hydra_plugins", "conf", "calibration", "evaluation"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "_data"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                    "-w", str(root / "dist")], check=True, cwd=root, capture_output=True)
    wheel = next((root / "dist").glob("quantlab-*.whl"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "suite-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True)
    return venv / "bin"


def _run(cmd: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    return subprocess.run(cmd, cwd=cwd, env={**clean, "HF_HUB_OFFLINE": "1", **env}, capture_output=True,
                          text=True, timeout=600)


def test_the_wheel_carries_its_data_and_imports_from_itself(installed, tmp_path):
    out = _run([str(installed / "python"), "-c",
                "import quantlab, quantlab.resources as r; print(quantlab.__file__); "
                "print(*(r.data_dir(n) for n in r.NAMES), sep='\\n')"], tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    site = str(installed.parent)
    assert all(line.startswith(site) for line in lines), lines  # nothing read from the checkout
    assert [Path(line).name for line in lines[1:]] == ["conf", "calibration", "evaluation"]
    assert (Path(lines[1]) / "sweep" / "fp8_vs_int4.yaml").is_file()
    assert (Path(lines[3]) / "piqa_local.yaml").is_file()


def test_every_command_answers_help_outside_the_checkout(installed, tmp_path):
    for sub in ("report", "export", "capabilities", "sensitivity"):
        out = _run([str(installed / "quantlab"), sub, "--help"], tmp_path)
        assert out.returncode == 0, (sub, out.stderr)
        assert out.stdout.startswith(f"usage: quantlab {sub}"), out.stdout[:200]
    out = _run([str(installed / "quantlab"), "run", "--help"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "scheme/weights" in out.stdout  # Hydra's help lists the packaged config groups
    out = _run([str(installed / "quantlab"), "frobnicate"], tmp_path)
    assert out.returncode == 2 and "unknown command 'frobnicate'; valid: run, report" in out.stderr


def test_a_sweep_runs_from_the_wheel_and_its_report_finds_it_by_environment(installed, tmp_path):
    """``MLFLOW_TRACKING_URI`` is the one tracking setting: ``run`` writes
    there and ``report`` (no flag) reads there."""
    uri = f"sqlite:///{tmp_path / 'x.db'}"
    out = _run([str(installed / "quantlab"), "run", "+sweep=smoke", "model=tiny"], tmp_path,
               MLFLOW_TRACKING_URI=uri)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "x.db").is_file() and not (tmp_path / "mlruns" / "mlflow.db").exists()
    report = _run([str(installed / "quantlab"), "report", "--no-log"], tmp_path, MLFLOW_TRACKING_URI=uri)
    assert report.returncode == 0, report.stderr
    assert "# Sweep smoke" in report.stdout and "bf16@cpu" in report.stdout
