"""W8A8 INT8 with SmoothQuant (Xiao et al., 2023), or without it (naive W8A8).

Activations have outlier channels that per-token int8 cannot represent well;
SmoothQuant moves that difficulty into the weights with per-input-channel
scales ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`` measured on calibration
data and folded into the previous operation (``schemes.smoothing``), so the
float function is unchanged. Then every selected layer becomes an
``Int8DynLinear``: int8 weights per channel, int8 activations per token,
``torch._int_mm`` (a real int8 GEMM on CPU).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from quantlab import calibration
from quantlab.hardware import Hardware
from quantlab.schemes import layers, smoothing
from quantlab.schemes.base import WeightScheme
from quantlab.schemes.qlinear import Int8DynLinear
from quantlab.schemes.registry import Applied, ApplyContext, Mapping, Support, register_weights

log = logging.getLogger("quantlab")


@dataclass
class W8A8Scheme(WeightScheme):
    smooth: bool = True  # false: naive W8A8, the reference SmoothQuant is measured against
    alpha: float = 0.5  # migration strength (0: none, 1: all onto the weights)
    calibration: str = "wiki"
    n_samples: int = 16
    seq_len: int = 512
    compute_dtype: str = "bfloat16"
    skip: list[str] = field(default_factory=lambda: list(layers.DEFAULT_SKIP))

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"w8a8 alpha {self.alpha}; valid: 0..1")

    def short_name(self) -> str:
        """``w8a8``, ``w8a8-sq`` (the preset's alpha 0.5), ``w8a8-sq-a0.75`` (any other alpha)."""
        if not self.smooth:
            return "w8a8"
        return "w8a8-sq" if self.alpha == 0.5 else f"w8a8-sq-a{self.alpha:g}"


def support(cfg: W8A8Scheme, hw: Hardware) -> Support:
    if hw.device == "cpu":
        return Support("real", "torch._int_mm int8 x int8 GEMM, per-token dynamic activation scales")
    return Support("unsupported", f"W8A8 is wired for the CPU kernel only (not {hw.device})")


def _amax(rows: torch.Tensor, so_far: torch.Tensor | None) -> torch.Tensor:
    m = rows.abs().amax(0)
    return m if so_far is None else torch.maximum(so_far, m)


def smoothing_scales(act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """SmoothQuant's ``s_j = max|X_j|^alpha / max_over_layers max|W_:,j|^(1-alpha)``."""
    w_max = torch.stack([w.abs().amax(0) for w in weights]).amax(0)
    return (act_max.clamp_min(1e-5).pow(alpha) / w_max.clamp_min(1e-5).pow(1 - alpha)).clamp_min(1e-5)


@torch.inference_mode()
def apply(model: nn.Module, cfg: W8A8Scheme, ctx: ApplyContext) -> Applied:
    dtype = getattr(torch, cfg.compute_dtype)
    model.float()
    selected = dict(layers.select(model, cfg.skip))
    tags: dict[str, str] = {}
    if cfg.smooth:
        ids, tags = calibration.batch_or_builtin(cfg.calibration, "smoothquant", ctx, cfg.n_samples, cfg.seq_len)
        groups = smoothing.plan(model, set(selected), "SmoothQuant")
        act_max = smoothing.capture(model, [first for *_, first in groups], ids, _amax)
        for layer, fold_name, how, members, first in groups:
            weights = [layer.get_submodule(m).weight.float() for m in members]
            smoothing.fold(layer, fold_name, how, members, smoothing_scales(act_max[first], weights, cfg.alpha))
        tags["smoothquant.groups"] = str(len(groups))
        log.info("smoothquant: %d layer groups smoothed (alpha %.2f)", len(groups), cfg.alpha)
    for name, lin in selected.items():
        layers.replace(model, name, Int8DynLinear.from_linear(lin, dtype))
    layers.cast_parameters(model, dtype)
    return Applied(backend="torch._int_mm (int8 x int8)", emulated=False, tags=tags)


def no_format(cfg: W8A8Scheme) -> Mapping:
    return Mapping(reason=f"{cfg.short_name()} does not export yet (compressed-tensors int-quantized with "
                          "dynamic per-token int8 input activations would be its format)")


register_weights("w8a8", W8A8Scheme, support, apply, checkpoint=no_format, gguf=no_format)
