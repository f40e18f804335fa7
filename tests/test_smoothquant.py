"""W8A8 INT8: the integer GEMM computes the quantized math exactly; SmoothQuant
keeps the float function and beats naive W8A8 where activations have outliers."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantlab import models
from quantlab.engines.pytorch import TorchEngine
from quantlab.hardware import cpu
from quantlab.probes import corpus, fidelity
from quantlab.schemes import layers
from quantlab.schemes.qlinear import Int8DynLinear
from quantlab.schemes.registry import ApplyContext, weights_handler
from quantlab.schemes.smoothquant import W8A8Scheme
from tests.test_awq import _outlier_model

SQ = W8A8Scheme(smooth=True, calibration="builtin", n_samples=4, seq_len=64)


def _apply(model, cfg, tmp_path):
    ctx = ApplyContext(hw=cpu(), tokenizer=models.byte_tokenizer(), cache_dir=str(tmp_path), data_dir=None, seed=0)
    return weights_handler(cfg).apply(model, cfg, ctx)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 33), seed=st.integers(0, 2**16))
def test_int_mm_equals_the_dequantized_math(m, seed):
    """_int_mm's int32 result, rescaled, is (q_x * s_x) @ (q_w * s_w)^T exactly
    up to float rounding: the kernel computes what the scheme claims."""
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(64, 48, bias=False)
    lin.weight.data = torch.randn(48, 64, generator=gen)
    q = Int8DynLinear.from_linear(lin, torch.float32)
    x = torch.randn(m, 64, generator=gen) * 3
    xq, sx = Int8DynLinear.quantize_tokens(x)
    expected = (xq.double() * sx.double()) @ q.dequantize().double().T
    assert torch.allclose(q(x).double(), expected, rtol=1e-5, atol=1e-4)
    assert (q(x) - lin(x)).abs().max() < 0.05 * lin(x).abs().max()  # and it is close to the float layer


def test_smoothing_keeps_the_float_function(tmp_path, monkeypatch):
    model = _outlier_model()
    ids = corpus.token_ids(models.byte_tokenizer(), "builtin", 64)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    monkeypatch.setattr(layers, "replace", lambda *a: None)
    monkeypatch.setattr(layers, "cast_parameters", lambda *a: None)
    applied = _apply(model, SQ, tmp_path)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert applied.tags["smoothquant.groups"] == "6"  # 2 layers x (qkv, gate/up, down)
    assert torch.allclose(before, after, rtol=1e-4, atol=1e-4)


def test_smoothquant_beats_naive_w8a8_with_outlier_channels(tmp_path):
    ids = corpus.token_ids(models.byte_tokenizer(), "builtin", 128)
    ref = fidelity.logprobs(TorchEngine(_outlier_model()), ids)
    kls = {}
    for cfg in (SQ, W8A8Scheme(smooth=False)):
        model = _outlier_model()
        applied = _apply(model, cfg, tmp_path)
        assert not applied.emulated and isinstance(model.model.layers[0].mlp.down_proj, Int8DynLinear)
        kls[cfg.short_name()] = fidelity.compare(ref, fidelity.logprobs(TorchEngine(model), ids))["fid/kl_mean"]
    assert kls["w8a8-sq"] < 0.8 * kls["w8a8"], kls


def test_alpha_is_range_checked():
    with pytest.raises(ValueError, match="w8a8 alpha 1.5; valid: 0..1"):
        W8A8Scheme(alpha=1.5)


def test_run_names_say_a_swept_alpha():
    assert [W8A8Scheme(smooth=False).short_name(), W8A8Scheme().short_name(),
            W8A8Scheme(alpha=0.75).short_name()] == ["w8a8", "w8a8-sq", "w8a8-sq-a0.75"]
