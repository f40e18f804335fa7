"""INT8 weight-only, per-output-channel symmetric (round to nearest)."""
from __future__ import annotations


import torch

from quantlab.hardware import Hardware
from quantlab.schemes.configs import Int8Scheme
from quantlab.schemes import layers
from quantlab.schemes.qlinear import Int8Linear, prefill_tags
from quantlab.schemes.registry import Applied, ApplyContext, Mapping, Support, register_weights


def support(cfg: Int8Scheme, hw: Hardware) -> Support:
    if hw.device == "cpu":
        return Support("real")
    if hw.device == "cuda":
        return Support("real", "torchao Int8WeightOnlyConfig; fused only under target.compile=true")
    return Support("unsupported", f"int8 on {hw.device}")


def apply(model: torch.nn.Module, cfg: Int8Scheme, ctx: ApplyContext) -> Applied:
    dtype = getattr(torch, cfg.compute_dtype)
    linears = layers.select(model, cfg.skip)
    if ctx.hw.device == "cuda":
        from torchao.quantization import Int8WeightOnlyConfig

        layers.torchao_quantize(model, linears, dtype, Int8WeightOnlyConfig())
        return Applied(backend="torchao.Int8WeightOnlyConfig", emulated=False)
    for name, lin in linears:
        layers.replace(model, name, Int8Linear.from_linear(lin, dtype))
    layers.cast_parameters(model, dtype)
    return Applied(backend="aten._weight_int8pack_mm", emulated=False, tags=prefill_tags(dtype))


def checkpoint(cfg: Int8Scheme) -> Mapping:
    """compressed-tensors ``pack-quantized`` 8-bit: int8 per output channel,
    symmetric, four to an int32, scales in the compute dtype (where the point
    keeps them: exact). The W8A16 layout vLLM reads (its compressed-tensors
    loader takes every ``int-quantized`` group for W8A8 and rejects a
    weight-only one; measured on vLLM 0.32)."""
    return Mapping({"format": "pack-quantized",
                    "args": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                             "scale_dtype": cfg.compute_dtype}, "dtype": cfg.compute_dtype})


def neuron(cfg: Int8Scheme) -> Mapping:
    """The Neuron SDK quantizes at export (same per-channel symmetric int8)."""
    return Mapping({"dtype": cfg.compute_dtype, "note": "Neuron weight-only int8 (quantized weights, bf16 compute)",
                    "quantization": {"quantized": True, "quantization_dtype": "int8",
                                     "quantization_type": "per_channel_symmetric"}})


def gguf(cfg: Int8Scheme) -> Mapping:
    """Q8_0: each 32-block takes its channel's scale (fp16)."""
    return Mapping({"type": "Q8_0"})


register_weights("int8", Int8Scheme, support, apply, checkpoint=checkpoint, neuron=neuron, gguf=gguf)
