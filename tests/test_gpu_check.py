"""benchmarks/gpu_check.sh cannot rot: its CPU dry run wires the same sweeps,
store and report; its prerequisites fail in one line; its wheel list resolves
for the device's Python and fits the carry limit."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def _run(env: dict, timeout: int = 900) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_CHECK_TARGET")}
    return subprocess.run(["bash", str(SCRIPT)], env={**base, "PYTHON": sys.executable, **env}, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_dry_run_on_cpu_writes_report_and_store(tmp_path):
    proc = _run({"OUT": str(tmp_path), "GPU_CHECK_TARGET": "cpu", "GPU_CHECK_LAYERS": "2", "GPU_CHECK_WHEELS": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    report = (tmp_path / "gpu_report.md").read_text()
    for section in ("## Capability matrix", "## launch_overhead", "## fp8_vs_int4", "## kv", "## formats",
                    "| weights=int8 |", "| weights=nvfp4 |"):
        assert section in report
    assert "sweep vllm: skipped (needs target cuda and QUANTLAB_VLLM_PYTHON" in report and "## vllm" not in report
    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = [r for r in c.search_runs([c.get_experiment_by_name("quantlab").experiment_id])
            if r.data.tags.get("quantlab.role") != "sweep"]
    by_sweep = {}
    for r in runs:
        by_sweep.setdefault(r.data.tags["quantlab.sweep"], []).append(r.data.tags["quantlab.outcome"])
    # fp8_vs_int4: the two weight schemes asked for plus the sweep's off-grid int4-g64 + INT8 KV point;
    # formats: its bf16 point is not fp8_vs_int4's (its probe does not time emulated points: another config)
    assert {k: sorted(v) for k, v in by_sweep.items()} == {
        "launch_overhead": ["finished"] * 2, "fp8_vs_int4": ["finished"] * 3, "kv": ["finished"] * 2,
        "formats": ["finished"] * 2}
    assert set(os.listdir(tmp_path)) <= {"mlflow.db", "gpu_report.md", "notes.txt", "launch_overhead.log",
                                         "fp8_vs_int4.log", "kv.log", "formats.log"}  # what the device tool brings back


def test_a_subset_reruns_one_sweep_alone(tmp_path):
    """A rerun within the lease (GPU_CHECK_SWEEPS) runs and reports only what it names."""
    proc = _run({"OUT": str(tmp_path), "GPU_CHECK_TARGET": "cpu", "GPU_CHECK_LAYERS": "2", "GPU_CHECK_WHEELS": "0",
                 "GPU_CHECK_SWEEPS": "kv"})
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    report = (tmp_path / "gpu_report.md").read_text()
    assert "## kv" in report and "## launch_overhead" not in report and "## fp8_vs_int4" not in report
    assert sorted(p.name for p in tmp_path.glob("*.log")) == ["kv.log"]


def test_prerequisites_fail_in_one_line(tmp_path):
    no_out = _run({})
    assert no_out.returncode != 0 and "OUT is not set" in no_out.stderr
    no_gpu = _run({"OUT": str(tmp_path), "GPU_CHECK_TARGET": "cuda"})
    import torch

    if not torch.cuda.is_available():
        assert no_gpu.returncode == 2 and no_gpu.stderr.strip().endswith("sees no CUDA device")
        assert len(no_gpu.stderr.strip().splitlines()) == 1


@pytest.mark.network
def test_wheel_list_resolves_for_the_device_and_fits_the_carry(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_wheels.py"), "--dest", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from benchmarks.gpu_wheels import BUDGET, requirements

    wheels = list(tmp_path.glob("*.whl"))
    assert len(wheels) == len(requirements())
    assert sum(w.stat().st_size for w in wheels) <= BUDGET
    assert all(("cp312" in w.name or "py3" in w.name or "abi3" in w.name) for w in wheels)
