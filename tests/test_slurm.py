"""Points as SLURM jobs (``hydra/launcher=slurm``, the ``slurm`` extra) on a
single-node SLURM this module starts (Debian's slurm-wlm: munged, slurmctld
and slurmd under a temporary directory, as root; skipped where absent), and
the launcher's bad inputs refused in one line."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import time

import mlflow
import pytest

from quantlab import cli, point
from quantlab.errors import UserError
from tests.conftest import free_port, run_cli, tracker

needs_plugin = pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
                                  reason="the slurm extra is not installed (pip install -e '.[slurm]')")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node SLURM cluster (this machine, its cores) for the module; its
    ``SLURM_CONF`` is set in this process, so the commands tests start see it."""
    daemons = {d: shutil.which(d) or f"/usr/sbin/{d}" for d in ("munged", "mungekey", "slurmctld", "slurmd")}
    if not all(os.access(p, os.X_OK) for p in daemons.values()) or shutil.which("sbatch") is None:
        pytest.skip("SLURM not installed (Debian: apt-get install slurm-wlm)")
    if os.geteuid() != 0:
        pytest.skip("slurmd runs jobs as root here")
    root = tmp_path_factory.mktemp("slurm")
    munge = root / "munge"
    munge.mkdir(mode=0o700)
    subprocess.run([daemons["mungekey"], "-c", "-k", munge / "munge.key"], check=True, capture_output=True)
    (munge / "munge.key").chmod(0o400)
    subprocess.run([daemons["munged"], f"--key-file={munge}/munge.key", f"--socket={munge}/munge.sock",
                    f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log", f"--seed-file={munge}/seed",
                    "-f"], check=True, capture_output=True)
    host, conf = socket.gethostname(), root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=quantlab", f"SlurmctldHost={host}", f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        "AuthType=auth/munge", f"AuthInfo=socket={munge}/munge.sock", "CredType=cred/munge",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", f"SlurmdSpoolDir={root}/d", f"StateSaveLocation={root}/ctld",
        f"SlurmctldPidFile={root}/ctld.pid", f"SlurmdPidFile={root}/d.pid", f"SlurmctldLogFile={root}/ctld.log",
        f"SlurmdLogFile={root}/d.log", "SlurmUser=root", "ReturnToService=2", "MpiDefault=none",
        "SchedulerType=sched/backfill", "JobCompType=jobcomp/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    try:
        subprocess.run([daemons["slurmctld"], "-c"], env=env, check=True, capture_output=True)
        subprocess.run([daemons["slurmd"]], env=env, check=True, capture_output=True)
        deadline = time.time() + 60
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                           text=True).stdout:
            if time.time() > deadline:
                pytest.fail("SLURM's node never came up: " + (root / "ctld.log").read_text()[-2000:])
            time.sleep(1)
        os.environ["SLURM_CONF"] = str(conf)
        yield root
    finally:
        os.environ.pop("SLURM_CONF", None)
        for pidfile in (root / "d.pid", root / "ctld.pid", munge / "munged.pid"):
            if pidfile.is_file():
                subprocess.run(["kill", pidfile.read_text().strip()], capture_output=True)


@needs_plugin
@pytest.mark.slurm
def test_a_slurm_sweep_logs_what_the_basic_launcher_logs(tmp_path, slurm):
    """``hydra/launcher=slurm tracking=server``: each point a SLURM job (one
    array), logging through a tracking server quantlab starts; the same runs
    and metric names as the basic launcher's, one parent with the report, exit 0."""
    basic = run_cli(["+sweep=smoke", "model=tiny", f"tracking.uri=sqlite:///{tmp_path}/basic.db",
                     f"tracking.artifact_root={tmp_path}/basic-art"], timeout=600)
    assert basic.returncode == 0, basic.stderr[-3000:]
    serve = tmp_path / "srv"
    proc = run_cli(["+sweep=smoke", "model=tiny", "hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path}/sweep",
                    "tracking=server", f"tracking.uri=http://127.0.0.1:{free_port()}", f"tracking.serve={serve}"],
                   timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = [j.name for j in (tmp_path / "sweep" / ".submitit").iterdir() if j.is_dir()]
    assert len([j for j in jobs if re.fullmatch(r"\d+_\d", j)]) == 3, jobs  # one array, a task per point
    runs = {}
    for uri in (f"sqlite:///{tmp_path}/basic.db", f"sqlite:///{serve}/mlflow.db"):
        client = mlflow.MlflowClient(uri)
        exp = client.get_experiment_by_name("quantlab").experiment_id
        (parent,) = client.search_runs([exp], f"tags.`{point.ROLE_TAG}` = '{point.ROLE_SWEEP}'")
        runs[uri] = {r.info.run_name: r for r in tracker(client.tracking_uri).children(parent.info.run_id)}
        assert parent.info.status == "FINISHED"
    b_kids, s_kids = runs.values()
    assert set(b_kids) == set(s_kids) == {"fp32@cpu", "bf16@cpu", "fp16@cpu"}
    for name, r in s_kids.items():
        assert r.data.tags[point.OUTCOME_TAG] == "finished" and set(r.data.metrics) == set(b_kids[name].data.metrics)
    assert len({r.data.tags[point.PID_TAG] for r in s_kids.values()}) == 3
    assert len(list((serve / "artifacts").rglob("report.md"))) == 1


@needs_plugin
def test_slurm_bad_input_is_one_line(monkeypatch):
    slurm = ["hydra/launcher=slurm"]
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "sbatch" else "/usr/bin/" + name)
    with pytest.raises(UserError, match="hydra/launcher=slurm: sbatch not found on PATH"):
        cli.check_launcher(slurm, "http://head:5000")
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    with pytest.raises(UserError, match="jobs on other nodes cannot write the file store sqlite:///m.db"):
        cli.check_launcher(slurm, "sqlite:///m.db")
    cli.check_launcher(slurm, "http://head:5000")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "hydra_plugins.hydra_submitit_launcher" else real(n, *a))
    with pytest.raises(UserError, match=r"needs the submitit launcher: pip install -e \"\.\[slurm\]\""):
        cli.check_launcher(slurm, "http://head:5000")
