"""Probes are plugins: the guide's probe (docs/guides/probes.md), registered from a package outside quantlab/ (by
entry-point metadata on PYTHONPATH, as an installed package's) runs in a
sweep point with no file in quantlab/ touched, sees what the point measured
before it, takes its settings from probe.plugins.<name>, and is timed and
logged like quantlab's own."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
from mlflow import MlflowClient

from tests.conftest import REPO

# the guide's example, as written
PLUGIN = re.search(r"```python\n(.*?)\n```", (REPO / "docs" / "guides" / "probes.md").read_text(), re.S)[1]


def _site(tmp_path, value: str = "quantlab_nonzero:NonzeroProbe", name: str = "nonzero"):
    site = tmp_path / "site"
    (site / "quantlab_nonzero").mkdir(parents=True)
    (site / "quantlab_nonzero" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    info = site / "quantlab_nonzero-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: quantlab-nonzero\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[quantlab.probes]\n{name} = {value}\n")
    return site


def _run(site, args, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-m", "quantlab", "model=tiny", "probe=smoke",
                           f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"tracking.artifact_root={tmp_path}/art",
                           *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_an_out_of_tree_probe_runs_in_a_point(tmp_path):
    site = _site(tmp_path)
    out = _run(site, ["+probe.plugins.nonzero.tol=0.01"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("quantlab").experiment_id])
    m, tags, params = run.data.metrics, run.data.tags, run.data.params
    assert 0.0 < m["nonzero/frac"] < 1.0  # tol 0.01 on a random model: some weights below it
    assert m["nonzero/bytes_seen"] == m["size/weight_bytes"]  # it saw what was measured before it
    assert m["nonzero/logprob"] < 0.0 and tags["nonzero.engine"] == "TorchEngine"
    assert "time/nonzero_s" in m and "fid/kl_mean" in m  # timed as its own stage; quantlab's probes still ran
    assert params["probe.plugins.nonzero.tol"] == "0.01"  # part of the point's config (and hash)

    # not asked for: not run
    out = _run(site, ["force=true"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = client.search_runs([client.get_experiment_by_name("quantlab").experiment_id],
                              order_by=["attributes.start_time DESC"])
    assert "nonzero/frac" not in runs[0].data.metrics and "fid/kl_mean" in runs[0].data.metrics


def test_a_plugin_that_cannot_load_is_one_line_before_any_point(tmp_path):
    site = _site(tmp_path, value="quantlab_nonzero.missing:Probe")
    out = _run(site, [], tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith(
        "quantlab: quantlab.probes 'nonzero' (quantlab_nonzero.missing:Probe, from quantlab-nonzero) cannot be loaded: "
        "ModuleNotFoundError")
    assert not (tmp_path / "art").exists()  # no run was made


def test_a_plugin_taking_a_name_quantlab_has_is_refused(tmp_path):
    site = _site(tmp_path, name="latency")
    out = _run(site, [], tmp_path)
    assert out.returncode == 2
    assert "quantlab.probes 'latency' is registered by both" in out.stderr


def test_quantlabs_own_probes_are_entry_points_in_run_order():
    from quantlab.probes import runner

    names = [p.name for p in runner.registered()]
    assert names == ["fidelity", "perplexity", "accuracy", "cache", "kv_position", "latency", "load"]
    text = (REPO / "pyproject.toml").read_text()
    assert all(f'{n} = "quantlab.probes.standard:' in text for n in names)


@pytest.mark.parametrize("probe", ["fidelity", "perplexity", "accuracy", "cache", "kv_position", "latency", "load"])
def test_every_probe_is_switched_by_its_own_section(probe):
    """enabled() reads probe.<name>.enabled: the runner runs exactly what the config asks."""
    from quantlab.probes import runner
    from tests.conftest import compose_cfg

    (p,) = [p for p in runner.registered() if p.name == probe]
    for on in (True, False):
        cfg = compose_cfg([f"probe.{probe}.enabled={str(on).lower()}"])
        assert p.enabled(cfg) is on
