"""Points as Ray tasks (``hydra/launcher=ray``, the ``ray`` extra): the same
sweep as the basic launcher, and the bad inputs refused before anything starts."""
from __future__ import annotations

import contextlib
import importlib.util
import os

import mlflow
import pytest

from quantlab import cli, point, tracking, tracking_server
from quantlab.errors import UserError
from tests.conftest import REPO, free_port, run_cli

needs_ray = pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is None,
                               reason="the ray extra is not installed (pip install -e '.[ray]')")


@pytest.fixture(autouse=True)
def ray_on_loopback(monkeypatch):
    """Ray gives its nodes this machine's interface address (127.0.0.1 becomes
    it too, when a driver connects); its single-machine mode, which this
    variable turns on, keeps every node, driver and worker on 127.0.0.1.
    Inherited by the quantlab processes the tests start."""
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def _sweep(tmp_path, name: str, *extra: str, server: bool = False):
    """Run the smoke sweep into a file store, or (``server``) through a
    tracking server quantlab starts for it; the runs and the parent's artifacts."""
    db = tmp_path / name / "mlflow.db" if server else tmp_path / f"{name}.db"
    store = ["tracking=server", f"tracking.uri=http://127.0.0.1:{free_port()}", f"tracking.serve={db.parent}"] \
        if server else [f"tracking.uri=sqlite:///{db}", f"tracking.artifact_root={tmp_path}/{name}-art"]
    proc = run_cli(["+sweep=smoke", "model=tiny", *store, *extra], timeout=600)
    client = mlflow.MlflowClient(f"sqlite:///{db}")  # the server's own store, read after it stopped
    exp = client.get_experiment_by_name("quantlab").experiment_id
    parents = client.search_runs([exp], f"tags.`{point.ROLE_TAG}` = '{point.ROLE_SWEEP}'")
    assert len(parents) == 1, proc.stderr[-2000:]
    kids = {r.info.run_name: r for r in tracking.children(client, exp, parents[0].info.run_id)}
    if server:
        arts = {p.name for p in (db.parent / "artifacts").glob(f"*/{parents[0].info.run_id}/artifacts/*")}
    else:
        arts = {a.path for a in client.list_artifacts(parents[0].info.run_id)}
    return proc, kids, arts


@needs_ray
def test_a_ray_sweep_logs_what_the_basic_launcher_logs(tmp_path):
    """Same runs (names, outcomes, metric names), one parent, the report on it
    and exit 0; each point in a fresh worker process of its own (max_calls 1),
    one at a time (each asks for the node's cores, so no two are timed on the
    same cores)."""
    basic, b_kids, b_arts = _sweep(tmp_path, "basic")
    ray, r_kids, r_arts = _sweep(tmp_path, "ray", "hydra/launcher=ray")
    assert basic.returncode == ray.returncode == 0, ray.stderr[-3000:]
    assert set(b_kids) == set(r_kids) == {"fp32@cpu", "bf16@cpu", "fp16@cpu"}
    for name, r in r_kids.items():
        assert r.data.tags[point.OUTCOME_TAG] == b_kids[name].data.tags[point.OUTCOME_TAG] == "finished"
        assert set(r.data.metrics) == set(b_kids[name].data.metrics), name
    assert "report.md" in b_arts and "report.md" in r_arts
    pids = {r.data.tags[point.PID_TAG] for r in r_kids.values()}
    assert len(pids) == 3 and len({r.data.tags[point.PID_TAG] for r in b_kids.values()}) == 1
    assert "Initializing ray" in ray.stdout + ray.stderr and "UserWarning" not in ray.stderr


@needs_ray
def test_a_ray_sweep_through_a_tracking_server_quantlab_starts(tmp_path):
    """``hydra/launcher=ray tracking=server`` with no server running: one is
    started for the sweep (the only writer: the workers log over HTTP), and
    its store holds the runs and metric names the basic launcher's file store
    does, the report on the parent, exit 0."""
    basic, b_kids, _ = _sweep(tmp_path, "basic")
    ray, r_kids, r_arts = _sweep(tmp_path, "served", "hydra/launcher=ray", server=True)
    assert basic.returncode == ray.returncode == 0, ray.stderr[-3000:]
    assert "started an MLflow tracking server" in ray.stderr
    assert set(b_kids) == set(r_kids) == {"fp32@cpu", "bf16@cpu", "fp16@cpu"}
    for name, r in r_kids.items():
        assert r.data.tags[point.OUTCOME_TAG] == b_kids[name].data.tags[point.OUTCOME_TAG] == "finished"
        assert set(r.data.metrics) == set(b_kids[name].data.metrics), name
    assert "report.md" in r_arts and len({r.data.tags[point.PID_TAG] for r in r_kids.values()}) == 3


def test_ray_bad_input_is_one_line_before_anything_starts(tmp_path, monkeypatch):
    local = ["hydra/launcher=ray"]
    cli.check_launcher(["+sweep=smoke"], "sqlite:///m.db")  # not the Ray launcher: nothing to check
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "hydra_plugins.hydra_ray_launcher" else real(n, *a))
    with pytest.raises(UserError, match=r"hydra/launcher=ray needs the Ray launcher: pip install -e \"\.\[ray\]\""):
        cli.check_launcher(local, "sqlite:///m.db")
    monkeypatch.setattr(importlib.util, "find_spec", real)
    if real("hydra_plugins.hydra_ray_launcher") is None:
        pytest.skip("the ray extra is not installed")
    cli.check_launcher(local, "sqlite:///m.db")  # a local instance may share this machine's file store
    with pytest.raises(UserError, match="cluster ray://127.0.0.1:1 unreachable"):
        cli.check_launcher([*local, "hydra.launcher.ray.init.address=ray://127.0.0.1:1"], "http://127.0.0.1:5000")
    proc = run_cli(["+sweep=smoke", "model=tiny", *local, "hydra.launcher.ray.init.address=auto",
                    f"tracking.uri=sqlite:///{tmp_path}/m.db"], timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("quantlab:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "points on other nodes cannot write the file store" in lines[0] and not (tmp_path / "m.db").exists()


@needs_ray
def test_a_point_on_a_lost_node_fails_and_the_rerun_finishes_it(tmp_path):
    """A two-node local cluster (ray.cluster_utils.Cluster, one CPU each), two
    points (one a node) logging to a tracking server quantlab starts: the
    worker node is killed while it runs its point. That point ends FAILED "node or worker
    lost", the others FINISHED once, the parent run ends, exit 1; the same
    command again (the head alone) finishes the lost point and reuses the rest."""
    import subprocess
    import sys
    import time

    import psutil
    from ray.cluster_utils import Cluster


    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    worker = cluster.add_node(num_cpus=1)
    port, serve = free_port(), tmp_path / "srv"
    args = ["+sweep=smoke", "model=tiny", "hydra/launcher=ray", f"hydra.launcher.ray.init.address={cluster.address}",
            "hydra.launcher.ray.remote.num_cpus=1", "tracking=server", f"tracking.uri=http://127.0.0.1:{port}",
            f"tracking.serve={serve}", "scheme/weights=fp32,bf16", "probe.latency.min_seconds=20"]
    try:
        log = open(tmp_path / "sweep.log", "w")  # a file, not a pipe: nobody reads while it runs
        proc = subprocess.Popen([sys.executable, "-m", "quantlab", *args], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        raylet = worker.all_processes["raylet"][0].process.pid
        victim, deadline = None, time.time() + 300
        while victim is None and time.time() < deadline and proc.poll() is None:
            time.sleep(1)
            if tracking_server.unreachable(f"http://127.0.0.1:{port}"):  # the client would retry for minutes
                continue
            client = mlflow.MlflowClient(f"http://127.0.0.1:{port}")
            with contextlib.suppress(Exception):  # the server may be starting
                for r in client.search_runs(["0", "1"], "attributes.status = 'RUNNING'"):
                    pid = int(r.data.tags.get(point.PID_TAG, 0))
                    if pid and psutil.pid_exists(pid) and raylet in {p.pid for p in psutil.Process(pid).parents()}:
                        victim = r.info.run_name
        assert victim is not None, "no point ran on the worker node: " + (tmp_path / "sweep.log").read_text()[-3000:]
        cluster.remove_node(worker, allow_graceful=False)
        proc.wait(timeout=600)
        log.close()
        assert proc.returncode == 1, (tmp_path / "sweep.log").read_text()[-3000:]
        client = mlflow.MlflowClient(f"sqlite:///{serve}/mlflow.db")
        exp = client.get_experiment_by_name("quantlab").experiment_id
        (parent,) = client.search_runs([exp], f"tags.`{point.ROLE_TAG}` = '{point.ROLE_SWEEP}'")
        assert parent.info.status == "FAILED"  # ended, with a failed point
        kids = tracking.children(client, exp, parent.info.run_id)
        assert sorted(r.info.run_name for r in kids) == ["bf16@cpu", "fp32@cpu"]
        lost = {r.info.run_name: r.data.tags[point.REASON_TAG] for r in kids if r.info.status == "FAILED"}
        assert list(lost) == [victim] and lost[victim].startswith("node or worker lost"), lost
        assert all(r.data.tags[point.OUTCOME_TAG] == "finished" for r in kids if r.info.run_name != victim)
        again = run_cli(args, timeout=600)
        assert again.returncode == 0, again.stderr[-3000:]
        newest = max(client.search_runs([exp], f"tags.`{point.ROLE_TAG}` = '{point.ROLE_SWEEP}'"),
                     key=lambda r: r.info.start_time)
        runs, reused = tracking.sweep_runs(client, exp, newest.info.run_id)
        assert [r.info.run_name for r in runs] == [victim] and runs[0].info.status == "FINISHED"
        assert [r.info.run_name for r in reused] == [n for n in ("bf16@cpu", "fp32@cpu") if n != victim]
    finally:
        cluster.shutdown()


@needs_ray
def test_a_node_without_the_data_directory_fails_its_point_in_one_line(tmp_path):
    """On a Ray worker a missing data_dir is a FAILED point naming the node,
    not accuracy probes silently skipped on some nodes only."""
    proc, kids, _ = _sweep(tmp_path, "nodata", "hydra/launcher=ray", "scheme/weights=fp32",
                           f"data_dir={tmp_path}/nowhere")
    assert proc.returncode == 1, proc.stderr[-3000:]
    (run,) = kids.values()
    assert run.info.status == "FAILED"
    assert run.data.tags[point.REASON_TAG].startswith(f"data_dir {tmp_path}/nowhere is not on this node")
