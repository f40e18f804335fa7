"""Shared fixtures: Hydra-composed configs on the tiny model, temp MLflow stores."""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

# Before torch (and its OpenMP) loads here or in any process a test starts: OpenMP threads that sleep when idle
# instead of spinning. Two xdist workers on 2 cores each run 2-thread torch, llama.cpp and vLLM processes; spinning
# threads took the cores from each other's work (the every-preset sweep of test_targets beside a 2-thread torch
# loop: 195 s spinning, 81 s passive, 73 s alone). No test asserts a speed (benchmarks/ measure, without this).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from quantlab.cli import CONF_DIR  # noqa: E402
from quantlab.compose import register_configs  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# the benchmark data: where QUANTLAB_DATA_DIR points (as .ci/run sets it), else ../shared/data
SHARED_DATA = Path(os.environ.get("QUANTLAB_DATA_DIR") or REPO.parent / "shared" / "data")


def compose_cfg(overrides: list[str] | None = None, to_object: bool = True):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides or [])
    return OmegaConf.to_object(cfg) if to_object else cfg


@pytest.fixture
def store(tmp_path):
    """A fresh SQLite tracking store; returns the override list that selects it."""
    return [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"tracking.artifact_root={tmp_path}/art"]


@pytest.fixture(autouse=True, scope="session")
def _suite_env(tmp_path_factory):
    """What every test and every module's shared sweep runs under: one quantlab
    cache per test session (reference logits, converted models), and no
    user's tracking store (every command honours MLFLOW_TRACKING_URI)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QUANTLAB_CACHE", os.environ.get("QUANTLAB_TEST_CACHE")
                  or str(tmp_path_factory.getbasetemp() / "qlcache"))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        yield


@pytest.fixture(scope="session")
def llama_tools() -> Path:
    """The folder of llama.cpp's own tools (llama-server, llama-perplexity,
    llama-bench) built from the llama.cpp that llama-cpp-python vendors, once
    per version and build-script revision, into
    ~/.cache/quantlab/llama-tools/<version>-r<revision>/
    (scripts/build_llama_tools.sh, about 10 minutes on 2 cores)."""
    from filelock import FileLock

    from benchmarks.llamacpp_peers import BUILD_SCRIPT, default_tools

    prefix = default_tools()
    prefix.parent.mkdir(parents=True, exist_ok=True)
    # one build: xdist workers whose files need the tools wait for the first
    with FileLock(f"{prefix}.lock"):
        if not all((prefix / t).is_file() for t in ("llama-server", "llama-perplexity", "llama-bench")):
            proc = subprocess.run(["bash", str(BUILD_SCRIPT), str(prefix)], capture_output=True, text=True,
                                  timeout=2400)
            if proc.returncode != 0:
                pytest.skip(f"could not build llama.cpp's tools (needs PyPI and cmake): {proc.stderr[-500:]}")
    return prefix


def tracker(uri: str, experiment: str = "quantlab"):
    """quantlab's :class:`~quantlab.tracking.Tracker` on a store a test's sweep wrote."""
    from quantlab import tracking
    from quantlab.tracking_config import TrackingConfig

    return tracking.connect(TrackingConfig(uri=uri, experiment=experiment, artifact_root=None))


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


def pg_bin(name: str) -> str | None:
    hits = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return hits[-1] if hits else shutil.which(name)


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL server on 127.0.0.1 for the module: yields
    ``(database, root)``, ``database(name)`` creating a database and
    returning its SQLAlchemy URI (one per test keeps stores apart)."""
    initdb, pg_ctl = pg_bin("initdb"), pg_bin("pg_ctl")
    if not (initdb and pg_ctl):
        pytest.skip("PostgreSQL server binaries not installed")
    pytest.importorskip("psycopg2")
    root = Path(tempfile.mkdtemp(prefix="quantlab-pg-", dir="/tmp"))
    root.chmod(0o777)
    as_pg = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    data, port = root / "data", free_port()
    subprocess.run([*as_pg, initdb, "-D", str(data), "-U", "postgres", "--auth=trust"], check=True,
                   capture_output=True)
    subprocess.run([*as_pg, pg_ctl, "-D", str(data), "-l", str(root / "pg.log"), "-w", "-o",
                    f"-p {port} -k {root} -c listen_addresses=127.0.0.1", "start"], check=True,
                   capture_output=True)

    def database(name: str) -> str:
        subprocess.run([*as_pg, pg_bin("createdb") or "createdb", "-h", "127.0.0.1", "-p", str(port),
                        "-U", "postgres", name], check=True, capture_output=True)
        return f"postgresql://postgres@127.0.0.1:{port}/{name}"  # the plain form: SQLAlchemy's default driver

    try:
        yield database, root
    finally:
        subprocess.run([*as_pg, pg_ctl, "-D", str(data), "-m", "fast", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


class MlflowServer:
    """``mlflow server`` on 127.0.0.1 that a test starts, crashes (SIGKILL to
    its process group) and starts again on the same port and store."""

    def __init__(self, backend: str, root: Path):
        self.backend, self.root, self.port = backend, Path(root), free_port()
        self.url, self.proc = f"http://127.0.0.1:{self.port}", None

    def start(self, timeout_s: float = 120.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.backend, "--serve-artifacts",
             "--artifacts-destination", (self.root / "artifacts").as_uri(), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            stdout=subprocess.DEVNULL, stderr=open(self.root / "server.log", "a"), start_new_session=True)
        deadline = time.time() + timeout_s
        while time.time() < deadline and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{self.url}/health", timeout=2).status == 200:
                    return
            time.sleep(0.5)
        self.stop()
        pytest.fail("mlflow server did not come up: " + (self.root / "server.log").read_text()[-2000:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
