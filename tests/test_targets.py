"""Targets: capability matrix vs what the sweep does, compile timing, Neuron protocol."""
from __future__ import annotations

import sys

import pytest
from mlflow.tracking import MlflowClient

from quantlab import capabilities, targets
from quantlab.config import NeuronTargetConfig
from quantlab.errors import UserError
from quantlab.schemes.float import FloatScheme
from quantlab.schemes.fp8 import FP8Scheme
from quantlab.schemes.int4 import Int4Scheme
from quantlab.schemes.int8 import Int8Scheme
from quantlab.schemes.kv import Int8KV, NoKV
from quantlab.targets.neuron import WorkerClient, export_kwargs, weight_support
from tests.conftest import SHARED_DATA, run_cli


@pytest.fixture(scope="module")
def matrix():
    return capabilities.matrix()


def test_matrix_covers_every_preset_and_target(matrix):
    from quantlab.cli import presets

    targets_ = set(presets("target"))
    assert {t for _, _, t in matrix} == targets_ == {"cpu", "cuda", "neuron"}
    assert {n for g, n, _ in matrix if g == "weights"} == set(presets("scheme/weights"))
    assert matrix[("weights", "fp8-e4m3", "cpu")][0] == "emulated"
    assert matrix[("weights", "int4-g64", "cpu")][0] == "real"
    text = capabilities.render(matrix)
    assert "| weights=int8 |" in text and "neuron" in text


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="gptq presets calibrate on ../shared/data")
def test_sweep_outcomes_match_matrix(tmp_path, matrix):
    """Every weight preset on the cpu and cuda targets, on a tiny model whose
    layers every group size divides: real/emulated run, unsupported is skipped."""
    from quantlab.cli import presets

    uri = f"sqlite:///{tmp_path}/m.db"
    schemes = ",".join(presets("scheme/weights"))
    proc = run_cli(["-m", "model=tiny", "model.tiny.hidden_size=128", "model.tiny.intermediate_size=256",
                    f"scheme/weights={schemes}", "target=cpu,cuda", "probe.latency.repeats=1",
                    "probe.latency.stages=false", "probe.cache.enabled=false",
                    "seed=0",
                    f"data_dir={SHARED_DATA}", f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a"],
                   timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    c = MlflowClient(uri)
    runs = [r for r in c.search_runs([c.get_experiment_by_name("quantlab").experiment_id], max_results=500)
            if r.data.tags.get("quantlab.role") != "sweep"]
    assert len(runs) == 2 * len(presets("scheme/weights"))
    for r in runs:
        status, _ = matrix[("weights", _preset_of(r, presets("scheme/weights")), r.data.tags["target"])]
        outcome = r.data.tags["quantlab.outcome"]
        if status == "unsupported":
            assert outcome == "skipped", r.info.run_name
        else:
            assert outcome == "finished", (r.info.run_name, r.data.tags.get("quantlab.reason"))
            assert r.data.tags["emulated"] == ("true" if status == "emulated" else "false")


def _preset_of(run, names):
    from tests.conftest import compose_cfg

    for n in names:
        if compose_cfg([f"scheme/weights={n}"]).scheme.weights.short_name() == run.data.tags["scheme.weights"]:
            return n
    raise AssertionError(run.info.run_name)


def test_cpu_compile_logs_compile_time_apart(tmp_path):
    from quantlab.pipeline import run_point
    from tests.conftest import compose_cfg

    uri = f"sqlite:///{tmp_path}/m.db"
    cfg = compose_cfg(["model=tiny", "target.compile=true", "scheme/weights=fp32", "probe.latency.repeats=1",
                       "probe.latency.stages=false", f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a"])
    res = run_point(cfg)
    assert res.outcome == "finished", res.reason
    m = MlflowClient(uri).get_run(res.run_id).data.metrics
    assert m["compile/enabled"] == 1.0 and m["compile/warmup_s"] > 0
    assert m["fid/kl_mean"] < 1e-6  # same function; inductor only reorders float sums


# --- Neuron: everything up to the SDK boundary ---

def test_neuron_export_kwargs_translation():
    cfg = NeuronTargetConfig(batch_size=4, sequence_length=1024, num_cores=8)
    legacy = export_kwargs(cfg, FloatScheme("bfloat16"), "legacy")
    assert legacy == {"export": True, "batch_size": 4, "sequence_length": 1024, "num_cores": 8,
                      "auto_cast_type": "bf16"}
    current = export_kwargs(cfg, Int8Scheme(), "current")
    assert current["tensor_parallel_size"] == 8 and current["torch_dtype"] == "bfloat16"
    assert current["quantization"]["quantization_dtype"] == "int8"
    assert export_kwargs(cfg, FP8Scheme(), "current")["quantization"]["quantization_dtype"] == "f8e4m3"
    with pytest.raises(UserError, match="dtype float32 not compilable"):
        export_kwargs(cfg, FloatScheme("float32"), "legacy")


@pytest.mark.parametrize("scheme,status", [
    (FloatScheme("bfloat16"), "real"), (FloatScheme("float16"), "real"), (FloatScheme("float32"), "unsupported"),
    (Int8Scheme(), "real"), (FP8Scheme(), "real"), (FP8Scheme(activations="dynamic"), "unsupported"),
    (Int4Scheme(), "unsupported"),
])
def test_neuron_capabilities(scheme, status):
    assert weight_support(scheme).status == status


def test_worker_protocol_with_a_worker_lacking_the_sdk():
    """The real worker module under this (non-Neuron) Python: hello answers and
    says what is missing; an export fails as one line; unknown ops are named."""
    client = WorkerClient(sys.executable, timeout_s=60)
    try:
        hello = client.call("hello")
        assert hello["ok"] and hello["neuron_cores"] == 0 and "optimum-neuron not importable" in hello["missing"]
        with pytest.raises(UserError, match=r"neuron worker 'export' failed: ModuleNotFoundError"):
            client.call("export", model="/x", out="/y", kwargs={})
        with pytest.raises(UserError, match="unknown op 'fly'; valid: hello, export, generate"):
            client.call("fly")
    finally:
        client.close()
    assert client.proc.returncode == 0


def test_missing_neuron_environment_is_one_line():
    target = targets.get(NeuronTargetConfig(python="/nonexistent/neuron/bin/python"))
    verdict = target.supports(FloatScheme("bfloat16"), NoKV())
    assert verdict.status == "unsupported"
    assert verdict.reason.startswith("neuron: interpreter '/nonexistent/neuron/bin/python' not found")
    assert "\n" not in verdict.reason
    target = targets.get(NeuronTargetConfig(python=sys.executable))
    assert "optimum-neuron not importable" in target.supports(FloatScheme("bfloat16"), Int8KV()).reason


def test_assumed_gpu_column():
    m = capabilities.assumed_cuda((9, 0))
    col = "cuda sm_90 (assumed)"
    assert m[("weights", "fp8-w8a8", col)][0] == "real"
    assert m[("weights", "fp8-e4m3", col)][0] == "emulated"
    assert m[("weights", "int4-g64-sym", col)][0] == "unsupported"
    assert capabilities.assumed_cuda((8, 0))[("weights", "fp8-w8a8", "cuda sm_80 (assumed)")][0] == "emulated"
