"""NVFP4: E2M1 values, an E4M3 scale per 16, an fp32 scale per tensor
(NVIDIA's Blackwell format; compressed-tensors ``NVFP4`` / ``NVFP4A16``,
ModelOpt), weight-only or W4A4.

W4A4 rounds each Linear's input to NVFP4 too: its 16-value scales from the
token itself, its per-tensor ("global") scale fixed before any request from
the largest input the layer saw over ``n_samples`` calibration windows, as
llm-compressor's ``static_minmax`` observer sets ``input_global_scale``.
Emulated in quantlab's engines (:mod:`quantlab.schemes.fplinear`).
"""
from __future__ import annotations

import torch

from quantlab import calibration
from quantlab.hardware import Hardware
from quantlab.schemes import fpgptq, fpquant, layers, smoothing
from quantlab.schemes.configs import NVFP4Scheme
from quantlab.schemes.fplinear import NVFP4Linear, emulated_support, replace_all, selected
from quantlab.schemes.registry import Applied, ApplyContext, Mapping, Support, register_weights

GROUP = NVFP4Linear.GROUP


def support(cfg: NVFP4Scheme, hw: Hardware) -> Support:
    return emulated_support(hw, "NVFP4", (10, 0))


def apply(model: torch.nn.Module, cfg: NVFP4Scheme, ctx: ApplyContext) -> Applied:
    dtype = getattr(torch, cfg.compute_dtype)
    tags: dict[str, str] = {}
    scales: dict[str, torch.Tensor] = {}
    linears = selected(model, cfg.skip, GROUP, cfg.short_name())
    names = {n for n, _ in linears}
    if cfg.activations == "nvfp4":
        ids, tags = calibration.batch_or_builtin(cfg.calibration, "nvfp4", ctx, cfg.n_samples, cfg.seq_len)
        amax = smoothing.capture(model, sorted(names), ids,
                                 lambda rows, top: rows.abs().amax() if top is None else top.max(rows.abs().amax()))
        scales = {n: fpquant.nvfp4_global_scale(a) for n, a in amax.items()}
    act = "nvfp4" if cfg.activations == "nvfp4" else "none"
    if cfg.gptq:
        tags.update(fpgptq.quantize(model, names, cfg, ctx, "nvfp4-gptq", lambda n, lin, h: fpgptq.nvfp4_layer(
            lin, h, cfg.damp, dtype, act, scales.get(n))))
    else:
        replace_all(model, linears, lambda n, lin: NVFP4Linear.quantize(lin.weight.float(), lin.bias, dtype, act,
                                                                        scales.get(n)))
    layers.cast_parameters(model, dtype)
    return Applied(backend=f"quantlab.NVFP4Linear({'gptq' if cfg.gptq else 'rtn'}, dequant)", emulated=True,
                   tags=tags)


_ARGS = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": GROUP,
         "scale_dtype": "float8_e4m3fn", "zp_dtype": "float8_e4m3fn"}


def checkpoint(cfg: NVFP4Scheme) -> Mapping:
    """compressed-tensors ``nvfp4-pack-quantized``: codes two to a byte, E4M3
    group scales, fp32 ``weight_global_scale``; W4A4 adds locally dynamic
    activation groups with the calibrated ``input_global_scale`` (the
    ``NVFP4`` / ``NVFP4A16`` presets)."""
    spec = {"format": "nvfp4-pack-quantized", "dtype": cfg.compute_dtype, "args": dict(_ARGS)}
    if cfg.activations == "nvfp4":
        spec["input_activations"] = {**_ARGS, "dynamic": "local", "observer": "static_minmax"}
    return Mapping(spec)


def gguf(cfg: NVFP4Scheme) -> Mapping:
    return Mapping(reason=f"{cfg.short_name()}: llama.cpp's NVFP4 blocks carry no per-tensor scale, so this "
                          "point's codes do not map onto them unchanged; nearest: mxfp4-a16 (MXFP4)")


register_weights("nvfp4", NVFP4Scheme, support, apply, checkpoint=checkpoint, gguf=gguf)
