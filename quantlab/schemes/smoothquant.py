"""W8A8 INT8 with SmoothQuant (Xiao et al., 2023), or without it (naive W8A8).

Activations have outlier channels that per-token int8 cannot represent well;
SmoothQuant moves that difficulty into the weights with per-input-channel
scales ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`` measured on calibration
data and folded into the previous operation (``schemes.smoothing``), so the
float function is unchanged. ``alpha`` is one number for the model, or (``grid >
0``) searched per layer group, like AWQ's, for the least W8A8 output error of
that group's layers on calibration rows (the "auto alpha" of later SmoothQuant
implementations). Then every selected layer becomes an
``Int8DynLinear``: int8 weights per channel, int8 activations per token,
``torch._int_mm`` (a real int8 GEMM on CPU).

``rotate_down > 0`` adds QuaRot's online Hadamard before ``down_proj``
(Ashkboos et al., 2024): the SwiGLU product entering it has per-*token*
outliers that no per-channel scale can move; a block-diagonal Hadamard on its
input (and the same rotation stored in its weight) spreads each over its
block before the per-token quantization. The smoothing search for that group
sees the rotation, so its alpha is chosen for the rotated layer.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from quantlab import calibration
from quantlab.hardware import Hardware
from quantlab.schemes import layers, smoothing
from quantlab.schemes.configs import W8A8Scheme
from quantlab.schemes.qlinear import Int8DynLinear, rotate_blocks, rtn_int8
from quantlab.schemes.registry import Applied, ApplyContext, Mapping, Support, register_weights

log = logging.getLogger("quantlab")


def support(cfg: W8A8Scheme, hw: Hardware) -> Support:
    if hw.device == "cpu":
        return Support("real", "torch._int_mm int8 x int8 GEMM, per-token dynamic activation scales")
    return Support("unsupported", f"W8A8 is wired for the CPU kernel only (not {hw.device})")


ROWS = 512  # activation rows kept per group for the alpha search


def _amax(rows: torch.Tensor, so_far: torch.Tensor | None) -> torch.Tensor:
    m = rows.abs().amax(0)
    return m if so_far is None else torch.maximum(so_far, m)


def smoothing_scales(act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """SmoothQuant's ``s_j = max|X_j|^alpha / max_over_layers max|W_:,j|^(1-alpha)``."""
    w_max = torch.stack([w.abs().amax(0) for w in weights]).amax(0)
    return (act_max.clamp_min(1e-5).pow(alpha) / w_max.clamp_min(1e-5).pow(1 - alpha)).clamp_min(1e-5)


def w8a8_error(x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor, rotate: int = 0) -> float:
    """``sum ||Q_token(R(x / s)) Q_channel(R(W s))^T - x W^T||^2`` over the
    layers sharing input ``x`` ([rows, K], fp32), ``R`` the block Hadamard of
    size ``rotate`` (identity at 0): the error ``Int8DynLinear`` makes."""
    xs = x / s
    xq, sx = Int8DynLinear.quantize_tokens(rotate_blocks(xs, rotate) if rotate else xs)
    xd = xq.float() * sx
    total = 0.0
    for w in weights:
        ws = w * s
        q, sw = rtn_int8(rotate_blocks(ws, rotate) if rotate else ws)
        total += float(((xd @ (q.float() * sw[:, None]).T - x @ w.T) ** 2).sum())
    return total


def search_alpha(x: torch.Tensor, act_max: torch.Tensor, weights: list[torch.Tensor],
                 grid: int, rotate: int = 0) -> tuple[torch.Tensor, float, float]:
    """``(s, alpha, error ratio vs naive W8A8)`` with the alpha in ``{0, 1/grid,
    ..., 1}`` whose SmoothQuant scales give the least ``w8a8_error`` on ``x``
    (naive W8A8 rotated the same way when ``rotate``)."""
    return smoothing.search([i / grid for i in range(grid + 1)],
                            lambda a: smoothing_scales(act_max, weights, a),
                            lambda s: w8a8_error(x, weights, s, rotate))


DOWN = "mlp.down_proj"


def _rotation(cfg: W8A8Scheme, name: str) -> int:
    """The Hadamard block of layer ``name``: ``rotate_down`` for ``down_proj``, else 0."""
    return cfg.rotate_down if name.endswith(DOWN) else 0


def _amax_and_rows(calls: int):
    """A ``smoothing.capture`` reducer: ``(max |x| per channel over every
    token, ~ROWS sampled rows)``."""
    sample = smoothing.row_sampler(ROWS, calls)

    def reduce(rows: torch.Tensor, so_far: tuple[torch.Tensor, torch.Tensor] | None):
        return _amax(rows, so_far and so_far[0]), sample(rows, so_far and so_far[1])

    return reduce


@torch.inference_mode()
def apply(model: nn.Module, cfg: W8A8Scheme, ctx: ApplyContext) -> Applied:
    dtype = getattr(torch, cfg.compute_dtype)
    model.float()
    selected = dict(layers.select(model, cfg.skip))
    for name, lin in selected.items():
        if _rotation(cfg, name) and lin.in_features % cfg.rotate_down:
            raise ValueError(f"w8a8 rotate_down {cfg.rotate_down} does not divide {name}'s "
                             f"{lin.in_features} input channels")
    tags: dict[str, str] = {}
    if cfg.smooth:
        ids, tags = calibration.batch_or_builtin(cfg.calibration, "smoothquant", ctx, cfg.n_samples, cfg.seq_len)
        groups = smoothing.plan(model, set(selected), "SmoothQuant")
        names = [first for *_, first in groups]
        if cfg.grid:
            seen = smoothing.capture(model, names, ids, _amax_and_rows(len(ids)))
        else:
            seen = {n: (m, None) for n, m in smoothing.capture(model, names, ids, _amax).items()}
        alphas, ratios = [], []
        for layer, fold_name, how, members, first in groups:
            weights = [layer.get_submodule(m).weight.float() for m in members]
            act_max, rows = seen[first]
            if cfg.grid:
                s, alpha, ratio = search_alpha(rows, act_max, weights, cfg.grid, _rotation(cfg, first))
                alphas.append(alpha)
                ratios.append(ratio)
            else:
                s = smoothing_scales(act_max, weights, cfg.alpha)
            smoothing.fold(layer, fold_name, how, members, s)
        tags["smoothquant.groups"] = str(len(groups))
        if ratios:
            tags.update({"smoothquant.alpha_mean": f"{sum(alphas) / len(alphas):.2f}",
                         "smoothquant.error_vs_naive": f"{sum(ratios) / len(ratios):.3f}"})
            log.info("smoothquant: %d layer groups smoothed, alpha searched per group (mean %.2f), "
                     "calibration output error %.3f of naive W8A8's", len(groups), sum(alphas) / len(alphas),
                     sum(ratios) / len(ratios))
        else:
            log.info("smoothquant: %d layer groups smoothed (alpha %.2f)", len(groups), cfg.alpha)
    for name, lin in selected.items():
        layers.replace(model, name, Int8DynLinear.from_linear(lin, dtype, _rotation(cfg, name)))
    layers.cast_parameters(model, dtype)
    if cfg.rotate_down:
        tags["w8a8.rotate_down"] = str(cfg.rotate_down)
    return Applied(backend="torch._int_mm (int8 x int8)", emulated=False, tags=tags)


def checkpoint(cfg: W8A8Scheme) -> Mapping:
    """compressed-tensors ``int-quantized``: int8 weights per output channel
    (the smoothing already folded into the norms and ``up_proj``, so the
    checkpoint is a plain Llama with W8A8 layers) and dynamic per-token int8
    input activations (what transformers applies on reload; vLLM's W8A8 INT8
    path reads this format). Not with ``rotate_down``: the rotated weights need
    the online Hadamard at inference, which this format's plain layers lack."""
    if cfg.rotate_down:
        return Mapping(reason=f"{cfg.short_name()}: down_proj computes in a Hadamard-rotated basis that "
                              "int-quantized checkpoints cannot express (export without rotate_down)")
    return Mapping({"format": "int-quantized", "dtype": cfg.compute_dtype,
                    "args": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                             "scale_dtype": cfg.compute_dtype},
                    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                          "dynamic": True}})


def no_gguf(cfg: W8A8Scheme) -> Mapping:
    return Mapping(reason=f"{cfg.short_name()}: GGUF has no int8-activation weight type (llama.cpp picks "
                          "its own activation format per kernel)")


register_weights("w8a8", W8A8Scheme, support, apply, checkpoint=checkpoint, gguf=no_gguf)
