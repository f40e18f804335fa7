"""Sweeps never lose finished work: reuse, kill -9 recovery, failure isolation, bad input."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from quantlab import records, tracking
from tests.conftest import REPO, run_cli, tracker


def _runs(uri: str, status: str | None = None):
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("quantlab")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    runs = [r for r in runs if r.data.tags.get("quantlab.role") != "sweep"
            and tracking.REUSED_FROM_TAG not in r.data.tags]  # measured runs, not light links
    return [r for r in runs if status is None or r.info.status == status]


def _store(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    return uri, [f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/art"]


SWEEP = ["-m", "model=tiny", "scheme/weights=fp32,bf16,int8"]


def test_rerun_reuses_finished_points_and_force_reruns(tmp_path):
    uri, store = _store(tmp_path)
    store.append("eval_seed=0")  # a finished sweep repeated with its draws pinned: its points are reused
    assert run_cli([*SWEEP, *store]).returncode == 0
    second = run_cli([*SWEEP, *store])
    assert second.returncode == 0
    assert second.stdout.count("| reused") == 3
    assert len(_runs(uri, "FINISHED")) == 3  # nothing re-ran, nothing duplicated
    # ... yet the second sweep's parent shows all three points (light runs that
    # link to the runs that measured them), and its tag filter finds them
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("quantlab").experiment_id
    parents = client.search_runs([exp], "tags.`quantlab.role` = 'sweep'", order_by=["attributes.start_time DESC"])
    own, light = tracker(client.tracking_uri).sweep_runs(parents[0].info.run_id)
    measured = {r.info.run_id: r for r in _runs(uri)}
    assert own == [] and sorted(r.info.run_name for r in light) == ["bf16@cpu", "fp32@cpu", "int8@cpu"]
    for r in light:
        first = measured[records.of(r).origin]
        assert r.data.tags[tracking.OUTCOME_TAG] == "reused" and r.info.run_name == first.info.run_name
        assert r.data.metrics["fid/kl_mean"] == first.data.metrics["fid/kl_mean"]
        assert tracking.HASH_TAG not in r.data.tags  # never found as a finished point itself
    assert run_cli([*SWEEP, *store, "force=true"]).returncode == 0
    assert len(_runs(uri, "FINISHED")) == 6


def test_kill_9_then_rerun_gives_exactly_n_finished(tmp_path):
    uri, store = _store(tmp_path)
    n = 4
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "quantlab", "-m", "model=tiny", "scheme/weights=fp32,bf16,fp16,int8",
         "probe.latency.repeats=40", *store], cwd=REPO, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:  # kill once at least one point finished, mid-sweep
        time.sleep(0.5)
        try:
            if len(_runs(uri, "FINISHED")) >= 1 and len(_runs(uri, "RUNNING")) == 1:
                break
        except Exception:  # noqa: BLE001 - store not created yet
            continue
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    k = len(_runs(uri, "FINISHED"))
    assert 1 <= k < n and len(_runs(uri, "RUNNING")) == 1
    rerun = run_cli(["-m", "model=tiny", "scheme/weights=fp32,bf16,fp16,int8",
                     "probe.latency.repeats=40", *store])
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    finished = _runs(uri, "FINISHED")
    assert len(finished) == n
    assert len({r.data.tags[tracking.HASH_TAG] for r in finished}) == n  # no duplicates
    killed = _runs(uri, "KILLED")
    assert len(killed) == 1 and killed[0].data.tags[tracking.OUTCOME_TAG] == "killed"
    # the rerun kept the killed sweep's evaluation draws (unpinned): that is why its points could be reused
    client = MlflowClient(tracking_uri=uri)
    new, old = client.search_runs([client.get_experiment_by_name("quantlab").experiment_id],
                                  "tags.`quantlab.role` = 'sweep'", order_by=["attributes.start_time DESC"])
    assert new.data.tags["quantlab.eval_seed_from"] == f"resumed {old.info.run_id}"
    assert new.data.tags["quantlab.eval_seed"] == old.data.tags["quantlab.eval_seed"]


def test_failing_point_is_isolated_and_sets_exit_status(tmp_path):
    uri, store = _store(tmp_path)
    # int4-g128 cannot divide the tiny model's 64-wide layers: that point fails.
    proc = run_cli(["-m", "model=tiny", "scheme/weights=fp32,int4-g128,bf16", *store])
    assert proc.returncode == 1
    runs = {r.info.run_name: r for r in _runs(uri)}
    assert runs["int4-g128@cpu"].info.status == "FAILED"
    assert "does not divide" in runs["int4-g128@cpu"].data.tags[tracking.REASON_TAG]
    assert runs["fp32@cpu"].info.status == runs["bf16@cpu"].info.status == "FINISHED"
    assert "Skipped or failed:" in proc.stdout


def test_unexpected_exception_logs_traceback(tmp_path, monkeypatch):
    from quantlab import pipeline
    from tests.conftest import compose_cfg

    uri, store = _store(tmp_path)
    cfg = compose_cfg(["model=tiny", *store])

    def boom(*a, **k):
        raise RuntimeError("injected failure")

    from quantlab.probes import latency

    monkeypatch.setattr(latency, "measure", boom)
    result = pipeline.run_point(cfg)
    assert result.outcome == "failed" and result.reason == "RuntimeError: injected failure"
    client = MlflowClient(tracking_uri=uri)
    assert "traceback.txt" in {a.path for a in client.list_artifacts(result.run_id)}
    assert client.get_run(result.run_id).info.status == "FAILED"


def test_process_isolation_runs_point_in_child(tmp_path):
    uri, store = _store(tmp_path)
    proc = run_cli(["model=tiny", "isolation=process", *store])
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run,) = _runs(uri)
    assert run.info.status == "FINISHED" and "fid/kl_mean" in run.data.metrics
    assert run.data.tags[tracking.PID_TAG] != str(os.getpid())


@pytest.mark.parametrize("args,message", [
    (["scheme/weights=int3"], "quantlab: unknown scheme/weights 'int3'; valid: "),
    (["target=tpu"], "quantlab: unknown target 'tpu'; valid: cpu, cuda"),
    (["model=tiny", "scheme/weights=int4-g64", "scheme.weights.group_size=48"],
     "quantlab: invalid config: int4 group_size 48; valid: 32, 64, 128, 256"),
    (["model=tiny", "scheme/weights=gptq-g64", "scheme.weights.bits=5"],
     "quantlab: invalid config: gptq bits 5; valid: 3, 4, 8"),
    (["model=gguf", "model.path=/nonexistent/model.gguf"],
     "quantlab: invalid config: model.path=/nonexistent/model.gguf: no such .gguf file"),
    (["model=hf", "model.path=/nonexistent/model"],
     "quantlab: invalid config: model.path=/nonexistent/model: no such model directory"),
    (["model=hf", "model.path=nobody/no-such-model-xyz"],  # HF_HUB_OFFLINE=1 (run_cli): not in the cache
     "quantlab: invalid config: model.path=nobody/no-such-model-xyz: hub id not in the local Hugging Face cache"),
    (["model=tiny", "tracking=server", "tracking.uri=http://127.0.0.1:1", "tracking.serve=null"],  # was 300 s
     "quantlab: tracking store http://127.0.0.1:1 unusable: server unreachable"),
    (["tracking.uri=sqlite:////proc/forbidden/mlflow.db"], "quantlab: tracking store sqlite:////proc/forbidden/mlflow.db"),
])
def test_bad_input_is_one_line(tmp_path, args, message):
    uri, store = _store(tmp_path)
    if not any(a.startswith("tracking.uri") for a in args):
        args = [*args, *store]
    t0 = time.monotonic()
    proc = run_cli(args)
    assert proc.returncode == 2
    assert time.monotonic() - t0 < 60  # one line, not a wait (a cold interpreter here takes ~15 s)
    assert not Path(uri.removeprefix("sqlite:///")).exists() or not _runs(uri)  # the store untouched
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(message), proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr


def test_sweep_file_without_package_header_warns(tmp_path):
    from quantlab.cli import _check_sweep_file

    bad = tmp_path / "bad.yaml"
    bad.write_text("hydra:\n  mode: MULTIRUN\n")
    assert "silently run ONE point" in _check_sweep_file(bad)[0]


def test_two_joblib_workers_log_every_point_once(tmp_path):
    uri, store = _store(tmp_path)
    proc = run_cli(["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "model=tiny",
                    "scheme/weights=fp32,bf16,fp16,int8", "probe.latency.repeats=1", *store])
    assert proc.returncode == 0, proc.stderr[-2000:]
    finished = _runs(uri, "FINISHED")
    assert sorted(r.info.run_name for r in finished) == ["bf16@cpu", "fp16@cpu", "fp32@cpu", "int8@cpu"]
    parents = {r.data.tags[tracking.PARENT_TAG] for r in finished}
    assert len(parents) == 1  # the workers inherited the sweep's parent run
    pids = {r.data.tags[tracking.PID_TAG] for r in finished}
    assert len(pids) == 2  # really two worker processes


def test_timings_are_never_reused_from_another_host(tmp_path):
    """Same config, code and data but another host (as on a shared tracking
    server): points that time are re-measured; the summary names where a
    reused point came from."""
    uri, store = _store(tmp_path)
    store.append("eval_seed=0")
    sweep = ["-m", "model=tiny", "scheme/weights=fp32,bf16", "probe.latency.repeats=1", "probe.latency.new_tokens=4",
             "probe.cache.enabled=false"]
    assert run_cli([*sweep, *store]).returncode == 0
    t = tracker(uri)
    for r in _runs(uri):
        t.run(r.info.run_id).set_tags({tracking.HOST_ID_TAG: "elsewhere", "host.fingerprint": "Other CPU"})
    again = run_cli([*sweep, *store])
    assert again.returncode == 0 and again.stdout.count("| reused") == 0
    assert len(_runs(uri, "FINISHED")) == 4
    # without timings, the other host's accuracy/fidelity figures are reusable
    no_lat = ["-m", "model=tiny", "scheme/weights=fp32", "probe.latency.enabled=false", "probe.cache.enabled=false"]
    assert run_cli([*no_lat, *store]).returncode == 0
    for r in _runs(uri):
        t.run(r.info.run_id).set_tags({tracking.HOST_ID_TAG: "elsewhere", "host.fingerprint": "Other CPU"})
    third = run_cli([*no_lat, *store])
    assert third.returncode == 0 and third.stdout.count("| reused") == 1
    assert "host Other CPU" in third.stdout


def test_point_hash_covers_code_and_data_files(tmp_path, monkeypatch):
    from quantlab import provenance
    from quantlab.pipeline import point_hash
    from tests.conftest import compose_cfg

    data = tmp_path / "data" / "wikitext-2-raw"
    data.mkdir(parents=True)
    (data / "wiki.test.raw").write_text(" = A = \n text \n")
    cfg = compose_cfg(["model=tiny", "probe=quick", f"data_dir={tmp_path / 'data'}"])
    assert provenance.WIKITEXT in provenance.data_files(cfg) and "arc/arc_easy_test.jsonl" in provenance.data_files(cfg)
    h0 = point_hash(cfg)
    assert point_hash(cfg) == h0
    (data / "wiki.test.raw").write_text(" = A = \n text! \n")  # one byte of the test set changed
    h1 = point_hash(cfg)
    assert h1 != h0
    assert point_hash(compose_cfg(["model=tiny", "probe=quick", "data_dir=null"])) != h1  # no data: another point
    monkeypatch.setattr(provenance, "code_version", lambda: "other")
    assert point_hash(cfg) != h1
    gptq = compose_cfg(["model=tiny", "scheme/weights=gptq-g64", "probe=smoke"])
    assert provenance.data_files(gptq) == ["calibration/wiki.utf8"]


def test_a_moved_store_reads_its_artifacts_where_it_now_is(tmp_path):
    """`mv mlruns elsewhere/`: MLflow kept absolute artifact paths; the next
    connection rewrites them to the store's new place, so configs and reports
    still load (the export reads config.yaml from there)."""
    import shutil

    from quantlab.tracking_config import TrackingConfig

    old = tmp_path / "old" / "mlruns"
    first = run_cli(["model=tiny", "probe=smoke", "probe.latency.enabled=false",
                     f"tracking.uri=sqlite:///{old}/mlflow.db", f"tracking.artifact_root={old}/artifacts"])
    assert first.returncode == 0, first.stderr[-2000:]
    new = tmp_path / "new" / "mlruns"
    new.parent.mkdir()
    shutil.move(old, new)
    t = tracking.connect(TrackingConfig(uri=f"sqlite:///{new}/mlflow.db", experiment="quantlab", artifact_root=None))
    client, exp = t.client, t.experiment_id
    (run,) = [r for r in client.search_runs([exp]) if r.info.run_name.endswith("@cpu")]
    assert run.info.artifact_uri.startswith((new / "artifacts").as_uri())
    got = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))
    assert "tiny" in open(got).read()
    assert tracking.relocate_artifacts(new / "mlflow.db") == 0  # once


def test_a_create_retried_after_its_answer_was_lost_leaves_one_run(tmp_path, monkeypatch):
    """MLflow's client retries a request whose answer was lost (a tracking
    server restarted while it replied): the create ran twice on the server.
    Tracker.start deletes the twin its own key finds, so a point is one run."""
    from quantlab.tracking_config import TrackingConfig

    t = tracking.connect(TrackingConfig(uri=f"sqlite:///{tmp_path}/m.db", artifact_root=None))
    client, exp = t.client, t.experiment_id
    real = client.create_run

    def created_twice(*args, **kwargs):
        real(*args, **kwargs)  # processed by the server, its answer lost
        return real(*args, **kwargs)  # the retry's answer

    monkeypatch.setattr(client, "create_run", created_twice)
    run_id = t.start("int8@cpu", {"k": "v"}, parent="p0").id
    (run,) = client.search_runs([exp])  # active runs only: the twin is deleted
    assert run.info.run_id == run_id and run.data.tags["k"] == "v"
    assert len(client.search_runs([exp], run_view_type=3)) == 2  # ViewType.ALL: the twin is there, deleted


def test_a_point_waits_for_a_tracking_server_that_stopped_answering(monkeypatch):
    """A server down when a point starts is waited for (SERVER_WAIT_S), not
    the point's end; the checks before a sweep starts still fail at once."""
    from quantlab import tracking_server
    from quantlab.errors import UserError

    answers = iter(["refused", "refused", ""])
    monkeypatch.setattr(tracking_server, "unreachable", lambda uri, timeout: next(answers))
    monkeypatch.setattr(time, "sleep", lambda s: None)
    tracking._check_server("http://127.0.0.1:1", wait_s=60)  # answers at the third look
    monkeypatch.setattr(tracking_server, "unreachable", lambda uri, timeout: "refused")
    with pytest.raises(UserError, match=r"server unreachable \(refused\) \(is the URI right\?"):
        tracking._check_server("http://127.0.0.1:1")
    clock = iter(range(0, 10_000, 30))
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    with pytest.raises(UserError, match=r"server unreachable \(refused\) for 60 s"):
        tracking._check_server("http://127.0.0.1:1", wait_s=60)


def test_an_experiment_another_writer_created_meanwhile_is_used(tmp_path, monkeypatch):
    """Two sweeps starting at once on a new store both find no experiment and
    both create it: the loser's RESOURCE_ALREADY_EXISTS (a PostgreSQL unique
    violation behind a server) means "use it", not "store unusable"."""
    from quantlab.tracking_config import TrackingConfig

    cfg = TrackingConfig(uri=f"sqlite:///{tmp_path}/m.db", artifact_root=None)
    first = tracking.connect(cfg).experiment_id
    real = MlflowClient.get_experiment_by_name
    calls = []

    def not_yet(self, name):  # the other writer's create lands between this look and our create
        calls.append(name)
        return None if len(calls) == 1 else real(self, name)

    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", not_yet)
    assert tracking.connect(cfg).experiment_id == first and len(calls) == 2


def test_provenance_from_a_copy_that_is_not_a_git_checkout(tmp_path):
    """Recorded as "not a git checkout", and git's "fatal: not a git
    repository" never reaches the console."""
    import shutil

    shutil.copytree(REPO / "quantlab", tmp_path / "quantlab", ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-c", "from quantlab import tracking; print(tracking.__file__); "
                           "print(tracking.git_commit())"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=120)
    where, commit = proc.stdout.strip().splitlines()[-2:]
    assert where.startswith(str(tmp_path)) and commit == "not a git checkout", proc.stderr
    assert "fatal" not in proc.stderr
    assert tracking.git_commit() not in ("not a git checkout", "unknown")  # this checkout is one


DROPPED = ("API request to {}/api/2.0/{} failed with exception ('Connection aborted.', "
           "RemoteDisconnected('Remote end closed connection without response'))")


def _dropped_once(monkeypatch, client, method: str, uri: str, endpoint: str) -> list[int]:
    """``client.method`` runs on the store, then (the first time only) fails as
    a tracking server at ``uri`` killed before it answered makes MLflow fail
    without retrying; the calls made, as a list the test reads."""
    from mlflow.exceptions import MlflowException

    real, calls = getattr(client, method), []

    def lost_answer(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            raise MlflowException(DROPPED.format(uri, endpoint))
        return out

    monkeypatch.setattr(client, method, lost_answer)
    return calls


@pytest.fixture
def server_tracker(tmp_path, monkeypatch):
    """A Tracker on a local store, its requests reported as if they went to a
    tracking server at http://127.0.0.1:1 that answered before and answers
    again at once; the URIs it was waited for."""
    from quantlab import tracking_server
    from quantlab.tracking_config import TrackingConfig

    uri, waited = "http://127.0.0.1:1", []
    monkeypatch.setattr(tracking, "_ANSWERED", {uri})
    monkeypatch.setattr(tracking_server, "unreachable", lambda u, timeout: waited.append(u) or "")
    return tracking.connect(TrackingConfig(uri=f"sqlite:///{tmp_path}/m.db", artifact_root=None)), uri, waited


def test_requests_a_restarted_server_dropped_are_sent_again_and_land_once(server_tracker, monkeypatch, caplog):
    """A request the server processed but never answered (killed, then
    started again: MLflow raises "Connection aborted" without its own retry)
    is sent again once the server answers: the experiment is found, the
    create leaves one run (its key finds the twin), the metrics one value
    each (stamped once), the params, tags and artifacts once."""
    from quantlab.tracking_config import TrackingConfig

    t, uri, waited = server_tracker
    looks = _dropped_once(monkeypatch, MlflowClient, "get_experiment_by_name", uri,
                          "mlflow/experiments/get-by-name")
    again = tracking.connect(TrackingConfig(uri=t.client.tracking_uri, artifact_root=None))
    assert again.experiment_id == t.experiment_id and len(looks) == 2 and waited == [uri]
    client = t.client
    creates = _dropped_once(monkeypatch, client, "create_run", uri, "mlflow/runs/create")
    run = t.start("int8@cpu", {"k": "v"}, params={"p": "1"})
    assert len(creates) == 2 and waited == [uri, uri]
    (active,) = client.search_runs([t.experiment_id])
    assert active.info.run_id == run.id and active.data.params == {"p": "1"}
    batches = _dropped_once(monkeypatch, client, "log_batch", uri, "mlflow/runs/log-batch")
    run.log_metrics({"fid/kl": 0.25, "latency/tpot_ms_p50": 3.0})
    assert len(batches) == 2
    assert [m.value for m in client.get_metric_history(run.id, "fid/kl")] == [0.25]
    run.set_tags({"t": "x"})
    uploads = _dropped_once(monkeypatch, client, "log_artifact", uri, "mlflow-artifacts/artifacts/note.txt")
    run.log_text("hello", "note.txt")
    assert len(uploads) == 2
    run.set_status("FINISHED")
    got = client.get_run(run.id)
    assert got.data.tags["t"] == "x" and got.info.status == "FINISHED"
    assert t.download(run.id, "note.txt").read_text() == "hello"
    assert sum("dropped a request" in r.getMessage() for r in caplog.records) == 4


@pytest.mark.parametrize("message", [
    "API request to http://127.0.0.1:2/api/2.0/mlflow/runs/create failed with exception "
    "('Connection aborted.', RemoteDisconnected('Remote end closed connection without response'))",
    "API request to endpoint /api/2.0/mlflow/runs/create failed with error code 500 != 200. Response body: ''",
    "RESOURCE_DOES_NOT_EXIST: Run 'x' not found",
])
def test_only_a_dropped_request_to_a_server_that_answered_is_sent_again(server_tracker, monkeypatch, message):
    """A server never reached (a wrong URI), an HTTP error or any other
    failure passes through at once: nothing waits, nothing is sent twice."""
    from mlflow.exceptions import MlflowException

    t, uri, waited = server_tracker
    calls = []

    def fails(*args, **kwargs):
        calls.append(1)
        raise MlflowException(message)

    monkeypatch.setattr(t.client, "create_run", fails)
    with pytest.raises(MlflowException, match=message[:20]):
        t.start("int8@cpu", {})
    assert calls == [1] and waited == []


def test_a_model_version_is_not_registered_twice(server_tracker, monkeypatch):
    """Registering is not safe to send twice (two versions): a dropped
    request is an error, never a second version."""
    from mlflow.exceptions import MlflowException

    t, uri, waited = server_tracker
    run = t.start("int8@cpu", {})
    calls = _dropped_once(monkeypatch, t.client, "create_model_version", uri, "mlflow/model-versions/create")
    with pytest.raises(MlflowException, match="Connection aborted"):
        t.register("tiny-int8", "runs:/x/model", run.id, {})
    assert len(calls) == 1 and waited == []
    assert len(t.client.search_model_versions("name='tiny-int8'")) == 1
