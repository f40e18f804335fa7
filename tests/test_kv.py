"""KV-cache schemes: real low-bit storage, per-head scales, round-trip bounds,
and combination with any weight scheme."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from quantlab import models
from quantlab.config import ModelConfig
from quantlab.probes.configs import CacheProbeConfig
from quantlab.engines.pytorch import TorchEngine
from quantlab.probes import cache as cache_probe
from quantlab import corpus
from quantlab.schemes.kv import FP8KV, Int4KV, Int4Layer, Int8KV, Int8Layer, NoKV, cache_bytes, cache_factory


def _kv(b=2, h=3, t=40, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, d, generator=g) * torch.linspace(0.5, 4, h)[None, :, None, None]


def test_int8_static_stores_int8_with_one_scale_per_head():
    layer = Int8Layer(dynamic=False)
    k, v = _kv(), _kv(seed=1)
    layer.update(k, v)
    layer.update(_kv(t=1, seed=2), _kv(t=1, seed=3))
    (qk, sk), (qv, sv) = layer._quantized_keys, layer._quantized_values
    assert qk.dtype == qv.dtype == torch.int8 and qk.shape == (2, 3, 41, 16)
    assert sk.shape == sv.shape == (1, 3, 1, 1)  # per head, frozen after the prefill
    err = (layer._dequantize(layer._quantized_keys)[:, :, :40] - k).abs()
    assert torch.all(err <= sk / 2 + 1e-6)  # round to nearest: half a step


def test_int8_dynamic_scales_per_head_and_token():
    layer = Int8Layer(dynamic=True)
    layer.update(_kv(), _kv(seed=1))
    layer.update(_kv(t=3, seed=2) * 10, _kv(t=3, seed=3))  # louder tokens get their own scale
    qk, sk = layer._quantized_keys
    assert sk.shape == (2, 3, 43, 1)
    out = layer._dequantize(layer._quantized_keys)[:, :, 40:]
    ref = _kv(t=3, seed=2) * 10
    assert ((out - ref).abs() <= sk[:, :, 40:] / 2 + 1e-5).all()


def test_int4_kivi_round_trip_and_packing():
    layer = Int4Layer(group_size=8, residual_length=4)
    k, v = _kv(t=32), _kv(t=32, seed=1)
    out_k, out_v = layer.update(k, v)
    assert torch.equal(out_k, k) and torch.equal(out_v, v)  # attention over the prefill is full precision
    (pk, sk, _), (pv, sv, _) = layer._quantized_keys, layer._quantized_values
    assert pk.dtype == pv.dtype == torch.uint8
    assert pk.shape == (2, 3, 16, 24 // 2) and sk.shape == (2, 3, 16, 3, 1)  # keys: per channel, 3 groups of 8 tokens
    assert pv.shape == (2, 3, 24, 16 // 2) and sv.shape == (2, 3, 24, 2, 1)  # values: per token, 2 groups of 8 channels
    assert layer.keys.shape[-2] == 8  # 32 - 24: within [residual, residual + group)
    kd, vd = layer._dequantize(layer._quantized_keys, -2), layer._dequantize(layer._quantized_values)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(kd, k[:, :, :24]) < 0.15 and rel(vd, v[:, :, :24]) < 0.15


@settings(max_examples=40, deadline=None)
@given(chunks=st.lists(st.integers(1, 40), min_size=1, max_size=8), g=st.sampled_from([2, 4, 8, 16]),
       residual=st.integers(0, 20))
def test_int4_kivi_windows_hold_for_any_token_counts(chunks, g, residual):
    """Any token count (odd ones too): stored tokens are whole groups of g, the
    full-precision window is the newest residual .. residual + g - 1 tokens,
    attention sees every token once in order, the full-precision ones exactly,
    and a stored group is never quantized again."""
    layer = Int4Layer(group_size=g, residual_length=residual)
    seen_k, first_group = [], None
    for i, t in enumerate(chunks):
        k, v = _kv(b=1, h=2, t=t, seed=2 * i), _kv(b=1, h=2, t=t, seed=2 * i + 1)
        seen_k.append(k)
        out_k, out_v = layer.update(k, v)
        total = sum(chunks[:i + 1])
        assert out_k.shape[-2] == out_v.shape[-2] == total == layer.get_seq_length()
        stored, fp = layer.quantized_tokens(), layer.keys.shape[-2]
        assert stored % g == 0 and stored + fp == total
        assert fp == total if total <= residual else residual <= fp < residual + g
        allk = torch.cat(seen_k, dim=-2)
        before = out_k.shape[-2] - k.shape[-2]  # what was stored before this update came dequantized
        assert torch.equal(out_k[..., before:, :], k)  # the new tokens are attended in full precision
        if layer._quantized_keys is not None:
            packed = layer._quantized_keys[0][..., : g // 2]
            if first_group is None:
                first_group = packed.clone()
            assert torch.equal(packed, first_group)  # the oldest group keeps its bytes
            assert torch.allclose(layer._dequantize(layer._quantized_keys, -2), allk[..., :stored, :],
                                  atol=4 * 4.0 / 15 * 2)  # within a step of the widest group's range


def test_int4_kv_rejects_what_it_cannot_group():
    with pytest.raises(ValueError, match="int4 kv group_size 3; valid: even, >= 2"):
        Int4KV(group_size=3)
    with pytest.raises(ValueError, match="head_dim 16 is not a multiple of group_size 32"):
        Int4Layer(group_size=32, residual_length=4).update(_kv(t=3), _kv(t=3))


def _probe(model, wins, cfg, kv, factory=None):
    engine = TorchEngine(model, cache_factory=factory or cache_factory(kv))
    return cache_probe.probe(engine, model.config, wins, cfg, model.get_input_embeddings().weight.element_size())


@pytest.fixture(scope="module")
def tiny():
    return models.tiny_model(ModelConfig(name="tiny", source="tiny")), models.byte_tokenizer()


@pytest.mark.parametrize("kv,ratio", [(Int8KV("static"), 0.51), (Int8KV("dynamic"), 0.63),
                                      (FP8KV(), 0.51), (Int4KV(group_size=16, residual_length=16), 0.45)])
def test_cache_probe_bytes_and_fidelity(tiny, kv, ratio):
    model, tok = tiny
    wins = corpus.token_ids(tok, "builtin", 2 * 160).reshape(2, 160)
    cfg = CacheProbeConfig(enabled=True, prefix_tokens=96, continuation_tokens=64, chunk=1)
    dense = _probe(model, wins, cfg, NoKV())
    quant = _probe(model, wins, cfg, kv)
    assert dense["kv/ratio_vs_dense"] == 1.0 and dense["kvfid/kl_mean"] < 1e-6  # summation order only
    assert quant["kv/ratio_vs_dense"] <= ratio
    assert 0 < quant["kvfid/kl_mean"] < 1e-2
    assert quant["kvfid/ppl"] == pytest.approx(dense["kvfid/ppl"], rel=0.02)


def test_int4_is_worse_than_int8(tiny):
    model, tok = tiny
    wins = corpus.token_ids(tok, "builtin", 300).reshape(1, 300)
    cfg = CacheProbeConfig(enabled=True, prefix_tokens=200, continuation_tokens=100, chunk=4)
    kl8 = _probe(model, wins, cfg, Int8KV())["kvfid/kl_mean"]
    kl4 = _probe(model, wins, cfg, Int4KV(group_size=16, residual_length=16))["kvfid/kl_mean"]
    assert kl8 < kl4


def test_dense_cache_bytes_match_shape(tiny):
    model, tok = tiny
    cache = DynamicCache(config=model.config)
    ids = corpus.token_ids(tok, "builtin", 50)
    model(input_ids=ids, cache=cache, use_cache=True)
    c = model.config  # 2 layers x K and V x 2 kv heads x head_dim 16 x 50 tokens x fp32
    assert cache_bytes(cache) == 2 * c.num_hidden_layers * c.num_key_value_heads * 16 * 50 * 4


@pytest.mark.parametrize("weights", ["int8", "int4-g32", "nf4", "fp8-e4m3"])
def test_kv_scheme_combines_with_weight_schemes(tmp_path, weights):
    from tests.conftest import compose_cfg
    from quantlab.pipeline import run_point

    cfg = compose_cfg(["model=tiny", f"scheme/weights={weights}", "scheme/kv=int8",
                       f"tracking.uri=sqlite:///{tmp_path}/m.db", f"tracking.artifact_root={tmp_path}/a",
                       "probe.latency.repeats=1"])
    result = run_point(cfg)
    assert result.outcome == "finished", result.reason
    assert result.name == f"{cfg.scheme.weights.short_name()}+kv8@cpu"


def test_calibration_records_the_maxima_the_cache_would_store():
    """calibrate(): per layer and KV head, the absolute maxima of exactly the
    keys (after RoPE) and values a DynamicCache stores for the same windows."""
    from quantlab.schemes.kv import calibrate

    model = models.tiny_model(ModelConfig(name="tiny", source="tiny"))
    ids = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(0))
    amax = calibrate(model, ids)
    ref = [(torch.zeros(2), torch.zeros(2)) for _ in amax]
    for row in ids:
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=row[None], cache=cache, use_cache=True)
        for i, layer in enumerate(cache.layers):
            ref[i] = (torch.maximum(ref[i][0], layer.keys.abs().float().amax(dim=(0, 2, 3))),
                      torch.maximum(ref[i][1], layer.values.abs().float().amax(dim=(0, 2, 3))))
    assert len(amax) == model.config.num_hidden_layers
    for (k, v), (rk, rv) in zip(amax, ref):
        assert k.shape == (model.config.num_key_value_heads,) and torch.equal(k, rk) and torch.equal(v, rv)


def test_calibrated_int8_scales_are_fixed_and_saturate_past_the_calibration():
    amax = [(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([0.5, 1.0, 8.0]))]
    factory = cache_factory(Int8KV("calibrated"), amax)  # KVCache(layer_factory, config=...), as the probes get it
    cache_layer = factory.args[0](0)
    assert factory.func.__name__ == "KVCache" and isinstance(cache_layer, Int8Layer)
    k, v = _kv(), _kv(seed=1)
    out_k, _ = cache_layer.update(k, v)
    assert torch.equal(out_k, k)  # the prefill attends its own states, as every quantized layer's
    cache_layer.update(_kv(t=1, seed=2), _kv(t=1, seed=3))
    sk = cache_layer._quantized_keys[1]
    assert torch.allclose(sk.flatten(), torch.tensor([1.0, 2.0, 4.0]) / 127)  # the calibration's, not the prefill's
    deq = cache_layer._dequantize(cache_layer._quantized_keys)[:, :, :40]
    inside = k.abs() <= torch.tensor([1.0, 2.0, 4.0])[None, :, None, None]
    assert torch.all((deq - k).abs()[inside] <= sk.expand_as(k)[inside] / 2 + 1e-6)
    assert torch.allclose(deq[~inside].abs(), (127 * sk).expand_as(k)[~inside])  # saturated, not wrapped
    with pytest.raises(ValueError, match="kv8-cal: calibrated scales need the calibration's maxima"):
        cache_factory(Int8KV("calibrated"))


def test_calibrated_fp8_saturates_instead_of_making_nans():
    from quantlab.schemes.kv import Fp8CalibratedLayer

    layer = cache_factory(FP8KV(scales="calibrated"), [(torch.tensor([0.5, 1.0]), torch.tensor([1.0, 2.0]))]).args[0](0)
    assert isinstance(layer, Fp8CalibratedLayer)
    assert layer.k_scale == pytest.approx(1.0 / 448) and layer.v_scale == pytest.approx(2.0 / 448)  # per tensor
    big = _kv(h=2) * 100  # far past the calibration's maxima
    layer.update(big, big)
    layer.update(big[:, :, :1], big[:, :, :1])
    out = layer._dequantize(layer._quantized_keys)
    assert torch.isfinite(out).all() and out.abs().max() == pytest.approx(1.0, rel=1e-6)


def test_calibrated_presets_name_their_points_and_map_where_the_scales_go():
    from quantlab.schemes.kv import gguf, vllm
    from tests.conftest import compose_cfg

    assert compose_cfg(["scheme/kv=int8-cal"]).scheme.kv.short_name() == "kv8-cal"
    fp8 = compose_cfg(["scheme/kv=fp8-cal"]).scheme.kv
    assert fp8.short_name() == "kvfp8-cal" and fp8.calibration_set() == "wiki"
    assert vllm(fp8).spec == {"kv_cache_dtype": "fp8", "scales": "checkpoint"}  # the export carries them
    assert vllm(FP8KV()).spec == {"kv_cache_dtype": "fp8", "scales": "1.0"}  # vLLM's default, not the prefill's
    assert "no vLLM --kv-cache-dtype" in vllm(Int8KV("calibrated")).reason
    assert "takes no calibrated scales" in gguf(Int8KV("calibrated")).reason
    assert gguf(Int8KV()).spec == {"type": "Q8_0"}
    with pytest.raises(ValueError, match="fp8 kv scales 'dynamic'; valid: prefill, calibrated"):
        FP8KV(scales="dynamic")


@pytest.mark.parametrize("kv", [Int8KV("calibrated"), FP8KV(scales="calibrated")])
def test_a_calibrated_point_logs_its_scales_and_measures_its_cache(kv, tmp_path):
    """Applied on a point: scales from the calibration set (the built-in text
    here, tagged as the fallback), the cache probe's KL small but not 0."""
    from quantlab.schemes.kv import apply
    from quantlab.schemes.registry import ApplyContext
    from quantlab.hardware import cpu

    model, tok = models.tiny_model(ModelConfig(name="tiny", source="tiny")), models.byte_tokenizer()
    ctx = ApplyContext(hw=cpu(), tokenizer=tok, cache_dir=str(tmp_path), data_dir=None, seed=0)
    applied = apply(model, kv, ctx)
    assert applied.tags["kv.calibration"] == "builtin" and "kv.calibration.fallback" in applied.tags
    lo, hi = map(float, applied.tags["kv.calibrated.k_amax"].split(".."))
    assert 0 < lo <= hi
    wins = corpus.token_ids(tok, "builtin", 2 * 160).reshape(2, 160)
    cfg = CacheProbeConfig(enabled=True, prefix_tokens=96, continuation_tokens=64, chunk=1)
    kl = _probe(model, wins, cfg, kv, applied.cache_factory)["kvfid/kl_mean"]
    assert 0 < kl < 0.05


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), spread=st.floats(1e-3, 1e3))
def test_the_toward_zero_e4m3_emulation_truncates(seed, spread):
    """The parity benchmark's emulation of vLLM's CPU cache conversion: every
    value maps to the largest E4M3 magnitude not above its own (same sign),
    saturated at 448: checked against a search over E4M3's codes."""
    from benchmarks.kv_vllm_parity import toward_zero_e4m3

    x = torch.randn(4096, generator=torch.Generator().manual_seed(seed), dtype=torch.float32) * spread
    q = toward_zero_e4m3(x).float()
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # magnitudes, ascending
    expected = torch.sign(x) * codes[torch.searchsorted(codes, x.abs().clamp(max=448.0), right=True) - 1]
    assert torch.equal(q, expected)
