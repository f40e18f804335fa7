"""Targets: capability matrix vs what the sweep does, compile timing, Neuron protocol."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from quantlab import capabilities, point, targets
from quantlab.targets.neuron import NeuronTargetConfig
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
    assert {t for _, _, t in matrix} == targets_ == {"cpu", "cuda", "cuda-compile", "cuda-graphs", "neuron", "llamacpp",
                                                                 "vllm"}
    assert {n for g, n, _ in matrix if g == "weights"} == set(presets("scheme/weights"))
    assert matrix[("weights", "fp8-e4m3", "cpu")][0] == "emulated"
    assert matrix[("weights", "int4-g64", "cpu")][0] == "real"
    text = capabilities.render(matrix)
    assert "| weights=int8 |" in text and "neuron" in text


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="gptq presets calibrate on ../shared/data")
def test_sweep_outcomes_match_matrix(tmp_path, matrix):
    """Every weight preset on the cpu target, and on cuda where a CUDA device
    is visible (without one the matrix says every cuda pair is the same
    "no CUDA device" skip, and a sweep's skipped point is checked elsewhere:
    47 of them cost 2.5 minutes of sweep overhead), on a tiny model whose
    layers every group size divides: real/emulated run, unsupported is
    skipped. Nothing timed (the outcomes are the question): no latency
    probe, no re-timing."""
    import torch

    from quantlab.cli import presets

    uri = f"sqlite:///{tmp_path}/m.db"
    targets = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    if targets == ["cpu"]:
        assert {s for (kind, _, t), (s, _) in matrix.items() if kind == "weights" and t == "cuda"} == {"unsupported"}
    schemes = ",".join(presets("scheme/weights"))
    proc = run_cli(["-m", "model=tiny", "model.tiny.hidden_size=128", "model.tiny.intermediate_size=256",
                    f"scheme/weights={schemes}", f"target={','.join(targets)}", "probe.latency.enabled=false",
                    "decision.retime_rounds=0", "probe.cache.enabled=false", "probe.fidelity.tokens=32", "seed=0",
                    f"data_dir={SHARED_DATA}", f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a"],
                   timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    c = MlflowClient(uri)
    runs = [r for r in c.search_runs([c.get_experiment_by_name("quantlab").experiment_id], max_results=500)
            if r.data.tags.get("quantlab.role") != "sweep"]
    assert len(runs) == len(targets) * len(presets("scheme/weights"))
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
                       f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a"])
    res = run_point(cfg)
    assert res.outcome == "finished", res.reason
    run = MlflowClient(uri).get_run(res.run_id)
    m = run.data.metrics
    assert run.info.run_name == "fp32@cpu+compile" and run.data.tags["target.variant"] == "cpu+compile"
    assert m["compile/enabled"] == 1.0 and m["compile/warmup_s"] > 0
    assert "compiled" in run.data.tags["probe.stages.skipped"]  # hooks would split the graph
    assert 0 < m["bw/util"]  # the roofline still runs in process
    assert m["fid/kl_mean"] < 1e-6  # same function; inductor only reorders float sums


def test_static_cache_decodes_like_the_dynamic_cache():
    """Greedy decoding into the target's StaticCache gives the dynamic cache's logits."""
    from transformers import DynamicCache, StaticCache

    from quantlab import models
    from quantlab.config import ModelConfig
    from quantlab.targets.cpu import CPUTargetConfig

    model, _ = models.load(ModelConfig(name="tiny", source="tiny"), "/tmp")
    target = targets.get(CPUTargetConfig(static_cache=64))
    factory = target.decode_cache(DynamicCache)
    assert isinstance(factory(config=model.config), StaticCache)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))

    def decode(make):
        cache, out, nxt = make(config=model.config), [], ids
        with torch.inference_mode():
            for _ in range(6):
                logits = model(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1]
                out.append(logits)
                nxt = logits.argmax(-1, keepdim=True)
        return torch.stack(out)

    torch.testing.assert_close(decode(factory), decode(DynamicCache), atol=1e-5, rtol=1e-5)


def test_compile_with_static_cache_runs_and_refuses_quantized_kv(tmp_path):
    from quantlab.pipeline import run_point
    from tests.conftest import compose_cfg

    uri = f"sqlite:///{tmp_path}/m.db"
    common = ["model=tiny", "target.compile=true", "target.static_cache=128", "probe.latency.repeats=1",
              f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a"]
    ok = run_point(compose_cfg([*common, "scheme/weights=fp32"]))
    assert ok.outcome == "finished" and ok.name == "fp32@cpu+compile+static", ok.reason
    m = MlflowClient(uri).get_run(ok.run_id).data.metrics
    assert m["fid/kl_mean"] < 1e-6 and m["lat/tpot_ms_count"] > 0
    kv = run_point(compose_cfg([*common, "scheme/weights=fp32", "scheme/kv=int8"]))
    assert kv.outcome == "skipped" and "static_cache" in kv.reason


def test_nf4_under_compile_is_skipped_with_the_reason(tmp_path):
    """bitsandbytes 4-bit + torch.compile fails on CPU (found by the fp8_vs_int4
    compile sweep): asked before loading, the point is a skip, not a crash."""
    from quantlab.pipeline import run_point
    from tests.conftest import compose_cfg

    res = run_point(compose_cfg(["model=tiny", "target.compile=true", "scheme/weights=nf4",
                                 f"tracking.uri=sqlite:///{tmp_path}/m.db", f"tracking.artifact_root={tmp_path}/a"]))
    assert res.outcome == "skipped" and "bitsandbytes 4-bit under torch.compile" in res.reason
    eager = targets.get(compose_cfg(["scheme/weights=nf4"]).target)
    assert eager.supports(compose_cfg(["scheme/weights=nf4"]).scheme.weights, NoKV()).status == "real"


@pytest.mark.parametrize("cfg,match", [
    (dict(compile=True, compile_mode="turbo"), "target.compile_mode='turbo': valid: default, "
                                                "max-autotune-no-cudagraphs"),
    (dict(compile=True, compile_mode="reduce-overhead"), "target.compile_mode='reduce-overhead': valid: "),
    (dict(static_cache=-1), r"target.static_cache=-1: must be >= 0 \(0: dynamic cache\)"),
])
def test_bad_cpu_target_options_are_one_line(cfg, match):
    from quantlab.targets.cpu import CPUTargetConfig

    with pytest.raises(UserError, match=match):
        targets.get(CPUTargetConfig(**cfg))


def test_cuda_graph_options():
    """CUDA graphs need fixed shapes: reduce-overhead without a static cache is refused
    (checked without a GPU); the presets name their runs apart."""
    from quantlab.targets.cuda import CUDATargetConfig
    from tests.conftest import compose_cfg

    with pytest.raises(UserError, match="captures CUDA graphs.*set target.static_cache"):
        targets.get(CUDATargetConfig(compile=True, compile_mode="reduce-overhead"))
    graphs = compose_cfg(["target=cuda-graphs"]).target
    assert (graphs.compile, graphs.compile_mode, graphs.static_cache) == (True, "reduce-overhead", 1024)
    assert targets.get(graphs).decode_cache(None).keywords == {"max_cache_len": 1024}
    assert [point.target_label(compose_cfg([f"target={t}"]).target) for t in ("cuda", "cuda-compile", "cuda-graphs")] \
        == ["cuda", "cuda+compile", "cuda+graphs+static"]


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
        with pytest.raises(UserError, match="unknown op 'fly'; valid: hello, export, load, logits, generate"):
            client.call("fly")
    finally:
        client.close()
    assert client.proc.returncode == 0


def test_silent_worker_times_out_in_one_line(tmp_path):
    """A worker that never answers (hung compile, wedged runtime) costs
    ``timeout_s``, then one line; the process is killed."""
    exe = tmp_path / "hung-python"
    exe.write_text("#!/bin/sh\nexec sleep 60\n")
    exe.chmod(0o755)
    client = WorkerClient(str(exe), timeout_s=1)
    with pytest.raises(UserError, match=r"no reply to 'hello' within 1 s \(target.timeout_s\)"):
        client.call("hello")
    assert client.proc.wait(timeout=5) != 0


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


FAKE_SDK = Path(__file__).resolve().parent / "fake_neuron"


@pytest.fixture
def fake_neuron_python(tmp_path):
    """An interpreter that sees the stand-in SDK (tests/fake_neuron) and its neuron-ls."""
    exe = tmp_path / "neuron-python"
    exe.write_text(f"#!/bin/sh\nexport PYTHONPATH={FAKE_SDK}:$PYTHONPATH PATH={FAKE_SDK}/bin:$PATH\n"
                   f"exec {sys.executable} \"$@\"\n")
    exe.chmod(0o755)
    return str(exe)


def test_neuron_sweep_through_the_worker(tmp_path, fake_neuron_python):
    """target=neuron end to end with the stand-in SDK behind the real worker:
    export with the translated arguments, compile cache, logits-based probes and
    worker-timed latency; schemes the SDK lacks are skipped with the reason."""
    uri = f"sqlite:///{tmp_path}/m.db"
    common = ["model=tiny", "target=neuron", f"target.python={fake_neuron_python}",
              f"target.compile_cache={tmp_path}/neuron-cache", "target.sequence_length=640",  # smoke: 512 tokens
              "probe=smoke", "probe.latency.repeats=2", f"tracking.uri={uri}",
              f"tracking.artifact_root={tmp_path}/a", f"cache_dir={tmp_path}/cache",
              "eval_seed=0"]  # the point run alone below draws its windows as the sweep's did
    proc = run_cli(["-m", "scheme/weights=bf16,int8,int4-g64", *common], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    c = MlflowClient(uri)
    runs = {r.info.run_name: r for r in c.search_runs([c.get_experiment_by_name("quantlab").experiment_id])
            if r.data.tags.get("quantlab.role") != "sweep"}
    assert set(runs) == {"bf16@neuron", "int8@neuron", "int4-g64@neuron"}
    skipped = runs["int4-g64@neuron"].data.tags
    assert skipped["quantlab.outcome"] == "skipped" and "no Neuron equivalent" in skipped["quantlab.reason"]
    bf16, int8 = runs["bf16@neuron"].data, runs["int8@neuron"].data
    for r in (bf16, int8):
        assert r.tags["quantlab.outcome"] == "finished", r.tags.get("quantlab.reason")
        assert r.tags["emulated"] == "false" and r.tags["backend.weights"].startswith("optimum-neuron 0.3.0")
        assert r.metrics["compile/neuron_cached"] == 0.0 and r.metrics["compile/neuron_export_s"] > 0
        assert r.metrics["compile/warmup_s"] >= r.metrics["compile/neuron_export_s"]
        assert r.metrics["size/neuron_artifact_mb"] > 0
        assert r.metrics["lat/tpot_ms_count"] == 2 * 15 and r.metrics["lat/ttft_ms_p50"] > 0
        assert "probe.cache.skipped" in r.tags and "probe.stages.skipped" in r.tags
        assert not any(k.startswith("bw/") for k in r.metrics)  # host bandwidth is not the device's
        assert "neuron" in r.tags["energy.reason"]
    assert "int8" in int8.tags["backend.weights"]
    # the reference is the fp32 model in this process: bf16 through the worker is
    # close, and the SDK's int8 rounding (the export argument arrived) adds error
    assert bf16.metrics["fid/kl_mean"] < 1e-3 and bf16.metrics["fid/top1_agree"] > 0.95
    assert int8.metrics["fid/kl_mean"] > bf16.metrics["fid/kl_mean"]

    # same point again (force): the compile cache is hit, nothing is recompiled
    proc = run_cli(["scheme/weights=bf16", "force=true", *common], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = [r for r in c.search_runs([c.get_experiment_by_name("quantlab").experiment_id],
                                      order_by=["attributes.start_time DESC"], max_results=1)][0]
    assert again.data.metrics["compile/neuron_cached"] == 1.0
    assert again.data.metrics["compile/neuron_export_s"] == 0.0
    assert again.data.metrics["fid/kl_mean"] == pytest.approx(bf16.metrics["fid/kl_mean"], rel=1e-6)


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="local lm-eval tasks read ../shared/data")
def test_neuron_lm_eval_and_perplexity_read_worker_logits(tmp_path, fake_neuron_python):
    """lm-eval and token perplexity on the worker's logits equal those of the same
    weights run in this process (the stand-in SDK computes in bf16 like the host)."""
    from quantlab.pipeline import run_point
    from tests.conftest import compose_cfg

    uri = f"sqlite:///{tmp_path}/m.db"
    probes = ["probe=smoke", "probe.latency.enabled=false", "probe.fidelity.enabled=false",
              "probe.cache.enabled=false", "probe.accuracy.enabled=true", "probe.accuracy.tasks=[arc_easy_local]",
              "probe.accuracy.limit=4", "probe.perplexity.enabled=true", "probe.perplexity.window=64",
              "probe.perplexity.max_windows=1", f"data_dir={SHARED_DATA}", f"tracking.uri={uri}",
              f"tracking.artifact_root={tmp_path}/a", f"cache_dir={tmp_path}/cache",
              "model=tiny", "scheme/weights=bf16"]
    neuron = run_point(compose_cfg([*probes, "target=neuron", f"target.python={fake_neuron_python}",
                                    f"target.compile_cache={tmp_path}/nc", "target.sequence_length=512"]))
    host = run_point(compose_cfg([*probes, "target=cpu"]))
    c = MlflowClient(uri)
    m_n, m_h = c.get_run(neuron.run_id).data.metrics, c.get_run(host.run_id).data.metrics
    assert neuron.outcome == host.outcome == "finished", (neuron.reason, host.reason)
    assert m_n["acc/arc_easy_local"] == m_h["acc/arc_easy_local"]
    ppl = "ppl_token_wikitext2_w64_rand1"
    assert m_n[ppl] == pytest.approx(m_h[ppl], rel=2e-2)


def test_static_cache_is_allocated_once_outside_the_graph_and_reset_per_request():
    """CUDA graphs replay over static addresses: the engine's StaticCache must be
    allocated eagerly (transformers marks its tensors static only outside a
    compiled graph; the H200 check saw inductor skip graphs for 'mutated inputs'
    when the compiled prefill allocated it), kept per batch size, and reset so a
    second request decodes what the first did and what a dynamic cache decodes."""
    from quantlab import models
    from quantlab.config import ModelConfig
    from quantlab.targets.cpu import CPUTargetConfig
    from quantlab.engines.pytorch import TorchEngine
    from transformers import DynamicCache

    from quantlab.schemes.registry import Applied

    model, _ = models.load(ModelConfig(name="tiny", source="tiny"), "/tmp")
    eng = targets.get(CPUTargetConfig(static_cache=64)).engine(model, Applied("none", False, DynamicCache))
    ref = TorchEngine(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    def tokens(engine):
        return torch.cat([t.reshape(2, -1).cpu() for t in engine.decode(ids, 6).chosen], dim=1)

    first = tokens(eng)
    cache = eng.request_cache(2)
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values, layer.cumulative_length)]
    assert all(getattr(t, "_dynamo_static_input_type", None) for t in tensors)
    ptrs = [t.data_ptr() for t in tensors]
    assert torch.equal(tokens(eng), first) and torch.equal(first, tokens(ref))
    assert [t.data_ptr() for t in tensors] == ptrs and eng.request_cache(2) is cache
    assert eng.request_cache(1) is not cache  # one cache per batch size


def test_capabilities_refuses_a_bad_capability_in_one_line(capsys):
    from quantlab import capabilities

    assert capabilities._capability("9.0") == (9, 0)
    with pytest.raises(SystemExit) as e:
        capabilities.main(["--assume-cuda", "abc"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].endswith("'abc': a CUDA compute capability MAJOR.MINOR, e.g. 9.0")


class _Parent:
    """What ``_log_capabilities`` needs of a parent run: ``log_text``."""

    def __init__(self):
        self.logged: dict[str, str] = {}

    def log_text(self, text: str, name: str) -> None:
        self.logged[name] = text


def test_capability_matrix_is_made_once_per_environment(tmp_path, monkeypatch):
    """A sweep logs the matrix from the cache when nothing it reads changed; a
    runtime picked by the environment (QUANTLAB_VLLM_PYTHON) is another key,
    the parent run's id and the sweep's evaluation seed are not."""
    from quantlab import sweep

    monkeypatch.setenv("QUANTLAB_CACHE", str(tmp_path))
    first = _Parent()
    sweep._log_capabilities(first)
    assert "| weights=int8 |" in first.logged["capabilities.md"]
    assert len(list((tmp_path / "capabilities").glob("*.md"))) == 1

    def no_subprocess(*a, **k):
        raise AssertionError("the matrix was made again")

    monkeypatch.setattr(sweep.subprocess, "run", no_subprocess)
    monkeypatch.setenv("QUANTLAB_PARENT_RUN_ID", "another")
    monkeypatch.setenv("QUANTLAB_EVAL_SEED", "12345")  # drawn anew by every sweep: it made every sweep a miss
    again = _Parent()
    sweep._log_capabilities(again)
    assert again.logged == first.logged
    key = capabilities.environment_key()
    monkeypatch.setenv("QUANTLAB_VLLM_PYTHON", str(tmp_path / "python"))
    assert capabilities.environment_key() != key
    with pytest.raises(AssertionError, match="made again"):
        sweep._log_capabilities(_Parent())
