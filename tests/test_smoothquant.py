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
from quantlab import corpus
from quantlab.probes import fidelity
from quantlab.schemes import layers
from quantlab.schemes.qlinear import Int8DynLinear
from quantlab.schemes.registry import ApplyContext, weights_handler
from quantlab.schemes.smoothquant import W8A8Scheme
from tests.test_awq import _outlier_model

SQ = W8A8Scheme(smooth=True, calibration="builtin", n_samples=4, seq_len=64)
SQ_AUTO = W8A8Scheme(smooth=True, grid=10, calibration="builtin", n_samples=4, seq_len=64)


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
    for cfg in (SQ, SQ_AUTO, W8A8Scheme(smooth=False)):
        model = _outlier_model()
        applied = _apply(model, cfg, tmp_path)
        assert not applied.emulated and isinstance(model.model.layers[0].mlp.down_proj, Int8DynLinear)
        kls[cfg.short_name()] = fidelity.compare(ref, fidelity.logprobs(TorchEngine(model), ids))["fid/kl_mean"]
        if cfg is SQ_AUTO:  # the search says how much output error it removed on the calibration rows
            assert 0 < float(applied.tags["smoothquant.error_vs_naive"]) < 1
    assert kls["w8a8-sq"] < 0.8 * kls["w8a8"], kls
    assert kls["w8a8-sq-auto"] < 0.8 * kls["w8a8"], kls


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), outlier=st.floats(5, 100))
def test_searched_alpha_is_no_worse_than_a_fixed_one(seed, outlier):
    """The searched scales' W8A8 output error is at most that of every alpha on
    the grid (0.5 included), and below naive W8A8's where channels are outliers."""
    from quantlab.schemes.smoothquant import search_alpha, smoothing_scales, w8a8_error

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 32, generator=gen)
    x[:, :3] *= outlier
    w = torch.randn(24, 32, generator=gen)
    amax = x.abs().amax(0)
    s, alpha, ratio = search_alpha(x, amax, [w], grid=10)
    best = w8a8_error(x, [w], s)
    assert alpha in [i / 10 for i in range(11)]
    for a in (0.0, 0.3, 0.5, 0.8, 1.0):
        assert best <= w8a8_error(x, [w], smoothing_scales(amax, [w], a)) * (1 + 1e-6)
    assert ratio < 1.0 and best == pytest.approx(ratio * w8a8_error(x, [w], torch.ones(32)))


def test_alpha_is_range_checked():
    with pytest.raises(ValueError, match="w8a8 alpha 1.5; valid: 0..1"):
        W8A8Scheme(alpha=1.5)


def test_run_names_say_a_swept_alpha():
    assert [W8A8Scheme(smooth=False).short_name(), W8A8Scheme().short_name(),
            W8A8Scheme(alpha=0.75).short_name(), W8A8Scheme(grid=20).short_name()] == [
        "w8a8", "w8a8-sq", "w8a8-sq-a0.75", "w8a8-sq-auto"]
    with pytest.raises(ValueError, match="w8a8 grid -1; valid: >= 0"):
        W8A8Scheme(grid=-1)


@settings(max_examples=20, deadline=None)
@given(block=st.sampled_from([1, 2, 8, 32, 128]), rows=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_block_hadamard_is_orthogonal_and_its_own_inverse(block, rows, seed):
    """Rotating both the input and the weight leaves ``x W^T`` unchanged, and
    rotating twice gives the input back: the float function is kept."""
    from quantlab.schemes.qlinear import rotate_blocks

    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, 128, generator=gen), torch.randn(48, 128, generator=gen)
    assert torch.allclose(rotate_blocks(x, block) @ rotate_blocks(w, block).T, x @ w.T, atol=1e-4)
    assert torch.allclose(rotate_blocks(rotate_blocks(x, block), block), x, atol=1e-5)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), outlier=st.floats(20, 200))
def test_rotation_shrinks_the_error_of_per_token_outliers(seed, outlier):
    """Each token with one huge channel, a different one per token (what the
    SwiGLU product entering down_proj has): per-channel smoothing cannot help,
    the block Hadamard spreads the outlier and cuts the W8A8 output error."""
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(128, 64, bias=False)
    lin.weight.data = torch.randn(64, 128, generator=gen)
    x = torch.randn(32, 128, generator=gen)
    x[torch.arange(32), torch.randint(0, 128, (32,), generator=gen)] *= outlier
    ref = lin(x)
    err = {b: float(((Int8DynLinear.from_linear(lin, torch.float32, b)(x) - ref) ** 2).sum()) for b in (0, 64)}
    assert err[64] < 0.5 * err[0], err
    rotated = Int8DynLinear.from_linear(lin, torch.float32, 64)
    assert (rotated.dequantize() - lin.weight).norm() < 0.01 * lin.weight.norm()  # in the input's own basis


def test_rotated_down_proj_runs_on_the_integer_kernel(tmp_path):
    cfg = W8A8Scheme(smooth=True, grid=10, rotate_down=32, calibration="builtin", n_samples=4, seq_len=64)
    ids = corpus.token_ids(models.byte_tokenizer(), "builtin", 128)
    ref = fidelity.logprobs(TorchEngine(_outlier_model()), ids)
    model = _outlier_model()
    applied = _apply(model, cfg, tmp_path)
    mlp = model.model.layers[0].mlp
    assert (mlp.down_proj.rotate, mlp.up_proj.rotate, model.model.layers[0].self_attn.q_proj.rotate) == (32, 0, 0)
    assert applied.tags["w8a8.rotate_down"] == "32" and not applied.emulated
    naive = _outlier_model()
    _apply(naive, W8A8Scheme(smooth=False), tmp_path)
    kl = fidelity.compare(ref, fidelity.logprobs(TorchEngine(model), ids))["fid/kl_mean"]
    assert kl < 0.8 * fidelity.compare(ref, fidelity.logprobs(TorchEngine(naive), ids))["fid/kl_mean"]


def test_rotation_is_checked_and_named_and_not_exported(tmp_path):
    from quantlab.export import formats

    assert W8A8Scheme(grid=20, rotate_down=128).short_name() == "w8a8-sq-auto-had128"
    assert W8A8Scheme(smooth=False, rotate_down=64).short_name() == "w8a8-had64"
    with pytest.raises(ValueError, match="w8a8 rotate_down 96; valid: 0 .none. or a power of two"):
        W8A8Scheme(rotate_down=96)
    with pytest.raises(ValueError, match="rotate_down 256 does not divide model.layers.0.mlp.down_proj's 128 input"):
        _apply(_outlier_model(), W8A8Scheme(smooth=False, rotate_down=256), tmp_path)
    tag = formats.exportable_tags(W8A8Scheme(rotate_down=128))["exportable.checkpoint"]
    assert tag.startswith("no: w8a8-sq-had128: down_proj computes in a Hadamard-rotated basis"), tag
