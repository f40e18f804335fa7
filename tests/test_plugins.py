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
import tomllib

import pytest
from mlflow import MlflowClient

from tests.conftest import REPO

# the guide's example, as written
PLUGIN = re.search(r"```python\n(.*?)\n```", (REPO / "docs" / "guides" / "probes.md").read_text(), re.S)[1]


def _site(tmp_path, value: str = "quantlab_nonzero:NonzeroProbe", name: str = "nonzero",
          spec: str = "quantlab_nonzero:SPEC"):
    site = tmp_path / "site"
    (site / "quantlab_nonzero").mkdir(parents=True)
    (site / "quantlab_nonzero" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    info = site / "quantlab_nonzero-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: quantlab-nonzero\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[quantlab.probes]\n{name} = {value}\n"
                                           f"[quantlab.probe_specs]\n{name} = {spec}\n")
    return site


def _run(site, args, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(site)}
    flags = [a for a in args if a.startswith("-")]
    args = [a for a in args if not a.startswith("-")]
    return subprocess.run([sys.executable, "-m", "quantlab", *flags, "model=tiny", "probe=smoke",
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

    assert "nonzero/frac_stderr" in m

    # not asked for: not run
    out = _run(site, ["force=true"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = client.search_runs([client.get_experiment_by_name("quantlab").experiment_id],
                              order_by=["attributes.start_time DESC"])
    assert "nonzero/frac" not in runs[0].data.metrics and "fid/kl_mean" in runs[0].data.metrics


def test_a_plugin_probes_metric_is_a_report_column_and_decides_a_budget(tmp_path):
    """The guide's probe declares ``nonzero/frac`` (higher is better, a
    decision metric, a column) and a section: in a sweep that names it as
    the decision metric, the report's table shows it, its decision bounds
    each point's loss on it and its section follows, with no file in
    quantlab/ knowing its name."""
    site = _site(tmp_path)
    out = _run(site, ["-m", "scheme/weights=fp32,int8", "+probe.plugins.nonzero.tol=0.01",
                      "decision.metric=nonzero/frac", "decision.budgets=[0.5]",
                      "sweep_name=plugin"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("quantlab").experiment_id
    (parent,) = [r for r in client.search_runs([exp]) if r.data.tags.get("quantlab.role") == "sweep"]
    report = (tmp_path / "report.md")
    client.download_artifacts(parent.info.run_id, "report.md", str(tmp_path))
    text = report.read_text()
    header = next(line for line in text.splitlines() if line.startswith("| point"))
    assert "| nonzero " in header, header
    assert "loss on `nonzero/frac`" in text, text[:3000]
    # int8 qualified: its loss has a bound (from the nonzero/frac_stderr both runs logged; one without never does)
    assert "within 50% loss" in text and "2 qualified" in text, text[:4000]
    # its own section, after the decision, one row a point
    section = text[text.index("Nonzero weights:"):]
    assert text.index("Decision rule") < text.index("Nonzero weights:")
    assert {line.split(" | ")[0] for line in section.splitlines()[4:6]} == {"| fp32@cpu", "| int8@cpu"}, section[:600]


def test_a_plugin_probes_bad_setting_or_undeclared_metric_is_refused_in_one_line(tmp_path):
    site = _site(tmp_path)
    for args, words in ((["+probe.plugins.nonzero.tol=-1"], "probe.plugins.nonzero.tol=-1: must be >= 0"),
                        (["+probe.plugins.nonzero.tolerance=0.1"],
                         "probe.plugins.nonzero.tolerance=0.1: probe nonzero has no such setting; valid: tol"),
                        (["decision.metric=nonzero/logprob"],
                         "decision.metric=nonzero/logprob: no enabled probe logs it; valid here: auto")):
        out = _run(site, args, tmp_path)
        assert out.returncode == 2 and words in out.stderr, out.stderr[-2000:]
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


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
    assert names == ["fidelity", "perplexity", "accuracy", "cache", "kv_position", "passkey", "latency", "load"]
    text = (REPO / "pyproject.toml").read_text()
    assert all(f'{n} = "quantlab.probes.standard:' in text for n in names)


@pytest.mark.parametrize("probe", ["fidelity", "perplexity", "accuracy", "cache", "kv_position", "passkey", "latency",
                                   "load"])
def test_every_probe_is_switched_by_its_own_section(probe):
    """enabled() reads probe.<name>.enabled: the runner runs exactly what the config asks."""
    from quantlab.probes import runner
    from tests.conftest import compose_cfg

    (p,) = [p for p in runner.registered() if p.name == probe]
    for on in (True, False):
        cfg = compose_cfg([f"probe.{probe}.enabled={str(on).lower()}"])
        assert p.enabled(cfg) is on


def _guide(page: str) -> tuple[dict[str, str], str]:
    """A guide's files (its ```python blocks, each opening with ``# <path>``)
    and its entry points (its ```toml block) as entry_points.txt text."""
    text = (REPO / "docs" / "guides" / page).read_text()
    files = {}
    for code in re.findall(r"```python\n(.*?)\n```", text, re.S):
        first = code.partition("\n")[0]
        if first.startswith("# ") and first.endswith(".py"):
            files[first[2:]] = code + "\n"
    (toml,) = re.findall(r"```toml\n(.*?)\n```", text, re.S)
    groups = tomllib.loads(toml)["project"]["entry-points"]
    eps = "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in names.items()) for g, names in groups.items())
    return files, eps


def _package(site, dist: str, files: dict[str, str], eps: str) -> None:
    for path, code in files.items():
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_text(code)
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(eps)


def test_an_out_of_tree_scheme_and_target_run_a_sweep(tmp_path):
    """The guides' scheme (docs/guides/schemes.md) and target with its engine
    (docs/guides/targets.md), as written there, from packages outside
    quantlab/: composed by their plain names, checked at compose time,
    applied, run and logged like quantlab's own."""
    site = tmp_path / "site"
    _package(site, "quantlab-pertensor", *_guide("schemes.md"))
    _package(site, "quantlab-nocache", *_guide("targets.md"))
    assert (site / "quantlab_pertensor" / "handler.py").exists() and (site / "quantlab_nocache" / "target.py").exists()

    bad = _run(site, ["scheme/weights=pertensor", "scheme.weights.compute_dtype=int3"], tmp_path)
    assert bad.returncode == 2 and "pertensor compute_dtype 'int3'; valid: bfloat16, float16, float32" in bad.stderr

    out = _run(site, ["scheme/weights=pertensor", "target=cpu_nocache", "scheme/kv=none,int8", "target.threads=1",
                      "-m"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("quantlab").experiment_id])
    points = {r.data.params.get("scheme.kv.type"): r for r in runs
              if r.data.params.get("target.name") == "cpu_nocache"}
    run, skipped = points["NoKV"], points["Int8KV"]
    m, tags = run.data.metrics, run.data.tags
    assert tags["quantlab.outcome"] == "finished", tags.get("quantlab.reason")
    assert tags["emulated"] == "true" and tags["backend.weights"] == "dequantized per-tensor int8"
    assert tags["support.reason"] == "dequantized to the compute dtype: no per-tensor int8 kernel"
    assert run.data.params["scheme.weights.type"] == "PerTensorInt8"
    assert 0.0 < m["fid/kl_mean"] < 0.05  # quantized (not the reference), yet close to it
    assert m["lat/tpot_ms_p50"] > 0 and m["compile/warmup_s"] > 0  # timed through the plugin engine
    assert skipped.data.tags["quantlab.outcome"] == "skipped"
    assert skipped.data.tags["quantlab.reason"] == "cpu_nocache keeps no KV cache to quantize"


def test_a_section_is_module_function_at_a_place_and_one_that_cannot_load_is_one_line(tmp_path, monkeypatch):
    from quantlab import metric_names, report
    from quantlab.errors import UserError
    from quantlab.metric_names import ProbeSpec, Section, SectionView

    for bad in (dict(function="nocolon"), dict(function="m:f", place="middle")):
        with pytest.raises(ValueError, match="a 'module:function' and a place of body, end"):
            Section(**bad)
    monkeypatch.setattr(metric_names, "declared", lambda: (ProbeSpec("gone", sections=(Section("no_such_mod:f"),)),))
    view = SectionView([], tmp_path, "t", lambda r, name: None)
    with pytest.raises(UserError, match="report section 'no_such_mod:f' cannot be loaded: No module named"):
        report.probe_sections(view, "body")
    assert report.probe_sections(view, "end") == ([], [])
