"""FP8 E4M3 weights with one fp32 scale per 128 x 128 block, activations in
dynamic groups of 128 along each token (DeepSeek-V3 / Qwen3 FP8 checkpoints,
compressed-tensors ``FP8_BLOCK``; vLLM and SGLang's blockwise FP8 on SM90+).

A layer whose sizes are not multiples of the block (SmolLM2's 576) gets a
partial block at the edge, scaled by the values it has, as compressed-tensors
pads with zeros; a last partial activation group likewise. vLLM's block
kernels require the input width to be a multiple of the block: such a model's
export is measurable here, not servable there (``block: 64`` fits 576).
Emulated in quantlab's engines (:mod:`quantlab.schemes.fplinear`).
"""
from __future__ import annotations

import torch

from quantlab.hardware import Hardware
from quantlab.schemes import layers
from quantlab.schemes.configs import FP8BlockScheme
from quantlab.schemes.fplinear import FP8BlockLinear, emulated_support, replace_all, selected
from quantlab.schemes.registry import Applied, ApplyContext, Mapping, Support, register_weights


def support(cfg: FP8BlockScheme, hw: Hardware) -> Support:
    return emulated_support(hw, "FP8 block-scaled", (8, 9))


def apply(model: torch.nn.Module, cfg: FP8BlockScheme, ctx: ApplyContext) -> Applied:
    dtype = getattr(torch, cfg.compute_dtype)
    act = "fp8-group" if cfg.activations == "dynamic" else "none"
    replace_all(model, selected(model, cfg.skip, 0, cfg.short_name()),
                lambda _n, lin: FP8BlockLinear(lin.weight.float(), lin.bias, dtype, cfg.block, act))
    layers.cast_parameters(model, dtype)
    return Applied(backend=f"quantlab.FP8BlockLinear({cfg.block}x{cfg.block}, dequant)", emulated=True)


def checkpoint(cfg: FP8BlockScheme) -> Mapping:
    """compressed-tensors ``float-quantized``, ``block`` strategy ``[b, b]``,
    fp32 scales; dynamic activation groups of ``b`` (the ``FP8_BLOCK`` preset)."""
    spec = {"format": "float-quantized", "dtype": cfg.compute_dtype,
            "args": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                     "block_structure": [cfg.block, cfg.block]}}
    if cfg.activations == "dynamic":
        spec["input_activations"] = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
                                     "group_size": cfg.block, "dynamic": True}
    return Mapping(spec)


def gguf(cfg: FP8BlockScheme) -> Mapping:
    return Mapping(reason=f"{cfg.short_name()} has no GGUF type (llama.cpp has no FP8 blocks); nearest: Q8_0 "
                          "(scheme/weights=int8)")


register_weights("fp8block", FP8BlockScheme, support, apply, checkpoint=checkpoint, gguf=gguf)
