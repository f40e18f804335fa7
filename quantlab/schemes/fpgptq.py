"""GPTQ onto the float grids of NVFP4 and MX: :mod:`quantlab.schemes.gptq`'s
sequential driver and solver with each format's group parameters and rounding.

As llm-compressor's GPTQ does for these formats: NVFP4's per-tensor scale is
fixed from the whole weight first; each group's scale (NVFP4's E4M3 one per
16, MX's E8M0 exponent per 32) is set from the group's error-updated weights
when the solver enters it; each column is rounded as round-to-nearest rounds
it (:mod:`quantlab.schemes.fpquant`), so a GPTQ point differs from its RTN
twin only in which codes and group scales it chose.
"""
from __future__ import annotations

import torch

from quantlab import calibration
from quantlab.schemes import fpquant as fq
from quantlab.schemes import gptq as gptq_driver
from quantlab.schemes.fplinear import MXLinear, NVFP4Linear
from quantlab.schemes.gptq_solver import gptq


def nvfp4_layer(lin: torch.nn.Linear, h: torch.Tensor, damp: float, dtype: torch.dtype, activations: str,
                input_global_scale: torch.Tensor | None) -> NVFP4Linear:
    w = lin.weight.float()
    gs = fq.nvfp4_global_scale(w.abs().amax())

    def fit(cols):
        return (fq.nvfp4_scales(cols, gs, 16)[:, 0],)

    def rnd(col, p):
        step = p[0] / gs
        codes = fq.e2m1_round(col.float() / step)
        return codes.double(), (fq.e2m1_decode(codes) * step).double()

    codes, (scale,) = gptq(w, h, 16, fit, rnd, damp)
    return NVFP4Linear(codes.to(torch.uint8), scale.float(), gs, lin.bias, dtype, activations, input_global_scale)


def mx_layer(lin: torch.nn.Linear, h: torch.Tensor, damp: float, dtype: torch.dtype, elem: str,
             activations: str) -> MXLinear:
    def fit(cols):
        return (fq.mx_exponents(cols, elem, 32)[:, 0],)

    def rnd(col, p):
        scale = fq.mx_scale(p[0])
        v = col.float() / scale
        if elem == "fp4":
            codes = fq.e2m1_round(v)
            return codes.double(), (fq.e2m1_decode(codes) * scale).double()
        values = fq.e4m3(v).float()
        return values.double(), (values * scale).double()

    elements, (exponents,) = gptq(lin.weight.float(), h, 32, fit, rnd, damp)
    elements = elements.to(torch.uint8) if elem == "fp4" else elements.float().to(torch.float8_e4m3fn)
    return MXLinear(elements, exponents, lin.bias, dtype, elem, activations)


def quantize(model: torch.nn.Module, selected: set[str], cfg, ctx, who: str, solve) -> dict[str, str]:
    """Calibrate on ``cfg``'s set and run ``solve(name, linear, hessian)`` over
    the ``selected`` Linears in GPTQ's sequential order; returns the
    calibration tags."""
    ids, tags = calibration.batch_or_builtin(cfg.calibration, who, ctx, cfg.n_samples, cfg.seq_len)
    gptq_driver.sequential(model, selected, ids, solve)
    return tags
