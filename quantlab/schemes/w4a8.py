"""W4A8: symmetric INT4 weight groups with dynamic per-token FP8 E4M3
activations (compressed-tensors ``W4AFP8``; TensorRT-LLM's and vLLM's
CUTLASS W4A8 on SM90). The INT4 rule is compressed-tensors' (``amax / 7.5``,
-8..7), not llama.cpp's Q4_0 rule that ``int4-g*-sym`` follows.
Emulated in quantlab's engines (:mod:`quantlab.schemes.fplinear`).
"""
from __future__ import annotations

import torch

from quantlab.hardware import Hardware
from quantlab.schemes import layers
from quantlab.schemes.configs import W4A8Scheme
from quantlab.schemes.fplinear import W4A8Linear, emulated_support, replace_all, selected
from quantlab.schemes.registry import Applied, ApplyContext, Mapping, Support, register_weights


def support(cfg: W4A8Scheme, hw: Hardware) -> Support:
    return emulated_support(hw, "INT4 x FP8", (9, 0))


def apply(model: torch.nn.Module, cfg: W4A8Scheme, ctx: ApplyContext) -> Applied:
    dtype = getattr(torch, cfg.compute_dtype)
    replace_all(model, selected(model, cfg.skip, cfg.group_size, cfg.short_name()),
                lambda _n, lin: W4A8Linear(lin.weight.float(), lin.bias, dtype, cfg.group_size))
    layers.cast_parameters(model, dtype)
    return Applied(backend="quantlab.W4A8Linear(dequant)", emulated=True)


def checkpoint(cfg: W4A8Scheme) -> Mapping:
    """compressed-tensors ``pack-quantized`` symmetric INT4 groups (fp32
    scales, where the point keeps them) with dynamic per-token FP8 input
    activations (the ``W4AFP8`` preset)."""
    return Mapping({"format": "pack-quantized", "dtype": cfg.compute_dtype,
                    "args": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                             "group_size": cfg.group_size, "scale_dtype": "float32"},
                    "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                          "dynamic": True}})


def gguf(cfg: W4A8Scheme) -> Mapping:
    return Mapping(reason=f"{cfg.short_name()}: llama.cpp has no FP8 activations; its nearest is Q4_0 "
                          "(scheme/weights=int4-g32-sym)")


register_weights("w4a8", W4A8Scheme, support, apply, checkpoint=checkpoint, gguf=gguf)
