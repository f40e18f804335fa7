"""llama.cpp target and GGUF export: block packing against gguf's reference
dequantizer, files llama.cpp loads and reproduces, the target end to end, and
bad input as one line."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mlflow.tracking import MlflowClient

from quantlab import models
from quantlab.engines.llamacpp import LlamaCppEngine
from quantlab.export import gguf as gguf_export
from quantlab.export import roundtrip
from quantlab.engines.pytorch import TorchEngine
from quantlab.hardware import cpu
from quantlab.schemes.qlinear import rtn_int4, rtn_int8
from quantlab.schemes.registry import ApplyContext, weights_handler
from tests.conftest import REPO, SHARED_DATA, compose_cfg, run_cli

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install 'quantlab[llamacpp]')")
# head_dim 32: llama.cpp's quantized K/V cache needs whole 32-blocks per head
TINY = ["model=tiny", "model.tiny.hidden_size=128", "model.tiny.intermediate_size=256"]


@settings(max_examples=25, deadline=None)
@given(n=st.sampled_from([16, 48]), blocks=st.integers(1, 4), seed=st.integers(0, 10_000),
       group=st.sampled_from([32, 64]), symmetric=st.booleans())
def test_int4_blocks_decode_to_the_points_weights(n, blocks, seed, group, symmetric):
    """Packed Q4_0/Q4_1 read back by gguf's reference dequantizer equal the point's
    dequantized weights up to the fp16 rounding of d and m."""
    k = max(blocks * 32, group) // group * group
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    q, scale, zero = rtn_int4(w, group, symmetric)  # w ~ (q - 8) * scale + zero
    zp = torch.round(8 - zero / scale)
    point = ((q.reshape(n, -1, group) - zp[..., None]) * scale[..., None]).reshape(n, k)
    if symmetric:
        data, kind = gguf_export.pack_q4_0(q, scale), "Q4_0"
    else:
        data, kind = gguf_export.pack_q4_1(q, scale, zp), "Q4_1"
    got = gguf_export.dequantize(data, kind, (n, k))
    # fp16 rounding (half an ulp, 2^-11 relative) of d times |q - zp| <= 15, and of m = -zp * d (<= 15 d)
    bound = scale.abs().repeat_interleave(group, 1) * (8 if symmetric else 30) * 2**-11 + 1e-6
    assert ((got - point).abs() <= bound).all()


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 8), blocks=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_int8_blocks_decode_to_the_points_weights(n, blocks, seed):
    w = torch.randn(n, 32 * blocks, generator=torch.Generator().manual_seed(seed))
    q, scale = rtn_int8(w)
    got = gguf_export.dequantize(gguf_export.pack_q8_0(q, scale[:, None]), "Q8_0", (n, 32 * blocks))
    point = q.float() * scale[:, None]
    assert ((got - point).abs() <= scale[:, None] * 127 * 2**-11 + 1e-7).all()


def _gguf_check(path, model, ids, kind):
    """The GGUF round trip on an engine built here, as the exporter does."""
    engine = LlamaCppEngine(path, "F16", model.config.vocab_size, n_ctx=max(64, ids.shape[1] + 8))
    try:
        return roundtrip.gguf_check(path, engine, model, ids, kind)
    finally:
        engine.close()


def _point(scheme: str, extra: list[str] | None = None):
    cfg = compose_cfg([*TINY, f"scheme/weights={scheme}", *(extra or [])])
    model, tok = models.load(cfg.model, cfg.cache_dir)
    w = cfg.scheme.weights
    weights_handler(w).apply(model, w, ApplyContext(hw=cpu(), tokenizer=tok, cache_dir=cfg.cache_dir))
    return model, tok


@pytest.mark.parametrize("scheme,kind", [("bf16", "BF16"), ("int8", "Q8_0"), ("int4-g64", "Q4_1"),
                                         ("int4-g32-sym", "Q4_0"), ("mxfp4-a16", "MXFP4")])
def test_llamacpp_reproduces_the_exported_point(tmp_path, scheme, kind):
    model, tok = _point(scheme)
    counts = gguf_export.write(model, tok, tmp_path / "m.gguf")
    assert kind in counts and counts["F32"] == 2 * 2 + 1  # norms stay F32
    check = _gguf_check(tmp_path / "m.gguf", model, torch.randint(0, 256, (1, 48)), kind)
    assert check["passed"], check
    assert check["kl_mean"] < 1e-3 and check["top1_agree"] > 0.9


def test_round_trip_fails_when_the_quantization_is_lost(tmp_path):
    """A file that holds the float model where the point is int4 fails (types and KL)."""
    model, tok = _point("int4-g32")
    dense, _ = models.load(compose_cfg(TINY).model, compose_cfg(TINY).cache_dir)
    gguf_export.write(dense, tok, tmp_path / "float.gguf")
    check = _gguf_check(tmp_path / "float.gguf", model, torch.randint(0, 256, (1, 48)), "Q4_1")
    assert not check["passed"] and "Q4_1" not in check["tensor_types"]


def _sweep(tmp_path, extra):
    uri = f"sqlite:///{tmp_path}/m.db"
    proc = run_cli(["-m", *TINY, "target=llamacpp", "probe=smoke", "probe.latency.repeats=2",
                    f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a", f"cache_dir={tmp_path}/c", *extra],
                   timeout=900)
    c = MlflowClient(uri)
    runs = {r.info.run_name: r for r in c.search_runs([c.get_experiment_by_name("quantlab").experiment_id])
            if r.data.tags.get("quantlab.role") != "sweep"}
    return proc, runs


def test_a_llamacpp_point_exports_in_both_formats(tmp_path):
    """A point measured on target=llamacpp (the natural CPU workflow) exports as
    a checkpoint and as GGUF; its logged config names a target whose config
    lives beside the target (once a KeyError: 'LlamaCppTargetConfig')."""
    uri = f"sqlite:///{tmp_path}/m.db"
    proc, runs = _sweep(tmp_path, ["scheme/weights=int8", "probe.latency.enabled=false"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_id = runs["int8@llamacpp"].info.run_id
    base = [sys.executable, "-m", "quantlab.export", "--tracking-uri", uri, "--run", run_id]
    for fmt, out in (("checkpoint", tmp_path / "ckpt"), ("gguf", tmp_path / "p.gguf")):
        done = subprocess.run([*base, "--format", fmt, "--out", str(out)], capture_output=True, text=True, cwd=REPO,
                              timeout=600)
        assert done.returncode == 0, (fmt, done.stderr[-2000:])
    assert json.loads((tmp_path / "ckpt" / "quantlab.json").read_text())["round_trip"]["passed"]
    assert json.loads((tmp_path / "p.gguf.quantlab.json").read_text())["format"] == "gguf/Q8_0"


def test_llamacpp_sweep_end_to_end(tmp_path):
    """Real llama.cpp latencies and logits-based probes; int8 KV runs on llama.cpp's
    q8_0 cache; schemes with no GGUF type are skipped with the reason."""
    proc, runs = _sweep(tmp_path, ["scheme/weights=int4-g32,nf4,fp8-e4m3", "scheme/kv=none,int8",
                                   "probe.cache.enabled=true"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("nf4@llamacpp", "fp8-e4m3+kv8@llamacpp"):
        assert runs[name].data.tags["quantlab.outcome"] == "skipped"
    assert "nearest: IQ4_NL" in runs["nf4@llamacpp"].data.tags["quantlab.reason"]
    assert "nearest: Q8_0" in runs["fp8-e4m3@llamacpp"].data.tags["quantlab.reason"]
    plain, kv8 = runs["int4-g32@llamacpp"].data, runs["int4-g32+kv8@llamacpp"].data
    for r in (plain, kv8):
        assert r.tags["quantlab.outcome"] == "finished", r.tags.get("quantlab.reason")
        assert r.metrics["lat/tpot_ms_count"] == 2 * (compose_cfg(["probe=smoke"]).probe.latency.new_tokens - 1)
        assert r.metrics["lat/ttft_ms_p50"] > 0
        assert r.metrics["fid/kl_mean"] < 0.5 and r.metrics["size/gguf_mb"] > 0
        assert r.metrics["size/runtime_weight_bytes"] == pytest.approx(r.metrics["size/weight_bytes"], rel=0.2)
        assert "no per-module timing" in r.tags["probe.stages.skipped"]
        assert "no cache-free reference" in r.tags["probe.cache.skipped"]
    assert "q8_0" in kv8.tags["support.reason"]
    # parity: the GGUF served is the point quantized (llama.cpp's 8-bit activations are all that differ)
    assert plain.metrics["parity/kl_mean"] < plain.metrics["fid/kl_mean"] / 5
    assert plain.metrics["parity/greedy_tokens"] == 32 and "parity/greedy_match_tokens" in plain.metrics
    # the q8_0 cache holds 34/64 of the f16 one's bytes (as llama.cpp reports them)
    # and moves the logits: every forward attends through it
    assert 0.45 < kv8.metrics["mem/kv_mb"] / plain.metrics["mem/kv_mb"] < 0.6
    assert kv8.metrics["fid/kl_mean"] > plain.metrics["fid/kl_mean"]
    assert plain.metrics["compile/gguf_cached"] == 0.0 and kv8.metrics["compile/gguf_cached"] == 1.0


def test_mxfp4_runs_on_llamacpps_own_kernels(tmp_path):
    """MXFP4 weights, emulated in the torch engine, run for real on llama.cpp
    from a GGUF of the point's own codes (not tagged emulated there); W4A4
    MXFP4 is skipped naming the weight-only preset llama.cpp runs."""
    proc, runs = _sweep(tmp_path, ["scheme/weights=mxfp4-a16,mxfp4"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = runs["mxfp4-a16@llamacpp"].data
    assert r.tags["quantlab.outcome"] == "finished", r.tags.get("quantlab.reason")
    assert r.tags["emulated"] == "false" and r.tags["support"] == "real" and "MXFP4" in r.tags["support.reason"]
    assert r.metrics["lat/tpot_ms_p50"] > 0
    assert r.metrics["parity/kl_mean"] < r.metrics["fid/kl_mean"] / 5  # llama.cpp's Q8_0 activations differ only
    assert runs["mxfp4@llamacpp"].data.tags["quantlab.outcome"] == "skipped"
    assert "use mxfp4-a16" in runs["mxfp4@llamacpp"].data.tags["quantlab.reason"]


def test_corrupt_gguf_cache_entry_fails_the_point_in_one_line(tmp_path):
    proc, runs = _sweep(tmp_path, ["scheme/weights=int8"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    entry = next((tmp_path / "c" / "gguf").glob("*.gguf"))
    with entry.open("r+b") as f:
        f.seek(entry.stat().st_size // 2)
        f.write(b"\xff" * 64)
    proc, _ = _sweep(tmp_path, ["scheme/weights=int8", "force=true"])
    assert proc.returncode == 1
    c = MlflowClient(f"sqlite:///{tmp_path}/m.db")
    runs = [r for r in c.search_runs([c.get_experiment_by_name("quantlab").experiment_id])
            if r.data.tags.get("quantlab.role") != "sweep"]
    failed = [r for r in runs if r.data.tags["quantlab.outcome"] == "failed"]
    assert len(failed) == 1 and "is corrupt (sha256 differs" in failed[0].data.tags["quantlab.reason"]
    assert "\n" not in failed[0].data.tags["quantlab.reason"]
    assert sum(r.data.tags["quantlab.outcome"] == "finished" for r in runs) == 1  # the first run kept


def test_missing_llama_cpp_is_a_skip_with_the_install_line(monkeypatch):
    from quantlab import targets
    from quantlab.schemes.kv import NoKV
    from quantlab.targets import llamacpp

    monkeypatch.setattr(llamacpp, "llama_cpp", lambda: None)
    cfg = compose_cfg(["target=llamacpp", "scheme/weights=int8"])
    verdict = targets.get(cfg.target).supports(cfg.scheme.weights, NoKV())
    assert verdict.status == "unsupported" and "pip install 'quantlab[llamacpp]'" in verdict.reason


def test_gguf_export_cli(tmp_path):
    """--format gguf on a finished run: the file and its manifest; refusals in one line."""
    uri = f"sqlite:///{tmp_path}/m.db"
    proc, runs = _sweep(tmp_path, ["scheme/weights=int4-g32-sym,nf4", "target=cpu"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    base = [sys.executable, "-m", "quantlab.export", "--tracking-uri", uri, "--format", "gguf"]
    run_id = runs["int4-g32-sym@cpu"].info.run_id
    out = subprocess.run([*base, "--run", run_id, "--out", str(tmp_path / "p.gguf")], capture_output=True,
                         text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    manifest = json.loads((tmp_path / "p.gguf.quantlab.json").read_text())
    assert manifest["format"] == "gguf/Q4_0" and manifest["round_trip"]["passed"]
    again = subprocess.run([*base, "--run", run_id, "--out", str(tmp_path / "p.gguf")], capture_output=True,
                           text=True, cwd=REPO, timeout=600)
    assert again.returncode == 2 and "exists; pass --force" in again.stderr.strip().splitlines()[-1]
    nf4 = subprocess.run([*base, "--run", runs["nf4@cpu"].info.run_id, "--out", str(tmp_path / "n.gguf")],
                         capture_output=True, text=True, cwd=REPO, timeout=600)
    assert nf4.returncode == 2 and "nf4 has no GGUF type; nearest: IQ4_NL" in nf4.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "n.gguf").exists()


GPTQ_SCRIPT = """
import json, sys, torch
from quantlab.engines.llamacpp import LlamaCppEngine
from quantlab.probes import perplexity
wins = torch.load(sys.argv[2])
eng = LlamaCppEngine(sys.argv[1], "F16", int(sys.argv[3]), n_ctx=512, threads=2)
print(json.dumps(perplexity.token_perplexity(eng, wins)))
"""


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="WikiText-2 lives in QUANTLAB_DATA_DIR or ../shared/data")
@pytest.mark.parametrize("model_args,tol", [
    pytest.param(TINY, 1e-3, id="tiny"),
    pytest.param(["model=smollm2-135m"], 2e-2, id="smollm2", marks=pytest.mark.slow),
])
def test_gptq_gguf_perplexity_in_a_fresh_process(tmp_path, model_args, tol):
    """The GPTQ point's GGUF, loaded by llama-cpp-python in another process, scores
    WikiText-2 like the in-memory point (tolerance: llama.cpp's 8-bit activations)."""
    from quantlab.probes import perplexity

    model, tok = _point("gptq-g32-sym", [*model_args, "scheme.weights.calibration=builtin",
                                        "scheme.weights.n_samples=8", "scheme.weights.seq_len=128"])
    gguf_export.write(model, tok, tmp_path / "g.gguf", getattr(model, "quantlab_gguf", None))
    ids = tok(perplexity.wikitext2_text(str(SHARED_DATA))[:20000], add_special_tokens=False,
              return_tensors="pt")["input_ids"][0]
    wins, _ = perplexity.windows(ids, 256, 4)
    torch.save(wins, tmp_path / "w.pt")
    ours = perplexity.token_perplexity(TorchEngine(model), wins)["ppl_token_wikitext2_w256"]
    proc = subprocess.run([sys.executable, "-c", GPTQ_SCRIPT, str(tmp_path / "g.gguf"), str(tmp_path / "w.pt"),
                           str(model.config.vocab_size)], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])["ppl_token_wikitext2_w256"]
    assert theirs == pytest.approx(ours, rel=tol)


def test_extra_buffers_off_only_where_amx_crashes_llama_cpp():
    """llama-cpp-python 0.3.36 built on an AMX-INT8 CPU segfaults in its first
    quantized decode with the extra buffer types on (seen in CI): off there, on elsewhere."""
    import llama_cpp.llama_cpp as low

    from quantlab.engines.llamacpp import _model_params, extra_buffers_ok

    assert not extra_buffers_ok(frozenset({"avx512f", "amx_int8", "amx_tile"}))
    assert extra_buffers_ok(frozenset({"avx512f", "avx512_vnni"}))
    default = low.llama_model_default_params
    with _model_params(use_extra_bufts=False):
        assert low.llama_model_default_params().use_extra_bufts is False
    assert low.llama_model_default_params is default and default().use_extra_bufts is True
