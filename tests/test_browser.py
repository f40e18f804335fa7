"""The MLflow UI, in a real headless browser, shows a sweep's runs and metrics.
Marked ``browser``; skipped where Debian's chromium is not installed."""
from __future__ import annotations

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
        url = f"{base}/#/experiments/{exp_id}/runs"
        dom = _chromium("--dump-dom", url).stdout
        runs = ",".join(f'"{r}"' for r in children)
        compare = f"{base}/#/compare-runs?runs=[{runs}]&experiments=[\"{exp_id}\"]"
        compare_dom = _chromium("--dump-dom", compare).stdout
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "mlflow_ui_experiment.png"
        _chromium(f"--screenshot={shot}", url)
        _chromium(f"--screenshot={ARTIFACTS / 'mlflow_ui_compare.png'}", compare)
    finally:
        server.terminate()
        server.wait(timeout=30)
    (ARTIFACTS / "experiment_dom.html").write_text(dom)
    (ARTIFACTS / "compare_dom.html").write_text(compare_dom)
    assert "sweep:smoke" in dom, "parent run missing from the experiment page"
    for name in ("fp32@cpu", "bf16@cpu", "fp16@cpu"):  # the compare view lists the points ...
        assert name in compare_dom, f"{name} missing from the compare page"
    # ... and a quantlab metric as a plot axis (MLflow renders the metric table lazily)
    assert any(k in compare_dom for k in ("size/weight_bytes", "fid/kl_mean", "lat/tpot_ms_p50"))
    assert shot.is_file() and shot.stat().st_size > 20_000
