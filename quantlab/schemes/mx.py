"""MXFP4 / MXFP8 (OCP microscaling v1.0): E2M1 or E4M3 elements, one E8M0
scale per 32, weights only or with the activations rounded the same way.

Emulated in quantlab's engines (:mod:`quantlab.schemes.fplinear`); llama.cpp
runs MXFP4 weights for real (its ``MXFP4`` block is the same 32 codes and
exponent, written from the point's own, activations in its Q8_0 as for
every llama.cpp type), so ``mxfp4-a16`` maps to GGUF.
"""
from __future__ import annotations

import torch

from quantlab.hardware import Hardware
from quantlab.schemes import fpgptq, layers
from quantlab.schemes.configs import MXScheme
from quantlab.schemes.fplinear import MXLinear, emulated_support, replace_all, selected
from quantlab.schemes.registry import Applied, ApplyContext, Mapping, Support, register_weights

GROUP = MXLinear.GROUP


def support(cfg: MXScheme, hw: Hardware) -> Support:
    return emulated_support(hw, cfg.short_name().upper(), (10, 0))


def apply(model: torch.nn.Module, cfg: MXScheme, ctx: ApplyContext) -> Applied:
    dtype = getattr(torch, cfg.compute_dtype)
    act = f"mx{cfg.elem}" if cfg.activations == "mx" else "none"
    tags: dict[str, str] = {}
    linears = selected(model, cfg.skip, GROUP, cfg.short_name())
    if cfg.gptq:
        tags = fpgptq.quantize(model, {n for n, _ in linears}, cfg, ctx, cfg.short_name(),
                               lambda _n, lin, h: fpgptq.mx_layer(lin, h, cfg.damp, dtype, cfg.elem, act))
    else:
        replace_all(model, linears, lambda _n, lin: MXLinear.quantize(lin.weight.float(), lin.bias, dtype, cfg.elem,
                                                                      act))
    layers.cast_parameters(model, dtype)
    return Applied(backend=f"quantlab.MXLinear({cfg.short_name()}, dequant)", emulated=True, tags=tags)


def _args(elem: str) -> dict:
    return {"num_bits": 4 if elem == "fp4" else 8, "type": "float", "symmetric": True, "strategy": "group",
            "group_size": GROUP, "scale_dtype": "uint8", "zp_dtype": "uint8"}


def checkpoint(cfg: MXScheme) -> Mapping:
    """compressed-tensors ``mxfp4-pack-quantized`` (codes two to a byte) or
    ``mxfp8-quantized`` (E4M3 weights), E8M0 scales as uint8 exponents; W4A4 /
    W8A8 add dynamic activation groups of 32 in the same format (the presets
    ``MXFP4`` / ``MXFP8`` and their ``A16`` forms)."""
    spec = {"format": "mxfp4-pack-quantized" if cfg.elem == "fp4" else "mxfp8-quantized",
            "dtype": cfg.compute_dtype, "args": _args(cfg.elem)}
    if cfg.activations == "mx":
        spec["input_activations"] = {**_args(cfg.elem), "dynamic": True}
    return Mapping(spec)


def gguf(cfg: MXScheme) -> Mapping:
    if cfg.elem != "fp4":
        return Mapping(reason=f"{cfg.short_name()} has no GGUF type (llama.cpp's MX type is MXFP4); nearest: Q8_0 "
                              "(scheme/weights=int8)")
    if cfg.activations == "mx":
        return Mapping(reason="llama.cpp multiplies MXFP4 weights by Q8_0 activations, not MXFP4 ones: use "
                              "mxfp4-a16 (the same weights) on target=llamacpp")
    return Mapping({"type": "MXFP4"})


register_weights("mx", MXScheme, support, apply, checkpoint=checkpoint, gguf=gguf)
