"""Shared fixtures: Hydra-composed configs on the tiny model, temp MLflow stores."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from quantlab.cli import CONF_DIR
from quantlab.compose import register_configs

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"


def compose_cfg(overrides: list[str] | None = None, to_object: bool = True):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides or [])
    return OmegaConf.to_object(cfg) if to_object else cfg


@pytest.fixture
def store(tmp_path):
    """A fresh SQLite tracking store; returns the override list that selects it."""
    return [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"tracking.artifact_root={tmp_path}/art"]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """One quantlab cache per test session (reference logits, converted models)."""
    cache = os.environ.get("QUANTLAB_TEST_CACHE") or str(tmp_path_factory.getbasetemp() / "qlcache")
    monkeypatch.setenv("QUANTLAB_CACHE", cache)


def run_cli(args: list[str], timeout: int = 600, python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``python [PYTHON_FLAGS] -m quantlab ARGS`` in a subprocess, as a user runs it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, *python_flags, "-m", "quantlab", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of asking)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
