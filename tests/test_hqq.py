"""HQQ: the hqq package's optimized groups on quantlab's kernels."""
from __future__ import annotations

import pytest
import torch

from quantlab import hardware, models
from quantlab.config import ModelConfig
from quantlab.engines.pytorch import TorchEngine
from quantlab.hardware import Hardware
from quantlab.probes import fidelity, size
from quantlab.schemes.hqq import GroupDequantLinear, HQQScheme, int4_linear, quantize
from quantlab.schemes.qlinear import Int4Linear
from quantlab.schemes.registry import ApplyContext, weights_handler


def _linear(w: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w.clone()
    return lin


def test_int4_groups_beat_round_to_nearest_on_outlier_weights():
    torch.manual_seed(0)
    w = torch.randn(128, 256) * 0.02
    w[:, 3] *= 25  # an outlier input channel, as in real checkpoints
    lin = _linear(w)
    for g in (32, 64):
        hqq = int4_linear(lin, g, torch.float32).dequantize()
        rtn = Int4Linear.from_linear(lin, g, False, torch.float32).dequantize()
        assert (hqq - w).pow(2).mean() < (rtn - w).pow(2).mean()


def test_int4_recovers_a_float_zero_point_grid_exactly():
    """Weights that already lie on an asymmetric 4-bit grid with float minima
    (what a dequantized GGUF Q4_1 checkpoint holds, like the offline default
    model) come back exactly through HQQ's float zero points; RTN's integer
    zero points cannot land on that grid."""
    torch.manual_seed(1)
    n, k, g = 64, 128, 32
    q = torch.randint(0, 16, (n, k // g, g)).float()
    q[..., 0], q[..., 1] = 0, 15  # every group spans the whole grid
    d = torch.rand(n, k // g, 1) * 0.01 + 0.001
    m = -torch.rand(n, k // g, 1) * 0.05
    w = (q * d + m).reshape(n, k)
    lin = _linear(w)
    hqq = int4_linear(lin, g, torch.float32).dequantize()
    rtn = Int4Linear.from_linear(lin, g, False, torch.float32).dequantize()
    assert (hqq - w).abs().max() < 1e-5
    assert (rtn - w).abs().max() > 1e-4


def test_int8_groups_dequantize_close_and_count_their_bytes():
    torch.manual_seed(2)
    w = torch.randn(96, 128)
    q, scale, zero = quantize(w, 8, 64)
    assert q.min() >= 0 and q.max() <= 255
    mod = GroupDequantLinear(q, scale, zero, 64, None, torch.float32)
    err = (mod.dequantize() - w).abs().max() / w.abs().max()
    assert err < 1 / 255
    x = torch.randn(3, 128)
    torch.testing.assert_close(mod(x), x @ mod.dequantize().T)
    assert size.tensor_bytes(mod.qweight) == 96 * 128
    assert size.tensor_bytes(mod.scale) + size.tensor_bytes(mod.zero) == 2 * 96 * 2 * 4


@pytest.mark.parametrize("nbits,emulated,backend", [(4, False, "aten._weight_int4pack_mm_for_cpu"),
                                                    (8, True, "GroupDequantLinear")])
def test_scheme_on_tiny_model(nbits, emulated, backend):
    model = models.tiny_model(ModelConfig(name="tiny", source="tiny"))
    ids = torch.randint(0, 256, (1, 48))
    ref = fidelity.logprobs(TorchEngine(model), ids)
    cfg = HQQScheme(nbits=nbits, group_size=32)
    applied = weights_handler(cfg).apply(model, cfg, ApplyContext(hw=hardware.cpu(), tokenizer=None))
    assert applied.emulated is emulated and backend in applied.backend
    out = fidelity.compare(ref, fidelity.logprobs(TorchEngine(model), ids), ids[0, 1:])
    assert out["fid/kl_mean"] < (0.05 if nbits == 4 else 1e-3)
    assert cfg.short_name() == f"hqq{nbits}-g32"


def test_support_export_and_bad_config():
    handler = weights_handler(HQQScheme())
    assert handler.support(HQQScheme(), hardware.cpu()).status == "real"
    assert handler.support(HQQScheme(nbits=8), hardware.cpu()).status == "emulated"
    assert handler.support(HQQScheme(), Hardware(device="cuda", name="x")).status == "unsupported"
    for fmt in ("checkpoint", "gguf"):
        assert "integer zero points" in handler.mapping(fmt, HQQScheme()).reason
    with pytest.raises(ValueError, match="hqq nbits 3; valid: 4, 8"):
        HQQScheme(nbits=3)
    with pytest.raises(ValueError, match="hqq group_size 48; valid: 32, 64, 128, 256"):
        HQQScheme(group_size=48)
