"""AWQ: activation-aware per-channel scaling, then int4 groups (Lin et al., 2023).

Input channels that carry large activations matter more; AWQ multiplies those
weight columns by ``s = mean|x|^alpha`` before round-to-nearest (so they get
finer steps) and divides the previous operation's output by ``s`` (so the
float model computes exactly the same function; where the scales fold:
``schemes.smoothing``). ``alpha`` is searched per group of layers sharing an
input, on calibration activations, minimising the output error of the
quantized layers.

The quantized layers are the same ``Int4Linear`` (tinygemm kernel) as RTN and
GPTQ, so AWQ points run, time and export like them.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
from torch import nn

from quantlab import calibration
from quantlab.hardware import Hardware
from quantlab.schemes import layers, smoothing
from quantlab.schemes.configs import AWQScheme
from quantlab.schemes.int4 import checkpoint as int4_checkpoint
from quantlab.schemes.int4 import gguf as int4_gguf
from quantlab.schemes.qlinear import Int4Linear, prefill_tags, rtn_int4
from quantlab.schemes.registry import Applied, ApplyContext, Support, register_weights

log = logging.getLogger("quantlab")
ROWS = 512  # activation rows kept per group for the search


def support(cfg: AWQScheme, hw: Hardware) -> Support:
    if hw.device == "cpu":
        return Support("real", "AWQ scales, then the same int4 kernel as RTN")
    return Support("unsupported", f"AWQ int4 packing is CPU-only (tinygemm CPU layout); not {hw.device}")


def rtn_dequantized(w: torch.Tensor, group_size: int, symmetric: bool) -> torch.Tensor:
    """``w`` after int4 round-to-nearest, as the kernel reads it back."""
    q, scale, zero = rtn_int4(w, group_size, symmetric)
    n, k = w.shape
    g = (q.reshape(n, k // group_size, group_size).float() - 8) * scale[..., None] + zero[..., None]
    return g.reshape(n, k)


Quantizer = Callable[[torch.Tensor], torch.Tensor]  # a weight -> the weight its kernel reads back


def search_scale(x: torch.Tensor, weights: list[torch.Tensor], quantizers: list[Quantizer],
                 grid: int) -> tuple[torch.Tensor, float, float]:
    """``(s, alpha, error ratio vs no scaling)``: the per-input-channel scale
    ``mean|x|^alpha`` (normalised) that minimises ``sum ||x (Q(W s)/s - W)^T||^2``
    over the layers sharing input ``x`` ([rows, K], fp32), each with its own
    quantizer ``Q``; alpha 0 is no scaling."""
    mean = x.abs().mean(0).clamp_min(1e-8)

    def scale(alpha: float) -> torch.Tensor:
        s = mean.pow(alpha)
        return s / (s.max() * s.min()).sqrt()

    def error(s: torch.Tensor) -> float:
        return sum(float(((x @ (q(w * s) / s - w).T) ** 2).sum()) for w, q in zip(weights, quantizers))

    return smoothing.search([i / max(grid, 1) for i in range(grid + 1)], scale, error)


@torch.inference_mode()
def scale_model(model: nn.Module, quantizers: dict[str, Quantizer], ids: torch.Tensor,
                grid: int) -> dict[str, str]:
    """Search and fold AWQ scales (in place, fp32 model) for every layer group
    whose members all have a quantizer in ``quantizers`` (layer name ->
    quantizer); returns the ``awq.*`` tags (groups, mean alpha, output error
    vs no scaling on the calibration rows)."""
    groups = smoothing.plan(model, set(quantizers), "AWQ")
    inputs = smoothing.capture(model, [first for *_, first in groups], ids, smoothing.row_sampler(ROWS, len(ids)))
    prefix = {id(m): n for n, m in model.named_modules()}
    ratios, alphas = [], []
    for layer, fold_name, how, members, first in groups:
        weights = [layer.get_submodule(m).weight.float() for m in members]
        qs = [quantizers[f"{prefix[id(layer)]}.{m}"] for m in members]
        s, alpha, ratio = search_scale(inputs[first], weights, qs, grid)
        smoothing.fold(layer, fold_name, how, members, s)
        ratios.append(ratio)
        alphas.append(alpha)
    if not ratios:
        return {}
    log.info("awq: %d groups scaled, mean alpha %.2f, calibration output error %.3f of unscaled",
             len(ratios), sum(alphas) / len(alphas), sum(ratios) / len(ratios))
    return {"awq.groups": str(len(ratios)), "awq.alpha_mean": f"{sum(alphas) / len(alphas):.2f}",
            "awq.error_vs_rtn": f"{sum(ratios) / len(ratios):.3f}"}


@torch.inference_mode()
def apply(model: nn.Module, cfg: AWQScheme, ctx: ApplyContext) -> Applied:
    dtype = getattr(torch, cfg.compute_dtype)
    model.float()
    selected = dict(layers.select(model, cfg.skip))
    layers.check_group_size(list(selected.items()), cfg.group_size, cfg.short_name())
    ids, tags = calibration.batch_or_builtin(cfg.calibration, "awq", ctx, cfg.n_samples, cfg.seq_len)
    rtn = functools.partial(rtn_dequantized, group_size=cfg.group_size, symmetric=cfg.symmetric)
    tags.update(scale_model(model, {n: rtn for n in selected}, ids, cfg.grid))
    for name, lin in selected.items():
        layers.replace(model, name, Int4Linear.from_linear(lin, cfg.group_size, cfg.symmetric, dtype))
    layers.cast_parameters(model, dtype)
    return Applied(backend="quantlab.awq+aten._weight_int4pack_mm_for_cpu", emulated=False, tags={**tags, **prefill_tags(dtype)})


register_weights("awq", AWQScheme, support, apply, checkpoint=int4_checkpoint, gguf=int4_gguf)
