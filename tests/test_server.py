"""A team tracking server: ``mlflow server`` on PostgreSQL, bound to loopback,
fed by a 2-worker joblib sweep. Marked ``server``; needs PostgreSQL's server
binaries (.ci/run installs Debian's postgresql) and psycopg2."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from mlflow.tracking import MlflowClient

from quantlab import tracking
from quantlab.tracking_config import shown_uri
from tests.conftest import REPO, MlflowServer, free_port, run_cli

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def mlflow_server(postgres):
    database, root = postgres
    server = MlflowServer(database("mlflow"), root / "server")
    server.start()
    yield server.url
    server.stop()


def test_two_workers_against_postgres_server(mlflow_server):
    points = ["fp32", "bf16", "fp16", "int8"]
    proc = run_cli(["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "model=tiny",
                    f"scheme/weights={','.join(points)}", "probe.latency.repeats=1",
                    "tracking=server", f"tracking.uri={mlflow_server}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name("quantlab").experiment_id], max_results=100)
    children = [r for r in runs if tracking.PARENT_TAG in r.data.tags]
    assert sorted(r.info.run_name for r in children) == sorted(f"{p}@cpu" for p in points)
    assert all(r.info.status == "FINISHED" for r in children)
    assert len({r.data.tags[tracking.HASH_TAG] for r in children}) == len(points)
    assert "config.yaml" in {a.path for a in client.list_artifacts(children[0].info.run_id)}


def test_unreachable_server_fails_before_any_work():
    port = free_port()  # nothing listens there
    proc = run_cli(["+sweep=smoke", "model=tiny", "tracking=server", f"tracking.uri=http://127.0.0.1:{port}",
                    "tracking.serve=null"], timeout=300)  # serve=null: never start one here
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"quantlab: tracking store http://127.0.0.1:{port} unusable")
    assert "loading model" not in proc.stdout


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_local_server_is_started_for_the_sweep_and_stopped_with_it(tmp_path, request, backend):
    """tracking=server on this machine with nothing there: quantlab starts
    ``mlflow server`` (its runs in SQLite under tracking.serve, or in the
    PostgreSQL database tracking.serve_backend names; served artifacts under
    tracking.serve), the points log through it, the report lands in its
    artifact store, and the server is gone when the command returns."""
    port = free_port()
    serve = tmp_path / "srv"
    db = f"sqlite:///{serve}/mlflow.db"
    extra = []
    if backend == "postgresql":
        db = request.getfixturevalue("postgres")[0]("autostarted")
        extra = [f"tracking.serve_backend={db}"]
    proc = run_cli(["+sweep=smoke", "model=tiny", "tracking=server", f"tracking.uri=http://127.0.0.1:{port}",
                    f"tracking.serve={serve}", "probe.latency.repeats=1", *extra], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"started an MLflow tracking server at http://127.0.0.1:{port} (runs in {shown_uri(db)}" in proc.stderr
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
    assert not (serve / "server.json").exists()
    client = MlflowClient(db)
    runs = client.search_runs([client.get_experiment_by_name("quantlab").experiment_id])
    children = sorted(r.info.run_name for r in runs if tracking.PARENT_TAG in r.data.tags)
    assert children == ["bf16@cpu", "fp16@cpu", "fp32@cpu"] and all(r.info.status == "FINISHED" for r in runs)
    assert runs[0].info.artifact_uri.startswith("mlflow-artifacts:")  # served, not a path on the worker
    assert len(list((serve / "artifacts").rglob("report.md"))) == 1 and len(list(serve.rglob("config.yaml"))) == 3
    assert (serve / "mlflow.db").exists() == (backend == "sqlite")


def test_a_port_another_process_holds_is_named_in_one_line(tmp_path):
    """Was 27 s and "exited with status 0: Application shutdown complete"."""
    with socket.socket() as busy:  # listens, never answers HTTP: mlflow server cannot bind the port
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        proc = run_cli(["+sweep=smoke", "model=tiny", "tracking=server", f"tracking.uri=http://127.0.0.1:{port}",
                        f"tracking.serve={tmp_path}/srv"], timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"quantlab: tracking server at http://127.0.0.1:{port} cannot start: port {port} is in use "
                           f"by pid {os.getpid()} (")
    assert time.monotonic() - t0 < 60  # no server start, no wait (a cold interpreter here takes ~15 s)
    assert "loading model" not in proc.stdout + proc.stderr and not (tmp_path / "srv" / "server.log").exists()


def test_a_server_that_cannot_start_is_one_line_and_nothing_runs(tmp_path):
    """A backend whose directory cannot be made is refused before a server
    starts; one the server cannot open (a directory where its database file
    would be) is the server's exit, in one line."""
    port = free_port()
    common = ["+sweep=smoke", "model=tiny", "tracking=server", f"tracking.uri=http://127.0.0.1:{port}",
              f"tracking.serve={tmp_path}/srv"]
    proc = run_cli([*common, "tracking.serve_backend=sqlite:////proc/forbidden/m.db"], timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "quantlab: tracking.serve_backend sqlite:////proc/forbidden/m.db unusable: cannot create /proc/forbidden: "
        "No such file or directory")
    (tmp_path / "a_dir").mkdir()
    proc = run_cli([*common, f"tracking.serve_backend=sqlite:///{tmp_path}/a_dir"], timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"quantlab: tracking server at http://127.0.0.1:{port} (started here") and "exited" in last
    assert "loading model" not in proc.stdout + proc.stderr


def test_a_server_quantlab_started_that_dies_is_restarted_and_the_sweep_loses_nothing(tmp_path):
    """kill -9 of the ``mlflow server`` quantlab started, after the first
    point finished, with nothing outside restarting it: quantlab restarts it
    on the same port and store, says so once, and every point is FINISHED
    once with its metrics once; the sweep exits 0."""
    port, serve = free_port(), tmp_path / "srv"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    sweep = subprocess.Popen([sys.executable, "-m", "quantlab", "+sweep=smoke", "model=tiny", "tracking=server",
                              f"tracking.uri=http://127.0.0.1:{port}", f"tracking.serve={serve}",
                              "probe.latency.repeats=1"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while _finished_children(serve / "mlflow.db") < 1:
            assert sweep.poll() is None and time.monotonic() < deadline, "the sweep ended before its first point"
            time.sleep(0.2)
        server = json.loads((serve / "server.json").read_text())["pid"]
        os.kill(server, signal.SIGKILL)
        out, err = sweep.communicate(timeout=900)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 0, err[-3000:]
    assert err.count("restarted it on the same port and store") == 1, err[-3000:]
    assert f"(pid {server}) died" in err
    client = MlflowClient(f"sqlite:///{serve}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("quantlab").experiment_id])
    children = [r for r in runs if tracking.PARENT_TAG in r.data.tags]
    assert sorted(r.info.run_name for r in children) == ["bf16@cpu", "fp16@cpu", "fp32@cpu"]
    assert all(r.info.status == "FINISHED" for r in runs)
    for r in children:
        assert len(client.get_metric_history(r.info.run_id, "size/weight_bytes")) == 1


def _finished_children(db) -> int:
    """FINISHED runs with a parent in the server's SQLite store, read-only (0 while it does not exist yet)."""
    import sqlite3

    if not db.exists():
        return 0
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)) as con:
            return con.execute("SELECT count(*) FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                               "WHERE r.status = 'FINISHED' AND t.key = ?", (tracking.PARENT_TAG,)).fetchone()[0]
    except sqlite3.OperationalError:  # tables not made yet, or the writer holds a lock
        return 0
