"""AWQ: scales fold without changing the float function; with outlier
activation channels it beats round-to-nearest at the same group size."""
from __future__ import annotations

import pytest
import torch

from quantlab import models
from quantlab.config import ModelConfig
from quantlab.engines.pytorch import TorchEngine
from quantlab.hardware import cpu
from quantlab import corpus
from quantlab.probes import fidelity
from quantlab.schemes import awq, layers
from quantlab.schemes.awq import AWQScheme
from quantlab.schemes.int4 import Int4Scheme
from quantlab.schemes.registry import ApplyContext, weights_handler

CFG = AWQScheme(group_size=32, calibration="builtin", n_samples=4, seq_len=64)


def _outlier_model():
    """The tiny model with a few activation channels 30x larger (scaled norm
    weights), as trained LLMs have: where activation-awareness matters."""
    model = models.tiny_model(ModelConfig(name="tiny", source="tiny"))
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[:4] *= 30
    return model


def _apply(model, cfg, tmp_path):
    ctx = ApplyContext(hw=cpu(), tokenizer=models.byte_tokenizer(), cache_dir=str(tmp_path), data_dir=None, seed=0)
    return weights_handler(cfg).apply(model, cfg, ctx)


def test_folded_scales_keep_the_float_function(tmp_path, monkeypatch):
    model = _outlier_model()
    ids = corpus.token_ids(models.byte_tokenizer(), "builtin", 64)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    monkeypatch.setattr(layers, "replace", lambda *a: None)  # scale and fold, do not quantize
    monkeypatch.setattr(layers, "cast_parameters", lambda *a: None)
    applied = _apply(model, CFG, tmp_path)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert float(applied.tags["awq.alpha_mean"]) > 0  # something was scaled ...
    assert torch.allclose(before, after, rtol=1e-4, atol=1e-4)  # ... and the function did not change


def test_alpha_zero_is_round_to_nearest():
    w, x = torch.randn(16, 64), torch.randn(32, 64)
    s, alpha, ratio = awq.search_scale(x, [w], [lambda v: awq.rtn_dequantized(v, 32, False)], grid=0)
    assert alpha == 0 and ratio == 1.0 and torch.allclose(s, torch.ones(64))


def test_awq_beats_rtn_with_outlier_channels(tmp_path):
    ids = corpus.token_ids(models.byte_tokenizer(), "builtin", 128)
    ref = fidelity.logprobs(TorchEngine(_outlier_model()), ids)
    kls = {}
    for name, cfg in (("awq", CFG), ("rtn", Int4Scheme(group_size=32))):
        model = _outlier_model()
        applied = _apply(model, cfg, tmp_path)
        kls[name] = fidelity.compare(ref, fidelity.logprobs(TorchEngine(model), ids))["fid/kl_mean"]
    assert applied.backend.startswith("aten")  # the RTN point ran on the same kernel family
    assert kls["awq"] < 0.8 * kls["rtn"], kls


def test_awq_group_size_is_checked():
    with pytest.raises(ValueError, match="awq group_size 48"):
        AWQScheme(group_size=48)


def test_mixed_recipe_with_awq_beats_it_without(tmp_path):
    """AWQ scales searched against each group's own recipe candidates lower the
    recipe's error on outlier channels, on the same kernels; the run is named
    with -awq and says what was scaled."""
    from quantlab.schemes.mixed import MixedScheme

    ids = corpus.token_ids(models.byte_tokenizer(), "builtin", 128)
    ref = fidelity.logprobs(TorchEngine(_outlier_model()), ids)
    recipe = {"model.layers.0.mlp.down_proj": "int8", "model.layers.1.self_attn.q_proj": "bf16"}
    kls = {}
    for use_awq in (True, False):
        cfg = MixedScheme(default="int4-g32", layers=recipe, awq=use_awq, calibration="builtin", n_samples=4,
                          seq_len=64)
        model = _outlier_model()
        applied = _apply(model, cfg, tmp_path)
        kls[cfg.short_name()] = fidelity.compare(ref, fidelity.logprobs(TorchEngine(model), ids))["fid/kl_mean"]
        if use_awq:
            assert int(applied.tags["awq.groups"]) == 6 and applied.tags["mixed.layers.bf16"] == "1"
    assert kls["mixed-custom-awq"] < 0.8 * kls["mixed-custom"], kls
