"""Points as Ray tasks (``hydra/launcher=ray``, the ``ray`` extra): the same
sweep as the basic launcher, and the bad inputs refused before anything starts."""
from __future__ import annotations

import importlib.util
import socket

import mlflow
import pytest

from quantlab import cli, point, tracking
from quantlab.errors import UserError
from tests.conftest import run_cli

needs_ray = pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is None,
                               reason="the ray extra is not installed (pip install -e '.[ray]')")


def _sweep(tmp_path, name: str, *extra: str, server: bool = False):
    """Run the smoke sweep into a file store, or (``server``) through a
    tracking server quantlab starts for it; the runs and the parent's artifacts."""
    db = tmp_path / name / "mlflow.db" if server else tmp_path / f"{name}.db"
    store = ["tracking=server", f"tracking.uri=http://127.0.0.1:{_free_port()}", f"tracking.serve={db.parent}"] \
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
