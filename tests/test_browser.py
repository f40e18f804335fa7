"""The MLflow UI, in a real headless browser, shows a sweep's runs and metrics,
and its compare view plots loss against latency. Marked ``browser``; skipped
where Debian's chromium (or, for the interactive test, playwright) is missing."""
from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.browser
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = REPO / "tests" / "artifacts"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_ui(uri: str):
    """An ``mlflow ui`` on a free local port for ``uri``; yields its base URL."""
    port = _port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri,
                               "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(120):
            try:
                if urllib.request.urlopen(f"{base}/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(1)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=30)


def compare_scatter(base: str, experiment_id: str, run_ids: list[str], x: str, y: str, screenshot=None) -> dict:
    """Open the compare view of ``run_ids``, pick the *Scatter Plot* tab and
    the axes ``x``/``y`` as a user does (type into each axis box, Enter), and
    return what plotly drew: axis titles and the points' names and values."""
    from playwright.sync_api import sync_playwright

    url = f"{base}/#/compare-runs?runs={json.dumps(run_ids)}&experiments={json.dumps([experiment_id])}"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.goto(url)
        page.get_by_text("Scatter Plot").click()
        for label, key in (("X-axis:", x), ("Y-axis:", y)):
            page.locator(f"xpath=//*[normalize-space(text())='{label}']/following::*[@role='combobox'][1]").click()
            page.keyboard.type(key)
            page.wait_for_timeout(300)
            page.keyboard.press("Enter")
        page.wait_for_function(f"() => document.querySelector('text.xtitle')?.dataset.unformatted === {json.dumps(x)}",
                               timeout=20_000)
        drawn = page.evaluate("""() => {
            const plot = document.querySelector('.js-plotly-plot');
            const t = plot.data[0];
            return {x_title: document.querySelector('text.xtitle').dataset.unformatted,
                    y_title: document.querySelector('text.ytitle').dataset.unformatted,
                    x: t.x, y: t.y, names: t.text.map(s => s.split('</b>')[0].replace('<b>', ''))};
        }""")
        if screenshot:
            page.screenshot(path=str(screenshot))
        browser.close()
    return drawn


def _chromium(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--window-size=1600,1000", "--virtual-time-budget=20000"]
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")
def test_mlflow_ui_lists_runs_and_metric_columns(tmp_path):
    uri = f"sqlite:///{tmp_path}/m.db"
    sweep = run_cli(["+sweep=smoke", "model=tiny", f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a"])
    assert sweep.returncode == 0, sweep.stderr[-2000:]
    client = MlflowClient(uri)
    exp_id = client.get_experiment_by_name("quantlab").experiment_id
    children = [r.info.run_id for r in client.search_runs([exp_id]) if r.info.run_name.endswith("@cpu")]
    with mlflow_ui(uri) as base:
        url = f"{base}/#/experiments/{exp_id}/runs"
        dom = _chromium("--dump-dom", url).stdout
        runs = ",".join(f'"{r}"' for r in children)
        compare = f"{base}/#/compare-runs?runs=[{runs}]&experiments=[\"{exp_id}\"]"
        compare_dom = _chromium("--dump-dom", compare).stdout
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "mlflow_ui_experiment.png"
        _chromium(f"--screenshot={shot}", url)
        _chromium(f"--screenshot={ARTIFACTS / 'mlflow_ui_compare.png'}", compare)
    (ARTIFACTS / "experiment_dom.html").write_text(dom)
    (ARTIFACTS / "compare_dom.html").write_text(compare_dom)
    assert "sweep:smoke" in dom, "parent run missing from the experiment page"
    for name in ("fp32@cpu", "bf16@cpu", "fp16@cpu"):  # the compare view lists the points ...
        assert name in compare_dom, f"{name} missing from the compare page"
    # ... and a quantlab metric as a plot axis (MLflow renders the metric table lazily)
    assert any(k in compare_dom for k in ("size/weight_bytes", "fid/kl_mean", "lat/tpot_ms_p50"))
    assert shot.is_file() and shot.stat().st_size > 20_000


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")
def test_compare_view_scatter_plots_loss_against_latency(tmp_path):
    """A sweep's points in the compare view: the scatter plot takes the
    decision loss (a metric the report logs on each point) and the decode
    latency as axes and draws every point at its logged values."""
    uri = f"sqlite:///{tmp_path}/m.db"
    sweep = run_cli(["-m", "scheme/weights=fp32,bf16,int8,int4-g32", "sweep_name=ui", "model=tiny", "probe=smoke",
                     f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a"])
    assert sweep.returncode == 0, sweep.stderr[-2000:]
    client = MlflowClient(uri)
    exp_id = client.get_experiment_by_name("quantlab").experiment_id
    points = {r.info.run_name: r for r in client.search_runs([exp_id]) if r.info.run_name.endswith("@cpu")}
    ARTIFACTS.mkdir(exist_ok=True)
    with mlflow_ui(uri) as base:
        drawn = compare_scatter(base, exp_id, [r.info.run_id for r in points.values()], "decision/loss",
                                "lat/tpot_ms_p50", screenshot=ARTIFACTS / "mlflow_compare_scatter.png")
    assert (drawn["x_title"], drawn["y_title"]) == ("decision/loss", "lat/tpot_ms_p50")
    assert sorted(drawn["names"]) == sorted(points)
    for name, x, y in zip(drawn["names"], drawn["x"], drawn["y"]):
        metrics = points[name].data.metrics
        assert x == pytest.approx(metrics["decision/loss"]) and y == pytest.approx(metrics["lat/tpot_ms_p50"])
    assert max(drawn["x"]) > 0  # the quantized points sit away from the float ones
