"""The Python API (quantlab.api, docs/api.md) and the one tracking setting
every command reads (MLFLOW_TRACKING_URI, else the local SQLite store)."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, compose_cfg


def _page_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)\n```", (REPO / "docs" / "api.md").read_text(), flags=re.S)


def test_the_api_page_runs_as_written(tmp_path):
    """Every block of docs/api.md, in order, in an empty directory: run a
    sweep, read it, decide, export."""
    blocks = _page_blocks()
    assert len(blocks) == 4
    script = tmp_path / "page.py"
    script.write_text("\n\n".join(blocks) + "\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/store.db"}
    env.pop("PYTHONPATH", None)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "exports" / "smallest" / "config.json").is_file()
    assert (tmp_path / "store.db").is_file() and not (tmp_path / "mlruns" / "mlflow.db").exists()


@pytest.fixture(scope="module")
def sweep_store(tmp_path_factory):
    """A finished smoke sweep on the tiny model, in its own store."""
    path = tmp_path_factory.mktemp("api")
    uri = f"sqlite:///{path}/mlflow.db"
    import quantlab

    quantlab.run("+sweep=smoke", "model=tiny", f"tracking.artifact_root={path}/art", tracking_uri=uri, cwd=path)
    return uri


def test_results_agree_with_the_report_and_its_pick(sweep_store):
    """The frame's loss and bound are the ones the sweep's report logged on
    each child (decision/loss, decision/loss_upper), and fastest_within on
    the whole frame picks what the report recommended."""
    import quantlab
    from mlflow import MlflowClient

    from quantlab import point

    df = quantlab.results("latest", tracking_uri=sweep_store)
    assert list(df["point"]) == ["fp32@cpu", "bf16@cpu", "fp16@cpu"]
    assert df["baseline"].tolist() == [True, False, False]
    assert set(df["outcome"]) == {"finished"}
    for _, row in df.iterrows():
        assert row["loss"] == pytest.approx(row["decision/loss"], abs=1e-12)
        assert row["loss_upper"] == pytest.approx(row["decision/loss_upper"], abs=1e-12)
        assert row["bound"].upper == pytest.approx(row["loss_upper"])
        assert row["tag.quantlab.sweep"] == "smoke"
    parent = MlflowClient(sweep_store).get_run(df.attrs["parent_run_id"]).data.tags
    for budget in (0.01, 0.05):
        pick = quantlab.fastest_within(df, budget)
        assert pick["point"] == parent[point.recommended_tags(budget)[0]]
        assert pick.attrs["tracking_uri"] == sweep_store


def test_the_sweep_retimed_its_qualified_points_side_by_side(sweep_store):
    """At the end of the sweep the points the loss half qualified were
    re-timed in interleaved rounds (retime.json on the parent, the rounds
    the declaration said); the report states the latency claim and the
    decision's error as one number."""
    import quantlab
    from mlflow import MlflowClient

    from quantlab import report, retime, tracking
    from quantlab.tracking_config import TrackingConfig

    df = quantlab.results("latest", tracking_uri=sweep_store)
    parent = df.attrs["parent_run_id"]
    tracker = tracking.connect(TrackingConfig(uri=sweep_store, artifact_root=None))
    timed = retime.Retimed.from_json(tracker.download(parent, retime.ARTIFACT).read_text())
    said = report.verdict.declared(MlflowClient(sweep_store).get_run(parent).data.tags)
    assert said.retime_rounds == 12 and len(timed.rounds) == 12 and said.tie_break == "size"
    assert 2 <= len(timed.names) <= said.retime_points and set(timed.names) <= set(df["point"])
    assert all(ms > 0 for row in timed.rounds for ms in row)
    text = (tracker.download(parent, "report.md")).read_text()
    assert "re-timed side by side, 12 interleaved rounds" in text
    assert "The decision's error: 0.025 (loss) + 0.025 (latency) = 0.05" in text


def test_fastest_within_decides_only_among_the_rows_given(sweep_store):
    import quantlab

    df = quantlab.results(tracking_uri=sweep_store)
    rest = df[~df["baseline"]]
    pick = quantlab.fastest_within(rest, 0.05, cost="size/weight_mb")
    assert pick["point"] in ("bf16@cpu", "fp16@cpu") and pick["loss_upper"] <= 0.05
    # a bound that cannot reach the budget: nothing is shown within it
    assert quantlab.fastest_within(rest, 1e-12) is None
    estimate_only = df.assign(bound=None, loss_upper=math.nan)
    assert quantlab.fastest_within(estimate_only, 0.05) is None
    from quantlab.errors import UserError

    with pytest.raises(UserError, match="no column 'lat/nope'"):
        quantlab.fastest_within(df, 0.05, cost="lat/nope")


def test_results_of_a_store_without_the_sweep_says_which_there_are(sweep_store, tmp_path):
    import quantlab
    from quantlab.errors import UserError

    with pytest.raises(UserError, match=r"no sweep 'nosuch'.*smoke"):
        quantlab.results("nosuch", tracking_uri=sweep_store)
    with pytest.raises(UserError, match="exited 2: quantlab: unknown scheme/weights 'int3'"):
        quantlab.run("scheme/weights=int3", tracking_uri=f"sqlite:///{tmp_path}/x.db", cwd=tmp_path)


def test_every_command_defaults_to_mlflow_tracking_uri(monkeypatch, tmp_path):
    """One tracking setting: the Hydra preset, the report and the export read
    MLFLOW_TRACKING_URI; unset, all three default to the same local file."""
    from quantlab import report_cli, tracking_config
    from quantlab import export_cli

    def defaults():
        import argparse

        seen = {}
        for name, mod in (("report", report_cli), ("export", export_cli)):
            def grab(self, argv=None, namespace=None, _name=name):
                seen[_name] = self.get_default("tracking_uri")
                raise SystemExit(0)
            monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
            with pytest.raises(SystemExit):
                mod.main([])
        return seen["report"], seen["export"], compose_cfg().tracking.uri

    assert defaults() == (tracking_config.DEFAULT_TRACKING_URI,) * 3
    assert "${oc.env:MLFLOW_TRACKING_URI," + tracking_config.DEFAULT_TRACKING_URI + "}" in \
        (REPO / "conf" / "tracking" / "local.yaml").read_text()
    uri = f"sqlite:///{tmp_path}/env.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert defaults() == (uri,) * 3
    assert compose_cfg([f"tracking.uri=sqlite:///{tmp_path}/flag.db"]).tracking.uri.endswith("flag.db")  # flags win
