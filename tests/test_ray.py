"""Points as Ray tasks (``hydra/launcher=ray``, the ``ray`` extra): the same
sweep as the basic launcher, and the bad inputs refused before anything starts."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import psutil
import pytest

from quantlab import cli, point, tracking_server
from quantlab.errors import UserError
from tests.conftest import REPO, MlflowServer, free_port, run_cli, tracker

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
    kids = {r.info.run_name: r for r in tracker(client.tracking_uri).children(parents[0].info.run_id)}
    if server:
        arts = {p.name for p in (db.parent / "artifacts").glob(f"*/{parents[0].info.run_id}/artifacts/*")}
    else:
        arts = {a.path for a in client.list_artifacts(parents[0].info.run_id)}
    return proc, kids, arts


@pytest.fixture(scope="module")
def basic(tmp_path_factory):
    """The smoke sweep under the basic launcher, into a file store: what both
    Ray sweeps are held against (run once for the file)."""
    return _sweep(tmp_path_factory.mktemp("basic"), "basic")


@needs_ray
def test_a_ray_sweep_logs_what_the_basic_launcher_logs(tmp_path, basic):
    """Same runs (names, outcomes, metric names), one parent, the report on it
    and exit 0; each point in a fresh worker process of its own (max_calls 1),
    one at a time (each asks for the node's cores, so no two are timed on the
    same cores)."""
    basic, b_kids, b_arts = basic
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
def test_a_ray_sweep_through_a_tracking_server_quantlab_starts(tmp_path, basic):
    """``hydra/launcher=ray tracking=server`` with no server running: one is
    started for the sweep (the only writer: the workers log over HTTP), and
    its store holds the runs and metric names the basic launcher's file store
    does, the report on the parent, exit 0."""
    basic, b_kids, _ = basic
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


@pytest.fixture
def two_nodes():
    """A local two-node Ray cluster (ray.cluster_utils.Cluster), one CPU a node."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    try:
        yield cluster
    finally:
        cluster.shutdown()


def _on_cluster(cluster, uri: str, *extra: str) -> list[str]:
    """The smoke sweep on ``cluster``, one point a node, logging to the server at ``uri``."""
    return ["+sweep=smoke", "model=tiny", "hydra/launcher=ray", f"hydra.launcher.ray.init.address={cluster.address}",
            "hydra.launcher.ray.remote.num_cpus=1", "tracking=server", f"tracking.uri={uri}", *extra]


def _launch(args: list[str], log: Path) -> subprocess.Popen:
    """``python -m quantlab ARGS`` in the background, its output in ``log`` (a
    file, not a pipe: nobody reads it while it runs)."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "quantlab", *args], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _wait_for(uri: str, proc: subprocess.Popen, log: Path, ready, timeout_s: float = 300.0) -> list:
    """Poll the server at ``uri`` until ``ready(runs)`` holds for the child runs
    there (the sweep still running); those runs."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        time.sleep(1)
        if tracking_server.unreachable(uri):  # the client would retry for minutes
            continue
        client = mlflow.MlflowClient(uri)
        with contextlib.suppress(mlflow.exceptions.MlflowException):  # the experiment may not exist yet
            runs = [r for r in client.search_runs(["0", "1"]) if point.PARENT_TAG in r.data.tags]
            if ready(runs):
                return runs
    raise AssertionError(f"sweep never reached the state awaited (exit {proc.poll()}): "
                         + log.read_text()[-3000:])


def _parents(client) -> list:
    exp = client.get_experiment_by_name("quantlab").experiment_id
    return sorted(client.search_runs([exp], f"tags.`{point.ROLE_TAG}` = '{point.ROLE_SWEEP}'"),
                  key=lambda r: r.info.start_time)


def _on_node(run, raylet_pid: int) -> bool:
    """Whether ``run``'s owning process is a worker of the node whose raylet is ``raylet_pid``."""
    pid = int(run.data.tags.get(point.PID_TAG, 0))
    with contextlib.suppress(psutil.NoSuchProcess):
        return bool(pid) and raylet_pid in {p.pid for p in psutil.Process(pid).parents()}
    return False


@needs_ray
@pytest.mark.server
def test_a_point_on_a_lost_node_fails_and_the_rerun_finishes_it(tmp_path, postgres, two_nodes):
    """Two points (one a node) logging to a tracking server quantlab starts
    (on PostgreSQL):
    the worker node is killed while it runs its point. That point ends FAILED
    "node or worker lost", the others FINISHED once, the parent run ends, exit
    1; the same command again (the head alone) finishes the lost point and
    reuses the rest."""
    worker = next(iter(two_nodes.worker_nodes))
    uri, serve, log = f"http://127.0.0.1:{free_port()}", tmp_path / "srv", tmp_path / "sweep.log"
    db = postgres[0]("lost_node")
    args = _on_cluster(two_nodes, uri, f"tracking.serve={serve}", f"tracking.serve_backend={db}",
                       "scheme/weights=fp32,bf16",
                       "probe.latency.min_seconds=20")
    proc = _launch(args, log)
    raylet = worker.all_processes["raylet"][0].process.pid
    runs = _wait_for(uri, proc, log, lambda runs: any(r.info.status == "RUNNING" and _on_node(r, raylet)
                                                       for r in runs))
    victim = next(r.info.run_name for r in runs if r.info.status == "RUNNING" and _on_node(r, raylet))
    two_nodes.remove_node(worker, allow_graceful=False)
    proc.wait(timeout=600)
    assert proc.returncode == 1, log.read_text()[-3000:]
    client = mlflow.MlflowClient(db)
    (parent,) = _parents(client)
    assert parent.info.status == "FAILED"  # ended, with a failed point
    kids = tracker(client.tracking_uri).children(parent.info.run_id)
    assert sorted(r.info.run_name for r in kids) == ["bf16@cpu", "fp32@cpu"]
    lost = {r.info.run_name: r.data.tags[point.REASON_TAG] for r in kids if r.info.status == "FAILED"}
    assert list(lost) == [victim] and lost[victim].startswith("node or worker lost"), lost
    assert all(r.data.tags[point.OUTCOME_TAG] == "finished" for r in kids if r.info.run_name != victim)
    again = run_cli(args, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    runs, reused = tracker(client.tracking_uri).sweep_runs(_parents(client)[-1].info.run_id)
    assert [r.info.run_name for r in runs] == [victim] and runs[0].info.status == "FINISHED"
    assert [r.info.run_name for r in reused] == [n for n in ("bf16@cpu", "fp32@cpu") if n != victim]


@needs_ray
@pytest.mark.server
def test_a_tracking_server_restarted_mid_sweep_loses_and_duplicates_nothing(tmp_path, postgres, two_nodes):
    """Three points on two nodes logging to an MLflow server on PostgreSQL.
    As soon as the first point has finished, the server is killed (SIGKILL)
    and started again on the same port and database once a point has found
    it unreachable (the next point starting, waiting for it). Every point ends
    FINISHED once, each metric has one value (no write was lost or made
    twice), each run has its config and the parent its report, exit 0."""
    server = MlflowServer(postgres[0]("restarted"), tmp_path / "srv")
    server.start()
    log = tmp_path / "sweep.log"
    try:
        proc = _launch(_on_cluster(two_nodes, server.url, "tracking.serve=null"), log)
        _wait_for(server.url, proc, log, lambda runs: any(r.info.status == "FINISHED" for r in runs))
        server.stop()
        down, deadline = time.time(), time.time() + 120
        while "unreachable" not in log.read_text() and time.time() < deadline and proc.poll() is None:
            time.sleep(1)
        assert "unreachable" in log.read_text(), log.read_text()[-3000:]  # a point met the outage
        time.sleep(5)
        server.start()
        proc.wait(timeout=600)
        assert proc.returncode == 0, log.read_text()[-3000:]
        client = mlflow.MlflowClient(server.url)
        (parent,) = _parents(client)
        assert parent.info.status == "FINISHED" and parent.data.metrics["points_finished"] == 3
        kids = tracker(client.tracking_uri).children(parent.info.run_id)
        assert sorted(r.info.run_name for r in kids) == ["bf16@cpu", "fp16@cpu", "fp32@cpu"]
        assert all(r.info.status == "FINISHED" and r.data.tags[point.OUTCOME_TAG] == "finished" for r in kids)
        assert "answers again" in log.read_text()  # the point that waited went on
        assert any(r.info.start_time > down * 1000 for r in kids)  # ... and is one of the three
        names = {frozenset(r.data.metrics) for r in kids}
        assert len(names) == 1 and "lat/tpot_ms_p50" in next(iter(names)), names
        for r in kids:
            assert all(len(client.get_metric_history(r.info.run_id, k)) == 1 for k in r.data.metrics), r.info.run_name
            assert "config.yaml" in {a.path for a in client.list_artifacts(r.info.run_id)}
        assert "report.md" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    finally:
        server.stop()


@needs_ray
@pytest.mark.server
def test_a_killed_driver_is_resumed_by_the_rerun(tmp_path, postgres, two_nodes):
    """kill -9 of ``python -m quantlab`` while its points run on a cluster,
    logging to a tracking server it started (on PostgreSQL): Ray ends the dead driver's
    points, the server outlives its command. The same command again adopts
    and finally stops that server, marks the dead sweep's runs KILLED, reuses
    the points that had finished and redoes the others, exit 0."""
    uri, serve, log = f"http://127.0.0.1:{free_port()}", tmp_path / "srv", tmp_path / "sweep.log"
    db = postgres[0]("killed_driver")
    args = _on_cluster(two_nodes, uri, f"tracking.serve={serve}", f"tracking.serve_backend={db}",
                       "probe.latency.min_seconds=15")
    proc = _launch(args, log)
    runs = _wait_for(uri, proc, log, lambda runs: {"FINISHED", "RUNNING"} <= {r.info.status for r in runs})
    finished = sorted(r.info.run_name for r in runs if r.info.status == "FINISHED")
    running = [int(r.data.tags[point.PID_TAG]) for r in runs if r.info.status == "RUNNING"]
    proc.kill()
    proc.wait()
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in running if psutil.pid_exists(p)], timeout=60)
    assert not alive, f"the dead driver's points still run: {alive}"
    assert not tracking_server.unreachable(uri)  # nothing could stop it
    again = run_cli(args, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "adopting the tracking server" in again.stderr and tracking_server.unreachable(uri)
    client = mlflow.MlflowClient(db)
    dead, parent = _parents(client)
    assert dead.info.status == "KILLED" and dead.data.tags[point.OUTCOME_TAG] == "killed"
    runs, reused = tracker(client.tracking_uri).sweep_runs(parent.info.run_id)
    assert sorted(r.info.run_name for r in reused) == finished
    assert sorted(r.info.run_name for r in runs + reused) == ["bf16@cpu", "fp16@cpu", "fp32@cpu"]
    assert all(r.info.status == "FINISHED" for r in runs)
    left = tracker(client.tracking_uri).children(dead.info.run_id)
    assert {r.info.status for r in left if r.info.run_name not in finished} <= {"KILLED"}


@needs_ray
@pytest.mark.server
def test_two_sweeps_on_one_cluster_and_one_server_keep_their_points_apart(tmp_path, postgres, two_nodes):
    """Two sweeps submitted at once to one cluster and one tracking server
    (PostgreSQL): each parent holds its own points and no other, both exit 0
    with their reports."""
    server = MlflowServer(postgres[0]("two_sweeps"), tmp_path / "srv")
    server.start()
    try:
        sweeps = {"fp32,bf16": ["bf16@cpu", "fp32@cpu"], "fp16,int8": ["fp16@cpu", "int8@cpu"]}
        procs = {w: _launch(_on_cluster(two_nodes, server.url, "tracking.serve=null", f"scheme/weights={w}"),
                            tmp_path / f"{w}.log") for w in sweeps}
        for w, proc in procs.items():
            proc.wait(timeout=900)
            assert proc.returncode == 0, (tmp_path / f"{w}.log").read_text()[-3000:]
        client = mlflow.MlflowClient(server.url)
        parents = _parents(client)
        assert len(parents) == 2
        for parent in parents:
            kids = tracker(client.tracking_uri).children(parent.info.run_id)
            weights = parent.data.params["sweep.overrides"].split("scheme/weights=")[1].split()[0]
            assert sorted(r.info.run_name for r in kids) == sweeps[weights]
            assert all(r.data.tags[point.OUTCOME_TAG] == "finished" for r in kids)
            assert "report.md" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    finally:
        server.stop()


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
