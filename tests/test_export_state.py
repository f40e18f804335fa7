"""A calibrated point keeps its quantized model when it is measured; its export
writes those tensors (no calibration), checks the file against the run's
sha256, and falls back to quantizing again when the cache no longer holds it."""
from __future__ import annotations

import dataclasses

import pytest

from quantlab import point
from quantlab.digest import sha256_file
from quantlab.export import state as quantized_state
from quantlab.export_run import export_run
from quantlab.schemes import registry
from quantlab.schemes.configs import GPTQScheme
from tests.conftest import run_cli, tracker

TINY = ["model=tiny", "model.tiny.hidden_size=128", "model.tiny.intermediate_size=256"]


@pytest.fixture(scope="module")
def gptq_point(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("state")
    uri = f"sqlite:///{tmp}/m.db"
    proc = run_cli([*TINY, "scheme/weights=gptq-g32-sym", "scheme.weights.calibration=builtin",
                    "scheme.weights.n_samples=4", "scheme.weights.seq_len=64", "probe=smoke",
                    "probe.latency.enabled=false", f"tracking.uri={uri}", f"tracking.artifact_root={tmp}/a",
                    f"cache_dir={tmp}/c"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    t = tracker(uri)
    run = next(r for r in t.client.search_runs([t.experiment_id]) if r.info.run_name == "gptq-g32-sym@cpu")
    return tmp, t, run


def _no_calibration(monkeypatch):
    def calibrate(*a, **k):
        raise AssertionError("the export calibrated again")

    h = registry.weights_handler(GPTQScheme())
    monkeypatch.setitem(registry._WEIGHTS, GPTQScheme, dataclasses.replace(h, apply=calibrate))


def test_a_gptq_point_exports_its_measured_tensors_without_calibrating(gptq_point, monkeypatch):
    tmp, t, run = gptq_point
    digest = run.data.tags[quantized_state.TAG]
    kept = tmp / "c" / "states" / f"{digest}.pt"
    assert sha256_file(kept) == digest and run.data.tags[point.OUTCOME_TAG] == "finished"
    _no_calibration(monkeypatch)
    manifest = export_run(t.run(run.info.run_id), tmp / "from-state")
    assert manifest["quantized_state_sha256"] == digest and manifest["round_trip"]["passed"]


def test_without_its_kept_state_the_export_quantizes_again_to_the_same_file(gptq_point):
    """A kept file that no longer hashes to the run's sha256 is not read: the
    export calibrates again and writes the same tensors (GPTQ on the same
    calibration is deterministic), so the kept state was the measured point's."""
    tmp, t, run = gptq_point
    source = t.run(run.info.run_id)
    first = export_run(source, tmp / "export-1", force=True)
    kept = tmp / "c" / "states" / f"{run.data.tags[quantized_state.TAG]}.pt"
    original = kept.read_bytes()
    kept.write_bytes(original + b"\0")
    try:
        again = export_run(source, tmp / "export-2", force=True)
    finally:
        kept.write_bytes(original)
    assert first["quantized_state_sha256"] is not None and again["quantized_state_sha256"] is None
    assert again["files_sha256"]["model.safetensors"] == first["files_sha256"]["model.safetensors"]


def test_a_point_that_calibrates_nothing_keeps_no_state(tmp_path):
    uri = f"sqlite:///{tmp_path}/m.db"
    proc = run_cli([*TINY, "scheme/weights=int4-g32", "probe=smoke", "probe.latency.enabled=false",
                    f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a", f"cache_dir={tmp_path}/c"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    t = tracker(uri)
    run = next(r for r in t.client.search_runs([t.experiment_id]) if r.info.run_name == "int4-g32@cpu")
    assert quantized_state.TAG not in run.data.tags and not (tmp_path / "c" / "states").exists()
